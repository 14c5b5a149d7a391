//! The documentation's Markdown as the checks read it: code blocks, code spans, headings
//! and their anchors, links, and the tables that a `<!-- NAME: ARGS -->` comment marks.
use std::path::{Path, PathBuf};

use pulldown_cmark::{CodeBlockKind, Event, HeadingLevel, Options, Parser, Tag, TagEnd};

/// One Markdown file of the documentation.
pub struct Doc {
    /// Relative to the repository's root, as messages name it.
    pub path: PathBuf,
    pub text: String,
}

/// The repository's root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("guard-user is in the workspace")
        .to_path_buf()
}

/// README.md and every `.md` file under docs/, in a stable order.
pub fn docs() -> Vec<Doc> {
    let root = root();
    let mut paths = vec![PathBuf::from("README.md")];
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .flatten()
            .map(|e| dir.join(e.file_name()))
            .collect();
        entries.sort();
        for p in entries {
            if root.join(&p).is_dir() {
                walk(root, &p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    walk(&root, Path::new("docs"), &mut paths);
    paths
        .into_iter()
        .map(|path| Doc {
            text: std::fs::read_to_string(root.join(&path))
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display())),
            path,
        })
        .collect()
}

/// The documentation page `docs/NAME`.
pub fn page(name: &str) -> Doc {
    let path = PathBuf::from("docs").join(name);
    Doc {
        text: std::fs::read_to_string(root().join(&path))
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display())),
        path,
    }
}

impl Doc {
    /// `path:line` of a byte offset, for messages.
    pub fn at(&self, offset: usize) -> String {
        let line = self.text[..offset.min(self.text.len())]
            .matches('\n')
            .count()
            + 1;
        format!("{}:{line}", self.path.display())
    }

    fn events(&self) -> impl Iterator<Item = (Event<'_>, std::ops::Range<usize>)> {
        Parser::new_ext(&self.text, Options::ENABLE_TABLES).into_offset_iter()
    }

    /// Fenced code blocks: (info string, text, offset).
    pub fn code_blocks(&self) -> Vec<(String, String, usize)> {
        let mut out = Vec::new();
        let mut current: Option<(String, String, usize)> = None;
        for (event, range) in self.events() {
            match event {
                Event::Start(Tag::CodeBlock(kind)) => {
                    let info = match kind {
                        CodeBlockKind::Fenced(info) => info.to_string(),
                        CodeBlockKind::Indented => String::new(),
                    };
                    current = Some((info, String::new(), range.start));
                }
                Event::Text(t) => {
                    if let Some((_, text, _)) = &mut current {
                        text.push_str(&t);
                    }
                }
                Event::End(TagEnd::CodeBlock) => out.extend(current.take()),
                _ => {}
            }
        }
        out
    }

    /// Code: every code span, and every line of every code block, with its offset.
    pub fn code(&self) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        for (event, range) in self.events() {
            if let Event::Code(c) = event {
                out.push((c.to_string(), range.start));
            }
        }
        for (_, text, at) in self.code_blocks() {
            out.extend(text.lines().map(|l| (l.to_string(), at)));
        }
        out
    }

    /// Headings: (level, plain text, anchor, offset), anchors as GitHub makes them.
    pub fn headings(&self) -> Vec<(HeadingLevel, String, String, usize)> {
        let mut out: Vec<(HeadingLevel, String, String, usize)> = Vec::new();
        let mut current: Option<(HeadingLevel, String, usize)> = None;
        for (event, range) in self.events() {
            match event {
                Event::Start(Tag::Heading { level, .. }) => {
                    current = Some((level, String::new(), range.start))
                }
                Event::Text(t) | Event::Code(t) => {
                    if let Some((_, text, _)) = &mut current {
                        text.push_str(&t);
                    }
                }
                Event::End(TagEnd::Heading(_)) => {
                    if let Some((level, text, at)) = current.take() {
                        let base = slug(&text);
                        let n = out.iter().filter(|h| slug(&h.1) == base).count();
                        let anchor = if n == 0 { base } else { format!("{base}-{n}") };
                        out.push((level, text, anchor, at));
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// Link and image targets, with their offsets.
    pub fn links(&self) -> Vec<(String, usize)> {
        self.events()
            .filter_map(|(event, range)| match event {
                Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                    Some((dest_url.to_string(), range.start))
                }
                _ => None,
            })
            .collect()
    }

    /// The code spans of the section under the heading whose text is `heading`, up to
    /// the next heading of its level or higher; None without such a heading.
    pub fn section_code(&self, heading: &str) -> Option<Vec<String>> {
        let mut level = None;
        let mut out = Vec::new();
        let mut in_heading = String::new();
        let mut heading_level = None;
        for (event, _) in self.events() {
            match event {
                Event::Start(Tag::Heading { level: l, .. }) => {
                    heading_level = Some(l);
                    in_heading.clear();
                }
                Event::End(TagEnd::Heading(_)) => {
                    let l = heading_level.take().expect("in a heading");
                    match level {
                        Some(open) if l <= open => return Some(out),
                        None if in_heading == heading => level = Some(l),
                        _ => {}
                    }
                }
                Event::Text(t) | Event::Code(t) if heading_level.is_some() => {
                    in_heading.push_str(&t)
                }
                Event::Code(c) if level.is_some() => out.push(c.to_string()),
                _ => {}
            }
        }
        level.map(|_| out)
    }

    /// The tables marked `<!-- NAME: ARGS -->` (the comment just before the table):
    /// (ARGS, rows, offset), the header row left out.
    pub fn marked_tables(&self, name: &str) -> Vec<(String, Vec<Vec<Cell>>, usize)> {
        let prefix = format!("<!-- {name}:");
        let mut out = Vec::new();
        let mut marker: Option<(String, usize)> = None;
        let mut table: Option<(String, Vec<Vec<Cell>>, usize)> = None;
        let mut in_head = false;
        for (event, range) in self.events() {
            let cell = table
                .as_mut()
                .filter(|_| !in_head)
                .and_then(|(_, rows, _)| rows.last_mut()?.last_mut());
            match event {
                Event::Html(h) | Event::InlineHtml(h) => {
                    if let Some(args) = h.trim().strip_prefix(&prefix) {
                        let args = args.trim().trim_end_matches("-->").trim();
                        marker = Some((args.to_string(), range.start));
                    }
                }
                Event::Start(Tag::Table(_)) => {
                    if let Some((args, at)) = marker.take() {
                        table = Some((args, Vec::new(), at));
                    }
                }
                Event::Start(Tag::TableHead) => in_head = true,
                Event::End(TagEnd::TableHead) => in_head = false,
                Event::Start(Tag::TableRow) if !in_head => {
                    if let Some((_, rows, _)) = &mut table {
                        rows.push(Vec::new());
                    }
                }
                Event::Start(Tag::TableCell) if !in_head => {
                    if let Some((_, rows, _)) = &mut table {
                        rows.last_mut().expect("a row").push(Cell::default());
                    }
                }
                Event::Code(c) => {
                    if let Some(cell) = cell {
                        cell.text.push_str(&c);
                        cell.code.push(c.to_string());
                    }
                }
                Event::Text(t) => {
                    if let Some(cell) = cell {
                        cell.text.push_str(&t);
                    }
                }
                Event::End(TagEnd::Table) => out.extend(table.take()),
                Event::Start(Tag::Paragraph | Tag::Heading { .. } | Tag::CodeBlock(_)) => {
                    if let Some((args, at)) = &marker {
                        panic!(
                            "{}: {prefix} {args} --> is not followed by a table",
                            self.at(*at)
                        );
                    }
                }
                _ => {}
            }
        }
        if let Some((args, at)) = marker {
            panic!(
                "{}: {prefix} {args} --> is not followed by a table",
                self.at(at)
            );
        }
        out
    }
}

/// A table cell: its text (code spans' included) and its code spans.
#[derive(Default, Debug)]
pub struct Cell {
    pub text: String,
    pub code: Vec<String>,
}

/// A heading's anchor as GitHub makes it: lower case, spaces to `-`, and every
/// character but letters, digits, `-` and `_` left out.
pub fn slug(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_are_githubs() {
        assert_eq!(
            slug("Listeners: accept-queue exhaustion"),
            "listeners-accept-queue-exhaustion"
        );
        assert_eq!(slug("`connguard run`"), "connguard-run");
        assert_eq!(
            slug("Restart, upgrade and crash"),
            "restart-upgrade-and-crash"
        );
        assert_eq!(slug("TIME_WAIT and ports"), "time_wait-and-ports");
    }
}

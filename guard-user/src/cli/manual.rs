//! The manual, written from the command-line definition: connguard(8) and a page for
//! each command (`connguard man`, which the Debian package is built with), and shell
//! completion scripts (`connguard completions`).
//!
//! A page's NAME, SYNOPSIS and OPTIONS come from clap_mangen; its DESCRIPTION is the
//! command's long help, and its other sections its `after_long_help`, so that `--help`
//! and the page say the same. In those texts `code` is set in bold and NAME(N) is a
//! reference to a page.
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::CommandFactory;
use clap_mangen::{
    Man,
    roff::{Inline, Roff, bold, roman},
};

use super::Cli;

/// System administration commands.
const SECTION: &str = "8";

/// Writes connguard.8 and connguard-COMMAND.8 for each visible command into `dir`
/// (created if missing); their paths.
pub fn write_pages(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut root = Cli::command().disable_help_subcommand(true);
    root.build();
    let commands = root.get_subcommands().filter(|c| !c.is_hide_set()).cloned();
    let mut written = Vec::new();
    for cmd in std::iter::once(root.clone()).chain(commands) {
        let name = cmd.get_display_name().unwrap_or(cmd.get_name()).to_string();
        let path = dir.join(format!("{name}.{SECTION}"));
        std::fs::write(&path, page(cmd)?).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// Prints the completion script of `shell` for connguard's commands and options.
pub fn print_completions(shell: clap_complete::Shell) {
    let mut cmd = visible(&Cli::command());
    let name = cmd.get_name().to_string();
    clap_complete::generate(shell, &mut cmd, name, &mut std::io::stdout().lock());
}

/// The command tree less what it hides (`connguard man`, `run --state-layout`), which
/// clap_complete would complete: a copy of its names, abouts, version and visible
/// arguments, as clap cannot remove a command or an argument.
fn visible(cmd: &clap::Command) -> clap::Command {
    let mut copy = clap::Command::new(cmd.get_name().to_string())
        .args(cmd.get_arguments().filter(|a| !a.is_hide_set()).cloned())
        .subcommands(
            cmd.get_subcommands()
                .filter(|c| !c.is_hide_set())
                .map(visible),
        );
    if let Some(about) = cmd.get_about() {
        copy = copy.about(about.clone());
    }
    if let Some(version) = cmd.get_version() {
        copy = copy.version(version.to_string());
    }
    copy
}

/// A command's page, in roff.
fn page(cmd: clap::Command) -> anyhow::Result<Vec<u8>> {
    let name = cmd.get_display_name().unwrap_or(cmd.get_name()).to_string();
    // The option texts are clap_mangen's to set: they lose their code marks.
    let cmd = cmd.mut_args(|arg| match arg.get_help().map(|h| h.to_string()) {
        Some(help) => arg.help(help.replace('`', "")),
        None => arg,
    });
    // NAME says the first paragraph of the long help, the about.
    let about = cmd.get_about().map(|t| t.to_string()).unwrap_or_default();
    let description = cmd.get_long_about().map_or(about.clone(), |t| {
        let text = t.to_string();
        match text.split_once("\n\n") {
            Some((first, rest)) if first.trim_end_matches('.') == about => rest.to_string(),
            _ => text,
        }
    });
    let sections = cmd.get_after_long_help().map(|t| t.to_string());
    let has_version = cmd.get_version().is_some();
    let has_commands = cmd.get_subcommands().any(|c| !c.is_hide_set());
    let man = Man::new(cmd)
        .title(name.to_uppercase())
        .section(SECTION)
        .source(format!("connguard {}", env!("CARGO_PKG_VERSION")));
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    let mut roff = Roff::new();
    roff.control("SH", ["DESCRIPTION"]);
    paragraphs(&mut roff, &description);
    roff.to_writer(&mut out)?;
    man.render_options_section(&mut out)?;
    if has_commands {
        man.render_subcommands_section(&mut out)?;
    }
    let mut roff = Roff::new();
    self::sections(&mut roff, sections.as_deref().unwrap_or_default())?;
    roff.to_writer(&mut out)?;
    if has_version {
        man.render_version_section(&mut out)?;
    }
    Ok(once_preamble(&out))
}

/// `page` with roff's preamble, which each rendered part starts with, kept only at its
/// start.
fn once_preamble(page: &[u8]) -> Vec<u8> {
    let mut preamble = Vec::new();
    Roff::new()
        .to_writer(&mut preamble)
        .expect("writing to memory");
    let text = String::from_utf8_lossy(page);
    let preamble = String::from_utf8_lossy(&preamble);
    let body = text.replacen(&*preamble, "", usize::MAX);
    format!("{preamble}{body}").into_bytes()
}

/// Text whose blank lines separate paragraphs.
fn paragraphs(roff: &mut Roff, text: &str) {
    for line in text.lines() {
        if line.trim().is_empty() {
            roff.control("PP", []);
        } else {
            roff.text(inline(line.trim()));
        }
    }
}

/// The sections of an `after_long_help` text. A line "Heading:" at the margin starts
/// section HEADING. Under it, a line indented by 2 and followed by lines indented by 6
/// is a term (a file, a signal, a variable, an example) that they describe; other lines
/// indented by 2 are paragraphs, which blank lines separate.
fn sections(roff: &mut Roff, text: &str) -> anyhow::Result<()> {
    let mut lines = text.lines().peekable();
    let mut paragraph_ends = false;
    while let Some(line) = lines.next() {
        if line.trim().is_empty() {
            paragraph_ends = true;
        } else if !line.starts_with(' ') {
            let heading = line
                .strip_suffix(':')
                .with_context(|| format!("a heading ends with ':', not {line:?}"))?;
            roff.control("SH", [heading.to_uppercase().as_str()]);
            paragraph_ends = false;
        } else if let Some(term) = line.strip_prefix("  ").filter(|t| {
            !t.starts_with(' ') && lines.peek().is_some_and(|l| l.starts_with("      "))
        }) {
            roff.control("TP", []);
            roff.text([bold(term)]);
            paragraph_ends = false;
        } else {
            if paragraph_ends {
                roff.control("PP", []);
                paragraph_ends = false;
            }
            roff.text(inline(line.trim()));
        }
    }
    Ok(())
}

/// A line of text: `code` in bold, a page reference NAME(N) with NAME in bold.
fn inline(line: &str) -> Vec<Inline> {
    let mut out = Vec::new();
    for (i, part) in line.split('`').enumerate() {
        if i % 2 == 1 {
            out.push(bold(part));
            continue;
        }
        for word in part.split_inclusive(' ') {
            match page_reference(word) {
                Some((name, rest)) => out.extend([bold(name), roman(rest)]),
                None => out.push(roman(word)),
            }
        }
    }
    out
}

/// "name(8)," as ("name", "(8),").
fn page_reference(word: &str) -> Option<(&str, &str)> {
    let open = word.find('(')?;
    let (name, rest) = word.split_at(open);
    let section = rest.strip_prefix('(')?.split(')').next()?;
    let is_section = section.len() == 1 && section.chars().all(|c| c.is_ascii_digit());
    let is_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    (is_section && is_name).then_some((name, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command's help text is well formed for its page, and names its sections
    /// as man-pages(7) orders them.
    #[test]
    fn every_page_renders_its_sections_in_order() {
        const ORDER: &[&str] = &[
            "EXIT STATUS",
            "SIGNALS",
            "ENVIRONMENT",
            "FILES",
            "EXAMPLES",
            "SEE ALSO",
        ];
        let dir = std::env::temp_dir().join(format!("connguard-man-{}", std::process::id()));
        let pages = write_pages(&dir).unwrap();
        let mut names: Vec<String> = pages
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut expected: Vec<String> = Cli::command()
            .get_subcommands()
            .filter(|c| !c.is_hide_set())
            .map(|c| format!("connguard-{}.8", c.get_name()))
            .chain(["connguard.8".to_string()])
            .collect();
        expected.sort();
        assert_eq!(names, expected);
        for path in &pages {
            let text = std::fs::read_to_string(path).unwrap();
            let headings: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix(".SH "))
                .map(|h| h.trim_matches('"'))
                .filter(|h| ORDER.contains(h))
                .collect();
            let mut sorted = headings.clone();
            sorted.sort_by_key(|h| ORDER.iter().position(|o| o == h));
            assert_eq!(headings, sorted, "{}", path.display());
            for needed in ["EXIT STATUS", "SEE ALSO"] {
                assert!(
                    headings.contains(&needed),
                    "{} has no {needed}",
                    path.display()
                );
            }
            assert!(!text.contains('`'), "{} keeps a code mark", path.display());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn code_and_page_references_are_set_in_bold() {
        let mut roff = Roff::new();
        roff.text(inline("run `connguard stop` or see ss(8), bpf(2) and f(x)"));
        assert_eq!(
            roff.to_roff(),
            "run \\fBconnguard stop\\fR or see \\fBss\\fR(8), \\fBbpf\\fR(2) and f(x)\n"
        );
    }
}

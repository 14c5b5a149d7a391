//! Docs that cannot drift: README.md and docs/ checked against the code they describe.
//!
//! - Every ```toml block is a whole policy the parser takes, but a ```toml fragment
//!   (a part of one, not checked) and a ```toml error, which the parser must refuse with
//!   the message of the ```text block right after it (the file named `policy.toml`).
//! - docs/policy.md documents every key the parser accepts, and no other, in tables
//!   marked `<!-- policy-keys: TABLE... -->` (TABLE the dotted path of a TOML table, as
//!   `scope.rule`, or `(file)` for the top level), the key in the first column.
//! - docs/operations.md documents every metric /metrics writes, in the table marked
//!   `<!-- metrics: all -->` (name, type, labels), and every `connguard_...` name in the
//!   docs is one it writes.
//! - docs/commands.md has a section `` `connguard NAME` `` per subcommand naming each of
//!   its flags and arguments, and every `connguard NAME --flag` in the docs exists.
//! - Each `--json` output's fields are documented in a table marked
//!   `<!-- json-fields: COMMAND -->`, the field's path (`a.b`, `a[].b`) first.
//! - docs/architecture.md lists the eBPF object's maps and programs, in tables marked
//!   `<!-- maps: all -->` and `<!-- programs: all -->`.
//! - Relative links resolve, to a file and, with `#anchor`, to one of its headings.
//! - README.md, the front page, has at most 250 lines, and it and docs/README.md link
//!   every page of docs/.
//! - No commit hash in README.md, docs/ or the comments of the tracked files (`hashes`).
mod fullest;
mod hashes;
mod markdown;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Component, Path, PathBuf},
};

use clap::CommandFactory;
use regex::Regex;

use connguard_api::{
    drill::DrillsReply, events::EventRecord, fleet::FleetView, kernel::Features,
    listeners::ListenersReport, ports::PortsReport, stats::Snapshot,
};

use crate::{cli::Cli, policy, report::prometheus};
use markdown::{Doc, docs, page};

/// Fails listing `problems`, one a line, if there are any.
fn report(what: &str, problems: Vec<String>) {
    assert!(
        problems.is_empty(),
        "{what}:\n  {}\n",
        problems.join("\n  ")
    );
}

/// What the code has that the docs lack (`missing`), and what the docs name that the code
/// does not have (`stale`), one message each.
fn mismatches<T: Ord>(
    code: &BTreeSet<T>,
    docs: &BTreeSet<T>,
    missing: impl Fn(&T) -> String,
    stale: impl Fn(&T) -> String,
) -> Vec<String> {
    code.difference(docs)
        .map(missing)
        .chain(docs.difference(code).map(stale))
        .collect()
}

#[test]
fn toml_examples_are_policies_the_parser_takes() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in docs() {
        let blocks = doc.code_blocks();
        for (i, (info, text, at)) in blocks.iter().enumerate() {
            let mut words = info.split_whitespace();
            if words.next() != Some("toml") {
                continue;
            }
            checked += 1;
            let word = words.next();
            if word == Some("drill") {
                if let Err(e) = policy::drill::parse(text, "drill.toml") {
                    problems.push(format!("{}: the drill parser refuses it: {e}", doc.at(*at)));
                }
                continue;
            }
            match (word, policy::parse(text, "policy.toml")) {
                (Some("fragment"), _) => {}
                (None, Ok(_)) => {}
                (None, Err(e)) => problems.push(format!("{}: the parser refuses it: {e}", doc.at(*at))),
                (Some("error"), Ok(_)) => problems.push(format!(
                    "{}: a ```toml error block the parser takes",
                    doc.at(*at)
                )),
                (Some("error"), Err(e)) => match blocks.get(i + 1) {
                    Some((info, shown, _)) if info == "text" => {
                        if shown.trim() != e.to_string() {
                            problems.push(format!(
                                "{}: the ```text block after it shows {:?}; the parser says {:?}",
                                doc.at(*at),
                                shown.trim(),
                                e.to_string()
                            ));
                        }
                    }
                    _ => problems.push(format!(
                        "{}: a ```toml error block needs the ```text block of its message right after it: {e}",
                        doc.at(*at)
                    )),
                },
                (Some(other), _) => problems.push(format!(
                    "{}: ```toml {other}: the words known after toml are fragment, error and drill",
                    doc.at(*at)
                )),
            }
        }
    }
    assert!(checked > 0, "no ```toml block in README.md and docs/");
    report("TOML examples", problems);
}

/// The keys that make the parser answer "unknown field `PROBE`, expected ...": those of
/// the table at `path` (each step a key and whether it is an array of tables); None
/// when that is no table of the policy.
fn probe_table(path: &[(String, bool)]) -> Option<Vec<String>> {
    let mut text = String::new();
    for i in 0..path.len() {
        let name: Vec<&str> = path[..=i].iter().map(|(k, _)| k.as_str()).collect();
        let name = name.join(".");
        text += &if path[i].1 {
            format!("[[{name}]]\n")
        } else {
            format!("[{name}]\n")
        };
    }
    text += "PROBE = 1\n";
    let err = policy::parse(&text, "probe.toml").err()?.to_string();
    let expected = err.split_once("unknown field `PROBE`, expected")?.1;
    Some(
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect(),
    )
}

/// Every key of the policy file, as `TABLE.KEY` (`KEY` at the top level), from the
/// parser's own answers: the tables it knows are found by giving each key a table, or
/// an array of tables, holding an unknown key.
fn policy_keys() -> BTreeMap<String, BTreeSet<String>> {
    fn walk(path: Vec<(String, bool)>, out: &mut BTreeMap<String, BTreeSet<String>>) {
        let table: Vec<&str> = path.iter().map(|(k, _)| k.as_str()).collect();
        let table = if table.is_empty() {
            "(file)".to_string()
        } else {
            table.join(".")
        };
        let keys = probe_table(&path).unwrap_or_else(|| panic!("{table} is no table"));
        for key in keys {
            out.entry(table.clone()).or_default().insert(key.clone());
            for array in [false, true] {
                let mut inner = path.clone();
                inner.push((key.clone(), array));
                if probe_table(&inner).is_some() {
                    walk(inner, out);
                    break;
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(Vec::new(), &mut out);
    out
}

#[test]
fn every_policy_key_is_documented_and_every_documented_key_exists() {
    let keys = policy_keys();
    assert!(
        keys.get("scope.rule")
            .is_some_and(|k| k.contains("max_connections")),
        "the probe found {keys:?}"
    );
    let doc = page("policy.md");
    let mut documented = BTreeSet::new();
    let mut problems = Vec::new();
    for (tables, rows, at) in doc.marked_tables("policy-keys") {
        for table in tables.split_whitespace() {
            for row in &rows {
                match row.first().and_then(|c| c.code.first()) {
                    Some(key) => {
                        documented.insert((table.to_string(), key.clone()));
                    }
                    None => problems.push(format!(
                        "{}: a row of the keys of {table} whose first cell names no `key`",
                        doc.at(at)
                    )),
                }
            }
        }
    }
    let accepted = keys
        .iter()
        .flat_map(|(table, keys)| keys.iter().map(|k| (table.clone(), k.clone())))
        .collect();
    let path = doc.path.display();
    problems.extend(mismatches(
        &accepted,
        &documented,
        |(table, key)| {
            format!(
                "{path}: the parser accepts key `{key}` in {table}, which no row of a table marked <!-- policy-keys: {table} --> documents"
            )
        },
        |(table, key)| {
            format!("{path}: documents key `{key}` in {table}, which the parser does not accept")
        },
    ));
    report("policy keys", problems);
}

/// The fullest snapshot, with a breaker on every destination: serde names no field of
/// a struct with a flattened field, and a destination's `breaker` is left out of the
/// JSON when it has none, so no pass of [`fullest`] can find it.
fn fullest_snapshot() -> Snapshot {
    let mut snap: Snapshot = fullest::value();
    for d in snap.scopes.iter_mut().flat_map(|s| &mut s.destinations) {
        d.breaker = Some(Box::new(fullest::value()));
    }
    snap
}

/// Every metric family /metrics writes of the fullest snapshot: name -> (type, labels).
fn exported_metrics() -> BTreeMap<String, (String, BTreeSet<String>)> {
    let snap = fullest_snapshot();
    let text = prometheus::render(&snap, &mut prometheus::Exported::default());
    let mut out: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE NAME KIND");
            out.insert(name.into(), (kind.into(), BTreeSet::new()));
        }
    }
    let label = Regex::new(r#"([a-zA-Z_][a-zA-Z0-9_]*)=""#).unwrap();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        let (_, labels) = out
            .get_mut(name)
            .unwrap_or_else(|| panic!("sample of no family: {line}"));
        if let Some((_, rest)) = line.split_once('{') {
            let inside = rest.rsplit_once('}').map_or(rest, |(l, _)| l);
            labels.extend(label.captures_iter(inside).map(|c| c[1].to_string()));
        }
    }
    out
}

#[test]
fn every_metric_is_documented_and_every_documented_metric_exists() {
    let metrics = exported_metrics();
    assert!(
        metrics.len() > 30 && metrics.contains_key("connguard_breaker_state"),
        "the fullest snapshot exported only {metrics:?}"
    );
    let doc = page("operations.md");
    let mut problems = Vec::new();
    let mut documented = BTreeMap::new();
    for (_, rows, at) in doc.marked_tables("metrics") {
        for row in rows {
            match (
                row.first().and_then(|c| c.code.first()),
                row.get(1),
                row.get(2),
            ) {
                (Some(name), Some(kind), Some(labels)) => {
                    let labels: BTreeSet<String> = labels.code.iter().cloned().collect();
                    documented.insert(name.clone(), (kind.text.trim().to_string(), labels));
                }
                _ => problems.push(format!(
                    "{}: a metrics row needs `name`, type and `labels` cells",
                    doc.at(at)
                )),
            }
        }
    }
    let path = doc.path.display();
    problems.extend(mismatches(
        &metrics.keys().cloned().collect(),
        &documented.keys().cloned().collect(),
        |name| {
            format!(
                "{path}: /metrics writes `{name}`, which no row of the table marked <!-- metrics: all --> documents"
            )
        },
        |name| format!("{path}: documents metric `{name}`, which /metrics does not write"),
    ));
    for (name, (kind, labels)) in &documented {
        let Some((exported_kind, exported_labels)) = metrics.get(name) else {
            continue;
        };
        if kind != exported_kind {
            problems.push(format!(
                "{path}: `{name}` is documented as a {kind}, /metrics writes a {exported_kind}"
            ));
        }
        if labels != exported_labels {
            problems.push(format!(
                "{path}: `{name}` is documented with labels {labels:?}, /metrics writes {exported_labels:?}"
            ));
        }
    }
    let mention = Regex::new(r"\bconnguard_[a-z0-9_]*[a-z0-9]").unwrap();
    for doc in docs() {
        for m in mention.find_iter(&doc.text) {
            if !metrics.contains_key(m.as_str()) {
                problems.push(format!(
                    "{}: names `{}`, which /metrics does not write",
                    doc.at(m.start()),
                    m.as_str()
                ));
            }
        }
    }
    report("metrics", problems);
}

/// The subcommands: name -> (its flags, `--long`, hidden ones included; whether each is
/// hidden), and the value names of its positional arguments.
type Subcommands = BTreeMap<String, (BTreeMap<String, bool>, Vec<String>)>;

fn subcommands() -> Subcommands {
    // A command with subcommands of its own (`drill`) is documented by theirs, named
    // `drill start`.
    let root = Cli::command();
    let mut out = Subcommands::new();
    for sub in root.get_subcommands() {
        let nested: Vec<_> = sub.get_subcommands().collect();
        if nested.is_empty() {
            out.insert(sub.get_name().to_string(), arguments(sub));
        }
        for n in nested {
            out.insert(format!("{} {}", sub.get_name(), n.get_name()), arguments(n));
        }
    }
    out
}

/// A command's flags (hidden or not) and the value names of its positionals.
fn arguments(cmd: &clap::Command) -> (BTreeMap<String, bool>, Vec<String>) {
    let mut flags = BTreeMap::new();
    let mut positionals = Vec::new();
    for arg in cmd.get_arguments() {
        if let Some(long) = arg.get_long() {
            flags.insert(format!("--{long}"), arg.is_hide_set());
        } else if arg.is_positional() {
            let names = arg.get_value_names().unwrap_or_default();
            positionals.extend(names.iter().map(|n| n.to_string()));
        }
    }
    (flags, positionals)
}

/// Flags every command takes from clap.
const CLAP_FLAGS: [&str; 2] = ["--help", "--version"];

#[test]
fn every_subcommand_and_flag_is_documented() {
    let subs = subcommands();
    assert!(subs.contains_key("run"), "{:?}", subs.keys());
    let doc = page("commands.md");
    let mut problems = Vec::new();
    for (name, (flags, positionals)) in &subs {
        let heading = format!("connguard {name}");
        let Some(code) = doc.section_code(&heading) else {
            problems.push(format!(
                "{}: no section `{heading}` for subcommand {name}",
                doc.path.display()
            ));
            continue;
        };
        let first_words: BTreeSet<&str> = code
            .iter()
            .filter_map(|c| c.split([' ', '=']).next())
            .collect();
        for (flag, hidden) in flags {
            if !hidden && !first_words.contains(flag.as_str()) {
                problems.push(format!(
                    "{}: section `{heading}` names no `{flag}` (a code span starting with it)",
                    doc.path.display()
                ));
            }
        }
        for value in positionals {
            if !first_words.contains(value.as_str()) {
                problems.push(format!(
                    "{}: section `{heading}` names no `{value}`, its argument",
                    doc.path.display()
                ));
            }
        }
        for word in first_words.iter().filter(|w| w.starts_with("--")) {
            if !flags.contains_key(*word) && !CLAP_FLAGS.contains(word) {
                problems.push(format!(
                    "{}: section `{heading}` names `{word}`, which `connguard {name}` does not take",
                    doc.path.display()
                ));
            }
        }
    }
    report("subcommands", problems);
}

#[test]
fn every_connguard_command_named_in_the_docs_exists() {
    let subs = subcommands();
    // A command line: a code span, or a line of a code block, that starts with it (after
    // a prompt, or a path to the binary).
    let invocation =
        Regex::new(r"^(?:\$\s+|sudo\s+)?(?:\S*/)?connguard ([a-z][a-z-]*)(.*)$").unwrap();
    let mut problems = Vec::new();
    let mut seen = 0;
    for doc in docs() {
        for (code, at) in doc.code() {
            if let Some(caps) = invocation.captures(code.trim()) {
                seen += 1;
                let (mut name, mut args) = (caps[1].to_string(), caps[2].to_string());
                // `connguard drill start ...`: the nested subcommand's own.
                if let Some((word, rest)) = args
                    .trim_start()
                    .split_once(' ')
                    .or(Some((args.trim(), "")))
                    && subs.contains_key(&format!("{name} {word}"))
                {
                    (name, args) = (format!("{name} {word}"), rest.to_string());
                }
                let Some((flags, _)) = subs.get(&name) else {
                    problems.push(format!(
                        "{}: `connguard {name}` is no subcommand",
                        doc.at(at)
                    ));
                    continue;
                };
                for flag in command_flags(&args) {
                    if !flags.contains_key(&flag) && !CLAP_FLAGS.contains(&flag.as_str()) {
                        problems.push(format!(
                            "{}: `connguard {name}` takes no `{flag}`",
                            doc.at(at)
                        ));
                    }
                }
            }
        }
    }
    assert!(seen > 10, "only {seen} connguard invocations in the docs");
    report("commands named in the docs", problems);
}

/// The `--flags` of a command line's arguments: up to a pipe, `;`, `&&`, a redirection
/// or a comment (`|` inside brackets separates alternatives).
fn command_flags(args: &str) -> Vec<String> {
    let mut depth = 0;
    let mut out = Vec::new();
    for word in args.split_whitespace() {
        let bare = word.trim_matches(|c| "[]()".contains(c));
        if depth == 0 && ["|", ";", "&&", ">", "2>", "#"].contains(&word) {
            break;
        }
        depth += word.matches('[').count() as i32 - word.matches(']').count() as i32;
        if let Some(flag) = bare.strip_prefix("--") {
            let flag = flag.split('=').next().unwrap_or_default();
            out.push(format!("--{flag}"));
        }
    }
    out
}

/// Each `--json` output, the marker's COMMAND, and its fields.
fn json_outputs() -> Vec<(&'static str, BTreeSet<String>)> {
    vec![
        ("stats", fullest::fields(&fullest_snapshot())),
        ("ports", fullest::fields(&fullest::value::<PortsReport>())),
        (
            "listeners",
            fullest::fields(&fullest::value::<ListenersReport>()),
        ),
        ("events", fullest::fields(&fullest::value::<EventRecord>())),
        ("kernel", fullest::fields(&fullest::value::<Features>())),
        ("fleet", fullest::fields(&fullest::value::<FleetView>())),
        (
            "drill list",
            fullest::fields(&fullest::value::<DrillsReply>()),
        ),
    ]
}

#[test]
fn every_json_field_is_documented_and_every_documented_field_exists() {
    let mut documented: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut problems = Vec::new();
    for doc in docs() {
        for (command, rows, at) in doc.marked_tables("json-fields") {
            for row in rows {
                match row.first().and_then(|c| c.code.first()) {
                    Some(path) => documented
                        .entry(command.clone())
                        .or_default()
                        .push((path.clone(), doc.at(at))),
                    None => problems.push(format!(
                        "{}: a row of {command}'s fields whose first cell names no `path`",
                        doc.at(at)
                    )),
                }
            }
        }
    }
    let outputs = json_outputs();
    for (command, fields) in &outputs {
        let rows = documented.remove(*command).unwrap_or_default();
        let paths = rows.iter().map(|(p, _)| p.clone()).collect();
        let at = |path: &String| rows.iter().find(|(p, _)| p == path).map(|(_, at)| at);
        problems.extend(mismatches(
            fields,
            &paths,
            |field| {
                format!(
                    "`connguard {command} --json` writes `{field}`, which no table marked <!-- json-fields: {command} --> documents"
                )
            },
            |path| {
                format!(
                    "{}: documents `{path}` of `connguard {command} --json`, which it does not write",
                    at(path).expect("documented")
                )
            },
        ));
    }
    for (command, rows) in documented {
        problems.push(format!(
            "{}: <!-- json-fields: {command} -->: no --json output of that name (known: {})",
            rows[0].1,
            outputs
                .iter()
                .map(|(c, _)| *c)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    report("JSON fields", problems);
}

/// The first cells' code of the tables marked `<!-- NAME: all -->` in `doc`.
fn listed(doc: &Doc, name: &str) -> BTreeSet<String> {
    doc.marked_tables(name)
        .into_iter()
        .flat_map(|(_, rows, _)| rows)
        .filter_map(|row| row.first()?.code.first().cloned())
        .collect()
}

#[test]
fn the_architecture_lists_every_map_and_program_of_the_object() {
    let doc = page("architecture.md");
    let mut problems = Vec::new();
    for (what, marker, names) in [
        ("map", "maps", guard_common::names::map::ALL),
        ("program", "programs", guard_common::names::program::ALL),
    ] {
        let names: BTreeSet<String> = names.iter().map(|n| n.to_string()).collect();
        let path = doc.path.display();
        problems.extend(mismatches(
            &names,
            &listed(&doc, marker),
            |n| {
                format!(
                    "{path}: the object's {what} `{n}` is in no row of the table marked <!-- {marker}: all -->"
                )
            },
            |n| format!("{path}: lists {what} `{n}`, which the object does not have"),
        ));
    }
    report("maps and programs", problems);
}

/// `to`, a link target relative to `from`'s folder, as a path from the root.
fn resolve(from: &Path, to: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for c in from.parent().unwrap_or(Path::new("")).join(to).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// The front page's length limit, in lines.
const FRONT_PAGE_LINES: usize = 250;

#[test]
fn the_front_page_is_short_and_it_and_the_index_link_every_page() {
    let all = docs();
    let pages: BTreeSet<PathBuf> = all
        .iter()
        .filter(|d| d.path.starts_with("docs") && d.path != Path::new("docs/README.md"))
        .map(|d| d.path.clone())
        .collect();
    let mut problems = Vec::new();
    for index in ["README.md", "docs/README.md"] {
        let doc = all
            .iter()
            .find(|d| d.path == Path::new(index))
            .unwrap_or_else(|| panic!("no {index}"));
        let linked: BTreeSet<PathBuf> = doc
            .links()
            .into_iter()
            .filter(|(url, _)| !url.contains("://"))
            .map(|(url, _)| resolve(&doc.path, url.split('#').next().unwrap_or_default()))
            .collect();
        problems.extend(
            pages
                .difference(&linked)
                .map(|p| format!("{index} does not link {}", p.display())),
        );
    }
    let readme = all.iter().find(|d| d.path == Path::new("README.md"));
    let lines = readme.map_or(0, |d| d.text.lines().count());
    if lines > FRONT_PAGE_LINES {
        problems.push(format!(
            "README.md has {lines} lines, more than {FRONT_PAGE_LINES}: move the detail into docs/"
        ));
    }
    report("the front page", problems);
}

#[test]
fn relative_links_resolve_to_files_and_headings() {
    let all = docs();
    let root = markdown::root();
    let anchors = |path: &Path| -> Option<BTreeSet<String>> {
        let doc = all.iter().find(|d| d.path == path)?;
        Some(doc.headings().into_iter().map(|h| h.2).collect())
    };
    let mut problems = Vec::new();
    let mut seen = 0;
    for doc in &all {
        for (url, at) in doc.links() {
            if url.contains("://") || url.starts_with("mailto:") {
                continue;
            }
            seen += 1;
            let (file, anchor) = match url.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (url.as_str(), None),
            };
            let target = if file.is_empty() {
                doc.path.clone()
            } else {
                resolve(&doc.path, file)
            };
            if !root.join(&target).exists() {
                problems.push(format!(
                    "{}: links to {url}: {} does not exist",
                    doc.at(at),
                    target.display()
                ));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            match anchors(&target) {
                Some(a) if a.contains(anchor) => {}
                Some(_) => problems.push(format!(
                    "{}: links to {url}: {} has no heading with anchor #{anchor}",
                    doc.at(at),
                    target.display()
                )),
                None => problems.push(format!(
                    "{}: links to {url}: an anchor in {}, which is not one of the docs",
                    doc.at(at),
                    target.display()
                )),
            }
        }
    }
    assert!(seen > 10, "only {seen} relative links in the docs");
    report("links", problems);
}

#[test]
fn command_flags_stop_at_the_end_of_the_command() {
    assert_eq!(
        command_flags(" ports [--json] [--netns PATH | --pid PID] | jq --raw"),
        ["--json", "--netns", "--pid"]
    );
    assert_eq!(
        command_flags(" run --policy=/etc/p.toml # --not-this"),
        ["--policy"]
    );
}

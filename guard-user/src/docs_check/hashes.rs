//! No commit hash in the docs or in comments: history lives in git, and prose states what
//! is true now. A kernel behaviour is cited by its source (`net/ipv4/tcp_minisocks.c:
//! tcp_time_wait()`) or the release that brought it, not by a commit id.
//!
//! Checked, in every file git tracks: each line of a `.md` file; the comment of each line
//! of a `.rs` file (from `//` to the end of the line, doc comments included); and the
//! `#` comments of `.toml`, `.yml`, `.service` and shell files. String literals and code
//! are not checked: test data such as container ids is hex too.
use std::{path::Path, process::Command, sync::LazyLock};

use regex::Regex;

use super::{markdown::root, report};

/// The words of `text` that look like commit hashes: 7 to 12 lower-case hex digits (git's
/// abbreviations) or 40 (a whole SHA-1), with at least one letter and one digit, and no
/// letter, digit or `_` on either side. Not taken for one: a number (`1000000`), a word of
/// the letters a to f alone (`deadbeef`, `facade`), a `0x` literal, upper-case hex, a
/// longer run of hex (a SHA-256 checksum).
fn hashes(text: &str) -> Vec<&str> {
    static WORD: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"\b(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b").expect("a valid regex")
    });
    WORD.find_iter(text)
        .map(|m| m.as_str())
        .filter(|w| w.bytes().any(|b| b.is_ascii_digit()) && w.bytes().any(|b| b >= b'a'))
        .collect()
}

/// The comment of a line of Rust: from the first `//` outside a string literal (after an
/// even number of unescaped `"`) to the end of the line.
fn rust_comment(line: &str) -> Option<&str> {
    let bytes = line.as_bytes();
    let mut quotes = 0;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'"' if i == 0 || bytes[i - 1] != b'\\' => quotes += 1,
            b'/' if quotes % 2 == 0 && bytes.get(i + 1) == Some(&b'/') => {
                return Some(&line[i..]);
            }
            _ => {}
        }
    }
    None
}

/// The comment of a line of a file that comments with `#`: from a `#` at the start of the
/// line or after a blank.
fn hash_comment(line: &str) -> Option<&str> {
    let bytes = line.as_bytes();
    (0..bytes.len())
        .find(|&i| bytes[i] == b'#' && (i == 0 || bytes[i - 1].is_ascii_whitespace()))
        .map(|i| &line[i..])
}

/// The part of `line` of the file at `path` that is prose to check; None for a file
/// whose kind is not checked.
fn prose<'a>(path: &Path, line: &'a str) -> Option<Option<&'a str>> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "md" => Some(Some(line)),
        "rs" => Some(rust_comment(line)),
        "toml" | "yml" | "yaml" | "service" | "sh" => Some(hash_comment(line)),
        "" if path.starts_with(".ci") => Some(hash_comment(line)),
        _ => None,
    }
}

/// The files git tracks, relative to the repository's root.
fn tracked() -> Vec<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root())
        .args(["ls-files", "-z"])
        .output()
        .expect("running git ls-files in the repository");
    assert!(
        out.status.success(),
        "git ls-files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("UTF-8 paths")
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(String::from)
        .collect()
}

#[test]
fn no_commit_hash_in_the_docs_or_in_comments() {
    let root = root();
    let mut checked = 0;
    let mut problems = Vec::new();
    for file in tracked() {
        let path = Path::new(&file);
        if prose(path, "").is_none() {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root.join(path)) else {
            continue;
        };
        checked += 1;
        for (n, line) in text.lines().enumerate() {
            for hash in prose(path, line).flatten().map(hashes).unwrap_or_default() {
                problems.push(format!(
                    "{file}:{}: `{hash}` looks like a commit hash: say what is true and why, or \
                     cite the source (file and function, release)",
                    n + 1
                ));
            }
        }
    }
    assert!(checked > 0, "no file checked");
    report("commit hashes", problems);
}

#[test]
fn what_looks_like_a_commit_hash() {
    // Put together here, so that this file's own lines hold none.
    let (a, b) = (concat!("947b", "d72"), concat!("8c33", "16a"));
    let full = concat!("0123456789abcdef", "0123456789abcdef", "01234567");
    assert_eq!(hashes(&format!("{a} (before), {b} (now)")), [a, b]);
    assert_eq!(hashes(&format!("fixed in {full}.")), [full]);
    assert!(hashes("1000000 attempts, 0x1a2b3c4d, deadbeef, ABC1234, facade").is_empty());
    assert!(hashes("a2f3e4b5c6d7e8f9a0 is too long; abc123 too short").is_empty());
    assert!(hashes(&format!("x{a} and {a}_tail are parts of words")).is_empty());

    let line = format!(r#"    let s = "http://x/{a}"; // see {b}"#);
    assert_eq!(rust_comment(&line), Some(format!("// see {b}").as_str()));
    assert_eq!(
        rust_comment(r#"    "a \" // quoted" // after"#),
        Some("// after")
    );
    assert_eq!(rust_comment("/// doc"), Some("/// doc"));
    assert_eq!(
        rust_comment(r#"    f("cri-containerd-0123abc.scope")"#),
        None
    );

    let line = format!("max = 5   # {a}");
    assert_eq!(hash_comment(&line), Some(format!("# {a}").as_str()));
    assert_eq!(hash_comment(&format!(r#"url = "http://x/#{a}""#)), None);
    assert_eq!(prose(Path::new(".ci/run"), "# x"), Some(Some("# x")));
    assert_eq!(
        prose(Path::new("packaging/grafana/connguard.json"), "x"),
        None
    );
}

//! connguard: the daemon and its command-line tools, as a library that the `connguard`
//! binary (src/main.rs) runs and that tests and examples drive.
//!
//! The modules are layers, each using only those listed before it: `workload` (on
//! crates alone), then `policy`, `host`, `kernel`, `enforce`, `fleet`, `listen`,
//! `diagnose`, `report`, `control`, `cli`. `daemon` wires them into the daemon; the
//! binary wires them into the other commands. The data of connguard's JSON and control
//! protocol are the `connguard-api` crate's.
pub mod cli;
pub mod control;
pub mod daemon;
pub mod diagnose;
#[cfg(test)]
mod docs_check;
pub mod enforce;
pub mod fleet;
pub mod host;
pub mod kernel;
pub mod listen;
pub mod policy;
pub mod report;
pub mod workload;

#[cfg(test)]
mod layering {
    use std::path::Path;

    /// The layers, lowest first; a file may use its own layer and those before it, but
    /// the first FOUNDATION (workload) use only themselves.
    const FOUNDATION: usize = 1;
    const LAYERS: &[&str] = &[
        "workload",
        "policy",
        "host",
        "kernel",
        "enforce",
        "fleet",
        "listen",
        "diagnose",
        "report",
        "control",
        "cli",
        "daemon",
        "lib",
        "main",
        "docs_check",
    ];

    /// The top-level modules a source text names after `crate::`, braces included.
    fn used(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        for (at, _) in text.match_indices("crate::") {
            let rest = &text[at + "crate::".len()..];
            let Some(inner) = rest.strip_prefix('{') else {
                out.push(
                    rest.chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect(),
                );
                continue;
            };
            let (mut depth, mut item) = (0, String::new());
            for c in inner.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(std::mem::take(&mut item));
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.push(item);
        }
        out.iter()
            .map(|i| i.trim().split("::").next().unwrap_or("").to_string())
            .filter(|m| !m.is_empty())
            .collect()
    }

    fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().is_dir() {
                files(&e.path(), out);
            } else if e.path().extension().is_some_and(|x| x == "rs") {
                out.push(e.path());
            }
        }
    }

    #[test]
    fn modules_use_only_their_own_layer_and_lower_ones() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut all = Vec::new();
        files(&src, &mut all);
        let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
        let mut upward = Vec::new();
        for path in all {
            let rel = path.strip_prefix(&src).unwrap();
            let layer = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy();
            let layer = layer.trim_end_matches(".rs");
            let own = rank(layer).unwrap_or_else(|| panic!("{} is in no layer", rel.display()));
            for m in used(&std::fs::read_to_string(&path).unwrap()) {
                match rank(&m) {
                    Some(r) if m == layer || (r < own && own >= FOUNDATION) => {}
                    _ => upward.push(format!("{} uses crate::{}", rel.display(), m)),
                }
            }
        }
        assert!(upward.is_empty(), "{upward:#?}");
    }
}

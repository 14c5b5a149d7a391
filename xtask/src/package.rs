//! `cargo xtask package`: a Debian package of the release build, staged under
//! target/package and built with dpkg-deb: the binary, the systemd unit (not enabled
//! nor started on install), the embedded default policy as the conffile
//! /etc/connguard/policy.toml, the man pages and shell completions (which the binary
//! writes from its command-line definition, anew for each package), the README and the
//! manual (docs/), and the Prometheus alert rules and Grafana dashboard as examples.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

/// The installed paths, below the package root.
const BIN: &str = "usr/bin/connguard";
const UNIT: &str = "lib/systemd/system/connguard.service";
const POLICY: &str = "etc/connguard/policy.toml";
const DOC: &str = "usr/share/doc/connguard";
/// Files of packaging/ installed as examples in DOC/examples.
const EXAMPLES: &[&str] = &["prometheus/alerts.yml", "grafana/connguard.json"];
/// connguard(8) and connguard-COMMAND(8), gzipped.
const MAN: &str = "usr/share/man/man8";
/// The completion scripts `connguard completions SHELL` prints, where each shell's
/// Debian package looks for them.
const COMPLETIONS: &[(&str, &str)] = &[
    ("bash", "usr/share/bash-completion/completions/connguard"),
    ("zsh", "usr/share/zsh/vendor-completions/_connguard"),
    ("fish", "usr/share/fish/vendor_completions.d/connguard.fish"),
];

/// After install or upgrade: systemd learns of the unit; nothing is enabled or started
/// (a host's operator chooses its policy first).
const POSTINST: &str = "#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
\tsystemctl --system daemon-reload >/dev/null || true
fi
";

/// Before removal (not before an upgrade, whose new daemon adopts the pinned state):
/// stop the daemon, then detach its programs and unpin its state, which a stop keeps.
const PRERM: &str = "#!/bin/sh
set -e
if [ \"$1\" = remove ]; then
\tif [ -d /run/systemd/system ]; then
\t\tdeb-systemd-invoke stop connguard.service >/dev/null || true
\tfi
\t/usr/bin/connguard stop >/dev/null || true
fi
";

/// After removal: systemd forgets the unit.
const POSTRM: &str = "#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
\tsystemctl --system daemon-reload >/dev/null || true
fi
";

pub fn run(root: &Path) -> anyhow::Result<PathBuf> {
    let deb = build(root, &root.join("target/package"))?;
    println!("{}", deb.display());
    Ok(deb)
}

/// Stages the package tree in `out` and builds the .deb there; its path.
pub fn build(root: &Path, out: &Path) -> anyhow::Result<PathBuf> {
    let version = version(root)?;
    let tree = out.join(format!("connguard_{version}_amd64"));
    if tree.exists() {
        std::fs::remove_dir_all(&tree)?;
    }
    let put = |path: &str, contents: &[u8], mode: u32| -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let file = tree.join(path);
        std::fs::create_dir_all(file.parent().context("no parent")?)?;
        std::fs::write(&file, contents).with_context(|| format!("writing {}", file.display()))?;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    let binary = root.join("target/release/connguard");
    let bytes = std::fs::read(&binary)
        .with_context(|| format!("{} is missing: run `cargo xtask build`", binary.display()))?;
    put(BIN, &bytes, 0o755)?;
    // Symbols stay in the build tree; the package ships the stripped binary.
    let status = Command::new("strip")
        .args(["--strip-unneeded"])
        .arg(tree.join(BIN))
        .status()
        .context("strip is missing (package binutils)")?;
    if !status.success() {
        bail!("strip failed");
    }
    let manual = out.join("man");
    if manual.exists() {
        std::fs::remove_dir_all(&manual)?;
    }
    connguard(&tree.join(BIN), &["man", "--dir"], Some(&manual))?;
    for page in std::fs::read_dir(&manual)? {
        let page = page?.path();
        let name = page.file_name().context("a page with no name")?;
        put(
            &format!("{MAN}/{}.gz", name.to_string_lossy()),
            &gzip(&std::fs::read(&page)?)?,
            0o644,
        )?;
    }
    for (shell, path) in COMPLETIONS {
        put(
            path,
            &connguard(&tree.join(BIN), &["completions", shell], None)?,
            0o644,
        )?;
    }
    put(
        UNIT,
        &std::fs::read(root.join("packaging/connguard.service"))?,
        0o644,
    )?;
    put(
        POLICY,
        &std::fs::read(root.join("policies/default.toml"))?,
        0o644,
    )?;
    put(
        &format!("{DOC}/README.md"),
        &std::fs::read(root.join("README.md"))?,
        0o644,
    )?;
    // The manual, beside the README whose links point into it.
    let mut pages: Vec<_> = std::fs::read_dir(root.join("docs"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    pages.sort();
    for page in pages
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
    {
        let name = page.file_name().unwrap_or_default().to_string_lossy();
        put(&format!("{DOC}/docs/{name}"), &std::fs::read(page)?, 0o644)?;
    }
    for example in EXAMPLES {
        put(
            &format!("{DOC}/examples/{example}"),
            &std::fs::read(root.join("packaging").join(example))?,
            0o644,
        )?;
    }
    put(&format!("{DOC}/copyright"), copyright().as_bytes(), 0o644)?;
    put(
        &format!("{DOC}/changelog.gz"),
        &gzip(changelog(&version).as_bytes())?,
        0o644,
    )?;
    let size_kib = installed_kib(&tree)?;
    put(
        "DEBIAN/control",
        control(&version, size_kib).as_bytes(),
        0o644,
    )?;
    put("DEBIAN/conffiles", format!("/{POLICY}\n").as_bytes(), 0o644)?;
    put("DEBIAN/postinst", POSTINST.as_bytes(), 0o755)?;
    put("DEBIAN/prerm", PRERM.as_bytes(), 0o755)?;
    put("DEBIAN/postrm", POSTRM.as_bytes(), 0o755)?;
    let deb = out.join(format!("connguard_{version}_amd64.deb"));
    let status = Command::new("dpkg-deb")
        .args(["--root-owner-group", "--build"])
        .arg(&tree)
        .arg(&deb)
        .status()
        .context("dpkg-deb is missing (package dpkg)")?;
    if !status.success() {
        bail!("dpkg-deb --build failed");
    }
    Ok(deb)
}

/// Runs the staged binary with `args` (and `dir`); what it printed.
fn connguard(binary: &Path, args: &[&str], dir: Option<&Path>) -> anyhow::Result<Vec<u8>> {
    let out = Command::new(binary)
        .args(args)
        .args(dir)
        .output()
        .with_context(|| format!("running {}", binary.display()))?;
    if !out.status.success() {
        bail!(
            "connguard {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// The size of the files below `tree` but for DEBIAN/ (Installed-Size), in KiB, each
/// file rounded up to a whole KiB.
fn installed_kib(tree: &Path) -> anyhow::Result<u64> {
    let mut kib = 0;
    let mut dirs = vec![tree.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                if entry.path() != tree.join("DEBIAN") {
                    dirs.push(entry.path());
                }
            } else {
                kib += entry.metadata()?.len().div_ceil(1024);
            }
        }
    }
    Ok(kib)
}

/// `text`, compressed as Debian wants it: gzip -9, no name or time stamp (-n).
fn gzip(text: &[u8]) -> anyhow::Result<Vec<u8>> {
    use std::io::Write;
    let mut child = Command::new("gzip")
        .args(["-9n"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("gzip is missing")?;
    child.stdin.take().context("gzip stdin")?.write_all(text)?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("gzip failed");
    }
    Ok(out.stdout)
}

/// A native package's changelog: one entry, for this version.
fn changelog(version: &str) -> String {
    format!(
        "connguard ({version}) unstable; urgency=medium

  * Built by cargo xtask package.

 -- connguard developers <maintainers@connguard.example.org>  Tue, 01 Dec 2026 00:00:00 +0000
"
    )
}

/// The connguard crate's version, from its Cargo.toml.
pub fn version(root: &Path) -> anyhow::Result<String> {
    let manifest = std::fs::read_to_string(root.join("guard-user/Cargo.toml"))?;
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .map(str::to_string)
        .context("no version in guard-user/Cargo.toml")
}

fn control(version: &str, size_kib: u64) -> String {
    format!(
        "Package: connguard
Version: {version}
Architecture: amd64
Maintainer: connguard developers <maintainers@connguard.example.org>
Installed-Size: {size_kib}
Depends: libc6 (>= 2.34)
Section: net
Priority: optional
Description: TCP connection budgets per cgroup, enforced in the kernel
 connguard counts concurrent TCP connections per cgroup and per destination with
 eBPF programs, sheds connections over budget at connect() and at the listener,
 and reports TIME_WAIT, ephemeral-port and accept-queue exhaustion.
"
    )
}

fn copyright() -> String {
    "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: connguard

Files: *
Copyright: 2026 connguard developers
License: GPL-2.0-only
 On Debian systems, the full text of the GNU General Public License version 2 is
 in /usr/share/common-licenses/GPL-2.
"
    .to_string()
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// A package built into a directory of its own (tests run side by side); the
    /// directory and the .deb.
    fn package(name: &str) -> (PathBuf, PathBuf) {
        let out = std::env::temp_dir().join(format!("connguard-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        let deb = build(&crate::root(), &out).unwrap();
        (out, deb)
    }

    /// Runs `cmd` with `args`; whether it succeeded, and its stdout and stderr.
    fn run(cmd: &str, args: &[&str]) -> (bool, String, String) {
        let o = Command::new(cmd)
            .args(args)
            .env("MANWIDTH", "100")
            .output()
            .unwrap_or_else(|e| panic!("{cmd}: {e} (cargo xtask setup installs it)"));
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    }

    /// The package holds what it should, with the policy as a conffile, maintainer
    /// scripts that only reload systemd (nothing enabled or started on install), and
    /// no lintian error nor any lintian tag about its manual or completions.
    #[test]
    fn the_package_holds_the_binary_unit_and_policy_and_passes_lintian() {
        let root = crate::root();
        let (out, deb) = package("package");
        let deb = deb.to_str().unwrap();
        let (ok, listing, _) = run("dpkg-deb", &["--contents", deb]);
        assert!(ok, "dpkg-deb --contents failed");
        let examples = EXAMPLES.iter().map(|e| format!("{DOC}/examples/{e}"));
        let paths = [BIN, UNIT, POLICY, "usr/share/doc/connguard/copyright"].map(String::from);
        for path in paths.into_iter().chain(examples) {
            assert!(
                listing.lines().any(|l| l.ends_with(&format!("./{path}"))),
                "{path} missing:\n{listing}"
            );
        }
        let (_, conffiles, _) = run("dpkg-deb", &["--info", deb]);
        let postinst = std::fs::read_to_string(out.join(format!(
            "connguard_{}_amd64/DEBIAN/postinst",
            version(&root).unwrap()
        )))
        .unwrap();
        assert!(
            postinst.contains("daemon-reload")
                && !postinst.contains("enable")
                && !postinst.contains("start"),
            "{postinst}"
        );
        assert!(conffiles.contains("conffiles"), "{conffiles}");
        let (_, report, _) = run("lintian", &["--display-info", deb]);
        let _ = std::fs::remove_dir_all(&out);
        let errors: Vec<&str> = report.lines().filter(|l| l.starts_with("E:")).collect();
        assert!(errors.is_empty(), "lintian errors:\n{report}");
        // no-manual-page, and whatever lintian finds wrong in a page or a script.
        let manual: Vec<&str> = report
            .lines()
            .filter(|l| {
                ["manual", "manpage", "whatis", "groff", "completion"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .collect();
        assert!(manual.is_empty(), "lintian on the manual:\n{report}");
    }

    /// The package holds connguard(8), which names every command, and a page for each
    /// command, each rendered by man without a warning; and completion scripts that
    /// their shells read and that complete commands.
    #[test]
    fn the_package_holds_man_pages_for_every_command_and_completions() {
        let (out, deb) = package("manual");
        let files = out.join("files");
        let (ok, _, err) = run(
            "dpkg-deb",
            &["--extract", deb.to_str().unwrap(), files.to_str().unwrap()],
        );
        assert!(ok, "dpkg-deb --extract: {err}");
        let (ok, help, err) = run(files.join(BIN).to_str().unwrap(), &["--help"]);
        assert!(ok, "connguard --help: {err}");
        // The commands as --help lists them (clap's help, not the pages' generator).
        let commands: Vec<&str> = help
            .lines()
            .skip_while(|l| *l != "Commands:")
            .skip(1)
            .take_while(|l| !l.is_empty())
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .collect();
        assert!(commands.len() >= 11, "{help}");
        let mut pages: Vec<String> = std::fs::read_dir(files.join(MAN))
            .unwrap_or_else(|e| panic!("no {MAN} in the package: {e}"))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        pages.sort();
        let mut expected: Vec<String> = commands
            .iter()
            .map(|c| format!("connguard-{c}.8.gz"))
            .chain(["connguard.8.gz".to_string()])
            .collect();
        expected.sort();
        assert_eq!(pages, expected);
        let render = |page: &str| {
            let path = files.join(MAN).join(page);
            let (ok, text, warnings) = run("man", &["--warnings", "-l", path.to_str().unwrap()]);
            assert!(ok && warnings.is_empty(), "man -l {page}: {warnings}");
            // The NAME line as apropos and whatis read it.
            let (ok, whatis, err) = run("lexgrog", &[path.to_str().unwrap()]);
            assert!(ok, "lexgrog {page}: {whatis}{err}");
            (text, whatis)
        };
        let (main, _) = render("connguard.8.gz");
        for command in &commands {
            assert!(main.contains(&format!("connguard-{command}(8)")), "{main}");
            let (text, whatis) = render(&format!("connguard-{command}.8.gz"));
            for heading in ["NAME", "SYNOPSIS", "DESCRIPTION", "EXIT STATUS", "SEE ALSO"] {
                assert!(
                    text.lines().any(|l| l == heading),
                    "connguard-{command}(8) has no {heading}:\n{text}"
                );
            }
            assert!(
                whatis.contains(&format!("\"connguard-{command} - ")),
                "{whatis}"
            );
        }
        let (daemon, _) = render("connguard-run.8.gz");
        for what in [
            "SIGNALS",
            "SIGHUP",
            "SIGTERM",
            "FILES",
            "/run/connguard/connguard.sock",
            "/sys/fs/bpf/connguard",
            "ENVIRONMENT",
            "CONNGUARD_WITHOUT",
        ] {
            assert!(
                daemon.contains(what),
                "connguard-run(8) lacks {what}:\n{daemon}"
            );
        }

        // Each script parses, and completes "connguard st" to exactly its two commands.
        let script = |shell: &str| {
            let (_, path) = COMPLETIONS.iter().find(|(s, _)| *s == shell).unwrap();
            files.join(path).to_str().unwrap().to_string()
        };
        let bash = script("bash");
        let (ok, _, err) = run("bash", &["-n", &bash]);
        assert!(ok, "bash -n: {err}");
        let (ok, words, err) = run(
            "bash",
            &[
                "-c",
                &format!(
                    "source {bash}; COMP_WORDS=(connguard st); COMP_CWORD=1; \
                     _connguard connguard st connguard; printf '%s\\n' \"${{COMPREPLY[@]}}\""
                ),
            ],
        );
        assert!(ok, "bash completion: {err}");
        assert_eq!(words, "stats\nstop\n");
        let (ok, _, err) = run("zsh", &["-n", &script("zsh")]);
        assert!(ok, "zsh -n: {err}");
        let fish = script("fish");
        let (ok, _, err) = run("fish", &["--no-execute", &fish]);
        assert!(ok, "fish --no-execute: {err}");
        let (ok, words, err) = run(
            "fish",
            &["-c", &format!("source {fish}; complete -C 'connguard st'")],
        );
        assert!(ok, "fish completion: {err}");
        let words: Vec<&str> = words.lines().filter_map(|l| l.split('\t').next()).collect();
        assert_eq!(words, ["stats", "stop"]);
        let _ = std::fs::remove_dir_all(&out);
    }
}

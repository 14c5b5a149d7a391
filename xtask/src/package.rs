//! `cargo xtask package`: a Debian package of the release build, staged under
//! target/package and built with dpkg-deb: the binary, the systemd unit (not enabled
//! nor started on install), the embedded default policy as the conffile
//! /etc/connguard/policy.toml, the README, and the Prometheus alert rules and Grafana
//! dashboard as examples.
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
        &gzip(&changelog(&version))?,
        0o644,
    )?;
    let size_kib = std::fs::metadata(tree.join(BIN))?.len() / 1024 + 64;
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

/// `text`, compressed as Debian wants it: gzip -9, no name or time stamp (-n).
fn gzip(text: &str) -> anyhow::Result<Vec<u8>> {
    use std::io::Write;
    let mut child = Command::new("gzip")
        .args(["-9n"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("gzip is missing")?;
    child
        .stdin
        .take()
        .context("gzip stdin")?
        .write_all(text.as_bytes())?;
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
fn version(root: &Path) -> anyhow::Result<String> {
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

    /// The package holds what it should, with the policy as a conffile, maintainer
    /// scripts that only reload systemd (nothing enabled or started on install), and
    /// no lintian error.
    #[test]
    fn the_package_holds_the_binary_unit_and_policy_and_passes_lintian() {
        let root = crate::root();
        let out = std::env::temp_dir().join(format!("connguard-package-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        let deb = build(&root, &out).unwrap();
        let run = |cmd: &str, args: &[&str]| {
            let o = Command::new(cmd)
                .args(args)
                .arg(&deb)
                .output()
                .unwrap_or_else(|e| panic!("{cmd}: {e} (cargo xtask setup installs it)"));
            (
                o.status.success(),
                String::from_utf8_lossy(&o.stdout).into_owned(),
            )
        };
        let (ok, listing) = run("dpkg-deb", &["--contents"]);
        assert!(ok, "dpkg-deb --contents failed");
        let examples = EXAMPLES.iter().map(|e| format!("{DOC}/examples/{e}"));
        let paths = [BIN, UNIT, POLICY, "usr/share/doc/connguard/copyright"].map(String::from);
        for path in paths.into_iter().chain(examples) {
            assert!(
                listing.lines().any(|l| l.ends_with(&format!("./{path}"))),
                "{path} missing:\n{listing}"
            );
        }
        let (_, conffiles) = run("dpkg-deb", &["--info"]);
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
        let lintian = Command::new("lintian")
            .arg(&deb)
            .output()
            .expect("lintian is missing: cargo xtask setup installs it");
        let report = String::from_utf8_lossy(&lintian.stdout);
        let errors: Vec<&str> = report.lines().filter(|l| l.starts_with("E:")).collect();
        let _ = std::fs::remove_dir_all(&out);
        assert!(errors.is_empty(), "lintian errors:\n{report}");
    }
}

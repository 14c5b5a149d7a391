//! `cargo xtask image`: the OCI image the DaemonSet of packaging/kubernetes/ runs, built
//! offline with buildah (no registry, no base image): `FROM scratch` with the release
//! binary, stripped, and the shared libraries `ldd` names for it, at the paths it names
//! them (the dynamic loader's among them). Tagged `localhost/connguard:VERSION` (the
//! name buildah and podman give `connguard:VERSION`, and one containerd's CRI takes as
//! it is) and written as an OCI archive, target/image/connguard_VERSION.oci.tar, which
//! `ctr -n k8s.io images import` and `podman load` read. The build is reproducible
//! (time stamps 0): the same binary makes the same image.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

/// The image's repository; its tag is the crate's version.
pub const REPOSITORY: &str = "localhost/connguard";

/// The Containerfile of the image, built in a context holding the staged `rootfs/`.
const CONTAINERFILE: &str = r#"FROM scratch
COPY rootfs/ /
ENTRYPOINT ["/usr/bin/connguard"]
CMD ["run"]
"#;

/// The image's name: REPOSITORY:VERSION.
pub fn reference(root: &Path) -> anyhow::Result<String> {
    Ok(format!("{REPOSITORY}:{}", crate::package::version(root)?))
}

pub fn run(root: &Path) -> anyhow::Result<PathBuf> {
    let archive = build(root, &root.join("target/image"))?;
    println!("{}", archive.display());
    Ok(archive)
}

/// Stages the image's files in `out`, builds the image with a containers-storage of its
/// own there (removed after) and writes its OCI archive there; the archive's path.
pub fn build(root: &Path, out: &Path) -> anyhow::Result<PathBuf> {
    let reference = reference(root)?;
    let version = crate::package::version(root)?;
    let context = out.join("context");
    if context.exists() {
        std::fs::remove_dir_all(&context)?;
    }
    let rootfs = context.join("rootfs");
    let binary = root.join("target/release/connguard");
    if !binary.exists() {
        bail!("{} is missing: run `cargo xtask build`", binary.display());
    }
    let staged = rootfs.join("usr/bin/connguard");
    copy(&binary, &staged)?;
    // Symbols stay in the build tree, as in the Debian package.
    run_tool(
        Command::new("strip").arg("--strip-unneeded").arg(&staged),
        "strip (package binutils)",
    )?;
    let ldd = run_tool(Command::new("ldd").arg(&binary), "ldd (package libc-bin)")?;
    for library in libraries(&ldd) {
        copy(&library, &rootfs.join(library.strip_prefix("/")?))?;
    }
    std::fs::write(context.join("Containerfile"), CONTAINERFILE)?;

    let storage = out.join("storage");
    let buildah = |args: &[&str]| {
        let mut cmd = Command::new("buildah");
        cmd.args(["--storage-driver", "vfs", "--root"])
            .arg(storage.join("root"))
            .arg("--runroot")
            .arg(storage.join("run"))
            .args(args);
        cmd
    };
    let archive = out.join(format!("connguard_{version}.oci.tar"));
    let _ = std::fs::remove_file(&archive);
    run_tool(
        buildah(&["build", "--quiet", "--format", "oci", "--timestamp", "0"])
            .args(["--tag", &reference, "--file"])
            .arg(context.join("Containerfile"))
            .arg(&context),
        "buildah (cargo xtask setup installs it)",
    )?;
    run_tool(
        buildah(&["push", "--quiet", &reference])
            .arg(format!("oci-archive:{}:{reference}", archive.display())),
        "buildah push",
    )?;
    // What buildah mounted, and the layers it kept: the archive is the product.
    run_tool(&mut buildah(&["rmi", "--all", "--force"]), "buildah rmi")?;
    std::fs::remove_dir_all(&storage)?;
    Ok(archive)
}

/// The absolute paths in `ldd`'s output: each library's, and the dynamic loader's.
fn libraries(ldd: &str) -> Vec<PathBuf> {
    ldd.lines()
        .filter_map(|l| {
            let path = l.split_once("=>").map_or(l, |(_, p)| p);
            path.split_whitespace().next()
        })
        .filter(|p| p.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

/// Copies the file `from` (through its symlinks) to `to`, making its directory.
fn copy(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to.parent().context("no parent")?)?;
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

/// Runs `cmd` (`what` names it when it cannot run); its standard output.
fn run_tool(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_names_the_libraries_and_the_loader() {
        let ldd = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f32)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f31)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f33)\n";
        assert_eq!(
            libraries(ldd),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
    }
}

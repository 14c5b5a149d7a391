//! Installs the toolchain for Rust eBPF (Debian's BPF-capable rustc and its `core`, LLVM 22
//! for bpf-linker) and the test tools, skipping what is
//! already there.
use std::{path::PathBuf, process::Command};

use anyhow::{Context, bail};

/// Debian packages: the BPF-capable rustc and its precompiled `core`, LLVM 22 for
/// bpf-linker, and the tools the tests and the demo drive.
const PACKAGES: &[&str] = &[
    "rustc-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "bpftool",
    "iproute2",
    "nginx-light",
    "wrk",
    "curl",
    "tmux",
    "nftables",
    "systemd",
    "binutils",
    "lintian",
    // man and lexgrog, and the shells whose completion scripts the package test runs.
    "man-db",
    "zsh",
    "fish",
    // promtool, which checks packaging/prometheus/alerts.yml and a scrape of /metrics
    // (Debian has it only in the server's package, whose service starts on :9090).
    "prometheus",
    // protoc and the well-known .proto files, which the build scripts of the etcd, CRI and
    // containerd API clients compile.
    "protobuf-compiler",
    "libprotobuf-dev",
    // A real etcd for the fleet tests and the fleet simulation.
    "etcd-server",
    "etcd-client",
    // The runtimes the workload tests start (nothing starts them here: PID 1 is not
    // systemd), and the static busybox their test image holds.
    "containerd",
    "runc",
    "podman",
    "busybox-static",
    // `cargo xtask image` builds the DaemonSet's image with it, offline.
    "buildah",
    // The virtual environment kubernetes-validate is installed in.
    "python3-venv",
];
const BPF_LINKER_VERSION: &str = "0.13.0";
/// kubernetes-validate, which validates packaging/kubernetes/ against Kubernetes'
/// schemas (it ships them: it reads no network at run time), and what it needs, each
/// pinned (PyPI): installed with --no-deps, so that the environment holds these and no
/// other version.
const KUBERNETES_VALIDATE: &[&str] = &[
    "kubernetes-validate==1.37.0",
    "attrs==26.1.0",
    "importlib_resources==7.1.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "packaging==26.4",
    "PyYAML==6.0.4",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "typing_extensions==4.16.0",
];

pub fn run() -> anyhow::Result<()> {
    install(PACKAGES)?;
    if !bpf_linker_ok() {
        eprintln!("setup: installing bpf-linker {BPF_LINKER_VERSION} (about a minute)");
        // bpf-linker's build script must find LLVM 22, not an older llvm-config.
        let path = format!(
            "/usr/lib/llvm-22/bin:{}",
            std::env::var("PATH").unwrap_or_default()
        );
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("PATH", path)
            .status()?;
        if !status.success() {
            bail!("cargo install bpf-linker failed");
        }
    }
    install_kubernetes_validate()
}

/// The virtual environment of kubernetes-validate, under target/ (its Python has PyYAML,
/// which the manifests' tests read YAML with).
pub fn kubernetes_validate_venv() -> PathBuf {
    crate::root().join("target/kubernetes-validate/venv")
}

/// Installs KUBERNETES_VALIDATE with pip into kubernetes_validate_venv(), a virtual
/// environment of Debian's Python, unless it holds them already (its file `pins` lists
/// what was installed).
fn install_kubernetes_validate() -> anyhow::Result<()> {
    let venv = kubernetes_validate_venv();
    let pins = KUBERNETES_VALIDATE.join("\n");
    if std::fs::read_to_string(venv.join("pins")).is_ok_and(|p| p == pins) {
        return Ok(());
    }
    eprintln!(
        "setup: installing {} into {}",
        KUBERNETES_VALIDATE[0],
        venv.display()
    );
    sh(
        "/usr/bin/python3",
        &["-m", "venv", "--clear", &venv.to_string_lossy()],
    )?;
    let mut args = vec![
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
    ];
    args.extend(KUBERNETES_VALIDATE);
    sh(&venv.join("bin/pip").to_string_lossy(), &args)?;
    std::fs::write(venv.join("pins"), pins)?;
    Ok(())
}

/// Installs the Debian packages of `packages` that are missing (none: nothing is run).
pub fn install(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if !missing.is_empty() {
        require_root(&format!("install {}", missing.join(" ")))?;
        eprintln!("setup: installing {}", missing.join(" "));
        sh("apt-get", &["update", "-q"])?;
        let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
        args.extend(&missing);
        let status = Command::new("apt-get")
            .args(&args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()?;
        if !status.success() {
            bail!("apt-get install {} failed", missing.join(" "));
        }
    }
    Ok(())
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout) == "install ok installed")
}

fn bpf_linker_ok() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION))
}

fn require_root(what: &str) -> anyhow::Result<()> {
    if euid() != 0 {
        bail!("setup needs root to {what}; run it as root (sudo -E cargo xtask setup)");
    }
    Ok(())
}

fn euid() -> u32 {
    // `id -u` keeps xtask free of libc.
    Command::new("id")
        .arg("-u")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(1)
}

fn sh(cmd: &str, args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new(cmd)
        .args(args)
        .status()
        .with_context(|| format!("running {cmd}"))?;
    if !status.success() {
        bail!("{cmd} {} failed: {status}", args.join(" "));
    }
    Ok(())
}

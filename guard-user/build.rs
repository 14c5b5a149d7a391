//! Builds the eBPF object (guard-ebpf) for bpfel-unknown-none with Debian's rustc, which
//! ships a precompiled `core` for that target, and leaves it in
//! OUT_DIR for `include_bytes!`. `cargo xtask setup` installs what this needs.
use std::{env, path::PathBuf, process::Command};

const BPF_RUSTC: &str = "/usr/bin/rustc";

fn main() -> anyhow::Result<()> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let ebpf_dir = manifest.join("../guard-ebpf");
    let common_dir = manifest.join("../guard-common");
    println!("cargo:rerun-if-changed={}", ebpf_dir.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        ebpf_dir.join("Cargo.toml").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        common_dir.join("src").display()
    );

    if !PathBuf::from(BPF_RUSTC).exists() || which("bpf-linker").is_none() {
        anyhow::bail!(
            "building the eBPF programs needs {BPF_RUSTC} (Debian rustc-web with \
             libstd-rust-web-dev-bpf) and bpf-linker on PATH: run `cargo xtask setup`"
        );
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let target_dir = out_dir.join("ebpf-target");
    let mut cmd = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    // The outer build's flags are for the host; none of them may reach the BPF build.
    for (key, _) in env::vars() {
        if (key.starts_with("CARGO_") && key != "CARGO_HOME") || key.starts_with("RUST") {
            cmd.env_remove(&key);
        }
    }
    cmd.current_dir(&ebpf_dir)
        .env("RUSTC", BPF_RUSTC)
        // aya-ebpf needs asm_experimental_arch, guard-ebpf core_intrinsics (atomics).
        .env(
            "RUSTC_BOOTSTRAP",
            "aya_ebpf,guard_ebpf,aya_ebpf_bindings,aya_ebpf_cty",
        )
        .args([
            "build",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "--target-dir",
        ])
        .arg(&target_dir);
    let status = cmd.status()?;
    anyhow::ensure!(status.success(), "building guard-ebpf failed: {status}");
    let object = target_dir.join("bpfel-unknown-none/release/guard-ebpf");
    std::fs::copy(&object, out_dir.join("guard-ebpf"))?;
    Ok(())
}

fn which(name: &str) -> Option<PathBuf> {
    env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.exists())
    })
}

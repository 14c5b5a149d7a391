//! `cargo xtask`: set-up, build, run, test and demo for connguard.
mod bench;
mod demo;
mod image;
#[cfg(test)]
mod kubernetes;
mod package;
mod setup;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "connguard's developer tasks; each one runs `setup` first")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (Debian packages, bpf-linker), skipping
    /// what is there. Idempotent; needs root to install.
    Setup,
    /// Build everything in release mode, the eBPF object included.
    Build,
    /// Build, then run the daemon in the foreground (default: the embedded policy that
    /// observes the whole host). Arguments after `--` go to `connguard run`.
    Run {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build, then run every test: unit tests and the integration tests on the host's
    /// kernel (root and cgroup v2 required), then the integration tests in a qemu guest
    /// on each Debian kernel of the matrix (5.10, 6.1, 6.12, 7), fetched once into
    /// target/vm.
    Test {
        /// Only the integration tests, in guests on these series (5.10, 6.1, 6.12, 7;
        /// comma-separated).
        #[arg(
            long,
            value_name = "SERIES",
            value_delimiter = ',',
            conflicts_with = "no_vm"
        )]
        kernel: Option<Vec<String>>,
        /// Skip the guests (a quick local loop; CI never passes it).
        #[arg(long)]
        no_vm: bool,
        /// Extra arguments for the test binaries (e.g. a test name filter).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Print the kernel table from the last guests' results
    /// (target/vm/run-*/result.json); with --write, put it into docs/kernels.md.
    KernelTable {
        #[arg(long)]
        write: bool,
    },
    /// A short before/after story: wrk with 300 connections against nginx, without and
    /// with a connguard budget of 50; then a retry storm against a failing dependency,
    /// without and with a circuit breaker.
    Demo,
    /// Build, then make a Debian package of the release build in target/package: the
    /// binary, the systemd unit (not enabled on install), /etc/connguard/policy.toml,
    /// the man pages, shell completions and the manual.
    Package,
    /// Build, then make the OCI image of the DaemonSet (packaging/kubernetes/) offline
    /// with buildah: FROM scratch, the stripped binary and its shared libraries, tagged
    /// localhost/connguard:VERSION, written to target/image/connguard_VERSION.oci.tar.
    Image,
    /// Measure connguard's cost side by side with no guard and with nftables, in
    /// interleaved rounds; writes what it measured to target/bench.json, prints the
    /// report with the targets, and puts it into docs/performance.md.
    Bench {
        /// One round per mode and smaller tables instead of five rounds per mode; its
        /// report goes into docs/performance.md only with --write.
        #[arg(long)]
        quick: bool,
        /// Put a --quick run's report into docs/performance.md too.
        #[arg(long)]
        write: bool,
        /// Render the last run's target/bench.json instead of measuring.
        #[arg(long)]
        render: bool,
        /// Measure only the fleet chaos (5 minutes; --quick: 30 s), into the last run's
        /// target/bench.json, and render that.
        #[arg(long)]
        fleet_chaos: bool,
        /// Measure only the scaling points (rules, destinations, cgroups), into the last
        /// run's target/bench.json, and render that.
        #[arg(long, conflicts_with = "fleet_chaos")]
        scaling: bool,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::run(),
        Task::Build => build(),
        Task::Package => {
            build()?;
            package::run(&root()).map(|_| ())
        }
        Task::Image => {
            build()?;
            image::run(&root()).map(|_| ())
        }
        Task::Run { args } => {
            build()?;
            let status = Command::new(root().join("target/release/connguard"))
                .arg("run")
                .args(args)
                .status()?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Task::Test {
            kernel: None,
            no_vm,
            args,
        } => {
            timed("setup and build", build_tests)?;
            timed("host tests", || {
                cargo(
                    &["test", "--release", "--workspace", "--", "--test-threads=1"],
                    &args,
                )
            })?;
            if no_vm {
                return Ok(());
            }
            let tests = integration_tests()?;
            timed("guests", || {
                vm::run(&root(), &vm::series_names(), &tests, &args)
            })?;
            println!("{}", vm::kernel_table(&root())?);
            Ok(())
        }
        Task::Test {
            kernel: Some(series),
            args,
            ..
        } => {
            build_tests()?;
            let series: Vec<&str> = series.iter().map(String::as_str).collect();
            vm::run(&root(), &series, &integration_tests()?, &args)
        }
        Task::KernelTable { write } => {
            let table = vm::kernel_table(&root())?;
            if write {
                write_kernel_table(&table)?;
            } else {
                print!("{table}");
            }
            Ok(())
        }
        Task::Bench {
            quick,
            write,
            render,
            fleet_chaos,
            scaling,
        } => {
            if !render {
                build()?;
            }
            bench::run(&bench::Options {
                quick,
                write,
                render,
                fleet_chaos,
                scaling,
            })
        }
        Task::Demo => {
            build()?;
            demo::run(&root().join("target/release/connguard"))
        }
    }
}

/// Replaces the text between docs/kernels.md's kernel-table markers with `table`.
fn write_kernel_table(table: &str) -> anyhow::Result<()> {
    write_between_markers(
        "docs/kernels.md",
        "<!-- kernel-table: written by `cargo xtask kernel-table --write` -->\n",
        "<!-- kernel-table end -->",
        table,
    )
}

/// Replaces the text between the markers `begin` and `end` of the page `page` (a path
/// from the workspace root) with `text`.
fn write_between_markers(page: &str, begin: &str, end: &str, text: &str) -> anyhow::Result<()> {
    let path = root().join(page);
    let page_text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let (Some(b), Some(e)) = (page_text.find(begin), page_text.find(end)) else {
        bail!("{page} has no markers {begin:?} and {end:?}");
    };
    anyhow::ensure!(b < e, "{page}: {end:?} comes before {begin:?}");
    let page_text = format!("{}{text}{}", &page_text[..b + begin.len()], &page_text[e..]);
    std::fs::write(&path, page_text)?;
    Ok(())
}

fn build() -> anyhow::Result<()> {
    setup::run()?;
    cargo(&["build", "--release", "--workspace", "--bins"], &[])
}

/// Sets up and builds what `cargo test --release --workspace` runs, the binaries
/// included, with the features the tests unify (the dev-dependencies'): a build with
/// `build`'s features first would build most dependencies twice.
fn build_tests() -> anyhow::Result<()> {
    setup::run()?;
    cargo(&["test", "--release", "--workspace", "--no-run"], &[])
}

fn cargo(args: &[&str], extra: &[String]) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(root())
        .args(args)
        .args(extra)
        .status()
        .context("running cargo")?;
    if !status.success() {
        bail!("cargo {} failed: {status}", args.join(" "));
    }
    Ok(())
}

/// Runs `phase`, then prints how long it took (CI's budget is spent by phase).
fn timed<T>(name: &str, phase: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let started = std::time::Instant::now();
    let result = phase();
    eprintln!("xtask: {name}: {} s", started.elapsed().as_secs());
    result
}

/// The integration test binaries (tests/tests/*.rs), built as the workspace's tests are:
/// with its features unified (guard-user's tests turn on the tests crate's `runtimes`),
/// so that the host run's binaries are reused, not built again without them.
fn integration_tests() -> anyhow::Result<Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tests_dir = root().join("tests/tests").canonicalize()?;
    let out = Command::new(cargo)
        .current_dir(root())
        .args(["test", "--release", "--workspace", "--tests", "--no-run"])
        .args(["--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("building the integration tests")?;
    if !out.status.success() {
        bail!("building the integration tests failed");
    }
    let mut tests = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let is_test = msg["target"]["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|k| k == "test"));
        let in_tests = msg["target"]["src_path"]
            .as_str()
            .is_some_and(|p| Path::new(p).starts_with(&tests_dir));
        if let (true, true, Some(exe)) = (is_test, in_tests, msg["executable"].as_str()) {
            tests.push(exe.to_string());
        }
    }
    tests.sort();
    Ok(tests)
}

/// The workspace root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

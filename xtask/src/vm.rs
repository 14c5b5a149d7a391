//! The integration tests inside qemu guests booted on Debian's kernels.
//!
//! A kernel series is fetched once from Debian's mirrors with a private apt setup (its
//! own sources, lists and cache under target/vm/apt; the host's sources are left
//! alone) and unpacked under target/vm/kernels/SERIES. The guest boots the kernel's
//! uncompressed vmlinux through its PVH entry under TCG (KVM does not work on these
//! machines), with an initramfs of busybox and the kernel's virtio, 9p and overlay
//! modules. Its /init mounts the host's root read-only over 9p with a tmpfs overlay,
//! mounts cgroup2, bpffs, tracefs and debugfs, brings loopback up, runs the host's own
//! test binaries (same paths, same libraries) and writes their output and exit status
//! to a virtio serial port backed by a host file.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail, ensure};
use connguard_api::kernel::Features;
use connguard_tests::{CHURN_SECONDS_VAR, WHOLE_HOST_CGROUPS_VAR};
use serde::{Deserialize, Serialize};

/// The restart churn test's length in the guests, in seconds.
const GUEST_CHURN_SECONDS: u32 = 60;
/// How many cgroups the whole-host policy test makes in the guests.
const GUEST_WHOLE_HOST_CGROUPS: u32 = 2_000;
/// What the guests need on the host.
const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "cpio",
    "xz-utils",
    "zstd",
];

/// The longest a guest may run (timeout(1) syntax): well above a whole suite's time
/// under TCG (docs/kernels.md), so that only a hung guest meets it.
const GUEST_TIMEOUT: &str = "45m";

/// Debian's suites that carry the kernels, all on deb.debian.org.
const SOURCES: &[(&str, &str)] = &[
    ("debian", "bullseye"),
    ("debian-security", "bullseye-security"),
    ("debian", "bookworm"),
    ("debian-security", "bookworm-security"),
    ("debian", "trixie"),
    ("debian-security", "trixie-security"),
    ("debian", "sid"),
];

/// A kernel series and the packages that hold its image and its modules: the newest
/// package whose name starts with each prefix and ends in "-amd64" (the generic flavour:
/// the cloud kernels have no 9p) or "-amd64-unsigned".
struct Series {
    name: &'static str,
    prefixes: &'static [&'static str],
    /// The features `connguard kernel` must find absent there (every other one present):
    /// a probe that changes its answer on a known kernel fails the run.
    absent: &'static [&'static str],
    /// Whether the daemon runs there (none of its required features is absent); the
    /// guest's `connguard kernel` must agree, or the run fails.
    daemon: bool,
}

const SERIES: &[Series] = &[
    Series {
        name: "5.10",
        prefixes: &["linux-image-5.10."],
        absent: &[
            "atomic_fetch",
            "bound_inactive_diag",
            "cgroup_storage",
            "set_retval",
            "so_netns_cookie",
            "tcx",
        ],
        daemon: false,
    },
    Series {
        name: "6.1",
        prefixes: &["linux-image-6.1."],
        absent: &["bound_inactive_diag", "cgroup_storage", "tcx"],
        daemon: true,
    },
    Series {
        name: "6.12",
        prefixes: &["linux-image-6.12."],
        absent: &[],
        daemon: true,
    },
    // sid splits the kernel into the image and its modules.
    Series {
        name: "7",
        prefixes: &["linux-binary-7.", "linux-modules-7."],
        absent: &[],
        daemon: true,
    },
];

/// The integration tests that need no daemon: what runs on a kernel where the daemon
/// cannot run (`connguard kernel` exits 1 there), where its refusal (and nothing
/// attached) is tested too. Each must pass there by name, so a renamed test cannot drop
/// out unseen.
const DAEMONLESS: &[&str] = &[
    "kernel_reports_every_feature_and_honours_without",
    "without_atomic_fetch_the_daemon_refuses_to_start_and_attaches_nothing",
    "without_the_guard_clients_past_the_queue_wait_over_a_second",
    "check_rejects_bad_files_with_line_and_column",
    "run_without_root_says_so",
    "exhausted_destination_is_named_with_exact_counts",
    "bind_before_connect_pool_is_reported_per_source_address",
    "top_shows_the_exhausted_destination_in_a_terminal_and_quits_on_q",
];

/// The integration tests that never run in the guests, even when named: their subject
/// is the daemon's user space (the control socket, the unit file and readiness, the
/// metric names the packaging uses, a drill's validation), which takes the same path on
/// every kernel, and the host runs them whole. Each must be a test of tests/tests (a
/// unit test checks), so that a renamed one cannot linger here.
const HOST_ONLY: &[&str] = &[
    "stalled_and_flooding_clients_delay_nobody",
    "concurrent_stats_clients_each_get_a_whole_document",
    "control_socket_is_private_and_never_replaces_a_file",
    "the_unit_passes_systemd_analyze_verify",
    "readiness_is_sent_once_the_policy_is_applied",
    "shipped_alerts_and_dashboard_use_the_exported_metrics",
    "bad_drills_are_refused",
];

/// What one guest found and ran, kept in target/vm/run-SERIES/result.json for the
/// kernel table of docs/kernels.md.
#[derive(Debug, Serialize, Deserialize)]
pub struct Outcome {
    pub series: String,
    pub release: String,
    /// `connguard kernel --json`'s features, and those the daemon requires.
    pub features: BTreeMap<String, bool>,
    pub required: Vec<String>,
    pub passed: Vec<String>,
    pub failed: Vec<String>,
    /// Boot to power-off, s.
    pub seconds: u64,
}

impl Outcome {
    /// The required features missing: the daemon runs when there are none.
    pub fn missing(&self) -> Vec<&str> {
        self.required
            .iter()
            .filter(|f| self.features.get(*f) != Some(&true))
            .map(String::as_str)
            .collect()
    }
}

/// Modules the guest loads at boot, with their dependencies: the host root over 9p,
/// the result port, the overlay, and what the tests use (veth pairs, clsact and tc BPF
/// filters on kernels without tcx, sock_diag for TCP, nftables' numgen for a dropped
/// SYN).
const MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "virtio_console",
    "overlay",
    "veth",
    "sch_ingress",
    "cls_bpf",
    "inet_diag",
    "tcp_diag",
    "nft_numgen",
];

/// The kernel series names, for `--kernel`.
pub fn series_names() -> Vec<&'static str> {
    SERIES.iter().map(|s| s.name).collect()
}

/// The integration test binaries (by name, tests/tests/NAME.rs) whose paths depend on a
/// probed feature (tcx for the listener guard's attachment, bound_inactive_diag for the
/// ports report, the probes themselves): each runs on every set of features the guests
/// have. Every other binary takes the same paths wherever the daemon runs.
const FEATURE_PATHS: &[&str] = &["kernel", "listeners", "listeners_per_source", "ports"];

/// Runs the integration test `binaries` (with `args`) in a guest booted on the newest
/// kernel of each of `series`, one after another (see `shares`), and fails naming each
/// kernel where a test failed, a probe answered otherwise than `absent` says, or the
/// guest gave no result. Each guest has 2 vCPUs (with 1, tests timed for 2 miss their
/// deadlines), which take turns on one host thread (`boot`). One guest at a time: two on
/// a 2-core machine each lose their host CPU at times, and the tests whose subject is
/// time (rates, breakers' open windows) then see the kernel's clock run on while the
/// guest stands still.
pub fn run(
    root: &Path,
    series: &[&str],
    binaries: &[String],
    args: &[String],
) -> anyhow::Result<()> {
    crate::setup::install(PACKAGES)?;
    let mut failed = Vec::new();
    let mut known = Vec::new();
    for name in series {
        match SERIES.iter().find(|s| s.name == *name) {
            Some(s) => known.push(s),
            None => bail!("no kernel series {name}; known: {:?}", series_names()),
        }
    }
    ensure!(
        FEATURE_PATHS
            .iter()
            .all(|f| binaries.iter().any(|b| binary_name(b) == *f)),
        "a binary of FEATURE_PATHS {FEATURE_PATHS:?} is not among the integration tests"
    );
    for (series, share) in shares(&known, binaries) {
        if let Err(e) = prepare(root, series, &share, args).and_then(|g| g.run(args)) {
            eprintln!("{e:#}");
            failed.push(series.name);
        }
    }
    ensure!(
        failed.is_empty(),
        "the integration tests failed in the guests on {failed:?} (see above)"
    );
    Ok(())
}

/// Which binaries each guest runs, so that the matrix fits CI's time (a whole suite
/// under TCG takes many times the host's, and the host runs it whole on its own kernel):
/// - where the daemon cannot run, every binary (its DAEMONLESS tests run by name);
/// - each FEATURE_PATHS binary on one guest of each set of features (`absent`), in turn
///   among the guests that share the set;
/// - every other binary on one guest where the daemon runs, in turn among them all.
fn shares<'a>(series: &[&'a Series], binaries: &[String]) -> Vec<(&'a Series, Vec<String>)> {
    let capable: Vec<&Series> = series.iter().copied().filter(|s| s.daemon).collect();
    let mut shares: Vec<(&Series, Vec<String>)> = series.iter().map(|s| (*s, Vec::new())).collect();
    let mut give = |to: &Series, binary: &String| {
        if let Some((_, share)) = shares.iter_mut().find(|(s, _)| s.name == to.name) {
            share.push(binary.clone());
        }
    };
    for s in series.iter().filter(|s| !s.daemon) {
        binaries.iter().for_each(|b| give(s, b));
    }
    let (paths, others): (Vec<&String>, Vec<&String>) = binaries
        .iter()
        .partition(|b| FEATURE_PATHS.contains(&binary_name(b)));
    let mut sets: Vec<&[&str]> = Vec::new();
    for s in &capable {
        if !sets.contains(&s.absent) {
            sets.push(s.absent);
        }
    }
    for set in sets {
        let alike: Vec<&&Series> = capable.iter().filter(|s| s.absent == set).collect();
        for (i, b) in paths.iter().enumerate() {
            give(alike[i % alike.len()], b);
        }
    }
    // None where no guest runs the daemon (`--kernel 5.10`).
    for (b, to) in others.iter().zip(capable.iter().cycle()) {
        give(to, b);
    }
    shares
}

/// The name of a test binary (`target/release/deps/NAME-HASH`): its tests/tests/NAME.rs.
fn binary_name(path: &str) -> &str {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.rsplit_once('-').map_or(file, |(name, _)| name)
}

/// A guest ready to boot: its kernel unpacked, its initramfs and script written.
struct Guest {
    series: &'static Series,
    release: String,
    vmlinux: PathBuf,
    initrd: PathBuf,
    /// target/vm/run-SERIES: the script, the output, the console and result.json.
    work: PathBuf,
    /// How many test binaries the script runs.
    binaries: usize,
}

/// Fetches the newest kernel of `series` (the first time) and writes the guest's
/// initramfs and the script that runs `binaries` with `args` there.
fn prepare(
    root: &Path,
    series: &'static Series,
    binaries: &[String],
    args: &[String],
) -> anyhow::Result<Guest> {
    let vm = root.join("target/vm");
    let kernel = fetch(&vm, series)?;
    let release = kernel_release(&kernel)?;
    let vmlinux = vmlinux(&kernel, &release)?;
    let initrd = initramfs(&vm, &kernel, &release)?;
    let work = vm.join(format!("run-{}", series.name));
    std::fs::create_dir_all(&work)?;
    // The guest asks `connguard kernel` whether the daemon can run there; if so, every
    // test (or what `args` name) but HOST_ONLY runs, else only DAEMONLESS (or what
    // `args` name). A skip matches a part of a name: no other test's name holds one of
    // HOST_ONLY (a unit test checks).
    let skips = HOST_ONLY
        .iter()
        .fold(String::new(), |f, t| f + " --skip " + t);
    let (capable, below) = if args.is_empty() {
        (skips, format!("--exact {}", DAEMONLESS.join(" ")))
    } else {
        (args.join(" ") + &skips, args.join(" "))
    };
    // The restart churn runs 2 minutes on the host and 1 in each guest, the whole-host
    // policy 50,000 cgroups on the host and 2,000 in each guest: the same kernel paths,
    // in less of a guest's time.
    let connguard = root.join("target/release/connguard");
    let mut text = format!(
        "cd {}\nK=$({} kernel --json) && FILTER='{capable}' || {{ FILTER='{below}'; echo BELOW_MINIMUM; }}\n\
         echo \"FEATURES $K\"\nstatus=0\nexport {CHURN_SECONDS_VAR}={GUEST_CHURN_SECONDS} \
         {WHOLE_HOST_CGROUPS_VAR}={GUEST_WHOLE_HOST_CGROUPS}\n",
        root.display(),
        connguard.display(),
    );
    for b in binaries {
        let run = format!("{b} --test-threads=1 $FILTER");
        text += &format!("echo '=== {run}'\n{run} || status=1\n");
    }
    text += "exit $status\n";
    std::fs::write(work.join("cmd.sh"), text)?;
    Ok(Guest {
        series,
        release,
        vmlinux,
        initrd,
        work,
        binaries: binaries.len(),
    })
}

impl Guest {
    /// Boots the guest, prints its output when it ends, writes result.json and checks
    /// the outcome.
    fn run(&self, args: &[String]) -> anyhow::Result<()> {
        let Guest {
            series,
            release,
            vmlinux,
            initrd,
            work,
            binaries,
        } = self;
        let script = work.join("cmd.sh");
        let out = work.join("out.log");
        let _ = std::fs::remove_file(&out);
        eprintln!("vm: booting {release} (TCG) for {binaries} test binaries");
        let started = std::time::Instant::now();
        let status = boot(vmlinux, initrd, &script, &out, work)?;
        let output = std::fs::read_to_string(&out).unwrap_or_default();
        print!("vm: {release}: the guest's output\n{output}");
        let seconds = started.elapsed().as_secs();
        let console = work.join("console.log");
        let Some(exit) = output
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("EXIT "))
            .and_then(|c| c.trim().parse::<i32>().ok())
        else {
            bail!(
                "vm: {release}: the guest ended without a result (qemu {status}, {seconds} s); \
             the console, from its first crash (or its last lines):\n{}",
                crash_lines(&std::fs::read_to_string(&console).unwrap_or_default())
            );
        };
        let kernel: Features = output
        .lines()
        .find_map(|l| l.strip_prefix("FEATURES "))
        .and_then(|j| serde_json::from_str(j).ok())
        .with_context(|| {
            let head: Vec<&str> = output.lines().take(10).collect();
            format!(
                "vm: {release}: `connguard kernel --json` printed no features; the guest's output began:\n{}",
                head.join("\n")
            )
        })?;
        let below_minimum = output.lines().any(|l| l == "BELOW_MINIMUM");
        let (passed, failed) = results(&output);
        let outcome = Outcome {
            series: series.name.to_string(),
            release: release.clone(),
            features: kernel.features,
            required: kernel.required,
            passed,
            failed,
            seconds,
        };
        std::fs::write(
            work.join("result.json"),
            serde_json::to_string_pretty(&outcome)?,
        )?;
        let wrong: Vec<String> = outcome
            .features
            .iter()
            .filter(|(name, present)| **present == series.absent.contains(&name.as_str()))
            .map(|(name, present)| {
                format!("{name} {}", if *present { "present" } else { "absent" })
            })
            .collect();
        ensure!(
            wrong.is_empty(),
            "vm: {release}: the probes found {} (expected absent: {:?})",
            wrong.join(", "),
            series.absent
        );
        ensure!(
            below_minimum != series.daemon,
            "vm: {release}: the daemon {} there, against the series' table",
            if below_minimum { "cannot run" } else { "runs" }
        );
        ensure!(
            below_minimum != outcome.missing().is_empty(),
            "vm: {release}: `connguard kernel` exited {} with the required features {:?} missing",
            if below_minimum { 1 } else { 0 },
            outcome.missing()
        );
        if below_minimum && args.is_empty() {
            let missing: Vec<&&str> = DAEMONLESS
                .iter()
                .filter(|t| !outcome.passed.iter().any(|p| p == **t))
                .collect();
            ensure!(
                missing.is_empty(),
                "vm: {release}: these tests did not pass: {missing:?}"
            );
        }
        ensure!(
            exit == 0 && outcome.failed.is_empty(),
            "vm: {release}: {} test(s) failed ({}), exit {exit}, {seconds} s; output above, console in {}",
            outcome.failed.len(),
            outcome.failed.join(", "),
            console.display()
        );
        eprintln!(
            "vm: {release}: {} tests passed ({seconds} s, boot included)",
            outcome.passed.len()
        );
        Ok(())
    }
}

/// The tests that passed and failed, from libtest's output: "test NAME ... ok" (or
/// "ok <1.2s>" with --report-time) for a pass; for a failure, the names it lists under
/// "failures:" at the end of each binary's run, as a test's own output can come between
/// its name and FAILED.
fn results(output: &str) -> (Vec<String>, Vec<String>) {
    let (mut passed, mut failed) = (Vec::new(), Vec::new());
    let mut listing = false;
    for l in output.lines() {
        if let Some((name, result)) = l.strip_prefix("test ").and_then(|r| r.split_once(" ... "))
            && result.split(' ').next() == Some("ok")
        {
            passed.push(name.to_string());
        }
        if l == "failures:" {
            listing = true;
        } else if l.starts_with("test result:") {
            listing = false;
        } else if let Some(name) = l.strip_prefix("    ").filter(|_| listing)
            && !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == ':')
        {
            failed.push(name.to_string());
        }
    }
    failed.sort();
    failed.dedup();
    (passed, failed)
}

/// How many console lines a guest's end shows.
const CRASH_LINES: usize = 40;

/// The console from the first line of the kernel's first crash report (an Oops, a BUG
/// or a panic), CRASH_LINES of it; the last CRASH_LINES where it has none.
fn crash_lines(console: &str) -> String {
    let lines: Vec<&str> = console.lines().collect();
    let first = lines.iter().position(|l| {
        [
            "] Oops: ",
            "] BUG: ",
            "] Kernel panic",
            "] general protection fault",
        ]
        .iter()
        .any(|m| l.contains(m))
    });
    let from = first.unwrap_or(lines.len().saturating_sub(CRASH_LINES));
    lines[from..lines.len().min(from + CRASH_LINES)].join("\n")
}

/// Boots the guest on `vmlinux` and `initrd`, with 2 vCPUs, to run `script`; its
/// output goes to `out`, the console to work/console.log. A guest that hangs is ended
/// after GUEST_TIMEOUT. The vCPUs take turns on one host thread (`thread=single`): under
/// multi-threaded TCG a vCPU sometimes executes the int3 of a kernel text patch after
/// the patch is done, and the kernel dies (docs/kernels.md).
fn boot(
    vmlinux: &Path,
    initrd: &Path,
    script: &Path,
    out: &Path,
    work: &Path,
) -> anyhow::Result<std::process::ExitStatus> {
    Command::new("timeout")
        .arg(GUEST_TIMEOUT)
        .arg("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg,thread=single",
            "-cpu",
            "max",
            "-M",
            "q35",
            "-m",
            "2G",
            "-smp",
            "2",
        ])
        .args(["-nographic", "-no-reboot", "-kernel"])
        .arg(vmlinux)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 quiet panic=-1 vmcmd={}",
            script.display()
        ))
        .args([
            "-fsdev",
            "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device",
            "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            "-device",
            "virtio-serial-pci",
            "-chardev",
        ])
        .arg(format!("file,id=out,path={}", out.display()))
        .args(["-device", "virtserialport,chardev=out,name=out"])
        .stdout(std::fs::File::create(work.join("console.log"))?)
        .stderr(std::process::Stdio::inherit())
        .status()
        .context("running qemu-system-x86_64")
}

/// The unpacked kernel of `series` under target/vm/kernels, fetched the first time.
fn fetch(vm: &Path, series: &Series) -> anyhow::Result<PathBuf> {
    let dir = vm.join("kernels").join(series.name);
    if dir.join("lib/modules").is_dir() {
        return Ok(dir);
    }
    let apt = vm.join("apt");
    for d in [
        "lists/partial",
        "cache/archives/partial",
        "etc/preferences.d",
    ] {
        std::fs::create_dir_all(apt.join(d))?;
    }
    let sources: String = SOURCES
        .iter()
        .map(|(archive, suite)| {
            format!(
                "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/{archive} {suite} main\n"
            )
        })
        .collect();
    std::fs::write(apt.join("etc/sources.list"), sources)?;
    let opts = apt_options(&apt);
    // Fresh lists for every kernel fetched (once per series): Debian drops old versions.
    eprintln!(
        "vm: reading Debian's package lists for kernel {}",
        series.name
    );
    run_ok(Command::new("apt-get").args(&opts).args(["update", "-q"]))?;
    let listed = output(
        Command::new("apt-cache")
            .args(&opts)
            .args(["pkgnames", "linux-"]),
    )?;
    let download = vm.join("kernels").join(format!("{}.debs", series.name));
    let _ = std::fs::remove_dir_all(&download);
    std::fs::create_dir_all(&download)?;
    let tmp = vm.join("kernels").join(format!("{}.partial", series.name));
    let _ = std::fs::remove_dir_all(&tmp);
    for prefix in series.prefixes {
        let package = newest(&listed, prefix)
            .with_context(|| format!("no package {prefix}*-amd64 in Debian's lists"))?;
        eprintln!("vm: fetching {package}");
        run_ok(
            Command::new("apt-get")
                .current_dir(&download)
                .args(&opts)
                .args(["download", "-q", &package]),
        )?;
        let deb = std::fs::read_dir(&download)?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}_")))
            })
            .with_context(|| format!("{package} was not downloaded"))?;
        run_ok(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tmp))?;
    }
    // Kernels of merged-/usr suites keep their modules in usr/lib/modules; depmod and
    // modprobe look in lib/modules.
    if !tmp.join("lib").exists() && tmp.join("usr/lib/modules").is_dir() {
        std::os::unix::fs::symlink("usr/lib", tmp.join("lib"))?;
    }
    std::fs::rename(&tmp, &dir)?;
    let _ = std::fs::remove_dir_all(&download);
    Ok(dir)
}

/// The newest package of `names` (one a line) that starts with `prefix` and is the
/// generic amd64 flavour, by Debian's version order of the rest of the name.
fn newest(names: &str, prefix: &str) -> Option<String> {
    let mut found: Vec<&str> = names
        .lines()
        .filter(|n| n.starts_with(prefix))
        .filter(|n| n.ends_with("-amd64") || n.ends_with("-amd64-unsigned"))
        .filter(|n| !n.contains("cloud") && !n.contains("-rt-") && !n.contains("dbg"))
        .collect();
    // Every name shares the prefix: its numbers in order are the version.
    let key = |n: &str| -> Vec<u64> {
        n.split(|c: char| !c.is_ascii_digit())
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    found.sort_by_key(|n| key(n));
    found.last().map(|n| n.to_string())
}

fn apt_options(apt: &Path) -> Vec<String> {
    let d = |p: &str| apt.join(p).display().to_string();
    [
        format!("Dir::Etc::sourcelist={}", d("etc/sources.list")),
        "Dir::Etc::sourceparts=-".into(),
        format!("Dir::Etc::preferencesparts={}", d("etc/preferences.d")),
        format!("Dir::State::Lists={}", d("lists")),
        format!("Dir::Cache={}", d("cache")),
        "APT::Architecture=amd64".into(),
        "Acquire::Languages=none".into(),
        // apt's _apt user cannot write into target/.
        "APT::Sandbox::User=root".into(),
    ]
    .into_iter()
    .flat_map(|o| ["-o".to_string(), o])
    .collect()
}

/// The release name of the unpacked kernel (its directory under lib/modules).
fn kernel_release(kernel: &Path) -> anyhow::Result<String> {
    let modules = kernel.join("lib/modules");
    std::fs::read_dir(&modules)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .with_context(|| format!("no kernel release under {}", modules.display()))
}

/// The uncompressed vmlinux of the kernel, taken out of its vmlinuz once: the compressed
/// payload starts at its format's magic (xz or zstd) and decompresses from there; the
/// bytes after it are not the decompressor's concern.
fn vmlinux(kernel: &Path, release: &str) -> anyhow::Result<PathBuf> {
    let out = kernel.join("vmlinux");
    if out.exists() {
        return Ok(out);
    }
    // boot/ in the linux-image packages; beside the modules in sid's linux-binary.
    let vmlinuz = [
        format!("boot/vmlinuz-{release}"),
        format!("lib/modules/{release}/vmlinuz"),
    ]
    .iter()
    .find_map(|p| std::fs::read(kernel.join(p)).ok())
    .with_context(|| format!("no vmlinuz of {release} in {}", kernel.display()))?;
    for (magic, tool) in [
        (&b"\xfd7zXZ\x00"[..], "xz"),
        (&b"\x28\xb5\x2f\xfd"[..], "zstd"),
    ] {
        let Some(at) = vmlinuz.windows(magic.len()).position(|w| w == magic) else {
            continue;
        };
        let mut child = Command::new(tool)
            .args(["-dc"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let mut stdin = child.stdin.take().expect("piped");
        let payload = vmlinuz[at..].to_vec();
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            let _ = stdin.write_all(&payload);
        });
        let decompressed = child.wait_with_output()?.stdout;
        let _ = writer.join();
        if decompressed.starts_with(b"\x7fELF") {
            // Renamed into place: an interrupted write leaves no short vmlinux behind.
            let partial = out.with_extension("partial");
            std::fs::write(&partial, decompressed)?;
            std::fs::rename(&partial, &out)?;
            return Ok(out);
        }
    }
    bail!("no xz or zstd payload that decompresses to an ELF vmlinux in vmlinuz-{release}")
}

/// The guest's initramfs (gzip'd cpio): busybox, MODULES with their dependencies in load
/// order (decompressed: busybox insmod reads plain .ko), and /init.
fn initramfs(vm: &Path, kernel: &Path, release: &str) -> anyhow::Result<PathBuf> {
    // Built on every run, which is cheap: it carries INIT, which may have changed.
    let out = kernel.join("initramfs.gz");
    run_ok(Command::new("depmod").arg("-b").arg(kernel).arg(release))?;
    let mut order = Vec::new();
    for m in MODULES {
        let shown = Command::new("modprobe")
            .arg("-d")
            .arg(kernel)
            .args(["-S", release, "--show-depends", m])
            .output()?;
        // Not a module of this kernel: built in (sid's packages list no modules.builtin
        // for modprobe to say so), or missing, and then the guest ends without a result
        // (no 9p root) or the tests fail.
        if !shown.status.success() {
            continue;
        }
        let deps = String::from_utf8_lossy(&shown.stdout);
        for path in deps.lines().filter_map(|l| l.strip_prefix("insmod ")) {
            let path = path.trim().to_string();
            if !order.contains(&path) {
                order.push(path);
            }
        }
    }
    let tree = vm.join("initramfs").join(release);
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(tree.join("bin"))?;
    std::fs::create_dir_all(tree.join("mods"))?;
    std::fs::copy("/bin/busybox", tree.join("bin/busybox")).context("copying busybox")?;
    let mut list = String::new();
    for (i, path) in order.iter().enumerate() {
        let name = Path::new(path)
            .file_name()
            .context("module path")?
            .to_string_lossy()
            .into_owned();
        let plain = name
            .trim_end_matches(".xz")
            .trim_end_matches(".zst")
            .to_string();
        let dest = tree.join("mods").join(format!("{i:02}-{plain}"));
        if name.ends_with(".xz") || name.ends_with(".zst") {
            let tool = if name.ends_with(".xz") { "xz" } else { "zstd" };
            let data = Command::new(tool).arg("-dc").arg(path).output()?;
            ensure!(data.status.success(), "{tool} -dc {path} failed");
            std::fs::write(&dest, data.stdout)?;
        } else {
            std::fs::copy(path, &dest)?;
        }
        list += &format!("/mods/{i:02}-{plain}\n");
    }
    std::fs::write(tree.join("mods/order"), list)?;
    std::fs::write(tree.join("init"), INIT)?;
    run_ok(Command::new("chmod").arg("+x").arg(tree.join("init")))?;
    run_ok(Command::new("sh").current_dir(&tree).arg("-c").arg(format!(
        "find . | cpio -o -H newc --quiet | gzip -1 > {}",
        out.display()
    )))?;
    Ok(out)
}

/// The guest's /init: host root over 9p under a tmpfs overlay, the file systems the
/// tests need (devpts for tmux; a fresh /run, so that the host's /run/netns files are
/// not there; /tmp stays the overlay's, since a checkout may live under it), then the
/// command file named on the kernel command line (`vmcmd=`), its output and `EXIT
/// status` to the port named "out", and power off.
const INIT: &str = r#"#!/bin/busybox sh
B=/bin/busybox
$B mkdir -p /proc /sys /dev /lower /upper /newroot
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
for m in $($B cat /mods/order); do $B insmod $m || echo "insmod $m failed"; done
$B mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 hostroot /lower
$B mount -t tmpfs -o size=4G tmpfs /upper
$B mkdir -p /upper/up /upper/work
$B mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/up,workdir=/upper/work /newroot
for d in proc sys dev; do $B mount --move /$d /newroot/$d; done
PORT=/dev/null
for p in /newroot/sys/class/virtio-ports/*; do
  [ "$($B cat $p/name)" = out ] && PORT=/dev/$($B basename $p)
done
CMD=$($B sed -n 's/.*vmcmd=\([^ ]*\).*/\1/p' /newroot/proc/cmdline)
exec $B chroot /newroot /bin/sh -c "
mount -t tmpfs tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug
mkdir -p /dev/pts
mount -t devpts devpts /dev/pts
ip link set lo up
sh $CMD > $PORT 2>&1
echo EXIT \$? > $PORT
/bin/busybox reboot -f"
"#;

fn run_ok(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    ensure!(status.success(), "{cmd:?} failed: {status}");
    Ok(())
}

fn output(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The kernel table of docs/kernels.md, from each guest's result.json (run by
/// `cargo xtask test`), in SERIES order; a series never run is left out.
pub fn kernel_table(root: &Path) -> anyhow::Result<String> {
    let mut rows = String::from(
        "| kernel | tests passed | time | daemon | shed connect() errno | listener guard | \
         port watermark | bound-only sockets in `ports` | map reads | later: cgroup storage |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut any = false;
    for series in SERIES {
        let path = root.join(format!("target/vm/run-{}/result.json", series.name));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let o: Outcome =
            serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
        any = true;
        let has = |f: &str| o.features.get(f) == Some(&true);
        let missing = o.missing();
        let runs = missing.is_empty();
        let daemon_only = |text: &str| {
            if runs {
                text.to_string()
            } else {
                "—".to_string()
            }
        };
        let yes = |f: &str| if has(f) { "yes" } else { "no" };
        rows += &format!(
            "| {} | {} of {} | {} s | {} | {} | {} | {} | {} | {} | {} |\n",
            o.release,
            o.passed.len(),
            o.passed.len() + o.failed.len(),
            o.seconds,
            if runs {
                "runs".to_string()
            } else {
                format!("refuses: no {}", missing.join(", no "))
            },
            daemon_only(if has("set_retval") {
                "the policy's"
            } else {
                "EPERM"
            }),
            daemon_only(if has("tcx") {
                "tcx link"
            } else {
                "clsact filter"
            }),
            daemon_only(if has("so_netns_cookie") {
                "enforced"
            } else {
                "not enforced"
            }),
            if has("bound_inactive_diag") {
                "listed"
            } else {
                "not listed"
            },
            daemon_only(if has("batch_lookup") {
                "batched"
            } else {
                "entry by entry"
            }),
            yes("cgroup_storage"),
        );
    }
    ensure!(
        any,
        "no guest results under target/vm/run-*/result.json: run `cargo xtask test` first"
    );
    Ok(rows)
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_binary_runs_once_where_the_daemon_runs_and_feature_paths_once_per_set() {
        let binaries: Vec<String> = [
            "attach",
            "breakers",
            "kernel",
            "listeners",
            "ports",
            "rates",
        ]
        .iter()
        .map(|n| format!("target/release/deps/{n}-0123456789abcdef"))
        .collect();
        let series: Vec<&super::Series> = super::SERIES.iter().collect();
        let shares = super::shares(&series, &binaries);
        let names =
            |i: usize| -> Vec<&str> { shares[i].1.iter().map(|b| super::binary_name(b)).collect() };
        assert_eq!(shares.len(), 4);
        // 5.10: below the daemon's minimum, every binary for its DAEMONLESS tests.
        assert_eq!(names(0).len(), 6);
        // 6.1 (its own set): every feature path, and a third of the others.
        assert_eq!(names(1), ["kernel", "listeners", "ports", "attach"]);
        // 6.12 and 7 (one set): the feature paths in turn, the others in turn.
        assert_eq!(names(2), ["kernel", "ports", "breakers"]);
        assert_eq!(names(3), ["listeners", "rates"]);
        // Where no guest runs the daemon, that guest's share alone.
        let below = super::shares(&series[..1], &binaries);
        assert_eq!((below.len(), below[0].1.len()), (1, 6));
    }

    #[test]
    fn host_only_and_daemonless_tests_are_tests_of_the_suite() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/tests");
        let mut suite = String::new();
        for file in std::fs::read_dir(&dir).unwrap() {
            suite += &std::fs::read_to_string(file.unwrap().path()).unwrap();
        }
        for name in super::HOST_ONLY.iter().chain(super::DAEMONLESS) {
            assert!(
                suite.contains(&format!("#[test]\nfn {name}()")),
                "{name} is no test of {}",
                dir.display()
            );
        }
        // A guest's --skip matches a part of a name: each of HOST_ONLY only its own.
        for name in super::HOST_ONLY {
            assert_eq!(
                suite.matches(name).count(),
                1,
                "{name} is a part of another name"
            );
        }
    }

    #[test]
    fn a_crash_is_shown_from_its_first_report() {
        let console = "[    2.0] virtio_blk: ok\n\
                       Booting from ROM..[    2.4] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n\
                       [    2.5] RIP: 0010:sched_clock_cpu+0x9/0x1d0\n\
                       [    3.1] Kernel panic - not syncing: Attempted to kill init\n";
        assert_eq!(
            super::crash_lines(console),
            console.split_once('\n').unwrap().1.trim_end()
        );
        let long: String = (0..50).map(|i| format!("[    1.{i}] BUG: x\n")).collect();
        let expected: Vec<String> = (0..40).map(|i| format!("[    1.{i}] BUG: x")).collect();
        assert_eq!(super::crash_lines(&long), expected.join("\n"));
        let quiet: String = (0..50).map(|i| format!("line {i}\n")).collect();
        let expected: Vec<String> = (10..50).map(|i| format!("line {i}")).collect();
        assert_eq!(super::crash_lines(&quiet), expected.join("\n"));
    }

    #[test]
    fn results_name_a_failure_whose_output_came_before_failed() {
        let output = "running 3 tests\n\
            test a ... ok <1.2s>\n\
            test b ... Error: listen: unknown\n\
            FAILED <0.9s>\n\
            test c ... ok\n\n\
            failures:\n\n\
            ---- b stdout ----\n\
            thread 'b' panicked at x.rs:1:1:\n    \
            indented text\n\n\
            failures:\n    \
            b\n\n\
            test result: FAILED. 2 passed; 1 failed\n\
            running 1 test\n\
            test d ... FAILED\n\n\
            failures:\n\n\
            failures:\n    \
            d\n\n\
            test result: FAILED. 0 passed; 1 failed\n";
        let (passed, failed) = super::results(output);
        assert_eq!(passed, ["a", "c"]);
        assert_eq!(failed, ["b", "d"]);
    }
}

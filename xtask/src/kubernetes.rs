//! The manifests of packaging/kubernetes/, checked: each against Kubernetes' schemas
//! (kubernetes-validate, offline, which `cargo xtask setup` installs), and against what
//! they name: the ConfigMap's policy, the flags of the binary, containerd's socket, the
//! image `cargo xtask image` tags, the systemd unit's capabilities, the ports, paths and
//! labels of the probes and the scrape. Then the image, run by podman as the DaemonSet
//! runs it, governs a cgroup of the host.
//!
//! The last test starts a daemon, which pins its state in /sys/fs/bpf/connguard: run it
//! alone, as `cargo xtask test` does, or under the integration tests' lock.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::{image, setup::kubernetes_validate_venv};

/// Where the manifests are.
fn dir() -> PathBuf {
    crate::root().join("packaging/kubernetes")
}

/// Every `.yaml` file below dir(), sorted.
fn files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "yaml") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&dir(), &mut files);
    files.sort();
    files
}

/// The documents of a YAML file, as JSON (read by the Python of kubernetes-validate's
/// environment, which has PyYAML).
fn documents(path: &Path) -> Vec<Value> {
    let python = kubernetes_validate_venv().join("bin/python");
    let out = Command::new(&python)
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask setup`)", python.display()));
    assert!(
        out.status.success(),
        "reading {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The one manifest of `kind`.
fn the(kind: &str) -> Value {
    let mut found: Vec<Value> = files()
        .iter()
        .flat_map(|f| documents(f))
        .filter(|d| d["kind"] == kind)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} in {}", dir().display());
    found.remove(0)
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v}"))
}

/// The DaemonSet's one container.
fn container(daemonset: &Value) -> &Value {
    let containers = daemonset["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    assert_eq!(containers.len(), 1, "{containers:?}");
    &containers[0]
}

/// The container's args.
fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| str_of(a).to_string())
        .collect()
}

/// The value of `flag` in `args`.
fn flag<'a>(args: &'a [String], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    &args[i + 1]
}

/// Runs kubernetes-validate --strict on `files` (for Kubernetes `version`, else the
/// newest it knows) in a network namespace of its own with no route out, so that a
/// check that reached for the network would fail here too: whether it passed, and what
/// it printed.
fn kubernetes_validate(version: Option<&str>, files: &[PathBuf]) -> (bool, String) {
    let bin = kubernetes_validate_venv().join("bin/kubernetes-validate");
    let mut cmd = Command::new("unshare");
    cmd.args(["--net", "--"]).arg(&bin).arg("--strict");
    if let Some(v) = version {
        cmd.args(["--kubernetes-version", v]);
    }
    let out = cmd
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask setup`)", bin.display()));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Every manifest passes Kubernetes' schemas, strictly (no unknown field), for the
/// newest version kubernetes-validate knows and for 1.30 (the first with the
/// appArmorProfile field); the PodMonitor, a custom resource with no schema there, is
/// the one resource it cannot check (its fields are checked below). A DaemonSet with an
/// unknown field fails: the check can fail.
#[test]
fn every_manifest_passes_kubernetes_schemas() {
    let files = files();
    let documents: usize = files.iter().map(|f| documents(f).len()).sum();
    assert!(documents >= 5, "{files:?}");
    for version in [None, Some("1.30.0")] {
        let (ok, out) = kubernetes_validate(version, &files);
        assert!(ok, "kubernetes-validate {version:?}:\n{out}");
        let passed = out
            .lines()
            .filter(|l| l.contains(" passed for resource "))
            .count();
        let unchecked: Vec<&str> = out
            .lines()
            .filter(|l| !l.contains(" passed for resource "))
            .collect();
        assert_eq!(
            (passed, unchecked.len()),
            (documents - 1, 1),
            "kubernetes-validate {version:?}:\n{out}"
        );
        assert!(
            unchecked[0].contains("Couldn't find schema for kind PodMonitor"),
            "{out}"
        );
    }
    let daemonset = dir().join("30-daemonset.yaml");
    let text = std::fs::read_to_string(&daemonset).unwrap();
    let bad = std::env::temp_dir().join(format!(
        "connguard-bad-daemonset-{}.yaml",
        std::process::id()
    ));
    std::fs::write(&bad, text.replace("hostPID: true", "hostPIDs: true")).unwrap();
    let (ok, out) = kubernetes_validate(None, std::slice::from_ref(&bad));
    let _ = std::fs::remove_file(&bad);
    assert!(!ok && out.contains("'hostPIDs' was unexpected"), "{out}");
}

/// The manifests name what exists: the ConfigMap's policy is one `connguard check`
/// takes, mounted where --policy reads it; the container's args are flags `connguard`
/// takes; its image is the one `cargo xtask image` tags; its capabilities are the
/// systemd unit's; the probes, the scrape annotations and the PodMonitor reach the
/// port --metrics serves, on the pods the DaemonSet makes; everything is in the
/// Namespace, run by the ServiceAccount; and the lease outlasts the grace period.
#[test]
fn the_manifests_name_what_exists() {
    let root = crate::root();
    let bin = root.join("target/release/connguard");
    let (namespace, account, config_map, daemonset, monitor) = (
        the("Namespace"),
        the("ServiceAccount"),
        the("ConfigMap"),
        the("DaemonSet"),
        the("PodMonitor"),
    );
    let ns = &namespace["metadata"]["name"];
    for m in [&account, &config_map, &daemonset, &monitor] {
        assert_eq!(&m["metadata"]["namespace"], ns, "{m}");
    }
    let pod = &daemonset["spec"]["template"];
    assert_eq!(
        pod["spec"]["serviceAccountName"],
        account["metadata"]["name"]
    );
    let c = container(&daemonset);
    let args = args(c);

    // `connguard run ARGS --help` fails on a flag it does not take, or a value it
    // refuses, before it prints the help.
    let out = Command::new(&bin)
        .args(&args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "connguard {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(args[0], "run");

    // The policy: the ConfigMap's key, mounted as a whole volume where --policy reads.
    let policy = Path::new(flag(&args, "--policy"));
    let volume = pod["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["configMap"]["name"] == config_map["metadata"]["name"])
        .expect("a volume of the ConfigMap");
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the ConfigMap's volume mounted");
    assert!(
        mount.get("subPath").is_none(),
        "kubelet never updates a subPath"
    );
    assert_eq!(
        policy.parent().unwrap(),
        Path::new(str_of(&mount["mountPath"]))
    );
    let key = policy.file_name().unwrap().to_str().unwrap();
    let text = str_of(&config_map["data"][key]);
    let file =
        std::env::temp_dir().join(format!("connguard-configmap-{}.toml", std::process::id()));
    std::fs::write(&file, text).unwrap();
    let out = Command::new(&bin).arg("check").arg(&file).output().unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "connguard check of the ConfigMap's policy: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // containerd's socket where the daemon reads it (--containerd-socket, else its
    // default), from the node's same path; the directory mounted, not the socket, so
    // that the socket a restarted containerd makes is seen.
    let socket = match args.iter().position(|a| a == "--containerd-socket") {
        Some(i) => args[i + 1].clone(),
        None => {
            let help = output(Command::new(&bin).args(["run", "--help"]));
            help.split_once("--containerd-socket")
                .and_then(|(_, h)| h.split_once("[default: "))
                .and_then(|(_, d)| d.split_once(']'))
                .expect("--containerd-socket's default in `connguard run --help`")
                .0
                .to_string()
        }
    };
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| Path::new(&socket).starts_with(str_of(&m["mountPath"])))
        .max_by_key(|m| str_of(&m["mountPath"]).len())
        .unwrap_or_else(|| panic!("no volume mounted above {socket}"));
    assert!(mount.get("subPath").is_none(), "{mount}");
    let volume = pod["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["hostPath"]["path"], mount["mountPath"], "{volume}");
    assert_eq!(
        Path::new(&socket).parent().unwrap(),
        Path::new(str_of(&mount["mountPath"])),
        "the socket's directory mounted"
    );

    assert_eq!(str_of(&c["image"]), image::reference(&root).unwrap());

    // What the unit grants, and no more.
    let unit = std::fs::read_to_string(root.join("packaging/connguard.service")).unwrap();
    let granted: BTreeSet<&str> = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .unwrap()
        .split_whitespace()
        .map(|c| c.trim_start_matches("CAP_"))
        .collect();
    let caps = &c["securityContext"]["capabilities"];
    let added: BTreeSet<&str> = caps["add"].as_array().unwrap().iter().map(str_of).collect();
    assert_eq!(added, granted);
    assert_eq!(caps["drop"], serde_json::json!(["ALL"]));
    assert_eq!(c["securityContext"]["privileged"], false);

    // The port --metrics serves, as the probes, the annotations and the PodMonitor name it.
    let metrics = flag(&args, "--metrics");
    let port: u16 = metrics.rsplit_once(':').unwrap().1.parse().unwrap();
    let ports = c["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0]["containerPort"], port);
    let name = &ports[0]["name"];
    for (probe, path) in [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ] {
        assert_eq!(c[probe]["httpGet"]["port"], *name, "{probe}");
        assert_eq!(c[probe]["httpGet"]["path"], path, "{probe}");
    }
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], port.to_string());
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let endpoints = monitor["spec"]["podMetricsEndpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0]["port"], *name);
    assert_eq!(endpoints[0]["path"], "/metrics");
    // The PodMonitor and the DaemonSet select the pods the DaemonSet makes.
    for selector in [
        &monitor["spec"]["selector"]["matchLabels"],
        &daemonset["spec"]["selector"]["matchLabels"],
    ] {
        for (k, v) in selector.as_object().unwrap() {
            assert_eq!(&pod["metadata"]["labels"][k], v, "{selector}");
        }
    }
    // Every node, whatever its taints.
    assert_eq!(
        pod["spec"]["tolerations"],
        serde_json::json!([{"operator": "Exists"}])
    );

    let lease: u64 = flag(&args, "--lease").parse().unwrap();
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap();
    assert!(grace < lease, "grace {grace} s, lease {lease} s");
}

/// Capability numbers (linux/capability.h) of the names the DaemonSet adds.
const CAPABILITIES: &[(&str, u32)] = &[
    ("DAC_READ_SEARCH", 2),
    ("NET_ADMIN", 12),
    ("SYS_PTRACE", 19),
    ("SYS_ADMIN", 21),
    ("SYS_RESOURCE", 24),
    ("PERFMON", 38),
    ("BPF", 39),
];

/// podman, on a config and storage of the test's own in `dir`.
fn podman(dir: &Path) -> Command {
    let mut cmd = Command::new("podman");
    cmd.env("CONTAINERS_CONF", dir.join("containers.conf"))
        .env("CONTAINERS_STORAGE_CONF", dir.join("storage.conf"));
    cmd
}

/// Runs `cmd`, which must succeed; its standard output.
fn output(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// GET `path` of `addr`: the status code, none while nothing answers.
fn get(addr: &str, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(conn, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// What the test leaves: its containers, its storage and the state its daemon pinned.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = podman(&self.0)
            .args(["rm", "--all", "--force", "--time", "0"])
            .output();
        let _ = std::fs::remove_dir_all(&self.0);
        connguard_tests::remove_pinned_state();
    }
}

/// The image, built and loaded into podman, prints its version, and its `connguard
/// kernel`, run with the DaemonSet's namespaces and capabilities, finds what the host's
/// finds; then it runs the daemon as the DaemonSet does (its args, host namespaces,
/// capabilities, read-only root, host paths and an in-memory /run/connguard, the
/// ConfigMap's volume replaced by a directory with the test's policy), which becomes
/// ready, answers `connguard stats` inside the container, and enforces a budget of 5 on
/// a cgroup of the host: 5 admitted, 5 more refused. podman's default seccomp profile
/// is in force. A capability the test's own bounding set lacks cannot be granted: it is
/// left out, and named in the output.
#[test]
fn the_image_runs_as_the_daemonset_runs_it() {
    use connguard_api::policy::Mode;
    use connguard_tests::{Cgroup, Probe, Server, budget_policy, unique};

    let root = crate::root();
    let dir = std::env::temp_dir().join(unique("connguard-image"));
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let _cleanup = Cleanup(dir.clone());
    let d = dir.display();
    std::fs::write(
        dir.join("containers.conf"),
        format!(
            "[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n\
             events_logfile_path = \"{d}/events.log\"\nruntime = \"runc\"\ntmp_dir = \"{d}/tmp\"\n\
             [network]\nnetwork_config_dir = \"{d}/net\"\n"
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("storage.conf"),
        format!(
            "[storage]\ndriver = \"vfs\"\ngraphroot = \"{d}/storage\"\nrunroot = \"{d}/run\"\n"
        ),
    )
    .unwrap();
    let archive = image::build(&root, &dir.join("image")).unwrap();
    let reference = image::reference(&root).unwrap();
    output(podman(&dir).arg("load").arg("--input").arg(&archive));
    // podman raises RLIMIT_NOFILE and RLIMIT_NPROC to defaults of its own, which takes
    // CAP_SYS_RESOURCE: lower ones instead.
    let limits = ["--ulimit=nofile=1024:1024", "--ulimit=nproc=1024:1024"];
    let version = output(
        podman(&dir)
            .args(["run", "--rm"])
            .args(limits)
            .args([&reference, "--version"]),
    );
    assert_eq!(
        version.trim(),
        format!("connguard {}", crate::package::version(&root).unwrap())
    );

    let daemonset = the("DaemonSet");
    let pod = &daemonset["spec"]["template"]["spec"];
    let c = container(&daemonset);
    assert_eq!(str_of(&c["image"]), reference);
    let mut run: Vec<String> = ["run", "--detach", "--name", "connguard"]
        .map(String::from)
        .into();
    run.extend(limits.map(String::from));
    if pod["hostPID"] == true {
        run.push("--pid=host".into());
    }
    if pod["hostNetwork"] == true {
        run.push("--network=host".into());
    }
    let security = &c["securityContext"];
    if security["readOnlyRootFilesystem"] == true {
        run.push("--read-only".into());
    }
    let bounding = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .map(|h| u64::from_str_radix(h.trim(), 16).unwrap())
        .unwrap();
    run.push("--cap-drop=all".into());
    for cap in security["capabilities"]["add"].as_array().unwrap() {
        let cap = str_of(cap);
        let (_, bit) = CAPABILITIES
            .iter()
            .find(|(n, _)| *n == cap)
            .unwrap_or_else(|| panic!("no number for {cap}"));
        if bounding & (1 << bit) != 0 {
            run.push(format!("--cap-add={cap}"));
        } else {
            println!(
                "CAP_{cap} is not in this process's bounding set: the container runs without it"
            );
        }
    }
    // `connguard kernel` with the DaemonSet's namespaces and capabilities finds what it
    // finds on the host: no probe is refused for want of a capability or by seccomp.
    let in_image = output(
        podman(&dir)
            .args(["run", "--rm"])
            .args(&run[4..])
            .args([&reference, "kernel"]),
    );
    let on_host = output(Command::new(root.join("target/release/connguard")).arg("kernel"));
    assert!(on_host.starts_with("kernel "), "{on_host}");
    assert_eq!(in_image, on_host);
    // The volumes: host paths bound (HostToContainer is rslave), the ConfigMap's a
    // directory with the test's policy, an emptyDir a tmpfs.
    let server = Server::start("127.0.0.1:0");
    let cg = Cgroup::new("image");
    let policy_dir = dir.join("policy");
    std::fs::create_dir_all(&policy_dir).unwrap();
    let args = args(c);
    let policy_file = Path::new(flag(&args, "--policy")).file_name().unwrap();
    std::fs::write(
        policy_dir.join(policy_file),
        budget_policy("image", &cg.rel, Mode::Enforce, &server.addr, 5).to_toml(),
    )
    .unwrap();
    for m in c["volumeMounts"].as_array().unwrap() {
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap();
        let at = str_of(&m["mountPath"]);
        let mut options = vec!["rbind"];
        if m["readOnly"] == true {
            options.push("ro");
        }
        if m["mountPropagation"] == "HostToContainer" {
            options.push("rslave");
        }
        if let Some(path) = volume["hostPath"]["path"].as_str() {
            if volume["hostPath"]["type"] == "DirectoryOrCreate" {
                std::fs::create_dir_all(path).unwrap();
            }
            run.push(format!("--volume={path}:{at}:{}", options.join(",")));
        } else if volume.get("configMap").is_some() {
            run.push(format!(
                "--volume={}:{at}:{}",
                policy_dir.display(),
                options.join(",")
            ));
        } else if volume.get("emptyDir").is_some() {
            run.push(format!("--tmpfs={at}"));
        } else {
            panic!("a volume the test cannot make: {volume}");
        }
    }
    // $(NODE_IP), which kubelet expands, is the loopback here; the port one free.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    run.push(reference.clone());
    let mut rest = args.clone();
    let i = rest.iter().position(|a| a == "--metrics").unwrap() + 1;
    rest[i] = addr.clone();
    run.extend(rest);
    output(podman(&dir).args(&run));

    let until = Instant::now() + Duration::from_secs(30);
    while get(&addr, "/readyz") != Some(200) {
        if Instant::now() > until {
            let logs = podman(&dir).args(["logs", "connguard"]).output().unwrap();
            panic!(
                "not ready within 30 s:\n{}",
                String::from_utf8_lossy(&logs.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(get(&addr, "/healthz"), Some(200));
    let stats =
        output(podman(&dir).args(["exec", "connguard", "/usr/bin/connguard", "stats", "--json"]));
    let stats: connguard_api::stats::Snapshot = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats.policy.generation, 1, "{:?}", stats.policy);

    let held = cg.hold(Probe::hold(server.addr, 5, 5));
    assert_eq!(held.outcome.ok, 5, "{:?}", held.outcome);
    let more = cg.probe(Probe::connect(server.addr, 5, 1));
    assert_eq!(more.errors("ECONNREFUSED"), 5, "{more:?}");
    drop(held);

    // SIGTERM: the daemon exits keeping its state pinned in the host's bpffs.
    output(podman(&dir).args(["stop", "--time", "10", "connguard"]));
    let logs = podman(&dir).args(["logs", "connguard"]).output().unwrap();
    let logs = String::from_utf8_lossy(&logs.stderr);
    assert!(
        logs.contains("exiting with the programs attached"),
        "{logs}"
    );
    let layouts: Vec<String> = std::fs::read_dir(connguard_tests::STATE_ROOT)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('v'))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        layouts.len(),
        1,
        "the pinned state outlives the container: {layouts:?}"
    );
}

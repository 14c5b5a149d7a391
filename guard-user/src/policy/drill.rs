//! Drill files (docs/drills.md): TOML, read into a validated `DrillSpec`. Errors name
//! file, line, column and reason; unknown keys are errors. `connguard drill start`'s
//! flags are written into such a file (`load`), so both are checked the same way.
use std::{ops::Range, path::Path};

use connguard_api::{
    drill::{AbortSpec, DrillSpec, Fault},
    policy::{Containers, Pods},
};
use guard_common::drill::{MAX_DRILL_NETS, MAX_DRILL_PORTS};
use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::{
    PolicyError,
    parse::{
        PortSpec, RawContainer, RawPod, at_least_one, bad_name, fraction, locator, parse_duration,
        parse_errno, parse_net, parse_ports, parse_workloads, read,
    },
};
use crate::workload::WorkloadSelector;

/// The longest drill: a drill is a bounded experiment, not a standing fault.
const MAX_DURATION_MS: u64 = 24 * 60 * 60 * 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDrill {
    name: Spanned<String>,
    scope: Option<Spanned<String>>,
    pod: Option<RawPod>,
    container: Option<RawContainer>,
    unit: Option<Spanned<String>>,
    #[serde(default)]
    dst: Vec<Spanned<String>>,
    #[serde(default)]
    ports: Vec<Spanned<PortSpec>>,
    fault: Spanned<String>,
    errno: Option<Spanned<String>>,
    probability: Spanned<f64>,
    duration: Option<Spanned<String>>,
    max_faults: Option<Spanned<i64>>,
    max_fraction: Option<Spanned<f64>>,
    window: Option<Spanned<String>>,
    #[serde(default)]
    abort: RawAbort,
}

/// A drill's workload selectors alone, as `DrillSpec` carries them.
#[derive(Deserialize, Serialize)]
struct Workloads {
    pod: Option<Pods>,
    container: Option<Containers>,
    unit: Option<String>,
}

/// A drill's workload selectors alone, as the parser reads them.
#[derive(Deserialize)]
struct RawWorkloads {
    pod: Option<RawPod>,
    container: Option<RawContainer>,
    unit: Option<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAbort {
    #[serde(default)]
    watch: Vec<Spanned<String>>,
    on_shedding: Option<bool>,
    on_breaker_open: Option<bool>,
    min_success_ratio: Option<Spanned<f64>>,
    window: Option<Spanned<String>>,
    min_attempts: Option<Spanned<i64>>,
    http: Option<Spanned<String>>,
}

/// Reads and validates a drill file.
pub fn load_file(path: &Path) -> Result<DrillSpec, PolicyError> {
    let (text, file) = read(path)?;
    parse(&text, &file)
}

/// Parses and validates drill text; `file` names it in errors.
pub fn parse(text: &str, file: &str) -> Result<DrillSpec, PolicyError> {
    let at = locator(text, file);
    let raw: RawDrill = toml::from_str(text)
        .map_err(|e| at(e.span().unwrap_or(0..0), e.message().trim().to_string()))?;
    for (key, name) in [("name", Some(&raw.name)), ("scope", raw.scope.as_ref())] {
        if let Some(name) = name
            && let Some(why) = bad_name(name.get_ref())
        {
            return Err(at(name.span(), format!("{key} {why}")));
        }
    }
    let (selectors, _) = parse_workloads(
        raw.pod.as_ref(),
        raw.container.as_ref(),
        raw.unit.as_ref(),
        &at,
    )?;
    if raw.scope.is_none() && selectors.is_empty() {
        return Err(at(
            raw.name.span(),
            "a drill needs a target: scope, or the pod, container or unit it faults".into(),
        ));
    }
    // The selectors in the form the control socket carries.
    let workloads: Workloads = toml::from_str(text)
        .map_err(|e| at(e.span().unwrap_or(0..0), e.message().trim().to_string()))?;
    if raw.name.get_ref().contains(char::is_whitespace) {
        return Err(at(raw.name.span(), "name must not contain spaces".into()));
    }
    let fault = match raw.fault.get_ref().as_str() {
        "refuse" => Fault::Refuse,
        "blackhole" => Fault::Blackhole,
        "delay" => Fault::Delay,
        "reset" => Fault::Reset,
        other => {
            return Err(at(
                raw.fault.span(),
                format!("unknown fault {other:?}; use refuse, blackhole, delay or reset"),
            ));
        }
    };
    parse_errno(&raw.errno, &at)?;
    if let Some(e) = &raw.errno
        && fault != Fault::Refuse
    {
        return Err(at(e.span(), format!("errno is for refuse, not {fault}")));
    }
    let p = *raw.probability.get_ref();
    if !(0.0..=1.0).contains(&p) {
        return Err(at(
            raw.probability.span(),
            format!("probability must be in [0, 1], like 0.3 (got {p})"),
        ));
    }
    let duration_ms = match &raw.duration {
        None => {
            return Err(at(
                raw.name.span(),
                "a drill needs a duration, like duration = \"5min\"".into(),
            ));
        }
        Some(d) => parse_duration(d.get_ref())
            .map_err(|why| at(d.span(), format!("duration {why}")))?
            .div_ceil(1_000_000)
            .min(MAX_DURATION_MS),
    };
    let max_faults = at_least_one(&raw.max_faults, "max_faults", &at)?;
    let max_fraction = fraction(
        &raw.max_fraction,
        "max_fraction",
        "the target's attempts",
        &at,
    )?
    .map(|permille| permille as f64 / 1000.0);
    if max_faults.is_none() && max_fraction.is_none() {
        return Err(at(
            raw.name.span(),
            "a drill needs a cap on its blast radius: max_faults, max_fraction, or both".into(),
        ));
    }
    let window_ms = match (&raw.window, max_fraction) {
        (None, _) => None,
        (Some(w), None) => return Err(at(w.span(), "window is for max_fraction".into())),
        (Some(w), Some(_)) => Some(ms(w, "window", &at)?),
    };
    let dst = bounded(&raw.dst, MAX_DRILL_NETS, "dst", &raw.name, &at)?
        .iter()
        .map(|d| {
            parse_net(d.get_ref())
                .map(|n| n.to_string())
                .map_err(|why| at(d.span(), why))
        })
        .collect::<Result<_, _>>()?;
    let ports = bounded(&raw.ports, MAX_DRILL_PORTS, "ports", &raw.name, &at)?
        .iter()
        .map(|p| {
            parse_ports(p.get_ref())
                .map(|r| match r.first == r.last {
                    true => r.first.to_string(),
                    false => format!("{}-{}", r.first, r.last),
                })
                .map_err(|why| at(p.span(), why))
        })
        .collect::<Result<_, _>>()?;
    Ok(DrillSpec {
        name: raw.name.into_inner(),
        scope: raw.scope.map(Spanned::into_inner).unwrap_or_default(),
        pod: workloads.pod,
        container: workloads.container,
        unit: workloads.unit,
        dst,
        ports,
        fault,
        errno: raw.errno.map(Spanned::into_inner),
        probability: p,
        duration_ms,
        max_faults,
        max_fraction,
        window_ms,
        abort: abort(raw.abort, &at)?,
    })
}

fn abort(
    raw: RawAbort,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<AbortSpec, PolicyError> {
    for w in &raw.watch {
        if let Some(why) = bad_name(w.get_ref()) {
            return Err(at(w.span(), format!("watch: a scope name {why}")));
        }
    }
    let min_success_ratio = match &raw.min_success_ratio {
        Some(r) if !(0.0..=1.0).contains(r.get_ref()) => {
            return Err(at(
                r.span(),
                format!(
                    "min_success_ratio must be in [0, 1], like 0.9 (got {})",
                    r.get_ref()
                ),
            ));
        }
        r => r.as_ref().map(|r| *r.get_ref()),
    };
    if let Some(url) = &raw.http
        && !url.get_ref().starts_with("http://")
    {
        return Err(at(
            url.span(),
            format!("http must be an http:// URL (got {:?})", url.get_ref()),
        ));
    }
    Ok(AbortSpec {
        watch: raw.watch.into_iter().map(Spanned::into_inner).collect(),
        on_shedding: raw.on_shedding.unwrap_or(true),
        on_breaker_open: raw.on_breaker_open.unwrap_or(true),
        min_success_ratio,
        window_ms: match &raw.window {
            Some(w) => ms(w, "abort window", at)?,
            None => 10_000,
        },
        min_attempts: at_least_one(&raw.min_attempts, "min_attempts", at)?.unwrap_or(20),
        http: raw.http.map(Spanned::into_inner),
    })
}

/// A duration key in ms.
fn ms(
    d: &Spanned<String>,
    key: &str,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<u64, PolicyError> {
    parse_duration(d.get_ref())
        .map(|ns| ns.div_ceil(1_000_000))
        .map_err(|why| at(d.span(), format!("{key} {why}")))
}

/// `list`, when it holds at most `max` entries.
fn bounded<'a, T>(
    list: &'a [Spanned<T>],
    max: usize,
    key: &str,
    near: &Spanned<String>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<&'a [Spanned<T>], PolicyError> {
    if list.len() > max {
        let span = list.get(max).map_or(near.span(), Spanned::span);
        return Err(at(
            span,
            format!(
                "{key} holds {} entries; a drill takes at most {max}",
                list.len()
            ),
        ));
    }
    Ok(list)
}

/// The workload selectors of `spec` (none for a drill of a whole scope), read as a
/// drill file's are.
pub fn workload_selectors(spec: &DrillSpec) -> Result<Vec<WorkloadSelector>, String> {
    let text = toml::to_string(&Workloads {
        pod: spec.pod.clone(),
        container: spec.container.clone(),
        unit: spec.unit.clone(),
    })
    .map_err(|e| e.to_string())?;
    let at = locator(&text, "the drill's workloads");
    let raw: RawWorkloads = toml::from_str(&text).map_err(|e| e.message().to_string())?;
    parse_workloads(
        raw.pod.as_ref(),
        raw.container.as_ref(),
        raw.unit.as_ref(),
        &at,
    )
    .map(|(selectors, _)| selectors)
    .map_err(|e| e.to_string())
}

/// `connguard drill start`'s drill: the file alone, or the flags (`key`, or
/// `table.key` such as `abort.http`, and a TOML value) over the file's keys, or the flags alone. Flags are
/// written into the file's table and the whole read as drill text, so that both are
/// checked the same way; a file that is no TOML table is refused at its own place.
pub fn load(file: Option<&Path>, flags: &[(&str, toml::Value)]) -> Result<DrillSpec, PolicyError> {
    let (mut table, source) = match file {
        Some(path) if flags.is_empty() => return load_file(path),
        Some(path) => {
            let (text, name) = read(path)?;
            let table: toml::Table = match toml::from_str(&text) {
                Ok(t) => t,
                Err(_) => return parse(&text, &name),
            };
            (table, format!("{name} with the command line's flags"))
        }
        None => (toml::Table::new(), "the command line's flags".to_string()),
    };
    for (key, value) in flags {
        // `abort.http`, `pod.namespace`: a key of the table so named.
        match key.split_once('.') {
            Some((outer, sub)) => {
                let inner = table
                    .entry(outer)
                    .or_insert_with(|| toml::Value::Table(Default::default()));
                if let toml::Value::Table(t) = inner {
                    t.insert(sub.to_string(), value.clone());
                }
            }
            None => {
                table.insert(key.to_string(), value.clone());
            }
        }
    }
    parse(&toml::to_string(&table).unwrap_or_default(), &source)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "db-refuse"
scope = "orders"
dst = ["10.20.0.0/16"]
ports = ["5432", 6000]
fault = "refuse"
probability = 0.3
duration = "2min"
max_faults = 100

[abort]
min_success_ratio = 0.5
"#;

    #[test]
    fn a_drill_file_reads_into_its_spec() {
        let d = parse(GOOD, "d.toml").unwrap();
        assert_eq!(d.name, "db-refuse");
        assert_eq!(d.dst, vec!["10.20.0.0/16"]);
        assert_eq!(d.ports, vec!["5432", "6000"]);
        assert_eq!(
            (d.fault, d.duration_ms, d.max_faults),
            (Fault::Refuse, 120_000, Some(100))
        );
        assert!(d.abort.on_shedding && d.abort.on_breaker_open);
        assert_eq!(d.abort.min_success_ratio, Some(0.5));
        assert_eq!((d.abort.window_ms, d.abort.min_attempts), (10_000, 20));
    }

    #[test]
    fn bad_drills_are_refused_at_their_place() {
        let cases = [
            (
                "probability = 0.3",
                "probability = 1.5",
                "d.toml:7:15: probability must be in [0, 1], like 0.3 (got 1.5)",
            ),
            (
                "max_faults = 100\n",
                "",
                "d.toml:2:8: a drill needs a cap on its blast radius: max_faults, max_fraction, or both",
            ),
            (
                "duration = \"2min\"\n",
                "",
                "d.toml:2:8: a drill needs a duration, like duration = \"5min\"",
            ),
            (
                "fault = \"refuse\"",
                "fault = \"drop\"",
                "d.toml:6:9: unknown fault \"drop\"; use refuse, blackhole, delay or reset",
            ),
            (
                "fault = \"refuse\"",
                "fault = \"blackhole\"\nerrno = \"EPERM\"",
                "d.toml:7:9: errno is for refuse, not blackhole",
            ),
            (
                "max_faults = 100",
                "max_faults = 100\nfrobnicate = 1",
                "d.toml:10:1: unknown field `frobnicate`",
            ),
            (
                "min_success_ratio = 0.5",
                "min_success_ratio = 2.0",
                "d.toml:12:21: min_success_ratio must be in [0, 1], like 0.9 (got 2)",
            ),
        ];
        for (from, to, want) in cases {
            let text = GOOD.replace(from, to);
            let err = parse(&text, "d.toml").unwrap_err().to_string();
            assert!(err.starts_with(want), "{from:?} -> {to:?}: {err}");
        }
    }

    #[test]
    fn a_drill_may_name_workloads_instead_of_a_scope() {
        let text = GOOD.replace(
            "scope = \"orders\"",
            "pod = { namespace = \"shop\", labels = { app = \"orders\" } }",
        );
        let d = parse(&text, "d.toml").unwrap();
        assert_eq!(d.scope, "");
        let pods = d.pod.clone().unwrap();
        assert_eq!(pods.namespace.as_deref(), Some("shop"));
        assert_eq!(pods.labels.labels["app"], "orders");
        let selectors = workload_selectors(&d).unwrap();
        assert_eq!(selectors.len(), 1);
        assert_eq!(selectors[0].to_string(), "pod namespace=shop app=orders");

        let err = parse(&GOOD.replace("scope = \"orders\"\n", ""), "d.toml").unwrap_err();
        assert_eq!(
            err.to_string(),
            "d.toml:2:8: a drill needs a target: scope, or the pod, container or unit it faults"
        );
        let err = parse(
            &GOOD.replace("scope = \"orders\"", "unit = \"orders\""),
            "d.toml",
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("d.toml:3:8: unit \"orders\": a unit name ends in"),
            "{err}"
        );
        let d = load(
            None,
            &[
                ("name", toml::Value::String("u".into())),
                ("unit", toml::Value::String("orders.service".into())),
                ("fault", toml::Value::String("refuse".into())),
                ("probability", toml::Value::Float(1.0)),
                ("duration", toml::Value::String("1min".into())),
                ("max_faults", toml::Value::Integer(5)),
                ("container.name", toml::Value::String("web-*".into())),
            ],
        )
        .unwrap();
        let selectors: Vec<String> = workload_selectors(&d)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(selectors, ["container name=web-*", "unit orders.service"]);
        // Labels and match expressions as the control socket carries them.
        let text = GOOD.replace(
            "scope = \"orders\"",
            "container = { labels = { app = \"web\" }, match_expressions = [{ key = \"tier\", operator = \"NotIn\", values = [\"db\"] }] }",
        );
        let d = parse(&text, "d.toml").unwrap();
        let json = serde_json::to_string(&d).unwrap();
        let back: DrillSpec = serde_json::from_str(&json).unwrap();
        let selectors = workload_selectors(&back).unwrap();
        assert_eq!(
            selectors[0].to_string(),
            "container app=web,tier notin (db)"
        );
    }

    #[test]
    fn flags_override_the_file_and_are_checked_alike() {
        let dir = std::env::temp_dir().join(format!("drill-{}.toml", std::process::id()));
        std::fs::write(&dir, GOOD).unwrap();
        let d = load(
            Some(&dir),
            &[
                ("probability", toml::Value::Float(1.0)),
                ("abort.min_attempts", toml::Value::Integer(5)),
            ],
        )
        .unwrap();
        assert_eq!((d.probability, d.abort.min_attempts), (1.0, 5));
        std::fs::write(&dir, "name = \"x\"\nscope = [").unwrap();
        let err = load(Some(&dir), &[("probability", toml::Value::Float(1.0))]).unwrap_err();
        assert_eq!(
            (err.file.as_str(), err.line),
            (dir.to_str().unwrap(), 2),
            "{err}"
        );
        std::fs::remove_file(&dir).unwrap();
        let err = load(None, &[("name", toml::Value::String("x".into()))]).unwrap_err();
        assert!(err.to_string().contains("missing field"), "{err}");
    }
}

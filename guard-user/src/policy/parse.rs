//! Policy files: TOML parsed and validated into [`Policy`]. Every error names file,
//! line, column and reason. Unknown keys are errors.
use std::{
    collections::{BTreeMap, HashSet},
    net::IpAddr,
    ops::Range,
    path::Path,
};

use guard_common::{
    MAX_CANDIDATES, MAX_NAME, MAX_PORT_RANGES, MAX_RAMP_STEPS, MAX_RULE_IDS, MAX_SCOPE_IDS,
    MODE_ENFORCE, MODE_OBSERVE, PortRange,
};
use ipnet::IpNet;
use serde::Deserialize;
use toml::Spanned;

use super::{
    BreakerPolicy, ERRNOS, FleetBudget, FleetPolicy, Limits, ListenerPolicy, PerSourcePolicy,
    Policy, PolicyError, Rate, RateUnit, Rule, Scope, Selector,
    compile::{candidates_of, rule_prefixes, unmapped_net},
    workloads::DERIVED_SEPARATOR,
};
use crate::workload::{
    WorkloadSelector,
    labels::{LabelSelector, Operator, Requirement, SelectorError},
    selector::{ContainerSelector, PodSelector, UnitSelector},
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    scope: Vec<Spanned<RawScope>>,
    #[serde(default)]
    listener: Vec<Spanned<RawListener>>,
    fleet: Option<Spanned<RawFleet>>,
    #[serde(default)]
    fleet_budget: Vec<Spanned<RawFleetBudget>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFleet {
    endpoints: Spanned<Vec<String>>,
    identity: Option<Spanned<String>>,
    prefix: Option<Spanned<String>>,
    ttl: Option<Spanned<String>>,
    refresh: Option<Spanned<String>>,
    user: Option<String>,
    password_file: Option<String>,
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFleetBudget {
    name: Spanned<String>,
    dst: Vec<Spanned<String>>,
    ports: Option<Vec<Spanned<PortSpec>>>,
    max_connections: Spanned<i64>,
    weight: Option<Spanned<i64>>,
    floor: Option<Spanned<i64>>,
    safe_share: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawListener {
    name: Spanned<String>,
    ports: Vec<Spanned<PortSpec>>,
    addr: Option<Spanned<String>>,
    netns: Option<Spanned<String>>,
    #[serde(default)]
    interfaces: Vec<String>,
    scope: Option<Spanned<String>>,
    accept_queue_watermark: Option<Spanned<f64>>,
    max_syn_recv: Option<Spanned<i64>>,
    per_source: Option<Spanned<RawPerSource>>,
    mode: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPerSource {
    prefix: Option<Spanned<i64>>,
    prefix6: Option<Spanned<i64>>,
    max_connections: Option<Spanned<i64>>,
    rate: Option<Spanned<String>>,
    burst: Option<Spanned<i64>>,
    action: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScope {
    name: Spanned<String>,
    cgroup: Option<Spanned<String>>,
    // Not Spanned: toml cannot give the span of a table only implied by a header below
    // it (`[scope.pod.labels]` alone), and an error names the key inside it anyway.
    pod: Option<RawPod>,
    container: Option<RawContainer>,
    unit: Option<Spanned<String>>,
    annotations: Option<Spanned<bool>>,
    mode: Option<Spanned<String>>,
    errno: Option<Spanned<String>>,
    max_connections: Option<Spanned<i64>>,
    max_connecting: Option<Spanned<i64>>,
    rate: Option<Spanned<String>>,
    burst: Option<Spanned<i64>>,
    breaker: Option<Spanned<RawBreaker>>,
    port_watermark: Option<Spanned<f64>>,
    #[serde(default)]
    rule: Vec<Spanned<RawRule>>,
}

/// `pod = { namespace = "shop", labels = { app = "orders" }, match_expressions = [...] }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPod {
    namespace: Option<Spanned<String>>,
    #[serde(default)]
    labels: BTreeMap<Spanned<String>, Spanned<String>>,
    #[serde(default)]
    match_expressions: Vec<Spanned<RawRequirement>>,
}

/// `container = { name = "orders-*", labels = { app = "orders" }, match_expressions = [...] }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawContainer {
    name: Option<Spanned<String>>,
    #[serde(default)]
    labels: BTreeMap<Spanned<String>, Spanned<String>>,
    #[serde(default)]
    match_expressions: Vec<Spanned<RawRequirement>>,
}

/// One of `match_expressions`: Kubernetes' `LabelSelectorRequirement`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequirement {
    key: Spanned<String>,
    operator: Spanned<String>,
    values: Option<Spanned<Vec<String>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Option<Spanned<String>>,
    dst: Option<Vec<Spanned<String>>>,
    ports: Option<Vec<Spanned<PortSpec>>>,
    max_connections: Option<Spanned<i64>>,
    max_connecting: Option<Spanned<i64>>,
    rate: Option<Spanned<String>>,
    burst: Option<Spanned<i64>>,
    breaker: Option<Spanned<RawBreaker>>,
    per: Option<Spanned<String>>,
    port_watermark: Option<Spanned<f64>>,
    fleet: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    window: Option<Spanned<String>>,
    min_samples: Option<Spanned<i64>>,
    failure_ratio: Option<Spanned<f64>>,
    slow_ratio: Option<Spanned<f64>>,
    slow_connect_ms: Option<Spanned<i64>>,
    open_for: Option<Spanned<String>>,
    max_open_for: Option<Spanned<String>>,
    ramp: Option<Spanned<Vec<Spanned<i64>>>>,
    step_successes: Option<Spanned<i64>>,
    errno: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum PortSpec {
    Number(i64),
    Text(String),
}

/// Reads and validates a policy file.
pub fn load_file(path: &Path) -> Result<Policy, PolicyError> {
    let (text, file) = read(path)?;
    parse(&text, &file)
}

/// A file's text and its name for errors.
pub(super) fn read(path: &Path) -> Result<(String, String), PolicyError> {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((text, file)),
        Err(e) => Err(PolicyError {
            file,
            line: 0,
            column: 0,
            reason: format!("cannot read: {e}"),
        }),
    }
}

/// Makes errors at a byte range of `text`, named by `file`, line and column.
pub(super) fn locator<'a>(
    text: &'a str,
    file: &'a str,
) -> impl Fn(Range<usize>, String) -> PolicyError + 'a {
    move |span: Range<usize>, reason: String| {
        let (line, column) = line_col(text, span.start);
        PolicyError {
            file: file.to_string(),
            line,
            column,
            reason,
        }
    }
}

/// Why a scope or rule name cannot be used, if it cannot: counts are kept by name in a
/// pinned map whose keys hold [`MAX_NAME`] bytes.
pub(super) fn bad_name(name: &str) -> Option<String> {
    if name.is_empty() {
        Some("must not be empty".into())
    } else if name.len() > MAX_NAME {
        Some(format!("is {} bytes long, at most {MAX_NAME}", name.len()))
    } else if name.contains('\0') {
        Some("must not contain NUL".into())
    } else {
        None
    }
}

/// Parses and validates policy text; `file` names it in errors and in `source`.
pub fn parse(text: &str, file: &str) -> Result<Policy, PolicyError> {
    let at = locator(text, file);
    let raw: RawPolicy = toml::from_str(text)
        .map_err(|e| at(e.span().unwrap_or(0..0), e.message().trim().to_string()))?;
    let listeners = parse_listeners(raw.listener, &at)?;
    let mut names = HashSet::new();
    let mut scopes = Vec::new();
    let mut n_rules = 0;
    // The spans of the rules that draw from a fleet budget, in policy order.
    let mut fleet_spans = Vec::new();
    for s in raw.scope {
        let span = s.span();
        if scopes.len() == MAX_SCOPE_IDS as usize {
            return Err(at(
                span,
                format!("too many scopes: at most {MAX_SCOPE_IDS}"),
            ));
        }
        let s = s.into_inner();
        let port_watermark = fraction(
            &s.port_watermark,
            "port_watermark",
            "the ephemeral range",
            &at,
        )?;
        let name = s.name.get_ref().trim().to_string();
        if let Some(reason) = bad_name(&name) {
            return Err(at(s.name.span(), format!("scope name {reason}")));
        }
        if name.contains(DERIVED_SEPARATOR) {
            return Err(at(
                s.name.span(),
                format!(
                    "scope name {name:?} has a '{DERIVED_SEPARATOR}', which names the scopes of annotated pods (SCOPE{DERIVED_SEPARATOR}NAMESPACE{DERIVED_SEPARATOR}POD)"
                ),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(at(s.name.span(), format!("duplicate scope name {name:?}")));
        }
        let cgroup = s
            .cgroup
            .as_ref()
            .map(|c| c.get_ref().trim().trim_matches('/').to_string());
        let (workloads, units) =
            parse_workloads(s.pod.as_ref(), s.container.as_ref(), s.unit.as_ref(), &at)?;
        if cgroup.is_none() && workloads.is_empty() {
            return Err(at(
                s.name.span(),
                format!("scope {name:?} selects nothing: give it cgroup, pod, container or unit"),
            ));
        }
        let annotations = match &s.annotations {
            Some(a) if *a.get_ref() && s.pod.is_none() => {
                return Err(at(
                    a.span(),
                    "annotations = true needs a pod selector: they are pods' annotations".into(),
                ));
            }
            a => a.as_ref().is_some_and(|a| *a.get_ref()),
        };
        let selector = Selector::new(cgroup.as_deref(), units).map_err(|e| {
            let span = s.cgroup.as_ref().map_or(span.clone(), |c| c.span());
            at(span, format!("bad cgroup pattern: {}", e.kind()))
        })?;
        let mode = parse_mode(&s.mode, &at)?;
        let errno = parse_errno(&s.errno, &at)?.unwrap_or(libc::ECONNREFUSED);
        let breaker = s.breaker.map(|b| parse_breaker(b, &at)).transpose()?;
        let limits = parse_limits(
            RawLimits {
                max_connections: &s.max_connections,
                max_connecting: &s.max_connecting,
                rate: &s.rate,
                burst: &s.burst,
            },
            &at,
        )?;
        let mut rule_names = HashSet::new();
        let mut rules = Vec::new();
        for (i, r) in s.rule.into_iter().enumerate() {
            let rule_span = r.span();
            n_rules += 1;
            if n_rules > MAX_RULE_IDS as usize {
                return Err(at(
                    rule_span,
                    format!("too many rules: at most {MAX_RULE_IDS} over all scopes"),
                ));
            }
            let rule = parse_rule(r.into_inner(), i, rule_span.clone(), &at)?;
            if rule.fleet.is_some() {
                fleet_spans.push(rule_span.clone());
            }
            if !rule_names.insert(rule.name.clone()) {
                return Err(at(
                    rule_span,
                    format!("duplicate rule name {:?} in scope {name:?}", rule.name),
                ));
            }
            rules.push(rule);
        }
        check_overlap(&rules).map_err(|reason| at(span.clone(), reason))?;
        scopes.push(Scope {
            name,
            cgroup,
            workloads,
            annotations,
            parent: None,
            warnings: Vec::new(),
            selector,
            mode,
            errno,
            limits,
            breaker,
            port_watermark,
            rules,
        });
    }
    let (fleet, fleet_budgets) =
        parse_fleet(raw.fleet, raw.fleet_budget, &mut scopes, &fleet_spans, &at)?;
    Ok(Policy {
        source: file.to_string(),
        scopes,
        listeners,
        fleet,
        fleet_budgets,
    })
}

/// `[fleet]` and the `[[fleet_budget]]`s, each drawn from by exactly one rule, whose
/// destinations become the budget's.
fn parse_fleet(
    raw: Option<Spanned<RawFleet>>,
    raw_budgets: Vec<Spanned<RawFleetBudget>>,
    scopes: &mut [Scope],
    rule_spans: &[Range<usize>],
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<(Option<FleetPolicy>, Vec<FleetBudget>), PolicyError> {
    let mut rule_spans = rule_spans.iter();
    let mut budgets: Vec<FleetBudget> = Vec::new();
    let mut spans = Vec::new();
    for b in raw_budgets {
        let span = b.span();
        let b = b.into_inner();
        let name = b.name.get_ref().trim().to_string();
        if !connguard_api::fleet::valid_segment(&name) {
            return Err(at(
                b.name.span(),
                format!("fleet budget name {name:?}: must be non-empty, without '/'"),
            ));
        }
        if budgets.iter().any(|o| o.name == name) {
            return Err(at(
                b.name.span(),
                format!("duplicate fleet budget {name:?}"),
            ));
        }
        let mut dst = Vec::new();
        for d in &b.dst {
            dst.push(parse_net(d.get_ref()).map_err(|reason| at(d.span(), reason))?);
        }
        if dst.is_empty() {
            return Err(at(span, format!("fleet budget {name:?}: dst is empty")));
        }
        let mut ports = Vec::new();
        for p in b.ports.unwrap_or_default() {
            ports.push(parse_ports(p.get_ref()).map_err(|reason| at(p.span(), reason))?);
        }
        if ports.len() > MAX_PORT_RANGES {
            return Err(at(
                span,
                format!("fleet budget {name:?}: at most {MAX_PORT_RANGES} port ranges"),
            ));
        }
        let count = |v: &Option<Spanned<i64>>, key: &str, min: i64| match v {
            None => Ok(None),
            Some(n) if *n.get_ref() >= min => Ok(Some(*n.get_ref() as u64)),
            Some(n) => Err(at(
                n.span(),
                format!("{key} must be at least {min} (got {})", n.get_ref()),
            )),
        };
        let total = count(&Some(b.max_connections), "max_connections", 1)?.unwrap_or(1);
        let weight = count(&b.weight, "weight", 1)?.unwrap_or(1);
        if weight > u32::MAX as u64 {
            return Err(at(span, format!("weight must be at most {}", u32::MAX)));
        }
        budgets.push(FleetBudget {
            name,
            dst,
            ports,
            total,
            weight: weight as u32,
            floor: count(&b.floor, "floor", 0)?.unwrap_or(0),
            safe_share: count(&b.safe_share, "safe_share", 0)?.unwrap_or(0),
        });
        spans.push(b.name.span());
    }
    // Each budget's one rule takes its destinations.
    let mut drawn: Vec<Option<String>> = vec![None; budgets.len()];
    for scope in scopes.iter_mut() {
        let mut last = None;
        for rule in &mut scope.rules {
            let Some(f) = &rule.fleet else { continue };
            let rule_span = rule_spans.next().cloned().unwrap_or(0..0);
            last = Some(rule_span.clone());
            let Some(i) = budgets.iter().position(|b| &b.name == f) else {
                return Err(at(
                    rule_span.clone(),
                    format!(
                        "rule {:?} of scope {:?} draws from fleet budget {f:?}, which no \
                         [[fleet_budget]] declares",
                        rule.name, scope.name
                    ),
                ));
            };
            let this = format!("rule {:?} of scope {:?}", rule.name, scope.name);
            if scope.annotations {
                return Err(at(
                    rule_span.clone(),
                    format!(
                        "{this} draws from fleet budget {f:?}, and its scope takes \
                         annotations: the scopes of annotated pods copy its rules, and one \
                         rule a host draws from a fleet budget"
                    ),
                ));
            }
            if let Some(other) = drawn[i].replace(this.clone()) {
                return Err(at(
                    spans[i].clone(),
                    format!(
                        "fleet budget {f:?} is drawn from by {other} and by {this}: one rule \
                         a host draws from a fleet budget"
                    ),
                ));
            }
            rule.dst = budgets[i].dst.clone();
            rule.ports = budgets[i].ports.clone();
        }
        if let Some(span) = last {
            check_overlap(&scope.rules).map_err(|reason| at(span, reason))?;
        }
    }
    if let Some(i) = drawn.iter().position(Option::is_none) {
        return Err(at(
            spans[i].clone(),
            format!(
                "fleet budget {:?}: no rule draws from it (give one rule fleet = {:?})",
                budgets[i].name, budgets[i].name
            ),
        ));
    }
    let fleet = match raw {
        None if budgets.is_empty() => None,
        None => {
            return Err(at(
                spans[0].clone(),
                "fleet budgets need a [fleet] table with the etcd endpoints".into(),
            ));
        }
        Some(f) => {
            let span = f.span();
            let f = f.into_inner();
            if budgets.is_empty() {
                return Err(at(span, "[fleet] without a [[fleet_budget]]".into()));
            }
            let endpoints_span = f.endpoints.span();
            let endpoints = f.endpoints.into_inner();
            if endpoints.is_empty() {
                return Err(at(endpoints_span, "endpoints is empty".into()));
            }
            for e in &endpoints {
                if !(e.starts_with("http://") || e.starts_with("https://")) {
                    return Err(at(
                        endpoints_span.clone(),
                        format!("etcd endpoint {e:?}: not an http:// or https:// URL"),
                    ));
                }
            }
            let secs = |v: &Option<Spanned<String>>| {
                v.as_ref()
                    .map(|d| {
                        parse_duration(d.get_ref())
                            .map(|ns| ns / 1_000_000)
                            .map_err(|reason| at(d.span(), reason))
                    })
                    .transpose()
            };
            let ttl_ms = secs(&f.ttl)?;
            if let (Some(ms), Some(t)) = (ttl_ms, &f.ttl)
                && (ms < 2000 || ms % 1000 != 0)
            {
                return Err(at(
                    t.span(),
                    "ttl: whole seconds, at least 2s (etcd's lease granularity)".into(),
                ));
            }
            let refresh_ms = secs(&f.refresh)?;
            // The library's defaults: a TTL of 10 s, a refresh of 2 s.
            let (ttl, refresh) = (ttl_ms.unwrap_or(10_000), refresh_ms.unwrap_or(2_000));
            if refresh == 0 || refresh * 3 > ttl {
                let given = f.refresh.as_ref().or(f.ttl.as_ref());
                return Err(at(
                    given.map_or(span.clone(), Spanned::span),
                    format!(
                        "refresh ({refresh} ms) must be above 0 and at most a third of the ttl \
                         ({ttl} ms)"
                    ),
                ));
            }
            if let Some(id) = &f.identity
                && !connguard_api::fleet::valid_segment(id.get_ref())
            {
                return Err(at(
                    id.span(),
                    "identity: must be non-empty, without '/'".into(),
                ));
            }
            if f.user.is_some() != f.password_file.is_some() {
                return Err(at(span, "user and password_file go together".into()));
            }
            if f.cert.is_some() != f.key.is_some() {
                return Err(at(span, "cert and key go together".into()));
            }
            if let Some(e) = endpoints.iter().find(|e| e.starts_with("https://"))
                && f.ca.is_none()
                && f.cert.is_none()
            {
                return Err(at(
                    endpoints_span,
                    format!("etcd endpoint {e:?}: https needs ca (or cert and key)"),
                ));
            }
            Some(FleetPolicy {
                endpoints,
                identity: f.identity.map(Spanned::into_inner),
                prefix: f.prefix.map(Spanned::into_inner),
                ttl_secs: ttl_ms.map(|ms| ms / 1000),
                refresh_ms,
                user: f.user,
                password_file: f.password_file.map(Into::into),
                ca: f.ca.map(Into::into),
                cert: f.cert.map(Into::into),
                key: f.key.map(Into::into),
            })
        }
    };
    Ok((fleet, budgets))
}

/// The `pod`, `container` and `unit` selectors of a scope (or a drill), and the units
/// apart (a scope's selector decides them from the cgroups' paths).
pub(super) fn parse_workloads(
    pod: Option<&RawPod>,
    container: Option<&RawContainer>,
    unit: Option<&Spanned<String>>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<(Vec<WorkloadSelector>, Vec<UnitSelector>), PolicyError> {
    let mut out = Vec::new();
    let mut units = Vec::new();
    if let Some(p) = pod {
        let labels = label_selector(&p.labels, &p.match_expressions, at)?;
        // Only a namespace or name given can be a bad glob.
        let namespace = p.namespace.as_ref();
        let selector = PodSelector::new(namespace.map(|n| n.get_ref().trim()), labels)
            .map_err(|e| at(namespace.map_or(0..0, |n| n.span()), e.0))?;
        out.push(WorkloadSelector::Pod(selector));
    }
    if let Some(c) = container {
        let labels = label_selector(&c.labels, &c.match_expressions, at)?;
        let name = c.name.as_ref();
        let selector = ContainerSelector::new(name.map(|n| n.get_ref().trim()), labels)
            .map_err(|e| at(name.map_or(0..0, |n| n.span()), e.0))?;
        out.push(WorkloadSelector::Container(selector));
    }
    if let Some(u) = unit {
        let unit = UnitSelector::new(u.get_ref().trim()).map_err(|e| at(u.span(), e.0))?;
        units.push(unit.clone());
        out.push(WorkloadSelector::Unit(unit));
    }
    Ok((out, units))
}

/// `labels` and `match_expressions` as a Kubernetes label selector, each bad key,
/// value or operator named where it is written.
fn label_selector(
    labels: &BTreeMap<Spanned<String>, Spanned<String>>,
    expressions: &[Spanned<RawRequirement>],
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<LabelSelector, PolicyError> {
    let alone = |labels: BTreeMap<String, String>, exprs: Vec<Requirement>| {
        LabelSelector::new(labels, exprs).map_err(|e| e.0)
    };
    let mut match_labels = BTreeMap::new();
    for (k, v) in labels {
        let (key, value) = (k.get_ref().clone(), v.get_ref().clone());
        alone(BTreeMap::from([(key.clone(), String::new())]), Vec::new())
            .map_err(|why| at(k.span(), why))?;
        alone(BTreeMap::from([(key.clone(), value.clone())]), Vec::new())
            .map_err(|why| at(v.span(), why))?;
        match_labels.insert(key, value);
    }
    let mut match_expressions = Vec::new();
    for r in expressions {
        let r = r.get_ref();
        let key = r.key.get_ref().clone();
        alone(BTreeMap::from([(key.clone(), String::new())]), Vec::new())
            .map_err(|why| at(r.key.span(), why))?;
        let operator: Operator = r
            .operator
            .get_ref()
            .parse()
            .map_err(|e: SelectorError| at(r.operator.span(), e.0))?;
        let requirement = Requirement {
            key,
            operator,
            values: r
                .values
                .as_ref()
                .map(|v| v.get_ref().clone())
                .unwrap_or_default(),
        };
        let span = r.values.as_ref().map_or(r.operator.span(), |v| v.span());
        alone(BTreeMap::new(), vec![requirement.clone()]).map_err(|why| at(span, why))?;
        match_expressions.push(requirement);
    }
    Ok(LabelSelector::new(match_labels, match_expressions)
        .expect("each label and expression checked above"))
}

fn parse_mode(
    mode: &Option<Spanned<String>>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<u32, PolicyError> {
    match mode {
        None => Ok(MODE_ENFORCE),
        Some(m) if m.get_ref() == "enforce" => Ok(MODE_ENFORCE),
        Some(m) if m.get_ref() == "observe" => Ok(MODE_OBSERVE),
        Some(m) => Err(at(
            m.span(),
            format!(
                "mode must be \"enforce\" or \"observe\", not {:?}",
                m.get_ref()
            ),
        )),
    }
}

fn parse_listeners(
    raw: Vec<Spanned<RawListener>>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<Vec<ListenerPolicy>, PolicyError> {
    let mut names = HashSet::new();
    let mut out = Vec::new();
    for l in raw {
        let span = l.span();
        let l = l.into_inner();
        let name = l.name.get_ref().trim().to_string();
        if let Some(reason) = bad_name(&name) {
            return Err(at(l.name.span(), format!("listener name {reason}")));
        }
        if !names.insert(name.clone()) {
            return Err(at(
                l.name.span(),
                format!("listener name {name:?} is used twice"),
            ));
        }
        if let Some(s) = &l.scope {
            return Err(at(
                s.span(),
                "listener scope = is not supported yet; name the listener's netns".into(),
            ));
        }
        if l.ports.is_empty() {
            return Err(at(span, format!("listener {name:?} needs ports")));
        }
        let mut ports = Vec::new();
        for p in &l.ports {
            ports.push(parse_ports(p.get_ref()).map_err(|reason| at(p.span(), reason))?);
        }
        let addr =
            match &l.addr {
                None => None,
                Some(a) => Some(a.get_ref().trim().parse::<IpAddr>().map_err(|_| {
                    at(a.span(), format!("{:?} is not an IP address", a.get_ref()))
                })?),
            };
        let accept_queue_watermark = fraction(
            &l.accept_queue_watermark,
            "accept_queue_watermark",
            "the backlog",
            at,
        )?;
        let max_syn_recv = at_least_one(&l.max_syn_recv, "max_syn_recv", at)?.map(|n| n as u32);
        let per_source = l.per_source.map(|p| parse_per_source(p, at)).transpose()?;
        if accept_queue_watermark.is_none() && max_syn_recv.is_none() && per_source.is_none() {
            return Err(at(
                span,
                format!(
                    "listener {name:?} needs accept_queue_watermark, max_syn_recv or per_source"
                ),
            ));
        }
        out.push(ListenerPolicy {
            name,
            ports,
            addr,
            netns: l.netns.map(|n| n.into_inner().into()),
            interfaces: l.interfaces,
            accept_queue_watermark,
            max_syn_recv,
            per_source,
            mode: parse_mode(&l.mode, at)?,
        });
    }
    Ok(out)
}

/// A listener guard's `per_source` table: prefix lengths, at least one limit, and the
/// action.
fn parse_per_source(
    raw: Spanned<RawPerSource>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<PerSourcePolicy, PolicyError> {
    use guard_common::callers::{PER_SOURCE_DROP, PER_SOURCE_RST};
    let span = raw.span();
    let p = raw.into_inner();
    let prefix = |v: &Option<Spanned<i64>>, key: &str, max: i64, default: u8| match v {
        None => Ok(default),
        Some(n) if (0..=max).contains(n.get_ref()) => Ok(*n.get_ref() as u8),
        Some(n) => Err(at(
            n.span(),
            format!(
                "{key} must be a prefix length from 0 to {max} bits (got {})",
                n.get_ref()
            ),
        )),
    };
    let limits = parse_limits(
        RawLimits {
            max_connections: &p.max_connections,
            max_connecting: &None,
            rate: &p.rate,
            burst: &p.burst,
        },
        at,
    )?;
    let max_connections = match (limits.max_connections, &p.max_connections) {
        (Some(n), Some(v)) if n > u32::MAX as u64 => {
            return Err(at(
                v.span(),
                format!("max_connections must be at most {} (got {n})", u32::MAX),
            ));
        }
        (n, _) => n.map(|n| n as u32),
    };
    if max_connections.is_none() && limits.rate.is_none() {
        return Err(at(
            span,
            "per_source needs max_connections or rate (like rate = \"50/s\")".into(),
        ));
    }
    let action = match p.action.as_ref().map(|a| a.get_ref().as_str()) {
        None | Some("rst") => PER_SOURCE_RST,
        Some("drop") => PER_SOURCE_DROP,
        Some(other) => {
            let span = p.action.as_ref().map_or(span, |a| a.span());
            return Err(at(
                span,
                format!("action must be \"rst\" or \"drop\", not {other:?}"),
            ));
        }
    };
    Ok(PerSourcePolicy {
        prefix: prefix(&p.prefix, "prefix", 32, 32)?,
        prefix6: prefix(&p.prefix6, "prefix6", 128, 64)?,
        max_connections,
        rate: limits.rate,
        action,
    })
}

fn parse_rule(
    r: RawRule,
    index: usize,
    span: Range<usize>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<Rule, PolicyError> {
    let port_watermark = fraction(
        &r.port_watermark,
        "port_watermark",
        "the ephemeral range",
        at,
    )?;
    let name = match &r.name {
        Some(n) => {
            let name = n.get_ref().trim().to_string();
            if let Some(reason) = bad_name(&name) {
                return Err(at(n.span(), format!("rule name {reason}")));
            }
            name
        }
        None => format!("rule{}", index + 1),
    };
    let mut dst = Vec::new();
    for d in r.dst.iter().flatten() {
        dst.push(parse_net(d.get_ref()).map_err(|reason| at(d.span(), reason))?);
    }
    let mut ports = Vec::new();
    for p in r.ports.iter().flatten() {
        ports.push(parse_ports(p.get_ref()).map_err(|reason| at(p.span(), reason))?);
    }
    if ports.len() > MAX_PORT_RANGES {
        return Err(at(
            span,
            format!(
                "rule {name:?} lists {} port ranges; at most {MAX_PORT_RANGES}",
                ports.len()
            ),
        ));
    }
    let per_endpoint = match r.per.as_ref().map(|p| p.get_ref().as_str()) {
        None | Some("endpoint") => true,
        Some("rule") => false,
        Some(other) => {
            let span = r.per.as_ref().map_or(span, |p| p.span());
            return Err(at(
                span,
                format!("per must be \"endpoint\" or \"rule\", not {other:?}"),
            ));
        }
    };
    let limits = parse_limits(
        RawLimits {
            max_connections: &r.max_connections,
            max_connecting: &r.max_connecting,
            rate: &r.rate,
            burst: &r.burst,
        },
        at,
    )?;
    let breaker = r.breaker.map(|b| parse_breaker(b, at)).transpose()?;
    let fleet = match &r.fleet {
        None => None,
        Some(f) => {
            let clash = [
                (
                    r.max_connections.as_ref().map(Spanned::span),
                    "max_connections",
                ),
                (r.per.as_ref().map(Spanned::span), "per"),
                // An empty `dst = []` has no span of its own: the rule's names it.
                (
                    r.dst
                        .as_ref()
                        .map(|d| d.first().map_or(span.clone(), Spanned::span)),
                    "dst",
                ),
                (
                    r.ports
                        .as_ref()
                        .map(|p| p.first().map_or(span.clone(), Spanned::span)),
                    "ports",
                ),
            ];
            if let Some((Some(span), key)) = clash.into_iter().find(|(s, _)| s.is_some()) {
                return Err(at(
                    span,
                    format!(
                        "rule {name:?} draws from fleet budget {:?}: its {key} is the \
                         budget's (dst, ports), or this host's share of it \
                         (max_connections, for the whole rule)",
                        f.get_ref()
                    ),
                ));
            }
            Some(f.get_ref().trim().to_string())
        }
    };
    Ok(Rule {
        name,
        dst,
        ports,
        limits,
        breaker,
        per_endpoint: per_endpoint && fleet.is_none(),
        port_watermark,
        fleet,
    })
}

/// The limit keys a scope and a rule share.
struct RawLimits<'a> {
    max_connections: &'a Option<Spanned<i64>>,
    max_connecting: &'a Option<Spanned<i64>>,
    rate: &'a Option<Spanned<String>>,
    burst: &'a Option<Spanned<i64>>,
}

/// Most tokens a bucket may hold.
const MAX_BURST: i64 = 1_000_000;

fn parse_limits(
    raw: RawLimits,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<Limits, PolicyError> {
    let max_connecting = at_least_one(raw.max_connecting, "max_connecting", at)?;
    let max_connecting = match (max_connecting, raw.max_connecting) {
        (Some(n), Some(v)) if n > u32::MAX as u64 => {
            return Err(at(
                v.span(),
                format!("max_connecting must be at most {} (got {n})", u32::MAX),
            ));
        }
        (n, _) => n.map(|n| n as u32),
    };
    let rate = match (raw.rate, raw.burst) {
        (None, None) => None,
        (None, Some(b)) => {
            return Err(at(
                b.span(),
                "burst needs a rate (like rate = \"200/s\")".into(),
            ));
        }
        (Some(r), burst) => {
            let (count, unit) = parse_rate(r.get_ref()).map_err(|reason| at(r.span(), reason))?;
            // By default the bucket holds one second's tokens (at least one).
            let burst = match burst {
                None => (count * 1_000_000_000).div_ceil(unit.ns()).max(1) as i64,
                Some(b) if (1..=MAX_BURST).contains(b.get_ref()) => *b.get_ref(),
                Some(b) => {
                    return Err(at(
                        b.span(),
                        format!(
                            "burst must be 1 to {MAX_BURST} attempts (got {})",
                            b.get_ref()
                        ),
                    ));
                }
            };
            Some(Rate {
                count,
                unit,
                burst: burst.min(MAX_BURST) as u32,
            })
        }
    };
    Ok(Limits {
        max_connections: at_least_one(raw.max_connections, "max_connections", at)?,
        max_connecting,
        rate,
    })
}

/// `N/s` or `N/min`: N new connection attempts per second or minute, N at least 1 and
/// at most one a nanosecond.
fn parse_rate(text: &str) -> Result<(u64, RateUnit), String> {
    let bad = |why: &str| format!("rate {text:?} {why}; write it like \"200/s\" or \"30/min\"");
    let (n, unit) = text.split_once('/').ok_or_else(|| bad("has no unit"))?;
    let unit = match unit.trim() {
        "s" => RateUnit::Second,
        "min" => RateUnit::Minute,
        _ => return Err(bad("has an unknown unit (known: s, min)")),
    };
    let count: u64 = n
        .trim()
        .parse()
        .map_err(|_| bad("does not start with a whole number"))?;
    if count == 0 {
        return Err(bad(
            "is 0, which would shed every attempt (leave it out for no rate)",
        ));
    }
    if count > unit.ns() {
        return Err(bad("is more than one attempt a nanosecond"));
    }
    Ok((count, unit))
}

/// An errno name of [`ERRNOS`].
pub(super) fn parse_errno(
    e: &Option<Spanned<String>>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<Option<i32>, PolicyError> {
    let Some(e) = e else {
        return Ok(None);
    };
    match super::errno(e.get_ref()) {
        Some(v) => Ok(Some(v)),
        None => {
            let known: Vec<_> = ERRNOS.iter().map(|(n, _)| *n).collect();
            Err(at(
                e.span(),
                format!(
                    "unknown errno {:?}; use one of {}",
                    e.get_ref(),
                    known.join(", ")
                ),
            ))
        }
    }
}

/// A breaker's table, with its defaults: window 10 s, 20 samples, failure ratio 0.5,
/// open 5 s to 60 s, ramp 10, 30, 60, 100 % by 5 successes; slow_ratio 0.8 when
/// slow_connect_ms is set.
fn parse_breaker(
    raw: Spanned<RawBreaker>,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<BreakerPolicy, PolicyError> {
    let span = raw.span();
    let b = raw.into_inner();
    let duration = |v: &Option<Spanned<String>>, key: &str, default_ns: u64| match v {
        None => Ok(default_ns),
        Some(d) => parse_duration(d.get_ref()).map_err(|why| at(d.span(), format!("{key} {why}"))),
    };
    let window_ns = duration(&b.window, "window", 10_000_000_000)?;
    if window_ns < 100_000_000 {
        let w = b.window.as_ref().expect("set");
        return Err(at(
            w.span(),
            format!("window must be at least 100ms (got {:?})", w.get_ref()),
        ));
    }
    let open_ns = duration(&b.open_for, "open_for", 5_000_000_000)?;
    let max_open_ns = duration(&b.max_open_for, "max_open_for", 60_000_000_000.max(open_ns))?;
    if max_open_ns < open_ns {
        return Err(at(
            b.max_open_for.as_ref().map_or(span.clone(), |m| m.span()),
            "max_open_for must be at least open_for".into(),
        ));
    }
    let count = |v: &Option<Spanned<i64>>, key: &str, default: i64, max: i64| match v {
        None => Ok(default as u32),
        Some(n) if (1..=max).contains(n.get_ref()) => Ok(*n.get_ref() as u32),
        Some(n) => Err(at(
            n.span(),
            format!("{key} must be 1 to {max} (got {})", n.get_ref()),
        )),
    };
    let min_samples = count(&b.min_samples, "min_samples", 20, 100_000)?;
    let step_successes = count(&b.step_successes, "step_successes", 5, 100_000)?;
    let ratio = |v: &Option<Spanned<f64>>, key: &str| fraction(v, key, "the window's outcomes", at);
    let failure_permille = ratio(&b.failure_ratio, "failure_ratio")?.unwrap_or(500);
    let slow_connect_ns = match &b.slow_connect_ms {
        None => None,
        Some(ms) if *ms.get_ref() >= 1 => Some(*ms.get_ref() as u64 * 1_000_000),
        Some(ms) => {
            return Err(at(
                ms.span(),
                format!("slow_connect_ms must be at least 1 (got {})", ms.get_ref()),
            ));
        }
    };
    let slow_permille = ratio(&b.slow_ratio, "slow_ratio")?;
    let slow_permille = match (slow_permille, slow_connect_ns) {
        (Some(_), None) => {
            let r = b.slow_ratio.as_ref().expect("set");
            return Err(at(r.span(), "slow_ratio needs slow_connect_ms".into()));
        }
        (None, Some(_)) => Some(800),
        (p, _) => p,
    };
    let ramp = match &b.ramp {
        None => vec![10, 30, 60, 100],
        Some(r) => parse_ramp(r.get_ref()).map_err(|why| at(r.span(), why))?,
    };
    Ok(BreakerPolicy {
        window_ns,
        min_samples,
        failure_permille,
        slow_permille,
        slow_connect_ns,
        open_ns,
        max_open_ns,
        ramp,
        step_successes,
        errno: parse_errno(&b.errno, at)?,
    })
}

/// `N` followed by `ms`, `s` or `min`, in ns; N a whole number, at least 1.
pub(super) fn parse_duration(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(digits);
    let ns = match unit.trim() {
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "min" => 60_000_000_000,
        _ => {
            return Err(format!(
                "{text:?} has no known unit (ms, s, min); write it like \"10s\""
            ));
        }
    };
    const DAY_NS: u64 = 24 * 60 * 60 * 1_000_000_000;
    match n.parse::<u64>().ok().and_then(|n| n.checked_mul(ns)) {
        Some(d) if (1..=DAY_NS).contains(&d) => Ok(d),
        _ => Err(format!(
            "{text:?} is not a whole number of {unit}, at least 1 and at most a day"
        )),
    }
}

/// Percents, each 1 to 100, rising, ending at 100: at most MAX_RAMP_STEPS.
fn parse_ramp(steps: &[Spanned<i64>]) -> Result<Vec<u8>, String> {
    if steps.is_empty() || steps.len() > MAX_RAMP_STEPS {
        return Err(format!(
            "ramp must have 1 to {MAX_RAMP_STEPS} steps (has {})",
            steps.len()
        ));
    }
    let mut out: Vec<u8> = Vec::new();
    for s in steps {
        let p = *s.get_ref();
        if !(1..=100).contains(&p) {
            return Err(format!("ramp steps are percents from 1 to 100 (got {p})"));
        }
        if let Some(&last) = out.last()
            && p <= last as i64
        {
            return Err(format!("ramp must rise: {p} after {last}"));
        }
        out.push(p as u8);
    }
    if out.last() != Some(&100) {
        return Err(format!(
            "ramp must rise to 100 (ends at {})",
            out.last().expect("not empty")
        ));
    }
    Ok(out)
}

/// A fraction in (0, 1] of `of`, kept in thousandths (at least 1).
pub(super) fn fraction(
    v: &Option<Spanned<f64>>,
    key: &str,
    of: &str,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<Option<u32>, PolicyError> {
    match v {
        None => Ok(None),
        Some(w) if *w.get_ref() > 0.0 && *w.get_ref() <= 1.0 => {
            Ok(Some((w.get_ref() * 1000.0).round().max(1.0) as u32))
        }
        Some(w) => Err(at(
            w.span(),
            format!(
                "{key} must be a fraction of {of} in (0, 1], like 0.8 (got {})",
                w.get_ref()
            ),
        )),
    }
}

/// A count of at least 1; leaving the key out means none.
pub(super) fn at_least_one(
    v: &Option<Spanned<i64>>,
    key: &str,
    at: &impl Fn(Range<usize>, String) -> PolicyError,
) -> Result<Option<u64>, PolicyError> {
    match v {
        None => Ok(None),
        Some(n) if *n.get_ref() >= 1 => Ok(Some(*n.get_ref() as u64)),
        Some(n) => Err(at(
            n.span(),
            format!(
                "{key} must be at least 1 (got {}); leave it out for no budget",
                n.get_ref()
            ),
        )),
    }
}

/// An address or CIDR; host bits must be zero.
pub(super) fn parse_net(s: &str) -> Result<IpNet, String> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(IpNet::from(ip));
    }
    let net: IpNet = s
        .parse()
        .map_err(|_| format!("{s:?} is not an IP address or CIDR"))?;
    if net.trunc() != net {
        return Err(format!(
            "{s:?} has host bits set; did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

pub(super) fn parse_ports(p: &PortSpec) -> Result<PortRange, String> {
    let port = |n: i64| -> Result<u16, String> {
        if (1..=65535).contains(&n) {
            Ok(n as u16)
        } else {
            Err(format!("port {n} is out of range 1-65535"))
        }
    };
    let number = |s: &str| -> Result<u16, String> {
        port(
            s.trim()
                .parse::<i64>()
                .map_err(|_| format!("{s:?} is not a port number"))?,
        )
    };
    match p {
        PortSpec::Number(n) => port(*n).map(|p| PortRange { first: p, last: p }),
        PortSpec::Text(s) => {
            let (first, last) = match s.split_once('-') {
                Some((a, b)) => (number(a)?, number(b)?),
                None => (number(s)?, number(s)?),
            };
            if first > last {
                return Err(format!("port range {s:?} is reversed"));
            }
            Ok(PortRange { first, last })
        }
    }
}

/// The kernel keeps at most MAX_CANDIDATES rules per destination prefix.
fn check_overlap(rules: &[Rule]) -> Result<(), String> {
    for prefix in rule_prefixes(rules) {
        let n = candidates_of(rules, &prefix).len();
        if n > MAX_CANDIDATES {
            let prefix = unmapped_net(&prefix);
            return Err(format!(
                "{n} rules can match destinations in {prefix}; at most {MAX_CANDIDATES} may overlap"
            ));
        }
    }
    Ok(())
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::policy::{DEFAULT_POLICY, DEFAULT_SOURCE};

    fn err(text: &str) -> String {
        parse(text, "p.toml").unwrap_err().to_string()
    }

    const GOOD: &str = r#"
[[scope]]
name = "orders"
cgroup = "/system.slice/orders.service/"
max_connections = 500

[[scope.rule]]
name = "risk"
dst = ["10.20.0.0/16", "fd00::/64", "192.0.2.7"]
ports = ["8080", "9000-9100", 443]
max_connections = 20
per = "rule"
"#;

    #[test]
    fn parses_the_design_vocabulary() {
        let p = parse(GOOD, "p.toml").unwrap();
        let s = &p.scopes[0];
        assert_eq!(
            (s.name.as_str(), s.cgroup.as_deref(), s.mode, s.errno),
            (
                "orders",
                Some("system.slice/orders.service"),
                MODE_ENFORCE,
                libc::ECONNREFUSED
            )
        );
        assert_eq!(s.limits.max_connections, Some(500));
        let r = &s.rules[0];
        assert_eq!(r.dst.len(), 3);
        assert_eq!(
            r.ports,
            [
                PortRange {
                    first: 8080,
                    last: 8080
                },
                PortRange {
                    first: 9000,
                    last: 9100
                },
                PortRange {
                    first: 443,
                    last: 443
                }
            ]
        );
        assert_eq!(
            (r.limits.max_connections, r.per_endpoint),
            (Some(20), false)
        );
    }

    #[test]
    fn the_embedded_default_observes_the_whole_host() {
        let p = parse(DEFAULT_POLICY, DEFAULT_SOURCE).unwrap();
        assert_eq!(p.scopes.len(), 1);
        assert_eq!(
            (
                p.scopes[0].cgroup.as_deref(),
                p.scopes[0].mode,
                p.scopes[0].limits.max_connections
            ),
            (Some(""), MODE_OBSERVE, None)
        );
    }

    #[test]
    fn errors_name_file_line_column_and_reason() {
        assert_eq!(
            err("[[scope]\nname = 1"),
            "p.toml:1:8: invalid table header\nexpected `.`, `]]`"
        );
        assert!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x\"\nbudget = 3\n")
                .starts_with("p.toml:4:1: unknown field `budget`")
        );
        assert_eq!(
            err(
                "[[scope]]\nname = \"a\"\ncgroup = \"x\"\n[[scope.rule]]\ndst = [\"10.0.0.300/8\"]\n"
            ),
            "p.toml:5:8: \"10.0.0.300/8\" is not an IP address or CIDR"
        );
        assert_eq!(
            err(
                "[[scope]]\nname = \"a\"\ncgroup = \"x\"\n[[scope.rule]]\ndst = [\"10.1.0.0/8\"]\n"
            ),
            "p.toml:5:8: \"10.1.0.0/8\" has host bits set; did you mean 10.0.0.0/8?"
        );
        assert_eq!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x\"\n[[scope.rule]]\nports = [\"70000\"]\n"),
            "p.toml:5:10: port 70000 is out of range 1-65535"
        );
        assert_eq!(
            err(
                "[[scope]]\nname = \"a\"\ncgroup = \"x\"\n[[scope]]\nname = \"a\"\ncgroup = \"y\"\n"
            ),
            "p.toml:5:8: duplicate scope name \"a\""
        );
        assert_eq!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x\"\nmax_connections = 0\n"),
            "p.toml:4:19: max_connections must be at least 1 (got 0); leave it out for no budget"
        );
        assert_eq!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x\"\nerrno = \"ENOPE\"\n"),
            "p.toml:4:9: unknown errno \"ENOPE\"; use one of ECONNREFUSED, EPERM, EACCES, ECONNRESET, ETIMEDOUT, ENETUNREACH, EHOSTUNREACH, EADDRNOTAVAIL, EAGAIN"
        );
        assert_eq!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x\"\nmode = \"shed\"\n"),
            "p.toml:4:8: mode must be \"enforce\" or \"observe\", not \"shed\""
        );
        assert_eq!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x[\"\n"),
            "p.toml:3:10: bad cgroup pattern: unclosed character class; missing ']'"
        );
    }

    #[test]
    fn workload_selectors_parse_and_name_their_errors() {
        let p = parse(
            "[[scope]]\nname = \"orders\"\n\
             pod = { namespace = \"shop\", labels = { app = \"orders\" }, match_expressions = [{ key = \"tier\", operator = \"In\", values = [\"web\"] }] }\n\
             annotations = true\n\
             [[scope]]\nname = \"web\"\ncgroup = \"x\"\ncontainer = { name = \"web-*\" }\nunit = \"web.service\"\n",
            "p.toml",
        )
        .unwrap();
        let (orders, web) = (&p.scopes[0], &p.scopes[1]);
        assert_eq!(orders.cgroup, None);
        assert!(orders.annotations);
        assert_eq!(
            orders.workloads[0].to_string(),
            "pod namespace=shop app=orders,tier in (web)"
        );
        assert!(web.selector.selects("x"));
        assert!(web.selector.selects("system.slice/web.service"));
        assert!(!web.selector.selects("system.slice/db.service"));
        assert_eq!(web.workloads.len(), 2);
        // A selector table implied by the header of its labels, or by dotted keys, as
        // connguard-api's builder writes a selector without a namespace or name.
        for text in [
            "[[scope]]\nname = \"a\"\n[scope.pod.labels]\napp = \"orders\"\n",
            "[[scope]]\nname = \"a\"\ncontainer.labels.app = \"orders\"\n",
        ] {
            let p = parse(text, "p.toml").unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(
                p.scopes[0].workloads[0]
                    .to_string()
                    .ends_with(" app=orders")
            );
        }
        assert_eq!(
            err("[[scope]]\nname = \"a\"\n[scope.pod.labels]\n\"-app\" = \"orders\"\n"),
            "p.toml:4:1: label key \"-app\": the name must be 1 to 63 characters, alphanumeric at both ends, with '-', '_' and '.' inside"
        );
        // Each error at the token named, on line 3.
        let head = "[[scope]]\nname = \"a\"\n";
        for (text, at, why) in [
            (
                "pod = { match_expressions = [{ key = \"tier\", operator = \"Equals\", values = [\"web\"] }] }",
                "\"Equals\"",
                "unknown operator \"Equals\": one of In, NotIn, Exists, DoesNotExist",
            ),
            (
                "pod = { match_expressions = [{ key = \"tier\", operator = \"Exists\", values = [\"web\"] }] }",
                "[\"web\"]",
                "\"tier\": values may not be given with operator Exists",
            ),
            (
                "pod = { match_expressions = [{ key = \"tier\", operator = \"In\" }] }",
                "\"In\"",
                "\"tier\": values must be given with operator In",
            ),
            (
                "container = { match_expressions = [{ key = \"Tier/x\", operator = \"Exists\" }] }",
                "\"Tier/x\"",
                "label key \"Tier/x\": the prefix must be a DNS subdomain (lower case, at most 253 characters)",
            ),
            (
                "pod = { labels = { \"-app\" = \"orders\" } }",
                "\"-app\"",
                "label key \"-app\": the name must be 1 to 63 characters, alphanumeric at both ends, with '-', '_' and '.' inside",
            ),
            (
                "pod = { labels = { app = \"orders-\" } }",
                "\"orders-\"",
                "label \"app\": value \"orders-\" must be at most 63 characters, alphanumeric at both ends, with '-', '_' and '.' inside",
            ),
            (
                "pod = { namespace = \"shop[\" }",
                "\"shop[\"",
                "namespace \"shop[\": unclosed character class; missing ']'",
            ),
            (
                "unit = \"orders\"",
                "\"orders\"",
                "unit \"orders\": a unit name ends in .service, .scope, .slice, .socket, .mount or .swap",
            ),
            (
                "pod = { namespace = \"shop\", name = \"x\" }",
                "name = ",
                "unknown field `name`, expected one of `namespace`, `labels`, `match_expressions`",
            ),
        ] {
            let col = text.find(at).unwrap() + 1;
            assert_eq!(
                err(&format!("{head}{text}\n")),
                format!("p.toml:3:{col}: {why}"),
                "{text}"
            );
        }
        assert_eq!(
            err("[[scope]]\nname = \"a\"\nmax_connections = 5\n"),
            "p.toml:2:8: scope \"a\" selects nothing: give it cgroup, pod, container or unit"
        );
        assert_eq!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x\"\nannotations = true\n"),
            "p.toml:4:15: annotations = true needs a pod selector: they are pods' annotations"
        );
        assert_eq!(
            err("[[scope]]\nname = \"a/b\"\ncgroup = \"x\"\n"),
            "p.toml:2:8: scope name \"a/b\" has a '/', which names the scopes of annotated pods (SCOPE/NAMESPACE/POD)"
        );
    }

    #[test]
    fn rates_and_handshake_budgets_parse_and_name_their_errors() {
        let p = parse(
            "[[scope]]\nname = \"a\"\ncgroup = \"x\"\nrate = \"200/s\"\nburst = 50\nmax_connecting = 20\n\
             [[scope.rule]]\nrate = \"30/min\"\n[[scope.rule]]\nrate = \"3/s\"\n",
            "p.toml",
        )
        .unwrap();
        let s = &p.scopes[0];
        let rate = s.limits.rate.as_ref().unwrap();
        assert_eq!(
            (rate.to_string(), rate.burst, rate.interval_ns()),
            ("200/s".into(), 50, 5_000_000)
        );
        assert_eq!(s.limits.max_connecting, Some(20));
        // One second's tokens by default, at least one; intervals rounded to the ns.
        let r = s.rules[0].limits.rate.as_ref().unwrap();
        assert_eq!((r.burst, r.interval_ns()), (1, 2_000_000_000));
        let r = s.rules[1].limits.rate.as_ref().unwrap();
        assert_eq!((r.burst, r.interval_ns()), (3, 333_333_333));
        let head = "[[scope]]\nname = \"a\"\ncgroup = \"x\"\n";
        for (text, want) in [
            (
                "rate = \"0/s\"",
                "p.toml:4:8: rate \"0/s\" is 0, which would shed every attempt (leave it out for no rate); write it like \"200/s\" or \"30/min\"",
            ),
            (
                "rate = \"5/h\"",
                "p.toml:4:8: rate \"5/h\" has an unknown unit (known: s, min); write it like \"200/s\" or \"30/min\"",
            ),
            (
                "rate = \"200\"",
                "p.toml:4:8: rate \"200\" has no unit; write it like \"200/s\" or \"30/min\"",
            ),
            (
                "rate = \"1.5/s\"",
                "p.toml:4:8: rate \"1.5/s\" does not start with a whole number; write it like \"200/s\" or \"30/min\"",
            ),
            (
                "burst = 5",
                "p.toml:4:9: burst needs a rate (like rate = \"200/s\")",
            ),
            (
                "rate = \"1/s\"\nburst = 0",
                "p.toml:5:9: burst must be 1 to 1000000 attempts (got 0)",
            ),
            (
                "max_connecting = 0",
                "p.toml:4:18: max_connecting must be at least 1 (got 0); leave it out for no budget",
            ),
        ] {
            assert_eq!(err(&format!("{head}{text}\n")), want, "{text}");
        }
    }

    #[test]
    fn breakers_parse_with_defaults_and_name_their_errors() {
        let p = parse(
            "[[scope]]\nname = \"a\"\ncgroup = \"x\"\n[scope.breaker]\n\
             [[scope.rule]]\n[scope.rule.breaker]\nwindow = \"2s\"\nmin_samples = 4\nfailure_ratio = 0.25\n\
             slow_connect_ms = 200\nopen_for = \"500ms\"\nmax_open_for = \"1min\"\nramp = [50, 100]\n\
             step_successes = 2\nerrno = \"EHOSTUNREACH\"\n",
            "p.toml",
        )
        .unwrap();
        let s = &p.scopes[0];
        assert_eq!(
            s.breaker,
            Some(BreakerPolicy {
                window_ns: 10_000_000_000,
                min_samples: 20,
                failure_permille: 500,
                slow_permille: None,
                slow_connect_ns: None,
                open_ns: 5_000_000_000,
                max_open_ns: 60_000_000_000,
                ramp: vec![10, 30, 60, 100],
                step_successes: 5,
                errno: None,
            })
        );
        assert_eq!(
            s.rules[0].breaker,
            Some(BreakerPolicy {
                window_ns: 2_000_000_000,
                min_samples: 4,
                failure_permille: 250,
                slow_permille: Some(800),
                slow_connect_ns: Some(200_000_000),
                open_ns: 500_000_000,
                max_open_ns: 60_000_000_000,
                ramp: vec![50, 100],
                step_successes: 2,
                errno: Some(libc::EHOSTUNREACH),
            })
        );
        let head = "[[scope]]\nname = \"a\"\ncgroup = \"x\"\n[scope.breaker]\n";
        for (text, want) in [
            (
                "failure_ratio = 1.5",
                "p.toml:5:17: failure_ratio must be a fraction of the window's outcomes in (0, 1], like 0.8 (got 1.5)",
            ),
            (
                "ramp = [10, 30, 60]",
                "p.toml:5:8: ramp must rise to 100 (ends at 60)",
            ),
            (
                "ramp = [30, 10, 100]",
                "p.toml:5:8: ramp must rise: 10 after 30",
            ),
            (
                "window = \"10h\"",
                "p.toml:5:10: window \"10h\" has no known unit (ms, s, min); write it like \"10s\"",
            ),
            (
                "window = \"50ms\"",
                "p.toml:5:10: window must be at least 100ms (got \"50ms\")",
            ),
            (
                "slow_ratio = 0.5",
                "p.toml:5:14: slow_ratio needs slow_connect_ms",
            ),
            (
                "open_for = \"10s\"\nmax_open_for = \"5s\"",
                "p.toml:6:16: max_open_for must be at least open_for",
            ),
            (
                "min_samples = 0",
                "p.toml:5:15: min_samples must be 1 to 100000 (got 0)",
            ),
            ("trip = 3", "p.toml:5:1: unknown field `trip`"),
        ] {
            let got = err(&format!("{head}{text}\n"));
            assert!(got.starts_with(want), "{text}: {got}");
        }
    }

    #[test]
    fn port_watermarks_are_fractions_kept_in_thousandths() {
        let p = parse(
            "[[scope]]\nname = \"a\"\ncgroup = \"x\"\nport_watermark = 0.8\n[[scope.rule]]\nport_watermark = 1\n",
            "p.toml",
        )
        .unwrap();
        assert_eq!(
            (
                p.scopes[0].port_watermark,
                p.scopes[0].rules[0].port_watermark
            ),
            (Some(800), Some(1000))
        );
        assert_eq!(
            err("[[scope]]\nname = \"a\"\ncgroup = \"x\"\nport_watermark = 1.5\n"),
            "p.toml:4:18: port_watermark must be a fraction of the ephemeral range in (0, 1], like 0.8 (got 1.5)"
        );
    }

    #[test]
    fn listener_guards_parse_and_name_their_errors() {
        let p = parse(
            "[[listener]]\nname = \"api\"\nports = [\"8080\", 9000]\naddr = \"10.0.0.5\"\nnetns = \"/run/netns/api\"\naccept_queue_watermark = 0.8\nmode = \"observe\"\n",
            "p.toml",
        )
        .unwrap();
        let l = &p.listeners[0];
        assert_eq!(
            (
                l.name.as_str(),
                l.ports.len(),
                l.accept_queue_watermark,
                l.max_syn_recv,
                l.mode
            ),
            ("api", 2, Some(800), None, MODE_OBSERVE)
        );
        assert_eq!(
            err("[[listener]]\nname = \"api\"\nports = [\"8080\"]\n"),
            "p.toml:1:1: listener \"api\" needs accept_queue_watermark, max_syn_recv or per_source"
        );
        assert_eq!(
            err("[[listener]]\nname = \"api\"\nports = [\"8080\"]\naccept_queue_watermark = 2.0\n"),
            "p.toml:4:26: accept_queue_watermark must be a fraction of the backlog in (0, 1], like 0.8 (got 2)"
        );
    }

    #[test]
    fn too_many_overlapping_rules_are_refused() {
        let mut text = String::from("[[scope]]\nname = \"a\"\ncgroup = \"x\"\n");
        for i in 0..=MAX_CANDIDATES {
            text += &format!(
                "[[scope.rule]]\nname = \"r{i}\"\nports = [\"{}\"]\n",
                1000 + i
            );
        }
        assert_eq!(
            err(&text),
            "p.toml:1:1: 9 rules can match destinations in ::/0; at most 8 may overlap"
        );
    }

    /// The field names a derived `Deserialize` of a struct reads: what the parser
    /// accepts of a table.
    fn fields<'de, T: Deserialize<'de>>() -> BTreeSet<&'static str> {
        use serde::de::{Error, Visitor, value};
        struct Fields(&'static [&'static str]);
        impl<'de> serde::Deserializer<'de> for &mut Fields {
            type Error = value::Error;
            fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, value::Error> {
                Err(value::Error::custom("not a struct"))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: &'static [&'static str],
                _: V,
            ) -> Result<V::Value, value::Error> {
                self.0 = fields;
                Err(value::Error::custom("fields read"))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
                enum identifier ignored_any
            }
        }
        let mut f = Fields(&[]);
        let _ = T::deserialize(&mut f);
        f.0.iter().copied().collect()
    }

    /// connguard_api's policy builder, with every key set, writes a file this parser
    /// takes as written, and each of its tables holds exactly the keys the parser reads
    /// there: the builder cannot lack a key nor write one the parser refuses.
    #[test]
    fn the_api_builder_sets_exactly_the_keys_the_parser_reads() {
        use connguard_api::policy::{self as api, Labelled, Limited};
        let breaker = api::Breaker::new()
            .window("2s")
            .min_samples(4)
            .failure_ratio(0.25)
            .slow_ratio(0.5)
            .slow_connect_ms(200)
            .open_for("500ms")
            .max_open_for("1min")
            .ramp([50, 100])
            .step_successes(2)
            .errno("EHOSTUNREACH");
        let policy = api::Policy::new()
            .scope(
                api::Scope::new("s", "x/*")
                    .pod(
                        api::Pods::new()
                            .namespace("shop*")
                            .label("app", "orders")
                            .expression("tier", api::Operator::In, ["web"]),
                    )
                    .container(
                        api::Containers::new()
                            .name("orders-*")
                            .label("app", "orders")
                            .expression("canary", api::Operator::DoesNotExist, [] as [&str; 0]),
                    )
                    .unit("orders.service")
                    .annotations(true)
                    .mode(api::Mode::Observe)
                    .errno("ETIMEDOUT")
                    .max_connections(10)
                    .max_connecting(4)
                    .rate("200/s")
                    .burst(50)
                    .port_watermark(0.9)
                    .breaker(breaker.clone())
                    .rule(
                        api::Rule::new("r")
                            .dst(["10.0.0.0/8", "fd00::1"])
                            .ports([api::Port::from(443), api::Port::from(8000..=8100)])
                            .per(api::Per::Rule)
                            .max_connections(3)
                            .max_connecting(2)
                            .rate("30/min")
                            .burst(5)
                            .port_watermark(0.8)
                            .breaker(breaker),
                    ),
            )
            .listener(
                api::Listener::new("l", [8080])
                    .addr("10.0.0.5")
                    .netns("/run/netns/api")
                    .interfaces(["lo"])
                    .accept_queue_watermark(0.8)
                    .max_syn_recv(100)
                    .per_source(
                        api::PerSource::new()
                            .prefix(24)
                            .prefix6(56)
                            .max_connections(100)
                            .rate("50/s")
                            .burst(100)
                            .action(api::Refusal::Drop),
                    )
                    .mode(api::Mode::Enforce),
            )
            .scope(api::Scope::new("f", "y").rule(api::Rule::new("db").fleet("db")))
            .fleet(
                api::Fleet::new(["https://127.0.0.1:2379"])
                    .identity("node-1")
                    .prefix("/fleet/")
                    .ttl("6s")
                    .refresh("1s")
                    .user("connguard", "/etc/connguard/etcd-password")
                    .ca("/etc/connguard/etcd-ca.pem")
                    .client_certificate("/etc/connguard/c.pem", "/etc/connguard/c.key"),
            )
            .fleet_budget(
                api::FleetBudget::new("db", ["10.20.0.5"], 3000)
                    .ports([3306])
                    .weight(2)
                    .floor(5)
                    .safe_share(1),
            );
        let text = policy.to_toml();
        let p = parse(&text, "p.toml").unwrap_or_else(|e| panic!("{e}\n{text}"));
        let (s, r, l) = (&p.scopes[0], &p.scopes[0].rules[0], &p.listeners[0]);
        assert_eq!(
            (s.mode, s.errno, s.limits.max_connecting, s.port_watermark),
            (MODE_OBSERVE, libc::ETIMEDOUT, Some(4), Some(900))
        );
        assert_eq!(
            (
                r.name.as_str(),
                r.per_endpoint,
                r.limits.rate.as_ref().map(|r| r.burst)
            ),
            ("r", false, Some(5))
        );
        assert_eq!(
            r.breaker.as_ref().map(|b| b.errno),
            Some(Some(libc::EHOSTUNREACH))
        );
        assert_eq!(
            (l.max_syn_recv, l.interfaces.as_slice()),
            (Some(100), &["lo".to_string()][..])
        );
        let ps = l.per_source.as_ref().expect("per_source");
        assert_eq!(
            (
                ps.prefix,
                ps.prefix6,
                ps.max_connections,
                ps.rate.as_ref().map(|r| r.burst),
                ps.action_name()
            ),
            (24, 56, Some(100), Some(100), "drop")
        );

        fn keys(t: &toml::Table) -> BTreeSet<&str> {
            t.keys().map(String::as_str).collect()
        }
        let table = |v: &toml::Value| v.as_table().expect("a table").clone();
        let doc: toml::Table = toml::from_str(&text).unwrap();
        let scope = table(&doc["scope"][0]);
        let rule = table(&scope["rule"][0]);
        let listener = table(&doc["listener"][0]);
        assert_eq!(
            keys(&table(&listener["per_source"])),
            fields::<RawPerSource>()
        );
        assert_eq!(keys(&doc), fields::<RawPolicy>());
        assert_eq!(keys(&scope), fields::<RawScope>());
        let fleet_rule = table(&table(&doc["scope"][1])["rule"][0]);
        assert_eq!(&keys(&rule) | &keys(&fleet_rule), fields::<RawRule>());
        assert_eq!(keys(&table(&doc["fleet"])), fields::<RawFleet>());
        assert_eq!(
            keys(&table(&doc["fleet_budget"][0])),
            fields::<RawFleetBudget>()
        );
        let f = p.fleet.as_ref().expect("[fleet]");
        assert_eq!(
            (
                f.ttl_secs,
                f.refresh_ms,
                p.fleet_budgets[0].weight,
                p.fleet_budgets[0].total
            ),
            (Some(6), Some(1000), 2, 3000)
        );
        assert_eq!(p.scopes[1].rules[0].dst, p.fleet_budgets[0].dst);
        let (pod, container) = (table(&scope["pod"]), table(&scope["container"]));
        assert_eq!(keys(&pod), fields::<RawPod>());
        assert_eq!(keys(&container), fields::<RawContainer>());
        assert_eq!(
            keys(&table(&pod["match_expressions"][0])),
            fields::<RawRequirement>()
        );
        assert_eq!(
            s.workloads
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            [
                "pod namespace=shop* app=orders,tier in (web)",
                "container name=orders-* app=orders,!canary",
                "unit orders.service"
            ]
        );
        assert!(s.annotations);
        for b in [&scope["breaker"], &rule["breaker"]] {
            assert_eq!(keys(&table(b)), fields::<RawBreaker>());
        }
        // `scope` is read to be refused with a reason (not supported yet).
        let mut listener_keys = fields::<RawListener>();
        listener_keys.remove("scope");
        assert_eq!(keys(&listener), listener_keys);
    }

    #[test]
    fn fleet_budgets_are_refused_with_the_reason() {
        let fleet = "[fleet]\nendpoints = [\"http://127.0.0.1:2379\"]\n";
        let budget =
            "[[fleet_budget]]\nname = \"db\"\ndst = [\"10.0.0.5\"]\nmax_connections = 30\n";
        let scope = "[[scope]]\nname = \"s\"\ncgroup = \"x\"\n";
        let draws = "[[scope.rule]]\nname = \"r\"\nfleet = \"db\"\n";
        let ok = format!("{fleet}{budget}{scope}{draws}");
        let p = parse(&ok, "p.toml").unwrap();
        let r = &p.scopes[0].rules[0];
        assert_eq!(
            (r.fleet.as_deref(), r.per_endpoint, r.dst.len()),
            (Some("db"), false, 1)
        );
        assert_eq!(
            err(&format!("{fleet}{budget}{scope}")),
            "p.toml:4:8: fleet budget \"db\": no rule draws from it (give one rule fleet = \"db\")"
        );
        assert_eq!(
            err(&format!("{budget}{scope}{draws}")),
            "p.toml:2:8: fleet budgets need a [fleet] table with the etcd endpoints"
        );
        assert_eq!(
            err(&format!("{fleet}{scope}{draws}")),
            "p.toml:6:1: rule \"r\" of scope \"s\" draws from fleet budget \"db\", which no [[fleet_budget]] declares"
        );
        assert!(
            err(&format!(
                "{fleet}{budget}{scope}{draws}[[scope.rule]]\nname = \"r2\"\nfleet = \"db\"\n"
            ))
            .ends_with("one rule a host draws from a fleet budget"),
        );
        assert!(
            err(&format!(
                "{fleet}{budget}{scope}{draws}dst = [\"10.0.0.6\"]\n"
            ))
            .contains("its dst is the budget's"),
        );
        assert!(
            err(&ok.replace("http://", "https://")).contains("https needs ca (or cert and key)"),
        );
        assert!(err(&ok.replace("30", "0")).contains("max_connections must be at least 1"));
        // The default refresh (2 s) needs a TTL of 6 s at least.
        assert!(
            err(&ok.replace("[fleet]\n", "[fleet]\nttl = \"3s\"\n")).contains(
                "refresh (2000 ms) must be above 0 and at most a third of the ttl (3000 ms)"
            ),
        );
        assert!(err(&format!("{ok}dst = []\n")).contains("its dst is the budget's"));
        assert!(
            err(&format!("{ok}[fleet_budget.x]\n")).contains("unknown field"),
            "a typo is an error"
        );
    }

    #[test]
    fn too_many_scopes_are_refused() {
        let mut text = String::new();
        for i in 0..=MAX_SCOPE_IDS {
            text += &format!("[[scope]]\nname = \"s{i}\"\ncgroup = \"x\"\n");
        }
        let line = 3 * MAX_SCOPE_IDS + 1;
        assert_eq!(
            err(&text),
            format!("p.toml:{line}:1: too many scopes: at most {MAX_SCOPE_IDS}")
        );
    }
}

//! Policy files as data: a builder that writes the TOML `connguard run --policy` and
//! `connguard check` read, with the keys the daemon's parser accepts under their names.
//! A key left unset (`None`, an empty list) is left out of the file, and the parser's
//! default applies. Values are written as the policy file takes them: rates as
//! `"200/s"`, durations as `"10s"`, fractions in (0, 1]; the parser checks them, with a
//! file:line:column error for a bad one.
//!
//! ```
//! use connguard_api::policy::{Limited, Mode, Policy, Rule, Scope};
//!
//! let policy = Policy::new().scope(
//!     Scope::new("orders", "system.slice/orders.service")
//!         .mode(Mode::Observe)
//!         .rule(Rule::new("db").dst(["10.0.0.5"]).ports([5432]).max_connections(20)),
//! );
//! assert!(policy.to_toml().contains("[[scope.rule]]"));
//! ```
use std::{collections::BTreeMap, fmt, ops::RangeInclusive};

use serde::{Deserialize, Serialize};

/// A policy file: its `[[scope]]`, `[[listener]]`, `[fleet]` and `[[fleet_budget]]`
/// tables.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scope: Vec<Scope>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub listener: Vec<Listener>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<Fleet>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fleet_budget: Vec<FleetBudget>,
}

/// `[fleet]`: the etcd that the fleet budgets are shared through, and this host's part.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Fleet {
    pub endpoints: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refresh: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl Fleet {
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Fleet {
        Fleet {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            ..Fleet::default()
        }
    }

    pub fn identity(mut self, identity: &str) -> Fleet {
        self.identity = Some(identity.into());
        self
    }

    pub fn prefix(mut self, prefix: &str) -> Fleet {
        self.prefix = Some(prefix.into());
        self
    }

    /// The lease's TTL, a duration in whole seconds (`"10s"`).
    pub fn ttl(mut self, duration: &str) -> Fleet {
        self.ttl = Some(duration.into());
        self
    }

    pub fn refresh(mut self, duration: &str) -> Fleet {
        self.refresh = Some(duration.into());
        self
    }

    /// An etcd user, and the file whose first line is its password.
    pub fn user(mut self, user: &str, password_file: &str) -> Fleet {
        self.user = Some(user.into());
        self.password_file = Some(password_file.into());
        self
    }

    /// The CA of etcd's certificate (PEM file).
    pub fn ca(mut self, file: &str) -> Fleet {
        self.ca = Some(file.into());
        self
    }

    /// A client certificate and its key (PEM files).
    pub fn client_certificate(mut self, cert: &str, key: &str) -> Fleet {
        self.cert = Some(cert.into());
        self.key = Some(key.into());
        self
    }
}

/// A `[[fleet_budget]]`: a total of active connections toward `dst` (and `ports`),
/// shared by every host; one rule of each host draws from it (`Rule::fleet`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetBudget {
    pub name: String,
    pub dst: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<Port>>,
    pub max_connections: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub safe_share: Option<u64>,
}

impl FleetBudget {
    pub fn new<S: Into<String>>(
        name: &str,
        dst: impl IntoIterator<Item = S>,
        max_connections: u64,
    ) -> FleetBudget {
        FleetBudget {
            name: name.into(),
            dst: dst.into_iter().map(Into::into).collect(),
            max_connections,
            ..FleetBudget::default()
        }
    }

    pub fn ports<P: Into<Port>>(mut self, ports: impl IntoIterator<Item = P>) -> FleetBudget {
        self.ports = Some(ports.into_iter().map(Into::into).collect());
        self
    }

    pub fn weight(mut self, weight: u32) -> FleetBudget {
        self.weight = Some(weight);
        self
    }

    pub fn floor(mut self, floor: u64) -> FleetBudget {
        self.floor = Some(floor);
        self
    }

    pub fn safe_share(mut self, share: u64) -> FleetBudget {
        self.safe_share = Some(share);
        self
    }
}

impl Policy {
    pub fn new() -> Policy {
        Policy::default()
    }

    /// Adds a `[[scope]]`.
    pub fn scope(mut self, scope: Scope) -> Policy {
        self.scope.push(scope);
        self
    }

    /// Adds a `[[listener]]`.
    pub fn listener(mut self, listener: Listener) -> Policy {
        self.listener.push(listener);
        self
    }

    /// Sets `[fleet]`.
    pub fn fleet(mut self, fleet: Fleet) -> Policy {
        self.fleet = Some(fleet);
        self
    }

    /// Adds a `[[fleet_budget]]`.
    pub fn fleet_budget(mut self, budget: FleetBudget) -> Policy {
        self.fleet_budget.push(budget);
        self
    }

    /// The policy file's text.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("every policy value has a TOML form")
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_toml())
    }
}

/// `mode`: shed what is over a limit, or only count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Enforce,
    Observe,
}

/// A rule's `per`: a budget for each destination endpoint, or one for the whole rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Per {
    Endpoint,
    Rule,
}

/// One entry of `ports`: a port, or an inclusive range written `"first-last"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Port {
    Number(u16),
    Text(String),
}

impl From<u16> for Port {
    fn from(port: u16) -> Port {
        Port::Number(port)
    }
}

impl From<&str> for Port {
    fn from(text: &str) -> Port {
        Port::Text(text.to_string())
    }
}

impl From<RangeInclusive<u16>> for Port {
    fn from(range: RangeInclusive<u16>) -> Port {
        Port::Text(format!("{}-{}", range.start(), range.end()))
    }
}

/// The keys a scope and a rule share: budgets (connections, connections in the
/// handshake, new connections per second or minute with the bucket's burst), the circuit
/// breaker, and the port watermark (a fraction of the ephemeral range).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connecting: Option<u32>,
    /// `"N/s"` or `"N/min"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    /// Attempts the rate's bucket holds when full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_watermark: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<Breaker>,
}

/// Setters of the keys of [`Limits`], for a scope and a rule alike.
pub trait Limited: Sized {
    fn limits_mut(&mut self) -> &mut Limits;

    fn max_connections(mut self, n: u64) -> Self {
        self.limits_mut().max_connections = Some(n);
        self
    }

    fn max_connecting(mut self, n: u32) -> Self {
        self.limits_mut().max_connecting = Some(n);
        self
    }

    /// `"N/s"` or `"N/min"`.
    fn rate(mut self, rate: &str) -> Self {
        self.limits_mut().rate = Some(rate.to_string());
        self
    }

    fn burst(mut self, attempts: u32) -> Self {
        self.limits_mut().burst = Some(attempts);
        self
    }

    /// A fraction of the ephemeral range, in (0, 1].
    fn port_watermark(mut self, fraction: f64) -> Self {
        self.limits_mut().port_watermark = Some(fraction);
        self
    }

    fn breaker(mut self, breaker: Breaker) -> Self {
        self.limits_mut().breaker = Some(breaker);
        self
    }
}

/// A `[[scope]]`: the cgroups it governs (a path or glob below the cgroup2 mount, the
/// pods, containers and systemd units it selects), how, and its rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scope {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// A systemd unit (or a glob of units): `"orders.service"`, `"shop.slice"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// Its pods' `connguard.io/max-connections` annotations set their own budgets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub annotations: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// What a shed connect() fails with: an errno name such as `"ECONNREFUSED"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errno: Option<String>,
    #[serde(flatten)]
    pub limits: Limits,
    /// Kubernetes pods of this node (a table).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<Pods>,
    /// Containers of the node's Docker Engine API (a table).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<Containers>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rule: Vec<Rule>,
}

impl Scope {
    /// A scope of the cgroups `cgroup` matches.
    pub fn new(name: &str, cgroup: &str) -> Scope {
        Scope {
            cgroup: Some(cgroup.to_string()),
            ..Scope::named(name)
        }
    }

    /// A scope that selects nothing yet: give it `cgroup`, `pod`, `container` or `unit`.
    pub fn named(name: &str) -> Scope {
        Scope {
            name: name.to_string(),
            cgroup: None,
            unit: None,
            annotations: None,
            mode: None,
            errno: None,
            limits: Limits::default(),
            pod: None,
            container: None,
            rule: Vec::new(),
        }
    }

    /// The cgroups a path or glob below the cgroup2 mount matches.
    pub fn cgroup(mut self, pattern: &str) -> Scope {
        self.cgroup = Some(pattern.to_string());
        self
    }

    pub fn pod(mut self, pods: Pods) -> Scope {
        self.pod = Some(pods);
        self
    }

    pub fn container(mut self, containers: Containers) -> Scope {
        self.container = Some(containers);
        self
    }

    pub fn unit(mut self, name: &str) -> Scope {
        self.unit = Some(name.to_string());
        self
    }

    pub fn annotations(mut self, honoured: bool) -> Scope {
        self.annotations = Some(honoured);
        self
    }

    pub fn mode(mut self, mode: Mode) -> Scope {
        self.mode = Some(mode);
        self
    }

    pub fn errno(mut self, name: &str) -> Scope {
        self.errno = Some(name.to_string());
        self
    }

    /// Adds a `[[scope.rule]]`.
    pub fn rule(mut self, rule: Rule) -> Scope {
        self.rule.push(rule);
        self
    }
}

impl Limited for Scope {
    fn limits_mut(&mut self) -> &mut Limits {
        &mut self.limits
    }
}

/// `pod`: the Kubernetes pods of the node in a namespace (a glob; any when unset) whose
/// labels match, with Kubernetes' label selector semantics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Pods {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(flatten)]
    pub labels: Labels,
}

impl Pods {
    pub fn new() -> Pods {
        Pods::default()
    }

    pub fn namespace(mut self, glob: &str) -> Pods {
        self.namespace = Some(glob.to_string());
        self
    }
}

impl Labelled for Pods {
    fn labels_mut(&mut self) -> &mut Labels {
        &mut self.labels
    }
}

/// `container`: the running containers of the node's Docker Engine API (Docker, Podman)
/// whose name (a glob; any when unset) and labels match.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Containers {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(flatten)]
    pub labels: Labels,
}

impl Containers {
    pub fn new() -> Containers {
        Containers::default()
    }

    pub fn name(mut self, glob: &str) -> Containers {
        self.name = Some(glob.to_string());
        self
    }
}

impl Labelled for Containers {
    fn labels_mut(&mut self) -> &mut Labels {
        &mut self.labels
    }
}

/// A Kubernetes label selector: `labels` (matchLabels) and `match_expressions`, all of
/// which must hold.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Labels {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Expression>,
}

/// One of `match_expressions` (a `LabelSelectorRequirement`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Expression {
    pub key: String,
    pub operator: Operator,
    /// Given with In and NotIn, never with Exists and DoesNotExist.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<String>>,
}

/// A match expression's operator, as Kubernetes spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// Setters of a label selector, for `pod` and `container` alike.
pub trait Labelled: Sized {
    fn labels_mut(&mut self) -> &mut Labels;

    /// The label `key` set to `value`.
    fn label(mut self, key: &str, value: &str) -> Self {
        self.labels_mut()
            .labels
            .insert(key.to_string(), value.to_string());
        self
    }

    /// A match expression; `values` empty for Exists and DoesNotExist.
    fn expression<S: Into<String>>(
        mut self,
        key: &str,
        operator: Operator,
        values: impl IntoIterator<Item = S>,
    ) -> Self {
        let values: Vec<String> = values.into_iter().map(Into::into).collect();
        self.labels_mut().match_expressions.push(Expression {
            key: key.to_string(),
            operator,
            values: (!values.is_empty()).then_some(values),
        });
        self
    }
}

/// A `[[scope.rule]]`: destinations (addresses or CIDRs; any when unset) and ports (any
/// when unset), and their limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Rule {
    /// `ruleN` (its place in the scope, from 1) when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dst: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<Port>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per: Option<Per>,
    /// The `[[fleet_budget]]` the rule draws from (then without dst, ports, per and
    /// max_connections: the budget's, and this host's share).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<String>,
    #[serde(flatten)]
    pub limits: Limits,
}

impl Rule {
    pub fn new(name: &str) -> Rule {
        Rule {
            name: Some(name.to_string()),
            ..Rule::default()
        }
    }

    pub fn dst<S: Into<String>>(mut self, dst: impl IntoIterator<Item = S>) -> Rule {
        self.dst = Some(dst.into_iter().map(Into::into).collect());
        self
    }

    pub fn ports<P: Into<Port>>(mut self, ports: impl IntoIterator<Item = P>) -> Rule {
        self.ports = Some(ports.into_iter().map(Into::into).collect());
        self
    }

    pub fn per(mut self, per: Per) -> Rule {
        self.per = Some(per);
        self
    }

    pub fn fleet(mut self, budget: &str) -> Rule {
        self.fleet = Some(budget.into());
        self
    }
}

impl Limited for Rule {
    fn limits_mut(&mut self) -> &mut Limits {
        &mut self.limits
    }
}

/// A `breaker` table: a circuit breaker per destination endpoint. Durations are written
/// `"500ms"`, `"10s"`, `"1min"`; ratios are fractions of the window's outcomes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Breaker {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_samples: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_connect_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub open_for: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_open_for: Option<String>,
    /// Percents let through at each half-open step, rising to 100.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ramp: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_successes: Option<u32>,
    /// What a connect() the breaker sheds fails with: an errno name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errno: Option<String>,
}

impl Breaker {
    pub fn new() -> Breaker {
        Breaker::default()
    }

    pub fn window(mut self, duration: &str) -> Breaker {
        self.window = Some(duration.to_string());
        self
    }

    pub fn min_samples(mut self, n: u32) -> Breaker {
        self.min_samples = Some(n);
        self
    }

    pub fn failure_ratio(mut self, fraction: f64) -> Breaker {
        self.failure_ratio = Some(fraction);
        self
    }

    pub fn slow_ratio(mut self, fraction: f64) -> Breaker {
        self.slow_ratio = Some(fraction);
        self
    }

    pub fn slow_connect_ms(mut self, ms: u64) -> Breaker {
        self.slow_connect_ms = Some(ms);
        self
    }

    pub fn open_for(mut self, duration: &str) -> Breaker {
        self.open_for = Some(duration.to_string());
        self
    }

    pub fn max_open_for(mut self, duration: &str) -> Breaker {
        self.max_open_for = Some(duration.to_string());
        self
    }

    pub fn ramp(mut self, percents: impl IntoIterator<Item = u32>) -> Breaker {
        self.ramp = Some(percents.into_iter().collect());
        self
    }

    pub fn step_successes(mut self, n: u32) -> Breaker {
        self.step_successes = Some(n);
        self
    }

    pub fn errno(mut self, name: &str) -> Breaker {
        self.errno = Some(name.to_string());
        self
    }
}

/// A `[[listener]]` guard: listening sockets on `ports` (of `addr`, in the network
/// namespace of the file `netns`, or the daemon's own), shed with RST past a fraction
/// of the accept queue's backlog or a count of SYN_RECV, and each caller's SYNs past its
/// `per_source` budgets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Listener {
    pub name: String,
    pub ports: Vec<Port>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// The interfaces to attach to (every one of the namespace when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accept_queue_watermark: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_syn_recv: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_source: Option<PerSource>,
}

impl Listener {
    pub fn new<P: Into<Port>>(name: &str, ports: impl IntoIterator<Item = P>) -> Listener {
        Listener {
            name: name.to_string(),
            ports: ports.into_iter().map(Into::into).collect(),
            addr: None,
            netns: None,
            interfaces: Vec::new(),
            accept_queue_watermark: None,
            max_syn_recv: None,
            mode: None,
            per_source: None,
        }
    }

    pub fn addr(mut self, addr: &str) -> Listener {
        self.addr = Some(addr.to_string());
        self
    }

    /// A network namespace file (`/run/netns/NAME`, `/proc/PID/ns/net`).
    pub fn netns(mut self, path: &str) -> Listener {
        self.netns = Some(path.to_string());
        self
    }

    pub fn interfaces<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Listener {
        self.interfaces = names.into_iter().map(Into::into).collect();
        self
    }

    /// A fraction of the backlog, in (0, 1].
    pub fn accept_queue_watermark(mut self, fraction: f64) -> Listener {
        self.accept_queue_watermark = Some(fraction);
        self
    }

    pub fn max_syn_recv(mut self, n: u32) -> Listener {
        self.max_syn_recv = Some(n);
        self
    }

    pub fn mode(mut self, mode: Mode) -> Listener {
        self.mode = Some(mode);
        self
    }

    pub fn per_source(mut self, budgets: PerSource) -> Listener {
        self.per_source = Some(budgets);
        self
    }
}

/// A listener guard's `per_source` table: the budgets of each caller, a source address
/// masked to `prefix` bits (IPv6: `prefix6`): connections it holds, and new connections
/// per second or minute with the bucket's burst; a SYN past them gets `action`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PerSource {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix6: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// `"N/s"` or `"N/min"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<Refusal>,
}

/// `per_source.action`: what a caller's SYN past its budgets gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Refusal {
    /// A RST at once: the client's connect() fails with ECONNREFUSED.
    Rst,
    /// Nothing: the client retransmits its SYN (after 1 s, 3 s, ...).
    Drop,
}

impl PerSource {
    pub fn new() -> PerSource {
        PerSource::default()
    }

    /// Bits of an IPv4 source address that name a caller (0 to 32).
    pub fn prefix(mut self, bits: u8) -> PerSource {
        self.prefix = Some(bits);
        self
    }

    /// Bits of an IPv6 source address that name a caller (0 to 128).
    pub fn prefix6(mut self, bits: u8) -> PerSource {
        self.prefix6 = Some(bits);
        self
    }

    pub fn max_connections(mut self, n: u32) -> PerSource {
        self.max_connections = Some(n);
        self
    }

    /// `"N/s"` or `"N/min"`.
    pub fn rate(mut self, rate: &str) -> PerSource {
        self.rate = Some(rate.to_string());
        self
    }

    pub fn burst(mut self, attempts: u32) -> PerSource {
        self.burst = Some(attempts);
        self
    }

    pub fn action(mut self, action: Refusal) -> PerSource {
        self.action = Some(action);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_written_under_their_names_and_unset_ones_left_out() {
        let policy = Policy::new()
            .scope(
                Scope::new("a", "x")
                    .max_connections(5)
                    .breaker(Breaker::new().window("2s"))
                    .rule(Rule::new("r").ports([Port::from(80), Port::from(9000..=9100)]))
                    .rule(Rule::default().max_connecting(2)),
            )
            .listener(Listener::new("l", [8080]).max_syn_recv(3));
        assert_eq!(
            policy.to_toml(),
            "[[scope]]\nname = \"a\"\ncgroup = \"x\"\nmax_connections = 5\n\n\
             [scope.breaker]\nwindow = \"2s\"\n\n\
             [[scope.rule]]\nname = \"r\"\nports = [80, \"9000-9100\"]\n\n\
             [[scope.rule]]\nmax_connecting = 2\n\n\
             [[listener]]\nname = \"l\"\nports = [8080]\nmax_syn_recv = 3\n"
        );
        assert_eq!(toml::from_str::<Policy>(&policy.to_toml()), Ok(policy));
    }

    #[test]
    fn workload_selectors_are_tables_of_the_scope() {
        let policy = Policy::new().scope(
            Scope::named("orders")
                .pod(
                    Pods::new()
                        .namespace("shop")
                        .label("app", "orders")
                        .expression("tier", Operator::In, ["web"])
                        .expression("canary", Operator::DoesNotExist, [] as [&str; 0]),
                )
                .annotations(true)
                .max_connections(5),
        );
        let text = policy.to_toml();
        assert_eq!(
            text,
            "[[scope]]\nname = \"orders\"\nannotations = true\nmax_connections = 5\n\n\
             [scope.pod]\nnamespace = \"shop\"\n\n[scope.pod.labels]\napp = \"orders\"\n\n\
             [[scope.pod.match_expressions]]\nkey = \"tier\"\noperator = \"In\"\nvalues = [\"web\"]\n\n\
             [[scope.pod.match_expressions]]\nkey = \"canary\"\noperator = \"DoesNotExist\"\n"
        );
        assert_eq!(toml::from_str::<Policy>(&text), Ok(policy));
    }
}

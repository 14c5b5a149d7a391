//! The policy in the kernel's terms: the entries of SCOPES and RULES, and a listener
//! guard's per-caller budgets. Networks are keyed
//! IPv6, IPv4 IPv4-mapped (guard_common::addr). For each distinct destination prefix of
//! a scope's rules, the RULES trie holds every rule whose network contains that prefix,
//! in policy order: the longest prefix containing an address then carries exactly the
//! rules whose `dst` contains the address, and the first whose ports match applies.
use std::net::Ipv6Addr;

use guard_common::{
    BreakerConf, Candidates, MAX_RAMP_STEPS, RULE_KEY_FIXED_BITS, RuleAddrKey, RuleRef, ScopeConf,
    callers::PerSource,
};
use ipnet::{IpNet, Ipv6Net};

use super::{BreakerPolicy, Limits, PerSourcePolicy, Rate, Rule, Scope};

/// A listener guard's `per_source` as its LISTENERS entries carry it (all zeros, off,
/// without one). IPv4 callers are keyed IPv4-mapped: their prefix counts 96 bits more.
pub fn per_source(p: Option<&PerSourcePolicy>) -> PerSource {
    let Some(p) = p else {
        return PerSource::default();
    };
    PerSource {
        action: p.action,
        max_connections: p.max_connections.unwrap_or(0),
        rate_interval_ns: p.rate.as_ref().map_or(0, Rate::interval_ns),
        burst: p.rate.as_ref().map_or(0, |r| r.burst),
        prefix4: 96 + p.prefix as u32,
        prefix6: p.prefix6 as u32,
        _pad: 0,
    }
}

/// A scope as SCOPES holds it, under its stable id.
pub fn scope_conf(scope: &Scope, scope_id: u32, serial: u32) -> ScopeConf {
    ScopeConf {
        scope_id,
        mode: scope.mode,
        errno: scope.errno as u32,
        has_rules: !scope.rules.is_empty() as u32,
        limits: limits(&scope.limits),
        breaker: breaker(scope.breaker.as_ref()),
        port_watermark: scope.port_watermark.unwrap_or(0),
        serial,
    }
}

/// A rule as a RULES entry carries it, under its stable id.
pub fn rule_ref(rule: &Rule, rule_id: u32) -> RuleRef {
    let mut r = RuleRef {
        rule_id,
        per_endpoint: rule.per_endpoint as u32,
        limits: limits(&rule.limits),
        breaker: breaker(rule.breaker.as_ref()),
        n_ports: rule.ports.len() as u32,
        port_watermark: rule.port_watermark.unwrap_or(0),
        ..Default::default()
    };
    r.ports[..rule.ports.len()].copy_from_slice(&rule.ports);
    r
}

/// Limits as the kernel takes them: 0 for none, and a budget of 0 (a fleet share of
/// nothing) as `BUDGET_OF_NONE`.
fn limits(l: &Limits) -> guard_common::Limits {
    guard_common::Limits {
        max_connections: match l.max_connections {
            None => 0,
            Some(0) => guard_common::BUDGET_OF_NONE,
            Some(n) => n,
        },
        rate_interval_ns: l.rate.as_ref().map_or(0, Rate::interval_ns),
        rate_burst: l.rate.as_ref().map_or(0, |r| r.burst),
        max_connecting: l.max_connecting.unwrap_or(0),
    }
}

/// A breaker as the kernel takes it: all 0 for none.
fn breaker(b: Option<&BreakerPolicy>) -> BreakerConf {
    let Some(b) = b else {
        return BreakerConf::default();
    };
    let mut ramp = [0u8; MAX_RAMP_STEPS];
    ramp[..b.ramp.len()].copy_from_slice(&b.ramp);
    BreakerConf {
        window_ns: b.window_ns,
        open_ns: b.open_ns,
        max_open_ns: b.max_open_ns,
        slow_ns: b.slow_connect_ns.unwrap_or(0),
        min_samples: b.min_samples,
        failure_permille: b.failure_permille,
        slow_permille: b.slow_permille.unwrap_or(0),
        step_successes: b.step_successes,
        errno: b.errno.unwrap_or(0) as u32,
        n_steps: b.ramp.len() as u32,
        ramp,
    }
}

/// One RULES entry: the prefix length in bits (of the whole key) and the key's data.
pub struct RuleEntry {
    pub prefix_len: u32,
    pub key: RuleAddrKey,
    pub candidates: Candidates,
}

/// The RULES entries of one scope's rules for generation `gen_`; `refs[i]` is
/// `rules[i]` under its id.
pub fn rule_entries(gen_: u32, scope_id: u32, rules: &[Rule], refs: &[RuleRef]) -> Vec<RuleEntry> {
    rule_prefixes(rules)
        .into_iter()
        .map(|prefix| {
            let mut candidates = Candidates::default();
            let matching = candidates_of(rules, &prefix);
            candidates.n = matching.len() as u32;
            for (slot, i) in candidates.rules.iter_mut().zip(matching) {
                *slot = refs[i];
            }
            RuleEntry {
                prefix_len: RULE_KEY_FIXED_BITS + prefix.prefix_len() as u32,
                key: RuleAddrKey {
                    gen_,
                    scope_id,
                    addr: prefix.addr().octets(),
                },
                candidates,
            }
        })
        .collect()
}

/// A network as the kernel keys it: IPv6, with IPv4 IPv4-mapped.
pub fn mapped(net: &IpNet) -> Ipv6Net {
    match net {
        IpNet::V4(n) => {
            Ipv6Net::new(n.addr().to_ipv6_mapped(), 96 + n.prefix_len()).expect("valid prefix")
        }
        IpNet::V6(n) => *n,
    }
}

fn rule_nets(rule: &Rule) -> Vec<Ipv6Net> {
    if rule.dst.is_empty() {
        vec![Ipv6Net::new(Ipv6Addr::UNSPECIFIED, 0).expect("valid prefix")]
    } else {
        rule.dst.iter().map(mapped).collect()
    }
}

/// The distinct destination prefixes of a scope's rules, as the kernel keys them.
pub fn rule_prefixes(rules: &[Rule]) -> Vec<Ipv6Net> {
    let mut out: Vec<Ipv6Net> = rules.iter().flat_map(rule_nets).collect();
    out.sort();
    out.dedup();
    out
}

/// Indices of the rules that match every address in `prefix`, in policy order. For the
/// longest rule prefix containing an address, these are exactly the rules whose `dst`
/// contains the address.
pub fn candidates_of(rules: &[Rule], prefix: &Ipv6Net) -> Vec<usize> {
    (0..rules.len())
        .filter(|&i| rule_nets(&rules[i]).iter().any(|n| n.contains(prefix)))
        .collect()
}

/// A network in the kernel's form, back as a user writes it (IPv4 when it lies within
/// the IPv4-mapped range).
pub fn unmapped_net(net: &Ipv6Net) -> IpNet {
    match net.addr().to_ipv4_mapped() {
        Some(v4) if net.prefix_len() >= 96 => {
            IpNet::V4(ipnet::Ipv4Net::new(v4, net.prefix_len() - 96).expect("valid prefix"))
        }
        _ => IpNet::V6(*net),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse;

    fn rules(text: &str) -> Vec<Rule> {
        let head = "[[scope]]\nname = \"s\"\ncgroup = \"x\"\n";
        parse(&format!("{head}{text}"), "t")
            .unwrap()
            .scopes
            .remove(0)
            .rules
    }

    #[test]
    fn each_prefix_carries_exactly_the_rules_that_contain_it_in_order() {
        let r = rules(
            "[[scope.rule]]\nname = \"wide\"\ndst = [\"10.0.0.0/8\"]\n\
             [[scope.rule]]\nname = \"host\"\ndst = [\"10.1.2.3\"]\n\
             [[scope.rule]]\nname = \"any\"\n\
             [[scope.rule]]\nname = \"v6\"\ndst = [\"fd00::/64\"]\n",
        );
        let shown: Vec<(String, Vec<usize>)> = rule_prefixes(&r)
            .iter()
            .map(|p| (unmapped_net(p).to_string(), candidates_of(&r, p)))
            .collect();
        assert_eq!(
            shown,
            [
                ("::/0".to_string(), vec![2]),
                ("10.0.0.0/8".to_string(), vec![0, 2]),
                ("10.1.2.3/32".to_string(), vec![0, 1, 2]),
                ("fd00::/64".to_string(), vec![2, 3]),
            ]
        );
    }

    #[test]
    fn ipv4_is_keyed_ipv4_mapped() {
        let net: IpNet = "192.0.2.0/24".parse().unwrap();
        assert_eq!(mapped(&net).to_string(), "::ffff:192.0.2.0/120");
        assert_eq!(unmapped_net(&mapped(&net)), net);
        assert_eq!(
            guard_common::addr::unmapped(mapped(&net).addr().octets()).to_string(),
            "192.0.2.0"
        );
    }
}

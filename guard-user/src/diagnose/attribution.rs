//! What the daemon adds to a namespace's ports report (the `ports COOKIE` control
//! request): TIME_WAIT birth rates per (source, destination), the scopes whose admitted
//! connections hold ports, and EADDRNOTAVAIL failures per scope and process.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    time::{Duration, Instant},
};

use connguard_api::ports::{
    ActiveScopes, DaemonDestination, DaemonPorts, EaddrnotavailCount, PortsReport,
};
use guard_common::{
    Counter, CounterKey, EaddrKey, TimeWaitKey,
    addr::{endpoint, unmapped},
};

use super::ports::diagnose;

/// Rates are TIME_WAIT births over at least this window (at most 1.5 times it).
pub const RATE_WINDOW: Duration = Duration::from_secs(5);

/// How often the daemon samples the TIME_WAITS map: twice per window, so that a sample
/// between one and one and a half windows old is always kept, and at most three are
/// (each a copy of the map, which grows with its entries: docs/performance.md).
pub const SAMPLE_EVERY: Duration = Duration::from_millis(2500);

/// Samples of the TIME_WAITS map, taken every SAMPLE_EVERY, for per-second rates.
#[derive(Default)]
pub struct TimeWaitRates {
    samples: VecDeque<(Instant, HashMap<TimeWaitKey, u64>)>,
}

impl TimeWaitRates {
    /// Keeps `counts`, and the samples since the newest one that is RATE_WINDOW old.
    pub fn sample(&mut self, now: Instant, counts: HashMap<TimeWaitKey, u64>) {
        self.samples.push_back((now, counts));
        while self.samples.len() > 2 && now - self.samples[1].0 >= RATE_WINDOW {
            self.samples.pop_front();
        }
    }

    /// Births per second per key, from the oldest sample to `counts`, read at `now`: the
    /// rate is as fresh as the reading, however old the newest sample is. A key absent
    /// from the oldest sample was born within the window and counts from zero.
    pub fn rates(
        &self,
        now: Instant,
        counts: &HashMap<TimeWaitKey, u64>,
    ) -> HashMap<TimeWaitKey, f64> {
        let Some((t0, old)) = self.samples.front() else {
            return HashMap::new();
        };
        let secs = (now - *t0).as_secs_f64();
        if secs <= 0.0 {
            return HashMap::new();
        }
        counts
            .iter()
            .map(|(k, n)| {
                (
                    *k,
                    n.saturating_sub(old.get(k).copied().unwrap_or(0)) as f64 / secs,
                )
            })
            .collect()
    }
}

/// The daemon's view of one namespace (cookie `netns`): TIME_WAIT rates summed over
/// scopes per (source, destination) with the scopes named, the scopes with active
/// connections per destination, and EADDRNOTAVAIL counts.
pub fn daemon_ports(
    netns: u64,
    rates: &HashMap<TimeWaitKey, f64>,
    destinations: &[Vec<(CounterKey, Counter)>],
    eaddrnotavail: &[(EaddrKey, u64)],
    scope_name: impl Fn(u32) -> String,
) -> DaemonPorts {
    let mut by_dest: BTreeMap<(String, String), (f64, BTreeSet<String>)> = BTreeMap::new();
    for (k, rate) in rates
        .iter()
        .filter(|(k, rate)| k.netns == netns && **rate > 0.0)
    {
        let e = by_dest
            .entry((
                unmapped(k.src).to_string(),
                endpoint(unmapped(k.dst), k.dport),
            ))
            .or_default();
        e.0 += rate;
        e.1.insert(scope_name(k.scope_id));
    }
    let mut active: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (k, _) in destinations.iter().flatten().filter(|(_, c)| c.active > 0) {
        active
            .entry(endpoint(unmapped(k.addr), k.port))
            .or_default()
            .insert(scope_name(k.scope_id));
    }
    DaemonPorts {
        destinations: by_dest
            .into_iter()
            .map(|((src, dst), (rate, scopes))| DaemonDestination {
                src,
                dst,
                time_wait_per_s: rate,
                scopes: scopes.into_iter().collect(),
            })
            .collect(),
        active: active
            .into_iter()
            .map(|(dst, scopes)| ActiveScopes {
                dst,
                scopes: scopes.into_iter().collect(),
            })
            .collect(),
        eaddrnotavail: eaddrnotavail_counts(eaddrnotavail, scope_name),
    }
}

/// EADDRNOTAVAIL counts with their scope and process named.
pub fn eaddrnotavail_counts(
    raw: &[(EaddrKey, u64)],
    scope_name: impl Fn(u32) -> String,
) -> Vec<EaddrnotavailCount> {
    raw.iter()
        .map(|(k, count)| EaddrnotavailCount {
            scope: scope_name(k.scope_id),
            comm: String::from_utf8_lossy(&k.comm)
                .trim_end_matches('\0')
                .to_string(),
            count: *count,
        })
        .collect()
}

/// Adds the daemon's rates and attribution to a report, and diagnoses again.
pub fn merge(r: &mut PortsReport, from: DaemonPorts) {
    for d in &mut r.destinations {
        if let Some(a) = from.active.iter().find(|a| a.dst == d.dst) {
            d.scopes = a.scopes.clone();
        }
        let Some(m) = from
            .destinations
            .iter()
            .find(|m| m.src == d.src && m.dst == d.dst)
        else {
            continue;
        };
        for s in &m.scopes {
            if !d.scopes.contains(s) {
                d.scopes.push(s.clone());
            }
        }
        d.time_wait_per_s = Some(m.time_wait_per_s);
        // TIME_WAIT entries live TCP_TIMEWAIT_LEN (60 s): at this rate the range fills
        // only if the entries alive at once outnumber the ports left for them.
        let room = r.ephemeral_ports.saturating_sub(r.bound_ports + d.active);
        if m.time_wait_per_s * 60.0 >= room as f64 {
            d.seconds_to_exhaustion = Some(d.available as f64 / m.time_wait_per_s);
        }
    }
    r.eaddrnotavail = from.eaddrnotavail;
    r.warnings = diagnose(r);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sampled as the daemon samples, through a minute of 10 births a second: at most
    /// three copies of the map are kept, and every reading gets the exact rate over a
    /// window of 5 to 7.5 s (shorter only in the daemon's first 5 s).
    #[test]
    fn three_samples_at_most_give_the_rate_over_the_window() {
        let key = TimeWaitKey::default();
        let start = Instant::now();
        let births = |at: Duration| HashMap::from([(key, at.as_millis() as u64 / 100)]);
        let mut r = TimeWaitRates::default();
        let mut at = Duration::ZERO;
        while at <= Duration::from_secs(60) {
            r.sample(start + at, births(at));
            assert!(
                r.samples.len() <= 3,
                "{} samples at {at:?}",
                r.samples.len()
            );
            for later in [0, 100, 1200, 2400].map(Duration::from_millis) {
                let now = at + later;
                let window = now - (r.samples[0].0 - start);
                assert!(
                    window < RATE_WINDOW + SAMPLE_EVERY
                        && (window >= RATE_WINDOW || now < RATE_WINDOW),
                    "a window of {window:?} at {now:?}"
                );
                if now > Duration::ZERO {
                    let rate = r.rates(start + now, &births(now))[&key];
                    assert!((rate - 10.0).abs() < 1e-9, "{rate}/s at {now:?}");
                }
            }
            at += SAMPLE_EVERY;
        }
    }
}

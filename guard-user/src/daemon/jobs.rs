//! The daemon's periodic jobs. Each runs its work (it reads socket tables over netlink
//! and maps through bpf(2)) once per period on a thread of its own. A run that fails is
//! logged with its cause, when it starts failing or fails differently, and the job runs
//! again at its next period; recovery is logged too. A panic ends the whole process (the
//! daemon's panic hook aborts), so no job dies alone while the daemon looks alive.
//!
//! A job with nothing to watch (no listener guard, no port watermark, no drill) runs at
//! its idle period, because on a host with no work for it every wake-up is the daemon's
//! whole idle cost; what gives it work wakes it at once (`Jobs::wake`).
use std::{
    collections::VecDeque,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use connguard_api::stats::JobStats;

use super::lock;

/// Runs kept for the period figures of `stats`.
const KEPT_RUNS: usize = 257;
/// A run still going after this long is logged (again every time as long), and fails
/// the health check (`running_ms` in `stats`): every job's run takes far less.
pub(super) const STALLED: Duration = Duration::from_secs(10);

pub type Work = Arc<dyn Fn() -> anyhow::Result<()> + Send + Sync>;

/// Whether a job has work to watch, asked after each run.
pub type Busy = Box<dyn Fn() -> bool + Send>;

#[derive(Default)]
pub struct Jobs {
    jobs: Mutex<Vec<Running>>,
}

/// A job and the alarm that ends its sleep.
struct Running {
    name: &'static str,
    job: Arc<Mutex<Job>>,
    alarm: Arc<Alarm>,
}

/// A job's sleep, which `Jobs::wake` ends early.
#[derive(Default)]
struct Alarm {
    rung: Mutex<bool>,
    ring: Condvar,
}

impl Alarm {
    /// Sleeps for `d`, or until rung (a ring during the run before counts).
    fn sleep(&self, d: Duration) {
        let rung = lock(&self.rung);
        let (mut rung, _) = self
            .ring
            .wait_timeout_while(rung, d, |rung| !*rung)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *rung = false;
    }

    fn ring(&self) {
        *lock(&self.rung) = true;
        self.ring.notify_one();
    }
}

struct Job {
    name: &'static str,
    period: Duration,
    /// The period while it has nothing to watch (`period` for a job that always has).
    idle: Duration,
    runs: u64,
    failures: u64,
    last_error: Option<String>,
    /// When the last KEPT_RUNS runs started.
    starts: VecDeque<Instant>,
    /// Whether a run is going now (it started at the back of `starts`).
    running: bool,
}

impl Jobs {
    /// Starts `work` every `period` on a thread of its own, for the daemon's life, so
    /// that a run wakes that one thread only. A run longer than the period delays the
    /// next one instead of bunching them. A thread the system refuses ends the daemon
    /// (a panic aborts it): a job missing for good would look like a live daemon.
    pub fn spawn(&self, name: &'static str, period: Duration, work: Work) {
        self.spawn_idling(name, period, period, Box::new(|| true), work);
    }

    /// As `spawn`, but every `idle` after a run when `busy` says the job has nothing to
    /// watch; `wake` starts the next run at once.
    pub fn spawn_idling(
        &self,
        name: &'static str,
        period: Duration,
        idle: Duration,
        busy: Busy,
        work: Work,
    ) {
        let job = Arc::new(Mutex::new(Job {
            name,
            period,
            idle,
            runs: 0,
            failures: 0,
            last_error: None,
            starts: VecDeque::with_capacity(KEPT_RUNS),
            running: false,
        }));
        let alarm = Arc::new(Alarm::default());
        lock(&self.jobs).push(Running {
            name,
            job: job.clone(),
            alarm: alarm.clone(),
        });
        // Thread names hold 15 bytes.
        let thread: String = format!("job-{name}").chars().take(15).collect();
        let spawned = std::thread::Builder::new().name(thread).spawn(move || {
            loop {
                let started = Instant::now();
                {
                    let mut j = lock(&job);
                    if j.starts.len() == KEPT_RUNS {
                        j.starts.pop_front();
                    }
                    j.starts.push_back(started);
                    j.running = true;
                }
                let result = work();
                let took = started.elapsed();
                lock(&job).record(result);
                let pace = if busy() { period } else { idle };
                alarm.sleep(pace.saturating_sub(took));
            }
        });
        if let Err(e) = spawned {
            panic!("starting the job {name}: {e}");
        }
    }

    /// Logs every run going for longer than STALLED, again each time as long; called
    /// every STALLED.
    pub fn warn_stalled(&self) {
        for s in self.stats() {
            if let Some(ms) = s.running_ms.filter(|ms| *ms >= STALLED.as_secs_f64() * 1e3) {
                log::warn!(
                    "job {}: a run has been going for {} s and has not ended",
                    s.name,
                    (ms / 1e3) as u64
                );
            }
        }
    }

    pub fn stats(&self) -> Vec<JobStats> {
        lock(&self.jobs)
            .iter()
            .map(|r| lock(&r.job).stats())
            .collect()
    }

    /// Starts the next run of the job `name` now, if it is sleeping (else as soon as
    /// its run ends): it has work to watch.
    pub fn wake(&self, name: &str) {
        for r in lock(&self.jobs).iter().filter(|r| r.name == name) {
            r.alarm.ring();
        }
    }
}

impl Job {
    fn record(&mut self, result: anyhow::Result<()>) {
        self.runs += 1;
        self.running = false;
        match result {
            Ok(()) => {
                if self.last_error.take().is_some() {
                    log::info!("job {}: running again without error", self.name);
                }
            }
            Err(e) => {
                self.failures += 1;
                let why = format!("{e:#}");
                if self.last_error.as_deref() != Some(&why) {
                    let idle = if self.idle == self.period {
                        String::new()
                    } else {
                        format!(" ({} ms with nothing to watch)", self.idle.as_millis())
                    };
                    log::warn!(
                        "job {} failed: {why}; it runs again every {} ms{idle}",
                        self.name,
                        self.period.as_millis()
                    );
                }
                self.last_error = Some(why);
            }
        }
    }

    fn stats(&self) -> JobStats {
        let mut periods: Vec<f64> = self
            .starts
            .iter()
            .zip(self.starts.iter().skip(1))
            .map(|(a, b)| (*b - *a).as_nanos() as f64 / 1e6)
            .collect();
        periods.sort_by(f64::total_cmp);
        // Nearest rank.
        let rank = |q: f64| {
            (!periods.is_empty()).then(|| {
                periods[((q * periods.len() as f64).ceil() as usize).clamp(1, periods.len()) - 1]
            })
        };
        JobStats {
            name: self.name.to_string(),
            period_ms: self.period.as_nanos() as f64 / 1e6,
            runs: self.runs,
            failures: self.failures,
            last_error: self.last_error.clone(),
            period_p50_ms: rank(0.5),
            period_p99_ms: rank(0.99),
            period_max_ms: periods.last().copied(),
            running_ms: self
                .starts
                .back()
                .filter(|_| self.running)
                .map(|t| t.elapsed().as_nanos() as f64 / 1e6),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// Waits up to 5 s for `runs` to reach `n`.
    fn wait_runs(runs: &AtomicU64, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while runs.load(Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "the job did not run {n} time(s) in 5 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn an_idle_job_waits_its_idle_period_unless_woken() {
        let jobs = Jobs::default();
        let runs = Arc::new(AtomicU64::new(0));
        let busy = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (r, b) = (runs.clone(), busy.clone());
        jobs.spawn_idling(
            "t",
            Duration::from_millis(1),
            Duration::from_secs(3600),
            Box::new(move || b.load(Ordering::SeqCst)),
            Arc::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }),
        );
        wait_runs(&runs, 1);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(runs.load(Ordering::SeqCst), 1, "ran again while idle");
        // Woken with work: it runs at once, then at its busy period.
        busy.store(true, Ordering::SeqCst);
        jobs.wake("t");
        wait_runs(&runs, 10);
        // Idle again after its next run; a wake for another job leaves it asleep.
        busy.store(false, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(100));
        let idle = runs.load(Ordering::SeqCst);
        jobs.wake("other");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(runs.load(Ordering::SeqCst), idle, "ran again while idle");
    }

    #[test]
    fn a_wake_during_a_run_starts_the_next_at_once() {
        let jobs = Arc::new(Jobs::default());
        let runs = Arc::new(AtomicU64::new(0));
        let (r, j) = (runs.clone(), jobs.clone());
        jobs.spawn_idling(
            "t",
            Duration::from_millis(1),
            Duration::from_secs(3600),
            Box::new(|| false),
            Arc::new(move || {
                // The first run is woken while it runs, as a reload during a reading.
                if r.fetch_add(1, Ordering::SeqCst) == 0 {
                    j.wake("t");
                }
                Ok(())
            }),
        );
        wait_runs(&runs, 2);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(runs.load(Ordering::SeqCst), 2, "one wake, one run");
    }

    #[test]
    fn failures_are_counted_and_periods_ranked() {
        let start = Instant::now();
        let mut j = Job {
            name: "t",
            period: Duration::from_millis(50),
            idle: Duration::from_millis(50),
            runs: 0,
            failures: 0,
            last_error: None,
            running: true,
            // Periods of 1, 2, ..., 100 ms.
            starts: (0..=100u64)
                .map(|i| start + Duration::from_millis(i * (i + 1) / 2))
                .collect(),
        };
        j.record(Err(anyhow::anyhow!("no netns")));
        j.record(Ok(()));
        j.record(Err(anyhow::anyhow!("no netns")));
        let s = j.stats();
        assert_eq!(
            (s.runs, s.failures, s.last_error.as_deref(), s.running_ms),
            (3, 2, Some("no netns"), None)
        );
        assert_eq!(
            (s.period_p50_ms, s.period_p99_ms, s.period_max_ms),
            (Some(50.0), Some(99.0), Some(100.0))
        );
    }
}

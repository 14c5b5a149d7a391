//! guard-probe's command line, as a value: the binary parses it, the tests build it
//! (`Cgroup::probe`), and `Probe::args` writes it back as arguments the parser reads as
//! the same value (a unit test holds them together). Every mode prints one JSON
//! `Outcome`; those that hold their sockets print it, then wait to be killed.
//!
//! NETNS is the path of a network namespace file (`/run/netns/NAME`), entered before
//! any socket is made; times are in ms unless a name says otherwise.
use std::{collections::BTreeMap, fmt, net::SocketAddr, str::FromStr};

use serde::{Deserialize, Serialize};

/// What guard-probe prints: attempts, successes, failures by errno name.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub attempts: u64,
    pub ok: u64,
    pub errors: BTreeMap<String, u64>,
    /// Longest time a failed connect() took, in µs.
    pub max_error_us: u64,
    /// Figures a mode adds, by name (each mode's documentation lists its own).
    pub categories: BTreeMap<String, u64>,
}

impl Outcome {
    /// Failures with the errno `name` (`ECONNREFUSED`, `TIMEOUT`, ...); 0 for none.
    pub fn errors(&self, name: &str) -> u64 {
        self.errors.get(name).copied().unwrap_or(0)
    }

    /// The figure `name` of `categories`, which the mode always reports.
    pub fn category(&self, name: &str) -> u64 {
        *self
            .categories
            .get(name)
            .unwrap_or_else(|| panic!("guard-probe reported no {name}: {self:?}"))
    }
}

/// A port `serve` listens on; with `greet`, written `greet:PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServePort {
    pub port: u16,
    /// Send each client one byte as it is accepted, and close.
    pub greet: bool,
}

impl ServePort {
    pub fn plain(port: u16) -> ServePort {
        ServePort { port, greet: false }
    }

    pub fn greeting(port: u16) -> ServePort {
        ServePort { port, greet: true }
    }
}

impl FromStr for ServePort {
    type Err = std::num::ParseIntError;

    fn from_str(s: &str) -> Result<ServePort, Self::Err> {
        Ok(match s.strip_prefix("greet:") {
            Some(p) => ServePort::greeting(p.parse()?),
            None => ServePort::plain(s.parse()?),
        })
    }
}

impl fmt::Display for ServePort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.greet {
            write!(f, "greet:{}", self.port)
        } else {
            write!(f, "{}", self.port)
        }
    }
}

/// guard-probe's modes.
#[derive(Debug, Clone, PartialEq, Eq, clap::Parser)]
#[command(
    name = "guard-probe",
    about = "The client side of connguard's integration tests"
)]
pub enum Probe {
    /// COUNT blocking connects from CONCURRENCY threads started together.
    Connect {
        addr: SocketAddr,
        count: u64,
        concurrency: u64,
    },
    /// `connect`, then holds the connections.
    Hold {
        addr: SocketAddr,
        count: u64,
        concurrency: u64,
    },
    /// THREADS threads connect, hold each connection 2 ms, close, for SECONDS.
    Storm {
        addr: SocketAddr,
        threads: u64,
        seconds: u64,
    },
    /// UDP sockets connected to ADDR (which runs the connect hooks), sending one
    /// datagram each, plus as many unconnected sendto()s.
    Udp { addr: SocketAddr, cycles: u64 },
    /// Creates a TCP socket, moves this process into the cgroup at CGROUP_DIR, then
    /// connects.
    Migrate {
        addr: SocketAddr,
        cgroup_dir: String,
    },
    /// TCP_FASTOPEN_CONNECT, in a namespace whose net.ipv4.tcp_fastopen lets clients go
    /// without a cookie: connect() returns at once, and the socket is closed unsent.
    Tfo { netns: String, addr: SocketAddr },
    /// COUNT MPTCP connects to ADDR in turn, each held until all are made.
    Mptcp { addr: SocketAddr, count: u64 },
    /// One connect, whose socket is then held: to an address with no route, it fails
    /// before leaving TCP_CLOSE (ENETUNREACH). With --listen, the socket then listens
    /// (on a port of its own, backlog 1) while held.
    FailHold {
        netns: String,
        addr: SocketAddr,
        #[arg(long)]
        listen: bool,
    },
    /// Servers on 127.0.0.1:PORT that wait for each client's FIN, then close (TIME_WAIT
    /// lands on the client side); `greet:PORT` sends each client one byte and closes.
    /// Holds them.
    Serve {
        netns: String,
        #[arg(required = true)]
        ports: Vec<ServePort>,
    },
    /// COUNT connections to ADDR, each closed by the client after the server's FIN,
    /// PER_SECOND at most (0: as fast as possible); with --reset, closed with a RST
    /// once the server's greeting is read. `categories`: elapsed_ns, first_eaddrnotavail
    /// and first_refused (1-based attempt numbers, 0 for none).
    Churn {
        netns: String,
        addr: SocketAddr,
        count: u64,
        per_second: u64,
        #[arg(long)]
        reset: bool,
    },
    /// COUNT sockets bound to ADDR, each then connected to the next of DESTINATIONS if
    /// any are given; a failed bind() or connect() is counted by its errno. Holds what
    /// succeeded.
    Bind {
        netns: String,
        addr: SocketAddr,
        count: u64,
        #[arg(value_delimiter = ',')]
        destinations: Vec<SocketAddr>,
    },
    /// A listener with BACKLOG that accepts nothing; with --accept-after-ms, everything
    /// after that long; with --on-usr1, everything once the process gets SIGUSR1.
    Listen {
        netns: String,
        addr: SocketAddr,
        backlog: u64,
        #[arg(long, conflicts_with = "on_usr1")]
        accept_after_ms: Option<u64>,
        #[arg(long)]
        on_usr1: bool,
    },
    /// COUNT connects, one every INTERVAL_MS, each given TIMEOUT_MS; holds them all.
    Open {
        netns: String,
        addr: SocketAddr,
        count: u64,
        #[arg(long, default_value_t = 0)]
        interval_ms: u64,
        #[arg(long, default_value_t = 500)]
        timeout_ms: u64,
    },
    /// COUNT clients started together, each connecting with TIMEOUT_MS until it
    /// succeeds, trying again PAUSE_MS after ECONNREFUSED, at most RETRIES times; holds
    /// the connections. `ok` counts clients; `categories`: first_refused, max_ok_us,
    /// ok_at_ms (CLOCK_MONOTONIC of the last success).
    Burst {
        netns: String,
        addr: SocketAddr,
        count: u64,
        timeout_ms: u64,
        retries: u64,
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
    },
    /// MEMBERS listeners on ADDR in one SO_REUSEPORT group: the first, with BACKLOG,
    /// never accepts; the others, with 1024, accept everything.
    Reuseport {
        netns: String,
        addr: SocketAddr,
        backlog: u64,
        members: u64,
    },
    /// A listener that accepts one connection, echoes on it, and accepts no other.
    Echo1 {
        netns: String,
        addr: SocketAddr,
        backlog: u64,
    },
    /// COUNT connects to distinct loopback addresses (127.x.y.z) on a closed PORT: each
    /// is refused, and each is a new destination for connguard.
    Spray {
        netns: String,
        count: u64,
        port: u16,
    },
    /// COUNT connects to ADDR, one at a time, each given up after TIMEOUT_MS if given;
    /// `categories`: p50_ns and p99_ns of the time connect() took to fail.
    Shedlat {
        netns: String,
        addr: SocketAddr,
        count: u64,
        #[arg(long)]
        timeout_ms: Option<u64>,
    },
    /// One connection, ROUNDS request/response exchanges, one every INTERVAL_MS.
    Talk {
        netns: String,
        addr: SocketAddr,
        rounds: u64,
        interval_ms: u64,
    },
    /// COUNT attempts with every outcome a connection can have, in a namespace with a
    /// route to 192.0.2.0/24 that swallows what is sent to 192.0.2.2; `categories`
    /// counts each kind, and gives the loopback servers' ports (`port_server_closed`;
    /// `port_client_closed`, which `addr_taken` connects to too; `port_refused`).
    Mixed { netns: String, count: u64 },
    /// COUNT connects to ADDR from one thread, spread over SPREAD_MS; `categories`:
    /// refill_us, the time from the first connect() to the last, each pause between two
    /// counted up to FILL_MS: what a token bucket that fills in FILL_MS, drained by the
    /// connects, gets back over them (a longer pause, the process descheduled, fills it
    /// no more).
    Paced {
        addr: SocketAddr,
        count: u64,
        spread_ms: u64,
        fill_ms: u64,
    },
    /// COUNT raw TCP segments to ADDR, SYNs (with --rst, RSTs) with sequence number SEQ,
    /// sent with IP_HDRINCL from the addresses of FROM (`a.b.c.d/len`: the i-th segment
    /// from its (i+1)-th address, wrapping; or `a.b.c.d`) and from source port SPORT (0:
    /// a new one per segment). No socket of this host has them: a spoofed source's SYNs,
    /// or a forged RST. IPv4 only.
    Segments {
        netns: String,
        from: String,
        addr: SocketAddr,
        count: u64,
        #[arg(long, default_value_t = 0)]
        sport: u16,
        #[arg(long, default_value_t = 0)]
        seq: u32,
        #[arg(long)]
        rst: bool,
    },
    /// COUNT connects from threads started together, each given up after TIMEOUT_MS;
    /// `categories`: refused_max_us, the longest a refused connect() took.
    Handshakes {
        netns: String,
        addr: SocketAddr,
        count: u64,
        timeout_ms: u64,
    },
}

impl Probe {
    /// `Connect`: COUNT blocking connects from CONCURRENCY threads.
    pub fn connect(addr: SocketAddr, count: u64, concurrency: u64) -> Probe {
        Probe::Connect {
            addr,
            count,
            concurrency,
        }
    }

    /// `Hold`: `connect`, then the connections held.
    pub fn hold(addr: SocketAddr, count: u64, concurrency: u64) -> Probe {
        Probe::Hold {
            addr,
            count,
            concurrency,
        }
    }

    /// `Listen`: a listener that accepts nothing.
    pub fn listen(netns: String, addr: SocketAddr, backlog: u64) -> Probe {
        Probe::Listen {
            netns,
            addr,
            backlog,
            accept_after_ms: None,
            on_usr1: false,
        }
    }

    /// `Churn`: COUNT connections as fast as they go, each closed after the server's
    /// FIN.
    pub fn churn(netns: String, addr: SocketAddr, count: u64) -> Probe {
        Probe::Churn {
            netns,
            addr,
            count,
            per_second: 0,
            reset: false,
        }
    }

    /// The arguments that `Probe::parse` reads back as this value.
    pub fn args(&self) -> Vec<String> {
        fn s(v: &impl ToString) -> String {
            v.to_string()
        }
        match self {
            Probe::Connect {
                addr,
                count,
                concurrency,
            } => vec!["connect".into(), s(addr), s(count), s(concurrency)],
            Probe::Hold {
                addr,
                count,
                concurrency,
            } => vec!["hold".into(), s(addr), s(count), s(concurrency)],
            Probe::Storm {
                addr,
                threads,
                seconds,
            } => vec!["storm".into(), s(addr), s(threads), s(seconds)],
            Probe::Udp { addr, cycles } => vec!["udp".into(), s(addr), s(cycles)],
            Probe::Migrate { addr, cgroup_dir } => vec!["migrate".into(), s(addr), s(cgroup_dir)],
            Probe::Tfo { netns, addr } => vec!["tfo".into(), s(netns), s(addr)],
            Probe::Mptcp { addr, count } => vec!["mptcp".into(), s(addr), s(count)],
            Probe::FailHold {
                netns,
                addr,
                listen,
            } => [
                vec!["fail-hold".into(), s(netns), s(addr)],
                if *listen {
                    vec!["--listen".into()]
                } else {
                    vec![]
                },
            ]
            .concat(),
            Probe::Serve { netns, ports } => [
                vec!["serve".into(), s(netns)],
                ports.iter().map(s).collect(),
            ]
            .concat(),
            Probe::Churn {
                netns,
                addr,
                count,
                per_second,
                reset,
            } => {
                let mut a = vec!["churn".into(), s(netns), s(addr), s(count), s(per_second)];
                if *reset {
                    a.push("--reset".into());
                }
                a
            }
            Probe::Bind {
                netns,
                addr,
                count,
                destinations,
            } => {
                let mut a = vec!["bind".into(), s(netns), s(addr), s(count)];
                if !destinations.is_empty() {
                    let list: Vec<String> = destinations.iter().map(s).collect();
                    a.push(list.join(","));
                }
                a
            }
            Probe::Listen {
                netns,
                addr,
                backlog,
                accept_after_ms,
                on_usr1,
            } => {
                let mut a = vec!["listen".into(), s(netns), s(addr), s(backlog)];
                if let Some(ms) = accept_after_ms {
                    a.extend(["--accept-after-ms".into(), s(ms)]);
                }
                if *on_usr1 {
                    a.push("--on-usr1".into());
                }
                a
            }
            Probe::Open {
                netns,
                addr,
                count,
                interval_ms,
                timeout_ms,
            } => vec![
                "open".into(),
                s(netns),
                s(addr),
                s(count),
                "--interval-ms".into(),
                s(interval_ms),
                "--timeout-ms".into(),
                s(timeout_ms),
            ],
            Probe::Burst {
                netns,
                addr,
                count,
                timeout_ms,
                retries,
                pause_ms,
            } => vec![
                "burst".into(),
                s(netns),
                s(addr),
                s(count),
                s(timeout_ms),
                s(retries),
                "--pause-ms".into(),
                s(pause_ms),
            ],
            Probe::Reuseport {
                netns,
                addr,
                backlog,
                members,
            } => vec![
                "reuseport".into(),
                s(netns),
                s(addr),
                s(backlog),
                s(members),
            ],
            Probe::Echo1 {
                netns,
                addr,
                backlog,
            } => vec!["echo1".into(), s(netns), s(addr), s(backlog)],
            Probe::Segments {
                netns,
                from,
                addr,
                count,
                sport,
                seq,
                rst,
            } => {
                let mut a = vec![
                    "segments".into(),
                    s(netns),
                    s(from),
                    s(addr),
                    s(count),
                    "--sport".into(),
                    s(sport),
                    "--seq".into(),
                    s(seq),
                ];
                if *rst {
                    a.push("--rst".into());
                }
                a
            }
            Probe::Spray { netns, count, port } => {
                vec!["spray".into(), s(netns), s(count), s(port)]
            }
            Probe::Shedlat {
                netns,
                addr,
                count,
                timeout_ms,
            } => {
                let mut a = vec!["shedlat".into(), s(netns), s(addr), s(count)];
                if let Some(ms) = timeout_ms {
                    a.extend(["--timeout-ms".into(), s(ms)]);
                }
                a
            }
            Probe::Talk {
                netns,
                addr,
                rounds,
                interval_ms,
            } => vec!["talk".into(), s(netns), s(addr), s(rounds), s(interval_ms)],
            Probe::Mixed { netns, count } => vec!["mixed".into(), s(netns), s(count)],
            Probe::Paced {
                addr,
                count,
                spread_ms,
                fill_ms,
            } => vec!["paced".into(), s(addr), s(count), s(spread_ms), s(fill_ms)],
            Probe::Handshakes {
                netns,
                addr,
                count,
                timeout_ms,
            } => vec![
                "handshakes".into(),
                s(netns),
                s(addr),
                s(count),
                s(timeout_ms),
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use clap::{CommandFactory, Parser};

    use super::*;

    /// Every mode, each optional argument both given and left out, reads back from its
    /// `args` as the same value.
    #[test]
    fn args_read_back_as_the_same_probe() {
        let addr: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let v6: SocketAddr = "[::1]:9".parse().unwrap();
        let ns = || "/run/netns/x".to_string();
        let probes = [
            Probe::Connect {
                addr,
                count: 5,
                concurrency: 2,
            },
            Probe::Hold {
                addr: v6,
                count: 1,
                concurrency: 1,
            },
            Probe::Storm {
                addr,
                threads: 4,
                seconds: 2,
            },
            Probe::Udp { addr, cycles: 3 },
            Probe::Migrate {
                addr,
                cgroup_dir: "/sys/fs/cgroup/a b".into(),
            },
            Probe::Tfo { netns: ns(), addr },
            Probe::Mptcp { addr, count: 2 },
            Probe::FailHold {
                netns: ns(),
                addr,
                listen: false,
            },
            Probe::FailHold {
                netns: ns(),
                addr,
                listen: true,
            },
            Probe::Serve {
                netns: ns(),
                ports: vec![ServePort::plain(8080), ServePort::greeting(8082)],
            },
            Probe::Churn {
                netns: ns(),
                addr,
                count: 150,
                per_second: 0,
                reset: false,
            },
            Probe::Churn {
                netns: ns(),
                addr,
                count: 1,
                per_second: 10,
                reset: true,
            },
            Probe::Bind {
                netns: ns(),
                addr,
                count: 3,
                destinations: Vec::new(),
            },
            Probe::Bind {
                netns: ns(),
                addr,
                count: 3,
                destinations: vec![addr, v6],
            },
            Probe::Listen {
                netns: ns(),
                addr,
                backlog: 8,
                accept_after_ms: None,
                on_usr1: false,
            },
            Probe::Listen {
                netns: ns(),
                addr,
                backlog: 8,
                accept_after_ms: Some(300),
                on_usr1: false,
            },
            Probe::Listen {
                netns: ns(),
                addr,
                backlog: 8,
                accept_after_ms: None,
                on_usr1: true,
            },
            Probe::Open {
                netns: ns(),
                addr,
                count: 3,
                interval_ms: 10,
                timeout_ms: 3000,
            },
            Probe::Burst {
                netns: ns(),
                addr,
                count: 20,
                timeout_ms: 3000,
                retries: 0,
                pause_ms: 0,
            },
            Probe::Burst {
                netns: ns(),
                addr,
                count: 20,
                timeout_ms: 3000,
                retries: 5,
                pause_ms: 50,
            },
            Probe::Reuseport {
                netns: ns(),
                addr,
                backlog: 1,
                members: 3,
            },
            Probe::Echo1 {
                netns: ns(),
                addr,
                backlog: 8,
            },
            Probe::Spray {
                netns: ns(),
                count: 100,
                port: 9,
            },
            Probe::Segments {
                netns: ns(),
                from: "10.200.0.0/15".into(),
                addr,
                count: 100_000,
                sport: 0,
                seq: 0,
                rst: false,
            },
            Probe::Segments {
                netns: ns(),
                from: "192.0.2.2".into(),
                addr,
                count: 1,
                sport: 40000,
                seq: 7,
                rst: true,
            },
            Probe::Shedlat {
                netns: ns(),
                addr,
                count: 40,
                timeout_ms: None,
            },
            Probe::Shedlat {
                netns: ns(),
                addr,
                count: 40,
                timeout_ms: Some(1000),
            },
            Probe::Talk {
                netns: ns(),
                addr,
                rounds: 5,
                interval_ms: 100,
            },
            Probe::Mixed {
                netns: ns(),
                count: 1000,
            },
            Probe::Paced {
                addr,
                count: 1000,
                spread_ms: 10_000,
                fill_ms: 100,
            },
            Probe::Handshakes {
                netns: ns(),
                addr,
                count: 16,
                timeout_ms: 3000,
            },
        ];
        for p in &probes {
            let args = p.args();
            let read =
                Probe::try_parse_from(std::iter::once("guard-probe".into()).chain(args.clone()));
            assert_eq!(read.as_ref().ok(), Some(p), "{args:?}: {read:?}");
        }
        let tested: BTreeSet<String> = probes.iter().map(|p| p.args()[0].clone()).collect();
        let modes: BTreeSet<String> = Probe::command()
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .filter(|n| n != "help")
            .collect();
        assert_eq!(tested, modes);
    }
}

//! What a host publishes in etcd, and where.
//!
//! Keys, below the configured prefix (default `/connguard/fleet/`):
//! - `<prefix><budget>/hosts/<identity>`: the host's [`Record`] (JSON), attached to the
//!   host's lease, so that etcd deletes it when the host stops renewing;
//! - `<prefix><budget>/raise`: no value; its mod_revision changes with every write that
//!   raises a claim on the budget (see the module's correctness argument).

pub use connguard_api::fleet::{Record, valid_segment};

/// The store's key layout for one fleet.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

/// What a key of the fleet's prefix is.
#[derive(Debug, PartialEq, Eq)]
pub enum Key<'a> {
    Host { budget: &'a str, identity: &'a str },
    Raise { budget: &'a str },
}

impl Keys {
    /// `prefix` ends with `/` (one is added otherwise).
    pub fn new(prefix: &str) -> Keys {
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Keys { prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn host(&self, budget: &str, identity: &str) -> String {
        format!("{}{budget}/hosts/{identity}", self.prefix)
    }

    pub fn raise(&self, budget: &str) -> String {
        format!("{}{budget}/raise", self.prefix)
    }

    /// The budget's keys all start with this.
    pub fn budget(&self, budget: &str) -> String {
        format!("{}{budget}/", self.prefix)
    }

    pub fn parse<'a>(&self, key: &'a str) -> Option<Key<'a>> {
        let rest = key.strip_prefix(self.prefix.as_str())?;
        let (budget, rest) = rest.split_once('/')?;
        match rest.split_once('/') {
            Some(("hosts", identity)) if !identity.contains('/') => {
                Some(Key::Host { budget, identity })
            }
            None if rest == "raise" => Some(Key::Raise { budget }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_foreign_keys_are_not_ours() {
        let k = Keys::new("/cg/fleet");
        assert_eq!(k.host("db", "h1"), "/cg/fleet/db/hosts/h1");
        assert_eq!(
            k.parse(&k.host("db", "h1")),
            Some(Key::Host {
                budget: "db",
                identity: "h1"
            })
        );
        assert_eq!(k.parse(&k.raise("db")), Some(Key::Raise { budget: "db" }));
        assert_eq!(k.parse("/cg/fleet/db/other"), None);
        assert_eq!(k.parse("/cg/fleet/db/hosts/a/b"), None);
        assert_eq!(k.parse("/elsewhere/db/raise"), None);
        assert!(k.budget("db").starts_with(k.prefix()));
        assert!(!valid_segment("a/b") && !valid_segment("") && valid_segment("host-1"));
    }

    #[test]
    fn a_claim_is_the_share_or_the_active_connections_above_it() {
        let r = Record {
            identity: "h".into(),
            lease: 1,
            has: 20,
            active: 30,
            wants: 0,
            weight: 1,
            floor: 0,
            total: 60,
            destinations: vec![],
            based_on: 0,
        };
        assert_eq!(r.claim(), 30);
        let drained = Record {
            active: 10,
            ..r.clone()
        };
        assert_eq!(drained.claim(), 20);
        assert!(!drained.takes_more_than(Some(&r)));
        assert!(r.takes_more_than(Some(&drained)));
        assert!(
            Record {
                total: 50,
                ..drained.clone()
            }
            .takes_more_than(Some(&drained))
        );
        assert!(drained.takes_more_than(None));
        assert!(
            !Record {
                has: 0,
                active: 0,
                ..r
            }
            .takes_more_than(None)
        );
    }
}

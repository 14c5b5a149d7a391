//! The JSON of a `stats` answer. serde_json writes the snapshot, and `Rows` writes each
//! scope's destination rows into it, which are nearly all of it (a row of 14 fields per
//! tracked destination), byte for byte as serde_json writes them (tested below) with less
//! work: serde_json escapes each of a row's keys and strings byte by byte, where the keys
//! are constants, an endpoint's text (digits, hex digits, `.`, `:` and brackets) has
//! nothing to escape, and a rule's name is escaped once per answer, not once per row.
//!
//! The rows are spliced through serde_json's `Formatter`, which sees every key and
//! container it writes: the rows of the n-th scope go into the n-th
//! `scopes[].destinations` array, written empty by serde_json.
use std::{
    collections::{HashMap, hash_map::Entry},
    io::{self, Write},
    sync::Arc,
};

use connguard_api::stats::{DestStats, Snapshot};
use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter};

/// Writes `snapshot` as `serde_json::to_writer` does. Its rows are taken out while it
/// is written and put back after, so that the caller frees them once the answer is sent.
pub fn write(out: &mut impl Write, snapshot: &mut Snapshot) -> io::Result<()> {
    let mut rows = Rows {
        scopes: snapshot
            .scopes
            .iter_mut()
            .map(|s| std::mem::take(&mut s.destinations))
            .collect(),
        rules: HashMap::new(),
    };
    let splice = Splice {
        rows: &mut rows,
        next_scope: 0,
        open: Vec::new(),
        key: None,
    };
    let written = snapshot
        .serialize(&mut serde_json::Serializer::with_formatter(out, splice))
        .map_err(io::Error::from);
    for (scope, rows) in snapshot.scopes.iter_mut().zip(rows.scopes) {
        scope.destinations = rows;
    }
    written
}

/// A container serde_json has begun and not ended, with what it is for `Splice`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    /// An object, and the last key it was given, where that key is one `Splice` follows.
    Object(Option<Key>),
    Array,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Scopes,
    Destinations,
}

/// serde_json's compact output, with each scope's rows written into its `destinations`.
struct Splice<'a> {
    rows: &'a mut Rows,
    /// The index of the scope whose `destinations` comes next.
    next_scope: usize,
    open: Vec<Open>,
    /// The text of the key being written (while a key is written).
    key: Option<Vec<u8>>,
}

impl Splice<'_> {
    /// Whether an array begun (or ended) here is a scope's `destinations`: the value of
    /// that key in an object of the array that is the value of the root object's `scopes`.
    fn at_destinations(&self) -> bool {
        self.open
            == [
                Open::Object(Some(Key::Scopes)),
                Open::Array,
                Open::Object(Some(Key::Destinations)),
            ]
    }
}

impl Formatter for Splice<'_> {
    fn begin_object<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open.push(Open::Object(None));
        CompactFormatter.begin_object(writer)
    }

    fn end_object<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open.pop();
        CompactFormatter.end_object(writer)
    }

    fn begin_array<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open.push(Open::Array);
        CompactFormatter.begin_array(writer)
    }

    fn end_array<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.open.pop();
        if self.at_destinations() {
            // serde_json wrote `[` for the emptied vector and writes `]` below.
            let scope = self.next_scope;
            self.next_scope += 1;
            self.rows.write(writer, scope)?;
        }
        CompactFormatter.end_array(writer)
    }

    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.key = Some(Vec::new());
        CompactFormatter.begin_object_key(writer, first)
    }

    fn write_string_fragment<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if let Some(key) = &mut self.key {
            key.extend_from_slice(fragment.as_bytes());
        }
        CompactFormatter.write_string_fragment(writer, fragment)
    }

    fn write_char_escape<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        char_escape: serde_json::ser::CharEscape,
    ) -> io::Result<()> {
        // A key with an escape is none that Splice follows.
        if let Some(key) = &mut self.key {
            key.push(b'\\');
        }
        CompactFormatter.write_char_escape(writer, char_escape)
    }

    fn end_object_key<W: ?Sized + Write>(&mut self, writer: &mut W) -> io::Result<()> {
        let key = match self.key.take().as_deref() {
            Some(b"scopes") => Some(Key::Scopes),
            Some(b"destinations") => Some(Key::Destinations),
            _ => None,
        };
        if let Some(Open::Object(last)) = self.open.last_mut() {
            *last = key;
        }
        CompactFormatter.end_object_key(writer)
    }
}

/// The destination rows of each scope, and the JSON of the rule names written so far.
struct Rows {
    scopes: Vec<Vec<DestStats>>,
    /// By the address of the rule's shared name (the rows of a rule share one `Arc`).
    rules: HashMap<usize, Vec<u8>>,
}

impl Rows {
    /// The rows of the `scope`-th scope as the elements of a JSON array, between its
    /// brackets.
    fn write<W: ?Sized + Write>(&mut self, out: &mut W, scope: usize) -> io::Result<()> {
        let mut digits = itoa::Buffer::new();
        let rows = self.scopes.get(scope).map_or(&[][..], Vec::as_slice);
        for (i, row) in rows.iter().enumerate() {
            if i > 0 {
                out.write_all(b",")?;
            }
            out.write_all(b"{\"rule\":")?;
            match &row.rule {
                None => out.write_all(b"null")?,
                Some(rule) => {
                    let json = match self.rules.entry(Arc::as_ptr(rule) as *const u8 as usize) {
                        Entry::Occupied(e) => e.into_mut(),
                        Entry::Vacant(e) => e.insert(serde_json::to_vec(&**rule)?),
                    };
                    out.write_all(json)?;
                }
            }
            out.write_all(b",\"dst\":")?;
            if row
                .dst
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b".:[]".contains(&b))
            {
                out.write_all(b"\"")?;
                out.write_all(row.dst.as_bytes())?;
                out.write_all(b"\"")?;
            } else {
                serde_json::to_writer(&mut *out, &row.dst)?;
            }
            let c = &row.counts;
            for (key, value) in [
                (&b",\"active\":"[..], c.active),
                (b",\"peak\":", c.peak),
                (b",\"admitted\":", c.admitted),
                (b",\"shed\":", c.shed),
                (b",\"would_shed\":", c.would_shed),
                (b",\"connecting\":", c.connecting),
                (b",\"rate_limited\":", c.rate_limited),
                (b",\"handshake_limited\":", c.handshake_limited),
                (b",\"breaker_limited\":", c.breaker_limited),
                (b",\"breaker_opened\":", c.breaker_opened),
                (b",\"breaker_half_opened\":", c.breaker_half_opened),
                (b",\"breaker_closed\":", c.breaker_closed),
            ] {
                out.write_all(key)?;
                out.write_all(digits.format(value).as_bytes())?;
            }
            if let Some(breaker) = &row.breaker {
                out.write_all(b",\"breaker\":")?;
                serde_json::to_writer(&mut *out, breaker)?;
            }
            out.write_all(b"}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use connguard_api::stats::{BreakerStats, Counts, DestStats, ScopeStats, Snapshot};

    fn row(rule: Option<&std::sync::Arc<str>>, dst: &str, n: u64) -> DestStats {
        DestStats {
            rule: rule.cloned(),
            dst: dst.into(),
            counts: Counts {
                active: n,
                peak: n + 1,
                admitted: u64::MAX,
                shed: 3,
                would_shed: 4,
                connecting: 5,
                rate_limited: 6,
                handshake_limited: 7,
                breaker_limited: 8,
                breaker_opened: 9,
                breaker_half_opened: 10,
                breaker_closed: 11,
            },
            ..DestStats::default()
        }
    }

    /// A scope as `stats` makes one, with `destinations`; its name, cgroup and warning
    /// carry the keys the splice follows, as text to escape.
    fn scope(name: &str, destinations: Vec<DestStats>) -> ScopeStats {
        let mut scope: ScopeStats = serde_json::from_value(serde_json::json!({
            "name": name, "cgroup": "\"destinations\":[]", "mode": "enforce",
            "active": 0, "peak": 0, "admitted": 0, "shed": 0, "would_shed": 0,
            "max_connections": 5, "max_connecting": null, "rate": null, "burst": null,
            "time_wait_created": 0, "rules": [], "destinations": [],
            "warnings": ["scopes", "destinations"],
        }))
        .unwrap();
        scope.destinations = destinations;
        scope
    }

    #[test]
    fn the_answer_is_serde_jsons_byte_for_byte() {
        let db: std::sync::Arc<str> = "db \"main\"\n".into();
        let api: std::sync::Arc<str> = "api".into();
        let mut broken = row(Some(&db), "10.0.0.9:5432", 2);
        broken.breaker = Some(Box::new(BreakerStats {
            state: "half_open".into(),
            step: Some(1),
            percent: 25,
            ..BreakerStats::default()
        }));
        let mut snapshot: Snapshot = serde_json::from_value(serde_json::json!({
            "policy": {"source": "p.toml", "generation": 1, "last_error": null},
            "scopes": [], "internal_errors": 0, "programs": [], "eaddrnotavail": [],
            "watched_ports": [], "listeners": [],
        }))
        .unwrap();
        snapshot.scopes = vec![
            scope(
                "destinations",
                vec![
                    row(Some(&db), "10.0.0.7:5432", 0),
                    row(None, "[fd00::1]:443", 1),
                    broken,
                    row(Some(&api), "[::ffff:10.0.0.1]:80", 3),
                    row(Some(&db), "odd\"text", 4),
                ],
            ),
            scope("empty", Vec::new()),
            scope("scopes", vec![row(Some(&api), "127.0.0.1:9", 7)]),
        ];
        let expected = serde_json::to_vec(&snapshot).unwrap();
        let mut written = Vec::new();
        super::write(&mut written, &mut snapshot).unwrap();
        assert_eq!(
            snapshot.scopes[0].destinations.len(),
            5,
            "the rows are put back"
        );
        assert_eq!(
            String::from_utf8(written).unwrap(),
            String::from_utf8(expected).unwrap()
        );
    }
}

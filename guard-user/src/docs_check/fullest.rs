//! The fullest value of a serde type, and the field paths of its JSON.
//!
//! A deserializer that makes every `Option` `Some`, every sequence and map hold one
//! element and every struct every field, so that serializing the value writes every
//! field the JSON can carry. A struct with a `#[serde(flatten)]` field is deserialized
//! as a map whose keys serde does not name: they are learned from the errors the
//! attempt ends with (`missing field`) and from the keys the value serializes to, and
//! the attempt is made again until no new key comes. A field of such a struct that is
//! optional and left out of the JSON when empty (`skip_serializing_if`) shows in neither,
//! and is not found: the caller sets it.
use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use serde::{
    Serialize,
    de::{
        self, DeserializeOwned, DeserializeSeed, Deserializer, EnumAccess, Expected, MapAccess,
        SeqAccess, Unexpected, VariantAccess, Visitor, value::StrDeserializer,
    },
};
use serde_json::Value;

/// What `deserialize_any` gives at a path (a value buffered for a flattened struct).
/// Without one, a number that names the path, so that a type error tells where it was.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Bool,
    Seq,
    Map,
}

/// Numbers at or past this are sentinels: index + SENTINEL into `Attempt::sentinels`.
const SENTINEL: u64 = 1000;

/// What is known of the type, kept across attempts.
#[derive(Default)]
struct Learned {
    /// Keys of the structs deserialized as maps (flattened), by path.
    keys: BTreeMap<String, BTreeSet<String>>,
    /// Kinds of buffered values, by path.
    kinds: BTreeMap<String, Kind>,
}

/// State of one attempt, which the error constructors (which take no `self`) read.
#[derive(Default)]
struct Attempt {
    /// Paths of the maps being deserialized, innermost last.
    maps: Vec<String>,
    /// Paths by sentinel.
    sentinels: Vec<String>,
    /// Paths of real maps (keys are data, not fields).
    real_maps: BTreeSet<String>,
    /// Paths of structs deserialized as maps (they have a flattened field).
    flattened: BTreeSet<String>,
}

thread_local! {
    static ATTEMPT: RefCell<Attempt> = RefCell::default();
}

/// Why an attempt failed: something learned, or a plain error.
#[derive(Debug)]
pub enum Error {
    MissingField { map: String, field: &'static str },
    WrongKind { path: String, expected: String },
    Other(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::MissingField { map, field } => write!(f, "{map}: missing field `{field}`"),
            Error::WrongKind { path, expected } => write!(f, "{path}: expected {expected}"),
            Error::Other(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Error::Other(msg.to_string())
    }

    fn missing_field(field: &'static str) -> Self {
        let map = ATTEMPT.with(|a| a.borrow().maps.last().cloned());
        match map {
            Some(map) => Error::MissingField { map, field },
            None => Error::Other(format!("missing field `{field}` outside a map")),
        }
    }

    fn invalid_type(unexp: Unexpected, exp: &dyn Expected) -> Self {
        if let Unexpected::Unsigned(n) = unexp
            && n >= SENTINEL
            && let Some(path) =
                ATTEMPT.with(|a| a.borrow().sentinels.get((n - SENTINEL) as usize).cloned())
        {
            return Error::WrongKind {
                path,
                expected: exp.to_string(),
            };
        }
        Error::Other(format!("invalid type: {unexp}, expected {exp}"))
    }
}

/// The fullest value of `T`, serialized to JSON, and the paths of its real maps.
fn fullest<T: DeserializeOwned + Serialize>() -> (Value, BTreeSet<String>) {
    let mut learned = Learned::default();
    for _ in 0..1000 {
        ATTEMPT.with(|a| *a.borrow_mut() = Attempt::default());
        let attempt = T::deserialize(Fullest {
            path: String::new(),
            learned: &learned,
        });
        match attempt {
            Ok(value) => {
                let json = serde_json::to_value(&value).expect("a value serializes");
                for path in ATTEMPT.with(|a| std::mem::take(&mut a.borrow_mut().flattened)) {
                    learned.keys.entry(path).or_default();
                }
                if !learn_keys(&json, "", &mut learned) {
                    let maps = ATTEMPT.with(|a| std::mem::take(&mut a.borrow_mut().real_maps));
                    return (json, maps);
                }
            }
            Err(Error::MissingField { map, field }) => {
                learned.keys.entry(map).or_default().insert(field.into());
            }
            Err(Error::WrongKind { path, expected }) => {
                let kind = match expected.as_str() {
                    "a string" | "a borrowed string" | "a character" => Kind::Str,
                    "a boolean" => Kind::Bool,
                    e if e.starts_with("a sequence") || e.starts_with("an array") => Kind::Seq,
                    e if e.starts_with("struct ") || e == "a map" => Kind::Map,
                    e => panic!("{path}: no value of a kind serde expects as {e:?}"),
                };
                learned.kinds.insert(path, kind);
            }
            Err(e) => panic!("the fullest value of {}: {e}", std::any::type_name::<T>()),
        }
    }
    panic!(
        "the fullest value of {} was not found in 1000 attempts",
        std::any::type_name::<T>()
    );
}

/// The fullest value of `T` (every option set, every list of one).
pub fn value<T: DeserializeOwned + Serialize>() -> T {
    serde_json::from_value(fullest::<T>().0).expect("the fullest value reads back")
}

/// Every field path of `value`'s JSON: `a.b` for a field of an object, `a[]` for the
/// elements of an array (`a[].b` their fields). A map whose keys are data (not fields)
/// is one path; the fields of its values, if objects, are under `a.*`.
pub fn fields<T: DeserializeOwned + Serialize>(value: &T) -> BTreeSet<String> {
    let maps = fullest::<T>().1;
    let json = serde_json::to_value(value).expect("a value serializes");
    let mut out = BTreeSet::new();
    fn walk(v: &Value, path: &str, maps: &BTreeSet<String>, out: &mut BTreeSet<String>) {
        match v {
            Value::Object(o) if maps.contains(path) => {
                for v in o.values() {
                    walk(v, &format!("{path}.*"), maps, out);
                }
            }
            Value::Object(o) => {
                for (k, v) in o {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    out.insert(p.clone());
                    walk(v, &p, maps, out);
                }
            }
            Value::Array(a) => {
                for v in a {
                    walk(v, &format!("{path}[]"), maps, out);
                }
            }
            _ => {}
        }
    }
    walk(&json, "", &maps, &mut out);
    out
}

/// Adds the keys a serialized value has at the paths of flattened structs; whether any
/// was new.
fn learn_keys(v: &Value, path: &str, learned: &mut Learned) -> bool {
    match v {
        Value::Object(o) => {
            let mut new = false;
            if let Some(keys) = learned.keys.get_mut(path) {
                for k in o.keys() {
                    new |= keys.insert(k.clone());
                }
            }
            for (k, v) in o {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                new |= learn_keys(v, &p, learned);
            }
            new
        }
        Value::Array(a) => a.iter().fold(false, |new, v| {
            learn_keys(v, &format!("{path}[]"), learned) | new
        }),
        _ => false,
    }
}

/// The deserializer of the fullest value at `path`.
#[derive(Clone)]
struct Fullest<'a> {
    path: String,
    learned: &'a Learned,
}

impl<'a> Fullest<'a> {
    fn at(&self, suffix: &str) -> Fullest<'a> {
        let path = if self.path.is_empty() || suffix.starts_with('[') {
            format!("{}{suffix}", self.path)
        } else {
            format!("{}.{suffix}", self.path)
        };
        Fullest {
            path,
            learned: self.learned,
        }
    }

    fn seq<'de, V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_seq(Elements {
            of: self.at("[]"),
            left: len,
        })
    }

    fn map<'de, V: Visitor<'de>>(self, keys: Vec<String>, visitor: V) -> Result<V::Value, Error> {
        ATTEMPT.with(|a| a.borrow_mut().maps.push(self.path.clone()));
        let out = visitor.visit_map(Entries {
            of: self,
            keys,
            next: 0,
        });
        ATTEMPT.with(|a| a.borrow_mut().maps.pop());
        out
    }
}

/// Deserializer methods that give the same leaf value whatever the path.
macro_rules! leaves {
    ($($method:ident => $visit:ident($($value:expr)?)),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            visitor.$visit($($value)?)
        })*
    };
}

impl<'de> Deserializer<'de> for Fullest<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.learned.kinds.get(&self.path).copied() {
            None => {
                let n = ATTEMPT.with(|a| {
                    let mut a = a.borrow_mut();
                    a.sentinels.push(self.path.clone());
                    a.sentinels.len() - 1
                });
                visitor.visit_u64(SENTINEL + n as u64)
            }
            Some(Kind::Str) => visitor.visit_str("x"),
            Some(Kind::Bool) => visitor.visit_bool(true),
            Some(Kind::Seq) => self.seq(1, visitor),
            Some(Kind::Map) => {
                let keys = self.keys();
                self.map(keys, visitor)
            }
        }
    }

    leaves! {
        deserialize_bool => visit_bool(true),
        deserialize_i8 => visit_i8(1),
        deserialize_i16 => visit_i16(1),
        deserialize_i32 => visit_i32(1),
        deserialize_i64 => visit_i64(1),
        deserialize_u8 => visit_u8(1),
        deserialize_u16 => visit_u16(1),
        deserialize_u32 => visit_u32(1),
        deserialize_u64 => visit_u64(1),
        deserialize_f32 => visit_f32(0.5),
        deserialize_f64 => visit_f64(0.5),
        deserialize_char => visit_char('x'),
        deserialize_str => visit_str("x"),
        deserialize_string => visit_str("x"),
        deserialize_bytes => visit_bytes(b"x"),
        deserialize_byte_buf => visit_bytes(b"x"),
        deserialize_ignored_any => visit_unit(),
        deserialize_identifier => visit_str("x"),
        deserialize_unit => visit_unit(),
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.seq(1, visitor)
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Error> {
        self.seq(len, visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.seq(len, visitor)
    }

    /// A struct with a flattened field (its keys as learned), or a real map (one entry).
    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        if visitor_expects_struct(&visitor) {
            ATTEMPT.with(|a| a.borrow_mut().flattened.insert(self.path.clone()));
            let keys = self.keys();
            self.map(keys, visitor)
        } else {
            ATTEMPT.with(|a| a.borrow_mut().real_maps.insert(self.path.clone()));
            self.map(vec!["x".into()], visitor)
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let keys = fields.iter().map(|f| f.to_string()).collect();
        self.map(keys, visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_enum(Variant {
            of: self,
            name: variants.first().copied().unwrap_or_default(),
        })
    }
}

impl Fullest<'_> {
    fn keys(&self) -> Vec<String> {
        self.learned
            .keys
            .get(&self.path)
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// Whether a map visitor builds a struct (serde names it "struct NAME").
fn visitor_expects_struct<'de, V: Visitor<'de>>(visitor: &V) -> bool {
    struct Expecting<'v, V>(&'v V);
    impl<'de, V: Visitor<'de>> fmt::Display for Expecting<'_, V> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            self.0.expecting(f)
        }
    }
    Expecting(visitor).to_string().starts_with("struct ")
}

struct Elements<'a> {
    of: Fullest<'a>,
    left: usize,
}

impl<'de> SeqAccess<'de> for Elements<'_> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(self.of.clone()).map(Some)
    }
}

struct Entries<'a> {
    of: Fullest<'a>,
    keys: Vec<String>,
    next: usize,
}

impl<'de> MapAccess<'de> for Entries<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some(key) = self.keys.get(self.next) else {
            return Ok(None);
        };
        seed.deserialize(StrDeserializer::new(key)).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let key = &self.keys[self.next];
        self.next += 1;
        seed.deserialize(self.of.at(key))
    }
}

struct Variant<'a> {
    of: Fullest<'a>,
    name: &'static str,
}

impl<'de, 'a> EnumAccess<'de> for Variant<'a> {
    type Error = Error;
    type Variant = Fullest<'a>;

    fn variant_seed<S: DeserializeSeed<'de>>(
        self,
        seed: S,
    ) -> Result<(S::Value, Fullest<'a>), Error> {
        let v = seed.deserialize(StrDeserializer::<Error>::new(self.name))?;
        Ok((v, self.of))
    }
}

impl<'de> VariantAccess<'de> for Fullest<'_> {
    type Error = Error;

    fn unit_variant(self) -> Result<(), Error> {
        Ok(())
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<S::Value, Error> {
        seed.deserialize(self)
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Error> {
        self.seq(len, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.map(fields.iter().map(|f| f.to_string()).collect(), visitor)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::*;

    #[derive(Serialize, Deserialize)]
    struct Outer {
        name: String,
        #[serde(flatten)]
        inner: Inner,
        #[serde(default)]
        leaves: Vec<Leaf>,
        map: BTreeMap<String, u8>,
        pair: [u16; 2],
    }

    /// Only optional fields, flattened: no `missing field` names them.
    #[derive(Serialize, Deserialize)]
    struct Inner {
        rate: Option<String>,
        #[serde(default)]
        count: u64,
    }

    #[derive(Serialize, Deserialize)]
    struct Leaf {
        x: u8,
        y: Option<bool>,
    }

    #[test]
    fn every_field_is_found_through_flatten_options_lists_and_maps() {
        let fields: Vec<String> = fields(&value::<Outer>()).into_iter().collect();
        assert_eq!(
            fields,
            [
                "count",
                "leaves",
                "leaves[].x",
                "leaves[].y",
                "map",
                "name",
                "pair",
                "rate"
            ]
        );
        let outer: Outer = value();
        assert_eq!(
            (
                outer.inner.rate.as_deref(),
                outer.leaves.len(),
                outer.map.len()
            ),
            (Some("x"), 1, 1)
        );
    }
}

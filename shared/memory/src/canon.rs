//! A canonical byte encoding for read-model state hashes.
//!
//! Hashing snapshot bytes would tie a state hash to serde's output, and a JSON object's key
//! order there depends on whether some crate in the build enabled serde_json's
//! `preserve_order`. This encoding fixes every choice itself: tagged, length-prefixed fields
//! and object keys in sorted order. Each read model hashes its own fields in a fixed order.

use std::collections::BTreeMap;

use crate::ScopeKey;
use chrono::{DateTime, Utc};
use serde_json::Value;

/// A blake3 hasher fed through typed, self-delimiting writes.
pub struct Canon(blake3::Hasher);

impl Canon {
    /// A hasher whose output cannot collide with another model's: the domain is hashed first.
    pub fn new(domain: &str) -> Self {
        let mut canon = Self(blake3::Hasher::new());
        canon.str(domain);
        canon
    }

    pub fn finish(self) -> [u8; 32] {
        *self.0.finalize().as_bytes()
    }

    pub fn u8(&mut self, value: u8) {
        self.0.update(&[value]);
    }

    pub fn u64(&mut self, value: u64) {
        self.0.update(&value.to_le_bytes());
    }

    pub fn len(&mut self, len: usize) {
        self.u64(len as u64);
    }

    pub fn f64(&mut self, value: f64) {
        // -0.0 and 0.0 compare equal, so they must hash equal.
        let value = if value == 0.0 { 0.0 } else { value };
        self.0.update(&value.to_bits().to_le_bytes());
    }

    pub fn str(&mut self, value: &str) {
        self.len(value.len());
        self.0.update(value.as_bytes());
    }

    pub fn strs(&mut self, values: &[String]) {
        self.len(values.len());
        for value in values {
            self.str(value);
        }
    }

    pub fn opt_str(&mut self, value: Option<&str>) {
        match value {
            None => self.u8(0),
            Some(value) => {
                self.u8(1);
                self.str(value);
            }
        }
    }

    pub fn time(&mut self, value: DateTime<Utc>) {
        self.0.update(&value.timestamp().to_le_bytes());
        self.0.update(&value.timestamp_subsec_nanos().to_le_bytes());
    }

    pub fn opt_time(&mut self, value: Option<DateTime<Utc>>) {
        match value {
            None => self.u8(0),
            Some(value) => {
                self.u8(1);
                self.time(value);
            }
        }
    }

    pub fn opt_u64(&mut self, value: Option<u64>) {
        match value {
            None => self.u8(0),
            Some(value) => {
                self.u8(1);
                self.u64(value);
            }
        }
    }

    pub fn scope(&mut self, scope: &ScopeKey) {
        self.str(scope.tenant.as_str());
        self.str(scope.kind.as_str());
        self.str(scope.id.as_str());
    }

    pub fn json(&mut self, value: &Value) {
        match value {
            Value::Null => self.u8(0),
            Value::Bool(b) => {
                self.u8(1);
                self.u8(u8::from(*b));
            }
            Value::Number(n) => {
                // The tags keep 1 and 1.0 apart, exactly as `Value`'s equality does.
                if let Some(u) = n.as_u64() {
                    self.u8(2);
                    self.u64(u);
                } else if let Some(i) = n.as_i64() {
                    self.u8(3);
                    self.0.update(&i.to_le_bytes());
                } else {
                    self.u8(4);
                    self.f64(n.as_f64().unwrap_or(f64::NAN));
                }
            }
            Value::String(s) => {
                self.u8(5);
                self.str(s);
            }
            Value::Array(items) => {
                self.u8(6);
                self.len(items.len());
                for item in items {
                    self.json(item);
                }
            }
            Value::Object(map) => {
                self.u8(7);
                self.len(map.len());
                let sorted: BTreeMap<&String, &Value> = map.iter().collect();
                for (key, item) in sorted {
                    self.str(key);
                    self.json(item);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hash_json(value: &Value) -> [u8; 32] {
        let mut canon = Canon::new("test");
        canon.json(value);
        canon.finish()
    }

    #[test]
    fn object_key_order_does_not_change_the_hash() {
        let a: Value = serde_json::from_str(r#"{"a": 1, "b": [true, null]}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"b": [true, null], "a": 1}"#).unwrap();
        assert_eq!(hash_json(&a), hash_json(&b));
    }

    #[test]
    fn values_that_differ_hash_apart() {
        assert_ne!(hash_json(&json!(1)), hash_json(&json!(1.0)));
        assert_ne!(
            hash_json(&json!(["ab", "c"])),
            hash_json(&json!(["a", "bc"]))
        );
        assert_eq!(hash_json(&json!(0.0)), hash_json(&json!(-0.0)));
        let mut a = Canon::new("facts");
        let mut b = Canon::new("skills");
        a.str("x");
        b.str("x");
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn absent_and_present_options_hash_apart() {
        let mut none = Canon::new("test");
        none.opt_str(None);
        none.u64(0);
        let mut some = Canon::new("test");
        some.opt_str(Some(""));
        assert_ne!(none.finish(), some.finish());
    }
}

//! The canonical byte encoding behind [`crate::SkillRegistry::state_hash`]: tagged,
//! length-prefixed fields in a fixed order, independent of serde's output.

use chrono::{DateTime, Utc};
use engram_memory::ScopeKey;

pub(crate) struct Canon(blake3::Hasher);

impl Canon {
    /// A hasher whose output cannot collide with another model's: the domain is hashed first.
    pub(crate) fn new(domain: &str) -> Self {
        let mut canon = Self(blake3::Hasher::new());
        canon.str(domain);
        canon
    }

    pub(crate) fn finish(self) -> [u8; 32] {
        *self.0.finalize().as_bytes()
    }

    pub(crate) fn u8(&mut self, value: u8) {
        self.0.update(&[value]);
    }

    pub(crate) fn u64(&mut self, value: u64) {
        self.0.update(&value.to_le_bytes());
    }

    pub(crate) fn len(&mut self, len: usize) {
        self.u64(len as u64);
    }

    pub(crate) fn str(&mut self, value: &str) {
        self.len(value.len());
        self.0.update(value.as_bytes());
    }

    pub(crate) fn strs(&mut self, values: &[String]) {
        self.len(values.len());
        for value in values {
            self.str(value);
        }
    }

    pub(crate) fn opt_str(&mut self, value: Option<&str>) {
        match value {
            None => self.u8(0),
            Some(value) => {
                self.u8(1);
                self.str(value);
            }
        }
    }

    pub(crate) fn opt_u64(&mut self, value: Option<u64>) {
        match value {
            None => self.u8(0),
            Some(value) => {
                self.u8(1);
                self.u64(value);
            }
        }
    }

    pub(crate) fn time(&mut self, value: DateTime<Utc>) {
        self.0.update(&value.timestamp().to_le_bytes());
        self.0.update(&value.timestamp_subsec_nanos().to_le_bytes());
    }

    pub(crate) fn opt_time(&mut self, value: Option<DateTime<Utc>>) {
        match value {
            None => self.u8(0),
            Some(value) => {
                self.u8(1);
                self.time(value);
            }
        }
    }

    pub(crate) fn scope(&mut self, scope: &ScopeKey) {
        self.str(scope.tenant.as_str());
        self.str(scope.kind.as_str());
        self.str(scope.id.as_str());
    }
}

//! Working memory: short-lived per-scope state in a KV bucket with per-key TTL.
//!
//! Keys are `<tenant>.<scope_kind>.<scope_id>.<key>`, every token a validated identifier, so one
//! scope's keys can be listed or watched with a wildcard and never collide with another's.
//! TTL uses the server's per-message TTL (2.11+): an expired key simply disappears.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use engram_schema::{Ident, SchemaError, Scope};

use crate::provision::js_err;
use crate::{Bus, BusError};

/// How much of one scope's working memory a read may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryBounds {
    /// Keys listed from the server before reading stops listing.
    pub max_listed: usize,
    /// Entries returned.
    pub max_entries: usize,
    /// Value bytes returned in all; the entry that crosses it is cut short.
    pub max_bytes: usize,
}

impl Default for EntryBounds {
    fn default() -> Self {
        Self {
            max_listed: 1024,
            max_entries: 64,
            max_bytes: 256 * 1024,
        }
    }
}

/// What [`WorkingMemory::entries`] read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entries {
    pub items: Vec<(String, Bytes)>,
    /// Keys listed but not read because of the bounds (a lower bound: listing itself stops
    /// at `max_listed`).
    pub left_out: usize,
}

/// Handle on the working-memory bucket.
#[derive(Clone, Debug)]
pub struct WorkingMemory {
    bus: Bus,
    store: kv::Store,
}

impl Bus {
    /// Opens the working-memory bucket; run [`Bus::provision`] first.
    pub async fn working_memory(&self) -> Result<WorkingMemory, BusError> {
        let store = self
            .js
            .get_key_value(&self.config.working_memory.bucket)
            .await
            .map_err(js_err)?;
        Ok(WorkingMemory {
            bus: self.clone(),
            store,
        })
    }
}

impl WorkingMemory {
    fn key(tenant: &Ident, scope: &Scope, key: &str) -> Result<String, SchemaError> {
        let key = Ident::parse("working memory key", key)?;
        Ok(format!("{tenant}.{}.{}.{key}", scope.kind, scope.id))
    }

    /// Sets `key` in `scope`, expiring after `ttl` (or the configured default). Returns the
    /// revision.
    pub async fn put(
        &self,
        tenant: &Ident,
        scope: &Scope,
        key: &str,
        value: Bytes,
        ttl: Option<Duration>,
    ) -> Result<u64, BusError> {
        let key = Self::key(tenant, scope, key)?;
        let max = self.bus.config.working_memory.max_value_size;
        if value.len() > usize::try_from(max).unwrap_or(0) {
            return Err(BusError::Schema(SchemaError::TooLarge {
                size: value.len(),
                max: max as usize,
            }));
        }
        let ttl = ttl.unwrap_or(self.bus.config.working_memory.default_ttl);
        if ttl < Duration::from_secs(1) {
            return Err(BusError::Schema(SchemaError::InvalidField {
                field: "ttl",
                reason: "must be at least 1s".into(),
            }));
        }
        // kv::Store has no put-with-TTL; publishing to the bucket's subject with a TTL header is
        // exactly what such a put would do.
        let subject = format!("$KV.{}.{key}", self.bus.config.working_memory.bucket);
        let ack = self
            .bus
            .js
            .send_publish(
                subject,
                jetstream::message::PublishMessage::build()
                    .payload(value)
                    .ttl(ttl),
            )
            .await
            .map_err(js_err)?
            .await
            .map_err(js_err)?;
        Ok(ack.sequence)
    }

    /// The live value of `key`, or `None` if unset, deleted or expired.
    pub async fn get(
        &self,
        tenant: &Ident,
        scope: &Scope,
        key: &str,
    ) -> Result<Option<Bytes>, BusError> {
        let key = Self::key(tenant, scope, key)?;
        self.store.get(key).await.map_err(js_err)
    }

    /// The live entries of one scope, as (key, value), keys sorted, within `bounds`: at most
    /// `max_entries` of them and `max_bytes` of values, the first in key order. A scope can
    /// hold any number of keys, and each value may be as large as the bucket allows, so a
    /// reader that took them all could be made to read without end. One stream-info request
    /// finds the scope's keys (exact token match on tenant, kind and id), then each is read.
    pub async fn entries(
        &self,
        tenant: &Ident,
        scope: &Scope,
        bounds: EntryBounds,
    ) -> Result<Entries, BusError> {
        let scope_prefix = format!("{tenant}.{}.{}.", scope.kind, scope.id);
        let filter = format!("{}{scope_prefix}>", self.store.prefix);
        let mut subjects = self
            .store
            .stream
            .info_with_subjects(&filter)
            .await
            .map_err(js_err)?;
        let mut keys = Vec::new();
        while let Some(entry) = futures::StreamExt::next(&mut subjects).await {
            let (subject, _) = entry.map_err(js_err)?;
            if let Some(key) = subject.strip_prefix(&self.store.prefix) {
                keys.push(key.to_owned());
            }
            // Keys come in no particular order, so which ones are kept past the bound is
            // arbitrary; the bound on what is held is what matters.
            if keys.len() >= bounds.max_listed {
                break;
            }
        }
        keys.sort();
        let mut entries = Entries::default();
        let mut bytes = 0usize;
        for full_key in keys {
            if entries.items.len() >= bounds.max_entries || bytes >= bounds.max_bytes {
                entries.left_out += 1;
                continue;
            }
            if let Some(value) = self.store.get(full_key.as_str()).await.map_err(js_err)? {
                let short = full_key
                    .strip_prefix(&scope_prefix)
                    .unwrap_or(&full_key)
                    .to_owned();
                let value = value.slice(..value.len().min(bounds.max_bytes - bytes));
                bytes += value.len();
                entries.items.push((short, value));
            }
        }
        Ok(entries)
    }

    /// Removes every key of one scope, history and delete markers included (erasure);
    /// returns how many messages went.
    pub async fn purge_scope(&self, tenant: &Ident, scope: &Scope) -> Result<u64, BusError> {
        let filter = format!(
            "{}{tenant}.{}.{}.>",
            self.store.prefix, scope.kind, scope.id
        );
        let purged = self
            .store
            .stream
            .purge()
            .filter(&filter)
            .await
            .map_err(js_err)?;
        Ok(purged.purged)
    }

    /// How many live keys one scope holds.
    pub async fn keys_of(&self, tenant: &Ident, scope: &Scope) -> Result<u64, BusError> {
        let entries = self
            .entries(
                tenant,
                scope,
                EntryBounds {
                    max_listed: 1024,
                    max_entries: 1024,
                    max_bytes: 1,
                },
            )
            .await?;
        Ok((entries.items.len() + entries.left_out) as u64)
    }

    pub async fn delete(&self, tenant: &Ident, scope: &Scope, key: &str) -> Result<(), BusError> {
        let key = Self::key(tenant, scope, key)?;
        self.store.delete(key).await.map_err(js_err)
    }
}

//! Leases: which one of several replicas does a piece of work (consolidating a partition of
//! scopes), held in a KV bucket whose entries expire.
//!
//! A lease is a key. Holding it means having written it last: `create` takes a free one
//! (it fails if the key exists), `update` at the revision last written renews it (it fails
//! if someone else wrote since). The bucket's `max_age` is the lease's time to live: a
//! holder that stops renewing (crashed, partitioned) loses the key when its last write
//! expires, and the next `create` by another replica takes it over. A takeover therefore
//! comes at most one TTL plus one renewal period after the holder's last renewal.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::kv;

use crate::provision::js_err;
use crate::{Bus, BusError};

/// Leases held by one process, each renewed by [`Leases::hold`].
pub struct Leases {
    store: kv::Store,
    holder: String,
    /// The revision this process last wrote, per key it holds.
    held: HashMap<String, u64>,
}

impl Leases {
    /// Opens (or creates) `bucket` with entries living `ttl`; `holder` names this process
    /// in the keys it holds (unique per process: a restarted one is a new holder).
    pub async fn open(
        bus: &Bus,
        bucket: &str,
        ttl: Duration,
        holder: String,
    ) -> Result<Self, BusError> {
        let js = bus.jetstream();
        let store = match js.get_key_value(bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_key_value(kv::Config {
                    bucket: bucket.to_owned(),
                    description: "engram leases: which replica does which work".into(),
                    history: 1,
                    max_age: ttl,
                    num_replicas: bus.replicas(),
                    ..Default::default()
                })
                .await
                .map_err(js_err)?,
        };
        Ok(Self {
            store,
            holder,
            held: HashMap::new(),
        })
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Takes `key` if it is free, or renews it if this process holds it; returns whether
    /// this process holds it now. Call it at least every third of the TTL.
    pub async fn hold(&mut self, key: &str) -> Result<bool, BusError> {
        let value = bytes::Bytes::from(self.holder.clone());
        if let Some(revision) = self.held.get(key).copied() {
            match self.store.update(key, value.clone(), revision).await {
                Ok(revision) => {
                    self.held.insert(key.to_owned(), revision);
                    return Ok(true);
                }
                // Someone else wrote it (our lease expired and was taken), or it expired
                // and is gone: try to take it afresh below.
                Err(_) => {
                    self.held.remove(key);
                }
            }
        }
        match self.store.create(key, value).await {
            Ok(revision) => {
                self.held.insert(key.to_owned(), revision);
                Ok(true)
            }
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(js_err(e)),
        }
    }

    /// Who holds `key`, if anyone.
    pub async fn holder_of(&self, key: &str) -> Result<Option<String>, BusError> {
        Ok(self
            .store
            .get(key)
            .await
            .map_err(js_err)?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }
}

/// The keys of `store` that begin with `prefix` and hold or held a value, read from the
/// subjects its stream holds: one stream-info request, not a consumer over every key, and
/// no value read. A key deleted since is listed (its delete marker is a message); reading it
/// says it is gone.
pub async fn keys_with_prefix(store: &kv::Store, prefix: &str) -> Result<Vec<String>, BusError> {
    use futures::TryStreamExt as _;
    // A subject filter's `>` stands for whole tokens: filter on the prefix's last whole
    // token, and on the rest by name.
    let tokens = prefix.rfind('.').map_or("", |dot| &prefix[..=dot]);
    let subjects: Vec<(String, usize)> = store
        .stream
        .info_with_subjects(format!("{}{tokens}>", store.prefix))
        .await
        .map_err(js_err)?
        .try_collect()
        .await
        .map_err(js_err)?;
    Ok(subjects
        .into_iter()
        .filter_map(|(subject, _)| subject.strip_prefix(&store.prefix).map(str::to_owned))
        .filter(|key| key.starts_with(prefix))
        .collect())
}

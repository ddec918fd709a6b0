//! Versioned snapshots of read models: what a new projector replica (and, through them, a
//! new agent instance) loads before replaying the tail of the stream, and what lets the
//! stream be bounded by retention.
//!
//! # Storage
//! - The object: the model's exported state (`Projection::export`: the checkpoint format,
//!   magic, MessagePack of ledger and model, blake3) in the Object Store bucket
//!   `ENGRAM_SNAPSHOTS`, named `<projector>/<seq>`. An Object Store `put` to an existing
//!   name purges the old object, so names carry the sequence and are never reused for other
//!   content: two cuts at one sequence hold the same state.
//! - The index: one KV entry per snapshot in `ENGRAM_SNAPSHOT_INDEX`, key
//!   `<projector>.<seq, 20 digits>`, value a JSON [`SnapshotMeta`]: version, label,
//!   sequence, ledger, content hash, state hash, created_at and size. The index is written
//!   after the object, so an entry always names a complete object; an object without an
//!   entry (a crash in between) is invisible and overwritten by the next cut at its seq.
//! - Retention ([`SnapshotsConfig::keep`]): the newest `keep` unlabelled snapshots of each
//!   projector stay, and every labelled one; the rest are deleted, index first.
//!
//! # Reading
//! [`SnapshotStore::load_latest_good`] tries snapshots newest first and checks each
//! against its content hash and its own checksum. A corrupt or truncated one is reported
//! and skipped, never loaded: the caller falls back to the previous good one, or to a full
//! replay.

use std::time::Duration;

use async_nats::jetstream::{kv, object_store};
use chrono::{DateTime, Utc};
use engram_bus::Bus;
use engram_projection_runtime::{ApplyLedger, Cut};
use futures::TryStreamExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::io::AsyncReadExt;

/// The index entry format this build writes and reads.
pub const META_FORMAT: u32 = 1;

/// `[snapshots]` in engram.toml.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SnapshotsConfig {
    pub bucket: String,
    pub index: String,
    /// Unlabelled snapshots kept per projector (labelled ones are always kept).
    pub keep: usize,
    /// How often each projector that can export cuts a snapshot, when at least
    /// `min_events` were applied since the last one; 0 cuts only on demand.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    pub min_events: u64,
    /// Largest snapshot object, in bytes: a cut past it is refused and logged.
    pub max_bytes: u64,
    /// Projectors that cut no periodic snapshots, only asked-for ones: for example
    /// `["vector"]`, whose snapshot of a million 384-dimensional memories is about 2 GB and
    /// holds its loop while it encodes. Such a projector bootstraps by replay.
    pub skip_periodic: Vec<String>,
}

impl Default for SnapshotsConfig {
    fn default() -> Self {
        Self {
            bucket: "ENGRAM_SNAPSHOTS".into(),
            index: "ENGRAM_SNAPSHOT_INDEX".into(),
            keep: 3,
            interval: Duration::from_secs(10 * 60),
            min_events: 10_000,
            max_bytes: 4 * 1024 * 1024 * 1024,
            skip_periodic: Vec::new(),
        }
    }
}

impl SnapshotsConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.keep == 0 {
            return Err(
                "snapshots.keep must be at least 1: the newest snapshot is what a bootstrap loads"
                    .into(),
            );
        }
        for (field, name) in [("bucket", &self.bucket), ("index", &self.index)] {
            if name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(format!(
                    "snapshots.{field} {name:?}: use letters, digits, _ and -"
                ));
            }
        }
        Ok(())
    }
}

/// One snapshot, as the index holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SnapshotMeta {
    pub format: u32,
    pub projector: String,
    /// The version: the stream sequence the snapshot holds everything up to.
    pub version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Events the state counts and their digest (`ApplyLedger`).
    pub events: u64,
    pub digest: u64,
    /// blake3 of the object, hex.
    pub content_hash: String,
    /// The model's state hash at the cut, hex: equal to a full replay's at this sequence.
    pub state_hash: String,
    pub created_at: DateTime<Utc>,
    /// The snapshot's size; `content_hash` is of these bytes too.
    pub bytes: u64,
    /// Its Object Store name.
    pub object: String,
    /// How the object is stored: absent as it is, `zstd` compressed (see [`stored_form`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
    /// The object's size as stored, when it is encoded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
}

impl SnapshotMeta {
    pub fn ledger(&self) -> ApplyLedger {
        ApplyLedger {
            seq: self.version,
            events: self.events,
            digest: self.digest,
        }
    }
}

#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("snapshot store unavailable: {0}; is the nats server up, with JetStream?")]
    Unavailable(String),
    #[error("snapshot {object} is corrupt: {reason}")]
    Corrupt { object: String, reason: String },
    #[error(
        "no snapshot {projector} version {version}; `engram snapshot list` shows the ones kept"
    )]
    NotFound { projector: String, version: u64 },
    #[error("label {0:?}: use 1-64 of A-Z a-z 0-9 _ - .")]
    InvalidLabel(String),
    #[error(
        "{projector} already keeps {max} labelled snapshots, which retention never deletes; delete old ones (`engram snapshot list` shows them) before labelling more"
    )]
    TooManyLabelled { projector: String, max: usize },
    #[error("snapshot of {projector} is {bytes} bytes, over snapshots.max_bytes ({max})")]
    TooLarge {
        projector: String,
        bytes: u64,
        max: u64,
    },
}

fn unavailable(e: impl std::fmt::Display) -> SnapshotError {
    SnapshotError::Unavailable(e.to_string())
}

/// What a bootstrap loads: the newest snapshot that checks (none: replay everything), and
/// the newer ones it skipped on the way.
#[derive(Debug, Default)]
pub struct Selection {
    pub chosen: Option<(SnapshotMeta, Vec<u8>)>,
    /// Newer snapshots that did not check, with why.
    pub skipped: Vec<(SnapshotMeta, String)>,
}

/// Labelled snapshots one projector keeps at most.
pub const MAX_LABELLED: usize = 32;

/// The snapshot objects and their index.
#[derive(Clone)]
pub struct SnapshotStore {
    objects: object_store::ObjectStore,
    index: kv::Store,
    config: SnapshotsConfig,
    /// Bytes per Object Store message: see [`chunk_size`].
    chunk_size: usize,
}

/// The one encoding a stored snapshot may have besides none.
const ZSTD: &str = "zstd";

/// How much of a snapshot [`stored_form`] compresses to see whether the rest is worth it.
const COMPRESSION_SAMPLE: usize = 1 << 20;

/// A snapshot as it is stored, and its encoding: zstd (level 1) when a sample of it shrinks
/// to at most four fifths. The text models' and the fact table's snapshots shrink several
/// times, and loading them from the Object Store was most of a bootstrap at a million
/// events; vectors hardly shrink, and are stored as they are, without compressing them all
/// to find that out.
fn stored_form(bytes: &[u8]) -> (std::borrow::Cow<'_, [u8]>, Option<&'static str>) {
    let sample = &bytes[..bytes.len().min(COMPRESSION_SAMPLE)];
    let pays = zstd::bulk::compress(sample, 1).is_ok_and(|c| c.len() * 5 <= sample.len() * 4);
    if pays && let Ok(compressed) = zstd::bulk::compress(bytes, 1) {
        return (compressed.into(), Some(ZSTD));
    }
    (bytes.into(), None)
}

/// The Object Store's chunk size for snapshots: as large as the server's message limit
/// allows (with room for headers), at most 1 MiB. A snapshot of a million events is hundreds
/// of megabytes, and each chunk is one message through an ordered consumer when it is
/// loaded: the client's default of 128 KiB made loading a large part of a bootstrap.
fn chunk_size(max_payload: usize) -> usize {
    const DEFAULT: usize = 128 * 1024;
    const MAX: usize = 1024 * 1024;
    max_payload.saturating_sub(16 * 1024).clamp(DEFAULT, MAX)
}

impl std::fmt::Debug for SnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStore")
            .field("config", &self.config)
            .finish()
    }
}

fn key(projector: &str, version: u64) -> String {
    format!("{projector}.{version:020}")
}

fn check_label(label: &str) -> Result<(), SnapshotError> {
    let ok = (1..=64).contains(&label.len())
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(SnapshotError::InvalidLabel(label.to_owned()))
    }
}

impl SnapshotStore {
    /// Opens the bucket and the index, creating them if missing.
    pub async fn open(bus: &Bus, config: SnapshotsConfig) -> Result<Self, SnapshotError> {
        let js = bus.jetstream();
        let objects = match js.get_object_store(&config.bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: config.bucket.clone(),
                    description: Some("engram read-model snapshots".into()),
                    storage: async_nats::jetstream::stream::StorageType::File,
                    num_replicas: bus.replicas(),
                    ..Default::default()
                })
                .await
                .map_err(unavailable)?,
        };
        let index = match js.get_key_value(&config.index).await {
            Ok(store) => store,
            Err(_) => js
                .create_key_value(kv::Config {
                    bucket: config.index.clone(),
                    description: "engram snapshot index".into(),
                    history: 1,
                    num_replicas: bus.replicas(),
                    ..Default::default()
                })
                .await
                .map_err(unavailable)?,
        };
        Ok(Self {
            objects,
            index,
            config,
            chunk_size: chunk_size(bus.client().server_info().max_payload),
        })
    }

    pub fn config(&self) -> &SnapshotsConfig {
        &self.config
    }

    /// Stores a cut of `projector` under its sequence, indexes it, and applies retention.
    pub async fn put(
        &self,
        projector: &str,
        cut: &Cut,
        label: Option<&str>,
    ) -> Result<SnapshotMeta, SnapshotError> {
        if let Some(label) = label {
            check_label(label)?;
            // Labelled snapshots outlive retention, and agents may ask for them: bounded, or
            // a loop of labelled cuts would fill the store.
            let labelled = self
                .list(Some(projector))
                .await?
                .iter()
                .filter(|m| m.label.is_some() && m.version != cut.ledger.seq)
                .count();
            if labelled >= MAX_LABELLED {
                return Err(SnapshotError::TooManyLabelled {
                    projector: projector.to_owned(),
                    max: MAX_LABELLED,
                });
            }
        }
        let bytes = cut.bytes.len() as u64;
        if bytes > self.config.max_bytes {
            return Err(SnapshotError::TooLarge {
                projector: projector.to_owned(),
                bytes,
                max: self.config.max_bytes,
            });
        }
        let version = cut.ledger.seq;
        let object = format!("{projector}/{version}");
        let meta = SnapshotMeta {
            format: META_FORMAT,
            projector: projector.to_owned(),
            version,
            label: label.map(str::to_owned),
            events: cut.ledger.events,
            digest: cut.ledger.digest,
            content_hash: blake3::hash(&cut.bytes).to_hex().to_string(),
            state_hash: hex(&cut.state_hash),
            created_at: Utc::now(),
            bytes,
            object: object.clone(),
            encoding: None,
            stored_bytes: None,
        };
        let existing = self.meta(projector, version).await?;
        let same_object = existing
            .as_ref()
            .is_some_and(|m| m.content_hash == meta.content_hash);
        let meta = match &existing {
            // The object stays as it was stored.
            Some(existing) if same_object => SnapshotMeta {
                encoding: existing.encoding.clone(),
                stored_bytes: existing.stored_bytes,
                ..meta
            },
            _ => meta,
        };
        let meta = if same_object {
            meta
        } else {
            let (stored, encoding) = stored_form(&cut.bytes);
            let mut reader = &stored[..];
            let chunked = object_store::ObjectMetadata {
                name: object.clone(),
                chunk_size: Some(self.chunk_size),
                ..Default::default()
            };
            self.objects
                .put(chunked, &mut reader)
                .await
                .map_err(unavailable)?;
            SnapshotMeta {
                encoding: encoding.map(str::to_owned),
                stored_bytes: encoding.map(|_| stored.len() as u64),
                ..meta
            }
        };
        // A second cut at one sequence keeps the first's label unless it brings its own.
        let meta = SnapshotMeta {
            label: meta.label.or(existing.and_then(|m| m.label)),
            ..meta
        };
        let value = serde_json::to_vec(&meta).map_err(unavailable)?;
        self.index
            .put(key(projector, version), value.into())
            .await
            .map_err(unavailable)?;
        self.prune(projector).await?;
        Ok(meta)
    }

    /// One snapshot's index entry.
    pub async fn meta(
        &self,
        projector: &str,
        version: u64,
    ) -> Result<Option<SnapshotMeta>, SnapshotError> {
        let Some(value) = self
            .index
            .get(key(projector, version))
            .await
            .map_err(unavailable)?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&value)
            .map(Some)
            .map_err(|e| SnapshotError::Corrupt {
                object: key(projector, version),
                reason: format!("index entry does not decode: {e}"),
            })
    }

    /// Every indexed snapshot (of one projector if given), by projector then version.
    pub async fn list(&self, projector: Option<&str>) -> Result<Vec<SnapshotMeta>, SnapshotError> {
        let keys: Vec<String> = match projector {
            // One projector's keys only, from the subjects the index stream holds: a node
            // asks this of each instance it starts, and every partition's instances share
            // the index.
            // A label may hold dots: a key of projector `a.b` is not one of `a`'s.
            Some(p) => engram_bus::keys_with_prefix(&self.index, &format!("{p}."))
                .await
                .map_err(unavailable)?
                .into_iter()
                .filter(|key| !key[p.len() + 1..].contains('.'))
                .collect(),
            None => match self.index.keys().await {
                Ok(keys) => keys.try_collect().await.map_err(unavailable)?,
                Err(e) => return Err(unavailable(e)),
            },
        };
        let mut out = Vec::new();
        for key in keys {
            let Some(value) = self.index.get(&key).await.map_err(unavailable)? else {
                continue;
            };
            match serde_json::from_slice::<SnapshotMeta>(&value) {
                Ok(meta) => out.push(meta),
                Err(e) => {
                    tracing::warn!(key, error = %e, "skipping an index entry that does not decode")
                }
            }
        }
        out.sort_by(|a, b| (&a.projector, a.version).cmp(&(&b.projector, b.version)));
        Ok(out)
    }

    /// The object of `meta`, checked against its content hash.
    pub async fn load(&self, meta: &SnapshotMeta) -> Result<Vec<u8>, SnapshotError> {
        let corrupt = |reason: String| SnapshotError::Corrupt {
            object: meta.object.clone(),
            reason,
        };
        let mut object = match self.objects.get(meta.object.as_str()).await {
            Ok(object) => object,
            Err(e) => return Err(corrupt(format!("cannot be read: {e}"))),
        };
        // Bounded by the sizes the index states: a longer object is not the one indexed, and
        // nothing larger than a snapshot may be is read or inflated.
        if meta.bytes > self.config.max_bytes {
            return Err(corrupt(format!(
                "the index says {} bytes, more than snapshots.max_bytes ({})",
                meta.bytes, self.config.max_bytes
            )));
        }
        let stored = meta.stored_bytes.unwrap_or(meta.bytes);
        let mut bytes = Vec::with_capacity(stored.min(self.config.max_bytes) as usize);
        let read = (&mut object).take(stored + 1).read_to_end(&mut bytes).await;
        if let Err(e) = read {
            return Err(corrupt(format!("truncated or unreadable: {e}")));
        }
        if bytes.len() as u64 != stored {
            return Err(corrupt(format!(
                "{} bytes, the index says {stored}",
                bytes.len(),
            )));
        }
        let bytes = match meta.encoding.as_deref() {
            None => bytes,
            Some(ZSTD) => zstd::bulk::decompress(&bytes, meta.bytes as usize)
                .map_err(|e| corrupt(format!("does not decompress: {e}")))?,
            Some(other) => return Err(corrupt(format!("unknown encoding {other:?}"))),
        };
        if bytes.len() as u64 != meta.bytes {
            return Err(corrupt(format!(
                "{} bytes, the index says {}",
                bytes.len(),
                meta.bytes
            )));
        }
        if blake3::hash(&bytes).to_hex().as_str() != meta.content_hash {
            return Err(corrupt("content hash mismatch".into()));
        }
        Ok(bytes)
    }

    /// The newest snapshot of `projector` that loads and checks, at or below `version` if
    /// given (a stream sequence: each partition's instance cuts at its own, so a version
    /// names the newest cut of each that holds no later event); none when there is none,
    /// and the caller replays the whole stream. A version below every snapshot kept is
    /// [`SnapshotError::NotFound`]. `check` runs the model's own verification (its
    /// checksum and decoding) on the bytes.
    pub async fn load_latest_good(
        &self,
        projector: &str,
        version: Option<u64>,
        check: impl Fn(&[u8]) -> Result<(), String>,
    ) -> Result<Selection, SnapshotError> {
        let mut skipped = Vec::new();
        let mut metas = self.list(Some(projector)).await?;
        if let Some(v) = version {
            if !metas.is_empty() && !metas.iter().any(|m| m.version <= v) {
                return Err(SnapshotError::NotFound {
                    projector: projector.to_owned(),
                    version: v,
                });
            }
            metas.retain(|m| m.version <= v);
        }
        for meta in metas.into_iter().rev() {
            let checked = match self.load(&meta).await {
                Ok(bytes) => check(&bytes).map(|()| bytes),
                Err(SnapshotError::Unavailable(e)) => return Err(SnapshotError::Unavailable(e)),
                Err(e) => Err(e.to_string()),
            };
            match checked {
                Ok(bytes) => {
                    return Ok(Selection {
                        chosen: Some((meta, bytes)),
                        skipped,
                    });
                }
                Err(reason) => {
                    tracing::warn!(projector, version = meta.version, %reason, "snapshot does not check; trying the previous one");
                    skipped.push((meta, reason));
                }
            }
        }
        if !skipped.is_empty() {
            tracing::warn!(
                projector,
                skipped = skipped.len(),
                "no snapshot checks; a full replay is needed"
            );
        }
        Ok(Selection {
            chosen: None,
            skipped,
        })
    }

    /// Deletes one snapshot: index entry first, so nothing ever names a missing object.
    pub async fn delete(&self, meta: &SnapshotMeta) -> Result<(), SnapshotError> {
        self.index
            .purge(key(&meta.projector, meta.version))
            .await
            .map_err(unavailable)?;
        if let Err(e) = self.objects.delete(meta.object.as_str()).await {
            tracing::warn!(object = meta.object, error = %e, "snapshot object not deleted; it is no longer indexed");
        }
        Ok(())
    }

    /// Retention: keeps the newest [`SnapshotsConfig::keep`] unlabelled snapshots of
    /// `projector` and every labelled one; returns those deleted.
    pub async fn prune(&self, projector: &str) -> Result<Vec<SnapshotMeta>, SnapshotError> {
        let unlabelled: Vec<SnapshotMeta> = self
            .list(Some(projector))
            .await?
            .into_iter()
            .filter(|m| m.label.is_none())
            .collect();
        let excess = unlabelled.len().saturating_sub(self.config.keep);
        let mut deleted = Vec::new();
        for meta in unlabelled.into_iter().take(excess) {
            self.delete(&meta).await?;
            deleted.push(meta);
        }
        Ok(deleted)
    }
}

/// Hex of a 32-byte hash.
pub fn hex(hash: &[u8; 32]) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::{ZSTD, chunk_size, stored_form};

    #[test]
    fn snapshots_that_shrink_are_compressed_and_others_stored_as_they_are() {
        let text: Vec<u8> = (0..200_000u32)
            .flat_map(|i| format!("memory {i} of scope team-{}\n", i % 100).into_bytes())
            .collect();
        let (stored, encoding) = stored_form(&text);
        assert_eq!(encoding, Some(ZSTD));
        assert!(stored.len() * 4 < text.len());
        assert_eq!(zstd::bulk::decompress(&stored, text.len()).unwrap(), text);
        // Noise (what float vectors look like to a compressor).
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..300_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let (stored, encoding) = stored_form(&noise);
        assert_eq!(encoding, None);
        assert_eq!(&stored[..], &noise[..]);
    }

    #[test]
    fn chunks_fill_the_servers_message_limit_up_to_a_mebibyte() {
        // nats-server's default limit (1 MB), leaving room for the chunk's headers.
        assert_eq!(chunk_size(1024 * 1024), 1024 * 1024 - 16 * 1024);
        assert_eq!(chunk_size(8 * 1024 * 1024), 1024 * 1024);
        // Never below the client's own default.
        assert_eq!(chunk_size(64 * 1024), 128 * 1024);
    }
}

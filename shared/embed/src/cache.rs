//! A memory + disk cache of embeddings in front of any [`Embedder`].
//!
//! Embedding is the dominant per-event cost of ingest, and the same text is embedded again on
//! every replay of the log and every rebuild of an index. This cache makes those repeats free:
//! entries are keyed by blake3 of (model id, text), so a model change can never serve stale
//! vectors, and values are the unit vectors themselves. It never changes a vector: a hit returns
//! exactly what the inner embedder returned.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use foyer::{
    BlockEngineConfig, Code, DeviceBuilder, FsDeviceBuilder, HybridCache, HybridCacheBuilder,
    HybridCachePolicy, RecoverMode, Spawner,
};

use crate::{EmbedError, Embedder};

const MIB: usize = 1024 * 1024;
/// Below this the disk cache has too few blocks to evict one while writing another.
const MIN_DISK_BYTES: usize = 4 * MIB;
/// Vectors longer than this are not from any embedding model; refusing them on decode turns a
/// corrupt length prefix into a miss instead of a huge allocation.
const MAX_DIM: usize = 1 << 16;

/// Where the cache lives and how big it may grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// The disk cache's directory; reopening the same directory finds earlier entries.
    pub dir: PathBuf,
    /// Bytes of vectors kept in memory.
    pub memory_bytes: usize,
    /// Bytes of disk the cache may use (at least 4 MiB).
    pub disk_bytes: usize,
}

impl CacheConfig {
    /// 64 MiB of memory (about 40k MiniLM vectors) and 1 GiB of disk (about 600k) under `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        CacheConfig {
            dir: dir.into(),
            memory_bytes: 64 * MIB,
            disk_bytes: 1024 * MIB,
        }
    }
}

/// Lookups since the cache was opened, one per text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
}

/// blake3(model id, 0, text): the 0 keeps ("ab", "c") and ("a", "bc") apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct CacheKey([u8; 32]);

impl CacheKey {
    fn new(model_id: &str, text: &str) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.update(model_id.as_bytes());
        hasher.update(&[0]);
        hasher.update(text.as_bytes());
        CacheKey(*hasher.finalize().as_bytes())
    }
}

impl Code for CacheKey {
    fn encode(&self, writer: &mut impl std::io::Write) -> foyer::Result<()> {
        writer.write_all(&self.0).map_err(foyer::Error::io_error)
    }

    fn decode(reader: &mut impl std::io::Read) -> foyer::Result<Self> {
        let mut bytes = [0u8; 32];
        reader
            .read_exact(&mut bytes)
            .map_err(foyer::Error::io_error)?;
        Ok(CacheKey(bytes))
    }

    fn estimated_size(&self) -> usize {
        32
    }
}

/// A vector as stored: a little-endian u32 length, then little-endian f32s.
#[derive(Debug, Clone, PartialEq)]
struct CachedVector(Vec<f32>);

impl Code for CachedVector {
    fn encode(&self, writer: &mut impl std::io::Write) -> foyer::Result<()> {
        let mut bytes = Vec::with_capacity(self.estimated_size());
        bytes.extend_from_slice(&(self.0.len() as u32).to_le_bytes());
        for x in &self.0 {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        writer.write_all(&bytes).map_err(foyer::Error::io_error)
    }

    fn decode(reader: &mut impl std::io::Read) -> foyer::Result<Self> {
        let mut len = [0u8; 4];
        reader
            .read_exact(&mut len)
            .map_err(foyer::Error::io_error)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_DIM {
            return Err(foyer::Error::io_error(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("cached vector claims {len} dimensions"),
            )));
        }
        let mut bytes = vec![0u8; len * 4];
        reader
            .read_exact(&mut bytes)
            .map_err(foyer::Error::io_error)?;
        Ok(CachedVector(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }

    fn estimated_size(&self) -> usize {
        4 + 4 * self.0.len()
    }
}

/// An [`Embedder`] that answers repeated texts from a foyer hybrid cache and sends only the
/// misses, in one batch, to the inner embedder. Same model id and dimension as the inner one.
///
/// Call [`CachedEmbedder::close`] before dropping it: that flushes in-memory entries to disk so
/// that the next open finds them.
pub struct CachedEmbedder {
    inner: Arc<dyn Embedder>,
    cache: HybridCache<CacheKey, CachedVector>,
    /// For error messages.
    dir: PathBuf,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl CachedEmbedder {
    /// Opens (or creates) the cache in `config.dir`, recovering entries a previous process left.
    /// Must run inside a tokio runtime: foyer's disk workers are spawned on it.
    pub async fn open(inner: Arc<dyn Embedder>, config: &CacheConfig) -> Result<Self, EmbedError> {
        let cache_error = |message: String| EmbedError::Cache {
            dir: config.dir.display().to_string(),
            message,
        };
        if config.disk_bytes < MIN_DISK_BYTES {
            return Err(EmbedError::Config(format!(
                "embedding cache disk_bytes is {}, it must be at least {MIN_DISK_BYTES}",
                config.disk_bytes
            )));
        }
        if config.memory_bytes == 0 {
            return Err(EmbedError::Config(
                "embedding cache memory_bytes must be above 0".into(),
            ));
        }
        let device = FsDeviceBuilder::new(&config.dir)
            .with_capacity(config.disk_bytes)
            .build()
            .map_err(|e| cache_error(format!("cannot open the disk device: {e}")))?;
        // Blocks are foyer's unit of eviction; 16 of them keeps eviction fine-grained on small
        // disks, and 16 MiB (foyer's default) is plenty for 1.5 KB entries on large ones.
        let block_size = (config.disk_bytes / 16).clamp(MIB, 16 * MIB);
        // foyer 0.22 spawns a disk fetch on its spawner while holding the shard's in-flight
        // lock; a runtime that is shutting down cancels that task on the spot, and the task's
        // drop takes the same lock: the thread deadlocks against itself and the process never
        // exits (foyer-rs/foyer#1345, unmerged). A runtime of the cache's own lives exactly as
        // long as the cache, so no get can meet it shutting down, whatever the caller's does.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("embed-cache")
            .enable_all()
            .build()
            .map_err(|e| cache_error(format!("cannot start the cache's runtime: {e}")))?;
        let cache = HybridCacheBuilder::new()
            .with_name("engram-embeddings")
            // Embeddings cost milliseconds each and never change: write them through at once,
            // so a crash loses nothing but the last flush window.
            .with_policy(HybridCachePolicy::WriteOnInsertion)
            .memory(config.memory_bytes)
            .with_weighter(|_key: &CacheKey, value: &CachedVector| 32 + 4 * value.0.len())
            .storage()
            .with_engine_config(BlockEngineConfig::new(device).with_block_size(block_size))
            .with_recover_mode(RecoverMode::Quiet)
            .with_spawner(Spawner::from(runtime))
            .build()
            .await
            .map_err(|e| cache_error(format!("cannot open: {e}")))?;
        Ok(CachedEmbedder {
            inner,
            cache,
            dir: config.dir.clone(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    /// Hits and misses since open.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
        }
    }

    /// The embedder that computes misses.
    pub fn inner(&self) -> &Arc<dyn Embedder> {
        &self.inner
    }

    /// Flushes memory to disk and stops foyer's workers. Embedding after close is an error.
    pub async fn close(&self) -> Result<(), EmbedError> {
        self.cache.close().await.map_err(|e| EmbedError::Cache {
            dir: self.dir.display().to_string(),
            message: format!("cannot close: {e}"),
        })
    }
}

#[async_trait::async_trait]
impl Embedder for CachedEmbedder {
    fn model_id(&self) -> &str {
        self.inner.model_id()
    }

    fn dim(&self) -> usize {
        self.inner.dim()
    }

    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let model_id = self.inner.model_id();
        let dim = self.inner.dim();
        let keys: Vec<CacheKey> = texts.iter().map(|t| CacheKey::new(model_id, t)).collect();
        let lookups = futures::future::join_all(keys.iter().map(|key| self.cache.get(key))).await;

        let mut out: Vec<Option<Vec<f32>>> = Vec::with_capacity(texts.len());
        for lookup in lookups {
            out.push(match lookup {
                Ok(Some(entry)) if entry.value().0.len() == dim => Some(entry.value().0.clone()),
                Ok(_) => None,
                Err(error) => {
                    // The disk is a cache: a failed read costs a recomputation, not the request.
                    tracing::warn!(%error, dir = %self.dir.display(), "embedding cache read failed");
                    None
                }
            });
        }

        // Each distinct missing text goes to the inner embedder once, however often it repeats.
        let mut missing: HashMap<CacheKey, Vec<usize>> = HashMap::new();
        let mut missing_texts = Vec::new();
        let mut missing_keys = Vec::new();
        for (i, slot) in out.iter().enumerate() {
            if slot.is_some() {
                continue;
            }
            let positions = missing.entry(keys[i]).or_default();
            if positions.is_empty() {
                missing_texts.push(texts[i].clone());
                missing_keys.push(keys[i]);
            }
            positions.push(i);
        }
        let miss_count = missing.values().map(Vec::len).sum::<usize>() as u64;
        self.hits
            .fetch_add(texts.len() as u64 - miss_count, Ordering::Relaxed);
        self.misses.fetch_add(miss_count, Ordering::Relaxed);

        if !missing_texts.is_empty() {
            let vectors = self.inner.embed(&missing_texts).await?;
            if vectors.len() != missing_texts.len() {
                return Err(EmbedError::Inference(format!(
                    "embedder {model_id} returned {} vectors for {} texts",
                    vectors.len(),
                    missing_texts.len()
                )));
            }
            for (key, vector) in missing_keys.into_iter().zip(vectors) {
                if vector.len() != dim {
                    return Err(EmbedError::DimensionMismatch {
                        model: model_id.to_string(),
                        expected: dim,
                        got: vector.len(),
                    });
                }
                for &i in &missing[&key] {
                    out[i] = Some(vector.clone());
                }
                self.cache.insert(key, CachedVector(vector));
            }
        }
        // Every slot is now filled: hits above, misses from the inner embedder.
        Ok(out.into_iter().flatten().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_separate_model_from_text() {
        assert_ne!(CacheKey::new("ab", "c"), CacheKey::new("a", "bc"));
        assert_eq!(CacheKey::new("m", "t"), CacheKey::new("m", "t"));
    }

    #[test]
    fn vectors_round_trip_through_their_encoding_and_reject_corrupt_lengths() {
        let vector = CachedVector(vec![0.25, -1.5, f32::MIN_POSITIVE]);
        let mut bytes = Vec::new();
        vector.encode(&mut bytes).unwrap();
        assert_eq!(bytes.len(), vector.estimated_size());
        assert_eq!(CachedVector::decode(&mut bytes.as_slice()).unwrap(), vector);
        let huge = u32::MAX.to_le_bytes();
        assert!(CachedVector::decode(&mut huge.as_slice()).is_err());
    }
}

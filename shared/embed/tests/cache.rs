//! The cache in front of a real (model-free) embedder: which texts reach it, what survives a
//! reopen, and that models never share entries. Here rather than in `src/`, because the
//! embedder they wrap comes from `engram-fixtures`, which itself depends on this crate.

use std::sync::{Arc, Mutex};

use engram_embed::{CacheConfig, CacheStats, CachedEmbedder, EmbedError, Embedder};
use engram_fixtures::HashEmbedder;

const MIB: usize = 1024 * 1024;

/// Wraps an embedder and records every batch it is asked for.
struct Counting {
    inner: HashEmbedder,
    model_id: String,
    batches: Mutex<Vec<Vec<String>>>,
}

impl Counting {
    fn new(model_id: &str) -> Arc<Self> {
        Arc::new(Counting {
            inner: HashEmbedder::new(64),
            model_id: model_id.to_string(),
            batches: Mutex::new(Vec::new()),
        })
    }

    fn calls(&self) -> usize {
        self.batches.lock().unwrap().len()
    }

    fn last_batch(&self) -> Vec<String> {
        self.batches
            .lock()
            .unwrap()
            .last()
            .cloned()
            .unwrap_or_default()
    }
}

#[async_trait::async_trait]
impl Embedder for Counting {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn dim(&self) -> usize {
        self.inner.dim()
    }

    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        self.batches.lock().unwrap().push(texts.to_vec());
        self.inner.embed(texts).await
    }
}

fn texts(prefix: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("{prefix} memory number {i}"))
        .collect()
}

fn small(dir: &std::path::Path) -> CacheConfig {
    CacheConfig {
        dir: dir.to_path_buf(),
        memory_bytes: 4 * MIB,
        disk_bytes: 16 * MIB,
    }
}

#[tokio::test]
async fn repeats_never_reach_the_inner_embedder() {
    let dir = tempfile::tempdir().unwrap();
    let counting = Counting::new("m");
    let cached = CachedEmbedder::open(counting.clone(), &small(dir.path()))
        .await
        .unwrap();
    assert_eq!((cached.model_id(), cached.dim()), ("m", 64));
    let batch = texts("a", 20);
    let first = cached.embed(&batch).await.unwrap();
    assert_eq!(counting.calls(), 1);
    assert_eq!(
        cached.stats(),
        CacheStats {
            hits: 0,
            misses: 20
        }
    );

    let second = cached.embed(&batch).await.unwrap();
    assert_eq!(
        counting.calls(),
        1,
        "a warm embed called the inner embedder"
    );
    assert_eq!(second, first);
    assert_eq!(
        cached.stats(),
        CacheStats {
            hits: 20,
            misses: 20
        }
    );
    cached.close().await.unwrap();
}

#[tokio::test]
async fn only_distinct_misses_go_to_the_inner_embedder_in_one_batch() {
    let dir = tempfile::tempdir().unwrap();
    let counting = Counting::new("m");
    let cached = CachedEmbedder::open(counting.clone(), &small(dir.path()))
        .await
        .unwrap();
    cached.embed(&texts("a", 3)).await.unwrap();
    let mixed: Vec<String> = [
        "new one",
        "a memory number 1",
        "new two",
        "new one",
        "a memory number 0",
    ]
    .map(String::from)
    .to_vec();
    let vectors = cached.embed(&mixed).await.unwrap();
    assert_eq!(counting.calls(), 2);
    assert_eq!(
        counting.last_batch(),
        vec!["new one".to_string(), "new two".to_string()]
    );
    let direct = counting.inner.embed(&mixed).await.unwrap();
    assert_eq!(
        vectors, direct,
        "cached results differ from the inner embedder's"
    );
    assert_eq!(cached.stats(), CacheStats { hits: 2, misses: 6 });
    assert!(cached.embed(&[]).await.unwrap().is_empty());
    cached.close().await.unwrap();
}

#[tokio::test]
async fn entries_survive_a_reopen_and_are_served_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let batch = texts("persist", 300);
    let first = {
        let counting = Counting::new("m");
        let cached = CachedEmbedder::open(counting.clone(), &small(dir.path()))
            .await
            .unwrap();
        let vectors = cached.embed(&batch).await.unwrap();
        cached.close().await.unwrap();
        vectors
    };
    // 300 vectors of 64 floats need ~90 KB; 32 KB of memory forces most reads to disk.
    let counting = Counting::new("m");
    let config = CacheConfig {
        memory_bytes: 32 * 1024,
        ..small(dir.path())
    };
    let cached = CachedEmbedder::open(counting.clone(), &config)
        .await
        .unwrap();
    let again = cached.embed(&batch).await.unwrap();
    assert_eq!(counting.calls(), 0, "reopened cache missed");
    assert_eq!(again, first);
    assert_eq!(
        cached.stats(),
        CacheStats {
            hits: 300,
            misses: 0
        }
    );
    cached.close().await.unwrap();
}

#[tokio::test]
async fn another_model_never_sees_these_entries() {
    let dir = tempfile::tempdir().unwrap();
    let batch = texts("shared", 5);
    let one = CachedEmbedder::open(Counting::new("model-one"), &small(dir.path()))
        .await
        .unwrap();
    one.embed(&batch).await.unwrap();
    one.close().await.unwrap();
    let counting = Counting::new("model-two");
    let two = CachedEmbedder::open(counting.clone(), &small(dir.path()))
        .await
        .unwrap();
    two.embed(&batch).await.unwrap();
    assert_eq!(counting.calls(), 1);
    assert_eq!(two.stats().misses, 5);
    two.close().await.unwrap();
}

#[tokio::test]
async fn rejects_a_disk_too_small_to_work() {
    let dir = tempfile::tempdir().unwrap();
    let config = CacheConfig {
        disk_bytes: MIB,
        ..small(dir.path())
    };
    let result = CachedEmbedder::open(Counting::new("m"), &config).await;
    assert!(matches!(result, Err(EmbedError::Config(_))));
}

/// foyer 0.22 spawns a miss's disk fetch while holding a lock that the fetch's drop takes
/// again; on a runtime that is shutting down the spawn drops the fetch at once and the thread
/// deadlocks against itself (foyer-rs/foyer#1345). That hung a whole CI run at a test's end.
/// Here the runtime the cache was opened on is gone before the lookup: with the cache's work
/// on the caller's runtime this never returns; on the cache's own runtime it is a plain miss.
#[test]
fn a_lookup_after_the_opening_runtime_shut_down_returns() {
    let dir = tempfile::tempdir().unwrap();
    let config = small(dir.path());
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    };
    let opening = runtime();
    let cached = opening
        .block_on(CachedEmbedder::open(Counting::new("m"), &config))
        .unwrap();
    opening.shutdown_background();

    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let vectors = runtime().block_on(cached.embed(&texts("late", 3)));
        let _ = done.send(vectors.map(|v| v.len()));
    });
    let answered = finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("a lookup on a cache whose opening runtime shut down deadlocked");
    assert_eq!(answered.unwrap(), 3);
}

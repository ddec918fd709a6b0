//! `bench-project`: what projecting costs against reading the same stream bare.
//!
//! One run has two parts, each against its own embedded nats-server:
//! 1. **projectors**: `events` episodic observations carrying client-supplied 384-dim vectors
//!    are appended, then read back by a raw ordered consumer (no decoding), by the bus's
//!    replay (decoding every envelope) and by each projector's rebuild from sequence 1 into a
//!    fresh state dir. Throughput is compared with the raw reader. The process RSS around the
//!    vector rebuild gives an approximate memory cost per stored memory.
//! 2. **embedder**: `embed_events` text events without vectors are appended; MiniLM embeds
//!    their texts bare (`embed_blocking`), then the vector projector rebuilds with MiniLM twice
//!    into the same state dir: once with an empty embedding cache, once with the cache the
//!    first rebuild filled.
//!
//! Rebuild figures are wall time of `engram_projectors::rebuild`, set-up included (in part 2
//! that is a model load and a cache open, which are measured on their own and also
//! subtracted). Nothing here asserts a figure; it only measures and reports.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{Consumer, DeliverPolicy, pull};
use chrono::{DateTime, Utc};
use engram_bus::{Bus, BusConfig, BusError, StartAt};
use engram_embed::{
    CacheConfig, CachedEmbedder, ClientSupplied, EmbedError, Embedder, EmbedderConfig, MINILM_DIM,
    MINILM_MODEL_ID, MiniLm,
};
use engram_projectors::{ProjectorName, ProjectorsConfig, StartError};
use engram_schema::{
    Content, Embedding, Envelope, EventKind, Ident, Layer, Scope, ScopeKind, SubjectFilter,
};
use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::report::Machine;
use crate::{BenchError, EmbeddedNats, cpu};

/// Dimension of the client-supplied vectors of part 1 (MiniLM's, so both parts index alike).
pub const DIM: usize = MINILM_DIM;
/// The model name part 1's events and embedder config agree on.
pub const CLIENT_MODEL: &str = "bench-384";
/// Events per `append_batch` call, and acks in flight within one.
const APPEND_CHUNK: usize = 4096;
const APPEND_INFLIGHT: usize = 1024;
/// Cluster centres of the synthetic vectors: real embeddings of one agent's work are far from
/// uniform on the sphere, and HNSW builds differently on clustered data.
const CLUSTERS: usize = 64;

/// What to run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProjectBenchConfig {
    /// Events of part 1.
    pub events: usize,
    /// Events of part 2; 0 skips it.
    pub embed_events: usize,
    /// Task scopes of part 1, filled unevenly (the first gets about a fifth of the events).
    pub scopes: usize,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ProjectBenchError {
    #[error("invalid benchmark parameters: {0}")]
    InvalidConfig(String),
    #[error(transparent)]
    Setup(#[from] BenchError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("{failed} of {total} appends failed; first error: {first}")]
    Append {
        failed: usize,
        total: usize,
        first: String,
    },
    #[error("reading the stream failed: {0}")]
    Read(String),
    #[error("rebuilding the {projector} projector failed: {source}")]
    Rebuild {
        projector: ProjectorName,
        #[source]
        source: StartError,
    },
    #[error("embedding failed: {0}")]
    Embed(#[from] EmbedError),
    #[error("cannot create a temp dir: {0}")]
    TempDir(std::io::Error),
    #[error("restarting the vector projector from its checkpoint failed: {0}")]
    Restore(String),
}

/// Everything a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct ProjectReport {
    pub started_at: DateTime<Utc>,
    pub params: ProjectBenchConfig,
    pub machine: Machine,
    pub nats_server_version: String,
    pub projectors: ProjectorsPart,
    /// Missing with `embed_events` 0.
    pub embedder: Option<EmbedderPart>,
}

/// One timed pass over `count` items.
#[derive(Clone, Debug, Serialize)]
pub struct Rate {
    pub count: u64,
    pub seconds: f64,
    pub per_sec: f64,
    /// CPU of this process (all threads) per item: on a shared 2-core machine wall time
    /// moves with other load, CPU time much less.
    pub client_cpu_us_per_item: f64,
    /// CPU of the embedded nats-server per item; `None` if unreadable.
    pub server_cpu_us_per_item: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProjectorsPart {
    pub events: u64,
    pub scopes: usize,
    pub mean_payload_bytes: f64,
    /// Appending the events (set-up, for reference).
    pub append: Rate,
    /// Ordered consumer counting payloads, no decoding: the baseline.
    pub raw_ordered: Rate,
    /// `Bus::replay`: an ordered consumer that decodes every envelope.
    pub bus_replay: Rate,
    pub rebuilds: Vec<ProjectorRate>,
    pub vector_memory: VectorMemory,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProjectorRate {
    pub projector: ProjectorName,
    /// Last sequence the rebuild applied.
    pub applied: u64,
    #[serde(flatten)]
    pub rate: Rate,
    /// Events/s over the raw ordered consumer's.
    pub vs_raw: f64,
    /// Events/s over the decoding replay's.
    pub vs_replay: f64,
}

/// Approximate: process RSS, so it includes allocator slack and buffers kept from earlier
/// phases and from the rebuild's mid-run checkpoint.
#[derive(Clone, Debug, Serialize)]
pub struct VectorMemory {
    pub rss_before_bytes: u64,
    /// At the rebuild's last progress report: everything applied, the read model still held.
    pub rss_end_bytes: u64,
    /// Memories the vector projector holds (every event of part 1 is one).
    pub memories: u64,
    pub bytes_per_memory: f64,
    /// Restoring the rebuild's checkpoint into a fresh projection (a restart), loading the
    /// saved graphs.
    pub restart_loaded_secs: f64,
    /// The same with the graph directories deleted, so every graph is built again.
    pub restart_built_secs: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct EmbedderPart {
    pub events: u64,
    pub mean_tokens: f64,
    /// `MiniLm::load_default`, weights already in the page cache.
    pub model_load_secs: f64,
    /// Opening an empty embedding cache.
    pub cache_open_cold_secs: f64,
    /// Opening the cache the cold rebuild filled (foyer recovers its index).
    pub cache_open_warm_secs: f64,
    /// `embed_blocking` over all texts, after a 16-text warm-up pass.
    pub bare: Rate,
    pub rebuild_cold: EmbedRebuild,
    pub rebuild_warm: EmbedRebuild,
    /// Texts the warm rebuild could find in the cache, probed just before it ran.
    pub warm_cache_entries: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct EmbedRebuild {
    /// Whole `rebuild` call, set-up included.
    #[serde(flatten)]
    pub rate: Rate,
    /// Events/s with model load and cache open (measured separately) subtracted; `None`
    /// when set-up is half the wall time or more, where the difference is mostly the noise
    /// of two separately measured loads.
    pub net_per_sec: Option<f64>,
    pub vs_bare: f64,
    pub net_vs_bare: Option<f64>,
}

impl ProjectBenchConfig {
    pub fn validate(&self) -> Result<(), ProjectBenchError> {
        let invalid = |reason: &str| Err(ProjectBenchError::InvalidConfig(reason.to_owned()));
        if self.events == 0 {
            return invalid("--events must be at least 1");
        }
        if self.scopes == 0 {
            return invalid("--scopes must be at least 1");
        }
        Ok(())
    }
}

/// Runs both parts. Call it on the runtime's main thread: it starts the embedded servers
/// (see [`EmbeddedNats::start`]).
pub async fn run(config: ProjectBenchConfig) -> Result<ProjectReport, ProjectBenchError> {
    config.validate()?;
    let started_at = Utc::now();
    let machine = Machine::detect();

    let server = EmbeddedNats::start().await?;
    eprintln!(
        "part 1: nats-server {} at {}",
        server.version(),
        server.url()
    );
    let version = server.version().to_owned();
    let result = projectors_part(&config, &server).await;
    server.stop().await;
    let projectors = result?;

    let embedder = if config.embed_events == 0 {
        None
    } else {
        let server = EmbeddedNats::start().await?;
        eprintln!("part 2: nats-server at {}", server.url());
        let result = embedder_part(&config, &server).await;
        server.stop().await;
        Some(result?)
    };
    Ok(ProjectReport {
        started_at,
        params: config,
        machine,
        nats_server_version: version,
        projectors,
        embedder,
    })
}

async fn projectors_part(
    config: &ProjectBenchConfig,
    server: &EmbeddedNats,
) -> Result<ProjectorsPart, ProjectBenchError> {
    let bus = connect(server).await?;
    let pid = server.pid();
    let mut rng = SmallRng::seed_from_u64(config.seed);
    let scopes = scopes(config.scopes);
    let centres: Vec<Vec<f32>> = (0..CLUSTERS).map(|_| random_unit(&mut rng, None)).collect();

    eprintln!("appending {} events with {DIM}-dim vectors", config.events);
    let meter = Meter::start(pid);
    let mut payload_bytes = 0u64;
    let mut appended = 0;
    while appended < config.events {
        let chunk: Vec<Envelope> = (appended..config.events.min(appended + APPEND_CHUNK))
            .map(|i| {
                // u² skews scopes: the first holds ~22% of events at 20 scopes, the last ~2.5%,
                // so some indexes grow HNSW graphs and others stay below the exact-scan cutoff.
                let u: f64 = rng.random();
                let scope = &scopes[((u * u) * scopes.len() as f64) as usize];
                let centre = &centres[rng.random_range(0..CLUSTERS)];
                let vector = random_unit(&mut rng, Some(centre));
                let mut event = observation(scope, text(&mut rng, i));
                event.embedding = Some(Embedding {
                    model: CLIENT_MODEL.into(),
                    vector,
                });
                event
            })
            .collect();
        payload_bytes += check_appends(&bus.append_batch(&chunk, APPEND_INFLIGHT).await)?;
        appended += chunk.len();
    }
    let append = meter.finish(appended as u64);
    eprintln!("appended in {:.1} s", append.seconds);

    // Unmeasured pass: every reader then finds the stream in the same caches.
    raw_ordered(&bus).await?;
    eprintln!("reading: raw ordered consumer");
    let meter = Meter::start(pid);
    let raw_count = raw_ordered(&bus).await?;
    let raw = meter.finish(raw_count);
    eprintln!("reading: bus replay");
    let meter = Meter::start(pid);
    let replay_count = bus_replay(&bus).await?;
    let replay = meter.finish(replay_count);

    let projector_config = ProjectorsConfig {
        embedder: EmbedderConfig::ClientSupplied {
            model: CLIENT_MODEL.into(),
            dim: DIM,
        },
        ..ProjectorsConfig::default()
    };
    projector_config
        .validate()
        .map_err(ProjectBenchError::InvalidConfig)?;
    let mut rebuilds = Vec::new();
    let mut vector_memory = None;
    for name in ProjectorName::all() {
        let dir = temp_dir()?;
        let rss_before = rss_bytes();
        let mut rss_end = rss_before;
        let meter = Meter::start(pid);
        let mut progress = Progress::new(name.as_str());
        let on_progress = |applied, target| {
            progress.report(applied, target);
            if applied >= target {
                rss_end = rss_bytes();
            }
        };
        let (applied, _) = engram_projectors::rebuild(
            name,
            &projector_config,
            dir.path(),
            bus.clone(),
            on_progress,
        )
        .await
        .map_err(|source| ProjectBenchError::Rebuild {
            projector: name,
            source,
        })?;
        let rate = meter.finish(applied);
        if name == ProjectorName::VECTOR {
            let memories = appended as u64;
            let (restart_loaded_secs, restart_built_secs) =
                vector_restarts(&projector_config, dir.path()).await?;
            vector_memory = Some(VectorMemory {
                rss_before_bytes: rss_before,
                rss_end_bytes: rss_end,
                memories,
                bytes_per_memory: rss_end.saturating_sub(rss_before) as f64 / memories as f64,
                restart_loaded_secs,
                restart_built_secs,
            });
        }
        rebuilds.push(ProjectorRate {
            projector: name,
            applied,
            vs_raw: rate.per_sec / raw.per_sec,
            vs_replay: rate.per_sec / replay.per_sec,
            rate,
        });
    }
    close(&bus).await;
    Ok(ProjectorsPart {
        events: appended as u64,
        scopes: config.scopes,
        mean_payload_bytes: payload_bytes as f64 / appended as f64,
        append,
        raw_ordered: raw,
        bus_replay: replay,
        rebuilds,
        vector_memory: vector_memory.expect("ProjectorName::all() includes the vector projector"),
    })
}

/// Times two restarts of the vector projector from the checkpoint in `dir`: with its saved
/// graphs, then with them deleted.
async fn vector_restarts(
    config: &ProjectorsConfig,
    dir: &Path,
) -> Result<(f64, f64), ProjectBenchError> {
    use engram_projection_runtime::Projection as _;
    let restore = || async {
        let embedder = engram_projectors::embedder(config, dir)
            .await
            .map_err(|source| ProjectBenchError::Rebuild {
                projector: ProjectorName::VECTOR,
                source,
            })?;
        let projection =
            engram_projectors::vector::VectorProjection::new(dir, embedder, config.hnsw.clone());
        let started = Instant::now();
        projection
            .restore()
            .await
            .map_err(|e| ProjectBenchError::Restore(e.to_string()))?;
        Ok::<_, ProjectBenchError>(started.elapsed().as_secs_f64())
    };
    eprintln!("vector restart from its checkpoint, graphs loaded");
    let loaded = restore().await?;
    for entry in std::fs::read_dir(dir).map_err(|e| ProjectBenchError::Restore(e.to_string()))? {
        let entry = entry.map_err(|e| ProjectBenchError::Restore(e.to_string()))?;
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("vector-graphs-")
        {
            std::fs::remove_dir_all(entry.path())
                .map_err(|e| ProjectBenchError::Restore(e.to_string()))?;
        }
    }
    eprintln!("vector restart from its checkpoint, graphs built again");
    let built = restore().await?;
    Ok((loaded, built))
}

async fn embedder_part(
    config: &ProjectBenchConfig,
    server: &EmbeddedNats,
) -> Result<EmbedderPart, ProjectBenchError> {
    let bus = connect(server).await?;
    let pid = server.pid();
    let mut rng = SmallRng::seed_from_u64(config.seed ^ 0x5eed);
    let scopes = scopes(4);
    // Distinct texts: a repeated text would hit the cache even in the cold rebuild.
    let texts: Vec<String> = (0..config.embed_events)
        .map(|i| text(&mut rng, i))
        .collect();
    let events: Vec<Envelope> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| observation(&scopes[i % scopes.len()], t.clone()))
        .collect();
    check_appends(&bus.append_batch(&events, APPEND_INFLIGHT).await)?;
    let n = texts.len() as u64;

    eprintln!("embedding {n} texts bare");
    let started = Instant::now();
    let model = tokio::task::spawn_blocking(MiniLm::load_default)
        .await
        .map_err(|e| EmbedError::Inference(format!("loading the model panicked: {e}")))??;
    let model_load_secs = started.elapsed().as_secs_f64();
    let counter = model.token_counter();
    let mean_tokens = texts.iter().map(|t| counter.count(t)).sum::<usize>() as f64 / n as f64;
    let bare = {
        let texts = texts.clone();
        let model = model.clone();
        let meter = Meter::start(pid);
        tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            // The first pass allocates and faults the weights in; bench-embed skips it too.
            model.embed_blocking(&refs[..refs.len().min(16)])?;
            let meter = meter.restart();
            model.embed_blocking(&refs)?;
            Ok::<_, EmbedError>(meter.finish(n))
        })
        .await
        .map_err(|e| EmbedError::Inference(format!("embedding panicked: {e}")))??
    };
    drop(model);

    let projector_config = ProjectorsConfig {
        embedder: EmbedderConfig::default(),
        ..ProjectorsConfig::default()
    };
    let cache_config = |dir: &Path| CacheConfig {
        dir: dir.join("embed-cache"),
        memory_bytes: projector_config.embed_cache_memory_mb * 1024 * 1024,
        disk_bytes: projector_config.embed_cache_disk_mb * 1024 * 1024,
    };
    let scratch = temp_dir()?;
    let (cache_open_cold_secs, _) = probe_cache(&cache_config(scratch.path()), &[]).await?;

    let dir = temp_dir()?;
    let rebuild = |label: &'static str| {
        let (bus, projector_config, dir) = (bus.clone(), &projector_config, dir.path());
        async move {
            eprintln!("vector rebuild with MiniLM, {label} embedding cache");
            let meter = Meter::start(pid);
            let mut progress = Progress::new(label);
            let (applied, _) = engram_projectors::rebuild(
                ProjectorName::VECTOR,
                projector_config,
                dir,
                bus,
                |applied, target| progress.report(applied, target),
            )
            .await
            .map_err(|source| ProjectBenchError::Rebuild {
                projector: ProjectorName::VECTOR,
                source,
            })?;
            Ok::<_, ProjectBenchError>(meter.finish(applied))
        }
    };
    let cold = rebuild("cold").await?;
    let (cache_open_warm_secs, found) = probe_cache(&cache_config(dir.path()), &texts).await?;
    let warm = rebuild("warm").await?;
    close(&bus).await;

    let judge = |rate: Rate, setup: f64| {
        let net_per_sec =
            (setup < 0.5 * rate.seconds).then(|| rate.count as f64 / (rate.seconds - setup));
        EmbedRebuild {
            vs_bare: rate.per_sec / bare.per_sec,
            net_vs_bare: net_per_sec.map(|r| r / bare.per_sec),
            net_per_sec,
            rate,
        }
    };
    Ok(EmbedderPart {
        events: n,
        mean_tokens,
        model_load_secs,
        cache_open_cold_secs,
        cache_open_warm_secs,
        rebuild_cold: judge(cold, model_load_secs + cache_open_cold_secs),
        rebuild_warm: judge(warm, model_load_secs + cache_open_warm_secs),
        bare,
        warm_cache_entries: found,
    })
}

/// Opens the embedding cache in front of an embedder that cannot embed, so that only hits
/// succeed; returns the open time and how many of `texts` it holds. Closes it again, which
/// writes nothing: a probe inserts nothing.
async fn probe_cache(
    cache: &CacheConfig,
    texts: &[String],
) -> Result<(f64, u64), ProjectBenchError> {
    let started = Instant::now();
    let inner: Arc<dyn Embedder> = Arc::new(ClientSupplied::new(MINILM_MODEL_ID, MINILM_DIM));
    let embedder = CachedEmbedder::open(inner, cache).await?;
    let open_secs = started.elapsed().as_secs_f64();
    let mut found = 0;
    for text in texts {
        if embedder.embed(std::slice::from_ref(text)).await.is_ok() {
            found += 1;
        }
    }
    embedder.close().await?;
    Ok((open_secs, found))
}

/// An ordered consumer over the events stream from sequence `first` (or the first message
/// after it, if it is gone; 1 for the whole stream); `None` if nothing is stored from there on
/// (an ordered consumer with nothing to deliver would wait for a first message).
pub(crate) async fn stream_from(
    bus: &Bus,
    first: u64,
) -> Result<Option<Consumer<pull::OrderedConfig>>, String> {
    let stream = bus
        .jetstream()
        .get_stream(&bus.config().stream.name)
        .await
        .map_err(|e| e.to_string())?;
    let deliver_policy = if first <= 1 {
        DeliverPolicy::All
    } else {
        DeliverPolicy::ByStartSequence {
            start_sequence: first,
        }
    };
    let consumer = stream
        .create_consumer(pull::OrderedConfig {
            filter_subject: SubjectFilter::all().to_subject(),
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    Ok((consumer.cached_info().num_pending > 0).then_some(consumer))
}

/// Counts the stream's messages through an ordered consumer without decoding them.
pub(crate) async fn raw_ordered(bus: &Bus) -> Result<u64, ProjectBenchError> {
    let read_err = |e: &dyn std::fmt::Display| ProjectBenchError::Read(e.to_string());
    let Some(consumer) = stream_from(bus, 1).await.map_err(|e| read_err(&e))? else {
        return Ok(0);
    };
    let mut messages = consumer.messages().await.map_err(|e| read_err(&e))?;
    let (mut count, mut bytes) = (0u64, 0usize);
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| read_err(&e))?;
        count += 1;
        bytes += message.payload.len();
        if message.info().map_err(|e| read_err(&e))?.pending == 0 {
            break;
        }
    }
    std::hint::black_box(bytes);
    Ok(count)
}

/// Counts the events `Bus::replay` decodes.
async fn bus_replay(bus: &Bus) -> Result<u64, ProjectBenchError> {
    let (_, mut events) = bus
        .replay_counted(&SubjectFilter::all(), StartAt::Beginning)
        .await?;
    let mut count = 0u64;
    while let Some(event) = events.next().await {
        std::hint::black_box(event.map_err(|e| ProjectBenchError::Read(e.to_string()))?);
        count += 1;
    }
    Ok(count)
}

async fn connect(server: &EmbeddedNats) -> Result<Bus, ProjectBenchError> {
    let bus = Bus::connect(BusConfig {
        url: server.url(),
        client_name: "engram-bench-project".into(),
        ..BusConfig::default()
    })
    .await?;
    bus.provision().await?;
    Ok(bus)
}

/// Drains the connection and waits until it is gone, so that stopping the server next does
/// not make the bus log a lost connection.
async fn close(bus: &Bus) {
    if let Err(e) = bus.client().drain().await {
        tracing::warn!(error = %e, "draining the connection failed");
    }
    for _ in 0..200 {
        if bus.client().flush().await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Total encoded bytes of the stored events, or the first failure.
fn check_appends(
    results: &[Result<engram_bus::AppendReceipt, engram_bus::AppendError>],
) -> Result<u64, ProjectBenchError> {
    let failed = results.iter().filter(|r| r.is_err()).count();
    if let Some(Err(first)) = results.iter().find(|r| r.is_err()) {
        return Err(ProjectBenchError::Append {
            failed,
            total: results.len(),
            first: first.to_string(),
        });
    }
    Ok(results.iter().flatten().map(|r| r.bytes as u64).sum())
}

fn temp_dir() -> Result<tempfile::TempDir, ProjectBenchError> {
    tempfile::Builder::new()
        .prefix("engram-bench-project-")
        .tempdir()
        .map_err(ProjectBenchError::TempDir)
}

fn scopes(count: usize) -> Vec<Scope> {
    (0..count)
        .map(|i| Scope::new(ScopeKind::Task, &format!("task-{i:03}")).expect("valid scope id"))
        .collect()
}

fn observation(scope: &Scope, text: String) -> Envelope {
    let ident = |field, value: &str| Ident::parse(field, value).expect("valid identifier");
    Envelope::new(
        ident("tenant", crate::workload::TENANT),
        scope.clone(),
        ident("agent_id", "bench-agent"),
        ident("instance_id", "bench-0001"),
        Layer::Episodic,
        EventKind::Observation,
        Content::text(text),
    )
}

/// A short agent observation, made distinct by `i`.
fn text(rng: &mut SmallRng, i: usize) -> String {
    const SUBJECTS: &[&str] = &[
        "the build",
        "test suite",
        "the deploy job",
        "user request",
        "api response",
        "the migration",
        "cache hit rate",
        "the retry loop",
        "lint run",
        "query planner",
    ];
    const VERBS: &[&str] = &[
        "failed with",
        "reported",
        "slowed down after",
        "recovered from",
        "timed out on",
        "returned",
        "flagged",
        "skipped",
    ];
    const OBJECTS: &[&str] = &[
        "a missing config key",
        "an expired token",
        "a flaky network call",
        "stale schema version",
        "disk pressure on node",
        "a null pointer in the parser",
        "duplicate event ids",
        "rate limiting from upstream",
        "an off-by-one in pagination",
        "a lock held too long",
    ];
    const TAILS: &[&str] = &[
        "; retrying with backoff",
        "; opened a ticket",
        "; rolled back the change",
        "; needs a human look",
        "",
        "; fixed by pinning the version",
    ];
    format!(
        "{} {} {} (step {i}){}",
        SUBJECTS.choose(rng).expect("non-empty"),
        VERBS.choose(rng).expect("non-empty"),
        OBJECTS.choose(rng).expect("non-empty"),
        TAILS.choose(rng).expect("non-empty"),
    )
}

/// A random unit vector, near `centre` if given.
fn random_unit(rng: &mut SmallRng, centre: Option<&[f32]>) -> Vec<f32> {
    let mut v: Vec<f32> = match centre {
        Some(c) => c
            .iter()
            .map(|x| x + 0.05 * rng.random_range(-1.0f32..1.0))
            .collect(),
        None => (0..DIM).map(|_| rng.random_range(-1.0f32..1.0)).collect(),
    };
    engram_embed::l2_normalize(&mut v);
    v
}

/// Resident set size of this process, from `/proc/self/statm`; 0 if unreadable.
fn rss_bytes() -> u64 {
    let pages: u64 = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    pages * page
}

/// Wall and CPU time from a start point.
#[derive(Clone, Copy)]
struct Meter {
    started: Instant,
    cpu: Duration,
    server_pid: Option<u32>,
    server_cpu: Option<Duration>,
}

impl Meter {
    fn start(server_pid: Option<u32>) -> Self {
        Self {
            started: Instant::now(),
            cpu: cpu::own(),
            server_pid,
            server_cpu: server_pid.and_then(cpu::of_pid),
        }
    }

    fn restart(self) -> Self {
        Self::start(self.server_pid)
    }

    fn finish(self, count: u64) -> Rate {
        let seconds = self.started.elapsed().as_secs_f64();
        let per_item = |d: Duration| d.as_secs_f64() * 1e6 / count.max(1) as f64;
        let server = match (self.server_pid.and_then(cpu::of_pid), self.server_cpu) {
            (Some(end), Some(start)) => Some(per_item(end.saturating_sub(start))),
            _ => None,
        };
        Rate {
            count,
            seconds,
            per_sec: count as f64 / seconds,
            client_cpu_us_per_item: per_item(cpu::own().saturating_sub(self.cpu)),
            server_cpu_us_per_item: server,
        }
    }
}

/// Progress on stderr, every tenth of the way.
struct Progress {
    label: &'static str,
    next_tenth: u64,
}

impl Progress {
    fn new(label: &'static str) -> Self {
        Self {
            label,
            next_tenth: 1,
        }
    }

    fn report(&mut self, applied: u64, target: u64) {
        if target > 0 && applied * 10 >= self.next_tenth * target {
            eprintln!("  {}: {applied}/{target}", self.label);
            self.next_tenth = applied * 10 / target + 1;
        }
    }
}

impl ProjectReport {
    /// The human-readable table.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let m = &self.machine;
        let _ = writeln!(
            out,
            "machine: {} cpus ({}), {}, load average {} at start",
            m.cpus,
            m.cpu_model.as_deref().unwrap_or("unknown cpu"),
            m.os,
            m.load_avg_1m
                .map_or("unknown".to_owned(), |l| format!("{l:.2}")),
        );
        let _ = writeln!(
            out,
            "nats-server {}, embedded on this machine (it shares the cpus with the readers)",
            self.nats_server_version
        );
        let p = &self.projectors;
        let _ = writeln!(
            out,
            "\npart 1: {} episodic observations with client-supplied {DIM}-dim vectors ({CLIENT_MODEL}), {} task scopes (skewed), mean payload {:.0} B, seed {}",
            p.events, p.scopes, p.mean_payload_bytes, self.params.seed
        );
        let _ = writeln!(
            out,
            "appended in {:.1} s ({:.0} events/s; set-up, not compared)\n",
            p.append.seconds, p.append.per_sec
        );
        let _ = writeln!(
            out,
            "{:<34}{:>9}{:>9}{:>11}{:>8}{:>11}{:>12}{:>14}",
            "reader",
            "events",
            "seconds",
            "events/s",
            "vs raw",
            "vs replay",
            "cpu us/ev",
            "server us/ev"
        );
        let row = |out: &mut String, label: &str, r: &Rate, vs_raw: f64, vs_replay: f64| {
            let _ = writeln!(
                out,
                "{label:<34}{:>9}{:>9.2}{:>11.0}{:>8.3}{:>11.3}{:>12.1}{:>14}",
                r.count,
                r.seconds,
                r.per_sec,
                vs_raw,
                vs_replay,
                r.client_cpu_us_per_item,
                r.server_cpu_us_per_item
                    .map_or("-".to_owned(), |s| format!("{s:.1}"))
            );
        };
        let (raw, replay) = (&p.raw_ordered, &p.bus_replay);
        row(
            &mut out,
            "raw ordered consumer (no decode)",
            raw,
            1.0,
            raw.per_sec / replay.per_sec,
        );
        row(
            &mut out,
            "bus replay (decodes)",
            replay,
            replay.per_sec / raw.per_sec,
            1.0,
        );
        for r in &p.rebuilds {
            let label = format!("rebuild {}", r.projector);
            row(&mut out, &label, &r.rate, r.vs_raw, r.vs_replay);
        }
        let vm = &p.vector_memory;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let _ = writeln!(
            out,
            "\nvector read model memory (approx: process RSS at the rebuild's last progress report minus RSS before it, includes allocator slack and the mid-run checkpoint's leftovers): {:.1} MiB -> {:.1} MiB = {:.0} B per stored memory ({} memories; the {DIM}-dim f32 vector alone is {} B)",
            mib(vm.rss_before_bytes),
            mib(vm.rss_end_bytes),
            vm.bytes_per_memory,
            vm.memories,
            DIM * 4
        );
        let _ = writeln!(
            out,
            "vector restart from the rebuild's checkpoint: {:.2} s loading the saved graphs, {:.2} s building them again ({:.1}x)",
            vm.restart_loaded_secs,
            vm.restart_built_secs,
            vm.restart_built_secs / vm.restart_loaded_secs.max(1e-9)
        );
        let _ = writeln!(
            out,
            "facts and skills index none of these events (all are observations): their rows are the projector framework alone (durable consumer, decode, batching, checkpoints)"
        );

        if let Some(e) = &self.embedder {
            let _ = writeln!(
                out,
                "\npart 2: {} distinct text events without vectors, MiniLM ({MINILM_MODEL_ID}), mean {:.1} tokens",
                e.events, e.mean_tokens
            );
            let _ = writeln!(
                out,
                "set-up inside each rebuild, measured apart: model load {:.2} s, cache open {:.2} s cold / {:.2} s warm; warm cache held {}/{} texts before the warm rebuild\n",
                e.model_load_secs,
                e.cache_open_cold_secs,
                e.cache_open_warm_secs,
                e.warm_cache_entries,
                e.events
            );
            let _ = writeln!(
                out,
                "{:<34}{:>9}{:>9}{:>11}{:>9}{:>12}{:>10}{:>12}",
                "stage",
                "events",
                "seconds",
                "events/s",
                "vs bare",
                "net ev/s",
                "net vs",
                "cpu us/ev"
            );
            let b = &e.bare;
            let _ = writeln!(
                out,
                "{:<34}{:>9}{:>9.2}{:>11.1}{:>9.3}{:>12}{:>10}{:>12.0}",
                "bare forward pass (embed_blocking)",
                b.count,
                b.seconds,
                b.per_sec,
                1.0,
                "-",
                "-",
                b.client_cpu_us_per_item
            );
            for (label, r) in [
                ("vector rebuild, cold embed cache", &e.rebuild_cold),
                ("vector rebuild, warm embed cache", &e.rebuild_warm),
            ] {
                let _ = writeln!(
                    out,
                    "{label:<34}{:>9}{:>9.2}{:>11.1}{:>9.3}{:>12}{:>10}{:>12.0}",
                    r.rate.count,
                    r.rate.seconds,
                    r.rate.per_sec,
                    r.vs_bare,
                    r.net_per_sec.map_or("-".to_owned(), |v| format!("{v:.1}")),
                    r.net_vs_bare.map_or("-".to_owned(), |v| format!("{v:.3}")),
                    r.rate.client_cpu_us_per_item
                );
            }
            let _ = writeln!(
                out,
                "net = the rebuild's wall time minus model load and cache open (as measured above); - where set-up is half the wall time or more"
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_are_unit_and_clustered() {
        let mut rng = SmallRng::seed_from_u64(7);
        let centre = random_unit(&mut rng, None);
        let near = random_unit(&mut rng, Some(&centre));
        let far = random_unit(&mut rng, None);
        for v in [&centre, &near, &far] {
            assert_eq!(v.len(), DIM);
            assert!((engram_embed::dot(v, v) - 1.0).abs() < 1e-4);
        }
        assert!(engram_embed::dot(&centre, &near) > engram_embed::dot(&centre, &far) + 0.3);
    }

    #[test]
    fn texts_are_distinct_and_valid_events() {
        let mut rng = SmallRng::seed_from_u64(1);
        let texts: std::collections::HashSet<String> =
            (0..1000).map(|i| text(&mut rng, i)).collect();
        assert_eq!(texts.len(), 1000);
        let event = observation(&scopes(1)[0], texts.into_iter().next().unwrap());
        assert!(event.validate().is_ok());
        // Else the vector and keyword projectors would skip every event.
        assert!(engram_memory::is_text_memory(&event));
    }

    #[test]
    fn progress_reports_each_tenth_once() {
        let mut p = Progress::new("t");
        let mut reported = 0;
        for applied in (0..=1000).step_by(7).chain([1000]) {
            let before = p.next_tenth;
            p.report(applied, 1000);
            if p.next_tenth != before {
                reported += 1;
            }
        }
        assert_eq!(reported, 10);
    }

    #[test]
    fn rejects_empty_runs() {
        let config = ProjectBenchConfig {
            events: 0,
            embed_events: 0,
            scopes: 20,
            seed: 0,
        };
        assert!(config.validate().is_err());
        assert!(
            ProjectBenchConfig {
                events: 1,
                ..config
            }
            .validate()
            .is_ok()
        );
    }
}

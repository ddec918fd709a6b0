//! Engram's projector services. Each turns the event stream into one read model and answers
//! queries on it over NATS; `engram up` runs them all in-process, a deployment can run each
//! as its own process (`engram projector <name>`).
//!
//! # Layout
//! - [`vector`]: text memories embedded into per-scope HNSW indexes.
//! - [`keyword`]: text memories in a tantivy BM25 index.
//! - [`facts`]: the bi-temporal fact table.
//! - [`skills`]: the skill registry (procedural memory).
//! - [`consolidator`]: every scope's memories, and the consolidation plans appended on a
//!   schedule or on demand.
//! - [`docs`]: shared automerge documents, merged in stream order (the consolidator's merge).
//! - this module: configuration, start-up (one connection, projector loop and NATS service
//!   per projector) and rebuild.
//!
//! Besides its query endpoint, every projector service answers `engram.p.<name>.status`
//! ([`ProjectorStatus`], which hashes the whole model) and `engram.p.<name>.ledger`
//! ([`ProjectorLedger`], cheap enough to poll), both taking a [`Consistency`].
//!
//! A projector service answers only the scopes it is handed; deciding which scopes a caller
//! may read is the query service's job.

pub mod consolidator;
pub mod docs;
pub mod facts;
pub mod keyword;
pub mod partitions;
pub mod registry;
pub mod skills;
pub mod vector;

use std::collections::BTreeMap;

use futures::{StreamExt, TryStreamExt};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use engram_bus::{Bus, StreamHead};
use engram_embed::{CacheConfig, CachedEmbedder, Embedder, EmbedderConfig};
use engram_memory::Seq;
use engram_memory::proto::{self, Consistency, ErrorCode};
use engram_projection_runtime::{
    ApplyLedger, NotYetVisible, Projection, ProjectorError, ProjectorSettings, Visibility,
};
use engram_rpc::Failure;
use engram_snapshots::{SnapshotError, SnapshotMeta, SnapshotStore, SnapshotsConfig};
use engram_vector::HnswParams;
pub use partitions::{PartitionSet, PartitionSetError};
pub use registry::{ProjectorName, REGISTRY, ReadModel};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// `[projectors]` in engram.toml.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProjectorsConfig {
    /// The projectors this process runs.
    pub run: Vec<ProjectorName>,
    /// The stream partitions this process runs them for (`"all"`, or such as `"0-7"`): a
    /// memory node of several serves some, the others the rest. Every partition must be
    /// served by some process, or queries of its scopes are answered `unavailable`.
    pub partitions: PartitionSet,
    /// Most events applied per batch.
    pub batch: usize,
    #[serde(with = "humantime_serde")]
    pub checkpoint_interval: Duration,
    pub checkpoint_every: u64,
    /// While the keyword projector is behind, how often it commits. A commit only makes what
    /// was applied durable (memories are searchable from the in-memory tail as soon as they
    /// are applied); each is a tantivy segment, fsyncs, and later merges, per partition.
    #[serde(with = "humantime_serde")]
    pub keyword_commit_interval: Duration,
    /// Once the keyword projector has caught up, the least time between two commits: at most
    /// this much applied work is replayed from the stream after a crash. Committing every
    /// small batch made a segment per batch and per partition, and with their fsyncs and
    /// merges most of the keyword projector's CPU.
    #[serde(with = "humantime_serde")]
    pub keyword_tail_commit_gap: Duration,
    /// Where vectors come from.
    pub embedder: EmbedderConfig,
    pub embed_cache_memory_mb: usize,
    pub embed_cache_disk_mb: usize,
    pub hnsw: HnswParams,
    /// Requests each projector endpoint handles at once; more are answered `busy` (429). The
    /// query service makes up to four projector requests per retrieval.
    pub max_in_flight: usize,
    /// Threads that apply batches to the models, apart from the threads that answer
    /// requests (see `engram_projection_runtime::pool`); 0 is one per core.
    pub apply_threads: usize,
    /// How many `nice` steps below the rest of the process the applying threads run
    /// (0..=19; 0 keeps the same priority). Under load they yield the CPU to nats-server's
    /// acknowledgements and to queries, and projectors fall a little behind instead.
    pub apply_nice: i32,
    /// Versioned snapshots: where they are kept, how many, how often they are cut.
    pub snapshots: SnapshotsConfig,
    /// When consolidation runs, and how it judges.
    pub consolidator: consolidator::ConsolidatorConfig,
    /// This process's name among replicas of the same projectors (an ident), for a
    /// deployment that runs several: each replica then reads with a durable consumer of its
    /// own (`<projector>-<replica>`), and queries go to any of them. `None`: the only one.
    pub replica: Option<engram_schema::Ident>,
    /// Which secrets are redacted, per tenant: the projectors' second line, for events raw
    /// clients publish (the SDK and the CLI, which use the same policy, redact before
    /// appending). Redacted in every read model and in dead-letter copies.
    pub scrub: engram_scrub::ScrubConfig,
}

impl Default for ProjectorsConfig {
    fn default() -> Self {
        let settings = ProjectorSettings::default();
        Self {
            run: ProjectorName::all(),
            partitions: PartitionSet::all(),
            batch: settings.batch,
            checkpoint_interval: settings.checkpoint_interval,
            checkpoint_every: settings.checkpoint_every,
            // Every commit is a tantivy segment per partition: new files, fsyncs and merges.
            // At 1 s, creating and merging them was a seventh of the service's CPU at 800
            // appends/s (16 partitions); at 5 s a crash replays at most 5 s of events.
            keyword_commit_interval: Duration::from_secs(5),
            keyword_tail_commit_gap: Duration::from_secs(5),
            embedder: EmbedderConfig::default(),
            embed_cache_memory_mb: 64,
            embed_cache_disk_mb: 1024,
            hnsw: HnswParams::default(),
            max_in_flight: 256,
            apply_threads: 0,
            apply_nice: engram_projection_runtime::pool::PoolSettings::default().nice,
            snapshots: SnapshotsConfig::default(),
            consolidator: consolidator::ConsolidatorConfig::default(),
            replica: None,
            scrub: engram_scrub::ScrubConfig::default(),
        }
    }
}

impl ProjectorsConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.batch == 0 {
            return Err("projectors.batch must be at least 1".into());
        }
        if self.max_in_flight == 0 {
            return Err("projectors.max_in_flight must be at least 1".into());
        }
        if self.embed_cache_disk_mb < 4 {
            return Err("projectors.embed_cache_disk_mb must be at least 4".into());
        }
        if !(0..=19).contains(&self.apply_nice) {
            return Err(format!(
                "projectors.apply_nice is {}: it lowers the applying threads' priority by 0 to 19 nice steps",
                self.apply_nice
            ));
        }
        if self.apply_threads > 1024 {
            return Err(format!(
                "projectors.apply_threads is {}: at most 1024 (0 is one per core)",
                self.apply_threads
            ));
        }
        self.snapshots
            .validate()
            .map_err(|e| format!("projectors.{e}"))?;
        for name in &self.snapshots.skip_periodic {
            name.parse::<ProjectorName>()
                .map_err(|e| format!("projectors.snapshots.skip_periodic: {e}"))?;
        }
        self.consolidator
            .validate()
            .map_err(|e| format!("projectors.{e}"))?;
        self.scrub
            .validate()
            .map_err(|e| format!("projectors.{e}"))?;
        self.hnsw
            .validate()
            .map_err(|e| format!("projectors.hnsw: {e}"))
    }

    fn endpoint_limits(&self) -> engram_rpc::EndpointLimits {
        engram_rpc::EndpointLimits {
            max_in_flight: self.max_in_flight,
            ..engram_rpc::EndpointLimits::default()
        }
    }

    /// The loop settings every projector starts from; a model's [`ReadModel::settings`]
    /// adjusts them.
    pub fn loop_settings(&self) -> ProjectorSettings {
        ProjectorSettings {
            batch: self.batch,
            checkpoint_interval: self.checkpoint_interval,
            checkpoint_every: self.checkpoint_every,
            scrubbers: Some(engram_scrub::Scrubbers::new(&self.scrub)),
            ..ProjectorSettings::default()
        }
    }
}

#[derive(Debug, Error)]
pub enum StartError {
    #[error("projector {projector}: {source}")]
    Snapshots {
        projector: &'static str,
        #[source]
        source: SnapshotError,
    },
    #[error("cannot set up the embedder: {0}")]
    Embedder(#[from] engram_embed::EmbedError),
    #[error("cannot set up the consolidator's summariser: {0}")]
    Summariser(#[from] engram_consolidate::SummariserError),
    #[error("cannot start the {projector} query endpoint: {source}")]
    Service {
        projector: &'static str,
        #[source]
        source: engram_rpc::RpcError,
    },
    #[error(transparent)]
    Projector(#[from] ProjectorError),
    #[error(
        "the {projector} projector's state in {dir} is in use by another process (is `engram up` or `engram projector` running?); stop it first"
    )]
    Locked {
        projector: &'static str,
        dir: PathBuf,
    },
    #[error("cannot use state dir {dir}: {source}")]
    StateDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Partitions(#[from] PartitionSetError),
    #[error("the server did not confirm the projector endpoints' subscriptions: {0}; is it up?")]
    Flush(String),
    #[error("cannot connect the {projector} projector: {source}")]
    Bus {
        projector: &'static str,
        #[source]
        source: engram_bus::BusError,
    },
}

/// The embedder the vector projector uses, behind the embedding cache in `dir`.
pub async fn embedder(
    config: &ProjectorsConfig,
    dir: &Path,
) -> Result<Arc<dyn Embedder>, StartError> {
    let inner = engram_embed::build(&config.embedder).await?;
    let cache = CacheConfig {
        dir: dir.join("embed-cache"),
        memory_bytes: config.embed_cache_memory_mb * 1024 * 1024,
        disk_bytes: config.embed_cache_disk_mb * 1024 * 1024,
    };
    Ok(Arc::new(CachedEmbedder::open(inner, &cache).await?))
}

/// Holds `<dir>/<projector>.lock` for as long as it lives: one process per projector state.
pub struct StateLock(#[allow(dead_code)] std::fs::File);

/// Locks a projector's state directory, or says who holds it.
pub fn lock_state(dir: &Path, projector: &'static str) -> Result<StateLock, StartError> {
    let state_err = |source| StartError::StateDir {
        dir: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(state_err)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(format!("{projector}.lock")))
        .map_err(state_err)?;
    match file.try_lock() {
        Ok(()) => Ok(StateLock(file)),
        Err(std::fs::TryLockError::WouldBlock) => Err(StartError::Locked {
            projector,
            dir: dir.to_owned(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(state_err(e)),
    }
}

/// Projectors running in this process: every model's instance for each partition it hosts
/// now. Partitions come and go while it runs ([`RunningProjectors::add_partition`],
/// [`RunningProjectors::remove_partition`]): a memory node hosts those it owns.
pub struct RunningProjectors {
    config: ProjectorsConfig,
    dir: PathBuf,
    /// The process's shutdown: every partition's token is a child of it.
    shutdown: CancellationToken,
    /// Every endpoint of every hosted instance, callable in this process: the query
    /// service beside these projectors asks them without NATS.
    pub local: engram_rpc::LocalRoutes,
    /// One per model this process runs: its connections and NATS service, shared by the
    /// instances of every partition.
    models: Vec<ModelHost>,
    /// The partitions hosted now.
    hosted: BTreeMap<u32, Hosted>,
    /// Each hosted instance's partition and visibility, read by the prover, `/healthz` and
    /// read-your-writes waits; changed as partitions come and go.
    instances: Instances,
    /// The prover of idle partitions, ended with the shutdown signal.
    prover: Option<JoinHandle<()>>,
}

/// The instances hosted now, by model and partition.
pub type Instances = Arc<std::sync::RwLock<InstanceMap>>;

/// Each hosted instance's partition and visibility, by model and partition.
pub type InstanceMap = BTreeMap<(ProjectorName, u32), (Arc<Part>, Visibility)>;

/// What the instances of one model in a process share.
struct ModelHost {
    name: ProjectorName,
    bus: Bus,
    responder: async_nats::Client,
    service: async_nats::service::Service,
    store: SnapshotStore,
    head: Arc<StreamHead>,
    shared: Shared,
}

/// One hosted partition: every model's instance of it, ended by `stop`.
struct Hosted {
    stop: CancellationToken,
    _locks: Vec<StateLock>,
    tasks: Vec<(ProjectorName, JoinHandle<Result<(), ProjectorError>>)>,
    /// Periodic snapshot cutters and background work; they end with `stop`.
    aux: Vec<JoinHandle<()>>,
}

/// An instance's visible sequence, read when asked.
pub type VisibleSeq = Box<dyn Fn() -> Seq + Send + Sync>;

impl RunningProjectors {
    /// What each hosted instance can be read at now, as `/healthz` reports it: the
    /// partition's visible sequence, or further when the stream holds no event of the
    /// partition after it.
    pub fn visible_now(&self) -> Vec<(&'static str, Seq)> {
        visible_now(&self.instances)
    }

    /// A reader of [`RunningProjectors::visible_now`] that follows partitions as they come
    /// and go.
    pub fn instances(&self) -> Instances {
        self.instances.clone()
    }

    /// The partitions hosted now, ascending.
    pub fn partitions(&self) -> Vec<u32> {
        self.hosted.keys().copied().collect()
    }

    /// Waits until every instance can be read at `seq` (or `wait` passes).
    pub async fn wait_visible(&self, seq: Seq, wait: Duration) -> Result<(), Failure> {
        wait_visible_all(&self.instances, seq, wait).await
    }

    /// Starts every model's instance of partition `index` (each restores its checkpoint in
    /// this process's state dir and applies the partition from there) and serves their
    /// endpoints. Nothing happens if it is hosted already.
    pub async fn add_partition(&mut self, index: u32) -> Result<(), StartError> {
        self.add(index, true).await.map(drop)
    }

    /// [`RunningProjectors::add_partition`] for a partition this process takes over: its
    /// instances answer queries `unavailable` until [`CatchUp::run`] has seen each caught
    /// up with the stream, so no query reads a model still loading its snapshot or tail.
    pub async fn take_partition(&mut self, index: u32) -> Result<CatchUp, StartError> {
        self.add(index, false).await
    }

    async fn add(&mut self, index: u32, ready: bool) -> Result<CatchUp, StartError> {
        if let Some(hosted) = self.hosted.get(&index) {
            return Ok(CatchUp {
                instances: self.instances_of(index),
                stop: hosted.stop.clone(),
            });
        }
        let stop = self.shutdown.child_token();
        let mut hosted = Hosted {
            stop: stop.clone(),
            _locks: Vec::new(),
            tasks: Vec::new(),
            aux: Vec::new(),
        };
        let mut started = Vec::new();
        let outcome = async {
            for host in &self.models {
                let projector = host.name.as_str();
                let part = Arc::new(Part::new(
                    projector,
                    index,
                    host.bus.clone(),
                    host.head.clone(),
                ));
                part.set_ready(ready);
                let part_dir = part.dir(&self.dir);
                hosted._locks.push(lock_state(&part_dir, projector)?);
                let serving = Serving {
                    service: &host.service,
                    limits: self.config.endpoint_limits(),
                    head: host.head.clone(),
                    part: part.clone(),
                    routes: engram_rpc::Routes::new(self.local.clone(), stop.clone()),
                };
                let launched = host
                    .name
                    .model()
                    .launch(
                        &self.config,
                        &part_dir,
                        host.bus.clone(),
                        &serving,
                        &host.shared,
                        &host.store,
                        stop.clone(),
                    )
                    .await?;
                let (visibility, task) = (launched.0.clone(), launched.1);
                hosted.tasks.push((host.name, task));
                hosted.aux.extend(launched.4);
                let aux = serve_admin(
                    host.name,
                    &self.config,
                    &serving,
                    &host.store,
                    (launched.0, launched.2, launched.3),
                    stop.clone(),
                )
                .await?;
                hosted.aux.push(aux);
                started.push(((host.name, index), (part, visibility)));
            }
            Ok::<(), StartError>(())
        }
        .await;
        if let Err(e) = outcome {
            // What did start of the partition stops again, checkpointing.
            stop.cancel();
            if let Err(stopping) = stop_hosted(hosted).await {
                tracing::warn!(partition = index, error = %stopping, "a partial start did not stop cleanly");
            }
            return Err(e);
        }
        write_instances(&self.instances).extend(started);
        // Added means answering: a request from any connection finds the endpoints.
        for host in &self.models {
            engram_rpc::settle(
                &host.responder,
                host.bus.client(),
                engram_rpc::SETTLE_WITHIN,
            )
            .await
            .map_err(|e| StartError::Flush(e.to_string()))?;
        }
        let catch_up = CatchUp {
            instances: self.instances_of(index),
            stop: hosted.stop.clone(),
        };
        self.hosted.insert(index, hosted);
        Ok(catch_up)
    }

    fn instances_of(&self, index: u32) -> Vec<(Arc<Part>, Visibility)> {
        read_instances(&self.instances)
            .iter()
            .filter(|((_, p), _)| *p == index)
            .map(|(_, instance)| instance.clone())
            .collect()
    }

    /// Lets every model's instance of partition `index` answer queries, or not (they answer
    /// `unavailable`); their loops go on either way. Nothing if it is not hosted.
    pub fn set_answering(&self, index: u32, answering: bool) {
        for (part, _) in self.instances_of(index) {
            part.set_ready(answering);
        }
    }

    /// Stops every model's instance of partition `index`: its endpoints first (queries of
    /// it go elsewhere or are `unavailable`), then its loops, each checkpointing; returns
    /// once they have. Nothing happens if it is not hosted.
    pub async fn remove_partition(&mut self, index: u32) -> Result<(), ProjectorError> {
        let Some(hosted) = self.hosted.remove(&index) else {
            return Ok(());
        };
        write_instances(&self.instances).retain(|(_, p), _| *p != index);
        hosted.stop.cancel();
        let stopped = stop_hosted(hosted).await;
        // After the loops stopped: none of them cuts one more snapshot and sets them again.
        for host in &self.models {
            snapshot_forgotten(instance_name(host.name.as_str(), index));
        }
        stopped
    }

    /// Waits for every projector to stop (after the shutdown signal); returns the first error.
    pub async fn join(mut self) -> Result<(), ProjectorError> {
        let mut first = Ok(());
        for (_, hosted) in std::mem::take(&mut self.hosted) {
            let stopped = stop_hosted(hosted).await;
            if first.is_ok() {
                first = stopped;
            }
        }
        if let Some(prover) = self.prover.take() {
            let _ = prover.await;
        }
        for host in self.models {
            if let Err(e) = host.service.stop().await {
                tracing::debug!(error = %e, "projector service did not stop cleanly");
            }
            for client in [host.responder, host.bus.client().clone()] {
                let drained = tokio::time::timeout(Duration::from_secs(5), client.drain()).await;
                if !matches!(drained, Ok(Ok(()))) {
                    tracing::debug!("projector connection did not drain in time");
                }
            }
        }
        first
    }
}

/// A partition taken over, waiting to answer: see [`RunningProjectors::take_partition`].
pub struct CatchUp {
    instances: Vec<(Arc<Part>, Visibility)>,
    stop: CancellationToken,
}

impl CatchUp {
    /// Waits until every instance of the partition has applied the partition up to where
    /// the stream was when this was called, then lets them answer; returns the sequence
    /// caught up to. `None` if the partition was given up (or the process stops) first.
    /// Transient failures (the server away) are waited out.
    pub async fn run(self, bus: &Bus) -> Option<Seq> {
        let target = loop {
            tokio::select! {
                () = self.stop.cancelled() => return None,
                last = bus.stream_last_seq() => match last {
                    Ok(last) => break last,
                    Err(e) => tracing::debug!(error = %e, "stream position unknown; asking again"),
                },
            }
            tokio::select! {
                () = self.stop.cancelled() => return None,
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        };
        let consistency = Consistency {
            min_seq: (target > 0).then_some(target),
            wait_ms: Some(proto::limits::MAX_WAIT_MS),
        };
        for (part, visibility) in &self.instances {
            loop {
                let caught_up = tokio::select! {
                    () = self.stop.cancelled() => return None,
                    waited = part.wait(visibility, target, &consistency) => waited,
                };
                match caught_up {
                    Ok(()) => break,
                    Err(f) => {
                        tracing::debug!(instance = part.instance, reason = %f.message, "still catching up")
                    }
                }
            }
        }
        for (part, _) in &self.instances {
            part.set_ready(true);
        }
        Some(target)
    }
}

fn read_instances(instances: &Instances) -> std::sync::RwLockReadGuard<'_, InstanceMap> {
    instances.read().unwrap_or_else(|p| p.into_inner())
}

fn write_instances(instances: &Instances) -> std::sync::RwLockWriteGuard<'_, InstanceMap> {
    instances.write().unwrap_or_else(|p| p.into_inner())
}

/// Waits until every instance of `instances` (those hosted when called) can be read at
/// `seq`, or `wait` passes.
pub async fn wait_visible_all(
    instances: &Instances,
    seq: Seq,
    wait: Duration,
) -> Result<(), Failure> {
    let consistency = Consistency {
        min_seq: Some(seq),
        wait_ms: Some(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)),
    };
    let hosted: Vec<_> = read_instances(instances).values().cloned().collect();
    for (part, visibility) in hosted {
        part.wait(&visibility, seq, &consistency).await?;
    }
    Ok(())
}

/// Each instance of `instances` with what it can be read at now.
pub fn visible_now(instances: &Instances) -> Vec<(&'static str, Seq)> {
    read_instances(instances)
        .values()
        .map(|(part, v)| (part.instance, part.visible(v)))
        .collect()
}

/// Waits for a stopped partition's loops (each checkpoints) and its other tasks; the first
/// loop's error, if any.
async fn stop_hosted(hosted: Hosted) -> Result<(), ProjectorError> {
    let mut first = Ok(());
    for (name, task) in hosted.tasks {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!(projector = %name, error = %e, "projector failed");
                if first.is_ok() {
                    first = Err(e);
                }
            }
            Err(e) => tracing::error!(projector = %name, error = %e, "projector task panicked"),
        }
    }
    for task in hosted.aux {
        let _ = task.await;
    }
    first
}

/// One partition of the events stream, as one instance of a read model reads it: its
/// subjects, its instance name (`vector-p3`: durable consumer, metrics, snapshots) and
/// what is known of the stream beyond the instance's visible sequence.
///
/// An instance sees only its partition's events, so its visible sequence stops at the
/// partition's last event however far the stream goes: a read-your-writes token of a write
/// to another partition would wait for ever. So a token above it asks the stream leader
/// for the partition's next event after the visible one: none, or one beyond the token,
/// proves the partition complete through the token, and that proof is kept.
pub struct Part {
    pub index: u32,
    pub instance: &'static str,
    filter: String,
    /// No event of the partition lies between the instance's visible sequence (when this
    /// was proved) and this one.
    proven: std::sync::atomic::AtomicU64,
    /// Whether the instance answers queries: a partition a memory node takes over answers
    /// only once it has caught up with the stream (before that, `unavailable`), so no
    /// query sees a model still loading. Set at once for a partition started statically.
    ready: std::sync::atomic::AtomicBool,
    head: Arc<StreamHead>,
    bus: Bus,
}

impl Part {
    pub fn new(model: &str, index: u32, bus: Bus, head: Arc<StreamHead>) -> Self {
        Self {
            index,
            instance: instance_name(model, index),
            filter: engram_schema::partition_filter(index),
            proven: std::sync::atomic::AtomicU64::new(0),
            ready: std::sync::atomic::AtomicBool::new(true),
            head,
            bus,
        }
    }

    /// Whether the instance answers queries now (see the field).
    pub fn ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_ready(&self, ready: bool) {
        self.ready
            .store(ready, std::sync::atomic::Ordering::Release);
    }

    /// The failure a query of a partition not yet caught up gets.
    pub(crate) fn not_ready(&self) -> Failure {
        Failure::new(
            ErrorCode::Unavailable,
            format!(
                "partition {} is not answering on this memory node now (being taken over and not caught up yet, or its lease unconfirmed); retry shortly",
                self.index
            ),
        )
    }

    /// Where this partition's instance keeps its state under the model's `dir`.
    pub fn dir(&self, dir: &Path) -> PathBuf {
        partition_dir(dir, self.index)
    }

    /// The sequence reads of this instance reflect: every event of the partition up to it
    /// is applied and visible.
    pub fn visible(&self, v: &Visibility) -> Seq {
        v.current()
            .max(self.proven.load(std::sync::atomic::Ordering::Acquire))
    }

    fn prove(&self, seq: Seq) {
        self.proven
            .fetch_max(seq, std::sync::atomic::Ordering::AcqRel);
    }

    /// Waits until the instance can be read at `min_seq` (see the type's docs), at most the
    /// token's wait.
    async fn wait(
        &self,
        v: &Visibility,
        min_seq: Seq,
        consistency: &Consistency,
    ) -> Result<(), Failure> {
        if min_seq <= self.visible(v) {
            return Ok(());
        }
        engram_rpc::check_min_seq(&self.head, consistency).await?;
        let wait = consistency
            .wait_ms
            .map_or(DEFAULT_WAIT, Duration::from_millis);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let current = v.current();
            if min_seq <= current {
                return Ok(());
            }
            let next = self
                .bus
                .leader_next_seq(&self.filter, current + 1)
                .await
                .map_err(|e| Failure::new(ErrorCode::Unavailable, e.to_string()))?;
            match next {
                // Nothing of the partition after `current`, and the token exists: read.
                None => {
                    self.prove(min_seq);
                    return Ok(());
                }
                Some(next) if next > min_seq => {
                    self.prove(next - 1);
                    return Ok(());
                }
                // The partition's next event is at or below the token: wait for it to be
                // applied, then look again.
                Some(next) => {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    v.wait_for(next, left).await.map_err(|e: NotYetVisible| {
                        Failure::new(ErrorCode::NotYetVisible, e.to_string())
                    })?;
                }
            }
        }
    }
}

/// How often idle partitions are proved complete through the stream's last sequence, for
/// `/healthz` and status polls (a read-your-writes token proves them at once).
const PROVE_EVERY: Duration = Duration::from_secs(1);

/// Every `PROVE_EVERY` until `stop`: reads the stream's last sequence and, for each partition
/// some instance of which is behind it, asks the leader for the partition's next event after
/// the least visible sequence among its instances. None proves all of them complete through
/// the last sequence; one proves them through the event before it. At most one small request
/// per partition and tick, none while the stream is still.
fn spawn_prover(bus: Bus, instances: Instances, stop: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PROVE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let Ok(last) = bus.stream_last_seq().await else {
                continue;
            };
            // The partitions hosted at this tick, each with its instances.
            let mut by_partition: BTreeMap<u32, Vec<(Arc<Part>, Visibility)>> = BTreeMap::new();
            for (part, v) in read_instances(&instances).values() {
                by_partition
                    .entry(part.index)
                    .or_default()
                    .push((part.clone(), v.clone()));
            }
            for instances in by_partition.values() {
                if instances.iter().all(|(p, v)| p.visible(v) >= last) {
                    continue;
                }
                let least = instances
                    .iter()
                    .map(|(_, v)| v.current())
                    .min()
                    .unwrap_or(0);
                let filter = &instances[0].0.filter;
                let proven = match bus.leader_next_seq(filter, least + 1).await {
                    Ok(None) => last,
                    Ok(Some(next)) => next - 1,
                    Err(e) => {
                        tracing::debug!(error = %e, "partition proof failed");
                        continue;
                    }
                };
                for (part, _) in instances {
                    part.prove(proven);
                }
            }
        }
    })
}

/// The name of a model's instance for one partition: `vector-p3`. Interned, so that starting
/// and stopping projectors again (tests do, in one process) names each instance once.
pub fn instance_name(model: &str, index: u32) -> &'static str {
    static NAMES: std::sync::Mutex<BTreeMap<(String, u32), &'static str>> =
        std::sync::Mutex::new(BTreeMap::new());
    let mut names = NAMES.lock().unwrap_or_else(|p| p.into_inner());
    names
        .entry((model.to_owned(), index))
        .or_insert_with(|| Box::leak(proto::instance_name(model, index).into_boxed_str()))
}

/// Where partition `index`'s instances keep their state under the projectors' `dir`.
pub fn partition_dir(dir: &Path, index: u32) -> PathBuf {
    dir.join(format!("p{index}"))
}

/// What the instances of one model in a process share: the embedder (one cache on disk
/// and in memory) and the summariser (one bound on calls in flight).
pub struct Shared {
    root: PathBuf,
    embedder: tokio::sync::OnceCell<Arc<dyn Embedder>>,
    pub(crate) summariser: tokio::sync::OnceCell<Arc<consolidator::Bounded>>,
}

impl Shared {
    /// Resources kept under `root`, the projectors' state dir (the embedding cache).
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
            embedder: tokio::sync::OnceCell::new(),
            summariser: tokio::sync::OnceCell::new(),
        }
    }

    /// The embedder, built on first use.
    pub async fn embedder(
        &self,
        config: &ProjectorsConfig,
    ) -> Result<Arc<dyn Embedder>, StartError> {
        self.embedder
            .get_or_try_init(|| embedder(config, &self.root))
            .await
            .cloned()
    }
}

/// Starts the configured projectors, one instance of each per partition of the stream
/// (those `projectors.partitions` names):
/// each model gets its own NATS connection (a consumer sharing a connection with a busy
/// publisher can stall), shared by its partitions' loops, and its query endpoints, served
/// on a second connection (`connect(name, Link::Responder)`): see [`engram_rpc::Link`].
/// State lives under `dir/p<partition>`. They stop (each checkpointing) when `shutdown` is
/// cancelled; [`RunningProjectors::join`] waits for that.
pub async fn start<F, Fut>(
    config: &ProjectorsConfig,
    dir: &Path,
    connect: F,
    shutdown: CancellationToken,
) -> Result<RunningProjectors, StartError>
where
    F: Fn(&'static str, engram_rpc::Link) -> Fut,
    Fut: Future<Output = Result<Bus, engram_bus::BusError>>,
{
    let mut running = open(config, dir, connect, shutdown).await?;
    let partitions = running
        .models
        .first()
        .map_or(0, |m| m.bus.config().stream.partitions);
    for index in config.partitions.within(partitions)? {
        running.add_partition(index).await?;
    }
    Ok(running)
}

/// Connects the configured projectors (each model its worker and responder connections and
/// its NATS service) without hosting any partition yet: a memory node adds the partitions
/// it comes to own ([`RunningProjectors::add_partition`]).
pub async fn open<F, Fut>(
    config: &ProjectorsConfig,
    dir: &Path,
    connect: F,
    shutdown: CancellationToken,
) -> Result<RunningProjectors, StartError>
where
    F: Fn(&'static str, engram_rpc::Link) -> Fut,
    Fut: Future<Output = Result<Bus, engram_bus::BusError>>,
{
    // The encoder's threads first, from this thread: started from an apply thread, they
    // would inherit its lowered priority, queries' embeddings included.
    engram_embed::start_pool();
    // One pool per process: the first configuration wins (tests open many sets of models).
    if let Err(e) =
        engram_projection_runtime::pool::configure(engram_projection_runtime::pool::PoolSettings {
            threads: config.apply_threads,
            nice: config.apply_nice,
        })
    {
        tracing::warn!(error = %e, "apply pool settings not changed");
    }
    let mut models = Vec::new();
    for name in config.run.iter().copied() {
        let projector = name.as_str();
        let bus = connect(projector, engram_rpc::Link::Worker)
            .await
            .map_err(|source| StartError::Bus { projector, source })?;
        let responder = connect(projector, engram_rpc::Link::Responder)
            .await
            .map_err(|source| StartError::Bus { projector, source })?
            .client()
            .clone();
        let service = engram_rpc::start_service(
            &responder,
            &format!("engram-{projector}"),
            &format!("engram {projector} projector"),
        )
        .await
        .map_err(|source| StartError::Service { projector, source })?;
        let store = SnapshotStore::open(&bus, config.snapshots.clone())
            .await
            .map_err(|source| StartError::Snapshots { projector, source })?;
        let head = Arc::new(StreamHead::new(bus.clone()));
        models.push(ModelHost {
            name,
            bus,
            responder,
            service,
            store,
            head,
            shared: Shared::new(dir),
        });
    }
    if let Some(model) = models.first() {
        // A node configured for partitions the stream lacks is refused before it starts.
        config
            .partitions
            .within(model.bus.config().stream.partitions)?;
    }
    let instances = Instances::default();
    let prover = models
        .first()
        .map(|m| spawn_prover(m.bus.clone(), instances.clone(), shutdown.clone()));
    Ok(RunningProjectors {
        config: config.clone(),
        dir: dir.to_owned(),
        shutdown,
        local: engram_rpc::LocalRoutes::default(),
        models,
        hosted: BTreeMap::new(),
        instances,
        prover,
    })
}

/// Serves the endpoints every instance has beside its model's queries (snapshot, bootstrap,
/// status, ledger, erase, traces, snapshot_traces) and returns the periodic snapshot cutter.
async fn serve_admin(
    name: ProjectorName,
    config: &ProjectorsConfig,
    serving: &Serving<'_>,
    store: &SnapshotStore,
    (visibility, status, cutter): (
        Visibility,
        Arc<dyn Projection>,
        engram_projection_runtime::Cutter,
    ),
    shutdown: CancellationToken,
) -> Result<JoinHandle<()>, StartError> {
    let projector = name.as_str();
    let service = serving.service;
    let part = serving.part.clone();
    let subject = |op: &str| proto::partition_subject(projector, op, part.index);
    let service_err = |source| StartError::Service { projector, source };
    let (eraser, traced, store_for_traces) = (cutter.clone(), status.clone(), store.clone());
    let newest = Arc::new(Newest::default());
    let (c, st, v, kept, pt) = (
        cutter.clone(),
        store.clone(),
        visibility.clone(),
        newest.clone(),
        part.clone(),
    );
    // One cut at a time: a cut exports the whole model, so requests wait for the one in
    // progress, and one that would cut the state the newest snapshot already holds gets
    // that snapshot instead of a copy.
    let cutting = Arc::new(tokio::sync::Mutex::new(()));
    engram_rpc::serve_with(
        service,
        &serving.routes,
        &subject("snapshot"),
        "snapshot",
        serving.limits,
        move |req: SnapshotRequest| {
            let (cutter, store, v, cutting, kept, part) = (
                c.clone(),
                st.clone(),
                v.clone(),
                cutting.clone(),
                kept.clone(),
                pt.clone(),
            );
            async move {
                let _one = cutting.lock().await;
                if req.label.is_none()
                    && !req.force
                    && let Some(newest) = store
                        .list(Some(cutter.projector()))
                        .await
                        .ok()
                        .and_then(|m| m.into_iter().last())
                    && newest.version >= covered(&v, &part)
                {
                    return Ok(newest);
                }
                cut_and_store(&cutter, &store, &kept, req.label.as_deref()).await
            }
        },
    )
    .await
    .map_err(service_err)?;
    let (st, model, kept, instance) = (store.clone(), name.model(), newest.clone(), part.instance);
    // Each slice decodes a whole snapshot: a few at once, the rest wait their turn.
    let slicing = Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_SLICES));
    engram_rpc::serve_with(
        service,
        &serving.routes,
        &subject("bootstrap"),
        "bootstrap",
        serving.limits,
        move |req: proto::BootstrapRequest| {
            let (store, slicing, newest) = (st.clone(), slicing.clone(), kept.clone());
            async move { bootstrap_slice(model, instance, &store, &newest, &slicing, req).await }
        },
    )
    .await
    .map_err(service_err)?;
    let cuts = spawn_periodic_cuts(
        (projector, cutter),
        (visibility.clone(), part.clone()),
        store.clone(),
        newest,
        shutdown.clone(),
    );
    let (v, p) = (visibility.clone(), part.clone());
    engram_rpc::serve_with(
        service,
        &serving.routes,
        &subject("status"),
        "status",
        serving.limits,
        move |req: Consistency| {
            let (status, v, p) = (status.clone(), v.clone(), p.clone());
            async move {
                req.validate().map_err(Failure::from)?;
                wait_visible(&v, &p, &p.head, &req).await?;
                let hash: String = status
                    .state_hash()
                    .await
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                // Visible first, ledger after: see `Visibility::ledger`.
                let visible_seq = p.visible(&v);
                Ok(ProjectorStatus {
                    projector: projector.to_owned(),
                    partition: Some(p.index),
                    visible_seq,
                    state_hash: hash,
                    ledger: v.ledger(),
                })
            }
        },
    )
    .await
    .map_err(service_err)?;
    let (v, p) = (visibility.clone(), part.clone());
    engram_rpc::serve_with(
        service,
        &serving.routes,
        &subject("ledger"),
        "ledger",
        serving.limits,
        move |req: Consistency| {
            let (v, p) = (v.clone(), p.clone());
            async move {
                req.validate().map_err(Failure::from)?;
                wait_visible(&v, &p, &p.head, &req).await?;
                let visible_seq = p.visible(&v);
                Ok(ProjectorLedger {
                    projector: projector.to_owned(),
                    partition: Some(p.index),
                    visible_seq,
                    ledger: v.ledger(),
                })
            }
        },
    )
    .await
    .map_err(service_err)?;
    // Erasure (admin only: no other identity may publish here). The model first applies
    // everything up to `through_seq` (what the stream held when it was purged), so no
    // event of the scopes is applied after the erasure; then erases and checkpoints.
    let (v, p) = (visibility.clone(), part.clone());
    engram_rpc::serve_with(
        service,
        &serving.routes,
        &subject("erase"),
        "erase",
        serving.limits,
        move |req: proto::EraseScopesRequest| {
            let (v, p, eraser) = (v.clone(), p.clone(), eraser.clone());
            async move {
                req.validate().map_err(Failure::from)?;
                let wait = Consistency {
                    min_seq: (req.through_seq > 0).then_some(req.through_seq),
                    wait_ms: Some(proto::limits::MAX_WAIT_MS),
                };
                wait_visible(&v, &p, &p.head, &wait).await?;
                let removed = eraser
                    .erase(req.scopes)
                    .await
                    .map_err(|e| Failure::new(proto::ErrorCode::Unavailable, e.to_string()))?;
                Ok(proto::EraseScopesResponse {
                    projector: projector.to_owned(),
                    removed,
                })
            }
        },
    )
    .await
    .map_err(service_err)?;
    // The newest snapshot, loaded into a scratch copy of the model: does it still hold
    // the scopes? (Erasure verification; admin only.)
    let (st, registered, cfg) = (store_for_traces, name.model(), config.clone());
    engram_rpc::serve_with(
        service,
        &serving.routes,
        &subject("snapshot_traces"),
        "snapshot_traces",
        serving.limits,
        move |req: proto::TracesRequest| {
            let (store, cfg) = (st.clone(), cfg.clone());
            async move {
                if req.scopes.len() > proto::limits::MAX_ERASE_SCOPES {
                    return Err(Failure::invalid(format!(
                        "scopes: at most {}",
                        proto::limits::MAX_ERASE_SCOPES
                    )));
                }
                let unavailable = |e: String| Failure::new(ErrorCode::Unavailable, e);
                let chosen = store
                    .load_latest_good(instance, None, |_| Ok(()))
                    .await
                    .map_err(|e| unavailable(e.to_string()))?
                    .chosen;
                let traces = match chosen {
                    None => 0,
                    Some((_, bytes)) => {
                        let scratch =
                            tempfile::tempdir().map_err(|e| unavailable(e.to_string()))?;
                        registered
                            .snapshot_traces(&cfg, scratch.path(), &bytes, &req.scopes)
                            .await
                            .map_err(|e| unavailable(e.to_string()))?
                    }
                };
                Ok(proto::TracesResponse {
                    projector: projector.to_owned(),
                    traces,
                })
            }
        },
    )
    .await
    .map_err(service_err)?;
    let model = traced;
    engram_rpc::serve_with(
        service,
        &serving.routes,
        &subject("traces"),
        "traces",
        serving.limits,
        move |req: proto::TracesRequest| {
            let model = model.clone();
            async move {
                if req.scopes.len() > proto::limits::MAX_ERASE_SCOPES {
                    return Err(Failure::invalid(format!(
                        "scopes: at most {}",
                        proto::limits::MAX_ERASE_SCOPES
                    )));
                }
                Ok(proto::TracesResponse {
                    projector: projector.to_owned(),
                    traces: model.traces(&req.scopes).await,
                })
            }
        },
    )
    .await
    .map_err(service_err)?;
    Ok(cuts)
}

/// A started projector: what queries wait on, its loop, the model for status requests, and
/// what asks its loop for snapshot cuts.
pub type Launched = (
    Visibility,
    JoinHandle<Result<(), ProjectorError>>,
    Arc<dyn Projection>,
    engram_projection_runtime::Cutter,
    Option<JoinHandle<()>>,
);

/// What `engram.p.<projector>.snapshot` takes: cut a snapshot now, with an optional label
/// (labelled snapshots are kept by retention). Unknown fields are refused, like every
/// request's (a misspelt `force` would cut nothing new).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    #[serde(default)]
    pub label: Option<String>,
    /// Cut even if the newest snapshot is at the model's sequence: after an erasure the
    /// model changed without a new event, and the old snapshot holds what was erased.
    #[serde(default)]
    pub force: bool,
}

/// Cuts a snapshot of one running projector and stores it.
async fn cut_and_store(
    cutter: &engram_projection_runtime::Cutter,
    store: &SnapshotStore,
    newest: &Newest,
    label: Option<&str>,
) -> Result<SnapshotMeta, Failure> {
    let started = std::time::Instant::now();
    let cut = cutter.cut().await.map_err(|e| match e {
        engram_projection_runtime::ProjectionError::Fatal(m) => Failure::invalid(m),
        engram_projection_runtime::ProjectionError::Transient(m) => {
            Failure::new(ErrorCode::Unavailable, m)
        }
    })?;
    let meta = store
        .put(cutter.projector(), &cut, label)
        .await
        .map_err(|e| match e {
            SnapshotError::InvalidLabel(_)
            | SnapshotError::TooLarge { .. }
            | SnapshotError::TooManyLabelled { .. } => Failure::invalid(e.to_string()),
            other => Failure::new(ErrorCode::Unavailable, other.to_string()),
        })?;
    engram_telemetry::metrics::SNAPSHOT_SECONDS
        .with_label_values(&[cutter.projector()])
        .observe(started.elapsed().as_secs_f64());
    engram_telemetry::metrics::SNAPSHOT_BYTES
        .with_label_values(&[cutter.projector()])
        .set(i64::try_from(meta.bytes).unwrap_or(i64::MAX));
    snapshot_known(cutter.projector(), &meta);
    tracing::info!(
        projector = cutter.projector(),
        version = meta.version,
        bytes = meta.bytes,
        took_ms = started.elapsed().as_millis() as u64,
        "snapshot cut"
    );
    newest.keep(&meta, cut.bytes);
    Ok(meta)
}

/// Records `meta` as the newest snapshot of `instance`: when it was cut and the sequence it
/// holds, for its age and the events a takeover would replay after it. Set when the instance
/// starts (from the index, whether or not it loads that snapshot) and whenever it cuts one.
fn snapshot_known(instance: &str, meta: &SnapshotMeta) {
    use engram_telemetry::metrics;
    let cut_at = meta.created_at.timestamp_millis() as f64 / 1000.0;
    metrics::SNAPSHOT_LAST_TIMESTAMP
        .with_label_values(&[instance])
        .set(cut_at);
    metrics::SNAPSHOT_LAST_SEQ
        .with_label_values(&[instance])
        .set(i64::try_from(meta.version).unwrap_or(i64::MAX));
}

/// Removes `instance`'s snapshot gauges once its partition has left this process: another
/// process cuts its snapshots now, and the age of the last one seen here would grow (and
/// alert) forever.
fn snapshot_forgotten(instance: &str) {
    use engram_telemetry::metrics;
    // Absent when the instance never had a snapshot: nothing to remove.
    let _ = metrics::SNAPSHOT_LAST_TIMESTAMP.remove_label_values(&[instance]);
    let _ = metrics::SNAPSHOT_LAST_SEQ.remove_label_values(&[instance]);
}

/// Bytes of the newest snapshot kept in memory for bootstrap slices, at most.
const MAX_KEPT_SNAPSHOT_BYTES: usize = 64 * 1024 * 1024;
/// How long a kept snapshot is sliced from before the store is asked again: another
/// replica may have cut a newer one, or retention removed this one.
const KEPT_SNAPSHOT_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// The newest snapshot this process cut, or last loaded for a bootstrap, already checked:
/// a bootstrap slices it without listing and fetching the store again. For a small scope the
/// fetch was most of a bootstrap's time, making it slower than replaying the scope.
#[derive(Default)]
struct Newest(std::sync::Mutex<Option<Kept>>);

struct Kept {
    meta: SnapshotMeta,
    bytes: Arc<Vec<u8>>,
    at: std::time::Instant,
}

impl Newest {
    /// Keeps a snapshot just cut, unless a newer one is kept.
    fn keep(&self, meta: &SnapshotMeta, bytes: impl Into<Arc<Vec<u8>>>) {
        let newer_kept = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|k| k.meta.version > meta.version);
        if !newer_kept {
            self.replace(meta, bytes);
        }
    }

    /// Keeps the newest snapshot the store holds, whatever was kept before.
    fn replace(&self, meta: &SnapshotMeta, bytes: impl Into<Arc<Vec<u8>>>) {
        let bytes = bytes.into();
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *kept = (bytes.len() <= MAX_KEPT_SNAPSHOT_BYTES).then(|| Kept {
            meta: meta.clone(),
            bytes,
            at: std::time::Instant::now(),
        });
    }

    /// The kept snapshot, if it is fresh and answers a request for `version` (the newest
    /// when `None`).
    fn get(&self, version: Option<u64>) -> Option<(SnapshotMeta, Arc<Vec<u8>>)> {
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let k = kept.as_ref()?;
        let fits = version.is_none_or(|v| v == k.meta.version);
        (fits && k.at.elapsed() < KEPT_SNAPSHOT_TTL).then(|| (k.meta.clone(), k.bytes.clone()))
    }
}

/// Bootstrap slices decoded at once by one projector service.
const MAX_CONCURRENT_SLICES: usize = 2;

/// The slice of a projector's newest good snapshot that the request's scopes may read.
async fn bootstrap_slice(
    model: &'static dyn registry::Registered,
    instance: &'static str,
    store: &SnapshotStore,
    newest: &Newest,
    slicing: &tokio::sync::Semaphore,
    req: proto::BootstrapRequest,
) -> Result<proto::BootstrapResponse, Failure> {
    use base64::Engine as _;
    req.validate().map_err(Failure::from)?;
    let keep = req.scopes.resolve().map_err(Failure::invalid)?;
    let projector = model.name();
    if req.model.as_str() != projector {
        return Err(Failure::invalid(format!(
            "this is the {projector} projector; ask engram.p.{}.bootstrap.<partition>",
            req.model
        )));
    }
    let _permit = slicing
        .acquire()
        .await
        .map_err(|e| Failure::new(ErrorCode::Internal, e.to_string()))?;
    let (meta, bytes, skipped) = match newest.get(req.version) {
        Some((meta, bytes)) => (meta, bytes, Vec::new()),
        None => {
            let check = move |bytes: &[u8]| {
                engram_projection_runtime::snapshot::check(bytes, "the snapshot", projector)
                    .map(drop)
                    .map_err(|e| e.to_string())
            };
            let selection = store
                .load_latest_good(instance, req.version, check)
                .await
                .map_err(|e| match e {
                    SnapshotError::NotFound { .. } => Failure::invalid(e.to_string()),
                    other => Failure::new(ErrorCode::Unavailable, other.to_string()),
                })?;
            let skipped = selection
                .skipped
                .iter()
                .map(|(m, why)| format!("version {}: {why}", m.version))
                .collect();
            let Some((meta, bytes)) = selection.chosen else {
                return Ok(proto::BootstrapResponse {
                    model: req.model,
                    snapshot: None,
                    skipped,
                    bytes: None,
                    held: Vec::new(),
                });
            };
            let bytes = Arc::new(bytes);
            if req.version.is_none() {
                newest.replace(&meta, bytes.clone());
            }
            (meta, bytes, skipped)
        }
    };
    let sliced = off_runtime(move || {
        model
            .slice(&bytes, &keep)
            .map_err(|e| Failure::new(ErrorCode::Internal, e))
    })
    .await?
    .ok_or_else(|| Failure::invalid(format!("{projector} keeps no scope snapshots")))?;
    if sliced.len() > proto::limits::MAX_DOC_BYTES {
        return Err(Failure::invalid(format!(
            "the scope's slice of {projector} is {} bytes, more than a reply carries ({}); replay the scope's events instead",
            sliced.len(),
            proto::limits::MAX_DOC_BYTES
        )));
    }
    Ok(proto::BootstrapResponse {
        model: req.model,
        snapshot: Some(proto::BootstrapSnapshot {
            version: meta.version,
            label: meta.label,
            created_at: meta.created_at,
            state_hash: meta.state_hash,
        }),
        skipped,
        bytes: Some(base64::engine::general_purpose::STANDARD.encode(sliced)),
        held: Vec::new(),
    })
}

/// Cuts a snapshot every `interval` once `min_events` were applied since the last one,
/// until `stop`; ends at once for a model that cannot export itself.
/// How far the stream a cut of the instance now would cover: what it applied, or further
/// when its partition is proved to hold nothing more up to there (a cut says so, see
/// `complete_through` in the runtime).
fn covered(visibility: &Visibility, part: &Part) -> Seq {
    visibility.ledger().seq.max(part.visible(visibility))
}

fn spawn_periodic_cuts(
    (model, cutter): (&'static str, engram_projection_runtime::Cutter),
    (visibility, part): (Visibility, Arc<Part>),
    store: SnapshotStore,
    newest: Arc<Newest>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let config = store.config().clone();
        if config.interval.is_zero() || config.skip_periodic.iter().any(|p| p.as_str() == model) {
            return;
        }
        let mut last_cut = store
            .list(Some(cutter.projector()))
            .await
            .ok()
            .and_then(|metas| metas.last().map(|m| m.version))
            .unwrap_or(0);
        let mut tick = tokio::time::interval(config.interval);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            // New events of the partition, or a stream gone so far past the last cut that
            // retention may soon remove what that cut needs after it: an idle partition's
            // snapshot is renewed rarely, but it is.
            let partitions = u64::from(part.bus.config().stream.partitions);
            if visibility.ledger().seq < last_cut + config.min_events
                && covered(&visibility, &part)
                    < last_cut + config.min_events.saturating_mul(partitions)
            {
                continue;
            }
            match cut_and_store(&cutter, &store, &newest, None).await {
                Ok(meta) => last_cut = meta.version,
                Err(f) if f.code == ErrorCode::Invalid => {
                    tracing::debug!(projector = cutter.projector(), reason = %f.message, "no periodic snapshots");
                    return;
                }
                Err(f) => {
                    tracing::warn!(projector = cutter.projector(), reason = %f.message, "periodic snapshot failed; trying again next time")
                }
            }
        }
    })
}

/// Where an instance's endpoints are served, and what bounds them.
pub struct Serving<'a> {
    service: &'a async_nats::service::Service,
    limits: engram_rpc::EndpointLimits,
    head: Arc<StreamHead>,
    pub(crate) part: Arc<Part>,
    /// The in-process table the endpoints are entered in, and the partition's token that
    /// ends them.
    pub(crate) routes: engram_rpc::Routes,
}

/// Rebuilds one projector's read model from sequence 1, every partition of it; returns the
/// furthest sequence applied and the model's state hash (as [`status_of`] gives it). The
/// projector must not be running.
pub async fn rebuild(
    name: ProjectorName,
    config: &ProjectorsConfig,
    dir: &Path,
    bus: Bus,
    progress: impl FnMut(Seq, Seq) + Send,
) -> Result<(Seq, [u8; 32]), StartError> {
    Ok(merged(
        &rebuild_partitions(name, config, dir, bus, progress).await?,
    ))
}

/// [`rebuild`], answering each partition's sequence and state hash, in partition order.
/// Partitions are rebuilt [`PARTITIONS_AT_ONCE`] at a time, as [`rebuild_from_snapshot`]
/// bootstraps them, so that the two compare alike.
pub async fn rebuild_partitions(
    name: ProjectorName,
    config: &ProjectorsConfig,
    dir: &Path,
    bus: Bus,
    progress: impl FnMut(Seq, Seq) + Send,
) -> Result<Vec<(Seq, [u8; 32])>, StartError> {
    let shared = Shared::new(dir);
    let head = Arc::new(StreamHead::new(bus.clone()));
    let progress = std::sync::Mutex::new(progress);
    let one = |index: u32| {
        let (bus, head, shared, progress) = (bus.clone(), head.clone(), &shared, &progress);
        async move {
            let part = Part::new(name.as_str(), index, bus.clone(), head);
            let part_dir = part.dir(dir);
            let _lock = lock_state(&part_dir, name.as_str())?;
            let mut report = |applied: Seq, target: Seq| {
                (progress.lock().unwrap_or_else(|p| p.into_inner()))(applied, target)
            };
            name.model()
                .rebuild(config, &part_dir, bus, &part, shared, &mut report)
                .await
                .map(|reached| (index, reached))
        }
    };
    let mut rebuilt: Vec<(u32, (Seq, [u8; 32]))> =
        futures::stream::iter(0..bus.config().stream.partitions)
            .map(one)
            .buffer_unordered(PARTITIONS_AT_ONCE)
            .try_collect()
            .await?;
    rebuilt.sort_by_key(|(index, _)| *index);
    Ok(rebuilt.into_iter().map(|(_, reached)| reached).collect())
}

/// Partitions a rebuild or a bootstrap works on at once: one partition's loading (a snapshot
/// fetched and decoded, a consumer created) overlaps another's applying, which one alone
/// leaves the cores idle through. A partition starts as soon as any other is done, not when
/// the oldest is: partitions differ in size, and waiting for the largest of each group of
/// four left the cores idle.
pub const PARTITIONS_AT_ONCE: usize = 4;

/// The furthest sequence and the model's hash of its partitions' `(seq, hash)`, in order:
/// the hash is [`ProjectorStatus::merge`]'s.
fn merged(parts: &[(Seq, [u8; 32])]) -> (Seq, [u8; 32]) {
    let mut hash = blake3::Hasher::new();
    for (_, h) in parts {
        hash.update(engram_snapshots::hex(h).as_bytes());
    }
    (
        parts.iter().map(|(s, _)| *s).max().unwrap_or(0),
        *hash.finalize().as_bytes(),
    )
}

/// How a replica was bootstrapped: per partition, the snapshot it loaded (none: a full
/// replay of the partition) and the newer ones that did not check; and where it ended.
#[derive(Clone, Debug, Serialize)]
pub struct Bootstrapped {
    pub projector: ProjectorName,
    pub partitions: Vec<PartitionBooted>,
    pub seq: Seq,
    pub state_hash: String,
}

/// One partition of a [`Bootstrapped`] model.
#[derive(Clone, Debug, Serialize)]
pub struct PartitionBooted {
    pub partition: u32,
    pub snapshot: Option<SnapshotMeta>,
    pub skipped: Vec<(SnapshotMeta, String)>,
}

impl Bootstrapped {
    /// Partitions that loaded a snapshot.
    pub fn from_snapshots(&self) -> usize {
        self.partitions
            .iter()
            .filter(|p| p.snapshot.is_some())
            .count()
    }
}

/// Builds one projector's read model, each partition from its newest good snapshot (at most
/// `version`) and then the partition's events after it; a partition with no snapshot that
/// checks, from all its events. The projector must not be running.
pub async fn rebuild_from_snapshot(
    name: ProjectorName,
    config: &ProjectorsConfig,
    dir: &Path,
    bus: Bus,
    version: Option<u64>,
    progress: impl FnMut(Seq, Seq) + Send,
) -> Result<Bootstrapped, StartError> {
    let projector = name.as_str();
    let store = SnapshotStore::open(&bus, config.snapshots.clone())
        .await
        .map_err(|source| StartError::Snapshots { projector, source })?;
    let shared = Shared::new(dir);
    let head = Arc::new(StreamHead::new(bus.clone()));
    let progress = std::sync::Mutex::new(progress);
    let one = |index: u32| {
        let (bus, head, shared, progress, store) =
            (bus.clone(), head.clone(), &shared, &progress, &store);
        async move {
            let part = Part::new(projector, index, bus.clone(), head);
            let part_dir = part.dir(dir);
            let _lock = lock_state(&part_dir, projector)?;
            let check = move |bytes: &[u8]| {
                engram_projection_runtime::snapshot::check(bytes, "the snapshot", projector)
                    .map(drop)
                    .map_err(|e| e.to_string())
            };
            let started = std::time::Instant::now();
            let selection = store
                .load_latest_good(part.instance, version, check)
                .await
                .map_err(|source| StartError::Snapshots { projector, source })?;
            tracing::debug!(
                projector = part.instance,
                load_ms = started.elapsed().as_millis() as u64,
                "snapshot loaded"
            );
            let mut report = |applied: Seq, target: Seq| {
                (progress.lock().unwrap_or_else(|p| p.into_inner()))(applied, target)
            };
            let model = name.model();
            let (snapshot, at) = match selection.chosen {
                Some((meta, bytes)) => {
                    let at = model
                        .bootstrap(config, &part_dir, bus, &part, shared, &bytes, &mut report)
                        .await?;
                    (Some(meta), at)
                }
                None => (
                    None,
                    model
                        .rebuild(config, &part_dir, bus, &part, shared, &mut report)
                        .await?,
                ),
            };
            Ok::<_, StartError>((
                at,
                PartitionBooted {
                    partition: index,
                    snapshot,
                    skipped: selection.skipped,
                },
            ))
        }
    };
    let mut booted: Vec<((Seq, [u8; 32]), PartitionBooted)> =
        futures::stream::iter(0..bus.config().stream.partitions)
            .map(one)
            .buffer_unordered(PARTITIONS_AT_ONCE)
            .try_collect()
            .await?;
    booted.sort_by_key(|(_, booted)| booted.partition);
    let (reached, partitions): (Vec<_>, Vec<_>) = booted.into_iter().unzip();
    let (seq, hash) = merged(&reached);
    Ok(Bootstrapped {
        projector: name,
        partitions,
        seq,
        state_hash: engram_snapshots::hex(&hash),
    })
}

/// What `engram.p.<projector>.status.<partition>` answers, and [`status_of`] for a whole
/// model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectorStatus {
    pub projector: String,
    /// The partition this instance holds; `None` for a whole model's, merged.
    #[serde(default)]
    pub partition: Option<u32>,
    pub visible_seq: Seq,
    /// Hex digest of the read model's logical state; equal states give equal hashes.
    pub state_hash: String,
    /// What the projector has applied, as in [`ProjectorLedger::ledger`].
    #[serde(default)]
    pub ledger: ApplyLedger,
}

/// What `engram.p.<projector>.ledger` answers: the status without the state hash, which
/// walks the whole model; this one costs nothing, so a load test can poll it for lag.
///
/// JSON: `{"projector": "vector", "visible_seq": 120, "ledger": {"seq": 125, "events": 118,
/// "digest": 1234567890123456789}}`. `digest` is a full u64: read it as one, not as a
/// JavaScript number.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectorLedger {
    pub projector: String,
    /// The partition this instance holds; `None` for a whole model's, merged.
    #[serde(default)]
    pub partition: Option<u32>,
    /// The sequence queries can see: every event of the partition up to it is visible (the
    /// partition may have none near it, so it can be past `ledger.seq`).
    pub visible_seq: Seq,
    /// What the projector has applied (counted and digested with
    /// [`engram_projection_runtime::ledger_entry`]), read after `visible_seq`, so
    /// `ledger.seq >= visible_seq`. It is ahead while a batch is applied but not yet
    /// published (the keyword projector commits at most every `keyword_commit_interval`
    /// while behind). It is the ledger of the model in memory, not of its last checkpoint:
    /// after a crash the restarted projector reports the checkpoint's ledger, which is
    /// behind, and catches up by replaying.
    pub ledger: ApplyLedger,
}

/// Adds up partitions' ledgers: the ledger of the whole model, equal to what one projector
/// reading the whole stream would count.
pub fn merge_ledgers<'a>(ledgers: impl IntoIterator<Item = &'a ApplyLedger>) -> ApplyLedger {
    ledgers
        .into_iter()
        .fold(ApplyLedger::default(), |mut all, one| {
            all.seq = all.seq.max(one.seq);
            all.events += one.events;
            all.digest = all.digest.wrapping_add(one.digest);
            all
        })
}

impl ProjectorLedger {
    /// The whole model's, from every partition's: visible where all of them are.
    pub fn merge(projector: &str, parts: &[ProjectorLedger]) -> Self {
        Self {
            projector: projector.to_owned(),
            partition: None,
            visible_seq: parts.iter().map(|p| p.visible_seq).min().unwrap_or(0),
            ledger: merge_ledgers(parts.iter().map(|p| &p.ledger)),
        }
    }
}

impl ProjectorStatus {
    /// The whole model's, from every partition's in partition order: its state hash is the
    /// hash of theirs, so equal partitions give equal models.
    pub fn merge(projector: &str, parts: &[ProjectorStatus]) -> Self {
        let mut hash = blake3::Hasher::new();
        for part in parts {
            hash.update(part.state_hash.as_bytes());
        }
        Self {
            projector: projector.to_owned(),
            partition: None,
            visible_seq: parts.iter().map(|p| p.visible_seq).min().unwrap_or(0),
            state_hash: hash.finalize().to_hex().to_string(),
            ledger: merge_ledgers(parts.iter().map(|p| &p.ledger)),
        }
    }
}

/// Asks `op` of every partition's instance of `model` at once; each answer, in partition
/// order.
pub async fn ask_each<Req, Resp>(
    client: &async_nats::Client,
    model: &str,
    op: &str,
    partitions: u32,
    request: &Req,
    timeout: Duration,
) -> Vec<Result<Resp, Failure>>
where
    Req: Serialize + Sync,
    Resp: serde::de::DeserializeOwned,
{
    let asks = (0..partitions).map(|p| {
        let subject = proto::partition_subject(model, op, p);
        async move { engram_rpc::call(client, &subject, request, timeout).await }
    });
    futures::future::join_all(asks)
        .await
        .into_iter()
        .map(|r| r.map_err(Failure::from))
        .collect()
}

/// [`ask_each`], failing with the first partition's failure.
pub async fn ask_partitions<Req, Resp>(
    client: &async_nats::Client,
    model: &str,
    op: &str,
    partitions: u32,
    request: &Req,
    timeout: Duration,
) -> Result<Vec<Resp>, Failure>
where
    Req: Serialize + Sync,
    Resp: serde::de::DeserializeOwned,
{
    ask_each(client, model, op, partitions, request, timeout)
        .await
        .into_iter()
        .collect()
}

/// A whole model's status: every partition's, merged ([`ProjectorStatus::merge`]).
pub async fn status_of(
    client: &async_nats::Client,
    model: &str,
    partitions: u32,
    consistency: &Consistency,
    timeout: Duration,
) -> Result<ProjectorStatus, Failure> {
    let parts: Vec<ProjectorStatus> =
        ask_partitions(client, model, "status", partitions, consistency, timeout).await?;
    Ok(ProjectorStatus::merge(model, &parts))
}

/// A whole model's ledger: every partition's, merged ([`ProjectorLedger::merge`]).
pub async fn ledger_of(
    client: &async_nats::Client,
    model: &str,
    partitions: u32,
    consistency: &Consistency,
    timeout: Duration,
) -> Result<ProjectorLedger, Failure> {
    let parts: Vec<ProjectorLedger> =
        ask_partitions(client, model, "ledger", partitions, consistency, timeout).await?;
    Ok(ProjectorLedger::merge(model, &parts))
}

/// The default wait for a read-your-writes token.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// Waits for a read-your-writes token, refusing at once one that no append returned: see
/// [`Part`] for a token of another partition's write.
pub(crate) async fn wait_visible(
    visibility: &Visibility,
    part: &Part,
    _head: &StreamHead,
    consistency: &Consistency,
) -> Result<(), Failure> {
    let Some(min_seq) = consistency.min_seq else {
        return Ok(());
    };
    part.wait(visibility, min_seq, consistency).await
}

/// Runs a query that scans a table on a blocking thread: a scan of a large fact table or
/// skill registry would otherwise hold up every other request on the runtime.
pub(crate) async fn off_runtime<T: Send + 'static>(
    query: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    tokio::task::spawn_blocking(query)
        .await
        .map_err(|e| Failure::new(ErrorCode::Internal, format!("query failed: {e}")))?
}

/// The newest snapshot of `instance` that checks, if it holds more than `held` (the
/// instance's own checkpoint): what an instance starts from when its partition comes to
/// this process with little or nothing of it here. `None` when there is none, or the store
/// cannot be read (the instance then replays from its checkpoint).
pub(crate) async fn newer_snapshot(
    store: &SnapshotStore,
    instance: &'static str,
    held: Seq,
) -> Option<Vec<u8>> {
    let newest = store.list(Some(instance)).await.ok()?.pop()?;
    snapshot_known(instance, &newest);
    if newest.version <= held {
        return None;
    }
    let model = instance.rsplit_once("-p").map_or(instance, |(m, _)| m);
    let check = move |bytes: &[u8]| {
        engram_projection_runtime::snapshot::check(bytes, "the snapshot", model)
            .map(drop)
            .map_err(|e| e.to_string())
    };
    match store.load_latest_good(instance, None, check).await {
        Ok(selection) => selection
            .chosen
            .filter(|(meta, _)| meta.version > held)
            .map(|(_, bytes)| bytes),
        Err(e) => {
            tracing::warn!(projector = instance, error = %e, "cannot read its snapshots; replaying from the checkpoint");
            None
        }
    }
}

/// Where a projector keeps its state under an engram home.
pub fn state_dir(home: &Path) -> PathBuf {
    home.join("projectors")
}

//! The projection runtime: turns the event stream into a read model, in order, exactly once
//! per model state, across crashes.
//!
//! # Layout
//! - [`Projection`]: what a read model implements (apply a batch, publish, checkpoint, restore).
//! - [`Projector`]: the loop. A durable pull consumer delivers events in stream order; each
//!   batch is applied, made visible, and every so often checkpointed (state and ledger
//!   together), after which the consumer is acked. Poison messages go to the dead-letter
//!   stream and are skipped; transient failures are retried with backoff, never skipped.
//! - [`ApplyLedger`]: the sequence a model's state includes, with a count and digest of the
//!   events applied to it, so that "every event exactly once" can be checked from outside.
//! - [`Visibility`]: the sequence queries can see, the ledger of what is applied, and a
//!   bounded wait for a read-your-writes token.
//! - [`snapshot`]: atomic, checksummed files holding a model together with its ledger.
//! - [`rebuild`](Projector::rebuild): replays the whole stream into an emptied model.
//!
//! Exactly-once comes from sequence numbers, not from the consumer: a model records the
//! sequence its state includes, skips anything at or below it, and a restart resumes from
//! the ledger saved with the state. Acks only tidy the server's bookkeeping.

pub mod model;
pub mod pool;
pub mod snapshot;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use engram_bus::{Bus, BusError, Delivery, StoredEvent};
use engram_memory::Seq;
use engram_schema::{DocChanged, EventKind};
use engram_scrub::DocChanges;
use engram_telemetry::metrics;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// What a projector has applied: how many events, and an order-independent digest of their
/// (seq, event id) pairs. Saved with the model's state, so a crash and replay can be checked
/// against the stream: an event applied twice or skipped changes count or digest.
///
/// Counted are the events handed to [`Projection::apply`] and not rejected, including those
/// the model ignores (the vector model ignores facts); dead-lettered messages are not.
/// Anyone can compute the expected ledger of a stream with [`ApplyLedger::add`] over its
/// good events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyLedger {
    /// The last sequence processed, counted or not (the same as the loop's applied sequence:
    /// a dead-lettered event at the end of a batch moves it too).
    pub seq: Seq,
    /// Events applied.
    pub events: u64,
    /// Wrapping sum of [`ledger_entry`] over the applied events. A sum, not a chained hash,
    /// so that the expected value can be computed from the stream in any order.
    pub digest: u64,
}

impl ApplyLedger {
    /// Counts one applied event; `seq` moves forward to it.
    pub fn add(&mut self, seq: Seq, event_id: &str) {
        self.seq = self.seq.max(seq);
        self.events += 1;
        self.digest = self.digest.wrapping_add(ledger_entry(seq, event_id));
    }
}

/// One event's share of [`ApplyLedger::digest`]: the first 8 bytes (little endian) of blake3
/// over `seq.to_le_bytes()` followed by the event id's bytes.
pub fn ledger_entry(seq: Seq, event_id: &str) -> u64 {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&seq.to_le_bytes());
    hasher.update(event_id.as_bytes());
    let hash = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

/// An event a projection failed to apply because of the event itself (it would fail again on
/// every retry). The model must be unchanged by it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// Index into the batch passed to [`Projection::apply`].
    pub index: usize,
    pub reason: String,
}

/// Failures of a projection that are not the event's fault.
#[derive(Debug, Error)]
pub enum ProjectionError {
    /// Retry later: an embedding service down, a full disk, a bus hiccup.
    #[error("{0}")]
    Transient(String),
    /// The model cannot go on (corrupt state on disk, bad configuration).
    #[error("{0}")]
    Fatal(String),
}

/// A read model fed by the projector.
///
/// Implementations keep their state behind interior mutability: queries read it while the
/// projector applies batches.
#[async_trait]
pub trait Projection: Send + Sync + 'static {
    /// Names the durable consumer, metrics, state directory and dead-letter subject.
    fn name(&self) -> &'static str;

    /// The directory the model keeps its state in, if any. The projector keeps its
    /// dead-letter id key there too (unless [`ProjectorSettings::state_dir`] names another),
    /// so that a dead letter sent again after a restart is still deduplicated.
    fn state_dir(&self) -> Option<&Path> {
        None
    }

    /// Loads the last checkpoint and returns the ledger saved with it (the default: empty).
    async fn restore(&self) -> Result<ApplyLedger, ProjectionError>;

    /// Applies `events` (stream order, all above the model's sequence). Events the model
    /// rejects are returned and left out; an `Err` means nothing of the batch may be assumed
    /// applied, and the batch is retried. Implementations must make a retried batch idempotent
    /// (skip sequences they already hold).
    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError>;

    /// Makes everything applied so far visible to queries. Models that apply in place need
    /// nothing; an index with commits (tantivy) commits here. How often this is called is
    /// [`ProjectorSettings::publish_interval`]; it is always called before a checkpoint and
    /// whenever the projector has caught up with the stream. A model whose publish is
    /// durable must save `applied` with it, as [`checkpoint`](Self::checkpoint) would.
    async fn publish(&self, _applied: &ApplyLedger) -> Result<(), ProjectionError> {
        Ok(())
    }

    /// Persists the state together with `applied`, atomically: [`restore`](Self::restore)
    /// must return exactly the ledger saved with the state it loads.
    async fn checkpoint(&self, applied: &ApplyLedger) -> Result<(), ProjectionError>;

    /// Empties the model and its checkpoint (before a rebuild).
    async fn reset(&self) -> Result<(), ProjectionError>;

    /// The model's whole state with `applied`, as one self-checking blob: the payload of a
    /// versioned snapshot, which [`import`](Self::import) loads on another replica. `None`
    /// (the default) for a model that cannot export itself; a replica of it rebuilds from
    /// the stream.
    async fn export(&self, _applied: &ApplyLedger) -> Result<Option<Vec<u8>>, ProjectionError> {
        Ok(None)
    }

    /// Replaces the model with an [`export`](Self::export)ed blob, after checking it; returns
    /// the ledger it holds. A blob that does not check is refused and the model is unchanged.
    /// The checkpoint need not follow (see [`import_is_checkpoint`](Self::import_is_checkpoint)):
    /// the runtime then makes one after the tail, and a restart before that restores the
    /// previous checkpoint, a consistent state of its own, and imports the snapshot again or
    /// replays after it.
    async fn import(&self, _bytes: &[u8]) -> Result<ApplyLedger, ProjectionError> {
        Err(ProjectionError::Fatal(format!(
            "projector {} cannot load snapshots; rebuild it from the stream",
            self.name()
        )))
    }

    /// A digest of the logical state, equal for equal content however it was built.
    async fn state_hash(&self) -> [u8; 32];

    /// Removes everything the model holds of the scopes `keys` (erasure), and returns how
    /// many items it removed. The loop publishes and checkpoints right after, so a restart
    /// cannot bring the removed items back from an older checkpoint. The default refuses: a
    /// model that keeps scope data must implement it.
    async fn erase(&self, _keys: &[engram_memory::ScopeKey]) -> Result<u64, ProjectionError> {
        Err(ProjectionError::Fatal(format!(
            "projector {} cannot erase scopes",
            self.name()
        )))
    }

    /// How many items the model holds of the scopes `keys`: what erasure verification
    /// reports as remaining traces (0 after an erase).
    async fn traces(&self, _keys: &[engram_memory::ScopeKey]) -> u64 {
        0
    }

    /// Whether the model applies the changes of `doc_changed` events (the docs model does;
    /// every other model ignores the kind). Decoding them inflates compressed changes, so
    /// the projector decodes them for such a model only, once per event: to find the secrets
    /// they write, to dead-letter those that do not decode before the model sees them, and
    /// to hand the model the changes uncompressed, so that its own parse inflates nothing.
    /// Every other projector leaves them alone. (Each projector's scrubber used to decode
    /// every change: one compressed change was inflated once per projector, and again by
    /// the model and by its dead letter.)
    fn applies_doc_changes(&self) -> bool {
        false
    }

    /// Whether [`import`](Self::import) leaves the imported state as the model's checkpoint
    /// (a restart restores it). A bootstrap of such a model ends without checkpointing again
    /// while fewer than [`ProjectorSettings::checkpoint_every`] events followed the
    /// snapshot, as a running projector would.
    fn import_is_checkpoint(&self) -> bool {
        false
    }

    /// Whether what [`apply`](Self::apply) took is searchable as soon as it returns, even
    /// when [`publish`](Self::publish) (a durable commit) is spaced out: the keyword index
    /// searches its uncommitted tail. Queries' read-your-writes waits then end at the apply,
    /// not at the next commit. Models that apply in place publish every batch anyway.
    fn searchable_when_applied(&self) -> bool {
        false
    }
}

/// Failures that stop a projector.
#[derive(Debug, Error)]
pub enum ProjectorError {
    #[error("projector {projector}: {source}")]
    Projection {
        projector: &'static str,
        #[source]
        source: ProjectionError,
    },
    #[error("projector {projector}: {source}")]
    Bus {
        projector: &'static str,
        #[source]
        source: BusError,
    },
    /// Retention removed events a replay would need: never replayed across the gap.
    #[error(
        "projector {projector} needs every event after seq {from}, but the stream now starts at seq {first} (retention removed the rest); bootstrap from a snapshot at seq {} or later",
        first - 1
    )]
    TailGone {
        projector: &'static str,
        from: Seq,
        first: Seq,
    },
}

/// A checkpoint waits at least this many times the previous one's duration.
pub const CHECKPOINT_COST_FACTOR: u32 = 10;

/// How a projector batches and checkpoints.
#[derive(Clone, Debug)]
pub struct ProjectorSettings {
    /// Most events applied in one batch.
    pub batch: usize,
    /// Checkpoint at least this often while events flow...
    pub checkpoint_interval: Duration,
    /// ...and after this many events, whichever comes first. Either way, never sooner than
    /// [`CHECKPOINT_COST_FACTOR`] times the last checkpoint's duration after it: a model
    /// whose snapshot grew slow (a million vectors) spends at most a tenth of its time
    /// saving, at the price of a longer replay after a crash.
    pub checkpoint_every: u64,
    /// Longest pause between retries of a failing batch.
    pub max_backoff: Duration,
    /// While the projector is behind, publish (make visible) at most this often; once it has
    /// caught up, every batch is published at once. Zero publishes every batch: right for
    /// models that apply in place, where publishing is free. An index whose publish is a
    /// durable commit sets it higher, so a backlog costs a few commits instead of one per
    /// batch; read-your-writes waits then see up to this much extra delay under load.
    pub publish_interval: Duration,
    /// Once caught up, the least time between two publishes. Zero publishes every batch at
    /// the tail: right for in-place models. An index whose publish is a durable commit sets
    /// a few tens of milliseconds: under a steady trickle every batch reaches the tail, and
    /// a commit per batch (a new segment, an fsync, later merges) costs more CPU than the
    /// writes themselves. Read-your-writes waits see up to this much extra delay.
    pub tail_publish_gap: Duration,
    /// How often `engram_projector_lag_events` is measured: the stream's last sequence minus
    /// the visible one. Measured apart from deliveries, so a projector that receives nothing
    /// (stalled, or its consumer gone) shows its lag growing instead of a frozen 0.
    pub lag_sample_interval: Duration,
    /// Tries at sending one dead letter (with the batch backoff in between) before it is
    /// given up: logged, counted in `engram_projector_dead_letters_dropped_total`, and
    /// skipped. The event itself stays in the events stream; a dead-letter stream that cannot
    /// take it must not stop the read model.
    pub dead_letter_attempts: u32,
    /// Where the key that makes dead-letter message ids unguessable is kept
    /// (`<dir>/<projector>.dlq-key`), so ids stay the same across restarts and a dead letter
    /// sent again after a crash is still deduplicated. `None` uses the projection's
    /// [`Projection::state_dir`], and failing that a key for this process only.
    pub state_dir: Option<PathBuf>,
    /// The durable consumer's name; `None` uses the projection's name. Replicas of one
    /// projector each read the whole stream, so each has a consumer of its own
    /// (`<projector>-<replica>`): sharing one would split the stream between them.
    pub consumer: Option<String>,
    /// Redacts secrets from every event before the model sees it, and from dead-letter
    /// copies: the second line behind the SDK's, for events raw clients publish. `None`
    /// applies events as stored.
    pub scrubbers: Option<engram_scrub::Scrubbers>,
    /// The stored subjects read (one partition's: [`engram_schema::partition_filter`]);
    /// `None` reads the whole stream. Stream order holds within it.
    pub filter: Option<String>,
    /// This instance's name in metrics, logs, errors and the snapshot store (`vector-p3`,
    /// one partition's vector model); `None` uses the projection's name. Dead letters keep
    /// the projection's name: they are found by model.
    pub instance: Option<&'static str>,
}

impl Default for ProjectorSettings {
    fn default() -> Self {
        Self {
            batch: 512,
            checkpoint_interval: Duration::from_secs(5),
            checkpoint_every: 50_000,
            max_backoff: Duration::from_secs(10),
            publish_interval: Duration::ZERO,
            tail_publish_gap: Duration::ZERO,
            lag_sample_interval: Duration::from_secs(5),
            dead_letter_attempts: 10,
            state_dir: None,
            consumer: None,
            scrubbers: None,
            filter: None,
            instance: None,
        }
    }
}

/// The sequence up to which a projector's effects are visible to queries, and the ledger of
/// what it has applied.
#[derive(Clone, Debug)]
pub struct Visibility {
    projector: &'static str,
    rx: watch::Receiver<Seq>,
    ledger: watch::Receiver<ApplyLedger>,
}

/// Why a read-your-writes wait gave up. Never answered with stale data instead.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error(
    "projector {projector} has applied up to seq {visible}, not yet {wanted}, after waiting {waited:?}; retry, or raise the wait (a growing gap means the projector is behind: see engram_projector_lag_events)"
)]
pub struct NotYetVisible {
    pub projector: &'static str,
    pub wanted: Seq,
    pub visible: Seq,
    pub waited: Duration,
}

impl Visibility {
    pub fn projector(&self) -> &'static str {
        self.projector
    }

    pub fn current(&self) -> Seq {
        *self.rx.borrow()
    }

    /// The ledger of everything applied so far. Its `seq` may be ahead of
    /// [`current`](Self::current) while a batch is applied but not yet published; read
    /// `current` first and the ledger after, and `ledger().seq >= current` holds (the ledger
    /// moves before visibility does, and neither moves back outside a rebuild).
    pub fn ledger(&self) -> ApplyLedger {
        *self.ledger.borrow()
    }

    /// Waits until `min_seq` is visible, at most `timeout`.
    pub async fn wait_for(&self, min_seq: Seq, timeout: Duration) -> Result<(), NotYetVisible> {
        if self.current() >= min_seq {
            return Ok(());
        }
        let start = Instant::now();
        let mut rx = self.rx.clone();
        match tokio::time::timeout(timeout, rx.wait_for(|seq| *seq >= min_seq)).await {
            Ok(Ok(_)) => Ok(()),
            // Timed out, or the projector stopped (the sender dropped).
            _ => Err(NotYetVisible {
                projector: self.projector,
                wanted: min_seq,
                visible: self.current(),
                waited: start.elapsed(),
            }),
        }
    }
}

/// A snapshot cut by the loop: the model's exported state and the ledger it holds.
#[derive(Clone, Debug)]
pub struct Cut {
    pub ledger: ApplyLedger,
    pub bytes: Vec<u8>,
    /// The model's state hash at the cut.
    pub state_hash: [u8; 32],
}

/// What the loop is asked to do between batches.
#[derive(Debug)]
enum LoopRequest {
    Cut(tokio::sync::oneshot::Sender<Result<Cut, ProjectionError>>),
    Erase {
        keys: Vec<engram_memory::ScopeKey>,
        reply: tokio::sync::oneshot::Sender<Result<u64, ProjectionError>>,
    },
}

/// Asks a running projector's loop for a [`Cut`], or an erasure. The loop does either
/// between batches, after publishing, so a cut holds exactly the events its ledger counts
/// and an erasure is checkpointed before it is answered.
#[derive(Clone, Debug)]
pub struct Cutter {
    projector: &'static str,
    tx: tokio::sync::mpsc::Sender<LoopRequest>,
}

impl Cutter {
    pub fn projector(&self) -> &'static str {
        self.projector
    }

    /// A cut of the model as it is now. Fails when the loop has stopped, or the model
    /// cannot export itself.
    pub async fn cut(&self) -> Result<Cut, ProjectionError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let stopped = || {
            ProjectionError::Transient(format!(
                "projector {} is not running; start it to cut a snapshot",
                self.projector
            ))
        };
        self.tx
            .send(LoopRequest::Cut(reply))
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// Erases the scopes `keys` from the model and checkpoints; returns the items removed.
    /// Fails when the loop has stopped: an erasure must then be run again.
    pub async fn erase(&self, keys: Vec<engram_memory::ScopeKey>) -> Result<u64, ProjectionError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let stopped = || {
            ProjectionError::Transient(format!(
                "projector {} is not running; start it, then erase again",
                self.projector
            ))
        };
        self.tx
            .send(LoopRequest::Erase { keys, reply })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

type CutRequests = tokio::sync::mpsc::Receiver<LoopRequest>;

/// Runs one projection against the stream.
pub struct Projector<P: Projection> {
    projection: Arc<P>,
    bus: Bus,
    settings: ProjectorSettings,
    visible: watch::Sender<Seq>,
    /// The loop's ledger, mirrored after every change for [`Visibility::ledger`].
    ledger: watch::Sender<ApplyLedger>,
    cuts: (Cutter, std::sync::Mutex<Option<CutRequests>>),
}

impl<P: Projection> Projector<P> {
    /// `bus` should be a connection of its own: a consumer sharing a connection with a
    /// saturating publisher can stall (nats.rs#1285).
    pub fn new(projection: Arc<P>, bus: Bus, settings: ProjectorSettings) -> Self {
        let (visible, _) = watch::channel(0);
        let (ledger, _) = watch::channel(ApplyLedger::default());
        let name = settings.instance.unwrap_or(projection.name());
        metrics::touch_projector(name);
        // A cut waits for the batch in hand; a few queued requests are plenty.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let cutter = Cutter {
            projector: name,
            tx,
        };
        Self {
            projection,
            bus,
            settings,
            visible,
            ledger,
            cuts: (cutter, std::sync::Mutex::new(Some(rx))),
        }
    }

    /// What this instance of the projection is called in metrics, logs, errors and
    /// snapshots: [`ProjectorSettings::instance`], or the projection's name.
    pub fn name(&self) -> &'static str {
        self.settings.instance.unwrap_or(self.projection.name())
    }

    /// The stored subjects this projector reads ([`ProjectorSettings::filter`]).
    fn filter(&self) -> &str {
        self.settings
            .filter
            .as_deref()
            .unwrap_or(engram_schema::STORED_SUBJECTS)
    }

    /// The durable consumer this projector reads with ([`ProjectorSettings::consumer`]).
    fn consumer(&self) -> &str {
        self.settings.consumer.as_deref().unwrap_or(self.name())
    }

    /// Asks this projector's loop ([`Projector::run`]) for snapshot cuts.
    pub fn cutter(&self) -> Cutter {
        self.cuts.0.clone()
    }

    pub fn visibility(&self) -> Visibility {
        Visibility {
            projector: self.name(),
            rx: self.visible.subscribe(),
            ledger: self.ledger.subscribe(),
        }
    }

    pub fn projection(&self) -> &Arc<P> {
        &self.projection
    }

    /// Restores the checkpoint and applies the stream until `shutdown` is cancelled, then
    /// checkpoints and returns. Bus outages are waited out; only a fatal projection error
    /// ends the loop early.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ProjectorError> {
        let restored =
            self.projection
                .restore()
                .await
                .map_err(|source| ProjectorError::Projection {
                    projector: self.name(),
                    source,
                })?;
        self.run_restored(restored, shutdown).await
    }

    /// Restores the checkpoint; then, when `newer` is a snapshot beyond it (checked first,
    /// and only if the stream still holds every event after it), loads that instead. Returns
    /// what the model holds now, for [`Projector::run_restored`]. What a memory node does as
    /// it takes a partition over: the newest snapshot plus the tail, never a full replay
    /// when a snapshot exists, and never a snapshot older than what it holds itself.
    pub async fn restore_or_import<F>(&self, newer: F) -> Result<ApplyLedger, ProjectorError>
    where
        F: AsyncFnOnce(Seq) -> Option<Vec<u8>>,
    {
        let name = self.name();
        let restored = match self.projection.restore().await {
            Ok(restored) => restored,
            Err(e) => {
                // A checkpoint that does not load (another embedding model, an old format)
                // is replaced by a snapshot when there is one, and is an error otherwise.
                let Some(snapshot) = newer(0).await else {
                    return Err(ProjectorError::Projection {
                        projector: name,
                        source: e,
                    });
                };
                tracing::info!(projector = name, error = %e, "discarding unusable checkpoint");
                return self.import_beyond(ApplyLedger::default(), &snapshot).await;
            }
        };
        match newer(restored.seq).await {
            Some(snapshot) => self.import_beyond(restored, &snapshot).await,
            None => Ok(restored),
        }
    }

    /// Loads `snapshot` if it holds more than `restored` and checks, with its tail still in
    /// the stream; else keeps `restored` (a snapshot that does not load leaves the model as
    /// it was, and the tail is replayed instead).
    async fn import_beyond(
        &self,
        restored: ApplyLedger,
        snapshot: &[u8],
    ) -> Result<ApplyLedger, ProjectorError> {
        let name = self.name();
        // The import decodes it whole before it replaces anything.
        let held = match snapshot::ledger(snapshot, "the snapshot", name) {
            Ok(held) if held.seq > restored.seq => held,
            Ok(_) => return Ok(restored),
            Err(e) => {
                tracing::warn!(projector = name, error = %e, "snapshot does not check; replaying instead");
                return Ok(restored);
            }
        };
        if let Err(e) = self.check_tail(held.seq).await {
            tracing::warn!(projector = name, error = %e, "snapshot's tail is gone; replaying instead");
            return Ok(restored);
        }
        match self.projection.import(snapshot).await {
            Ok(loaded) => {
                tracing::info!(
                    projector = name,
                    from = restored.seq,
                    to = loaded.seq,
                    "loaded a snapshot newer than the checkpoint"
                );
                Ok(loaded)
            }
            Err(e) => {
                tracing::warn!(projector = name, error = %e, "snapshot does not load; replaying instead");
                Ok(restored)
            }
        }
    }

    /// [`Projector::run`] for a model already restored to `restored` (by
    /// [`Projector::restore_or_import`]).
    pub async fn run_restored(
        self,
        restored: ApplyLedger,
        shutdown: CancellationToken,
    ) -> Result<(), ProjectorError> {
        let shutdown = shutdown.cancelled_owned();
        let name = self.name();
        // Every partition's instance restores: one with nothing saved is no news.
        if restored.seq > 0 {
            tracing::info!(
                projector = name,
                seq = restored.seq,
                events = restored.events,
                "projector restored checkpoint"
            );
        } else {
            tracing::debug!(projector = name, "projector starts empty");
        }
        let key = self.dead_letter_key()?;
        let mut state = LoopState::new(restored, key);
        self.ledger.send_replace(restored);
        self.publish_visible(&mut state);
        let _sampler = self.spawn_lag_sampler();
        let mut cuts = self.cuts.1.lock().unwrap_or_else(|p| p.into_inner()).take();
        tokio::pin!(shutdown);
        let mut backoff = Backoff::new(self.settings.max_backoff);
        'connect: loop {
            // Messages of a previous consumer cannot be acked on the new one.
            state.ack_point = None;
            let mut reader = tokio::select! {
                _ = &mut shutdown => break 'connect,
                reader = self.bus.durable_reader_of(self.consumer(), self.filter(), state.applied(), self.settings.batch) => match reader {
                    Ok(reader) => reader,
                    Err(e) => {
                        metrics::PROJECTOR_ERRORS.with_label_values(&[name, "bus"]).inc();
                        tracing::warn!(projector = name, error = %e, "cannot open consumer, retrying");
                        tokio::select! {
                            _ = &mut shutdown => break 'connect,
                            _ = backoff.wait() => continue 'connect,
                        }
                    }
                },
            };
            loop {
                let next = tokio::select! {
                    _ = &mut shutdown => break 'connect,
                    _ = tokio::time::sleep_until(state.publish_due(&self.settings)), if state.unpublished() => {
                        // A backlog stopped short of the tail (say, messages expired): publish
                        // what is applied instead of waiting for the next event.
                        if let Err(e) = self.publish(&mut state).await {
                            metrics::PROJECTOR_ERRORS.with_label_values(&[name, "publish"]).inc();
                            tracing::warn!(projector = name, error = %e, "publish failed, retrying");
                        }
                        continue;
                    }
                    _ = tokio::time::sleep(self.settings.checkpoint_interval.max(state.checkpoint_gap())), if state.unsaved() > 0 => {
                        // Idle with unsaved work: checkpoint now rather than on the next event.
                        self.checkpoint(&mut state).await?;
                        continue;
                    }
                    Some(request) = async { cuts.as_mut()?.recv().await }, if cuts.is_some() => {
                        match request {
                            LoopRequest::Cut(reply) => {
                                let cut = self.cut(&mut state).await;
                                if let Err(e) = &cut {
                                    tracing::warn!(projector = name, error = %e, "snapshot cut failed");
                                }
                                let _ = reply.send(cut);
                            }
                            LoopRequest::Erase { keys, reply } => {
                                let erased = self.erase(&mut state, &keys).await;
                                match &erased {
                                    Ok(n) => tracing::info!(projector = name, scopes = keys.len(), removed = n, "scopes erased"),
                                    Err(e) => tracing::warn!(projector = name, error = %e, "erasure failed"),
                                }
                                let _ = reply.send(erased);
                            }
                        }
                        continue;
                    }
                    next = reader.next_batch(self.settings.batch) => next,
                };
                let mut batch = match next {
                    Some(Ok(batch)) => batch,
                    Some(Err(e)) => {
                        metrics::PROJECTOR_ERRORS
                            .with_label_values(&[name, "bus"])
                            .inc();
                        tracing::warn!(projector = name, error = %e, "consumer failed, reopening");
                        continue 'connect;
                    }
                    None => continue 'connect,
                };
                self.count_redelivered(&batch);
                loop {
                    match self.apply_batch(&mut state, &batch).await {
                        Ok(()) => {
                            backoff.reset();
                            state.ack_point = batch.pop();
                            break;
                        }
                        Err(ProjectionError::Fatal(reason)) => {
                            return Err(ProjectorError::Projection {
                                projector: name,
                                source: ProjectionError::Fatal(reason),
                            });
                        }
                        Err(ProjectionError::Transient(reason)) => {
                            metrics::PROJECTOR_ERRORS
                                .with_label_values(&[name, "apply"])
                                .inc();
                            tracing::warn!(projector = name, error = %reason, "batch failed, retrying");
                            tokio::select! {
                                _ = &mut shutdown => break 'connect,
                                _ = backoff.wait() => {}
                            }
                        }
                    }
                }
                if state.checkpoint_due(&self.settings) {
                    self.checkpoint(&mut state).await?;
                }
            }
        }
        if state.unsaved() > 0 {
            self.checkpoint(&mut state).await?;
        }
        tracing::info!(projector = name, seq = state.applied(), "projector stopped");
        Ok(())
    }

    /// Empties the model and replays the whole stream into it, calling `progress(applied,
    /// target)` after each batch, until it has caught up; then checkpoints and returns the
    /// ledger saved. The projector must not be running elsewhere: its durable consumer is
    /// replaced.
    pub async fn rebuild(
        &self,
        progress: impl FnMut(Seq, Seq),
    ) -> Result<ApplyLedger, ProjectorError> {
        let name = self.name();
        // Restore first: it opens what the model keeps on disk, which reset then empties.
        // A checkpoint that cannot be restored (say, made with another embedding model) is
        // exactly what a rebuild replaces, so its failure is not fatal here.
        if let Err(e) = self.projection.restore().await {
            tracing::info!(projector = name, error = %e, "discarding unusable checkpoint");
        }
        self.projection
            .reset()
            .await
            .map_err(|source| ProjectorError::Projection {
                projector: name,
                source,
            })?;
        self.replay_from(ApplyLedger::default(), false, progress)
            .await
    }

    /// Loads an exported snapshot (checked first: a blob that does not check changes
    /// nothing), then replays the stream after its sequence until caught up, calling
    /// `progress` as [`Projector::rebuild`] does; returns the ledger reached. Checkpoints at
    /// the end unless the import is the checkpoint and the tail is shorter than
    /// [`ProjectorSettings::checkpoint_every`] (see [`Projection::import_is_checkpoint`]).
    /// The stream must still hold every event after the snapshot: a tail that retention has
    /// cut is an error before anything is loaded, never a gap.
    pub async fn bootstrap(
        &self,
        snapshot: &[u8],
        progress: impl FnMut(Seq, Seq),
    ) -> Result<ApplyLedger, ProjectorError> {
        let name = self.name();
        let projection_err = |source| ProjectorError::Projection {
            projector: name,
            source,
        };
        // The tail must be there before anything is replaced. The import decodes the blob
        // whole before it replaces anything, so the ledger is all read here.
        let held = snapshot::ledger(snapshot, "the snapshot", name).map_err(projection_err)?;
        self.check_tail(held.seq).await?;
        if let Err(e) = self.projection.restore().await {
            tracing::info!(projector = name, error = %e, "discarding unusable checkpoint");
        }
        let started = std::time::Instant::now();
        let loaded = self
            .projection
            .import(snapshot)
            .await
            .map_err(projection_err)?;
        let imported = started.elapsed();
        let durable = self.projection.import_is_checkpoint();
        let ledger = self.replay_from(loaded, durable, progress).await?;
        tracing::debug!(
            projector = name,
            seq = held.seq,
            bytes = snapshot.len(),
            import_ms = imported.as_millis() as u64,
            tail_ms = (started.elapsed() - imported).as_millis() as u64,
            tail_events = ledger.seq.saturating_sub(held.seq),
            "bootstrapped from a snapshot"
        );
        Ok(ledger)
    }

    /// Fails when the stream no longer holds every event after `seq` (retention removed
    /// some): replaying from there would skip them.
    pub async fn check_tail(&self, seq: Seq) -> Result<(), ProjectorError> {
        let name = self.name();
        let summary = self
            .bus
            .stream_state()
            .await
            .map_err(|source| ProjectorError::Bus {
                projector: name,
                source,
            })?;
        if summary.last_seq > seq && summary.first_seq > seq + 1 {
            return Err(ProjectorError::TailGone {
                projector: name,
                from: seq,
                first: summary.first_seq,
            });
        }
        Ok(())
    }

    /// Replays the stream after `from` into the model (which holds `from`), until caught up.
    /// `durable`: `from` is the model's checkpoint already.
    async fn replay_from(
        &self,
        from: ApplyLedger,
        durable: bool,
        mut progress: impl FnMut(Seq, Seq),
    ) -> Result<ApplyLedger, ProjectorError> {
        let name = self.name();
        let bus_err = |source| ProjectorError::Bus {
            projector: name,
            source,
        };
        let projection_err = |source| ProjectorError::Projection {
            projector: name,
            source,
        };
        self.check_tail(from.seq).await?;
        let mut target = self.bus.stream_state().await.map_err(bus_err)?.last_seq;
        // A partition's consumer delivers nothing when the partition has no event after
        // `from`, however far the stream has gone: there is nothing to wait for.
        if self.settings.filter.is_some()
            && target > from.seq
            && self
                .bus
                .leader_next_seq(self.filter(), from.seq + 1)
                .await
                .map_err(bus_err)?
                .is_none()
        {
            target = from.seq;
        }
        self.bus
            .delete_durable(self.consumer())
            .await
            .map_err(bus_err)?;
        let mut state = LoopState::new(from, self.dead_letter_key()?);
        self.ledger.send_replace(state.ledger);
        self.publish_visible(&mut state);
        if target > from.seq {
            let mut reader = self
                .bus
                .durable_reader_of(
                    self.consumer(),
                    self.filter(),
                    from.seq,
                    self.settings.batch,
                )
                .await
                .map_err(bus_err)?;
            loop {
                let mut batch = match reader.next_batch(self.settings.batch).await {
                    Some(Ok(batch)) => batch,
                    Some(Err(source)) => return Err(bus_err(source)),
                    None => {
                        return Err(bus_err(BusError::Unavailable(
                            "consumer ended during rebuild".into(),
                        )));
                    }
                };
                self.count_redelivered(&batch);
                self.apply_batch(&mut state, &batch)
                    .await
                    .map_err(projection_err)?;
                let caught_up = batch.last().is_some_and(|d| d.pending == 0);
                state.ack_point = batch.pop();
                progress(state.applied(), target.max(state.applied()));
                if state.unsaved() >= self.settings.checkpoint_every {
                    self.checkpoint(&mut state).await?;
                }
                if caught_up {
                    break;
                }
            }
        }
        if durable && state.unsaved() < self.settings.checkpoint_every {
            // The checkpoint holds `from` (an imported snapshot), and a restart replays the
            // few events after it, as it would for a running projector, rather than the
            // bootstrap saving the whole model a second time. Dead letters go now all the same.
            self.send_dead_letters(&mut state)
                .await
                .map_err(projection_err)?;
            if state.unpublished() && !self.projection.searchable_when_applied() {
                self.publish(&mut state).await.map_err(projection_err)?;
            }
            return Ok(state.ledger);
        }
        self.checkpoint(&mut state).await?;
        Ok(state.ledger)
    }

    /// An erasure: removes the scopes, then publishes and checkpoints, so that neither a
    /// query nor a restart sees what was removed.
    async fn erase(
        &self,
        state: &mut LoopState,
        keys: &[engram_memory::ScopeKey],
    ) -> Result<u64, ProjectionError> {
        let removed = self.projection.erase(keys).await?;
        self.projection.publish(&state.ledger).await?;
        self.checkpoint(state).await.map_err(|e| {
            ProjectionError::Transient(format!("erased, but the checkpoint failed: {e}"))
        })?;
        Ok(removed)
    }

    /// A snapshot cut: publishes what is applied (dead letters first), then exports.
    async fn cut(&self, state: &mut LoopState) -> Result<Cut, ProjectionError> {
        if state.unpublished() {
            self.publish(state).await?;
        }
        self.send_dead_letters(state).await?;
        let mut ledger = state.ledger;
        if self.settings.filter.is_some() {
            ledger.seq = self.complete_through(ledger.seq).await?;
        }
        let bytes = self.projection.export(&ledger).await?.ok_or_else(|| {
            ProjectionError::Fatal(format!(
                "projector {} cannot export snapshots; its replicas rebuild from the stream",
                self.name()
            ))
        })?;
        let state_hash = self.projection.state_hash().await;
        Ok(Cut {
            ledger,
            bytes,
            state_hash,
        })
    }

    /// For a partition's projector that has applied everything of its partition up to
    /// `seq`: the furthest sequence up to which that still holds, because the partition has
    /// no event after `seq` below it. A snapshot then says it covers the stream up to there,
    /// so an idle partition's snapshot is not refused as older than what retention kept
    /// while nothing of the partition was removed.
    async fn complete_through(&self, seq: Seq) -> Result<Seq, ProjectionError> {
        let unavailable = |e: BusError| ProjectionError::Transient(e.to_string());
        // The head first: when the partition has nothing after `seq` at the next ask, it had
        // nothing up to this head either.
        let last = self.bus.stream_state().await.map_err(unavailable)?.last_seq;
        if last <= seq {
            return Ok(seq);
        }
        let next = self
            .bus
            .leader_next_seq(self.filter(), seq + 1)
            .await
            .map_err(unavailable)?;
        // Every sequence below a stored message's is taken, so none of the partition lies
        // between `seq` and its next event.
        Ok(next.map_or(last, |n| n.saturating_sub(1)).max(seq))
    }

    /// Applies one delivered batch (skipping what the model already has, dead-lettering
    /// poison), then publishes if the batch reached the tail of the stream and the tail gap
    /// has passed, or the publish interval has passed. On `Err` the batch is retried with the same `state`: what was
    /// applied is skipped and only the dead letters and the publish are tried again.
    async fn apply_batch(
        &self,
        state: &mut LoopState,
        batch: &[Delivery],
    ) -> Result<(), ProjectionError> {
        self.apply_fresh(state, batch).await?;
        if self.projection.searchable_when_applied() {
            self.publish_visible(state);
        }
        state.caught_up = batch.last().is_some_and(|d| d.pending == 0);
        if state.unpublished() && state.last_publish.elapsed() >= state.publish_gap(&self.settings)
        {
            self.publish(state).await?;
        }
        Ok(())
    }

    /// Makes everything applied visible to queries.
    async fn publish(&self, state: &mut LoopState) -> Result<(), ProjectionError> {
        // A durable publish (tantivy's commit) past an unsent dead letter would lose it.
        self.send_dead_letters(state).await?;
        self.projection.publish(&state.ledger).await?;
        state.published = state.applied();
        state.last_publish = Instant::now();
        self.publish_visible(state);
        Ok(())
    }

    /// The apply half of [`apply_batch`](Self::apply_batch). Once the model has taken the
    /// batch, `state` (ledger included) moves with it even if dead-lettering then fails: the
    /// model would skip the batch on a retry, so only the dead letters are tried again. Had
    /// `state` stayed behind, the retry would count the rejected events as applied, and a
    /// checkpoint would label the model's state with a sequence older than it holds.
    async fn apply_fresh(
        &self,
        state: &mut LoopState,
        batch: &[Delivery],
    ) -> Result<(), ProjectionError> {
        self.send_dead_letters(state).await?;
        let name = self.name();
        let started = Instant::now();
        let fresh: Vec<&Delivery> = batch.iter().filter(|d| d.seq > state.applied()).collect();
        let Some(last) = fresh.last() else {
            return Ok(());
        };
        let last_seq = last.seq;

        let mut events = Vec::with_capacity(fresh.len());
        // Beside each event: its redacted copy, what its dead letter carries if the model
        // refuses it (screened once, not again for the letter).
        let mut redacted = Vec::with_capacity(fresh.len());
        let mut poison: Vec<(&Delivery, String, Option<Redacted>)> = Vec::new();
        for delivery in &fresh {
            match &delivery.event {
                Ok(event) => match self.screened(event) {
                    Ok(screened) => {
                        events.push(screened.event);
                        redacted.push(screened.redacted);
                    }
                    Err((reason, copy)) => poison.push((delivery, reason, copy)),
                },
                Err(e) => poison.push((delivery, e.to_string(), None)),
            }
        }
        // On the apply pool, not this runtime's workers: see `pool`.
        let projection = self.projection.clone();
        let span = tracing::Span::current();
        let (events, rejected) = pool::run(
            async move {
                let rejected = projection.apply(&events).await;
                (events, rejected)
            }
            .instrument(span),
        )
        .await;
        let rejected = rejected?;
        let mut refused = vec![false; events.len()];
        for r in &rejected {
            match refused.get_mut(r.index) {
                // Out of range, or reported twice: nothing more to dead-letter.
                None | Some(true) => continue,
                Some(flag) => *flag = true,
            }
            let delivery = fresh
                .iter()
                .find(|d| d.seq == events[r.index].seq)
                .expect("every applied event came from the batch");
            poison.push((delivery, r.reason.clone(), redacted[r.index].take()));
        }
        let mut ledger = state.ledger;
        for (stored, _) in events
            .iter()
            .zip(&refused)
            .filter(|(_, refused)| !**refused)
        {
            ledger.add(stored.seq, stored.event.event_id.as_str());
            let stored_at = SystemTime::from(stored.stored_at);
            if stored_at >= state.started {
                state.becoming_visible.push(stored_at);
            }
        }
        let applied_count = ledger.events - state.ledger.events;
        // A batch ending in poison still moves the sequence past it.
        ledger.seq = last_seq;
        state.ledger = ledger;
        state.events_since_checkpoint += fresh.len() as u64;
        state.dead_letters.extend(
            poison
                .into_iter()
                .map(|(delivery, reason, copy)| DeadLetter {
                    seq: delivery.seq,
                    subject: delivery.subject().to_owned(),
                    payload: self.dead_letter_payload(delivery, copy),
                    reason,
                    attempts: 0,
                }),
        );
        self.ledger.send_replace(ledger);
        metrics::PROJECTOR_APPLIED
            .with_label_values(&[name])
            .inc_by(applied_count);
        metrics::PROJECTOR_BATCH_SECONDS
            .with_label_values(&[name])
            .observe(started.elapsed().as_secs_f64());
        self.send_dead_letters(state).await
    }

    /// `event` as the model may see it: with its secrets redacted by its tenant's policy
    /// (counted under this projector's name), or as stored when nothing is redacted. The
    /// changes of a `doc_changed` event are decoded only for a model that applies them
    /// ([`Projection::applies_doc_changes`]), and then once: that one decode finds their
    /// secrets, refuses the event if they do not decode (`Err`: the reason the model would
    /// give, which the event is dead-lettered with, and its redacted copy if any), and the
    /// model gets them uncompressed, so that its parse inflates nothing.
    fn screened(&self, event: &StoredEvent) -> Result<Screened, (String, Option<Redacted>)> {
        let Some(scrubbers) = &self.settings.scrubbers else {
            // Nothing decodes the changes here: the model's own parse is their one decode.
            return Ok(Screened {
                event: event.clone(),
                redacted: None,
            });
        };
        let decoded = (event.event.kind == EventKind::DocChanged
            && self.projection.applies_doc_changes())
        .then(|| DocChanged::from_event(&event.event));
        let docs = match &decoded {
            Some(Ok((_, changes))) => DocChanges::Decoded(changes),
            // A change that does not decode writes no readable strings.
            Some(Err(_)) | None => DocChanges::Leave,
        };
        let redacted = scrubbers
            .scrubbed_with(&event.event, docs)
            .map(|(clean, kinds)| {
                let name = self.name();
                for kind in &kinds {
                    metrics::SCRUB_REDACTIONS
                        .with_label_values(&[kind.as_str(), name])
                        .inc();
                }
                tracing::warn!(
                    projector = name,
                    seq = event.seq,
                    redactions = kinds.len(),
                    "secrets redacted from a raw event before it was applied"
                );
                Redacted {
                    clean: Box::new(clean),
                    kinds,
                }
            });
        let seen = redacted.as_ref().map_or(&event.event, |r| &*r.clean);
        let model_event = match decoded {
            None => seen.clone(),
            Some(Ok((_, changes))) => {
                DocChanged::uncompressed(seen, &changes).unwrap_or_else(|| seen.clone())
            }
            Some(Err(e)) => return Err((e.to_string(), redacted)),
        };
        Ok(Screened {
            event: StoredEvent {
                event: model_event,
                ..event.clone()
            },
            redacted,
        })
    }

    /// The bytes a dead letter carries: the stored message, unless secrets must be redacted
    /// from it. An event is encoded again with its secrets redacted, as it was screened
    /// (`redacted`); a message that does not decode as an event is redacted as text (it is
    /// kept for inspection, and was no event to begin with).
    fn dead_letter_payload(&self, delivery: &Delivery, redacted: Option<Redacted>) -> Vec<u8> {
        let raw = delivery.payload();
        let Some(scrubbers) = &self.settings.scrubbers else {
            return raw.to_vec();
        };
        let count = |kinds: &[engram_scrub::Kind]| {
            for kind in kinds {
                metrics::SCRUB_REDACTIONS
                    .with_label_values(&[kind.as_str(), "dead_letter"])
                    .inc();
            }
        };
        if delivery.event.is_ok() {
            // Screened already: scrubbing it again would decode its document changes again.
            return match redacted {
                None => raw.to_vec(),
                Some(Redacted { clean, kinds }) => {
                    count(&kinds);
                    rmp_serde::to_vec_named(&clean).unwrap_or_default()
                }
            };
        }
        // Not decoded as data first: a poison message may nest without bound, and a
        // recursive decoder would overflow the stack on it. Strings are stored as UTF-8 in
        // MessagePack, so the secrets are found in the bytes read as text.
        let scrubber = scrubbers.for_tenant("");
        let text = String::from_utf8_lossy(raw);
        let out = scrubber.scrub(&text);
        if out.is_clean() {
            return raw.to_vec();
        }
        count(&out.redactions.iter().map(|r| r.kind).collect::<Vec<_>>());
        out.text.into_owned().into_bytes()
    }

    /// Sends the dead letters of applied batches, oldest first. The stream deduplicates them
    /// by message id, a keyed hash of projector and sequence, so one sent twice across a
    /// retry is stored once. A letter that fails [`ProjectorSettings::dead_letter_attempts`]
    /// times is dropped (logged and counted): the dead-letter stream is for inspection, and
    /// waiting on it forever would stall the read model.
    async fn send_dead_letters(&self, state: &mut LoopState) -> Result<(), ProjectionError> {
        let name = self.projection.name();
        while let Some(letter) = state.dead_letters.front_mut() {
            let msg_id = dead_letter_id(&state.dead_letter_key, name, letter.seq);
            let sent = self
                .bus
                .dead_letter(
                    name,
                    letter.seq,
                    &msg_id,
                    &letter.subject,
                    &letter.payload,
                    &letter.reason,
                )
                .await;
            match sent {
                Ok(()) => {
                    metrics::PROJECTOR_DEAD_LETTERED
                        .with_label_values(&[name])
                        .inc();
                    tracing::warn!(projector = name, seq = letter.seq, reason = %letter.reason, "event dead-lettered and skipped");
                }
                Err(e) => {
                    letter.attempts += 1;
                    if letter.attempts < self.settings.dead_letter_attempts.max(1) {
                        return Err(ProjectionError::Transient(format!(
                            "dead-lettering seq {} failed (try {} of {}): {e}",
                            letter.seq, letter.attempts, self.settings.dead_letter_attempts
                        )));
                    }
                    metrics::PROJECTOR_DEAD_LETTERS_DROPPED
                        .with_label_values(&[name])
                        .inc();
                    tracing::error!(
                        projector = name,
                        seq = letter.seq,
                        subject = %letter.subject,
                        attempts = letter.attempts,
                        reason = %letter.reason,
                        error = %e,
                        "dead letter dropped: the dead-letter stream did not take it; the event is skipped and stays in the events stream at this seq"
                    );
                }
            }
            state.dead_letters.pop_front();
        }
        Ok(())
    }

    /// The dead-letter id key: kept in the state directory, or made up for this process.
    fn dead_letter_key(&self) -> Result<[u8; 32], ProjectorError> {
        let name = self.projection.name();
        let dir = self.settings.state_dir.as_deref();
        let Some(dir) = dir.or_else(|| self.projection.state_dir()) else {
            return Ok(rand::random());
        };
        load_or_create_key(dir, name).map_err(|source| ProjectorError::Projection {
            projector: name,
            source,
        })
    }

    /// Measures the lag every [`ProjectorSettings::lag_sample_interval`] until dropped.
    fn spawn_lag_sampler(&self) -> AbortOnDrop {
        let (bus, name, visible) = (self.bus.clone(), self.name(), self.visible.subscribe());
        let filter = self.settings.filter.clone();
        let interval = self
            .settings
            .lag_sample_interval
            .max(Duration::from_millis(10));
        AbortOnDrop(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let seen = *visible.borrow();
                // A partition's lag is its own events after the visible one; the stream's
                // last sequence would count every other partition's too.
                let lag = match &filter {
                    Some(filter) => bus
                        .direct_batch(filter, seen + 1, 1, 1)
                        .await
                        .map(|b| b.items.len() as u64 + b.pending),
                    None => bus
                        .stream_last_seq()
                        .await
                        .map(|last| last.saturating_sub(seen)),
                };
                match lag {
                    Ok(lag) => {
                        metrics::PROJECTOR_LAG
                            .with_label_values(&[name])
                            .set(i64::try_from(lag).unwrap_or(i64::MAX));
                    }
                    // The loop reports bus trouble; the gauge keeps its last value.
                    Err(e) => {
                        tracing::debug!(projector = name, error = %e, "lag sample failed");
                    }
                }
            }
        }))
    }

    async fn checkpoint(&self, state: &mut LoopState) -> Result<(), ProjectorError> {
        let name = self.name();
        let started = Instant::now();
        if let Err(e) = self.send_dead_letters(state).await {
            // Only a shutdown in the middle of retrying a batch gets here. A checkpoint past
            // an unsent dead letter would skip that event for good; keeping the last one
            // means a restart replays and rejects it again.
            tracing::warn!(projector = name, seq = state.applied(), error = %e, "checkpoint skipped: dead letters not sent");
            return Ok(());
        }
        if state.unpublished() {
            // A checkpoint never holds more than queries can see, so a restart cannot make
            // visible what was never published (and for tantivy the publish is the
            // checkpoint).
            self.publish(state)
                .await
                .map_err(|source| ProjectorError::Projection {
                    projector: name,
                    source,
                })?;
        }
        self.projection
            .checkpoint(&state.ledger)
            .await
            .map_err(|source| {
                metrics::PROJECTOR_ERRORS
                    .with_label_values(&[name, "checkpoint"])
                    .inc();
                ProjectorError::Projection {
                    projector: name,
                    source,
                }
            })?;
        metrics::PROJECTOR_CHECKPOINT_SECONDS
            .with_label_values(&[name])
            .observe(started.elapsed().as_secs_f64());
        tracing::debug!(
            projector = name,
            seq = state.applied(),
            events = state.ledger.events,
            "checkpoint saved"
        );
        // Only now may the server forget these messages. A failed ack is harmless: a restart
        // repositions the consumer from the checkpoint anyway.
        if let Some(point) = state.ack_point.take()
            && let Err(e) = point.ack_through().await
        {
            tracing::debug!(projector = name, error = %e, "ack after checkpoint failed");
        }
        state.events_since_checkpoint = 0;
        state.last_checkpoint = Instant::now();
        state.last_checkpoint_took = started.elapsed();
        Ok(())
    }

    /// Makes everything applied visible to queries' waits, and measures how long the events
    /// that became visible waited since the stream stored them.
    fn publish_visible(&self, state: &mut LoopState) {
        let seq = state.applied();
        metrics::PROJECTOR_VISIBLE_SEQ
            .with_label_values(&[self.name()])
            .set(seq as i64);
        self.visible.send_replace(seq);
        if state.becoming_visible.is_empty() {
            // No series for an instance that has shown nothing new since it started.
            return;
        }
        // Every event, not only a batch's last: a read-your-writes wait is an event's, and
        // under a backlog the first events of a batch waited longest; the last one would show
        // the newest event's wait and hide the backlog. An observation is a few atomic adds.
        let now = SystemTime::now();
        let seconds = metrics::PROJECTOR_VISIBILITY_SECONDS.with_label_values(&[self.name()]);
        for stored_at in state.becoming_visible.drain(..) {
            seconds.observe(
                now.duration_since(stored_at)
                    .unwrap_or_default()
                    .as_secs_f64(),
            );
        }
    }

    /// Counts the messages of a batch that JetStream had delivered before. Counted as they
    /// arrive, not as they are applied, so that a batch retried after a failure counts once.
    fn count_redelivered(&self, batch: &[Delivery]) {
        let again = batch.iter().filter(|d| d.delivered > 1).count() as u64;
        if again > 0 {
            metrics::PROJECTOR_REDELIVERED
                .with_label_values(&[self.name()])
                .inc_by(again);
        }
    }
}

struct LoopState {
    /// What the model's state includes: its sequence, and the events applied to it.
    ledger: ApplyLedger,
    /// Keys [`dead_letter_id`]; fixed for the projector's state directory.
    dead_letter_key: [u8; 32],
    /// Events the model rejected (or that do not decode), applied in the sense that the
    /// sequence has moved past them, still to be sent to the dead-letter stream.
    dead_letters: VecDeque<DeadLetter>,
    events_since_checkpoint: u64,
    last_checkpoint: Instant,
    last_checkpoint_took: Duration,
    /// The last message delivered; acked (with everything before it) after a checkpoint.
    ack_point: Option<Delivery>,
    /// The sequence queries can see.
    published: Seq,
    last_publish: Instant,
    /// Whether the last batch reached the tail of the stream.
    caught_up: bool,
    /// When this loop started: of the events it applies, those stored since are measured in
    /// `engram_projector_visibility_seconds`; older ones are a backlog from before it ran.
    started: SystemTime,
    /// When the stream stored each applied event that queries cannot see yet (of those
    /// measured); emptied whenever visibility moves. That is after every batch for models
    /// that publish each, and for the keyword index, searchable as it applies; a model with
    /// a publish interval holds what it applies in one, and never more than a checkpoint's
    /// worth, since a checkpoint publishes.
    becoming_visible: Vec<SystemTime>,
}

/// A poison message waiting to be dead-lettered, owned so that it outlives its batch.
/// An event as [`Projector::screened`] hands it to the model.
struct Screened {
    event: StoredEvent,
    /// Its redacted copy, when secrets were taken out of it.
    redacted: Option<Redacted>,
}

/// An event with its secrets redacted, and the kinds redacted.
struct Redacted {
    clean: Box<engram_schema::Envelope>,
    kinds: Vec<engram_scrub::Kind>,
}

struct DeadLetter {
    seq: Seq,
    subject: String,
    payload: Vec<u8>,
    reason: String,
    /// Failed tries at sending it.
    attempts: u32,
}

/// The `Nats-Msg-Id` of `projector`'s dead letter for `seq`: the same on every try (so the
/// stream deduplicates a resend), and not computable without the key (so a client cannot
/// publish it first and have the real dead letter dropped as a duplicate).
pub fn dead_letter_id(key: &[u8; 32], projector: &str, seq: Seq) -> String {
    let mut hasher = blake3::Hasher::new_keyed(key);
    hasher.update(projector.as_bytes());
    hasher.update(&[0]);
    hasher.update(&seq.to_le_bytes());
    format!("dlq-{}", &hasher.finalize().to_hex()[..32])
}

/// Reads `<dir>/<projector>.dlq-key`, creating it with 32 random bytes the first time.
fn load_or_create_key(dir: &Path, projector: &str) -> Result<[u8; 32], ProjectionError> {
    let path = dir.join(format!("{projector}.dlq-key"));
    match std::fs::read(&path) {
        Ok(bytes) => bytes.try_into().map_err(|_| {
            ProjectionError::Fatal(format!(
                "dead-letter key {} is not 32 bytes; delete it and a new one is made",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key: [u8; 32] = rand::random();
            let io_err = |e: std::io::Error| {
                ProjectionError::Fatal(format!(
                    "cannot write dead-letter key {}: {e}; check the state directory's permissions",
                    path.display()
                ))
            };
            std::fs::create_dir_all(dir).map_err(io_err)?;
            // Written aside and renamed, so a crash never leaves a short key behind.
            let tmp = dir.join(format!("{projector}.dlq-key.tmp"));
            std::fs::write(&tmp, key).map_err(io_err)?;
            std::fs::rename(&tmp, &path).map_err(io_err)?;
            Ok(key)
        }
        Err(e) => Err(ProjectionError::Fatal(format!(
            "cannot read dead-letter key {}: {e}; check the state directory's permissions",
            path.display()
        ))),
    }
}

/// Aborts a background task when its owner is done with it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl LoopState {
    fn new(restored: ApplyLedger, dead_letter_key: [u8; 32]) -> Self {
        Self {
            ledger: restored,
            dead_letter_key,
            dead_letters: VecDeque::new(),
            events_since_checkpoint: 0,
            last_checkpoint: Instant::now(),
            last_checkpoint_took: Duration::ZERO,
            ack_point: None,
            published: restored.seq,
            last_publish: Instant::now(),
            caught_up: false,
            started: SystemTime::now(),
            becoming_visible: Vec::new(),
        }
    }

    /// The sequence the model's state includes.
    fn applied(&self) -> Seq {
        self.ledger.seq
    }

    fn unsaved(&self) -> u64 {
        self.events_since_checkpoint
    }

    /// The least time between checkpoints, from what the last one cost.
    fn checkpoint_gap(&self) -> Duration {
        self.last_checkpoint_took * CHECKPOINT_COST_FACTOR
    }

    fn checkpoint_due(&self, settings: &ProjectorSettings) -> bool {
        let since = self.last_checkpoint.elapsed();
        since >= self.checkpoint_gap()
            && (self.unsaved() >= settings.checkpoint_every
                || since >= settings.checkpoint_interval)
    }

    fn unpublished(&self) -> bool {
        self.published < self.applied()
    }

    /// How long after the last publish the next may be: short at the tail, long in a backlog.
    fn publish_gap(&self, settings: &ProjectorSettings) -> Duration {
        if self.caught_up {
            settings.tail_publish_gap.min(settings.publish_interval)
        } else {
            settings.publish_interval
        }
    }

    fn publish_due(&self, settings: &ProjectorSettings) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.last_publish + self.publish_gap(settings))
    }
}

/// Exponential backoff with a cap, for retrying a failing batch or reconnecting.
struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new(max: Duration) -> Self {
        Self {
            next: Duration::from_millis(50),
            max,
        }
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(self.max);
    }

    fn reset(&mut self) {
        self.next = Duration::from_millis(50);
    }
}

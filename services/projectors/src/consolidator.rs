//! The consolidator: a read model of every scope's memories (`engram-consolidate`), the
//! plans it answers at `engram.p.consolidator.plan`, and its scheduled runs, which append
//! those plans.
//!
//! Outputs carry ids derived from their inputs, so two replicas running the same schedule
//! append the same events and the stream stores each once; the model then knows them and
//! plans them no more.
//!
//! Both paths plan synchronously, then [`refine()`] the plan: with an LLM summariser
//! configured (`[projectors.consolidator.summariser]`) it rewrites the session summaries
//! and adds candidate facts. A rewritten summary keeps its derived id, so replicas still
//! collide on one id and the stream stores one of their texts (see
//! [`engram_consolidate::refine`](mod@engram_consolidate::refine)).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use engram_bus::{Bus, StoredEvent};
use engram_consolidate::model::Origin;
use engram_consolidate::summariser::SummariserError;
use engram_consolidate::{
    Memories, Policy, RefineOptions, Summariser, SummariserConfig, Unrefined, plan_with, refine,
};
use engram_memory::proto::{
    Consistency, ConsolidateRequest, ConsolidateResponse, Neighbour, NeighboursRequest,
    NeighboursResponse,
};
use engram_memory::{ScopeKey, Seq};
use engram_projection_runtime::model::SnapshotProjection;
use engram_projection_runtime::{ApplyLedger, Projection, ProjectionError, Rejected, Visibility};
use engram_rpc::Failure;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const NAME: &str = engram_memory::proto::read_models::CONSOLIDATOR;

/// `[projectors.consolidator]` in engram.toml.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsolidatorConfig {
    /// How often every scope is consolidated (its plan appended); 0 only on demand
    /// (`engram consolidate`, SDK `consolidate`).
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Each partition of the stream is consolidated by the one replica holding its lease,
    /// which lives this long without renewal (renewed every third of it): a replica that
    /// dies is replaced within about this time.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    pub policy: Policy,
    /// Who writes session summaries: the extractive summariser (default), or an
    /// OpenAI-compatible chat endpoint, which also proposes candidate facts.
    pub summariser: SummariserConfig,
}

impl Default for ConsolidatorConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(5 * 60),
            lease_ttl: Duration::from_secs(15),
            policy: Policy::default(),
            summariser: SummariserConfig::default(),
        }
    }
}

impl ConsolidatorConfig {
    /// Checks what serde cannot; errors name the key under `consolidator`.
    pub fn validate(&self) -> Result<(), String> {
        self.policy.validate()?;
        self.summariser
            .validate()
            .map_err(|e| format!("consolidator.{e}"))
    }
}

/// How long an on-demand plan waits for the summariser: the SDK gives a consolidate call
/// 15 s of work beyond its read-your-writes wait, and the plan must reach it in time. A
/// summary not written by then keeps its extractive text.
const ON_DEMAND_SUMMARY_TIME: Duration = Duration::from_secs(10);

/// Neighbours asked per memory: near-duplicates chain through them into one group.
const NEIGHBOURS_PER_MEMORY: usize = 4;
/// Close pairs of one scope kept until a merge takes them (a plan cut short by
/// `max_events`, an append that failed); the oldest go first past this.
const MAX_PENDING_PAIRS: usize = 4_096;
/// How long a neighbours request may take, its read-your-writes wait included.
const NEIGHBOURS_TIMEOUT: Duration = Duration::from_secs(10);

/// The memories model, the policy its plans follow, and who writes their summaries.
pub struct Consolidator {
    memories: SnapshotProjection<Memories>,
    policy: Policy,
    /// Rewrites planned summaries and proposes candidate facts; the extractive summariser
    /// (which changes nothing) unless the config names another. Fixed at start.
    summariser: Arc<dyn Summariser>,
    refine: RefineOptions,
    /// Where the vector model is asked for close pairs; set when the loop starts (a
    /// rebuild or bootstrap, which plans nothing, has none).
    bus: OnceLock<Bus>,
    /// Per scope, what the vector model was asked about: runtime state only, since a plan
    /// never depends on what was asked before, only on the pairs given to it.
    asked: Mutex<HashMap<ScopeKey, Asked>>,
}

/// A scope's memories asked about up to `through`, and the close pairs found whose
/// memories were both still shown when last looked at.
#[derive(Default)]
struct Asked {
    through: Seq,
    pending: Vec<Neighbour>,
}

impl Consolidator {
    /// A consolidator whose model lives in `dir`.
    fn new(
        dir: &Path,
        policy: Policy,
        summariser: Arc<dyn Summariser>,
        refine: RefineOptions,
    ) -> Self {
        Self {
            memories: SnapshotProjection::new(NAME, dir),
            policy,
            summariser,
            refine,
            bus: OnceLock::new(),
            asked: Mutex::default(),
        }
    }

    /// The scopes of the model `wanted` picks.
    fn scopes(&self, wanted: impl Fn(&ScopeKey) -> bool) -> Vec<ScopeKey> {
        self.memories
            .read()
            .scopes()
            .filter(|s| wanted(s))
            .cloned()
            .collect()
    }

    /// The close pairs of each scope's memories, for dedup: the vector model is asked about
    /// the memories written since it was last asked (at most
    /// [`proto::limits::MAX_NEIGHBOUR_IDS`](engram_memory::proto::limits::MAX_NEIGHBOUR_IDS)
    /// per scope and run; the rest the next run), and the pairs found before that no merge
    /// has taken yet are offered again. A vector model that does not answer leaves dedup to
    /// MinHash for the run, and is asked the same again the next.
    async fn neighbours(&self, scopes: &[ScopeKey]) -> HashMap<ScopeKey, Vec<Neighbour>> {
        let mut out = HashMap::new();
        if self.policy.dedup_vector_similarity >= 1.0 {
            // Turned off (only identical vectors would count, which MinHash finds anyway).
            return out;
        }
        let Some(bus) = self.bus.get() else {
            return out;
        };
        for scope in scopes {
            let (ask, last, applied) = {
                let memories = self.memories.read();
                let Some(state) = memories.scope(scope) else {
                    continue;
                };
                let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
                let entry = asked.entry(scope.clone()).or_default();
                // Pairs a merge has taken (or that name a memory since hidden) are done.
                let shown = |id: &engram_schema::EventId| {
                    state.memory(id.as_str()).is_some_and(|m| !m.hidden)
                };
                entry.pending.retain(|p| shown(&p.a) && shown(&p.b));
                let ask: Vec<(Seq, engram_schema::EventId)> = state
                    .memories
                    .range(entry.through + 1..)
                    .filter(|(_, m)| {
                        !m.hidden && m.origin != Origin::Summary && m.signature.is_some()
                    })
                    .take(engram_memory::proto::limits::MAX_NEIGHBOUR_IDS)
                    .map(|(seq, m)| (*seq, m.event_id.clone()))
                    .collect();
                let last = ask.last().map(|(seq, _)| *seq);
                (ask, last, memories.applied_seq().unwrap_or(0))
            };
            if let Some(last) = last {
                let request = NeighboursRequest {
                    scope: scope.clone(),
                    event_ids: ask.into_iter().map(|(_, id)| id).collect(),
                    min_similarity: self.policy.dedup_vector_similarity as f32,
                    k: NEIGHBOURS_PER_MEMORY,
                    // The vector model must have indexed what this model holds, or the newest
                    // memories would be asked about before they have vectors.
                    consistency: Consistency {
                        min_seq: Some(applied),
                        wait_ms: Some(5_000),
                    },
                };
                let subject = engram_memory::proto::partition_subject(
                    engram_memory::proto::read_models::VECTOR,
                    engram_memory::proto::read_models::NEIGHBOURS_OP,
                    // The vector model of the scope's partition holds its vectors.
                    scope.partition(bus.config().stream.partitions),
                );
                match engram_rpc::call::<_, NeighboursResponse>(
                    bus.client(),
                    &subject,
                    &request,
                    NEIGHBOURS_TIMEOUT,
                )
                .await
                {
                    Ok(answer) => {
                        engram_telemetry::metrics::CONSOLIDATION_NEIGHBOUR_REQUESTS
                            .with_label_values(&["ok"])
                            .inc();
                        engram_telemetry::metrics::CONSOLIDATION_NEIGHBOUR_PAIRS
                            .inc_by(answer.pairs.len() as u64);
                        let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
                        let entry = asked.entry(scope.clone()).or_default();
                        entry.through = last;
                        entry.pending.extend(answer.pairs);
                        let over = entry.pending.len().saturating_sub(MAX_PENDING_PAIRS);
                        entry.pending.drain(..over);
                    }
                    Err(e) => {
                        engram_telemetry::metrics::CONSOLIDATION_NEIGHBOUR_REQUESTS
                            .with_label_values(&["failed"])
                            .inc();
                        tracing::debug!(scope = %scope.scope(), error = %e, "no close pairs from the vector model; dedup by minhash alone this run");
                    }
                }
            }
            let asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(entry) = asked.get(scope).filter(|e| !e.pending.is_empty()) {
                out.insert(scope.clone(), entry.pending.clone());
            }
        }
        out
    }

    /// The plans of `scopes`, at most `policy.max_events` events, with the source texts
    /// their refinement needs; `neighbours` are each scope's close pairs. Blocks: call it
    /// off the async runtime.
    fn plans(
        &self,
        scopes: &[ScopeKey],
        steps: &[&str],
        neighbours: &HashMap<ScopeKey, Vec<Neighbour>>,
    ) -> Unrefined {
        let memories = self.memories.read();
        let mut events = Vec::new();
        for scope in scopes {
            let pairs = neighbours.get(scope).map_or(&[][..], Vec::as_slice);
            events.extend(plan_with(&memories, scope, &self.policy, steps, pairs).events);
            if events.len() >= self.policy.max_events {
                events.truncate(self.policy.max_events);
                break;
            }
        }
        Unrefined::new(&memories, events, self.summariser.as_ref(), &self.refine)
    }

    /// `unrefined` with its summaries written by the summariser and its candidate facts;
    /// a summary whose call fails, or is still running at `deadline`, keeps its text.
    async fn refine(
        &self,
        unrefined: Unrefined,
        deadline: Option<tokio::time::Instant>,
    ) -> Vec<engram_schema::Envelope> {
        let options = RefineOptions {
            deadline,
            ..self.refine.clone()
        };
        refine(unrefined, self.summariser.as_ref(), &options).await
    }
}

#[async_trait]
impl Projection for Consolidator {
    fn name(&self) -> &'static str {
        NAME
    }
    fn state_dir(&self) -> Option<&Path> {
        self.memories.state_dir()
    }
    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        self.memories.restore().await
    }
    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        self.memories.apply(events).await
    }
    async fn checkpoint(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        self.memories.checkpoint(applied).await
    }
    async fn reset(&self) -> Result<(), ProjectionError> {
        self.memories.reset().await
    }
    async fn export(&self, applied: &ApplyLedger) -> Result<Option<Vec<u8>>, ProjectionError> {
        self.memories.export(applied).await
    }
    async fn import(&self, bytes: &[u8]) -> Result<ApplyLedger, ProjectionError> {
        self.memories.import(bytes).await
    }
    fn import_is_checkpoint(&self) -> bool {
        self.memories.import_is_checkpoint()
    }
    async fn state_hash(&self) -> [u8; 32] {
        self.memories.state_hash().await
    }
    async fn erase(&self, keys: &[ScopeKey]) -> Result<u64, ProjectionError> {
        // The close pairs kept for a scope name its memories: they go with it.
        {
            let mut asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
            for key in keys {
                asked.remove(key);
            }
        }
        self.memories.erase(keys).await
    }
    async fn traces(&self, keys: &[ScopeKey]) -> u64 {
        let pending: u64 = {
            let asked = self.asked.lock().unwrap_or_else(|p| p.into_inner());
            keys.iter()
                .filter_map(|k| asked.get(k))
                .map(|a| a.pending.len() as u64)
                .sum()
        };
        self.memories.traces(keys).await + pending
    }
}

/// The consolidator's summariser, at most `RefineOptions::concurrency` calls at once in
/// all: each plan is refined on its own (a scheduled run, and every on-demand plan beside
/// it), so a bound per plan alone would let their calls add up.
pub(crate) struct Bounded {
    inner: Arc<dyn Summariser>,
    /// One permit per call in flight; never closed.
    calls: tokio::sync::Semaphore,
}

#[async_trait]
impl Summariser for Bounded {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn refines_plan(&self) -> bool {
        self.inner.refines_plan()
    }

    async fn summarise(
        &self,
        texts: &[String],
    ) -> Result<engram_consolidate::summariser::SessionSummary, SummariserError> {
        // A caller's deadline covers the wait for a permit too (`RefineOptions::deadline`).
        let _permit = self
            .calls
            .acquire()
            .await
            .map_err(|_| SummariserError::Config("the summariser was shut down".into()))?;
        self.inner.summarise(texts).await
    }
}

/// The consolidator, as the registry runs it. It cuts no scope slices (no `slice`): an
/// instance starting from a snapshot keeps facts, skills and docs, never a consolidator
/// (`read_models::TABLE`).
pub struct ConsolidatorModel;

#[async_trait]
impl crate::ReadModel for ConsolidatorModel {
    const NAME: &'static str = NAME;
    const ENDPOINT: (&'static str, &'static str) =
        (engram_memory::proto::read_models::PLAN_OP, "consolidate");
    type Projection = Consolidator;
    type Request = ConsolidateRequest;
    type Response = ConsolidateResponse;

    async fn open(
        config: &crate::ProjectorsConfig,
        dir: &Path,
        shared: &crate::Shared,
    ) -> Result<Arc<Consolidator>, crate::StartError> {
        let consolidator = &config.consolidator;
        let refine = RefineOptions::of(&consolidator.summariser);
        // One summariser for every partition's consolidator: its bound on calls in flight
        // is the process's.
        let summariser = shared
            .summariser
            .get_or_try_init(|| async {
                Ok::<_, crate::StartError>(Arc::new(Bounded {
                    calls: tokio::sync::Semaphore::new(refine.concurrency.max(1)),
                    inner: consolidator.summariser.build()?,
                }))
            })
            .await?
            .clone();
        Ok(Arc::new(Consolidator::new(
            dir,
            consolidator.policy.clone(),
            summariser,
            refine,
        )))
    }

    async fn answer(
        projection: Arc<Consolidator>,
        request: ConsolidateRequest,
        visible: Seq,
    ) -> Result<ConsolidateResponse, Failure> {
        let scopes = request.scopes.resolve().map_err(Failure::invalid)?;
        let deadline = tokio::time::Instant::now() + ON_DEMAND_SUMMARY_TIME;
        let dedup = request.steps.is_empty() || request.steps.iter().any(|s| s == "dedup");
        let neighbours = if request.restore.is_empty() && dedup {
            projection.neighbours(&scopes[..1]).await
        } else {
            HashMap::new()
        };
        let planner = projection.clone();
        let unrefined = crate::off_runtime(move || {
            if !request.restore.is_empty() {
                let memories = planner.memories.read();
                let events =
                    engram_consolidate::restore(&memories, &scopes[0], &request.restore).events;
                return Ok(Unrefined::new(
                    &memories,
                    events,
                    planner.summariser.as_ref(),
                    &planner.refine,
                ));
            }
            let steps: Vec<&str> = request.steps.iter().map(String::as_str).collect();
            Ok(planner.plans(&scopes[..1], &steps, &neighbours))
        })
        .await?;
        Ok(ConsolidateResponse {
            events: projection.refine(unrefined, Some(deadline)).await,
            visible_seq: visible,
            results: Vec::new(),
        })
    }

    fn background(
        config: &crate::ProjectorsConfig,
        projection: Arc<Consolidator>,
        visibility: Visibility,
        bus: Bus,
        part: &crate::Part,
        stop: CancellationToken,
    ) -> Option<JoinHandle<()>> {
        let partition = part.index;
        let replica = config.replica.clone();
        let config = config.consolidator.clone();
        // On-demand plans ask the vector model too, scheduled or not.
        let _ = projection.bus.set(bus.clone());
        if config.interval.is_zero() {
            return None;
        }
        // Unique per process (a fresh v7 uuid), so a restarted replica is a new holder and
        // waits for its old leases to expire rather than renewing a dead process's.
        let holder = format!(
            "{}-{}",
            replica.map_or_else(|| "single".to_owned(), |r| r.to_string()),
            engram_schema::EventId::new()
        );
        Some(tokio::spawn(async move {
            let leases = loop {
                match engram_bus::Leases::open(&bus, LEASES, config.lease_ttl, holder.clone()).await
                {
                    Ok(leases) => break leases,
                    Err(e) => {
                        tracing::warn!(error = %e, "no lease bucket yet; consolidation waits");
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(config.lease_ttl / 3) => {}
                        }
                    }
                }
            };
            run_schedule(config, projection, visibility, bus, leases, partition, stop).await;
        }))
    }
}

/// The KV bucket of the consolidator's partition leases.
pub const LEASES: &str = "ENGRAM_LEASES";

/// The lease key of partition `p`.
pub fn lease_key(p: u32) -> String {
    format!("consolidator.p{p}")
}

/// Renews the lease of the instance's partition every third of its TTL, and every
/// `interval` while holding it appends the plans of the partition's scopes.
async fn run_schedule(
    config: ConsolidatorConfig,
    projection: Arc<Consolidator>,
    visibility: Visibility,
    bus: Bus,
    mut leases: engram_bus::Leases,
    partition: u32,
    stop: CancellationToken,
) {
    let mut renew = tokio::time::interval(config.lease_ttl / 3);
    let mut run = tokio::time::interval(config.interval);
    run.tick().await;
    let mut held = false;
    let mut last_run = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = renew.tick() => {
                if renew_lease(&mut leases, partition, &mut held).await {
                    // A partition just taken is consolidated at once: its last holder
                    // may have died with a run due.
                    last_run = None;
                }
                continue;
            }
            _ = run.tick() => {}
        }
        let seen = visibility.current();
        if last_run == Some(seen) || !held {
            continue;
        }
        let started = std::time::Instant::now();
        // The instance holds its partition's scopes only.
        let scopes = projection.scopes(|_| true);
        let neighbours = projection.neighbours(&scopes).await;
        let p = projection.clone();
        let Ok(unrefined) =
            tokio::task::spawn_blocking(move || p.plans(&scopes, &[], &neighbours)).await
        else {
            continue;
        };
        // An LLM summariser can take minutes here (calls of up to its timeout, a few at a
        // time). The leases are renewed meanwhile: expired mid-run, another replica would
        // take the partitions and redo the same scopes.
        let mut taken = false;
        let refining = projection.refine(unrefined, None);
        tokio::pin!(refining);
        let events = loop {
            tokio::select! {
                events = &mut refining => break events,
                _ = stop.cancelled() => return,
                _ = renew.tick() => taken |= renew_lease(&mut leases, partition, &mut held).await,
            }
        };
        let planned = events.len();
        let mut appended = 0;
        for result in bus.append_batch(&events, 256).await {
            match result {
                Ok(_) => appended += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "consolidation output not appended; planned again next run")
                }
            }
        }
        engram_telemetry::metrics::CONSOLIDATION_OUTPUTS
            .with_label_values(&["appended"])
            .inc_by(appended as u64);
        engram_telemetry::metrics::CONSOLIDATION_SECONDS.observe(started.elapsed().as_secs_f64());
        if planned > 0 {
            tracing::info!(
                planned,
                appended,
                took_ms = started.elapsed().as_millis() as u64,
                "consolidation run"
            );
        }
        // A partition taken during the run was not in it: the next tick runs again.
        last_run = (!taken).then_some(seen);
    }
}

/// Holds (takes or renews) the partition's lease; returns whether it was newly taken.
async fn renew_lease(leases: &mut engram_bus::Leases, partition: u32, held: &mut bool) -> bool {
    let now = leases.hold(&lease_key(partition)).await.unwrap_or(false);
    let taken = now && !*held;
    if taken {
        // One per partition at every start: detail, not news.
        tracing::debug!(
            partition,
            holder = leases.holder(),
            "consolidation partition taken"
        );
    }
    if now != *held {
        let change = if now { 1 } else { -1 };
        engram_telemetry::metrics::CONSOLIDATION_PARTITIONS_HELD.add(change);
    }
    *held = now;
    taken
}

//! The consolidator: a read model of every scope's memories (`engram-consolidate`), the
//! plans it answers at `engram.p.consolidator.plan`, and its scheduled runs, which append
//! those plans.
//!
//! Outputs carry ids derived from their inputs, so two replicas running the same schedule
//! append the same events and the stream stores each once; the model then knows them and
//! plans them no more.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use engram_bus::{Bus, StoredEvent};
use engram_consolidate::{Memories, Policy, plan};
use engram_memory::proto::{ConsolidateRequest, ConsolidateResponse};
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
    pub policy: Policy,
}

impl Default for ConsolidatorConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(5 * 60),
            policy: Policy::default(),
        }
    }
}

/// The memories model and the policy its plans follow.
pub struct Consolidator {
    memories: SnapshotProjection<Memories>,
    policy: Policy,
}

impl Consolidator {
    /// The plans of `scopes` (all scopes when `None`), at most `max` events.
    fn plans(&self, scopes: Option<&[ScopeKey]>, steps: &[&str]) -> Vec<engram_schema::Envelope> {
        let memories = self.memories.read();
        let all: Vec<ScopeKey> = match scopes {
            Some(s) => s.to_vec(),
            None => memories.scopes().cloned().collect(),
        };
        let mut events = Vec::new();
        for scope in &all {
            events.extend(plan(&memories, scope, &self.policy, steps).events);
            if events.len() >= self.policy.max_events {
                events.truncate(self.policy.max_events);
                break;
            }
        }
        events
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
    async fn state_hash(&self) -> [u8; 32] {
        self.memories.state_hash().await
    }
}

/// The consolidator, as the registry runs it.
pub struct ConsolidatorModel;

#[async_trait]
impl crate::ReadModel for ConsolidatorModel {
    const NAME: &'static str = NAME;
    const ENDPOINT: (&'static str, &'static str) = ("plan", "consolidate");
    type Projection = Consolidator;
    type Request = ConsolidateRequest;
    type Response = ConsolidateResponse;

    fn slice(snapshot: &[u8], keep: &[ScopeKey]) -> Result<Option<Vec<u8>>, String> {
        crate::registry::slice_of::<Memories>(snapshot, keep, NAME)
    }

    async fn open(
        config: &crate::ProjectorsConfig,
        dir: &Path,
    ) -> Result<Arc<Consolidator>, crate::StartError> {
        Ok(Arc::new(Consolidator {
            memories: SnapshotProjection::new(NAME, dir),
            policy: config.consolidator.policy.clone(),
        }))
    }

    async fn answer(
        projection: Arc<Consolidator>,
        request: ConsolidateRequest,
        visible: Seq,
    ) -> Result<ConsolidateResponse, Failure> {
        let scopes = request.scopes.resolve().map_err(Failure::invalid)?;
        crate::off_runtime(move || {
            let steps: Vec<&str> = request.steps.iter().map(String::as_str).collect();
            Ok(ConsolidateResponse {
                events: projection.plans(Some(&scopes[..1]), &steps),
                visible_seq: visible,
            })
        })
        .await
    }

    fn background(
        config: &crate::ProjectorsConfig,
        projection: Arc<Consolidator>,
        visibility: Visibility,
        bus: Bus,
        stop: CancellationToken,
    ) -> Option<JoinHandle<()>> {
        let interval = config.consolidator.interval;
        if interval.is_zero() {
            return None;
        }
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            let mut last_run = 0;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let seen = visibility.current();
                if seen == last_run {
                    continue;
                }
                let started = std::time::Instant::now();
                let p = projection.clone();
                let Ok(events) = tokio::task::spawn_blocking(move || p.plans(None, &[])).await
                else {
                    continue;
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
                engram_telemetry::metrics::CONSOLIDATION_SECONDS
                    .observe(started.elapsed().as_secs_f64());
                if planned > 0 {
                    tracing::info!(
                        planned,
                        appended,
                        took_ms = started.elapsed().as_millis() as u64,
                        "consolidation run"
                    );
                }
                last_run = seen;
            }
        }))
    }
}

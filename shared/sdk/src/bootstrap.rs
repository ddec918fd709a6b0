//! A new instance's memory of its scopes: the slice of each read model's newest snapshot
//! that its scopes may read, then the stream after the snapshot. It reaches the state a
//! replay of its scopes' whole history would, in a fraction of the reading.
//!
//! ```no_run
//! # async fn demo(client: engram_sdk::Client, scopes: engram_sdk::ScopeRequest) -> Result<(), Box<dyn std::error::Error>> {
//! let booted = client.bootstrap(&scopes, None).await?;
//! for (model, snapshot) in &booted.snapshots {
//!     println!("{model}: from snapshot {:?}", snapshot.as_ref().map(|s| s.version));
//! }
//! println!("{} tail events replayed; facts now: {}", booted.replayed, booted.memory.facts.len());
//! # Ok(()) }
//! ```

use base64::Engine as _;
use engram_bus::{BusError, ReadError, StartAt};
use engram_docs::DocStore;
use engram_facts::FactTable;
use engram_memory::model::{EventModel, Sliced};
use engram_memory::proto::{BootstrapRequest, BootstrapSnapshot, Consistency, read_models};
use engram_memory::{ScopeKey, Seq};
use engram_rpc::RpcError;
use engram_schema::{Ident, SubjectFilter};
use engram_skills::SkillRegistry;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use thiserror::Error;

use crate::{Client, ScopeRequest};

/// Most tail events one bootstrap holds before applying them in stream order.
pub const MAX_TAIL_EVENTS: usize = 2_000_000;

#[derive(Debug, Error)]
pub enum BootstrapError {
    #[error(transparent)]
    Rpc(#[from] RpcError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("scope: {0}")]
    Scope(String),
    #[error("the {model} slice does not load: {reason}")]
    Slice { model: String, reason: String },
    #[error(
        "the stream starts at seq {first}, but this bootstrap needs every event of its scopes after seq {from} (retention removed the rest); bootstrap again to use a newer snapshot"
    )]
    TailGone { from: Seq, first: Seq },
    #[error(
        "more than {MAX_TAIL_EVENTS} events to replay after the snapshots; cut a newer snapshot (`engram snapshot create`)"
    )]
    TailTooLong,
}

/// The read models of some scopes, held by one instance.
#[derive(Debug, Default)]
pub struct ScopeMemory {
    pub facts: FactTable,
    pub skills: SkillRegistry,
    pub docs: DocStore,
    /// Everything of these scopes up to this stream sequence is applied.
    pub through: Seq,
    /// Scopes a model's slice holds beyond its own sequence (a slice of several partitions,
    /// each cut at its own: [`engram_memory::proto::BootstrapResponse::held`]): their events
    /// at or below it are in the model already, and the tail skips them for that model.
    held: std::collections::BTreeMap<(usize, engram_memory::ScopeKey), Seq>,
}

impl ScopeMemory {
    /// One digest over the three models: equal for equal states, however they were built.
    pub fn state_hash(&self) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"engram-scope-memory/1");
        hasher.update(&self.facts.state_hash());
        hasher.update(&self.skills.state_hash());
        hasher.update(&self.docs.state_hash());
        *hasher.finalize().as_bytes()
    }

    /// Applies one event to each model that does not hold it yet; whether one did not. An
    /// event a model refuses is skipped, as its projector dead-letters it.
    fn apply(&mut self, seq: Seq, event: &engram_schema::Envelope) -> bool {
        let scope = engram_memory::ScopeKey::of(event);
        let fresh = |model: usize| {
            self.held
                .get(&(model, scope.clone()))
                .is_none_or(|held| seq > *held)
        };
        let (facts, skills, docs) = (fresh(FACTS), fresh(SKILLS), fresh(DOCS));
        if facts {
            let _ = self.facts.apply(seq, event);
        }
        if skills {
            let _ = self.skills.apply(seq, event);
        }
        if docs {
            let _ = self.docs.apply(seq, event);
        }
        facts || skills || docs
    }
}

/// The models' places in [`ScopeMemory`]'s `held`.
const FACTS: usize = 0;
const SKILLS: usize = 1;
const DOCS: usize = 2;

impl ScopeMemory {
    /// Records how far a model's slice holds each scope of `held`.
    fn hold(&mut self, model: usize, held: &[engram_memory::proto::ScopeHeld]) {
        for h in held {
            self.held.insert((model, h.scope.clone()), h.seq);
        }
    }
}

/// A finished bootstrap: the memory, and how it was built.
#[derive(Debug)]
pub struct Bootstrapped {
    pub memory: ScopeMemory,
    /// Each model and the snapshot its slice came from (`None`: replayed from the start).
    pub snapshots: Vec<(String, Option<BootstrapSnapshot>)>,
    /// Newer snapshots that did not check, and why.
    pub skipped: Vec<String>,
    /// Tail events read and applied.
    pub replayed: u64,
}

/// Scopes with at most this many events are bootstrapped by replaying them
/// ([`Client::bootstrap_with`]): in the load test, a bootstrap from snapshots of scopes of
/// about a hundred events took 3.8 times their replay.
pub const REPLAY_BELOW: u64 = 1_000;

fn decode<M: DeserializeOwned>(model: &str, bytes: &str) -> Result<(Seq, M), BootstrapError> {
    let bad = |reason: String| BootstrapError::Slice {
        model: model.to_owned(),
        reason,
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(bytes)
        .map_err(|e| bad(e.to_string()))?;
    let (ledger, state) =
        engram_projection_runtime::snapshot::decode::<M>(&bytes, "the slice", model)
            .map_err(|e| bad(e.to_string()))?;
    Ok((ledger.seq, state))
}

impl Client {
    /// Builds the memory of `scopes` from the newest good snapshot of each read model (at
    /// most `version`) and the stream after it. A model without a snapshot that checks is
    /// replayed from the start.
    pub async fn bootstrap(
        &self,
        scopes: &ScopeRequest,
        version: Option<Seq>,
    ) -> Result<Bootstrapped, BootstrapError> {
        self.bootstrap_with(scopes, version, REPLAY_BELOW).await
    }

    /// [`Client::bootstrap`], replaying scopes whose history holds at most `replay_below`
    /// events instead of loading snapshots (0 always loads them). Such a replay is a single
    /// read per scope, where loading slices is three requests and then the tail: on a small
    /// scope the replay is several times faster, and it reads no more events. It is used only
    /// when nothing was asked of a snapshot (`version` is `None`) and retention has removed
    /// no history (else the count could not say what a replay would miss).
    pub async fn bootstrap_with(
        &self,
        scopes: &ScopeRequest,
        version: Option<Seq>,
        replay_below: u64,
    ) -> Result<Bootstrapped, BootstrapError> {
        let models: Vec<&'static str> = read_models::with_scope_snapshots().collect();
        if version.is_none() && replay_below > 0 {
            let mut memory = ScopeMemory::default();
            match self
                .replay_tail(scopes, 0, &mut memory, Some(replay_below))
                .await
            {
                Ok(Some(replayed)) => {
                    return Ok(Bootstrapped {
                        memory,
                        snapshots: models.iter().map(|m| ((*m).to_owned(), None)).collect(),
                        skipped: Vec::new(),
                        replayed,
                    });
                }
                // Larger, or history is gone: snapshots it is.
                Ok(None) | Err(BootstrapError::TailGone { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let mut memory = ScopeMemory::default();
        let mut snapshots = Vec::new();
        let mut skipped = Vec::new();
        let mut from = Seq::MAX;
        let mut requests = Vec::with_capacity(models.len());
        for &model in &models {
            requests.push(BootstrapRequest {
                scopes: scopes.clone(),
                model: Ident::parse("model", model)
                    .map_err(|e| BootstrapError::Scope(e.to_string()))?,
                version,
                consistency: Consistency::default(),
            });
        }
        // Each projector loads its own snapshot: asked at once, the slowest sets the time,
        // not the sum.
        let responses =
            futures::future::join_all(requests.iter().map(|r| self.bootstrap_slice(r))).await;
        for (model, response) in models.into_iter().zip(responses) {
            let response = response?;
            skipped.extend(response.skipped.iter().map(|s| format!("{model} {s}")));
            let held = match &response.bytes {
                None => 0,
                Some(bytes) => match model {
                    read_models::FACTS => {
                        let (seq, m) = decode::<FactTable>(model, bytes)?;
                        memory.facts = m;
                        memory.hold(FACTS, &response.held);
                        seq
                    }
                    read_models::SKILLS => {
                        let (seq, m) = decode::<SkillRegistry>(model, bytes)?;
                        memory.skills = m;
                        memory.hold(SKILLS, &response.held);
                        seq
                    }
                    read_models::DOCS => {
                        let (seq, m) = decode::<DocStore>(model, bytes)?;
                        memory.docs = m;
                        memory.hold(DOCS, &response.held);
                        seq
                    }
                    // A model the table says keeps scope snapshots, which this instance
                    // does not hold.
                    other => {
                        return Err(BootstrapError::Slice {
                            model: other.to_owned(),
                            reason: "an instance keeps no such model".to_owned(),
                        });
                    }
                },
            };
            from = from.min(held);
            snapshots.push((model.to_owned(), response.snapshot));
        }
        let replayed = self
            .replay_tail(scopes, from, &mut memory, None)
            .await?
            .expect("a replay without a limit completes");
        Ok(Bootstrapped {
            memory,
            snapshots,
            skipped,
            replayed,
        })
    }

    /// The memory of `scopes` from a replay of their whole history, with no snapshot: what
    /// a bootstrap must equal.
    pub async fn replay_scope(&self, scopes: &ScopeRequest) -> Result<ScopeMemory, BootstrapError> {
        let mut memory = ScopeMemory::default();
        self.replay_tail(scopes, 0, &mut memory, None).await?;
        Ok(memory)
    }

    /// One model's slice of its newest good snapshot (at most `request.version`) for the
    /// request's scopes, as the query service answers it: what `bootstrap` loads first.
    pub async fn bootstrap_slice(
        &self,
        request: &BootstrapRequest,
    ) -> Result<engram_memory::proto::BootstrapResponse, RpcError> {
        self.query(engram_memory::proto::BOOTSTRAP, request, None)
            .await
    }

    /// Applies every event of `scopes` after `from`, up to the stream's end when it starts,
    /// in stream order; returns how many were read. With `at_most`, `None` (and `memory`
    /// untouched) when the scopes hold more events than that after `from`.
    async fn replay_tail(
        &self,
        scopes: &ScopeRequest,
        from: Seq,
        memory: &mut ScopeMemory,
        at_most: Option<u64>,
    ) -> Result<Option<u64>, BootstrapError> {
        if self.agent_identity().is_some() {
            return self.replay_tail_paged(scopes, from, memory, at_most).await;
        }
        let keys: Vec<ScopeKey> = scopes.resolve().map_err(BootstrapError::Scope)?;
        let summary = self.bus().stream_state().await?;
        let through = summary.last_seq;
        if through > from && summary.first_seq > from + 1 {
            return Err(BootstrapError::TailGone {
                from,
                first: summary.first_seq,
            });
        }
        // One replay per scope, merged by sequence: the models skip anything at or below
        // what they hold, so they must see the scopes' events in stream order.
        let mut tail = Vec::new();
        if through > from {
            // Every scope's read is opened first: their counts decide whether to read at all.
            let mut reads = Vec::with_capacity(keys.len());
            let mut pending = 0;
            for key in &keys {
                let filter = SubjectFilter::all()
                    .tenant(key.tenant.clone())
                    .scope(key.kind, key.id.clone());
                let (count, events) = self
                    .bus()
                    .replay_counted(&filter, StartAt::Seq(from + 1))
                    .await?;
                pending += count;
                if at_most.is_some_and(|max| pending > max) {
                    return Ok(None);
                }
                reads.push(events);
            }
            for mut events in reads {
                while let Some(item) = events.next().await {
                    match item {
                        Ok(stored) if stored.seq <= through => tail.push(stored),
                        Ok(_) => {}
                        // A message that is no event is skipped, as the projectors do.
                        Err(ReadError::Decode { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                    if tail.len() > MAX_TAIL_EVENTS {
                        return Err(BootstrapError::TailTooLong);
                    }
                }
            }
        }
        tail.sort_by_key(|s| s.seq);
        Ok(Some(apply_tail(memory, &tail, through)))
    }

    /// [`Self::replay_tail`] through the query service's replay pages: an agent's key
    /// reaches no stream, only its own query subjects, and the service reads the scopes its
    /// identity may read.
    async fn replay_tail_paged(
        &self,
        scopes: &ScopeRequest,
        from: Seq,
        memory: &mut ScopeMemory,
        at_most: Option<u64>,
    ) -> Result<Option<u64>, BootstrapError> {
        let mut tail = Vec::new();
        let mut after = from;
        let mut through = None;
        loop {
            let page: engram_memory::proto::ReplayResponse = self
                .query(
                    engram_memory::proto::REPLAY,
                    &engram_memory::proto::ReplayRequest {
                        scopes: scopes.clone(),
                        after_seq: after,
                        limit: engram_memory::proto::limits::MAX_REPLAY_EVENTS,
                    },
                    None,
                )
                .await?;
            let last = *through.get_or_insert(page.last_seq);
            if after == from && last > from && page.first_seq > from + 1 {
                return Err(BootstrapError::TailGone {
                    from,
                    first: page.first_seq,
                });
            }
            tail.extend(page.events.into_iter().filter(|e| e.seq <= last));
            if at_most.is_some_and(|max| tail.len() as u64 > max) {
                return Ok(None);
            }
            if tail.len() > MAX_TAIL_EVENTS {
                return Err(BootstrapError::TailTooLong);
            }
            if page.done || page.next_after >= last || page.next_after <= after {
                break;
            }
            after = page.next_after;
        }
        let tail: Vec<_> = tail.into_iter().map(|e| (e.seq, e.event)).collect();
        let through = through.unwrap_or(from);
        let mut applied = 0;
        for (seq, event) in &tail {
            applied += u64::from(memory.apply(*seq, event));
        }
        advance(memory, through);
        Ok(Some(applied))
    }
}

/// Applies `tail` (in stream order) and marks everything through `through` applied;
/// returns how many events it applied (an event every model's slice held is not).
fn apply_tail(memory: &mut ScopeMemory, tail: &[engram_bus::StoredEvent], through: Seq) -> u64 {
    let mut applied = 0;
    for stored in tail {
        applied += u64::from(memory.apply(stored.seq, &stored.event));
    }
    advance(memory, through);
    applied
}

fn advance(memory: &mut ScopeMemory, through: Seq) {
    // A model already at `through` (the stream's last event was one of these scopes', or
    // nothing came after its snapshot) holds it: advancing again would go nowhere.
    if memory.facts.applied_seq() < Some(through) {
        memory.facts.advance_through(through);
    }
    if memory.skills.applied_seq() < Some(through) {
        memory.skills.advance_through(through);
    }
    if memory.docs.applied_seq() < Some(through) {
        memory.docs.advance_through(through);
    }
    memory.through = memory.through.max(through);
}

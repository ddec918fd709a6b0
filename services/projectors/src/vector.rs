//! The vector projector: episodic and semantic text memories, embedded and indexed per scope.
//!
//! Vectors come from the event when the client supplied one from the configured model;
//! otherwise the configured embedder makes them (through the embedding cache, so a rebuild
//! does not embed again). One `VectorIndex` per scope keeps scopes apart by construction: a
//! search only ever touches the indexes of the scopes it was given.
//!
//! An outcome or feedback naming contradicted memories, or a feedback flagging a faulty
//! instance, lowers the confidence of memories of its own scope recorded before it
//! ([`engram_memory::confidence`]), in stream order; the ids of the signals applied are kept
//! in the checkpoint, so a late retry of one lowers nothing twice. A consolidation output
//! starts at the least confidence of its sources as they are when it is applied
//! ([`Inheritance`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use engram_bus::StoredEvent;
use engram_embed::Embedder;
use engram_memory::confidence::{Distrust, Inheritance, Withdrawn};
use engram_memory::proto::{
    MemoryHit, Neighbour, NeighboursRequest, NeighboursResponse, SearchRequest, SearchResponse,
};
use engram_memory::{Hit, MemoryMeta, ScopeKey, Seq, is_text_memory};
use engram_projection_runtime::{ApplyLedger, Projection, ProjectionError, Rejected, snapshot};
use engram_rpc::Failure;
use engram_schema::{EventId, EventKind};
use engram_telemetry::metrics;
use engram_vector::{HnswParams, RowLayout, VectorIndex};
use serde::{Deserialize, Serialize};

pub const NAME: &str = engram_memory::proto::read_models::VECTOR;

/// Vectors inserted per hold of the state's write lock: about 30 ms of graph work on two
/// cores, the longest a search waits behind a batch.
const INSERT_CHUNK: usize = 64;

/// A text memory as the text projectors keep it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    pub meta: MemoryMeta,
    pub text: String,
}

#[derive(Default)]
struct State {
    applied: Seq,
    memories: BTreeMap<Seq, Memory>,
    /// Event ids already indexed (and their sequence): a retry stored again after the
    /// stream's duplicate window must still count once.
    event_ids: HashMap<EventId, Seq>,
    /// Ids of memories withdrawn by `forgotten` events, kept in the checkpoint so that a late
    /// retry of one is never indexed again.
    forgotten: BTreeSet<EventId>,
    /// Ids of the distrust signals applied, kept in the checkpoint so that a late retry of
    /// one does not lower confidences again.
    distrusted: BTreeSet<EventId>,
    /// Distrusted memories withdrawn by `forgotten` events, with their scope and confidence:
    /// a copy restored from one inherits it. Kept in the checkpoint.
    withdrawn: Withdrawn,
    /// The scope of each id in `forgotten` and `distrusted`, which the ids alone do not say:
    /// an erasure looks its scopes up here to drop those ids too. Kept in the checkpoint; one
    /// written before it has none, and an erasure cannot attribute its ids ([`erase_scopes`]).
    id_scopes: BTreeMap<EventId, ScopeKey>,
    scopes: HashMap<ScopeKey, VectorIndex>,
}

/// A checkpoint's model, and an exported snapshot's (without graphs). Written as
/// [`SnapshotOut`], which must keep its fields in this order.
#[derive(Deserialize)]
struct Snapshot {
    model: String,
    dim: usize,
    memories: Vec<(Memory, Vec<f32>)>,
    #[serde(default)]
    forgotten: Vec<EventId>,
    /// Each scope's row layout, and the subdirectory of `graphs` holding its graph (if it
    /// has one), so that a restart loads graphs instead of building them.
    #[serde(default)]
    scopes: Vec<SavedScope>,
    /// The directory (under the state dir) the graphs of this checkpoint are in.
    #[serde(default)]
    graphs: Option<String>,
    #[serde(default)]
    distrusted: Vec<EventId>,
    #[serde(default)]
    withdrawn: Withdrawn,
    #[serde(default)]
    id_scopes: BTreeMap<EventId, ScopeKey>,
}

/// [`Snapshot`] as it is written: borrowed from the state, so that a checkpoint or an export
/// encodes every vector where it is instead of copying them all first. Structs are encoded
/// as arrays, so the fields are [`Snapshot`]'s, in its order.
#[derive(Serialize)]
struct SnapshotOut<'a> {
    model: &'a str,
    dim: usize,
    memories: MemoriesOut<'a>,
    forgotten: &'a BTreeSet<EventId>,
    scopes: Vec<SavedScope>,
    graphs: Option<&'a str>,
    distrusted: &'a BTreeSet<EventId>,
    withdrawn: &'a Withdrawn,
    id_scopes: &'a BTreeMap<EventId, ScopeKey>,
}

/// Every memory that has a vector, with it, in sequence order: `Snapshot::memories`.
struct MemoriesOut<'a>(&'a State);

impl MemoriesOut<'_> {
    fn each(&self) -> impl Iterator<Item = (&Memory, &[f32])> {
        let state = self.0;
        state.memories.values().filter_map(|m| {
            let vector = state.scopes.get(&m.meta.scope)?.vector(m.meta.seq)?;
            Some((m, vector))
        })
    }
}

impl Serialize for MemoriesOut<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        // MessagePack writes the length first.
        let mut seq = serializer.serialize_seq(Some(self.each().count()))?;
        for memory in self.each() {
            seq.serialize_element(&memory)?;
        }
        seq.end()
    }
}

#[derive(Serialize, Deserialize)]
struct SavedScope {
    scope: ScopeKey,
    layout: RowLayout,
    graph: Option<usize>,
}

impl State {
    /// The state a checkpoint or an imported snapshot holds, at `ledger`: each scope's index
    /// rebuilt row for row from its layout, its graph loaded from `dir` (the state dir) when
    /// the checkpoint names one there, else built from the vectors. `what` names the source in
    /// errors. Blocking: graph builds take minutes for large scopes.
    fn restore(
        snap: Snapshot,
        ledger: &ApplyLedger,
        params: HnswParams,
        dir: Option<&std::path::Path>,
        what: &str,
    ) -> Result<Self, ProjectionError> {
        let dim = snap.dim;
        let corrupt =
            |e: engram_vector::VectorError| ProjectionError::Fatal(format!("{what}: {e}"));
        let mut grouped: HashMap<ScopeKey, Vec<(Seq, Vec<f32>)>> = HashMap::new();
        let mut state = State {
            applied: ledger.seq,
            ..State::default()
        };
        for (memory, vector) in snap.memories {
            let s = memory.meta.seq;
            grouped
                .entry(memory.meta.scope.clone())
                .or_default()
                .push((s, vector));
            state.event_ids.insert(memory.meta.event_id.clone(), s);
            state.memories.insert(s, memory);
        }
        state.forgotten = snap.forgotten.into_iter().collect();
        state.distrusted = snap.distrusted.into_iter().collect();
        state.withdrawn = snap.withdrawn;
        state.id_scopes = snap.id_scopes;
        let writer_unknown = state
            .memories
            .values()
            .filter(|m| m.meta.instance_id.is_none())
            .count();
        if writer_unknown > 0 {
            tracing::warn!(
                memories = writer_unknown,
                "the {what} predates instance ids: faulty-instance flags cannot lower these memories; run `engram rebuild vector` to read them from the stream"
            );
        }
        let graphs = snap.graphs.and_then(|name| Some(dir?.join(name)));
        let started = std::time::Instant::now();
        let (mut loaded, mut built) = (0usize, 0usize);
        for saved in snap.scopes {
            let vectors: HashMap<Seq, Vec<f32>> = grouped
                .remove(&saved.scope)
                .unwrap_or_default()
                .into_iter()
                .collect();
            let graph = saved
                .graph
                .and_then(|i| graphs.as_ref().map(|g| g.join(i.to_string())));
            let (index, graph_loaded) = VectorIndex::restore(
                dim,
                params.clone(),
                &saved.layout,
                |seq| vectors.get(&seq).map(Vec::as_slice),
                graph.as_deref(),
            )
            .map_err(corrupt)?;
            if graph_loaded {
                loaded += 1;
            } else if index.has_graph() {
                built += 1;
            }
            state.scopes.insert(saved.scope, index);
        }
        // Scopes the checkpoint has no layout for (one written before layouts were saved):
        // their graphs are built again.
        for (scope, vectors) in grouped {
            let index = VectorIndex::from_vectors(dim, params.clone(), vectors).map_err(corrupt)?;
            built += usize::from(index.has_graph());
            state.scopes.insert(scope, index);
        }
        tracing::info!(
            scopes = state.scopes.len(),
            memories = state.memories.len(),
            graphs_loaded = loaded,
            graphs_built = built,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "{what} restored"
        );
        Ok(state)
    }

    /// The state with `applied` in the checkpoint format: a checkpoint (with the graphs it
    /// saved in `graphs`, a directory of the state dir) or an export (without).
    fn encode(
        &self,
        applied: &ApplyLedger,
        model: &str,
        dim: usize,
        scopes: Vec<SavedScope>,
        graphs: Option<&str>,
    ) -> Result<Vec<u8>, ProjectionError> {
        snapshot::encode(
            applied,
            &SnapshotOut {
                model,
                dim,
                memories: MemoriesOut(self),
                forgotten: &self.forgotten,
                scopes,
                graphs,
                distrusted: &self.distrusted,
                withdrawn: &self.withdrawn,
                id_scopes: &self.id_scopes,
            },
        )
    }
}

/// Graph directories are named by the checkpoint: `vector-graphs-<seq>-<unix nanos>`.
const GRAPHS_PREFIX: &str = "vector-graphs-";

pub struct VectorProjection {
    dir: PathBuf,
    path: PathBuf,
    embedder: Arc<dyn Embedder>,
    params: HnswParams,
    state: Arc<RwLock<State>>,
}

impl VectorProjection {
    pub fn new(dir: impl Into<PathBuf>, embedder: Arc<dyn Embedder>, params: HnswParams) -> Self {
        let dir = dir.into();
        Self {
            path: dir.join("vector.snap"),
            dir,
            embedder,
            params,
            state: Arc::default(),
        }
    }

    pub fn embedder(&self) -> &Arc<dyn Embedder> {
        &self.embedder
    }

    /// Refuses vectors of another model or dimension than the embedder's: they cannot be
    /// compared with what it embeds. `what` names them (a checkpoint, a snapshot).
    fn check_embedder(&self, snap: &Snapshot, what: &str) -> Result<(), ProjectionError> {
        if snap.model == self.embedder.model_id() && snap.dim == self.embedder.dim() {
            return Ok(());
        }
        Err(ProjectionError::Fatal(format!(
            "{what} holds {}-dimensional vectors of model {}, but the embedder is {} ({} dimensions); rebuild from the stream to re-embed (`engram rebuild vector`)",
            snap.dim,
            snap.model,
            self.embedder.model_id(),
            self.embedder.dim()
        )))
    }

    /// Memories held, for status and benchmarks.
    pub fn len(&self) -> usize {
        self.read().memories.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate bytes held by the indexes and memory table.
    pub fn memory_bytes(&self) -> usize {
        let state = self.read();
        let indexes: usize = state.scopes.values().map(VectorIndex::memory_bytes).sum();
        let table: usize = state
            .memories
            .values()
            .map(|m| m.text.len() + std::mem::size_of::<Memory>() + 64)
            .sum();
        indexes + table
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Answers a search over `request.scopes` (already checked by the caller).
    pub async fn search(&self, request: &SearchRequest) -> Result<SearchResponse, Failure> {
        let query = match &request.vector {
            Some(v) => {
                if v.len() != self.embedder.dim() {
                    return Err(Failure::invalid(format!(
                        "query vector has {} dimensions; the index holds {}-dimensional vectors of model {}",
                        v.len(),
                        self.embedder.dim(),
                        self.embedder.model_id()
                    )));
                }
                v.clone()
            }
            None => {
                let mut vectors = self
                    .embedder
                    .embed(std::slice::from_ref(&request.query))
                    .await
                    .map_err(|e| {
                        let code = if e.is_retryable() {
                            engram_memory::proto::ErrorCode::Unavailable
                        } else {
                            engram_memory::proto::ErrorCode::Invalid
                        };
                        Failure::new(code, format!("cannot embed the query: {e}"))
                    })?;
                vectors.pop().unwrap_or_default()
            }
        };
        // Exact scans of a few thousand vectors, or a filtered graph walk, take milliseconds:
        // off the runtime's threads, so one search cannot stall the others.
        let (state, request) = (self.state.clone(), request.clone());
        tokio::task::spawn_blocking(move || search_state(&state, &request, &query))
            .await
            .map_err(|e| {
                Failure::new(
                    engram_memory::proto::ErrorCode::Internal,
                    format!("vector search failed: {e}"),
                )
            })?
    }
}

impl VectorProjection {
    /// Answers a neighbours request (already checked): for each named memory of the scope,
    /// up to `k` others whose vectors are at least `min_similarity` from its own, by the
    /// same index searches as retrieval. Summaries are left out on both sides: a summary is
    /// close to what it summarises, and is no duplicate of it.
    pub async fn neighbours(
        &self,
        request: NeighboursRequest,
    ) -> Result<NeighboursResponse, Failure> {
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || neighbours_state(&state, &request))
            .await
            .map_err(|e| {
                Failure::new(
                    engram_memory::proto::ErrorCode::Internal,
                    format!("neighbours search failed: {e}"),
                )
            })?
    }
}

fn neighbours_state(
    state: &RwLock<State>,
    request: &NeighboursRequest,
) -> Result<NeighboursResponse, Failure> {
    let mut pairs = Vec::new();
    let mut visible_seq = 0;
    for id in &request.event_ids {
        // The lock is taken per memory: a request of a thousand searches must not hold
        // the projector's writes back for all of them.
        let state = state.read().unwrap_or_else(|p| p.into_inner());
        visible_seq = state.applied;
        let candidate = |seq: Seq| {
            state.memories.get(&seq).is_some_and(|m| {
                m.meta.scope == request.scope
                    && !m.meta.tags.iter().any(|t| t == engram_memory::SUMMARY_TAG)
            })
        };
        let (Some(&seq), Some(index)) = (state.event_ids.get(id), state.scopes.get(&request.scope))
        else {
            continue;
        };
        let Some(vector) = index.vector(seq).filter(|_| candidate(seq)) else {
            continue;
        };
        let hits = index
            .search(vector, request.k, &|s| s != seq && candidate(s))
            .map_err(|e| Failure::invalid(e.to_string()))?;
        for hit in hits {
            if hit.score < request.min_similarity {
                break;
            }
            if let Some(b) = state.memories.get(&hit.seq) {
                pairs.push(Neighbour {
                    a: id.clone(),
                    b: b.meta.event_id.clone(),
                    similarity: hit.score,
                });
            }
        }
    }
    Ok(NeighboursResponse { pairs, visible_seq })
}

/// The search half of [`VectorProjection::search`], once the query vector is known.
fn search_state(
    state: &RwLock<State>,
    request: &SearchRequest,
    query: &[f32],
) -> Result<SearchResponse, Failure> {
    let state = state.read().unwrap_or_else(|p| p.into_inner());
    let allowed = |seq: Seq| {
        state
            .memories
            .get(&seq)
            .is_some_and(|m| request.filter.matches(&m.meta))
    };
    let mut hits: Vec<Hit> = Vec::new();
    for scope in &request.scopes {
        if let Some(index) = state.scopes.get(scope) {
            let found = index
                .search(query, request.k, &allowed)
                .map_err(|e| Failure::invalid(e.to_string()))?;
            hits.extend(found);
        }
    }
    hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.seq.cmp(&b.seq)));
    hits.truncate(request.k);
    let mut also = Vec::new();
    for seq in &request.score_also {
        let Some(memory) = state.memories.get(seq) else {
            continue;
        };
        if !request.scopes.contains(&memory.meta.scope) || !request.filter.matches(&memory.meta) {
            continue;
        }
        if let Some(vector) = state
            .scopes
            .get(&memory.meta.scope)
            .and_then(|index| index.vector(*seq))
        {
            also.push(Hit {
                seq: *seq,
                score: engram_embed::dot(query, vector),
            });
        }
    }
    Ok(SearchResponse {
        hits: hits
            .into_iter()
            .filter_map(|hit| {
                state.memories.get(&hit.seq).map(|m| MemoryHit {
                    hit,
                    meta: m.meta.clone(),
                    text: m.text.clone(),
                })
            })
            .collect(),
        also,
        visible_seq: state.applied,
    })
}

#[async_trait]
impl Projection for VectorProjection {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        let path = self.path.clone();
        let loaded = tokio::task::spawn_blocking(move || snapshot::load::<Snapshot>(&path, NAME))
            .await
            .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        let Some((ledger, snap)) = loaded else {
            return Ok(ApplyLedger::default());
        };
        self.check_embedder(&snap, "the vector checkpoint")?;
        let (params, dir) = (self.params.clone(), self.dir.clone());
        let state = tokio::task::spawn_blocking(move || {
            State::restore(snap, &ledger, params, Some(&dir), "vector checkpoint")
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
        Ok(ledger)
    }

    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        let (model, dim) = (self.embedder.model_id().to_owned(), self.embedder.dim());
        let mut rejected = Vec::new();
        // What to do, in stream order: index a memory (with the vector if the client supplied
        // a usable one, and the sources it inherits its confidence from), forget some, or
        // distrust some.
        let mut wanted: Vec<(usize, Option<Vec<f32>>, Option<Inheritance>)> = Vec::new();
        let mut forgets: Vec<(usize, Vec<EventId>)> = Vec::new();
        let mut distrusts: Vec<(usize, Distrust)> = Vec::new();
        {
            let state = self.read();
            let mut seen = HashSet::new();
            let mut signals_seen = HashSet::new();
            for (index, stored) in events.iter().enumerate() {
                let event = &stored.event;
                if stored.seq <= state.applied {
                    continue;
                }
                if event.kind == EventKind::Forgotten {
                    match event.forgotten_ids() {
                        Ok(ids) => forgets.push((index, ids)),
                        Err(e) => rejected.push(Rejected {
                            index,
                            reason: e.to_string(),
                        }),
                    }
                    continue;
                }
                // A consolidation output whose sources do not check is refused whole, like a
                // signal that does not check.
                let inherits = match Inheritance::of(event) {
                    Ok(inherits) => inherits,
                    Err(e) => {
                        rejected.push(Rejected {
                            index,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                };
                // A signal that does not check is refused whole, its text included: a
                // rejected event leaves the model as it was. A signal that checks is applied
                // even if its event's own text is refused below (no usable vector, text the
                // embedder will not take): confidences must not depend on the embedder, or
                // the two text models would disagree. Only the text is dead-lettered then.
                match Distrust::of(stored.seq, event) {
                    Ok(Some(signal))
                        if !state.distrusted.contains(&signal.event_id)
                            && signals_seen.insert(signal.event_id.clone()) =>
                    {
                        distrusts.push((index, signal));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        rejected.push(Rejected {
                            index,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                }
                if !is_text_memory(event)
                    || state.event_ids.contains_key(&event.event_id)
                    || state.forgotten.contains(&event.event_id)
                    || !seen.insert(&event.event_id)
                {
                    continue;
                }
                let supplied = event
                    .embedding
                    .as_ref()
                    .filter(|e| e.model == model && e.vector.len() == dim)
                    .map(|e| e.vector.clone());
                wanted.push((index, supplied, inherits));
            }
        }
        let to_embed: Vec<String> = wanted
            .iter()
            .filter(|(_, v, _)| v.is_none())
            .map(|(i, ..)| events[*i].event.content.text.clone())
            .collect();
        let mut embedded = if to_embed.is_empty() {
            Vec::new()
        } else {
            match self.embedder.embed(&to_embed).await {
                Ok(vectors) => vectors,
                Err(e) if !e.is_input_fault() => {
                    // An embedder outage (a key, model or url to fix, a server down) is no
                    // event's fault: the batch waits and retries rather than dead-letters.
                    return Err(ProjectionError::Transient(format!("embedding failed: {e}")));
                }
                Err(e) => {
                    // Some text cannot be embedded as it is (too long, vectors required from
                    // clients): embed one at a time, dead-letter only the texts refused alone.
                    let mut each = if to_embed.len() == 1 {
                        vec![Err(e.to_string())]
                    } else {
                        embed_each(self.embedder.as_ref(), &to_embed).await?
                    }
                    .into_iter();
                    let mut vectors = Vec::with_capacity(to_embed.len());
                    wanted.retain_mut(|(i, v, inherits)| {
                        if v.is_some() {
                            return true;
                        }
                        match each.next() {
                            Some(Ok(vector)) => {
                                vectors.push(vector);
                                true
                            }
                            // A consolidation output the embedder will not take (vectors
                            // come from clients, and the consolidator is none) gets one
                            // from its sources at insert time.
                            Some(Err(_)) if inherits.is_some() => {
                                *v = Some(Vec::new());
                                true
                            }
                            Some(Err(reason)) => {
                                rejected.push(Rejected { index: *i, reason });
                                false
                            }
                            // Too few answers: caught below as too few vectors.
                            None => true,
                        }
                    });
                    vectors
                }
            }
        }
        .into_iter();
        metrics::EMBEDDINGS.with_label_values(&["client"]).inc_by(
            wanted
                .iter()
                .filter(|(_, v, _)| v.as_ref().is_some_and(|v| !v.is_empty()))
                .count() as u64,
        );

        let mut ops = Vec::with_capacity(wanted.len() + forgets.len() + distrusts.len());
        for (index, supplied, inherits) in wanted {
            let stored = &events[index];
            let vector = match supplied {
                Some(v) => v,
                None => embedded.next().ok_or_else(|| {
                    ProjectionError::Transient("embedder returned too few vectors".into())
                })?,
            };
            let memory = Memory {
                meta: MemoryMeta::of(stored.seq, &stored.event),
                text: stored.event.content.text.clone(),
            };
            ops.push(Op::Insert(index, memory, vector, inherits));
        }
        for (index, ids) in forgets {
            let scope = ScopeKey::of(&events[index].event);
            ops.push(Op::Forget(index, scope, ids));
        }
        for (index, signal) in distrusts {
            ops.push(Op::Distrust(index, signal));
        }
        ops.sort_by_key(Op::index);
        let last = events.last().map(|e| e.seq);
        let (state, dim, params) = (self.state.clone(), dim, self.params.clone());
        // Graph inserts are milliseconds each: off the async threads, linked in parallel, and
        // in chunks so that searches get the lock between them.
        let refused = tokio::task::spawn_blocking(move || {
            let mut refused = Vec::new();
            let mut pending: Vec<(usize, Memory, Vec<f32>)> = Vec::new();
            let mut worn: HashSet<ScopeKey> = HashSet::new();
            for op in ops {
                match op {
                    Op::Insert(index, mut memory, vector, inherits) => {
                        if let Some(inherits) = &inherits {
                            // A source still in the chunk is inserted first, so that the
                            // state holds every source as the events before this one left
                            // it, wherever the chunk and batch boundaries fall.
                            if pending
                                .iter()
                                .any(|(_, m, _)| inherits.sources.contains(&m.meta.event_id))
                            {
                                insert_chunk(&state, dim, &params, &pending, &mut refused);
                                pending.clear();
                            }
                            memory.meta.confidence = inherited(&state, inherits);
                        }
                        let vector = if vector.is_empty() {
                            match inherits.as_ref().and_then(|i| from_sources(&state, i)) {
                                Some(v) => v,
                                None => {
                                    refused.push(Rejected {
                                        index,
                                        reason: "no vector: the embedder takes vectors from clients only, and none of this consolidation output's sources has one here".into(),
                                    });
                                    continue;
                                }
                            }
                        } else {
                            vector
                        };
                        pending.push((index, memory, vector));
                        if pending.len() == INSERT_CHUNK {
                            insert_chunk(&state, dim, &params, &pending, &mut refused);
                            pending.clear();
                        }
                    }
                    Op::Forget(_, scope, ids) => {
                        insert_chunk(&state, dim, &params, &pending, &mut refused);
                        pending.clear();
                        if forget(&state, &scope, &ids) {
                            worn.insert(scope);
                        }
                    }
                    Op::Distrust(_, signal) => {
                        insert_chunk(&state, dim, &params, &pending, &mut refused);
                        pending.clear();
                        distrust(&state, &signal);
                    }
                }
            }
            insert_chunk(&state, dim, &params, &pending, &mut refused);
            for scope in worn {
                compact(&state, dim, &params, &scope);
            }
            if let Some(last) = last {
                let mut state = state.write().unwrap_or_else(|p| p.into_inner());
                state.applied = state.applied.max(last);
            }
            refused
        })
        .await
        .map_err(|e| ProjectionError::Fatal(format!("vector insert task: {e}")))?;
        rejected.extend(refused);
        rejected.sort_by_key(|r| r.index);
        Ok(rejected)
    }

    async fn checkpoint(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        let (dir, path, state, model, dim, applied) = (
            self.dir.clone(),
            self.path.clone(),
            self.state.clone(),
            self.embedder.model_id().to_owned(),
            self.embedder.dim(),
            *applied,
        );
        tokio::task::spawn_blocking(move || {
            let io = |what: &str, path: &std::path::Path, e: std::io::Error| {
                ProjectionError::Transient(format!(
                    "vector checkpoint: {what} {}: {e}",
                    path.display()
                ))
            };
            // A fresh name every time: the directory the durable snapshot names is never
            // touched until a newer snapshot has replaced it.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let graphs_name = format!("{GRAPHS_PREFIX}{}-{nanos}", applied.seq);
            let graphs = dir.join(&graphs_name);
            let (bytes, saved) = {
                // Writers wait while the graphs are written; searches do not.
                let state = state.read().unwrap_or_else(|p| p.into_inner());
                let mut scopes = Vec::with_capacity(state.scopes.len());
                for (i, (scope, index)) in state.scopes.iter().enumerate() {
                    let mut graph = None;
                    if index.has_graph() {
                        let sub = graphs.join(i.to_string());
                        std::fs::create_dir_all(&sub).map_err(|e| io("create", &sub, e))?;
                        if index
                            .save_graph(&sub)
                            .map_err(|e| io("write graph", &sub, e))?
                        {
                            graph = Some(i);
                        }
                    }
                    scopes.push(SavedScope {
                        scope: scope.clone(),
                        layout: index.layout(),
                        graph,
                    });
                }
                let saved = graphs.exists().then_some(graphs_name.as_str());
                (state.encode(&applied, &model, dim, scopes, saved)?, saved)
            };
            if saved.is_some() {
                std::fs::File::open(&graphs)
                    .and_then(|d| d.sync_all())
                    .map_err(|e| io("sync", &graphs, e))?;
            }
            // Encoded under the read lock, written to disk after it is released.
            snapshot::write_atomic(&path, &bytes)?;
            // The new snapshot is durable: older graph directories are garbage now.
            remove_graphs_except(&dir, saved);
            Ok(())
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))?
    }

    /// The checkpoint's content without the graphs, which stay local: the importing replica
    /// builds them from the vectors, and what it saves is re-embedding every memory, the
    /// slow part of a replay. Encoded straight from the state, under its read lock, so the
    /// only copy is the blob: about 2 GB for a million 384-dimensional memories.
    async fn export(&self, applied: &ApplyLedger) -> Result<Option<Vec<u8>>, ProjectionError> {
        let (state, model, dim, applied) = (
            self.state.clone(),
            self.embedder.model_id().to_owned(),
            self.embedder.dim(),
            *applied,
        );
        tokio::task::spawn_blocking(move || {
            let state = state.read().unwrap_or_else(|p| p.into_inner());
            let scopes = state
                .scopes
                .iter()
                .map(|(scope, index)| SavedScope {
                    scope: scope.clone(),
                    layout: index.layout(),
                    graph: None,
                })
                .collect();
            state.encode(&applied, &model, dim, scopes, None).map(Some)
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))?
    }

    /// Checks the blob, its model and dimension against this replica's embedder, and builds
    /// the state from it as [`restore`](Projection::restore) does from a checkpoint (graphs
    /// built from the vectors); then checkpoints, graphs included, so a restart loads them.
    /// Until the state is built, nothing is replaced.
    async fn import(&self, bytes: &[u8]) -> Result<ApplyLedger, ProjectionError> {
        let bytes = bytes.to_vec();
        let (ledger, mut snap) = tokio::task::spawn_blocking(move || {
            snapshot::decode::<Snapshot>(&bytes, "the vector snapshot", NAME)
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        self.check_embedder(&snap, "the vector snapshot")?;
        // Graph directories are another replica's, never ours.
        snap.graphs = None;
        let params = self.params.clone();
        let state = tokio::task::spawn_blocking(move || {
            State::restore(snap, &ledger, params, None, "vector snapshot")
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
        self.checkpoint(&ledger).await?;
        Ok(ledger)
    }

    async fn reset(&self) -> Result<(), ProjectionError> {
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = State::default();
        snapshot::remove(&self.path)?;
        remove_graphs_except(&self.dir, None);
        Ok(())
    }

    async fn state_hash(&self) -> [u8; 32] {
        let state = self.read();
        let mut hasher = blake3::Hasher::new();
        for memory in state.memories.values() {
            hasher.update(&rmp_serde::to_vec(memory).unwrap_or_default());
            if let Some(v) = state
                .scopes
                .get(&memory.meta.scope)
                .and_then(|i| i.vector(memory.meta.seq))
            {
                for x in v {
                    hasher.update(&x.to_le_bytes());
                }
            }
        }
        for id in &state.forgotten {
            hasher.update(id.as_str().as_bytes());
        }
        // Marked off, and only when there are some, so a state without signals hashes as
        // it did before they existed.
        if !state.distrusted.is_empty() {
            hasher.update(b"\0distrusted");
            for id in &state.distrusted {
                hasher.update(id.as_str().as_bytes());
            }
        }
        if !state.withdrawn.is_empty() {
            hasher.update(b"\0withdrawn");
            for (id, (scope, confidence)) in &state.withdrawn {
                hasher.update(id.as_str().as_bytes());
                hasher.update(scope.to_string().as_bytes());
                hasher.update(&confidence.to_le_bytes());
            }
        }
        if !state.id_scopes.is_empty() {
            hasher.update(b"\0id scopes");
            for (id, scope) in &state.id_scopes {
                hasher.update(id.as_str().as_bytes());
                hasher.update(scope.to_string().as_bytes());
            }
        }
        *hasher.finalize().as_bytes()
    }

    /// Removes every memory of the scopes `keys`, held or forgotten, with its vector, text,
    /// index (graph and tombstones included) and the ids kept of it, and the distrust signals
    /// of those scopes applied; returns how many events that was ([`traces`] before).
    /// Graph files go with the next checkpoint, which the loop writes right after: it saves
    /// only the scopes still held and removes older graph directories.
    ///
    /// [`traces`]: Projection::traces
    async fn erase(&self, keys: &[ScopeKey]) -> Result<u64, ProjectionError> {
        let (state, keys) = (self.state.clone(), keys.iter().cloned().collect());
        // Scanning every memory, and freeing a large scope's graph, are blocking work.
        tokio::task::spawn_blocking(move || erase_scopes(&state, &keys))
            .await
            .map_err(|e| ProjectionError::Fatal(format!("vector erase task: {e}")))
    }

    /// The events of the scopes `keys` the model keeps anything of: memories held or
    /// forgotten, and distrust signals applied ([`held_of`]).
    async fn traces(&self, keys: &[ScopeKey]) -> u64 {
        let keys: HashSet<ScopeKey> = keys.iter().cloned().collect();
        // A scan of the memory table under the read lock: searches go on meanwhile, and
        // verification asks this once per erasure.
        held_of(&self.read(), &keys).1.len() as u64
    }
}

/// One step of a batch, in stream order (the index into the batch).
enum Op {
    /// A memory, its vector, and for a consolidation output the sources it inherits its
    /// confidence from.
    Insert(usize, Memory, Vec<f32>, Option<Inheritance>),
    Forget(usize, ScopeKey, Vec<EventId>),
    Distrust(usize, Distrust),
}

impl Op {
    fn index(&self) -> usize {
        match self {
            Op::Insert(index, ..) | Op::Forget(index, ..) | Op::Distrust(index, ..) => *index,
        }
    }
}

/// Embeds `texts` one at a time, after the embedder refused them together for an input fault:
/// a vector for each text it takes, the reason for each it refuses on its own. An outage midway
/// is transient, as for the whole batch.
async fn embed_each(
    embedder: &dyn Embedder,
    texts: &[String],
) -> Result<Vec<Result<Vec<f32>, String>>, ProjectionError> {
    let mut each = Vec::with_capacity(texts.len());
    for text in texts {
        match embedder.embed(std::slice::from_ref(text)).await {
            Ok(mut vectors) if vectors.len() == 1 => each.push(Ok(vectors.remove(0))),
            Ok(_) => {
                return Err(ProjectionError::Transient(
                    "embedder returned no vector for one text".into(),
                ));
            }
            Err(e) if e.is_input_fault() => each.push(Err(e.to_string())),
            Err(e) => {
                return Err(ProjectionError::Transient(format!("embedding failed: {e}")));
            }
        }
    }
    Ok(each)
}

/// Inserts one chunk under one hold of the write lock; refused vectors go to `refused`.
fn insert_chunk(
    state: &RwLock<State>,
    dim: usize,
    params: &HnswParams,
    chunk: &[(usize, Memory, Vec<f32>)],
    refused: &mut Vec<Rejected>,
) {
    if chunk.is_empty() {
        return;
    }
    let mut state = state.write().unwrap_or_else(|p| p.into_inner());
    let mut by_scope: HashMap<&ScopeKey, Vec<usize>> = HashMap::new();
    for (i, (_, memory, _)) in chunk.iter().enumerate() {
        by_scope.entry(&memory.meta.scope).or_default().push(i);
    }
    for (scope, members) in by_scope {
        let index = state.scopes.entry(scope.clone()).or_insert_with(|| {
            VectorIndex::new(dim, params.clone()).expect("hnsw params are validated at start-up")
        });
        let items: Vec<(Seq, &[f32])> = members
            .iter()
            .map(|&i| (chunk[i].1.meta.seq, chunk[i].2.as_slice()))
            .collect();
        let results = index.insert_many(&items);
        for (&i, result) in members.iter().zip(results) {
            let (event_index, memory, _) = &chunk[i];
            match result {
                Ok(()) => {
                    state
                        .event_ids
                        .insert(memory.meta.event_id.clone(), memory.meta.seq);
                    state.memories.insert(memory.meta.seq, memory.clone());
                }
                Err(e) => refused.push(Rejected {
                    index: *event_index,
                    reason: format!("unusable vector: {e}"),
                }),
            }
        }
    }
}

/// Withdraws the memories of `ids` that belong to `scope` (an id of another scope is left
/// alone: a scope can only forget its own). Their event ids stay known, so a late retry of a
/// forgotten event is not indexed again. Returns whether the scope's index now wants a
/// rebuild.
fn forget(state: &RwLock<State>, scope: &ScopeKey, ids: &[EventId]) -> bool {
    let mut state = state.write().unwrap_or_else(|p| p.into_inner());
    let state = &mut *state;
    for id in ids {
        let Some(&seq) = state.event_ids.get(id) else {
            continue;
        };
        if state
            .memories
            .get(&seq)
            .is_none_or(|m| &m.meta.scope != scope)
        {
            continue;
        }
        if let Some(memory) = state.memories.remove(&seq) {
            engram_memory::confidence::withdraw(&mut state.withdrawn, &memory.meta);
        }
        state.forgotten.insert(id.clone());
        state.id_scopes.insert(id.clone(), scope.clone());
        if let Some(index) = state.scopes.get_mut(scope) {
            index.remove(seq);
        }
        metrics::PROJECTOR_FORGOTTEN
            .with_label_values(&[NAME])
            .inc();
    }
    state
        .scopes
        .get(scope)
        .is_some_and(VectorIndex::wants_rebuild)
}

/// The confidence a consolidation output starts at, from its sources as the state holds
/// them ([`Inheritance::confidence`]).
/// A vector for a consolidation output the embedder cannot embed: the normalised mean of
/// its sources' vectors in its own scope (a merged memory's are near-duplicates of its
/// text; a summary's are what it distils). `None` when no source is held (a restored copy's
/// source was forgotten, and its vector with it). Read at insert time, in stream order, so
/// a replay with other batch boundaries derives the same vector.
fn from_sources(state: &RwLock<State>, inherits: &Inheritance) -> Option<Vec<f32>> {
    let state = state.read().unwrap_or_else(|p| p.into_inner());
    let index = state.scopes.get(&inherits.scope)?;
    let mut sum: Option<Vec<f32>> = None;
    for id in &inherits.sources {
        let Some(vector) = state.event_ids.get(id).and_then(|seq| index.vector(*seq)) else {
            continue;
        };
        match &mut sum {
            None => sum = Some(vector.to_vec()),
            Some(sum) => sum.iter_mut().zip(vector).for_each(|(s, x)| *s += x),
        }
    }
    let mut mean = sum?;
    engram_embed::l2_normalize(&mut mean);
    Some(mean)
}

fn inherited(state: &RwLock<State>, inherits: &Inheritance) -> f64 {
    let state = state.read().unwrap_or_else(|p| p.into_inner());
    inherits.confidence(|id| {
        let held = state
            .event_ids
            .get(id)
            .and_then(|seq| state.memories.get(seq));
        match held {
            Some(m) => Some((&m.meta.scope, m.meta.confidence)),
            None => state.withdrawn.get(id).map(|(scope, c)| (scope, *c)),
        }
    })
}

/// Lowers the confidence of the memories `signal` is about: those it contradicts and, for a
/// faulty-instance flag, every memory of its scope (each scope's index holds exactly its live
/// memories). [`Distrust::factor`] decides, so memories of other scopes and later ones are
/// left alone. Records the signal, so a late retry of it is not applied again.
fn distrust(state: &RwLock<State>, signal: &Distrust) {
    let mut state = state.write().unwrap_or_else(|p| p.into_inner());
    let state = &mut *state;
    state.distrusted.insert(signal.event_id.clone());
    state
        .id_scopes
        .insert(signal.event_id.clone(), signal.scope.clone());
    let mut about: BTreeSet<Seq> = signal
        .contradicts
        .iter()
        .filter_map(|id| state.event_ids.get(id).copied())
        .collect();
    if signal.faulty_instance.is_some()
        && let Some(index) = state.scopes.get(&signal.scope)
    {
        about.extend(index.iter().map(|(seq, _)| seq));
    }
    let mut lowered = 0usize;
    for seq in about {
        if let Some(memory) = state.memories.get_mut(&seq)
            && let Some(meta) = signal.apply(&memory.meta)
        {
            memory.meta = meta;
            lowered += 1;
        }
    }
    tracing::debug!(
        scope = %signal.scope,
        seq = signal.seq,
        lowered,
        "memories distrusted"
    );
}

/// Replaces a scope's index by one without tombstones. The replacement is built from a copy
/// with no lock held, so searches go on against the old index meanwhile; nothing else
/// writes, because the only writer is the batch this runs in.
fn compact(state: &RwLock<State>, dim: usize, params: &HnswParams, scope: &ScopeKey) {
    let live: Vec<(Seq, Vec<f32>)> = {
        let state = state.read().unwrap_or_else(|p| p.into_inner());
        let Some(index) = state.scopes.get(scope) else {
            return;
        };
        index.iter().map(|(seq, v)| (seq, v.to_vec())).collect()
    };
    match VectorIndex::from_vectors(dim, params.clone(), live) {
        Ok(fresh) => {
            let mut state = state.write().unwrap_or_else(|p| p.into_inner());
            state.scopes.insert(scope.clone(), fresh);
        }
        // Only stored vectors go back in, so this cannot fail; keep the old index if it does.
        Err(e) => tracing::warn!(error = %e, "vector index compaction failed; keeping tombstones"),
    }
}

/// What `state` holds of the scopes `keys`: the sequences of their memories, and the ids of
/// every event of theirs it keeps anything of (memories held, memories forgotten, distrust
/// signals applied), each once. Every memory is looked at, not only those in the scopes'
/// indexes: an erasure must not trust an invariant to find what it removes.
fn held_of(state: &State, keys: &HashSet<ScopeKey>) -> (Vec<Seq>, BTreeSet<EventId>) {
    let mut seqs = Vec::new();
    let mut ids = BTreeSet::new();
    for (seq, memory) in &state.memories {
        if keys.contains(&memory.meta.scope) {
            seqs.push(*seq);
            ids.insert(memory.meta.event_id.clone());
        }
    }
    // A withdrawn entry says its scope too, even when restored from a checkpoint that did not
    // keep `id_scopes`.
    let withdrawn = state.withdrawn.iter().map(|(id, (scope, _))| (id, scope));
    ids.extend(
        state
            .id_scopes
            .iter()
            .chain(withdrawn)
            .filter(|(_, scope)| keys.contains(*scope))
            .map(|(id, _)| id.clone()),
    );
    (seqs, ids)
}

/// Removes everything of the scopes `keys` ([`Projection::erase`]); returns the events
/// removed, as [`held_of`] counts them. What goes is found under the read lock, so searches
/// go on meanwhile; nothing writes in between, because the loop erases between batches. The
/// indexes taken out are freed after the write lock is released: a large graph takes a
/// while.
fn erase_scopes(state: &RwLock<State>, keys: &HashSet<ScopeKey>) -> u64 {
    let (seqs, ids, unattributed) = {
        let state = state.read().unwrap_or_else(|p| p.into_inner());
        let (seqs, ids) = held_of(&state, keys);
        let unattributed = state
            .forgotten
            .iter()
            .chain(&state.distrusted)
            .filter(|id| !state.id_scopes.contains_key(*id) && !state.withdrawn.contains_key(*id))
            .count();
        (seqs, ids, unattributed)
    };
    let indexes: Vec<VectorIndex> = {
        let mut state = state.write().unwrap_or_else(|p| p.into_inner());
        let state = &mut *state;
        for seq in &seqs {
            state.memories.remove(seq);
        }
        // The ids of forgotten memories still map to their old sequences here, and signals'
        // ids are kept apart from memories: each is dropped by id.
        for id in &ids {
            state.event_ids.remove(id);
            state.forgotten.remove(id);
            state.distrusted.remove(id);
            state.withdrawn.remove(id);
            state.id_scopes.remove(id);
        }
        keys.iter().filter_map(|k| state.scopes.remove(k)).collect()
    };
    if unattributed > 0 {
        tracing::warn!(
            ids = unattributed,
            "forgotten memories' and applied signals' ids restored from a checkpoint older than their scopes cannot be attributed to a scope; those of the erased scopes stay, without text or vector"
        );
    }
    tracing::debug!(
        scopes = keys.len(),
        memories = seqs.len(),
        events = ids.len(),
        indexes = indexes.len(),
        "vector scopes erased"
    );
    drop(indexes);
    ids.len() as u64
}

/// Removes `vector-graphs-*` directories other than `keep`. Failures are only logged: a
/// leftover directory wastes disk, nothing more.
fn remove_graphs_except(dir: &std::path::Path, keep: Option<&str>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(GRAPHS_PREFIX)
            && Some(name.as_ref()) != keep
            && let Err(e) = std::fs::remove_dir_all(entry.path())
        {
            tracing::warn!(dir = %entry.path().display(), error = %e, "cannot remove an old vector graph directory");
        }
    }
}

/// The vector read model, as the registry runs it.
pub struct Vector;

#[async_trait]
impl crate::ReadModel for Vector {
    const NAME: &'static str = NAME;
    const ENDPOINT: (&'static str, &'static str) = ("search", "vector_search");
    type Projection = VectorProjection;
    type Request = SearchRequest;
    type Response = SearchResponse;

    async fn open(
        config: &crate::ProjectorsConfig,
        dir: &std::path::Path,
    ) -> Result<Arc<VectorProjection>, crate::StartError> {
        let embedder = crate::embedder(config, dir).await?;
        Ok(Arc::new(VectorProjection::new(
            dir,
            embedder,
            config.hnsw.clone(),
        )))
    }

    async fn answer(
        projection: Arc<VectorProjection>,
        request: SearchRequest,
        _visible: Seq,
    ) -> Result<SearchResponse, Failure> {
        projection.search(&request).await
    }

    async fn more_endpoints(
        projection: Arc<VectorProjection>,
        endpoints: &crate::registry::Endpoints<'_>,
    ) -> Result<(), crate::StartError> {
        endpoints
            .serve(
                engram_memory::proto::NEIGHBOURS_OP,
                "vector_neighbours",
                move |request: NeighboursRequest, _visible| {
                    let projection = projection.clone();
                    async move { projection.neighbours(request).await }
                },
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use engram_fixtures::HashEmbedder;
    use engram_memory::MemoryFilter;
    use engram_memory::proto::Consistency;
    use engram_schema::{Envelope, Ident, ScopeKind};
    use engram_testkit::stored;
    use serde_json::json;

    use super::*;

    fn ident(s: &str) -> Ident {
        Ident::parse("test", s).unwrap()
    }

    fn key(tenant: &str, task: &str) -> ScopeKey {
        ScopeKey {
            tenant: ident(tenant),
            kind: ScopeKind::Task,
            id: ident(task),
        }
    }

    /// An event of `kind` in `tenant`/`task:<task>`, with `data`.
    fn event(
        tenant: &str,
        task: &str,
        kind: EventKind,
        text: &str,
        data: serde_json::Value,
    ) -> Envelope {
        let mut e = engram_testkit::event(tenant, task, text);
        e.kind = kind;
        e.content.data = Some(data);
        e
    }

    fn memory(tenant: &str, task: &str, text: &str) -> Envelope {
        engram_testkit::event(tenant, task, text)
    }

    fn forgetting(tenant: &str, task: &str, id: &EventId) -> Envelope {
        event(
            tenant,
            task,
            EventKind::Forgotten,
            "superseded",
            json!({"event_ids": [id]}),
        )
    }

    /// Graphs from two live vectors on, so that the scopes here have graph files.
    fn projection(dir: &std::path::Path) -> VectorProjection {
        let params = HnswParams {
            exact_below: 2,
            ..HnswParams::default()
        };
        VectorProjection::new(dir, Arc::new(HashEmbedder::new(16)), params)
    }

    /// The event ids a search of `scope` finds.
    async fn found(vector: &VectorProjection, scope: &ScopeKey) -> BTreeSet<EventId> {
        let request = SearchRequest {
            scopes: vec![scope.clone()],
            query: "the vault key rotates monthly".into(),
            vector: None,
            k: 10,
            filter: MemoryFilter::default(),
            consistency: Consistency::default(),
            score_also: Vec::new(),
            rest: 0,
        };
        let hits = vector.search(&request).await.unwrap().hits;
        hits.into_iter().map(|h| h.meta.event_id).collect()
    }

    fn contains(haystack: &[u8], needle: &str) -> bool {
        haystack
            .windows(needle.len())
            .any(|w| w == needle.as_bytes())
    }

    /// The graph subdirectories of the state dir's graph directories.
    fn graph_dirs(dir: &std::path::Path) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(GRAPHS_PREFIX)
            {
                for sub in std::fs::read_dir(entry.path()).unwrap().flatten() {
                    found.push(sub.path());
                }
            }
        }
        found
    }

    #[tokio::test]
    async fn erasing_a_scope_removes_all_of_it_and_only_it() {
        // Given acme/t1 with two memories, one contradicted by an outcome (itself a memory and
        // an applied signal) and then forgotten (so its confidence is kept as withdrawn)...
        let (erased, kept, other_tenant) =
            (key("acme", "t1"), key("acme", "t2"), key("acme2", "t1"));
        let a1 = memory("acme", "t1", "acme t1: the vault key rotates monthly");
        let a2 = memory("acme", "t1", "acme t1: prices doubled overnight");
        let outcome = event(
            "acme",
            "t1",
            EventKind::Outcome,
            "acme t1: prices did not double",
            json!({"success": false, "contradicts": [a2.event_id]}),
        );
        let forget_a2 = forgetting("acme", "t1", &a2.event_id);
        // ...acme/t2 with two memories, and acme2/t1 (same scope id, a tenant whose name
        // starts with acme) with three, one of them forgotten...
        let b1 = memory("acme", "t2", "acme t2: the vault key rotates monthly");
        let b2 = memory("acme", "t2", "acme t2: deploys run on fridays");
        let c1 = memory("acme2", "t1", "acme2 t1: the vault key rotates monthly");
        let c2 = memory("acme2", "t1", "acme2 t1: backups run nightly");
        let c3 = memory("acme2", "t1", "acme2 t1: an old note");
        let forget_c3 = forgetting("acme2", "t1", &c3.event_id);
        let all = [
            a1.clone(),
            a2.clone(),
            outcome.clone(),
            forget_a2,
            b1.clone(),
            b2.clone(),
            c1.clone(),
            c2.clone(),
            c3.clone(),
            forget_c3,
        ];
        let dir = tempfile::tempdir().unwrap();
        let vector = projection(dir.path());
        vector.restore().await.unwrap();
        let events = stored(&all, 1);
        assert!(vector.apply(&events).await.unwrap().is_empty());
        let ledger = ApplyLedger {
            seq: events.last().unwrap().seq,
            ..ApplyLedger::default()
        };
        vector.publish(&ledger).await.unwrap();
        vector.checkpoint(&ledger).await.unwrap();
        assert_eq!(vector.traces(std::slice::from_ref(&erased)).await, 3);
        assert_eq!(vector.traces(std::slice::from_ref(&kept)).await, 2);
        assert_eq!(vector.traces(std::slice::from_ref(&other_tenant)).await, 3);
        assert_eq!(graph_dirs(dir.path()).len(), 3, "each scope has a graph");
        {
            let state = vector.read();
            assert!(state.withdrawn.contains_key(&a2.event_id));
            assert!(state.distrusted.contains(&outcome.event_id));
            assert_eq!(state.forgotten.len(), 2);
        }
        let before = std::fs::read(dir.path().join("vector.snap")).unwrap();
        assert!(contains(&before, "acme t1:") && contains(&before, a2.event_id.as_str()));
        let ours = [&a1, &a2, &outcome].map(|e| e.event_id.clone());

        // When acme/t1 is erased, and the loop publishes and checkpoints...
        let removed = vector.erase(std::slice::from_ref(&erased)).await.unwrap();
        vector.publish(&ledger).await.unwrap();
        vector.checkpoint(&ledger).await.unwrap();

        // ...then it held three events, and nothing of them is left: no memory, vector,
        // index, forgotten id, withdrawn confidence or applied signal...
        assert_eq!(removed, 3);
        assert_eq!(vector.traces(std::slice::from_ref(&erased)).await, 0);
        {
            let state = vector.read();
            assert!(!state.scopes.contains_key(&erased));
            assert!(state.memories.values().all(|m| m.meta.scope != erased));
            assert!(state.withdrawn.is_empty(), "only a2 was withdrawn");
            assert!(state.distrusted.is_empty(), "only the outcome was a signal");
            assert_eq!(
                state.forgotten.iter().collect::<Vec<_>>(),
                [&c3.event_id],
                "acme2's forgotten id stays"
            );
            for id in &ours {
                assert!(!state.event_ids.contains_key(id));
                assert!(!state.id_scopes.contains_key(id));
            }
        }
        // ...the other scopes keep all they had, and searches find nothing only in the erased
        // scope...
        assert_eq!(vector.traces(std::slice::from_ref(&kept)).await, 2);
        assert_eq!(vector.traces(std::slice::from_ref(&other_tenant)).await, 3);
        assert_eq!(
            vector
                .traces(&[erased.clone(), kept.clone(), other_tenant.clone()])
                .await,
            5
        );
        assert!(found(&vector, &erased).await.is_empty());
        assert_eq!(
            found(&vector, &kept).await,
            BTreeSet::from([b1.event_id.clone(), b2.event_id.clone()])
        );
        assert_eq!(
            found(&vector, &other_tenant).await,
            BTreeSet::from([c1.event_id.clone(), c2.event_id.clone()])
        );
        // ...the checkpoint, its graphs and an export hold nothing of it...
        assert_eq!(
            graph_dirs(dir.path()).len(),
            2,
            "the erased scope's graph is gone"
        );
        let checkpoint = std::fs::read(dir.path().join("vector.snap")).unwrap();
        let export = vector.export(&ledger).await.unwrap().unwrap();
        for bytes in [&checkpoint, &export] {
            assert!(!contains(bytes, "acme t1:"));
            assert!(contains(bytes, "acme t2:") && contains(bytes, "acme2 t1:"));
            for id in &ours {
                assert!(!contains(bytes, id.as_str()));
            }
        }
        // ...a restart from the checkpoint brings none of it back...
        let restarted = projection(dir.path());
        assert_eq!(restarted.restore().await.unwrap(), ledger);
        assert_eq!(restarted.state_hash().await, vector.state_hash().await);
        assert_eq!(restarted.traces(std::slice::from_ref(&erased)).await, 0);
        assert_eq!(restarted.traces(std::slice::from_ref(&kept)).await, 2);
        assert_eq!(
            restarted.traces(std::slice::from_ref(&other_tenant)).await,
            3
        );
        assert!(found(&restarted, &erased).await.is_empty());
        assert_eq!(found(&restarted, &kept).await.len(), 2);
        assert_eq!(found(&restarted, &other_tenant).await.len(), 2);
        // ...and erasing again removes nothing, before or after the restart.
        assert_eq!(
            vector.erase(std::slice::from_ref(&erased)).await.unwrap(),
            0
        );
        assert_eq!(restarted.erase(&[erased]).await.unwrap(), 0);
        assert_eq!(restarted.traces(&[kept, other_tenant]).await, 5);
    }
}

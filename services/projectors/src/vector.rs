//! The vector projector: episodic and semantic text memories, embedded and indexed per scope.
//!
//! Which memories there are, and what forgettings, distrust signals and consolidation outputs
//! do to them, is [`engram_text::TextMemories`]' to decide, the same model the keyword index
//! follows; this module embeds and indexes the operations it returns. Vectors come from the
//! event when the client supplied one from the configured model; otherwise the configured
//! embedder makes them (through the embedding cache, so a rebuild does not embed again). A
//! memory the embedder will not take stays in the model without a vector (dead-lettered
//! here, found by keyword), so that what it says and its confidence do not depend on the
//! embedder. One `VectorIndex` per scope keeps scopes apart by construction: a search only
//! ever touches the indexes of the scopes it was given.
//!
//! A batch's vectors are appended to their indexes' flat stores, where searches scan them, and
//! the batch is visible as soon as that is done; linking them into a large scope's HNSW graph
//! (about a millisecond each) happens after, on a thread of its own ([`Linker`]). Applying
//! waits while more than [`MAX_UNLINKED`] vectors are still to link, so the scan stays short.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use engram_bus::StoredEvent;
use engram_embed::Embedder;
use engram_memory::confidence::{Inheritance, Withdrawn};
use engram_memory::proto::{
    MemoryHit, Neighbour, NeighboursRequest, NeighboursResponse, SearchRequest, SearchResponse,
};
use engram_memory::{Hit, ScopeKey, Seq};
use engram_projection_runtime::{ApplyLedger, Projection, ProjectionError, Rejected, snapshot};
use engram_rpc::Failure;
use engram_schema::EventId;
use engram_telemetry::metrics;
use engram_text::{IndexOp, Parts, TextMemories};
use engram_vector::{HnswParams, RowLayout, VectorIndex};
use serde::{Deserialize, Serialize};

pub use engram_text::Memory;

pub const NAME: &str = engram_memory::proto::read_models::VECTOR;

/// Vectors linked into a graph per hold of the state's write lock: about 30 ms of graph work
/// on two cores, the longest a search waits behind the linker.
const INSERT_CHUNK: usize = 64;

/// The most vectors left for the linker before applying waits for it: what a search of a
/// large scope scans besides its graph walk (4,096 dot products of 384 dimensions: well under
/// a millisecond).
const MAX_UNLINKED: usize = 4_096;

#[derive(Default)]
struct State {
    /// The memories and what the stream did to them; the indexes follow it.
    text: TextMemories,
    /// The last sequence whose batch is wholly indexed: what searches report visible. The
    /// model moves ahead of it while a batch's vectors are still being inserted.
    visible: Seq,
    scopes: HashMap<ScopeKey, VectorIndex>,
    /// Scopes whose index has vectors waiting for its graph ([`Linker`]).
    unlinked: HashSet<ScopeKey>,
}

impl State {
    fn vector(&self, memory: &Memory) -> Option<&[f32]> {
        self.scopes.get(&memory.meta.scope)?.vector(memory.meta.seq)
    }
}

/// A checkpoint's model, and an exported snapshot's (without graphs). Written as
/// [`SnapshotOut`], which must keep its fields in this order.
#[derive(Deserialize)]
struct Snapshot {
    model: String,
    dim: usize,
    /// Every memory, with its vector; an empty one for a memory the embedder did not take.
    memories: Vec<(Memory, Floats)>,
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
    /// An exported snapshot's graphs, as hnsw_rs dumps them: the importing replica loads
    /// them instead of building them from the vectors. Empty in a checkpoint, whose graphs
    /// are files in the state dir.
    #[serde(default)]
    graph_dumps: Vec<GraphDump>,
}

/// One scope's graph, as hnsw_rs dumps it, carried in an exported snapshot: a build takes
/// minutes per hundred thousand vectors on two cores, reading a dump back seconds.
#[derive(Serialize, Deserialize)]
struct GraphDump {
    /// The scope's place in [`Snapshot::scopes`].
    scope: usize,
    #[serde(with = "serde_bytes")]
    graph: Vec<u8>,
    #[serde(with = "serde_bytes")]
    data: Vec<u8>,
}

/// [`Snapshot`] as it is written: borrowed from the state, so that a checkpoint or an export
/// encodes every vector where it is instead of copying them all first. Structs are encoded
/// as arrays, so the fields are [`Snapshot`]'s, in its order.
#[derive(Serialize)]
struct SnapshotOut<'a> {
    model: &'a str,
    dim: usize,
    memories: MemoriesOut<'a>,
    forgotten: &'a std::collections::BTreeSet<EventId>,
    scopes: Vec<SavedScope>,
    graphs: Option<&'a str>,
    distrusted: &'a std::collections::BTreeSet<EventId>,
    withdrawn: &'a Withdrawn,
    id_scopes: &'a BTreeMap<EventId, ScopeKey>,
    graph_dumps: &'a [GraphDump],
}

/// Every memory with its vector (empty when it has none), in sequence order:
/// `Snapshot::memories`.
struct MemoriesOut<'a>(&'a State);

impl Serialize for MemoriesOut<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let state = self.0;
        // MessagePack writes the length first.
        let mut seq = serializer.serialize_seq(Some(state.text.len()))?;
        for memory in state.text.memories() {
            seq.serialize_element(&(memory, FloatsOut(state.vector(memory).unwrap_or(&[]))))?;
        }
        seq.end()
    }
}

/// A vector as it is written: its floats' little-endian bytes, one MessagePack bin. An array
/// of floats costs five bytes and a parse per float; a million 384-d vectors made a snapshot
/// a fifth larger and its import several times slower.
struct FloatsOut<'a>(&'a [f32]);

impl Serialize for FloatsOut<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut bytes = Vec::with_capacity(self.0.len() * 4);
        for x in self.0 {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        serializer.serialize_bytes(&bytes)
    }
}

/// A vector as it is read: the bin [`FloatsOut`] writes, or the array of floats checkpoints
/// held before it.
struct Floats(Vec<f32>);

impl<'de> Deserialize<'de> for Floats {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Floats;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a vector: little-endian f32 bytes or an array of floats")
            }
            fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Floats, E> {
                if !bytes.len().is_multiple_of(4) {
                    return Err(E::invalid_length(bytes.len(), &"a multiple of 4 bytes"));
                }
                Ok(Floats(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                ))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Floats, A::Error> {
                // Bounded by the blob, which was checked whole before decoding.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4_096));
                while let Some(x) = seq.next_element::<f32>()? {
                    out.push(x);
                }
                Ok(Floats(out))
            }
        }
        deserializer.deserialize_any(Visit)
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
    ) -> Result<(Self, (usize, usize)), ProjectionError> {
        let dim = snap.dim;
        let corrupt =
            |e: engram_vector::VectorError| ProjectionError::Fatal(format!("{what}: {e}"));
        let mut grouped: HashMap<ScopeKey, Vec<(Seq, Vec<f32>)>> = HashMap::new();
        let mut memories = Vec::with_capacity(snap.memories.len());
        for (memory, Floats(vector)) in snap.memories {
            if !vector.is_empty() {
                grouped
                    .entry(memory.meta.scope.clone())
                    .or_default()
                    .push((memory.meta.seq, vector));
            }
            memories.push(memory);
        }
        let mut state = State {
            text: TextMemories::from_parts(Parts {
                applied: ledger.seq,
                memories,
                forgotten: snap.forgotten.into_iter().collect(),
                distrusted: snap.distrusted.into_iter().collect(),
                withdrawn: snap.withdrawn,
                id_scopes: snap.id_scopes,
            }),
            scopes: HashMap::new(),
            visible: ledger.seq,
            unlinked: HashSet::new(),
        };
        let writer_unknown = state
            .text
            .memories()
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
            memories = state.text.len(),
            graphs_loaded = loaded,
            graphs_built = built,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "{what} restored"
        );
        Ok((state, (loaded, built)))
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
        graph_dumps: &[GraphDump],
    ) -> Result<Vec<u8>, ProjectionError> {
        snapshot::encode(
            applied,
            &SnapshotOut {
                model,
                dim,
                memories: MemoriesOut(self),
                forgotten: self.text.forgotten(),
                scopes,
                graphs,
                distrusted: self.text.distrusted(),
                withdrawn: self.text.withdrawn(),
                id_scopes: self.text.id_scopes(),
                graph_dumps,
            },
        )
    }
}

/// Writes a snapshot's graph dumps into a fresh graphs directory of `dir`, each scope's in
/// the subdirectory a checkpoint would use; its name, or `None` when there are none.
fn write_graph_dumps(
    dir: &std::path::Path,
    seq: Seq,
    dumps: Vec<GraphDump>,
) -> Result<Option<String>, ProjectionError> {
    if dumps.is_empty() {
        return Ok(None);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = format!("{GRAPHS_PREFIX}{seq}-{nanos}");
    for dump in dumps {
        let sub = dir.join(&name).join(dump.scope.to_string());
        let io = |e: std::io::Error| {
            ProjectionError::Transient(format!("vector import: writing {}: {e}", sub.display()))
        };
        std::fs::create_dir_all(&sub).map_err(io)?;
        std::fs::write(sub.join("graph.hnsw.graph"), &dump.graph).map_err(io)?;
        std::fs::write(sub.join("graph.hnsw.data"), &dump.data).map_err(io)?;
    }
    Ok(Some(name))
}

/// Graph directories are named by the checkpoint: `vector-graphs-<seq>-<unix nanos>`.
const GRAPHS_PREFIX: &str = "vector-graphs-";

pub struct VectorProjection {
    dir: PathBuf,
    path: PathBuf,
    embedder: Arc<dyn Embedder>,
    params: HnswParams,
    state: Arc<RwLock<State>>,
    linker: Arc<Linker>,
    /// Graphs the last restore or import loaded from dumps and built from vectors.
    graphs_restored: Arc<std::sync::Mutex<(usize, usize)>>,
}

impl VectorProjection {
    /// How many graphs the last restore or import loaded from dumps, and how many it built
    /// from the vectors (minutes per hundred thousand).
    pub fn graphs_restored(&self) -> (usize, usize) {
        *self
            .graphs_restored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub fn new(dir: impl Into<PathBuf>, embedder: Arc<dyn Embedder>, params: HnswParams) -> Self {
        let dir = dir.into();
        let state: Arc<RwLock<State>> = Arc::default();
        Self {
            path: dir.join("vector.snap"),
            dir,
            embedder,
            params,
            linker: Arc::new(Linker::start(state.clone())),
            state,
            graphs_restored: Arc::default(),
        }
    }

    /// Vectors appended and not yet linked into their scopes' graphs, for status and tests.
    pub fn unlinked(&self) -> usize {
        unlinked_count(&self.read())
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
        self.read().text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Approximate bytes held by the indexes and memory table.
    pub fn memory_bytes(&self) -> usize {
        let state = self.read();
        let indexes: usize = state.scopes.values().map(VectorIndex::memory_bytes).sum();
        let table: usize = state
            .text
            .memories()
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
        visible_seq = state.visible;
        let candidate = |seq: Seq| {
            state.text.get(seq).is_some_and(|m| {
                m.meta.scope == request.scope
                    && !m.meta.tags.iter().any(|t| t == engram_memory::SUMMARY_TAG)
            })
        };
        let (Some(seq), Some(index)) = (state.text.seq_of(id), state.scopes.get(&request.scope))
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
            if let Some(b) = state.text.get(hit.seq) {
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
            .text
            .get(seq)
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
        let Some(memory) = state.text.get(*seq) else {
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
                state.text.get(hit.seq).map(|m| MemoryHit {
                    hit,
                    meta: m.meta.clone(),
                    text: m.text.clone(),
                })
            })
            .collect(),
        also,
        visible_seq: state.visible,
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
        let (state, graphs) = state;
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
        *self
            .graphs_restored
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = graphs;
        Ok(ledger)
    }

    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        let (model, dim) = (self.embedder.model_id().to_owned(), self.embedder.dim());
        // The vector of each memory the batch adds, by its index in the batch: the client's
        // when usable, else the embedder's (or why it refused the text). Worked out before
        // the model changes, so that an embedder outage leaves the batch to be retried whole.
        let mut vectors: HashMap<usize, Result<Vec<f32>, String>> = HashMap::new();
        let mut to_embed: Vec<usize> = Vec::new();
        {
            let state = self.read();
            let mut seen = HashSet::new();
            for (index, stored) in events.iter().enumerate() {
                let event = &stored.event;
                if stored.seq <= state.text.applied()
                    || !state.text.wants(event)
                    || !seen.insert(&event.event_id)
                {
                    continue;
                }
                let supplied = event
                    .embedding
                    .as_ref()
                    .filter(|e| e.model == model && e.vector.len() == dim);
                match supplied {
                    Some(e) => {
                        vectors.insert(index, Ok(e.vector.clone()));
                    }
                    None => to_embed.push(index),
                }
            }
        }
        metrics::EMBEDDINGS
            .with_label_values(&["client"])
            .inc_by(vectors.len() as u64);
        if !to_embed.is_empty() {
            let texts: Vec<String> = to_embed
                .iter()
                .map(|&i| events[i].event.content.text.clone())
                .collect();
            let embedded = match self.embedder.embed(&texts).await {
                Ok(vectors) => vectors.into_iter().map(Ok).collect(),
                Err(e) if !e.is_input_fault() => {
                    // An embedder outage (a key, model or url to fix, a server down) is no
                    // event's fault: the batch waits and retries rather than dead-letters.
                    return Err(ProjectionError::Transient(format!("embedding failed: {e}")));
                }
                // Some text cannot be embedded as it is (too long, vectors required from
                // clients): embed one at a time, and only the texts refused alone go without.
                Err(e) if texts.len() == 1 => vec![Err(e.to_string())],
                Err(_) => embed_each(self.embedder.as_ref(), &texts).await?,
            };
            if embedded.len() != to_embed.len() {
                return Err(ProjectionError::Transient(
                    "embedder returned too few vectors".into(),
                ));
            }
            vectors.extend(to_embed.into_iter().zip(embedded));
        }
        let events = events.to_vec();
        let (state, params, linker) =
            (self.state.clone(), self.params.clone(), self.linker.clone());
        // Off the async threads: a batch may wait for the linker, and a compaction rebuilds a
        // graph.
        let mut rejected = tokio::task::spawn_blocking(move || {
            linker.wait_below(&state, MAX_UNLINKED);
            let mut rejected = Vec::new();
            let mut pending: Vec<Pending> = Vec::new();
            let mut worn: HashSet<ScopeKey> = HashSet::new();
            for (index, stored) in events.iter().enumerate() {
                let applied = state
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .text
                    .apply(stored.seq, &stored.event);
                let applied = match applied {
                    Ok(applied) => applied,
                    Err(e) => {
                        rejected.push(Rejected {
                            index,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                };
                for op in applied.ops {
                    match op {
                        IndexOp::Index { seq, inherits } => {
                            let vector = match vectors.remove(&index) {
                                Some(Ok(vector)) => vector,
                                refused => {
                                    // A consolidation output the embedder will not take
                                    // (vectors come from clients, and the consolidator is
                                    // none) gets one from its sources, as the events before
                                    // it left them: pending ones are inserted first.
                                    let derived = inherits.as_ref().and_then(|inherits| {
                                        insert_chunk(&state, dim, &params, &mut pending, &mut rejected);
                                        from_sources(&state, inherits)
                                    });
                                    match (derived, refused) {
                                        (Some(vector), _) => vector,
                                        (None, Some(Err(reason))) if inherits.is_none() => {
                                            rejected.push(Rejected { index, reason });
                                            continue;
                                        }
                                        (None, _) => {
                                            rejected.push(Rejected {
                                                index,
                                                reason: "no vector: the embedder takes vectors from clients only, and none of this consolidation output's sources has one here".into(),
                                            });
                                            continue;
                                        }
                                    }
                                }
                            };
                            pending.push((index, seq, ScopeKey::of(&stored.event), vector));
                            if pending.len() == INSERT_CHUNK {
                                insert_chunk(&state, dim, &params, &mut pending, &mut rejected);
                            }
                        }
                        IndexOp::Unindex { seq, scope, .. } => {
                            insert_chunk(&state, dim, &params, &mut pending, &mut rejected);
                            if unindex(&state, &scope, seq) {
                                worn.insert(scope);
                            }
                        }
                        // Confidences live in the model, which searches filter on.
                        IndexOp::Reweight { .. } => {}
                    }
                }
            }
            insert_chunk(&state, dim, &params, &mut pending, &mut rejected);
            for scope in worn {
                compact(&state, dim, &params, &scope);
            }
            if let Some(last) = events.last() {
                let mut state = state.write().unwrap_or_else(|p| p.into_inner());
                state.text.advance_to(last.seq);
                // Searches report this batch visible only now, with every vector stored.
                state.visible = state.text.applied();
            }
            linker.wake();
            rejected
        })
        .await
        .map_err(|e| ProjectionError::Fatal(format!("vector insert task: {e}")))?;
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
                (
                    state.encode(&applied, &model, dim, scopes, saved, &[])?,
                    saved,
                )
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

    /// The checkpoint's content with every scope's graph as hnsw_rs dumps it: the importing
    /// replica neither embeds the memories again nor builds their graphs, the two slow parts
    /// of a replay. Encoded from the state under its read lock; the graphs are dumped
    /// through a scratch directory first.
    async fn export(&self, applied: &ApplyLedger) -> Result<Option<Vec<u8>>, ProjectionError> {
        let (state, model, dim, applied) = (
            self.state.clone(),
            self.embedder.model_id().to_owned(),
            self.embedder.dim(),
            *applied,
        );
        tokio::task::spawn_blocking(move || {
            let io = |what: &str, e: std::io::Error| {
                ProjectionError::Transient(format!("vector export: {what}: {e}"))
            };
            let scratch = tempfile::tempdir().map_err(|e| io("a scratch dir", e))?;
            let state = state.read().unwrap_or_else(|p| p.into_inner());
            let (mut scopes, mut dumps) = (Vec::new(), Vec::new());
            for (i, (scope, index)) in state.scopes.iter().enumerate() {
                let mut graph = None;
                if index.has_graph() {
                    let sub = scratch.path().join(i.to_string());
                    std::fs::create_dir_all(&sub).map_err(|e| io("a scratch dir", e))?;
                    if index.save_graph(&sub).map_err(|e| io("dump a graph", e))? {
                        let read = |suffix: &str| {
                            std::fs::read(sub.join(format!("graph.{suffix}")))
                                .map_err(|e| io("read a graph dump", e))
                        };
                        dumps.push(GraphDump {
                            scope: i,
                            graph: read("hnsw.graph")?,
                            data: read("hnsw.data")?,
                        });
                        graph = Some(i);
                    }
                }
                scopes.push(SavedScope {
                    scope: scope.clone(),
                    layout: index.layout(),
                    graph,
                });
            }
            state
                .encode(&applied, &model, dim, scopes, None, &dumps)
                .map(Some)
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))?
    }

    /// Checks the blob, its model and dimension against this replica's embedder, and builds
    /// the state from it as [`restore`](Projection::restore) does from a checkpoint (graphs
    /// loaded from the dumps it carries). Until the state is built, nothing is replaced.
    /// No checkpoint here: the runtime makes one after the tail (a bootstrap) or after its
    /// next events, and a restart before then imports the same snapshot again. Encoding
    /// the whole state once more took as long as decoding it.
    async fn import(&self, bytes: &[u8]) -> Result<ApplyLedger, ProjectionError> {
        let bytes = bytes.to_vec();
        let (ledger, mut snap) = tokio::task::spawn_blocking(move || {
            snapshot::decode::<Snapshot>(&bytes, "the vector snapshot", NAME)
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        self.check_embedder(&snap, "the vector snapshot")?;
        let (params, dir) = (self.params.clone(), self.dir.clone());
        let state = tokio::task::spawn_blocking(move || {
            // The graphs it carries, written where a checkpoint's would be, and loaded from
            // there; a directory it names is another replica's, never ours.
            snap.graphs =
                write_graph_dumps(&dir, ledger.seq, std::mem::take(&mut snap.graph_dumps))?;
            if snap.graphs.is_none() {
                for scope in &mut snap.scopes {
                    scope.graph = None;
                }
            }
            State::restore(snap, &ledger, params, Some(&dir), "vector snapshot")
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        let (state, graphs) = state;
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
        *self
            .graphs_restored
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = graphs;
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
        state.text.hash_into(&mut hasher, |memory, hasher| {
            for x in state.vector(memory).unwrap_or(&[]) {
                hasher.update(&x.to_le_bytes());
            }
        });
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
    /// forgotten, and distrust signals applied ([`TextMemories::held`]).
    async fn traces(&self, keys: &[ScopeKey]) -> u64 {
        let keys: HashSet<ScopeKey> = keys.iter().cloned().collect();
        // A scan of the memory table under the read lock: searches go on meanwhile, and
        // verification asks this once per erasure.
        self.read().text.held(&keys).events
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

/// A vector waiting for its chunk: the batch index of its event, its memory's sequence and
/// scope.
type Pending = (usize, Seq, ScopeKey, Vec<f32>);

/// Appends the pending vectors to their indexes' flat stores under one hold of the write lock
/// (searchable at once; the [`Linker`] links them into graphs), and empties `pending`; a
/// vector the index refuses goes to `rejected` (its memory stays, without a vector).
fn insert_chunk(
    state: &RwLock<State>,
    dim: usize,
    params: &HnswParams,
    pending: &mut Vec<Pending>,
    rejected: &mut Vec<Rejected>,
) {
    if pending.is_empty() {
        return;
    }
    let mut state = state.write().unwrap_or_else(|p| p.into_inner());
    let mut by_scope: HashMap<&ScopeKey, Vec<usize>> = HashMap::new();
    for (i, (_, _, scope, _)) in pending.iter().enumerate() {
        by_scope.entry(scope).or_default().push(i);
    }
    for (scope, members) in by_scope {
        let index = state.scopes.entry(scope.clone()).or_insert_with(|| {
            VectorIndex::new(dim, params.clone()).expect("hnsw params are validated at start-up")
        });
        let items: Vec<(Seq, &[f32])> = members
            .iter()
            .map(|&i| (pending[i].1, pending[i].3.as_slice()))
            .collect();
        for (&i, result) in members.iter().zip(index.append_many(&items)) {
            if let Err(e) = result {
                rejected.push(Rejected {
                    index: pending[i].0,
                    reason: format!("unusable vector: {e}"),
                });
            }
        }
        if index.pending_links() > 0 {
            state.unlinked.insert(scope.clone());
        }
    }
    pending.clear();
}

/// Vectors waiting for their graphs, over every scope that has some.
fn unlinked_count(state: &State) -> usize {
    state
        .unlinked
        .iter()
        .filter_map(|scope| state.scopes.get(scope))
        .map(VectorIndex::pending_links)
        .sum()
}

/// Links appended vectors into their scopes' graphs on a thread of its own (see the module
/// docs), a chunk per hold of the write lock. It ends when its projection is dropped.
struct Linker {
    wake: std::sync::mpsc::SyncSender<()>,
    /// Notified after every chunk, for an apply waiting on [`MAX_UNLINKED`].
    progress: Arc<(std::sync::Mutex<()>, std::sync::Condvar)>,
}

impl Linker {
    fn start(state: Arc<RwLock<State>>) -> Self {
        let (wake, woken) = std::sync::mpsc::sync_channel::<()>(1);
        let progress = Arc::new((std::sync::Mutex::new(()), std::sync::Condvar::new()));
        let notify = progress.clone();
        std::thread::Builder::new()
            .name("vector-linker".into())
            .spawn(move || {
                while woken.recv().is_ok() {
                    link_all(&state, &notify);
                }
            })
            .expect("the vector linker thread starts");
        Self { wake, progress }
    }

    fn wake(&self) {
        // A full channel means a wake-up is already pending; it links everything.
        let _ = self.wake.try_send(());
    }

    /// Blocks while more than `max` vectors wait for the linker.
    fn wait_below(&self, state: &RwLock<State>, max: usize) {
        loop {
            let waiting = unlinked_count(&state.read().unwrap_or_else(|p| p.into_inner()));
            if waiting <= max {
                return;
            }
            self.wake();
            let (lock, signal) = &*self.progress;
            let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
            // A timeout, not a bare wait: a chunk may finish between the count and the wait.
            let _ = signal.wait_timeout(guard, std::time::Duration::from_millis(20));
        }
    }
}

/// Links every scope's waiting vectors, a chunk per hold of the write lock.
fn link_all(state: &RwLock<State>, progress: &(std::sync::Mutex<()>, std::sync::Condvar)) {
    loop {
        let next = state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .unlinked
            .iter()
            .next()
            .cloned();
        let Some(scope) = next else {
            return;
        };
        {
            let mut state = state.write().unwrap_or_else(|p| p.into_inner());
            let done = match state.scopes.get_mut(&scope) {
                Some(index) => {
                    index.link_pending(INSERT_CHUNK);
                    index.pending_links() == 0
                }
                None => true,
            };
            if done {
                state.unlinked.remove(&scope);
            }
        }
        progress.1.notify_all();
    }
}

/// Removes forgotten memory `seq` from its scope's index; returns whether the index now
/// wants a rebuild.
fn unindex(state: &RwLock<State>, scope: &ScopeKey, seq: Seq) -> bool {
    let mut state = state.write().unwrap_or_else(|p| p.into_inner());
    metrics::PROJECTOR_FORGOTTEN
        .with_label_values(&[NAME])
        .inc();
    state.scopes.get_mut(scope).is_some_and(|index| {
        index.remove(seq);
        index.wants_rebuild()
    })
}

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
        let Some(vector) = state.text.seq_of(id).and_then(|seq| index.vector(seq)) else {
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

/// Removes everything of the scopes `keys` ([`Projection::erase`]); returns the events
/// removed, as [`TextMemories::held`] counts them. Nothing writes meanwhile, because the loop
/// erases between batches. The indexes taken out are freed after the write lock is
/// released: a large graph takes a while.
fn erase_scopes(state: &RwLock<State>, keys: &HashSet<ScopeKey>) -> u64 {
    let (erased, indexes) = {
        let mut state = state.write().unwrap_or_else(|p| p.into_inner());
        let erased = state.text.erase(keys);
        state.unlinked.retain(|k| !keys.contains(k));
        let indexes: Vec<VectorIndex> =
            keys.iter().filter_map(|k| state.scopes.remove(k)).collect();
        (erased, indexes)
    };
    if erased.unattributed > 0 {
        tracing::warn!(
            ids = erased.unattributed,
            "forgotten memories' and applied signals' ids restored from a checkpoint older than their scopes cannot be attributed to a scope; those of the erased scopes stay, without text or vector"
        );
    }
    tracing::debug!(
        scopes = keys.len(),
        memories = erased.seqs.len(),
        events = erased.events,
        indexes = indexes.len(),
        "vector scopes erased"
    );
    drop(indexes);
    erased.events
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
        shared: &crate::Shared,
    ) -> Result<Arc<VectorProjection>, crate::StartError> {
        // One embedder (and cache) for every partition's vector model.
        let embedder = shared.embedder(config).await?;
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
    use std::collections::BTreeSet;

    use engram_schema::{Envelope, EventKind, Ident, ScopeKind};
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
        // Graphs are linked off the apply path: the checkpoint saves those linked by then.
        engram_testkit::wait_until(
            "the linker to finish",
            std::time::Duration::from_secs(60),
            || {
                let n = vector.unlinked();
                async move { n == 0 }
            },
        )
        .await;
        vector.checkpoint(&ledger).await.unwrap();
        assert_eq!(vector.traces(std::slice::from_ref(&erased)).await, 3);
        assert_eq!(vector.traces(std::slice::from_ref(&kept)).await, 2);
        assert_eq!(vector.traces(std::slice::from_ref(&other_tenant)).await, 3);
        assert_eq!(graph_dirs(dir.path()).len(), 3, "each scope has a graph");
        {
            let state = vector.read();
            assert!(state.text.withdrawn().contains_key(&a2.event_id));
            assert!(state.text.distrusted().contains(&outcome.event_id));
            assert_eq!(state.text.forgotten().len(), 2);
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
            assert!(state.text.memories().all(|m| m.meta.scope != erased));
            assert!(state.text.withdrawn().is_empty(), "only a2 was withdrawn");
            assert!(
                state.text.distrusted().is_empty(),
                "only the outcome was a signal"
            );
            assert_eq!(
                state.text.forgotten().iter().collect::<Vec<_>>(),
                [&c3.event_id],
                "acme2's forgotten id stays"
            );
            for id in &ours {
                assert!(state.text.seq_of(id).is_none());
                assert!(!state.text.id_scopes().contains_key(id));
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exported_snapshot_carries_its_graphs_and_an_import_loads_them() {
        // Given a scope with a graph (exact below 2), linked
        let dir = tempfile::tempdir().unwrap();
        let vector = projection(dir.path());
        vector.restore().await.unwrap();
        let events: Vec<Envelope> = (0..200)
            .map(|i| memory("acme", "t1", &format!("memory {i} of the vault")))
            .collect();
        let batch = stored(&events, 1);
        assert!(vector.apply(&batch).await.unwrap().is_empty());
        let ledger = ApplyLedger {
            seq: 200,
            ..ApplyLedger::default()
        };
        vector.publish(&ledger).await.unwrap();
        engram_testkit::wait_until(
            "the linker to finish",
            std::time::Duration::from_secs(60),
            || {
                let n = vector.unlinked();
                async move { n == 0 }
            },
        )
        .await;
        // When it is exported and imported by a replica with nothing on disk
        let export = vector.export(&ledger).await.unwrap().unwrap();
        let replica_dir = tempfile::tempdir().unwrap();
        let replica = projection(replica_dir.path());
        replica.restore().await.unwrap();
        assert_eq!(replica.import(&export).await.unwrap(), ledger);
        // Then the replica loaded the graph it carried rather than building one, and answers
        // as the original does
        assert_eq!(replica.graphs_restored(), (1, 0));
        assert_eq!(replica.state_hash().await, vector.state_hash().await);
        let scope = key("acme", "t1");
        assert_eq!(found(&replica, &scope).await, found(&vector, &scope).await);
        // And its own checkpoint (the runtime makes one after the tail), restarted from,
        // loads the graph too.
        replica.checkpoint(&ledger).await.unwrap();
        let restarted = projection(replica_dir.path());
        assert_eq!(restarted.restore().await.unwrap(), ledger);
        assert_eq!(restarted.graphs_restored(), (1, 0));
    }

    #[test]
    fn vectors_are_written_as_bytes_and_read_from_bytes_or_float_arrays() {
        let v = vec![0.25f32, -1.5, f32::MIN_POSITIVE, 3.0e7];
        let written = rmp_serde::to_vec(&FloatsOut(&v)).unwrap();
        // A bin of 16 bytes: a 2-byte header and the floats' little-endian bytes.
        assert_eq!(written.len(), 2 + 4 * v.len());
        let Floats(read) = rmp_serde::from_slice(&written).unwrap();
        assert_eq!(read, v);
        // Checkpoints written before held arrays of floats.
        let Floats(old) = rmp_serde::from_slice(&rmp_serde::to_vec(&v).unwrap()).unwrap();
        assert_eq!(old, v);
        // A bin that is no whole number of floats is refused.
        let torn = rmp_serde::to_vec(&serde_bytes::Bytes::new(&[1, 2, 3, 4, 5])).unwrap();
        assert!(rmp_serde::from_slice::<Floats>(&torn).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_is_searchable_when_applied_and_its_graph_links_follow_without_loss() {
        use engram_fixtures::synthetic::{Mixture, MixtureSpec};
        use rand::SeedableRng;

        // Given a scope with a graph (exact below 2), clustered client vectors (what a graph
        // can be walked on), and a batch of memories applied at once
        let dir = tempfile::tempdir().unwrap();
        let dim = 32;
        let open = |dir: &std::path::Path| {
            let params = HnswParams {
                exact_below: 2,
                ..HnswParams::default()
            };
            VectorProjection::new(dir, Arc::new(HashEmbedder::new(dim)), params)
        };
        let vector = open(dir.path());
        vector.restore().await.unwrap();
        let scope = key("acme", "t1");
        let mixture = Mixture::new(
            MixtureSpec {
                dim,
                clusters: 6,
                ..MixtureSpec::default()
            },
            7,
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let with_vector = |i: usize, rng: &mut rand::rngs::StdRng| {
            let mut e = memory("acme", "t1", &format!("memory {i}"));
            e.embedding = Some(engram_schema::Embedding {
                model: format!("hash-{dim}"),
                vector: mixture.sample(rng),
            });
            e
        };
        let events: Vec<Envelope> = (0..300).map(|i| with_vector(i, &mut rng)).collect();
        let batch = stored(&events, 1);
        assert!(vector.apply(&batch).await.unwrap().is_empty());
        let find = |e: &Envelope| SearchRequest {
            scopes: vec![scope.clone()],
            query: e.content.text.clone(),
            vector: e.embedding.as_ref().map(|v| v.vector.clone()),
            k: 1,
            filter: MemoryFilter::default(),
            consistency: Consistency::default(),
            score_also: Vec::new(),
            rest: 0,
        };
        // Then each memory is its own best match as soon as apply returns, linked or not
        for e in events.iter().step_by(37) {
            let hits = vector.search(&find(e)).await.unwrap().hits;
            assert_eq!(hits[0].meta.event_id, e.event_id, "{}", e.content.text);
        }
        // And the linker links them all, after which the answers are the same
        engram_testkit::wait_until(
            "the linker to finish",
            std::time::Duration::from_secs(60),
            || {
                let n = vector.unlinked();
                async move { n == 0 }
            },
        )
        .await;
        for e in events.iter().step_by(37) {
            let hits = vector.search(&find(e)).await.unwrap().hits;
            assert_eq!(hits[0].meta.event_id, e.event_id);
        }
        // And a checkpoint taken with vectors still unlinked restores every one of them
        let more: Vec<Envelope> = (300..350).map(|i| with_vector(i, &mut rng)).collect();
        assert!(vector.apply(&stored(&more, 301)).await.unwrap().is_empty());
        let ledger = ApplyLedger {
            seq: 350,
            ..ApplyLedger::default()
        };
        vector.checkpoint(&ledger).await.unwrap();
        let restored = open(dir.path());
        assert_eq!(restored.restore().await.unwrap().seq, 350);
        assert_eq!(restored.unlinked(), 0);
        assert_eq!(restored.len(), 350);
        for e in more.iter().step_by(7) {
            let hits = restored.search(&find(e)).await.unwrap().hits;
            assert_eq!(hits[0].meta.event_id, e.event_id);
        }
    }
}

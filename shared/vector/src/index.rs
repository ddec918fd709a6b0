//! [`VectorIndex`]: one scope's vectors, an exact flat store plus, for large scopes, an HNSW
//! graph over it.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::time::Instant;

use engram_memory::{Hit, Seq};
use hnsw_rs::prelude::{FilterT, Hnsw, Neighbour};
use tracing::debug;

use crate::kernel::{UnitCosine, dot, push_unit};
use crate::{HnswParams, VectorError};

/// hnsw_rs's own ceiling on layers. With 16 links a node reaches layer `l` with probability
/// 16^-l, so 16 layers is never the limit.
const GRAPH_LAYERS: usize = 16;

/// Below this many vectors a graph is built by serial inserts: rayon's per-task overhead is
/// not worth paying (hnsw_rs suggests about 1000 per thread).
const PARALLEL_BUILD_MIN: usize = 4_096;

/// Fewer new vectors than this are linked into the graph one by one, more in parallel.
const PARALLEL_INSERT_MIN: usize = 8;

/// A filter allowing at most 1/this of a scope is answered by a scan, never by a filtered
/// graph search.
const SCAN_BELOW_SHARE: usize = 20;

/// How many live vectors a selective filter is tried on to estimate how many it allows.
const FILTER_SAMPLE: usize = 1_024;

/// The vectors of one scope, keyed by stream sequence, searchable by cosine similarity.
///
/// Vectors are normalised on the way in and kept in one contiguous array (the *flat store*),
/// which exact search scans. Once the scope holds [`HnswParams::exact_below`] live vectors,
/// an HNSW graph over the same rows answers searches approximately; below that, and for
/// filters that allow few vectors, search stays exact.
///
/// Linking a vector into the graph costs about a thousand distance computations, so a caller
/// that wants a vector searchable at once [`append_many`](Self::append_many)s it: the row is in
/// the flat store, and searches scan the rows not yet linked beside the graph walk, until
/// [`link_pending`](Self::link_pending) links them (the vector projector does that off its apply
/// path).
///
/// hnsw_rs cannot delete, so [`remove`](Self::remove) leaves a tombstone: the row stays in
/// the store and the graph but is never returned. [`maybe_rebuild`](Self::maybe_rebuild)
/// compacts both once tombstones pass [`HnswParams::rebuild_tombstone_ratio`].
///
/// The index is `Send + Sync` and searching takes `&self`, so any number of threads can
/// search one index at once (behind an `Arc<RwLock<_>>`, say); changes take `&mut self`.
pub struct VectorIndex {
    /// Length of every stored and query vector; fixed at creation.
    pub(crate) dim: usize,
    pub(crate) params: HnswParams,
    /// Unit vectors, row after row: row `r` is `vectors[r * dim..(r + 1) * dim]`. Rows are
    /// appended by inserts and only dropped by a rebuild, so they stay valid graph data ids.
    pub(crate) vectors: Vec<f32>,
    /// The sequence of each row.
    pub(crate) seqs: Vec<Seq>,
    /// Whether each row is live; false once its sequence was removed (a tombstone).
    pub(crate) live: Vec<bool>,
    /// The row of each live sequence.
    pub(crate) rows: HashMap<Seq, usize>,
    /// Whether rows are in ascending sequence order, as when a projector inserts in stream
    /// order; `iter` sorts only when they are not.
    pub(crate) rows_in_seq_order: bool,
    /// HNSW over rows (data id = row). `None` until the live count first reaches
    /// `exact_below`, and again after a rebuild that leaves fewer than that.
    pub(crate) graph: Option<Hnsw<'static, f32, UnitCosine>>,
    /// With a graph: rows below this are linked into it (or tombstones), rows from it on are
    /// searched by scan until linked. Without one it has no meaning.
    pub(crate) linked: usize,
}

// The query service shares indexes across tasks; fail the build, not the deployment, if a
// dependency upgrade ever breaks this.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<VectorIndex>();
};

impl fmt::Debug for VectorIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VectorIndex")
            .field("dim", &self.dim)
            .field("params", &self.params)
            .field("len", &self.len())
            .field("live_len", &self.live_len())
            .field("has_graph", &self.has_graph())
            .finish()
    }
}

impl VectorIndex {
    /// An empty index for vectors of `dim` components.
    pub fn new(dim: usize, params: HnswParams) -> Result<Self, VectorError> {
        if dim == 0 {
            return Err(VectorError::InvalidParams(
                "dimension is 0, vectors need at least one component".into(),
            ));
        }
        params.validate()?;
        Ok(Self {
            dim,
            params,
            vectors: Vec::new(),
            seqs: Vec::new(),
            live: Vec::new(),
            rows: HashMap::new(),
            rows_in_seq_order: true,
            graph: None,
            linked: 0,
        })
    }

    /// Rebuilds an index from `(seq, vector)` pairs, for instance another index's
    /// [`iter`](Self::iter) saved in a snapshot. Duplicate sequences keep their first vector.
    /// A large index gets its graph from a parallel build, which is not deterministic: the
    /// restored index finds the same exact results, and approximate ones of the same quality.
    pub fn from_vectors<I, V>(
        dim: usize,
        params: HnswParams,
        vectors: I,
    ) -> Result<Self, VectorError>
    where
        I: IntoIterator<Item = (Seq, V)>,
        V: AsRef<[f32]>,
    {
        let mut index = Self::new(dim, params)?;
        let vectors = vectors.into_iter();
        let (lower, _) = vectors.size_hint();
        index.reserve(lower);
        for (seq, vector) in vectors {
            index.push_row(seq, vector.as_ref())?;
        }
        index.link_pending(usize::MAX);
        Ok(index)
    }

    /// Stores `vector` (normalised) under `seq`. A `seq` that is already live is left as it
    /// is, so replaying an event is harmless; a removed `seq` may be inserted again.
    ///
    /// When this insert brings the live count to `exact_below`, it builds the graph over
    /// every live vector, which takes a while (see the crate docs); later inserts add one
    /// node each.
    pub fn insert(&mut self, seq: Seq, vector: &[f32]) -> Result<(), VectorError> {
        if self.rows.contains_key(&seq) {
            // Still refuse a bad vector: a caller sending one has a bug worth hearing about.
            return push_unit(vector, self.dim, &mut Vec::with_capacity(self.dim));
        }
        self.push_row(seq, vector)?;
        self.link_pending(usize::MAX);
        Ok(())
    }

    /// [`insert`](Self::insert) for many vectors at once, with one result per item in order:
    /// a refused vector leaves the others in. The graph links the new vectors in parallel
    /// (rayon), which is what a projector applying a batch wants: an HNSW insert is about a
    /// thousand distance computations, so it is the cost of a vector projector.
    pub fn insert_many(&mut self, items: &[(Seq, &[f32])]) -> Vec<Result<(), VectorError>> {
        let results = self.append_many(items);
        self.link_pending(usize::MAX);
        results
    }

    /// Stores the vectors as [`insert_many`](Self::insert_many) does, searchable at once, but
    /// links none into the graph: searches scan them until [`link_pending`](Self::link_pending)
    /// does. Microseconds per vector, where a graph insert is about a millisecond.
    pub fn append_many(&mut self, items: &[(Seq, &[f32])]) -> Vec<Result<(), VectorError>> {
        let mut results = Vec::with_capacity(items.len());
        for &(seq, vector) in items {
            if self.rows.contains_key(&seq) {
                // Still refuse a bad vector: a caller sending one has a bug worth hearing about.
                results.push(push_unit(
                    vector,
                    self.dim,
                    &mut Vec::with_capacity(self.dim),
                ));
                continue;
            }
            results.push(self.push_row(seq, vector).map(|_| ()));
        }
        results
    }

    /// Rows appended and not yet linked into the graph, or every row when the scope has
    /// reached [`HnswParams::exact_below`] and its graph is still to be built; 0 for a scope
    /// searched exactly.
    pub fn pending_links(&self) -> usize {
        match &self.graph {
            Some(_) => self.len() - self.linked,
            None if self.wants_graph() => self.len(),
            None => 0,
        }
    }

    /// Links up to `max` pending rows into the graph, oldest first (building the graph, all at
    /// once, when the scope has just reached `exact_below`); returns how many rows it took.
    pub fn link_pending(&mut self, max: usize) -> usize {
        let Some(graph) = &self.graph else {
            if !self.wants_graph() {
                return 0;
            }
            self.graph = Some(self.build_graph());
            self.linked = self.len();
            return self.len();
        };
        let end = self.linked.saturating_add(max).min(self.len());
        let rows: Vec<(&[f32], usize)> = (self.linked..end)
            .filter(|&row| self.live[row])
            .map(|row| (self.row(row), row))
            .collect();
        if rows.len() >= PARALLEL_INSERT_MIN {
            graph.parallel_insert_slice(&rows);
        } else {
            for &item in &rows {
                graph.insert_slice(item);
            }
        }
        let taken = end - self.linked;
        self.linked = end;
        taken
    }

    /// Tombstones `seq`: it is never returned again. Returns whether it was live.
    pub fn remove(&mut self, seq: Seq) -> bool {
        match self.rows.remove(&seq) {
            Some(row) => {
                self.live[row] = false;
                true
            }
            None => false,
        }
    }

    /// The `k` live vectors most similar to `query` among those whose sequence `filter`
    /// allows, best first, scored by cosine similarity. Approximate once the index has a
    /// graph; see the crate docs for when it falls back to an exact scan.
    pub fn search(
        &self,
        query: &[f32],
        k: usize,
        filter: &dyn Fn(Seq) -> bool,
    ) -> Result<Vec<Hit>, VectorError> {
        let query = self.unit_query(query)?;
        // No search can return more than the scope holds; a caller's k must never size the
        // graph's candidate heap (hnsw_rs allocates `ef` up front).
        let k = k.min(self.live_len());
        if k == 0 || self.rows.is_empty() {
            return Ok(Vec::new());
        }
        let graph = match &self.graph {
            Some(graph) if self.live_len() >= self.params.exact_below => graph,
            _ => return Ok(self.scan(&query, k, filter)),
        };
        let ef = self.params.ef_search_for(self.live_len()).max(k);
        let allowed = |row: usize| self.live[row] && filter(self.seqs[row]);

        // Unfiltered, then drop what is not allowed: as good as a plain search whenever at
        // least k of the ef candidates survive, which is the usual case (no filter, few
        // tombstones).
        let hits = self.rank(&query, k, graph.search(&query, ef, ef), &allowed);
        if hits.len() >= k {
            return Ok(hits);
        }
        // Too few survived, so the filter is selective. If it allows only a few vectors, or
        // a small share of the scope, scanning them is exact and cheap; a filtered graph
        // search would wander through most of the graph looking for them (bench-ann at 1M
        // vectors with 1% allowed: over a second per query, against 189 ms for a full scan).
        let allowed_estimate = self.estimate_allowed(filter);
        if allowed_estimate <= self.params.exact_below
            || allowed_estimate <= self.live_len() / SCAN_BELOW_SHARE
        {
            return Ok(self.scan(&query, k, filter));
        }
        let graph_filter = |row: &usize| allowed(*row);
        let candidates = graph.search_filter(&query, ef, ef, Some(&graph_filter as &dyn FilterT));
        let hits = self.rank(&query, k, candidates, &allowed);
        if hits.len() >= k {
            return Ok(hits);
        }
        Ok(self.scan(&query, k, filter))
    }

    /// Like [`search`](Self::search), but always an exact scan of the flat store. The
    /// reference that approximate recall is measured against.
    pub fn exact_search(
        &self,
        query: &[f32],
        k: usize,
        filter: &dyn Fn(Seq) -> bool,
    ) -> Result<Vec<Hit>, VectorError> {
        let query = self.unit_query(query)?;
        Ok(self.scan(&query, k, filter))
    }

    /// Stored rows, tombstones included: what memory and scan time are proportional to.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether nothing is stored, not even a tombstone.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Live vectors: what searches can return.
    pub fn live_len(&self) -> usize {
        self.rows.len()
    }

    /// Removed vectors still taking space until a rebuild.
    pub fn tombstone_count(&self) -> usize {
        self.len() - self.live_len()
    }

    /// Length of every vector in this index.
    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn params(&self) -> &HnswParams {
        &self.params
    }

    /// Changes the search-time candidate list size (values below 1 count as 1). It still
    /// grows with the scope if `ef_search_grows` is set.
    pub fn set_ef_search(&mut self, ef_search: usize) {
        self.params.ef_search = ef_search.max(1);
    }

    /// Whether an HNSW graph exists (built once the live count reached `exact_below`).
    pub fn has_graph(&self) -> bool {
        self.graph.is_some()
    }

    /// Whether tombstones exceed `rebuild_tombstone_ratio` of stored rows, so that a
    /// rebuild is due. A caller that must keep searching meanwhile can build the replacement
    /// from [`iter`](Self::iter) with [`from_vectors`](Self::from_vectors) and swap it in.
    pub fn wants_rebuild(&self) -> bool {
        self.tombstone_count() > 0
            && (self.tombstone_count() as f64)
                > self.params.rebuild_tombstone_ratio * self.len() as f64
    }

    /// Rebuilds if tombstones exceed `rebuild_tombstone_ratio` of stored rows. Returns
    /// whether it did.
    pub fn maybe_rebuild(&mut self) -> bool {
        if !self.wants_rebuild() {
            return false;
        }
        self.rebuild();
        true
    }

    /// Drops tombstones: compacts the flat store into sequence order and builds a fresh
    /// graph over the live vectors (or none, if fewer than `exact_below` remain). Needs the
    /// memory of both the old and the new index while it runs, and blocks for as long as a
    /// full build takes: run it on a blocking thread.
    pub fn rebuild(&mut self) {
        let started = Instant::now();
        let tombstones = self.tombstone_count();
        let mut order: Vec<usize> = self.rows.values().copied().collect();
        order.sort_unstable_by_key(|&row| self.seqs[row]);

        let mut vectors = Vec::with_capacity(order.len() * self.dim);
        let mut seqs = Vec::with_capacity(order.len());
        let mut rows = HashMap::with_capacity(order.len());
        for (new_row, &old_row) in order.iter().enumerate() {
            vectors.extend_from_slice(self.row(old_row));
            seqs.push(self.seqs[old_row]);
            rows.insert(self.seqs[old_row], new_row);
        }
        // Drop the old graph first: it is the largest thing in memory.
        self.graph = None;
        self.vectors = vectors;
        self.seqs = seqs;
        self.live = vec![true; order.len()];
        self.rows = rows;
        self.rows_in_seq_order = true;
        self.link_pending(usize::MAX);
        debug!(
            live = self.live_len(),
            tombstones,
            graph = self.has_graph(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "vector index rebuilt"
        );
    }

    /// The stored unit vector of a live `seq`, for scoring a known memory against a query
    /// without a search.
    pub fn vector(&self, seq: Seq) -> Option<&[f32]> {
        self.rows.get(&seq).map(|&row| self.row(row))
    }

    /// Whether `seq` is live.
    pub fn contains(&self, seq: Seq) -> bool {
        self.rows.contains_key(&seq)
    }

    /// Live `(seq, unit vector)` pairs in ascending sequence order: what a snapshot stores
    /// and a state hash reads. Feeding them to [`from_vectors`](Self::from_vectors) gives
    /// back an equivalent index.
    pub fn iter(&self) -> impl Iterator<Item = (Seq, &[f32])> + '_ {
        let mut order: Vec<usize> = (0..self.len()).filter(|&row| self.live[row]).collect();
        if !self.rows_in_seq_order {
            order.sort_unstable_by_key(|&row| self.seqs[row]);
        }
        order.into_iter().map(|row| (self.seqs[row], self.row(row)))
    }

    /// Estimated heap bytes held: the flat store and its maps exactly (by capacity), the
    /// graph by a per-node model of hnsw_rs's layout (its own copy of each vector, neighbour
    /// lists of `Arc`s, 16 per-layer list headers per node) that the `bench-ann` binary
    /// checks against the process's resident memory.
    pub fn memory_bytes(&self) -> usize {
        // hashbrown: one control byte per bucket, buckets ~8/7 of capacity.
        let map = self.rows.capacity() * (size_of::<(Seq, usize)>() + 1) * 8 / 7;
        let flat = self.vectors.capacity() * size_of::<f32>()
            + self.seqs.capacity() * size_of::<Seq>()
            + self.live.capacity()
            + map;
        let graph = self.graph.as_ref().map_or(0, |graph| {
            graph.get_nb_point() * graph_node_bytes(self.dim, self.params.max_nb_conn)
        });
        flat + graph
    }

    fn row(&self, row: usize) -> &[f32] {
        &self.vectors[row * self.dim..(row + 1) * self.dim]
    }

    pub(crate) fn reserve(&mut self, additional: usize) {
        self.vectors.reserve(additional.saturating_mul(self.dim));
        self.seqs.reserve(additional);
        self.live.reserve(additional);
        self.rows.reserve(additional);
    }

    /// Appends a live row for a sequence that is not live; the graph is the caller's business.
    fn push_row(&mut self, seq: Seq, vector: &[f32]) -> Result<usize, VectorError> {
        if let Some(&row) = self.rows.get(&seq) {
            return Ok(row);
        }
        push_unit(vector, self.dim, &mut self.vectors)?;
        let row = self.seqs.len();
        if self.seqs.last().is_some_and(|&last| last > seq) {
            self.rows_in_seq_order = false;
        }
        self.seqs.push(seq);
        self.live.push(true);
        self.rows.insert(seq, row);
        Ok(row)
    }

    pub(crate) fn wants_graph(&self) -> bool {
        self.graph.is_none() && self.live_len() > 0 && self.live_len() >= self.params.exact_below
    }

    /// A graph over the live rows.
    pub(crate) fn build_graph(&self) -> Hnsw<'static, f32, UnitCosine> {
        let started = Instant::now();
        let graph = Hnsw::new(
            self.params.max_nb_conn,
            self.live_len(),
            GRAPH_LAYERS,
            self.params.ef_construction,
            UnitCosine,
        );
        let items: Vec<(&[f32], usize)> = (0..self.len())
            .filter(|&row| self.live[row])
            .map(|row| (self.row(row), row))
            .collect();
        if items.len() >= PARALLEL_BUILD_MIN {
            graph.parallel_insert_slice(&items);
        } else {
            for &item in &items {
                graph.insert_slice(item);
            }
        }
        debug!(
            nodes = items.len(),
            dim = self.dim,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "vector graph built"
        );
        graph
    }

    fn unit_query(&self, query: &[f32]) -> Result<Vec<f32>, VectorError> {
        let mut unit = Vec::with_capacity(self.dim);
        push_unit(query, self.dim, &mut unit)?;
        Ok(unit)
    }

    /// Exact top k over live rows the filter allows. The filter runs before the product, so a
    /// selective filter makes the scan cheaper.
    fn scan(&self, query: &[f32], k: usize, filter: &dyn Fn(Seq) -> bool) -> Vec<Hit> {
        if k == 0 {
            return Vec::new();
        }
        let mut top = TopK::new(k);
        for (row, vector) in self.vectors.chunks_exact(self.dim).enumerate() {
            if self.live[row] && filter(self.seqs[row]) {
                top.offer(dot(query, vector), self.seqs[row]);
            }
        }
        top.into_hits()
    }

    /// Top k of graph candidates and of the rows not yet linked that are allowed, rescored
    /// from the flat store so that graph and exact searches give identical scores to the same
    /// vector.
    fn rank(
        &self,
        query: &[f32],
        k: usize,
        candidates: Vec<Neighbour>,
        allowed: &impl Fn(usize) -> bool,
    ) -> Vec<Hit> {
        let mut top = TopK::new(k);
        let unlinked = self.linked..self.len();
        for row in candidates
            .into_iter()
            .map(|c| c.d_id)
            .filter(|row| !unlinked.contains(row))
            .chain(unlinked.clone())
        {
            if allowed(row) {
                top.offer(dot(query, self.row(row)), self.seqs[row]);
            }
        }
        top.into_hits()
    }

    /// How many live vectors `filter` allows, from a sample spread over the rows by a Weyl
    /// sequence (so that a filter on `seq % m` is not fooled by a regular stride).
    fn estimate_allowed(&self, filter: &dyn Fn(Seq) -> bool) -> usize {
        let rows = self.len();
        let (mut sampled, mut passed) = (0usize, 0usize);
        let mut position = 0.0f64;
        for _ in 0..FILTER_SAMPLE.min(rows) {
            position = (position + GOLDEN_FRACTION).fract();
            let row = ((position * rows as f64) as usize).min(rows - 1);
            if self.live[row] {
                sampled += 1;
                passed += usize::from(filter(self.seqs[row]));
            }
        }
        if sampled == 0 {
            return 0;
        }
        ((passed as f64 / sampled as f64) * self.live_len() as f64).ceil() as usize
    }
}

/// `(sqrt(5) - 1) / 2`: its multiples mod 1 spread as evenly as any sequence can.
const GOLDEN_FRACTION: f64 = 0.618_033_988_749_894_9;

/// Estimated heap bytes per graph node, modelled on hnsw_rs 0.3.5's layout:
/// - the node's own copy of the vector;
/// - the `Point` in an `Arc`, its `Arc<RwLock<Vec<Vec<_>>>>` of neighbour lists with one
///   list header per possible layer (16 of them), and the node's slot in its layer's list;
/// - on layer 0, up to `2 * max_nb_conn` neighbours, each a pointer plus its own `Arc`
///   allocation (`PointWithOrder`: an `Arc<Point>` and a distance, with allocator rounding),
///   with lists that grow by doubling before they are pruned, hence the spare capacity.
///
/// Upper layers add about `1 / max_nb_conn` of that again, which the spare capacity covers.
fn graph_node_bytes(dim: usize, max_nb_conn: usize) -> usize {
    let vector = dim * size_of::<f32>() + 16;
    let node = 128 + 48 + GRAPH_LAYERS * 24 + 8;
    let neighbour = 8 + 48;
    let neighbours = 2 * max_nb_conn * neighbour + 2 * max_nb_conn * 8;
    vector + node + neighbours
}

/// The k best `(score, seq)` seen so far: a heap whose top is the worst kept, so each offer
/// costs O(log k) and most cost a single comparison.
struct TopK {
    k: usize,
    heap: BinaryHeap<Ranked>,
}

/// Ordered worst first: lower score, then (for a stable order among equal scores) higher seq.
#[derive(Clone, Copy)]
struct Ranked {
    score: f32,
    seq: Seq,
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .score
            .total_cmp(&self.score)
            .then(self.seq.cmp(&other.seq))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

impl TopK {
    fn new(k: usize) -> Self {
        Self {
            k,
            heap: BinaryHeap::with_capacity(k.min(1 << 16) + 1),
        }
    }

    fn offer(&mut self, score: f32, seq: Seq) {
        let ranked = Ranked { score, seq };
        if self.heap.len() < self.k {
            self.heap.push(ranked);
        } else if let Some(mut worst) = self.heap.peek_mut()
            && ranked < *worst
        {
            *worst = ranked;
        }
    }

    fn into_hits(self) -> Vec<Hit> {
        // Ascending in this order is best first.
        self.heap
            .into_sorted_vec()
            .into_iter()
            .map(|Ranked { score, seq }| Hit { seq, score })
            .collect()
    }
}

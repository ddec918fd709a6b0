//! Engram's vector read model: one [`VectorIndex`] per scope, finding the memories whose
//! embeddings are most similar (by cosine) to a query's, keyed by the stream sequence
//! ([`Seq`](engram_memory::Seq)) of the event each came from.
//!
//! # How a search is answered
//! - **Small scopes** (fewer than [`HnswParams::exact_below`] live vectors, 5,000 by
//!   default) keep only a flat store of unit vectors, and search scans it: exact, and for
//!   that size faster than a graph.
//! - **Large scopes** also keep an HNSW graph (hnsw_rs) over the same rows, built in one go
//!   (in parallel) by the insert that reaches `exact_below` and then grown by one node per
//!   insert. A search asks the graph for `max(ef_search, k)` candidates, drops tombstones and
//!   whatever the filter refuses, and rescores the rest from the flat store.
//! - **Selective filters**: when fewer than `k` candidates survive, a sample of the rows
//!   estimates how many the filter allows. At most `exact_below` are scanned exactly;
//!   otherwise a filtered graph search runs, and if even that finds fewer than `k`, a scan.
//!   So a filter never costs recall, only (at worst) a scan.
//!
//! Scores are cosine similarities (higher is better), computed the same way on both paths, so
//! graph and exact searches agree on any vector they both return.
//!
//! # Deletion
//! hnsw_rs cannot delete a node (its maintainer says so, hnswlib-rs#11), so
//! [`VectorIndex::remove`] tombstones. [`VectorIndex::maybe_rebuild`] compacts the index once
//! tombstones pass [`HnswParams::rebuild_tombstone_ratio`].
//!
//! # Costs to plan for
//! - Memory: the flat store holds each vector once, and the graph holds a second copy plus
//!   its links (hnsw_rs owns its points). At 384 dimensions and the default parameters that
//!   is a few KB per vector: see [`VectorIndex::memory_bytes`] and the `bench-ann` figures.
//! - The insert that creates the graph, [`VectorIndex::rebuild`] and
//!   [`VectorIndex::from_vectors`] of a large scope each block for a full graph build, on
//!   rayon's global pool: run them on a blocking thread, never on an async worker.
//!
//! # Layout
//! - [`VectorIndex`] (`index`): the store, the graph, search, tombstones and rebuilds.
//! - [`HnswParams`] (`params`): construction and search knobs, with serde for config files.
//! - [`VectorError`] (`error`): refused vectors and parameters.
//! - `persist`: [`VectorIndex::save_graph`] and [`VectorIndex::restore`], so that a restart
//!   loads the graph instead of building it again; [`RowLayout`].
//! - `kernel`: dot products (AVX2 when the CPU has it) and normalisation.
//!
//! The `bench-ann` binary of `engram-bench` measures build speed, exact and graph latency,
//! recall and memory on the synthetic data of `engram_fixtures::synthetic`:
//! `cargo run --release -p engram-bench --bin bench-ann -- --help`.

mod error;
mod index;
mod kernel;
mod params;
mod persist;

pub use error::VectorError;
pub use index::VectorIndex;
pub use params::{EF_SEARCH_BASE_SIZE, HnswParams};
pub use persist::RowLayout;

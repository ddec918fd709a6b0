//! Saving an index's graph, so that a restart loads it instead of building it again.
//!
//! A graph build is the slow part of an index (about 1.8 minutes for 100k vectors and half an
//! hour for a million, on two cores); reading hnsw_rs's dump back takes seconds. The flat
//! store is not written here: its vectors are the caller's to keep (the vector projector's
//! snapshot holds every live memory's vector), and [`RowLayout`] says which row each was.

use std::path::Path;

use engram_memory::Seq;
use hnsw_rs::api::AnnT;
use hnsw_rs::hnswio::HnswIo;
use hnsw_rs::prelude::Hnsw;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::kernel::{UnitCosine, push_unit};
use crate::{HnswParams, VectorError, VectorIndex};

/// hnsw_rs names its two dump files `<basename>.hnsw.graph` and `<basename>.hnsw.data`.
const BASENAME: &str = "graph";

/// Which sequence each row of an index holds, tombstones included: the graph's data ids are
/// rows, so a restored index must put every vector back in the same row.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowLayout {
    pub seqs: Vec<Seq>,
    pub live: Vec<bool>,
    /// Rows below this are in the saved graph; the rest were appended after it and are linked
    /// at restore. `None` (a layout saved before rows could wait): all of them.
    #[serde(default)]
    pub linked: Option<usize>,
}

impl VectorIndex {
    /// The row of every stored vector, for [`restore`](Self::restore).
    pub fn layout(&self) -> RowLayout {
        RowLayout {
            seqs: self.seqs.clone(),
            live: self.live.clone(),
            linked: self.graph.is_some().then_some(self.linked),
        }
    }

    /// Writes the graph (if the index has one) into `dir`, which must exist and be empty.
    /// Returns whether there was a graph to write. The files are fsynced.
    pub fn save_graph(&self, dir: &Path) -> std::io::Result<bool> {
        let Some(graph) = &self.graph else {
            return Ok(false);
        };
        let basename = graph
            .file_dump(dir, BASENAME)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        if basename != BASENAME {
            // hnsw_rs picks another name when files exist; the directory was not empty.
            return Err(std::io::Error::other(format!(
                "graph dump went to {basename} in {}: the directory was not empty",
                dir.display()
            )));
        }
        for suffix in ["hnsw.graph", "hnsw.data"] {
            std::fs::File::open(dir.join(format!("{BASENAME}.{suffix}")))?.sync_all()?;
        }
        Ok(true)
    }

    /// Rebuilds an index saved as `layout` plus, for each live row, `vector(seq)`; loads the
    /// graph from `graph_dir` if given. A graph that cannot be read, or does not match the
    /// layout, is built again from the vectors (slow, but never wrong), with a warning.
    /// Returns the index and whether its graph was loaded.
    pub fn restore<'v>(
        dim: usize,
        params: HnswParams,
        layout: &RowLayout,
        vector: impl Fn(Seq) -> Option<&'v [f32]>,
        graph_dir: Option<&Path>,
    ) -> Result<(Self, bool), VectorError> {
        if layout.seqs.len() != layout.live.len() {
            return Err(VectorError::InvalidParams(format!(
                "row layout has {} sequences but {} live flags",
                layout.seqs.len(),
                layout.live.len()
            )));
        }
        let mut index = Self::new(dim, params)?;
        index.reserve(layout.seqs.len());
        let mut in_order = true;
        for (row, (&seq, &live)) in layout.seqs.iter().zip(&layout.live).enumerate() {
            // A live row whose vector the caller no longer has becomes a tombstone: it was
            // removed after the layout was taken.
            match vector(seq).filter(|_| live) {
                Some(v) => {
                    push_unit(v, dim, &mut index.vectors)?;
                    index.rows.insert(seq, row);
                    index.live.push(true);
                }
                None => {
                    // Never read: tombstoned rows are skipped by scans and searches.
                    index.vectors.resize(index.vectors.len() + dim, 0.0);
                    index.live.push(false);
                }
            }
            if index.seqs.last().is_some_and(|&last| last > seq) {
                in_order = false;
            }
            index.seqs.push(seq);
        }
        index.rows_in_seq_order = in_order;
        let loaded = graph_dir.and_then(|dir| match load_graph(dir, index.len()) {
            Ok(graph) => Some(graph),
            Err(reason) => {
                warn!(dir = %dir.display(), %reason, "vector graph not loaded; building it again");
                None
            }
        });
        let mut graph_loaded = false;
        match loaded {
            Some(graph) if index.live_len() >= index.params.exact_below => {
                index.graph = Some(graph);
                index.linked = layout.linked.unwrap_or(index.len()).min(index.len());
                graph_loaded = true;
            }
            _ => {}
        }
        // Rows appended after the graph was saved, or the whole graph when none was loaded.
        index.link_pending(usize::MAX);
        Ok((index, graph_loaded))
    }
}

/// Reads a graph dump of at most `rows` points.
fn load_graph(dir: &Path, rows: usize) -> Result<Hnsw<'static, f32, UnitCosine>, String> {
    for suffix in ["hnsw.graph", "hnsw.data"] {
        let path = dir.join(format!("{BASENAME}.{suffix}"));
        if !path.is_file() {
            return Err(format!("{} is missing", path.display()));
        }
    }
    let started = std::time::Instant::now();
    // The loaded graph borrows its loader for as long as it lives, and this graph lives as
    // long as the index: so the loader (a path and a few options, no vector data, since
    // memory mapping is off) is leaked, once per scope per restart.
    // hnsw_rs asserts on a malformed dump instead of returning an error.
    let loaded = std::panic::catch_unwind(|| {
        let io: &'static mut HnswIo = Box::leak(Box::new(HnswIo::new(dir, BASENAME)));
        io.load_hnsw::<f32, UnitCosine>()
    })
    .map_err(|_| "the graph dump is malformed".to_owned())?
    .map_err(|e| e.to_string())?;
    let mut graph = loaded;
    // A graph built after some removals leaves those rows out, so it may hold fewer.
    if graph.get_nb_point() > rows {
        return Err(format!(
            "the dump holds {} points, the layout only {rows} rows",
            graph.get_nb_point()
        ));
    }
    // Reloaded graphs come back with candidate extension on; new graphs have it off, and it
    // slows every later insert.
    graph.set_extend_candidates(false);
    debug!(
        points = rows,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "vector graph loaded"
    );
    Ok(graph)
}

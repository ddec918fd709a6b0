use serde::{Deserialize, Serialize};

use crate::VectorError;

/// How a [`VectorIndex`](crate::VectorIndex) builds and searches its graph. The defaults suit
/// sentence embeddings (a few hundred dimensions) from one scope.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HnswParams {
    /// Links per node on the upper layers (twice this on layer 0). More links: better recall,
    /// more memory, slower inserts. hnsw_rs stores it in a `u8`, so at most 255.
    pub max_nb_conn: usize,
    /// Candidate list size while inserting. Higher builds a better graph, more slowly.
    pub ef_construction: usize,
    /// Candidate list size while searching; raised to `k` for each query. Higher gives better
    /// recall, more slowly. Query time only: it can change on a built index. With
    /// `ef_search_grows`, this is the value up to [`EF_SEARCH_BASE_SIZE`] live vectors.
    pub ef_search: usize,
    /// Grow the search candidate list in proportion to the scope above
    /// [`EF_SEARCH_BASE_SIZE`] live vectors (64 at 125k, 512 at 1M), so that recall holds as
    /// a scope grows while a search stays a small, fixed fraction of an exact scan (whose cost
    /// grows the same way). `bench-ann` on clustered 384-d data: a fixed ef 64 gave recall@10
    /// 0.98 at 100k but 0.81 at 1M; ef 512 gave 0.97 at 1M, 37x faster than exact.
    pub ef_search_grows: bool,
    /// Below this many live vectors the index keeps no graph and every search is an exact
    /// scan, which for small scopes is both faster and exact. The graph is built when the live
    /// count reaches it. Also used for filtered searches: when a filter is estimated to allow
    /// at most this many vectors, they are scanned exactly.
    pub exact_below: usize,
    /// [`maybe_rebuild`](crate::VectorIndex::maybe_rebuild) rebuilds once tombstones make up
    /// more than this fraction of stored vectors.
    pub rebuild_tombstone_ratio: f64,
}

impl Default for HnswParams {
    fn default() -> Self {
        Self {
            max_nb_conn: 16,
            ef_construction: 200,
            ef_search: 64,
            ef_search_grows: true,
            exact_below: 5_000,
            rebuild_tombstone_ratio: 0.2,
        }
    }
}

/// Live vectors up to which `ef_search` is used as it is; see `ef_search_grows`.
pub const EF_SEARCH_BASE_SIZE: usize = 125_000;

impl HnswParams {
    /// The candidate list size a search of a scope of `live` vectors uses (before raising it
    /// to `k`).
    pub fn ef_search_for(&self, live: usize) -> usize {
        if !self.ef_search_grows || live <= EF_SEARCH_BASE_SIZE {
            return self.ef_search;
        }
        let scaled = self.ef_search as f64 * live as f64 / EF_SEARCH_BASE_SIZE as f64;
        scaled.ceil() as usize
    }

    /// Checks what hnsw_rs would otherwise answer with a panic or `process::exit`.
    pub fn validate(&self) -> Result<(), VectorError> {
        let invalid = |why: String| Err(VectorError::InvalidParams(why));
        if !(2..=255).contains(&self.max_nb_conn) {
            return invalid(format!(
                "max_nb_conn is {}, it must be between 2 and 255",
                self.max_nb_conn
            ));
        }
        if self.ef_construction == 0 {
            return invalid("ef_construction is 0, it must be at least 1".into());
        }
        if self.ef_search == 0 {
            return invalid("ef_search is 0, it must be at least 1".into());
        }
        if !(self.rebuild_tombstone_ratio.is_finite() && self.rebuild_tombstone_ratio >= 0.0) {
            return invalid(format!(
                "rebuild_tombstone_ratio is {}, it must be a finite number >= 0",
                self.rebuild_tombstone_ratio
            ));
        }
        Ok(())
    }
}

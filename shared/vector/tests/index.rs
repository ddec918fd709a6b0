//! Given/when/then tests of `VectorIndex` through its public API.

use std::collections::HashSet;
use std::sync::OnceLock;

use engram_fixtures::synthetic::{Mixture, MixtureSpec};
use engram_memory::{Hit, Seq};
use engram_vector::{HnswParams, VectorError, VectorIndex};
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn any(_: Seq) -> bool {
    true
}

fn seqs(hits: &[Hit]) -> Vec<Seq> {
    hits.iter().map(|hit| hit.seq).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Fraction of the exact top-k that the approximate top-k found.
fn recall(approx: &[Hit], exact: &[Hit]) -> f64 {
    let truth: HashSet<Seq> = exact.iter().map(|hit| hit.seq).collect();
    let found = approx.iter().filter(|hit| truth.contains(&hit.seq)).count();
    found as f64 / exact.len().max(1) as f64
}

fn small_graph_params() -> HnswParams {
    HnswParams {
        exact_below: 100,
        ..HnswParams::default()
    }
}

fn mixture(dim: usize, clusters: usize) -> Mixture {
    Mixture::new(
        MixtureSpec {
            dim,
            clusters,
            ..MixtureSpec::default()
        },
        42,
    )
}

/// `n` clustered vectors with sequences 1..=n.
fn clustered(n: usize, dim: usize, seed: u64) -> Vec<(Seq, Vec<f32>)> {
    let mixture = mixture(dim, (n / 100).max(1));
    let mut rng = StdRng::seed_from_u64(seed);
    (1..=n as Seq)
        .map(|seq| (seq, mixture.sample(&mut rng)))
        .collect()
}

fn queries(n: usize, dim: usize, clusters: usize) -> Vec<Vec<f32>> {
    let mixture = mixture(dim, clusters);
    let mut rng = StdRng::seed_from_u64(9_999);
    (0..n).map(|_| mixture.sample(&mut rng)).collect()
}

/// 20k vectors in release builds. Debug builds use fewer: hnsw_rs's graph code is generic
/// over the distance, so it is compiled as part of this crate, unoptimised in a debug build
/// (about 30x slower). `cargo test --release -p engram-vector` runs the full size.
const BIG_N: usize = if cfg!(debug_assertions) {
    2_000
} else {
    20_000
};
const BIG_DIM: usize = 64;

/// Default parameters except `exact_below`, so that the debug size has a graph too.
fn big_params() -> HnswParams {
    HnswParams {
        exact_below: 500,
        ..HnswParams::default()
    }
}

/// `BIG_N` clustered 64-dimensional vectors with a graph, inserted one by one as a projector
/// would. Built once and shared, because a graph build is the slow part of these tests.
fn big_index() -> &'static VectorIndex {
    static INDEX: OnceLock<VectorIndex> = OnceLock::new();
    INDEX.get_or_init(|| {
        let mut index = VectorIndex::new(BIG_DIM, big_params()).unwrap();
        for (seq, vector) in clustered(BIG_N, BIG_DIM, 1) {
            index.insert(seq, &vector).unwrap();
        }
        index
    })
}

fn big_queries() -> Vec<Vec<f32>> {
    queries(200, BIG_DIM, BIG_N / 100)
}

fn mean_recall_at_10(index: &VectorIndex, filter: &dyn Fn(Seq) -> bool) -> f64 {
    let queries = big_queries();
    let total: f64 = queries
        .iter()
        .map(|query| {
            let approx = index.search(query, 10, filter).unwrap();
            let exact = index.exact_search(query, 10, filter).unwrap();
            assert!(approx.iter().all(|hit| filter(hit.seq)));
            recall(&approx, &exact)
        })
        .sum();
    total / queries.len() as f64
}

#[test]
fn given_three_vectors_when_searching_then_hits_are_ordered_by_cosine_similarity() {
    let mut index = VectorIndex::new(3, HnswParams::default()).unwrap();
    let stored = [
        (1, vec![1.0, 0.0, 0.0]),
        (2, vec![1.0, 1.0, 0.0]),
        (3, vec![0.0, 0.0, 5.0]),
    ];
    for (seq, vector) in &stored {
        index.insert(*seq, vector).unwrap();
    }
    let query = [2.0, 0.5, 0.0];

    let hits = index.search(&query, 3, &any).unwrap();

    assert_eq!(seqs(&hits), vec![1, 2, 3]);
    for (hit, (_, vector)) in hits.iter().zip(&stored) {
        assert!((hit.score - cosine(&query, vector)).abs() < 1e-6);
    }
    assert_eq!(seqs(&index.search(&query, 2, &any).unwrap()), vec![1, 2]);
    assert!(index.search(&query, 0, &any).unwrap().is_empty());
}

#[test]
fn given_a_removed_seq_when_searching_either_path_then_it_is_never_returned() {
    for params in [HnswParams::default(), small_graph_params()] {
        let data = clustered(500, 16, 3);
        let mut index = VectorIndex::from_vectors(16, params.clone(), data.clone()).unwrap();
        let (removed, removed_vector) = &data[10];
        assert_eq!(
            index.search(removed_vector, 1, &any).unwrap()[0].seq,
            *removed
        );

        assert!(index.remove(*removed));
        assert!(
            !index.remove(*removed),
            "a second remove finds nothing live"
        );

        for hits in [
            index.search(removed_vector, 500, &any).unwrap(),
            index.search(removed_vector, 10, &any).unwrap(),
            index.exact_search(removed_vector, 500, &any).unwrap(),
        ] {
            assert!(!seqs(&hits).contains(removed), "params {params:?}");
        }
        assert_eq!(
            index.exact_search(removed_vector, 500, &any).unwrap().len(),
            499
        );
        assert_eq!(
            (index.len(), index.live_len(), index.tombstone_count()),
            (500, 499, 1)
        );
    }
}

#[test]
fn given_tombstones_over_the_ratio_when_maybe_rebuild_then_they_are_dropped() {
    let data = clustered(1_000, 16, 4);
    let mut index = VectorIndex::from_vectors(16, small_graph_params(), data.clone()).unwrap();
    // 20% exactly is not over the default ratio of 0.2.
    for (seq, _) in data.iter().step_by(5) {
        index.remove(*seq);
    }
    assert_eq!(index.tombstone_count(), 200);
    assert!(!index.maybe_rebuild());
    index.remove(data[1].0);
    let memory_before = index.memory_bytes();

    assert!(index.maybe_rebuild());

    assert_eq!(
        (index.len(), index.live_len(), index.tombstone_count()),
        (799, 799, 0)
    );
    assert!(index.has_graph());
    assert!(index.memory_bytes() < memory_before);
    let removed: HashSet<Seq> = data.iter().step_by(5).map(|(seq, _)| *seq).collect();
    for (seq, vector) in data.iter().take(50) {
        let hits = index.search(vector, 20, &any).unwrap();
        if removed.contains(seq) || *seq == data[1].0 {
            assert!(!seqs(&hits).contains(seq));
        } else {
            assert_eq!(
                hits[0].seq, *seq,
                "a live vector finds itself after the rebuild"
            );
        }
        assert!(hits.iter().all(|hit| !removed.contains(&hit.seq)));
    }
    assert!(!index.maybe_rebuild(), "nothing left to drop");
}

#[test]
fn given_a_rebuild_leaving_fewer_than_exact_below_then_the_graph_is_dropped() {
    let data = clustered(300, 8, 5);
    let mut index = VectorIndex::from_vectors(8, small_graph_params(), data.clone()).unwrap();
    assert!(index.has_graph());
    for (seq, _) in &data[..250] {
        index.remove(*seq);
    }

    index.rebuild();

    assert!(!index.has_graph());
    let hits = index.search(&data[299].1, 100, &any).unwrap();
    assert_eq!(hits.len(), 50);
    assert_eq!(hits[0].seq, data[299].0);
}

#[test]
fn given_a_live_seq_when_inserted_again_then_the_insert_is_ignored() {
    let mut index = VectorIndex::new(2, HnswParams::default()).unwrap();
    index.insert(7, &[1.0, 0.0]).unwrap();

    index.insert(7, &[0.0, 1.0]).unwrap();

    assert_eq!((index.len(), index.live_len()), (1, 1));
    assert_eq!(index.vector(7), Some(&[1.0, 0.0][..]));
    let stored: Vec<(Seq, Vec<f32>)> = index.iter().map(|(s, v)| (s, v.to_vec())).collect();
    assert_eq!(stored, vec![(7, vec![1.0, 0.0])]);
    assert_eq!(
        index.insert(7, &[1.0]),
        Err(VectorError::DimensionMismatch {
            expected: 2,
            got: 1
        }),
        "a bad vector is refused even for a seq already present"
    );

    // Once removed, the seq may come back (a replay re-applies the insert, then the delete).
    index.remove(7);
    assert!(!index.contains(7) && index.vector(7).is_none());
    index.insert(7, &[0.0, 3.0]).unwrap();
    let hits = index.search(&[0.0, 1.0], 5, &any).unwrap();
    assert_eq!(seqs(&hits), vec![7]);
    assert!((hits[0].score - 1.0).abs() < 1e-6);
    assert_eq!(index.vector(7), Some(&[0.0, 1.0][..]), "stored normalised");
}

#[test]
fn given_a_small_index_when_filtering_then_only_allowed_seqs_are_returned() {
    let data = clustered(300, 8, 6);
    let index = VectorIndex::from_vectors(8, HnswParams::default(), data.clone()).unwrap();
    let even = |seq: Seq| seq.is_multiple_of(2);

    let hits = index.search(&data[0].1, 300, &even).unwrap();

    assert_eq!(hits.len(), 150);
    assert!(hits.iter().all(|hit| hit.seq.is_multiple_of(2)));
    assert!(index.search(&data[0].1, 10, &|_| false).unwrap().is_empty());
}

#[test]
fn given_a_graph_index_when_filtering_at_any_selectivity_then_only_allowed_seqs_are_returned() {
    let index = big_index();
    // Spread by a hash so the allowed set is not aligned with clusters or insertion order.
    // 50% is served by a plain graph search; 10% (at the release size) by a filtered graph
    // search; 1% and 0.1% allow fewer than `exact_below`, so they are scanned: recall 1.
    let hashed = |seq: Seq| seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54;
    for (percent, min_recall) in [(50.0, 0.9), (10.0, 0.9), (1.0, 1.0), (0.1, 1.0)] {
        let threshold = (1024.0 * percent / 100.0) as u64;
        let filter = move |seq: Seq| hashed(seq) < threshold.max(1);
        let recall = mean_recall_at_10(index, &filter);
        assert!(
            recall >= min_recall,
            "{percent}% allowed: recall@10 {recall}"
        );
    }
    let nothing = |_: Seq| false;
    assert!(
        index
            .search(&big_queries()[0], 10, &nothing)
            .unwrap()
            .is_empty()
    );
    let chosen = BIG_N as Seq / 2;
    let only = |seq: Seq| seq == chosen;
    assert_eq!(
        seqs(&index.search(&big_queries()[0], 10, &only).unwrap()),
        vec![chosen]
    );
}

#[test]
fn given_bad_vectors_when_inserting_or_querying_then_they_are_refused_with_typed_errors() {
    let mut index = VectorIndex::new(3, HnswParams::default()).unwrap();
    index.insert(1, &[1.0, 2.0, 3.0]).unwrap();
    let cases = [
        (
            vec![1.0, 2.0],
            VectorError::DimensionMismatch {
                expected: 3,
                got: 2,
            },
        ),
        (
            vec![1.0, f32::NAN, 3.0],
            VectorError::NonFinite {
                index: 1,
                value: f32::NAN,
            },
        ),
        (
            vec![f32::INFINITY, 0.0, 0.0],
            VectorError::NonFinite {
                index: 0,
                value: f32::INFINITY,
            },
        ),
        (vec![0.0, 0.0, 0.0], VectorError::ZeroVector),
    ];
    for (vector, expected) in cases {
        let matches = |result: Result<(), VectorError>| match (result, &expected) {
            // NaN != NaN, so compare the variant and position.
            (
                Err(VectorError::NonFinite { index, value }),
                VectorError::NonFinite { index: i, .. },
            ) => index == *i && !value.is_finite(),
            (Err(error), expected) => error == *expected,
            (Ok(()), _) => false,
        };
        assert!(matches(index.insert(2, &vector)), "insert {vector:?}");
        assert!(
            matches(index.search(&vector, 1, &any).map(|_| ())),
            "search {vector:?}"
        );
        assert!(
            matches(index.exact_search(&vector, 1, &any).map(|_| ())),
            "exact {vector:?}"
        );
    }
    assert_eq!((index.len(), index.live_len()), (1, 1));
    assert!(!index.remove(2));
    assert!(
        VectorError::ZeroVector
            .to_string()
            .starts_with("vector is all zeros"),
        "messages are lowercase and say what to do"
    );
}

#[test]
fn given_bad_parameters_when_creating_then_they_are_refused() {
    let bad = [
        (1, HnswParams::default()),
        (0, HnswParams::default()),
        (
            4,
            HnswParams {
                max_nb_conn: 256,
                ..HnswParams::default()
            },
        ),
        (
            4,
            HnswParams {
                max_nb_conn: 1,
                ..HnswParams::default()
            },
        ),
        (
            4,
            HnswParams {
                ef_construction: 0,
                ..HnswParams::default()
            },
        ),
        (
            4,
            HnswParams {
                ef_search: 0,
                ..HnswParams::default()
            },
        ),
        (
            4,
            HnswParams {
                rebuild_tombstone_ratio: f64::NAN,
                ..HnswParams::default()
            },
        ),
        (
            4,
            HnswParams {
                rebuild_tombstone_ratio: -0.1,
                ..HnswParams::default()
            },
        ),
    ];
    for (i, (dim, params)) in bad.into_iter().enumerate() {
        let result = VectorIndex::new(dim, params.clone());
        if i == 0 {
            assert!(result.is_ok());
        } else {
            assert!(
                matches!(result, Err(VectorError::InvalidParams(_))),
                "{dim} {params:?}"
            );
            assert!(VectorIndex::from_vectors(dim, params, Vec::<(Seq, Vec<f32>)>::new()).is_err());
        }
    }
}

#[test]
fn given_params_in_a_config_file_then_missing_fields_take_defaults() {
    let params: HnswParams = serde_json::from_str(r#"{"ef_search": 128}"#).unwrap();
    assert_eq!(
        params,
        HnswParams {
            ef_search: 128,
            ..HnswParams::default()
        }
    );
    assert!(serde_json::from_str::<HnswParams>(r#"{"ef_serch": 128}"#).is_err());
}

#[test]
fn given_clustered_vectors_when_searching_the_graph_then_recall_at_10_is_at_least_095() {
    let index = big_index();
    assert!(index.has_graph());
    assert_eq!(index.live_len(), BIG_N);

    let recall = mean_recall_at_10(index, &any);

    assert!(recall >= 0.95, "recall@10 {recall}");
}

#[test]
fn given_a_graph_index_with_tombstones_then_recall_holds_without_a_rebuild() {
    let n = BIG_N / 2;
    let mut index =
        VectorIndex::from_vectors(BIG_DIM, big_params(), clustered(n, BIG_DIM, 11)).unwrap();
    for seq in (1..=n as Seq).step_by(4) {
        index.remove(seq);
    }
    let queries = queries(100, BIG_DIM, n / 100);
    let mut total = 0.0;
    for query in &queries {
        let approx = index.search(query, 10, &any).unwrap();
        assert!(approx.iter().all(|hit| hit.seq % 4 != 1));
        total += recall(&approx, &index.exact_search(query, 10, &any).unwrap());
    }
    let recall = total / queries.len() as f64;
    assert!(recall >= 0.95, "recall@10 {recall}");
}

#[test]
fn given_a_small_index_when_round_tripped_through_iter_then_search_results_are_identical() {
    let mut index = VectorIndex::new(8, HnswParams::default()).unwrap();
    let mut data = clustered(400, 8, 7);
    data.reverse();
    for (seq, vector) in &data {
        index.insert(*seq, vector).unwrap();
    }
    for seq in [3, 50, 51, 399] {
        index.remove(seq);
    }

    let restored = VectorIndex::from_vectors(8, HnswParams::default(), index.iter()).unwrap();

    let order: Vec<Seq> = index.iter().map(|(seq, _)| seq).collect();
    assert!(
        order.windows(2).all(|pair| pair[0] < pair[1]),
        "iter is in seq order"
    );
    assert_eq!(order.len(), 396);
    assert!(
        index.iter().eq(restored.iter()),
        "identical vectors, bit for bit"
    );
    for query in queries(20, 8, 4) {
        assert_eq!(
            index.search(&query, 10, &any).unwrap(),
            restored.search(&query, 10, &any).unwrap()
        );
    }
}

#[test]
fn given_a_graph_index_when_round_tripped_through_iter_then_results_match() {
    let index = big_index();

    let restored = VectorIndex::from_vectors(BIG_DIM, big_params(), index.iter()).unwrap();

    assert!(restored.has_graph());
    assert!(index.iter().eq(restored.iter()));
    for query in big_queries().iter().take(50) {
        assert_eq!(
            index.exact_search(query, 10, &any).unwrap(),
            restored.exact_search(query, 10, &any).unwrap()
        );
    }
    // The restored graph comes from a parallel build, so it is not the same graph: it only
    // has to be as good.
    let recall = mean_recall_at_10(&restored, &any);
    assert!(recall >= 0.95, "restored recall@10 {recall}");
}

#[test]
fn given_inserts_crossing_exact_below_then_the_graph_is_built_once_and_kept_current() {
    let params = HnswParams {
        exact_below: 50,
        ..HnswParams::default()
    };
    let data = clustered(200, 8, 8);
    let mut index = VectorIndex::new(8, params).unwrap();
    for (seq, vector) in &data[..49] {
        index.insert(*seq, vector).unwrap();
    }
    assert!(!index.has_graph());

    index.insert(data[49].0, &data[49].1).unwrap();
    assert!(index.has_graph());
    for (seq, vector) in &data[50..] {
        index.insert(*seq, vector).unwrap();
    }

    for (seq, vector) in &data {
        assert_eq!(index.search(vector, 1, &any).unwrap()[0].seq, *seq);
    }
}

#[test]
fn given_more_vectors_then_the_memory_estimate_grows_beyond_the_raw_floats() {
    let empty = VectorIndex::new(32, small_graph_params()).unwrap();
    let flat = VectorIndex::from_vectors(32, HnswParams::default(), clustered(90, 32, 1)).unwrap();
    let graph =
        VectorIndex::from_vectors(32, small_graph_params(), clustered(1_000, 32, 1)).unwrap();
    assert_eq!(empty.memory_bytes(), 0);
    assert!(flat.memory_bytes() >= 90 * 32 * 4);
    // A graph keeps its own copy of each vector as well as links.
    assert!(graph.memory_bytes() >= 2 * 1_000 * 32 * 4);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn exact_search_equals_a_full_sort_by_cosine(
        vectors in prop::collection::vec(prop::collection::vec(-10.0f32..10.0, 4), 1..60),
        query in prop::collection::vec(-10.0f32..10.0, 4),
        k in 1usize..20,
    ) {
        prop_assume!(query.iter().any(|x| *x != 0.0));
        let mut index = VectorIndex::new(4, HnswParams::default()).unwrap();
        let mut expected = Vec::new();
        for (seq, vector) in vectors.iter().enumerate() {
            if index.insert(seq as Seq, vector).is_ok() {
                expected.push((cosine(&query, vector), seq as Seq));
            }
        }
        expected.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));

        let hits = index.exact_search(&query, k, &any).unwrap();

        prop_assert_eq!(hits.len(), k.min(expected.len()));
        for (hit, (score, _)) in hits.iter().zip(&expected) {
            // Compare scores, not seqs: rounding may order near-ties differently.
            prop_assert!((hit.score - score).abs() < 1e-5);
        }
        prop_assert!(hits.windows(2).all(|pair| pair[0].score >= pair[1].score));
    }
}

#[test]
fn given_batches_with_a_bad_vector_when_inserted_many_then_the_rest_is_searchable_as_with_single_inserts()
 {
    // Given 1,000 clustered vectors in batches of 64, one of them the wrong length and one
    // repeated, so the graph (built at 100) links most of them in parallel
    let data = clustered(1_000, 16, 3);
    let mut batched = VectorIndex::new(16, small_graph_params()).unwrap();
    let mut single = VectorIndex::new(16, small_graph_params()).unwrap();
    let bad = vec![1.0f32; 3];
    let mut refused = Vec::new();
    for chunk in data.chunks(64) {
        let mut items: Vec<(Seq, &[f32])> = chunk.iter().map(|(s, v)| (*s, v.as_slice())).collect();
        if chunk[0].0 == 129 {
            items[5] = (items[5].0, &bad);
            items.push(items[0]);
        }
        for (item, result) in items.iter().zip(batched.insert_many(&items)) {
            if result.is_err() {
                refused.push(item.0);
            }
        }
    }
    for (seq, vector) in &data {
        if *seq != 134 {
            single.insert(*seq, vector).unwrap();
        }
    }

    // Then only the bad one was refused, everything else is stored once, and searches find
    // what exact search finds
    assert_eq!(refused, vec![134]);
    assert!(batched.has_graph());
    assert_eq!((batched.len(), batched.live_len()), (999, 999));
    let stored = |index: &VectorIndex| -> Vec<(Seq, Vec<f32>)> {
        index.iter().map(|(s, v)| (s, v.to_vec())).collect()
    };
    assert_eq!(stored(&batched), stored(&single));
    let queries = queries(50, 16, 10);
    let mean: f64 = queries
        .iter()
        .map(|q| {
            recall(
                &batched.search(q, 10, &any).unwrap(),
                &batched.exact_search(q, 10, &any).unwrap(),
            )
        })
        .sum::<f64>()
        / queries.len() as f64;
    assert!(mean >= 0.9, "recall@10 {mean}");
}

#[test]
fn given_a_saved_graph_when_restored_then_searches_match_and_a_corrupt_dump_is_rebuilt() {
    // Given an index with a graph and two tombstones, its graph saved and its layout taken
    let data = clustered(1_000, 16, 5);
    let mut index = VectorIndex::from_vectors(16, small_graph_params(), data.clone()).unwrap();
    index.remove(10);
    index.remove(500);
    let dir = tempfile::tempdir().unwrap();
    assert!(index.save_graph(dir.path()).unwrap());
    let layout = index.layout();
    let vectors: std::collections::HashMap<Seq, Vec<f32>> =
        index.iter().map(|(seq, v)| (seq, v.to_vec())).collect();
    let lookup = |seq: Seq| vectors.get(&seq).map(Vec::as_slice);

    // When it is restored with the graph
    let (restored, loaded) =
        VectorIndex::restore(16, small_graph_params(), &layout, lookup, Some(dir.path())).unwrap();
    assert!(loaded, "the graph came from the dump");

    // Then it holds the same vectors and answers every search exactly as before
    assert!(restored.has_graph());
    assert_eq!((restored.len(), restored.live_len()), (1_000, 998));
    let stored = |index: &VectorIndex| -> Vec<(Seq, Vec<f32>)> {
        index.iter().map(|(s, v)| (s, v.to_vec())).collect()
    };
    assert_eq!(stored(&restored), stored(&index));
    for query in queries(30, 16, 10) {
        let before = index.search(&query, 10, &any).unwrap();
        assert_eq!(restored.search(&query, 10, &any).unwrap(), before);
        assert!(!seqs(&before).contains(&10));
    }

    // And a damaged dump is not trusted: the graph is built again and searches still work
    std::fs::write(dir.path().join("graph.hnsw.graph"), b"not a graph").unwrap();
    let (rebuilt, loaded) =
        VectorIndex::restore(16, small_graph_params(), &layout, lookup, Some(dir.path())).unwrap();
    assert!(!loaded, "a damaged dump is not loaded");
    assert!(rebuilt.has_graph());
    let query = &queries(1, 16, 10)[0];
    assert!(
        recall(
            &rebuilt.search(query, 10, &any).unwrap(),
            &rebuilt.exact_search(query, 10, &any).unwrap()
        ) >= 0.8
    );
}

#[test]
fn given_the_default_rule_when_a_scope_grows_then_ef_search_grows_in_proportion_above_125k() {
    let grows = HnswParams::default();
    assert_eq!(grows.ef_search_for(1_000), 64);
    assert_eq!(grows.ef_search_for(125_000), 64);
    assert_eq!(grows.ef_search_for(250_000), 128);
    assert_eq!(grows.ef_search_for(1_000_000), 512);
    let fixed = HnswParams {
        ef_search_grows: false,
        ..HnswParams::default()
    };
    assert_eq!(fixed.ef_search_for(1_000_000), 64);
}

/// A caller's `k` must never size what the graph allocates: before it was clamped to the
/// scope's live count, `k` of 1e13 flowed into `ef` and hnsw_rs's candidate heap asked for
/// 8 EB, aborting the process.
#[test]
fn a_huge_k_on_a_graph_backed_scope_returns_the_scope_and_allocates_nothing_more() {
    let params = small_graph_params();
    let mut index = VectorIndex::new(16, params.clone()).unwrap();
    let vectors = clustered(params.exact_below * 2, 16, 7);
    for (seq, vector) in &vectors {
        index.insert(*seq, vector).unwrap();
    }
    for k in [vectors.len() + 1, 10_000_000_000_000, usize::MAX] {
        let hits = index.search(&vectors[0].1, k, &any).unwrap();
        assert_eq!(hits.len(), vectors.len(), "k = {k}");
        // A filter that rejects most rows takes the filtered paths, clamped the same way.
        let hits = index
            .search(&vectors[0].1, k, &|seq| seq % 10 == 0)
            .unwrap();
        assert_eq!(hits.len(), vectors.len() / 10, "k = {k}");
    }
}

#[test]
fn given_appended_vectors_not_yet_linked_then_searches_find_them_and_linking_changes_no_answer() {
    // Given a graph index, then vectors appended without linking
    let dim = 16;
    let vectors = clustered(600, dim, 7);
    let (first, fresh) = vectors.split_at(400);
    let mut index = VectorIndex::from_vectors(dim, small_graph_params(), first.to_vec()).unwrap();
    assert!(index.has_graph());
    let items: Vec<(Seq, &[f32])> = fresh.iter().map(|(s, v)| (*s, v.as_slice())).collect();
    assert!(index.append_many(&items).iter().all(Result::is_ok));
    assert_eq!(index.pending_links(), fresh.len());

    // Then each fresh vector is its own nearest neighbour, found before any link, at the
    // score an exact search gives it
    for (seq, vector) in fresh.iter().step_by(20) {
        let hits = index.search(vector, 5, &any).unwrap();
        assert_eq!(hits[0].seq, *seq);
        let exact = index.exact_search(vector, 1, &any).unwrap();
        assert_eq!(hits[0].score, exact[0].score);
    }
    // And once they are linked, in chunks, recall against exact search is what the graph
    // gives (every query of the mixture, as before), and nothing is pending
    let before: Vec<Vec<Hit>> = queries(20, dim, 4)
        .iter()
        .map(|q| index.search(q, 10, &any).unwrap())
        .collect();
    while index.link_pending(64) > 0 {}
    assert_eq!(index.pending_links(), 0);
    for (q, unlinked) in queries(20, dim, 4).iter().zip(&before) {
        let exact = index.exact_search(q, 10, &any).unwrap();
        let linked = index.search(q, 10, &any).unwrap();
        assert!(recall(unlinked, &exact) >= 0.9, "{:?}", seqs(unlinked));
        assert!(recall(&linked, &exact) >= 0.9, "{:?}", seqs(&linked));
    }
}

#[test]
fn given_a_graph_saved_with_rows_still_unlinked_when_restored_then_they_are_linked() {
    let dim = 16;
    let vectors = clustered(500, dim, 11);
    let (first, fresh) = vectors.split_at(300);
    let mut index = VectorIndex::from_vectors(dim, small_graph_params(), first.to_vec()).unwrap();
    let items: Vec<(Seq, &[f32])> = fresh.iter().map(|(s, v)| (*s, v.as_slice())).collect();
    index.append_many(&items);
    let dir = tempfile::tempdir().unwrap();
    assert!(index.save_graph(dir.path()).unwrap());
    let layout = index.layout();
    assert_eq!(layout.linked, Some(first.len()));

    let all: std::collections::HashMap<Seq, Vec<f32>> = vectors.iter().cloned().collect();
    let (restored, loaded) = VectorIndex::restore(
        dim,
        small_graph_params(),
        &layout,
        |seq| all.get(&seq).map(Vec::as_slice),
        Some(dir.path()),
    )
    .unwrap();
    assert!(loaded, "the saved graph is loaded, not rebuilt");
    assert_eq!(restored.pending_links(), 0);
    for (seq, vector) in fresh.iter().step_by(25) {
        assert_eq!(restored.search(vector, 1, &any).unwrap()[0].seq, *seq);
    }
}

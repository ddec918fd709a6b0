//! `bench-ann`: how one scope's `VectorIndex` performs at a given size, on synthetic
//! clustered embeddings (see `engram_fixtures::synthetic` for what the data is and is not).
//!
//! For each size: build time (one parallel build, as a restore does), then for the same set of
//! new queries drawn from the data's distribution, exact and graph latency, graph recall@k
//! against exact for each `--ef`, filtered searches, single inserts into the built index, and
//! memory per vector (resident set growth over the build, and the index's own estimate).
//!
//! `cargo run --release -p engram-bench --bin bench-ann -- --sizes 100000 --json`

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use engram_fixtures::synthetic::{Mixture, MixtureSpec};
use engram_memory::{Hit, Seq};
use engram_vector::EF_SEARCH_BASE_SIZE;
use engram_vector::{HnswParams, VectorIndex};
use hdrhistogram::Histogram;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(about = "Benchmark exact and HNSW search of one scope's vector index")]
struct Args {
    /// Index sizes (vectors in the scope) to measure, one after another.
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 384)]
    dim: usize,
    /// Topics of the synthetic data (see `engram_fixtures::synthetic`).
    #[arg(long, default_value_t = MixtureSpec::default().topics)]
    topics: usize,
    /// Clusters (groups of near-paraphrases) of the synthetic data.
    #[arg(long, default_value_t = MixtureSpec::default().clusters)]
    clusters: usize,
    /// Squared weight of the direction all vectors share.
    #[arg(long, default_value_t = MixtureSpec::default().common_share)]
    common_share: f64,
    /// Squared weight of a cluster's topic direction.
    #[arg(long, default_value_t = MixtureSpec::default().topic_share)]
    topic_share: f64,
    /// Expected squared norm of the noise around each unit centroid (same-cluster cosine is
    /// about 1 / (1 + this)).
    #[arg(long, default_value_t = MixtureSpec::default().noise_energy)]
    noise_energy: f64,
    /// Noise std of component i falls as (i+1)^-decay; 0 is isotropic (much harder).
    #[arg(long, default_value_t = MixtureSpec::default().spectrum_decay)]
    spectrum_decay: f64,
    #[arg(long, default_value_t = 500)]
    queries: usize,
    #[arg(long, default_value_t = 10)]
    k: usize,
    /// ef_search values to sweep.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,256")]
    ef: Vec<usize>,
    /// The smallest swept ef reaching this recall@k is the one reported as tuned, and the one
    /// filtered searches use.
    #[arg(long, default_value_t = 0.95)]
    target_recall: f64,
    #[arg(long, default_value_t = HnswParams::default().max_nb_conn)]
    max_nb_conn: usize,
    #[arg(long, default_value_t = HnswParams::default().ef_construction)]
    ef_construction: usize,
    /// Fractions of the scope a filter allows, for filtered-search runs.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.01")]
    filter_fractions: Vec<f64>,
    /// Single inserts into the built index, timed one by one (a projector's steady state).
    #[arg(long, default_value_t = 2_000)]
    inserts: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON document instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    data: String,
    dim: usize,
    k: usize,
    queries: usize,
    threads: usize,
    params: HnswParams,
    sizes: Vec<SizeReport>,
}

#[derive(Serialize)]
struct SizeReport {
    vectors: usize,
    build_seconds: f64,
    build_inserts_per_second: f64,
    exact: Latency,
    ann: Vec<AnnRun>,
    /// Smallest swept ef whose recall reached the target, if any did.
    tuned_ef: Option<usize>,
    filtered: Vec<FilteredRun>,
    single_insert: Latency,
    rss_bytes_per_vector: f64,
    estimated_bytes_per_vector: f64,
    raw_vector_bytes: usize,
}

#[derive(Serialize)]
struct AnnRun {
    ef: usize,
    latency: Latency,
    recall: f64,
    speedup_p50: f64,
}

#[derive(Serialize)]
struct FilteredRun {
    allowed_fraction: f64,
    ef: usize,
    latency: Latency,
    exact: Latency,
    recall: f64,
}

#[derive(Serialize, Clone, Copy)]
struct Latency {
    p50_ms: f64,
    p99_ms: f64,
    mean_ms: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.sizes.is_empty() || args.ef.is_empty() || args.queries == 0 || args.k == 0 {
        bail!("--sizes, --ef, --queries and --k must not be empty or zero");
    }
    let params = HnswParams {
        max_nb_conn: args.max_nb_conn,
        ef_construction: args.ef_construction,
        // The sweep measures each ef as given; the default rule's choice per size is printed.
        ef_search_grows: false,
        ..HnswParams::default()
    };
    params.validate().context("invalid graph parameters")?;
    let mixture = Mixture::new(
        MixtureSpec {
            dim: args.dim,
            topics: args.topics,
            clusters: args.clusters,
            common_share: args.common_share,
            topic_share: args.topic_share,
            noise_energy: args.noise_energy,
            spectrum_decay: args.spectrum_decay,
        },
        args.seed,
    );
    let mut report = Report {
        data: mixture.describe(),
        dim: args.dim,
        k: args.k,
        queries: args.queries,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        params: params.clone(),
        sizes: Vec::new(),
    };
    if !args.json {
        println!("data: {}", report.data);
        println!(
            "dim {}, k {}, {} queries (new draws, not in the index), {} threads, {:?}",
            args.dim, args.k, args.queries, report.threads, params
        );
    }
    for &size in &args.sizes {
        let result = bench_size(&args, &mixture, &params, size)?;
        if !args.json {
            print_size(&result, args.k);
        }
        report.sizes.push(result);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

fn bench_size(
    args: &Args,
    mixture: &Mixture,
    params: &HnswParams,
    size: usize,
) -> anyhow::Result<SizeReport> {
    let dim = args.dim;
    let progress = |what: &str| eprintln!("[{size}] {what}");

    progress("generating vectors");
    let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(size as u64));
    let mut data = Vec::with_capacity(size * dim);
    for _ in 0..size {
        mixture.sample_into(&mut rng, &mut data);
    }
    let mut query_rng = StdRng::seed_from_u64(args.seed.wrapping_add(u64::MAX / 2));
    let queries: Vec<Vec<f32>> = (0..args.queries)
        .map(|_| mixture.sample(&mut query_rng))
        .collect();

    progress("building (parallel insert)");
    let rss_before = resident_bytes()?;
    let started = Instant::now();
    let rows = (0..size).map(|i| (i as Seq + 1, &data[i * dim..(i + 1) * dim]));
    let mut index = VectorIndex::from_vectors(dim, params.clone(), rows)?;
    let build = started.elapsed();
    let rss_delta = resident_bytes()?.saturating_sub(rss_before);
    let estimated = index.memory_bytes();
    drop(data);
    progress(&format!(
        "built in {:.1} s, resident growth {rss_delta} B, estimate {estimated} B",
        build.as_secs_f64()
    ));
    if size >= params.exact_below && !index.has_graph() {
        bail!("index of {size} vectors has no graph");
    }

    progress("exact searches");
    let any = |_: Seq| true;
    let mut exact_latency = new_histogram();
    let mut truth = Vec::with_capacity(queries.len());
    for query in &queries {
        let started = Instant::now();
        let hits = index.exact_search(query, args.k, &any)?;
        record(&mut exact_latency, started.elapsed());
        truth.push(hits);
    }
    let exact = latency(&exact_latency);
    progress(&format!(
        "exact p50 {:.3} ms, p99 {:.3} ms",
        exact.p50_ms, exact.p99_ms
    ));

    let mut ann = Vec::new();
    for &ef in &args.ef {
        progress(&format!("graph searches, ef {ef}"));
        index.set_ef_search(ef);
        let (latency_ms, recall) = timed_recall(&index, &queries, &truth, args.k, &any)?;
        progress(&format!(
            "ef {ef}: p50 {:.3} ms, p99 {:.3} ms, recall {recall:.4}",
            latency_ms.p50_ms, latency_ms.p99_ms
        ));
        ann.push(AnnRun {
            ef,
            latency: latency_ms,
            recall,
            speedup_p50: exact.p50_ms / latency_ms.p50_ms,
        });
    }
    let tuned_ef = ann
        .iter()
        .find(|run| run.recall >= args.target_recall)
        .map(|run| run.ef);
    let filter_ef = tuned_ef.unwrap_or_else(|| *args.ef.iter().max().unwrap_or(&64));
    index.set_ef_search(filter_ef);

    let mut filtered = Vec::new();
    for &fraction in &args.filter_fractions {
        progress(&format!("filtered searches, {fraction} allowed"));
        let threshold = (fraction.clamp(0.0, 1.0) * u64::MAX as f64) as u64;
        let filter = move |seq: Seq| splitmix64(seq) <= threshold;
        let mut exact_latency = new_histogram();
        let mut filtered_truth = Vec::with_capacity(queries.len());
        for query in &queries {
            let started = Instant::now();
            let hits = index.exact_search(query, args.k, &filter)?;
            record(&mut exact_latency, started.elapsed());
            filtered_truth.push(hits);
        }
        let (latency_ms, recall) =
            timed_recall(&index, &queries, &filtered_truth, args.k, &filter)?;
        filtered.push(FilteredRun {
            allowed_fraction: fraction,
            ef: filter_ef,
            latency: latency_ms,
            exact: latency(&exact_latency),
            recall,
        });
    }

    progress("single inserts");
    let mut insert_latency = new_histogram();
    let mut vector = Vec::with_capacity(dim);
    for i in 0..args.inserts {
        vector.clear();
        mixture.sample_into(&mut rng, &mut vector);
        let started = Instant::now();
        index.insert((size + i) as Seq + 1, &vector)?;
        record(&mut insert_latency, started.elapsed());
    }

    Ok(SizeReport {
        vectors: size,
        build_seconds: build.as_secs_f64(),
        build_inserts_per_second: size as f64 / build.as_secs_f64(),
        exact,
        ann,
        tuned_ef,
        filtered,
        single_insert: latency(&insert_latency),
        rss_bytes_per_vector: rss_delta as f64 / size as f64,
        estimated_bytes_per_vector: estimated as f64 / size as f64,
        raw_vector_bytes: dim * size_of::<f32>(),
    })
}

/// Latency of `index.search` over `queries`, and its mean recall@k against `truth`.
fn timed_recall(
    index: &VectorIndex,
    queries: &[Vec<f32>],
    truth: &[Vec<Hit>],
    k: usize,
    filter: &dyn Fn(Seq) -> bool,
) -> anyhow::Result<(Latency, f64)> {
    let mut histogram = new_histogram();
    let mut recall_sum = 0.0;
    for (query, exact) in queries.iter().zip(truth) {
        let started = Instant::now();
        let hits = index.search(query, k, filter)?;
        record(&mut histogram, started.elapsed());
        let found = hits
            .iter()
            .filter(|hit| exact.iter().any(|e| e.seq == hit.seq))
            .count();
        recall_sum += if exact.is_empty() {
            1.0
        } else {
            found as f64 / exact.len() as f64
        };
    }
    Ok((latency(&histogram), recall_sum / queries.len() as f64))
}

fn print_size(result: &SizeReport, k: usize) {
    println!("\n== {} vectors ==", result.vectors);
    println!(
        "build: {:.1} s, {:.0} inserts/s (parallel)",
        result.build_seconds, result.build_inserts_per_second
    );
    println!(
        "memory per vector: {:.0} B resident growth, {:.0} B estimated (raw vector {} B)",
        result.rss_bytes_per_vector, result.estimated_bytes_per_vector, result.raw_vector_bytes
    );
    println!(
        "exact: p50 {:.3} ms, p99 {:.3} ms",
        result.exact.p50_ms, result.exact.p99_ms
    );
    for run in &result.ann {
        println!(
            "ann ef {:>4}: p50 {:.3} ms, p99 {:.3} ms, recall@{k} {:.4}, speedup (p50) {:.1}x",
            run.ef, run.latency.p50_ms, run.latency.p99_ms, run.recall, run.speedup_p50
        );
    }
    match result.tuned_ef {
        Some(ef) => {
            println!("tuned ef_search: {ef} (smallest swept ef reaching the target recall)")
        }
        None => println!("tuned ef_search: none of the swept values reached the target recall"),
    }
    println!(
        "the default rule (ef_search 64, growing above {EF_SEARCH_BASE_SIZE} vectors) searches this size with ef {}",
        HnswParams::default().ef_search_for(result.vectors)
    );
    for run in &result.filtered {
        println!(
            "filtered {:.3} allowed, ef {}: p50 {:.3} ms, p99 {:.3} ms, recall@{k} {:.4} (exact p50 {:.3} ms)",
            run.allowed_fraction,
            run.ef,
            run.latency.p50_ms,
            run.latency.p99_ms,
            run.recall,
            run.exact.p50_ms
        );
    }
    println!(
        "single insert into the built index: p50 {:.3} ms, p99 {:.3} ms",
        result.single_insert.p50_ms, result.single_insert.p99_ms
    );
}

fn new_histogram() -> Histogram<u64> {
    // Nanoseconds up to an hour, three significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX).max(1);
    histogram.saturating_record(nanos);
}

fn latency(histogram: &Histogram<u64>) -> Latency {
    let ms = |nanos: u64| nanos as f64 / 1e6;
    Latency {
        p50_ms: ms(histogram.value_at_quantile(0.5)),
        p99_ms: ms(histogram.value_at_quantile(0.99)),
        mean_ms: histogram.mean() / 1e6,
    }
}

/// Resident set size from /proc/self/status (VmRSS, in kB, so no page size is assumed).
fn resident_bytes() -> anyhow::Result<usize> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("failed to read /proc/self/status")?;
    let line = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .context("no VmRSS line in /proc/self/status")?;
    let kb: usize = line
        .split_whitespace()
        .nth(1)
        .context("malformed VmRSS line")?
        .parse()
        .context("malformed VmRSS value")?;
    Ok(kb * 1024)
}

/// A well-mixed hash, so filters pick scattered sequences, unrelated to clusters or order.
fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

//! `engram-bench query`: retrieval latency through the whole system at a given scope size,
//! beside its physical reference in the same run.
//!
//! N memories with client-supplied 384-dim vectors (the clustered synthetic mixture of
//! `engram_fixtures::synthetic`) and short texts from a fixed vocabulary go into one scope
//! through the bus. Once the projectors have applied them (read-your-writes on the last
//! sequence), each query is asked in dense, BM25 and hybrid mode through the query service.
//! The same vectors are also loaded into an in-process `VectorIndex`, and every query vector
//! is searched there exactly and through the graph: that is the reference for the dense
//! mode's latency (what the service adds over the bare index) and for its recall.

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::Instant;

use crate::progress;
use engram::config::Config;
use engram_embed::EmbedderConfig;
use engram_fixtures::synthetic::{Mixture, MixtureSpec};
use engram_memory::proto::{Consistency, RetrievalMode, RetrieveRequest, ScopeRequest};
use engram_schema::{Content, Embedding, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::{Client, RetryPolicy};
use engram_vector::{HnswParams, VectorIndex};
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// The model name the benchmark's vectors claim; the embedded deployment accepts only it.
const MODEL: &str = "bench-synthetic-384";
const DIM: usize = 384;

/// Words the memories' texts are drawn from: a few hundred, so that BM25 has postings of
/// every length.
const WORDS: &[&str] = &[
    "deploy",
    "rollback",
    "cluster",
    "latency",
    "timeout",
    "retry",
    "cache",
    "index",
    "schema",
    "migration",
    "token",
    "login",
    "session",
    "queue",
    "worker",
    "backoff",
    "replica",
    "shard",
    "leader",
    "election",
    "snapshot",
    "stream",
    "consumer",
    "ack",
    "lag",
    "budget",
    "context",
    "prompt",
    "embedding",
    "vector",
    "keyword",
    "fact",
    "skill",
    "outcome",
    "failure",
    "success",
    "test",
    "build",
    "compile",
    "lint",
    "format",
    "docker",
    "kubernetes",
    "helm",
    "terraform",
    "bucket",
    "object",
    "policy",
    "role",
    "permission",
    "secret",
    "vault",
    "rotate",
    "certificate",
    "proxy",
    "gateway",
    "route",
    "header",
    "payload",
    "json",
    "msgpack",
    "protobuf",
    "grpc",
    "http",
    "socket",
    "tls",
    "dns",
    "ipv6",
    "subnet",
    "firewall",
    "alert",
    "metric",
    "trace",
    "span",
    "log",
    "dashboard",
    "incident",
    "postmortem",
    "runbook",
    "oncall",
    "pager",
    "ticket",
    "sprint",
    "review",
    "merge",
    "branch",
    "commit",
    "release",
    "tag",
    "changelog",
    "version",
    "upgrade",
    "downgrade",
    "patch",
    "hotfix",
    "regression",
    "flaky",
    "benchmark",
    "profile",
    "memory",
    "leak",
    "heap",
    "stack",
    "thread",
    "mutex",
    "deadlock",
    "race",
    "atomic",
    "lock",
];

#[derive(Debug, clap::Args)]
pub struct QueryArgs {
    /// Memories in the one scope queried.
    #[arg(long, default_value_t = 100_000)]
    pub memories: usize,
    /// Queries per mode.
    #[arg(long, default_value_t = 500)]
    pub queries: usize,
    /// Results per query.
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    memories: usize,
    queries: usize,
    top_k: usize,
    ingest_seconds: f64,
    projection_seconds: f64,
    /// Through the query service, per mode.
    service: Vec<ModeFigures>,
    /// The same vectors in an in-process index.
    index_exact: Latency,
    index_graph: Latency,
    index_graph_recall: f64,
    /// Dense-mode results through the service against the exact top-k.
    service_dense_recall: f64,
}

#[derive(Debug, Serialize)]
struct ModeFigures {
    mode: &'static str,
    latency: Latency,
    /// Messages the client published per query, from its NATS client's statistics: its
    /// requests (one round trip each).
    client_requests_per_query: f64,
    /// Messages the query service published per query on its own connection: requests to
    /// read models it does not host, stream lookups. 0 when the node answers in process.
    service_messages_per_query: f64,
}

#[derive(Debug, Serialize)]
struct Latency {
    p50_ms: f64,
    p99_ms: f64,
}

impl Latency {
    fn of(h: &Histogram<u64>) -> Self {
        Self {
            p50_ms: h.value_at_quantile(0.5) as f64 / 1000.0,
            p99_ms: h.value_at_quantile(0.99) as f64 / 1000.0,
        }
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("static bounds")
}

pub async fn run(config: &Config, args: QueryArgs, json: bool) -> anyhow::Result<ExitCode> {
    if args.memories == 0 || args.queries == 0 || args.top_k == 0 {
        anyhow::bail!("--memories, --queries and --top-k must be at least 1");
    }
    let (home, mut local) = crate::temporary_home(config)?;
    local.projectors.embedder = EmbedderConfig::ClientSupplied {
        model: MODEL.into(),
        dim: DIM,
    };
    eprintln!("starting an embedded engram in {}", home.path().display());
    let up = engram::up::start(&local, 0).await?;
    // A connection of the benchmark's own: its statistics count only its queries.
    let bus = engram_bus::Bus::connect(up.bus.config().clone()).await?;
    let client = Client::from_bus(bus, RetryPolicy::default());
    let service_sent = || up.node.as_ref().map_or(0, |n| n.query_messages_sent());
    let result = bench(&client, &args, &local.projectors.hnsw, &service_sent).await;
    up.shutdown().await;
    drop(home);
    let report = result?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&report);
    }
    Ok(ExitCode::SUCCESS)
}

async fn bench(
    client: &Client,
    args: &QueryArgs,
    hnsw: &HnswParams,
    service_sent: &dyn Fn() -> u64,
) -> anyhow::Result<Report> {
    let client_sent = || {
        client
            .bus()
            .client()
            .statistics()
            .out_messages
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mixture = Mixture::new(
        MixtureSpec {
            dim: DIM,
            ..MixtureSpec::default()
        },
        args.seed,
    );
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let tenant = Ident::parse("tenant", "bench")?;
    let agent = Ident::parse("agent", "bench-query")?;
    let scope = Scope::new(ScopeKind::Task, "bench-query")?;

    let bar = progress(args.memories as u64, "appending memories");
    let mut vectors: Vec<(u64, Vec<f32>)> = Vec::with_capacity(args.memories);
    let mut last_seq = 0;
    let started = Instant::now();
    let mut pending: Vec<Envelope> = Vec::with_capacity(512);
    let mut pending_vectors: Vec<Vec<f32>> = Vec::with_capacity(512);
    for i in 0..args.memories {
        let vector = mixture.sample(&mut rng);
        let mut event = Envelope::new(
            tenant.clone(),
            scope.clone(),
            agent.clone(),
            agent.clone(),
            Layer::Episodic,
            EventKind::Observation,
            Content::text(sentence(&mut rng, 12)),
        );
        event.embedding = Some(Embedding {
            model: MODEL.into(),
            vector: vector.clone(),
        });
        pending.push(event);
        pending_vectors.push(vector);
        if pending.len() == 512 || i + 1 == args.memories {
            let receipts = client.append_batch(&pending).await;
            for (receipt, vector) in receipts.into_iter().zip(pending_vectors.drain(..)) {
                let seq = receipt?.seq;
                last_seq = last_seq.max(seq);
                vectors.push((seq, vector));
            }
            bar.inc(pending.len() as u64);
            pending.clear();
        }
    }
    bar.finish_and_clear();
    let ingest_seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "appended {} memories in {ingest_seconds:.1} s; waiting for the projectors",
        args.memories
    );

    let scopes = ScopeRequest {
        tenant,
        scope,
        grants: Vec::new(),
    };
    let request = |query: String, vector: Vec<f32>, mode, min_seq: Option<u64>| RetrieveRequest {
        scopes: scopes.clone(),
        query,
        vector: Some(vector),
        top_k: args.top_k,
        filter: Default::default(),
        consistency: Consistency {
            min_seq,
            wait_ms: None,
        },
        mode,
        ranking: None,
    };
    let waited = Instant::now();
    crate::retrieve_when_visible(
        client,
        request(
            "deploy".into(),
            mixture.sample(&mut rng),
            RetrievalMode::Hybrid,
            Some(last_seq),
        ),
        std::time::Duration::from_secs(3600),
    )
    .await?;
    let projection_seconds = waited.elapsed().as_secs_f64();
    eprintln!("projected in {projection_seconds:.1} s after the last append");

    let queries: Vec<(String, Vec<f32>)> = (0..args.queries)
        .map(|_| (sentence(&mut rng, 3), mixture.sample(&mut rng)))
        .collect();

    let modes = [
        ("dense", RetrievalMode::Dense),
        ("bm25", RetrievalMode::Keyword),
        ("hybrid", RetrievalMode::Hybrid),
    ];
    let mut service = Vec::new();
    let mut dense_results: Vec<Vec<u64>> = Vec::new();
    let bar = progress((args.queries * modes.len()) as u64, "querying the service");
    for (name, mode) in modes {
        let mut h = histogram();
        let (client_before, service_before) = (client_sent(), service_sent());
        for (text, vector) in &queries {
            let started = Instant::now();
            let response = client
                .retrieve(&request(text.clone(), vector.clone(), mode, None))
                .await?;
            h.record(started.elapsed().as_micros().max(1) as u64)?;
            if mode == RetrievalMode::Dense {
                dense_results.push(response.results.iter().map(|r| r.seq).collect());
            }
            bar.inc(1);
        }
        let per_query = |n: u64| n as f64 / queries.len().max(1) as f64;
        service.push(ModeFigures {
            mode: name,
            latency: Latency::of(&h),
            client_requests_per_query: per_query(client_sent() - client_before),
            service_messages_per_query: per_query(service_sent() - service_before),
        });
    }
    bar.finish_and_clear();

    eprintln!(
        "building the in-process reference index ({} vectors)",
        vectors.len()
    );
    let params = hnsw.clone();
    let (index_exact, index_graph, index_graph_recall, service_dense_recall) =
        tokio::task::spawn_blocking({
            let queries: Vec<Vec<f32>> = queries.iter().map(|(_, v)| v.clone()).collect();
            let k = args.top_k;
            move || -> anyhow::Result<(Latency, Latency, f64, f64)> {
                let index = VectorIndex::from_vectors(DIM, params, vectors)?;
                let any = |_| true;
                let (mut exact_h, mut graph_h) = (histogram(), histogram());
                let (mut graph_recall, mut service_recall) = (0.0, 0.0);
                for (query, service_seqs) in queries.iter().zip(&dense_results) {
                    let started = Instant::now();
                    let exact = index.exact_search(query, k, &any)?;
                    exact_h.record(started.elapsed().as_micros().max(1) as u64)?;
                    let started = Instant::now();
                    let graph = index.search(query, k, &any)?;
                    graph_h.record(started.elapsed().as_micros().max(1) as u64)?;
                    let truth: HashSet<u64> = exact.iter().map(|h| h.seq).collect();
                    let share = |seqs: &mut dyn Iterator<Item = u64>| {
                        seqs.filter(|s| truth.contains(s)).count() as f64
                            / truth.len().max(1) as f64
                    };
                    graph_recall += share(&mut graph.iter().map(|h| h.seq));
                    service_recall += share(&mut service_seqs.iter().copied());
                }
                let n = queries.len().max(1) as f64;
                Ok((
                    Latency::of(&exact_h),
                    Latency::of(&graph_h),
                    graph_recall / n,
                    service_recall / n,
                ))
            }
        })
        .await??;

    Ok(Report {
        memories: args.memories,
        queries: args.queries,
        top_k: args.top_k,
        ingest_seconds,
        projection_seconds,
        service,
        index_exact,
        index_graph,
        index_graph_recall,
        service_dense_recall,
    })
}

fn print(r: &Report) {
    println!(
        "{} memories in one scope, client-supplied {DIM}-dim vectors (synthetic clustered mixture), {} queries per mode, top {}",
        r.memories, r.queries, r.top_k
    );
    println!(
        "ingest {:.1} s, then projection done {:.1} s after the last append",
        r.ingest_seconds, r.projection_seconds
    );
    println!(
        "{:<34} {:>9} {:>9} {:>10}",
        "search", "p50 ms", "p99 ms", "recall@k"
    );
    let row = |name: &str, l: &Latency, recall: Option<f64>| {
        let recall = recall.map_or("-".to_owned(), |r| format!("{r:.4}"));
        println!(
            "{:<34} {:>9.3} {:>9.3} {:>10}",
            name, l.p50_ms, l.p99_ms, recall
        );
    };
    row("in-process exact scan", &r.index_exact, Some(1.0));
    row(
        "in-process index (default params)",
        &r.index_graph,
        Some(r.index_graph_recall),
    );
    for m in &r.service {
        let recall = (m.mode == "dense").then_some(r.service_dense_recall);
        row(
            &format!("retrieve via service, {}", m.mode),
            &m.latency,
            recall,
        );
    }
    for m in &r.service {
        println!(
            "{}: {:.2} client requests and {:.2} service messages per query (NATS client statistics)",
            m.mode, m.client_requests_per_query, m.service_messages_per_query
        );
    }
}

fn sentence(rng: &mut SmallRng, words: usize) -> String {
    let n = rng.random_range(words.max(2) / 2..=words.max(2));
    (0..n)
        .map(|_| *WORDS.choose(rng).expect("non-empty vocabulary"))
        .collect::<Vec<_>>()
        .join(" ")
}

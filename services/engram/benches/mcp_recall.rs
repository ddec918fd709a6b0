//! The MCP `recall` round trip over stdio, beside the same retrieval through the native SDK,
//! in one run against one `engram up`: what the MCP layer (a child process, JSON-RPC over
//! pipes, argument decoding, result shaping) costs on top of the query itself.
//!
//! `cargo bench -p engram --bench mcp_recall` (`MCP_BENCH_CALLS`, default 200;
//! `MCP_BENCH_MEMORIES`, default 200; `MCP_BENCH_WARMUP` calls before timing, default 10).
//! `cargo test` runs it too (the target has `test = true`), on tiny inputs (5 calls, 20
//! memories, 2 warm-up calls), so the published figures come from code known to work: cargo
//! passes `--bench` only to a benchmark run.
//! Prints p50, p90, p99 and the slowest call of both, and the ratios of p50 and p99. Every
//! distinct query is embedded before timing, so both sides measure a cached embedding: a first
//! embedding would be charged to whichever side asked first.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engram_sdk::proto::{Consistency, RetrievalMode, RetrieveRequest, ScopeRequest};
use engram_sdk::{BusConfig, Client, EventKind, Layer, MemoryFilter, RetryPolicy, Scope};
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, ClientConfig};
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use serde_json::json;

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");

const TOPICS: [&str; 10] = [
    "the checkout page times out when the payments API is slow",
    "login fails with a 500 after the session store restarts",
    "the nightly export job runs out of memory on large tenants",
    "search results are stale because the indexer lags behind",
    "the mobile app crashes when the profile photo is missing",
    "emails are delayed because the queue consumer was paused",
    "the billing report double counts refunds issued on the same day",
    "deploys fail when the migration takes a lock on the orders table",
    "the cache hit rate dropped after the key format changed",
    "uploads over 2 GB are rejected by the load balancer",
];

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run(c: &mut Command) -> String {
    let out = c.output().expect("run engram");
    assert!(
        out.status.success(),
        "{:?}: {}",
        c.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(what: &str, mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let (p50, p99) = (percentile(&samples, 0.5), percentile(&samples, 0.99));
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{what:<28} n={:<5} p50={:>8.3} ms  p90={:>8.3} ms  p99={:>8.3} ms  max={:>8.3} ms",
        samples.len(),
        ms(p50),
        ms(percentile(&samples, 0.9)),
        ms(p99),
        ms(*samples.last().unwrap())
    );
    (p50, p99)
}

/// The defaults of a benchmark run, or of the test suite's tiny one.
struct Sizes {
    calls: usize,
    memories: usize,
    warmup: usize,
}

const BENCH: Sizes = Sizes {
    calls: 200,
    memories: 200,
    warmup: 10,
};
const TEST: Sizes = Sizes {
    calls: 5,
    memories: 20,
    warmup: 2,
};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        // `cargo test -- --list`: name the one "test" this target is, run nothing.
        println!("mcp_recall: test");
        return;
    }
    let sizes = if args.iter().any(|a| a == "--bench") {
        BENCH
    } else {
        TEST
    };
    let calls = env_usize("MCP_BENCH_CALLS", sizes.calls);
    let memories = env_usize("MCP_BENCH_MEMORIES", sizes.memories);
    let home = tempfile::tempdir().unwrap();
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let mut up = Command::new(ENGRAM)
        .args([
            "up",
            "--nats-port",
            &lease.port().to_string(),
            "--http",
            "127.0.0.1:0",
        ])
        .env("ENGRAM_HOME", home.path())
        .env_remove("ENGRAM_CONFIG")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let ready = loop {
        let line = lines
            .next()
            .expect("engram up exited")
            .expect("engram up output");
        if line.contains("engram is up") {
            break line;
        }
    };
    let nats = ready
        .split_whitespace()
        .find_map(|t| t.strip_prefix("nats="))
        .unwrap()
        .to_owned();
    let cli = || {
        let mut c = Command::new(ENGRAM);
        c.env("ENGRAM_HOME", home.path())
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_CREDS")
            .args(["--nats", &nats]);
        c
    };
    run(cli().args(["tenant", "add", "acme"]));
    let issued: serde_json::Value = serde_json::from_str(&run(cli().args([
        "--json", "key", "add", "--tenant", "acme", "--agent", "bench",
    ])))
    .unwrap();
    let key = issued["api_key"].as_str().unwrap().to_owned();
    let creds = engram_access::Credentials::from_api_key(&key).unwrap();

    // The native side: the SDK as the same agent, connected once the server knows the key.
    let bus = BusConfig {
        url: nats.clone(),
        nkey: Some(engram_bus::NkeyAuth::of(&creds)),
        ..BusConfig::default()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let client = loop {
        match Client::with_config(bus.clone(), RetryPolicy::default(), false).await {
            Ok(client) => break client,
            // The server takes a new key with its next config reload.
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the key never worked: {e}"),
        }
    };
    let scope: Scope = "task:bench".parse().unwrap();
    let agent = client.agent("acme", "bench", "seed").unwrap();
    let mut last = 0;
    for i in 0..memories {
        let text = format!("{} (case {i})", TOPICS[i % TOPICS.len()]);
        let receipt = agent
            .event(scope.clone(), Layer::Episodic, EventKind::Observation, text)
            .append()
            .await
            .unwrap();
        last = receipt.seq;
    }
    let queries: Vec<String> = (0..calls)
        .map(|i| format!("why {}", TOPICS[i % TOPICS.len()]))
        .collect();
    let request = |query: &str, min_seq: Option<u64>| RetrieveRequest {
        scopes: ScopeRequest {
            tenant: engram_sdk::Ident::parse("tenant", "acme").unwrap(),
            scope: scope.clone(),
            grants: Vec::new(),
        },
        query: query.to_owned(),
        vector: None,
        top_k: 8,
        // As the MCP tool asks: memories only (its server wrote nothing, so it names no min_seq).
        filter: MemoryFilter {
            kinds: vec![
                EventKind::Observation,
                EventKind::Action,
                EventKind::Outcome,
                EventKind::Preference,
                EventKind::Feedback,
                EventKind::Checkpoint,
                EventKind::Consolidated,
                EventKind::FactAsserted,
                EventKind::SkillRecorded,
            ],
            ..MemoryFilter::default()
        },
        consistency: Consistency {
            min_seq,
            wait_ms: Some(20_000),
        },
        mode: RetrievalMode::Hybrid,
        ranking: None,
    };
    // Every memory indexed (and the embedder warm) before anything is timed.
    client
        .retrieve(&request("warm up", Some(last)))
        .await
        .unwrap();

    let command = tokio::process::Command::new(ENGRAM).configure(|c| {
        c.args([
            "--nats",
            &nats,
            "mcp",
            "--key",
            &key,
            "--scope",
            "task:bench",
        ])
        .env("ENGRAM_HOME", home.path())
        .env("RUST_LOG", "warn")
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_CREDS");
    });
    let mcp = ClientConfig::default()
        .serve(TokioChildProcess::new(command).unwrap())
        .await
        .unwrap();
    let recall = |query: &str| {
        CallToolRequestParams::new("recall").with_arguments(
            json!({"query": query, "limit": 8})
                .as_object()
                .unwrap()
                .clone(),
        )
    };
    for _ in 0..env_usize("MCP_BENCH_WARMUP", sizes.warmup) {
        let warm = mcp.call_tool(recall("warm up")).await.unwrap();
        assert_ne!(warm.is_error, Some(true), "{warm:?}");
    }

    // Each distinct query embedded once before timing: the embedding cache would otherwise
    // charge it to whichever side asks first.
    let mut distinct = queries.clone();
    distinct.sort();
    distinct.dedup();
    for query in &distinct {
        client.retrieve(&request(query, None)).await.unwrap();
    }

    // Interleaved, so both sides see the same machine load.
    let (mut over_mcp, mut native) = (Vec::new(), Vec::new());
    for query in &queries {
        let started = Instant::now();
        let result = mcp.call_tool(recall(query)).await.unwrap();
        over_mcp.push(started.elapsed());
        assert_ne!(result.is_error, Some(true), "{result:?}");
        let recalled = result
            .structured_content
            .as_ref()
            .and_then(|r| r["memories"].as_array());
        assert!(recalled.is_some_and(|m| !m.is_empty()), "{result:?}");
        let started = Instant::now();
        let response = client.retrieve(&request(query, None)).await.unwrap();
        native.push(started.elapsed());
        assert!(!response.results.is_empty());
    }
    println!("recall round trip, {memories} memories in one scope, top 8, hybrid:");
    let (mcp50, mcp99) = report("mcp recall (stdio)", over_mcp);
    let (sdk50, sdk99) = report("sdk retrieve (native)", native);
    println!(
        "ratio mcp/sdk: p50 {:.2}x  p99 {:.2}x",
        mcp50.as_secs_f64() / sdk50.as_secs_f64(),
        mcp99.as_secs_f64() / sdk99.as_secs_f64()
    );
    mcp.cancel().await.unwrap();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(up.id() as libc::pid_t, libc::SIGTERM) };
    let _ = up.wait();
}

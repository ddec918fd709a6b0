//! `engram-bench gateway`: what the HTTP API adds over the native NATS path, in one run.
//!
//! One embedded `engram up` (authentication on, as deployed) with one agent key. The same
//! agent identity then appends and retrieves two ways, alternating request by request so
//! that both see the same machine: natively (the SDK over NATS with the agent's
//! credentials) and through the gateway (HTTP/1.1 keep-alive to `/v1/events` and
//! `/v1/retrieve` with the API key). The bodies are the same events and the same requests.
//! The ratios of the percentiles are the overhead; the target is at most 1.3x at p99
//! for retrieve.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use engram::config::Config;
use engram_access::{AccessLog, Credentials, Record, ScopePattern};
use engram_embed::EmbedderConfig;
use engram_memory::proto::{Consistency, RetrievalMode, RetrieveRequest, ScopeRequest};
use engram_schema::{Content, Embedding, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::{Client, RetryPolicy};
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::progress;

const MODEL: &str = "bench-synthetic-384";
const DIM: usize = 384;

#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// Memories in the scope before retrieval is timed.
    #[arg(long, default_value_t = 5_000)]
    pub memories: usize,
    /// Timed requests per path and operation.
    #[arg(long, default_value_t = 1_000)]
    pub requests: usize,
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

#[derive(Debug, Serialize)]
struct Pair {
    operation: &'static str,
    native: Latency,
    gateway: Latency,
    p50_ratio: f64,
    p99_ratio: f64,
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

#[derive(Debug, Serialize)]
struct Report {
    memories: usize,
    requests: usize,
    pairs: Vec<Pair>,
    /// A keyless request (401 before any NATS): the HTTP round trip itself.
    http_floor: Latency,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("static bounds")
}

fn vector(rng: &mut SmallRng) -> Vec<f32> {
    let v: Vec<f32> = (0..DIM).map(|_| rng.random::<f32>() - 0.5).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    v.into_iter().map(|x| x / norm).collect()
}

pub async fn run(config: &Config, args: GatewayArgs, json: bool) -> anyhow::Result<ExitCode> {
    if args.memories == 0 || args.requests == 0 || args.top_k == 0 {
        anyhow::bail!("--memories, --requests and --top-k must be at least 1");
    }
    let (home, mut local) = crate::temporary_home(config)?;
    local.projectors.embedder = EmbedderConfig::ClientSupplied {
        model: MODEL.into(),
        dim: DIM,
    };
    // The benchmark's own requests are many more than a real agent's rate.
    local.gateway.rate_per_second = 1e6;
    local.gateway.burst = 1e6;
    eprintln!("starting an embedded engram in {}", home.path().display());
    let up = engram::up::start(&local, 0).await?;
    let result = bench(&up, &args).await;
    up.shutdown().await;
    drop(home);
    let report = result?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} memories in one scope, {} timed requests per path, the same agent identity on both",
            report.memories, report.requests
        );
        println!(
            "{:<10} {:>12} {:>12} {:>12} {:>12} {:>9} {:>9}",
            "operation", "native p50", "native p99", "http p50", "http p99", "p50 x", "p99 x"
        );
        for p in &report.pairs {
            println!(
                "{:<10} {:>10.3}ms {:>10.3}ms {:>10.3}ms {:>10.3}ms {:>9.2} {:>9.2}",
                p.operation,
                p.native.p50_ms,
                p.native.p99_ms,
                p.gateway.p50_ms,
                p.gateway.p99_ms,
                p.p50_ratio,
                p.p99_ratio
            );
        }
        println!(
            "http floor (a keyless request, answered 401 without NATS): p50 {:.3}ms p99 {:.3}ms",
            report.http_floor.p50_ms, report.http_floor.p99_ms
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn bench(up: &engram::up::Running, args: &GatewayArgs) -> anyhow::Result<Report> {
    let tenant = Ident::parse("tenant", "bench")?;
    let agent = Ident::parse("agent", "gateway-bench")?;
    let scope = Scope::new(ScopeKind::Task, "gateway-bench")?;
    let log = AccessLog::new(up.bus.client().clone());
    let creds = Credentials::generate_agent(tenant.clone(), agent.clone());
    log.append(
        Record::TenantAdded {
            tenant: tenant.clone(),
        },
        "engram-bench",
    )
    .await?;
    log.append(
        Record::AgentKeyAdded {
            tenant: tenant.clone(),
            agent: agent.clone(),
            key: creds.public_key(),
            scopes: ScopePattern::defaults(&agent),
            expires_at: None,
        },
        "engram-bench",
    )
    .await?;
    // The server takes the key with its next reload, moments after the record.
    let native = {
        let started = Instant::now();
        loop {
            let config = engram_bus::BusConfig {
                nkey: Some(engram_bus::NkeyAuth::of(&creds)),
                url: up.nats_url.clone(),
                ..up.bus.config().clone()
            };
            match Client::with_config(config, RetryPolicy::default(), false).await {
                Ok(c) => break c,
                Err(_) if started.elapsed() < Duration::from_secs(30) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => anyhow::bail!("the agent key never connected: {e}"),
            }
        }
    };
    let api_key = creds
        .api_key()
        .ok_or_else(|| anyhow::anyhow!("agent credentials have an API key"))?;
    let base = format!("http://{}", up.http_addr);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(4)
        .build()?;

    let mut rng = SmallRng::seed_from_u64(args.seed);
    let event = |rng: &mut SmallRng, i: usize| {
        let mut e = Envelope::new(
            tenant.clone(),
            scope.clone(),
            agent.clone(),
            Ident::parse("instance", "bench").expect("valid"),
            Layer::Episodic,
            EventKind::Observation,
            Content::text(format!(
                "memory {i}: the deploy of service {} timed out",
                i % 97
            )),
        );
        e.embedding = Some(Embedding {
            model: MODEL.into(),
            vector: vector(rng),
        });
        e
    };

    // The scope's memories, natively, in batches.
    let bar = progress(args.memories as u64, "appending memories");
    let mut last_seq = 0;
    let mut i = 0;
    while i < args.memories {
        let batch: Vec<Envelope> = (i..(i + 500).min(args.memories))
            .map(|j| event(&mut rng, j))
            .collect();
        for r in native.append_batch(&batch).await {
            last_seq = last_seq.max(r?.seq);
        }
        bar.inc(batch.len() as u64);
        i += batch.len();
    }
    bar.finish_and_clear();

    let scopes = ScopeRequest {
        tenant: tenant.clone(),
        scope: scope.clone(),
        grants: Vec::new(),
    };
    let request = |rng: &mut SmallRng, min_seq: Option<u64>| RetrieveRequest {
        scopes: scopes.clone(),
        query: "deploy timed out".into(),
        vector: Some(vector(rng)),
        top_k: args.top_k,
        filter: Default::default(),
        consistency: Consistency {
            min_seq,
            wait_ms: None,
        },
        mode: RetrievalMode::Hybrid,
        ranking: None,
    };
    crate::retrieve_when_visible(
        &native,
        request(&mut rng, Some(last_seq)),
        Duration::from_secs(3600),
    )
    .await?;

    // Warm both paths (connections, caches) before timing.
    for _ in 0..20 {
        native.retrieve(&request(&mut rng, None)).await?;
        post(
            &http,
            &base,
            "/v1/retrieve",
            &api_key,
            &request(&mut rng, None),
        )
        .await?;
    }

    // Appends first, then (once the projectors have applied them, so that no retrieval
    // competes with indexing) retrievals; within each, which path goes first alternates.
    let bar = progress((args.requests * 5) as u64, "timing both paths");
    let (mut native_append, mut http_append) = (histogram(), histogram());
    let mut last_seq = 0;
    for n in 0..args.requests {
        let native_first = n % 2 == 0;
        for native_turn in [native_first, !native_first] {
            let e = event(&mut rng, args.memories + 2 * n + usize::from(native_turn));
            if native_turn {
                let started = Instant::now();
                last_seq = last_seq.max(native.append(&e).await?.seq);
                native_append.record(started.elapsed().as_micros().max(1) as u64)?;
            } else {
                let body = serde_json::to_value(&e)?;
                let started = Instant::now();
                let answer = post(&http, &base, "/v1/events", &api_key, &body).await?;
                http_append.record(started.elapsed().as_micros().max(1) as u64)?;
                let seq = answer["results"][0]["seq"].as_u64();
                last_seq = last_seq.max(seq.ok_or_else(|| anyhow::anyhow!("no seq: {answer}"))?);
            }
            bar.inc(1);
        }
    }
    crate::retrieve_when_visible(
        &native,
        request(&mut rng, Some(last_seq)),
        Duration::from_secs(3600),
    )
    .await?;
    let (mut native_retrieve, mut http_retrieve) = (histogram(), histogram());
    for n in 0..args.requests {
        let r = request(&mut rng, None);
        let native_first = n % 2 == 0;
        for native_turn in [native_first, !native_first] {
            let started = Instant::now();
            if native_turn {
                native.retrieve(&r).await?;
                native_retrieve.record(started.elapsed().as_micros().max(1) as u64)?;
            } else {
                post(&http, &base, "/v1/retrieve", &api_key, &r).await?;
                http_retrieve.record(started.elapsed().as_micros().max(1) as u64)?;
            }
            bar.inc(1);
        }
    }
    // The HTTP stack alone: a request the gateway answers without NATS (no key: 401).
    let mut floor = histogram();
    for _ in 0..args.requests {
        let started = Instant::now();
        let status = http
            .post(format!("{base}/v1/retrieve"))
            .json(&serde_json::json!({}))
            .send()
            .await?
            .status();
        anyhow::ensure!(
            status.as_u16() == 401,
            "a keyless request answered {status}"
        );
        floor.record(started.elapsed().as_micros().max(1) as u64)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let pair = |operation, n: &Histogram<u64>, g: &Histogram<u64>| {
        let (native, gateway) = (Latency::of(n), Latency::of(g));
        Pair {
            operation,
            p50_ratio: gateway.p50_ms / native.p50_ms.max(1e-9),
            p99_ratio: gateway.p99_ms / native.p99_ms.max(1e-9),
            native,
            gateway,
        }
    };
    Ok(Report {
        memories: args.memories,
        requests: args.requests,
        pairs: vec![
            pair("append", &native_append, &http_append),
            pair("retrieve", &native_retrieve, &http_retrieve),
        ],
        http_floor: Latency::of(&floor),
    })
}

async fn post<T: Serialize>(
    http: &reqwest::Client,
    base: &str,
    path: &str,
    key: &str,
    body: &T,
) -> anyhow::Result<serde_json::Value> {
    let response = http
        .post(format!("{base}{path}"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await?;
    let status = response.status();
    let bytes = response.bytes().await?;
    anyhow::ensure!(
        status.is_success(),
        "{path} answered {status}: {}",
        String::from_utf8_lossy(&bytes)
    );
    Ok(serde_json::from_slice(&bytes)?)
}

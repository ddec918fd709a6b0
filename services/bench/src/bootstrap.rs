//! `engram-bench bootstrap`: a new replica from a snapshot and the tail of the stream,
//! against a full replay to the same state, for every model a replica bootstraps (vector,
//! keyword, facts, skills, docs), in one run. A raw read of the same stream is the physical reference.
//!
//! The stream: `events - tail` events, a snapshot of each model cut there, then `tail` more
//! events. Both replicas start from nothing on disk and must end with equal state hashes.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use engram::config::Config;
use engram_bus::{Bus, StartAt};
use engram_docs::LocalDoc;
use engram_memory::proto::read_models;
use engram_projectors::ProjectorName;
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind, SubjectFilter};
use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;

use crate::progress;

#[derive(Debug, clap::Args)]
pub struct BootstrapArgs {
    /// Events in the stream.
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// Events after the snapshot (default: a tenth of --events, at most 10,000, the events
    /// between two periodic snapshots by default).
    #[arg(long)]
    pub tail: Option<u64>,
    /// Scopes the events spread over.
    #[arg(long, default_value_t = 100)]
    pub scopes: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Only these models (comma-separated; default: every model a replica bootstraps).
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
}

#[derive(Debug, Serialize)]
struct ModelRun {
    projector: String,
    full_replay_s: f64,
    bootstrap_s: f64,
    ratio: f64,
    snapshot_version: u64,
    snapshot_bytes: u64,
    /// Both replicas ended at the same sequence with the same state hash.
    equal: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    events: u64,
    tail: u64,
    scopes: usize,
    models: Vec<ModelRun>,
    full_replay_s: f64,
    bootstrap_s: f64,
    /// bootstrap_s / full_replay_s, over the models together.
    ratio: f64,
    /// Reading and decoding the whole stream once, applying nothing.
    raw_replay_s: f64,
}

/// The models a bootstrap loads from snapshots.
/// Every read model a replica bootstraps from snapshots: the text models (whose full replay
/// rebuilds an index and, with a real embedder, embeds every memory again) and those whose
/// scopes start from slices. Not the consolidator, whose state is its schedule.
fn snapshot_models(only: &[String]) -> anyhow::Result<Vec<ProjectorName>> {
    let all: Vec<&str> = [read_models::VECTOR, read_models::KEYWORD]
        .into_iter()
        .chain(read_models::with_scope_snapshots())
        .collect();
    if let Some(unknown) = only.iter().find(|m| !all.contains(&m.as_str())) {
        anyhow::bail!("--models: {unknown} is none of {}", all.join(", "));
    }
    all.into_iter()
        .filter(|name| only.is_empty() || only.iter().any(|m| m == name))
        .map(|name| name.parse().map_err(anyhow::Error::msg))
        .collect()
}

/// The vectors the workload supplies with its text memories (the full replay then indexes
/// them without embedding: the reference is the index, not a model).
const MODEL: &str = "bench-random-384";
const DIM: usize = 384;

struct Workload {
    rng: SmallRng,
    scopes: Vec<Scope>,
    boards: Vec<LocalDoc>,
    tenant: Ident,
    agent: Ident,
    n: u64,
}

impl Workload {
    fn next(&mut self) -> anyhow::Result<Envelope> {
        self.n += 1;
        let i = self.n;
        let s = self.rng.random_range(0..self.scopes.len());
        let scope = self.scopes[s].clone();
        let roll = self.rng.random_range(0..100u32);
        let (kind, layer, text, data) = match roll {
            0..40 => {
                let predicate =
                    ["owner", "version", "region", "oncall"][self.rng.random_range(0..4)];
                (
                    EventKind::FactAsserted,
                    Layer::Semantic,
                    format!("fact {i}"),
                    Some(json!({
                        "subject": format!("svc-{}", self.rng.random_range(0..500u32)),
                        "predicate": predicate,
                        "object": format!("v{}", self.rng.random_range(0..50u32)),
                    })),
                )
            }
            40..45 => (
                EventKind::SkillRecorded,
                Layer::Procedural,
                format!("skill {i}"),
                Some(json!({
                    "name": format!("skill-{}", self.rng.random_range(0..100u32)),
                    "description": format!("does task {i}"),
                    "steps": ["look", "change", "check"],
                })),
            ),
            45..60 => (
                EventKind::Outcome,
                Layer::Episodic,
                format!("outcome {i}"),
                Some(json!({
                    "skill": format!("skill-{}", self.rng.random_range(0..100u32)),
                    "success": self.rng.random_bool(0.7),
                })),
            ),
            60..65 => {
                let board = &mut self.boards[s];
                let item = self.rng.random_range(0..50u32);
                // Each edit writes something new (a status and the edit's number), so
                // it is always a change.
                let status = ["todo", "doing", "done"][self.rng.random_range(0..3)];
                board.set_path(
                    &format!("/items/t-{item}"),
                    &json!({"status": status, "edit": i}),
                )?;
                let out = board
                    .outgoing("task_board", "sprint", 150_000)?
                    .pop()
                    .context("an edit gives changes")?;
                board.mark_sent(&out.synced_after);
                (
                    EventKind::DocChanged,
                    Layer::Working,
                    format!("edit {i}"),
                    Some(out.data),
                )
            }
            _ => (
                EventKind::Observation,
                Layer::Episodic,
                format!("observation {i}"),
                None,
            ),
        };
        // Every event with text is a memory the text models index; a document's changes
        // are not.
        let text_memory = kind != EventKind::DocChanged;
        let mut event = Envelope::new(
            self.tenant.clone(),
            scope,
            self.agent.clone(),
            self.agent.clone(),
            layer,
            kind,
            Content { text, data },
        );
        event.importance = 0.5;
        if text_memory {
            let v: Vec<f32> = (0..DIM).map(|_| self.rng.random::<f32>() - 0.5).collect();
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
            event.embedding = Some(engram_schema::Embedding {
                model: MODEL.into(),
                vector: v.into_iter().map(|x| x / norm).collect(),
            });
        }
        Ok(event)
    }
}

async fn append(
    bus: &Bus,
    work: &mut Workload,
    count: u64,
    message: &'static str,
) -> anyhow::Result<u64> {
    let bar = progress(count, message);
    let mut last = 0;
    let mut left = count;
    while left > 0 {
        let n = left.min(1_000);
        let events = (0..n)
            .map(|_| work.next())
            .collect::<anyhow::Result<Vec<_>>>()?;
        for r in bus.append_batch(&events, 1_000).await {
            last = last.max(r?.seq);
        }
        left -= n;
        bar.inc(n);
    }
    bar.finish_and_clear();
    Ok(last)
}

pub async fn run(config: &Config, args: BootstrapArgs, json: bool) -> anyhow::Result<ExitCode> {
    let tail = args.tail.unwrap_or((args.events / 10).min(10_000));
    if args.events == 0 || tail >= args.events || args.scopes == 0 {
        anyhow::bail!("--events must be at least 1, --tail below --events, --scopes at least 1");
    }
    snapshot_models(&args.models)?;
    let (home, mut local) = crate::temporary_home(config)?;
    local.projectors.embedder = engram_embed::EmbedderConfig::ClientSupplied {
        model: MODEL.into(),
        dim: DIM,
    };
    let bin = tokio::task::spawn_blocking(engram_natsd::locate).await??;
    let server = engram_natsd::NatsServer::start(engram_natsd::ServerOptions::new(
        bin,
        home.path().join("nats"),
        home.path().join("run"),
    ))
    .await?;
    let bus = Bus::connect(local.bus_config(server.url())).await?;
    bus.provision().await?;
    let result = bench(&bus, &local, &args, tail, home.path()).await;
    // The connection first, so that it does not see its server go.
    drop(bus);
    drop(server);
    drop(home);
    let report = result?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for m in &report.models {
            println!(
                "{:<7} full replay {:>7.2}s  bootstrap {:>7.2}s  ratio {:.3}  snapshot {} bytes at {}  equal {}",
                m.projector,
                m.full_replay_s,
                m.bootstrap_s,
                m.ratio,
                m.snapshot_bytes,
                m.snapshot_version,
                m.equal
            );
        }
        println!(
            "{} events, tail {}: full replay {:.2}s, bootstrap {:.2}s, ratio {:.3}; raw read of the stream {:.2}s",
            report.events,
            report.tail,
            report.full_replay_s,
            report.bootstrap_s,
            report.ratio,
            report.raw_replay_s
        );
    }
    if report.models.iter().any(|m| !m.equal) {
        anyhow::bail!("a bootstrapped replica differs from the full replay");
    }
    Ok(ExitCode::SUCCESS)
}

async fn bench(
    bus: &Bus,
    config: &Config,
    args: &BootstrapArgs,
    tail: u64,
    home: &std::path::Path,
) -> anyhow::Result<Report> {
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let scopes: Vec<Scope> = (0..args.scopes)
        .map(|i| Scope::new(ScopeKind::Team, &format!("team-{i}")))
        .collect::<Result<_, _>>()?;
    let boards = (0..args.scopes)
        .map(|_| LocalDoc::genesis::<engram_docs::TaskBoard>())
        .collect::<Result<_, _>>()?;
    let mut work = Workload {
        rng: SmallRng::seed_from_u64(rng.random()),
        scopes,
        boards,
        tenant: Ident::parse("tenant", "bench")?,
        agent: Ident::parse("agent", "bench-bootstrap")?,
        n: 0,
    };
    append(bus, &mut work, args.events - tail, "appending the history").await?;
    // The snapshots: the models run over the history, then every partition's instance cuts
    // its own, as in a deployment; they stop before the tail is written.
    let cut_at = bus.stream_state().await?.last_seq;
    let stop = tokio_util::sync::CancellationToken::new();
    let running = engram_projectors::start(
        &engram_projectors::ProjectorsConfig {
            run: snapshot_models(&args.models)?,
            ..config.projectors.clone()
        },
        &home.join("cut"),
        |_, _| Bus::connect(bus.config().clone()),
        stop.clone(),
    )
    .await?;
    let partitions = bus.config().stream.partitions;
    let bar = progress(
        snapshot_models(&args.models)?.len() as u64,
        "cutting the snapshots",
    );
    for name in snapshot_models(&args.models)? {
        // Waits of a minute (the longest a request may ask for), for up to an hour.
        let consistency = engram_memory::proto::Consistency {
            min_seq: Some(cut_at),
            wait_ms: Some(60_000),
        };
        let timeout = std::time::Duration::from_secs(90);
        let mut waited = 0;
        while let Err(f) = engram_projectors::status_of(
            bus.client(),
            name.as_str(),
            partitions,
            &consistency,
            timeout,
        )
        .await
        {
            waited += 1;
            anyhow::ensure!(
                waited < 60,
                "{name} did not reach seq {cut_at} within an hour: {}",
                f.message
            );
        }
        let _: Vec<engram_snapshots::SnapshotMeta> = engram_projectors::ask_partitions(
            bus.client(),
            name.as_str(),
            "snapshot",
            partitions,
            &engram_projectors::SnapshotRequest::default(),
            timeout,
        )
        .await
        .map_err(|f| anyhow::anyhow!("cutting {name}: {}", f.message))?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    stop.cancel();
    running.join().await?;
    append(bus, &mut work, tail, "appending the tail").await?;

    let raw_started = Instant::now();
    let mut raw = bus
        .replay(&SubjectFilter::all(), StartAt::Beginning)
        .await?;
    let mut read = 0u64;
    while let Some(item) = raw.next().await {
        item?;
        read += 1;
    }
    let raw_replay_s = raw_started.elapsed().as_secs_f64();
    anyhow::ensure!(
        read == args.events,
        "the raw read saw {read} of {} events",
        args.events
    );

    let mut models = Vec::new();
    for name in snapshot_models(&args.models)? {
        let full_dir = home.join(format!("full-{name}"));
        let started = Instant::now();
        let (full_seq, full_hash) =
            engram_projectors::rebuild(name, &config.projectors, &full_dir, bus.clone(), |_, _| {})
                .await?;
        let full_replay_s = started.elapsed().as_secs_f64();
        let boot_dir = home.join(format!("boot-{name}"));
        let started = Instant::now();
        let booted = engram_projectors::rebuild_from_snapshot(
            name,
            &config.projectors,
            &boot_dir,
            bus.clone(),
            None,
            |_, _| {},
        )
        .await?;
        let bootstrap_s = started.elapsed().as_secs_f64();
        // Every partition that holds events starts from its own snapshot.
        let snapshots: Vec<_> = booted
            .partitions
            .iter()
            .filter_map(|p| p.snapshot.as_ref())
            .collect();
        anyhow::ensure!(!snapshots.is_empty(), "the bootstrap found no snapshot");
        models.push(ModelRun {
            projector: name.to_string(),
            full_replay_s,
            bootstrap_s,
            ratio: bootstrap_s / full_replay_s,
            snapshot_version: snapshots.iter().map(|s| s.version).max().unwrap_or(0),
            snapshot_bytes: snapshots.iter().map(|s| s.bytes).sum(),
            equal: booted.seq == full_seq && booted.state_hash == engram_snapshots::hex(&full_hash),
        });
    }
    let full_replay_s: f64 = models.iter().map(|m| m.full_replay_s).sum();
    let bootstrap_s: f64 = models.iter().map(|m| m.bootstrap_s).sum();
    Ok(Report {
        events: args.events,
        tail,
        scopes: args.scopes,
        full_replay_s,
        bootstrap_s,
        ratio: bootstrap_s / full_replay_s,
        raw_replay_s,
        models,
    })
}

//! `loadtest`: hundreds of simulated agent instances against Engram, every acknowledged write
//! verified at the end. Exit code 1 if anything was lost, duplicated or invisible; 3 if the
//! run was correct but did not sustain its target rate, unless `--allow-overload` is given.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use engram_loadtest::fleet::target::EmbedderChoice;
use engram_loadtest::fleet::{self, FleetConfig};

/// Which faults `--chaos` injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ChaosKind {
    /// A projector or memory node, then nats-server (`--chaos` alone).
    #[value(alias = "true")]
    Processes,
    /// Every fault a NATS cluster must survive.
    Cluster,
}

#[derive(Debug, Parser)]
#[command(
    name = "loadtest",
    about = "Simulated agent fleet against Engram: open-loop load, ledger verification, report with charts"
)]
struct Cli {
    /// A TOML scenario file: any FleetConfig field (`instances = 500`, `duration = "5m"`,
    /// `embedder = "client"`, ...). Environment variables and flags override it.
    #[arg(long, env = "ENGRAM_LOADTEST_CONFIG")]
    config: Option<PathBuf>,

    /// NATS URL of a running Engram deployment. Without it, nats-server and `engram up` are
    /// started in a temp dir and removed afterwards.
    #[arg(long, env = "ENGRAM_LOADTEST_NATS")]
    nats: Option<String>,

    /// Concurrent simulated agent instances (10 to 1000). [default: 300]
    #[arg(long, env = "ENGRAM_LOADTEST_INSTANCES")]
    instances: Option<usize>,

    /// Instances per team; a team shares one task scope. [default: 5]
    #[arg(long, env = "ENGRAM_LOADTEST_TEAM_SIZE")]
    team_size: Option<usize>,

    /// Target appends per second over all instances (each step appends one event). [default: 4]
    #[arg(long, env = "ENGRAM_LOADTEST_RATE")]
    rate: Option<f64>,

    /// Seconds of load. [default: 120]
    #[arg(long, env = "ENGRAM_LOADTEST_DURATION", value_parser = engram_loadtest::parse_secs)]
    duration: Option<Duration>,

    /// Share of instances that die midway and are succeeded by a fresh instance. [default: 0.1]
    #[arg(long, env = "ENGRAM_LOADTEST_CHURN")]
    churn: Option<f64>,

    /// Share of text-memory appends recalled at once with their consistency token. [default: 0.3]
    #[arg(long, env = "ENGRAM_LOADTEST_RECALL")]
    recall: Option<f64>,

    /// Share of fact assertions checked at once with their token. [default: 0.5]
    #[arg(long, env = "ENGRAM_LOADTEST_FACT_CHECK")]
    fact_check: Option<f64>,

    /// Share of skill records checked at once with their token. [default: 0.5]
    #[arg(long, env = "ENGRAM_LOADTEST_SKILL_CHECK")]
    skill_check: Option<f64>,

    /// Share of steps that also edit the team's task board. [default: 0.1]
    #[arg(long, env = "ENGRAM_LOADTEST_DOC_EDIT")]
    doc_edit: Option<f64>,

    /// Share of instances offline for the middle third of the run, pushing their board
    /// edits late. [default: 0.2]
    #[arg(long, env = "ENGRAM_LOADTEST_OFFLINE")]
    offline: Option<f64>,

    /// Share of an operation's requests (appends, recalls, queries, ...) that may fail with a
    /// retryable error (unavailable, timed out) outside chaos outages before the run fails;
    /// refusals `busy` are counted apart. Errors retrying cannot fix always fail it.
    /// [default: 0.01]
    #[arg(long, env = "ENGRAM_LOADTEST_ERROR_BUDGET")]
    error_budget: Option<f64>,

    /// Every n-th step of an instance starts with build_context. [default: 5]
    #[arg(long, env = "ENGRAM_LOADTEST_CONTEXT_EVERY")]
    context_every: Option<u64>,

    /// Seconds between scheduled consolidation runs in the engram started here (0: off; a
    /// remote deployment keeps its own schedule). [default: 5]
    #[arg(long, env = "ENGRAM_LOADTEST_CONSOLIDATE_EVERY", value_parser = engram_loadtest::parse_secs)]
    consolidate_every: Option<Duration>,

    /// Share of episodic memories that repeat one of the instance's recent ones: the
    /// near-duplicates consolidation merges. [default: 0.05]
    #[arg(long, env = "ENGRAM_LOADTEST_DUPLICATES")]
    duplicates: Option<f64>,

    /// Every n-th event of an instance ends its session (`checkpoint {"finished": true}`),
    /// which consolidation summarises; 0: never. [default: 20]
    #[arg(long, env = "ENGRAM_LOADTEST_FINISH_EVERY")]
    finish_every: Option<u64>,

    /// Seconds between on-demand snapshots of every projector during the load, which the
    /// successors of dying instances bootstrap from (0: none until the one after the load).
    /// [default: 10]
    #[arg(long, env = "ENGRAM_LOADTEST_SNAPSHOT_EVERY", value_parser = engram_loadtest::parse_secs)]
    snapshot_every: Option<Duration>,

    /// Prometheus endpoint of the deployment given with --nats (http://host:port/metrics),
    /// for the figures only its processes measure (consolidation runs, batch times). An
    /// engram started here is read without it.
    #[arg(long, env = "ENGRAM_LOADTEST_METRICS")]
    metrics: Option<String>,

    /// Share of steps that end with an ordinary retrieve. [default: 0.2]
    #[arg(long, env = "ENGRAM_LOADTEST_QUERY")]
    query: Option<f64>,

    /// Read-your-writes wait per request, in seconds (a timeout is retried). [default: 10]
    #[arg(long, env = "ENGRAM_LOADTEST_WAIT", value_parser = engram_loadtest::parse_secs)]
    wait: Option<Duration>,

    /// Connections the instances share. [default: 8]
    #[arg(long, env = "ENGRAM_LOADTEST_CONNECTIONS")]
    connections: Option<usize>,

    /// Faults during the run, each timed until the system recovered. `--chaos` (processes):
    /// the projectors run as processes of their own; kill -9 one and then nats-server,
    /// restart them (with --nodes, a memory node instead of a projector: its partitions move
    /// to the others, and back once it is started again). `--chaos cluster` (needs
    /// --cluster 3 --nodes 2): kill -9 a follower NATS node, then the events stream's leader,
    /// then a memory node; restart every process one after another; freeze a node (SIGSTOP)
    /// past its routes' timeout.
    #[arg(long, env = "ENGRAM_LOADTEST_CHAOS", num_args = 0..=1, default_missing_value = "processes", value_enum)]
    chaos: Option<ChaosKind>,

    /// Run N NATS servers as one JetStream cluster, every stream on 3 of them. [default: 0,
    /// one server]
    #[arg(long, env = "ENGRAM_LOADTEST_CLUSTER")]
    cluster: Option<usize>,

    /// Written-to-readable p99 that a fault's recovery is timed back under, in seconds.
    /// [default: 1]
    #[arg(long, env = "ENGRAM_LOADTEST_VISIBILITY_GOAL", value_parser = engram_loadtest::parse_secs)]
    visibility_goal: Option<Duration>,

    /// Run N memory nodes as processes of their own (`engram up --nodes N`), sharing the
    /// stream's partitions. [default: 0, one node inside engram up]
    #[arg(long, env = "ENGRAM_LOADTEST_NODES")]
    nodes: Option<usize>,

    /// Exit 0 when the run was correct but did not sustain its target rate (more than 1% of
    /// the scheduled steps never ran); without it such a run exits 3. The headline says
    /// NOT SUSTAINED either way.
    #[arg(long, env = "ENGRAM_LOADTEST_ALLOW_OVERLOAD")]
    allow_overload: bool,

    /// minilm: the built-in embedder, as `engram up` runs by default. client: the load test
    /// supplies small vectors, which takes the embedding cost out. [default: minilm]
    #[arg(
        long,
        env = "ENGRAM_LOADTEST_EMBEDDER",
        value_enum,
        default_value = "minilm"
    )]
    embedder: Option<EmbedderChoice>,

    /// The engram binary [default: next to this one, else on PATH].
    #[arg(long, env = "ENGRAM_BIN")]
    engram_bin: Option<PathBuf>,

    /// Extra TOML for the engram processes started here (appended to the load test's own).
    #[arg(long, env = "ENGRAM_LOADTEST_ENGRAM_CONFIG")]
    engram_config: Option<PathBuf>,

    /// Longest wait, in seconds, for the projectors to apply everything after the load (and
    /// for read-your-writes checks still pending when the load ends). [default: 120]
    #[arg(long, env = "ENGRAM_LOADTEST_DRAIN_LIMIT", value_parser = engram_loadtest::parse_secs)]
    drain_limit: Option<Duration>,

    /// Seconds of the raw JetStream reference (at least one step period, at most --duration). [default: 30]
    #[arg(long, env = "ENGRAM_LOADTEST_REFERENCE", value_parser = engram_loadtest::parse_secs)]
    reference: Option<Duration>,

    /// Where report.json, report.md and the SVG charts go. [default: target/loadtest]
    #[arg(long, env = "ENGRAM_LOADTEST_OUT")]
    out: Option<PathBuf>,

    /// Search for the highest rate the fleet holds (the run passes and every step runs),
    /// starting at --rate, then run above it: one fresh target and report per rate, and
    /// capacity.md and capacity.json in --out.
    #[arg(long, env = "ENGRAM_LOADTEST_FIND_CAPACITY")]
    find_capacity: bool,

    /// The search ends once the lowest rate not held is within this share above the
    /// highest held. [default: 0.1]
    #[arg(long, env = "ENGRAM_LOADTEST_CAPACITY_RESOLUTION")]
    capacity_resolution: Option<f64>,

    /// At most this many runs in the search, before the overload runs. [default: 8]
    #[arg(long, env = "ENGRAM_LOADTEST_CAPACITY_RUNS")]
    capacity_runs: Option<usize>,

    /// After the search, runs at these multiples of the capacity, judged against the run at
    /// capacity (comma-separated). [default: 1.5]
    #[arg(long, env = "ENGRAM_LOADTEST_OVERLOAD", value_delimiter = ',')]
    overload: Option<Vec<f64>>,

    /// Seed of the simulated content and schedule [default: random].
    #[arg(long, env = "ENGRAM_LOADTEST_SEED")]
    seed: Option<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    engram_telemetry::init_logging(engram_telemetry::LogFormat::Text, "warn")
        .context("failed to set up logging")?;
    let config = config(cli)?;
    if config.capacity.enabled {
        return find_capacity(config).await;
    }
    let out = config.out.clone();
    let report = fleet::run(config, interrupted())
        .await
        .context("load test failed")?;
    print!("{}", report.markdown());
    eprintln!(
        "report: {}/report.md, report.json and charts (*.svg)",
        out.display()
    );
    let code = report.exit_code();
    match code {
        0 => {}
        1 => eprintln!("FAILED: {}", report.failures().join("; ")),
        _ => eprintln!(
            "load {}; correctness passed (--allow-overload accepts a run that falls short of its target)",
            report.load.summary()
        ),
    }
    Ok(ExitCode::from(code))
}

/// `--find-capacity`: one whole run per rate of the search, each in its own directory under
/// --out, against a fresh target each (or, with --nats, the same deployment); the first
/// ctrl-c ends the run under way early (it still verifies and reports) and the search after
/// it.
async fn find_capacity(config: FleetConfig) -> anyhow::Result<ExitCode> {
    let stop = tokio::sync::watch::channel(false).0;
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            interrupted().await;
            let _ = stop.send(true);
        });
    }
    let runs = std::sync::atomic::AtomicU64::new(0);
    let run = |rate: f64| {
        let mut one = config.clone();
        one.rate = rate;
        let index = runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if one.nats.is_some() {
            // One deployment for every run: a seed of its own each, or a run would write the
            // same markers again and a recall could find an earlier run's write.
            one.seed = config.seed.wrapping_add(index);
        }
        one.out = fleet::capacity::run_dir(&config.out, rate);
        // Falling short is what the search looks for, not a failure of the run.
        one.allow_overload = true;
        one.capacity.enabled = false;
        let mut stopped = stop.subscribe();
        async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            let report = fleet::run(one, shutdown).await?;
            eprintln!("[capacity] {}", report.verdicts());
            Ok(fleet::capacity::RunFigures::of(&report, rate))
        }
    };
    let report = fleet::capacity::search(&config, run, || *stop.borrow())
        .await
        .context("capacity search failed")?;
    std::fs::create_dir_all(&config.out)
        .with_context(|| format!("cannot create {}", config.out.display()))?;
    report.write(&config.out)?;
    print!("{}", report.markdown());
    eprintln!(
        "capacity report: {}/capacity.md and capacity.json; each run's report in its rate-<r> directory",
        config.out.display()
    );
    Ok(ExitCode::from(report.exit_code()))
}

/// Defaults, then the TOML file, then environment variables and flags (clap reads both; a
/// flag beats its variable).
fn config(cli: Cli) -> anyhow::Result<FleetConfig> {
    let mut config = match &cli.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            toml::from_str(&text)
                .with_context(|| format!("invalid scenario file {}", path.display()))?
        }
        None => FleetConfig::default(),
    };
    macro_rules! set {
        ($($field:ident),*) => { $(if let Some(value) = cli.$field { config.$field = value; })* };
    }
    set!(
        instances,
        team_size,
        rate,
        duration,
        churn,
        recall,
        fact_check,
        skill_check,
        doc_edit,
        offline,
        error_budget,
        context_every,
        consolidate_every,
        duplicates,
        finish_every,
        snapshot_every,
        query,
        wait,
        connections,
        nodes,
        cluster,
        visibility_goal,
        embedder,
        drain_limit,
        reference,
        out
    );
    config.chaos |= cli.chaos == Some(ChaosKind::Processes);
    config.chaos_cluster |= cli.chaos == Some(ChaosKind::Cluster);
    config.allow_overload |= cli.allow_overload;
    config.capacity.enabled |= cli.find_capacity;
    if let Some(resolution) = cli.capacity_resolution {
        config.capacity.resolution = resolution;
    }
    if let Some(runs) = cli.capacity_runs {
        config.capacity.max_runs = runs;
    }
    if let Some(overload) = cli.overload {
        config.capacity.overload = overload;
    }
    if cli.nats.is_some() {
        config.nats = cli.nats;
    }
    if cli.engram_bin.is_some() {
        config.engram_bin = cli.engram_bin;
    }
    if cli.metrics.is_some() {
        config.metrics = cli.metrics;
    }
    if cli.engram_config.is_some() {
        config.engram_config = cli.engram_config;
    }
    config.seed = cli.seed.unwrap_or_else(|| {
        if config.seed == 0 {
            rand::random()
        } else {
            config.seed
        }
    });
    Ok(config)
}

/// The first ctrl-c stops the load early; the run still drains, verifies and reports.
async fn interrupted() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
    eprintln!(
        "interrupted: stopping the load; the run still verifies and reports. ctrl-c again exits now"
    );
    tokio::spawn(async {
        let _ = tokio::signal::ctrl_c().await;
        std::process::exit(130);
    });
}

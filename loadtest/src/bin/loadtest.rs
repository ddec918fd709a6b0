//! `loadtest`: hundreds of simulated agent instances against Engram, every acknowledged write
//! verified at the end. Exit code 1 if anything was lost, duplicated or invisible.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use engram_loadtest::fleet::target::EmbedderChoice;
use engram_loadtest::fleet::{self, FleetConfig};

#[derive(Debug, Parser)]
#[command(
    name = "loadtest",
    about = "Simulated agent fleet against Engram: open-loop load, ledger verification, report with charts"
)]
struct Cli {
    /// NATS URL of a running Engram deployment. Without it, nats-server and `engram up` are
    /// started in a temp dir and removed afterwards.
    #[arg(long, env = "ENGRAM_LOADTEST_NATS")]
    nats: Option<String>,

    /// Concurrent simulated agent instances (10 to 1000).
    #[arg(long, env = "ENGRAM_LOADTEST_INSTANCES", default_value_t = FleetConfig::default().instances)]
    instances: usize,

    /// Instances per team; a team shares one task scope.
    #[arg(long, env = "ENGRAM_LOADTEST_TEAM_SIZE", default_value_t = FleetConfig::default().team_size)]
    team_size: usize,

    /// Target appends per second over all instances (each step appends one event).
    #[arg(long, env = "ENGRAM_LOADTEST_RATE", default_value_t = FleetConfig::default().rate)]
    rate: f64,

    /// Seconds of load.
    #[arg(long, env = "ENGRAM_LOADTEST_DURATION", value_parser = engram_loadtest::parse_secs, default_value = "120")]
    duration: Duration,

    /// Share of instances that die midway and are succeeded by a fresh instance.
    #[arg(long, env = "ENGRAM_LOADTEST_CHURN", default_value_t = FleetConfig::default().churn)]
    churn: f64,

    /// Share of text-memory appends recalled at once with their consistency token.
    #[arg(long, env = "ENGRAM_LOADTEST_RECALL", default_value_t = FleetConfig::default().recall)]
    recall: f64,

    /// Share of fact assertions checked at once with their token.
    #[arg(long, env = "ENGRAM_LOADTEST_FACT_CHECK", default_value_t = FleetConfig::default().fact_check)]
    fact_check: f64,

    /// Every n-th step of an instance starts with build_context.
    #[arg(long, env = "ENGRAM_LOADTEST_CONTEXT_EVERY", default_value_t = FleetConfig::default().context_every)]
    context_every: u64,

    /// Share of steps that end with an ordinary retrieve.
    #[arg(long, env = "ENGRAM_LOADTEST_QUERY", default_value_t = FleetConfig::default().query)]
    query: f64,

    /// Read-your-writes wait per request, in seconds (a timeout is retried).
    #[arg(long, env = "ENGRAM_LOADTEST_WAIT", value_parser = engram_loadtest::parse_secs, default_value = "10")]
    wait: Duration,

    /// Connections the instances share.
    #[arg(long, env = "ENGRAM_LOADTEST_CONNECTIONS", default_value_t = FleetConfig::default().connections)]
    connections: usize,

    /// Run the projectors as processes of their own; kill -9 one and then nats-server during
    /// the run, restart them, and report the recovery.
    #[arg(long, env = "ENGRAM_LOADTEST_CHAOS")]
    chaos: bool,

    /// minilm: the built-in embedder, as `engram up` runs by default. client: the load test
    /// supplies small vectors, which takes the embedding cost out.
    #[arg(
        long,
        env = "ENGRAM_LOADTEST_EMBEDDER",
        value_enum,
        default_value = "minilm"
    )]
    embedder: EmbedderChoice,

    /// The engram binary [default: next to this one, else on PATH].
    #[arg(long, env = "ENGRAM_BIN")]
    engram_bin: Option<PathBuf>,

    /// Extra TOML for the engram processes started here (appended to the load test's own).
    #[arg(long, env = "ENGRAM_LOADTEST_ENGRAM_CONFIG")]
    engram_config: Option<PathBuf>,

    /// Longest wait, in seconds, for the projectors to apply everything after the load (and
    /// for read-your-writes checks still pending when the load ends).
    #[arg(long, env = "ENGRAM_LOADTEST_DRAIN_LIMIT", value_parser = engram_loadtest::parse_secs, default_value = "120")]
    drain_limit: Duration,

    /// Seconds of the raw JetStream reference (at least one step period, at most --duration).
    #[arg(long, env = "ENGRAM_LOADTEST_REFERENCE", value_parser = engram_loadtest::parse_secs, default_value = "30")]
    reference: Duration,

    /// Where report.json, report.md and the SVG charts go.
    #[arg(long, env = "ENGRAM_LOADTEST_OUT", default_value = "target/loadtest")]
    out: PathBuf,

    /// Seed of the simulated content and schedule [default: random].
    #[arg(long, env = "ENGRAM_LOADTEST_SEED")]
    seed: Option<u64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    engram_telemetry::init_logging(engram_telemetry::LogFormat::Text, "warn")
        .context("failed to set up logging")?;
    let config = FleetConfig {
        nats: cli.nats,
        engram_bin: cli.engram_bin,
        engram_config: cli.engram_config,
        embedder: cli.embedder,
        instances: cli.instances,
        team_size: cli.team_size,
        rate: cli.rate,
        duration: cli.duration,
        churn: cli.churn,
        recall: cli.recall,
        fact_check: cli.fact_check,
        context_every: cli.context_every,
        query: cli.query,
        wait: cli.wait,
        connections: cli.connections,
        chaos: cli.chaos,
        drain_limit: cli.drain_limit,
        reference: cli.reference,
        out: cli.out,
        seed: cli.seed.unwrap_or_else(rand::random),
    };
    let out = config.out.clone();
    let report = fleet::run(config, interrupted())
        .await
        .context("load test failed")?;
    print!("{}", report.markdown());
    eprintln!(
        "report: {}/report.md, report.json and charts (*.svg)",
        out.display()
    );
    if report.passed() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("FAILED: {}", report.failures().join("; "));
        Ok(ExitCode::from(1))
    }
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

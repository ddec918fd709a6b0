//! `bench-append`: Engram appends against raw JetStream publishes of the same sizes.
//!
//! Parses the flags, starts an embedded nats-server unless `--nats` names one, runs
//! [`engram_loadtest::run`], prints the table and optionally writes the JSON report.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use engram_loadtest::{BenchConfig, EmbeddedNats, StopRule};

#[derive(Debug, Parser)]
#[command(
    name = "bench-append",
    about = "Measures Engram appends against raw JetStream publishes of the same sizes"
)]
struct Cli {
    /// NATS URL of a running server. Without it, a nats-server is started in a temp dir and
    /// removed afterwards.
    #[arg(long, env = "ENGRAM_BENCH_NATS")]
    nats: Option<String>,

    /// Without --nats: start N nats-servers on loopback as one JetStream cluster instead of
    /// one server.
    #[arg(long, env = "ENGRAM_BENCH_CLUSTER", conflicts_with = "nats")]
    cluster: Option<usize>,

    /// Replicas of the events stream and the raw stream (what R3 costs against R1: run it
    /// with 3, then 1, on the same cluster size and seed). [default: 3 with --cluster, else 1]
    #[arg(long, env = "ENGRAM_BENCH_REPLICAS")]
    replicas: Option<usize>,

    /// Concurrent simulated agent instances, each awaiting its own acks.
    #[arg(long, env = "ENGRAM_BENCH_AGENTS", default_value_t = 200)]
    agents: usize,

    /// Measured seconds per phase [default: 10].
    #[arg(long, env = "ENGRAM_BENCH_DURATION", value_parser = engram_loadtest::parse_secs, conflicts_with = "events_per_agent")]
    duration: Option<Duration>,

    /// Measured events per agent per phase, instead of a duration.
    #[arg(long, env = "ENGRAM_BENCH_EVENTS_PER_AGENT")]
    events_per_agent: Option<u64>,

    /// With --events-per-agent: stop a phase after this many measured seconds regardless.
    #[arg(long, env = "ENGRAM_BENCH_TIME_LIMIT", value_parser = engram_loadtest::parse_secs, default_value = "300")]
    time_limit: Duration,

    /// Connections the agents share (async-nats multiplexes; one per agent is not realistic).
    #[arg(long, env = "ENGRAM_BENCH_CONNECTIONS", default_value_t = 8)]
    connections: usize,

    /// Unmeasured seconds at the start of each phase.
    #[arg(long, env = "ENGRAM_BENCH_WARMUP", value_parser = engram_loadtest::parse_secs, default_value = "1")]
    warmup: Duration,

    /// Agents per team; each team shares one task scope.
    #[arg(long, env = "ENGRAM_BENCH_TEAM_SIZE", default_value_t = 10)]
    team_size: usize,

    /// Seed of the event content [default: random].
    #[arg(long, env = "ENGRAM_BENCH_SEED")]
    seed: Option<u64>,

    /// Also write the report as JSON to this file.
    #[arg(long, env = "ENGRAM_BENCH_JSON")]
    json: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    engram_telemetry::init_logging(engram_telemetry::LogFormat::Text, "warn")
        .context("failed to set up logging")?;

    let stop = match cli.events_per_agent {
        Some(events) => StopRule::EventsPerAgent {
            events,
            time_limit: cli.time_limit,
        },
        None => StopRule::Duration(cli.duration.unwrap_or(Duration::from_secs(10))),
    };
    // Started here, on the main thread, which lives as long as the run (see EmbeddedNats::start).
    let embedded = match &cli.nats {
        Some(_) => None,
        None => {
            let server = EmbeddedNats::start_cluster(cli.cluster.unwrap_or(1))
                .await
                .context("failed to start an embedded nats-server (or pass --nats <url>)")?;
            eprintln!(
                "started nats-server {} at {} (store in {})",
                server.version(),
                server.url(),
                server.store_dir().display()
            );
            Some(server)
        }
    };
    let url = match (&cli.nats, &embedded) {
        (Some(url), _) => url.clone(),
        (None, Some(server)) => server.url(),
        (None, None) => unreachable!("a server is started when no url is given"),
    };
    let config = BenchConfig {
        url,
        agents: cli.agents,
        connections: cli.connections,
        stop,
        warmup: cli.warmup,
        team_size: cli.team_size,
        seed: cli.seed.unwrap_or_else(rand::random),
        embedded_server: embedded.is_some(),
        server_pid: embedded.as_ref().and_then(EmbeddedNats::pid),
        replicas: cli
            .replicas
            .unwrap_or(if cli.cluster.unwrap_or(1) > 1 { 3 } else { 1 }),
    };

    let result = engram_loadtest::run(config, interrupted()).await;
    // The embedded server goes whatever the outcome, so that a failed run leaves nothing behind.
    if let Some(server) = embedded {
        server.stop().await;
    }
    let report = result.context("benchmark failed")?;

    print!("{}", report.render());
    if let Some(path) = &cli.json {
        let json =
            serde_json::to_string_pretty(&report).context("failed to serialise the report")?;
        std::fs::write(path, json + "\n")
            .with_context(|| format!("failed to write {}", path.display()))?;
        eprintln!("report written to {}", path.display());
    }
    Ok(())
}

/// Completes on the first ctrl-c, which stops the agents and still prints what was measured.
/// A second ctrl-c exits at once; the embedded server then dies with the process, but its
/// temp dir stays behind.
async fn interrupted() {
    if tokio::signal::ctrl_c().await.is_err() {
        // No signal handler: never interrupt, the run still ends by its own stop rule.
        std::future::pending::<()>().await;
    }
    eprintln!("interrupted: stopping after the current appends; press ctrl-c again to exit now");
    tokio::spawn(async {
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("interrupted again: exiting");
        std::process::exit(130);
    });
}

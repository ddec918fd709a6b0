//! `engram-bench`: quality and latency benchmarks that run through the real system.
//!
//! A binary of its own so that what `engram up` links carries none of it: the LoCoMo loader,
//! the synthetic vector generator and the histograms are benchmark-only.
//!
//! # Layout
//! - [`locomo`]: retrieval recall on LoCoMo, by mode.
//! - [`query`]: retrieval latency at a scope size, beside in-process exact and graph search.
//! - [`facts`]: the fact table's costs in process.
//! - [`docs`]: shared-document merge throughput and size, in process.
//! - [`bootstrap`]: a replica from a snapshot and the tail, against a full replay.
//! - [`gateway`]: the HTTP API's overhead over the native NATS path, same identity.
//! - [`cli`]: flags (the `engram` binary's global ones, plus the benchmark).

pub mod bootstrap;
pub mod docs;
pub mod facts;
pub mod gateway;
pub mod locomo;
pub mod query;

use anyhow::Context as _;
use engram::config::Config;
use indicatif::{ProgressBar, ProgressStyle};

/// The `engram` binary beside this one (cargo builds both into the same target dir): node
/// processes are `engram node`.
pub(crate) fn engram_bin_beside() -> anyhow::Result<std::path::PathBuf> {
    let beside = std::env::current_exe()?.with_file_name("engram");
    anyhow::ensure!(
        beside.is_file(),
        "memory node processes run the engram binary, and none is at {}: build it (`cargo build --release -p engram`)",
        beside.display()
    );
    Ok(beside)
}

/// `config` moved into a new temporary home, with a managed nats-server and the HTTP
/// listener on free ports, for a self-contained run. The home is removed when dropped.
pub(crate) fn temporary_home(config: &Config) -> anyhow::Result<(tempfile::TempDir, Config)> {
    let home = tempfile::tempdir().context("creating a temporary home")?;
    let mut local = config.clone();
    local.home = home.path().to_owned();
    local.nats.managed_port = 0;
    local.http.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    Ok((home, local))
}

/// Retrieves with `request`'s read-your-writes token, asking again while the projectors are
/// still behind, for at most `total`: a benchmark's first query waits for the whole ingest
/// to be projected, longer than one request may wait.
pub(crate) async fn retrieve_when_visible(
    client: &engram_sdk::Client,
    mut request: engram_memory::proto::RetrieveRequest,
    total: std::time::Duration,
) -> anyhow::Result<engram_memory::proto::RetrieveResponse> {
    let started = std::time::Instant::now();
    request.consistency.wait_ms = Some(engram_memory::proto::limits::MAX_WAIT_MS);
    loop {
        match client.retrieve(&request).await {
            Err(e)
                if e.code() == engram_memory::proto::ErrorCode::NotYetVisible
                    && started.elapsed() < total =>
            {
                continue;
            }
            other => return other.context("waiting for the projectors to apply the ingest"),
        }
    }
}

/// A progress bar with rate and ETA, as every benchmark phase shows one.
pub(crate) fn progress(len: u64, message: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(message);
    bar
}

pub mod cli {
    use std::process::ExitCode;

    use clap::{Parser, Subcommand};
    use engram::config::Config;

    #[derive(Debug, Parser)]
    #[command(
        name = "engram-bench",
        version,
        about = "Engram's benchmarks, through the real bus, projectors and query service"
    )]
    pub struct Cli {
        #[command(flatten)]
        pub global: engram::cli::GlobalArgs,
        #[command(subcommand)]
        pub command: Command,
    }

    #[derive(Debug, Subcommand)]
    pub enum Command {
        /// Retrieval quality on LoCoMo: ingest through the bus, then ask every category 1-4
        /// question in hybrid, dense-only and BM25-only modes. Without --nats it starts its own
        /// nats-server and services in a temporary directory.
        Locomo(crate::locomo::LocomoArgs),
        /// Retrieval latency at a scope size (100k memories by default) through the query
        /// service, beside exact and graph search of the same vectors in-process.
        /// Self-contained.
        Query(crate::query::QueryArgs),
        /// The HTTP API's latency on append and retrieve against the native NATS path of the
        /// same agent identity, alternating request by request; p50 and p99 ratios.
        Gateway(crate::gateway::GatewayArgs),
        /// What the bi-temporal fact table costs in process: applying assertions, hashing,
        /// snapshots, current, as-of and text queries, and one fact re-asserted many times.
        Facts(crate::facts::FactsArgs),
        /// A new replica of each snapshot-keeping model (facts, skills, docs) from a snapshot
        /// plus the tail, against a full replay to the same state, in one run; the ratio of
        /// their times is `ratio`. Self-contained.
        Bootstrap(crate::bootstrap::BootstrapArgs),
        /// Shared documents in process: a team editing one task board (300 instances for an
        /// hour by default), merged in stream order; throughput, size, cost per change.
        Docs(crate::docs::DocsArgs),
    }

    /// Loads config as `engram` does, sets up logging and runs the benchmark.
    pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
        let config = Config::load(cli.global.config.as_deref(), &cli.global.overrides())?;
        engram_telemetry::init_logging(config.log.format, &config.log.filter)?;
        let json = cli.global.json;
        match cli.command {
            Command::Locomo(args) => crate::locomo::run(&config, args, json).await,
            Command::Query(args) => crate::query::run(&config, args, json).await,
            Command::Gateway(args) => crate::gateway::run(&config, args, json).await,
            Command::Facts(args) => crate::facts::run(args, json).await,
            Command::Bootstrap(args) => crate::bootstrap::run(&config, args, json).await,
            Command::Docs(args) => crate::docs::run(args, json).await,
        }
    }
}

//! Load generators for Engram.
//!
//! - [`fleet`] (binary `loadtest`): hundreds of simulated agent instances against a running
//!   Engram, open loop at a target rate, every acknowledged write verified against the stream
//!   and every projector at the end; optional chaos (`kill -9` of a projector and of
//!   nats-server); a JSON, Markdown and SVG report with raw JetStream figures from the same run.
//! - `bench-append` (this module's [`run`]): how much does appending through Engram cost
//!   compared with the bare JetStream publishes it is built on? Two phases against the same
//!   server, with the same number of concurrent agents, the same connection pool size and the
//!   same stop rule: (1) **engram**: each simulated agent appends realistic events through the
//!   SDK and awaits each ack before the next, recording every encoded size; (2) **raw**: as
//!   many publishers replay those exact sizes as plain JetStream publishes with a
//!   `Nats-Msg-Id`, to a stream configured like the events stream.
//! - [`project`] (binary `bench-project`): projector rebuilds against a raw replay.
//!
//! # Layout
//! - [`workload`]: the synthetic agents and the events they append.
//! - `driver`: bench-append's closed loop, warm-up, stop rule, figures.
//! - `engram`: bench-append's engram sender; it records the size trace.
//! - [`raw`]: the raw sender and the reference stream (bench-append and the fleet's reference).
//! - [`embedded`]: a private nats-server in a temp dir, for runs without `--nats`.
//! - [`report`]: bench-append's figures as a table and as JSON, and the machine description.

mod cpu;
mod driver;
pub mod embedded;
mod engram;
pub mod fleet;
pub mod leaf;
pub mod project;
pub mod raw;
pub mod report;
pub mod workload;

use std::future::Future;
use std::time::Duration;

use engram_bus::{Bus, BusConfig, BusError};
use engram_sdk::{Client, RetryPolicy};
use futures::future::try_join_all;
use tokio::sync::watch;

pub use driver::{LatencySummary, PhaseResult, StopRule};
pub use embedded::EmbeddedNats;
pub use report::Report;

use crate::driver::Clock;
use crate::engram::{EngramAgent, Trace};
use crate::raw::RawPublisher;
use crate::report::{Machine, Params, Ratios, SizeSummary};
use crate::workload::{AgentProfile, AgentWorkload};

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    /// NATS URL of the server under test.
    pub url: String,
    /// Concurrent simulated agent instances (and raw publishers).
    pub agents: usize,
    /// Size of the connection pool each phase's agents share, round robin.
    pub connections: usize,
    pub stop: StopRule,
    /// Unmeasured time at the start of each phase: connections warm up, the stream's first
    /// blocks are created and the server's caches fill.
    pub warmup: Duration,
    /// Agents per team; a team shares one task scope.
    pub team_size: usize,
    /// Seeds the event content, so runs with the same seed send the same sizes.
    pub seed: u64,
    /// Recorded in the report: the server runs on this machine, sharing its cpus.
    pub embedded_server: bool,
    /// The local nats-server's pid, when known, so its CPU per event can be reported.
    pub server_pid: Option<u32>,
    /// Replicas of the events stream and of the raw reference stream alike (1 on a single
    /// server; up to the cluster's size on a cluster).
    pub replicas: usize,
}

/// Parses a flag given in seconds, fractions allowed (`0.5`, `10`).
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is not a valid duration"))
}

/// Why a run could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid benchmark parameters: {0}")]
    InvalidConfig(String),
    #[error("nats-server could not be started: {0}")]
    Server(String),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("raw reference stream: {0}")]
    RawStream(String),
    #[error("the engram phase stored no event, so there are no sizes to replay; first error: {0}")]
    NothingStored(String),
}

impl BenchConfig {
    pub fn validate(&self) -> Result<(), BenchError> {
        let invalid = |reason: &str| Err(BenchError::InvalidConfig(reason.to_owned()));
        if self.agents == 0 {
            return invalid("--agents must be at least 1");
        }
        if self.connections == 0 {
            return invalid("--connections must be at least 1");
        }
        if self.team_size == 0 {
            return invalid("--team-size must be at least 1");
        }
        if !(1..=5).contains(&self.replicas) {
            return invalid("--replicas must be 1 to 5 (JetStream's limit)");
        }
        match self.stop {
            StopRule::Duration(d) if d.is_zero() => invalid("--duration must be positive"),
            StopRule::EventsPerAgent { events: 0, .. } => {
                invalid("--events-per-agent must be at least 1")
            }
            StopRule::EventsPerAgent { time_limit, .. } if time_limit.is_zero() => {
                invalid("--time-limit must be positive")
            }
            _ => Ok(()),
        }
    }
}

/// Runs both phases and returns the report. When `shutdown` completes, the agents stop after
/// their current append; the phase under way is reported as cut short and the raw phase is
/// skipped if it had not begun.
pub async fn run(
    config: BenchConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Report, BenchError> {
    config.validate()?;
    let started_at = chrono::Utc::now();
    // Before the run, so that the load average shows other work, not ours.
    let machine = Machine::detect();
    let (stop_tx, stop_rx) = watch::channel(false);
    let watcher = tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let result = run_phases(&config, stop_rx).await;
    watcher.abort();
    let (nats_server_version, sizes, engram, raw) = result?;
    let ratios = raw.as_ref().map(|raw| Ratios::new(&engram, raw));
    Ok(Report {
        started_at,
        params: params(&config),
        machine,
        nats_server_version,
        payload_sizes: sizes,
        engram,
        raw,
        ratios,
    })
}

type Phases = (String, SizeSummary, PhaseResult, Option<PhaseResult>);

async fn run_phases(
    config: &BenchConfig,
    stop: watch::Receiver<bool>,
) -> Result<Phases, BenchError> {
    // Phase 1: engram.
    let pool = connect_pool(config, "engram").await?;
    // A cluster just started elects its meta leader first; a single server answers at once.
    pool[0].wait_for_jetstream(Duration::from_secs(60)).await?;
    pool[0].provision().await?;
    let server_version = pool[0].client().server_info().version;
    // Retries as the SDK does them, but bounded well inside the driver's grace period.
    let retry = RetryPolicy {
        max_elapsed: Duration::from_secs(10),
        ..RetryPolicy::default()
    };
    let agents = (0..config.agents)
        .map(|i| {
            let client = Client::from_bus(pool[i % pool.len()].clone(), retry);
            let profile = AgentProfile::new(i, config.team_size);
            let seed = config.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            EngramAgent::new(client, AgentWorkload::new(profile, seed))
        })
        .collect();
    let clock = Clock::start(config.warmup, config.stop);
    let (agents, engram) =
        driver::run_phase("engram", agents, clock, stop.clone(), config.server_pid).await;
    close_pool(pool).await;
    let traces: Vec<Trace> = agents.into_iter().map(EngramAgent::into_trace).collect();
    let sizes = SizeSummary::from_sizes(
        traces
            .iter()
            .flat_map(|t| t.events.iter().map(|&(_, size)| size))
            .collect(),
    );
    if *stop.borrow() {
        return Ok((server_version, sizes, engram, None));
    }
    let traces = fill_empty_traces(traces)
        .ok_or_else(|| BenchError::NothingStored(engram.first_error.clone().unwrap_or_default()))?;

    // Phase 2: raw, on a fresh pool so that it inherits no state from phase 1.
    let pool = connect_pool(config, "raw").await?;
    raw::create_stream(&pool[0]).await?;
    let filler = raw::filler(sizes.max as usize);
    let publishers = traces
        .into_iter()
        .enumerate()
        .map(|(i, trace)| {
            let js = pool[i % pool.len()].jetstream().clone();
            RawPublisher::new(js, trace, filler.clone())
        })
        .collect();
    let clock = Clock::start(config.warmup, config.stop);
    let (_, raw) = driver::run_phase("raw", publishers, clock, stop, config.server_pid).await;
    if let Err(e) = raw::delete_stream(&pool[0]).await {
        tracing::warn!(error = %e, "reference stream left behind");
    }
    close_pool(pool).await;
    Ok((server_version, sizes, engram, Some(raw)))
}

/// Connects the pool. Every connection is a [`Bus`], in both phases, so that both use the
/// same client options and the same JetStream context settings (ack timeout, in-flight cap).
///
/// The pool is only ever used for publishing. If a consumer is ever added (to verify what was
/// stored, say), it needs its own connection: behind a saturating publisher on a shared one
/// it can stall (nats.rs#1285).
async fn connect_pool(config: &BenchConfig, phase: &str) -> Result<Vec<Bus>, BusError> {
    let connections = config.connections.min(config.agents);
    try_join_all((0..connections).map(|i| {
        let mut bus = BusConfig {
            url: config.url.clone(),
            client_name: format!("engram-bench-{phase}-{i}"),
            ..BusConfig::default()
        };
        bus.stream.replicas = config.replicas;
        Bus::connect(bus)
    }))
    .await
}

/// Closes the pool's connections and waits, briefly, until they are gone. Without the wait,
/// an embedded server stopped right after the run races the closing connections, and the
/// bus logs a lost connection that is not one.
async fn close_pool(pool: Vec<Bus>) {
    for bus in &pool {
        // Drain sends what is buffered, then closes the connection for every clone.
        if let Err(e) = bus.client().drain().await {
            tracing::warn!(error = %e, "draining a connection failed");
        }
    }
    for bus in &pool {
        // A flush fails once the connection's handler has exited; that is the only sign of it.
        for _ in 0..200 {
            if bus.client().flush().await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// An agent whose appends all failed has no sizes to replay; it borrows another's trace so
/// that the raw phase keeps the same concurrency. `None` if no agent stored anything.
fn fill_empty_traces(mut traces: Vec<Trace>) -> Option<Vec<Trace>> {
    let donors: Vec<usize> = (0..traces.len())
        .filter(|&i| !traces[i].events.is_empty())
        .collect();
    if donors.is_empty() {
        return None;
    }
    for i in 0..traces.len() {
        if traces[i].events.is_empty() {
            let donor = &traces[donors[i % donors.len()]];
            traces[i] = Trace {
                subjects: donor.subjects.clone(),
                events: donor.events.clone(),
            };
        }
    }
    Some(traces)
}

fn params(config: &BenchConfig) -> Params {
    let (duration_secs, events_per_agent, time_limit_secs) = match config.stop {
        StopRule::Duration(d) => (Some(d.as_secs_f64()), None, None),
        StopRule::EventsPerAgent { events, time_limit } => {
            (None, Some(events), Some(time_limit.as_secs_f64()))
        }
    };
    Params {
        agents: config.agents,
        connections: config.connections.min(config.agents),
        team_size: config.team_size,
        warmup_secs: config.warmup.as_secs_f64(),
        duration_secs,
        events_per_agent,
        time_limit_secs,
        seed: config.seed,
        embedded_server: config.embedded_server,
        replicas: config.replicas,
    }
}

//! The fleet load test: hundreds of simulated agent instances against a running Engram,
//! open loop, with every acknowledged write verified at the end.
//!
//! A run, in order:
//! 1. **Target.** `engram up` against a nats-server started here (or a remote deployment with
//!    `--nats`). With `--chaos`, the projectors run as processes of their own.
//! 2. **Load.** Every identity steps on its open-loop schedule for `duration` (see
//!    [`instance`]); a sampler records projector lag and process CPU and memory each second.
//!    The consolidator runs on its schedule (`consolidate_every` in a target started here),
//!    and every projector is asked for a snapshot every `snapshot_every` ([`snapshots`]),
//!    which the successors of dying instances bootstrap from.
//!    With `--chaos`, a projector and then nats-server are killed with SIGKILL and restarted.
//!    Each fault holds the load open until its recovery is timed ([`span`]).
//! 3. **Drain.** Wait until every projector has applied the whole stream.
//! 4. **Verify.** Read the stream and every projector's apply ledger ([`verify`]); then cut
//!    one more snapshot of each projector, timed, and read the target's metrics again
//!    ([`consolidation`]).
//! 5. **Reference.** Raw JetStream publishes of the same sizes at the same schedule, a raw
//!    tailing consumer, and a raw replay of the stream ([`reference`]).
//! 6. **Report.** JSON, Markdown and SVG charts in the output dir.
//!
//! The run fails (exit code 1 from the binary) if anything was lost, duplicated or invisible.
//! Beside that verdict on correctness stands one on the load: a run that did not sustain its
//! target rate ([`report::LoadVerdict`]) says so in its headline, and the binary exits with 3
//! unless `allow_overload` is set.

pub mod capacity;
pub mod charts;
pub mod consolidation;
pub mod docs;
mod instance;
mod metrics;
mod record;
pub mod reference;
pub mod report;
mod sampler;
pub mod snapshots;
mod span;
pub mod target;
pub(crate) use target::locate_engram;
pub mod timeline;
pub mod verify;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engram_bus::{Bus, BusConfig, BusError};
use engram_sdk::{Client, RetryPolicy};
use futures::future::try_join_all;
use tokio::sync::watch;
use tokio::time::Instant;

pub use self::instance::{hash_vector, workload_of};
pub use self::record::Acked;
use self::record::{Metric, Recorder};
use self::report::{ChaosEvent, FleetReport, Ratios};
use self::sampler::Samples;
use self::target::{EmbedderChoice, Target, TargetOptions};
use self::timeline::Timeline;
use crate::report::Machine;

/// What to run. The defaults are the `just loadtest` scenario; a TOML scenario file holds any
/// of these fields (durations as `"90s"`, `"5m"`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// A running deployment's NATS URL; `None` starts `engram up` here.
    pub nats: Option<String>,
    pub engram_bin: Option<PathBuf>,
    /// Extra TOML appended to the config of the engram processes started here.
    pub engram_config: Option<PathBuf>,
    pub embedder: EmbedderChoice,
    /// Concurrent simulated identities (10 to 1000 is the intended range).
    pub instances: usize,
    /// Identities per team; a team shares one task scope.
    pub team_size: usize,
    /// Target steps (one append each) per second, over all instances.
    pub rate: f64,
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
    /// Share of identities whose instance dies midway and is succeeded.
    pub churn: f64,
    /// Share of text-memory appends the writer recalls with its token.
    pub recall: f64,
    /// Share of fact assertions the writer checks with its token.
    pub fact_check: f64,
    /// Share of skill records the writer checks with its token.
    pub skill_check: f64,
    /// Share of steps that also edit the team's task board.
    pub doc_edit: f64,
    /// Share of instances that work offline for the middle third of the run: they keep
    /// editing the board and push their edits when back.
    pub offline: f64,
    /// Share of an operation's requests that may fail with a retryable error outside chaos
    /// outages; beyond it the run fails. Errors no retry can fix always fail it.
    pub error_budget: f64,
    /// Every n-th step starts with `build_context`.
    pub context_every: u64,
    /// The consolidator's schedule in a target started here (0: off); a remote deployment
    /// keeps its own.
    #[serde(with = "humantime_serde")]
    pub consolidate_every: Duration,
    /// Share of episodic memories that repeat a recent one of the same instance: the
    /// near-duplicates consolidation merges.
    pub duplicates: f64,
    /// Every n-th event of an instance ends its session (`checkpoint {"finished": true}`
    /// in its private scope), which consolidation summarises; 0: never.
    pub finish_every: u64,
    /// How often every projector is asked for a snapshot during the load (0: never), so
    /// that successors bootstrap from snapshots as they would in a deployment.
    #[serde(with = "humantime_serde")]
    pub snapshot_every: Duration,
    /// The Prometheus endpoint of a remote deployment (`http://host:port/metrics`), for
    /// the figures only its processes measure; a target started here is read without it.
    pub metrics: Option<String>,
    /// Share of steps that end with an ordinary retrieve.
    pub query: f64,
    /// Read-your-writes wait per request.
    #[serde(with = "humantime_serde")]
    pub wait: Duration,
    /// Connections the instances share.
    pub connections: usize,
    /// Memory nodes as processes of their own (`engram up --nodes N`), sharing the stream's
    /// partitions; 0 runs one inside `engram up`.
    pub nodes: usize,
    /// With `nodes` of 2 or more, chaos kills a node (not a projector): its partitions move
    /// to the others, and back once `engram up` has started it again after this.
    #[serde(with = "humantime_serde")]
    pub node_restart_after: Duration,
    pub chaos: bool,
    /// NATS servers forming one JetStream cluster (every stream on 3 of them); 0 runs one.
    pub cluster: usize,
    /// Chaos for a cluster (`--chaos cluster`): kill -9 a follower NATS node, then the events
    /// stream's leader, then a memory node; a rolling restart of every process; a frozen node.
    pub chaos_cluster: bool,
    /// Written-to-readable p99 a fault's recovery is timed back under.
    #[serde(with = "humantime_serde")]
    pub visibility_goal: Duration,
    /// Accept a run that did not sustain its target rate: its report still says so, but the
    /// binary exits 0 (given correctness passed) instead of 3. For exploring where a machine
    /// tops out, not for a check that the target holds.
    pub allow_overload: bool,
    /// Longest wait for the projectors to apply everything after the load.
    #[serde(with = "humantime_serde")]
    pub drain_limit: Duration,
    /// Length of the raw reference phase (at most `duration`).
    #[serde(with = "humantime_serde")]
    pub reference: Duration,
    pub out: PathBuf,
    /// 0 in a scenario file: pick one at random.
    pub seed: u64,
    /// `--find-capacity`: search for the highest rate held instead of one run.
    pub capacity: capacity::CapacitySearch,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            nats: None,
            engram_bin: None,
            engram_config: None,
            embedder: EmbedderChoice::Minilm,
            instances: 300,
            team_size: 5,
            // What this 2-core machine sustains with the built-in MiniLM embedder, which is the
            // bottleneck (about 5 agent-length texts/s); see docs/benchmarks.md.
            rate: 4.0,
            duration: Duration::from_secs(120),
            churn: 0.1,
            recall: 0.3,
            fact_check: 0.5,
            skill_check: 0.5,
            doc_edit: 0.1,
            offline: 0.2,
            error_budget: 0.01,
            context_every: 5,
            consolidate_every: Duration::from_secs(5),
            duplicates: 0.05,
            finish_every: 20,
            snapshot_every: Duration::from_secs(10),
            metrics: None,
            query: 0.2,
            wait: Duration::from_secs(10),
            connections: 8,
            nodes: 0,
            // Past the node's leases (10 s) and the others' catching up on its partitions,
            // so that the report sees them taken over before the node is back.
            node_restart_after: Duration::from_secs(30),
            chaos: false,
            cluster: 0,
            chaos_cluster: false,
            visibility_goal: Duration::from_secs(1),
            allow_overload: false,
            drain_limit: Duration::from_secs(120),
            reference: Duration::from_secs(30),
            out: PathBuf::from("target/loadtest"),
            seed: 0,
            capacity: capacity::CapacitySearch::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("invalid load test parameters: {0}")]
    Invalid(String),
    #[error("cannot set up the system under test: {0}")]
    Setup(String),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("{0}")]
    Drain(String),
    #[error("verification could not run: {0}")]
    Verify(String),
    #[error("cannot write the report: {0}")]
    Report(String),
}

impl FleetConfig {
    pub fn validate(&self) -> Result<(), FleetError> {
        let invalid = |reason: String| Err(FleetError::Invalid(reason));
        if !(1..=1000).contains(&self.instances) {
            return invalid(format!(
                "--instances is {}; it must be 1 to 1000",
                self.instances
            ));
        }
        if self.team_size == 0 || self.connections == 0 || self.context_every == 0 {
            return invalid(
                "--team-size, --connections and --context-every must be at least 1".into(),
            );
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return invalid(format!("--rate is {}; it must be positive", self.rate));
        }
        if self.duration.is_zero() {
            return invalid("--duration must be positive".into());
        }
        for (name, share) in [
            ("--churn", self.churn),
            ("--recall", self.recall),
            ("--fact-check", self.fact_check),
            ("--skill-check", self.skill_check),
            ("--doc-edit", self.doc_edit),
            ("--offline", self.offline),
            ("--error-budget", self.error_budget),
            ("--query", self.query),
            ("--duplicates", self.duplicates),
        ] {
            if !(0.0..=1.0).contains(&share) {
                return invalid(format!("{name} is {share}; it must be between 0 and 1"));
            }
        }
        if self.nodes > 64 {
            return invalid(format!("--nodes is {}; at most 64", self.nodes));
        }
        if self.nodes > 0 && self.nats.is_some() {
            return invalid(
                "--nodes starts memory nodes here, so it needs the local target; drop --nats"
                    .into(),
            );
        }
        if self.chaos && self.nodes == 1 {
            return invalid(
                "--chaos with --nodes kills one node and needs another to take its partitions: use --nodes 2 or more (or none)".into(),
            );
        }
        if self.cluster != 0 && !(3..=9).contains(&self.cluster) {
            return invalid(format!(
                "--cluster is {}; a cluster has 3 to 9 nodes (or 0 for one server)",
                self.cluster
            ));
        }
        if self.cluster > 0 && self.nats.is_some() {
            return invalid("--cluster starts the NATS cluster here; drop --nats".into());
        }
        if self.chaos_cluster && (self.cluster < 3 || self.nodes < 2) {
            return invalid(
                "--chaos cluster kills NATS nodes and memory nodes: it needs --cluster 3 (or more) and --nodes 2 (or more)".into(),
            );
        }
        if self.chaos && self.cluster > 0 {
            return invalid("with --cluster, use --chaos cluster".into());
        }
        if self.chaos && self.nats.is_some() {
            return invalid(
                "--chaos kills and restarts processes, so it needs the local target; drop --nats"
                    .into(),
            );
        }
        if self.capacity.enabled && (self.chaos || self.chaos_cluster) {
            return invalid(
                "--find-capacity measures the load a healthy deployment holds: drop --chaos".into(),
            );
        }
        self.capacity.validate()
    }

    /// Seconds between two steps of one instance.
    fn period(&self) -> Duration {
        Duration::from_secs_f64(self.instances as f64 / self.rate)
    }
}

/// Runs the whole test and returns its report (written to `config.out` as well).
pub async fn run(
    config: FleetConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<FleetReport, FleetError> {
    config.validate()?;
    let started_at = chrono::Utc::now();
    let machine = Machine::detect();
    std::fs::create_dir_all(&config.out)
        .map_err(|e| FleetError::Report(format!("cannot create {}: {e}", config.out.display())))?;
    eprintln!(
        "[setup] starting the system under test ({})",
        if config.nats.is_some() {
            "remote"
        } else if config.cluster > 0 && config.nodes > 0 {
            "engram up with memory node processes + a nats-server cluster"
        } else if config.cluster > 0 {
            "engram up + a nats-server cluster"
        } else if config.nodes > 0 {
            "engram up with memory node processes + nats-server"
        } else if config.chaos {
            "engram up + 4 projector processes + nats-server"
        } else {
            "engram up + nats-server"
        }
    );
    let mut target = Target::start(TargetOptions {
        remote: config.nats.clone(),
        engram_bin: config.engram_bin.clone(),
        separate_projectors: config.chaos && config.nodes == 0,
        embedder: config.embedder,
        extra_config: config.engram_config.clone(),
        consolidate_every: config.consolidate_every,
        nodes: config.nodes,
        node_restart_after: config.node_restart_after,
        cluster: config.cluster,
        partitionable: config.chaos_cluster,
    })
    .await?;
    if config.nodes > 0 {
        let monitor = connect_pool(&target.url, 1, "engram-loadtest-nodes")
            .await?
            .remove(0);
        // Until the nodes have shared the partitions out, not only served them all: the
        // first to start takes every partition and hands some over as the others join.
        let bucket = engram_node::NodeConfig::default().bucket;
        let deadline = Instant::now() + Duration::from_secs(300);
        while Instant::now() < deadline {
            let members = engram_node::ownership::live_members(&monitor, &bucket)
                .await
                .unwrap_or_default();
            if members.iter().filter(|m| !m.serving.is_empty()).count() >= config.nodes {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        wait_partitions_settled(&monitor, Duration::from_secs(300)).await;
        close_pool(&[monitor]).await;
    }
    let result = load_and_verify(&config, &mut target, machine, started_at, shutdown).await;
    let failed = !matches!(&result, Ok(r) if r.passed());
    let kept = if failed { target.keep_files() } else { None };
    target.stop().await;
    if let Some(dir) = kept {
        eprintln!("logs and stores kept in {}", dir.display());
    }
    result
}

async fn load_and_verify(
    config: &FleetConfig,
    target: &mut Target,
    machine: Machine,
    started_at: chrono::DateTime<chrono::Utc>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<FleetReport, FleetError> {
    let pool = connect_pool(&target.url, config.connections, "engram-loadtest").await?;
    pool[0].provision().await?;
    let nats_server_version = pool[0].client().server_info().version;
    let monitor = connect_pool(&target.url, 1, "engram-loadtest-monitor")
        .await?
        .remove(0);

    let baseline = verify::Baseline::take(&monitor).await?;
    let metrics_url = config.metrics.clone().or_else(|| target.metrics_url());
    let metrics_before = read_metrics(metrics_url.as_deref()).await;
    let consolidator_cpu_before = consolidator_cpu(target);
    let (stop_tx, stop_rx) = watch::channel(false);
    let interrupt = {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        })
    };
    let start = Instant::now() + Duration::from_secs(1);
    let load = span::LoadSpan::new(start, config.duration, config.period());
    let recorder = Arc::new(Recorder::new(start));
    let boards = Arc::new(docs::Boards::default());
    let shared = Arc::new(instance::Shared {
        recorder: recorder.clone(),
        clients: pool
            .iter()
            .map(|bus| {
                // Refusals come back to the instances, which time and count each one and
                // ask again as an agent would (`Instance::unless_busy`).
                let retry = RetryPolicy {
                    retry_busy: false,
                    ..RetryPolicy::default()
                };
                Client::from_bus(bus.clone(), retry)
            })
            .collect(),
        team_size: config.team_size,
        period: config.period(),
        start,
        load: load.clone(),
        drain_limit: config.drain_limit,
        churn: config.churn,
        recall: config.recall,
        fact_check: config.fact_check,
        skill_check: config.skill_check,
        doc_edit: config.doc_edit,
        offline: config.offline,
        boards: boards.clone(),
        context_every: config.context_every,
        query: config.query,
        duplicates: config.duplicates,
        finish_every: config.finish_every,
        wait: config.wait,
        embedder: config.embedder,
        seed: config.seed,
        stop: stop_rx.clone(),
    });

    let pids = Arc::new(Mutex::new(target.pids()));
    let samples = Samples::default();
    let (sampler_stop, sampler_rx) = watch::channel(false);
    let sampler = tokio::spawn(sampler::run(
        monitor.clone(),
        start,
        pids.clone(),
        samples.clone(),
        sampler_rx,
    ));
    let progress = tokio::spawn(progress(
        recorder.clone(),
        samples.clone(),
        start,
        load.clone(),
    ));
    let cuts = snapshots::Cuts::default();
    let (cutter_stop, cutter_rx) = watch::channel(false);
    let cutter = tokio::spawn(snapshots::run_during_load(
        monitor.client().clone(),
        cuts.clone(),
        start,
        config.snapshot_every,
        cutter_rx,
    ));
    eprintln!(
        "[load] {} instances in teams of {}, {:.1} steps/s in all (one every {:.1}s each), for {:?}",
        config.instances,
        config.team_size,
        config.rate,
        config.period().as_secs_f64(),
        config.duration
    );
    let instances: Vec<_> = (0..config.instances)
        .map(|i| tokio::spawn(instance::run(shared.clone(), i)))
        .collect();

    let chaos_events = if config.chaos || config.chaos_cluster {
        chaos(
            target,
            &chaos_plan(config),
            &pids,
            &monitor,
            &recorder,
            start,
            config.duration,
            &load,
            config.visibility_goal,
        )
        .await
    } else {
        Vec::new()
    };
    for task in instances {
        if let Err(e) = task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    progress.abort();
    let _ = cutter_stop.send(true);
    let _ = cutter.await;
    let load_ended = Instant::now();
    eprintln!("[drain] load done; waiting for the projectors to apply the whole stream");
    let drain_started = Instant::now();
    let drain = verify::drain(&monitor, config.drain_limit).await;
    let drain_secs = drain.as_ref().map(|d| d.took.as_secs_f64()).ok();
    let consolidator_cpu_secs = consolidator_cpu_before
        .zip(consolidator_cpu(target))
        .map(|(before, after)| after.saturating_sub(before).as_secs_f64());
    let recorded = recorder.finish();
    eprintln!(
        "[verify] reading the stream and the projectors' ledgers ({} acknowledged appends)",
        recorded.ledger.len()
    );
    let verification = match &drain {
        Ok(_) => {
            let mut v = verify::verify(
                &monitor,
                &recorded.ledger,
                crate::workload::TENANT,
                &baseline,
            )
            .await?;
            let last = recorded.ledger.iter().map(|a| a.seq).max().unwrap_or(0);
            let client = Client::from_bus(monitor.clone(), RetryPolicy::default());
            v.docs = Some(docs::verify(&client, &boards, last).await);
            Some(v)
        }
        Err(e) => {
            eprintln!("[verify] skipped: {e}");
            None
        }
    };
    let metrics_after = read_metrics(metrics_url.as_deref()).await;
    let nodes = node_shares(&monitor, target).await;
    eprintln!("[snapshots] cutting one snapshot of each projector");
    let snapshots = cuts.finish(monitor.client()).await;
    let interrupted = *stop_rx.borrow();
    interrupt.abort();
    let mut reference_r1 = None;
    let reference = if interrupted {
        None
    } else {
        // At least one period, so that every raw publisher sends at least once even when
        // instances step rarely.
        let secs = config.reference.max(config.period()).min(config.duration);
        eprintln!("[reference] raw JetStream publishes of the same sizes, same schedule, {secs:?}");
        let sizes: Vec<u32> = recorded.ledger.iter().map(|a| a.bytes).collect();
        let with_replicas = |replicas: usize| {
            let mut bus_config = monitor.config().clone();
            bus_config.stream.replicas = replicas;
            Bus::from_client(monitor.client().clone(), bus_config)
        };
        let replicas = if config.cluster > 0 {
            config.cluster.min(3)
        } else {
            1
        };
        let main = reference::run(
            &with_replicas(replicas),
            config.instances,
            config.period(),
            secs,
            &sizes,
            config.seed,
        )
        .await?;
        if replicas > 1 {
            eprintln!("[reference] the same on a stream with one replica, for what R3 costs");
            reference_r1 = Some(
                reference::run(
                    &with_replicas(1),
                    config.instances,
                    config.period(),
                    secs,
                    &sizes,
                    config.seed,
                )
                .await?,
            );
        }
        Some(main)
    };
    let _ = sampler_stop.send(true);
    let _ = sampler.await;
    let _ = stop_tx.send(true);
    close_pool(&pool).await;

    let measured_secs = recorded
        .last_ack
        .map_or(0.0, |t| t.saturating_duration_since(start).as_secs_f64())
        .max(
            (load_ended.min(start + load.length()))
                .saturating_duration_since(start)
                .as_secs_f64(),
        );
    let appends = recorded.ledger.len() as u64;
    let queries: u64 = recorded.queries_per_second.iter().sum();
    let timeline = timeline(&recorded, &samples.all(), &chaos_events);
    let latency: BTreeMap<String, record::Latency> = recorded
        .latency
        .iter()
        .map(|(m, l)| (metric_name(*m).to_owned(), l.clone()))
        .collect();
    let appends_per_sec = appends as f64 / measured_secs.max(1e-9);
    let metrics = match (metrics_before, metrics_after) {
        (Ok(before), Ok(after)) => Ok((before, after)),
        (Err(why), _) | (_, Err(why)) => Err(why),
    };
    let applied = verification
        .iter()
        .flat_map(|v| &v.projectors)
        .filter(|p| p.error.is_none())
        .map(|p| (p.projector.clone(), p.applied_events))
        .collect();
    let no_lag = Vec::new();
    let inputs = consolidation::Inputs {
        metrics: &metrics,
        separate_projectors: target.separate_projectors(),
        tally: verification.as_ref().map(|v| &v.tally),
        interval_secs: config
            .nats
            .is_none()
            .then_some(config.consolidate_every.as_secs_f64()),
        lag: timeline
            .lag_events
            .get(engram_projectors::consolidator::NAME)
            .unwrap_or(&no_lag),
        caught_up_secs_after_load: drain.as_ref().ok().and_then(|d| {
            d.caught_up
                .get(engram_projectors::consolidator::NAME)
                .map(|t| (drain_started - load_ended + *t).as_secs_f64())
        }),
        applied,
        process_cpu_secs: consolidator_cpu_secs,
        measured_secs,
    };
    let consolidation = consolidation::consolidation(&inputs);
    let docs_merge = consolidation::docs_merge(&inputs);
    let ratios = reference.as_ref().map(|r| Ratios {
        appends_per_sec: appends_per_sec / r.publishes_per_sec.max(1e-9),
        ack_p50: recorded.latency[&Metric::Ack].p50 / r.ack_ms.p50.max(1e-9),
        ack_p99: recorded.latency[&Metric::Ack].p99 / r.ack_ms.p99.max(1e-9),
        visibility_p50: recorded.latency[&Metric::Visibility].p50 / r.delivery_ms.p50.max(1e-9),
        visibility_p99: recorded.latency[&Metric::Visibility].p99 / r.delivery_ms.p99.max(1e-9),
    });
    let report = FleetReport {
        started_at,
        config: config.clone(),
        machine,
        nats_server_version,
        interrupted,
        load_secs: load.length().as_secs_f64(),
        measured_secs,
        appends,
        appends_per_sec,
        target_appends_per_sec: config.rate,
        queries,
        queries_per_sec: queries as f64 / measured_secs.max(1e-9),
        duplicate_acks: recorded.duplicates_acked,
        latency_ms: latency,
        takeovers: recorded.takeovers,
        takeover_events_checked: recorded.takeover_events_checked,
        bootstraps: recorded.bootstraps.clone(),
        consolidation,
        docs_merge,
        snapshots,
        load: report::LoadVerdict::of(
            &recorded.problems,
            appends_per_sec,
            config.rate,
            recorded.latency.get(&Metric::Ack),
            recorded.latency.get(&Metric::Query),
        ),
        problems: recorded.problems.clone(),
        drain_secs,
        drain_error: drain.err().map(|e| e.to_string()),
        verification,
        chaos: chaos_events,
        nodes,
        reference,
        reference_r1,
        ratios,
        resources: report::resources(&timeline),
        timeline,
    };
    report.write(&config.out)?;
    Ok(report)
}

fn metric_name(metric: Metric) -> &'static str {
    match metric {
        Metric::Ack => "ack",
        Metric::AckService => "ack_service",
        Metric::Visibility => "visibility",
        Metric::KeywordVisibility => "visibility_keyword",
        Metric::Query => "query",
        Metric::Context => "context",
        Metric::Facts => "facts",
        Metric::Skills => "skills",
        Metric::Takeover => "takeover_replay",
        Metric::Bootstrap => "takeover_bootstrap",
        Metric::Answered => "answered",
        Metric::Refused => "refused",
    }
}

/// The target's metrics now, or why there are none.
async fn read_metrics(url: Option<&str>) -> Result<metrics::Scrape, String> {
    let Some(url) = url else {
        return Err(
            "a remote deployment without --metrics (its Prometheus endpoint, http://host:port/metrics)"
                .into(),
        );
    };
    metrics::scrape(url).await.map_err(|e| {
        tracing::warn!(error = %e, "cannot read the target's metrics");
        format!("its metrics could not be read: {e}")
    })
}

/// CPU time so far of the consolidator's process, when it has one of its own (chaos mode).
fn consolidator_cpu(target: &Target) -> Option<Duration> {
    if !target.separate_projectors() {
        return None;
    }
    let (_, pid) = target
        .pids()
        .into_iter()
        .find(|(name, _)| name == engram_projectors::consolidator::NAME)?;
    crate::cpu::of_pid(pid)
}

/// Each memory node process's share at the end of the run: the partitions it serves, the
/// events its read models applied (its `/metrics`) and the CPU its process used (since it
/// last started). Empty without node processes.
async fn node_shares(monitor: &Bus, target: &Target) -> Vec<report::NodeShare> {
    let pids = target.node_pids();
    if pids.is_empty() {
        return Vec::new();
    }
    let bucket = engram_node::NodeConfig::default().bucket;
    let members = engram_node::ownership::live_members(monitor, &bucket)
        .await
        .unwrap_or_default();
    let mut shares = Vec::new();
    for m in members {
        let applied = match &m.http {
            Some(addr) => metrics::scrape(&format!("http://{addr}/metrics"))
                .await
                .ok()
                .and_then(|s| s.sum("engram_projector_applied_total", &[]))
                .map(|v| v as u64),
            None => None,
        };
        let cpu_secs = pids
            .iter()
            .find(|(name, _)| *name == m.node)
            .and_then(|(_, pid)| crate::cpu::of_pid(*pid))
            .map(|d| d.as_secs_f64());
        shares.push(report::NodeShare {
            node: m.node,
            partitions: m.serving,
            applied_events: applied,
            cpu_secs,
        });
    }
    shares
}

/// Until every partition is served by some live memory node other than `but` (a node just
/// killed, whose announcement outlives it until it expires); how long that took, `None` if
/// not within `within`.
async fn wait_nodes_serving(monitor: &Bus, but: Option<&str>, within: Duration) -> Option<f64> {
    let started = Instant::now();
    let partitions = monitor.config().stream.partitions as usize;
    let bucket = engram_node::NodeConfig::default().bucket;
    while started.elapsed() < within {
        let served: std::collections::BTreeSet<u32> =
            engram_node::ownership::live_members(monitor, &bucket)
                .await
                .unwrap_or_default()
                .into_iter()
                .filter(|m| Some(m.node.as_str()) != but)
                .flat_map(|m| m.serving)
                .collect();
        if served.len() == partitions {
            return Some(started.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Until every partition is served and which node serves which has not changed for 3 s
/// (moves back to a returned node included); how long that took.
async fn wait_partitions_settled(monitor: &Bus, within: Duration) -> Option<f64> {
    let started = Instant::now();
    let partitions = monitor.config().stream.partitions as usize;
    let bucket = engram_node::NodeConfig::default().bucket;
    // Who served what, and since when it has been so.
    type Serving = Vec<(String, Vec<u32>)>;
    let mut last: Option<(Serving, Instant)> = None;
    while started.elapsed() < within {
        let mut now: Serving = engram_node::ownership::live_members(monitor, &bucket)
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.node, m.serving.into_iter().collect()))
            .collect();
        now.sort();
        let served: std::collections::BTreeSet<u32> =
            now.iter().flat_map(|(_, s)| s.iter().copied()).collect();
        if served.len() == partitions {
            match &last {
                Some((seen, since)) if *seen == now => {
                    if since.elapsed() >= Duration::from_secs(3) {
                        return Some(started.elapsed().as_secs_f64());
                    }
                }
                _ => last = Some((now, Instant::now())),
            }
        } else {
            last = None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Until the node `name` serves some partition again; how long that took.
async fn wait_node_back(monitor: &Bus, name: &str, within: Duration) -> Option<f64> {
    let started = Instant::now();
    let bucket = engram_node::NodeConfig::default().bucket;
    while started.elapsed() < within {
        let back = engram_node::ownership::live_members(monitor, &bucket)
            .await
            .unwrap_or_default()
            .into_iter()
            .any(|m| m.node == name && !m.serving.is_empty());
        if back {
            return Some(started.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// One fault of chaos mode, at a share of the load's duration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// `kill -9` of a named process (a projector, a node `node-<i>`, "nats-server"), which
    /// is started again (a node by `engram up`, after `node.restart_after`).
    Kill(&'static str),
    /// `kill -9` of the cluster node leading the events stream, or of one following it.
    KillLeader,
    KillFollower,
    /// SIGTERM, start and catch-up of every NATS node, then of every memory node, one after
    /// another.
    RollingRestart,
    /// SIGSTOP of a follower for longer than its routes' ping timeout, then SIGCONT.
    Freeze,
    /// The events stream's leader cut off the network (its link down) for [`CUT_FOR`], then
    /// healed: the majority elects another and goes on; what the cut-off side acknowledged,
    /// if anything, must survive (the ledger checks every acknowledged append).
    Partition,
}

/// What chaos mode does: with `--chaos` (processes), a projector or memory node and then
/// the one nats-server; with `--chaos cluster`, every fault a cluster must survive.
fn chaos_plan(config: &FleetConfig) -> Vec<(f64, Fault)> {
    if config.chaos_cluster {
        return vec![
            // Recoveries take 10 to 75 s (a memory node waits out its leases, a rolling
            // restart each process's restart), so the later faults start when the earlier
            // ones have recovered: at 300 s of load the last still has a minute left.
            (0.08, Fault::KillFollower),
            (0.18, Fault::KillLeader),
            (0.30, Fault::Kill("node-1")),
            (0.46, Fault::RollingRestart),
            (0.70, Fault::Freeze),
            (0.82, Fault::Partition),
        ];
    }
    let first = if config.nodes >= 2 {
        "node-1"
    } else {
        "vector"
    };
    vec![(0.3, Fault::Kill(first)), (0.6, Fault::Kill("nats-server"))]
}

/// How long a partitioned node stays cut off: past its routes' ping timeout (2 s x 2), the
/// clients' (`bus.ping_interval` 5 s x 3 pings) and the majority's election of a leader.
const CUT_FOR: Duration = Duration::from_secs(20);

/// How long a frozen node stays stopped: past the loadtest cluster's route ping timeout
/// (ping_interval 2 s x ping_max 2) and JetStream's leader election timeouts.
const FREEZE: Duration = Duration::from_secs(10);

/// The events stream's leader as the load test names NATS servers ("nats-<i>").
async fn stream_leader(monitor: &Bus) -> Option<String> {
    let (raft, _) = monitor.events_cluster().await.ok()??;
    Some(format!("nats-{}", raft.leader?.rsplit_once('-')?.1))
}

/// Until the server `victim` ("nats-<i>") holds a current replica of the events stream
/// (or leads it); how long that took.
async fn wait_replica_current(monitor: &Bus, victim: &str, within: Duration) -> Option<f64> {
    let started = Instant::now();
    let name = format!("engram-{}", victim.strip_prefix("nats-")?);
    while started.elapsed() < within {
        if let Ok(Some((cluster, _))) = monitor.events_cluster().await
            && Bus::holds_current_copy(&cluster, &name)
        {
            return Some(started.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Chaos mode, run alongside the load: each fault of [`chaos_plan`] at its share of the
/// load, timed until the system has recovered: appends resumed, a NATS node's replica
/// current again, a memory node's partitions moved away and back, every projector caught
/// up, and written-to-readable back under the goal.
#[allow(clippy::too_many_arguments)]
async fn chaos(
    target: &mut Target,
    plan: &[(f64, Fault)],
    pids: &Arc<Mutex<Vec<(String, u32)>>>,
    monitor: &Bus,
    recorder: &Recorder,
    start: Instant,
    duration: Duration,
    load: &Arc<span::LoadSpan>,
    visibility_goal: Duration,
) -> Vec<ChaosEvent> {
    let mut events = Vec::new();
    let clustered = target.nats_names().len() > 1;
    // Each fault holds the load open until it has been timed (see [`span`]), and the hold
    // passes straight to the next fault when that one is already due, so that a slow
    // recovery delays the faults after it rather than leaving them no load to be timed in.
    let mut held: Option<span::Hold> = None;
    for &(share, fault) in plan {
        let due = start + duration.mul_f64(share);
        if Instant::now() < due {
            held = None;
            tokio::time::sleep_until(due).await;
        }
        // Every fault is due within `duration` or takes over the last one's hold, so the load
        // is still on; were it not, the fault is reported as not run rather than timed with
        // nothing appending.
        let Some(hold) = held.take().or_else(|| load.hold()) else {
            let what = match fault {
                Fault::Kill(name) => format!("kill -9 {name}"),
                Fault::KillLeader => "kill -9 the stream leader".to_owned(),
                Fault::KillFollower => "kill -9 a follower".to_owned(),
                Fault::RollingRestart => "rolling restart".to_owned(),
                Fault::Freeze => "sigstop".to_owned(),
                Fault::Partition => "partition".to_owned(),
            };
            eprintln!("[chaos] {what}: not run, the load had ended");
            events.push(ChaosEvent {
                victim: what,
                at_secs: start.elapsed().as_secs_f64(),
                down_secs: 0.0,
                stream_seq_at_kill: None,
                appends_while_down: 0,
                appends_resumed_secs: None,
                caught_up_secs: None,
                caught_up_to_seq: None,
                taken_over_secs: None,
                returned_secs: None,
                visibility_max_ms: None,
                action: None,
                ack_gap_max_ms: None,
                replica_caught_up_secs: None,
                visibility_back_secs: None,
                leader_change: None,
                error: Some("not run: the load had already ended".to_owned()),
            });
            continue;
        };
        if let (Fault::Partition, Err(why)) = (fault, target.partitionable()) {
            eprintln!("[chaos] network partition: not run, this machine cannot ({why})");
            continue;
        }
        let leader_before = if clustered {
            stream_leader(monitor).await
        } else {
            None
        };
        let follower = || {
            target
                .nats_names()
                .into_iter()
                .find(|n| Some(n) != leader_before.as_ref())
        };
        let (victim, action) = match fault {
            Fault::Kill(name) => (name.to_owned(), "kill -9"),
            Fault::KillLeader => (leader_before.clone().unwrap_or_default(), "kill -9"),
            Fault::KillFollower => (follower().unwrap_or_default(), "kill -9"),
            Fault::RollingRestart => ("every process".to_owned(), "rolling restart"),
            Fault::Freeze => (follower().unwrap_or_default(), "sigstop"),
            Fault::Partition => (leader_before.clone().unwrap_or_default(), "partition"),
        };
        let stream_seq_at_kill = monitor.stream_state().await.ok().map(|s| s.last_seq);
        let killed = Instant::now();
        eprintln!("[chaos] {action} {victim}");
        recorder.outage(true);
        let appends_before = recorder.acked_count();
        let nats = victim.starts_with("nats-");
        let node = victim.starts_with("node-");
        // Appends go on through a dead projector, node or cluster follower, and resume
        // after a new leader is elected: watched from the fault. A single server's restart
        // is waited for first, so that an ack that raced the kill is no resumption.
        let watch_appends = victim != "nats-server";
        let mut taken_over = None;
        let mut replica_caught_up = None;
        let restart = match fault {
            Fault::RollingRestart => rolling_restart(target, monitor, &mut replica_caught_up).await,
            Fault::Freeze => {
                target.freeze(&victim, true);
                tokio::time::sleep(FREEZE).await;
                target.freeze(&victim, false);
                Ok(())
            }
            Fault::Partition => {
                target.cut(&victim, true);
                tokio::time::sleep(CUT_FOR).await;
                target.cut(&victim, false);
                Ok(())
            }
            _ => {
                let old_pid = target
                    .node_pids()
                    .into_iter()
                    .find(|(n, _)| *n == victim)
                    .map(|(_, pid)| pid);
                target.kill(&victim).await;
                // A node's partitions move to the others: timed from the kill, unless
                // `engram up` has started it again before they all had.
                if node {
                    let deadline = Instant::now() + Duration::from_secs(120);
                    while Instant::now() < deadline {
                        let step = Duration::from_millis(500);
                        if wait_nodes_serving(monitor, Some(&victim), step)
                            .await
                            .is_some()
                        {
                            taken_over = Some(killed.elapsed().as_secs_f64());
                            break;
                        }
                        let restarted = target
                            .node_pids()
                            .into_iter()
                            .any(|(n, pid)| n == victim && Some(pid) != old_pid);
                        if restarted {
                            break;
                        }
                    }
                } else {
                    // Long enough for clients to notice and start retrying.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                target.restart(&victim).await
            }
        };
        if nats && clustered {
            replica_caught_up = wait_replica_current(monitor, &victim, Duration::from_secs(120))
                .await
                .map(|_| killed.elapsed().as_secs_f64());
        }
        let returned = if node {
            wait_node_back(monitor, &victim, Duration::from_secs(300))
                .await
                .map(|_| killed.elapsed().as_secs_f64())
        } else {
            None
        };
        let serving = Instant::now();
        *pids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = target.pids();
        let mut event = ChaosEvent {
            victim: victim.clone(),
            at_secs: (killed - start).as_secs_f64(),
            down_secs: (serving - killed).as_secs_f64(),
            stream_seq_at_kill,
            appends_while_down: recorder.acks_between(killed, serving),
            appends_resumed_secs: None,
            caught_up_secs: None,
            caught_up_to_seq: None,
            taken_over_secs: taken_over,
            returned_secs: returned,
            visibility_max_ms: None,
            action: Some(action.to_owned()),
            ack_gap_max_ms: None,
            replica_caught_up_secs: replica_caught_up,
            visibility_back_secs: None,
            leader_change: None,
            error: restart.err().map(|e| e.to_string()),
        };
        if event.error.is_none() {
            let baseline = if watch_appends {
                appends_before
            } else {
                recorder.acked_count()
            };
            // The load is held open meanwhile, so appends can resume.
            let resume_by = Instant::now() + Duration::from_secs(120);
            while recorder.acked_count() <= baseline && Instant::now() < resume_by {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if recorder.acked_count() > baseline {
                event.appends_resumed_secs = Some(if watch_appends {
                    // Appends went on during the outage; the first one after the kill is
                    // within the 10 ms polling of it.
                    recorder
                        .first_ack_after(killed)
                        .map_or(0.0, |t| (t - killed).as_secs_f64())
                } else {
                    killed.elapsed().as_secs_f64()
                });
            }
            // Caught up: every projector has applied what the stream held once appends resumed.
            let deadline = Instant::now() + Duration::from_secs(120);
            if let Ok(summary) = monitor.stream_state().await {
                let wanted = summary.last_seq;
                while Instant::now() < deadline {
                    let mut all = true;
                    for name in target::projectors() {
                        match sampler::projector_ledger(monitor.client(), name).await {
                            Ok(l) if l.visible_seq >= wanted => {}
                            _ => all = false,
                        }
                    }
                    if all {
                        event.caught_up_secs = Some(killed.elapsed().as_secs_f64());
                        event.caught_up_to_seq = Some(wanted);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        // Partitions that moved away move back once their node is up again: the outage
        // lasts until every partition is served and none has moved for a while.
        if target.node_pids().len() > 1 {
            wait_partitions_settled(monitor, Duration::from_secs(120)).await;
        }
        // Written-to-readable is measured by instances whose checks end up to `wait` later:
        // recovered once it has been under the goal for a few seconds (at most a minute).
        let goal_ms = visibility_goal.as_secs_f64() * 1000.0;
        let settle_deadline = Instant::now() + Duration::from_secs(60);
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = Instant::now();
            let back = recorder.visibility_back_secs(killed, now, goal_ms);
            let steady = back.is_some_and(|b| (now - killed).as_secs_f64() - b >= 3.0);
            if steady || now >= settle_deadline {
                break;
            }
        }
        recorder.outage(false);
        let now = Instant::now();
        event.visibility_max_ms = recorder.visibility_max_ms(killed, now);
        event.ack_gap_max_ms = Some(recorder.longest_ack_gap_ms(killed, now));
        event.visibility_back_secs =
            recorder.visibility_back_secs(killed, now, visibility_goal.as_secs_f64() * 1000.0);
        if clustered {
            let after = stream_leader(monitor).await;
            if let (Some(before), Some(after)) = (&leader_before, &after)
                && before != after
            {
                event.leader_change = Some((before.clone(), after.clone()));
            }
        }
        if node {
            eprintln!(
                "[chaos] {victim}: its partitions served by the others after {}, it served again after {}, longest written-to-readable {} ms",
                secs(event.taken_over_secs),
                secs(event.returned_secs),
                event
                    .visibility_max_ms
                    .map_or_else(|| "?".to_owned(), |v| format!("{v:.0}"))
            );
        }
        eprintln!(
            "[chaos] {action} {victim}: back after {:.2}s, appends resumed after {}, longest gap without acks {:.0} ms, replica current after {}, projectors caught up after {}, visibility under goal after {}",
            event.down_secs,
            secs(event.appends_resumed_secs),
            event.ack_gap_max_ms.unwrap_or_default(),
            secs(event.replica_caught_up_secs),
            secs(event.caught_up_secs),
            secs(event.visibility_back_secs),
        );
        events.push(event);
        held = Some(hold);
    }
    events
}

/// SIGTERM each NATS node in turn, start it again and wait until its replica is current;
/// then each memory node, waiting until it serves again. Sets `slowest` to the longest
/// replica catch-up.
async fn rolling_restart(
    target: &mut Target,
    monitor: &Bus,
    slowest: &mut Option<f64>,
) -> Result<(), FleetError> {
    for name in target.nats_names() {
        let began = Instant::now();
        eprintln!("[chaos] rolling restart: {name}");
        target.stop_nats(&name).await;
        target.restart(&name).await?;
        let took = wait_replica_current(monitor, &name, Duration::from_secs(120))
            .await
            .ok_or_else(|| {
                FleetError::Setup(format!("{name} never caught up after its restart"))
            })?;
        let _ = took;
        let whole = began.elapsed().as_secs_f64();
        *slowest = Some(slowest.map_or(whole, |s: f64| s.max(whole)));
    }
    for (name, pid) in target.node_pids() {
        eprintln!("[chaos] rolling restart: {name}");
        target.stop_node(&name);
        // Gone from the members first, so that "back" is its new life, not its old one. A
        // stopped node is started again at once, so its new pid also says it left (a busy
        // monitor may never see the gap between the two lives).
        let gone = Instant::now() + Duration::from_secs(60);
        while Instant::now() < gone {
            if target
                .node_pids()
                .into_iter()
                .any(|(n, p)| n == name && p != pid)
            {
                break;
            }
            let still = engram_node::ownership::live_members(
                monitor,
                &engram_node::NodeConfig::default().bucket,
            )
            .await
            .unwrap_or_default()
            .into_iter()
            .any(|m| m.node == name && !m.serving.is_empty());
            if !still {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        wait_node_back(monitor, &name, Duration::from_secs(300))
            .await
            .ok_or_else(|| {
                FleetError::Setup(format!("{name} never served again after its restart"))
            })?;
    }
    Ok(())
}

fn secs(value: Option<f64>) -> String {
    value.map_or_else(|| "never".to_owned(), |s| format!("{s:.2}s"))
}

/// A line every five seconds while the load runs.
async fn progress(
    recorder: Arc<Recorder>,
    samples: Samples,
    start: Instant,
    load: Arc<span::LoadSpan>,
) {
    let mut tick = tokio::time::interval_at(start + Duration::from_secs(5), Duration::from_secs(5));
    let mut last = 0usize;
    loop {
        let now = tick.tick().await;
        let acked = recorder.acked_count();
        let lag = samples
            .last()
            .map(|s| {
                target::projectors()
                    .iter()
                    .map(|p| {
                        format!(
                            "{p} {}",
                            s.lag(p).map_or_else(|| "?".to_owned(), |l| l.to_string())
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let (end, held) = load.end();
        let phase = if held && now > end {
            "  (held open until a fault's recovery is timed)"
        } else if now > end {
            "  (finishing read-your-writes checks)"
        } else {
            ""
        };
        eprintln!(
            "[load] {:>4.0}s of {:.0}s  acked {acked} ({:.0}/s)  lag: {lag}{phase}",
            (now - start).as_secs_f64(),
            (end - start).as_secs_f64(),
            (acked - last) as f64 / 5.0,
        );
        last = acked;
    }
}

/// Second-by-second series from the recorder and the sampler.
fn timeline(
    recorded: &record::Recorded,
    samples: &[sampler::Sample],
    chaos: &[ChaosEvent],
) -> Timeline {
    let seconds = recorded
        .per_second
        .len()
        .max(recorded.appends_per_second.len())
        .max(
            samples
                .iter()
                .map(|s| s.at_secs as usize + 1)
                .max()
                .unwrap_or(0),
        );
    let mut t = Timeline {
        t_secs: (0..seconds).map(|s| s as f64).collect(),
        ..Timeline::default()
    };
    let at = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0) as f64;
    for i in 0..seconds {
        t.appends_per_sec.push(at(&recorded.appends_per_second, i));
        t.queries_per_sec.push(at(&recorded.queries_per_second, i));
        let figures = recorded.per_second.get(i).cloned().unwrap_or_default();
        t.ack_p50_ms.push(figures.ack_p50);
        t.ack_p99_ms.push(figures.ack_p99);
        t.visibility_p50_ms.push(figures.visibility_p50);
        t.visibility_p99_ms.push(figures.visibility_p99);
    }
    let mut by_second: Vec<Option<&sampler::Sample>> = vec![None; seconds];
    for sample in samples {
        if let Some(slot) = by_second.get_mut(sample.at_secs as usize) {
            *slot = Some(sample);
        }
    }
    for name in target::projectors() {
        t.lag_events.insert(
            name.to_owned(),
            by_second
                .iter()
                .map(|s| s.and_then(|s| s.lag(name)))
                .collect(),
        );
    }
    let processes: std::collections::BTreeSet<String> = samples
        .iter()
        .flat_map(|s| s.processes.keys().cloned())
        .collect();
    for process in processes {
        let reading =
            |s: Option<&sampler::Sample>| s.and_then(|s| s.processes.get(&process).copied());
        t.cpu_percent.insert(
            process.clone(),
            by_second
                .iter()
                .map(|s| reading(*s).and_then(|r| r.0))
                .collect(),
        );
        t.rss_mib.insert(
            process.clone(),
            by_second
                .iter()
                .map(|s| reading(*s).and_then(|r| r.1))
                .collect(),
        );
    }
    for event in chaos {
        t.markers
            .push((event.at_secs, format!("kill -9 {}", event.victim)));
    }
    t
}

/// Connects `n` buses: the instances share them round robin, as agents in one process would.
async fn connect_pool(url: &str, n: usize, name: &str) -> Result<Vec<Bus>, BusError> {
    try_join_all((0..n).map(|i| {
        Bus::connect(BusConfig {
            url: url.to_owned(),
            client_name: format!("{name}-{i}"),
            ..BusConfig::default()
        })
    }))
    .await
}

async fn close_pool(pool: &[Bus]) {
    for bus in pool {
        let _ = tokio::time::timeout(Duration::from_secs(5), bus.client().drain()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scenario_file_sets_what_it_names_and_keeps_the_defaults_for_the_rest() {
        let config: FleetConfig = toml::from_str(
            "instances = 1000\nduration = \"5m\"\nembedder = \"client\"\nchaos = true\nallow_overload = true\n",
        )
        .unwrap();
        assert_eq!(config.instances, 1000);
        assert_eq!(config.duration, Duration::from_secs(300));
        assert_eq!(config.embedder, EmbedderChoice::Client);
        assert!(config.chaos && config.allow_overload);
        assert!(!FleetConfig::default().allow_overload);
        assert_eq!(config.rate, FleetConfig::default().rate);
        config.validate().unwrap();

        let typo = toml::from_str::<FleetConfig>("instanses = 10\n").unwrap_err();
        assert!(typo.to_string().contains("instanses"), "{typo}");
        let too_many = FleetConfig {
            instances: 1001,
            ..FleetConfig::default()
        };
        assert!(
            matches!(too_many.validate(), Err(FleetError::Invalid(m)) if m.contains("1 to 1000"))
        );
    }
}

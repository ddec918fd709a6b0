//! Runs one phase: N simulated agents in closed loops, each awaiting its own ack before it
//! sends again, with an unmeasured warm-up and a stop rule that always ends.
//!
//! The driver knows nothing of what is sent: a [`Sender`] prepares a message (untimed, so
//! its cost shows in throughput but not in ack latency) and sends it (timed). Both phases of
//! the benchmark run through this same loop, so their figures differ only by what they send.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

/// When a phase stops measuring.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StopRule {
    /// Every agent sends until this much measured time has passed.
    Duration(Duration),
    /// Every agent makes exactly this many measured attempts, unless `time_limit` (counted
    /// from the end of warm-up) runs out first.
    EventsPerAgent { events: u64, time_limit: Duration },
}

/// How long an operation may still run after the measured window has closed. It exceeds the
/// ack timeout plus a retry, so that only a stuck server ever hits it.
const GRACE: Duration = Duration::from_secs(15);

/// The time frame of one phase, shared by all its agents.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    started: Instant,
    /// Operations that start before this are warm-up: sent, but not measured.
    measure_from: Instant,
    /// No operation starts at or after this.
    stop_at: Instant,
    /// Measured attempts per agent, in count mode.
    events_per_agent: Option<u64>,
    /// Nothing waits past this, whatever it waits for: the bound that makes a phase end.
    hard_deadline: Instant,
}

impl Clock {
    pub(crate) fn start(warmup: Duration, rule: StopRule) -> Self {
        let started = Instant::now();
        let measure_from = started + warmup;
        let (stop_at, events_per_agent) = match rule {
            StopRule::Duration(d) => (measure_from + d, None),
            StopRule::EventsPerAgent { events, time_limit } => {
                (measure_from + time_limit, Some(events))
            }
        };
        Self {
            started,
            measure_from,
            stop_at,
            events_per_agent,
            hard_deadline: stop_at + GRACE,
        }
    }
}

/// The result of one send.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Acknowledged by the stream; `bytes` is the payload size.
    Stored { bytes: usize, duplicate: bool },
    /// Not stored (or not known to be); `kind` is a short label for grouping.
    Failed { kind: &'static str, message: String },
}

/// What one phase sends.
pub(crate) trait Sender: Send + Sync + 'static {
    type Item: Send;

    /// Makes the next message. `measured` says whether it falls in the measured window.
    fn prepare(&mut self, measured: bool) -> Self::Item;

    /// Sends it and waits for the ack. This is the part whose latency is recorded.
    fn send(&self, item: Self::Item) -> impl Future<Output = Outcome> + Send;
}

/// Counters the progress line reads while a phase runs; they include warm-up.
#[derive(Debug, Default)]
struct Progress {
    completed: AtomicU64,
    errors: AtomicU64,
}

/// One agent's measured figures.
#[derive(Debug)]
struct AgentStats {
    latency_us: Histogram<u64>,
    attempts: u64,
    stored: u64,
    duplicates: u64,
    bytes: u64,
    errors: BTreeMap<&'static str, u64>,
    first_error: Option<String>,
    last_completion: Option<Instant>,
}

/// Highest latency the histograms track; anything slower is clamped to it.
const MAX_LATENCY_US: u64 = 120_000_000;

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("static histogram bounds are valid")
}

impl AgentStats {
    fn new() -> Self {
        Self {
            latency_us: new_histogram(),
            attempts: 0,
            stored: 0,
            duplicates: 0,
            bytes: 0,
            errors: BTreeMap::new(),
            first_error: None,
            last_completion: None,
        }
    }

    fn record(&mut self, outcome: Outcome, latency: Duration, completed: Instant) {
        self.attempts += 1;
        self.last_completion = Some(completed);
        match outcome {
            Outcome::Stored { bytes, duplicate } => {
                let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
                self.latency_us.saturating_record(micros.max(1));
                self.stored += 1;
                self.duplicates += u64::from(duplicate);
                self.bytes += bytes as u64;
            }
            Outcome::Failed { kind, message } => {
                *self.errors.entry(kind).or_default() += 1;
                self.first_error.get_or_insert(message);
            }
        }
    }
}

/// The measured figures of one phase, merged over its agents.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseResult {
    pub name: String,
    /// Attempts that were acknowledged (duplicates included).
    pub events: u64,
    pub duplicates: u64,
    pub errors: u64,
    pub errors_by_kind: BTreeMap<String, u64>,
    pub first_error: Option<String>,
    /// Payload bytes acknowledged.
    pub bytes: u64,
    /// From the end of warm-up to the last measured completion.
    pub measured_secs: f64,
    pub events_per_sec: f64,
    /// Payload megabytes (10^6 bytes) per second.
    pub mb_per_sec: f64,
    /// Ack latency of acknowledged appends, in milliseconds.
    pub latency_ms: LatencySummary,
    /// True if the run was interrupted or hit its time limit before the stop rule was met.
    pub cut_short: bool,
    /// CPU microseconds this process (the agents) spent per acknowledged event.
    pub client_cpu_us_per_event: Option<f64>,
    /// CPU microseconds the local nats-server spent per acknowledged event, when its pid is known.
    pub server_cpu_us_per_event: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LatencySummary {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl LatencySummary {
    fn from_histogram(h: &Histogram<u64>) -> Self {
        let ms = |us: u64| us as f64 / 1_000.0;
        Self {
            mean: h.mean() / 1_000.0,
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        }
    }
}

/// Runs every sender in its own task until the clock's stop rule, an interrupt (`stop`
/// turning true) or the hard deadline, and returns the senders, in order, with the figures.
pub(crate) async fn run_phase<S: Sender>(
    name: &str,
    senders: Vec<S>,
    clock: Clock,
    stop: watch::Receiver<bool>,
    server_pid: Option<u32>,
) -> (Vec<S>, PhaseResult) {
    let progress = Arc::new(Progress::default());
    // CPU is sampled when measuring starts and when the last agent is done, the same window
    // the events are counted in (give or take the final in-flight acks).
    let cpu_start = tokio::spawn(async move {
        tokio::time::sleep_until(clock.measure_from).await;
        (crate::cpu::own(), server_pid.and_then(crate::cpu::of_pid))
    });
    let reporter = tokio::spawn(report_progress(name.to_owned(), progress.clone(), clock));
    let tasks: Vec<_> = senders
        .into_iter()
        .map(|sender| tokio::spawn(drive(sender, clock, progress.clone(), stop.clone())))
        .collect();
    let mut senders = Vec::with_capacity(tasks.len());
    let mut stats = Vec::with_capacity(tasks.len());
    for task in tasks {
        match task.await {
            Ok((sender, agent)) => {
                senders.push(sender);
                stats.push(agent);
            }
            // A panicking agent is a bug in this crate; hiding it would skew the figures.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("agent task of phase {name} was cancelled: {e}"),
        }
    }
    reporter.abort();
    let interrupted = *stop.borrow();
    let mut result = merge(name, &stats, clock, interrupted);
    if let Ok((client_start, server_start)) = cpu_start.await {
        let per_event = |cpu: Duration| {
            (result.events > 0).then(|| cpu.as_secs_f64() * 1e6 / result.events as f64)
        };
        result.client_cpu_us_per_event = per_event(crate::cpu::own().saturating_sub(client_start));
        result.server_cpu_us_per_event = server_start
            .zip(server_pid.and_then(crate::cpu::of_pid))
            .and_then(|(start, end)| per_event(end.saturating_sub(start)));
    }
    (senders, result)
}

async fn drive<S: Sender>(
    mut sender: S,
    clock: Clock,
    progress: Arc<Progress>,
    stop: watch::Receiver<bool>,
) -> (S, AgentStats) {
    let mut stats = AgentStats::new();
    loop {
        let now = Instant::now();
        let measured = now >= clock.measure_from;
        let count_reached = clock
            .events_per_agent
            .is_some_and(|n| measured && stats.attempts >= n);
        if *stop.borrow() || now >= clock.stop_at || count_reached {
            break;
        }
        let item = sender.prepare(measured);
        let started = Instant::now();
        let outcome = tokio::time::timeout_at(clock.hard_deadline, sender.send(item))
            .await
            .unwrap_or_else(|_| Outcome::Failed {
                kind: "deadline",
                message: "no ack before the phase's hard deadline".to_owned(),
            });
        let completed = Instant::now();
        progress.completed.fetch_add(1, Ordering::Relaxed);
        if matches!(outcome, Outcome::Failed { .. }) {
            progress.errors.fetch_add(1, Ordering::Relaxed);
        }
        if measured {
            stats.record(outcome, completed - started, completed);
        }
    }
    (sender, stats)
}

fn merge(name: &str, stats: &[AgentStats], clock: Clock, interrupted: bool) -> PhaseResult {
    let mut latency = new_histogram();
    let mut errors_by_kind = BTreeMap::new();
    let (mut events, mut duplicates, mut bytes) = (0, 0, 0);
    let mut first_error = None;
    let mut last_completion = clock.measure_from;
    let mut cut_short = interrupted;
    for agent in stats {
        latency
            .add(&agent.latency_us)
            .expect("histograms share their bounds");
        events += agent.stored;
        duplicates += agent.duplicates;
        bytes += agent.bytes;
        for (kind, n) in &agent.errors {
            *errors_by_kind.entry((*kind).to_owned()).or_default() += n;
        }
        if first_error.is_none() {
            first_error.clone_from(&agent.first_error);
        }
        if let Some(t) = agent.last_completion {
            last_completion = last_completion.max(t);
        }
        if let Some(n) = clock.events_per_agent {
            cut_short |= agent.attempts < n;
        }
    }
    let measured_secs = (last_completion - clock.measure_from).as_secs_f64();
    let per_sec = |x: f64| {
        if measured_secs > 0.0 {
            x / measured_secs
        } else {
            0.0
        }
    };
    PhaseResult {
        name: name.to_owned(),
        events,
        duplicates,
        errors: errors_by_kind.values().sum(),
        errors_by_kind,
        first_error,
        bytes,
        measured_secs,
        events_per_sec: per_sec(events as f64),
        mb_per_sec: per_sec(bytes as f64 / 1e6),
        latency_ms: LatencySummary::from_histogram(&latency),
        cut_short,
        client_cpu_us_per_event: None,
        server_cpu_us_per_event: None,
    }
}

/// Prints one line a second on stderr, so a long run shows it is alive and how fast it goes.
async fn report_progress(name: String, progress: Arc<Progress>, clock: Clock) {
    let mut tick = tokio::time::interval_at(
        clock.started + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    let mut last = 0;
    loop {
        let now = tick.tick().await;
        let completed = progress.completed.load(Ordering::Relaxed);
        let errors = progress.errors.load(Ordering::Relaxed);
        // Labelled by where the second that just ended began.
        let window_start = now - Duration::from_secs(1);
        let state = if window_start < clock.measure_from {
            "warming up"
        } else if window_start < clock.stop_at {
            "measuring"
        } else {
            "finishing"
        };
        eprintln!(
            "[{name:>6}] {:>4.0}s  {state:<10}  {:>8} acks/s  total {:>9}  errors {errors}",
            (now - clock.started).as_secs_f64(),
            completed - last,
            completed,
        );
        last = completed;
    }
}

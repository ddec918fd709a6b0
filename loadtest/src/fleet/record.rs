//! What the simulated instances measured and acknowledged, shared by all of them.
//!
//! Latencies go into HDR histograms twice: once for the whole run and once for the second
//! they completed in, which is what the timeline and charts are drawn from. The ledger keeps
//! every acknowledged append, for the end-of-run verification.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::time::Instant;

/// Microsecond histograms up to ten minutes, three significant digits.
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("static bounds are valid")
}

/// Latency figures in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Latency {
    pub(crate) fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |us: u64| us as f64 / 1_000.0;
        Self {
            count: h.len(),
            mean: h.mean() / 1_000.0,
            p50: ms(h.value_at_quantile(0.50)),
            p95: ms(h.value_at_quantile(0.95)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        }
    }
}

/// The kinds of latency a run records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Metric {
    /// Append acknowledged, open loop: how late its step started (behind the instance's
    /// earlier steps) plus the time from send to ack.
    Ack,
    /// Append acknowledged, from when it was sent: the service time alone.
    AckService,
    /// Ack until the writer's read-your-writes retrieve returned the write.
    Visibility,
    /// Ack until a keyword-only read-your-writes retrieve returned the write: measured
    /// (before the hybrid one) only where the server embeds, since a keyword search does
    /// not wait for the embedding the hybrid one does.
    KeywordVisibility,
    /// A retrieve without a consistency token.
    Query,
    /// `build_context` with the instance's latest token.
    Context,
    /// A facts query with the token of the fact just asserted.
    Facts,
    /// A skills query with the token of the skill just recorded.
    Skills,
    /// A successor instance replaying its scopes (its private and its team's) from the
    /// start: the ground-truth check, and the physical reference of [`Metric::Bootstrap`].
    Takeover,
    /// A successor instance bootstrapping the same scopes: snapshot slices, then the tail.
    Bootstrap,
    /// One query request that was answered (any query operation), from its send: the
    /// service time, without the refusals and pauses before it that the per-operation
    /// figures include.
    Answered,
    /// One query request refused `busy`, from its send to the refusal.
    Refused,
}

impl Metric {
    const ALL: [Metric; 12] = [
        Metric::Ack,
        Metric::AckService,
        Metric::Visibility,
        Metric::KeywordVisibility,
        Metric::Query,
        Metric::Context,
        Metric::Facts,
        Metric::Skills,
        Metric::Takeover,
        Metric::Bootstrap,
        Metric::Answered,
        Metric::Refused,
    ];

    fn is_query(self) -> bool {
        matches!(
            self,
            Metric::Visibility
                | Metric::KeywordVisibility
                | Metric::Query
                | Metric::Context
                | Metric::Facts
                | Metric::Skills
        )
    }
}

/// The read-your-writes checks a step makes of its own write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Check {
    /// A text memory, recalled from both indexes.
    Recall,
    /// A fact assertion, in its history.
    Fact,
    /// A skill record, in the skill registry.
    Skill,
}

impl Check {
    fn name(self) -> &'static str {
        match self {
            Check::Recall => "recall",
            Check::Fact => "fact",
            Check::Skill => "skill",
        }
    }
}

/// What became of the read-your-writes checks of one kind. `due` equals the sum of the others
/// once the run is over: a check that vanished without an outcome would break that.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CheckOutcomes {
    /// Writes chosen for the check.
    pub due: u64,
    /// The write was found where it belongs.
    pub passed: u64,
    /// The answer came without the write: a violation.
    pub invisible: u64,
    /// No answer came before the run gave up, or the request was refused.
    pub unchecked: u64,
    /// Skills only: a later record of the same skill had superseded the write by the time it
    /// was read, so only its having been applied in order was checked.
    pub superseded: u64,
}

impl CheckOutcomes {
    pub fn settled(&self) -> u64 {
        self.passed + self.invisible + self.unchecked + self.superseded
    }
}

/// One acknowledged append.
#[derive(Clone, Debug)]
pub struct Acked {
    pub event_id: String,
    pub seq: u64,
    /// Encoded size, for the raw reference to publish the same bytes.
    pub bytes: u32,
}

/// What the successors' bootstraps did (`Client::bootstrap` of their scopes).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Bootstraps {
    /// Bootstraps that completed.
    pub completed: u64,
    /// Of those, the ones where at least one read model came from a snapshot.
    pub from_snapshot: u64,
    /// Tail events they replayed after their snapshots (those from a snapshot).
    pub tail_events_from_snapshot: u64,
    /// Events replayed by the bootstraps that found no snapshot: their scopes' whole history.
    pub events_without_snapshot: u64,
    /// Newer snapshots the bootstraps found but could not use (they did not check).
    pub skipped_snapshots: u64,
    /// Bootstraps that never completed before the run gave up, or that failed with an
    /// error no retry can fix; their errors are under the `bootstrap` operation.
    pub failed: u64,
    /// Bootstraps refused because retention removed history no snapshot covers: what a
    /// bootstrap must do rather than load a gap (the successor's replay still checks its
    /// scopes). Not a failure of the system under test.
    pub refused_tail_gone: u64,
}

/// Counters of things that went wrong, by kind.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Problems {
    /// Requests made, by operation (append, recall, facts, skills, context, query, takeover);
    /// each try of a retried request counts.
    pub attempts: BTreeMap<String, u64>,
    /// Failed requests that retrying cannot fix (refused as invalid, failed inside the
    /// service, a reply that does not decode), by `operation:error kind`. Any fails the run.
    pub hard_errors: BTreeMap<String, u64>,
    /// Failed requests that may succeed later (unavailable, timed out; a refusal `busy` is
    /// counted in `refused`), outside chaos outages, by `operation:error kind`. More than
    /// the error budget of an operation's attempts fails the run.
    pub errors: BTreeMap<String, u64>,
    /// Retryable failures of requests that overlapped a chaos outage (sent or failed between
    /// the kill and every projector having caught up): expected, shown, and not held against
    /// the budget.
    pub outage_errors: BTreeMap<String, u64>,
    /// Requests refused `busy` (at the service's in-flight bound), by operation: the
    /// designed answer to overload, asked again after a pause, so neither an error nor
    /// held against the budget. Their time to the refusal is `latency_ms.refused`.
    #[serde(default)]
    pub refused: BTreeMap<String, u64>,
    /// The first message of each error kind, to say what happened.
    pub first_errors: BTreeMap<String, String>,
    /// Read-your-writes retrieves that returned results without the write.
    pub invisible: u64,
    /// Up to ten of those, described.
    pub invisible_examples: Vec<String>,
    /// Read-your-writes waits that timed out (the retrieve was retried until it succeeded
    /// or the run ended).
    pub visibility_timeouts: u64,
    /// Writes whose read-your-writes check never got an answer before the run ended, or whose
    /// request was refused, and takeovers whose replay never succeeded.
    pub unchecked: u64,
    /// Every read-your-writes check, by kind (recall, fact, skill), from due to outcome.
    pub checks: BTreeMap<String, CheckOutcomes>,
    /// Steps due before the end of the load, over all instances; each ran or was missed.
    pub steps_due: u64,
    /// Steps that ran; each appended or recorded an append error.
    pub steps_run: u64,
    /// Events a successor did not find when replaying its predecessor's private scope.
    pub takeover_missing: u64,
    /// Steps due before the end of the load that never started: their instance was still
    /// busy with earlier steps (the system did not keep up with the target rate).
    pub missed_steps: u64,
}

/// A request as counted by [`Recorder::attempt`]: the outage epoch it started in.
#[derive(Clone, Copy, Debug)]
#[must_use]
pub(crate) struct Attempt {
    epoch: u64,
}

pub(crate) struct Recorder {
    started: Instant,
    /// Set by chaos mode from a kill until the system has recovered.
    /// Counts outage starts and ends: odd while one lasts. A request is judged by the
    /// epochs it started and failed in, so one sent during an outage and failing just after
    /// it (a reply that waited on the dead server) is still the outage's.
    outage: AtomicU64,
    inner: Mutex<Inner>,
}

struct Inner {
    total: BTreeMap<Metric, Histogram<u64>>,
    /// Per second since the start: histograms of the metrics drawn over time.
    per_second: Vec<BTreeMap<Metric, Histogram<u64>>>,
    appends_per_second: Vec<u64>,
    queries_per_second: Vec<u64>,
    ledger: Vec<Acked>,
    duplicates_acked: u64,
    problems: Problems,
    takeovers: u64,
    takeover_events_checked: u64,
    bootstraps: Bootstraps,
    /// When each ledger entry was acknowledged, in order of recording.
    ack_times: Vec<Instant>,
}

impl Recorder {
    pub(crate) fn new(started: Instant) -> Self {
        Self {
            started,
            outage: AtomicU64::new(0),
            inner: Mutex::new(Inner {
                total: Metric::ALL.iter().map(|&m| (m, histogram())).collect(),
                per_second: Vec::new(),
                appends_per_second: Vec::new(),
                queries_per_second: Vec::new(),
                ledger: Vec::new(),
                duplicates_acked: 0,
                problems: Problems::default(),
                takeovers: 0,
                takeover_events_checked: 0,
                bootstraps: Bootstraps::default(),
                ack_times: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn second(&self, at: Instant) -> usize {
        at.saturating_duration_since(self.started).as_secs() as usize
    }

    /// Records a latency that ended at `at`.
    pub(crate) fn latency(&self, metric: Metric, took: Duration, at: Instant) {
        let us = (took.as_micros() as u64).clamp(1, 600_000_000);
        let second = self.second(at);
        let mut inner = self.lock();
        inner
            .total
            .get_mut(&metric)
            .expect("every metric has a histogram")
            .record(us)
            .expect("clamped into bounds");
        if matches!(metric, Metric::Ack | Metric::Visibility) {
            while inner.per_second.len() <= second {
                inner.per_second.push(BTreeMap::new());
            }
            inner.per_second[second]
                .entry(metric)
                .or_insert_with(histogram)
                .record(us)
                .expect("clamped into bounds");
        }
        if metric.is_query() {
            bump(&mut inner.queries_per_second, second);
        }
    }

    pub(crate) fn acked(&self, entry: Acked, duplicate: bool, at: Instant) {
        let second = self.second(at);
        let mut inner = self.lock();
        bump(&mut inner.appends_per_second, second);
        if duplicate {
            // The SDK retried with the same id and the stream had it already: stored once,
            // counted once. Reported to show retries happened.
            inner.duplicates_acked += 1;
        }
        inner.ledger.push(entry);
        inner.ack_times.push(at);
    }

    /// Marks the start (true) or end (false) of a chaos outage.
    pub(crate) fn outage(&self, on: bool) {
        let epoch = self.outage.load(Ordering::SeqCst);
        if (epoch % 2 == 1) != on {
            self.outage.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Counts a request about to be made; the answer is passed to [`Recorder::error`] if it
    /// fails.
    pub(crate) fn attempt(&self, operation: &str) -> Attempt {
        *self
            .lock()
            .problems
            .attempts
            .entry(operation.to_owned())
            .or_default() += 1;
        Attempt {
            epoch: self.outage.load(Ordering::SeqCst),
        }
    }

    /// Records a request of `operation` refused `busy`, `took` after it was sent.
    pub(crate) fn refused(&self, operation: &str, took: Duration, at: Instant) {
        self.refused_in(operation);
        self.latency(Metric::Refused, took, at);
    }

    /// Counts a refusal `busy` inside a compound operation (a bootstrap's queries), whose
    /// own time to the refusal is not seen.
    pub(crate) fn refused_in(&self, operation: &str) {
        *self
            .lock()
            .problems
            .refused
            .entry(operation.to_owned())
            .or_default() += 1;
    }

    /// Counts a failed request; `retryable` says whether the same request may succeed later.
    pub(crate) fn error(
        &self,
        attempt: Attempt,
        operation: &str,
        kind: &str,
        retryable: bool,
        message: &str,
    ) {
        let key = format!("{operation}:{kind}");
        let now = self.outage.load(Ordering::SeqCst);
        let in_outage = attempt.epoch % 2 == 1 || now != attempt.epoch;
        let mut inner = self.lock();
        let problems = &mut inner.problems;
        let counts = if !retryable {
            &mut problems.hard_errors
        } else if in_outage {
            &mut problems.outage_errors
        } else {
            &mut problems.errors
        };
        *counts.entry(key.clone()).or_default() += 1;
        // When it happened, so that one outside an outage can be placed on the timeline.
        let at = Instant::now()
            .saturating_duration_since(self.started)
            .as_secs_f64();
        problems
            .first_errors
            .entry(key)
            .or_insert_with(|| format!("at {at:.1}s: {message}"));
    }

    /// A step was due before the end of the load.
    pub(crate) fn steps_due(&self, steps: u64) {
        self.lock().problems.steps_due += steps;
    }

    pub(crate) fn step_run(&self) {
        self.lock().problems.steps_run += 1;
    }

    /// A write was chosen for a read-your-writes check.
    pub(crate) fn check_due(&self, check: Check) {
        self.outcomes(check, |o| o.due += 1);
    }

    pub(crate) fn check_passed(&self, check: Check) {
        self.outcomes(check, |o| o.passed += 1);
    }

    pub(crate) fn check_superseded(&self, check: Check) {
        self.outcomes(check, |o| o.superseded += 1);
    }

    fn outcomes(&self, check: Check, f: impl FnOnce(&mut CheckOutcomes)) {
        f(self
            .lock()
            .problems
            .checks
            .entry(check.name().to_owned())
            .or_default());
    }

    /// A check's answer came without the write.
    pub(crate) fn invisible(&self, check: Check, example: String) {
        self.outcomes(check, |o| o.invisible += 1);
        let mut inner = self.lock();
        inner.problems.invisible += 1;
        if inner.problems.invisible_examples.len() < 10 {
            inner.problems.invisible_examples.push(example);
        }
    }

    pub(crate) fn missed(&self, steps: u64) {
        self.lock().problems.missed_steps += steps;
    }

    pub(crate) fn visibility_timeout(&self) {
        self.lock().problems.visibility_timeouts += 1;
    }

    /// A check (or a takeover, with `None`) that never got a usable answer.
    pub(crate) fn unchecked(&self, check: Option<Check>) {
        if let Some(check) = check {
            self.outcomes(check, |o| o.unchecked += 1);
        }
        self.lock().problems.unchecked += 1;
    }

    pub(crate) fn takeover(&self, checked: u64, missing: u64) {
        let mut inner = self.lock();
        inner.takeovers += 1;
        inner.takeover_events_checked += checked;
        inner.problems.takeover_missing += missing;
    }

    /// A successor's bootstrap completed: whether any model came from a snapshot, the tail
    /// events it replayed, and the newer snapshots it skipped.
    pub(crate) fn bootstrapped(&self, from_snapshot: bool, replayed: u64, skipped: u64) {
        let mut inner = self.lock();
        let b = &mut inner.bootstraps;
        b.completed += 1;
        b.skipped_snapshots += skipped;
        if from_snapshot {
            b.from_snapshot += 1;
            b.tail_events_from_snapshot += replayed;
        } else {
            b.events_without_snapshot += replayed;
        }
    }

    pub(crate) fn bootstrap_failed(&self) {
        self.lock().bootstraps.failed += 1;
    }

    pub(crate) fn bootstrap_refused_tail_gone(&self) {
        self.lock().bootstraps.refused_tail_gone += 1;
    }

    /// When the first append acknowledged at or after `at` was, if any yet.
    pub(crate) fn first_ack_after(&self, at: Instant) -> Option<Instant> {
        self.lock()
            .ack_times
            .iter()
            .rev()
            .take_while(|t| **t >= at)
            .last()
            .copied()
    }

    /// Appends acknowledged at or after `from` and before `to`.
    pub(crate) fn acks_between(&self, from: Instant, to: Instant) -> u64 {
        self.lock()
            .ack_times
            .iter()
            .filter(|t| **t >= from && **t < to)
            .count() as u64
    }

    /// Acknowledged appends so far, for progress lines.
    /// The longest written-to-readable time recorded in the seconds from `from` to `to`.
    pub(crate) fn visibility_max_ms(&self, from: Instant, to: Instant) -> Option<f64> {
        let (first, last) = (self.second(from), self.second(to));
        let inner = self.lock();
        inner
            .per_second
            .iter()
            .enumerate()
            .filter(|(s, _)| (first..=last).contains(s))
            .filter_map(|(_, metrics)| metrics.get(&Metric::Visibility))
            .filter(|h| !h.is_empty())
            .map(|h| h.max() as f64 / 1000.0)
            .reduce(f64::max)
    }

    /// The longest time from `from` to `to` without an acknowledged append: an outage's
    /// gap as an appending client saw it.
    pub(crate) fn longest_ack_gap_ms(&self, from: Instant, to: Instant) -> f64 {
        let mut times: Vec<Instant> = self
            .lock()
            .ack_times
            .iter()
            .copied()
            .filter(|t| *t >= from && *t <= to)
            .collect();
        times.push(from);
        times.push(to);
        times.sort_unstable();
        times
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1000.0)
            .fold(0.0, f64::max)
    }

    /// Seconds from `from` until written-to-readable p99 was back under `goal_ms` for good
    /// (every second with measurements from then up to `to`); `None` if it never was.
    pub(crate) fn visibility_back_secs(
        &self,
        from: Instant,
        to: Instant,
        goal_ms: f64,
    ) -> Option<f64> {
        let (first, last) = (self.second(from), self.second(to));
        let inner = self.lock();
        let p99 = |s: usize| {
            inner
                .per_second
                .get(s)
                .and_then(|m| m.get(&Metric::Visibility))
                .filter(|h| !h.is_empty())
                .map(|h| h.value_at_quantile(0.99) as f64 / 1000.0)
        };
        let mut back = None;
        for s in first..=last {
            match p99(s) {
                Some(ms) if ms > goal_ms => back = None,
                Some(_) if back.is_none() => back = Some(s),
                _ => {}
            }
        }
        back.map(|s| {
            let at = self.started + std::time::Duration::from_secs(s as u64);
            at.saturating_duration_since(from).as_secs_f64()
        })
    }

    pub(crate) fn acked_count(&self) -> usize {
        self.lock().ledger.len()
    }

    pub(crate) fn finish(&self) -> Recorded {
        let inner = self.lock();
        let per_second = inner
            .per_second
            .iter()
            .map(|m| {
                let q = |metric, quantile| {
                    m.get(&metric)
                        .filter(|h| !h.is_empty())
                        .map(|h| h.value_at_quantile(quantile) as f64 / 1_000.0)
                };
                SecondFigures {
                    ack_p50: q(Metric::Ack, 0.5),
                    ack_p99: q(Metric::Ack, 0.99),
                    visibility_p50: q(Metric::Visibility, 0.5),
                    visibility_p99: q(Metric::Visibility, 0.99),
                }
            })
            .collect();
        Recorded {
            latency: inner
                .total
                .iter()
                .map(|(&m, h)| (m, Latency::of(h)))
                .collect(),
            per_second,
            appends_per_second: inner.appends_per_second.clone(),
            queries_per_second: inner.queries_per_second.clone(),
            ledger: inner.ledger.clone(),
            duplicates_acked: inner.duplicates_acked,
            problems: inner.problems.clone(),
            takeovers: inner.takeovers,
            takeover_events_checked: inner.takeover_events_checked,
            bootstraps: inner.bootstraps.clone(),
            last_ack: inner.ack_times.iter().max().copied(),
        }
    }
}

fn bump(counts: &mut Vec<u64>, second: usize) {
    if counts.len() <= second {
        counts.resize(second + 1, 0);
    }
    counts[second] += 1;
}

#[derive(Clone, Debug, Default)]
pub(crate) struct SecondFigures {
    pub(crate) ack_p50: Option<f64>,
    pub(crate) ack_p99: Option<f64>,
    pub(crate) visibility_p50: Option<f64>,
    pub(crate) visibility_p99: Option<f64>,
}

/// Everything recorded, once the instances have stopped.
pub(crate) struct Recorded {
    pub(crate) latency: BTreeMap<Metric, Latency>,
    pub(crate) per_second: Vec<SecondFigures>,
    pub(crate) appends_per_second: Vec<u64>,
    pub(crate) queries_per_second: Vec<u64>,
    pub(crate) ledger: Vec<Acked>,
    pub(crate) duplicates_acked: u64,
    pub(crate) problems: Problems,
    pub(crate) takeovers: u64,
    pub(crate) takeover_events_checked: u64,
    pub(crate) bootstraps: Bootstraps,
    pub(crate) last_ack: Option<Instant>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_land_in_the_total_and_in_their_second() {
        let start = Instant::now();
        let recorder = Recorder::new(start);
        recorder.latency(Metric::Ack, Duration::from_millis(5), start);
        recorder.latency(
            Metric::Ack,
            Duration::from_millis(50),
            start + Duration::from_millis(2_500),
        );
        recorder.latency(
            Metric::Query,
            Duration::from_millis(7),
            start + Duration::from_millis(2_100),
        );
        let recorded = recorder.finish();
        let ack = &recorded.latency[&Metric::Ack];
        assert_eq!(ack.count, 2);
        assert!((ack.max - 50.0).abs() < 0.1, "{ack:?}");
        assert_eq!(recorded.per_second.len(), 3);
        assert!(recorded.per_second[1].ack_p50.is_none());
        assert!((recorded.per_second[2].ack_p99.unwrap() - 50.0).abs() < 0.1);
        assert_eq!(recorded.queries_per_second, vec![0, 0, 1]);
    }

    #[test]
    fn a_request_is_an_outage_error_if_an_outage_overlapped_it() {
        let recorder = Recorder::new(Instant::now());
        let before = recorder.attempt("query");
        recorder.error(before, "query", "unavailable", true, "ordinary");
        let spanning = recorder.attempt("query");
        recorder.outage(true);
        let during = recorder.attempt("query");
        recorder.error(
            spanning,
            "query",
            "unavailable",
            true,
            "failed in the outage",
        );
        recorder.outage(false);
        // Sent while the server was down, failed once it was back.
        recorder.error(during, "query", "unavailable", true, "failed just after");
        let after = recorder.attempt("query");
        recorder.error(after, "query", "unavailable", true, "ordinary again");
        let problems = recorder.finish().problems;
        assert_eq!(problems.errors["query:unavailable"], 2);
        assert_eq!(problems.outage_errors["query:unavailable"], 2);
    }
}

//! The fleet run's report: JSON for tracking, Markdown for people, SVG charts for the shape
//! of the run over time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::consolidation::{Consolidation, DocsMerge};
use super::record::{Bootstraps, Latency, Problems};
use super::reference::Reference;
use super::snapshots::ProjectorSnapshots;
use super::timeline::Timeline;
use super::verify::Verification;
use super::{FleetConfig, FleetError};
use crate::report::Machine;

#[derive(Clone, Debug, Serialize)]
pub struct FleetReport {
    pub started_at: DateTime<Utc>,
    pub config: FleetConfig,
    pub machine: Machine,
    pub nats_server_version: String,
    pub interrupted: bool,
    /// How long the load ran: `duration`, or more when a chaos fault's recovery ran past it
    /// and held the load open until it was timed (then a whole number of periods).
    #[serde(default)]
    pub load_secs: f64,
    /// From the first step to the last acknowledgement.
    pub measured_secs: f64,
    pub appends: u64,
    pub appends_per_sec: f64,
    pub target_appends_per_sec: f64,
    /// Retrieves, contexts and facts queries answered.
    pub queries: u64,
    pub queries_per_sec: f64,
    /// Appends the SDK retried after a lost ack and the stream recognised as stored.
    pub duplicate_acks: u64,
    /// By kind: ack (open loop), ack_service (from sent), visibility, query, context, facts,
    /// skills, takeover_replay, takeover_bootstrap, answered and refused (one query request
    /// each).
    pub latency_ms: BTreeMap<String, Latency>,
    pub takeovers: u64,
    pub takeover_events_checked: u64,
    /// What the successors' bootstraps did; their time is `latency_ms.takeover_bootstrap`,
    /// beside `takeover_replay`, the replay of the same scopes.
    pub bootstraps: Bootstraps,
    /// The consolidator during the run: runs, outputs, lag, cost, and what it hid.
    pub consolidation: Consolidation,
    /// The docs projector's merging of the task boards.
    pub docs_merge: DocsMerge,
    /// Per projector: snapshot cuts during the load and the one after it.
    pub snapshots: Vec<ProjectorSnapshots>,
    /// Whether the run carried the load it was asked for: the verdict beside correctness.
    pub load: LoadVerdict,
    pub problems: Problems,
    pub drain_secs: Option<f64>,
    pub drain_error: Option<String>,
    pub verification: Option<Verification>,
    pub chaos: Vec<ChaosEvent>,
    /// With memory node processes: each one's share of the work at the end.
    #[serde(default)]
    pub nodes: Vec<NodeShare>,
    pub reference: Option<Reference>,
    /// On a cluster: the same raw reference on a stream with one replica, in the same run,
    /// for what R3 costs.
    #[serde(default)]
    pub reference_r1: Option<Reference>,
    pub ratios: Option<Ratios>,
    /// Peak and mean CPU and memory per process over the run.
    pub resources: BTreeMap<String, Resources>,
    pub timeline: Timeline,
}

/// The percentage of the scheduled steps a run may miss and still count as having sustained
/// its target: a few instances still finishing their last step as the load ends.
pub const MISSED_STEPS_ALLOWED_PERCENT: u64 = 1;

/// Whether the target rate was sustained, with the figures that say how far short a run fell.
/// Judged on the steps the run reached (all that were due, unless it was interrupted): an
/// instance runs its steps in order, and those still owed when the load ends are missed.
#[derive(Clone, Debug, Serialize)]
pub struct LoadVerdict {
    /// At most [`MISSED_STEPS_ALLOWED_PERCENT`] of the steps reached were missed.
    pub sustained: bool,
    /// Steps that ran and steps missed: the steps the run reached.
    pub steps_reached: u64,
    pub steps_missed: u64,
    pub missed_percent: f64,
    pub appends_per_sec: f64,
    pub target_appends_per_sec: f64,
    /// Open-loop append latency (step lateness included) and retrieve latency, p99.
    pub ack_p99_ms: Option<f64>,
    pub retrieve_p99_ms: Option<f64>,
}

impl LoadVerdict {
    pub(crate) fn of(
        problems: &Problems,
        appends_per_sec: f64,
        target_appends_per_sec: f64,
        ack: Option<&Latency>,
        retrieve: Option<&Latency>,
    ) -> Self {
        let steps_reached = problems.steps_run + problems.missed_steps;
        let missed_percent = 100.0 * problems.missed_steps as f64 / steps_reached.max(1) as f64;
        let p99 = |l: Option<&Latency>| l.filter(|l| l.count > 0).map(|l| l.p99);
        Self {
            sustained: problems.missed_steps * 100 <= MISSED_STEPS_ALLOWED_PERCENT * steps_reached,
            steps_reached,
            steps_missed: problems.missed_steps,
            missed_percent,
            appends_per_sec,
            target_appends_per_sec,
            ack_p99_ms: p99(ack),
            retrieve_p99_ms: p99(retrieve),
        }
    }

    /// `SUSTAINED` or `NOT SUSTAINED`, with the figures.
    pub fn summary(&self) -> String {
        let ms = |label: &str, v: Option<f64>| v.map(|v| format!(", {label} p99 {v:.0} ms"));
        format!(
            "{}: {} of {} scheduled steps never ran ({:.1}%; at most {}% may), {:.1} of {:.1} appends/s{}{}",
            if self.sustained {
                "SUSTAINED"
            } else {
                "NOT SUSTAINED"
            },
            self.steps_missed,
            self.steps_reached,
            self.missed_percent,
            MISSED_STEPS_ALLOWED_PERCENT,
            self.appends_per_sec,
            self.target_appends_per_sec,
            ms("ack", self.ack_p99_ms).unwrap_or_default(),
            ms("retrieve", self.retrieve_p99_ms).unwrap_or_default(),
        )
    }
}

/// One kill and its recovery, in seconds from the kill.
#[derive(Clone, Debug, Serialize)]
pub struct ChaosEvent {
    pub victim: String,
    /// Seconds since the load started.
    pub at_secs: f64,
    /// Kill until the process was running and serving again (2 s of it is the pause before
    /// the restart).
    pub down_secs: f64,
    /// The stream's last sequence just before the kill.
    pub stream_seq_at_kill: Option<u64>,
    /// Appends acknowledged between the kill and the restart: a dead projector must not stop
    /// them.
    pub appends_while_down: u64,
    /// Kill until the first append acknowledged after it (for nats-server: after the
    /// restart, since nothing can be acknowledged while it is down).
    pub appends_resumed_secs: Option<f64>,
    /// Kill until every projector had applied the stream as it stood when appends resumed.
    pub caught_up_secs: Option<f64>,
    /// The stream's last sequence they had all applied then: past `stream_seq_at_kill` when
    /// appends went on through or after the outage.
    pub caught_up_to_seq: Option<u64>,
    /// A memory node: kill until every partition was served by the other nodes.
    #[serde(default)]
    pub taken_over_secs: Option<f64>,
    /// A memory node: kill until it served partitions again, restarted by `engram up`.
    #[serde(default)]
    pub returned_secs: Option<f64>,
    /// The longest written-to-readable time measured from the kill until the recovery was
    /// timed: the visibility gap the outage caused.
    #[serde(default)]
    pub visibility_max_ms: Option<f64>,
    /// What was done: "kill -9" (the default), "sigterm" (a rolling restart), "sigstop".
    #[serde(default)]
    pub action: Option<String>,
    /// The longest time without an acknowledged append from the fault to the recovery.
    #[serde(default)]
    pub ack_gap_max_ms: Option<f64>,
    /// A NATS server: fault until its replica of the events stream was current again.
    #[serde(default)]
    pub replica_caught_up_secs: Option<f64>,
    /// Fault until written-to-readable p99 was back under the run's goal for good.
    #[serde(default)]
    pub visibility_back_secs: Option<f64>,
    /// The events stream's leader before and after the fault, when it changed.
    #[serde(default)]
    pub leader_change: Option<(String, String)>,
    pub error: Option<String>,
}

/// One memory node process at the end of a run.
#[derive(Clone, Debug, Serialize)]
pub struct NodeShare {
    pub node: String,
    /// The partitions it served.
    pub partitions: Vec<u32>,
    /// Events its read models applied (every model's instances summed), since it started.
    pub applied_events: Option<u64>,
    /// CPU its process used since it started.
    pub cpu_secs: Option<f64>,
}

/// Engram's figures over the raw reference's, from the same run.
#[derive(Clone, Debug, Serialize)]
pub struct Ratios {
    pub appends_per_sec: f64,
    pub ack_p50: f64,
    pub ack_p99: f64,
    /// Engram's ack-to-retrievable over raw publish-to-delivered.
    pub visibility_p50: f64,
    pub visibility_p99: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Resources {
    pub cpu_percent_mean: Option<f64>,
    pub cpu_percent_max: Option<f64>,
    pub rss_mib_max: Option<f64>,
    pub rss_mib_last: Option<f64>,
}

pub(crate) fn resources(timeline: &Timeline) -> BTreeMap<String, Resources> {
    let mut out = BTreeMap::new();
    for (process, cpu) in &timeline.cpu_percent {
        let cpu: Vec<f64> = cpu.iter().flatten().copied().collect();
        let rss: Vec<f64> = timeline
            .rss_mib
            .get(process)
            .map(|r| r.iter().flatten().copied().collect())
            .unwrap_or_default();
        out.insert(
            process.clone(),
            Resources {
                cpu_percent_mean: (!cpu.is_empty())
                    .then(|| cpu.iter().sum::<f64>() / cpu.len() as f64),
                cpu_percent_max: cpu.iter().copied().reduce(f64::max),
                rss_mib_max: rss.iter().copied().reduce(f64::max),
                rss_mib_last: rss.last().copied(),
            },
        );
    }
    out
}

impl FleetReport {
    /// Acknowledged events lost or duplicated, in the stream or in any projector.
    pub fn lost(&self) -> u64 {
        self.verification.as_ref().map_or(0, |v| {
            v.lost + v.projectors.iter().map(|p| p.lost).sum::<u64>()
        })
    }

    pub fn duplicated(&self) -> u64 {
        self.verification.as_ref().map_or(0, |v| {
            v.duplicated + v.seq_mismatch + v.projectors.iter().map(|p| p.duplicated).sum::<u64>()
        })
    }

    /// Writes the writer could not see with its token, and events a successor did not find
    /// in its predecessor's scope.
    pub fn invisible(&self) -> u64 {
        self.problems.invisible + self.problems.takeover_missing
    }

    /// True if (almost) every scheduled step ran: see [`LoadVerdict`].
    pub fn sustained(&self) -> bool {
        self.load.sustained
    }

    /// The headline's verdict: `FAILED` when correctness failed; else `NOT SUSTAINED` when the
    /// target rate was not (whether or not `allow_overload` accepts that); else `PASSED`.
    pub fn verdict(&self) -> &'static str {
        if !self.passed() {
            "FAILED"
        } else if !self.sustained() {
            "NOT SUSTAINED"
        } else {
            "PASSED"
        }
    }

    /// The binary's exit code: 1 when correctness failed, 3 when only the load was not
    /// sustained and `allow_overload` is off, else 0.
    pub fn exit_code(&self) -> u8 {
        if !self.passed() {
            1
        } else if !self.sustained() && !self.config.allow_overload {
            3
        } else {
            0
        }
    }

    /// The run's two verdicts in one line, correctness first; the headline is this after the
    /// overall verdict.
    pub fn verdicts(&self) -> String {
        format!(
            "correctness {}; load {}{}",
            if self.passed() {
                "PASSED".to_owned()
            } else {
                format!("FAILED: {}", self.failures().join("; "))
            },
            self.load.summary(),
            if !self.sustained() && self.config.allow_overload {
                " (accepted: --allow-overload)"
            } else {
                ""
            }
        )
    }

    /// Query requests refused `busy`, and of how many: the service's answer to more than
    /// it holds in flight. Each operation's row times it from its first try, pauses after
    /// refusals included; `answered` times the answered try alone.
    pub fn refusals(&self) -> String {
        let refused: u64 = self.problems.refused.values().sum();
        if refused == 0 {
            return "No query request was refused busy.".to_owned();
        }
        let asked: u64 = self
            .problems
            .refused
            .keys()
            .filter_map(|op| self.problems.attempts.get(op))
            .sum();
        format!(
            "Refused busy: {refused} of {asked} requests of those operations ({}), each asked again after a pause; the operations' rows include the pauses, `answered` does not.",
            self.problems
                .refused
                .iter()
                .map(|(op, n)| format!("{op} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }

    /// Why the run fails, if it does.
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.lost() > 0 {
            out.push(format!("{} lost", self.lost()));
        }
        if self.duplicated() > 0 {
            out.push(format!("{} duplicated", self.duplicated()));
        }
        if self.invisible() > 0 {
            out.push(format!("{} invisible", self.invisible()));
        }
        if self.problems.unchecked > 0 {
            out.push(format!(
                "{} read-your-writes checks never answered",
                self.problems.unchecked
            ));
        }
        for (kind, n) in &self.problems.hard_errors {
            out.push(format!(
                "{n} {kind} errors no retry can fix (first: {})",
                self.problems
                    .first_errors
                    .get(kind)
                    .map_or("", String::as_str)
            ));
        }
        for (operation, failed, attempts) in self.errors_by_operation() {
            if failed as f64 > self.config.error_budget * attempts as f64 {
                out.push(format!(
                    "{operation}: {failed} of {attempts} requests failed ({:.1}%), over the error budget of {:.1}% (see Errors)",
                    100.0 * failed as f64 / attempts.max(1) as f64,
                    100.0 * self.config.error_budget
                ));
            }
        }
        if !self.interrupted {
            for (check, o) in &self.problems.checks {
                if o.settled() != o.due {
                    out.push(format!(
                        "{} of {} {check} checks ended without an outcome",
                        o.due - o.settled().min(o.due),
                        o.due
                    ));
                }
            }
            let p = &self.problems;
            if p.steps_run + p.missed_steps != p.steps_due {
                out.push(format!(
                    "{} steps were due, but {} ran and {} were missed",
                    p.steps_due, p.steps_run, p.missed_steps
                ));
            }
        }
        if self.bootstraps.failed > 0 {
            out.push(format!(
                "{} takeover bootstraps never completed (see Errors, operation bootstrap)",
                self.bootstraps.failed
            ));
        }
        if let Some(e) = &self.drain_error {
            out.push(e.clone());
        }
        if let Some(d) = self.verification.as_ref().and_then(|v| v.docs.as_ref())
            && d.failures() > 0
        {
            out.push(format!(
                "task boards: {} pushed items missing, {} boards where readers disagree, {} changes held; e.g. {}",
                d.items_missing,
                d.readers_disagree,
                d.held,
                d.examples.first().map_or("", String::as_str)
            ));
        }
        if let Some(v) = &self.verification {
            for p in v.projectors.iter().filter(|p| p.error.is_some()) {
                out.push(format!(
                    "projector {} could not be verified: {}",
                    p.projector,
                    p.error.as_deref().unwrap_or_default()
                ));
            }
        }
        if self.appends == 0 {
            out.push("no append was acknowledged".to_owned());
        }
        for event in self.chaos.iter().filter(|e| e.error.is_some()) {
            out.push(format!(
                "chaos, {} {}: {}",
                event.action.as_deref().unwrap_or("fault"),
                event.victim,
                event.error.as_deref().unwrap_or_default()
            ));
        }
        out
    }

    /// Correctness: nothing lost, duplicated or invisible, every check answered, errors
    /// within budget. Whether the load was sustained is [`Self::sustained`].
    pub fn passed(&self) -> bool {
        self.failures().is_empty()
    }

    /// Failed requests of `operation`, of every kind, chaos outages included.
    pub fn failed(&self, operation: &str) -> u64 {
        let p = &self.problems;
        [&p.hard_errors, &p.errors, &p.outage_errors]
            .into_iter()
            .flat_map(|counts| counts.iter())
            .filter(|(key, _)| key.split_once(':').is_some_and(|(op, _)| op == operation))
            .map(|(_, n)| n)
            .sum()
    }

    /// Per operation: retryable failures outside chaos outages, and requests made.
    pub fn errors_by_operation(&self) -> Vec<(String, u64, u64)> {
        let mut failed: BTreeMap<&str, u64> = BTreeMap::new();
        for (key, n) in &self.problems.errors {
            let operation = key.split_once(':').map_or(key.as_str(), |(op, _)| op);
            *failed.entry(operation).or_default() += n;
        }
        failed
            .into_iter()
            .map(|(op, n)| {
                let attempts = self.problems.attempts.get(op).copied().unwrap_or(0);
                (op.to_owned(), n, attempts)
            })
            .collect()
    }

    /// report.json, report.md and the charts, into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), FleetError> {
        let err = |what: &Path, e: &dyn std::fmt::Display| {
            FleetError::Report(format!("{}: {e}", what.display()))
        };
        let json = serde_json::to_string_pretty(self).map_err(|e| err(dir, &e))?;
        let path = dir.join("report.json");
        std::fs::write(&path, json + "\n").map_err(|e| err(&path, &e))?;
        let path = dir.join("report.md");
        std::fs::write(&path, self.markdown()).map_err(|e| err(&path, &e))?;
        super::charts::write_charts(&self.timeline, dir).map_err(|e| err(dir, &e))?;
        Ok(())
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let c = &self.config;
        let _ = writeln!(
            out,
            "# Engram load test: {} — {}\n",
            self.verdict(),
            self.verdicts()
        );
        let _ = writeln!(
            out,
            "{} instances in teams of {}, target {:.1} appends/s for {:.0} s{}; embedder {:?}; {}{}; seed {}; nats-server {}; started {}.\n",
            c.instances,
            c.team_size,
            c.rate,
            c.duration.as_secs_f64(),
            if self.load_secs > c.duration.as_secs_f64() + 1e-3 {
                format!(
                    " (held open to {:.1} s until the chaos faults' recoveries were timed)",
                    self.load_secs
                )
            } else {
                String::new()
            },
            c.embedder,
            if c.nats.is_some() {
                "remote deployment"
            } else {
                "local engram up"
            },
            match (c.nodes, c.chaos) {
                (0, true) => ", chaos (projectors in their own processes)".to_owned(),
                (0, false) => String::new(),
                (n, true) => format!(", {n} memory node processes, chaos (one node killed)"),
                (n, false) => format!(", {n} memory node processes"),
            } + &match (c.cluster, c.chaos_cluster) {
                (0, _) => String::new(),
                (n, false) => format!(", a {n}-node NATS cluster (R3)"),
                (n, true) => format!(", a {n}-node NATS cluster (R3), cluster chaos"),
            },
            c.seed,
            self.nats_server_version,
            self.started_at.format("%Y-%m-%d %H:%M:%S UTC"),
        );
        let m = &self.machine;
        let _ = writeln!(
            out,
            "Machine: {} cpus ({}), {:.1} GiB, {}, load average {:.2} at the start.\n",
            m.cpus,
            m.cpu_model.as_deref().unwrap_or("unknown"),
            m.memory_gib.unwrap_or_default(),
            m.os,
            m.load_avg_1m.unwrap_or_default()
        );
        let _ = writeln!(out, "## Ledger\n");
        let _ = writeln!(out, "| check | count |\n|---|---|");
        let _ = writeln!(out, "| acknowledged appends | {} |", self.appends);
        let _ = writeln!(out, "| lost | {} |", self.lost());
        let _ = writeln!(out, "| duplicated | {} |", self.duplicated());
        let _ = writeln!(out, "| invisible | {} |", self.invisible());
        for (check, o) in &self.problems.checks {
            let _ = writeln!(
                out,
                "| read-your-writes {check} checks: due / passed / invisible / unchecked{} | {} / {} / {} / {}{} |",
                if check == "skill" {
                    " / superseded"
                } else {
                    ""
                },
                o.due,
                o.passed,
                o.invisible,
                o.unchecked,
                if check == "skill" {
                    format!(" / {}", o.superseded)
                } else {
                    String::new()
                }
            );
        }
        let _ = writeln!(
            out,
            "| read-your-writes waits that timed out and were retried | {} |",
            self.problems.visibility_timeouts
        );
        let _ = writeln!(
            out,
            "| takeovers (events checked in the predecessor's scope) | {} ({}) |",
            self.takeovers, self.takeover_events_checked
        );
        let _ = writeln!(
            out,
            "| retried appends the stream deduplicated | {} |",
            self.duplicate_acks
        );
        let _ = writeln!(
            out,
            "| steps missed (their instance was still busy when the load ended) | {} |",
            self.problems.missed_steps
        );
        if let Some(v) = &self.verification {
            let _ = writeln!(
                out,
                "| stream events after seq {} (of them unacknowledged load-test appends) | {} ({}) |",
                v.baseline_seq, v.stream_events, v.stored_unacked
            );
            if let Some(d) = &v.docs {
                let _ = writeln!(
                    out,
                    "| task boards: edits, pushes (late), items checked, missing, readers disagreeing, conflicting fields | {}, {} ({}), {}, {}, {}, {} |",
                    d.edits,
                    d.pushes,
                    d.late_pushes,
                    d.items_expected,
                    d.items_missing,
                    d.readers_disagree,
                    d.conflicts
                );
            }
            let _ = writeln!(
                out,
                "\n| projector | after seq | through seq | applied | expected | dead-lettered | digest |\n|---|---|---|---|---|---|---|"
            );
            for p in &v.projectors {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    p.projector,
                    p.baseline_seq,
                    p.through_seq,
                    p.applied_events,
                    p.expected_events,
                    p.dead_lettered,
                    match &p.error {
                        Some(e) => format!("not checked: {e}"),
                        None if p.digest_matches => "equal".to_owned(),
                        None => "DIFFERENT".to_owned(),
                    }
                );
            }
            for example in &v.examples {
                let _ = writeln!(out, "- {example}");
            }
        }
        for example in &self.problems.invisible_examples {
            let _ = writeln!(out, "- invisible: {example}");
        }
        let _ = writeln!(out, "\n## Throughput and latency\n");
        let _ = writeln!(
            out,
            "{:.1} appends/s (target {:.1}) and {:.1} queries/s over {:.1} s. {}\n",
            self.appends_per_sec,
            self.target_appends_per_sec,
            self.queries_per_sec,
            self.measured_secs,
            if self.problems.missed_steps == 0 {
                "Every scheduled step ran.".to_owned()
            } else if self.sustained() {
                format!(
                    "The target rate was sustained: {} of {} steps never started (their instance was still busy with earlier ones when the load ended), within the {}% allowed.",
                    self.problems.missed_steps,
                    self.load.steps_reached,
                    MISSED_STEPS_ALLOWED_PERCENT
                )
            } else {
                format!(
                    "**The target rate was not sustained**: {} of {} steps never started because their instance was still busy with earlier ones.",
                    self.problems.missed_steps, self.load.steps_reached
                )
            }
        );
        let _ = writeln!(
            out,
            "| latency, ms | count | p50 | p95 | p99 | p99.9 | max |\n|---|---|---|---|---|---|---|"
        );
        let label = |k: &str| match k {
            "ack" => "append ack, open loop (step lateness + send to ack)",
            "ack_service" => "append ack, from when it was sent",
            "visibility" => "ack until the writer retrieves it",
            "visibility_keyword" => {
                "ack until the writer retrieves it by keyword (server-side embedding only)"
            }
            "query" => "retrieve (no token)",
            "context" => "build_context (with token)",
            "facts" => "facts history (with token)",
            "skills" => "skill by name (with token)",
            "takeover_replay" => "successor replays its scopes (private and team)",
            "takeover_bootstrap" => "successor bootstraps the same scopes",
            "answered" => "one query request answered, any operation (its own service time)",
            "refused" => "one query request refused busy (send to refusal)",
            _ => "other",
        };
        for (kind, l) in &self.latency_ms {
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                label(kind),
                l.count,
                l.p50,
                l.p95,
                l.p99,
                l.p999,
                l.max
            );
        }
        let _ = writeln!(out, "\n{}", self.refusals());
        if let (Some(r), Some(x)) = (&self.reference, &self.ratios) {
            let _ = writeln!(out, "\n## Against raw JetStream, same run\n");
            let _ = writeln!(
                out,
                "Raw: {} publishers on the same schedule with the same sizes for {:.0} s; a consumer tailing the stream; an ordered consumer replaying the events stream.\n",
                r.publishers, r.measured_secs
            );
            let _ = writeln!(
                out,
                "| figure | engram | raw | engram / raw |\n|---|---|---|---|"
            );
            let ack = &self.latency_ms["ack"];
            let vis = &self.latency_ms["visibility"];
            let _ = writeln!(
                out,
                "| appends/s | {:.1} | {:.1} | {:.2} |",
                self.appends_per_sec, r.publishes_per_sec, x.appends_per_sec
            );
            let _ = writeln!(
                out,
                "| ack p50 ms | {:.2} | {:.2} | {:.2} |",
                ack.p50, r.ack_ms.p50, x.ack_p50
            );
            let _ = writeln!(
                out,
                "| ack p99 ms | {:.2} | {:.2} | {:.2} |",
                ack.p99, r.ack_ms.p99, x.ack_p99
            );
            let _ = writeln!(
                out,
                "| written until readable p50 ms (engram: ack until retrieved; raw: publish until delivered) | {:.2} | {:.2} | {:.1} |",
                vis.p50, r.delivery_ms.p50, x.visibility_p50
            );
            let _ = writeln!(
                out,
                "| written until readable p99 ms | {:.2} | {:.2} | {:.1} |",
                vis.p99, r.delivery_ms.p99, x.visibility_p99
            );
            let _ = writeln!(
                out,
                "| raw replay of the events stream, events/s | | {:.0} | |",
                r.replay_events_per_sec
            );
            if let Some(r1) = &self.reference_r1 {
                let _ = writeln!(
                    out,
                    "\n### What three replicas cost (raw JetStream, same run)\n"
                );
                let _ = writeln!(
                    out,
                    "| figure | R3 | R1 | R3 / R1 |\n|---|---|---|---|\n| appends/s | {:.1} | {:.1} | {:.2} |\n| ack p50 ms | {:.2} | {:.2} | {:.2} |\n| ack p99 ms | {:.2} | {:.2} | {:.2} |",
                    r.publishes_per_sec,
                    r1.publishes_per_sec,
                    r.publishes_per_sec / r1.publishes_per_sec.max(1e-9),
                    r.ack_ms.p50,
                    r1.ack_ms.p50,
                    r.ack_ms.p50 / r1.ack_ms.p50.max(1e-9),
                    r.ack_ms.p99,
                    r1.ack_ms.p99,
                    r.ack_ms.p99 / r1.ack_ms.p99.max(1e-9),
                );
            }
        }
        self.takeover_markdown(&mut out);
        self.consolidation_markdown(&mut out);
        self.snapshots_markdown(&mut out);
        if !self.chaos.is_empty() {
            let _ = writeln!(out, "\n## Chaos\n");
            let _ = writeln!(
                out,
                "| fault | at s | back s | appends while down | appends resumed s | longest gap without acks ms | replica current s | leader change | projectors caught up s | caught up after the restart s | stream seq at the kill, caught up to | partitions taken over s | node serving again s | longest written-to-readable ms | visibility p99 under goal s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
            );
            let opt = |v: Option<f64>| v.map_or_else(|| "never".to_owned(), |v| format!("{v:.2}"));
            for e in &self.chaos {
                let seq = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
                let _ = writeln!(
                    out,
                    "| {} {} | {:.1} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {}, {} | {} | {} | {} | {} |",
                    e.action.as_deref().unwrap_or("kill -9"),
                    e.victim,
                    e.at_secs,
                    e.down_secs,
                    e.appends_while_down,
                    opt(e.appends_resumed_secs),
                    e.ack_gap_max_ms
                        .map_or_else(|| "?".to_owned(), |v| format!("{v:.0}")),
                    e.replica_caught_up_secs
                        .map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
                    e.leader_change
                        .as_ref()
                        .map_or_else(|| "-".to_owned(), |(a, b)| format!("{a} → {b}")),
                    opt(e.caught_up_secs),
                    opt(e.caught_up_secs.map(|c| c - e.down_secs)),
                    seq(e.stream_seq_at_kill),
                    seq(e.caught_up_to_seq),
                    e.taken_over_secs
                        .map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
                    e.returned_secs
                        .map_or_else(|| "-".to_owned(), |v| format!("{v:.2}")),
                    e.visibility_max_ms
                        .map_or_else(|| "?".to_owned(), |v| format!("{v:.0}")),
                    opt(e.visibility_back_secs),
                );
            }
        }
        if !self.nodes.is_empty() {
            let total: u64 = self.nodes.iter().filter_map(|n| n.applied_events).sum();
            let _ = writeln!(out, "\n## Memory nodes\n");
            let _ = writeln!(
                out,
                "| node | partitions | events applied (every model) | share | CPU s | CPU µs per applied event |\n|---|---|---|---|---|---|"
            );
            for n in &self.nodes {
                let share = n.applied_events.filter(|_| total > 0).map_or_else(
                    || "?".to_owned(),
                    |a| format!("{:.0}%", 100.0 * a as f64 / total as f64),
                );
                let per_event = match (n.cpu_secs, n.applied_events) {
                    (Some(cpu), Some(a)) if a > 0 => format!("{:.0}", cpu * 1e6 / a as f64),
                    _ => "?".to_owned(),
                };
                let _ = writeln!(
                    out,
                    "| {} | {} ({:?}) | {} | {share} | {} | {per_event} |",
                    n.node,
                    n.partitions.len(),
                    n.partitions,
                    n.applied_events
                        .map_or_else(|| "?".to_owned(), |a| a.to_string()),
                    n.cpu_secs
                        .map_or_else(|| "?".to_owned(), |c| format!("{c:.1}")),
                );
            }
        }
        let _ = writeln!(out, "\n## Projector lag and resources\n");
        let _ = writeln!(
            out,
            "| projector | max lag, events | mean lag |\n|---|---|---|"
        );
        for (name, lag) in &self.timeline.lag_events {
            let lag: Vec<u64> = lag.iter().flatten().copied().collect();
            let _ = writeln!(
                out,
                "| {name} | {} | {:.1} |",
                lag.iter().max().copied().unwrap_or_default(),
                if lag.is_empty() {
                    0.0
                } else {
                    lag.iter().sum::<u64>() as f64 / lag.len() as f64
                }
            );
        }
        let _ = writeln!(
            out,
            "\n| process | mean CPU % | max CPU % | max RSS MiB |\n|---|---|---|---|"
        );
        let f = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
        for (process, r) in &self.resources {
            let _ = writeln!(
                out,
                "| {process} | {} | {} | {} |",
                f(r.cpu_percent_mean),
                f(r.cpu_percent_max),
                f(r.rss_mib_max)
            );
        }
        let p = &self.problems;
        if !(p.errors.is_empty() && p.hard_errors.is_empty() && p.outage_errors.is_empty()) {
            let _ = writeln!(out, "\n## Errors\n");
            let _ = writeln!(
                out,
                "Requests by operation: {}. Error budget: {:.1}% of an operation's requests may fail with a retryable error outside chaos outages.\n",
                p.attempts
                    .iter()
                    .map(|(op, n)| format!("{op} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                100.0 * self.config.error_budget
            );
            for (title, counts) in [
                ("no retry can fix (each fails the run)", &p.hard_errors),
                ("retryable, held against the budget", &p.errors),
                ("retryable, during a chaos outage", &p.outage_errors),
            ] {
                for (kind, n) in counts {
                    let _ = writeln!(
                        out,
                        "- {kind}, {title}: {n} (first: {})",
                        p.first_errors.get(kind).map_or("", String::as_str)
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "\nCharts: latency.svg, lag.svg, throughput.svg, resources.svg. Figures: report.json."
        );
        out
    }
}

/// A figure, or "absent" when this run could not measure it.
fn or_absent<T>(value: Option<T>, show: impl FnOnce(T) -> String) -> String {
    value.map_or_else(|| "absent".to_owned(), show)
}

impl FleetReport {
    fn takeover_markdown(&self, out: &mut String) {
        if self.takeovers == 0
            && self.bootstraps.completed == 0
            && self.bootstraps.failed == 0
            && self.bootstraps.refused_tail_gone == 0
        {
            return;
        }
        let b = &self.bootstraps;
        let _ = writeln!(out, "\n## Takeovers: bootstrap against replay\n");
        let _ = writeln!(
            out,
            "{} takeovers. Each successor bootstraps its scopes, private and team (the slices of the newest facts, skills and docs snapshots, then the stream after them; scopes of at most 1,000 events are replayed instead), applying them to those models, then replays the same scopes from the start: the replay checks that every event its predecessors were acknowledged is there, and is the bootstrap's reference (it reads ids only and applies nothing).\n",
            self.takeovers
        );
        let _ = writeln!(out, "| figure | value |\n|---|---|");
        let _ = writeln!(
            out,
            "| bootstraps completed / failed | {} / {} |",
            b.completed, b.failed
        );
        let _ = writeln!(
            out,
            "| refused: retention removed history no snapshot covers yet (correct; the replay still checks) | {} |",
            b.refused_tail_gone
        );
        let _ = writeln!(
            out,
            "| of them from a snapshot (at least one model) | {} |",
            b.from_snapshot
        );
        let _ = writeln!(
            out,
            "| tail events replayed after the snapshots | {}{} |",
            b.tail_events_from_snapshot,
            if b.from_snapshot > 0 {
                format!(
                    " ({:.1} per bootstrap)",
                    b.tail_events_from_snapshot as f64 / b.from_snapshot as f64
                )
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            out,
            "| events replayed by bootstraps that found no snapshot | {} |",
            b.events_without_snapshot
        );
        let _ = writeln!(
            out,
            "| newer snapshots skipped (they did not check) | {} |",
            b.skipped_snapshots
        );
        let figures =
            |l: &Latency| format!("{:.2} / {:.2} / {:.2} / {:.2}", l.p50, l.p99, l.max, l.mean);
        let boot = self.latency_ms.get("takeover_bootstrap");
        let replay = self.latency_ms.get("takeover_replay");
        if let Some(l) = boot {
            let _ = writeln!(
                out,
                "| bootstrap ms: p50 / p99 / max / mean | {} |",
                figures(l)
            );
        }
        if let Some(l) = replay {
            let _ = writeln!(
                out,
                "| replay of the same scopes ms: p50 / p99 / max / mean | {} |",
                figures(l)
            );
        }
        if let (Some(boot), Some(replay)) = (boot, replay)
            && boot.count > 0
            && replay.count > 0
        {
            let _ = writeln!(
                out,
                "| bootstrap / replay, p50 and mean | {:.2} and {:.2} |",
                boot.p50 / replay.p50.max(1e-9),
                boot.mean / replay.mean.max(1e-9)
            );
        }
    }

    fn consolidation_markdown(&self, out: &mut String) {
        let c = &self.consolidation;
        let _ = writeln!(out, "\n## Consolidation\n");
        let _ = writeln!(
            out,
            "{}; {} of the episodic memories repeat a recent one, every {} events of an instance end its session.\n",
            match c.interval_secs {
                Some(s) if s > 0.0 => format!("The consolidator runs every {s:.0} s"),
                Some(_) => "Scheduled consolidation is off".to_owned(),
                None => "A remote deployment: the consolidator runs on its own schedule".to_owned(),
            },
            format_share(self.config.duplicates),
            self.config.finish_every
        );
        let _ = writeln!(out, "| figure | value |\n|---|---|");
        let _ = writeln!(
            out,
            "| scheduled runs | {} |",
            or_absent(c.runs, |n| n.to_string())
        );
        let _ = writeln!(
            out,
            "| run seconds: total / mean / median at most / slowest at most (histogram buckets) | {} / {} / {} / {} |",
            or_absent(c.run_secs_total, |s| format!("{s:.3}")),
            or_absent(c.run_secs_mean, |s| format!("{s:.4}")),
            or_absent(c.run_secs_p50_at_most, |s| format!("{s}")),
            or_absent(c.run_secs_max_at_most, |s| format!("{s}"))
        );
        let _ = writeln!(
            out,
            "| outputs the runs appended | {} |",
            or_absent(c.outputs_appended, |n| n.to_string())
        );
        let _ = writeln!(
            out,
            "| outputs in the stream, by what they are | {} |",
            if c.outputs.is_empty() {
                "none".to_owned()
            } else {
                c.outputs
                    .iter()
                    .map(|(op, n)| format!("{op} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
        let _ = writeln!(
            out,
            "| consolidator lag during the load, max / mean events | {} / {} |",
            or_absent(c.lag_max_events, |n| n.to_string()),
            or_absent(c.lag_mean_events, |n| format!("{n:.1}"))
        );
        let _ = writeln!(
            out,
            "| consolidator caught up with the stream after the load, s | {} |",
            or_absent(c.caught_up_secs_after_load, |s| format!("{s:.2}"))
        );
        let _ = writeln!(
            out,
            "| events the consolidator applied | {} |",
            or_absent(c.events_applied, |n| n.to_string())
        );
        let us = |v: Option<f64>| or_absent(v, |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "| cost per event applied, µs: scheduled runs (wall time) / applying to its model (batch time) / its process's CPU | {} / {} / {} |",
            us(c.run_us_per_event),
            us(c.apply_us_per_event),
            us(c.process_cpu_us_per_event)
        );
        match &c.shrink {
            Some(s) => {
                let _ = writeln!(
                    out,
                    "| **searchable memories** | **{} before consolidation → {} after ({:+.1}%)**: {} hidden (superseded or archived), {} added (merged copies, summaries) |",
                    s.before, s.after, s.change_percent, s.hidden, s.added
                );
            }
            None => {
                let _ = writeln!(out, "| searchable memories | absent |");
            }
        }
        let d = &self.docs_merge;
        let _ = writeln!(
            out,
            "| shared-document merge: doc_changed events merged by the docs projector, per second of the load | {} / {} |",
            or_absent(d.doc_changes, |n| n.to_string()),
            or_absent(d.changes_per_sec, |r| format!("{r:.1}"))
        );
        let _ = writeln!(
            out,
            "| docs projector batch time, s / per change, ms / changes per busy second | {} / {} / {} |",
            or_absent(d.busy_secs, |s| format!("{s:.3}")),
            or_absent(d.ms_per_change, |s| format!("{s:.3}")),
            or_absent(d.changes_per_busy_sec, |r| format!("{r:.0}"))
        );
        let absent: Vec<String> = c
            .absent
            .iter()
            .chain(&d.absent)
            .map(|(figure, why)| format!("{figure}: {why}"))
            .collect();
        if !absent.is_empty() {
            let _ = writeln!(out, "\nAbsent: {}.", absent.join("; "));
        }
    }

    fn snapshots_markdown(&self, out: &mut String) {
        if self.snapshots.is_empty() {
            return;
        }
        let _ = writeln!(out, "\n## Snapshots\n");
        let _ = writeln!(
            out,
            "Cut on demand (`engram.p.<projector>.snapshot`) every {:.0} s during the load, and once after it; timed from the request to the stored snapshot.\n",
            self.config.snapshot_every.as_secs_f64()
        );
        let _ = writeln!(
            out,
            "| projector | cuts during the load | cut s there: median / max | cut after the load, s | bytes | seq | events |\n|---|---|---|---|---|---|---|"
        );
        for p in &self.snapshots {
            if let Some(why) = &p.refused {
                let _ = writeln!(out, "| {} | no snapshots: {why} | | | | | |", p.projector);
                continue;
            }
            let secs = |v: Option<f64>| or_absent(v, |s| format!("{s:.3}"));
            let (cut, bytes, seq, events) = match &p.final_cut {
                Some(c) => (
                    format!(
                        "{:.3}{}",
                        c.secs,
                        if c.fresh {
                            ""
                        } else {
                            " (an earlier one, nothing new to cut)"
                        }
                    ),
                    c.bytes.to_string(),
                    c.version.to_string(),
                    c.events.to_string(),
                ),
                None => (
                    format!(
                        "failed: {}",
                        p.first_failure.as_deref().unwrap_or("no answer")
                    ),
                    String::new(),
                    String::new(),
                    String::new(),
                ),
            };
            let _ = writeln!(
                out,
                "| {} | {}{} | {} / {} | {cut} | {bytes} | {seq} | {events} |",
                p.projector,
                p.cuts_during_load,
                if p.failures > 0 {
                    format!(" ({} failed)", p.failures)
                } else {
                    String::new()
                },
                secs(p.cut_secs_p50_during_load),
                secs(p.cut_secs_max_during_load),
            );
        }
    }
}

fn format_share(share: f64) -> String {
    format!("{:.0}%", share * 100.0)
}

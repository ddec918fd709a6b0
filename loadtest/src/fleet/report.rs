//! The fleet run's report: JSON for tracking, Markdown for people, SVG charts for the shape
//! of the run over time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::record::{Latency, Problems};
use super::reference::Reference;
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
    /// takeover_replay.
    pub latency_ms: BTreeMap<String, Latency>,
    pub takeovers: u64,
    pub takeover_events_checked: u64,
    pub problems: Problems,
    pub drain_secs: Option<f64>,
    pub drain_error: Option<String>,
    pub verification: Option<Verification>,
    pub chaos: Vec<ChaosEvent>,
    pub reference: Option<Reference>,
    pub ratios: Option<Ratios>,
    /// Peak and mean CPU and memory per process over the run.
    pub resources: BTreeMap<String, Resources>,
    pub timeline: Timeline,
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
    pub error: Option<String>,
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

    /// True if (almost) every scheduled step ran: at most 1% were missed.
    pub fn kept_up(&self) -> bool {
        self.problems.missed_steps * 100 <= self.appends + self.problems.missed_steps
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
                "restart of {} failed: {}",
                event.victim,
                event.error.as_deref().unwrap_or_default()
            ));
        }
        out
    }

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
        let verdict = if self.passed() {
            "PASSED".to_owned()
        } else {
            format!("FAILED: {}", self.failures().join("; "))
        };
        let _ = writeln!(out, "# Engram load test: {verdict}\n");
        let _ = writeln!(
            out,
            "{} instances in teams of {}, target {:.1} appends/s for {:.0} s; embedder {:?}; {}{}; seed {}; nats-server {}; started {}.\n",
            c.instances,
            c.team_size,
            c.rate,
            c.duration.as_secs_f64(),
            c.embedder,
            if c.nats.is_some() {
                "remote deployment"
            } else {
                "local engram up"
            },
            if c.chaos {
                ", chaos (projectors in their own processes)"
            } else {
                ""
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
            if self.kept_up() {
                "Every scheduled step ran.".to_owned()
            } else {
                format!(
                    "**The target rate was not sustained**: {} steps never started because their instance was still busy with earlier ones.",
                    self.problems.missed_steps
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
            "query" => "retrieve (no token)",
            "context" => "build_context (with token)",
            "facts" => "facts history (with token)",
            "skills" => "skill by name (with token)",
            "takeover_replay" => "successor replays its scope",
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
        }
        if !self.chaos.is_empty() {
            let _ = writeln!(out, "\n## Chaos\n");
            let _ = writeln!(
                out,
                "| kill -9 | at s | back s | appends while down | appends resumed s | projectors caught up s | caught up after the restart s | stream seq at the kill, caught up to |\n|---|---|---|---|---|---|---|---|"
            );
            let opt = |v: Option<f64>| v.map_or_else(|| "never".to_owned(), |v| format!("{v:.2}"));
            for e in &self.chaos {
                let seq = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
                let _ = writeln!(
                    out,
                    "| {} | {:.1} | {:.2} | {} | {} | {} | {} | {}, {} |",
                    e.victim,
                    e.at_secs,
                    e.down_secs,
                    e.appends_while_down,
                    opt(e.appends_resumed_secs),
                    opt(e.caught_up_secs),
                    opt(e.caught_up_secs.map(|c| c - e.down_secs)),
                    seq(e.stream_seq_at_kill),
                    seq(e.caught_up_to_seq)
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

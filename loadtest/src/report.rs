//! What a run found, as a table for people and as JSON for tracking over time.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::driver::PhaseResult;

/// Everything a run measured, with what it ran on and with which parameters.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub started_at: DateTime<Utc>,
    pub params: Params,
    pub machine: Machine,
    /// Version from the server's INFO, so it is right for an external server too.
    pub nats_server_version: String,
    pub payload_sizes: SizeSummary,
    pub engram: PhaseResult,
    /// Missing if the run was interrupted before the raw phase.
    pub raw: Option<PhaseResult>,
    pub ratios: Option<Ratios>,
}

/// The parameters in force, flattened for JSON.
#[derive(Clone, Debug, Serialize)]
pub struct Params {
    pub agents: usize,
    pub connections: usize,
    pub team_size: usize,
    pub warmup_secs: f64,
    pub duration_secs: Option<f64>,
    pub events_per_agent: Option<u64>,
    pub time_limit_secs: Option<f64>,
    pub seed: u64,
    /// True when the bench started its own nats-server on this machine, competing with the
    /// agents for the same cores.
    pub embedded_server: bool,
    /// Replicas of both phases' streams.
    pub replicas: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: Option<String>,
    pub memory_gib: Option<f64>,
    pub os: String,
    /// One-minute load average when the run began: other work on the machine skews the
    /// figures, and this is the cheapest way to notice.
    pub load_avg_1m: Option<f64>,
}

impl Machine {
    pub fn detect() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, model)| model.trim().to_owned());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_gib = meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<f64>().ok())
            .map(|kib| kib / (1024.0 * 1024.0));
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let load_avg_1m = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next()?.parse().ok());
        Self {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            memory_gib,
            os: format!("{} {}", std::env::consts::OS, kernel.trim())
                .trim()
                .to_owned(),
            load_avg_1m,
        }
    }
}

/// The distribution of payload sizes the engram phase recorded (and the raw phase replayed).
#[derive(Clone, Debug, Default, Serialize)]
pub struct SizeSummary {
    pub count: usize,
    pub min: u32,
    pub p50: u32,
    pub p90: u32,
    pub p99: u32,
    pub max: u32,
    pub mean: f64,
}

impl SizeSummary {
    pub fn from_sizes(mut sizes: Vec<u32>) -> Self {
        if sizes.is_empty() {
            return Self::default();
        }
        sizes.sort_unstable();
        let at = |q: f64| sizes[((sizes.len() - 1) as f64 * q).round() as usize];
        Self {
            count: sizes.len(),
            min: sizes[0],
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: sizes[sizes.len() - 1],
            mean: sizes.iter().map(|&s| f64::from(s)).sum::<f64>() / sizes.len() as f64,
        }
    }
}

/// Engram divided by raw: below 1 for throughput and above 1 for latency is Engram's cost.
#[derive(Clone, Debug, Serialize)]
pub struct Ratios {
    pub throughput: f64,
    pub latency_p50: f64,
    pub latency_p99: f64,
}

impl Ratios {
    pub fn new(engram: &PhaseResult, raw: &PhaseResult) -> Self {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        Self {
            throughput: ratio(engram.events_per_sec, raw.events_per_sec),
            latency_p50: ratio(engram.latency_ms.p50, raw.latency_ms.p50),
            latency_p99: ratio(engram.latency_ms.p99, raw.latency_ms.p99),
        }
    }
}

impl Report {
    /// The human-readable summary printed at the end of a run.
    pub fn render(&self) -> String {
        let p = &self.params;
        let m = &self.machine;
        let mut out = String::new();
        let stop = match (p.duration_secs, p.events_per_agent) {
            (Some(d), _) => format!("{d} s measured per phase"),
            (None, Some(n)) => format!("{n} measured events per agent per phase"),
            (None, None) => "unknown stop rule".to_owned(),
        };
        let _ = writeln!(
            out,
            "bench-append: {} agents on {} connections, teams of {}, {stop} after {} s warm-up, seed {}",
            p.agents, p.connections, p.team_size, p.warmup_secs, p.seed
        );
        let _ = writeln!(
            out,
            "machine: {} cpus ({}), {}, {}, load average {} at start",
            m.cpus,
            m.cpu_model.as_deref().unwrap_or("unknown cpu"),
            m.memory_gib
                .map_or("unknown memory".to_owned(), |g| format!(
                    "{g:.1} GiB memory"
                )),
            m.os,
            m.load_avg_1m
                .map_or("unknown".to_owned(), |l| format!("{l:.2}")),
        );
        let _ = writeln!(
            out,
            "nats-server {}{}, streams with {} replica{}",
            self.nats_server_version,
            if p.embedded_server {
                ", embedded on this machine (it shares the cpus with the agents)"
            } else {
                ", external"
            },
            p.replicas,
            if p.replicas == 1 { "" } else { "s" }
        );
        let s = &self.payload_sizes;
        let _ = writeln!(
            out,
            "payload sizes (encoded envelopes, replayed by raw): {} recorded, min {} B, p50 {} B, p90 {} B, p99 {} B, max {} B, mean {} B",
            group(s.count as u64),
            group(s.min.into()),
            group(s.p50.into()),
            group(s.p90.into()),
            group(s.p99.into()),
            group(s.max.into()),
            group(s.mean.round() as u64)
        );
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<11}{:>10}{:>11}{:>8}{:>9}{:>9}{:>9}{:>10}{:>9}{:>8}{:>6}",
            "phase",
            "events",
            "events/s",
            "MB/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9 ms",
            "max ms",
            "errors",
            "dups"
        );
        for phase in std::iter::once(&self.engram).chain(&self.raw) {
            let l = &phase.latency_ms;
            let _ = writeln!(
                out,
                "{:<11}{:>10}{:>11}{:>8.2}{:>9.2}{:>9.2}{:>9.2}{:>10.2}{:>9.2}{:>8}{:>6}{}",
                phase.name,
                group(phase.events),
                group(phase.events_per_sec.round() as u64),
                phase.mb_per_sec,
                l.p50,
                l.p90,
                l.p99,
                l.p999,
                l.max,
                group(phase.errors),
                group(phase.duplicates),
                if phase.cut_short { "  (cut short)" } else { "" }
            );
        }
        if let Some(r) = &self.ratios {
            let _ = writeln!(
                out,
                "{:<11}{:>10}{:>11}{:>8}{:>9}{:>9}{:>9}",
                "engram/raw",
                "",
                format!("{:.2}x", r.throughput),
                format!("{:.2}x", r.throughput),
                format!("{:.2}x", r.latency_p50),
                "",
                format!("{:.2}x", r.latency_p99),
            );
        }
        let _ = writeln!(out);
        for phase in std::iter::once(&self.engram).chain(&self.raw) {
            let us = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.1}"));
            let _ = writeln!(
                out,
                "cpu per event ({}): agents {} us, nats-server {} us",
                phase.name,
                us(phase.client_cpu_us_per_event),
                us(phase.server_cpu_us_per_event)
            );
        }
        for phase in std::iter::once(&self.engram).chain(&self.raw) {
            if phase.errors == 0 {
                continue;
            }
            let kinds: Vec<String> = phase
                .errors_by_kind
                .iter()
                .map(|(kind, n)| format!("{kind} {n}"))
                .collect();
            let _ = writeln!(
                out,
                "{} errors: {}; first: {}",
                phase.name,
                kinds.join(", "),
                phase.first_error.as_deref().unwrap_or("-")
            );
        }
        if self.raw.is_none() {
            let _ = writeln!(out, "raw phase not run: the run was interrupted");
        }
        out
    }
}

/// `1234567` as `1,234,567`.
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_thousands() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1_000), "1,000");
        assert_eq!(group(1_234_567), "1,234,567");
    }
}

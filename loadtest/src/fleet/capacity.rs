//! The capacity search (`loadtest --find-capacity`): the highest rate a fleet holds, and what
//! happens above it.
//!
//! A rate is **held** when its run passes (nothing lost, duplicated or invisible; errors
//! within budget) and every scheduled step ran. The search starts at the configured rate,
//! grows it by half again while runs hold (or shrinks it while they do not), then bisects
//! between the highest rate held and the lowest not held until they are within the
//! resolution. Each run is a whole fleet run with its own target and report
//! (`<out>/rate-<r>/`), all on the same seed, so their schedules differ only in speed.
//!
//! Then the **overload** runs, at multiples of the capacity, are judged against the run at
//! capacity (issue 27 §3): refusals come back `busy` at once (time to a refusal at p99
//! within twice an append's ack from send in the same run), answered query requests keep
//! their p99 within 3× of theirs at capacity, and appends (ack from send) within 2×. The runs of
//! the search above the capacity are judged the same way.

use std::fmt::Write as _;
use std::future::Future;

use serde::{Deserialize, Serialize};

use super::report::FleetReport;
use super::{FleetConfig, FleetError};

/// How the search runs. In a scenario file: a `[capacity]` table.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CapacitySearch {
    /// Search instead of one run at `rate`, which is where the search starts.
    pub enabled: bool,
    /// Done once the lowest rate not held is within this share above the highest held.
    pub resolution: f64,
    /// At most this many runs in the search (the overload runs come after them).
    pub max_runs: usize,
    /// Overload runs after the search, at these multiples of the capacity found.
    pub overload: Vec<f64>,
}

impl Default for CapacitySearch {
    fn default() -> Self {
        Self {
            enabled: false,
            resolution: 0.1,
            max_runs: 8,
            overload: vec![1.5],
        }
    }
}

impl CapacitySearch {
    pub fn validate(&self) -> Result<(), FleetError> {
        let invalid = |reason: String| Err(FleetError::Invalid(reason));
        if !(self.resolution.is_finite() && (0.01..=1.0).contains(&self.resolution)) {
            return invalid(format!(
                "--capacity-resolution is {}; it must be 0.01 to 1",
                self.resolution
            ));
        }
        if !(1..=30).contains(&self.max_runs) {
            return invalid(format!(
                "--capacity-runs is {}; it must be 1 to 30",
                self.max_runs
            ));
        }
        if self.overload.len() > 5
            || self
                .overload
                .iter()
                .any(|f| !(f.is_finite() && *f > 1.0 && *f <= 10.0))
        {
            return invalid(format!(
                "--overload is {:?}; at most 5 factors, each above 1 and at most 10",
                self.overload
            ));
        }
        Ok(())
    }
}

/// Growth of the rate between runs while they hold (and shrinking while they do not).
const STEP: f64 = 1.5;
/// Below this many steps per second a search that holds nothing stops.
const MIN_RATE: f64 = 0.5;
/// The overload bounds against the run at capacity.
const QUERY_BOUND: f64 = 3.0;
const APPEND_BOUND: f64 = 2.0;
/// A refusal "at once" against an append's ack in the same run: a refusal is two hops
/// through nats-server (the request to the service, its reply back) where an ack is one and
/// the stream's write, so the two are of one size; a refusal queued behind the service's
/// work takes tens to hundreds of times longer.
const REFUSAL_BOUND: f64 = 2.0;

/// One run's figures, as the search and the verdicts need them.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RunFigures {
    pub rate: f64,
    /// Nothing lost, duplicated or invisible, and errors within budget.
    pub passed: bool,
    pub steps_reached: u64,
    pub steps_missed: u64,
    pub appends_per_sec: f64,
    /// Query requests made and refused `busy`, over every query operation.
    pub query_requests: u64,
    pub refused: u64,
    /// p99 of one answered query request, of a refusal, of an append from send, and of a
    /// raw JetStream publish in the same run's reference phase, in ms.
    pub answered_p99_ms: Option<f64>,
    pub refused_p99_ms: Option<f64>,
    pub ack_p99_ms: Option<f64>,
    pub raw_ack_p99_ms: Option<f64>,
    pub engram_cpu_percent: Option<f64>,
    pub report_dir: String,
}

impl RunFigures {
    /// Whether this run held its rate: passed, and every scheduled step ran.
    pub fn held(&self) -> bool {
        self.passed && self.steps_missed == 0 && self.steps_reached > 0
    }

    pub fn of(report: &FleetReport, rate: f64) -> Self {
        let p99 = |kind: &str| {
            report
                .latency_ms
                .get(kind)
                .filter(|l| l.count > 0)
                .map(|l| l.p99)
        };
        let refused: u64 = report.problems.refused.values().sum();
        let query_requests = ["query", "context", "recall", "facts", "skills"]
            .iter()
            .filter_map(|op| report.problems.attempts.get(*op))
            .sum();
        Self {
            rate,
            passed: report.passed(),
            steps_reached: report.load.steps_reached,
            steps_missed: report.load.steps_missed,
            appends_per_sec: report.appends_per_sec,
            query_requests,
            refused,
            answered_p99_ms: p99("answered"),
            refused_p99_ms: p99("refused"),
            ack_p99_ms: p99("ack_service"),
            raw_ack_p99_ms: report
                .reference
                .as_ref()
                .filter(|r| r.ack_ms.count > 0)
                .map(|r| r.ack_ms.p99),
            engram_cpu_percent: report
                .resources
                .get("engram")
                .and_then(|r| r.cpu_percent_mean),
            report_dir: report.config.out.display().to_string(),
        }
    }
}

/// An overload run against the run at capacity.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct OverloadVerdict {
    pub rate: f64,
    /// Rate over capacity.
    pub factor: f64,
    /// Refusals came back within [`REFUSAL_BOUND`] times an append's ack (p99 from send,
    /// same run); `None` when nothing was refused.
    pub refused_at_once: Option<bool>,
    /// Answered query requests' p99 over theirs at capacity, and whether within 3×.
    pub answered_ratio: Option<f64>,
    pub answered_within: Option<bool>,
    /// Appends' p99 from send over theirs at capacity, and whether within 2×.
    pub ack_ratio: Option<f64>,
    pub ack_within: Option<bool>,
}

impl OverloadVerdict {
    fn of(run: &RunFigures, at_capacity: &RunFigures) -> Self {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        let answered_ratio = ratio(run.answered_p99_ms, at_capacity.answered_p99_ms);
        let ack_ratio = ratio(run.ack_p99_ms, at_capacity.ack_p99_ms);
        Self {
            rate: run.rate,
            factor: run.rate / at_capacity.rate,
            refused_at_once: (run.refused > 0).then_some(matches!(
                (run.refused_p99_ms, run.ack_p99_ms),
                (Some(r), Some(a)) if r <= REFUSAL_BOUND * a
            )),
            answered_ratio,
            answered_within: answered_ratio.map(|r| r <= QUERY_BOUND),
            ack_ratio,
            ack_within: ack_ratio.map(|r| r <= APPEND_BOUND),
        }
    }

    /// Every bound held that could be judged.
    pub fn graceful(&self) -> bool {
        self.refused_at_once != Some(false)
            && self.answered_within != Some(false)
            && self.ack_within != Some(false)
    }
}

/// What the search found.
#[derive(Clone, Debug, Serialize)]
pub struct CapacityReport {
    pub instances: usize,
    pub seed: u64,
    pub search: CapacitySearch,
    /// Every run, in the order run.
    pub runs: Vec<RunFigures>,
    /// The highest rate held, if any was.
    pub capacity: Option<f64>,
    /// The runs above the capacity, judged against the run at it.
    pub overload: Vec<OverloadVerdict>,
    /// A run that failed correctness (lost, duplicated, invisible, or errors over budget).
    pub failed_runs: Vec<f64>,
    pub interrupted: bool,
}

impl CapacityReport {
    /// 1 when a run failed correctness (at any rate), 3 when no rate was held, else 0.
    pub fn exit_code(&self) -> u8 {
        if !self.failed_runs.is_empty() {
            1
        } else if self.capacity.is_none() {
            3
        } else {
            0
        }
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Capacity: {}\n",
            match self.capacity {
                Some(c) => format!(
                    "{c:.1} steps/s held with {} instances (seed {})",
                    self.instances, self.seed
                ),
                None => format!("no rate held with {} instances", self.instances),
            }
        );
        let _ = writeln!(
            out,
            "A rate is held when its run passes and every scheduled step ran. Resolution {:.0}%, at most {} search runs; overload at {:?}× the capacity. Ratios are against the run at capacity; a refusal is at once when its p99 is within {REFUSAL_BOUND}× an append's ack p99 (from send) in the same run.\n",
            100.0 * self.search.resolution,
            self.search.max_runs,
            self.search.overload
        );
        let _ = writeln!(
            out,
            "| steps/s | held | appends/s | steps missed | query requests refused | answered query p99 ms | refusal p99 ms | ack p99 ms (from send) | raw ack p99 ms | engram CPU % | report |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
        let mut runs = self.runs.clone();
        runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        for r in &runs {
            let _ = writeln!(
                out,
                "| {:.1} | {} | {:.1} | {} of {} | {} of {} | {} | {} | {} | {} | {} | {} |",
                r.rate,
                if r.held() {
                    "yes"
                } else if !r.passed {
                    "FAILED"
                } else {
                    "no"
                },
                r.appends_per_sec,
                r.steps_missed,
                r.steps_reached,
                r.refused,
                r.query_requests,
                ms(r.answered_p99_ms),
                ms(r.refused_p99_ms),
                ms(r.ack_p99_ms),
                ms(r.raw_ack_p99_ms),
                r.engram_cpu_percent
                    .map_or("-".to_owned(), |v| format!("{v:.0}")),
                r.report_dir
            );
        }
        if !self.overload.is_empty() {
            let _ = writeln!(
                out,
                "\n## Above capacity\n\n| steps/s | × capacity | refusals at once | answered p99 / at capacity (≤ {QUERY_BOUND}) | ack p99 / at capacity (≤ {APPEND_BOUND}) | graceful |\n|---:|---:|---|---:|---:|---|"
            );
            let yes = |v: Option<bool>| match v {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "-",
            };
            let x = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}×"));
            for v in &self.overload {
                let _ = writeln!(
                    out,
                    "| {:.1} | {:.2} | {} | {} | {} | {} |",
                    v.rate,
                    v.factor,
                    match v.refused_at_once {
                        None => "none refused",
                        Some(b) => yes(Some(b)),
                    },
                    x(v.answered_ratio),
                    x(v.ack_ratio),
                    if v.graceful() { "yes" } else { "**no**" }
                );
            }
        }
        if !self.failed_runs.is_empty() {
            let _ = writeln!(
                out,
                "\n**Runs that failed correctness or their error budget**: {:?} steps/s; see their reports.",
                self.failed_runs
            );
        }
        if self.interrupted {
            let _ = writeln!(out, "\nInterrupted: the search stopped early.");
        }
        out
    }

    pub fn write(&self, dir: &std::path::Path) -> Result<(), FleetError> {
        let write = |name: &str, body: &[u8]| {
            std::fs::write(dir.join(name), body).map_err(|e| {
                FleetError::Report(format!("cannot write {}: {e}", dir.join(name).display()))
            })
        };
        let json = serde_json::to_vec_pretty(self)
            .map_err(|e| FleetError::Report(format!("cannot encode the capacity report: {e}")))?;
        write("capacity.json", &json)?;
        write("capacity.md", self.markdown().as_bytes())
    }
}

/// The next rate to run, given every run so far; `None` when the search is done.
pub fn next_rate(runs: &[RunFigures], start: f64, resolution: f64) -> Option<f64> {
    let Some(last) = runs.last() else {
        return Some(start);
    };
    let lowest_not_held = runs
        .iter()
        .filter(|r| !r.held())
        .map(|r| r.rate)
        .min_by(f64::total_cmp);
    // The highest held below every rate not held: a rate held above one that was not is
    // noise of the machine, and bisecting stays between the two that bracket.
    let highest_held = runs
        .iter()
        .filter(|r| r.held() && lowest_not_held.is_none_or(|n| r.rate < n))
        .map(|r| r.rate)
        .max_by(f64::total_cmp);
    let next = match (highest_held, lowest_not_held) {
        (Some(held), None) => held * STEP,
        (None, Some(not)) => not / STEP,
        (Some(held), Some(not)) => {
            if not <= held * (1.0 + resolution) {
                return None;
            }
            (held * not).sqrt()
        }
        (None, None) => last.rate,
    };
    let next = (next * 10.0).round() / 10.0;
    (next >= MIN_RATE && !runs.iter().any(|r| r.rate == next)).then_some(next)
}

/// The search, over `run` (one whole fleet run at a rate): what the binary calls with
/// [`super::run`], and what a test calls with a model of a system.
pub async fn search<F, Fut>(
    config: &FleetConfig,
    mut run: F,
    interrupted: impl Fn() -> bool,
) -> Result<CapacityReport, FleetError>
where
    F: FnMut(f64) -> Fut,
    Fut: Future<Output = Result<RunFigures, FleetError>>,
{
    config.validate()?;
    let search = &config.capacity;
    let mut runs: Vec<RunFigures> = Vec::new();
    while runs.len() < search.max_runs && !interrupted() {
        let Some(rate) = next_rate(&runs, config.rate, search.resolution) else {
            break;
        };
        eprintln!(
            "[capacity] run {} of at most {}: {rate:.1} steps/s",
            runs.len() + 1,
            search.max_runs
        );
        let figures = run(rate).await?;
        eprintln!(
            "[capacity] {rate:.1} steps/s: {} ({} of {} steps missed, {} of {} query requests refused)",
            if figures.held() {
                "held"
            } else if !figures.passed {
                "FAILED"
            } else {
                "not held"
            },
            figures.steps_missed,
            figures.steps_reached,
            figures.refused,
            figures.query_requests
        );
        runs.push(figures);
    }
    let capacity = capacity_of(&runs);
    if let Some(capacity) = capacity {
        for factor in &search.overload {
            if interrupted() {
                break;
            }
            let rate = (capacity * factor * 10.0).round() / 10.0;
            if runs.iter().any(|r| r.rate == rate) {
                continue;
            }
            eprintln!("[capacity] overload: {rate:.1} steps/s ({factor}× the capacity)");
            runs.push(run(rate).await?);
        }
    }
    let overload = match capacity.and_then(|c| runs.iter().find(|r| r.rate == c)) {
        Some(at) => {
            let mut above: Vec<&RunFigures> = runs.iter().filter(|r| r.rate > at.rate).collect();
            above.sort_by(|a, b| a.rate.total_cmp(&b.rate));
            above
                .into_iter()
                .map(|r| OverloadVerdict::of(r, at))
                .collect()
        }
        None => Vec::new(),
    };
    let failed_runs = runs.iter().filter(|r| !r.passed).map(|r| r.rate).collect();
    Ok(CapacityReport {
        instances: config.instances,
        seed: config.seed,
        search: search.clone(),
        runs,
        capacity,
        overload,
        failed_runs,
        interrupted: interrupted(),
    })
}

/// The highest rate held below every rate not held.
fn capacity_of(runs: &[RunFigures]) -> Option<f64> {
    let lowest_not_held = runs
        .iter()
        .filter(|r| !r.held())
        .map(|r| r.rate)
        .min_by(f64::total_cmp);
    runs.iter()
        .filter(|r| r.held() && lowest_not_held.is_none_or(|n| r.rate < n))
        .map(|r| r.rate)
        .max_by(f64::total_cmp)
}

/// Each run's report directory under `out`.
pub fn run_dir(out: &std::path::Path, rate: f64) -> std::path::PathBuf {
    out.join(format!("rate-{rate}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model system that holds every rate up to `limit`, for the search's arithmetic.
    fn model(limit: f64) -> impl FnMut(f64) -> std::future::Ready<Result<RunFigures, FleetError>> {
        move |rate| {
            let held = rate <= limit;
            std::future::ready(Ok(RunFigures {
                rate,
                passed: true,
                steps_reached: 100,
                steps_missed: if held { 0 } else { 7 },
                query_requests: 50,
                refused: if held { 0 } else { 20 },
                answered_p99_ms: Some(if held { 10.0 } else { 25.0 }),
                refused_p99_ms: Some(2.0),
                ack_p99_ms: Some(if held { 4.0 } else { 9.0 }),
                ..RunFigures::default()
            }))
        }
    }

    fn config(rate: f64) -> FleetConfig {
        FleetConfig {
            rate,
            capacity: CapacitySearch {
                enabled: true,
                ..CapacitySearch::default()
            },
            ..FleetConfig::default()
        }
    }

    #[tokio::test]
    async fn grows_until_a_rate_is_not_held_then_bisects_to_the_resolution() {
        let mut c = config(100.0);
        c.capacity.max_runs = 12;
        let report = search(&c, model(620.0), || false).await.unwrap();
        let rates: Vec<f64> = report.runs.iter().map(|r| r.rate).collect();
        // Half again each run while held: 100, 150, 225, 337.5, about 506, about 759.
        for pair in rates[..6].windows(2) {
            assert!((pair[1] / pair[0] - STEP).abs() < 0.01, "{rates:?}");
        }
        assert!(rates[..5].iter().all(|r| *r <= 620.0) && rates[5] > 620.0);
        let capacity = report.capacity.unwrap();
        assert!(capacity <= 620.0, "{capacity}");
        let lowest_not_held = report
            .runs
            .iter()
            .filter(|r| !r.held())
            .map(|r| r.rate)
            .fold(f64::INFINITY, f64::min);
        assert!(lowest_not_held <= capacity * 1.1, "{rates:?}");
        assert_eq!(report.exit_code(), 0);
        // The overload run at 1.5× the capacity is there and judged.
        let overload = report
            .overload
            .iter()
            .find(|v| (v.factor - 1.5).abs() < 0.01)
            .unwrap();
        assert_eq!(overload.answered_ratio, Some(2.5));
        assert_eq!(overload.ack_ratio, Some(2.25));
        assert_eq!(overload.answered_within, Some(true));
        assert_eq!(overload.ack_within, Some(false));
        assert_eq!(overload.refused_at_once, Some(true));
        assert!(!overload.graceful());
        let table = report.markdown();
        assert!(
            table.contains("| yes |") && table.contains("**no**"),
            "{table}"
        );
    }

    #[tokio::test]
    async fn the_run_budget_ends_the_search() {
        let report = search(&config(100.0), model(620.0), || false)
            .await
            .unwrap();
        // Eight search runs, then the overload run.
        assert_eq!(report.runs.len(), 9);
    }

    #[tokio::test]
    async fn a_start_above_the_limit_shrinks_until_one_holds() {
        let report = search(&config(1000.0), model(300.0), || false)
            .await
            .unwrap();
        let rates: Vec<f64> = report.runs.iter().map(|r| r.rate).collect();
        assert_eq!(&rates[..3], &[1000.0, 666.7, 444.5]);
        let capacity = report.capacity.unwrap();
        assert!((270.0..=300.0).contains(&capacity), "{rates:?}");
    }

    #[tokio::test]
    async fn a_system_that_holds_nothing_has_no_capacity_and_exits_3() {
        let mut c = config(4.0);
        c.capacity.max_runs = 30;
        let report = search(&c, model(0.1), || false).await.unwrap();
        assert_eq!(report.capacity, None);
        assert!(report.overload.is_empty());
        assert!(report.runs.iter().all(|r| r.rate >= MIN_RATE));
        assert_eq!(report.exit_code(), 3);
        assert!(report.markdown().contains("no rate held"));
    }

    #[tokio::test]
    async fn a_run_that_loses_writes_fails_the_search() {
        let mut system = model(500.0);
        let lossy = move |rate: f64| {
            let figures = system(rate);
            async move {
                let mut figures = figures.await?;
                figures.passed = rate < 600.0;
                Ok(figures)
            }
        };
        let report = search(&config(400.0), lossy, || false).await.unwrap();
        assert!(
            report.failed_runs.contains(&600.0),
            "{:?}",
            report.failed_runs
        );
        assert_eq!(report.exit_code(), 1);
        assert!(report.markdown().contains("FAILED"));
    }

    #[test]
    fn a_refusal_is_at_once_within_twice_an_appends_ack() {
        let at = RunFigures {
            rate: 100.0,
            answered_p99_ms: Some(10.0),
            ack_p99_ms: Some(4.0),
            ..RunFigures::default()
        };
        let above = |refused_p99: f64| RunFigures {
            rate: 150.0,
            refused: 5,
            refused_p99_ms: Some(refused_p99),
            ..at.clone()
        };
        assert_eq!(
            OverloadVerdict::of(&above(7.9), &at).refused_at_once,
            Some(true)
        );
        assert_eq!(
            OverloadVerdict::of(&above(8.1), &at).refused_at_once,
            Some(false)
        );
        let none = RunFigures {
            refused: 0,
            ..above(100.0)
        };
        assert_eq!(OverloadVerdict::of(&none, &at).refused_at_once, None);
    }

    #[test]
    fn bad_search_settings_are_refused() {
        for search in [
            CapacitySearch {
                resolution: 0.0,
                ..CapacitySearch::default()
            },
            CapacitySearch {
                max_runs: 0,
                ..CapacitySearch::default()
            },
            CapacitySearch {
                overload: vec![0.5],
                ..CapacitySearch::default()
            },
            CapacitySearch {
                overload: vec![f64::NAN],
                ..CapacitySearch::default()
            },
        ] {
            assert!(search.validate().is_err(), "{search:?}");
        }
        assert!(CapacitySearch::default().validate().is_ok());
    }
}

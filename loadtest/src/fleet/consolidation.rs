//! Consolidation and document merging during the load: what the consolidator did, what it
//! cost, how far behind it ran, how much it shrank what retrieval searches, and how fast the
//! docs projector merged the boards.
//!
//! Three sources, each for what only it knows:
//! - **the stream**, read once by the verification ([`StreamTally`]): the text memories the
//!   agents wrote, every consolidation output by what it is, the memories the consolidator's
//!   `forgotten` events hid, the `doc_changed` events. Any target has it.
//! - **the target's metrics**, scraped before and after the load ([`super::metrics`]):
//!   consolidation runs and their time, a projector's batch time. Only where the
//!   consolidator's process serves them: `engram up` started here, or a remote deployment
//!   given `--metrics`; not projectors in processes of their own (chaos mode).
//! - **the processes**: CPU time of a consolidator in its own process (chaos mode).
//!
//! A figure no source gives is absent, with the reason, never 0.

use std::collections::{BTreeMap, HashSet};

use engram_schema::{Envelope, EventKind};
use serde::Serialize;

use super::metrics::{HistogramDelta, Scrape};

/// The consolidator's agent id (`engram_consolidate::steps::CONSOLIDATOR`).
const CONSOLIDATOR: &str = "consolidator";

/// The run's part of the stream, as the report needs it (the load test's tenant only).
#[derive(Clone, Debug, Default, Serialize)]
pub struct StreamTally {
    /// Text memories the load test's agents wrote: what retrieval searches without
    /// consolidation.
    pub agent_memories: u64,
    /// Text memories consolidation wrote (merged memories and session summaries).
    pub consolidated_memories: u64,
    /// Consolidation outputs by what they are: `merged`, `summary`, `restored`
    /// (`consolidated` events), `superseded`, `archived` (`forgotten` ones), `promoted`
    /// (skills), `other`.
    pub outputs: BTreeMap<String, u64>,
    /// Memories of the run the consolidator's `forgotten` events hid.
    pub hidden: u64,
    /// Text memories of the run retrieval still searches: the agents' and consolidation's,
    /// less the hidden.
    pub searchable: u64,
    /// `doc_changed` events: board pushes the docs projector merged.
    pub doc_changes: u64,
    #[serde(skip)]
    memories: HashSet<String>,
    #[serde(skip)]
    hidden_ids: HashSet<String>,
}

impl StreamTally {
    /// Counts one event of the load test's tenant; true if it is an append an instance
    /// makes through its ledger (not a board push, a consolidation output or a usage report).
    pub(crate) fn add(&mut self, event: &Envelope) -> bool {
        let by_consolidator = event.agent_id.as_str() == CONSOLIDATOR;
        let text_memory = engram_memory::is_text_memory(event);
        if event.kind == EventKind::DocChanged {
            self.doc_changes += 1;
            return false;
        }
        if !by_consolidator {
            if text_memory {
                self.agent_memories += 1;
                self.memories.insert(event.event_id.as_str().to_owned());
            }
            // Usage reports (`feedback`) are the query service's; the workload writes none.
            return event.kind != EventKind::Feedback;
        }
        let data = event.content.data.as_ref();
        let output = match event.kind {
            EventKind::Consolidated => data
                .and_then(|d| d.get("op"))
                .and_then(|op| op.as_str())
                .unwrap_or("other")
                .to_owned(),
            EventKind::Forgotten => {
                let named = data
                    .and_then(|d| d.get("event_ids"))
                    .and_then(|ids| ids.as_array())
                    .into_iter()
                    .flatten()
                    .filter_map(|id| id.as_str());
                self.hidden_ids.extend(named.map(str::to_owned));
                if data.is_some_and(|d| d.get("superseded_by").is_some()) {
                    "superseded".to_owned()
                } else if data.is_some_and(|d| d.get("archived").is_some()) {
                    "archived".to_owned()
                } else {
                    "forgotten".to_owned()
                }
            }
            EventKind::SkillRecorded => "promoted".to_owned(),
            _ => "other".to_owned(),
        };
        *self.outputs.entry(output).or_default() += 1;
        if text_memory && event.kind == EventKind::Consolidated {
            self.consolidated_memories += 1;
            self.memories.insert(event.event_id.as_str().to_owned());
        }
        false
    }

    /// Counts the hidden and the searchable once the stream is read.
    pub(crate) fn finish(&mut self) {
        self.hidden = self
            .memories
            .iter()
            .filter(|id| self.hidden_ids.contains(*id))
            .count() as u64;
        self.searchable = self.memories.len() as u64 - self.hidden;
    }
}

/// How much consolidation shrank what retrieval searches, over the run's memories.
#[derive(Clone, Debug, Serialize)]
pub struct Shrink {
    /// Before consolidation: every text memory the agents wrote.
    pub before: u64,
    /// After: those and consolidation's own, less what consolidation hid.
    pub after: u64,
    /// Memories hidden (superseded by a merge, or archived).
    pub hidden: u64,
    /// Memories consolidation added (merged copies, session summaries).
    pub added: u64,
    /// `after` against `before`, in percent (negative: fewer to search).
    pub change_percent: f64,
}

/// What consolidation did during the run and what it cost.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Consolidation {
    /// The schedule the engram processes started here ran with (0: off); `None` for a
    /// remote deployment, whose own applies.
    pub interval_secs: Option<f64>,
    /// Scheduled runs during the run (`engram_consolidation_run_seconds`), their time in
    /// all, on average, and the histogram bucket bounds their median and slowest fell in.
    pub runs: Option<u64>,
    pub run_secs_total: Option<f64>,
    pub run_secs_mean: Option<f64>,
    pub run_secs_p50_at_most: Option<f64>,
    pub run_secs_max_at_most: Option<f64>,
    /// Outputs the runs appended (`engram_consolidation_outputs_total{outcome="appended"}`);
    /// duplicates the stream stored once count each time.
    pub outputs_appended: Option<u64>,
    /// Outputs in the stream, by what they are (see [`StreamTally::outputs`]).
    pub outputs: BTreeMap<String, u64>,
    /// The consolidator projector's lag during the load, sampled each second.
    pub lag_max_events: Option<u64>,
    pub lag_mean_events: Option<f64>,
    /// From the end of the load until the consolidator had applied the whole stream.
    pub caught_up_secs_after_load: Option<f64>,
    /// Events the consolidator applied during the run.
    pub events_applied: Option<u64>,
    /// Scheduled runs' time per event applied, µs: what planning and appending the
    /// outputs cost per event of the workload.
    pub run_us_per_event: Option<f64>,
    /// The consolidator projector's batch time per event applied, µs: keeping its model of
    /// every scope's memories up to date.
    pub apply_us_per_event: Option<f64>,
    /// CPU time of the consolidator's process per event applied, µs (both of the above and
    /// its queries); only where it runs in a process of its own.
    pub process_cpu_us_per_event: Option<f64>,
    pub shrink: Option<Shrink>,
    /// Figures this run could not measure, and why.
    pub absent: BTreeMap<String, String>,
}

/// The docs projector's merging of the boards during the run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DocsMerge {
    /// `doc_changed` events in the run's part of the stream, all applied by the docs
    /// projector (the verification checks it applied the whole stream).
    pub doc_changes: Option<u64>,
    /// Those per second of the measured window: the rate it merged them at, which is the
    /// rate they came (it kept up when its lag stayed low).
    pub changes_per_sec: Option<f64>,
    /// The docs projector's batch time during the run
    /// (`engram_projector_batch_seconds{projector="docs"}`); its batches hold every event of
    /// the stream, and it skips all but `doc_changed` at once.
    pub busy_secs: Option<f64>,
    /// Batch time per `doc_changed` event, ms: the mean merge cost of a change.
    pub ms_per_change: Option<f64>,
    /// `doc_changed` events per second of batch time: what the projector sustains.
    pub changes_per_busy_sec: Option<f64>,
    /// Figures this run could not measure, and why.
    pub absent: BTreeMap<String, String>,
}

/// The target's metrics at the edges of the run, or why there are none.
pub(crate) type MetricsPair = Result<(Scrape, Scrape), String>;

/// What the consolidation and merge figures are built from.
pub(crate) struct Inputs<'a> {
    pub(crate) metrics: &'a MetricsPair,
    /// Set when the consolidator and docs projectors run in processes of their own.
    pub(crate) separate_projectors: bool,
    pub(crate) tally: Option<&'a StreamTally>,
    pub(crate) interval_secs: Option<f64>,
    /// Each sampled second's consolidator lag.
    pub(crate) lag: &'a [Option<u64>],
    pub(crate) caught_up_secs_after_load: Option<f64>,
    /// Events applied during the run, by projector (from the verification).
    pub(crate) applied: BTreeMap<String, u64>,
    /// The consolidator process's CPU seconds over the run, if it has its own.
    pub(crate) process_cpu_secs: Option<f64>,
    pub(crate) measured_secs: f64,
}

impl Inputs<'_> {
    /// The metrics of the projectors' process, or why there are none.
    fn projector_metrics(&self) -> Result<(&Scrape, &Scrape), String> {
        if self.separate_projectors {
            return Err(
                "the projectors run in processes of their own, which serve no metrics".into(),
            );
        }
        self.metrics
            .as_ref()
            .map(|(before, after)| (before, after))
            .map_err(Clone::clone)
    }
}

fn per_event_us(secs: f64, events: Option<u64>) -> Option<f64> {
    events.filter(|&n| n > 0).map(|n| secs * 1e6 / n as f64)
}

pub(crate) fn consolidation(inputs: &Inputs<'_>) -> Consolidation {
    let mut out = Consolidation {
        interval_secs: inputs.interval_secs,
        events_applied: inputs.applied.get(CONSOLIDATOR).copied(),
        caught_up_secs_after_load: inputs.caught_up_secs_after_load,
        ..Consolidation::default()
    };
    let lag: Vec<u64> = inputs.lag.iter().flatten().copied().collect();
    out.lag_max_events = lag.iter().max().copied();
    out.lag_mean_events =
        (!lag.is_empty()).then(|| lag.iter().sum::<u64>() as f64 / lag.len() as f64);
    if lag.is_empty() {
        out.absent.insert(
            "lag".into(),
            "the consolidator never answered the sampler".into(),
        );
    }
    if out.events_applied.is_none() {
        out.absent.insert(
            "events_applied".into(),
            "the consolidator's ledger was not verified".into(),
        );
    }
    match inputs.projector_metrics() {
        Ok((before, after)) => {
            let runs =
                HistogramDelta::between(before, after, "engram_consolidation_run_seconds", &[]);
            match runs {
                Some(runs) => {
                    out.runs = Some(runs.count.round() as u64);
                    out.run_secs_total = Some(runs.sum);
                    out.run_secs_mean = (runs.count > 0.0).then(|| runs.sum / runs.count);
                    out.run_secs_p50_at_most = runs.quantile_bound(0.5);
                    out.run_secs_max_at_most = runs.quantile_bound(1.0);
                    out.run_us_per_event = per_event_us(runs.sum, out.events_applied);
                }
                None => {
                    out.absent.insert(
                        "runs".into(),
                        "the target's metrics have no engram_consolidation_run_seconds (no consolidator there)".into(),
                    );
                }
            }
            let appended = [("outcome", "appended")];
            out.outputs_appended = after
                .sum("engram_consolidation_outputs_total", &appended)
                .map(|a| {
                    (a - before
                        .sum("engram_consolidation_outputs_total", &appended)
                        .unwrap_or(0.0))
                    .round() as u64
                });
            match HistogramDelta::between(
                before,
                after,
                "engram_projector_batch_seconds",
                &[("projector", CONSOLIDATOR)],
            ) {
                Some(batches) => {
                    out.apply_us_per_event = per_event_us(batches.sum, out.events_applied);
                }
                None => {
                    out.absent.insert(
                        "apply_us_per_event".into(),
                        "the target's metrics have no consolidator batch times".into(),
                    );
                }
            }
        }
        Err(why) => {
            for figure in ["runs", "run_us_per_event", "apply_us_per_event"] {
                out.absent.insert(figure.into(), why.clone());
            }
        }
    }
    match inputs.process_cpu_secs {
        Some(cpu) => out.process_cpu_us_per_event = per_event_us(cpu, out.events_applied),
        None => {
            out.absent.insert(
                "process_cpu_us_per_event".into(),
                "the consolidator shares its process with the other projectors (or runs elsewhere)"
                    .into(),
            );
        }
    }
    match inputs.tally {
        Some(tally) => {
            out.outputs = tally.outputs.clone();
            let before = tally.agent_memories;
            out.shrink = Some(Shrink {
                before,
                after: tally.searchable,
                hidden: tally.hidden,
                added: tally.consolidated_memories,
                change_percent: if before == 0 {
                    0.0
                } else {
                    (tally.searchable as f64 - before as f64) * 100.0 / before as f64
                },
            });
        }
        None => {
            for figure in ["outputs", "shrink"] {
                out.absent
                    .insert(figure.into(), "the stream was not verified".into());
            }
        }
    }
    out
}

pub(crate) fn docs_merge(inputs: &Inputs<'_>) -> DocsMerge {
    let mut out = DocsMerge {
        doc_changes: inputs.tally.map(|t| t.doc_changes),
        ..DocsMerge::default()
    };
    out.changes_per_sec = out
        .doc_changes
        .map(|n| n as f64 / inputs.measured_secs.max(1e-9));
    if out.doc_changes.is_none() {
        out.absent
            .insert("doc_changes".into(), "the stream was not verified".into());
    }
    match inputs.projector_metrics().and_then(|(before, after)| {
        HistogramDelta::between(
            before,
            after,
            "engram_projector_batch_seconds",
            &[("projector", "docs")],
        )
        .ok_or_else(|| "the target's metrics have no docs batch times".to_owned())
    }) {
        Ok(batches) => {
            out.busy_secs = Some(batches.sum);
            if let Some(n) = out.doc_changes.filter(|&n| n > 0) {
                out.ms_per_change = Some(batches.sum * 1e3 / n as f64);
                out.changes_per_busy_sec = (batches.sum > 0.0).then(|| n as f64 / batches.sum);
            }
        }
        Err(why) => {
            out.absent.insert("busy_secs".into(), why);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
    use serde_json::json;

    use super::*;

    fn event(agent: &str, layer: Layer, kind: EventKind, data: serde_json::Value) -> Envelope {
        let id = |v: &str| Ident::parse("id", v).unwrap();
        Envelope::new(
            id("bench"),
            Scope::new(ScopeKind::Task, "t1").unwrap(),
            id(agent),
            id(agent),
            layer,
            kind,
            Content {
                text: "the login handler returns a 500 error".into(),
                data: Some(data),
            },
        )
    }

    /// Given three agent memories, two of them merged by the consolidator, and a summary
    /// of the third, when the stream is tallied, then the two merged sources are hidden and
    /// the merged copy and the summary are searchable beside the third.
    #[test]
    fn given_a_merge_and_a_summary_the_tally_counts_what_retrieval_still_searches() {
        let mut tally = StreamTally::default();
        let a = event(
            "coder-0001",
            Layer::Episodic,
            EventKind::Observation,
            json!({}),
        );
        let b = event(
            "coder-0001",
            Layer::Episodic,
            EventKind::Observation,
            json!({}),
        );
        let c = event("coder-0002", Layer::Episodic, EventKind::Action, json!({}));
        for e in [&a, &b, &c] {
            assert!(tally.add(e), "an agent's append");
        }
        let ids = [a.event_id.as_str(), b.event_id.as_str()];
        let merged = event(
            CONSOLIDATOR,
            Layer::Semantic,
            EventKind::Consolidated,
            json!({"op": "merged", "sources": ids, "recurrences": 2}),
        );
        let superseded = event(
            CONSOLIDATOR,
            Layer::Semantic,
            EventKind::Forgotten,
            json!({"event_ids": ids, "superseded_by": merged.event_id.as_str()}),
        );
        let summary = event(
            CONSOLIDATOR,
            Layer::Semantic,
            EventKind::Consolidated,
            json!({"op": "summary", "sources": [c.event_id.as_str()]}),
        );
        let mut board = event(
            "coder-0001",
            Layer::Working,
            EventKind::DocChanged,
            json!({}),
        );
        board.event_id = EventId::new();
        for e in [&merged, &superseded, &summary, &board] {
            assert!(!tally.add(e), "not a ledger append");
        }
        tally.finish();
        assert_eq!(tally.agent_memories, 3);
        assert_eq!(tally.consolidated_memories, 2);
        assert_eq!(tally.hidden, 2);
        assert_eq!(tally.searchable, 3, "c, the merged copy and the summary");
        assert_eq!(tally.doc_changes, 1);
        assert_eq!(
            tally.outputs,
            BTreeMap::from([
                ("merged".to_owned(), 1),
                ("summary".to_owned(), 1),
                ("superseded".to_owned(), 1)
            ])
        );
    }

    #[test]
    fn figures_without_a_source_are_absent_with_a_reason() {
        let metrics: MetricsPair = Err("a remote deployment; pass --metrics".into());
        let inputs = Inputs {
            metrics: &metrics,
            separate_projectors: false,
            tally: None,
            interval_secs: None,
            lag: &[Some(3), None, Some(1)],
            caught_up_secs_after_load: Some(0.2),
            applied: BTreeMap::from([(CONSOLIDATOR.to_owned(), 100)]),
            process_cpu_secs: None,
            measured_secs: 10.0,
        };
        let c = consolidation(&inputs);
        assert_eq!(c.runs, None);
        assert_eq!(c.lag_max_events, Some(3));
        assert_eq!(c.lag_mean_events, Some(2.0));
        assert!(c.absent["runs"].contains("--metrics"), "{:?}", c.absent);
        assert!(c.absent.contains_key("shrink"));
        let d = docs_merge(&inputs);
        assert_eq!(d.doc_changes, None);
        assert!(d.absent.contains_key("busy_secs"));
    }
}

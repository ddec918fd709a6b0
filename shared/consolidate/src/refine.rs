//! The post-pass that lets a [`Summariser`] other than the extractive one write a plan's
//! session summaries, and turns the facts it proposes into candidate `fact_asserted` events.
//!
//! A plan stays a synchronous, deterministic function of the model ([`crate::plan`]); this
//! pass runs after it, where waiting is allowed. It is in two halves so that the model's
//! lock is never held across a call: [`Unrefined::new`] copies each summary's source texts
//! out of the model (run it where the plan ran, on a blocking thread), and [`refine()`] calls
//! the summariser, at most [`RefineOptions::concurrency`] calls at once.
//!
//! # What it changes, and what it must not
//! - A summary keeps its event id, which derives from its inputs (scope and the checkpoint
//!   that finished the session), not from its text. An LLM is not deterministic, so two
//!   replicas (or a scheduled run and an on-demand one) may write different texts under one
//!   id; the stream stores whichever is appended first and deduplicates the other, and once
//!   applied the model plans that id no more. So every replica still converges on one
//!   summary per session, though not a text a replay could recompute: the log, not the
//!   plan, is the record of it.
//! - When a call fails (timeout, unreachable, non-2xx, an unusable answer) the plan's
//!   extractive summary is kept, with a warning and
//!   `engram_consolidation_summariser_failures_total{reason}`; the run goes on.
//! - At most [`RefineOptions::max_summaries`] summaries are sent per run. The plan's other
//!   summaries are held back: they are planned again, with the same ids, by the next run,
//!   as events past `max_events` are.
//! - Candidate facts never compete with what agents assert: they are `multi` (a candidate
//!   ends no other value of its predicate, while a later `single` assertion ends it),
//!   asserted with a confidence below 1, tagged `candidate`, and carry no text, so they are
//!   not text memories: retrieval does not show them as memories, and no later summary or
//!   merge reads them back (an LLM summarising its own guesses).

use std::collections::BTreeMap;

use engram_memory::ScopeKey;
use engram_schema::{Content, Envelope, EventId, EventKind, Layer};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::model::Memories;
use crate::summariser::{CandidateFact, Summariser, SummariserError};

/// The tag every candidate fact carries.
pub const CANDIDATE_TAG: &str = "candidate";

/// How much one run may ask of the summariser.
#[derive(Clone, Debug, PartialEq)]
pub struct RefineOptions {
    /// Summaries sent to the summariser per run; the plan's others wait for the next run.
    pub max_summaries: usize,
    /// Calls in flight at once.
    pub concurrency: usize,
    /// Most bytes of memory text copied per summary, oldest first.
    pub max_input_bytes: usize,
    /// The `confidence` of every candidate fact.
    pub candidate_confidence: f64,
    /// When set, a call still running at this instant fails as timed out (and the
    /// extractive summary is kept): for a caller that must answer within its own deadline.
    pub deadline: Option<tokio::time::Instant>,
}

impl Default for RefineOptions {
    fn default() -> Self {
        Self {
            max_summaries: 16,
            concurrency: 2,
            max_input_bytes: 32 * 1024,
            candidate_confidence: 0.5,
            deadline: None,
        }
    }
}

impl RefineOptions {
    /// The defaults, with what `config` sets.
    pub fn of(config: &crate::summariser::SummariserConfig) -> Self {
        Self {
            max_input_bytes: config.max_input_bytes(),
            candidate_confidence: config.candidate_confidence(),
            ..Self::default()
        }
    }
}

/// A plan's events, with the source texts of the summaries to be refined.
#[derive(Debug)]
pub struct Unrefined {
    events: Vec<Envelope>,
    /// Index in `events` of each summary to refine, with its sources' texts in order.
    texts: Vec<(usize, Vec<String>)>,
}

impl Unrefined {
    /// Reads from `memories` what refining `events` needs: each `consolidated` summary's
    /// sources (`content.data.sources`), in order, up to `options.max_input_bytes`. With a
    /// summariser that does not refine plans there is nothing to read. Summaries past
    /// `options.max_summaries` are dropped from the events (planned again next run).
    pub fn new(
        memories: &Memories,
        events: Vec<Envelope>,
        summariser: &dyn Summariser,
        options: &RefineOptions,
    ) -> Self {
        let mut unrefined = Self {
            events,
            texts: Vec::new(),
        };
        if !summariser.refines_plan() {
            return unrefined;
        }
        let mut kept = Vec::with_capacity(unrefined.events.len());
        for event in std::mem::take(&mut unrefined.events) {
            let Some(sources) = summary_sources(&event) else {
                kept.push(event);
                continue;
            };
            if unrefined.texts.len() == options.max_summaries {
                continue;
            }
            let texts = source_texts(memories, &event, &sources, options.max_input_bytes);
            if !texts.is_empty() {
                unrefined.texts.push((kept.len(), texts));
            }
            kept.push(event);
        }
        unrefined.events = kept;
        unrefined
    }

    /// The events as planned, unrefined.
    pub fn into_events(self) -> Vec<Envelope> {
        self.events
    }

    /// How many summaries [`refine()`] will send.
    pub fn summaries(&self) -> usize {
        self.texts.len()
    }
}

/// The source ids of a `consolidated` summary event.
fn summary_sources(event: &Envelope) -> Option<Vec<&str>> {
    if event.kind != EventKind::Consolidated {
        return None;
    }
    let data = event.content.data.as_ref()?;
    if data.get("op").and_then(Value::as_str) != Some("summary") {
        return None;
    }
    Some(
        data.get("sources")?
            .as_array()?
            .iter()
            .filter_map(Value::as_str)
            .collect(),
    )
}

fn source_texts(
    memories: &Memories,
    summary: &Envelope,
    sources: &[&str],
    max_bytes: usize,
) -> Vec<String> {
    let Some(state) = memories.scope(&ScopeKey::of(summary)) else {
        return Vec::new();
    };
    let mut texts = Vec::new();
    let mut bytes = 0;
    for id in sources {
        let Some(memory) = state.memory(id) else {
            continue;
        };
        if bytes >= max_bytes {
            break;
        }
        bytes += memory.text.len();
        texts.push(memory.text.clone());
    }
    texts
}

/// The plan with its summaries written by `summariser`, each followed by its candidate
/// facts. Never fails: a summary whose call fails keeps its extractive text.
pub async fn refine(
    unrefined: Unrefined,
    summariser: &dyn Summariser,
    options: &RefineOptions,
) -> Vec<Envelope> {
    let Unrefined { mut events, texts } = unrefined;
    if texts.is_empty() {
        return events;
    }
    let results: Vec<(usize, Result<_, SummariserError>)> = futures::stream::iter(texts)
        .map(|(index, texts)| async move {
            let call = summariser.summarise(&texts);
            let result = match options.deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, call)
                    .await
                    .unwrap_or(Err(SummariserError::Deadline)),
                None => call.await,
            };
            (index, result)
        })
        .buffered(options.concurrency.max(1))
        .collect()
        .await;
    let mut candidates: BTreeMap<usize, Vec<Envelope>> = BTreeMap::new();
    for (index, result) in results {
        let summary = &mut events[index];
        match result {
            Ok(written) => {
                summary.content.text = written.text;
                let facts = written
                    .facts
                    .iter()
                    .enumerate()
                    .map(|(i, fact)| candidate(summary, i, fact, options.candidate_confidence))
                    .filter(|event| match event.validate() {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::debug!(summary_id = %summary.event_id, error = %e, "candidate fact dropped");
                            false
                        }
                    })
                    .collect();
                candidates.insert(index, facts);
            }
            Err(e) => {
                engram_telemetry::metrics::CONSOLIDATION_SUMMARISER_FAILURES
                    .with_label_values(&[e.reason()])
                    .inc();
                tracing::warn!(
                    tenant = %summary.tenant,
                    scope = %summary.scope,
                    summary_id = %summary.event_id,
                    summariser = summariser.kind(),
                    reason = e.reason(),
                    error = %e,
                    "session summary kept extractive: the summariser failed"
                );
            }
        }
    }
    if candidates.is_empty() {
        return events;
    }
    let mut out =
        Vec::with_capacity(events.len() + candidates.values().map(Vec::len).sum::<usize>());
    for (index, event) in events.into_iter().enumerate() {
        out.push(event);
        if let Some(facts) = candidates.remove(&index) {
            out.extend(facts);
        }
    }
    out
}

/// Candidate fact `index` of `summary`: written like the summary (its tenant, scope,
/// consolidator writer, clock and correlation), caused by it, with an id derived from it.
fn candidate(summary: &Envelope, index: usize, fact: &CandidateFact, confidence: f64) -> Envelope {
    let mut event = Envelope::new(
        summary.tenant.clone(),
        summary.scope.clone(),
        summary.agent_id.clone(),
        summary.instance_id.clone(),
        Layer::Semantic,
        EventKind::FactAsserted,
        Content {
            text: String::new(),
            data: Some(json!({
                "subject": fact.subject,
                "predicate": fact.predicate,
                "object": fact.object,
                "confidence": confidence,
                "cardinality": "multi",
            })),
        },
    );
    event.event_id =
        EventId::derived(&["candidate", summary.event_id.as_str(), &index.to_string()]);
    event.occurred_at = summary.occurred_at;
    event.recorded_at = summary.recorded_at;
    event.importance = 0.5;
    event.tags = vec![CANDIDATE_TAG.to_owned()];
    event.causation_id = Some(summary.event_id.clone());
    event.correlation_id = summary.correlation_id.clone();
    event
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use engram_fixtures::models::{event, scope, t};
    use engram_memory::model::EventModel;
    use engram_schema::{FactAsserted, Payload};

    use super::*;
    use crate::summariser::{Extractive, SessionSummary};
    use crate::{Policy, plan};

    /// Writes "llm: <first text>" and proposes one fact per text; fails on "fail".
    #[derive(Default)]
    struct Scripted {
        calls: Mutex<Vec<Vec<String>>>,
    }

    #[async_trait::async_trait]
    impl Summariser for Scripted {
        fn kind(&self) -> &'static str {
            "scripted"
        }
        async fn summarise(&self, texts: &[String]) -> Result<SessionSummary, SummariserError> {
            self.calls.lock().unwrap().push(texts.to_vec());
            if texts.iter().any(|t| t.contains("fail")) {
                return Err(SummariserError::Http {
                    url: "http://scripted".into(),
                    status: 503,
                    body: "overloaded".into(),
                });
            }
            Ok(SessionSummary {
                text: format!("llm: {}", texts[0]),
                facts: texts
                    .iter()
                    .map(|t| CandidateFact {
                        subject: "session".into(),
                        predicate: "mentions".into(),
                        object: json!(t.split_whitespace().next().unwrap()),
                    })
                    .collect(),
            })
        }
    }

    /// `sessions` finished sessions of one scope, each of the given texts.
    fn model(sessions: &[&[&str]]) -> (Memories, ScopeKey) {
        let team = scope("acme", "core");
        let mut memories = Memories::default();
        let mut seq = 0;
        for (s, texts) in sessions.iter().enumerate() {
            for text in *texts {
                let mut e = event(
                    &team,
                    Layer::Episodic,
                    EventKind::Observation,
                    None,
                    t(&format!("2026-01-0{}", s + 1)),
                );
                e.content.text = (*text).into();
                seq += 1;
                memories.apply(seq, &e).unwrap();
            }
            let finished = event(
                &team,
                Layer::Working,
                EventKind::Checkpoint,
                Some(json!({"finished": true})),
                t(&format!("2026-01-0{}T12:00:00Z", s + 1)),
            );
            seq += 1;
            memories.apply(seq, &finished).unwrap();
        }
        (memories, team)
    }

    #[tokio::test]
    async fn summaries_are_rewritten_and_followed_by_their_candidate_facts() {
        let (memories, team) = model(&[&[
            "billing drops rows with a null region.",
            "importer writes the null regions.",
        ]]);
        let planned = plan(&memories, &team, &Policy::default(), &["summarise"]).events;
        assert_eq!(planned.len(), 1);
        let summariser = Scripted::default();
        let options = RefineOptions::default();
        let unrefined = Unrefined::new(&memories, planned.clone(), &summariser, &options);
        assert_eq!(unrefined.summaries(), 1);
        let events = refine(unrefined, &summariser, &options).await;
        assert_eq!(events.len(), 3, "{events:#?}");
        let summary = &events[0];
        assert_eq!(
            summary.event_id, planned[0].event_id,
            "the id is the plan's"
        );
        assert_eq!(
            summary.content.text,
            "llm: billing drops rows with a null region."
        );
        assert_eq!(summary.content.data, planned[0].content.data);
        summary.validate().unwrap();
        assert_eq!(
            summariser.calls.lock().unwrap().clone(),
            vec![vec![
                "billing drops rows with a null region.".to_owned(),
                "importer writes the null regions.".to_owned()
            ]]
        );
        for (i, fact) in events[1..].iter().enumerate() {
            fact.validate().unwrap();
            let Some(Payload::FactAsserted(payload)) = Payload::of(fact).unwrap() else {
                panic!("{fact:?}")
            };
            assert_eq!(payload.confidence(), 0.5);
            assert_eq!(payload.cardinality(), engram_schema::Cardinality::Multi);
            assert_eq!(
                fact.event_id,
                EventId::derived(&["candidate", summary.event_id.as_str(), &i.to_string()])
            );
            assert_eq!(fact.causation_id.as_ref(), Some(&summary.event_id));
            assert_eq!(fact.tags, vec![CANDIDATE_TAG.to_owned()]);
            assert_eq!(
                (fact.tenant.clone(), fact.scope.clone()),
                (summary.tenant.clone(), summary.scope.clone())
            );
            assert_eq!(fact.agent_id.as_str(), crate::steps::CONSOLIDATOR);
            assert_eq!(fact.occurred_at, summary.occurred_at);
            assert!(!engram_memory::is_text_memory(fact));
            let _: FactAsserted = FactAsserted::from_event(fact).unwrap();
        }
    }

    #[tokio::test]
    async fn a_failed_call_keeps_the_extractive_summary_and_the_rest_go_on() {
        let (memories, team) = model(&[
            &["please fail this session now."],
            &["deploys wait for the migration lock."],
        ]);
        let planned = plan(&memories, &team, &Policy::default(), &["summarise"]).events;
        assert_eq!(planned.len(), 2);
        let summariser = Scripted::default();
        let options = RefineOptions::default();
        let events = refine(
            Unrefined::new(&memories, planned.clone(), &summariser, &options),
            &summariser,
            &options,
        )
        .await;
        assert_eq!(events.len(), 3);
        assert_eq!(events[0], planned[0], "unchanged");
        assert_eq!(
            events[1].content.text,
            "llm: deploys wait for the migration lock."
        );
        assert_eq!(events[2].kind, EventKind::FactAsserted);
    }

    #[tokio::test]
    async fn summaries_past_the_cap_wait_and_the_extractive_summariser_changes_nothing() {
        let (memories, team) = model(&[
            &["one session here."],
            &["two session here."],
            &["three session here."],
        ]);
        let planned = plan(&memories, &team, &Policy::default(), &[]).events;
        assert_eq!(planned.len(), 3);
        let summariser = Scripted::default();
        let options = RefineOptions {
            max_summaries: 2,
            ..RefineOptions::default()
        };
        let unrefined = Unrefined::new(&memories, planned.clone(), &summariser, &options);
        assert_eq!(unrefined.summaries(), 2);
        let events = refine(unrefined, &summariser, &options).await;
        let summaries: Vec<_> = events
            .iter()
            .filter(|e| e.kind == EventKind::Consolidated)
            .map(|e| e.event_id.clone())
            .collect();
        assert_eq!(
            summaries,
            vec![planned[0].event_id.clone(), planned[1].event_id.clone()]
        );

        let unrefined = Unrefined::new(&memories, planned.clone(), &Extractive, &options);
        assert_eq!(unrefined.summaries(), 0);
        assert_eq!(refine(unrefined, &Extractive, &options).await, planned);
    }

    #[tokio::test]
    async fn a_call_past_the_deadline_keeps_the_extractive_summary() {
        struct Slow;
        #[async_trait::async_trait]
        impl Summariser for Slow {
            fn kind(&self) -> &'static str {
                "slow"
            }
            async fn summarise(&self, _: &[String]) -> Result<SessionSummary, SummariserError> {
                tokio::time::sleep(std::time::Duration::from_secs(3_600)).await;
                unreachable!("the deadline passes first")
            }
        }
        let (memories, team) = model(&[&["a slow session indeed."]]);
        let planned = plan(&memories, &team, &Policy::default(), &[]).events;
        let options = RefineOptions {
            deadline: Some(tokio::time::Instant::now() + std::time::Duration::from_millis(50)),
            ..RefineOptions::default()
        };
        let events = refine(
            Unrefined::new(&memories, planned.clone(), &Slow, &options),
            &Slow,
            &options,
        )
        .await;
        assert_eq!(events, planned);
    }
}

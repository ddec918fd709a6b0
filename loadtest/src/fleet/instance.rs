//! One simulated agent identity over the run: an instance that works through its task on an
//! open-loop schedule, and, for some, dies midway and is succeeded by a fresh instance that
//! takes over the identity: it bootstraps its scopes' memory (snapshot slices and the tail
//! after them), then replays the same scopes from the start to check that every event its
//! predecessors were acknowledged is there.
//!
//! A step is due every `instances / rate` seconds, whatever happened to the previous one.
//! Steps run in order, as an agent's do; when one runs late, the next starts late, and the
//! lateness counts towards its append's latency. That is what keeps coordinated omission
//! from hiding a stall: a stalled server makes every step due during the stall slow, not
//! just the one that hit it.
//!
//! A step appends one event, then, as the agent needs it:
//! - recalls the write it just made with its consistency token (read-your-writes) and checks
//!   it is there, in both the dense and the keyword index. It asks with the write's marker,
//!   which the write's text and tags carry, so that both indexes must match it: a miss is a
//!   violation, never a question that happened to share no word with the text;
//! - after a fact assertion, asks for that fact's history with the token and checks the
//!   assertion is in it;
//! - after a skill record, asks for the skill by name with the token and checks the record
//!   is the version the registry serves (or that a later record superseded it);
//! - builds its context for the next step with its latest token;
//! - asks its memory an ordinary question (no token).

use std::sync::Arc;
use std::time::Duration;

use engram_memory::MemoryFilter;
use engram_memory::proto::{
    Consistency, ContextRequest, ErrorCode, FactsRequest, RetrievalMode, RetrieveRequest,
    RetrieveResponse, ScopeRequest, SkillsRequest,
};
use engram_rpc::RpcError;
use engram_schema::{Embedding, Envelope, EventKind, Ident, Layer, SubjectFilter};
use engram_sdk::bootstrap::BootstrapError;
use engram_sdk::{Client, RetryPolicy, StartAt};
use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::record::{Acked, Check, Metric, Recorder};

/// The longest pause before asking a refused query again: the SDK's own backoff ceiling.
const MAX_BUSY_PAUSE: Duration = Duration::from_secs(2);
use super::sampler::projector_ledger;
use super::span::LoadSpan;
use super::target::{CLIENT_DIM, CLIENT_MODEL, EmbedderChoice, projectors};
use crate::workload::{AgentProfile, AgentWorkload};

/// What every instance shares.
pub(crate) struct Shared {
    pub(crate) recorder: Arc<Recorder>,
    pub(crate) clients: Vec<Client>,
    pub(crate) team_size: usize,
    pub(crate) period: Duration,
    pub(crate) start: Instant,
    /// When the load ends: no step due at or after it runs.
    pub(crate) load: Arc<LoadSpan>,
    /// How long after the load's end read-your-writes checks still waiting give up (counted
    /// as unchecked).
    pub(crate) drain_limit: Duration,
    pub(crate) churn: f64,
    pub(crate) recall: f64,
    pub(crate) fact_check: f64,
    pub(crate) skill_check: f64,
    pub(crate) doc_edit: f64,
    pub(crate) offline: f64,
    pub(crate) boards: Arc<super::docs::Boards>,
    pub(crate) context_every: u64,
    pub(crate) query: f64,
    /// Share of episodic memories that repeat a recent one, and every how many events a
    /// session finishes: what consolidation works on (see
    /// [`AgentWorkload::consolidation_material`]).
    pub(crate) duplicates: f64,
    pub(crate) finish_every: u64,
    pub(crate) wait: Duration,
    pub(crate) embedder: EmbedderChoice,
    pub(crate) seed: u64,
    /// Set on ctrl-c: instances finish their step and stop.
    pub(crate) stop: tokio::sync::watch::Receiver<bool>,
}

impl Shared {
    /// Read-your-writes checks and retries still waiting at this point give up: the load's
    /// end and the drain limit, or, while a fault holds the load open, not yet.
    pub(crate) fn give_up(&self) -> Instant {
        match self.load.end() {
            (_, true) => Instant::now() + self.drain_limit,
            (end, false) => end + self.drain_limit,
        }
    }
}

/// Identity `index`'s seed in a run seeded with `seed`.
fn identity_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The content identity `index` of a run seeded with `seed` generates, exactly as the run
/// does: to reproduce what a run wrote. A run with duplicates or finished sessions adds them
/// with [`AgentWorkload::consolidation_material`].
pub fn workload_of(seed: u64, index: usize, team_size: usize) -> AgentWorkload {
    AgentWorkload::new(
        AgentProfile::new(index, team_size),
        identity_seed(seed, index),
    )
}

/// Runs identity `index` until the end of the load.
pub(crate) async fn run(shared: Arc<Shared>, index: usize) {
    let seed = identity_seed(shared.seed, index);
    let mut rng = SmallRng::seed_from_u64(seed.rotate_left(17));
    let profile = AgentProfile::new(index, shared.team_size);
    let mut agent = Instance {
        client: shared.clients[index % shared.clients.len()].clone(),
        workload: workload_of(shared.seed, index, shared.team_size)
            .consolidation_material(shared.duplicates, shared.finish_every),
        profile,
        last_seq: None,
        context_phase: rng.random_range(0..shared.context_every.max(1)),
        private_acked: Vec::new(),
        rng: SmallRng::seed_from_u64(seed.rotate_left(29)),
        shared: shared.clone(),
        board: None,
        offline: None,
    };
    let offset = shared.period.mul_f64(rng.random::<f64>());
    // Deaths and offline spells fall within the load as it was asked for.
    let run_for = shared.load.length();
    let due_at = |step: u64| shared.start + offset + shared.period * step as u32;
    // Successions happen in the middle of the run, so both generations do real work.
    let mut dies_at = rng
        .random_bool(shared.churn.clamp(0.0, 1.0))
        .then(|| shared.start + run_for.mul_f64(rng.random_range(0.2..0.8)));
    agent.offline = rng
        .random_bool(shared.offline.clamp(0.0, 1.0))
        .then(|| (shared.start + run_for / 3, shared.start + run_for * 2 / 3));
    // Each step is counted due when its time comes, not up front: a chaos fault may hold
    // the load open past `duration` (see [`LoadSpan`]).
    for step in 0u64.. {
        let due = due_at(step);
        if *shared.stop.borrow() {
            break;
        }
        if let Some(end) = shared.load.ended(Instant::now()) {
            // Fallen so far behind that the load is over: the steps still owed are missed,
            // not run late, so an overloaded run ends on time and says how far short it fell.
            let owed = (step..).take_while(|&s| due_at(s) < end).count() as u64;
            shared.recorder.steps_due(owed);
            shared.recorder.missed(owed);
            break;
        }
        if let Some(dies) = dies_at.filter(|&t| due >= t) {
            // The instance dies at its time, not at its next step: its successor starts up
            // (bootstrap, and the replay that checks its predecessor) between steps, as a
            // real one would, and makes a step late only by running past it. Taken over at
            // the step, the start-up counted as that append's latency.
            tokio::time::sleep_until(dies).await;
            dies_at = None;
            agent.die_and_succeed().await;
        }
        tokio::time::sleep_until(due).await;
        if !shared.load.includes(due) {
            break;
        }
        shared.recorder.steps_due(1);
        agent.step(step, due).await;
    }
    // Back online at the end: what it edited offline goes now.
    agent.push_board().await;
}

struct Instance {
    client: Client,
    workload: AgentWorkload,
    profile: AgentProfile,
    /// The highest sequence this instance was acknowledged: its consistency token.
    last_seq: Option<u64>,
    /// Which of every `context_every` steps builds a context. Random per instance: with the
    /// same phase everywhere, every instance built its context in the same step period, a
    /// synchronised burst no real fleet produces.
    context_phase: u64,
    /// Ids acknowledged in the private scope, by this identity's instances so far.
    private_acked: Vec<String>,
    rng: SmallRng,
    shared: Arc<Shared>,
    /// The team's task board, as this instance's copy; opened on its first edit.
    board: Option<super::docs::Board>,
    /// When this instance works offline, if it does.
    offline: Option<(Instant, Instant)>,
}

impl Instance {
    fn scopes(&self) -> ScopeRequest {
        ScopeRequest {
            tenant: self.profile.tenant.clone(),
            scope: self.profile.team_scope.clone(),
            grants: vec![self.profile.private_scope.clone()],
        }
    }

    fn vector(&self, text: &str) -> Option<Vec<f32>> {
        (self.shared.embedder == EmbedderChoice::Client).then(|| hash_vector(text))
    }

    /// In client-vector mode, the event carries its own vector, as the embedder expects.
    fn attach_vector(&self, event: &mut Envelope) {
        if let Some(vector) = self.vector(&event.content.text) {
            event.embedding = Some(Embedding {
                model: CLIENT_MODEL.to_owned(),
                vector,
            });
        }
    }

    async fn step(&mut self, step: u64, due: Instant) {
        let recorder = self.shared.recorder.clone();
        recorder.step_run();
        // How late the step started: its earlier steps ran over, or the runtime was starved.
        // It counts towards the append's latency, which is the open-loop correction; the
        // step's own context build before the append does not.
        let late = Instant::now().saturating_duration_since(due);
        if (step + self.context_phase).is_multiple_of(self.shared.context_every.max(1)) {
            self.build_context().await;
        }
        let mut event = self.workload.next_event();
        let marker = format!("ref-{:012x}", self.rng.random::<u64>() >> 16);
        let text_memory = matches!(event.layer, Layer::Episodic | Layer::Semantic);
        if text_memory {
            // A unique tag lets the writer find exactly this memory again, whatever else the
            // scope holds; the text names it too, as agents quote ticket and commit ids.
            event.tags.push(marker.clone());
            event.content.text.push_str(&format!(" ({marker})"));
        }
        self.attach_vector(&mut event);
        let sent = Instant::now();
        let attempt = recorder.attempt("append");
        let receipt = match self.client.append(&event).await {
            Ok(receipt) => receipt,
            Err(e) => {
                recorder.error(
                    attempt,
                    "append",
                    e.kind(),
                    e.is_retryable(),
                    &e.to_string(),
                );
                return;
            }
        };
        let acked = Instant::now();
        recorder.latency(Metric::Ack, late + (acked - sent), acked);
        recorder.latency(Metric::AckService, acked - sent, acked);
        let private = event.scope == self.profile.private_scope;
        if private {
            self.private_acked.push(receipt.event_id.clone());
        }
        recorder.acked(
            Acked {
                event_id: receipt.event_id.clone(),
                seq: receipt.seq,
                bytes: u32::try_from(receipt.bytes).unwrap_or(u32::MAX),
            },
            receipt.duplicate,
            acked,
        );
        self.last_seq = Some(self.last_seq.unwrap_or(0).max(receipt.seq));

        // A repeated text may be merged away by consolidation at any moment, so it is not
        // recalled: a miss would say nothing about visibility.
        let repeated = self.workload.last_was_duplicate();
        if text_memory && self.rng.random_bool(self.shared.recall) && !repeated {
            self.recall_own_write(&event, &marker, receipt.seq, acked)
                .await;
        }
        if event.kind == EventKind::FactAsserted && self.rng.random_bool(self.shared.fact_check) {
            self.check_fact(&event, receipt.seq).await;
        }
        if event.kind == EventKind::SkillRecorded && self.rng.random_bool(self.shared.skill_check) {
            self.check_skill(&event, receipt.seq).await;
        }
        if self.rng.random_bool(self.shared.query) {
            self.ask().await;
        }
        if self.rng.random_bool(self.shared.doc_edit) {
            self.edit_board(step).await;
        }
    }

    /// One edit of the team's board (opened on the first), pushed unless offline.
    async fn edit_board(&mut self, step: u64) {
        let recorder = self.shared.recorder.clone();
        let p = &self.profile;
        if self.board.is_none() {
            let attempt = recorder.attempt("doc_open");
            // The board's client waits out `busy` itself (the SDK's default): its open is a
            // compound of requests whose refusals the load test does not time one by one.
            let patient = Client::from_bus(self.client.bus().clone(), RetryPolicy::default());
            let agent = match patient.agent(
                p.tenant.as_str(),
                p.agent_id.as_str(),
                p.instance_id.as_str(),
            ) {
                Ok(agent) => agent,
                Err(e) => {
                    return recorder.error(attempt, "doc_open", "invalid", false, &e.to_string());
                }
            };
            match super::docs::Board::open(&agent, p.team_scope.clone(), self.offline).await {
                Ok(board) => self.board = Some(board),
                Err(e) => {
                    return recorder.error(
                        attempt,
                        "doc_open",
                        "unavailable",
                        true,
                        &e.to_string(),
                    );
                }
            }
        }
        let board = self.board.as_mut().expect("opened above");
        let attempt = recorder.attempt("doc_edit");
        if let Err(e) = board
            .edit(
                &self.shared.boards,
                &p.tenant,
                &p.team_scope,
                p.instance_id.as_str(),
                step,
            )
            .await
        {
            recorder.error(attempt, "doc_edit", "unavailable", true, &e.to_string());
        }
    }

    /// Pushes what the board copy holds unsent (end of the run).
    async fn push_board(&mut self) {
        let p = &self.profile;
        if let Some(board) = self.board.as_mut() {
            let attempt = self.shared.recorder.attempt("doc_edit");
            if let Err(e) = board
                .push(&self.shared.boards, &p.tenant, &p.team_scope)
                .await
            {
                self.shared.recorder.error(
                    attempt,
                    "doc_edit",
                    "unavailable",
                    true,
                    &e.to_string(),
                );
            }
        }
    }

    /// Read-your-writes: the write must come back, from both indexes, once the token is
    /// visible. A wait that runs out is retried (an agent would); results without the write
    /// are a violation.
    ///
    /// The query is the write's marker: the text ends with it and the tag filter names it, so
    /// the keyword index must match it by construction (a workload question shares words with
    /// the text only by chance) and the dense side must rank the one memory the filter lets
    /// through.
    async fn recall_own_write(&mut self, event: &Envelope, marker: &str, seq: u64, acked: Instant) {
        let recorder = self.shared.recorder.clone();
        recorder.check_due(Check::Recall);
        let query = marker.to_owned();
        let request = RetrieveRequest {
            scopes: self.scopes(),
            vector: self.vector(&query),
            query,
            top_k: 5,
            filter: MemoryFilter {
                tags: vec![marker.to_owned()],
                ..MemoryFilter::default()
            },
            consistency: self.consistency(Some(seq)),
            mode: RetrievalMode::Hybrid,
            ranking: None,
        };
        if request.vector.is_none() {
            // The server embeds: the keyword side can show the write before the embedding
            // ends, so its visibility is measured on its own first.
            let by_keyword = RetrieveRequest {
                mode: RetrievalMode::Keyword,
                ..request.clone()
            };
            let Some((response, now)) = self.recall(&by_keyword).await else {
                return;
            };
            if response
                .results
                .iter()
                .any(|r| r.event_id.as_str() == event.event_id.as_str())
            {
                recorder.latency(Metric::KeywordVisibility, now - acked, now);
            } else {
                let what = format!(
                    "missing from a keyword read-your-writes retrieve that returned {} results",
                    response.results.len()
                );
                self.invisible(event, seq, &what, &by_keyword, &response)
                    .await;
                return;
            }
        }
        let Some((response, now)) = self.recall(&request).await else {
            return;
        };
        let found = response
            .results
            .iter()
            .find(|r| r.event_id.as_str() == event.event_id.as_str());
        let what = match found {
            Some(hit) if hit.parts.dense.is_some() && hit.parts.keyword.is_some() => {
                recorder.latency(Metric::Visibility, now - acked, now);
                recorder.check_passed(Check::Recall);
                return;
            }
            Some(hit) => format!(
                "came back from only one index: dense {:?}, keyword {:?}",
                hit.parts.dense, hit.parts.keyword
            ),
            None => format!(
                "missing from a read-your-writes retrieve that returned {} results",
                response.results.len()
            ),
        };
        self.invisible(event, seq, &what, &request, &response).await;
    }

    /// A read-your-writes retrieve, asked until answered, with when its answer came.
    async fn recall(&self, request: &RetrieveRequest) -> Option<(RetrieveResponse, Instant)> {
        let response = self
            .until_answered("recall", Check::Recall, |client| {
                let request = request.clone();
                async move { client.retrieve(&request).await }
            })
            .await?;
        Some((response, Instant::now()))
    }

    /// Records the write as invisible to a read-your-writes retrieve: what went wrong, and
    /// what each projector had made visible just after.
    async fn invisible(
        &self,
        event: &Envelope,
        seq: u64,
        what: &str,
        request: &RetrieveRequest,
        response: &RetrieveResponse,
    ) {
        let projectors = self.visible_now().await;
        self.shared.recorder.invisible(
            Check::Recall,
            format!(
                "{} (seq {seq}, {}) {what}; query {:?}; text {:?}; the retrieve read {:?}; projectors' visible seqs just after: {projectors}",
                event.event_id, event.scope, request.query, event.content.text, response.visible
            ),
        );
    }

    /// Each projector's visible sequence at this moment, for a report of a violation.
    async fn visible_now(&self) -> String {
        let mut out = Vec::with_capacity(projectors().len());
        for name in projectors() {
            out.push(
                match projector_ledger(self.client.bus().client(), name).await {
                    Ok(l) => format!("{name} {}", l.visible_seq),
                    Err(e) => format!("{name} not answering ({e})"),
                },
            );
        }
        out.join(", ")
    }

    /// The fact just asserted must be in its (subject, predicate) history.
    async fn check_fact(&mut self, event: &Envelope, seq: u64) {
        let recorder = self.shared.recorder.clone();
        recorder.check_due(Check::Fact);
        let data = event.content.data.as_ref();
        let field = |name: &str| {
            data.and_then(|d| d.get(name))
                .and_then(|v| v.as_str())
                .map(str::to_owned)
        };
        let request = FactsRequest {
            scopes: self.scopes(),
            subject: field("subject"),
            predicate: field("predicate"),
            text: None,
            valid_at: None,
            known_at: None,
            history: true,
            limit: 1_000,
            consistency: self.consistency(Some(seq)),
        };
        let started = Instant::now();
        let Some(response) = self
            .until_answered("facts", Check::Fact, |client| {
                let request = request.clone();
                async move { client.facts(&request).await }
            })
            .await
        else {
            return;
        };
        let now = Instant::now();
        recorder.latency(Metric::Facts, now - started, now);
        let id = event.event_id.as_str();
        let found = response.facts.iter().any(|fact| {
            fact.get("sources")
                .and_then(|s| s.as_array())
                .is_some_and(|sources| {
                    sources.iter().any(|s| {
                        s.pointer("/provenance/event_id")
                            .and_then(|v| v.as_str())
                            .is_some_and(|v| v == id)
                    })
                })
        });
        if found {
            recorder.check_passed(Check::Fact);
        } else {
            let projectors = self.visible_now().await;
            recorder.invisible(
                Check::Fact,
                format!(
                    "fact {id} (seq {seq}) missing from its history ({} versions, facts visible seq {}); asked {:?}; projectors' visible seqs just after: {projectors}",
                    response.facts.len(),
                    response.visible_seq,
                    (&request.subject, &request.predicate),
                ),
            );
        }
    }

    /// The skill just recorded must be what the registry serves under its name, unless a
    /// later record of that name (a teammate's) has superseded it: then the version served
    /// must come from a later sequence, which the registry can only hold if it applied this
    /// one in order before it.
    async fn check_skill(&mut self, event: &Envelope, seq: u64) {
        let recorder = self.shared.recorder.clone();
        recorder.check_due(Check::Skill);
        let name = event
            .content
            .data
            .as_ref()
            .and_then(|d| d.get("name"))
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        let request = SkillsRequest {
            scopes: ScopeRequest {
                tenant: self.profile.tenant.clone(),
                scope: event.scope.clone(),
                grants: Vec::new(),
            },
            task: None,
            name,
            limit: 10,
            consistency: self.consistency(Some(seq)),
        };
        let started = Instant::now();
        let Some(response) = self
            .until_answered("skills", Check::Skill, |client| {
                let request = request.clone();
                async move { client.skills(&request).await }
            })
            .await
        else {
            return;
        };
        let now = Instant::now();
        recorder.latency(Metric::Skills, now - started, now);
        let id = event.event_id.as_str();
        let served = response.skills.first().and_then(|skill| {
            let source = skill.get("source")?;
            Some((
                source.get("seq")?.as_u64()?,
                source.get("event_id")?.as_str()?.to_owned(),
            ))
        });
        match served {
            Some((s, served_id)) if s == seq && served_id == id => {
                recorder.check_passed(Check::Skill)
            }
            Some((s, _)) if s > seq => recorder.check_superseded(Check::Skill),
            other => {
                let projectors = self.visible_now().await;
                recorder.invisible(
                    Check::Skill,
                    format!(
                        "skill record {id} (seq {seq}, {}) is not what the registry serves under {:?}: it serves {other:?} (seq, event id), skills visible seq {}; projectors' visible seqs just after: {projectors}",
                        event.scope, request.name, response.visible_seq
                    ),
                );
            }
        }
    }

    async fn build_context(&mut self) {
        let recorder = self.shared.recorder.clone();
        let query = self.workload.question();
        let request = ContextRequest {
            scopes: self.scopes(),
            agent_id: self.profile.agent_id.clone(),
            task: self.profile.team_scope.id.as_str().to_owned(),
            vector: self.vector(&query),
            query,
            token_budget: 1_024,
            consistency: self.consistency(self.last_seq),
        };
        let started = Instant::now();
        let answer = self
            .unless_busy("context", |client| {
                let request = request.clone();
                async move { client.build_context(&request).await }
            })
            .await;
        match answer {
            Ok(_) => {
                let now = Instant::now();
                recorder.latency(Metric::Context, now - started, now);
            }
            Err((attempt, e)) => recorder.error(
                attempt,
                "context",
                error_kind(&e),
                e.is_retryable(),
                &e.to_string(),
            ),
        }
    }

    async fn ask(&mut self) {
        let recorder = self.shared.recorder.clone();
        let query = self.workload.question();
        let request = RetrieveRequest {
            scopes: self.scopes(),
            vector: self.vector(&query),
            query,
            top_k: 10,
            filter: MemoryFilter::default(),
            consistency: Consistency::default(),
            mode: RetrievalMode::Hybrid,
            ranking: None,
        };
        let started = Instant::now();
        let answer = self
            .unless_busy("query", |client| {
                let request = request.clone();
                async move { client.retrieve(&request).await }
            })
            .await;
        match answer {
            Ok(_) => {
                let now = Instant::now();
                recorder.latency(Metric::Query, now - started, now);
            }
            Err((attempt, e)) => recorder.error(
                attempt,
                "query",
                error_kind(&e),
                e.is_retryable(),
                &e.to_string(),
            ),
        }
    }

    fn consistency(&self, min_seq: Option<u64>) -> Consistency {
        Consistency {
            min_seq,
            wait_ms: min_seq.map(|_| self.shared.wait.as_millis() as u64),
        }
    }

    /// Calls until an answer comes back: a read-your-writes timeout or an unavailable
    /// service (a restarting server or projector) is retried until the run's give-up point.
    /// `None` if it never answered or the request was refused; either way the check counts
    /// as unchecked, which fails the run.
    async fn until_answered<T, F, Fut>(&self, operation: &str, check: Check, call: F) -> Option<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, RpcError>>,
    {
        let recorder = &self.shared.recorder;
        loop {
            match self.unless_busy(operation, &call).await {
                Ok(answer) => return Some(answer),
                Err((attempt, e)) => {
                    if e.code() == ErrorCode::NotYetVisible {
                        recorder.visibility_timeout();
                    } else {
                        recorder.error(
                            attempt,
                            operation,
                            error_kind(&e),
                            e.is_retryable(),
                            &e.to_string(),
                        );
                        if !e.is_retryable() {
                            recorder.unchecked(Some(check));
                            return None;
                        }
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    if Instant::now() >= self.shared.give_up() {
                        recorder.unchecked(Some(check));
                        return None;
                    }
                }
            }
        }
    }

    /// One query, asked as an agent asks it: refused `busy`, it is asked again after a
    /// pause that starts at the service's retry-after and doubles (jittered), until it is
    /// answered, fails otherwise, or the run's give-up point passes. Each try counts as an
    /// attempt; each refusal is recorded with its time from send to refusal, and the answered
    /// try with its own (`Metric::Answered`). A failure comes back with its attempt.
    async fn unless_busy<T, F, Fut>(
        &self,
        operation: &str,
        call: F,
    ) -> Result<T, (super::record::Attempt, RpcError)>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, RpcError>>,
    {
        let recorder = &self.shared.recorder;
        let mut pause = engram_rpc::BUSY_RETRY_AFTER;
        loop {
            let attempt = recorder.attempt(operation);
            let sent = Instant::now();
            let answer = call(self.client.clone()).await;
            let now = Instant::now();
            match answer {
                Ok(answer) => {
                    recorder.latency(Metric::Answered, now - sent, now);
                    return Ok(answer);
                }
                Err(e) if e.code() == ErrorCode::Busy && now < self.shared.give_up() => {
                    recorder.refused(operation, now - sent, now);
                    tokio::time::sleep(pause.mul_f64(rand::random_range(0.5..1.0))).await;
                    pause = (pause * 2).min(MAX_BUSY_PAUSE);
                }
                Err(e) => return Err((attempt, e)),
            }
        }
    }

    /// The instance dies (an append may be in flight, its ack never seen), and a fresh
    /// instance takes over the identity: it bootstraps the memory of its scopes, as a real
    /// successor starts, then replays the same scopes from the start and must find every
    /// event its predecessors were acknowledged in the private one. The replay is the ground
    /// truth and the bootstrap's physical reference: both are timed.
    async fn die_and_succeed(&mut self) {
        let mut last_words = self.workload.next_event();
        self.attach_vector(&mut last_words);
        // Abandoned mid-flight: it may or may not be stored, and it is not in the ledger.
        let _ = tokio::time::timeout(
            Duration::from_micros(self.rng.random_range(50..2_000)),
            self.client.append(&last_words),
        )
        .await;

        let generation = self.profile.instance_id.as_str().matches('-').count();
        let successor = format!("{}-{}", self.profile.instance_id.as_str(), generation);
        let instance_id = Ident::parse("instance_id", &successor)
            .expect("generated instance ids use only [a-z0-9-]");
        self.profile.instance_id = instance_id.clone();
        self.workload.set_instance(instance_id);
        self.last_seq = None;
        // The board copy dies with the instance, unpushed edits with it.
        self.board = None;

        let recorder = self.shared.recorder.clone();
        let through = self.bootstrap().await;
        let started = Instant::now();
        let Some((seen, max_seq)) = self.replay_scopes().await else {
            recorder.unchecked(None);
            return;
        };
        let now = Instant::now();
        recorder.latency(Metric::Takeover, now - started, now);
        let missing = self
            .private_acked
            .iter()
            .filter(|id| !seen.contains(id.as_str()))
            .count() as u64;
        recorder.takeover(self.private_acked.len() as u64, missing);
        // The successor reads with the furthest of what it bootstrapped and replayed.
        let token = max_seq.max(through.unwrap_or(0));
        self.last_seq = (token > 0).then_some(token);
    }

    /// The successor's bootstrap of its scopes (private and team): the sequence its memory
    /// holds everything up to. Retryable failures are retried until the run's give-up
    /// point; `None` if none completed.
    async fn bootstrap(&self) -> Option<u64> {
        let recorder = &self.shared.recorder;
        let scopes = self.scopes();
        let started = Instant::now();
        loop {
            let attempt = recorder.attempt("bootstrap");
            match self.client.bootstrap(&scopes, None).await {
                Ok(booted) => {
                    let now = Instant::now();
                    recorder.latency(Metric::Bootstrap, now - started, now);
                    recorder.bootstrapped(
                        booted.snapshots.iter().any(|(_, s)| s.is_some()),
                        booted.replayed,
                        booted.skipped.len() as u64,
                    );
                    return Some(booted.memory.through);
                }
                // Retention removed history of the stream that no snapshot covers (a
                // deployment that held history before the run, cut none yet): refusing is
                // right, loading the gap would not be. Counted, not an error; the replay
                // after it still checks the scopes.
                Err(BootstrapError::TailGone { .. }) => {
                    recorder.bootstrap_refused_tail_gone();
                    return None;
                }
                // One of its queries refused at the service's in-flight bound: the
                // designed answer to overload, counted as a refusal, asked again.
                Err(BootstrapError::Rpc(e))
                    if e.code() == ErrorCode::Busy && Instant::now() < self.shared.give_up() =>
                {
                    recorder.refused_in("bootstrap");
                    tokio::time::sleep(engram_rpc::BUSY_RETRY_AFTER).await;
                }
                Err(e) => {
                    let (kind, retryable) = bootstrap_error_kind(&e);
                    recorder.error(attempt, "bootstrap", kind, retryable, &e.to_string());
                    if !retryable || Instant::now() >= self.shared.give_up() {
                        recorder.bootstrap_failed();
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    }

    /// The successor's replay of the scopes it bootstrapped, private then team: every event
    /// id in them and the highest sequence. `None` if a replay never completed.
    async fn replay_scopes(&self) -> Option<(std::collections::HashSet<String>, u64)> {
        let mut seen = std::collections::HashSet::new();
        let mut max_seq = 0;
        for scope in [&self.profile.private_scope, &self.profile.team_scope] {
            let filter = SubjectFilter::all()
                .tenant(self.profile.tenant.clone())
                .scope(scope.kind, scope.id.clone());
            let (ids, seq) = self.replay(&filter).await?;
            seen.extend(ids);
            max_seq = max_seq.max(seq);
        }
        Some((seen, max_seq))
    }

    /// One scope's replay from the start: its event ids and highest sequence. A replay cut
    /// short by an outage starts again, until the run's give-up point; `None` if none
    /// completed.
    async fn replay(
        &self,
        filter: &SubjectFilter,
    ) -> Option<(std::collections::HashSet<String>, u64)> {
        let recorder = &self.shared.recorder;
        loop {
            let attempt = recorder.attempt("takeover");
            let failed = match self.client.replay(filter, StartAt::Beginning).await {
                Ok(mut events) => {
                    let mut seen = std::collections::HashSet::new();
                    let mut max_seq = 0;
                    let mut failed = None;
                    while let Some(event) = events.next().await {
                        match event {
                            Ok(stored) => {
                                max_seq = max_seq.max(stored.seq);
                                seen.insert(stored.event.event_id.as_str().to_owned());
                            }
                            // An event refused by the reader is in the stream but not the
                            // scope's: nothing retrying changes.
                            Err(e @ engram_bus::ReadError::Decode { .. }) => {
                                recorder.error(
                                    attempt,
                                    "takeover",
                                    "refused_event",
                                    false,
                                    &e.to_string(),
                                );
                            }
                            Err(e) => {
                                failed = Some(e.to_string());
                                break;
                            }
                        }
                    }
                    match failed {
                        None => return Some((seen, max_seq)),
                        Some(e) => e,
                    }
                }
                Err(e) if !e.is_retryable() => {
                    recorder.error(attempt, "takeover", "bus", false, &e.to_string());
                    return None;
                }
                Err(e) => e.to_string(),
            };
            recorder.error(attempt, "takeover", "unavailable", true, &failed);
            if Instant::now() >= self.shared.give_up() {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// A bootstrap failure's kind, and whether bootstrapping again may succeed.
fn bootstrap_error_kind(e: &BootstrapError) -> (&'static str, bool) {
    match e {
        BootstrapError::Rpc(e) => (error_kind(e), e.is_retryable()),
        BootstrapError::Bus(e) => ("bus", e.is_retryable()),
        // The read was cut short (a restarting server): read again.
        BootstrapError::Read(engram_bus::ReadError::Consumer(_)) => ("read", true),
        BootstrapError::Read(engram_bus::ReadError::Decode { .. }) => ("refused_event", false),
        BootstrapError::Scope(_) => ("scope", false),
        BootstrapError::Slice { .. } => ("slice", false),
        // Counted apart by the caller; never reaches here.
        BootstrapError::TailGone { .. } => ("tail_gone", false),
        BootstrapError::TailTooLong => ("tail_too_long", false),
    }
}

fn error_kind(e: &RpcError) -> &'static str {
    match e {
        RpcError::Service { code, .. } => match code {
            ErrorCode::Invalid => "invalid",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotYetVisible => "not_yet_visible",
            ErrorCode::Busy => "busy",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        },
        RpcError::NoResponders { .. } => "no_responders",
        RpcError::Timeout { .. } => "timeout",
        RpcError::Transport { .. } => "transport",
        RpcError::BadReply { .. } => "bad_reply",
    }
}

/// A small deterministic text vector (feature hashing of words), for runs where the client
/// supplies vectors: similar texts get similar vectors, at no model cost.
pub fn hash_vector(text: &str) -> Vec<f32> {
    let mut v = vec![0f32; CLIENT_DIM];
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        let h = blake3::hash(word.to_lowercase().as_bytes());
        let bytes = h.as_bytes();
        let slot = usize::from(bytes[0]) % CLIENT_DIM;
        let sign = if bytes[1] & 1 == 0 { 1.0 } else { -1.0 };
        v[slot] += sign;
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    } else {
        v[0] = 1.0;
    }
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn hash_vectors_are_unit_length_and_deterministic() {
        let a = super::hash_vector("the login handler returns a 500 error");
        assert_eq!(a.len(), super::CLIENT_DIM);
        assert!((a.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-4);
        assert_eq!(
            a,
            super::hash_vector("The login handler returns a 500 error")
        );
        assert_eq!(super::hash_vector("").len(), super::CLIENT_DIM);
    }
}

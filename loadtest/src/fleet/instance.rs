//! One simulated agent identity over the run: an instance that works through its task on an
//! open-loop schedule, and, for some, dies midway and is succeeded by a fresh instance that
//! takes over the identity by replaying its private scope.
//!
//! A step is due every `instances / rate` seconds, whatever happened to the previous one.
//! Steps run in order, as an agent's do; when one runs late, the next starts late, and the
//! lateness counts towards its append's latency. That is what keeps coordinated omission
//! from hiding a stall: a stalled server makes every step due during the stall slow, not
//! just the one that hit it.
//!
//! A step appends one event, then, as the agent needs it:
//! - recalls the write it just made with its consistency token (read-your-writes) and checks
//!   it is there, in both the dense and the keyword index;
//! - after a fact assertion, asks for that fact's history with the token and checks the
//!   assertion is in it;
//! - builds its context for the next step with its latest token;
//! - asks its memory an ordinary question (no token).

use std::sync::Arc;
use std::time::Duration;

use engram_memory::MemoryFilter;
use engram_memory::proto::{
    Consistency, ContextRequest, ErrorCode, FactsRequest, RetrievalMode, RetrieveRequest,
    ScopeRequest,
};
use engram_rpc::RpcError;
use engram_schema::{Embedding, Envelope, EventKind, Ident, Layer, SubjectFilter};
use engram_sdk::{Client, StartAt};
use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::record::{Acked, Metric, Recorder};
use super::target::{CLIENT_DIM, CLIENT_MODEL, EmbedderChoice};
use crate::workload::{AgentProfile, AgentWorkload};

/// What every instance shares.
pub(crate) struct Shared {
    pub(crate) recorder: Arc<Recorder>,
    pub(crate) clients: Vec<Client>,
    pub(crate) team_size: usize,
    pub(crate) period: Duration,
    pub(crate) start: Instant,
    /// No step starts at or after this.
    pub(crate) end: Instant,
    /// Read-your-writes checks still waiting at this point give up (counted as unchecked).
    pub(crate) give_up: Instant,
    pub(crate) churn: f64,
    pub(crate) recall: f64,
    pub(crate) fact_check: f64,
    pub(crate) context_every: u64,
    pub(crate) query: f64,
    pub(crate) wait: Duration,
    pub(crate) embedder: EmbedderChoice,
    pub(crate) seed: u64,
    /// Set on ctrl-c: instances finish their step and stop.
    pub(crate) stop: tokio::sync::watch::Receiver<bool>,
}

/// Runs identity `index` until the end of the load.
pub(crate) async fn run(shared: Arc<Shared>, index: usize) {
    let seed = shared.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rng = SmallRng::seed_from_u64(seed.rotate_left(17));
    let profile = AgentProfile::new(index, shared.team_size);
    let mut agent = Instance {
        client: shared.clients[index % shared.clients.len()].clone(),
        workload: AgentWorkload::new(profile.clone(), seed),
        profile,
        last_seq: None,
        context_phase: rng.random_range(0..shared.context_every.max(1)),
        private_acked: Vec::new(),
        rng: SmallRng::seed_from_u64(seed.rotate_left(29)),
        shared: shared.clone(),
    };
    let offset = shared.period.mul_f64(rng.random::<f64>());
    let run_for = shared.end.saturating_duration_since(shared.start);
    // Successions happen in the middle of the run, so both generations do real work.
    let mut dies_at = rng
        .random_bool(shared.churn.clamp(0.0, 1.0))
        .then(|| shared.start + run_for.mul_f64(rng.random_range(0.2..0.8)));
    for step in 0u64.. {
        let due = shared.start + offset + shared.period * step as u32;
        if due >= shared.end || *shared.stop.borrow() {
            break;
        }
        if Instant::now() >= shared.end {
            // Fallen so far behind that the load is over: the steps still owed are missed,
            // not run late, so an overloaded run ends on time and says how far short it fell.
            let owed = (shared.end - due).as_secs_f64() / shared.period.as_secs_f64();
            shared.recorder.missed(owed.ceil() as u64);
            break;
        }
        tokio::time::sleep_until(due).await;
        if dies_at.is_some_and(|t| due >= t) {
            dies_at = None;
            agent.die_and_succeed().await;
        }
        agent.step(step, due).await;
    }
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
        let receipt = match self.client.append(&event).await {
            Ok(receipt) => receipt,
            Err(e) => {
                recorder.error("append", e.kind(), &e.to_string());
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

        if text_memory && self.rng.random_bool(self.shared.recall) {
            self.recall_own_write(&event, &marker, receipt.seq, acked)
                .await;
        }
        if event.kind == EventKind::FactAsserted && self.rng.random_bool(self.shared.fact_check) {
            self.check_fact(&event, receipt.seq).await;
        }
        if self.rng.random_bool(self.shared.query) {
            self.ask().await;
        }
    }

    /// Read-your-writes: the write must come back, from both indexes, once the token is
    /// visible. A wait that runs out is retried (an agent would); results without the write
    /// are a violation.
    async fn recall_own_write(&mut self, event: &Envelope, marker: &str, seq: u64, acked: Instant) {
        let recorder = self.shared.recorder.clone();
        let query = self.workload.question();
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
        let Some(response) = self
            .until_answered("recall", |client| {
                let request = request.clone();
                async move { client.retrieve(&request).await }
            })
            .await
        else {
            return;
        };
        let now = Instant::now();
        let found = response
            .results
            .iter()
            .find(|r| r.event_id.as_str() == event.event_id.as_str());
        match found {
            Some(hit) if hit.parts.dense.is_some() && hit.parts.keyword.is_some() => {
                recorder.latency(Metric::Visibility, now - acked, now);
            }
            Some(hit) => recorder.invisible(format!(
                "{} (seq {seq}) came back from only one index: dense {:?}, keyword {:?}",
                event.event_id, hit.parts.dense, hit.parts.keyword
            )),
            None => recorder.invisible(format!(
                "{} (seq {seq}, {}) missing from a read-your-writes retrieve that saw {:?}",
                event.event_id, event.scope, response.visible
            )),
        }
    }

    /// The fact just asserted must be in its (subject, predicate) history.
    async fn check_fact(&mut self, event: &Envelope, seq: u64) {
        let recorder = self.shared.recorder.clone();
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
            .until_answered("facts", |client| {
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
        if !found {
            recorder.invisible(format!(
                "fact {id} (seq {seq}) missing from its history ({} versions)",
                response.facts.len()
            ));
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
        match self.client.build_context(&request).await {
            Ok(_) => {
                let now = Instant::now();
                recorder.latency(Metric::Context, now - started, now);
            }
            Err(e) => recorder.error("context", error_kind(&e), &e.to_string()),
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
        match self.client.retrieve(&request).await {
            Ok(_) => {
                let now = Instant::now();
                recorder.latency(Metric::Query, now - started, now);
            }
            Err(e) => recorder.error("query", error_kind(&e), &e.to_string()),
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
    /// `None` if it never answered or the request was refused.
    async fn until_answered<T, F, Fut>(&self, operation: &str, call: F) -> Option<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, RpcError>>,
    {
        let recorder = &self.shared.recorder;
        loop {
            match call(self.client.clone()).await {
                Ok(answer) => return Some(answer),
                Err(e) => {
                    if e.code() == ErrorCode::NotYetVisible {
                        recorder.visibility_timeout();
                    } else {
                        recorder.error(operation, error_kind(&e), &e.to_string());
                        if e.code() == ErrorCode::Invalid {
                            return None;
                        }
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    if Instant::now() >= self.shared.give_up {
                        recorder.unchecked();
                        return None;
                    }
                }
            }
        }
    }

    /// The instance dies (an append may be in flight, its ack never seen), and a fresh
    /// instance takes over the identity: it replays the private scope and must find every
    /// event its predecessors were acknowledged there.
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

        let recorder = self.shared.recorder.clone();
        let scope = &self.profile.private_scope;
        let filter = SubjectFilter::all()
            .tenant(self.profile.tenant.clone())
            .scope(scope.kind, scope.id.clone());
        let started = Instant::now();
        let mut seen = std::collections::HashSet::new();
        let mut max_seq = 0;
        match self.client.replay(&filter, StartAt::Beginning).await {
            Ok(mut events) => {
                while let Some(event) = events.next().await {
                    match event {
                        Ok(stored) => {
                            max_seq = max_seq.max(stored.seq);
                            seen.insert(stored.event.event_id.as_str().to_owned());
                        }
                        Err(e) => recorder.error("takeover", "decode", &e.to_string()),
                    }
                }
            }
            Err(e) => {
                recorder.error("takeover", "bus", &e.to_string());
                return;
            }
        }
        let now = Instant::now();
        recorder.latency(Metric::Takeover, now - started, now);
        let missing = self
            .private_acked
            .iter()
            .filter(|id| !seen.contains(id.as_str()))
            .count() as u64;
        recorder.takeover(self.private_acked.len() as u64, missing);
        // The successor reads with what it replayed as its token.
        self.last_seq = (max_seq > 0).then_some(max_seq);
    }
}

fn error_kind(e: &RpcError) -> &'static str {
    match e {
        RpcError::Service { code, .. } => match code {
            ErrorCode::Invalid => "invalid",
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

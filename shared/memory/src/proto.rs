//! The query protocol: JSON over NATS request/reply, following the NATS services convention
//! (`$SRV.PING|INFO|STATS` discovery comes with it).
//!
//! Public endpoints, served by the query service (`engram-query`):
//! - `engram.q.retrieve`: [`RetrieveRequest`] -> [`RetrieveResponse`]
//! - `engram.q.context`: [`ContextRequest`] -> [`Context`]
//! - `engram.q.facts`: [`FactsRequest`] -> [`FactsResponse`]
//! - `engram.q.skills`: [`SkillsRequest`] -> [`SkillsResponse`]
//!
//! Internal endpoints, served by each projector service and called by the query service:
//! - `engram.p.<projector>.search`: [`SearchRequest`] -> [`SearchResponse`] (vector, keyword)
//! - `engram.p.facts.query`, `engram.p.skills.search`
//!
//! Errors are NATS service errors: the `Nats-Service-Error-Code` header carries one of the
//! [`ErrorCode`] values and the body is a JSON [`ErrorBody`].

use chrono::{DateTime, Utc};
use engram_schema::{EventId, EventKind, Ident, Layer, Scope};
use serde::{Deserialize, Serialize};

use crate::{Hit, MemoryFilter, MemoryMeta, ScopeKey, Seq};

pub const QUERY_SERVICE: &str = "engram-query";
pub const RETRIEVE: &str = "engram.q.retrieve";
pub const CONTEXT: &str = "engram.q.context";
pub const FACTS: &str = "engram.q.facts";
pub const SKILLS: &str = "engram.q.skills";

/// The subject of a projector service's endpoint.
pub fn projector_subject(projector: &str, op: &str) -> String {
    format!("engram.p.{projector}.{op}")
}

/// Which retrievers a retrieval fuses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetrievalMode {
    #[default]
    Hybrid,
    Dense,
    Keyword,
}

/// Who is asking, and which scopes they may read.
///
/// A query reads its own scope plus the ancestors it lists in `grants`. A grant must be of a
/// strictly wider kind than the own scope (org > team > user > agent > task > session) and
/// of the same tenant; a sibling (same kind, other id) or anything of another tenant is
/// refused, never silently read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScopeRequest {
    pub tenant: Ident,
    pub scope: Scope,
    #[serde(default)]
    pub grants: Vec<Scope>,
}

/// Read-your-writes: wait until every projector read from has applied `min_seq`, at most
/// `wait_ms` (default 5000). A timeout is a typed error, never stale results.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Consistency {
    #[serde(default)]
    pub min_seq: Option<Seq>,
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RetrieveRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    pub query: String,
    /// A query vector from the same model as the index (required when the deployment uses
    /// client-supplied vectors).
    #[serde(default)]
    pub vector: Option<Vec<f32>>,
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    #[serde(default)]
    pub filter: MemoryFilter,
    #[serde(default, flatten)]
    pub consistency: Consistency,
    #[serde(default)]
    pub mode: RetrievalMode,
    /// Overrides the service's configured ranking for this request.
    #[serde(default)]
    pub ranking: Option<Ranking>,
}

fn default_top_k() -> usize {
    10
}

/// How hybrid results are ranked. Every weight is configurable, per deployment and per
/// request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Ranking {
    /// How the dense and keyword lists are combined.
    pub fusion: Fusion,
    /// Weight of the keyword (BM25) side in the fused score; the dense side gets 1 minus it.
    pub keyword_weight: f32,
    /// Reciprocal-rank-fusion constant.
    pub rrf_k: f32,
    /// Candidates fetched from each retriever, as a multiple of `top_k` (at least 50).
    pub candidates_factor: usize,
    /// Half-life of the recency boost, in hours; 0 disables it.
    pub recency_half_life_hours: f64,
    /// Weight of the recency boost (multiplies `1 + w * 0.5^(age / half_life)`).
    pub recency_weight: f32,
    /// Weight of importance (multiplies `1 + w * (importance - 0.5)`).
    pub importance_weight: f32,
}

impl Default for Ranking {
    fn default() -> Self {
        Self {
            fusion: Fusion::default(),
            keyword_weight: 0.5,
            rrf_k: 60.0,
            candidates_factor: 5,
            recency_half_life_hours: 0.0,
            recency_weight: 0.0,
            importance_weight: 0.1,
        }
    }
}

/// Ways to fuse the dense and keyword lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fusion {
    /// Weighted reciprocal-rank fusion: `w / (rrf_k + rank)` summed over the lists.
    Rrf,
    /// Both retrievers score every candidate of either list; each side's scores are
    /// normalised over the candidates and mixed by `keyword_weight`. Unlike RRF it keeps how
    /// much better the first hit is than the tenth, which matters when one side is weak.
    #[default]
    Score,
}

/// How one result's score was made.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScoreParts {
    /// Cosine similarity and 1-based rank on the dense side, if it found this memory.
    pub dense: Option<f32>,
    pub dense_rank: Option<usize>,
    /// BM25 score and rank on the keyword side.
    pub keyword: Option<f32>,
    pub keyword_rank: Option<usize>,
    /// The fused relevance before boosts.
    pub fused: f32,
    pub recency_boost: f32,
    pub importance_boost: f32,
}

/// One retrieved memory with its provenance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryResult {
    pub seq: Seq,
    pub event_id: EventId,
    pub tenant: Ident,
    pub scope: Scope,
    pub agent_id: Ident,
    pub layer: Layer,
    pub kind: EventKind,
    pub occurred_at: DateTime<Utc>,
    pub importance: f64,
    pub tags: Vec<String>,
    pub text: String,
    pub score: f32,
    pub parts: ScoreParts,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RetrieveResponse {
    pub results: Vec<MemoryResult>,
    /// The sequence each projector read from had made visible when it answered.
    pub visible: Vec<(String, Seq)>,
}

/// A search of one projector's text index (internal).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchRequest {
    pub scopes: Vec<ScopeKey>,
    pub query: String,
    #[serde(default)]
    pub vector: Option<Vec<f32>>,
    pub k: usize,
    #[serde(default)]
    pub filter: MemoryFilter,
    #[serde(default, flatten)]
    pub consistency: Consistency,
    /// Also score these memories, if they are in the allowed scopes, whatever their rank
    /// (so that fusion can compare both retrievers on the same candidates).
    #[serde(default)]
    pub score_also: Vec<Seq>,
}

/// A text memory as a projector holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryHit {
    pub hit: Hit,
    pub meta: MemoryMeta,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SearchResponse {
    pub hits: Vec<MemoryHit>,
    /// Scores of `score_also` memories (those in scope), in no particular order.
    #[serde(default)]
    pub also: Vec<Hit>,
    pub visible_seq: Seq,
}

/// Facts as they are now, or as they stood.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FactsRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub predicate: Option<String>,
    /// Free-text match over subject, predicate and object (current facts only).
    #[serde(default)]
    pub text: Option<String>,
    /// Valid-time point: facts true in the world at this time (default: now).
    #[serde(default)]
    pub valid_at: Option<DateTime<Utc>>,
    /// Transaction-time point: as Engram knew it then (default: latest knowledge).
    #[serde(default)]
    pub known_at: Option<DateTime<Utc>>,
    /// Every version, superseded and retracted included.
    #[serde(default)]
    pub history: bool,
    #[serde(default = "default_top_k")]
    pub limit: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FactsResponse {
    /// Facts as JSON objects, in the fact table's own shape.
    pub facts: Vec<serde_json::Value>,
    pub visible_seq: Seq,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SkillsRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    /// A task description to match skills against; or `name` for one skill.
    #[serde(default)]
    pub task: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default = "default_top_k")]
    pub limit: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SkillsResponse {
    /// Skills as JSON objects with a `score`, in the registry's own shape.
    pub skills: Vec<serde_json::Value>,
    pub visible_seq: Seq,
}

/// What an agent asks for at the start of each step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContextRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    pub agent_id: Ident,
    /// The task the agent works on; its working memory is read from the task scope.
    pub task: String,
    pub query: String,
    #[serde(default)]
    pub vector: Option<Vec<f32>>,
    /// Most tokens the assembled context may take, counted with the model's tokenizer.
    pub token_budget: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

/// One item of an assembled context.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContextItem {
    /// working, episodic, semantic (memories and facts) or procedural.
    pub layer: Layer,
    pub text: String,
    pub tokens: usize,
    /// Where it came from: an event id, a fact's source, a skill name, a working-memory key.
    pub source: String,
    pub score: f32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Context {
    pub items: Vec<ContextItem>,
    pub tokens: usize,
    pub token_budget: usize,
    /// Candidates left out because they did not fit or repeated an included item.
    pub dropped: usize,
    /// The context as one text block, sections by layer.
    pub rendered: String,
}

/// Error codes of the query protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed or refers to scopes it may not read (400).
    Invalid,
    /// A read-your-writes wait ran out (408).
    NotYetVisible,
    /// Too many requests in flight on this endpoint; retry after a short pause (429).
    Busy,
    /// A projector or model is unavailable (503).
    Unavailable,
    /// A bug or a broken read model (500).
    Internal,
}

impl ErrorCode {
    pub fn http_status(self) -> usize {
        match self {
            Self::Invalid => 400,
            Self::NotYetVisible => 408,
            Self::Busy => 429,
            Self::Unavailable => 503,
            Self::Internal => 500,
        }
    }

    pub fn from_status(code: usize) -> Self {
        match code {
            400 => Self::Invalid,
            408 => Self::NotYetVisible,
            429 => Self::Busy,
            503 => Self::Unavailable,
            _ => Self::Internal,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

impl ScopeRequest {
    /// The scope keys this request may read: its own, then its grants. Refuses grants that
    /// are not strict ancestors by kind, or repeat a kind, with a message saying why.
    pub fn resolve(&self) -> Result<Vec<ScopeKey>, String> {
        let mut keys = vec![ScopeKey::new(self.tenant.clone(), self.scope.clone())];
        let mut kinds_seen = Vec::new();
        for grant in &self.grants {
            if grant.kind >= self.scope.kind {
                return Err(format!(
                    "grant {grant} is not an ancestor of {}: only wider scopes (org > team > user > agent > task > session) can be granted; a sibling or narrower scope is never readable",
                    self.scope
                ));
            }
            if kinds_seen.contains(&grant.kind) {
                return Err(format!(
                    "two grants of kind {}: a scope has one ancestor of each kind",
                    grant.kind
                ));
            }
            kinds_seen.push(grant.kind);
            keys.push(ScopeKey::new(self.tenant.clone(), grant.clone()));
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use engram_schema::ScopeKind;

    use super::*;

    fn request(scope: &str, grants: &[&str]) -> ScopeRequest {
        ScopeRequest {
            tenant: Ident::parse("tenant", "acme").unwrap(),
            scope: scope.parse().unwrap(),
            grants: grants.iter().map(|g| g.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn grants_must_be_strict_ancestors() {
        let keys = request("task:t1", &["team:a", "org:o"]).resolve().unwrap();
        assert_eq!(keys.len(), 3);
        assert_eq!(keys[1].kind, ScopeKind::Team);
        assert!(
            request("task:t1", &["task:t2"]).resolve().is_err(),
            "sibling"
        );
        assert!(
            request("team:a", &["task:t1"]).resolve().is_err(),
            "narrower"
        );
        assert!(
            request("task:t1", &["team:a", "team:b"]).resolve().is_err(),
            "two teams"
        );
    }
}

//! The query protocol: JSON over NATS request/reply, following the NATS services convention
//! (`$SRV.PING|INFO|STATS` discovery comes with it).
//!
//! Public endpoints, served by the query service (`engram-query`):
//! - `engram.q.retrieve`: [`RetrieveRequest`] -> [`RetrieveResponse`]
//! - `engram.q.context`: [`ContextRequest`] -> [`Context`]
//! - `engram.q.facts`: [`FactsRequest`] -> [`FactsResponse`]
//! - `engram.q.skills`: [`SkillsRequest`] -> [`SkillsResponse`]
//! - `engram.q.doc`: [`DocRequest`] -> [`DocResponse`] (shared documents)
//! - `engram.q.consolidate`: [`ConsolidateRequest`] -> [`ConsolidateResponse`] (the
//!   events consolidation plans for one scope; the caller appends them)
//! - `engram.q.bootstrap`: [`BootstrapRequest`] -> [`BootstrapResponse`] (a scope's slice
//!   of a read model's snapshot, to replay the tail after)
//! - `engram.q.brief`: [`BriefRequest`] -> [`BriefResponse`] (a task's handoff brief, built
//!   from its events and read models, citing event ids)
//!
//! Internal endpoints, served for each partition of the stream by the instance of the read
//! model that owns it, and called by the query service:
//! - `engram.p.<model>.search.<partition>`: [`SearchRequest`] -> [`SearchResponse`] (vector,
//!   keyword)
//! - `engram.p.facts.query.<partition>`, `engram.p.skills.search.<partition>`,
//!   `engram.p.docs.get.<partition>`
//!
//! Errors are NATS service errors: the `Nats-Service-Error-Code` header carries one of the
//! [`ErrorCode`] values and the body is a JSON [`ErrorBody`].
//!
//! Every request type, and every type inside one, refuses unknown fields
//! (`deny_unknown_fields`): a misspelt `grants` or `min_seq` would otherwise be dropped in
//! silence, reading fewer scopes or stale state. Response types accept them, so that an older
//! client reads a newer server's answers. Most requests flatten [`ScopeRequest`] and
//! [`Consistency`] into themselves; serde checks the keys no field and no flattened struct
//! took, which holds as long as every flattened type is a plain derived struct (one without
//! a flatten of its own: such a type reads every key left, so an outer check would refuse
//! them all). A body flattening a whole request (the gateway's `/v1/consolidate`) leaves the
//! check to the request's own type. `tests::unknown_fields_are_refused_in_every_request`
//! keeps this true.

use chrono::{DateTime, Utc};
use engram_schema::{EventId, EventKind, Ident, Layer, Scope};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{Hit, MemoryFilter, MemoryMeta, ScopeKey, Seq};

pub const QUERY_SERVICE: &str = "engram-query";
pub const RETRIEVE: &str = "engram.q.retrieve";
pub const CONTEXT: &str = "engram.q.context";
pub const FACTS: &str = "engram.q.facts";
pub const SKILLS: &str = "engram.q.skills";
pub const DOC: &str = "engram.q.doc";
pub const BOOTSTRAP: &str = "engram.q.bootstrap";
pub const CONSOLIDATE: &str = "engram.q.consolidate";
pub const SNAPSHOT: &str = "engram.q.snapshot";
pub const REPLAY: &str = "engram.q.replay";
pub const BRIEF: &str = "engram.q.brief";
pub const WORKING: &str = "engram.q.working";
pub const WHOAMI: &str = "engram.q.whoami";
/// Agents only, as `engram.q.<tenant>.<agent>.append`: [`AppendRequest`] ->
/// [`AppendResponse`]. An agent's key publishes nothing to the log itself.
pub const APPEND: &str = "engram.q.append";
pub const SCOPES: &str = "engram.q.scopes";
pub const SNAPSHOTS: &str = "engram.q.snapshots";
pub const DEAD_LETTERS: &str = "engram.q.dead_letters";

/// Every read model, in one table: its name, the ops it answers beside the ones every
/// projector serves (ledger, status, snapshot, bootstrap, erase, traces), the bus role it
/// runs as, and whether a scope can start from its snapshots. The projector registry
/// (`engram_projectors::REGISTRY`) runs the models; its tests hold it to this table, so a
/// model added there and not here (or an op renamed on one side) fails them.
pub mod read_models {
    pub const VECTOR: &str = "vector";
    pub const KEYWORD: &str = "keyword";
    pub const FACTS: &str = "facts";
    pub const SKILLS: &str = "skills";
    pub const DOCS: &str = "docs";
    pub const CONSOLIDATOR: &str = "consolidator";

    /// Retrieval (vector, keyword) and skill search: `engram.p.<name>.search`.
    pub const SEARCH_OP: &str = "search";
    /// The fact query: `engram.p.facts.query`.
    pub const QUERY_OP: &str = "query";
    /// A shared document or the list of them: `engram.p.docs.get`.
    pub const GET_OP: &str = "get";
    /// A scope's consolidation plan: `engram.p.consolidator.plan`.
    pub const PLAN_OP: &str = "plan";
    /// A memory's nearest neighbours, which the consolidator asks: `engram.p.vector.neighbours`.
    pub const NEIGHBOURS_OP: &str = "neighbours";

    /// Which bus role, and so which credentials, a model's service runs as.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum ModelRole {
        /// Reads the stream and answers queries.
        Projector,
        /// A projector that also appends (its scheduled runs' plans): its own role, so the
        /// plain projectors never get the right to write.
        Consolidator,
    }

    impl ModelRole {
        /// The role of the model `name`. A name outside the table (the registry's tests
        /// keep every registered one in it) gets the projector role, the one that may not
        /// append.
        pub fn of(name: &str) -> Self {
            spec(name).map_or(Self::Projector, |m| m.role)
        }
    }

    /// One read model, as the rest of Engram names it.
    #[derive(Debug)]
    pub struct ReadModelSpec {
        /// Its durable consumer, state files, metrics and `engram.p.<name>.*` subjects.
        pub name: &'static str,
        /// The ops it answers as `engram.p.<name>.<op>`, its main query first.
        pub ops: &'static [&'static str],
        pub role: ModelRole,
        /// A scope can start from a slice of its snapshot (`engram.q.bootstrap`): what an
        /// instance holds locally of its scopes.
        pub scope_snapshots: bool,
    }

    /// Every read model, in the order a snapshot of all of them is cut.
    pub const TABLE: &[ReadModelSpec] = &[
        ReadModelSpec {
            name: FACTS,
            ops: &[QUERY_OP],
            role: ModelRole::Projector,
            scope_snapshots: true,
        },
        ReadModelSpec {
            name: SKILLS,
            ops: &[SEARCH_OP],
            role: ModelRole::Projector,
            scope_snapshots: true,
        },
        ReadModelSpec {
            name: DOCS,
            ops: &[GET_OP],
            role: ModelRole::Projector,
            scope_snapshots: true,
        },
        ReadModelSpec {
            name: CONSOLIDATOR,
            ops: &[PLAN_OP],
            role: ModelRole::Consolidator,
            scope_snapshots: false,
        },
        ReadModelSpec {
            name: VECTOR,
            ops: &[SEARCH_OP, NEIGHBOURS_OP],
            role: ModelRole::Projector,
            scope_snapshots: false,
        },
        ReadModelSpec {
            name: KEYWORD,
            ops: &[SEARCH_OP],
            role: ModelRole::Projector,
            scope_snapshots: false,
        },
    ];

    /// Every read model's name, in [`TABLE`] order.
    pub const ALL: [&str; TABLE.len()] = {
        let mut all = [""; TABLE.len()];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].name;
            i += 1;
        }
        all
    };

    /// The row of the model `name`.
    pub fn spec(name: &str) -> Option<&'static ReadModelSpec> {
        TABLE.iter().find(|m| m.name == name)
    }

    /// The models a scope can start from a snapshot of, in [`TABLE`] order.
    pub fn with_scope_snapshots() -> impl Iterator<Item = &'static str> {
        TABLE.iter().filter(|m| m.scope_snapshots).map(|m| m.name)
    }
}

/// See [`read_models::NEIGHBOURS_OP`].
pub use read_models::NEIGHBOURS_OP;

/// The subject of a read model's endpoint for one partition of the stream: each partition
/// has its own instance of every model, served by the node that owns the partition.
pub fn partition_subject(model: &str, op: &str, partition: u32) -> String {
    format!("engram.p.{model}.{op}.{partition}")
}

/// The name of a read model's instance for one partition (`vector-p3`): its durable
/// consumer, its metrics label and its snapshots' name in the snapshot store.
pub fn instance_name(model: &str, partition: u32) -> String {
    format!("{model}-p{partition}")
}

/// The partitions of `scopes` (of one tenant) among `partitions`, each with the scopes it
/// holds, in partition order: what a request over several scopes fans out to.
pub fn by_partition(scopes: &[ScopeKey], partitions: u32) -> Vec<(u32, Vec<ScopeKey>)> {
    let mut split: std::collections::BTreeMap<u32, Vec<ScopeKey>> = Default::default();
    for scope in scopes {
        split
            .entry(scope.partition(partitions))
            .or_default()
            .push(scope.clone());
    }
    split.into_iter().collect()
}

/// What one request may ask for. Everything a client can reach is bounded: a request beyond
/// a limit is refused with a 400 naming the field, never clamped in silence and never left to
/// allocate what it asks for.
pub mod limits {
    /// Events one append request carries. The request must also fit the server's
    /// `max_payload`; the SDK splits larger batches.
    pub const MAX_APPEND_EVENTS: usize = 256;
    /// Scopes one listing returns.
    pub const MAX_LISTED_SCOPES: usize = 10_000;
    /// Dead letters one listing returns.
    pub const MAX_DEAD_LETTERS: usize = 500;
    /// Bytes of a query text (retrieve, context, a fact or skill search). A retrieval query
    /// longer than a page of text says nothing more to the embedder (which reads 256 tokens)
    /// and only costs the keyword side.
    pub const MAX_QUERY_BYTES: usize = 16 * 1024;
    /// Longest read-your-writes wait a request may ask for.
    pub const MAX_WAIT_MS: u64 = 60_000;
    /// Results one retrieval may return, whatever the deployment's `query.max_top_k` says.
    pub const MAX_TOP_K: usize = 1_000;
    /// Largest `ranking.candidates_factor`.
    pub const MAX_CANDIDATES_FACTOR: usize = 100;
    /// Most session summaries one retrieval returns beside its results.
    pub const MAX_SUMMARIES: usize = 20;
    /// Most candidates one projector search returns (`k`). The query service asks for
    /// `top_k * candidates_factor`, at least 50, at most this.
    pub const MAX_SEARCH_K: usize = 2_000;
    /// Most memories a search may ask to have scored besides its hits (`score_also`).
    pub const MAX_SCORE_ALSO: usize = 2 * MAX_SEARCH_K;
    /// Most scopes one projector search reads: the own scope and one ancestor per wider kind.
    pub const MAX_SCOPES: usize = 6;
    /// Most facts or skills one request returns.
    pub const MAX_LIMIT: usize = 1_000;
    /// Largest context token budget.
    pub const MAX_TOKEN_BUDGET: usize = 32_768;
    /// Most values in each list of a memory filter (layers, kinds, tags).
    pub const MAX_FILTER_VALUES: usize = 64;
    /// Bytes of a working-memory key or a skill name asked for.
    pub const MAX_NAME_BYTES: usize = 256;
    /// Largest compacted document a reply carries (`include_bytes`), before base64. A
    /// document past it is too big to fork from over request/reply: shard it (one board per
    /// sprint, one profile per user).
    pub const MAX_DOC_BYTES: usize = 1024 * 1024;
    /// Most documents or history entries one doc request returns.
    pub const MAX_DOC_ITEMS: usize = 256;
    /// Items per section of a brief, and events one brief reads.
    pub const MAX_BRIEF_ITEMS: usize = 200;
    pub const MAX_BRIEF_EVENTS: usize = 20_000;
    /// Memories one neighbours request names.
    pub const MAX_NEIGHBOUR_IDS: usize = 1_024;
    /// Neighbours one memory gets in a neighbours answer.
    pub const MAX_NEIGHBOURS: usize = 16;
    /// Scopes one erasure or traces request names.
    pub const MAX_ERASE_SCOPES: usize = 1_024;
    /// Events one replay page returns.
    pub const MAX_REPLAY_EVENTS: usize = 1_000;
    /// Bytes of events (as JSON) one replay page returns, beyond its first event: a page
    /// fits the server's max_payload.
    pub const MAX_REPLAY_BYTES: usize = 512 * 1024;
    /// Longest `ttl_ms` a working-memory put may ask for: seven days. Working memory is a
    /// scope's scratch space; the bucket keeps no age limit of its own (its entries live
    /// exactly their TTL), so without this bound a key could be held for ever.
    pub const MAX_WORKING_TTL_MS: u64 = 7 * 24 * 60 * 60 * 1000;
    /// Shortest `ttl_ms`: the server's TTL granularity is a second.
    pub const MIN_WORKING_TTL_MS: u64 = 1000;
}

/// A request field outside what the protocol allows; answered as a 400 that names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidField {
    /// The field's path in the request, for example `ranking.candidates_factor`.
    pub field: &'static str,
    pub reason: String,
}

impl InvalidField {
    fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for InvalidField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for InvalidField {}

fn check_text(field: &'static str, text: &str, max: usize) -> Result<(), InvalidField> {
    if text.len() > max {
        return Err(InvalidField::new(
            field,
            format!("{} bytes, at most {max} allowed; shorten it", text.len()),
        ));
    }
    Ok(())
}

fn check_range<T: PartialOrd + std::fmt::Display + Copy>(
    field: &'static str,
    value: T,
    min: T,
    max: T,
) -> Result<(), InvalidField> {
    if !(min..=max).contains(&value) {
        return Err(InvalidField::new(
            field,
            format!("{value} is outside {min}..={max}"),
        ));
    }
    Ok(())
}

fn check_weight(field: &'static str, value: f64, min: f64, max: f64) -> Result<(), InvalidField> {
    if !value.is_finite() {
        return Err(InvalidField::new(field, "must be a finite number"));
    }
    check_range(field, value, min, max)
}

fn check_vector(field: &'static str, vector: Option<&Vec<f32>>) -> Result<(), InvalidField> {
    let Some(vector) = vector else {
        return Ok(());
    };
    let max = engram_schema::envelope::MAX_EMBEDDING_DIMS;
    if vector.is_empty() || vector.len() > max {
        return Err(InvalidField::new(
            field,
            format!("{} dimensions, expected 1..={max}", vector.len()),
        ));
    }
    if vector.iter().any(|x| !x.is_finite()) {
        return Err(InvalidField::new(field, "contains NaN or infinity"));
    }
    Ok(())
}

fn check_limit(field: &'static str, value: usize, max: usize) -> Result<(), InvalidField> {
    check_range(field, value, 1, max)
}

/// Which retrievers a retrieval fuses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScopeRequest {
    pub tenant: Ident,
    pub scope: Scope,
    #[serde(default)]
    pub grants: Vec<Scope>,
}

/// Read-your-writes: wait until every projector read from has applied `min_seq`, at most
/// `wait_ms` (default 5000, at most [`limits::MAX_WAIT_MS`]). A timeout is a typed error,
/// never stale results; a `min_seq` beyond the stream's last sequence is refused at once, since
/// no append returned it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Consistency {
    #[serde(default)]
    pub min_seq: Option<Seq>,
    #[serde(default)]
    #[schemars(range(max = limits::MAX_WAIT_MS))]
    pub wait_ms: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetrieveRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    pub query: String,
    /// A query vector from the same model as the index (required when the deployment uses
    /// client-supplied vectors).
    #[serde(default)]
    pub vector: Option<Vec<f32>>,
    /// At most the deployment's `query.max_top_k` (1000 by default, never more).
    #[serde(default = "default_top_k")]
    #[schemars(range(min = 1, max = limits::MAX_TOP_K))]
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Ranking {
    /// How the dense and keyword lists are combined.
    pub fusion: Fusion,
    /// Weight of the keyword (BM25) side in the fused score; the dense side gets 1 minus it.
    pub keyword_weight: f32,
    /// Reciprocal-rank-fusion constant.
    pub rrf_k: f32,
    /// Candidates fetched from each retriever, as a multiple of `top_k` (at least 50, at
    /// most [`limits::MAX_SEARCH_K`] in all).
    #[schemars(range(min = 1, max = limits::MAX_CANDIDATES_FACTOR))]
    pub candidates_factor: usize,
    /// Half-life of the recency boost, in hours; 0 disables it.
    pub recency_half_life_hours: f64,
    /// Weight of the recency boost (multiplies `1 + w * 0.5^(age / half_life)`).
    pub recency_weight: f32,
    /// Weight of importance (multiplies `1 + w * (importance - 0.5)`).
    pub importance_weight: f32,
    /// Weight of a memory's nearness to a date the query names ("in July 2023", "on
    /// October 13, 2023", "yesterday"): multiplies `1 + w * nearness`, where nearness is 1
    /// within the date and halves for every `date_half_life_days` outside it. A query that
    /// names no date is ranked as without it. 0 disables it.
    pub date_weight: f32,
    /// How fast nearness to a named date falls outside it, in days; 0 lifts only the
    /// memories within the date.
    pub date_half_life_days: f64,
    /// Session summaries (the consolidator's, tagged [`crate::SUMMARY_TAG`]) returned
    /// beside the results, in `summaries`, best first: at most
    /// [`limits::MAX_SUMMARIES`].
    #[schemars(range(max = limits::MAX_SUMMARIES))]
    pub summaries: usize,
    /// Whether summaries also compete with other memories for the `top_k` places. Off by
    /// default: an extractive summary quotes what the memories already say, and on LoCoMo
    /// it took places from the turns that answered (docs/benchmarks.md). A filter that
    /// asks for summaries (kind `consolidated` or tag `summary`) ranks them as results.
    pub summary_results: bool,
}

impl Ranking {
    /// Every field finite and within its documented range: `keyword_weight` 0..=1, `rrf_k`
    /// above 0 and at most 1e6, `candidates_factor` 1..=[`limits::MAX_CANDIDATES_FACTOR`],
    /// `recency_half_life_hours` 0..=1e6, `date_half_life_days` 0..=36500, the three boost
    /// weights 0..=10.
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_weight(
            "ranking.keyword_weight",
            f64::from(self.keyword_weight),
            0.0,
            1.0,
        )?;
        check_weight("ranking.rrf_k", f64::from(self.rrf_k), 0.0, 1e6)?;
        if self.rrf_k <= 0.0 {
            return Err(InvalidField::new(
                "ranking.rrf_k",
                "must be above 0 (it divides: 0 or less gives infinite scores)",
            ));
        }
        check_limit(
            "ranking.candidates_factor",
            self.candidates_factor,
            limits::MAX_CANDIDATES_FACTOR,
        )?;
        check_weight(
            "ranking.recency_half_life_hours",
            self.recency_half_life_hours,
            0.0,
            1e6,
        )?;
        check_weight(
            "ranking.recency_weight",
            f64::from(self.recency_weight),
            0.0,
            10.0,
        )?;
        check_weight(
            "ranking.importance_weight",
            f64::from(self.importance_weight),
            0.0,
            10.0,
        )?;
        check_weight(
            "ranking.date_weight",
            f64::from(self.date_weight),
            0.0,
            10.0,
        )?;
        check_weight(
            "ranking.date_half_life_days",
            self.date_half_life_days,
            0.0,
            36_500.0,
        )?;
        check_range(
            "ranking.summaries",
            self.summaries,
            0,
            limits::MAX_SUMMARIES,
        )
    }

    /// How many candidates to fetch from each retriever for `top_k` results: saturating, at
    /// least 50 and at most [`limits::MAX_SEARCH_K`].
    pub fn depth(&self, top_k: usize) -> usize {
        top_k
            .saturating_mul(self.candidates_factor.max(1))
            .clamp(50, limits::MAX_SEARCH_K)
    }
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
            date_weight: 1.0,
            date_half_life_days: 7.0,
            summaries: 3,
            summary_results: false,
        }
    }
}

/// Ways to fuse the dense and keyword lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
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
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
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
    /// `date_weight` times the memory's nearness to the dates the query names.
    #[serde(default)]
    pub date_boost: f32,
}

/// One retrieved memory with its provenance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
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
    /// 0..=1: lowered by outcomes that contradicted it and flags on its writer
    /// ([`crate::confidence`]). Not part of the score: `filter.min_confidence` leaves
    /// distrusted memories out instead of ranking them lower.
    #[serde(default = "crate::full_confidence")]
    pub confidence: f64,
    pub text: String,
    pub score: f32,
    pub parts: ScoreParts,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RetrieveResponse {
    pub results: Vec<MemoryResult>,
    /// The best session summaries for the query (`ranking.summaries` of them), apart
    /// from `results` unless `ranking.summary_results`.
    #[serde(default)]
    pub summaries: Vec<MemoryResult>,
    /// The sequence each projector read from had made visible when it answered.
    pub visible: Vec<(String, Seq)>,
}

/// A search of one projector's text index (internal).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
    /// Keyword side only: also return, in `also`, the scores of the memories ranked after
    /// the `k` hits, down to this rank (without their text). 0 for none.
    #[serde(default)]
    pub rest: usize,
}

/// The memories of one scope whose vectors lie within a radius of the named ones
/// (internal): the near-duplicate candidates the consolidator checks by text. Summaries
/// are never neighbours, nor memories out of default retrieval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NeighboursRequest {
    pub scope: ScopeKey,
    /// Memories of `scope` to find the neighbours of; ids it does not hold are skipped.
    pub event_ids: Vec<EventId>,
    /// Cosine similarity a neighbour has at least, in 0..=1.
    pub min_similarity: f32,
    /// Neighbours per memory, at most [`limits::MAX_NEIGHBOURS`].
    pub k: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

/// Two memories of the scope whose vectors are close; `a` is one of the ids asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Neighbour {
    pub a: EventId,
    pub b: EventId,
    pub similarity: f32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct NeighboursResponse {
    pub pairs: Vec<Neighbour>,
    pub visible_seq: Seq,
}

/// A text memory as a projector holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryHit {
    pub hit: Hit,
    pub meta: MemoryMeta,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SearchResponse {
    pub hits: Vec<MemoryHit>,
    /// Scores of `score_also` memories (those in scope), in no particular order.
    #[serde(default)]
    pub also: Vec<Hit>,
    pub visible_seq: Seq,
}

/// Facts as they are now, or as they stood.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
    #[schemars(range(min = 1, max = limits::MAX_LIMIT))]
    pub limit: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FactsResponse {
    /// Facts as JSON objects, in the fact table's own shape.
    pub facts: Vec<serde_json::Value>,
    pub visible_seq: Seq,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SkillsRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    /// A task description to match skills against; or `name` for one skill.
    #[serde(default)]
    pub task: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default = "default_top_k")]
    #[schemars(range(min = 1, max = limits::MAX_LIMIT))]
    pub limit: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SkillsResponse {
    /// Skills as JSON objects with a `score`, in the registry's own shape.
    pub skills: Vec<serde_json::Value>,
    pub visible_seq: Seq,
}

/// What a doc request reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DocRead {
    /// One document's state and conflicts.
    #[default]
    State,
    /// One document's recent `doc_changed` events, newest last.
    History,
    /// The documents of the readable scopes (own scope and grants), of `doc_type` if given.
    List,
}

/// A shared document, or the documents of some scopes.
///
/// `State` and `History` read the document `doc_type`/`name` of the request's own scope;
/// `List` reads the own scope and the granted ancestors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DocRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    #[serde(default)]
    pub read: DocRead,
    /// Required for `state` and `history`; a filter for `list`.
    #[serde(default)]
    pub doc_type: Option<Ident>,
    /// Required for `state` and `history`.
    #[serde(default)]
    pub name: Option<Ident>,
    /// `state`: also return the compacted document (base64), to fork a local copy from.
    #[serde(default)]
    pub include_bytes: bool,
    /// `list`: also return each document's state.
    #[serde(default)]
    pub include_values: bool,
    /// Most documents (`list`) or history entries (`history`), at most 256.
    #[serde(default = "default_doc_limit")]
    #[schemars(range(min = 1, max = limits::MAX_DOC_ITEMS))]
    pub limit: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

fn default_doc_limit() -> usize {
    50
}

/// A field written concurrently: every value it holds, the one `value` shows first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DocConflict {
    /// JSON-pointer path of the field, for example `/items/t-7/status`.
    pub path: String,
    pub values: Vec<serde_json::Value>,
}

/// One `doc_changed` event as a document's history shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DocHistoryEntry {
    pub seq: Seq,
    pub event_id: EventId,
    pub agent_id: Ident,
    pub instance_id: Ident,
    pub occurred_at: DateTime<Utc>,
    /// Changes the event carried that the document did not hold yet.
    pub changes: usize,
    /// Changes applied because of it (held ones it released included).
    pub applied: usize,
    /// Changes held back after it, waiting for their dependencies.
    pub held: usize,
}

/// One document: what it is, how it was built, and (when asked) its state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DocSummary {
    pub scope: Scope,
    pub doc_type: Ident,
    pub name: Ident,
    /// Its heads: hex change hashes, sorted. Equal heads, equal state.
    pub heads: Vec<String>,
    /// Changes it holds, and `doc_changed` events merged into it.
    pub changes: u64,
    pub events: u64,
    /// Changes waiting for dependencies the stream has not delivered yet.
    pub held: usize,
    /// The seq of the last event merged.
    pub last_seq: Seq,
    /// Compacted size in bytes.
    pub bytes: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DocResponse {
    /// `state`, `history`: the document, `None` when it does not exist (yet).
    #[serde(default)]
    pub doc: Option<DocSummary>,
    /// `state`: the winning value of every field (`doc.value` holds it too).
    #[serde(default)]
    pub conflicts: Vec<DocConflict>,
    /// `state`: the view was cut at its depth or size bound.
    #[serde(default)]
    pub truncated: bool,
    /// `state` with `include_bytes`: the compacted document, base64.
    #[serde(default)]
    pub bytes: Option<String>,
    #[serde(default)]
    pub history: Vec<DocHistoryEntry>,
    /// `list`: the documents, in scope then id order.
    #[serde(default)]
    pub docs: Vec<DocSummary>,
    pub visible_seq: Seq,
}

/// The events consolidation plans for the request's own scope at its visible sequence:
/// merged near-duplicates, summaries of a finished session or task, archived memories.
/// Planning writes nothing; appending the events is what consolidates, and their ids are
/// derived from their inputs, so appending them twice stores them once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsolidateRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    /// Only these steps (`dedup`, `summarise`, `decay`); all when empty.
    #[serde(default)]
    pub steps: Vec<String>,
    /// Instead of the steps: bring these archived or superseded memories of the scope back
    /// into default retrieval, each as a `consolidated` copy (`op: restored`). At most 1000.
    #[serde(default)]
    #[schemars(length(max = 1000))]
    pub restore: Vec<EventId>,
    /// Append the plan too: the query service stores each planned event (authored by the
    /// consolidator) in a scope the caller may write, and answers each one's result in
    /// `results`. Without it the plan is only returned (a dry run).
    #[serde(default)]
    pub apply: bool,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ConsolidateResponse {
    pub events: Vec<engram_schema::Envelope>,
    pub visible_seq: Seq,
    /// With `apply`: one result per planned event, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<AppendResult>,
}

/// One page of the events of the request's scopes (its own and its grants), in stream
/// order, after `after_seq`: how an agent, whose key reaches no stream directly, replays
/// its memory. Page on with `next_after` until `done`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    /// Events with a sequence above this (0: from the start).
    #[serde(default)]
    pub after_seq: Seq,
    /// At most this many events (1..=1000, default 500).
    #[serde(default = "default_replay_limit")]
    #[schemars(range(min = 1, max = limits::MAX_REPLAY_EVENTS))]
    pub limit: usize,
}

fn default_replay_limit() -> usize {
    500
}

impl ReplayRequest {
    /// Everything but the scopes ([`ScopeRequest::resolve`]).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.limit == 0 || self.limit > limits::MAX_REPLAY_EVENTS {
            return Err(InvalidField::new(
                "limit",
                format!("must be 1..={}", limits::MAX_REPLAY_EVENTS),
            ));
        }
        Ok(())
    }
}

/// The handoff brief of the request's own scope, a task ([`engram_brief`]): what the task
/// is, what was decided and why, what failed and how it was fixed, what is open on its task
/// boards, which skills apply, its artifacts; every statement citing the events it comes
/// from. Built from one bounded replay of the scope (and of `session:<session>`, when
/// named and readable), and the docs and skills read models read at the replay's last
/// sequence. Grants are refused: a brief is of one task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BriefRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    /// The session being resumed: its scope's working-layer events are shown, when the
    /// caller may read `session:<session>` (else the brief says it could not).
    #[serde(default)]
    pub session: Option<Ident>,
    /// Items per section, the latest kept (1..=200, default 50).
    #[serde(default)]
    #[schemars(range(min = 1, max = limits::MAX_BRIEF_ITEMS))]
    pub max_items: Option<usize>,
    /// Events read, at most (1..=20000, default 20000); past it the brief says so.
    #[serde(default)]
    #[schemars(range(min = 1, max = limits::MAX_BRIEF_EVENTS))]
    pub max_events: Option<usize>,
}

impl BriefRequest {
    /// Everything but the scopes ([`ScopeRequest::resolve`]).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.scopes.grants.is_empty() {
            return Err(InvalidField::new(
                "grants",
                "a brief is of the own scope only",
            ));
        }
        if self.scopes.scope.kind != engram_schema::ScopeKind::Task {
            return Err(InvalidField::new(
                "scope",
                format!(
                    "{} is no task: a brief is of a task scope (task:<id>)",
                    self.scopes.scope
                ),
            ));
        }
        if let Some(n) = self.max_items {
            check_range("max_items", n, 1, limits::MAX_BRIEF_ITEMS)?;
        }
        if let Some(n) = self.max_events {
            check_range("max_events", n, 1, limits::MAX_BRIEF_EVENTS)?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BriefResponse {
    pub brief: engram_brief::Brief,
    /// The brief as Markdown.
    pub markdown: String,
}

/// Who the caller is, as the registry knows it (agents only: `engram.q.<t>.<a>.whoami`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WhoamiRequest {}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WhoamiResponse {
    pub tenant: Ident,
    pub agent: Ident,
    /// The scopes the key may write and read (`kind:id`, or `kind:*` for every id).
    pub scopes: Vec<String>,
    /// Scopes granted to it, read only.
    pub grants: Vec<String>,
    /// The public keys of the agent's live credentials, as the registry holds them: the
    /// gateway refuses an API key whose public key is not one of them. Absent when the
    /// query service runs without a registry (no authentication).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_keys: Option<Vec<String>>,
}

/// The scopes of a tenant that hold events, with their counts: for an agent, only those
/// it may read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScopesRequest {
    pub tenant: Ident,
    /// At most this many scopes (1..=10000, default 1000).
    #[serde(default = "default_scopes_limit")]
    #[schemars(range(min = 1, max = limits::MAX_LISTED_SCOPES))]
    pub limit: usize,
}

fn default_scopes_limit() -> usize {
    1000
}

impl ScopesRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.limit == 0 || self.limit > limits::MAX_LISTED_SCOPES {
            return Err(InvalidField::new(
                "limit",
                format!("must be 1..={}", limits::MAX_LISTED_SCOPES),
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ScopeCount {
    pub scope: Scope,
    /// Events the stream holds in the scope.
    pub events: u64,
    /// Of those, by memory layer (the subject's last token).
    pub layers: std::collections::BTreeMap<String, u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ScopesResponse {
    pub scopes: Vec<ScopeCount>,
    /// More scopes (or more subjects than one listing reads) than were returned.
    pub truncated: bool,
}

/// The snapshot index: every read model's snapshots, oldest first. Metadata only (version,
/// sizes, hashes, labels), the same for every caller.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsRequest {
    /// One projector's only.
    #[serde(default)]
    pub projector: Option<Ident>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SnapshotsResponse {
    /// Index entries (`engram_snapshots::SnapshotMeta`).
    pub snapshots: Vec<serde_json::Value>,
}

/// The newest dead letters of a tenant: events a projector refused. For an agent, only
/// those of scopes it may read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeadLettersRequest {
    pub tenant: Ident,
    /// At most this many (1..=500, default 100), newest first.
    #[serde(default = "default_dead_letters_limit")]
    #[schemars(range(min = 1, max = limits::MAX_DEAD_LETTERS))]
    pub limit: usize,
}

fn default_dead_letters_limit() -> usize {
    100
}

impl DeadLettersRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.limit == 0 || self.limit > limits::MAX_DEAD_LETTERS {
            return Err(InvalidField::new(
                "limit",
                format!("must be 1..={}", limits::MAX_DEAD_LETTERS),
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeadLetterInfo {
    /// Its sequence in the dead-letter stream (`engram dlq show`).
    pub dlq_seq: u64,
    /// The projector that refused it.
    pub projector: String,
    /// Its sequence in the events stream.
    pub event_seq: Option<u64>,
    pub subject: String,
    pub scope: Option<Scope>,
    /// Why it was refused.
    pub reason: String,
    pub stored_at: DateTime<Utc>,
    /// The event's id, kind and the start of its text, when its bytes still decode.
    pub event_id: Option<String>,
    pub kind: Option<String>,
    pub text: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeadLettersResponse {
    pub dead_letters: Vec<DeadLetterInfo>,
    /// Dead letters of readable scopes among the newest 50,000 of the stream (more than
    /// were returned when above the limit).
    pub total: u64,
}

/// Erases the scopes from one projector's model (admin only: `engram.p.<name>.erase`), once
/// it has applied `through_seq`, and checkpoints before answering.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EraseScopesRequest {
    pub scopes: Vec<ScopeKey>,
    #[serde(default)]
    pub through_seq: Seq,
}

impl EraseScopesRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.scopes.is_empty() || self.scopes.len() > limits::MAX_ERASE_SCOPES {
            return Err(InvalidField::new(
                "scopes",
                format!("1..={} scopes", limits::MAX_ERASE_SCOPES),
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EraseScopesResponse {
    pub projector: String,
    /// Items the model removed.
    pub removed: u64,
}

/// How many items one projector's model holds of the scopes (`engram.p.<name>.traces`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TracesRequest {
    pub scopes: Vec<ScopeKey>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TracesResponse {
    pub projector: String,
    pub traces: u64,
}

/// What a working-memory request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkingOp {
    /// Sets `key` to `value`, expiring after `ttl_ms` (or the deployment's default).
    Put,
    Get,
    Delete,
    /// The live entries of the scope, bounded.
    List,
}

/// Events an agent appends, through the query service: the agent's key may publish on its
/// own query subjects only, so no reply subject it names can make the stream, a bucket or
/// the JetStream API publish for it (a JetStream publish is acknowledged at whatever reply
/// subject the publisher chose). The service checks each event against the caller the
/// subject names (tenant, `agent_id`, a scope its key may write) and appends it with the
/// same deduplication key a direct append uses, so a retried request stores nothing twice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendRequest {
    /// 1..=[`limits::MAX_APPEND_EVENTS`] events, each the envelope contract.
    #[schemars(length(min = 1, max = limits::MAX_APPEND_EVENTS))]
    pub events: Vec<engram_schema::Envelope>,
    /// Store the (single) event only if its subject's last sequence is exactly this (0: the
    /// subject must be empty); otherwise it fails with `conflict`.
    #[serde(default)]
    pub expected_last_subject_seq: Option<u64>,
}

/// One result per event, in request order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendResponse {
    pub results: Vec<AppendResult>,
}

/// One event's outcome: stored (`seq`, `duplicate` when its id was already stored), or why
/// not. Nothing of a failed event was stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendResult {
    #[serde(default)]
    pub seq: Option<Seq>,
    #[serde(default)]
    pub duplicate: bool,
    /// The event's encoded size.
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub error: Option<AppendFailure>,
}

/// Why one event was not stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendFailure {
    /// `invalid`, `too_large`, `conflict`, `unavailable` (safe to retry with the same event
    /// id), `rejected` or `forbidden`.
    pub kind: String,
    pub message: String,
    /// `too_large`: the event's size and the limit.
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub max: Option<u64>,
}

/// Working memory of the request's own scope (never its grants: working memory is the
/// scope's scratch space), through the query service: how an agent, whose key reaches no
/// bucket directly, keeps it. Put and delete need a scope the agent's key may write.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkingRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    pub op: WorkingOp,
    #[serde(default)]
    #[schemars(length(max = limits::MAX_NAME_BYTES))]
    pub key: Option<String>,
    /// Text for `put`.
    #[serde(default)]
    pub value: Option<String>,
    /// `put` only: how long the entry lives, in ms (default: the deployment's
    /// `working_memory.default_ttl`), 1000..=[`limits::MAX_WORKING_TTL_MS`] (7 days).
    #[serde(default)]
    #[schemars(range(min = limits::MIN_WORKING_TTL_MS, max = limits::MAX_WORKING_TTL_MS))]
    pub ttl_ms: Option<u64>,
}

impl WorkingRequest {
    /// Everything but the scopes ([`ScopeRequest::resolve`]).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.scopes.grants.is_empty() {
            return Err(InvalidField::new(
                "grants",
                "working memory reads and writes the own scope only",
            ));
        }
        let needs_key = self.op != WorkingOp::List;
        match &self.key {
            None if needs_key => return Err(InvalidField::new("key", "required")),
            Some(k) if k.len() > limits::MAX_NAME_BYTES => {
                return Err(InvalidField::new(
                    "key",
                    format!("at most {} bytes", limits::MAX_NAME_BYTES),
                ));
            }
            _ => {}
        }
        if (self.op == WorkingOp::Put) != self.value.is_some() {
            return Err(InvalidField::new(
                "value",
                "given with put, and only with put",
            ));
        }
        if let Some(ttl) = self.ttl_ms {
            if self.op != WorkingOp::Put {
                return Err(InvalidField::new("ttl_ms", "given with put only"));
            }
            if !(limits::MIN_WORKING_TTL_MS..=limits::MAX_WORKING_TTL_MS).contains(&ttl) {
                return Err(InvalidField::new(
                    "ttl_ms",
                    format!(
                        "{ttl} ms is outside {}..={} ms; working memory is scratch space: keep what must last as events",
                        limits::MIN_WORKING_TTL_MS,
                        limits::MAX_WORKING_TTL_MS
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkingEntry {
    pub key: String,
    pub value: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkingResponse {
    /// The entry asked for (`get`), or the scope's live entries (`list`).
    pub entries: Vec<WorkingEntry>,
    /// Entries `list` left out past its bounds.
    pub left_out: usize,
    /// The revision a `put` stored.
    pub revision: Option<u64>,
}

/// An event as the stream stored it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReplayedEvent {
    pub seq: Seq,
    pub stored_at: DateTime<Utc>,
    pub event: engram_schema::Envelope,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReplayResponse {
    pub events: Vec<ReplayedEvent>,
    /// The stream's first and last sequence when the page was read: a first sequence above
    /// `after_seq + 1` means retention dropped history the replay cannot return.
    pub first_seq: Seq,
    pub last_seq: Seq,
    /// The `after_seq` of the next page.
    pub next_after: Seq,
    /// Nothing of these scopes is left up to `last_seq`.
    pub done: bool,
}

/// A new instance's start: the slice of `model`'s newest good snapshot (at most `version`)
/// that the request's scopes may read, in the checkpoint format; the instance then replays
/// the stream after the snapshot's version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BootstrapRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    /// `facts`, `skills` or `docs`.
    pub model: Ident,
    #[serde(default)]
    pub version: Option<Seq>,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

/// Cut a snapshot of every read model now (SDK `client.snapshot`), with an optional label:
/// labelled snapshots are kept by retention, so a run can be bootstrapped from exactly this
/// point later. A snapshot holds every scope of a model; a bootstrap hands each instance only
/// the slice of its own scopes, which the scopes here are checked like any request's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCutRequest {
    #[serde(flatten)]
    pub scopes: ScopeRequest,
    /// 1-64 of `A-Z a-z 0-9 _ - .`.
    #[serde(default)]
    pub label: Option<String>,
}

impl SnapshotCutRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let Some(label) = &self.label {
            let ok = (1..=64).contains(&label.len())
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            if !ok {
                return Err(InvalidField::new("label", "use 1-64 of A-Z a-z 0-9 _ - ."));
            }
        }
        Ok(())
    }
}

/// The snapshots cut, one per read model that can export itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SnapshotCutResponse {
    /// Each model's snapshot index entry (projector, version, label, sizes, hashes): the
    /// newest one, when nothing was applied since it and no label was asked for.
    pub snapshots: Vec<serde_json::Value>,
    /// Models that did not cut one, and why (one that cannot export itself, one not running).
    #[serde(default)]
    pub skipped: Vec<String>,
}

/// The snapshot a bootstrap slice was cut from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BootstrapSnapshot {
    pub version: Seq,
    #[serde(default)]
    pub label: Option<String>,
    pub created_at: DateTime<Utc>,
    /// The whole model's state hash at the snapshot, hex.
    pub state_hash: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BootstrapResponse {
    pub model: Ident,
    /// `None`: no snapshot checks, replay the stream from its start.
    #[serde(default)]
    pub snapshot: Option<BootstrapSnapshot>,
    /// Newer snapshots that did not check, and why.
    #[serde(default)]
    pub skipped: Vec<String>,
    /// The slice, base64 of the checkpoint format (magic, MessagePack of ledger and model,
    /// blake3).
    #[serde(default)]
    pub bytes: Option<String>,
    /// For a slice of scopes in several partitions of the stream, each cut from its own
    /// partition's snapshot: how far each scope is held. The slice's own sequence is the
    /// least of them; a scope's events at or below its `seq` are in the slice already, and
    /// a replay of the tail skips them. Empty: every scope is held through the slice's
    /// sequence.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<ScopeHeld>,
}

/// How far a bootstrap slice holds one scope: see [`BootstrapResponse::held`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ScopeHeld {
    pub scope: ScopeKey,
    pub seq: Seq,
}

/// What an agent asks for at the start of each step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
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
    #[schemars(range(min = 1, max = limits::MAX_TOKEN_BUDGET))]
    pub token_budget: usize,
    #[serde(default, flatten)]
    pub consistency: Consistency,
}

/// One item of an assembled context.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ContextItem {
    /// working, episodic, semantic (memories and facts) or procedural.
    pub layer: Layer,
    pub text: String,
    pub tokens: usize,
    /// Where it came from: an event id, a fact's source, a skill name, a working-memory key.
    pub source: String,
    pub score: f32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed or refers to scopes it may not read (400).
    Invalid,
    /// The caller's identity may not do this: another tenant, or a scope it holds no grant
    /// of (403).
    Forbidden,
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
            Self::Forbidden => 403,
            Self::NotYetVisible => 408,
            Self::Busy => 429,
            Self::Unavailable => 503,
            Self::Internal => 500,
        }
    }

    pub fn from_status(code: usize) -> Self {
        match code {
            400 => Self::Invalid,
            403 => Self::Forbidden,
            408 => Self::NotYetVisible,
            429 => Self::Busy,
            503 => Self::Unavailable,
            _ => Self::Internal,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

/// A request a projector answers: checked in full before anything waits or runs (the
/// projector endpoints are reachable without the query service), carrying its
/// read-your-writes token.
pub trait ProjectorRequest {
    fn validate(&self) -> Result<(), InvalidField>;
    fn consistency(&self) -> Consistency;
}

macro_rules! projector_request {
    ($($t:ty),+) => {$(
        impl ProjectorRequest for $t {
            fn validate(&self) -> Result<(), InvalidField> {
                <$t>::validate(self)
            }
            fn consistency(&self) -> Consistency {
                self.consistency
            }
        }
    )+};
}

projector_request!(
    ConsolidateRequest,
    SearchRequest,
    NeighboursRequest,
    FactsRequest,
    SkillsRequest,
    DocRequest,
    BootstrapRequest
);

/// The consolidation steps a request may name.
pub const CONSOLIDATION_STEPS: [&str; 3] = ["dedup", "summarise", "decay"];

impl ConsolidateRequest {
    /// Everything but the scopes ([`ScopeRequest::resolve`]): known steps, no grants (a
    /// plan is of one scope).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.scopes.grants.is_empty() {
            return Err(InvalidField::new(
                "grants",
                "consolidation plans one scope: ask without grants",
            ));
        }
        check_range("steps", self.steps.len(), 0, CONSOLIDATION_STEPS.len())?;
        check_range("restore", self.restore.len(), 0, 1000)?;
        if !self.restore.is_empty() && !self.steps.is_empty() {
            return Err(InvalidField::new(
                "restore",
                "a restore runs no steps: ask for one or the other",
            ));
        }
        if let Some(bad) = self
            .steps
            .iter()
            .find(|s| !CONSOLIDATION_STEPS.contains(&s.as_str()))
        {
            return Err(InvalidField::new(
                "steps",
                format!(
                    "unknown step {:?}; use {}",
                    bad.chars().take(64).collect::<String>(),
                    CONSOLIDATION_STEPS.join(", ")
                ),
            ));
        }
        self.consistency.validate()
    }
}

impl BootstrapRequest {
    /// Everything but the scopes ([`ScopeRequest::resolve`]).
    pub fn validate(&self) -> Result<(), InvalidField> {
        let keeps = read_models::spec(self.model.as_str()).is_some_and(|m| m.scope_snapshots);
        if !keeps {
            let mut models: Vec<&str> = read_models::with_scope_snapshots().collect();
            let last = models.pop().unwrap_or_default();
            return Err(InvalidField::new(
                "model",
                format!(
                    "{} keeps no scope snapshots; use {} or {last}",
                    self.model,
                    models.join(", ")
                ),
            ));
        }
        self.consistency.validate()
    }
}

impl DocRequest {
    /// Everything but the scopes ([`ScopeRequest::resolve`]).
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_range("limit", self.limit, 1, limits::MAX_DOC_ITEMS)?;
        if self.read != DocRead::List {
            if self.doc_type.is_none() {
                return Err(InvalidField::new(
                    "doc_type",
                    "give the document's type, for example task_board",
                ));
            }
            if self.name.is_none() {
                return Err(InvalidField::new("name", "give the document's name"));
            }
        }
        if self.include_bytes && self.read != DocRead::State {
            return Err(InvalidField::new(
                "include_bytes",
                "only a state read returns the document's bytes",
            ));
        }
        self.consistency.validate()
    }
}

impl Consistency {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let Some(wait) = self.wait_ms
            && wait > limits::MAX_WAIT_MS
        {
            return Err(InvalidField::new(
                "wait_ms",
                format!(
                    "{wait} ms is longer than the longest wait, {} ms; retry instead of waiting longer",
                    limits::MAX_WAIT_MS
                ),
            ));
        }
        Ok(())
    }
}

impl MemoryFilter {
    pub fn validate(&self) -> Result<(), InvalidField> {
        let max = limits::MAX_FILTER_VALUES;
        check_range("filter.layers", self.layers.len(), 0, max)?;
        check_range("filter.kinds", self.kinds.len(), 0, max)?;
        check_range("filter.tags", self.tags.len(), 0, max)?;
        if let Some(tag) = self
            .tags
            .iter()
            .find(|t| t.len() > engram_schema::envelope::MAX_TAG_LEN)
        {
            return Err(InvalidField::new(
                "filter.tags",
                format!(
                    "a tag of {} bytes; tags are at most {} bytes",
                    tag.len(),
                    engram_schema::envelope::MAX_TAG_LEN
                ),
            ));
        }
        if let Some(m) = self.min_importance {
            check_weight("filter.min_importance", m, 0.0, 1.0)?;
        }
        if let Some(m) = self.min_confidence {
            check_weight("filter.min_confidence", m, 0.0, 1.0)?;
        }
        Ok(())
    }
}

impl RetrieveRequest {
    /// Everything but the scopes ([`ScopeRequest::resolve`]); `max_top_k` is the deployment's
    /// own cap, itself at most [`limits::MAX_TOP_K`].
    pub fn validate(&self, max_top_k: usize) -> Result<(), InvalidField> {
        check_text("query", &self.query, limits::MAX_QUERY_BYTES)?;
        check_limit("top_k", self.top_k, max_top_k.min(limits::MAX_TOP_K))?;
        check_vector("vector", self.vector.as_ref())?;
        if self.query.trim().is_empty() && self.vector.is_none() {
            return Err(InvalidField::new(
                "query",
                "give a query text or a query vector",
            ));
        }
        self.filter.validate()?;
        self.consistency.validate()?;
        if let Some(ranking) = &self.ranking {
            ranking.validate()?;
        }
        Ok(())
    }
}

impl SearchRequest {
    /// A projector checks this itself: its endpoint is reachable without the query service.
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_limit("scopes", self.scopes.len(), limits::MAX_SCOPES)?;
        check_text("query", &self.query, limits::MAX_QUERY_BYTES)?;
        check_vector("vector", self.vector.as_ref())?;
        check_range("k", self.k, 0, limits::MAX_SEARCH_K)?;
        check_range("rest", self.rest, 0, 4 * limits::MAX_SEARCH_K)?;
        check_range(
            "score_also",
            self.score_also.len(),
            0,
            limits::MAX_SCORE_ALSO,
        )?;
        self.filter.validate()?;
        self.consistency.validate()
    }
}

impl NeighboursRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_limit("event_ids", self.event_ids.len(), limits::MAX_NEIGHBOUR_IDS)?;
        check_limit("k", self.k, limits::MAX_NEIGHBOURS)?;
        if !self.min_similarity.is_finite() {
            return Err(InvalidField::new(
                "min_similarity",
                "must be a finite number",
            ));
        }
        check_range("min_similarity", self.min_similarity, 0.0, 1.0)?;
        self.consistency.validate()
    }
}

impl FactsRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        for (field, text) in [
            ("subject", &self.subject),
            ("predicate", &self.predicate),
            ("text", &self.text),
        ] {
            if let Some(text) = text {
                check_text(field, text, limits::MAX_QUERY_BYTES)?;
            }
        }
        check_limit("limit", self.limit, limits::MAX_LIMIT)?;
        self.consistency.validate()
    }
}

impl SkillsRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let Some(task) = &self.task {
            check_text("task", task, limits::MAX_QUERY_BYTES)?;
        }
        if let Some(name) = &self.name {
            check_text("name", name, limits::MAX_NAME_BYTES)?;
        }
        check_limit("limit", self.limit, limits::MAX_LIMIT)?;
        self.consistency.validate()
    }
}

impl ContextRequest {
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_text("query", &self.query, limits::MAX_QUERY_BYTES)?;
        check_text("task", &self.task, limits::MAX_NAME_BYTES)?;
        check_vector("vector", self.vector.as_ref())?;
        check_limit("token_budget", self.token_budget, limits::MAX_TOKEN_BUDGET)?;
        self.consistency.validate()
    }
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

/// The query protocol as one JSON document, published as `schemas/json/query.v1.json`: every
/// endpoint's subject with its request and response types, the error codes, and the types
/// under `$defs`. What JSON Schema cannot say (byte limits of texts, scope grant rules) is in
/// the descriptions and checked by the `validate` methods.
pub fn json_schema() -> serde_json::Value {
    let mut generator = schemars::generate::SchemaSettings::draft2020_12().into_generator();
    let endpoint = |subject: &str, served_by: &str, request, response| {
        serde_json::json!({
            "subject": subject,
            "served_by": served_by,
            "request": request,
            "response": response,
        })
    };
    // Each partition's instance answers `<subject>.<partition>`.
    let projector = |name: &str, op: &str| format!("engram.p.{name}.{op}.<partition>");
    let public = vec![
        endpoint(
            RETRIEVE,
            QUERY_SERVICE,
            generator.subschema_for::<RetrieveRequest>(),
            generator.subschema_for::<RetrieveResponse>(),
        ),
        endpoint(
            CONTEXT,
            QUERY_SERVICE,
            generator.subschema_for::<ContextRequest>(),
            generator.subschema_for::<Context>(),
        ),
        endpoint(
            FACTS,
            QUERY_SERVICE,
            generator.subschema_for::<FactsRequest>(),
            generator.subschema_for::<FactsResponse>(),
        ),
        endpoint(
            SKILLS,
            QUERY_SERVICE,
            generator.subschema_for::<SkillsRequest>(),
            generator.subschema_for::<SkillsResponse>(),
        ),
        endpoint(
            DOC,
            QUERY_SERVICE,
            generator.subschema_for::<DocRequest>(),
            generator.subschema_for::<DocResponse>(),
        ),
        endpoint(
            BOOTSTRAP,
            QUERY_SERVICE,
            generator.subschema_for::<BootstrapRequest>(),
            generator.subschema_for::<BootstrapResponse>(),
        ),
        endpoint(
            CONSOLIDATE,
            QUERY_SERVICE,
            generator.subschema_for::<ConsolidateRequest>(),
            generator.subschema_for::<ConsolidateResponse>(),
        ),
        endpoint(
            REPLAY,
            QUERY_SERVICE,
            generator.subschema_for::<ReplayRequest>(),
            generator.subschema_for::<ReplayResponse>(),
        ),
        endpoint(
            BRIEF,
            QUERY_SERVICE,
            generator.subschema_for::<BriefRequest>(),
            generator.subschema_for::<BriefResponse>(),
        ),
        endpoint(
            WORKING,
            QUERY_SERVICE,
            generator.subschema_for::<WorkingRequest>(),
            generator.subschema_for::<WorkingResponse>(),
        ),
        endpoint(
            "engram.q.<tenant>.<agent>.append",
            QUERY_SERVICE,
            generator.subschema_for::<AppendRequest>(),
            generator.subschema_for::<AppendResponse>(),
        ),
        endpoint(
            "engram.q.<tenant>.<agent>.whoami",
            QUERY_SERVICE,
            generator.subschema_for::<WhoamiRequest>(),
            generator.subschema_for::<WhoamiResponse>(),
        ),
        endpoint(
            SCOPES,
            QUERY_SERVICE,
            generator.subschema_for::<ScopesRequest>(),
            generator.subschema_for::<ScopesResponse>(),
        ),
        endpoint(
            SNAPSHOTS,
            QUERY_SERVICE,
            generator.subschema_for::<SnapshotsRequest>(),
            generator.subschema_for::<SnapshotsResponse>(),
        ),
        endpoint(
            DEAD_LETTERS,
            QUERY_SERVICE,
            generator.subschema_for::<DeadLettersRequest>(),
            generator.subschema_for::<DeadLettersResponse>(),
        ),
    ];
    let internal = vec![
        endpoint(
            &projector(read_models::VECTOR, read_models::SEARCH_OP),
            "engram-vector",
            generator.subschema_for::<SearchRequest>(),
            generator.subschema_for::<SearchResponse>(),
        ),
        endpoint(
            &projector(read_models::VECTOR, read_models::NEIGHBOURS_OP),
            "engram-vector",
            generator.subschema_for::<NeighboursRequest>(),
            generator.subschema_for::<NeighboursResponse>(),
        ),
        endpoint(
            &projector(read_models::KEYWORD, read_models::SEARCH_OP),
            "engram-keyword",
            generator.subschema_for::<SearchRequest>(),
            generator.subschema_for::<SearchResponse>(),
        ),
        endpoint(
            &projector(read_models::FACTS, read_models::QUERY_OP),
            "engram-facts",
            generator.subschema_for::<FactsRequest>(),
            generator.subschema_for::<FactsResponse>(),
        ),
        endpoint(
            &projector(read_models::SKILLS, read_models::SEARCH_OP),
            "engram-skills",
            generator.subschema_for::<SkillsRequest>(),
            generator.subschema_for::<SkillsResponse>(),
        ),
        endpoint(
            &projector(read_models::DOCS, read_models::GET_OP),
            "engram-docs",
            generator.subschema_for::<DocRequest>(),
            generator.subschema_for::<DocResponse>(),
        ),
        endpoint(
            &projector("<name>", "erase"),
            "every engram projector",
            generator.subschema_for::<EraseScopesRequest>(),
            generator.subschema_for::<EraseScopesResponse>(),
        ),
        endpoint(
            &projector("<name>", "traces"),
            "every engram projector",
            generator.subschema_for::<TracesRequest>(),
            generator.subschema_for::<TracesResponse>(),
        ),
    ];
    let errors: Vec<serde_json::Value> = [
        ErrorCode::Invalid,
        ErrorCode::Forbidden,
        ErrorCode::NotYetVisible,
        ErrorCode::Busy,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ]
    .into_iter()
    .map(|code| serde_json::json!({"code": code, "status": code.http_status()}))
    .collect();
    let error_code = generator.subschema_for::<ErrorCode>();
    serde_json::json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "engram query protocol v1",
        "description": "JSON request/reply over NATS (the NATS services convention). A failure is a reply with the header Nats-Service-Error-Code (the status below) and Nats-Service-Error (the message). Send Engram-Timeout-Ms with your own timeout so the service drops work you no longer wait for.",
        "endpoints": public,
        "internal_endpoints": internal,
        "errors": {"codes": errors, "code": error_code},
        "$defs": generator.take_definitions(true),
    })
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
    fn the_read_model_table_names_each_model_once_and_bootstrap_follows_it() {
        let names: Vec<&str> = read_models::TABLE.iter().map(|m| m.name).collect();
        assert_eq!(read_models::ALL.to_vec(), names);
        for spec in read_models::TABLE {
            assert_eq!(
                names.iter().filter(|n| **n == spec.name).count(),
                1,
                "{spec:?}"
            );
            assert!(!spec.ops.is_empty(), "{spec:?}: no main op");
            assert_eq!(
                read_models::spec(spec.name).map(|m| m.name),
                Some(spec.name)
            );
            assert_eq!(read_models::ModelRole::of(spec.name), spec.role);
            let asked = BootstrapRequest {
                scopes: request("task:t1", &[]),
                model: Ident::parse("model", spec.name).unwrap(),
                version: None,
                consistency: Consistency::default(),
            };
            assert_eq!(asked.validate().is_ok(), spec.scope_snapshots, "{spec:?}");
        }
        let refused = BootstrapRequest {
            scopes: request("task:t1", &[]),
            model: Ident::parse("model", read_models::VECTOR).unwrap(),
            version: None,
            consistency: Consistency::default(),
        }
        .validate()
        .unwrap_err();
        assert!(
            refused.to_string().contains("use facts, skills or docs"),
            "{refused}"
        );
        assert_eq!(
            read_models::ModelRole::of("not-a-model"),
            read_models::ModelRole::Projector
        );
    }

    /// Clients in other languages read the published copy; a stale one would mislead them.
    #[test]
    fn committed_query_schema_is_current() {
        let mut text = serde_json::to_string_pretty(&json_schema()).unwrap();
        text.push('\n');
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../schemas/json/query.v1.json"
        );
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == text,
            "{path} is stale; run `just schema` (cargo run -p engram-memory --bin engram-query-schema -- schemas/json/query.v1.json)"
        );
    }

    #[test]
    fn the_query_schema_states_the_limits() {
        let schema = json_schema().to_string();
        assert!(
            schema.contains("\"maximum\":60000"),
            "wait_ms bound missing"
        );
        assert!(schema.contains("engram.q.retrieve"));
        assert!(schema.contains("\"status\":429"));
    }

    #[test]
    fn a_neighbours_request_is_bounded_in_ids_neighbours_and_radius() {
        let ok = NeighboursRequest {
            scope: ScopeKey::new(
                Ident::parse("tenant", "acme").unwrap(),
                "team:core".parse().unwrap(),
            ),
            event_ids: vec![EventId::new()],
            min_similarity: 0.9,
            k: 4,
            consistency: Consistency::default(),
        };
        ok.validate().unwrap();
        let field = |r: NeighboursRequest| r.validate().unwrap_err().field;
        let many = vec![EventId::new(); limits::MAX_NEIGHBOUR_IDS + 1];
        for (bad, named) in [
            (
                NeighboursRequest {
                    event_ids: many,
                    ..ok.clone()
                },
                "event_ids",
            ),
            (
                NeighboursRequest {
                    event_ids: vec![],
                    ..ok.clone()
                },
                "event_ids",
            ),
            (NeighboursRequest { k: 0, ..ok.clone() }, "k"),
            (
                NeighboursRequest {
                    k: limits::MAX_NEIGHBOURS + 1,
                    ..ok.clone()
                },
                "k",
            ),
            (
                NeighboursRequest {
                    min_similarity: f32::NAN,
                    ..ok.clone()
                },
                "min_similarity",
            ),
            (
                NeighboursRequest {
                    min_similarity: 1.5,
                    ..ok.clone()
                },
                "min_similarity",
            ),
        ] {
            assert_eq!(field(bad), named);
        }
    }

    #[test]
    fn min_confidence_is_a_finite_number_in_0_to_1() {
        for ok in [0.0, 0.6, 1.0] {
            let filter = MemoryFilter {
                min_confidence: Some(ok),
                ..MemoryFilter::default()
            };
            filter.validate().unwrap();
        }
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            let filter = MemoryFilter {
                min_confidence: Some(bad),
                ..MemoryFilter::default()
            };
            assert_eq!(
                filter.validate().unwrap_err().field,
                "filter.min_confidence",
                "{bad}"
            );
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

    /// Decodes `body` as `T` and encodes it again: what a Rust client sends of it.
    fn via<T: Serialize + serde::de::DeserializeOwned>(
        body: &serde_json::Value,
    ) -> Result<serde_json::Value, String> {
        let decoded: T = serde_json::from_value(body.clone()).map_err(|e| e.to_string())?;
        serde_json::to_value(&decoded).map_err(|e| e.to_string())
    }

    type Via = fn(&serde_json::Value) -> Result<serde_json::Value, String>;

    /// Every request type with a smallest valid body, by the name its schema has.
    fn every_request() -> Vec<(&'static str, Via, serde_json::Value)> {
        use serde_json::json;
        let scope = json!({"kind": "task", "id": "t1"});
        let key = json!({"tenant": "acme", "kind": "task", "id": "t1"});
        let scoped = |extra: serde_json::Value| {
            let mut body = json!({"tenant": "acme", "scope": scope.clone()});
            if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
                body.extend(extra.clone());
            }
            body
        };
        vec![
            (
                "RetrieveRequest",
                via::<RetrieveRequest> as Via,
                scoped(json!({"query": "q"})),
            ),
            (
                "ContextRequest",
                via::<ContextRequest>,
                scoped(json!({"agent_id": "a1", "task": "t1", "query": "q", "token_budget": 100})),
            ),
            ("FactsRequest", via::<FactsRequest>, scoped(json!({}))),
            ("SkillsRequest", via::<SkillsRequest>, scoped(json!({}))),
            ("BriefRequest", via::<BriefRequest>, scoped(json!({}))),
            (
                "DocRequest",
                via::<DocRequest>,
                scoped(json!({"read": "list"})),
            ),
            (
                "BootstrapRequest",
                via::<BootstrapRequest>,
                scoped(json!({"model": "facts"})),
            ),
            (
                "ConsolidateRequest",
                via::<ConsolidateRequest>,
                scoped(json!({})),
            ),
            ("ReplayRequest", via::<ReplayRequest>, scoped(json!({}))),
            (
                "AppendRequest",
                via::<AppendRequest>,
                json!({"events": [{
                    "schema_version": 1, "event_id": "0190a0b0-0000-7000-8000-000000000001",
                    "tenant": "acme", "scope": scope.clone(), "agent_id": "a1",
                    "instance_id": "i1", "layer": "episodic", "kind": "observation",
                    "occurred_at": "2026-01-01T00:00:00Z", "recorded_at": "2026-01-01T00:00:00Z",
                    "content": {"text": "x"}, "importance": 0.5, "tags": [],
                }]}),
            ),
            (
                "WorkingRequest",
                via::<WorkingRequest>,
                scoped(json!({"op": "list"})),
            ),
            ("WhoamiRequest", via::<WhoamiRequest>, json!({})),
            (
                "ScopesRequest",
                via::<ScopesRequest>,
                json!({"tenant": "acme"}),
            ),
            ("SnapshotsRequest", via::<SnapshotsRequest>, json!({})),
            (
                "DeadLettersRequest",
                via::<DeadLettersRequest>,
                json!({"tenant": "acme"}),
            ),
            (
                "SnapshotCutRequest",
                via::<SnapshotCutRequest>,
                scoped(json!({})),
            ),
            (
                "SearchRequest",
                via::<SearchRequest>,
                json!({"scopes": [key.clone()], "query": "q", "k": 5}),
            ),
            (
                "NeighboursRequest",
                via::<NeighboursRequest>,
                json!({"scope": key.clone(), "event_ids": [], "min_similarity": 0.9, "k": 4}),
            ),
            (
                "EraseScopesRequest",
                via::<EraseScopesRequest>,
                json!({"scopes": [key.clone()]}),
            ),
            (
                "TracesRequest",
                via::<TracesRequest>,
                json!({"scopes": [key]}),
            ),
            // Decoded alone by the projectors' status and ledger endpoints.
            ("Consistency", via::<Consistency>, json!({})),
            ("ScopeRequest", via::<ScopeRequest>, scoped(json!({}))),
            ("Ranking", via::<Ranking>, json!({})),
            ("MemoryFilter", via::<MemoryFilter>, json!({})),
        ]
    }

    fn with(body: &serde_json::Value, key: &str, value: serde_json::Value) -> serde_json::Value {
        let mut body = body.clone();
        body.as_object_mut()
            .expect("a request is an object")
            .insert(key.to_owned(), value);
        body
    }

    /// A misspelt field was dropped in silence: `grnt` read no grant, `min_sq` read stale
    /// state. Every request type, and every type flattened into one, refuses it by name; and
    /// what a Rust client encodes of a request still decodes (the flattened parts included).
    #[test]
    fn unknown_fields_are_refused_in_every_request() {
        for (name, via, body) in every_request() {
            let sent = via(&body).unwrap_or_else(|e| panic!("{name}: {body} does not decode: {e}"));
            via(&sent)
                .unwrap_or_else(|e| panic!("{name}: its own encoding {sent} is refused: {e}"));
            let mut misspelt = vec![("grnt", with(&sent, "grnt", serde_json::json!([])))];
            // The flattened parts: a type that carries them must refuse their misspellings.
            if sent.get("wait_ms").is_some() {
                misspelt.push(("min_sq", with(&sent, "min_sq", 3.into())));
            }
            if sent.get("grants").is_some() {
                misspelt.push(("grant", with(&sent, "grant", serde_json::json!([]))));
            }
            for (field, body) in misspelt {
                let e = via(&body).expect_err(&format!("{name} took `{field}`: {body}"));
                assert!(
                    e.contains(&format!("unknown field `{field}`")),
                    "{name}: {e}"
                );
            }
        }
    }

    /// Misspelt fields inside a request's objects are refused too, naming them.
    #[test]
    fn unknown_fields_are_refused_inside_requests() {
        use serde_json::json;
        let retrieve = every_request()
            .into_iter()
            .find(|(name, ..)| *name == "RetrieveRequest")
            .expect("listed")
            .2;
        let search = json!({"scopes": [], "query": "q", "k": 5});
        for (body, field) in [
            (with(&retrieve, "filter", json!({"tgs": ["x"]})), "tgs"),
            (with(&retrieve, "ranking", json!({"rrf": 1})), "rrf"),
            (
                with(&search, "filter", json!({"min_confidance": 0.5})),
                "min_confidance",
            ),
        ] {
            let e = match body.get("k") {
                Some(_) => via::<SearchRequest>(&body),
                None => via::<RetrieveRequest>(&body),
            }
            .expect_err(&body.to_string());
            assert!(e.contains(&format!("unknown field `{field}`")), "{e}");
        }
    }

    /// The published schema says what the decoders do: no request takes other properties,
    /// and the table above covers every request an endpoint takes.
    #[test]
    fn every_request_schema_refuses_other_properties() {
        let schema = json_schema();
        let listed: Vec<&str> = every_request().iter().map(|(name, ..)| *name).collect();
        let defs = &schema["$defs"];
        let endpoints = schema["endpoints"]
            .as_array()
            .into_iter()
            .chain(schema["internal_endpoints"].as_array())
            .flatten();
        for endpoint in endpoints {
            let reference = endpoint["request"]["$ref"].as_str().expect("a $ref");
            let name = reference.trim_start_matches("#/$defs/");
            assert!(
                listed.contains(&name),
                "{name} is missing from every_request"
            );
            assert_eq!(
                defs[name]["additionalProperties"],
                serde_json::Value::Bool(false),
                "{name}"
            );
        }
        for nested in ["Ranking", "MemoryFilter"] {
            assert_eq!(
                defs[nested]["additionalProperties"],
                serde_json::Value::Bool(false),
                "{nested}"
            );
        }
    }

    #[test]
    fn a_working_ttl_is_bounded() {
        let put = |ttl_ms: Option<u64>| WorkingRequest {
            scopes: request("task:t1", &[]),
            op: WorkingOp::Put,
            key: Some("k".into()),
            value: Some("v".into()),
            ttl_ms,
        };
        for ok in [
            None,
            Some(limits::MIN_WORKING_TTL_MS),
            Some(limits::MAX_WORKING_TTL_MS),
        ] {
            put(ok).validate().unwrap();
        }
        for bad in [
            0,
            limits::MIN_WORKING_TTL_MS - 1,
            limits::MAX_WORKING_TTL_MS + 1,
            u64::MAX,
        ] {
            let e = put(Some(bad)).validate().unwrap_err();
            assert_eq!(e.field, "ttl_ms", "{bad}");
            assert!(
                e.reason.contains(&limits::MAX_WORKING_TTL_MS.to_string()),
                "{e}"
            );
        }
        let get = WorkingRequest {
            op: WorkingOp::Get,
            value: None,
            ..put(Some(60_000))
        };
        assert_eq!(get.validate().unwrap_err().field, "ttl_ms");
    }
}

//! Vocabulary shared by the read models (vector, keyword, facts, skills) and the query service.
//!
//! Read models are keyed by sequence number: the stream sequence of the event a memory came
//! from is unique, totally ordered, and what read-your-writes tokens speak of.
//!
//! [`confidence`] is the pollution-defence rule the vector and keyword models both apply:
//! how contradicting outcomes and faulty-instance flags lower a memory's confidence.
//!
//! [`model`] is the base of the scope-keyed models (fact table, skill registry): the applied
//! seq and the rule that skips events at or below it, their snapshot shape, provenance and
//! payload errors. Their given/when/then test helpers are in `engram_fixtures::models`.

pub mod brief_inputs;
pub mod canon;
pub mod confidence;
pub mod model;
pub mod proto;

use std::fmt;

use chrono::{DateTime, Utc};
use engram_schema::{Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A stream sequence number: the identity of a memory inside every read model.
pub type Seq = u64;

/// One tenant's scope. Two keys are the same scope only if every part is equal: there is no
/// prefix or case-insensitive matching anywhere (a peer store leaked memory that way).
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub struct ScopeKey {
    pub tenant: Ident,
    pub kind: ScopeKind,
    pub id: Ident,
}

impl ScopeKey {
    pub fn new(tenant: Ident, scope: Scope) -> Self {
        Self {
            tenant,
            kind: scope.kind,
            id: scope.id,
        }
    }

    pub fn of(event: &Envelope) -> Self {
        Self::new(event.tenant.clone(), event.scope.clone())
    }

    /// Which of `partitions` this scope falls in: the events stream's own partition
    /// function ([`engram_schema::partition_of`], nats-server's `partition()`), so work split
    /// by it (the memory nodes, the consolidator's leases) follows the stream's partitions.
    pub fn partition(&self, partitions: u32) -> u32 {
        engram_schema::partition_of(&self.tenant, self.kind, &self.id, partitions.max(1))
    }

    pub fn scope(&self) -> Scope {
        Scope {
            kind: self.kind,
            id: self.id.clone(),
        }
    }

    /// One opaque token, `tenant/kind/id`, for indexes that match whole terms (tantivy's
    /// `STRING` fields). `/` cannot occur in an identifier, so distinct keys give distinct tokens.
    pub fn token(&self) -> String {
        format!("{}/{}/{}", self.tenant, self.kind, self.id)
    }
}

impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.tenant, self.kind, self.id)
    }
}

/// What the read models keep about a text memory besides its text and vector: enough to
/// filter (by confidence too), rank by time and importance, and point back at the event.
///
/// Checkpoints encode it as an array: new fields go last, with a serde default, so that
/// older checkpoints still load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryMeta {
    pub seq: Seq,
    pub event_id: EventId,
    pub scope: ScopeKey,
    pub agent_id: Ident,
    pub layer: Layer,
    pub kind: EventKind,
    pub occurred_at: DateTime<Utc>,
    pub importance: f64,
    pub tags: Vec<String>,
    /// The instance that wrote it, which a faulty-instance flag names. `None` only for a
    /// memory restored from a checkpoint written before it was kept: no flag reaches such a
    /// memory until the read model is rebuilt from the stream.
    #[serde(default)]
    pub instance_id: Option<Ident>,
    /// How much it is still trusted, in 0..=1: 1 when written, lowered by later outcomes that
    /// contradict it and by flags on its writer ([`confidence`]).
    #[serde(default = "full_confidence")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub confidence: f64,
}

fn full_confidence() -> f64 {
    1.0
}

impl MemoryMeta {
    pub fn of(seq: Seq, event: &Envelope) -> Self {
        Self {
            seq,
            event_id: event.event_id.clone(),
            scope: ScopeKey::of(event),
            agent_id: event.agent_id.clone(),
            layer: event.layer,
            kind: event.kind,
            occurred_at: event.occurred_at,
            importance: event.importance,
            tags: event.tags.clone(),
            instance_id: Some(event.instance_id.clone()),
            confidence: full_confidence(),
        }
    }
}

/// The tag the consolidator puts on a session summary. Retrieval keeps summaries apart
/// from the memories they distil (see `Ranking::summary_results`), and finds them by it.
pub const SUMMARY_TAG: &str = "summary";

/// Whether an event is a text memory for the vector and keyword indexes: episodic and
/// semantic events with text. Working memory lives in the KV bucket, procedural memory in
/// the skill registry. A `forgotten` event's text is its reason, not a memory, and a
/// `doc_changed` event's is a note on an edit the document store holds.
pub fn is_text_memory(event: &Envelope) -> bool {
    matches!(event.layer, Layer::Episodic | Layer::Semantic)
        && !matches!(event.kind, EventKind::Forgotten | EventKind::DocChanged)
        && !event.content.text.trim().is_empty()
}

/// Restrictions on which memories a query may return, beyond its scopes. Empty lists mean
/// "any"; `tags` matches a memory carrying at least one of them; `min_confidence` leaves out
/// memories that later outcomes contradicted or a faulty instance wrote ([`confidence`]).
///
/// Part of requests only: unknown fields are refused, so that a misspelt `min_confidence`
/// is an error rather than a filter that lets everything through.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryFilter {
    pub layers: Vec<Layer>,
    pub kinds: Vec<EventKind>,
    pub tags: Vec<String>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    pub min_importance: Option<f64>,
    /// 0..=1; default: none left out for their confidence.
    #[schemars(range(min = 0.0, max = 1.0))]
    pub min_confidence: Option<f64>,
}

impl MemoryFilter {
    pub fn matches(&self, meta: &MemoryMeta) -> bool {
        (self.layers.is_empty() || self.layers.contains(&meta.layer))
            && (self.kinds.is_empty() || self.kinds.contains(&meta.kind))
            && (self.tags.is_empty() || meta.tags.iter().any(|t| self.tags.contains(t)))
            && self.since.is_none_or(|t| meta.occurred_at >= t)
            && self.until.is_none_or(|t| meta.occurred_at < t)
            && self.min_importance.is_none_or(|m| meta.importance >= m)
            && self.min_confidence.is_none_or(|m| meta.confidence >= m)
    }
}

/// A scored memory from one retriever. Higher is better; scores of different retrievers are
/// not comparable, which is why fusion works on ranks and normalised scores.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Hit {
    pub seq: Seq,
    pub score: f32,
}

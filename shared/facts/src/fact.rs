//! The rows of the fact table.

use std::fmt;

use chrono::{DateTime, Utc};
use engram_memory::model::Provenance;
use engram_memory::{ScopeKey, Seq};
use engram_schema::Cardinality;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A fact's identity: the stream sequence of the assertion that created it. Merged
/// assertions keep the id of the first one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FactId(pub Seq);

impl fmt::Display for FactId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fact@{}", self.0)
    }
}

/// One assertion merged into a fact: what it claimed, and its validity as later knowledge
/// has cut it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Source {
    pub provenance: Provenance,
    /// Validity as asserted: the half-open interval `[valid_from, valid_to)`.
    pub valid_from: DateTime<Utc>,
    pub valid_to: Option<DateTime<Utc>>,
    /// Where this assertion's validity ends per the latest knowledge: `valid_to`, or earlier
    /// if a later single-valued assertion of another object starts earlier. A value at or
    /// before `valid_from` means later knowledge overrode this assertion entirely.
    pub valid_until: Option<DateTime<Utc>>,
    pub confidence: f64,
    pub cardinality: Cardinality,
}

impl Source {
    pub fn is_valid_at(&self, at: DateTime<Utc>) -> bool {
        self.valid_from <= at && self.valid_until.is_none_or(|until| at < until)
    }
}

/// One version of a fact: a subject's predicate having an object, over a valid time, as
/// believed over a transaction time. See the crate docs for the semantics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fact {
    pub id: FactId,
    pub scope: ScopeKey,
    /// Trimmed; case matters.
    pub subject: String,
    /// Trimmed; case matters.
    pub predicate: String,
    pub object: Value,
    /// The cardinality of the latest source (by `occurred_at`, then seq).
    pub cardinality: Cardinality,
    /// The earliest `valid_from` of the sources.
    pub valid_from: DateTime<Utc>,
    /// The latest `valid_until` of the sources, `None` if one is open-ended. Per the latest
    /// knowledge; a value at or before `valid_from` means the fact was overridden entirely.
    /// When later knowledge cut a merged fact in the middle, its validity has a gap: use
    /// [`Fact::is_valid_at`], which looks at each source.
    pub valid_to: Option<DateTime<Utc>>,
    /// Transaction time start: the earliest `recorded_at` of the sources.
    pub recorded_at: DateTime<Utc>,
    /// Transaction time end: the `recorded_at` of the retraction. Set once, never cleared.
    pub retracted_at: Option<DateTime<Utc>>,
    pub retracted_by: Option<Provenance>,
    /// The highest confidence of the sources.
    pub confidence: f64,
    /// The assertions merged into this fact, in stream order. Never empty.
    pub sources: Vec<Source>,
    /// The fact holding the first later single-valued assertion of another object, if any.
    /// Frozen at retraction for retracted facts.
    pub superseded_by: Option<FactId>,
}

impl Fact {
    /// Valid at `at` per the latest knowledge, ignoring retraction.
    pub fn is_valid_at(&self, at: DateTime<Utc>) -> bool {
        self.sources.iter().any(|source| source.is_valid_at(at))
    }

    pub fn is_retracted(&self) -> bool {
        self.retracted_at.is_some()
    }

    /// The latest source by `occurred_at`, then seq: the one that places this fact on the
    /// timeline.
    /// `None` only for a hand-built fact without sources; the table never holds one.
    pub fn latest_source(&self) -> Option<&Source> {
        self.sources
            .iter()
            .max_by_key(|source| source.provenance.position())
    }

    /// Recomputes what follows from the sources after one was added or cut.
    pub(crate) fn refresh_summary(&mut self) {
        self.valid_from = self
            .sources
            .iter()
            .map(|s| s.valid_from)
            .min()
            .unwrap_or(self.valid_from);
        self.recorded_at = self
            .sources
            .iter()
            .map(|s| s.provenance.recorded_at)
            .min()
            .unwrap_or(self.recorded_at);
        self.confidence = self
            .sources
            .iter()
            .map(|s| s.confidence)
            .fold(0.0, f64::max);
        self.cardinality = self
            .latest_source()
            .map_or(self.cardinality, |s| s.cardinality);
        self.valid_to = self
            .sources
            .iter()
            .try_fold(None, |latest: Option<DateTime<Utc>>, source| {
                source
                    .valid_until
                    .map(|until| Some(latest.map_or(until, |l| l.max(until))))
            })
            .flatten();
    }
}

//! The fact table: applying events and answering queries.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use engram_memory::canon::Canon;
use engram_memory::model::{EventModel, ScopedModel, ScopesMut};
use engram_memory::{ScopeKey, Seq};
use engram_schema::{Cardinality, Envelope, EventKind, FactRetracted};
use serde::{Deserialize, Serialize};

use crate::FactError;
use crate::Provenance;
use crate::fact::{Fact, FactId, Source};
use crate::group::Group;
use crate::payload::{self, Assertion};
use crate::text;

/// What [`FactTable::apply`] did with an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A `fact_asserted` event created a new fact.
    Created(FactId),
    /// A `fact_asserted` event repeated a believed fact and joined its sources.
    Merged(FactId),
    /// A `fact_retracted` event ended the belief in these facts; empty when nothing matched.
    Retracted(Vec<FactId>),
    /// Not a fact event; only the applied seq moved.
    Ignored,
    /// The seq is at or below the last applied one: nothing changed.
    AlreadyApplied,
}

/// subject -> predicate -> the versions of that fact, in order of creation.
type Subjects = BTreeMap<String, BTreeMap<String, Group>>;

/// The bi-temporal fact table of every scope. See the crate docs for the semantics.
///
/// A [`ScopedModel`] counting fact versions: it owns the applied seq, the snapshot shape and
/// the order everything is hashed in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FactTable {
    model: ScopedModel<Subjects>,
}

impl FactTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// The highest seq applied so far, `None` for a new table. Snapshots store it so that
    /// replay resumes after it.
    pub fn applied_seq(&self) -> Option<Seq> {
        self.model.applied_seq()
    }

    /// Applies the event at stream sequence `seq`.
    ///
    /// Idempotent by seq: when `seq` is at or below [`FactTable::applied_seq`] nothing
    /// changes and the answer is [`Applied::AlreadyApplied`]. Events other than
    /// `fact_asserted` and `fact_retracted` are [`Applied::Ignored`]. A malformed payload is
    /// an error and leaves the table unchanged, the applied seq included. The result
    /// depends only on `seq` and `event`, never on the clock.
    pub fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Applied, FactError> {
        let applied = self.model.apply(seq, |table| {
            // Parse everything before touching the table, so that a failure changes nothing.
            Ok(match event.kind {
                EventKind::FactAsserted => {
                    let assertion = payload::assertion(seq, event)?;
                    apply_assertion(table, seq, event, assertion)
                }
                EventKind::FactRetracted => {
                    let retraction = payload::retraction(seq, event)?;
                    apply_retraction(table, seq, event, retraction)
                }
                _ => Applied::Ignored,
            })
        })?;
        Ok(applied.unwrap_or(Applied::AlreadyApplied))
    }

    /// Facts valid now (by the wall clock) per the latest knowledge, not retracted. For a
    /// predicate asserted only as single-valued, all have one object (two versions of it
    /// when a retraction reopened an earlier one). Ordered by subject, predicate, then id.
    /// `subject` and `predicate` are trimmed and matched exactly (case matters).
    pub fn current(
        &self,
        scope: &ScopeKey,
        subject: Option<&str>,
        predicate: Option<&str>,
    ) -> Vec<&Fact> {
        self.as_of(scope, Utc::now(), None, subject, predicate)
    }

    /// The facts valid at `valid_at`, as Engram believed them at `known_at`: counting only
    /// assertions recorded by then and retractions recorded after it. `None` means the latest
    /// knowledge. The returned facts show their fields per the latest knowledge; only the
    /// selection is as of `known_at`. Ordered as [`FactTable::current`].
    pub fn as_of(
        &self,
        scope: &ScopeKey,
        valid_at: DateTime<Utc>,
        known_at: Option<DateTime<Utc>>,
        subject: Option<&str>,
        predicate: Option<&str>,
    ) -> Vec<&Fact> {
        let mut found = Vec::new();
        for group in self.groups(scope, subject, predicate) {
            let facts = group.facts();
            match known_at {
                // The stored validity is the latest knowledge already.
                None => found.extend(
                    facts
                        .iter()
                        .filter(|fact| !fact.is_retracted() && fact.is_valid_at(valid_at)),
                ),
                Some(known_at) => {
                    let timeline = group.timeline(Some(known_at));
                    found.extend(
                        (0..facts.len())
                            .filter(|&f| timeline.is_valid_at(facts, f, valid_at))
                            .map(|f| &facts[f]),
                    );
                }
            }
        }
        found
    }

    /// Every version of one subject's predicate, retracted and superseded ones included,
    /// ordered by `valid_from`, then by when they were said (`occurred_at`, then seq).
    pub fn history(&self, scope: &ScopeKey, subject: &str, predicate: &str) -> Vec<&Fact> {
        let mut versions: Vec<&Fact> = self
            .groups(scope, Some(subject), Some(predicate))
            .into_iter()
            .flat_map(Group::facts)
            .collect();
        versions.sort_by_key(|fact| {
            let said = fact.sources.first().map(|s| s.provenance.position());
            (fact.valid_from, said, fact.id)
        });
        versions
    }

    /// Current facts of `scopes` ranked by the share of the query's words found in their
    /// subject, predicate and object (lowercase alphanumeric words; an object's JSON strings,
    /// numbers, booleans and keys count). Ties go to higher confidence, then to the order of
    /// [`FactTable::current`]. At most `k` results, all with a score above zero.
    pub fn search(&self, scopes: &[ScopeKey], query: &str, k: usize) -> Vec<(&Fact, f32)> {
        let query: BTreeSet<String> = text::words(query).collect();
        if query.is_empty() || k == 0 {
            return Vec::new();
        }
        let now = Utc::now();
        let unique: BTreeSet<&ScopeKey> = scopes.iter().collect();
        let mut scored: Vec<(&Fact, f32)> = Vec::new();
        for scope in unique {
            for fact in self.as_of(scope, now, None, None, None) {
                let mut words: BTreeSet<String> = text::words(&fact.subject).collect();
                words.extend(text::words(&fact.predicate));
                text::json_words(&fact.object, &mut words);
                let overlap = query.iter().filter(|w| words.contains(*w)).count();
                if overlap > 0 {
                    scored.push((fact, overlap as f32 / query.len() as f32));
                }
            }
        }
        // Stable: equal scores and confidences keep scope, subject, predicate, id order.
        scored.sort_by(|a, b| {
            b.1.total_cmp(&a.1)
                .then_with(|| b.0.confidence.total_cmp(&a.0.confidence))
        });
        scored.truncate(k);
        scored
    }

    /// Fact versions held, superseded and retracted ones included.
    pub fn len(&self) -> usize {
        self.model.len()
    }

    pub fn is_empty(&self) -> bool {
        self.model.is_empty()
    }

    /// A blake3 digest of the whole state, applied seq included, over a canonical encoding:
    /// equal tables give equal hashes however they were built or restored.
    pub fn state_hash(&self) -> [u8; 32] {
        self.model.state_hash("engram-facts/v1", |canon, subjects| {
            canon.len(subjects.len());
            for (subject, predicates) in subjects {
                canon.str(subject);
                canon.len(predicates.len());
                for (predicate, group) in predicates {
                    canon.str(predicate);
                    canon.len(group.facts().len());
                    for fact in group.facts() {
                        hash_fact(canon, fact);
                    }
                }
            }
        })
    }

    /// The groups of `scope` matching the optional subject and predicate, in key order.
    fn groups(
        &self,
        scope: &ScopeKey,
        subject: Option<&str>,
        predicate: Option<&str>,
    ) -> Vec<&Group> {
        let Some(subjects) = self.model.scope(scope) else {
            return Vec::new();
        };
        let by_subject: Vec<&BTreeMap<String, Group>> = match subject {
            Some(subject) => subjects.get(subject.trim()).into_iter().collect(),
            None => subjects.values().collect(),
        };
        let predicate = predicate.map(str::trim);
        by_subject
            .into_iter()
            .flat_map(|predicates| match predicate {
                Some(predicate) => predicates.get(predicate).into_iter().collect::<Vec<_>>(),
                None => predicates.values().collect(),
            })
            .collect()
    }
}

/// Adds an assertion: a new fact, or one more source of the believed fact it repeats.
fn apply_assertion(
    table: ScopesMut<'_, Subjects>,
    seq: Seq,
    event: &Envelope,
    assertion: Assertion,
) -> Applied {
    let scope = ScopeKey::of(event);
    let group = table
        .scopes
        .entry(scope.clone())
        .or_default()
        .entry(assertion.subject.clone())
        .or_default()
        .entry(assertion.predicate.clone())
        .or_default();
    let source = Source {
        provenance: Provenance::of(seq, event),
        valid_from: assertion.valid_from,
        valid_to: assertion.valid_to,
        valid_until: assertion.valid_to,
        confidence: assertion.confidence,
        cardinality: assertion.cardinality,
    };
    let applied = match group.find(|fact| is_same_claim(fact, &assertion)) {
        Some(index) => {
            group.push_source(index, source);
            Applied::Merged(group.facts()[index].id)
        }
        None => {
            let id = FactId(seq);
            group.push_fact(Fact {
                id,
                scope,
                subject: assertion.subject,
                predicate: assertion.predicate,
                object: assertion.object,
                cardinality: assertion.cardinality,
                valid_from: assertion.valid_from,
                valid_to: assertion.valid_to,
                recorded_at: event.recorded_at,
                retracted_at: None,
                retracted_by: None,
                confidence: assertion.confidence,
                sources: vec![source],
                superseded_by: None,
            });
            *table.len += 1;
            Applied::Created(id)
        }
    };
    group.refresh();
    applied
}

/// Ends the belief in the matching facts of the event's scope. Creates nothing, not even an
/// empty scope: a retraction that matches nothing changes only the applied seq.
fn apply_retraction(
    table: ScopesMut<'_, Subjects>,
    seq: Seq,
    event: &Envelope,
    retraction: FactRetracted,
) -> Applied {
    let scope = ScopeKey::of(event);
    let Some(group) = table
        .scopes
        .get_mut(&scope)
        .and_then(|subjects| subjects.get_mut(&retraction.subject))
        .and_then(|predicates| predicates.get_mut(&retraction.predicate))
    else {
        return Applied::Retracted(Vec::new());
    };
    let retracted = group.retract(
        retraction.object.as_ref(),
        event.recorded_at,
        &Provenance::of(seq, event),
    );
    Applied::Retracted(retracted)
}

/// Whether an assertion repeats `fact`: believed, the same object, and validity that
/// overlaps what is left of the fact's (or equals what one of its sources asserted).
fn is_same_claim(fact: &Fact, assertion: &Assertion) -> bool {
    !fact.is_retracted()
        && fact.object == assertion.object
        && fact.sources.iter().any(|source| {
            (source.valid_from == assertion.valid_from && source.valid_to == assertion.valid_to)
                || overlaps(
                    (source.valid_from, source.valid_until),
                    (assertion.valid_from, assertion.valid_to),
                )
        })
}

fn overlaps(
    a: (DateTime<Utc>, Option<DateTime<Utc>>),
    b: (DateTime<Utc>, Option<DateTime<Utc>>),
) -> bool {
    a.1.is_none_or(|a_end| b.0 < a_end) && b.1.is_none_or(|b_end| a.0 < b_end)
}

fn hash_fact(canon: &mut Canon, fact: &Fact) {
    canon.u64(fact.id.0);
    canon.scope(&fact.scope);
    canon.str(&fact.subject);
    canon.str(&fact.predicate);
    canon.json(&fact.object);
    canon.u8(cardinality_code(fact.cardinality));
    canon.time(fact.valid_from);
    canon.opt_time(fact.valid_to);
    canon.time(fact.recorded_at);
    canon.opt_time(fact.retracted_at);
    match &fact.retracted_by {
        None => canon.u8(0),
        Some(provenance) => {
            canon.u8(1);
            provenance.write_to(canon);
        }
    }
    canon.f64(fact.confidence);
    canon.len(fact.sources.len());
    for source in &fact.sources {
        source.provenance.write_to(canon);
        canon.time(source.valid_from);
        canon.opt_time(source.valid_to);
        canon.opt_time(source.valid_until);
        canon.f64(source.confidence);
        canon.u8(cardinality_code(source.cardinality));
    }
    canon.opt_u64(fact.superseded_by.map(|id| id.0));
}

/// Fixed codes, so that the state hash does not depend on the enum's declaration order.
fn cardinality_code(cardinality: Cardinality) -> u8 {
    match cardinality {
        Cardinality::Single => 0,
        Cardinality::Multi => 1,
    }
}

impl engram_memory::model::Sliced for FactTable {
    fn into_slice(self, keep: &[ScopeKey]) -> Self {
        Self {
            model: self.model.into_slice(keep, facts_in),
        }
    }

    fn absorb(&mut self, other: Self) {
        self.model.absorb(other.model, facts_in);
    }

    fn erase(&mut self, keys: &[ScopeKey]) -> u64 {
        self.model.erase(keys, facts_in)
    }

    fn held(&self, keys: &[ScopeKey]) -> u64 {
        self.model.held(keys, facts_in)
    }

    fn advance_through(&mut self, seq: Seq) {
        self.model.advance_through(seq);
    }
}

impl EventModel for FactTable {
    type Applied = Applied;
    type Error = FactError;

    fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Applied, FactError> {
        FactTable::apply(self, seq, event)
    }

    fn state_hash(&self) -> [u8; 32] {
        FactTable::state_hash(self)
    }
}

/// What one scope counts: its fact versions.
fn facts_in(subjects: &Subjects) -> usize {
    subjects
        .values()
        .flat_map(|predicates| predicates.values())
        .map(|group| group.facts().len())
        .sum()
}

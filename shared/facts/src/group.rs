//! The versions of one (scope, subject, predicate): where each assertion's validity ends,
//! and which fact supersedes which.
//!
//! Everything derived here is a function of the set of believed assertions, not of the
//! order in which they arrived: an assertion's validity ends at the earliest `valid_from`
//! among the single-valued assertions of another object that come after it in
//! (`occurred_at`, seq) order. One sweep from the latest assertion backwards computes that
//! for all of them. The group keeps what the sweep needs (object classes, assertions in
//! order) up to date as assertions arrive, so a sweep is a single linear pass.

use chrono::{DateTime, Utc};
use engram_memory::Seq;
use engram_schema::Cardinality;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::Provenance;
use crate::fact::{Fact, FactId, Source};

/// One group's facts in order of creation, with derived indexes that snapshots leave out.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Group {
    facts: Vec<Fact>,
    /// Per fact: facts with equal objects share a class, and never cut each other.
    classes: Vec<usize>,
    /// Every source as (position, fact index, source index), earliest position first.
    order: Vec<((DateTime<Utc>, Seq), usize, usize)>,
}

impl Group {
    pub(crate) fn facts(&self) -> &[Fact] {
        &self.facts
    }

    fn from_facts(facts: Vec<Fact>) -> Self {
        let mut group = Self::default();
        for fact in facts {
            let index = group.facts.len();
            group.classes.push(group.class_of(&fact.object));
            for (s, source) in fact.sources.iter().enumerate() {
                group.order.push((source.provenance.position(), index, s));
            }
            group.facts.push(fact);
        }
        group.order.sort_unstable_by_key(|entry| entry.0);
        group
    }

    fn class_of(&self, object: &Value) -> usize {
        self.facts
            .iter()
            .position(|fact| fact.object == *object)
            .map_or_else(
                || self.classes.iter().max().map_or(0, |max| max + 1),
                |f| self.classes[f],
            )
    }

    /// The index of the newest fact that `accepts`, if any.
    pub(crate) fn find(&self, accepts: impl Fn(&Fact) -> bool) -> Option<usize> {
        self.facts.iter().rposition(accepts)
    }

    pub(crate) fn push_fact(&mut self, fact: Fact) {
        let class = self.class_of(&fact.object);
        let index = self.facts.len();
        self.facts.push(fact);
        self.classes.push(class);
        for s in 0..self.facts[index].sources.len() {
            self.index_source(index, s);
        }
    }

    pub(crate) fn push_source(&mut self, index: usize, source: Source) {
        self.facts[index].sources.push(source);
        self.index_source(index, self.facts[index].sources.len() - 1);
    }

    fn index_source(&mut self, f: usize, s: usize) {
        let position = self.facts[f].sources[s].provenance.position();
        // Streams are mostly in order, so this is mostly an append.
        let at = self.order.partition_point(|entry| entry.0 < position);
        self.order.insert(at, (position, f, s));
    }

    /// Ends the belief in every believed fact with `object` (any object when `None`), then
    /// recomputes the rest without them. Returns the facts retracted.
    pub(crate) fn retract(
        &mut self,
        object: Option<&Value>,
        at: DateTime<Utc>,
        by: &Provenance,
    ) -> Vec<FactId> {
        let mut retracted = Vec::new();
        for fact in &mut self.facts {
            if fact.retracted_at.is_none() && object.is_none_or(|object| *object == fact.object) {
                fact.retracted_at = Some(at);
                fact.retracted_by = Some(by.clone());
                retracted.push(fact.id);
            }
        }
        if !retracted.is_empty() {
            self.refresh();
        }
        retracted
    }

    /// Recomputes the stored validity and supersession of the believed facts. Retracted
    /// facts keep what they had when retracted.
    pub(crate) fn refresh(&mut self) {
        let timeline = self.timeline(None);
        for (f, fact) in self.facts.iter_mut().enumerate() {
            if !timeline.believed[f] {
                continue;
            }
            for (source, until) in fact.sources.iter_mut().zip(timeline.until_of(f)) {
                if let Some(until) = until {
                    source.valid_until = *until;
                }
            }
            fact.superseded_by = timeline.superseded_by[f];
            fact.refresh_summary();
        }
    }

    /// The group as believed at `known_at`, or per the latest knowledge when `None`.
    pub(crate) fn timeline(&self, known_at: Option<DateTime<Utc>>) -> Timeline {
        let facts = &self.facts;
        let believed: Vec<bool> = facts
            .iter()
            .map(|fact| match known_at {
                None => fact.retracted_at.is_none(),
                Some(known_at) => {
                    fact.retracted_at
                        .is_none_or(|retracted| retracted > known_at)
                        && fact.recorded_at <= known_at
                }
            })
            .collect();
        let mut offsets = Vec::with_capacity(facts.len());
        let mut sources = 0;
        for fact in facts {
            offsets.push(sources);
            sources += fact.sources.len();
        }
        let mut until = vec![None; sources];
        let mut earliest_start = EarliestStart::default();
        let mut next_single = NextSingle::default();
        let mut superseded_by = vec![None; facts.len()];
        let mut placed = vec![false; facts.len()];
        for &(_, f, s) in self.order.iter().rev() {
            let source = &facts[f].sources[s];
            if !believed[f]
                || known_at.is_some_and(|known_at| source.provenance.recorded_at > known_at)
            {
                continue;
            }
            let class = self.classes[f];
            until[offsets[f] + s] = Some(earliest_end(
                source.valid_to,
                earliest_start.excluding(class),
            ));
            if !placed[f] {
                // The first source met going backwards is the fact's latest one.
                placed[f] = true;
                superseded_by[f] = next_single.excluding(class).map(|g| facts[g].id);
            }
            if source.cardinality == Cardinality::Single {
                earliest_start.offer(source.valid_from, class);
                next_single.push(class, f);
            }
        }
        Timeline {
            believed,
            until,
            offsets,
            superseded_by,
        }
    }
}

impl Serialize for Group {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.facts.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Group {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<Fact>::deserialize(deserializer).map(Self::from_facts)
    }
}

/// A group as believed at one point of transaction time.
pub(crate) struct Timeline {
    /// Per fact: believed at that time (recorded, not yet retracted).
    believed: Vec<bool>,
    /// Per source, facts one after another (see `offsets`): `None` if not recorded yet,
    /// else where its validity ends (`Some(None)`: open-ended).
    until: Vec<Option<Option<DateTime<Utc>>>>,
    /// Where each fact's sources start in `until`.
    offsets: Vec<usize>,
    superseded_by: Vec<Option<FactId>>,
}

impl Timeline {
    fn until_of(&self, index: usize) -> &[Option<Option<DateTime<Utc>>>] {
        let end = self
            .offsets
            .get(index + 1)
            .copied()
            .unwrap_or(self.until.len());
        &self.until[self.offsets[index]..end]
    }

    /// Whether fact `index` was believed valid at `at`.
    pub(crate) fn is_valid_at(&self, facts: &[Fact], index: usize, at: DateTime<Utc>) -> bool {
        self.believed[index]
            && facts[index]
                .sources
                .iter()
                .zip(self.until_of(index))
                .any(|(source, until)| {
                    until.is_some_and(|until| {
                        source.valid_from <= at && until.is_none_or(|until| at < until)
                    })
                })
    }
}

fn earliest_end(a: Option<DateTime<Utc>>, b: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// The earliest `valid_from` seen so far, and the earliest among the other classes, which
/// together answer "earliest start of a class other than c" for any c.
#[derive(Default)]
struct EarliestStart {
    best: Option<(DateTime<Utc>, usize)>,
    runner_up: Option<DateTime<Utc>>,
}

impl EarliestStart {
    fn offer(&mut self, start: DateTime<Utc>, class: usize) {
        match self.best {
            None => self.best = Some((start, class)),
            Some((best, best_class)) if best_class == class => {
                self.best = Some((best.min(start), class));
            }
            Some((best, _)) if start < best => {
                self.runner_up = Some(best);
                self.best = Some((start, class));
            }
            Some(_) => {
                self.runner_up = Some(self.runner_up.map_or(start, |r| r.min(start)));
            }
        }
    }

    fn excluding(&self, class: usize) -> Option<DateTime<Utc>> {
        match self.best {
            Some((best, best_class)) if best_class != class => Some(best),
            _ => self.runner_up,
        }
    }
}

/// The most recently offered single-valued source (going backwards: the earliest so far)
/// and the most recent one of another class.
#[derive(Default)]
struct NextSingle {
    last: Option<(usize, usize)>,
    other: Option<(usize, usize)>,
}

impl NextSingle {
    fn push(&mut self, class: usize, fact: usize) {
        match self.last {
            Some((last_class, _)) if last_class == class => {}
            _ => self.other = self.last,
        }
        self.last = Some((class, fact));
    }

    fn excluding(&self, class: usize) -> Option<usize> {
        match self.last {
            Some((last_class, fact)) if last_class != class => Some(fact),
            _ => self.other.map(|(_, fact)| fact),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot keeps only the facts; the indexes rebuilt from them must equal the ones
    /// kept up to date on the way, or a restored table would sweep differently.
    #[test]
    fn rebuilt_indexes_equal_incremental_ones() {
        use chrono::TimeZone;
        use engram_memory::ScopeKey;
        use engram_schema::{EventId, Ident, Scope, ScopeKind};
        use serde_json::json;

        let at = |day: u32| Utc.with_ymd_and_hms(2024, 1, day, 0, 0, 0).unwrap();
        let source = |seq: Seq, day: u32| Source {
            provenance: Provenance {
                event_id: EventId::new(),
                seq,
                agent_id: Ident::parse("agent_id", "a").unwrap(),
                occurred_at: at(day),
                recorded_at: at(day),
            },
            valid_from: at(day),
            valid_to: None,
            valid_until: None,
            confidence: 1.0,
            cardinality: Cardinality::Single,
        };
        let fact = |seq: Seq, day: u32, object: &str| Fact {
            id: FactId(seq),
            scope: ScopeKey::new(
                Ident::parse("tenant", "t").unwrap(),
                Scope::new(ScopeKind::Team, "a").unwrap(),
            ),
            subject: "s".into(),
            predicate: "p".into(),
            object: json!(object),
            cardinality: Cardinality::Single,
            valid_from: at(day),
            valid_to: None,
            recorded_at: at(day),
            retracted_at: None,
            retracted_by: None,
            confidence: 1.0,
            sources: vec![source(seq, day)],
            superseded_by: None,
        };
        let mut group = Group::default();
        group.push_fact(fact(1, 5, "x"));
        group.push_fact(fact(2, 3, "y"));
        group.push_source(0, source(3, 1));
        group.push_fact(fact(4, 4, "x"));
        group.refresh();

        let rebuilt = Group::from_facts(group.facts.clone());

        assert_eq!(rebuilt, group);
        assert_eq!(group.classes, [0, 1, 0]);
        let seqs: Vec<Seq> = group.order.iter().map(|entry| entry.0.1).collect();
        assert_eq!(seqs, [3, 2, 4, 1]);
    }
}

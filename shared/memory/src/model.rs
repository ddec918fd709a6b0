//! The base of the small in-memory read models (the fact table, the skill registry): state
//! per scope, built by applying the stream in order, skipping what it already holds.
//!
//! This module owns the rule "an event at or below the applied sequence is already in":
//! [`AppliedSeq`] is the only place it is written down, and both [`ScopedModel`] and the
//! projector framework's snapshot projection ask it. It also owns the snapshot shape those
//! models share, so that every one of them encodes and hashes its prologue the same way.
//! It does no I/O and never reads a clock.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use engram_schema::payload::PayloadError;
use engram_schema::{Envelope, EventId, EventKind, Ident};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::canon::Canon;
use crate::{ScopeKey, Seq};

/// The highest stream sequence a read model holds: events at or below it were applied (or
/// ignored, or refused) already, so a redelivery or a replay after a restore skips them.
///
/// Encoded as the bare `Option<Seq>` it wraps, so snapshots that held one read unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AppliedSeq(Option<Seq>);

impl AppliedSeq {
    /// Nothing applied yet.
    pub const NONE: Self = Self(None);

    /// The applied sequence of a checkpoint label. Stream sequences start at 1, so 0 is the
    /// label of an empty model.
    pub fn through(seq: Seq) -> Self {
        Self((seq > 0).then_some(seq))
    }

    pub fn get(self) -> Option<Seq> {
        self.0
    }

    /// Whether the event at `seq` is already in the model, and must be skipped.
    pub fn holds(self, seq: Seq) -> bool {
        self.0.is_some_and(|applied| seq <= applied)
    }

    /// Records that the event at `seq` is in. Callers only move forward: they skip what
    /// [`holds`](Self::holds) says is in, so `seq` is above the applied sequence.
    pub fn advance(&mut self, seq: Seq) {
        debug_assert!(!self.holds(seq), "applied seq moves forward only: {seq}");
        self.0 = Some(seq);
    }
}

/// A read model built by applying the stream in order, seq by seq. The projector framework
/// runs any such model that can be snapshotted, with no wrapper type.
pub trait EventModel {
    /// What applying one event did.
    type Applied;
    /// Why an event was refused. Refusals must be permanent (the same event fails the same
    /// way on every replay) and leave the model unchanged.
    type Error: fmt::Display;

    /// Applies the event at stream sequence `seq`; at or below the applied sequence it
    /// changes nothing. The result depends only on `seq` and `event`, never on a clock.
    fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Self::Applied, Self::Error>;

    /// A digest of the whole state, over a canonical encoding: equal states give equal
    /// hashes however they were built or restored.
    fn state_hash(&self) -> [u8; 32];
}

/// The state of every scope of one model (`T` per scope), how far it has applied, and a
/// count the model keeps so that `len` needs no walk.
///
/// Everything is in ordered maps, so the snapshot encoding and the state hash do not depend
/// on hash-map iteration order. The encoding is a struct of `applied_seq`, `scopes` (a
/// sequence of pairs) and `len`, in that order: changing it breaks existing snapshots.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(bound(serialize = "T: Serialize", deserialize = "T: Deserialize<'de>"))]
pub struct ScopedModel<T> {
    /// The highest seq applied (or ignored) so far; events at or below it are skipped.
    applied_seq: AppliedSeq,
    #[serde(with = "pairs")]
    scopes: BTreeMap<ScopeKey, T>,
    /// What the model counts (fact versions, skills); only its appliers change it.
    len: usize,
}

/// What applying one event may change: the scopes and the count. Handed out only by
/// [`ScopedModel::apply`], so that nothing changes a model without moving its sequence.
pub struct ScopesMut<'a, T> {
    pub scopes: &'a mut BTreeMap<ScopeKey, T>,
    pub len: &'a mut usize,
}

impl<T> Default for ScopedModel<T> {
    fn default() -> Self {
        Self {
            applied_seq: AppliedSeq::NONE,
            scopes: BTreeMap::new(),
            len: 0,
        }
    }
}

impl<T> ScopedModel<T> {
    /// The highest seq applied so far, `None` for a new model. Snapshots store it so that
    /// replay resumes after it.
    pub fn applied_seq(&self) -> Option<Seq> {
        self.applied_seq.get()
    }

    /// Applies the event at `seq` with `apply`, unless the model already holds it: then
    /// nothing changes and the answer is `Ok(None)`. When `apply` fails the applied sequence
    /// stays, and `apply` must have changed nothing either (parse before touching).
    pub fn apply<A, E>(
        &mut self,
        seq: Seq,
        apply: impl FnOnce(ScopesMut<'_, T>) -> Result<A, E>,
    ) -> Result<Option<A>, E> {
        if self.applied_seq.holds(seq) {
            return Ok(None);
        }
        let applied = apply(ScopesMut {
            scopes: &mut self.scopes,
            len: &mut self.len,
        })?;
        self.applied_seq.advance(seq);
        Ok(Some(applied))
    }

    pub fn scope(&self, scope: &ScopeKey) -> Option<&T> {
        self.scopes.get(scope)
    }

    /// Every scope with state, in key order.
    pub fn scopes(&self) -> impl Iterator<Item = (&ScopeKey, &T)> {
        self.scopes.iter()
    }

    /// The model with only the scopes in `keep`: what one scope's reader may be handed
    /// (a bootstrap slice), never another's. The applied sequence stays: the slice holds
    /// everything its scopes had up to it. `count` is what `len` counts in one scope.
    pub fn into_slice(mut self, keep: &[ScopeKey], count: impl Fn(&T) -> usize) -> Self {
        self.scopes.retain(|scope, _| keep.contains(scope));
        self.len = self.scopes.values().map(count).sum();
        self
    }

    /// Takes in the scopes of `other`, a model of other scopes (another partition's slice):
    /// the union, applied through the lesser of the two sequences (a reader replays each
    /// scope from where its own slice stopped). A scope in both keeps this model's.
    pub fn absorb(&mut self, other: Self, count: impl Fn(&T) -> usize) {
        self.applied_seq = match (self.applied_seq.get(), other.applied_seq.get()) {
            (Some(a), Some(b)) => AppliedSeq::through(a.min(b)),
            _ => AppliedSeq::NONE,
        };
        for (scope, state) in other.scopes {
            self.scopes.entry(scope).or_insert(state);
        }
        self.len = self.scopes.values().map(count).sum();
    }

    /// Removes the scopes in `erase` (an erasure), returning how many items they held
    /// (`count` per scope, as for [`Self::into_slice`]). The applied sequence stays.
    pub fn erase(&mut self, erase: &[ScopeKey], count: impl Fn(&T) -> usize) -> u64 {
        let mut removed = 0;
        for key in erase {
            if let Some(state) = self.scopes.remove(key) {
                let n = count(&state);
                self.len = self.len.saturating_sub(n);
                removed += n as u64;
            }
        }
        removed
    }

    /// How many items (`count` per scope) the model holds of the scopes in `keys`.
    pub fn held(&self, keys: &[ScopeKey], count: impl Fn(&T) -> usize) -> u64 {
        keys.iter()
            .filter_map(|k| self.scopes.get(k))
            .map(|s| count(s) as u64)
            .sum()
    }

    /// Records that the model holds everything up to `seq` of the scopes it was fed: a
    /// reader that replayed only its scopes' subjects through `seq` has seen all of them,
    /// and skips anything at or below it from then on.
    pub fn advance_through(&mut self, seq: Seq) {
        self.applied_seq.advance(seq);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The state hash under `domain` (which keeps models' hashes apart): the applied seq,
    /// then each scope in key order, its state written by `hash_scope`.
    pub fn state_hash(&self, domain: &str, mut hash_scope: impl FnMut(&mut Canon, &T)) -> [u8; 32] {
        let mut canon = Canon::new(domain);
        canon.opt_u64(self.applied_seq.get());
        canon.len(self.scopes.len());
        for (scope, state) in &self.scopes {
            canon.scope(scope);
            hash_scope(&mut canon, state);
        }
        canon.finish()
    }
}

/// A scoped model that can be cut down to some scopes, for a reader who may see only those
/// (an agent bootstrapping its scope from a snapshot of the whole model).
pub trait Sliced: Sized {
    /// The model with only the scopes in `keep`, its applied sequence unchanged.
    fn into_slice(self, keep: &[ScopeKey]) -> Self;
    /// See [`ScopedModel::absorb`].
    fn absorb(&mut self, other: Self);
    /// See [`ScopedModel::advance_through`].
    fn advance_through(&mut self, seq: Seq);
    /// Removes the scopes in `keys`; returns the items they held ([`ScopedModel::erase`]).
    fn erase(&mut self, keys: &[ScopeKey]) -> u64;
    /// The items held of the scopes in `keys` ([`ScopedModel::held`]).
    fn held(&self, keys: &[ScopeKey]) -> u64;
}

/// Which event said something (asserted a fact, recorded a skill), and when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    pub event_id: EventId,
    pub seq: Seq,
    pub agent_id: Ident,
    /// When it happened, by the agent's clock: orders competing claims.
    pub occurred_at: DateTime<Utc>,
    /// When Engram was told: transaction time.
    pub recorded_at: DateTime<Utc>,
}

impl Provenance {
    pub fn of(seq: Seq, event: &Envelope) -> Self {
        Self {
            event_id: event.event_id.clone(),
            seq,
            agent_id: event.agent_id.clone(),
            occurred_at: event.occurred_at,
            recorded_at: event.recorded_at,
        }
    }

    /// The order in which claims compete: the latest `occurred_at` wins, ties go to the
    /// higher seq. Unique, because seqs are.
    pub fn position(&self) -> (DateTime<Utc>, Seq) {
        (self.occurred_at, self.seq)
    }

    /// Writes every field into a state hash, in declaration order.
    pub fn write_to(&self, canon: &mut Canon) {
        canon.str(self.event_id.as_str());
        canon.u64(self.seq);
        canon.str(self.agent_id.as_str());
        canon.time(self.occurred_at);
        canon.time(self.recorded_at);
    }
}

/// Why a scoped model refused an event: its payload does not fit the contract. Every
/// variant is permanent: the same event fails the same way on every replay, so the
/// projector dead-letters it and moves on. A refused event leaves the model exactly as it
/// was.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PayloadRefused {
    #[error("seq {seq}: {kind} event {event_id} has no JSON object in content.data; {hint}")]
    MissingData {
        seq: Seq,
        event_id: EventId,
        kind: EventKind,
        /// What to send instead, with an example, in the model's words.
        hint: &'static str,
    },
    #[error("seq {seq}: {kind} event {event_id} has an invalid content.data.{field}: {reason}")]
    InvalidField {
        seq: Seq,
        event_id: EventId,
        kind: EventKind,
        field: &'static str,
        reason: String,
    },
}

impl PayloadRefused {
    /// The refusal of the event at `seq` whose payload the contract's types did not accept;
    /// `hint` says what to send when there was no payload object at all.
    pub fn of(seq: Seq, event: &Envelope, error: PayloadError, hint: &'static str) -> Self {
        match error.payload_field() {
            Some(field) => Self::InvalidField {
                seq,
                event_id: event.event_id.clone(),
                kind: event.kind,
                field,
                reason: error.reason,
            },
            None => Self::MissingData {
                seq,
                event_id: event.event_id.clone(),
                kind: event.kind,
                hint,
            },
        }
    }

    /// The payload field at fault, if the payload was an object at all.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::MissingData { .. } => None,
            Self::InvalidField { field, .. } => Some(field),
        }
    }

    /// The stream sequence of the event that failed.
    pub fn seq(&self) -> Seq {
        match self {
            Self::MissingData { seq, .. } | Self::InvalidField { seq, .. } => *seq,
        }
    }
}

/// Serde for maps keyed by [`ScopeKey`]: a sequence of pairs.
///
/// A struct key is fine for MessagePack but not for JSON, and a snapshot should be readable
/// by either when someone needs to look inside one.
mod pairs {
    use std::collections::BTreeMap;

    use serde::de::{Deserialize, Deserializer};
    use serde::ser::{Serialize, Serializer};

    pub(super) fn serialize<K, V, S>(map: &BTreeMap<K, V>, serializer: S) -> Result<S::Ok, S::Error>
    where
        K: Serialize,
        V: Serialize,
        S: Serializer,
    {
        serializer.collect_seq(map.iter())
    }

    pub(super) fn deserialize<'de, K, V, D>(deserializer: D) -> Result<BTreeMap<K, V>, D::Error>
    where
        K: Deserialize<'de> + Ord,
        V: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        let pairs = Vec::<(K, V)>::deserialize(deserializer)?;
        Ok(pairs.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_applied_seq_holds_everything_at_or_below_it() {
        let mut applied = AppliedSeq::through(0);
        assert_eq!(applied, AppliedSeq::NONE);
        assert!(!applied.holds(1));

        applied.advance(5);
        assert!(applied.holds(4) && applied.holds(5));
        assert!(!applied.holds(6));
        assert_eq!(applied, AppliedSeq::through(5));
    }

    #[test]
    fn a_scoped_model_skips_what_it_holds_and_keeps_its_seq_when_apply_fails() {
        let mut model = ScopedModel::<u32>::default();
        let bump = |changes: ScopesMut<'_, u32>| {
            *changes.len += 1;
            Ok::<_, ()>("applied")
        };
        assert_eq!(model.apply(3, bump), Ok(Some("applied")));
        assert_eq!(model.apply(3, bump), Ok(None));
        assert_eq!(model.apply(2, bump), Ok(None));
        assert_eq!(model.apply(4, |_| Err::<(), _>("refused")), Err("refused"));
        assert_eq!((model.applied_seq(), model.len()), (Some(3), 1));
    }

    #[test]
    fn the_snapshot_shape_is_the_one_facts_and_skills_always_wrote() {
        // Checkpoints on disk hold this shape: a bare optional seq, scopes as pairs, a count.
        let mut model = ScopedModel::<u32>::default();
        assert_eq!(
            serde_json::to_string(&model).unwrap(),
            r#"{"applied_seq":null,"scopes":[],"len":0}"#
        );
        let scope = ScopeKey::new(
            Ident::parse("tenant", "acme").unwrap(),
            engram_schema::Scope::new(engram_schema::ScopeKind::Team, "core").unwrap(),
        );
        model
            .apply(7, |changes| {
                changes.scopes.insert(scope.clone(), 42);
                Ok::<_, ()>(())
            })
            .unwrap();
        let json = serde_json::to_string(&model).unwrap();
        assert_eq!(
            json,
            r#"{"applied_seq":7,"scopes":[[{"tenant":"acme","kind":"team","id":"core"},42]],"len":0}"#
        );
        assert_eq!(
            serde_json::from_str::<ScopedModel<u32>>(&json).unwrap(),
            model
        );
    }
}

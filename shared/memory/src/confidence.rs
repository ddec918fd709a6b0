//! Pollution defence: how much the text read models (vector, keyword) still trust a memory.
//!
//! Every text memory starts at confidence 1. Two signals lower it, both carried in the data of
//! ordinary events and checked at append (`engram_schema::payload`):
//! - `contradicts` on an `outcome` or `feedback`: the memories it names were shown wrong;
//!   each is multiplied by [`CONTRADICTED`].
//! - `faulty_instance` on a `feedback`: every memory the named instance wrote before the
//!   flag is multiplied by [`FAULTY_INSTANCE`]. What it writes after the flag starts at 1
//!   again: the flag reports what it did, instance ids are reused after restarts, and a
//!   standing ban would be state no later event could lift. Flag it again if it goes on.
//!
//! A signal only reaches memories of its own tenant and scope (the envelope's, which readers
//! check against the subject; never a scope named in the body), recorded before it in the
//! stream. It is the `forgotten` rule: a writer of one scope has no say over what another
//! reads, and instance ids are client-chosen names, not unique across tenants or scopes.
//!
//! [`Distrust::factor`] is the whole rule, so the two read models cannot disagree, and it is
//! a pure function of the memory and the signal: applied in stream order, a replay gives the
//! same confidences bit for bit. The read models apply a signal once per event id, so a
//! retry stored again after the stream's duplicate window does not lower anything twice.
//!
//! A consolidation output (a merged memory, a session summary, a restored copy) says again
//! what its sources said, so it starts at the least of their confidences instead of 1
//! ([`Inheritance`]): merging a contradicted claim with a clean copy of it must not make it
//! trusted again.
//!
//! Retrieval leaves low-confidence memories out only when asked (`filter.min_confidence`);
//! a context leaves out those below `query.context_min_confidence` (0.3), so one
//! contradiction (0.5) keeps a memory in a context and two (0.25), or one faulty flag, take
//! it out.

use std::collections::HashSet;

use engram_schema::payload::PayloadError;
use engram_schema::{
    Consolidated, Contradicts, Envelope, EventId, EventKind, FaultyInstance, Ident,
};

use crate::{MemoryMeta, ScopeKey, Seq};

/// What one contradiction leaves of a memory's confidence. A half: one outcome against a
/// memory may be the outcome's mistake, or the world having moved on, so the memory stays
/// retrievable and in contexts; a second contradiction (a quarter) takes it below the
/// context threshold.
pub const CONTRADICTED: f64 = 0.5;

/// What a faulty-instance flag leaves of the confidence of each memory the instance wrote. A
/// quarter: the flag condemns everything the instance wrote, not one claim, so it counts as
/// much as two contradictions and takes its memories out of contexts at once, while an
/// explicit retrieval can still find them (to review, or to `forget` them).
pub const FAULTY_INSTANCE: f64 = 0.25;

/// A signal that lowers the confidence of memories already in a read model: the
/// `contradicts` and `faulty_instance` keys of one event.
#[derive(Clone, Debug, PartialEq)]
pub struct Distrust {
    /// The signalling event's sequence: only memories before it are affected.
    pub seq: Seq,
    pub event_id: EventId,
    /// The signalling event's own tenant and scope.
    pub scope: ScopeKey,
    /// Memories it contradicts, each named once.
    pub contradicts: HashSet<EventId>,
    pub faulty_instance: Option<Ident>,
}

impl Distrust {
    /// The signal `event` (at `seq`) carries, `None` when it carries neither key, or the
    /// payload error that makes it unusable (the read models dead-letter such an event).
    pub fn of(seq: Seq, event: &Envelope) -> Result<Option<Self>, PayloadError> {
        let contradicts = Contradicts::from_event(event)?;
        let faulty = FaultyInstance::from_event(event)?;
        if contradicts.is_none() && faulty.is_none() {
            return Ok(None);
        }
        Ok(Some(Self {
            seq,
            event_id: event.event_id.clone(),
            scope: ScopeKey::of(event),
            contradicts: contradicts
                .map(|c| c.contradicts.into_iter().collect())
                .unwrap_or_default(),
            faulty_instance: faulty.map(|f| f.faulty_instance),
        }))
    }

    /// What this signal multiplies `meta`'s confidence by: 1 for a memory it is not about (of
    /// another tenant or scope, or recorded at or after it), else [`CONTRADICTED`] if it names
    /// the memory, times [`FAULTY_INSTANCE`] if the memory's writer is the flagged instance.
    pub fn factor(&self, meta: &MemoryMeta) -> f64 {
        if meta.scope != self.scope || meta.seq >= self.seq {
            return 1.0;
        }
        let mut factor = 1.0;
        if self.contradicts.contains(&meta.event_id) {
            factor *= CONTRADICTED;
        }
        if self
            .faulty_instance
            .as_ref()
            .is_some_and(|faulty| meta.instance_id.as_ref() == Some(faulty))
        {
            factor *= FAULTY_INSTANCE;
        }
        factor
    }

    /// `meta` with this signal applied, or `None` when the signal leaves it as it is.
    pub fn apply(&self, meta: &MemoryMeta) -> Option<MemoryMeta> {
        let factor = self.factor(meta);
        (factor != 1.0).then(|| MemoryMeta {
            confidence: meta.confidence * factor,
            ..meta.clone()
        })
    }
}

/// The memories a consolidation output inherits its confidence from: the sources of a
/// `consolidated` event (merged, summary or restored), as the event names them.
#[derive(Clone, Debug, PartialEq)]
pub struct Inheritance {
    /// The output's own tenant and scope: only sources of it count.
    pub scope: ScopeKey,
    pub sources: Vec<EventId>,
}

impl Inheritance {
    /// The sources `event` inherits from: `None` for an event that is no consolidation
    /// output, the payload error of a `consolidated` event whose data does not check (the
    /// read models dead-letter it whole, as they do a signal that does not check).
    pub fn of(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        if event.kind != EventKind::Consolidated {
            return Ok(None);
        }
        let consolidated = Consolidated::from_event(event)?;
        Ok(Some(Self {
            scope: ScopeKey::of(event),
            sources: consolidated.sources,
        }))
    }

    /// The confidence the output starts at: the least of its sources' confidences, 1 if it
    /// has none in the read model.
    ///
    /// Why: the output repeats its sources. Started at 1 it would launder their distrust: a
    /// contradicted claim merged with a clean copy of itself would be trusted again. Why the
    /// least: one distrusted source is enough to doubt what was distilled from it, and a
    /// product would count twice a doubt that near-copies share.
    ///
    /// `memory` looks a source up in the read model as every event before the output left
    /// it (sources inserted earlier in the same batch included, with their own confidence).
    /// A source of another tenant or scope is ignored (the `forgotten` rule: an output speaks
    /// only for its own scope), and a source the model never held counts as 1. A source
    /// withdrawn by a `forgotten` event (archived, superseded) counts with the confidence it
    /// had when withdrawn, which the read models keep for that ([`Withdrawn`]): a restored
    /// copy of a distrusted memory stays distrusted. Computed when the output is applied, in
    /// stream order, it is a pure function of the stream, so a live apply and a replay in
    /// other batches give the same confidence bit for bit.
    ///
    /// `source` gives a source's scope and confidence, held or withdrawn.
    pub fn confidence<'a>(
        &self,
        mut source: impl FnMut(&EventId) -> Option<(&'a ScopeKey, f64)>,
    ) -> f64 {
        self.sources
            .iter()
            .filter_map(&mut source)
            .filter(|(scope, _)| **scope == self.scope)
            .map(|(_, confidence)| confidence)
            .fold(1.0, f64::min)
    }
}

/// What a read model keeps of the distrusted memories it withdrew (forgotten, archived,
/// superseded): their scope and confidence, by id, so that a copy restored from one
/// inherits its distrust ([`Inheritance::confidence`]). Only confidences under 1 are kept;
/// a withdrawn memory not here was fully trusted.
pub type Withdrawn = std::collections::BTreeMap<EventId, (ScopeKey, f64)>;

/// `withdrawn` with `meta`'s memory, if it was distrusted.
pub fn withdraw(withdrawn: &mut Withdrawn, meta: &MemoryMeta) {
    if meta.confidence < 1.0 {
        withdrawn.insert(meta.event_id.clone(), (meta.scope.clone(), meta.confidence));
    }
}

#[cfg(test)]
mod tests {
    use engram_schema::{Content, EventKind, Layer, Scope, ScopeKind};
    use serde_json::json;

    use super::*;

    fn ident(s: &str) -> Ident {
        Ident::parse("id", s).unwrap()
    }

    fn event(tenant: &str, scope: &str, instance: &str, kind: EventKind) -> Envelope {
        Envelope::new(
            ident(tenant),
            Scope::new(ScopeKind::Task, scope).unwrap(),
            ident("agent"),
            ident(instance),
            Layer::Episodic,
            kind,
            Content::text("text"),
        )
    }

    #[test]
    fn a_signal_lowers_only_earlier_memories_of_its_own_scope() {
        let written = event("acme", "t1", "i-1", EventKind::Observation);
        let memory = MemoryMeta::of(5, &written);
        let mut flag = event("acme", "t1", "i-2", EventKind::Feedback);
        flag.content.data = Some(json!({
            "contradicts": [written.event_id],
            "faulty_instance": "i-1",
        }));
        let signal = Distrust::of(9, &flag).unwrap().unwrap();
        assert_eq!(signal.factor(&memory), CONTRADICTED * FAULTY_INSTANCE);
        assert_eq!(
            signal.apply(&memory).unwrap().confidence,
            CONTRADICTED * FAULTY_INSTANCE
        );

        // The same id and instance in another tenant or scope, or written after the flag
        for other in [
            MemoryMeta::of(5, &event("other", "t1", "i-1", EventKind::Observation)),
            MemoryMeta::of(5, &event("acme", "t2", "i-1", EventKind::Observation)),
            MemoryMeta::of(9, &written),
            MemoryMeta::of(10, &written),
        ] {
            let other = MemoryMeta {
                event_id: written.event_id.clone(),
                ..other
            };
            assert_eq!(signal.factor(&other), 1.0, "{other:?}");
            assert_eq!(signal.apply(&other), None);
        }
        // A memory of unknown writer (restored from an older checkpoint) is not flagged
        let unknown = MemoryMeta {
            instance_id: None,
            ..MemoryMeta::of(5, &event("acme", "t1", "i-1", EventKind::Observation))
        };
        assert_eq!(signal.factor(&unknown), 1.0);
    }

    #[test]
    fn a_consolidation_output_starts_at_the_least_confidence_of_its_own_scopes_sources() {
        let sources: Vec<MemoryMeta> = [
            ("acme", "t1", 0.5),
            ("acme", "t1", 1.0),
            ("acme", "t2", 0.25),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, (tenant, scope, confidence))| MemoryMeta {
            confidence,
            ..MemoryMeta::of(
                i as u64 + 1,
                &event(tenant, scope, "i-1", EventKind::Observation),
            )
        })
        .collect();
        let lookup = |id: &EventId| {
            sources
                .iter()
                .find(|m| &m.event_id == id)
                .map(|m| (&m.scope, m.confidence))
        };
        let inherited = |event: &Envelope| {
            Inheritance::of(event).map(|i| i.map_or(1.0, |i| i.confidence(lookup)))
        };
        let mut merged = event("acme", "t1", "consolidator", EventKind::Consolidated);
        merged.content.data = Some(json!({
            "op": "merged",
            "sources": [sources[0].event_id, sources[1].event_id, sources[2].event_id, EventId::new()],
        }));
        // The contradicted source counts; the other scope's quarter and the unknown id do not
        assert_eq!(inherited(&merged).unwrap(), CONTRADICTED);
        merged.content.data = Some(json!({"op": "summary", "sources": [sources[1].event_id]}));
        assert_eq!(inherited(&merged).unwrap(), 1.0);
        // Any other memory starts at 1, and an output whose data does not check is refused
        let plain = event("acme", "t1", "i-1", EventKind::Observation);
        assert_eq!(inherited(&plain).unwrap(), 1.0);
        merged.content.data = Some(json!({"op": "merged", "sources": []}));
        assert_eq!(
            inherited(&merged).unwrap_err().field,
            "content.data.sources"
        );
    }

    #[test]
    fn an_event_without_the_keys_is_no_signal_and_a_bad_one_is_refused() {
        let mut e = event("acme", "t1", "i-1", EventKind::Outcome);
        e.content.data = Some(json!({"skill": "lint", "success": true}));
        assert_eq!(Distrust::of(1, &e).unwrap(), None);
        e.content.data = Some(json!({"contradicts": ["*"]}));
        assert_eq!(
            Distrust::of(1, &e).unwrap_err().field,
            "content.data.contradicts"
        );
        // An outcome cannot flag an instance: that key is free data there
        e.content.data = Some(json!({"faulty_instance": "i-1"}));
        assert_eq!(Distrust::of(1, &e).unwrap(), None);
    }
}

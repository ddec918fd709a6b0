//! The consolidator's read model: what each scope remembers, in the terms consolidation
//! needs.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use engram_memory::model::{EventModel, ScopedModel};
use engram_memory::{ScopeKey, Seq, is_text_memory};
use engram_schema::{
    Consolidated, ConsolidationOp, Envelope, EventId, EventKind, Forgotten, PayloadError, Used,
};
use serde::{Deserialize, Serialize};

use crate::minhash::Signature;

/// Bytes of a memory's text kept for summaries and merged memories.
pub const MAX_TEXT_BYTES: usize = 2_048;
/// Session ends one scope remembers.
pub const MAX_FINISHES: usize = 4_096;

/// Where a memory came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Written by an agent.
    Source,
    Merged,
    Summary,
    Restored,
}

impl From<ConsolidationOp> for Origin {
    fn from(op: ConsolidationOp) -> Self {
        match op {
            ConsolidationOp::Merged => Self::Merged,
            ConsolidationOp::Summary => Self::Summary,
            ConsolidationOp::Restored => Self::Restored,
        }
    }
}

/// One text memory of a scope.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    pub event_id: EventId,
    pub text: String,
    pub importance: f64,
    pub occurred_at: DateTime<Utc>,
    /// When it was last written, recalled as a recurrence, or used: decay counts from here.
    pub last_useful: DateTime<Utc>,
    pub recurrences: u32,
    /// Times an agent reported using it (`feedback` with `used`): each reinforces it.
    #[serde(default)]
    pub uses: u32,
    pub signature: Option<Signature>,
    /// Superseded, archived or forgotten: out of default retrieval, still in the log.
    pub hidden: bool,
    pub origin: Origin,
}

/// One scope, as the consolidator sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScopeState {
    /// By stream sequence: the order the scope's memories were written in.
    pub memories: BTreeMap<Seq, Memory>,
    pub by_id: BTreeMap<String, Seq>,
    /// The newest `occurred_at` of the scope's events: the consolidator's clock for it, so
    /// that a plan depends on the stream alone.
    pub latest: Option<DateTime<Utc>>,
    /// The seqs of the `checkpoint`s with `"finished": true`, oldest first: each ends a
    /// session (or task) of the scope, whose memories since the previous one it summarises.
    /// At most [`MAX_FINISHES`]; older ones are dropped (their summaries are in the log).
    pub finishes: Vec<Seq>,
    /// Ids of consolidation outputs (`consolidated`, `forgotten`) applied.
    pub outputs: BTreeSet<String>,
}

impl ScopeState {
    /// The memories default retrieval sees, in stream order.
    pub fn visible(&self) -> impl Iterator<Item = (&Seq, &Memory)> {
        self.memories.iter().filter(|(_, m)| !m.hidden)
    }

    pub fn memory(&self, id: &str) -> Option<&Memory> {
        self.memories.get(self.by_id.get(id)?)
    }

    /// Agents used these memories at `at`: their decay restarts, and each use counts.
    fn used(&mut self, ids: &[EventId], at: DateTime<Utc>) {
        for id in ids {
            if let Some(seq) = self.by_id.get(id.as_str())
                && let Some(m) = self.memories.get_mut(seq)
            {
                m.uses = m.uses.saturating_add(1);
                m.last_useful = m.last_useful.max(at);
            }
        }
    }

    fn hide(&mut self, ids: &[EventId]) {
        for id in ids {
            if let Some(seq) = self.by_id.get(id.as_str())
                && let Some(m) = self.memories.get_mut(seq)
            {
                m.hidden = true;
            }
        }
    }

    fn insert(&mut self, seq: Seq, event: &Envelope, origin: Origin, recurrences: u32) {
        let mut text = event.content.text.clone();
        if text.len() > MAX_TEXT_BYTES {
            let mut end = MAX_TEXT_BYTES;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        self.by_id.insert(event.event_id.as_str().to_owned(), seq);
        self.memories.insert(
            seq,
            Memory {
                event_id: event.event_id.clone(),
                signature: Signature::of(&text),
                text,
                importance: event.importance,
                occurred_at: event.occurred_at,
                last_useful: event.occurred_at,
                recurrences,
                uses: 0,
                hidden: false,
                origin,
            },
        );
    }
}

/// Why the consolidator refused an event: its payload does not fit the contract.
pub type Refused = PayloadError;

/// Every scope's memories, as consolidation reads them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Memories {
    model: ScopedModel<ScopeState>,
}

impl Memories {
    pub fn scope(&self, scope: &ScopeKey) -> Option<&ScopeState> {
        self.model.scope(scope)
    }

    pub fn applied_seq(&self) -> Option<Seq> {
        self.model.applied_seq()
    }

    /// Every scope with memories, in key order.
    pub fn scopes(&self) -> impl Iterator<Item = &ScopeKey> {
        self.model.scopes().map(|(k, _)| k)
    }

    pub fn len(&self) -> usize {
        self.model.len()
    }

    pub fn is_empty(&self) -> bool {
        self.model.is_empty()
    }
}

impl EventModel for Memories {
    type Applied = bool;
    type Error = Refused;

    /// Text memories and consolidation outputs are recorded; `forgotten` hides what it
    /// names (own scope only); `feedback` with `used` reinforces what it names; a
    /// `checkpoint` with `"finished": true` finishes the scope.
    /// Everything else only moves the scope's clock. Returns whether a memory was added.
    fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<bool, Refused> {
        // Parse before touching anything.
        let consolidated = match event.kind {
            EventKind::Consolidated => Some(Consolidated::from_event(event)?),
            _ => None,
        };
        let forgotten = match event.kind {
            EventKind::Forgotten => Some(Forgotten::from_event(event)?),
            _ => None,
        };
        let used = match event.kind {
            EventKind::Feedback => Used::from_event(event)?,
            _ => None,
        };
        let applied = self.model.apply(seq, |scopes| {
            let state = scopes.scopes.entry(ScopeKey::of(event)).or_default();
            state.latest = Some(
                state
                    .latest
                    .map_or(event.occurred_at, |t| t.max(event.occurred_at)),
            );
            let mut added = false;
            if let Some(out) = &consolidated {
                state.outputs.insert(event.event_id.as_str().to_owned());
                state.insert(seq, event, out.op.into(), out.recurrences());
                added = true;
            } else if let Some(forgotten) = &forgotten {
                state.outputs.insert(event.event_id.as_str().to_owned());
                state.hide(&forgotten.event_ids);
            } else if let Some(used) = &used {
                state.used(&used.used, event.occurred_at);
            } else if is_text_memory(event) {
                state.insert(seq, event, Origin::Source, 1);
                added = true;
            } else if event.kind == EventKind::Checkpoint
                && event
                    .content
                    .data
                    .as_ref()
                    .and_then(|d| d.get("finished"))
                    .and_then(serde_json::Value::as_bool)
                    == Some(true)
            {
                if state.finishes.len() == MAX_FINISHES {
                    state.finishes.remove(0);
                }
                state.finishes.push(seq);
            }
            if added {
                *scopes.len += 1;
            }
            Ok::<_, Refused>(added)
        })?;
        Ok(applied.unwrap_or(false))
    }

    fn state_hash(&self) -> [u8; 32] {
        self.model
            .state_hash("engram-consolidate/1", |canon, state| {
                canon.len(state.memories.len());
                for (seq, m) in &state.memories {
                    canon.u64(*seq);
                    canon.str(m.event_id.as_str());
                    canon.str(&m.text);
                    canon.f64(m.importance);
                    canon.time(m.occurred_at);
                    canon.time(m.last_useful);
                    canon.u64(u64::from(m.recurrences));
                    canon.u64(u64::from(m.uses));
                    canon.u8(u8::from(m.hidden));
                    canon.u8(m.origin as u8);
                }
                canon.opt_time(state.latest);
                canon.len(state.finishes.len());
                for f in &state.finishes {
                    canon.u64(*f);
                }
                canon.len(state.outputs.len());
                for id in &state.outputs {
                    canon.str(id);
                }
            })
    }
}

impl engram_memory::model::Sliced for Memories {
    fn into_slice(self, keep: &[ScopeKey]) -> Self {
        Self {
            model: self.model.into_slice(keep, |s| s.memories.len()),
        }
    }

    fn advance_through(&mut self, seq: Seq) {
        self.model.advance_through(seq);
    }
}

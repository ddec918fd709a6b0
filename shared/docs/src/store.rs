//! The shared-document read model: every `doc_changed` event applied in stream order.
//!
//! automerge's `apply_changes` is idempotent, so a change delivered twice (a retried append
//! that the stream's dedup window no longer covered, an instance resending after a crash) is
//! applied once. A change whose dependencies have not arrived yet (its writer's earlier event
//! is still in flight, or was sent by another instance that is offline) is held, in the
//! model's own list so that it is saved with the checkpoint and counted in the state hash,
//! and applied as soon as they arrive. The state is a function of the set of changes, so
//! every reader at the same sequence has the same state.
//!
//! An event is applied whole or not at all: its changes are parsed first, then applied to
//! the document with a copy kept, and a refusal (a change automerge rejects, such as a reused
//! actor sequence, or one that makes it panic) puts the copy back.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::OnceLock;

use automerge::{Automerge, Change, ChangeHash};
use engram_memory::model::{EventModel, ScopedModel};
use engram_memory::{ScopeKey, Seq};
use engram_schema::{DocChanged, Envelope, EventKind, Ident, PayloadError};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::view::DocView;
use crate::{DocId, hex};

/// Most changes one document may hold back waiting for their dependencies. An event that
/// would hold more is refused: it names history the stream does not have.
pub const MAX_PENDING_CHANGES: usize = 4_096;
/// History entries kept per document (the newest); older ones are counted, not listed.
pub const HISTORY_KEPT: usize = 256;

/// Why an event was refused. The model is unchanged by it.
#[derive(Debug, Error)]
pub enum DocError {
    #[error(transparent)]
    Payload(#[from] PayloadError),
    #[error("document {doc}: automerge refused the changes: {reason}")]
    Apply { doc: DocId, reason: String },
    #[error(
        "document {doc}: {held} changes would wait for dependencies the stream has not delivered (at most {MAX_PENDING_CHANGES}); send the writer's earlier changes first"
    )]
    TooManyPending { doc: DocId, held: usize },
}

/// What applying one event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Not a `doc_changed` event.
    Ignored,
    /// Already held.
    AlreadyApplied,
    /// Merged: `applied` changes are now in the document (some may be earlier held ones),
    /// `held` wait for their dependencies.
    Merged { applied: usize, held: usize },
}

/// One `doc_changed` event as a document's history shows it.
pub use engram_memory::proto::DocHistoryEntry as HistoryEntry;

/// One document, with what the model knows of how it was built.
pub struct DocEntry {
    doc: Automerge,
    /// Changes waiting for dependencies, in arrival order.
    pending: Vec<Change>,
    events: u64,
    changes: u64,
    last_seq: Seq,
    history: VecDeque<HistoryEntry>,
    /// The compacted save, made once per state: checkpoints and readers share it.
    saved: OnceLock<Vec<u8>>,
}

impl Default for DocEntry {
    fn default() -> Self {
        Self {
            doc: Automerge::new(),
            pending: Vec::new(),
            events: 0,
            changes: 0,
            last_seq: 0,
            history: VecDeque::new(),
            saved: OnceLock::new(),
        }
    }
}

impl std::fmt::Debug for DocEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocEntry")
            .field("heads", &self.heads())
            .field("pending", &self.pending.len())
            .field("events", &self.events)
            .finish()
    }
}

impl DocEntry {
    pub fn doc(&self) -> &Automerge {
        &self.doc
    }

    /// The document's heads, hex, sorted.
    pub fn heads(&self) -> Vec<String> {
        let mut heads: Vec<String> = self.doc.get_heads().iter().map(hex).collect();
        heads.sort();
        heads
    }

    /// The compacted document (automerge `save`): what a writer loads to fork from.
    pub fn saved(&self) -> &[u8] {
        self.saved.get_or_init(|| self.doc.save())
    }

    pub fn view(&self) -> DocView {
        DocView::of(&self.doc)
    }

    pub fn hydrate<T: autosurgeon::Hydrate>(&self) -> Result<T, autosurgeon::HydrateError> {
        autosurgeon::hydrate(&self.doc)
    }

    /// Events merged into it.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Changes it holds.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Changes waiting for dependencies.
    pub fn held(&self) -> usize {
        self.pending.len()
    }

    pub fn last_seq(&self) -> Seq {
        self.last_seq
    }

    /// The newest [`HISTORY_KEPT`] events, oldest first.
    pub fn history(&self) -> impl Iterator<Item = &HistoryEntry> {
        self.history.iter()
    }

    fn has(&self, hash: &ChangeHash) -> bool {
        self.doc.get_change_meta_by_hash(hash).is_some()
    }

    fn merge(
        &mut self,
        doc_id: &DocId,
        seq: Seq,
        event: &Envelope,
        incoming: Vec<Change>,
    ) -> Result<Applied, DocError> {
        let mut known: HashSet<ChangeHash> = self.pending.iter().map(Change::hash).collect();
        let fresh: Vec<Change> = incoming
            .into_iter()
            .filter(|c| !self.has(&c.hash()) && known.insert(c.hash()))
            .collect();
        if fresh.is_empty() {
            return Ok(Applied::AlreadyApplied);
        }
        let fresh_count = fresh.len();
        let mut waiting: Vec<Change> = self.pending.iter().cloned().chain(fresh).collect();
        // Ready are the changes whose dependencies the document holds or that become ready
        // before them: passes until nothing moves, so `ready` is in causal order.
        let mut ready = Vec::new();
        let mut ready_hashes = HashSet::new();
        loop {
            let before = ready.len();
            waiting.retain(|change| {
                let deps_met = change
                    .deps()
                    .iter()
                    .all(|d| ready_hashes.contains(d) || self.has(d));
                if deps_met {
                    ready_hashes.insert(change.hash());
                    ready.push(change.clone());
                }
                !deps_met
            });
            if ready.len() == before {
                break;
            }
        }
        if waiting.len() > MAX_PENDING_CHANGES {
            return Err(DocError::TooManyPending {
                doc: doc_id.clone(),
                held: waiting.len(),
            });
        }
        let applied = ready.len();
        if applied > 0 {
            let backup = self.doc.clone();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.doc.apply_changes(ready)
            }));
            let refused = match outcome {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some("automerge panicked applying them".to_owned()),
            };
            if let Some(reason) = refused {
                self.doc = backup;
                return Err(DocError::Apply {
                    doc: doc_id.clone(),
                    reason,
                });
            }
        }
        self.pending = waiting;
        self.events += 1;
        self.changes += applied as u64;
        self.last_seq = seq;
        self.saved = OnceLock::new();
        if self.history.len() == HISTORY_KEPT {
            self.history.pop_front();
        }
        self.history.push_back(HistoryEntry {
            seq,
            event_id: event.event_id.clone(),
            agent_id: event.agent_id.clone(),
            instance_id: event.instance_id.clone(),
            occurred_at: event.occurred_at,
            changes: fresh_count,
            applied,
            held: self.pending.len(),
        });
        Ok(Applied::Merged {
            applied,
            held: self.pending.len(),
        })
    }
}

/// The wire shape of a [`DocEntry`] in checkpoints: the compacted document and the raw held
/// changes.
#[derive(Serialize, Deserialize)]
struct EntryWire {
    doc: serde_bytes::ByteBuf,
    pending: Vec<serde_bytes::ByteBuf>,
    events: u64,
    changes: u64,
    last_seq: Seq,
    history: VecDeque<HistoryEntry>,
}

impl Serialize for DocEntry {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        EntryWire {
            doc: serde_bytes::ByteBuf::from(self.saved().to_vec()),
            pending: self
                .pending
                .iter()
                .map(|c| serde_bytes::ByteBuf::from(c.raw_bytes().to_vec()))
                .collect(),
            events: self.events,
            changes: self.changes,
            last_seq: self.last_seq,
            history: self.history.clone(),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for DocEntry {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let wire = EntryWire::deserialize(deserializer)?;
        let doc = Automerge::load(&wire.doc).map_err(D::Error::custom)?;
        let pending = wire
            .pending
            .iter()
            .map(|bytes| Change::try_from(&bytes[..]).map_err(D::Error::custom))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            doc,
            pending,
            events: wire.events,
            changes: wire.changes,
            last_seq: wire.last_seq,
            history: wire.history,
            saved: OnceLock::from(wire.doc.into_vec()),
        })
    }
}

/// One scope's documents. Saved as a list of pairs: the key is a struct, which JSON maps
/// cannot hold.
#[derive(Debug, Default)]
pub struct ScopeDocs(BTreeMap<DocId, DocEntry>);

impl std::ops::Deref for ScopeDocs {
    type Target = BTreeMap<DocId, DocEntry>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for ScopeDocs {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Serialize for ScopeDocs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter())
    }
}

impl<'de> Deserialize<'de> for ScopeDocs {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let pairs = Vec::<(DocId, DocEntry)>::deserialize(deserializer)?;
        Ok(Self(pairs.into_iter().collect()))
    }
}

/// Every shared document of every scope.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct DocStore {
    model: ScopedModel<ScopeDocs>,
}

impl DocStore {
    pub fn applied_seq(&self) -> Option<Seq> {
        self.model.applied_seq()
    }

    /// Documents held, over all scopes.
    pub fn len(&self) -> usize {
        self.model.len()
    }

    pub fn is_empty(&self) -> bool {
        self.model.is_empty()
    }

    pub fn get(&self, scope: &ScopeKey, doc: &DocId) -> Option<&DocEntry> {
        self.model.scope(scope)?.get(doc)
    }

    /// A scope's documents in id order, of one type if `doc_type` is given.
    pub fn list<'a>(
        &'a self,
        scope: &ScopeKey,
        doc_type: Option<&'a Ident>,
    ) -> impl Iterator<Item = (&'a DocId, &'a DocEntry)> + 'a {
        self.model
            .scope(scope)
            .into_iter()
            .flat_map(|docs| docs.iter())
            .filter(move |(id, _)| doc_type.is_none_or(|t| &id.doc_type == t))
    }

    /// Applies the event at `seq`: a `doc_changed` event is merged into its document (of the
    /// event's own tenant and scope); every other kind is ignored.
    pub fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Applied, DocError> {
        let applied = self.model.apply(seq, |scopes| {
            if event.kind != EventKind::DocChanged {
                return Ok(Applied::Ignored);
            }
            let (payload, changes) = DocChanged::from_event(event)?;
            let key = ScopeKey::of(event);
            let id = DocId {
                doc_type: payload.doc_type,
                name: payload.name,
            };
            let docs = scopes.scopes.entry(key.clone()).or_default();
            let created = !docs.contains_key(&id);
            let entry = docs.entry(id.clone()).or_default();
            match entry.merge(&id, seq, event, changes) {
                Ok(applied) => {
                    if created {
                        *scopes.len += 1;
                    }
                    Ok(applied)
                }
                Err(e) => {
                    if created {
                        docs.remove(&id);
                        if docs.is_empty() {
                            scopes.scopes.remove(&key);
                        }
                    }
                    Err(e)
                }
            }
        })?;
        Ok(applied.unwrap_or(Applied::AlreadyApplied))
    }
}

impl engram_memory::model::Sliced for DocStore {
    fn into_slice(self, keep: &[ScopeKey]) -> Self {
        Self {
            model: self.model.into_slice(keep, docs_in),
        }
    }

    fn absorb(&mut self, other: Self) {
        self.model.absorb(other.model, docs_in);
    }

    fn erase(&mut self, keys: &[ScopeKey]) -> u64 {
        self.model.erase(keys, docs_in)
    }

    fn held(&self, keys: &[ScopeKey]) -> u64 {
        self.model.held(keys, docs_in)
    }

    fn advance_through(&mut self, seq: Seq) {
        self.model.advance_through(seq);
    }
}

impl EventModel for DocStore {
    type Applied = Applied;
    type Error = DocError;

    fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Applied, DocError> {
        DocStore::apply(self, seq, event)
    }

    /// Over each document's heads (which name its whole change set), its held changes, its
    /// counts and its kept history: equal for the same stream however the model was built
    /// (replayed, restored from a checkpoint, or bootstrapped).
    fn state_hash(&self) -> [u8; 32] {
        self.model.state_hash("engram-docs/1", |canon, docs| {
            canon.len(docs.len());
            for (id, entry) in docs.iter() {
                canon.str(id.doc_type.as_str());
                canon.str(id.name.as_str());
                canon.strs(&entry.heads());
                let mut held: Vec<String> = entry.pending.iter().map(|c| hex(&c.hash())).collect();
                held.sort();
                canon.strs(&held);
                canon.u64(entry.events);
                canon.u64(entry.changes);
                canon.u64(entry.last_seq);
                canon.len(entry.history.len());
                for h in &entry.history {
                    canon.u64(h.seq);
                    canon.str(h.event_id.as_str());
                }
            }
        })
    }
}

/// What one scope counts: its documents.
fn docs_in(docs: &ScopeDocs) -> usize {
    docs.len()
}

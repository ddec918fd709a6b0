//! The text memories the vector and keyword indexes hold, as one pure event model.
//!
//! Both indexes serve the same memories: episodic and semantic events with text
//! ([`is_text_memory`]). What a memory is, and what later events do to it, is decided here
//! once, and each index only follows the [`IndexOp`]s that [`TextMemories::apply`] returns:
//! the vector index embeds and inserts, the keyword index adds documents. So the two agree by
//! construction, not by keeping two copies of the same rules in step.
//!
//! The rules, each applied in stream order:
//! - **Dedup.** A memory is indexed once per event id. A retry stored again after the
//!   stream's duplicate window has a new sequence but the same id, and is skipped; so is the
//!   late retry of a memory since forgotten.
//! - **Forgetting.** A `forgotten` event withdraws the memories it names, of its own scope
//!   only: a writer of one scope has no say over what another reads.
//! - **Distrust.** An outcome or feedback naming contradicted memories, or a feedback
//!   flagging a faulty instance, lowers the confidence of memories of its own scope recorded
//!   before it ([`Distrust`]), once per signal id.
//! - **Inheritance.** A consolidation output starts at the least confidence of its sources
//!   as the events before it left them ([`Inheritance`]), a source withdrawn since counting
//!   with the confidence it was withdrawn at ([`Withdrawn`]).
//!
//! An event that does not check (a `forgotten` event's ids, a signal's or a consolidation
//! output's data) is refused whole and changes nothing. The model does no I/O and never
//! reads a clock, so a replay in other batches gives the same state bit for bit.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use engram_memory::confidence::{self, Distrust, Inheritance, Withdrawn};
use engram_memory::{MemoryMeta, ScopeKey, Seq, is_text_memory};
use engram_schema::payload::PayloadError;
use engram_schema::{Envelope, EventId, EventKind, SchemaError};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A text memory: its metadata (confidence included) and its text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    pub meta: MemoryMeta,
    pub text: String,
}

/// Why an event was refused. Permanent: the same event is refused the same way on every
/// replay, and a refused event leaves the model as it was.
#[derive(Debug, Error)]
pub enum Refused {
    #[error(transparent)]
    Forgotten(#[from] SchemaError),
    #[error(transparent)]
    Payload(#[from] PayloadError),
}

/// What an index does to follow one applied event. The memory an op names is read from the
/// model ([`TextMemories::get`]) as the op left it.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexOp {
    /// A new memory to index; for a consolidation output, the sources it inherits from (the
    /// vector index derives a vector from theirs when its embedder takes none).
    Index {
        seq: Seq,
        inherits: Option<Inheritance>,
    },
    /// A memory withdrawn by a `forgotten` event.
    Unindex {
        seq: Seq,
        scope: ScopeKey,
        event_id: EventId,
    },
    /// A memory whose confidence changed: an index that stores confidences replaces it.
    Reweight { seq: Seq },
}

impl IndexOp {
    pub fn seq(&self) -> Seq {
        match self {
            IndexOp::Index { seq, .. }
            | IndexOp::Unindex { seq, .. }
            | IndexOp::Reweight { seq } => *seq,
        }
    }
}

/// What applying one event did.
#[derive(Debug, Default, PartialEq)]
pub struct Applied {
    /// In the order the index must follow them.
    pub ops: Vec<IndexOp>,
    /// The id of the distrust signal the event carried, when it was applied now (the first
    /// time): a model that logs the ids it keeps logs this one, in the event's scope.
    pub signal: Option<EventId>,
}

/// The model's state, as a checkpoint or snapshot carries it and [`TextMemories::from_parts`]
/// takes it back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parts {
    pub applied: Seq,
    pub memories: Vec<Memory>,
    /// Ids withdrawn by `forgotten` events: a late retry of one is never indexed again.
    pub forgotten: BTreeSet<EventId>,
    /// Ids of the distrust signals applied: a late retry of one lowers nothing again.
    pub distrusted: BTreeSet<EventId>,
    /// Distrusted memories among the forgotten, with scope and confidence.
    pub withdrawn: Withdrawn,
    /// The scope of each id in `forgotten` and `distrusted`, which the ids alone do not say:
    /// an erasure drops the ids of its scopes by it. A checkpoint written before scopes were
    /// kept has none for its ids, and an erasure cannot attribute them.
    pub id_scopes: BTreeMap<EventId, ScopeKey>,
}

/// What an erasure removed ([`TextMemories::erase`]).
#[derive(Debug, Default, PartialEq)]
pub struct Erased {
    /// The sequences of the memories removed, which the indexes remove too.
    pub seqs: Vec<Seq>,
    /// Every event of the scopes the model kept anything of: memories held or forgotten,
    /// signals applied, withdrawn confidences; each once.
    pub events: u64,
    /// Forgotten and signal ids left because no scope is known for them (see
    /// [`Parts::id_scopes`]).
    pub unattributed: usize,
}

/// What the model keeps of some scopes ([`TextMemories::held`]).
#[derive(Debug, Default, PartialEq)]
pub struct Held {
    pub memories: u64,
    /// Events of every kind, memories included, each once (what [`Erased::events`] counts).
    pub events: u64,
}

/// The text memories and what the stream did to them. See the crate docs for the rules.
#[derive(Debug, Default)]
pub struct TextMemories {
    applied: Seq,
    memories: BTreeMap<Seq, Memory>,
    /// Every memory id indexed, with its sequence, forgotten ones included (so that what a
    /// signal names is found, and a forgotten memory's late retry stays out).
    event_ids: HashMap<EventId, Seq>,
    /// The sequences of `memories` by scope: a faulty-instance flag looks only at its own
    /// scope's memories, not every tenant's.
    by_scope: HashMap<ScopeKey, BTreeSet<Seq>>,
    forgotten: BTreeSet<EventId>,
    distrusted: BTreeSet<EventId>,
    withdrawn: Withdrawn,
    id_scopes: BTreeMap<EventId, ScopeKey>,
}

impl TextMemories {
    pub fn from_parts(parts: Parts) -> Self {
        let mut model = Self {
            applied: parts.applied,
            forgotten: parts.forgotten,
            distrusted: parts.distrusted,
            withdrawn: parts.withdrawn,
            id_scopes: parts.id_scopes,
            ..Self::default()
        };
        for memory in parts.memories {
            model.insert(memory);
        }
        model
    }

    /// The last sequence applied (or skipped, or refused at the end of a batch).
    pub fn applied(&self) -> Seq {
        self.applied
    }

    /// Records that everything through `seq` was seen: a batch that ends in refused events
    /// still moves past them.
    pub fn advance_to(&mut self, seq: Seq) {
        self.applied = self.applied.max(seq);
    }

    pub fn len(&self) -> usize {
        self.memories.len()
    }

    pub fn is_empty(&self) -> bool {
        self.memories.is_empty()
    }

    pub fn get(&self, seq: Seq) -> Option<&Memory> {
        self.memories.get(&seq)
    }

    /// The sequence memory `id` was indexed at, forgotten or not.
    pub fn seq_of(&self, id: &EventId) -> Option<Seq> {
        self.event_ids.get(id).copied()
    }

    /// Every memory held, in sequence order.
    pub fn memories(&self) -> impl Iterator<Item = &Memory> {
        self.memories.values()
    }

    /// The memories of `scope`, in sequence order.
    pub fn of_scope<'a>(&'a self, scope: &ScopeKey) -> impl Iterator<Item = &'a Memory> + 'a {
        self.by_scope
            .get(scope)
            .into_iter()
            .flatten()
            .filter_map(|seq| self.memories.get(seq))
    }

    pub fn forgotten(&self) -> &BTreeSet<EventId> {
        &self.forgotten
    }

    pub fn distrusted(&self) -> &BTreeSet<EventId> {
        &self.distrusted
    }

    pub fn withdrawn(&self) -> &Withdrawn {
        &self.withdrawn
    }

    pub fn id_scopes(&self) -> &BTreeMap<EventId, ScopeKey> {
        &self.id_scopes
    }

    /// Whether `event` would be indexed as a new memory if applied now: a text memory whose
    /// id is neither held nor forgotten. What an index that must prepare work ahead (embed
    /// texts in one batch) asks before applying.
    pub fn wants(&self, event: &Envelope) -> bool {
        is_text_memory(event) && !self.knows(&event.event_id)
    }

    fn knows(&self, id: &EventId) -> bool {
        self.event_ids.contains_key(id) || self.forgotten.contains(id)
    }

    /// Applies the event at `seq`. At or below the applied sequence it changes nothing. An
    /// event that does not check is refused and changes nothing either.
    pub fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Applied, Refused> {
        if seq <= self.applied {
            return Ok(Applied::default());
        }
        if event.kind == EventKind::Forgotten {
            let ids = event.forgotten_ids()?;
            self.applied = seq;
            return Ok(self.forget(&ScopeKey::of(event), ids));
        }
        // Both checked before anything changes: a refused event leaves the model as it was.
        let inherits = Inheritance::of(event)?;
        let signal = Distrust::of(seq, event)?;
        self.applied = seq;
        let mut applied = Applied::default();
        // The signal first: a memory the same event carries is at the signal's own sequence,
        // which the signal never reaches.
        if let Some(signal) = signal
            && !self.distrusted.contains(&signal.event_id)
        {
            applied.ops = self.distrust(&signal);
            applied.signal = Some(signal.event_id);
        }
        if self.wants(event) {
            let mut meta = MemoryMeta::of(seq, event);
            if let Some(inherits) = &inherits {
                meta.confidence = self.inherited(inherits);
            }
            self.insert(Memory {
                meta,
                text: event.content.text.clone(),
            });
            applied.ops.push(IndexOp::Index { seq, inherits });
        }
        Ok(applied)
    }

    fn insert(&mut self, memory: Memory) {
        let seq = memory.meta.seq;
        self.event_ids.insert(memory.meta.event_id.clone(), seq);
        self.by_scope
            .entry(memory.meta.scope.clone())
            .or_default()
            .insert(seq);
        self.memories.insert(seq, memory);
    }

    fn remove(&mut self, seq: Seq) -> Option<Memory> {
        let memory = self.memories.remove(&seq)?;
        if let Some(seqs) = self.by_scope.get_mut(&memory.meta.scope) {
            seqs.remove(&seq);
            if seqs.is_empty() {
                self.by_scope.remove(&memory.meta.scope);
            }
        }
        Some(memory)
    }

    /// Withdraws the memories of `ids` that belong to `scope`; an id of another scope, or
    /// one not held, is left alone. Their ids stay known, so a late retry stays out.
    fn forget(&mut self, scope: &ScopeKey, ids: Vec<EventId>) -> Applied {
        let mut applied = Applied::default();
        for id in ids {
            let Some(seq) = self.seq_of(&id) else {
                continue;
            };
            if self
                .memories
                .get(&seq)
                .is_none_or(|m| &m.meta.scope != scope)
            {
                continue;
            }
            if let Some(memory) = self.remove(seq) {
                confidence::withdraw(&mut self.withdrawn, &memory.meta);
            }
            self.forgotten.insert(id.clone());
            self.id_scopes.insert(id.clone(), scope.clone());
            applied.ops.push(IndexOp::Unindex {
                seq,
                scope: scope.clone(),
                event_id: id,
            });
        }
        applied
    }

    /// Lowers the confidence of the memories `signal` is about: those it contradicts and, for
    /// a faulty-instance flag, those of its scope the instance wrote. [`Distrust::apply`]
    /// decides, so other scopes and later memories are left alone. Records the signal.
    fn distrust(&mut self, signal: &Distrust) -> Vec<IndexOp> {
        self.distrusted.insert(signal.event_id.clone());
        self.id_scopes
            .insert(signal.event_id.clone(), signal.scope.clone());
        let mut about: BTreeSet<Seq> = signal
            .contradicts
            .iter()
            .filter_map(|id| self.seq_of(id))
            .collect();
        if let Some(instance) = &signal.faulty_instance {
            about.extend(
                self.of_scope(&signal.scope)
                    .filter(|m| m.meta.instance_id.as_ref() == Some(instance))
                    .map(|m| m.meta.seq),
            );
        }
        let mut ops = Vec::new();
        for seq in about {
            if let Some(memory) = self.memories.get_mut(&seq)
                && let Some(meta) = signal.apply(&memory.meta)
            {
                memory.meta = meta;
                ops.push(IndexOp::Reweight { seq });
            }
        }
        ops
    }

    /// The confidence a consolidation output starts at, from its sources as held now, or
    /// as withdrawn ([`Inheritance::confidence`]).
    fn inherited(&self, inherits: &Inheritance) -> f64 {
        inherits.confidence(
            |id| match self.seq_of(id).and_then(|seq| self.memories.get(&seq)) {
                Some(m) => Some((&m.meta.scope, m.meta.confidence)),
                None => self.withdrawn.get(id).map(|(scope, c)| (scope, *c)),
            },
        )
    }

    /// What the model keeps of the scopes `keys`: the sequences of their memories, and the
    /// ids of every event of theirs it keeps anything of, each once. Every memory is looked
    /// at, not only the scopes' lists: an erasure must not trust an invariant to find what it
    /// removes.
    fn held_of(&self, keys: &HashSet<ScopeKey>) -> (Vec<Seq>, BTreeSet<EventId>) {
        let mut seqs = Vec::new();
        let mut ids = BTreeSet::new();
        for (seq, memory) in &self.memories {
            if keys.contains(&memory.meta.scope) {
                seqs.push(*seq);
                ids.insert(memory.meta.event_id.clone());
            }
        }
        // A withdrawn entry says its scope too, even when restored from a checkpoint that
        // did not keep `id_scopes`.
        let withdrawn = self.withdrawn.iter().map(|(id, (scope, _))| (id, scope));
        ids.extend(
            self.id_scopes
                .iter()
                .chain(withdrawn)
                .filter(|(_, scope)| keys.contains(*scope))
                .map(|(id, _)| id.clone()),
        );
        (seqs, ids)
    }

    /// How much the model keeps of the scopes `keys`.
    pub fn held(&self, keys: &HashSet<ScopeKey>) -> Held {
        let (seqs, ids) = self.held_of(keys);
        Held {
            memories: seqs.len() as u64,
            events: ids.len() as u64,
        }
    }

    /// Removes everything of the scopes `keys`: their memories, and the ids kept of their
    /// forgotten memories and applied signals, and their withdrawn confidences.
    pub fn erase(&mut self, keys: &HashSet<ScopeKey>) -> Erased {
        let (seqs, ids) = self.held_of(keys);
        for seq in &seqs {
            self.remove(*seq);
        }
        // The ids of forgotten memories still map to their old sequences, and signals' ids
        // are kept apart from memories: each is dropped by id.
        for id in &ids {
            self.event_ids.remove(id);
            self.forgotten.remove(id);
            self.distrusted.remove(id);
            self.withdrawn.remove(id);
            self.id_scopes.remove(id);
        }
        let unattributed = self
            .forgotten
            .iter()
            .chain(&self.distrusted)
            .filter(|id| !self.id_scopes.contains_key(*id) && !self.withdrawn.contains_key(*id))
            .count();
        Erased {
            seqs,
            events: ids.len() as u64,
            unattributed,
        }
    }

    /// Feeds the state to `hasher`: each memory in sequence order (with what `extra` adds of
    /// it, such as its vector), then the kept ids. Sections a model has none of add nothing,
    /// so a state without signals hashes as it did before signals existed.
    pub fn hash_into(
        &self,
        hasher: &mut blake3::Hasher,
        mut extra: impl FnMut(&Memory, &mut blake3::Hasher),
    ) {
        for memory in self.memories.values() {
            hasher.update(&rmp_serde::to_vec(memory).unwrap_or_default());
            extra(memory, hasher);
        }
        for id in &self.forgotten {
            hasher.update(id.as_str().as_bytes());
        }
        if !self.distrusted.is_empty() {
            hasher.update(b"\0distrusted");
            for id in &self.distrusted {
                hasher.update(id.as_str().as_bytes());
            }
        }
        if !self.withdrawn.is_empty() {
            hasher.update(b"\0withdrawn");
            for (id, (scope, confidence)) in &self.withdrawn {
                hasher.update(id.as_str().as_bytes());
                hasher.update(scope.to_string().as_bytes());
                hasher.update(&confidence.to_le_bytes());
            }
        }
        if !self.id_scopes.is_empty() {
            hasher.update(b"\0id scopes");
            for (id, scope) in &self.id_scopes {
                hasher.update(id.as_str().as_bytes());
                hasher.update(scope.to_string().as_bytes());
            }
        }
    }

    /// The state hash with nothing besides the model.
    pub fn state_hash(&self) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new();
        self.hash_into(&mut hasher, |_, _| {});
        *hasher.finalize().as_bytes()
    }

    /// The state as [`Parts`], cloned.
    pub fn to_parts(&self) -> Parts {
        Parts {
            applied: self.applied,
            memories: self.memories.values().cloned().collect(),
            forgotten: self.forgotten.clone(),
            distrusted: self.distrusted.clone(),
            withdrawn: self.withdrawn.clone(),
            id_scopes: self.id_scopes.clone(),
        }
    }
}

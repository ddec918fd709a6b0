//! The consolidator's read model: what each scope remembers, in the terms consolidation
//! needs.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use engram_memory::model::{EventModel, ScopedModel};
use engram_memory::{ScopeKey, Seq, is_text_memory};
use engram_schema::{
    Consolidated, ConsolidationOp, Envelope, EventId, EventKind, Forgotten, PayloadError,
    SkillOutcome, Used,
};
use serde::{Deserialize, Serialize};

use crate::minhash::Signature;
use crate::steps::CONSOLIDATOR;

/// Bytes of a memory's text kept for summaries and merged memories.
pub const MAX_TEXT_BYTES: usize = 2_048;
/// Session ends one scope remembers.
pub const MAX_FINISHES: usize = 4_096;
/// Actions one episode holds. A longer one is not a procedure worth promoting, and a
/// client may send any number: past this it is marked overflowed, and dropped when it ends.
pub const MAX_EPISODE_ACTIONS: usize = 32;
/// Ended episodes one scope remembers; older ones are dropped (their events are in the log).
/// With the bounds below, at most about 16 MiB of episode text per scope, ended and open.
pub const MAX_EPISODES: usize = 1_024;
/// Episodes in progress one scope tracks; for a new one past this, the one idle longest is
/// dropped. Groups are client-chosen (any correlation id), so they must be bounded too.
pub const MAX_OPEN_EPISODES: usize = 1_024;
/// Bytes of an action's text kept.
pub const MAX_ACTION_BYTES: usize = 256;

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
    /// Times queries returned it (`feedback` with `retrieved`, aggregated by the query
    /// service). Reported, never reinforcing: being returned is not being useful.
    #[serde(default)]
    pub retrievals: u64,
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
    /// Ids of consolidation outputs (`consolidated`, `forgotten`, and `skill_recorded`
    /// written by the consolidator) applied.
    pub outputs: BTreeSet<String>,
    /// The scope's action sequences and how they ended, for promoting skills.
    #[serde(default)]
    pub episodes: Episodes,
}

/// An action sequence that an outcome ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Episode {
    /// The actions' texts in stream order, each at most [`MAX_ACTION_BYTES`]; 1 to
    /// [`MAX_EPISODE_ACTIONS`] of them.
    pub actions: Vec<String>,
    /// The outcome's `content.data.success`.
    pub success: bool,
    /// The outcome event that ended it.
    pub outcome: EventId,
}

/// An episode whose outcome has not arrived yet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpenEpisode {
    pub actions: Vec<String>,
    /// More than [`MAX_EPISODE_ACTIONS`] arrived: the sequence is not known whole, so it
    /// is dropped when it ends instead of promoted as a prefix.
    pub overflowed: bool,
    /// The seq of its latest action: which open episode has been idle longest.
    pub last_seq: Seq,
}

/// A scope's episodes: the `action` events of one group (the events' `correlation_id`,
/// else their `instance_id`) up to the `outcome` that ends them. An outcome ends its
/// group's episode when it names no skill (a skill's outcome is the skill registry's) and
/// its `content.data.success` is a boolean; other outcomes leave the episode open.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Episodes {
    /// By group key ([`Episodes::group`]).
    open: BTreeMap<String, OpenEpisode>,
    /// Group keys by their open episode's `last_seq`, to find the one idle longest without
    /// a scan: a flood of new groups would otherwise scan thousands per event.
    idle: BTreeMap<Seq, String>,
    /// By the seq of the outcome that ended each, oldest first; at most [`MAX_EPISODES`].
    ended: BTreeMap<Seq, Episode>,
}

impl Episodes {
    /// The ended episodes, in stream order.
    pub fn ended(&self) -> impl Iterator<Item = (&Seq, &Episode)> {
        self.ended.iter()
    }

    /// The episodes in progress, by group key.
    pub fn open(&self) -> impl Iterator<Item = (&String, &OpenEpisode)> {
        self.open.iter()
    }

    /// The group an action or outcome belongs to. Hashed, because a correlation id is a
    /// client's string of any length; prefixed, so that a correlation id equal to some
    /// instance's id is still another group.
    fn group(event: &Envelope) -> String {
        let (tag, value) = match &event.correlation_id {
            Some(correlation) => ("correlation", correlation.as_str()),
            None => ("instance", event.instance_id.as_str()),
        };
        let mut hasher = blake3::Hasher::new();
        hasher.update(tag.as_bytes());
        hasher.update(&[0]);
        hasher.update(value.as_bytes());
        hasher.finalize().to_hex()[..32].to_owned()
    }

    fn action(&mut self, seq: Seq, event: &Envelope) {
        let text = event.content.text.trim();
        if text.is_empty() {
            // Nothing to name a step by.
            return;
        }
        let group = Self::group(event);
        if !self.open.contains_key(&group)
            && self.open.len() >= MAX_OPEN_EPISODES
            && let Some((_, idlest)) = self.idle.pop_first()
        {
            self.open.remove(&idlest);
        }
        let episode = self.open.entry(group.clone()).or_default();
        if self.idle.get(&episode.last_seq) == Some(&group) {
            self.idle.remove(&episode.last_seq);
        }
        episode.last_seq = seq;
        self.idle.insert(seq, group);
        if episode.actions.len() == MAX_EPISODE_ACTIONS {
            episode.overflowed = true;
        } else {
            episode
                .actions
                .push(truncated(text, MAX_ACTION_BYTES).to_owned());
        }
    }

    fn outcome(&mut self, seq: Seq, event: &Envelope, success: bool) {
        let Some(episode) = self.open.remove(&Self::group(event)) else {
            return;
        };
        self.idle.remove(&episode.last_seq);
        if episode.overflowed || episode.actions.is_empty() {
            return;
        }
        if self.ended.len() >= MAX_EPISODES {
            self.ended.pop_first();
        }
        self.ended.insert(
            seq,
            Episode {
                actions: episode.actions,
                success,
                outcome: event.event_id.clone(),
            },
        );
    }

    fn hash(&self, canon: &mut engram_memory::canon::Canon) {
        // `idle` is derived from `open`, so it is left out.
        canon.len(self.open.len());
        for (group, episode) in &self.open {
            canon.str(group);
            canon.strs(&episode.actions);
            canon.u8(u8::from(episode.overflowed));
            canon.u64(episode.last_seq);
        }
        canon.len(self.ended.len());
        for (seq, episode) in &self.ended {
            canon.u64(*seq);
            canon.strs(&episode.actions);
            canon.u8(u8::from(episode.success));
            canon.str(episode.outcome.as_str());
        }
    }
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
fn truncated(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The `success` of an outcome that ends an episode: one naming no skill, with a boolean
/// `content.data.success`. `None` for every other event.
fn episode_outcome(event: &Envelope) -> Option<bool> {
    if event.kind != EventKind::Outcome {
        return None;
    }
    // A skill's outcome, even a malformed one, is the skill registry's to count.
    if !matches!(SkillOutcome::from_event(event), Ok(None)) {
        return None;
    }
    event.content.data.as_ref()?.get("success")?.as_bool()
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

    /// Queries returned these memories this many times: counted, their decay untouched.
    fn retrieved(&mut self, counts: &BTreeMap<EventId, u32>) {
        for (id, n) in counts {
            if let Some(seq) = self.by_id.get(id.as_str())
                && let Some(m) = self.memories.get_mut(seq)
            {
                m.retrievals = m.retrievals.saturating_add(u64::from(*n));
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
        let text = truncated(&event.content.text, MAX_TEXT_BYTES).to_owned();
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
                retrievals: 0,
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
    /// names (own scope only); `feedback` with `used` reinforces what it names, and with
    /// `retrieved` counts how often queries returned them (no reinforcement); a
    /// `checkpoint` with `"finished": true` finishes the scope. Besides, `action`s and the
    /// outcomes that end them make the scope's [`Episodes`], and a `skill_recorded` the
    /// consolidator wrote is an output applied.
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
        let retrieved = match event.kind {
            EventKind::Feedback => engram_schema::Retrieved::from_event(event)?,
            _ => None,
        };
        let ended = episode_outcome(event);
        // The payload is the skill registry's to check; the consolidator only needs to know
        // that its own promotion was applied.
        let promoted =
            event.kind == EventKind::SkillRecorded && event.agent_id.as_str() == CONSOLIDATOR;
        let applied = self.model.apply(seq, |scopes| {
            let state = scopes.scopes.entry(ScopeKey::of(event)).or_default();
            state.latest = Some(
                state
                    .latest
                    .map_or(event.occurred_at, |t| t.max(event.occurred_at)),
            );
            // An action or outcome may also be a text memory: episodes are kept besides.
            if event.kind == EventKind::Action {
                state.episodes.action(seq, event);
            } else if let Some(success) = ended {
                state.episodes.outcome(seq, event, success);
            } else if promoted {
                state.outputs.insert(event.event_id.as_str().to_owned());
            }
            let mut added = false;
            if let Some(out) = &consolidated {
                state.outputs.insert(event.event_id.as_str().to_owned());
                state.insert(seq, event, out.op.into(), out.recurrences());
                added = true;
            } else if let Some(forgotten) = &forgotten {
                state.outputs.insert(event.event_id.as_str().to_owned());
                state.hide(&forgotten.event_ids);
            } else if used.is_some() || retrieved.is_some() {
                if let Some(used) = &used {
                    state.used(&used.used, event.occurred_at);
                }
                if let Some(retrieved) = &retrieved {
                    state.retrieved(&retrieved.retrieved);
                }
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
            .state_hash("engram-consolidate/2", |canon, state| {
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
                    canon.u64(m.retrievals);
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
                state.episodes.hash(canon);
            })
    }
}

impl engram_memory::model::Sliced for Memories {
    fn into_slice(self, keep: &[ScopeKey]) -> Self {
        Self {
            model: self.model.into_slice(keep, memories_in),
        }
    }

    fn absorb(&mut self, other: Self) {
        self.model.absorb(other.model, memories_in);
    }

    fn erase(&mut self, keys: &[ScopeKey]) -> u64 {
        self.model.erase(keys, memories_in)
    }

    fn held(&self, keys: &[ScopeKey]) -> u64 {
        self.model.held(keys, memories_in)
    }

    fn advance_through(&mut self, seq: Seq) {
        self.model.advance_through(seq);
    }
}

/// What one scope counts: its memories.
fn memories_in(scope: &ScopeState) -> usize {
    scope.memories.len()
}

//! The skill registry: applying events and answering queries.

use std::collections::{BTreeMap, BTreeSet};

use engram_memory::canon::Canon;
use engram_memory::model::{EventModel, ScopedModel, ScopesMut};
use engram_memory::{ScopeKey, Seq};
use engram_schema::{Envelope, EventKind, SkillOutcome, SkillRecorded};
use serde::{Deserialize, Serialize};

use crate::Provenance;
use crate::SkillError;
use crate::payload;
use crate::skill::{PendingOutcomes, Skill, Usage};
use crate::text;

/// What [`SkillRegistry::apply`] did with an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A `skill_recorded` event added `version`; `latest` says whether it is now the one
    /// [`SkillRegistry::get`] returns.
    Recorded { version: u32, latest: bool },
    /// An `outcome` event was counted for this recorded version.
    OutcomeCounted { version: u32 },
    /// An `outcome` event named a skill or version not recorded yet; it waits in
    /// [`SkillRegistry::pending`].
    OutcomePending { version: Option<u32> },
    /// Neither a skill event nor an outcome naming a skill; only the applied seq moved.
    Ignored,
    /// The seq is at or below the last applied one: nothing changed.
    AlreadyApplied,
}

/// Everything known under one skill name in one scope.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(from = "EntrySnapshot")]
struct Entry {
    /// Ordered by (version, seq). The first record of a version number is that version's
    /// holder; later records with the same number are history only.
    versions: Vec<Skill>,
    pending: PendingOutcomes,
    /// The search terms of the latest version as [`text::term_id`]s, sorted and unique:
    /// one contiguous array per skill keeps search cache-friendly. Derived, so snapshots
    /// leave it out; it changes whenever the latest version does.
    #[serde(skip)]
    terms: Vec<u64>,
}

/// What a snapshot holds of an [`Entry`].
#[derive(Deserialize)]
struct EntrySnapshot {
    versions: Vec<Skill>,
    pending: PendingOutcomes,
}

impl From<EntrySnapshot> for Entry {
    fn from(snapshot: EntrySnapshot) -> Self {
        let mut entry = Self {
            versions: snapshot.versions,
            pending: snapshot.pending,
            terms: Vec::new(),
        };
        entry.index_terms();
        entry
    }
}

impl Entry {
    /// The holder of `version`, if recorded.
    fn holder(&self, version: u32) -> Option<usize> {
        let first = self.versions.partition_point(|s| s.version < version);
        (self.versions.get(first)?.version == version).then_some(first)
    }

    fn latest(&self) -> Option<usize> {
        self.holder(self.versions.last()?.version)
    }

    fn index_terms(&mut self) {
        self.terms = match self.latest() {
            Some(index) => {
                let mut ids: Vec<u64> = skill_terms(&self.versions[index])
                    .iter()
                    .map(|term| text::term_id(term))
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                ids
            }
            None => Vec::new(),
        };
    }

    fn has_term(&self, term: u64) -> bool {
        self.terms.binary_search(&term).is_ok()
    }
}

/// name -> everything known under it.
type Names = BTreeMap<String, Entry>;

/// The skill registry of every scope. See the crate docs for the semantics.
///
/// A [`ScopedModel`] counting skills (scope and name) with at least one recorded version: it
/// owns the applied seq, the snapshot shape and the order everything is hashed in.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SkillRegistry {
    model: ScopedModel<Names>,
}

/// How much reliability can move a score: the factor runs from `1 - SPREAD` (always
/// failed) to `1 + SPREAD` (always succeeded), and is 1 for an untried skill.
const RELIABILITY_SPREAD: f64 = 0.2;

impl SkillRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// The highest seq applied so far, `None` for a new registry. Snapshots store it so that
    /// replay resumes after it.
    pub fn applied_seq(&self) -> Option<Seq> {
        self.model.applied_seq()
    }

    /// Applies the event at stream sequence `seq`.
    ///
    /// Idempotent by seq: when `seq` is at or below [`SkillRegistry::applied_seq`] nothing
    /// changes and the answer is [`Applied::AlreadyApplied`]. Events other than
    /// `skill_recorded` and `outcome`, and outcomes naming no skill, are
    /// [`Applied::Ignored`]. A malformed payload is an error and leaves the registry
    /// unchanged, the applied seq included. The result depends only on `seq` and `event`,
    /// never on the clock.
    pub fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Applied, SkillError> {
        let applied = self.model.apply(seq, |registry| {
            // Parse and resolve everything before touching the registry, so that a failure
            // changes nothing.
            Ok(match event.kind {
                EventKind::SkillRecorded => {
                    let recording = payload::recording(seq, event)?;
                    let version = resolve_version(registry.scopes, seq, event, &recording)?;
                    record(registry, seq, event, recording, version)
                }
                EventKind::Outcome => match payload::outcome(seq, event)? {
                    Some(outcome) => count(registry, event, outcome),
                    None => Applied::Ignored,
                },
                _ => Applied::Ignored,
            })
        })?;
        Ok(applied.unwrap_or(Applied::AlreadyApplied))
    }

    fn entry(&self, scope: &ScopeKey, name: &str) -> Option<&Entry> {
        entry(self.model.scope(scope)?, name)
    }

    /// The latest version of a skill: the highest version number, and of equal numbers the
    /// first recorded. `name` is trimmed and matched exactly (case matters).
    pub fn get(&self, scope: &ScopeKey, name: &str) -> Option<&Skill> {
        let entry = self.entry(scope, name)?;
        entry.latest().map(|index| &entry.versions[index])
    }

    /// Every recorded version of a skill, ordered by version, then by seq.
    pub fn versions(&self, scope: &ScopeKey, name: &str) -> Vec<&Skill> {
        self.entry(scope, name)
            .map(|entry| entry.versions.iter().collect())
            .unwrap_or_default()
    }

    /// Outcomes waiting for a version of this skill to be recorded, if any.
    pub fn pending(&self, scope: &ScopeKey, name: &str) -> Option<&PendingOutcomes> {
        self.entry(scope, name)
            .map(|entry| &entry.pending)
            .filter(|pending| !pending.is_empty())
    }

    /// The latest versions in `scopes` most relevant to a task, best first, at most `k`,
    /// all with some relevance.
    ///
    /// Relevance is the IDF-weighted share of the task's terms found in a skill's name,
    /// description, preconditions and steps (lowercase words without stop words; IDF over
    /// the skills searched, so other scopes never influence it). It is multiplied by a mild
    /// reliability factor, `0.8 + 0.4 * success_rate`, from 0.8 to 1.2 and 1.0 untried:
    /// reliability orders skills of similar relevance but does not lift an irrelevant one
    /// over a relevant one. Ties keep scope, then name order.
    pub fn search(
        &self,
        scopes: &[ScopeKey],
        task_description: &str,
        k: usize,
    ) -> Vec<(&Skill, f32)> {
        let mut query: Vec<u64> = text::terms(task_description)
            .map(|term| text::term_id(&term))
            .collect();
        query.sort_unstable();
        query.dedup();
        if query.is_empty() || k == 0 {
            return Vec::new();
        }
        let unique: BTreeSet<&ScopeKey> = scopes.iter().collect();
        let candidates: Vec<(&Skill, &Entry)> = unique
            .into_iter()
            .filter_map(|scope| self.model.scope(scope))
            .flat_map(|names| names.values())
            .filter_map(|entry| entry.latest().map(|index| (&entry.versions[index], entry)))
            .collect();
        // hits[c * terms + t]: whether candidate c has query term t.
        let hits: Vec<bool> = candidates
            .iter()
            .flat_map(|(_, entry)| query.iter().map(|&term| entry.has_term(term)))
            .collect();
        let n = candidates.len() as f64;
        let idf: Vec<f64> = (0..query.len())
            .map(|t| {
                let df = hits
                    .iter()
                    .skip(t)
                    .step_by(query.len())
                    .filter(|&&hit| hit)
                    .count() as f64;
                (1.0 + (n - df + 0.5) / (df + 0.5)).ln()
            })
            .collect();
        let total: f64 = idf.iter().sum();
        let mut scored: Vec<(&Skill, f32)> = candidates
            .iter()
            .zip(hits.chunks(query.len()))
            .filter_map(|((skill, _), hits)| {
                let matched: f64 = idf
                    .iter()
                    .zip(hits)
                    .filter(|(_, hit)| **hit)
                    .map(|(weight, _)| weight)
                    .sum();
                (matched > 0.0).then(|| {
                    let reliability = 1.0 + RELIABILITY_SPREAD * (2.0 * skill.success_rate() - 1.0);
                    (*skill, (matched / total * reliability) as f32)
                })
            })
            .collect();
        // Stable, so equal scores keep scope, then name order.
        scored.sort_by(|a, b| b.1.total_cmp(&a.1));
        scored.truncate(k);
        scored
    }

    /// Skills (scope and name) with at least one recorded version.
    pub fn len(&self) -> usize {
        self.model.len()
    }

    pub fn is_empty(&self) -> bool {
        self.model.is_empty()
    }

    /// A blake3 digest of the whole state, applied seq and pending outcomes included, over a
    /// canonical encoding: equal registries give equal hashes however they were built or
    /// restored.
    pub fn state_hash(&self) -> [u8; 32] {
        self.model.state_hash("engram-skills/v1", |canon, names| {
            canon.len(names.len());
            for (name, entry) in names {
                canon.str(name);
                canon.len(entry.versions.len());
                for skill in &entry.versions {
                    hash_skill(canon, skill);
                }
                hash_usage(canon, &entry.pending.unversioned);
                canon.len(entry.pending.by_version.len());
                for (version, usage) in &entry.pending.by_version {
                    canon.u64(u64::from(*version));
                    hash_usage(canon, usage);
                }
            }
        })
    }
}

/// The explicit version, or one above the highest recorded (1 for a new skill).
fn resolve_version(
    scopes: &BTreeMap<ScopeKey, Names>,
    seq: Seq,
    event: &Envelope,
    recording: &SkillRecorded,
) -> Result<u32, SkillError> {
    if let Some(version) = recording.version {
        return Ok(version);
    }
    let highest = scopes
        .get(&ScopeKey::of(event))
        .and_then(|names| entry(names, &recording.name))
        .and_then(|entry| entry.versions.last())
        .map_or(0, |skill| skill.version);
    highest
        .checked_add(1)
        .ok_or_else(|| SkillError::InvalidField {
            seq,
            event_id: event.event_id.clone(),
            kind: event.kind,
            field: "version",
            reason: format!(
                "the highest recorded version is {highest}, so the next one would overflow; record it under a new name"
            ),
        })
}

fn record(
    registry: ScopesMut<'_, Names>,
    seq: Seq,
    event: &Envelope,
    recording: SkillRecorded,
    version: u32,
) -> Applied {
    let scope = ScopeKey::of(event);
    let entry = registry
        .scopes
        .entry(scope.clone())
        .or_default()
        .entry(recording.name.clone())
        .or_default();
    let first_version = entry.versions.is_empty();
    let new_version = entry.holder(version).is_none();
    let latest = entry.versions.last().is_none_or(|s| version > s.version);
    let mut skill = Skill {
        scope,
        name: recording.name,
        version,
        description: recording.description,
        steps: recording.steps.unwrap_or_default(),
        script: recording.script,
        preconditions: recording.preconditions.unwrap_or_default(),
        successes: 0,
        failures: 0,
        last_used: None,
        recorded_at: event.recorded_at,
        source: Provenance::of(seq, event),
    };
    // Only the holder of a version counts outcomes, so a record repeating a version number
    // brings no counts of its own: observed ones included, or one way of working recorded
    // twice would count twice.
    if new_version && let Some(observed) = recording.observed {
        skill.count(&Usage::observed(observed));
    }
    if new_version && let Some(usage) = entry.pending.by_version.remove(&version) {
        skill.count(&usage);
    }
    if first_version {
        skill.count(&std::mem::take(&mut entry.pending.unversioned));
    }
    // Seqs only grow, so this lands after every earlier record of the same version.
    let at = entry.versions.partition_point(|s| s.version <= version);
    entry.versions.insert(at, skill);
    if latest {
        entry.index_terms();
    }
    if first_version {
        *registry.len += 1;
    }
    Applied::Recorded { version, latest }
}

fn count(registry: ScopesMut<'_, Names>, event: &Envelope, outcome: SkillOutcome) -> Applied {
    let entry = registry
        .scopes
        .entry(ScopeKey::of(event))
        .or_default()
        .entry(outcome.skill)
        .or_default();
    let holder = match outcome.version {
        Some(version) => entry.holder(version),
        None => entry.latest(),
    };
    if let Some(index) = holder {
        let skill = &mut entry.versions[index];
        let mut usage = Usage::default();
        usage.count(outcome.success, event.occurred_at);
        skill.count(&usage);
        return Applied::OutcomeCounted {
            version: skill.version,
        };
    }
    let usage = match outcome.version {
        Some(version) => entry.pending.by_version.entry(version).or_default(),
        None => &mut entry.pending.unversioned,
    };
    usage.count(outcome.success, event.occurred_at);
    Applied::OutcomePending {
        version: outcome.version,
    }
}

fn entry<'a>(names: &'a Names, name: &str) -> Option<&'a Entry> {
    names.get(name.trim())
}

fn skill_terms(skill: &Skill) -> BTreeSet<String> {
    text::term_set(
        [skill.name.as_str(), skill.description.as_str()]
            .into_iter()
            .chain(skill.preconditions.iter().map(String::as_str))
            .chain(skill.steps.iter().map(String::as_str)),
    )
}

fn hash_skill(canon: &mut Canon, skill: &Skill) {
    canon.scope(&skill.scope);
    canon.str(&skill.name);
    canon.u64(u64::from(skill.version));
    canon.str(&skill.description);
    canon.strs(&skill.steps);
    canon.opt_str(skill.script.as_deref());
    canon.strs(&skill.preconditions);
    canon.u64(skill.successes);
    canon.u64(skill.failures);
    canon.opt_time(skill.last_used);
    canon.time(skill.recorded_at);
    skill.source.write_to(canon);
}

fn hash_usage(canon: &mut Canon, usage: &Usage) {
    canon.u64(usage.successes);
    canon.u64(usage.failures);
    canon.opt_time(usage.last_used);
}

impl engram_memory::model::Sliced for SkillRegistry {
    fn into_slice(self, keep: &[ScopeKey]) -> Self {
        Self {
            model: self.model.into_slice(keep, skills_in),
        }
    }

    fn absorb(&mut self, other: Self) {
        self.model.absorb(other.model, skills_in);
    }

    fn erase(&mut self, keys: &[ScopeKey]) -> u64 {
        self.model.erase(keys, skills_in)
    }

    fn held(&self, keys: &[ScopeKey]) -> u64 {
        self.model.held(keys, skills_in)
    }

    fn advance_through(&mut self, seq: Seq) {
        self.model.advance_through(seq);
    }
}

impl EventModel for SkillRegistry {
    type Applied = Applied;
    type Error = SkillError;

    fn apply(&mut self, seq: Seq, event: &Envelope) -> Result<Applied, SkillError> {
        SkillRegistry::apply(self, seq, event)
    }

    fn state_hash(&self) -> [u8; 32] {
        SkillRegistry::state_hash(self)
    }
}

/// What one scope counts: its skill versions.
fn skills_in(names: &Names) -> usize {
    names.values().map(|e| e.versions.len()).sum()
}

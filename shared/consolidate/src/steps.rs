//! The consolidation steps, in one list. Each reads one scope's state and plans events;
//! [`plan`] runs them in order, each leaving alone the memories an earlier one claimed.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use engram_memory::ScopeKey;
use engram_memory::proto::Neighbour;
use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::model::{Memories, Origin, ScopeState};
use crate::promote::Promote;

/// The agent and instance consolidation outputs are written as.
pub const CONSOLIDATOR: &str = "consolidator";
/// Members of a MinHash bucket each candidate is compared with.
pub const BUCKET_NEIGHBOURS: usize = 32;
/// Most source ids one output names (the payload's bound).
pub const MAX_SOURCES: usize = engram_schema::payload::MAX_FORGOTTEN;

/// How consolidation judges: `[consolidator]` in engram.toml.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Jaccard similarity of word 3-shingle sets at which two memories are one (MinHash
    /// bands find the candidates; the sets themselves decide).
    pub dedup_similarity: f64,
    /// Cosine similarity of two memories' vectors at which the vector model offers them as
    /// near-duplicates beside the MinHash bands (a reworded or reordered text shares few
    /// shingles). Such a pair is one only if the words of one hold every word of the other
    /// and they share [`Policy::dedup_vector_words`] of their words: the merge keeps the
    /// fuller text and loses nothing either said. 1 turns vector candidates off.
    pub dedup_vector_similarity: f64,
    /// Jaccard similarity of the word sets a vector-offered pair needs besides containment.
    pub dedup_vector_words: f64,
    /// Importance a merged memory gains per recurrence beyond the first.
    pub importance_per_recurrence: f64,
    /// Days after which a memory's importance has halved, counted from when it was last
    /// useful (written, recurred, used) to the scope's newest event.
    pub half_life_days: f64,
    /// Decayed importance below which a memory is archived.
    pub archive_below: f64,
    /// Importance each reported use adds before decay (up to 1).
    pub reinforcement: f64,
    /// Importance of a session summary.
    pub summary_importance: f64,
    /// Episodes an action sequence must have ended before it is promoted to a skill.
    pub promote_min_occurrences: u32,
    /// Share of those episodes that must have succeeded, 0-1.
    pub promote_min_success: f64,
    /// Most events one plan holds; the rest wait for the next run.
    pub max_events: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            dedup_similarity: 0.75,
            dedup_vector_similarity: 0.9,
            dedup_vector_words: 0.5,
            importance_per_recurrence: 0.1,
            half_life_days: 30.0,
            archive_below: 0.05,
            reinforcement: 0.1,
            summary_importance: 0.7,
            promote_min_occurrences: 3,
            promote_min_success: 0.6,
            max_events: 256,
        }
    }
}

impl Policy {
    pub fn validate(&self) -> Result<(), String> {
        let unit = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("consolidator.{name} must be in 0.0..=1.0, not {v}"))
            }
        };
        unit("dedup_similarity", self.dedup_similarity)?;
        unit("dedup_vector_similarity", self.dedup_vector_similarity)?;
        unit("dedup_vector_words", self.dedup_vector_words)?;
        unit("importance_per_recurrence", self.importance_per_recurrence)?;
        unit("archive_below", self.archive_below)?;
        unit("reinforcement", self.reinforcement)?;
        unit("summary_importance", self.summary_importance)?;
        unit("promote_min_success", self.promote_min_success)?;
        if self.promote_min_occurrences < 2 {
            return Err(format!(
                "consolidator.promote_min_occurrences must be at least 2, not {}: a sequence seen once is not recurring",
                self.promote_min_occurrences
            ));
        }
        if !(self.half_life_days > 0.0 && self.half_life_days.is_finite()) {
            return Err("consolidator.half_life_days must be a positive number of days".into());
        }
        if self.max_events == 0 {
            return Err("consolidator.max_events must be at least 1".into());
        }
        Ok(())
    }
}

/// What one step run plans for one scope.
pub struct Ctx<'a> {
    pub scope: &'a ScopeKey,
    pub state: &'a ScopeState,
    pub policy: &'a Policy,
    /// The scope's clock: its newest event's time.
    pub now: DateTime<Utc>,
    /// Memories an earlier step of this plan already uses.
    pub claimed: BTreeSet<String>,
    /// Pairs of the scope's memories whose vectors are close, from the vector model.
    pub neighbours: &'a [Neighbour],
}

impl Ctx<'_> {
    /// An output event: semantic (what consolidation distils is knowledge; a step writing
    /// another layer sets it), written by the consolidator at the scope's clock.
    pub(crate) fn output(
        &self,
        id: EventId,
        kind: EventKind,
        text: String,
        data: serde_json::Value,
        importance: f64,
        caused_by: Option<EventId>,
    ) -> Envelope {
        let me = Ident::parse("agent_id", CONSOLIDATOR).expect("a valid ident");
        let mut e = Envelope::new(
            self.scope.tenant.clone(),
            self.scope.scope(),
            me.clone(),
            me,
            Layer::Semantic,
            kind,
            Content {
                text,
                data: Some(data),
            },
        );
        e.event_id = id;
        e.occurred_at = self.now;
        e.recorded_at = self.now;
        e.importance = importance.clamp(0.0, 1.0);
        e.causation_id = caused_by;
        e.correlation_id = Some(format!("consolidation/{}", self.scope.scope()));
        e
    }

    /// Whether the output `id` was already applied, so planning it again is pointless.
    pub(crate) fn done(&self, id: &EventId) -> bool {
        self.state.outputs.contains(id.as_str())
    }
}

/// One consolidation step.
pub trait Step: Sync {
    fn name(&self) -> &'static str;
    /// Appends this step's events for `ctx`'s scope to `out`, claiming what it uses.
    fn plan(&self, ctx: &mut Ctx<'_>, out: &mut Vec<Envelope>);
}

/// Every step, in the order a plan runs them: merging first, so that a summary and decay
/// see one memory per recurring one. Promotion reads episodes, not memories, so where it
/// runs matters only for the order of the plan's events.
pub static STEPS: &[&dyn Step] = &[&Dedup, &Summarise, &Promote, &Decay];

/// A scope's planned events, in order.
pub struct Plan {
    pub scope: ScopeKey,
    pub events: Vec<Envelope>,
}

/// Runs the steps named in `only` (all when empty) over `scope` of `memories`, with no
/// vector neighbours: dedup finds candidates by MinHash alone.
pub fn plan(memories: &Memories, scope: &ScopeKey, policy: &Policy, only: &[&str]) -> Plan {
    plan_with(memories, scope, policy, only, &[])
}

/// [`plan`], with the pairs of `scope`'s memories the vector model found close
/// ([`engram_memory::proto::NeighboursRequest`]) as further dedup candidates. The plan is a
/// function of the model and these pairs; pairs naming memories the model does not show
/// are ignored.
pub fn plan_with(
    memories: &Memories,
    scope: &ScopeKey,
    policy: &Policy,
    only: &[&str],
    neighbours: &[Neighbour],
) -> Plan {
    let mut events = Vec::new();
    if let Some(state) = memories.scope(scope)
        && let Some(now) = state.latest
    {
        let mut ctx = Ctx {
            scope,
            state,
            policy,
            now,
            claimed: BTreeSet::new(),
            neighbours,
        };
        for step in STEPS
            .iter()
            .filter(|s| only.is_empty() || only.contains(&s.name()))
        {
            step.plan(&mut ctx, &mut events);
        }
    }
    events.truncate(policy.max_events);
    Plan {
        scope: scope.clone(),
        events,
    }
}

/// Copies that bring hidden (archived or superseded) memories of `scope` back into default
/// retrieval: one `consolidated` event (`op: restored`) per id, with the memory's text and
/// importance, its decay clock restarted at the scope's clock. Ids that are not hidden
/// memories of the scope are left out.
pub fn restore(memories: &Memories, scope: &ScopeKey, ids: &[EventId]) -> Plan {
    let mut events = Vec::new();
    if let Some(state) = memories.scope(scope)
        && let Some(now) = state.latest
    {
        let ctx = Ctx {
            scope,
            state,
            policy: &Policy::default(),
            now,
            claimed: BTreeSet::new(),
            neighbours: &[],
        };
        let at = memories.applied_seq().unwrap_or(0).to_string();
        for id in ids {
            let Some(m) = state.memory(id.as_str()).filter(|m| m.hidden) else {
                continue;
            };
            // Derived from the memory and the sequence the restore was planned at: a retry
            // of this restore is stored once, a restore after a later archive is new.
            let out = EventId::derived(&["restored", id.as_str(), &at]);
            if ctx.done(&out) {
                continue;
            }
            events.push(ctx.output(
                out,
                EventKind::Consolidated,
                m.text.clone(),
                json!({"op": "restored", "sources": [id.as_str()], "recurrences": m.recurrences}),
                m.importance,
                Some(id.clone()),
            ));
        }
    }
    Plan {
        scope: scope.clone(),
        events,
    }
}

/// Near-duplicate memories become one. Candidates come from two places: a shared MinHash
/// band (one when the Jaccard similarity of their shingle sets reaches
/// [`Policy::dedup_similarity`]),
/// and the vector model's radius search ([`Ctx::neighbours`]: one when the words of one
/// hold the other's, see [`Policy::dedup_vector_similarity`]). The merged memory keeps
/// every source's id, counts the recurrences, gains importance per recurrence, and takes
/// the text of the member with the most distinct words (then the one that recurred most,
/// then the earliest), so a merge of a text into a fuller one loses nothing; the sources
/// are superseded (a `forgotten` event caused by it), not deleted.
pub struct Dedup;

impl Step for Dedup {
    fn name(&self) -> &'static str {
        "dedup"
    }

    fn plan(&self, ctx: &mut Ctx<'_>, out: &mut Vec<Envelope>) {
        let candidates: Vec<(u64, &crate::model::Memory)> = ctx
            .state
            .visible()
            .filter(|(_, m)| m.origin != Origin::Summary && m.signature.is_some())
            .map(|(seq, m)| (*seq, m))
            .collect();
        let index: BTreeMap<u64, usize> = candidates
            .iter()
            .enumerate()
            .map(|(i, (s, _))| (*s, i))
            .collect();
        let mut parent: Vec<usize> = (0..candidates.len()).collect();
        fn root(parent: &mut [usize], mut i: usize) -> usize {
            while parent[i] != i {
                parent[i] = parent[parent[i]];
                i = parent[i];
            }
            i
        }
        // Shingle sets of the candidates a band pairs, made when first compared: most
        // memories of a large scope share no band with any other.
        let mut shingles: Vec<Option<Vec<u64>>> = vec![None; candidates.len()];
        let mut buckets: BTreeMap<(usize, u64), Vec<u64>> = BTreeMap::new();
        for (seq, m) in &candidates {
            let sig = m.signature.expect("filtered above");
            for (band, key) in sig.bands().into_iter().enumerate() {
                buckets.entry((band, key)).or_default().push(*seq);
            }
        }
        for seqs in buckets.values() {
            for (i, a) in seqs.iter().enumerate() {
                // Each candidate is compared with the next few in its bucket, not all: a
                // scope flooded with one text makes a bucket of thousands, whose pairs would
                // be millions. Near-duplicates chain through their neighbours into one group.
                for b in seqs[i + 1..].iter().take(BUCKET_NEIGHBOURS) {
                    let (ia, ib) = (index[a], index[b]);
                    let (ra, rb) = (root(&mut parent, ia), root(&mut parent, ib));
                    if ra == rb {
                        // Already one group: nothing to learn from comparing them.
                        continue;
                    }
                    // The band only proposes; the shingle sets decide. A 32-hash estimate
                    // is off by 0.08 typically, enough to merge two short texts that differ
                    // in the one word that matters.
                    for i in [ia, ib] {
                        if shingles[i].is_none() {
                            shingles[i] = Some(crate::minhash::shingles(&candidates[i].1.text));
                        }
                    }
                    let set = |i: usize| shingles[i].as_deref().unwrap_or_default();
                    if crate::minhash::jaccard(set(ia), set(ib)) >= ctx.policy.dedup_similarity {
                        parent[ra.max(rb)] = ra.min(rb);
                    }
                }
            }
        }
        let by_id: std::collections::HashMap<&str, usize> = candidates
            .iter()
            .enumerate()
            .map(|(i, (_, m))| (m.event_id.as_str(), i))
            .collect();
        for pair in ctx.neighbours {
            if f64::from(pair.similarity) < ctx.policy.dedup_vector_similarity {
                continue;
            }
            let (Some(&ia), Some(&ib)) = (by_id.get(pair.a.as_str()), by_id.get(pair.b.as_str()))
            else {
                continue;
            };
            let (ra, rb) = (root(&mut parent, ia), root(&mut parent, ib));
            if ra != rb
                && words_contained(
                    &candidates[ia].1.text,
                    &candidates[ib].1.text,
                    ctx.policy.dedup_vector_words,
                )
            {
                parent[ra.max(rb)] = ra.min(rb);
            }
        }
        let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for i in 0..candidates.len() {
            let r = root(&mut parent, i);
            groups.entry(r).or_default().push(i);
        }
        for members in groups.into_values().filter(|g| g.len() > 1) {
            let members: Vec<&(u64, &crate::model::Memory)> = members
                .iter()
                .take(MAX_SOURCES)
                .map(|&i| &candidates[i])
                .collect();
            let ids: Vec<&str> = members.iter().map(|(_, m)| m.event_id.as_str()).collect();
            let mut parts = vec!["merged", ctx.scope.tenant.as_str()];
            let scope = ctx.scope.scope().to_string();
            parts.push(&scope);
            parts.extend(&ids);
            let merged_id = EventId::derived(&parts);
            if ctx.done(&merged_id) {
                continue;
            }
            let representative = members
                .iter()
                .map(|m| (distinct_words(&m.1.text), m))
                .max_by(|(wa, a), (wb, b)| {
                    wa.cmp(wb)
                        .then(a.1.recurrences.cmp(&b.1.recurrences))
                        .then(b.0.cmp(&a.0))
                })
                .map(|(_, m)| m)
                .expect("a group has members");
            let recurrences: u32 = members.iter().map(|(_, m)| m.recurrences).sum();
            let top = members
                .iter()
                .map(|(_, m)| m.importance)
                .fold(0.0, f64::max);
            let importance = top
                + ctx.policy.importance_per_recurrence * f64::from(recurrences.saturating_sub(1));
            out.push(ctx.output(
                merged_id.clone(),
                EventKind::Consolidated,
                representative.1.text.clone(),
                json!({"op": "merged", "sources": ids, "recurrences": recurrences}),
                importance,
                Some(representative.1.event_id.clone()),
            ));
            out.push(ctx.output(
                EventId::derived(&["superseded", merged_id.as_str()]),
                EventKind::Forgotten,
                format!(
                    "superseded by {merged_id}, which merges {} recurrences",
                    ids.len()
                ),
                json!({"event_ids": ids, "superseded_by": merged_id.as_str()}),
                0.5,
                Some(merged_id.clone()),
            ));
            for id in ids {
                ctx.claimed.insert(id.to_owned());
            }
        }
    }
}

fn distinct_words(text: &str) -> usize {
    crate::minhash::words(text)
        .into_iter()
        .collect::<BTreeSet<_>>()
        .len()
}

/// Whether the words of one text hold every word of the other, and the two share at least
/// `min_jaccard` of their words: a rewording or reordering that adds nothing, or a fuller
/// telling of the same thing.
pub fn words_contained(a: &str, b: &str, min_jaccard: f64) -> bool {
    let wa: BTreeSet<String> = crate::minhash::words(a).into_iter().collect();
    let wb: BTreeSet<String> = crate::minhash::words(b).into_iter().collect();
    if wa.is_empty() || wb.is_empty() {
        return false;
    }
    let shared = wa.intersection(&wb).count();
    let union = wa.len() + wb.len() - shared;
    (shared == wa.len() || shared == wb.len()) && shared as f64 / union as f64 >= min_jaccard
}

/// A finished session or task (a `checkpoint` with `"finished": true`) becomes a semantic
/// memory: the extractive summary of the scope's memories since the previous such
/// checkpoint. Its sources are kept; a summary adds to what retrieval can find, and
/// supersedes nothing.
pub struct Summarise;

impl Step for Summarise {
    fn name(&self) -> &'static str {
        "summarise"
    }

    fn plan(&self, ctx: &mut Ctx<'_>, out: &mut Vec<Envelope>) {
        let scope = ctx.scope.scope().to_string();
        let mut start = 0;
        for &finished in &ctx.state.finishes {
            let window = start..finished;
            start = finished;
            let id = EventId::derived(&[
                "summary",
                ctx.scope.tenant.as_str(),
                &scope,
                &finished.to_string(),
            ]);
            if ctx.done(&id) {
                continue;
            }
            let sources: Vec<&crate::model::Memory> = ctx
                .state
                .memories
                .range(window)
                .map(|(_, m)| m)
                .filter(|m| matches!(m.origin, Origin::Source | Origin::Merged) && !m.hidden)
                .take(MAX_SOURCES)
                .collect();
            let Some(text) = crate::summary::summarise(sources.iter().map(|m| m.text.as_str()))
            else {
                continue;
            };
            let ids: Vec<&str> = sources.iter().map(|m| m.event_id.as_str()).collect();
            let mut summary = ctx.output(
                id,
                EventKind::Consolidated,
                text,
                json!({"op": "summary", "sources": ids}),
                ctx.policy.summary_importance,
                sources.first().map(|m| m.event_id.clone()),
            );
            // Retrieval tells a summary from the memories it distils by this tag.
            summary.tags = vec![engram_memory::SUMMARY_TAG.to_owned()];
            // Dated when its session ended (its newest source), not when it was planned: a
            // question about when something happened finds the session's time, and the
            // summary decays from there like what it summarises.
            if let Some(end) = sources.iter().map(|m| m.occurred_at).max() {
                summary.occurred_at = end;
            }
            out.push(summary);
        }
    }
}

/// Importance decays by half every [`Policy::half_life_days`] since a memory was last
/// useful (written, recurred, or reported used); each reported use adds
/// [`Policy::reinforcement`] before decay. Below [`Policy::archive_below`] it is archived: a
/// `forgotten` event marked `"archived": true`, so it leaves default retrieval and stays in
/// the log.
pub struct Decay;

/// A memory's importance after reinforcement by `uses` reported uses (each adds
/// `policy.reinforcement`, up to 1) and decay since it was last useful, at `now`.
pub fn effective(memory: &crate::model::Memory, now: DateTime<Utc>, policy: &Policy) -> f64 {
    let reinforced = (memory.importance + policy.reinforcement * f64::from(memory.uses)).min(1.0);
    decayed(reinforced, memory.last_useful, now, policy.half_life_days)
}

/// A memory's importance after decay, at `now`.
pub fn decayed(
    importance: f64,
    last_useful: DateTime<Utc>,
    now: DateTime<Utc>,
    half_life_days: f64,
) -> f64 {
    let days = (now - last_useful).num_seconds().max(0) as f64 / 86_400.0;
    importance * 0.5f64.powf(days / half_life_days)
}

impl Step for Decay {
    fn name(&self) -> &'static str {
        "decay"
    }

    fn plan(&self, ctx: &mut Ctx<'_>, out: &mut Vec<Envelope>) {
        let archived: Vec<&str> = ctx
            .state
            .visible()
            .map(|(_, m)| m)
            .filter(|m| !ctx.claimed.contains(m.event_id.as_str()))
            .filter(|m| effective(m, ctx.now, ctx.policy) < ctx.policy.archive_below)
            .map(|m| m.event_id.as_str())
            .collect();
        for chunk in archived.chunks(MAX_SOURCES) {
            let scope = ctx.scope.scope().to_string();
            let mut parts = vec!["archived", ctx.scope.tenant.as_str(), &scope];
            parts.extend(chunk);
            let id = EventId::derived(&parts);
            if ctx.done(&id) {
                continue;
            }
            out.push(ctx.output(
                id,
                EventKind::Forgotten,
                format!(
                    "archived: importance decayed below {} (half-life {} days); restorable from the log",
                    ctx.policy.archive_below, ctx.policy.half_life_days
                ),
                json!({"event_ids": chunk, "archived": true}),
                0.5,
                None,
            ));
            for id in chunk {
                ctx.claimed.insert((*id).to_owned());
            }
        }
    }
}

//! Promoting skills: action sequences that keep recurring and mostly work become skills in
//! the registry, judged by the outcomes that ended them.
//!
//! The evidence is the scope's [`Episodes`](crate::model::Episodes): the actions of one
//! group up to the outcome that ends them. This step only reads it and plans
//! `skill_recorded` events; the skill registry counts them like any other record.

use std::collections::BTreeMap;

use engram_schema::payload::MAX_TEXT_CHARS;
use engram_schema::{Envelope, EventId, EventKind, Layer, ObservedOutcomes, SkillRecorded};

use crate::model::Episode;
use crate::steps::{Ctx, Step};

/// Fewest actions a promoted sequence has: a single action is something an agent does, not
/// a procedure to look up.
pub const MIN_STEPS: usize = 2;
/// Hex digits of the sequence's hash in a promoted skill's name.
pub const NAME_HASH_HEX: usize = 12;
/// Longest readable part of a promoted skill's name, in bytes (it is ASCII).
const MAX_SLUG_BYTES: usize = 48;

/// An action's text as a step of a sequence: lowercase, whitespace collapsed to single
/// spaces, every run of digits one `#`. "Open  file 12" and "open file 7" are one step;
/// what differs between runs of a procedure is mostly its numbers (ids, lines, counts).
pub fn normalise(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        let mut in_number = false;
        for c in word.chars() {
            if c.is_numeric() {
                if !in_number {
                    out.push('#');
                }
                in_number = true;
                continue;
            }
            in_number = false;
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// The name a promoted sequence is recorded under, from its key (its [`normalise`]d steps,
/// one per line): `promoted-<slug>-<hash>`, the slug the key's ASCII letters and digits in
/// runs joined by `-` (at most 48 bytes), the hash the first [`NAME_HASH_HEX`] hex digits
/// of blake3 of the key. The same sequence always gets the same name, so more evidence is a
/// new version of one skill rather than another skill.
pub fn skill_name(key: &str) -> String {
    let mut slug = String::new();
    for c in key.chars() {
        if slug.len() >= MAX_SLUG_BYTES {
            break;
        }
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let slug = slug.trim_end_matches('-');
    let hash = blake3::hash(key.as_bytes()).to_hex();
    let hash = &hash[..NAME_HASH_HEX];
    if slug.is_empty() {
        format!("promoted-{hash}")
    } else {
        format!("promoted-{slug}-{hash}")
    }
}

/// What the scope's episodes say about one normalised sequence.
struct Evidence<'a> {
    /// The normalised steps.
    steps: Vec<String>,
    occurrences: u32,
    successes: u32,
    /// The most recent episode of it: its original texts become the skill's steps, its
    /// outcome the record's cause.
    latest: &'a Episode,
}

impl Evidence<'_> {
    fn success_rate(&self) -> f64 {
        f64::from(self.successes) / f64::from(self.occurrences)
    }
}

/// An action sequence (normalised with [`normalise`], at least [`MIN_STEPS`] steps) that
/// ended at least [`Policy::promote_min_occurrences`](crate::Policy) of the scope's
/// episodes, with a success rate of at least `promote_min_success`, becomes a procedural
/// `skill_recorded` written by the consolidator:
/// - `name`: [`skill_name`] of the sequence; no `version`, so the registry gives each
///   record the next one, and more evidence later (another episode) is a new version;
/// - `description`: the episode counts and the normalised steps;
/// - `steps`: the original texts of the most recent episode;
/// - `observed`: its episodes' successes and failures, which the version starts with.
///
/// Provenance is the envelope's, not the payload's (which the append check holds to
/// `SkillRecorded`'s fields): `causation_id` is the most recent episode's outcome and
/// `correlation_id` is `consolidation/<scope>`; the episodes themselves are the scope's
/// action and outcome events in the log. The id is derived from tenant, scope, sequence and
/// the count's [`milestone`], so re-planning the same evidence gives the same event, once
/// applied it is planned no more, and a new version comes only when the evidence doubled.
pub struct Promote;

impl Step for Promote {
    fn name(&self) -> &'static str {
        "promote"
    }

    fn plan(&self, ctx: &mut Ctx<'_>, out: &mut Vec<Envelope>) {
        // Keyed by the normalised steps, one per line: a normalised step has no newline.
        let mut seen: BTreeMap<String, Evidence<'_>> = BTreeMap::new();
        for (_, episode) in ctx.state.episodes.ended() {
            if episode.actions.len() < MIN_STEPS {
                continue;
            }
            let steps: Vec<String> = episode.actions.iter().map(|a| normalise(a)).collect();
            let evidence = seen.entry(steps.join("\n")).or_insert_with(|| Evidence {
                steps,
                occurrences: 0,
                successes: 0,
                latest: episode,
            });
            evidence.occurrences += 1;
            evidence.successes += u32::from(episode.success);
            evidence.latest = episode;
        }
        let scope = ctx.scope.scope().to_string();
        for (key, evidence) in &seen {
            if evidence.occurrences < ctx.policy.promote_min_occurrences
                || evidence.success_rate() < ctx.policy.promote_min_success
            {
                continue;
            }
            let id = EventId::derived(&[
                "promoted",
                ctx.scope.tenant.as_str(),
                &scope,
                key,
                &milestone(evidence.occurrences, ctx.policy.promote_min_occurrences).to_string(),
            ]);
            if ctx.done(&id) {
                continue;
            }
            let failures = evidence.occurrences - evidence.successes;
            let description = bounded(format!(
                "Promoted from {} episodes ({} succeeded, {failures} failed): {}.",
                evidence.occurrences,
                evidence.successes,
                evidence.steps.join("; then "),
            ));
            let skill = SkillRecorded {
                name: skill_name(key),
                description: description.clone(),
                version: None,
                steps: Some(evidence.latest.actions.clone()),
                script: None,
                preconditions: None,
                observed: Some(ObservedOutcomes {
                    successes: evidence.successes,
                    failures,
                }),
            };
            let data = serde_json::to_value(&skill).expect("a skill record serialises");
            let mut event = ctx.output(
                id,
                EventKind::SkillRecorded,
                description,
                data,
                evidence.success_rate(),
                Some(evidence.latest.outcome.clone()),
            );
            // How to do something is procedural memory: the skill registry's, not a text
            // memory for the indexes (which take episodic and semantic text).
            event.layer = Layer::Procedural;
            out.push(event);
        }
    }
}

/// The evidence count a promotion is made at: the minimum, then each doubling of it (3, 6,
/// 12, ...). A hot sequence that ends an episode every minute gets a new version when its
/// evidence has doubled, not one per episode; the version made at a milestone carries every
/// count seen when it was planned.
pub fn milestone(occurrences: u32, min: u32) -> u32 {
    let mut m = min.max(1);
    while m.saturating_mul(2) <= occurrences && m < u32::MAX / 2 {
        m *= 2;
    }
    m
}

/// `text` cut to the payload's [`MAX_TEXT_CHARS`]: 32 steps of 256 bytes can be more, and
/// lowercasing can lengthen a text.
fn bounded(text: String) -> String {
    if text.chars().count() <= MAX_TEXT_CHARS {
        return text;
    }
    text.chars().take(MAX_TEXT_CHARS).collect()
}

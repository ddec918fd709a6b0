//! The skill registry: procedural memory, per scope. Which skills agents have recorded,
//! in which versions, how often each worked, and which fit a task.
//!
//! A pure in-memory read model, projected from `skill_recorded` and `outcome` events. It
//! does no I/O. The projector feeds it events in stream order with
//! [`SkillRegistry::apply`], snapshots it with rmp-serde (it is `Serialize + Deserialize`)
//! together with [`SkillRegistry::applied_seq`], and can check that a rebuild from seq 1
//! equals the incremental registry with [`SkillRegistry::state_hash`].
//!
//! # Layout
//! - `registry`: [`SkillRegistry`], applying events and the queries.
//! - `skill`: the rows: [`Skill`] and [`PendingOutcomes`].
//! - `payload`: reading event payloads through the contract's types before anything changes.
//! - `text`: the terms search matches on.
//!
//! What the skill registry shares with the fact table is [`engram_memory::model`]'s: the
//! applied seq and the rule that skips events at or below it, the snapshot shape, the
//! prologue of the state hash, [`Provenance`] and [`SkillError`].
//!
//! # Payloads (`content.data`)
//!
//! `skill_recorded`:
//!
//! | field | type | default | meaning |
//! |---|---|---|---|
//! | `name` | string, required | | the skill's name, unique per scope |
//! | `version` | whole number in 1..=4294967295 | one above the highest recorded, or 1 | |
//! | `description` | non-empty string, at most 4096 characters, required | | what the skill does; search depends on it |
//! | `steps` | at most 256 strings of at most 4096 characters | `[]` | how to do it |
//! | `script` | string of at most 65536 characters | none | a runnable form of it |
//! | `preconditions` | at most 256 strings of at most 4096 characters | `[]` | what must hold before using it |
//! | `observed` | `{"successes": n, "failures": m}`, at least one outcome | none | outcomes seen before it was recorded: the version starts with them |
//!
//! `outcome` (only these fields matter here; outcome events carry other things too):
//!
//! | field | type | default | meaning |
//! |---|---|---|---|
//! | `skill` | string | | the skill used; an outcome without it is not about a skill and is ignored |
//! | `success` | boolean, required with `skill` | | whether using it worked |
//! | `version` | whole number ≥ 1 | the latest version | the version used |
//!
//! Names and descriptions are trimmed; names must then be 1 to 256 characters. Nothing else
//! is normalised: case matters (`Deploy` and `deploy` are different skills). An explicit
//! `null` counts as an absent field; unknown fields are ignored, so that newer clients can
//! add some.
//!
//! These payloads are the event contract's [`engram_schema::SkillRecorded`] and
//! [`engram_schema::SkillOutcome`], and every append is checked against them, so one that
//! does not fit reaches the registry only by a raw publish or from before the contract. The
//! registry checks again: such an event is a [`SkillError`] naming the field, and the
//! registry stays unchanged.
//!
//! # Semantics
//!
//! - **Versions.** Every record is kept. The latest version, which [`SkillRegistry::get`]
//!   returns and search ranks, is the highest version number; a record whose version is
//!   lower than or equal to one already recorded stays in [`SkillRegistry::versions`] but
//!   does not replace it. Of records sharing a number, the first one holds it: outcomes
//!   count for it, and later ones are history.
//! - **Outcomes** add one success or failure to the version they name, or to the latest
//!   one, and move its `last_used` to the outcome's `occurred_at` if that is later. Counts
//!   belong to a version: a new version starts untried, or with the counts its record says
//!   were `observed` (the consolidator promotes recurring action sequences with the
//!   outcomes of their episodes). Observed counts carry no time, so `last_used` stays as
//!   the reported outcomes make it.
//! - **Outcomes before their skill.** Instances append independently, so an outcome can
//!   reach the stream before the skill it used. It is kept as pending
//!   ([`SkillRegistry::pending`]) rather than dropped or counted on a placeholder: an
//!   outcome naming a version joins that version when it is recorded; one naming no version
//!   joins the first version recorded under the name. The counts end up as if the skill had
//!   come first.
//! - **Ranking.** [`SkillRegistry::search`] multiplies lexical relevance by a mild factor
//!   from the Laplace-smoothed success rate ([`Skill::success_rate`]); see there.
//!
//! Scopes never mix: a [`ScopeKey`](engram_memory::ScopeKey) matches only itself, so
//! `team-a` sees nothing of `team-ab` nor of another tenant's `team-a`, and pending
//! outcomes of one scope never join another's skill.
//!
//! Cost: search computes IDF over the latest skills of the scopes it is given, so it is
//! linear in their number and text.

mod payload;
mod registry;
mod skill;
mod text;

/// Why an event could not be applied: a payload the contract refuses. A failed apply leaves
/// the registry exactly as it was.
pub use engram_memory::model::PayloadRefused as SkillError;
pub use engram_memory::model::Provenance;
pub use engram_schema::payload::MAX_NAME_CHARS;
pub use registry::{Applied, SkillRegistry};
pub use skill::{PendingOutcomes, Skill, Usage};

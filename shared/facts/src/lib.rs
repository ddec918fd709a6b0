//! The bi-temporal fact table: semantic memory as subject–predicate–object facts, per scope.
//!
//! A pure in-memory read model, projected from `fact_asserted` and `fact_retracted` events.
//! It does no I/O. The projector feeds it events in stream order with
//! [`FactTable::apply`], snapshots it with rmp-serde (it is `Serialize + Deserialize`)
//! together with [`FactTable::applied_seq`], and can check that a rebuild from seq 1 equals
//! the incremental table with [`FactTable::state_hash`].
//!
//! # Layout
//! - `table`: [`FactTable`], applying events and the queries.
//! - `fact`: the rows: [`Fact`] and its [`Source`]s.
//! - `group`: the versions of one subject's predicate: where validity ends, who supersedes whom.
//! - `payload`: reading event payloads through the contract's types before anything changes.
//!
//! What the fact table shares with the skill registry is [`engram_memory::model`]'s: the
//! applied seq and the rule that skips events at or below it, the snapshot shape, the
//! prologue of the state hash, [`Provenance`] and [`FactError`].
//!
//! # Payloads (`content.data`)
//!
//! `fact_asserted`:
//!
//! | field | type | default | meaning |
//! |---|---|---|---|
//! | `subject` | string, required | | who or what the fact is about |
//! | `predicate` | string, required | | the property or relation |
//! | `object` | any JSON but `null`, required | | the value |
//! | `valid_from` | RFC 3339 string | the event's `occurred_at` | when it became true in the world |
//! | `valid_to` | RFC 3339 string | open-ended | when it stopped being true; must be after `valid_from` |
//! | `confidence` | number in 0..=1 | 1.0 | how sure the asserting agent is |
//! | `cardinality` | `"single"` or `"multi"` | `"single"` | whether the subject has one value of the predicate at a time |
//!
//! `fact_retracted`: `subject` and `predicate` as above, and optionally `object` (any JSON);
//! without it, every object of that subject's predicate is retracted.
//!
//! Subjects and predicates are trimmed and must then be 1 to 256 characters; an object nests
//! at most 32 levels deep. Nothing else is normalised: case matters (`Alice` and `alice` are
//! different subjects), and objects compare by JSON equality (`1` and `1.0` differ). An
//! explicit `null` counts as an absent field; unknown fields are ignored, so that newer
//! clients can add some.
//!
//! These payloads are the event contract's [`engram_schema::FactAsserted`] and
//! [`engram_schema::FactRetracted`], and every append is checked against them, so one that
//! does not fit reaches the table only by a raw publish or from before the contract. The
//! table checks again: such an event is a [`FactError`] naming the field, and the table
//! stays unchanged.
//!
//! # Semantics
//!
//! Each fact has two time axes:
//! - **valid time**, `[valid_from, valid_to)`: when it is true in the world, as the agents
//!   say (defaulting to when the asserting event occurred);
//! - **transaction time**, `[recorded_at, retracted_at)`: when Engram believed it, by the
//!   events' `recorded_at`.
//!
//! A fact is the set of its assertions ([`Source`]s). Valid time only ever shrinks through
//! new knowledge, and a retraction only ends transaction time; nothing is deleted.
//!
//! - **Merge.** An assertion with the same scope, subject, predicate and object as a
//!   believed fact, whose validity overlaps what is left of that fact's (or equals what one
//!   of its sources asserted), joins it: one fact, one more source. The fact's confidence is
//!   the *maximum* of its sources', not noisy-or: agents repeating one another are not
//!   independent witnesses, and noisy-or would let repetition alone reach certainty.
//!   Merging is decided when the assertion is applied, in stream order.
//! - **Supersession.** Assertions compete by (`occurred_at`, seq): the latest said wins,
//!   ties go to the higher seq. A single-valued assertion ends the validity of every
//!   assertion of another object said before it at its own `valid_from`: the earlier one's
//!   `valid_until` becomes `min(valid_to, later.valid_from)`. So when an older assertion
//!   arrives late it stays in history but does not become current; its validity ends where
//!   the later one's begins, and if it fell between two others it cuts the earlier one in
//!   turn. The result does not depend on arrival order. If the later assertion's
//!   `valid_from` is at or before the earlier one's, the earlier one is overridden entirely
//!   (its `valid_to` is at or before its `valid_from`). `superseded_by` names the fact
//!   holding the first such later assertion.
//! - **Multi-valued.** A `"multi"` assertion ends nothing: values accumulate. A later
//!   `"single"` assertion of another object still ends them, as it ends any earlier value.
//! - **Retraction** means "we were wrong", not "it stopped being true": it sets
//!   `retracted_at` to the retraction's `recorded_at` on every believed fact of that subject
//!   and predicate (and object, if given), leaving valid time alone. Validity is then
//!   recomputed without the retracted facts, so retracting the value that superseded another
//!   makes the other current again. To say a fact stopped being true, assert a new value, or
//!   assert it with a `valid_to`. A retraction acts on what is believed when it is applied;
//!   one that matches nothing is recorded as retracting nothing and is not kept for later.
//! - **As of.** [`FactTable::as_of`] answers "what was valid at `valid_at`, as Engram
//!   believed at `known_at`": it recomputes the timeline from the assertions recorded by
//!   `known_at`, leaving out facts retracted by then. [`FactTable::current`] is `as_of`
//!   the wall clock's now with the latest knowledge; it is the only place a clock is read,
//!   and [`FactTable::apply`] never reads one.
//!
//! Scopes never mix: a [`ScopeKey`](engram_memory::ScopeKey) matches only itself, so
//! `team-a` sees nothing of `team-ab` nor of another tenant's `team-a`.
//!
//! Cost: applying an assertion or retraction recomputes its subject's predicate in one
//! linear pass over its n assertions, so a predicate with thousands of versions or a fact
//! re-asserted thousands of times makes each further assertion of it proportionally slower.
//! `as_of` with a `known_at` makes the same pass per matching predicate; `search` scans the
//! current facts of the scopes it is given.

mod fact;
mod group;
mod payload;
mod table;
mod text;

/// Why an event could not be applied: a payload the contract refuses. A failed apply leaves
/// the table exactly as it was.
pub use engram_memory::model::PayloadRefused as FactError;
pub use engram_memory::model::Provenance;
pub use engram_schema::Cardinality;
pub use engram_schema::payload::MAX_TERM_CHARS;
pub use fact::{Fact, FactId, Source};
pub use table::{Applied, FactTable};

//! Consolidation: memory that is deduplicated, distilled and decayed over time, with every
//! output an event on the stream.
//!
//! # Layout
//! - [`model`]: the consolidator's read model ([`Memories`]): per scope, the text memories
//!   with a MinHash signature, importance, recurrences and when they were last useful,
//!   which ones are hidden (superseded, archived or forgotten), and whether the scope's
//!   session or task has finished.
//! - [`minhash`]: signatures over word shingles, and the banding that finds candidates.
//! - [`steps`]: the consolidation steps, in one list ([`STEPS`]): [`steps::Dedup`],
//!   [`steps::Summarise`], [`steps::Decay`]. A step reads one scope's state and plans
//!   events; it never writes.
//! - [`summary`]: the deterministic extractive summariser.
//!
//! # Why it is auditable and replayable
//! A plan is a function of the model at one sequence, and its events carry ids derived from
//! their inputs ([`engram_schema::EventId::derived`]) and times taken from the scope's
//! own events, never from a clock. The same stream gives byte-identical outputs on every
//! replica; an output appended twice is stored once (the stream deduplicates by id), and
//! once applied the model knows it and plans it no more. Every output names its sources
//! (`content.data.sources`, `causation_id`), so the log says why each memory exists.

pub mod minhash;
pub mod model;
pub mod steps;
pub mod summary;

pub use model::{Memories, Memory, ScopeState};
pub use steps::{Plan, Policy, STEPS, Step, plan, restore};

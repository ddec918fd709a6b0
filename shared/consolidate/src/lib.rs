//! Consolidation: memory that is deduplicated, distilled and decayed over time, with every
//! output an event on the stream.
//!
//! # Layout
//! - [`model`]: the consolidator's read model ([`Memories`]): per scope, the text memories
//!   with a MinHash signature, importance, recurrences and when they were last useful,
//!   which ones are hidden (superseded, archived or forgotten), whether the scope's
//!   session or task has finished, and its episodes (actions up to the outcome that ends
//!   them).
//! - [`minhash`]: signatures over word shingles, and the banding that finds candidates.
//! - [`steps`]: the consolidation steps, in one list ([`STEPS`]): [`steps::Dedup`],
//!   [`steps::Summarise`], [`promote::Promote`], [`steps::Decay`]. A step reads one scope's
//!   state and plans events; it never writes.
//! - [`promote`]: recurring, mostly successful action sequences become skills.
//! - [`summary`]: the deterministic extractive summariser.
//! - [`summariser`]: the pluggable [`Summariser`]: the extractive one (default) or any
//!   OpenAI-compatible chat endpoint, which also proposes candidate facts.
//! - [`refine`](mod@refine): the async post-pass after a plan that has the summariser write
//!   its session summaries and appends candidate `fact_asserted` events.
//!
//! # Why it is auditable and replayable
//! A plan is a function of the model at one sequence (and of the pairs the vector model
//! offered dedup, which are exact below its scan threshold), and its events carry ids derived from
//! their inputs ([`engram_schema::EventId::derived`]) and times taken from the scope's
//! own events, never from a clock. The same stream gives byte-identical outputs on every
//! replica; an output appended twice is stored once (the stream deduplicates by id), and
//! once applied the model knows it and plans it no more. Every output names its sources
//! (`content.data.sources`, `causation_id`), so the log says why each memory exists; a
//! promoted skill names the latest outcome it was judged by (`causation_id`).

pub mod minhash;
pub mod model;
pub mod promote;
pub mod refine;
pub mod steps;
pub mod summariser;
pub mod summary;

pub use model::{Memories, Memory, ScopeState};
pub use refine::{RefineOptions, Unrefined, refine};
pub use steps::{Plan, Policy, STEPS, Step, plan, plan_with, restore};
pub use summariser::{Summariser, SummariserConfig, SummariserError};

//! The pure parts of the LoCoMo retrieval benchmark: reading the dataset, and scoring what a
//! retriever returns. Nothing here talks to NATS or embeds text; the benchmark binary ingests
//! [`Turn::memory_text`] through the real system, one scope per [`Conversation`], and feeds
//! each answer back to an [`Evaluator`].
//!
//! The protocol (see `bench/README.md` next to the data): ingest every turn as one episodic
//! memory dated by its session; ask every question of categories 1 to 4 that has evidence;
//! report turn- and session-level recall at k = 5, 10, 20, overall and per category.
//!
//! # Layout
//! - [`dia_id`]: [`DiaId`] (`D3:14`) and the repair of malformed evidence ids.
//! - [`dataset`]: the data model and [`Dataset::load`]. Derived annotations (observations,
//!   summaries) are never read, so they cannot be indexed by mistake.
//! - [`eval`]: recall@k, latency percentiles, and the [`Report`] (JSON and a text table).
//! - [`error`]: [`LocomoError`], naming the file and what in it is wrong.
//!
//! # Evidence that names no turn
//! Evidence ids are normalised first (`D:11:26` is D11:26, `D30:05` is D30:5, `D8:6; D9:17`
//! is two ids). Ids that still name no turn are dropped from [`Question::evidence`] and kept
//! in [`Dataset::unmatched_evidence`]: counting a turn no retriever can return would lower
//! every retriever's recall alike and hide real differences. A scored question left with no
//! evidence is not asked, and is counted in [`DatasetCounts::questions_skipped_no_evidence`].

pub mod dataset;
pub mod dia_id;
pub mod error;
pub mod eval;
pub mod locate;

pub use dataset::{
    Conversation, Dataset, DatasetCounts, Question, Session, Turn, Unmatched, UnmatchedEvidence,
    category_name, parse_session_date,
};
pub use dia_id::{DiaId, DiaIdError};
pub use error::{LocomoError, Problem};
pub use eval::{
    CategoryReport, DEFAULT_KS, Evaluator, GroupReport, LatencyMs, ModeReport, Report,
    session_recall, turn_recall,
};

//! Why a dataset could not be loaded. Every error names the file; data errors also name the
//! conversation, so a bad annotation can be found and fixed by hand.

use std::io;
use std::path::PathBuf;

use crate::dia_id::DiaIdError;

#[derive(Debug, thiserror::Error)]
pub enum LocomoError {
    #[error("cannot read locomo dataset {}: {source}; check the path", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "locomo dataset {} is not locomo json at `{at}`: {source}; expected a list of \
         {{sample_id, conversation, qa}} objects as in snap-research/LoCoMo data/locomo10.json",
        path.display()
    )]
    Json {
        path: PathBuf,
        /// Where in the document the problem is, e.g. `[2].qa[14].category`.
        at: String,
        #[source]
        source: serde_json::Error,
    },

    #[error("locomo dataset {}: conversation {sample_id}: {problem}", path.display())]
    Invalid {
        path: PathBuf,
        sample_id: String,
        problem: Problem,
    },
}

/// Well-formed JSON that still cannot be a LoCoMo conversation.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("sample_id appears more than once; each conversation needs its own id")]
    DuplicateConversation,

    #[error("session_{session} has no session_{session}_date_time; add its date")]
    MissingSessionDate { session: u32 },

    #[error(
        "session_{session}_date_time {raw:?} is not a date like \"1:56 pm on 8 May, 2023\" \
         ({reason}); fix the date"
    )]
    BadSessionDate {
        session: u32,
        raw: String,
        reason: chrono::ParseError,
    },

    #[error("turn {position} of session_{session} has a bad dia_id: {source}")]
    BadTurnId {
        session: u32,
        /// Zero-based position of the turn in its session's list.
        position: usize,
        #[source]
        source: DiaIdError,
    },

    #[error("turn {dia_id} is listed under session_{session}; its dia_id must name that session")]
    TurnOutsideSession { session: u32, dia_id: String },

    #[error("dia_id {dia_id} names more than one turn; dia_ids must be unique")]
    DuplicateTurn { dia_id: String },

    #[error("question {question} has category {category}; expected 1 to 5")]
    BadCategory { question: usize, category: u8 },

    #[error("question {question} has an answer that is neither text nor a number")]
    BadAnswer { question: usize },
}

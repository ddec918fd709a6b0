//! The document types Engram ships. Each is a plain Rust type read with autosurgeon's
//! `hydrate` and written with `reconcile`, so concurrent edits to different fields merge, and
//! concurrent edits to one field stay visible as a conflict.
//!
//! Collections that many instances add to are maps keyed by an id the writer picks (a task
//! id, a question id), not lists: two instances adding "t-7" and "t-8" at once both land,
//! and editing one item never rewrites another.

use std::collections::BTreeMap;

use autosurgeon::{Hydrate, Reconcile};

use crate::local::{LocalDoc, LocalDocError};
use serde::{Deserialize, Serialize};

/// A typed shared document: the `doc_type` it is stored under.
pub trait DocType: Reconcile + Hydrate + Default + Clone {
    const TYPE: &'static str;
}

/// The built-in document types, by name.
pub const BUILTIN: &[&str] = &[TaskBoard::TYPE, Profile::TYPE, Scratchpad::TYPE];

/// A new document of the built-in type named `doc_type` ([`LocalDoc::genesis`]); `None` for
/// a type of the user's own.
pub fn genesis_of(doc_type: &str) -> Result<Option<LocalDoc>, LocalDocError> {
    Ok(Some(match doc_type {
        TaskBoard::TYPE => LocalDoc::genesis::<TaskBoard>()?,
        Profile::TYPE => LocalDoc::genesis::<Profile>()?,
        Scratchpad::TYPE => LocalDoc::genesis::<Scratchpad>()?,
        _ => return Ok(None),
    }))
}

/// Checks that a document of the built-in type named `doc_type` still reads as that type
/// (an untyped edit could have written a number where a status goes); any document of a
/// user's own type passes.
pub fn check_reads_as(doc_type: &str, doc: &LocalDoc) -> Result<(), LocalDocError> {
    match doc_type {
        TaskBoard::TYPE => doc.value::<TaskBoard>().map(drop),
        Profile::TYPE => doc.value::<Profile>().map(drop),
        Scratchpad::TYPE => doc.value::<Scratchpad>().map(drop),
        _ => Ok(()),
    }
}

/// A team's task board: items with an owner, a status and notes.
#[derive(Clone, Debug, Default, PartialEq, Reconcile, Hydrate, Serialize, Deserialize)]
pub struct TaskBoard {
    /// Items by id.
    #[autosurgeon(missing = "Default::default")]
    pub items: BTreeMap<String, TaskItem>,
}

impl DocType for TaskBoard {
    const TYPE: &'static str = "task_board";
}

#[derive(Clone, Debug, Default, PartialEq, Reconcile, Hydrate, Serialize, Deserialize)]
pub struct TaskItem {
    #[autosurgeon(missing = "Default::default")]
    pub title: String,
    /// The instance or agent working on it.
    #[autosurgeon(missing = "Default::default")]
    pub owner: Option<String>,
    #[autosurgeon(missing = "Default::default")]
    pub status: TaskStatus,
    /// Notes in the order they were added; concurrent additions are all kept.
    #[autosurgeon(missing = "Default::default")]
    pub notes: Vec<String>,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Reconcile, Hydrate, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    #[default]
    #[autosurgeon(rename = "todo")]
    Todo,
    #[autosurgeon(rename = "doing")]
    Doing,
    #[autosurgeon(rename = "blocked")]
    Blocked,
    #[autosurgeon(rename = "done")]
    Done,
}

impl TaskStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Todo => "todo",
            Self::Doing => "doing",
            Self::Blocked => "blocked",
            Self::Done => "done",
        }
    }
}

/// Preferences and settings of a user or a team.
#[derive(Clone, Debug, Default, PartialEq, Reconcile, Hydrate, Serialize, Deserialize)]
pub struct Profile {
    #[autosurgeon(missing = "Default::default")]
    pub preferences: BTreeMap<String, String>,
    #[autosurgeon(missing = "Default::default")]
    pub settings: BTreeMap<String, String>,
}

impl DocType for Profile {
    const TYPE: &'static str = "profile";
}

/// Decisions taken and questions still open, by id.
#[derive(Clone, Debug, Default, PartialEq, Reconcile, Hydrate, Serialize, Deserialize)]
pub struct Scratchpad {
    #[autosurgeon(missing = "Default::default")]
    pub decisions: BTreeMap<String, Decision>,
    #[autosurgeon(missing = "Default::default")]
    pub questions: BTreeMap<String, Question>,
}

impl DocType for Scratchpad {
    const TYPE: &'static str = "scratchpad";
}

#[derive(Clone, Debug, Default, PartialEq, Reconcile, Hydrate, Serialize, Deserialize)]
pub struct Decision {
    #[autosurgeon(missing = "Default::default")]
    pub text: String,
    #[autosurgeon(missing = "Default::default")]
    pub rationale: Option<String>,
    #[autosurgeon(missing = "Default::default")]
    pub by: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Reconcile, Hydrate, Serialize, Deserialize)]
pub struct Question {
    #[autosurgeon(missing = "Default::default")]
    pub text: String,
    /// Set once answered; an open question has none.
    #[autosurgeon(missing = "Default::default")]
    pub answer: Option<String>,
}

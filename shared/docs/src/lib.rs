//! Shared documents: per-scope automerge documents that many agent instances edit at once.
//!
//! # Layout
//! - [`types`]: the typed documents Engram ships (task board, profile, scratchpad), read and
//!   written through autosurgeon. Users define their own the same way: any type that is
//!   `Reconcile + Hydrate` and names its [`DocType::TYPE`].
//! - [`local`]: a writer's copy ([`LocalDoc`]): forked from the heads it last saw, edited
//!   offline as long as it likes, and turned into `doc_changed` payloads of what the stream
//!   has not seen.
//! - [`store`]: the read model ([`DocStore`]): applies `doc_changed` events in stream order.
//!   Every reader at the same sequence holds the same change set, hence the same state.
//! - [`view`]: a document as JSON, with every conflicting value kept ([`Conflict`]).
//!
//! # Why automerge, and how its costs are kept small
//! Documents keep their whole history and every transaction is costly, so a document is one
//! entity of one scope (a board, a profile), never a scope's whole state; a writer batches an
//! edit into one transaction and a push into one event; the store persists documents
//! compacted (`save`), which is a fraction of the incremental changes it received.

pub mod local;
pub mod store;
pub mod types;
pub mod view;

pub use automerge;
pub use autosurgeon;
pub use local::{LocalDoc, LocalDocError};
pub use store::{DocEntry, DocError, DocStore, HistoryEntry};
pub use types::{
    Decision, DocType, Profile, Question, Scratchpad, TaskBoard, TaskItem, TaskStatus,
};
pub use view::{Conflict, DocView, MAX_VIEW_DEPTH};

use engram_schema::Ident;
use serde::{Deserialize, Serialize};

/// Which document of a scope: its type and name. The scope itself always comes from the
/// event's subject and envelope, never from the payload.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DocId {
    pub doc_type: Ident,
    pub name: Ident,
}

impl std::fmt::Display for DocId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.doc_type, self.name)
    }
}

/// Hex of a change hash, as events and views carry it.
pub fn hex(hash: &automerge::ChangeHash) -> String {
    hash.to_string()
}

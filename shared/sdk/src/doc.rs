//! Shared documents from an agent's side: open a writer's copy, edit it (offline as long as
//! needed), push what the stream has not seen, and refresh from what others pushed.
//!
//! ```no_run
//! # async fn demo(agent: engram_sdk::Agent) -> Result<(), Box<dyn std::error::Error>> {
//! use engram_sdk::doc::{TaskBoard, TaskItem};
//! use engram_sdk::{Scope, ScopeKind};
//! let team = Scope::new(ScopeKind::Team, "core")?;
//! let mut board = agent.open_doc::<TaskBoard>(team, "sprint-12", None).await?;
//! board.edit(|b| {
//!     b.items.insert("t-7".into(), TaskItem { title: "fix login".into(), ..Default::default() });
//! })?;
//! let receipt = board.push().await?; // its seq is the read-your-writes token
//! for conflict in board.conflicts() {
//!     println!("{} holds {:?}", conflict.path, conflict.values);
//! }
//! # Ok(()) }
//! ```

use std::marker::PhantomData;

use base64::Engine as _;
use engram_bus::{AppendError, AppendReceipt};
pub use engram_docs::{
    Conflict, Decision, DocType, DocView, LocalDoc, LocalDocError, Profile, Question, Scratchpad,
    TaskBoard, TaskItem, TaskStatus,
};
use engram_memory::proto::{Consistency, DocRead, DocRequest, DocResponse, ScopeRequest};
use engram_rpc::RpcError;
use engram_schema::{EventKind, Ident, Layer, SchemaError, Scope};
use thiserror::Error;

use crate::Agent;

/// Most bytes of encoded changes in one `doc_changed` event: half the smallest event limit
/// a deployment may set, so envelope and base64 overhead always fit; a longer push goes in
/// several events.
pub const MAX_PUSH_BYTES: usize = 192 * 1024;

#[derive(Debug, Error)]
pub enum DocClientError {
    #[error(transparent)]
    Rpc(#[from] RpcError),
    #[error(transparent)]
    Append(#[from] AppendError),
    /// Boxed: automerge's errors are large, and every edit returns this type.
    #[error(transparent)]
    Local(Box<LocalDocError>),
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("the document service's reply is unusable: {0}")]
    BadReply(String),
}

impl From<LocalDocError> for DocClientError {
    fn from(e: LocalDocError) -> Self {
        Self::Local(Box::new(e))
    }
}

/// Most paths one [`Agent::edit_doc`] sets and deletes.
pub const MAX_EDIT_PATHS: usize = 256;

/// What [`Agent::edit_doc`] did.
#[derive(Debug)]
pub struct DocEdit {
    /// The push's last receipt: its seq is the read-your-writes token.
    pub receipt: AppendReceipt,
    /// The document as the writer's copy holds it after the edit.
    pub view: DocView,
    /// Fields written concurrently, every value kept.
    pub conflicts: Vec<Conflict>,
}

#[derive(Debug, Error)]
pub enum DocEditError {
    #[error("nothing to edit: give at least one path to set or delete")]
    Nothing,
    #[error("{paths} paths in one edit; at most {MAX_EDIT_PATHS}")]
    TooMany { paths: usize },
    #[error(
        "after this edit the document no longer reads as a {doc_type} ({reason}); nothing was sent"
    )]
    NotItsType { doc_type: String, reason: String },
    #[error("the edit changed nothing (every value was already there)")]
    Unchanged,
    #[error(transparent)]
    Client(#[from] DocClientError),
}

impl From<LocalDocError> for DocEditError {
    fn from(e: LocalDocError) -> Self {
        Self::Client(e.into())
    }
}

/// A writer's copy of one shared document, of any type: what [`SharedDoc`] is made of, and
/// what tools that edit documents generically (`engram doc edit`) use.
pub struct DocHandle {
    agent: Agent,
    scope: Scope,
    doc_type: Ident,
    name: Ident,
    local: LocalDoc,
    /// The seq of the last push, or of the state it was refreshed from: the token that makes
    /// the next refresh see at least that much.
    seen_seq: u64,
}

impl std::fmt::Debug for DocHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocHandle")
            .field("scope", &self.scope)
            .field("doc_type", &self.doc_type)
            .field("name", &self.name)
            .field("seen_seq", &self.seen_seq)
            .finish()
    }
}

/// A writer's copy of one shared document of type `T`.
pub struct SharedDoc<T> {
    handle: DocHandle,
    _type: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for SharedDoc<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

impl Agent {
    /// Opens a writer's copy of the document `name` of type `T` in `scope` (of this agent's
    /// tenant): the state the stream holds once `min_seq` is visible, or `T`'s genesis when
    /// the document does not exist yet.
    pub async fn open_doc<T: DocType>(
        &self,
        scope: Scope,
        name: &str,
        min_seq: Option<u64>,
    ) -> Result<SharedDoc<T>, DocClientError> {
        let handle = self
            .open_handle(scope, T::TYPE, name, LocalDoc::genesis::<T>()?, min_seq)
            .await?;
        Ok(SharedDoc {
            handle,
            _type: PhantomData,
        })
    }

    /// Opens a writer's copy of a document of any type. A new document starts as its
    /// built-in type's genesis, or empty for a type of the user's own.
    pub async fn open_raw_doc(
        &self,
        scope: Scope,
        doc_type: &str,
        name: &str,
        min_seq: Option<u64>,
    ) -> Result<DocHandle, DocClientError> {
        let start = engram_docs::types::genesis_of(doc_type)?.unwrap_or_default();
        self.open_handle(scope, doc_type, name, start, min_seq)
            .await
    }

    async fn open_handle(
        &self,
        scope: Scope,
        doc_type: &str,
        name: &str,
        local: LocalDoc,
        min_seq: Option<u64>,
    ) -> Result<DocHandle, DocClientError> {
        let mut handle = DocHandle {
            agent: self.clone(),
            scope,
            doc_type: Ident::parse("doc_type", doc_type)?,
            name: Ident::parse("name", name)?,
            local,
            seen_seq: min_seq.unwrap_or(0),
        };
        handle.refresh().await?;
        Ok(handle)
    }

    /// Edits a document of any type by JSON-pointer paths and pushes the edit: the generic
    /// writer behind `engram doc edit`, `POST /v1/docs/edit` and the MCP `task_board` tool.
    /// Each value is redacted by the tenant's policy before the change is made (a secret put
    /// and overwritten in one transaction would still be in the change's bytes). A built-in
    /// type must still read as itself afterwards, or nothing is sent.
    pub async fn edit_doc(
        &self,
        scope: Scope,
        doc_type: &str,
        name: &str,
        min_seq: Option<u64>,
        sets: &[(String, serde_json::Value)],
        deletes: &[String],
    ) -> Result<DocEdit, DocEditError> {
        if sets.is_empty() && deletes.is_empty() {
            return Err(DocEditError::Nothing);
        }
        if sets.len() + deletes.len() > MAX_EDIT_PATHS {
            return Err(DocEditError::TooMany {
                paths: sets.len() + deletes.len(),
            });
        }
        let mut handle = self.open_raw_doc(scope, doc_type, name, min_seq).await?;
        let client = self.client().clone();
        let local = handle.local();
        for (path, value) in sets {
            let mut value = value.clone();
            client.scrub_value(self.tenant().as_str(), &mut value);
            local.set_path(path, &value).map_err(DocClientError::from)?;
        }
        for path in deletes {
            local.delete_path(path).map_err(DocClientError::from)?;
        }
        engram_docs::types::check_reads_as(doc_type, local).map_err(|e| {
            DocEditError::NotItsType {
                doc_type: doc_type.to_owned(),
                reason: e.to_string(),
            }
        })?;
        let conflicts = handle.conflicts();
        let receipt = handle.push().await?.ok_or(DocEditError::Unchanged)?;
        Ok(DocEdit {
            receipt,
            view: handle.view(),
            conflicts,
        })
    }

    /// A document's state, history or the list of a scope's documents (read only).
    pub async fn read_doc(&self, request: &DocRequest) -> Result<DocResponse, RpcError> {
        self.client().doc(request).await
    }
}

impl DocHandle {
    /// Fields written concurrently, every value kept (the one the view shows first).
    pub fn conflicts(&self) -> Vec<Conflict> {
        self.local.conflicts()
    }

    /// The document as this copy holds it, as JSON with its conflicts.
    pub fn view(&self) -> DocView {
        self.local.view()
    }

    /// Changes not pushed yet.
    pub fn unsent(&mut self) -> usize {
        self.local.unsent()
    }

    /// The automerge copy itself.
    pub fn local(&mut self) -> &mut LocalDoc {
        &mut self.local
    }

    /// The stream sequence this copy has seen at least.
    pub fn seen_seq(&self) -> u64 {
        self.seen_seq
    }

    /// This copy's heads, hex, sorted: equal to the service's `DocSummary::heads` when it
    /// holds exactly what the service does.
    pub fn heads(&mut self) -> Vec<String> {
        let mut heads: Vec<String> = self.local.heads().iter().map(engram_docs::hex).collect();
        heads.sort();
        heads
    }

    /// Sends every change the stream has not seen, in as many events as it takes, each
    /// acknowledged before the next. Returns the last receipt (`None` when nothing was
    /// unsent). A failure leaves what was not acknowledged unsent, for the next push.
    pub async fn push(&mut self) -> Result<Option<AppendReceipt>, DocClientError> {
        let outgoing =
            self.local
                .outgoing(self.doc_type.as_str(), self.name.as_str(), MAX_PUSH_BYTES)?;
        let mut last = None;
        for out in outgoing {
            let text = format!(
                "{} change(s) to {}/{}",
                out.changes, self.doc_type, self.name
            );
            let receipt = self
                .agent
                .event(
                    self.scope.clone(),
                    Layer::Working,
                    EventKind::DocChanged,
                    text,
                )
                .data(out.data)
                .append()
                .await?;
            self.local.mark_sent(&out.synced_after);
            self.seen_seq = self.seen_seq.max(receipt.seq);
            last = Some(receipt);
        }
        Ok(last)
    }

    /// Merges what the stream holds (at least up to this copy's last push) into this copy.
    pub async fn refresh(&mut self) -> Result<(), DocClientError> {
        let request = DocRequest {
            scopes: ScopeRequest {
                tenant: self.agent.tenant().clone(),
                scope: self.scope.clone(),
                grants: Vec::new(),
            },
            read: DocRead::State,
            doc_type: Some(self.doc_type.clone()),
            name: Some(self.name.clone()),
            include_bytes: true,
            include_values: false,
            limit: 1,
            consistency: Consistency {
                min_seq: (self.seen_seq > 0).then_some(self.seen_seq),
                wait_ms: None,
            },
        };
        let response = self.agent.read_doc(&request).await?;
        self.seen_seq = self.seen_seq.max(response.visible_seq);
        if let Some(bytes) = response.bytes {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(bytes)
                .map_err(|e| DocClientError::BadReply(format!("document bytes: {e}")))?;
            self.local.merge_remote(&bytes)?;
        }
        Ok(())
    }
}

impl<T: DocType> SharedDoc<T> {
    /// The document as this copy holds it: the stream's state as last refreshed, plus local
    /// edits.
    pub fn value(&self) -> Result<T, DocClientError> {
        Ok(self.handle.local.value()?)
    }

    /// One edit, as one automerge transaction. Nothing is sent until [`SharedDoc::push`].
    /// Secrets in the strings it writes are redacted by the tenant's policy before the
    /// change is made, as an event's text is before it is appended.
    pub fn edit(&mut self, edit: impl FnOnce(&mut T)) -> Result<(), DocClientError> {
        let client = self.handle.agent.client().clone();
        let tenant = self.handle.agent.tenant().as_str().to_owned();
        let scrubber = client.scrubbers().for_tenant(&tenant);
        // The kinds found, by string: `edit_redacted` may look at one string twice.
        let found = std::cell::RefCell::new(std::collections::BTreeMap::new());
        self.handle.local.edit_redacted(edit, |s| {
            let out = scrubber.scrub(s);
            if out.is_clean() {
                return None;
            }
            let kinds: Vec<_> = out.redactions.iter().map(|r| r.kind).collect();
            found.borrow_mut().insert(s.to_owned(), kinds);
            Some(out.text.into_owned())
        })?;
        for kind in found.into_inner().into_values().flatten() {
            engram_telemetry::metrics::SCRUB_REDACTIONS
                .with_label_values(&[kind.as_str(), "sdk"])
                .inc();
        }
        Ok(())
    }

    /// Fields written concurrently, every value kept (the one `value` shows first).
    pub fn conflicts(&self) -> Vec<Conflict> {
        self.handle.conflicts()
    }

    /// Changes not pushed yet.
    pub fn unsent(&mut self) -> usize {
        self.handle.unsent()
    }

    /// See [`DocHandle::push`].
    pub async fn push(&mut self) -> Result<Option<AppendReceipt>, DocClientError> {
        self.handle.push().await
    }

    /// See [`DocHandle::refresh`].
    pub async fn refresh(&mut self) -> Result<(), DocClientError> {
        self.handle.refresh().await
    }

    pub fn seen_seq(&self) -> u64 {
        self.handle.seen_seq
    }

    /// See [`DocHandle::heads`].
    pub fn heads(&mut self) -> Vec<String> {
        self.handle.heads()
    }

    /// The untyped handle.
    pub fn handle(&mut self) -> &mut DocHandle {
        &mut self.handle
    }
}

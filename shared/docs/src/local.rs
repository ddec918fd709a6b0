//! A writer's copy of a shared document.
//!
//! An instance loads the document as the stream last showed it (or starts from nothing),
//! edits it locally, as often and as long offline as it likes, and pushes what the stream
//! has not seen as `doc_changed` payloads. Each edit is one automerge transaction: a
//! transaction is costly, and one per field would multiply the history.
//!
//! What the stream holds is tracked as a set of heads (`synced`): the changes to send are
//! automerge's `get_changes(synced)`, in causal order, cut into payloads that each fit an
//! event. A payload marked sent moves `synced` past exactly its changes, so a push that fails
//! halfway resends only the rest, and a resend of anything is harmless (the store applies a
//! change once).

use std::collections::HashSet;

use automerge::{AutoCommit, Change, ChangeHash, ReadDoc};
use base64::Engine as _;
use engram_schema::payload::{MAX_DOC_CHANGES, MAX_DOC_HEADS};
use serde_json::json;
use thiserror::Error;

use crate::hex;
use crate::types::DocType;
use crate::view::{Conflict, DocView};

#[derive(Debug, Error)]
pub enum LocalDocError {
    // Boxed, as the other automerge and autosurgeon errors here: they are large, and every
    // edit returns this type.
    #[error("the document bytes do not load: {0}")]
    Load(#[source] Box<automerge::AutomergeError>),
    #[error("the document does not read as {doc_type}: {source}")]
    Hydrate {
        doc_type: &'static str,
        // Boxed: the hydrate error is large, and every edit returns this type.
        #[source]
        source: Box<autosurgeon::HydrateError>,
    },
    #[error("the edit could not be written: {0}")]
    Reconcile(#[source] Box<autosurgeon::ReconcileError>),
    #[error(
        "one edit is {bytes} bytes encoded, more than an event carries ({max}); make it in smaller steps"
    )]
    ChangeTooLarge { bytes: usize, max: usize },
    #[error("path {path:?}: {reason}")]
    Path { path: String, reason: String },
    #[error("automerge refused the edit: {0}")]
    Edit(#[source] Box<automerge::AutomergeError>),
}

impl From<autosurgeon::ReconcileError> for LocalDocError {
    fn from(e: autosurgeon::ReconcileError) -> Self {
        Self::Reconcile(Box::new(e))
    }
}

fn load_err(e: automerge::AutomergeError) -> LocalDocError {
    LocalDocError::Load(Box::new(e))
}

fn edit_err(e: automerge::AutomergeError) -> LocalDocError {
    LocalDocError::Edit(Box::new(e))
}

/// Puts `redact`'s version of every string of `doc` that has one (map values, list items and
/// text objects); returns how many. An explicit stack, not recursion: a document merged from
/// others may nest as deep as they made it.
fn redact_strings(
    doc: &mut AutoCommit,
    redact: &impl Fn(&str) -> Option<String>,
) -> Result<usize, LocalDocError> {
    use automerge::transaction::Transactable;
    use automerge::{ObjType, Prop, ScalarValue, Value};
    let mut redacted = 0;
    let mut stack = vec![automerge::ROOT];
    while let Some(obj) = stack.pop() {
        let Some(kind) = doc.object_type(&obj).ok() else {
            continue;
        };
        let props: Vec<Prop> = match kind {
            ObjType::Map | ObjType::Table => doc.keys(&obj).map(Prop::from).collect(),
            ObjType::List => (0..doc.length(&obj)).map(Prop::from).collect(),
            ObjType::Text => {
                let text = doc.text(&obj).map_err(edit_err)?;
                if let Some(clean) = redact(&text) {
                    doc.update_text(&obj, &clean).map_err(edit_err)?;
                    redacted += 1;
                }
                continue;
            }
        };
        for prop in props {
            match doc.get(&obj, prop.clone()).map_err(edit_err)? {
                Some((Value::Object(_), child)) => stack.push(child),
                Some((Value::Scalar(v), _)) => {
                    if let ScalarValue::Str(s) = v.as_ref()
                        && let Some(clean) = redact(s)
                    {
                        doc.put(&obj, prop, clean).map_err(edit_err)?;
                        redacted += 1;
                    }
                }
                None => {}
            }
        }
    }
    Ok(redacted)
}

/// Deepest JSON value [`LocalDoc::set_path`] writes.
pub const MAX_SET_DEPTH: usize = 32;

/// One payload to append, and the heads the stream holds once it is stored.
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// `content.data` of a `doc_changed` event.
    pub data: serde_json::Value,
    pub changes: usize,
    /// Pass to [`LocalDoc::mark_sent`] once the event is acknowledged.
    pub synced_after: Vec<ChangeHash>,
}

/// A writer's local copy of one document.
pub struct LocalDoc {
    doc: AutoCommit,
    synced: Vec<ChangeHash>,
}

impl std::fmt::Debug for LocalDoc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalDoc")
            .field("synced", &self.synced.len())
            .finish()
    }
}

impl Default for LocalDoc {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalDoc {
    /// An empty document, with a fresh random actor: two writers (or two runs of one) never
    /// share an actor, which automerge requires. For a type of the user's own, create its
    /// top-level collections the way [`LocalDoc::genesis`] does, or two writers that start
    /// at once each create their own and one set hides the other.
    pub fn new() -> Self {
        Self {
            doc: AutoCommit::new(),
            synced: Vec::new(),
        }
    }

    /// A new document of type `T`, starting from `T`'s genesis: `T::default()` written by
    /// a fixed actor at time 0, so that every writer makes the byte-identical first change.
    /// Two instances that create the same board at once then share its `items` map instead
    /// of each making one (of which automerge would show only the winner's).
    pub fn genesis<T: DocType>() -> Result<Self, LocalDocError> {
        let mut doc = AutoCommit::new().with_actor(automerge::ActorId::from(
            format!("engram-genesis/{}", T::TYPE).as_bytes(),
        ));
        autosurgeon::reconcile(&mut doc, T::default())?;
        doc.commit_with(automerge::transaction::CommitOptions::default().with_time(0));
        doc.set_actor(automerge::ActorId::random());
        Ok(Self {
            doc,
            synced: Vec::new(),
        })
    }

    /// The document as the stream holds it (a store's compacted save); all of it counts as
    /// sent.
    pub fn load(bytes: &[u8]) -> Result<Self, LocalDocError> {
        let mut doc = AutoCommit::load(bytes).map_err(load_err)?;
        doc.set_actor(automerge::ActorId::random());
        let synced = doc.get_heads();
        Ok(Self { doc, synced })
    }

    /// Merges the stream's current state (a store's save) into this copy: others' changes
    /// appear, local unsent ones stay unsent.
    pub fn merge_remote(&mut self, bytes: &[u8]) -> Result<(), LocalDocError> {
        let mut remote = AutoCommit::load(bytes).map_err(load_err)?;
        let remote_heads = remote.get_heads();
        self.doc.merge(&mut remote).map_err(load_err)?;
        self.synced = union_heads(&mut self.doc, &self.synced, &remote_heads).map_err(load_err)?;
        Ok(())
    }

    /// The document read as `T`; an empty document reads as `T::default()`.
    pub fn value<T: DocType>(&self) -> Result<T, LocalDocError> {
        if self.doc.length(automerge::ROOT) == 0 {
            return Ok(T::default());
        }
        autosurgeon::hydrate(&self.doc).map_err(|source| LocalDocError::Hydrate {
            doc_type: T::TYPE,
            source: Box::new(source),
        })
    }

    /// Edits the document as `T` in one transaction: read, change, write back what changed.
    pub fn edit<T: DocType>(&mut self, edit: impl FnOnce(&mut T)) -> Result<(), LocalDocError> {
        let mut value = self.value::<T>()?;
        edit(&mut value);
        autosurgeon::reconcile(&mut self.doc, &value)?;
        self.doc.commit();
        Ok(())
    }

    /// [`LocalDoc::edit`], with every string the edit writes checked by `redact` (the string
    /// with its secrets redacted, or `None` when it has none). When one needs it, the edit is
    /// made again from the state before it with the strings redacted, so the change never
    /// holds the secret: overwriting it within the transaction would not remove it from the
    /// change's bytes. Returns how many strings were redacted.
    pub fn edit_redacted<T: DocType>(
        &mut self,
        edit: impl FnOnce(&mut T),
        redact: impl Fn(&str) -> Option<String>,
    ) -> Result<usize, LocalDocError> {
        use automerge::ScalarValue;
        use automerge::legacy::OpType;
        let before = self.doc.get_heads();
        self.edit(edit)?;
        if self.doc.get_heads() == before {
            return Ok(0);
        }
        let Some(change) = self.doc.get_last_local_change() else {
            return Ok(0);
        };
        let dirty = change.decode().operations.iter().any(
            |op| matches!(&op.action, OpType::Put(ScalarValue::Str(s)) if redact(s).is_some()),
        );
        if !dirty {
            return Ok(0);
        }
        // The state with the secrets, redacted in place, is read back as the edited value;
        // then it is discarded for the state before the edit, and the value written there.
        let redacted = redact_strings(&mut self.doc, &redact)?;
        self.doc.commit();
        let value: T = self.value()?;
        let mut redo = self.doc.fork_at(&before).map_err(edit_err)?;
        // A fork gets an actor of its own; the copy keeps writing as the one it was.
        redo.set_actor(self.doc.get_actor().clone());
        autosurgeon::reconcile(&mut redo, &value)?;
        redo.commit();
        self.doc = redo;
        Ok(redacted)
    }

    /// Sets the value at a JSON-pointer `path` (`/items/t-7/status`), creating the maps on
    /// the way, as one transaction: what generic tools (`engram doc edit --set`) write with.
    /// In a list, a token is an index, or `-` to append.
    pub fn set_path(&mut self, path: &str, value: &serde_json::Value) -> Result<(), LocalDocError> {
        let (parent, last) = self.walk(path, true)?;
        put_json(&mut self.doc, &parent, last, value, path, 0)?;
        self.doc.commit();
        Ok(())
    }

    /// Deletes the field or list item at a JSON-pointer `path`, as one transaction.
    pub fn delete_path(&mut self, path: &str) -> Result<(), LocalDocError> {
        use automerge::transaction::Transactable;
        let (parent, last) = self.walk(path, false)?;
        let prop = self.prop(&parent, &last, path, false)?;
        self.doc.delete(&parent, prop).map_err(edit_err)?;
        self.doc.commit();
        Ok(())
    }

    /// The object holding the last token of `path`, and that token; with `create`, missing
    /// maps on the way are made.
    fn walk(
        &mut self,
        path: &str,
        create: bool,
    ) -> Result<(automerge::ObjId, String), LocalDocError> {
        use automerge::transaction::Transactable;
        let bad = |reason: &str| LocalDocError::Path {
            path: path.to_owned(),
            reason: reason.to_owned(),
        };
        let Some(rest) = path.strip_prefix('/') else {
            return Err(bad(
                "a path starts with / (a JSON pointer such as /items/t-7/status)",
            ));
        };
        let mut tokens: Vec<String> = rest
            .split('/')
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect();
        if tokens.len() > MAX_SET_DEPTH {
            return Err(bad("deeper than 32 levels"));
        }
        let last = tokens
            .pop()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| bad("it names no field"))?;
        let mut obj = automerge::ROOT;
        for token in tokens {
            let prop = self.prop(&obj, &token, path, false)?;
            obj = match self.doc.get(&obj, prop.clone()).map_err(edit_err)? {
                Some((automerge::Value::Object(_), id)) => id,
                Some(_) => return Err(bad(&format!("{token:?} holds a value, not a map or list"))),
                None if create => match prop {
                    automerge::Prop::Map(key) => self
                        .doc
                        .put_object(&obj, key, automerge::ObjType::Map)
                        .map_err(edit_err)?,
                    automerge::Prop::Seq(_) => return Err(bad(&format!("no item {token}"))),
                },
                None => return Err(bad(&format!("no field {token:?}"))),
            };
        }
        Ok((obj, last))
    }

    /// A token as a map key or a list index (`-` is one past the end when `append` is set).
    fn prop(
        &self,
        obj: &automerge::ObjId,
        token: &str,
        path: &str,
        append: bool,
    ) -> Result<automerge::Prop, LocalDocError> {
        match self.doc.object_type(obj) {
            Ok(automerge::ObjType::List) => {
                let len = self.doc.length(obj);
                let index = if append && token == "-" {
                    len
                } else {
                    token
                        .parse::<usize>()
                        .ok()
                        .filter(|i| *i < len)
                        .ok_or_else(|| LocalDocError::Path {
                            path: path.to_owned(),
                            reason: format!("{token:?} is not an index of this {len}-item list"),
                        })?
                };
                Ok(automerge::Prop::Seq(index))
            }
            _ => Ok(automerge::Prop::Map(token.to_owned())),
        }
    }

    /// The automerge document itself, for types of the user's own. Commit once per edit.
    pub fn raw(&mut self) -> &mut AutoCommit {
        &mut self.doc
    }

    pub fn view(&self) -> DocView {
        DocView::of(&self.doc)
    }

    /// Fields holding concurrent values, every value kept.
    pub fn conflicts(&self) -> Vec<Conflict> {
        self.view().conflicts
    }

    pub fn heads(&mut self) -> Vec<ChangeHash> {
        self.doc.get_heads()
    }

    /// Changes the stream has not been sent.
    pub fn unsent(&mut self) -> usize {
        self.doc.get_changes(&self.synced).len()
    }

    /// What the stream has not seen, as `doc_changed` payloads of at most `max_bytes` of
    /// encoded changes and [`MAX_DOC_CHANGES`] changes each, in causal order.
    pub fn outgoing(
        &mut self,
        doc_type: &str,
        name: &str,
        max_bytes: usize,
    ) -> Result<Vec<Outgoing>, LocalDocError> {
        let changes: Vec<Change> = self.doc.get_changes(&self.synced);
        let mut out = Vec::new();
        let mut synced = self.synced.clone();
        let mut batch: Vec<(String, Change)> = Vec::new();
        let mut bytes = 0;
        let flush = |batch: &mut Vec<(String, Change)>, synced: &mut Vec<ChangeHash>| {
            let chunk: Vec<Change> = batch.iter().map(|(_, c)| c.clone()).collect();
            *synced = advance(synced, &chunk);
            let heads: Vec<String> = if synced.len() <= MAX_DOC_HEADS {
                synced.iter().map(hex).collect()
            } else {
                Vec::new()
            };
            let encoded: Vec<String> = batch.drain(..).map(|(e, _)| e).collect();
            Outgoing {
                data: json!({
                    "doc_type": doc_type,
                    "name": name,
                    "changes": encoded,
                    "heads": heads,
                }),
                changes: chunk.len(),
                synced_after: synced.clone(),
            }
        };
        for change in changes {
            let encoded = base64::engine::general_purpose::STANDARD.encode(change.raw_bytes());
            if encoded.len() > max_bytes {
                return Err(LocalDocError::ChangeTooLarge {
                    bytes: encoded.len(),
                    max: max_bytes,
                });
            }
            if !batch.is_empty()
                && (bytes + encoded.len() > max_bytes || batch.len() == MAX_DOC_CHANGES)
            {
                out.push(flush(&mut batch, &mut synced));
                bytes = 0;
            }
            bytes += encoded.len();
            batch.push((encoded, change));
        }
        if !batch.is_empty() {
            out.push(flush(&mut batch, &mut synced));
        }
        Ok(out)
    }

    /// Records that an [`Outgoing`] payload is stored.
    pub fn mark_sent(&mut self, synced_after: &[ChangeHash]) {
        self.synced = synced_after.to_vec();
    }
}

/// Writes `value` at `last` of `parent`: maps and lists as new objects, filled in.
fn put_json(
    doc: &mut AutoCommit,
    parent: &automerge::ObjId,
    last: String,
    value: &serde_json::Value,
    path: &str,
    depth: usize,
) -> Result<(), LocalDocError> {
    use automerge::transaction::Transactable;
    use serde_json::Value as J;
    if depth > MAX_SET_DEPTH {
        return Err(LocalDocError::Path {
            path: path.to_owned(),
            reason: "the value nests deeper than 32 levels".into(),
        });
    }
    let is_list = matches!(doc.object_type(parent), Ok(automerge::ObjType::List));
    let index = if is_list {
        let len = doc.length(parent);
        Some(if last == "-" {
            len
        } else {
            last.parse::<usize>()
                .ok()
                .filter(|i| *i <= len)
                .ok_or_else(|| LocalDocError::Path {
                    path: path.to_owned(),
                    reason: format!("{last:?} is not an index of this {len}-item list, nor -"),
                })?
        })
    } else {
        None
    };
    let made = match value {
        J::Object(_) | J::Array(_) => {
            let kind = if value.is_object() {
                automerge::ObjType::Map
            } else {
                automerge::ObjType::List
            };
            Some(
                match index {
                    Some(i) if i == doc.length(parent) => doc.insert_object(parent, i, kind),
                    Some(i) => doc.put_object(parent, i, kind),
                    None => doc.put_object(parent, last.as_str(), kind),
                }
                .map_err(edit_err)?,
            )
        }
        scalar => {
            let scalar = match scalar {
                J::Null => automerge::ScalarValue::Null,
                J::Bool(b) => automerge::ScalarValue::Boolean(*b),
                J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                    (Some(i), _, _) => automerge::ScalarValue::Int(i),
                    (None, Some(u), _) => automerge::ScalarValue::Uint(u),
                    (_, _, f) => automerge::ScalarValue::F64(f.unwrap_or(0.0)),
                },
                J::String(s) => automerge::ScalarValue::Str(s.as_str().into()),
                J::Object(_) | J::Array(_) => unreachable!("matched above"),
            };
            match index {
                Some(i) if i == doc.length(parent) => doc.insert(parent, i, scalar),
                Some(i) => doc.put(parent, i, scalar),
                None => doc.put(parent, last.as_str(), scalar),
            }
            .map_err(edit_err)?;
            None
        }
    };
    if let Some(obj) = made {
        match value {
            J::Object(map) => {
                for (key, child) in map {
                    put_json(doc, &obj, key.clone(), child, path, depth + 1)?;
                }
            }
            J::Array(items) => {
                for child in items {
                    put_json(doc, &obj, "-".into(), child, path, depth + 1)?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The heads of `synced` plus a causally closed `chunk` after it: the chunk's changes no
/// later change of the chunk depends on, and the old heads none of the chunk depends on.
fn advance(synced: &[ChangeHash], chunk: &[Change]) -> Vec<ChangeHash> {
    let depended: HashSet<ChangeHash> = chunk.iter().flat_map(|c| c.deps().to_vec()).collect();
    let mut heads: Vec<ChangeHash> = synced
        .iter()
        .chain(chunk.iter().map(|c| c.hash()).collect::<Vec<_>>().iter())
        .filter(|h| !depended.contains(h))
        .copied()
        .collect();
    heads.sort();
    heads.dedup();
    heads
}

/// The heads of the union of what `a` and `b` name, both held by `doc`: a fork at all of
/// them holds exactly their ancestors, and its heads are the union's.
fn union_heads(
    doc: &mut AutoCommit,
    a: &[ChangeHash],
    b: &[ChangeHash],
) -> Result<Vec<ChangeHash>, automerge::AutomergeError> {
    let all: Vec<ChangeHash> = a.iter().chain(b).copied().collect();
    Ok(doc.fork_at(&all)?.get_heads())
}

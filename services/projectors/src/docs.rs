//! The shared-document projector: the document store behind `engram.p.docs.get`.
//!
//! It is the consolidator's merge step: automerge changes from every instance, applied in
//! stream order, so that every replica at the same sequence serves the same documents.

use base64::Engine as _;
use engram_docs::{DocEntry, DocId, DocStore};
use engram_memory::proto::{DocRead, DocRequest, DocResponse, DocSummary, ErrorCode, limits};
use engram_memory::{ScopeKey, Seq};
use engram_projection_runtime::model::SnapshotProjection;
use engram_rpc::Failure;

pub const NAME: &str = engram_memory::proto::read_models::DOCS;

pub type DocsProjection = SnapshotProjection<DocStore>;

/// The docs projection kept in `dir`. It is the one model that applies document changes, so
/// its projector is the one that decodes them (once per event: the secret check and the
/// store share that decode, and the store parses them uncompressed); every other projector
/// leaves them alone, since decoding inflates compressed changes.
pub fn projection(dir: &std::path::Path) -> DocsProjection {
    DocsProjection::new(NAME, dir).applying_doc_changes()
}

fn summary(scope: &ScopeKey, id: &DocId, entry: &DocEntry, with_value: bool) -> DocSummary {
    DocSummary {
        scope: scope.scope(),
        doc_type: id.doc_type.clone(),
        name: id.name.clone(),
        heads: entry.heads(),
        changes: entry.changes(),
        events: entry.events(),
        held: entry.held(),
        last_seq: entry.last_seq(),
        bytes: entry.saved().len(),
        value: with_value.then(|| entry.view().value),
    }
}

/// Answers a doc request: one document of the own scope, its history, or the documents of
/// every readable scope.
pub fn query(
    projection: &DocsProjection,
    request: &DocRequest,
    visible_seq: Seq,
) -> Result<DocResponse, Failure> {
    let scopes = request.scopes.resolve().map_err(Failure::invalid)?;
    let store = projection.read();
    let mut response = DocResponse {
        doc: None,
        conflicts: Vec::new(),
        truncated: false,
        bytes: None,
        history: Vec::new(),
        docs: Vec::new(),
        visible_seq,
    };
    if request.read == DocRead::List {
        for scope in &scopes {
            for (id, entry) in store.list(scope, request.doc_type.as_ref()) {
                if response.docs.len() == request.limit {
                    return Ok(response);
                }
                response
                    .docs
                    .push(summary(scope, id, entry, request.include_values));
            }
        }
        return Ok(response);
    }
    let (Some(doc_type), Some(name)) = (&request.doc_type, &request.name) else {
        return Err(Failure::invalid("give the document's doc_type and name"));
    };
    let own = &scopes[0];
    let id = DocId {
        doc_type: doc_type.clone(),
        name: name.clone(),
    };
    let Some(entry) = store.get(own, &id) else {
        return Ok(response);
    };
    match request.read {
        DocRead::State => {
            let view = entry.view();
            response.conflicts = view.conflicts;
            response.truncated = view.truncated;
            let mut doc = summary(own, &id, entry, false);
            doc.value = Some(view.value);
            if request.include_bytes {
                let saved = entry.saved();
                if saved.len() > limits::MAX_DOC_BYTES {
                    return Err(Failure::new(
                        ErrorCode::Invalid,
                        format!(
                            "document {id} is {} bytes compacted, more than a reply carries ({}); read it without include_bytes, and shard it (one document per sprint or entity) to keep editing",
                            saved.len(),
                            limits::MAX_DOC_BYTES
                        ),
                    ));
                }
                response.bytes = Some(base64::engine::general_purpose::STANDARD.encode(saved));
            }
            response.doc = Some(doc);
        }
        DocRead::History => {
            let kept: Vec<_> = entry.history().collect();
            let skip = kept.len().saturating_sub(request.limit);
            response.history = kept.into_iter().skip(skip).cloned().collect();
            response.doc = Some(summary(own, &id, entry, false));
        }
        DocRead::List => unreachable!("answered above"),
    }
    Ok(response)
}

/// The shared-document read model, as the registry runs it.
pub struct DocsModel;

#[async_trait::async_trait]
impl crate::ReadModel for DocsModel {
    const NAME: &'static str = NAME;
    const ENDPOINT: (&'static str, &'static str) =
        (engram_memory::proto::read_models::GET_OP, "docs");
    type Projection = DocsProjection;
    type Request = DocRequest;
    type Response = DocResponse;

    fn slice(snapshot: &[u8], keep: &[engram_memory::ScopeKey]) -> Result<Option<Vec<u8>>, String> {
        crate::registry::slice_of::<DocStore>(snapshot, keep, NAME)
    }

    async fn open(
        _config: &crate::ProjectorsConfig,
        dir: &std::path::Path,
        _shared: &crate::Shared,
    ) -> Result<std::sync::Arc<DocsProjection>, crate::StartError> {
        Ok(std::sync::Arc::new(projection(dir)))
    }

    async fn answer(
        projection: std::sync::Arc<DocsProjection>,
        request: DocRequest,
        visible: Seq,
    ) -> Result<DocResponse, Failure> {
        crate::off_runtime(move || query(&projection, &request, visible)).await
    }
}

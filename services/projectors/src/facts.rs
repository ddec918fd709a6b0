//! The fact projector: the bi-temporal fact table behind `engram.p.facts.query`.

use engram_facts::FactTable;
use engram_memory::Seq;
use engram_memory::proto::{FactsRequest, FactsResponse};
use engram_projection_runtime::model::SnapshotProjection;
use engram_rpc::Failure;

pub const NAME: &str = engram_memory::proto::read_models::FACTS;

pub type FactsProjection = SnapshotProjection<FactTable>;

/// Answers a facts query over already-resolved scopes.
pub fn query(
    projection: &FactsProjection,
    request: &FactsRequest,
    visible_seq: Seq,
) -> Result<FactsResponse, Failure> {
    let scopes = request.scopes.resolve().map_err(Failure::invalid)?;
    let table = projection.read();
    let mut facts = Vec::new();
    for scope in &scopes {
        if request.history {
            let (Some(subject), Some(predicate)) = (&request.subject, &request.predicate) else {
                return Err(Failure::invalid("history needs both subject and predicate"));
            };
            facts.extend(table.history(scope, subject, predicate));
        } else if let Some(text) = &request.text {
            facts.extend(
                table
                    .search(std::slice::from_ref(scope), text, request.limit)
                    .into_iter()
                    .map(|(f, _)| f),
            );
        } else {
            let valid_at = request.valid_at.unwrap_or_else(chrono::Utc::now);
            facts.extend(table.as_of(
                scope,
                valid_at,
                request.known_at,
                request.subject.as_deref(),
                request.predicate.as_deref(),
            ));
        }
    }
    facts.truncate(request.limit);
    let facts = facts
        .into_iter()
        .map(|f| {
            serde_json::to_value(f)
                .map_err(|e| Failure::new(engram_memory::proto::ErrorCode::Internal, e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    Ok(FactsResponse { facts, visible_seq })
}

/// The fact read model, as the registry runs it.
pub struct FactsModel;

#[async_trait::async_trait]
impl crate::ReadModel for FactsModel {
    const NAME: &'static str = NAME;
    const ENDPOINT: (&'static str, &'static str) =
        (engram_memory::proto::read_models::QUERY_OP, "facts");
    type Projection = FactsProjection;
    type Request = FactsRequest;
    type Response = FactsResponse;

    fn slice(snapshot: &[u8], keep: &[engram_memory::ScopeKey]) -> Result<Option<Vec<u8>>, String> {
        crate::registry::slice_of::<engram_facts::FactTable>(snapshot, keep, NAME)
    }

    async fn open(
        _config: &crate::ProjectorsConfig,
        dir: &std::path::Path,
        _shared: &crate::Shared,
    ) -> Result<std::sync::Arc<FactsProjection>, crate::StartError> {
        Ok(std::sync::Arc::new(FactsProjection::new(NAME, dir)))
    }

    async fn answer(
        projection: std::sync::Arc<FactsProjection>,
        request: FactsRequest,
        visible: Seq,
    ) -> Result<FactsResponse, Failure> {
        crate::off_runtime(move || query(&projection, &request, visible)).await
    }
}

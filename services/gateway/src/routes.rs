//! The `/v1` handlers. Each takes the caller from its API key, fills the tenant it leaves
//! out, refuses one naming another, and answers through the SDK, so an HTTP request gets the
//! same checks, bounds and errors as the NATS path.

use std::sync::Arc;

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use engram_memory::proto;
use serde::de::DeserializeOwned;

use crate::{ApiError, Caller, Gateway};

/// Most events one append request carries.
pub const MAX_BATCH: usize = 1_000;

type Result<T> = std::result::Result<Json<T>, ApiError>;

pub(crate) fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/v1/events", post(append))
        .route("/v1/retrieve", post(retrieve))
        .route("/v1/context", post(context))
        .route("/v1/facts", post(facts))
        .route("/v1/skills", post(skills))
        .route("/v1/docs", post(docs))
        .route("/v1/replay", post(replay))
        .route("/v1/working", post(working))
        .route("/openapi.json", get(openapi))
}

/// The body, or why not: too large is 413, as the limit layer decided.
fn body(body: std::result::Result<Bytes, BytesRejection>) -> std::result::Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                "the request body exceeds the gateway's limit (gateway.max_body_bytes); send fewer events per request",
            )
        } else {
            ApiError::invalid(r.body_text())
        }
    })
}

/// `bytes` as JSON with the caller's tenant filled in where it is left out; a tenant that
/// is not the caller's is refused here, before anything is asked.
fn with_tenant(caller: &Caller, bytes: &[u8]) -> std::result::Result<serde_json::Value, ApiError> {
    let mut value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not JSON: {e}")))?;
    fill(caller, &mut value)?;
    Ok(value)
}

fn fill(caller: &Caller, value: &mut serde_json::Value) -> std::result::Result<(), ApiError> {
    let Some(object) = value.as_object_mut() else {
        return Err(ApiError::invalid("the body must be a JSON object"));
    };
    let tenant = caller.tenant().as_str();
    match object.get("tenant").and_then(|t| t.as_str()) {
        None => {
            object.insert("tenant".into(), tenant.into());
        }
        Some(t) if t == tenant => {}
        Some(t) => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("this API key is of tenant {tenant}; the request names tenant {t}"),
            ));
        }
    }
    Ok(())
}

fn decode<T: DeserializeOwned>(value: serde_json::Value) -> std::result::Result<T, ApiError> {
    serde_json::from_value(value)
        .map_err(|e| ApiError::invalid(format!("request does not decode: {e}")))
}

/// A request of one of the query paths, decoded for the caller.
async fn request<T: DeserializeOwned>(
    gateway: &Gateway,
    headers: &HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<(Caller, T), ApiError> {
    let caller = gateway.caller(headers).await?;
    let bytes = body(raw)?;
    let value = with_tenant(&caller, &bytes)?;
    Ok((caller, decode(value)?))
}

#[derive(serde::Serialize, schemars::JsonSchema)]
pub struct Appended {
    /// One per event, in order: its receipt or why it was not stored.
    pub results: Vec<AppendResult>,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
pub struct AppendResult {
    pub event_id: String,
    /// The stream sequence: pass it as `min_seq` to read this write.
    pub seq: Option<u64>,
    pub duplicate: bool,
    pub error: Option<ErrorBody>,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}

/// `POST /v1/events`: one event or an array of at most 1000. Every event is checked before
/// any is sent; one bad event and none is appended. `tenant` and `agent_id` default to the
/// key's, and an event naming another tenant or agent is refused: the key says who writes.
async fn append(
    State(gateway): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Appended> {
    let caller = gateway.caller(&headers).await?;
    let bytes = body(raw)?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not JSON: {e}")))?;
    let items = match value {
        serde_json::Value::Array(items) => items,
        one => vec![one],
    };
    if items.is_empty() || items.len() > MAX_BATCH {
        return Err(ApiError::invalid(format!(
            "send 1..={MAX_BATCH} events per request"
        )));
    }
    let codec = engram_schema::Codec::default();
    let agent = caller.agent().as_str().to_owned();
    let mut events = Vec::with_capacity(items.len());
    for (i, mut item) in items.into_iter().enumerate() {
        fill(&caller, &mut item)?;
        let object = item.as_object_mut().expect("fill checked it is an object");
        match object.get("agent_id").and_then(|a| a.as_str()) {
            None => {
                object.insert("agent_id".into(), agent.clone().into());
            }
            Some(a) if a == agent => {}
            Some(a) => {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "forbidden",
                    format!("event {i}: this API key is agent {agent}; the event names agent {a}"),
                ));
            }
        }
        object
            .entry("instance_id")
            .or_insert_with(|| "gateway".into());
        let event = codec
            .decode_json(&item.to_string())
            .map_err(|e| ApiError::invalid(format!("event {i}: {e}")))?;
        events.push(event);
    }
    let mut receipts: Vec<_> = caller
        .client
        .append_batch(&events)
        .await
        .into_iter()
        .map(|r| r.map_err(ApiError::from))
        .collect();
    // One event that failed is that event's error, status and all.
    if let [Err(_)] = receipts.as_slice()
        && let Some(Err(e)) = receipts.pop()
    {
        return Err(e);
    }
    let results = events
        .iter()
        .zip(receipts)
        .map(|(event, r)| match r {
            Ok(receipt) => AppendResult {
                event_id: event.event_id.to_string(),
                seq: Some(receipt.seq),
                duplicate: receipt.duplicate,
                error: None,
            },
            Err(e) => AppendResult {
                event_id: event.event_id.to_string(),
                seq: None,
                duplicate: false,
                error: Some(ErrorBody {
                    code: e.code.to_owned(),
                    message: e.message,
                }),
            },
        })
        .collect();
    Ok(Json(Appended { results }))
}

async fn retrieve(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<proto::RetrieveResponse> {
    let (caller, r): (_, proto::RetrieveRequest) = request(&g, &headers, raw).await?;
    Ok(Json(caller.client.retrieve(&r).await?))
}

async fn context(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<proto::Context> {
    let (caller, r): (_, proto::ContextRequest) = request(&g, &headers, raw).await?;
    Ok(Json(caller.client.build_context(&r).await?))
}

async fn facts(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<proto::FactsResponse> {
    let (caller, r): (_, proto::FactsRequest) = request(&g, &headers, raw).await?;
    Ok(Json(caller.client.facts(&r).await?))
}

async fn skills(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<proto::SkillsResponse> {
    let (caller, r): (_, proto::SkillsRequest) = request(&g, &headers, raw).await?;
    Ok(Json(caller.client.skills(&r).await?))
}

async fn docs(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<proto::DocResponse> {
    let (caller, r): (_, proto::DocRequest) = request(&g, &headers, raw).await?;
    Ok(Json(caller.client.doc(&r).await?))
}

async fn replay(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<proto::ReplayResponse> {
    let (caller, r): (_, proto::ReplayRequest) = request(&g, &headers, raw).await?;
    Ok(Json(caller.client.replay_page(&r).await?))
}

async fn working(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<proto::WorkingResponse> {
    let (caller, r): (_, proto::WorkingRequest) = request(&g, &headers, raw).await?;
    Ok(Json(caller.client.working(&r).await?))
}

async fn openapi() -> Json<serde_json::Value> {
    Json(crate::openapi::document())
}

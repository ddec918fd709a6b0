//! The `/v1` handlers. Each takes the caller from its API key, fills the tenant it leaves
//! out, refuses one naming another, and answers through the SDK, so an HTTP request gets the
//! same checks, bounds and errors as the NATS path.
//!
//! The caller comes from [`crate::authenticate`], which runs before the handler's body
//! extractor: a request without a valid key is answered 401 with its body unread.
//!
//! `routes()` is the one list of the gateway's paths, the keyless ones included.

use std::sync::Arc;

use axum::extract::Extension;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use engram_memory::proto;
use serde::de::DeserializeOwned;

use crate::{ApiError, Caller, Gateway, Probes};

/// Most events one append request carries.
pub const MAX_BATCH: usize = 1_000;

type Result<T> = std::result::Result<Json<T>, ApiError>;

pub(crate) fn routes(gateway: &Arc<Gateway>, probes: Probes) -> Router<Arc<Gateway>> {
    // Every `/v1` route but the tail (which authenticates itself and reads no body) takes
    // its caller from the middleware; `route_layer`, so an unknown path is a 404 unasked.
    let authenticated = Router::new()
        .route("/v1/events", post(append))
        .route("/v1/retrieve", post(retrieve))
        .route("/v1/context", post(context))
        .route("/v1/facts", post(facts))
        .route("/v1/skills", post(skills))
        .route("/v1/docs", post(docs))
        .route("/v1/docs/edit", post(docs_edit))
        .route("/v1/replay", post(replay))
        .route("/v1/brief", post(brief))
        .route("/v1/working", post(working))
        .route("/v1/forget", post(forget))
        .route("/v1/consolidate", post(consolidate))
        .route("/v1/snapshots", post(snapshots))
        .route("/v1/bootstrap", post(bootstrap))
        .route("/v1/erase", post(erase))
        .route("/v1/whoami", get(whoami))
        .route("/v1/scopes", post(scopes))
        .route("/v1/dead_letters", post(dead_letters))
        .route_layer(axum::middleware::from_fn_with_state(
            gateway.clone(),
            crate::authenticate,
        ));
    let open = authenticated
        .route("/v1/tail", get(crate::tail::tail))
        .route("/reference", get(crate::openapi::reference))
        .route("/openapi.json", get(openapi))
        .merge(crate::inspector::routes());
    match probes {
        // Outside the authenticating layer: probes and scrapers hold no key. Neither handler
        // takes a body extractor, so a body sent with them is never read.
        Probes::Gateway => open
            .route("/healthz", get(crate::ops::healthz))
            .route("/metrics", get(crate::ops::metrics)),
        Probes::Host => open,
    }
}

/// The body, or why not: too large is 413, as the limit layer decided; not sent in time is
/// 408 (`http.body_read_timeout`).
fn body(body: std::result::Result<Bytes, BytesRejection>) -> std::result::Result<Bytes, ApiError> {
    body.map_err(|r| {
        if let Some(late) = crate::serve::timed_out(&r) {
            ApiError::new(StatusCode::REQUEST_TIMEOUT, "timeout", late.to_string())
        } else if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
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

/// The body as `T`, with the NATS path's message for the same mistake: the field's path, and
/// an unknown field named (every body type refuses them).
fn decode<T: DeserializeOwned>(value: serde_json::Value) -> std::result::Result<T, ApiError> {
    engram_rpc::decode_from(value).map_err(ApiError::invalid)
}

/// A request of one of the query paths, decoded for the caller.
fn request<T: DeserializeOwned>(
    caller: Caller,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<(Caller, T), ApiError> {
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

/// One result per event, in order.
fn results(
    events: &[engram_schema::Envelope],
    receipts: Vec<std::result::Result<engram_sdk::AppendReceipt, ApiError>>,
) -> Vec<AppendResult> {
    events
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
        .collect()
}

/// `POST /v1/events`: one event or an array of at most 1000. Every event is checked before
/// any is sent; one bad event and none is appended. `tenant` and `agent_id` default to the
/// key's, and an event naming another tenant or agent is refused: the key says who writes.
async fn append(
    Extension(caller): Extension<Caller>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Appended> {
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
        let event = codec.decode_value(item).map_err(|e| match e {
            engram_schema::SchemaError::TooLarge { .. }
            | engram_schema::SchemaError::PayloadTooLarge { .. } => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("event {i}: {e}"),
            ),
            e => ApiError::invalid(format!("event {i}: {e}")),
        })?;
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
    let results = results(&events, receipts);
    Ok(Json(Appended { results }))
}

/// A route that decodes its request for the caller and answers with one SDK call.
macro_rules! forward {
    ($name:ident, $req:ty, $resp:ty, |$client:ident, $r:ident| $call:expr) => {
        async fn $name(
            Extension(caller): Extension<Caller>,
            raw: std::result::Result<Bytes, BytesRejection>,
        ) -> Result<$resp> {
            let (caller, $r): (_, $req) = request(caller, raw)?;
            let $client = &caller.client;
            Ok(Json($call.await?))
        }
    };
}

forward!(
    retrieve,
    proto::RetrieveRequest,
    proto::RetrieveResponse,
    |c, r| c.retrieve(&r)
);
forward!(context, proto::ContextRequest, proto::Context, |c, r| c
    .build_context(&r));
forward!(facts, proto::FactsRequest, proto::FactsResponse, |c, r| c
    .facts(&r));
forward!(
    skills,
    proto::SkillsRequest,
    proto::SkillsResponse,
    |c, r| c.skills(&r)
);
forward!(docs, proto::DocRequest, proto::DocResponse, |c, r| c
    .doc(&r));
forward!(
    replay,
    proto::ReplayRequest,
    proto::ReplayResponse,
    |c, r| c.replay_page(&r)
);
forward!(brief, proto::BriefRequest, proto::BriefResponse, |c, r| c
    .brief(&r));
forward!(
    working,
    proto::WorkingRequest,
    proto::WorkingResponse,
    |c, r| c.working(&r)
);
forward!(
    snapshots,
    SnapshotsBody,
    proto::SnapshotsResponse,
    |c, r| c.list_snapshots(&r.request)
);
forward!(
    bootstrap,
    proto::BootstrapRequest,
    proto::BootstrapResponse,
    |c, r| c.bootstrap_slice(&r)
);
forward!(
    scopes,
    proto::ScopesRequest,
    proto::ScopesResponse,
    |c, r| c.list_scopes(&r)
);
forward!(
    dead_letters,
    proto::DeadLettersRequest,
    proto::DeadLettersResponse,
    |c, r| c.list_dead_letters(&r)
);

/// `POST /v1/snapshots`: the query protocol's request names no tenant (the index is the same
/// for every caller), but a `/v1` body may name the key's, as every other one does, and the
/// gateway fills it in ([`fill`]).
#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsBody {
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(flatten)]
    pub request: proto::SnapshotsRequest,
}

/// `GET /v1/whoami`: the key's tenant, agent, scopes and grants.
async fn whoami(Extension(caller): Extension<Caller>) -> Result<proto::WhoamiResponse> {
    Ok(Json(caller.client.whoami().await?))
}

/// The caller's agent, writing as the gateway's instance.
fn writer(caller: &Caller) -> std::result::Result<engram_sdk::Agent, ApiError> {
    caller
        .client
        .agent(
            caller.tenant().as_str(),
            caller.agent().as_str(),
            GATEWAY_INSTANCE,
        )
        .map_err(|e| ApiError::invalid(e.to_string()))
}

/// The instance id of events the gateway writes for a caller that names none.
pub const GATEWAY_INSTANCE: &str = "gateway";

#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DocEditRequest {
    #[serde(default)]
    pub tenant: Option<String>,
    pub scope: engram_schema::Scope,
    /// `task_board`, `profile`, `scratchpad`, or a type of your own.
    pub doc_type: String,
    pub name: String,
    /// Edit the state that includes at least this sequence (your last write's).
    #[serde(default)]
    pub min_seq: Option<u64>,
    /// Values to set, by JSON pointer (`/items/t-7/status`); maps on the way are made.
    #[serde(default)]
    pub set: Vec<PathValue>,
    /// JSON pointers to delete.
    #[serde(default)]
    pub delete: Vec<String>,
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathValue {
    pub path: String,
    pub value: serde_json::Value,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
pub struct DocEdited {
    /// Pass as `min_seq` to read this edit merged.
    pub seq: u64,
    pub event_id: String,
    /// The document after the edit, with its conflicts (concurrent writes, every value kept).
    pub view: engram_sdk::doc::DocView,
}

/// `POST /v1/docs/edit`: sets and deletes by JSON pointer in one change, pushed as the key's
/// agent.
async fn docs_edit(
    Extension(caller): Extension<Caller>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<DocEdited> {
    let (caller, r): (_, DocEditRequest) = request(caller, raw)?;
    let sets: Vec<_> = r.set.into_iter().map(|p| (p.path, p.value)).collect();
    let edit = writer(&caller)?
        .edit_doc(r.scope, &r.doc_type, &r.name, r.min_seq, &sets, &r.delete)
        .await
        .map_err(doc_edit_error)?;
    Ok(Json(DocEdited {
        seq: edit.receipt.seq,
        event_id: edit.receipt.event_id.to_string(),
        view: edit.view,
    }))
}

fn doc_edit_error(e: engram_sdk::doc::DocEditError) -> ApiError {
    use engram_sdk::doc::{DocClientError as C, DocEditError as E};
    match e {
        E::Client(C::Rpc(e)) => e.into(),
        E::Client(C::Append(e)) => e.into(),
        E::Client(C::BadReply(m)) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", m)
        }
        other => ApiError::invalid(other.to_string()),
    }
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForgetRequest {
    #[serde(default)]
    pub tenant: Option<String>,
    pub scope: engram_schema::Scope,
    /// The memories to withdraw from retrieval (at most 1000); ids of other scopes are ignored.
    #[schemars(length(min = 1, max = 1000))]
    pub event_ids: Vec<engram_schema::EventId>,
    pub reason: String,
    /// The layer the forget event is recorded in (default episodic).
    #[serde(default)]
    pub layer: Option<engram_schema::Layer>,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
pub struct Receipt {
    /// Pass as `min_seq` to read with this write applied.
    pub seq: u64,
    pub event_id: String,
    pub duplicate: bool,
}

/// `POST /v1/forget`: one `forgotten` event naming the memories.
async fn forget(
    Extension(caller): Extension<Caller>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Receipt> {
    let (caller, r): (_, ForgetRequest) = request(caller, raw)?;
    if r.event_ids.is_empty() || r.event_ids.len() > 1000 {
        return Err(ApiError::invalid("name 1..=1000 event_ids to forget"));
    }
    let receipt = writer(&caller)?
        .forget(
            r.scope,
            r.layer.unwrap_or(engram_schema::Layer::Episodic),
            &r.event_ids,
            r.reason,
        )
        .await?;
    Ok(Json(Receipt {
        seq: receipt.seq,
        event_id: receipt.event_id.to_string(),
        duplicate: receipt.duplicate,
    }))
}

/// `ConsolidateRequest` plus `dry_run`. Unknown fields are refused by the request's own type:
/// it flattens the scopes itself, so it reads every key this body leaves, and a
/// `deny_unknown_fields` here would refuse all of them (hence the schema-only attribute).
#[derive(serde::Deserialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ConsolidateBody {
    #[serde(flatten)]
    pub request: proto::ConsolidateRequest,
    /// Only plan: answer the events without appending them.
    #[serde(default)]
    pub dry_run: bool,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
pub struct Consolidated {
    /// Events the consolidator planned.
    pub planned: usize,
    /// The planned events, on a dry run (empty otherwise).
    pub events: Vec<serde_json::Value>,
    /// One per event appended (none on a dry run).
    pub results: Vec<AppendResult>,
}

/// `POST /v1/consolidate`: the scope's consolidation plan, appended as the key's agent (the
/// plan's event ids derive from its inputs, so a retry stores each once).
async fn consolidate(
    Extension(caller): Extension<Caller>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Consolidated> {
    let (caller, body): (_, ConsolidateBody) = request(caller, raw)?;
    if body.dry_run {
        let plan = caller.client.consolidation_plan(&body.request).await?;
        return Ok(Json(Consolidated {
            planned: plan.events.len(),
            events: plan
                .events
                .iter()
                .filter_map(|e| serde_json::to_value(e).ok())
                .collect(),
            results: Vec::new(),
        }));
    }
    let (events, receipts) = caller.client.consolidate(&body.request).await?;
    Ok(Json(Consolidated {
        planned: events.len(),
        events: Vec::new(),
        results: results(
            &events,
            receipts
                .into_iter()
                .map(|r| r.map_err(ApiError::from))
                .collect(),
        ),
    }))
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EraseRequest {
    #[serde(default)]
    pub tenant: Option<String>,
    pub scopes: Vec<engram_schema::Scope>,
}

/// `POST /v1/erase`: verified erasure deletes events from the stream, which no agent's
/// identity may do, and an API key is an agent's: the gateway will not act for it with a
/// wider one. The answer says who can.
async fn erase(
    Extension(caller): Extension<Caller>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<serde_json::Value> {
    let (caller, r): (_, EraseRequest) = request(caller, raw)?;
    let scopes: Vec<String> = r.scopes.iter().map(|s| format!("--scope {s}")).collect();
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!(
            "erasure deletes events from the log, which only the admin identity may do, and an API key is an agent's; run `engram erase --tenant {} {}` with the admin's credentials, or withdraw memories from retrieval with POST /v1/forget",
            caller.tenant(),
            scopes.join(" ")
        ),
    ))
}

async fn openapi() -> Json<serde_json::Value> {
    Json(crate::openapi::document())
}

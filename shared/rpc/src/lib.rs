//! Typed JSON request/reply over NATS, following the NATS services convention.
//!
//! Servers register endpoints on an `async_nats::service::Service`, which brings
//! `$SRV.PING|INFO|STATS` discovery and per-endpoint stats for free. Failures travel as service
//! errors: the `Nats-Service-Error-Code` header holds an HTTP-like status
//! ([`ErrorCode::http_status`]) and `Nats-Service-Error` the message, so non-Rust agents can
//! read them without a schema.
//!
//! A request is answered only at the caller's own inbox
//! ([`engram_access::perms::reply_allowed`]): on an agent's subject
//! (`engram.q.<tenant>.<agent>.<op>`) that agent's `_INBOX.a.<tenant>.<agent>.`, elsewhere
//! an inbox that is no agent's. Any other request is dropped before its handler runs and
//! counted in `engram_rpc_replies_refused_total`. Serve on a connection of the service's
//! responder identity ([`engram_access::Role::Responder`]), which may publish to inboxes only.

pub mod front;
mod local;

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::service::{self, ServiceExt};
use engram_bus::StreamHead;
use engram_memory::proto::{Consistency, ErrorCode, InvalidField};
use engram_telemetry::metrics;
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use thiserror::Error;
use tracing::Instrument;

pub use local::{LocalRoutes, Routes};

/// Which of a service's two connections is meant. A service works (consumes, appends,
/// writes KV, asks other services) on its worker connection and answers requests on its
/// responder connection, whose identity may publish to inboxes only: so no reply subject a
/// requester writes can borrow the worker's rights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Link {
    Worker,
    Responder,
}

/// A failed call, as the caller sees it.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum RpcError {
    /// The server refused or failed the request; `code` says how.
    #[error("{message}")]
    Service { code: ErrorCode, message: String },
    /// No server answered on the subject.
    #[error(
        "no engram service answers on {subject}; is `engram up` (or the service) running and connected to this nats server?"
    )]
    NoResponders { subject: String },
    #[error("request to {subject} timed out after {timeout:?}")]
    Timeout { subject: String, timeout: Duration },
    #[error("request to {subject} failed: {reason}")]
    Transport { subject: String, reason: String },
    #[error("reply from {subject} does not decode: {reason}")]
    BadReply { subject: String, reason: String },
}

impl RpcError {
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Service { code, .. } => *code,
            Self::BadReply { .. } => ErrorCode::Internal,
            _ => ErrorCode::Unavailable,
        }
    }

    /// True when the same request may succeed later.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.code(),
            ErrorCode::Unavailable | ErrorCode::NotYetVisible | ErrorCode::Busy
        )
    }
}

/// A handler's failure: a code and a message for the caller.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{message}")]
pub struct Failure {
    pub code: ErrorCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Invalid, message)
    }
}

impl From<InvalidField> for Failure {
    fn from(e: InvalidField) -> Self {
        Self::invalid(e.to_string())
    }
}

/// Refuses a `min_seq` beyond the events stream's last sequence: no append returned it, so
/// waiting for it could only time out (and hold a request slot until then).
pub async fn check_min_seq(head: &StreamHead, consistency: &Consistency) -> Result<(), Failure> {
    let Some(min_seq) = consistency.min_seq else {
        return Ok(());
    };
    match head
        .beyond(min_seq)
        .await
        .map_err(|e| Failure::new(ErrorCode::Unavailable, e.to_string()))?
    {
        None => Ok(()),
        Some(last) => Err(Failure::invalid(format!(
            "min_seq: {min_seq} is beyond the events stream's last sequence {last}; pass the seq an append returned"
        ))),
    }
}

impl From<RpcError> for Failure {
    fn from(e: RpcError) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

/// Sends `request` to `subject` and decodes the reply.
pub async fn call<Req: Serialize, Resp: DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    request: &Req,
    timeout: Duration,
) -> Result<Resp, RpcError> {
    let body = serde_json::to_vec(request).map_err(|e| RpcError::Transport {
        subject: subject.to_owned(),
        reason: format!("cannot encode request: {e}"),
    })?;
    // The connection's default request timeout (10 s) would cut long read-your-writes waits
    // short: every call sets its own.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(TIMEOUT_HEADER, timeout.as_millis().to_string().as_str());
    let request = async_nats::Request::new()
        .payload(body.into())
        .headers(headers)
        .timeout(Some(timeout));
    let reply = tokio::time::timeout(
        timeout + Duration::from_millis(100),
        client.send_request(subject.to_owned(), request),
    )
    .await
    .map_err(|_| RpcError::Timeout {
        subject: subject.to_owned(),
        timeout,
    })?
    .map_err(|e| match e.kind() {
        async_nats::RequestErrorKind::NoResponders => RpcError::NoResponders {
            subject: subject.to_owned(),
        },
        async_nats::RequestErrorKind::TimedOut => RpcError::Timeout {
            subject: subject.to_owned(),
            timeout,
        },
        _ => RpcError::Transport {
            subject: subject.to_owned(),
            reason: e.to_string(),
        },
    })?;
    if let Some(headers) = &reply.headers
        && let Some(code) = headers.get(service::NATS_SERVICE_ERROR_CODE)
    {
        let code = code.as_str().parse::<usize>().unwrap_or(500);
        let message = headers
            .get(service::NATS_SERVICE_ERROR)
            .map(|m| m.as_str().to_owned())
            .unwrap_or_else(|| format!("service error {code}"));
        return Err(RpcError::Service {
            code: ErrorCode::from_status(code),
            message,
        });
    }
    serde_json::from_slice(&reply.payload).map_err(|e| RpcError::BadReply {
        subject: subject.to_owned(),
        reason: e.to_string(),
    })
}

/// Starts a NATS service named `name` (letters, digits, `-`, `_`).
pub async fn start_service(
    client: &async_nats::Client,
    name: &str,
    description: &str,
) -> Result<service::Service, RpcError> {
    client
        .service_builder()
        .description(description)
        .start(name, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| RpcError::Transport {
            subject: format!("$SRV.*.{name}"),
            reason: e.to_string(),
        })
}

/// How long [`settle`] waits by default: the server answers in a round trip, so only a
/// server that is down or overloaded takes this long.
pub const SETTLE_WITHIN: Duration = Duration::from_secs(10);

/// Returns once the server has taken every subscription `responder` sent before the call,
/// so a request from any connection finds those endpoints. A flush is not enough: it only
/// writes the buffer, and the server may still be reading it when another connection's
/// request arrives (no responders). The server handles one connection's messages in order,
/// so a message `responder` publishes after its subscriptions, seen arriving at `witness`,
/// proves they are in place. The responder may publish only to inboxes, which is all this
/// needs; it publishes again until one arrives, since `witness`'s own subscription is
/// under the same race.
pub async fn settle(
    responder: &async_nats::Client,
    witness: &async_nats::Client,
    deadline: Duration,
) -> Result<(), RpcError> {
    let inbox = witness.new_inbox();
    let failed = |reason: String| RpcError::Transport {
        subject: inbox.clone(),
        reason,
    };
    let mut seen = witness
        .subscribe(inbox.clone())
        .await
        .map_err(|e| failed(format!("subscribing: {e}")))?;
    let settled = async {
        loop {
            responder
                .publish(inbox.clone(), bytes::Bytes::new())
                .await
                .map_err(|e| failed(format!("publishing: {e}")))?;
            responder
                .flush()
                .await
                .map_err(|e| failed(format!("flushing: {e}")))?;
            match tokio::time::timeout(Duration::from_millis(20), seen.next()).await {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => return Err(failed("the subscription ended".to_owned())),
                Err(_) => continue,
            }
        }
    };
    let outcome = tokio::time::timeout(deadline, settled)
        .await
        .unwrap_or_else(|_| {
            Err(RpcError::Timeout {
                subject: inbox.clone(),
                timeout: deadline,
            })
        });
    let _ = seen.unsubscribe().await;
    outcome
}

/// The header a caller sets to its own timeout in milliseconds (relative, so clocks need not
/// agree). The server drops a request's work once it has passed: nobody waits for the answer.
pub const TIMEOUT_HEADER: &str = "Engram-Timeout-Ms";

/// How long a busy caller should wait before retrying, said in the busy reply.
pub const BUSY_RETRY_AFTER: Duration = Duration::from_millis(100);

/// What one endpoint may hold, whatever its callers send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointLimits {
    /// Requests handled at once. One more is answered at once with [`ErrorCode::Busy`], so a
    /// flood costs a reply each, not a task and its memory each.
    pub max_in_flight: usize,
    /// Longest a request may run, waits included. A caller's [`TIMEOUT_HEADER`] shortens it.
    pub max_duration: Duration,
}

impl Default for EndpointLimits {
    fn default() -> Self {
        Self {
            max_in_flight: 64,
            // The longest read-your-writes wait, plus time to answer.
            max_duration: Duration::from_millis(engram_memory::proto::limits::MAX_WAIT_MS)
                + Duration::from_secs(30),
        }
    }
}

/// How long the request's caller waits, from its [`TIMEOUT_HEADER`], within `max`.
fn deadline(message: &async_nats::Message, max: Duration) -> Duration {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(TIMEOUT_HEADER))
        .and_then(|v| v.as_str().parse::<u64>().ok())
        .map_or(max, |ms| Duration::from_millis(ms).min(max))
}

pub(crate) fn outcome_label(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::Invalid => "invalid",
        ErrorCode::Forbidden => "forbidden",
        ErrorCode::NotYetVisible => "timeout",
        ErrorCode::Busy => "busy",
        ErrorCode::Unavailable => "unavailable",
        ErrorCode::Internal => "error",
    }
}

fn service_error(failure: &Failure) -> service::error::Error {
    service::error::Error {
        // Header values are one line.
        status: failure.message.replace(['\r', '\n'], " "),
        code: failure.code.http_status(),
    }
}

/// A handler's answer, or `unavailable` once `deadline` has passed: dropping the handler's
/// future cancels its waits and requests to other services.
pub(crate) async fn within<T>(
    deadline: Duration,
    answer: impl Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    tokio::time::timeout(deadline, answer)
        .await
        .unwrap_or_else(|_| {
            Err(Failure::new(
                ErrorCode::Unavailable,
                format!(
                    "the request ran past its deadline of {} ms and was dropped; retry, or allow more time",
                    deadline.as_millis()
                ),
            ))
        })
}

/// Counts an answered request of `op` in the query metrics, by outcome, with its time.
pub(crate) fn counted<T>(op: &str, started: Instant, result: &Result<T, Failure>) {
    let outcome = match result {
        Ok(_) => "ok",
        Err(f) => outcome_label(f.code),
    };
    metrics::QUERIES.with_label_values(&[op, outcome]).inc();
    metrics::QUERY_SECONDS
        .with_label_values(&[op])
        .observe(started.elapsed().as_secs_f64());
}

/// A request body as `Req`, or why not, naming the field where decoding stopped: a client in
/// another language learns which of its fields to fix. Every request type refuses unknown
/// fields (`engram_memory::proto`), so a misspelt one is named here too, and nothing may
/// follow the JSON value.
fn decode<Req: DeserializeOwned>(body: &[u8]) -> Result<Req, String> {
    let mut json = serde_json::Deserializer::from_slice(body);
    let request = decode_from(&mut json)?;
    json.end()
        .map_err(|e| format!("request does not decode: {e}"))?;
    Ok(request)
}

/// [`decode`] from any deserializer, with the same messages: the gateway decodes its bodies
/// (JSON values, once it has filled in the tenant) with it, so HTTP and NATS callers read
/// the same error for the same mistake.
pub fn decode_from<'de, Req, D>(deserializer: D) -> Result<Req, String>
where
    Req: serde::Deserialize<'de>,
    D: serde::Deserializer<'de>,
{
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            format!("request does not decode: {}", e.into_inner())
        } else {
            format!("request does not decode: field {path}: {}", e.into_inner())
        }
    })
}

/// Serves `subject` on `service` with `handler` until the endpoint closes. Each request runs
/// in its own task on the calling runtime, so a slow request (a read-your-writes wait) never
/// holds up others; at most `limits.max_in_flight` run at once, and none beyond its deadline.
/// Requests are admitted or refused `busy` on the [`front`] door's thread.
pub async fn serve<Req, Resp, H, Fut>(
    service: &service::Service,
    subject: &str,
    op: &'static str,
    limits: EndpointLimits,
    handler: H,
) -> Result<tokio::task::JoinHandle<()>, RpcError>
where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    H: Fn(Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Failure>> + Send + 'static,
{
    serve_from(service, subject, op, limits, move |_: &str, r| handler(r)).await
}

/// [`serve`], with the subject each request arrived on handed to `handler`: on a wildcard
/// subject whose tokens the server's permissions pin to the caller's key, that subject is
/// who is asking.
pub async fn serve_from<Req, Resp, H, Fut>(
    service: &service::Service,
    subject: &str,
    op: &'static str,
    limits: EndpointLimits,
    handler: H,
) -> Result<tokio::task::JoinHandle<()>, RpcError>
where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    H: Fn(&str, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Failure>> + Send + 'static,
{
    serve_inner(service, None, subject, op, limits, handler).await
}

/// [`serve`], also entered in `routes.local` (if any) for callers in this process, until
/// `routes.stop` ends the endpoint.
pub async fn serve_with<Req, Resp, H, Fut>(
    service: &service::Service,
    routes: &Routes,
    subject: &str,
    op: &'static str,
    limits: EndpointLimits,
    handler: H,
) -> Result<tokio::task::JoinHandle<()>, RpcError>
where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    H: Fn(Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Failure>> + Send + 'static,
{
    serve_inner(
        service,
        Some(routes),
        subject,
        op,
        limits,
        move |_: &str, r| handler(r),
    )
    .await
}

/// [`serve_from`], also entered in `routes.local` (if any) for callers in this process,
/// until `routes.stop` ends the endpoint.
pub async fn serve_from_with<Req, Resp, H, Fut>(
    service: &service::Service,
    routes: &Routes,
    subject: &str,
    op: &'static str,
    limits: EndpointLimits,
    handler: H,
) -> Result<tokio::task::JoinHandle<()>, RpcError>
where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    H: Fn(&str, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Failure>> + Send + 'static,
{
    serve_inner(service, Some(routes), subject, op, limits, handler).await
}

async fn serve_inner<Req, Resp, H, Fut>(
    service: &service::Service,
    routes: Option<&Routes>,
    subject: &str,
    op: &'static str,
    limits: EndpointLimits,
    handler: H,
) -> Result<tokio::task::JoinHandle<()>, RpcError>
where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    H: Fn(&str, Req) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, Failure>> + Send + 'static,
{
    let mut endpoint = service
        .endpoint(subject)
        .await
        .map_err(|e| RpcError::Transport {
            subject: subject.to_owned(),
            reason: e.to_string(),
        })?;
    let handler = Arc::new(handler);
    let subject = subject.to_owned();
    let permits = routes
        .and_then(|r| r.permits.clone())
        .unwrap_or_else(|| Arc::new(tokio::sync::Semaphore::new(limits.max_in_flight.max(1))));
    if let Some(local) = routes.and_then(|r| r.local.as_ref()) {
        local.insert(
            &subject,
            Arc::new(local::Typed {
                handler: handler.clone(),
                permits: permits.clone(),
                limits,
                op,
                types: PhantomData::<fn(Req) -> Resp>,
            }),
        );
    }
    let routes = routes.cloned();
    // Admission on the front door's thread, the work on the runtime serving the endpoint.
    let work = tokio::runtime::Handle::current();
    Ok(front::handle().spawn(async move {
        let stop = routes.as_ref().map(|r| r.stop.clone()).unwrap_or_default();
        loop {
            let request = tokio::select! {
                request = endpoint.next() => match request {
                    Some(request) => request,
                    None => break,
                },
                () = stop.cancelled() => {
                    if let Some(local) = routes.as_ref().and_then(|r| r.local.as_ref()) {
                        local.remove(&subject);
                    }
                    if let Err(e) = endpoint.stop().await {
                        tracing::debug!(subject = %subject, error = %e, "endpoint did not unsubscribe");
                    }
                    break;
                }
            };
            // Before anything else, busy replies included: the reply subject is the
            // requester's to choose, and answering it is a publish with this service's
            // rights. Only the caller's own inbox gets an answer; any other request is
            // dropped undone (its work may be a write, and nobody could read its answer).
            let reply = request.message.reply.as_ref().map(|r| r.as_str());
            if !engram_access::perms::reply_allowed(&request.message.subject, reply) {
                metrics::RPC_REPLIES_REFUSED.with_label_values(&[op]).inc();
                tracing::debug!(
                    op,
                    subject = %request.message.subject,
                    reply = reply.unwrap_or(""),
                    "request dropped: its reply subject is not the caller's inbox"
                );
                continue;
            }
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                metrics::QUERIES.with_label_values(&[op, "busy"]).inc();
                let busy = Failure::new(
                    ErrorCode::Busy,
                    format!(
                        "{subject} is busy: {} requests in flight; retry after {} ms",
                        limits.max_in_flight,
                        BUSY_RETRY_AFTER.as_millis()
                    ),
                );
                if let Err(e) = request.respond(Err(service_error(&busy))).await {
                    tracing::debug!(op, error = %e, "cannot send busy reply");
                }
                continue;
            };
            let handler = handler.clone();
            work.spawn(
                async move {
                    let _permit = permit;
                    let started = Instant::now();
                    let deadline = deadline(&request.message, limits.max_duration);
                    let result = match decode::<Req>(&request.message.payload) {
                        Ok(req) => {
                            within(deadline, handler(request.message.subject.as_str(), req))
                                .await
                        }
                        Err(e) => Err(Failure::invalid(e)),
                    };
                    counted(op, started, &result);
                    let response = match result {
                        Ok(resp) => serde_json::to_vec(&resp)
                            .map(bytes::Bytes::from)
                            .map_err(|e| {
                                service_error(&Failure::new(
                                    ErrorCode::Internal,
                                    format!("cannot encode reply: {e}"),
                                ))
                            }),
                        Err(failure) => {
                            if failure.code == ErrorCode::Internal {
                                tracing::warn!(op, error = %failure.message, "query failed");
                            }
                            Err(service_error(&failure))
                        }
                    };
                    let size = response.as_ref().map_or(0, bytes::Bytes::len);
                    match request.respond(response).await {
                        Ok(()) => {}
                        Err(e) if e.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                            // Silence would leave the caller waiting out its timeout.
                            let too_big = Failure::invalid(format!(
                                "the reply ({size} bytes) exceeds the nats server's max_payload; ask for fewer results or a narrower filter"
                            ));
                            if let Err(e) = request.respond(Err(service_error(&too_big))).await {
                                tracing::debug!(op, error = %e, "cannot send reply");
                            }
                        }
                        Err(e) => tracing::debug!(op, error = %e, "cannot send reply"),
                    }
                }
                .instrument(tracing::debug_span!("rpc", op)),
            );
        }
        if let Some(local) = routes.as_ref().and_then(|r| r.local.as_ref()) {
            local.remove(&subject);
        }
        tracing::debug!(subject = %subject, "endpoint closed");
    }))
}

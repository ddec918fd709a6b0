//! Typed JSON request/reply over NATS, following the NATS services convention.
//!
//! Servers register endpoints on an `async_nats::service::Service`, which brings
//! `$SRV.PING|INFO|STATS` discovery and per-endpoint stats for free. Failures travel as service
//! errors: the `Nats-Service-Error-Code` header holds an HTTP-like status
//! ([`ErrorCode::http_status`]) and `Nats-Service-Error` the message, so non-Rust agents can
//! read them without a schema.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::service::{self, ServiceExt};
use engram_memory::proto::ErrorCode;
use engram_telemetry::metrics;
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use thiserror::Error;

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
    let request = async_nats::Request::new()
        .payload(body.into())
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

/// Serves `subject` on `service` with `handler` until the endpoint closes. Each request runs
/// in its own task, so a slow request (a read-your-writes wait) never holds up others.
pub async fn serve<Req, Resp, H, Fut>(
    service: &service::Service,
    subject: &str,
    op: &'static str,
    handler: H,
) -> Result<tokio::task::JoinHandle<()>, RpcError>
where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    H: Fn(Req) -> Fut + Send + Sync + 'static,
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
    Ok(tokio::spawn(async move {
        while let Some(request) = endpoint.next().await {
            let handler = handler.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let result = match serde_json::from_slice::<Req>(&request.message.payload) {
                    Ok(req) => handler(req).await,
                    Err(e) => Err(Failure::invalid(format!("request does not decode: {e}"))),
                };
                let outcome = match &result {
                    Ok(_) => "ok",
                    Err(f) => match f.code {
                        ErrorCode::Invalid => "invalid",
                        ErrorCode::NotYetVisible => "timeout",
                        ErrorCode::Busy => "busy",
                        ErrorCode::Unavailable => "unavailable",
                        ErrorCode::Internal => "error",
                    },
                };
                metrics::QUERIES.with_label_values(&[op, outcome]).inc();
                metrics::QUERY_SECONDS
                    .with_label_values(&[op])
                    .observe(started.elapsed().as_secs_f64());
                let response = match result {
                    Ok(resp) => serde_json::to_vec(&resp)
                        .map(bytes::Bytes::from)
                        .map_err(|e| service::error::Error {
                            status: format!("cannot encode reply: {e}"),
                            code: 500,
                        }),
                    Err(failure) => {
                        if failure.code == ErrorCode::Internal {
                            tracing::warn!(op, error = %failure.message, "query failed");
                        }
                        Err(service::error::Error {
                            // Header values are one line.
                            status: failure.message.replace(['\r', '\n'], " "),
                            code: failure.code.http_status(),
                        })
                    }
                };
                if let Err(e) = request.respond(response).await {
                    tracing::debug!(op, error = %e, "cannot send reply");
                }
            });
        }
        tracing::debug!(subject = %subject, "endpoint closed");
    }))
}

//! What operators' tools read from the gateway as its own process (`engram gateway`):
//! `/healthz` for probes and load balancers, `/metrics` for Prometheus. Inside `engram up`
//! the process answers both paths itself ([`crate::Probes::Host`]).
//!
//! Neither needs an API key (probes and scrapers hold none), reads a request body, or shows
//! anything a caller could use: the NATS URL is served with its credentials redacted, and no
//! tenant, agent or key appears.
//!
//! **What `/healthz` checks, and why no more.** The gateway holds no NATS identity of its
//! own: each API key connects as its agent, and the deployments give the gateway no
//! credentials on purpose. So, without a caller, it can ask the query service nothing; it
//! checks what every request needs first, that a NATS server answers at the gateway's URL.
//! A server greets each new connection (its `INFO` line) before the client sends any
//! credentials, so the check sends none and leaves no failed authentication in the server's
//! log. The memory nodes behind NATS report their own health on their `/healthz`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _};

use crate::Gateway;

/// How long one check of the NATS servers may take (all of them at once, DNS included):
/// well inside a probe's timeout (`timeoutSeconds: 5` in `deploy/k8s`).
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a check's outcome is reused. Probes and scrapes come every few seconds; a flood
/// of `/healthz` requests, which anyone may send, then costs the NATS servers one connection
/// a second, not one per request.
const CHECK_REUSE: Duration = Duration::from_secs(1);

/// The longest greeting read: a server's `INFO` line lists its cluster's client URLs, a few
/// KiB for a large cluster.
const MAX_GREETING: u64 = 64 * 1024;

/// The last check of whether a NATS server answers, shared by concurrent `/healthz`
/// requests: they wait for one check instead of each making its own.
#[derive(Default)]
pub(crate) struct NatsCheck {
    /// When the last check finished, and its outcome (why no server answered, on failure).
    last: tokio::sync::Mutex<Option<(Instant, Result<(), String>)>>,
}

impl NatsCheck {
    /// Whether a server of `urls` answers: a check at most [`CHECK_REUSE`] old, or a new one.
    async fn reachable(&self, urls: &str) -> Result<(), String> {
        let mut last = self.last.lock().await;
        if let Some((at, outcome)) = last.as_ref()
            && at.elapsed() < CHECK_REUSE
        {
            return outcome.clone();
        }
        let outcome = greeted(urls).await;
        // Logged when it changes, not on every probe: an outage is one line, not one a second.
        let was_up = last.as_ref().is_none_or(|(_, o)| o.is_ok());
        let url = engram_bus::config::redact_url(urls);
        match &outcome {
            Err(reason) if was_up => {
                tracing::warn!(%url, %reason, "no nats server answers the gateway");
            }
            Ok(()) if !was_up => tracing::info!(%url, "a nats server answers the gateway again"),
            _ => {}
        }
        *last = Some((Instant::now(), outcome.clone()));
        outcome
    }
}

/// Ok once any server of `urls` (comma-separated, as the gateway connects to them) greets a
/// new connection within [`CHECK_TIMEOUT`], as a client fails over to whichever answers;
/// otherwise each server's reason. All are asked at once, so that one that drops packets
/// does not use up the time of the others.
async fn greeted(urls: &str) -> Result<(), String> {
    let addrs = engram_bus::config::server_addrs(urls)?;
    let mut checks: FuturesUnordered<_> = addrs
        .iter()
        .map(|addr| async move {
            // The URL as it may be shown: a URL's user info can be the account's password.
            let shown = engram_bus::config::redact_url(addr.as_url_str());
            match tokio::time::timeout(CHECK_TIMEOUT, greeting(addr)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("{shown}: {e}")),
                Err(_) => Err(format!("{shown}: no greeting within {CHECK_TIMEOUT:?}")),
            }
        })
        .collect();
    let mut failures = Vec::new();
    while let Some(outcome) = checks.next().await {
        match outcome {
            Ok(()) => return Ok(()),
            Err(e) => failures.push(e),
        }
    }
    Err(failures.join("; "))
}

/// Connects to `addr` and reads its first line, which a NATS server sends unasked:
/// `INFO {...}`. The connection is closed without a word sent.
async fn greeting(addr: &async_nats::ServerAddr) -> Result<(), String> {
    let stream = tokio::net::TcpStream::connect((addr.host(), addr.port()))
        .await
        .map_err(|e| e.to_string())?;
    // A websocket listener greets only after an HTTP upgrade: that it accepts the
    // connection is all it says without one.
    if addr.is_websocket() {
        return Ok(());
    }
    let mut line = Vec::new();
    tokio::io::BufReader::new(stream.take(MAX_GREETING))
        .read_until(b'\n', &mut line)
        .await
        .map_err(|e| e.to_string())?;
    if line.starts_with(b"INFO ") {
        Ok(())
    } else if line.is_empty() {
        Err("the connection closed before the server's greeting".into())
    } else {
        Err("something answers, but not as a nats server".into())
    }
}

/// `GET /healthz`: 200 when a NATS server answers at the gateway's URL; 503 otherwise, with
/// the reason, so that a load balancer and a human both learn something. The body has the
/// shape of `engram up`'s (`status`, `nats.url`, `reason` when unavailable), with
/// `nats.reachable` for its `nats.connected`: the gateway holds no connection of its own.
pub(crate) async fn healthz(State(gateway): State<Arc<Gateway>>) -> Response {
    let urls = &gateway.bus.url;
    let shown = engram_bus::config::redact_url(urls);
    let (status, body) = match gateway.nats_check.reachable(urls).await {
        Ok(()) => (
            StatusCode::OK,
            serde_json::json!({
                "status": "ok",
                "nats": {"url": shown, "reachable": true},
            }),
        ),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({
                "status": "unavailable",
                "reason": format!("no nats server answers: {reason}"),
                "nats": {"url": shown, "reachable": false},
            }),
        ),
    };
    (status, axum::Json(body)).into_response()
}

/// `GET /metrics`: every metric of this process, in the Prometheus text format. The one
/// exposition of every Engram process: `engram up` and `engram node --http` answer with it
/// too, after refreshing the stream's gauges.
pub async fn metrics() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        engram_telemetry::metrics::render(),
    )
        .into_response()
}

//! Serving HTTP with bounds on what one connection may hold: the one server loop of
//! `engram up` and `engram gateway`.
//!
//! `axum::serve` sets none: a client that sends its headers a byte at a time, never sends
//! the body it announced, or opens connections and says nothing, held its connection (and
//! its task and buffers) for as long as it liked. Here:
//! - the request head must arrive within [`ServeLimits::header_read_timeout`] of the
//!   connection opening or going idle between requests (hyper's header read timeout), so an
//!   idle or slow-loris connection is closed;
//! - the body must arrive within [`ServeLimits::body_read_timeout`] of the head, a deadline
//!   for the whole body, not a gap between bytes (a trickle cannot extend it); a handler
//!   reading past it gets [`BodyTimedOut`], answered 408, and the connection is closed;
//! - at most [`ServeLimits::max_connections`] connections are open at once: one more is
//!   closed as soon as it is accepted, so a flood costs an accept each, not a task each.
//!
//! A body is read only by the handler that wants it, after the key is checked
//! ([`crate::authenticate`]), so an unauthenticated body is never read at all.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt as _;

/// How long a shutdown waits for open requests to finish (live tails and MCP streams do
/// not) before it closes their connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How long the loop pauses after an accept fails for want of resources (no file
/// descriptors left): retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What one connection may hold: `[http]` `header_read_timeout`, `body_read_timeout` and
/// `max_connections`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeLimits {
    /// A request's head (request line and headers) arrives within this long of the
    /// connection opening or finishing its previous response, or the connection is closed.
    pub header_read_timeout: Duration,
    /// A request's whole body arrives within this long of its head.
    pub body_read_timeout: Duration,
    /// Connections open at once; one more is closed when accepted.
    pub max_connections: usize,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            // A 1 MiB body (gateway.max_body_bytes) over a slow link, with room to spare.
            body_read_timeout: Duration::from_secs(30),
            max_connections: 512,
        }
    }
}

impl ServeLimits {
    pub fn validate(&self) -> Result<(), String> {
        if self.header_read_timeout.is_zero() || self.body_read_timeout.is_zero() {
            return Err(
                "http.header_read_timeout and http.body_read_timeout must be above 0 (for example \"10s\")".into(),
            );
        }
        if self.max_connections == 0 {
            return Err("http.max_connections must be at least 1".into());
        }
        Ok(())
    }
}

/// A request body that did not arrive within [`ServeLimits::body_read_timeout`].
#[derive(Debug, thiserror::Error)]
#[error(
    "the request body did not arrive within {0:?} of its headers (http.body_read_timeout); send the whole body at once"
)]
pub struct BodyTimedOut(pub Duration);

/// Serves `app` on `listener` within `limits` until `shutdown` completes; then stops
/// accepting, lets open requests finish for [`SHUTDOWN_GRACE`], and closes what is left.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // Every connection's task, so that none outlives the server (dropping the set aborts
    // them); finished ones are reaped as the loop goes.
    let mut connections = tokio::task::JoinSet::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut full_since: Option<std::time::Instant> = None;
    tokio::pin!(shutdown);
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept an http connection");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Closed at once: waiting for a slot would let a flood hold the accept queue.
            engram_telemetry::metrics::GATEWAY_ERRORS
                .with_label_values(&["too_many_connections"])
                .inc();
            if full_since.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                full_since = Some(std::time::Instant::now());
                tracing::warn!(
                    max_connections = limits.max_connections,
                    %peer,
                    "http connection refused: http.max_connections are open"
                );
            }
            drop(stream);
            continue;
        };
        let router = app.clone();
        let body_timeout = limits.body_read_timeout;
        let service = hyper::service::service_fn(move |request: hyper::Request<_>| {
            let request = request.map(|body| Body::new(DeadlineBody::new(body, body_timeout)));
            router.clone().oneshot(request)
        });
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        connections.spawn(async move {
            let _slot = slot;
            // A client that hung up, timed out or sent garbage: nothing to report.
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, %peer, "http connection ended");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::info!(
            open = connections.len(),
            "http connections still open after the shutdown grace; closing them"
        );
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// An accept error about one connection (it went before it was accepted), not the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// A body with a deadline for all of it, counted from when its request arrived. The timer
/// starts only when a read has to wait, so a request without a body costs none.
struct DeadlineBody<B> {
    inner: B,
    deadline: Instant,
    timeout: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl<B> DeadlineBody<B> {
    fn new(inner: B, timeout: Duration) -> Self {
        Self {
            inner,
            deadline: Instant::now() + timeout,
            timeout,
            sleep: None,
        }
    }
}

impl<B> http_body::Body for DeadlineBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimedOut(this.timeout))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether `error` (a body rejection's) is, somewhere in its chain, a body that timed out.
pub fn timed_out<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyTimedOut> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(t) = e.downcast_ref::<BodyTimedOut>() {
            return Some(t);
        }
        next = e.source();
    }
    None
}

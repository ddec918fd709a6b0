//! `GET /v1/tail`: a live tail of the caller's readable scopes over Server-Sent Events.
//!
//! An agent's key reaches no stream, so the tail is the replay endpoint paged on from the
//! client's last sequence: each event is sent as it is found, and an empty page waits a
//! moment before the next. A client that reconnects with `Last-Event-ID` (the last event's
//! seq, which every event carries as its SSE id) resumes where it stopped, without a gap or
//! a duplicate. Open tails are bounded per key and in all.
//!
//! A page says how far it read (`next_after`), events or not, and the next starts after it:
//! an idle tail's page reads nothing while nothing is appended, and one small direct get per
//! scope when only other scopes were written to, however much (`engram_query::replay`).
//!
//! Every error is JSON, as on every other route: before the stream starts, an [`ApiError`]
//! answer (a bad query string too); after, one `error` event whose data is the same
//! `{"error": {"code", "message"}}` body, and then the stream ends.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use engram_memory::proto;
use engram_schema::Scope;
use futures::Stream;

use crate::{ApiError, Gateway};

/// How long an empty page waits before the next read.
const IDLE_POLL: Duration = Duration::from_millis(250);

#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TailQuery {
    /// `kind:id`, one of the key's scopes.
    pub scope: String,
    /// Granted scopes to include too, comma separated `kind:id`.
    #[serde(default)]
    pub grants: Option<String>,
    /// Start after this sequence (0: from the start). `Last-Event-ID` overrides it.
    #[serde(default)]
    pub after_seq: u64,
}

pub(crate) async fn tail(
    State(g): State<Arc<Gateway>>,
    headers: HeaderMap,
    query: Result<Query<TailQuery>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    // The key first, as on every route: nothing is said about a request without one.
    let caller = g.caller(&headers).await?;
    let Query(q) = query.map_err(|r| {
        ApiError::invalid(format!(
            "the query string: {}; /v1/tail takes scope=<kind:id>, grants=<kind:id,...> and after_seq=<seq>",
            r.body_text()
        ))
    })?;
    let parse = |s: &str| {
        s.trim()
            .parse::<Scope>()
            .map_err(|e| ApiError::invalid(format!("scope {s:?}: {e}")))
    };
    let scope = parse(&q.scope)?;
    let grants = match q.grants.as_deref().filter(|g| !g.is_empty()) {
        Some(list) => list.split(',').map(parse).collect::<Result<Vec<_>, _>>()?,
        None => Vec::new(),
    };
    let after = match headers.get("last-event-id") {
        None => q.after_seq,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::invalid(
                    "Last-Event-ID must be the seq of the last event received (the SSE id every event carries)",
                )
            })?,
    };
    let mut request = proto::ReplayRequest {
        scopes: proto::ScopeRequest {
            tenant: caller.tenant().clone(),
            scope,
            grants,
        },
        after_seq: after,
        limit: 500,
    };
    // The first page is read before the response starts, so a scope the key may not read
    // is a 403, not an empty stream.
    let first = caller.client.replay_page(&request).await?;
    let permit = g.tail_permit(&caller.creds.public_key())?;
    let client = caller.client.clone();
    let stream = async_stream(move |tx| async move {
        let _permit = permit;
        let mut page = Some(first);
        loop {
            let current = match page.take() {
                Some(p) => p,
                None => match client.replay_page(&request).await {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = tx.send(error_event(ApiError::from(e))).await;
                        return;
                    }
                },
            };
            let empty = current.events.is_empty();
            for event in current.events {
                let sse = Event::default()
                    .id(event.seq.to_string())
                    .event("memory")
                    .json_data(&event)
                    .unwrap_or_else(|_| Event::default().comment("an event that does not encode"));
                if tx.send(sse).await.is_err() {
                    return;
                }
            }
            request.after_seq = current.next_after.max(request.after_seq);
            if empty || current.done {
                // An idle tail sends nothing, so no failed send tells it the client went:
                // watching the channel frees the slot (`max_tails_per_key`, `max_tails`)
                // as soon as the response is dropped.
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(IDLE_POLL) => {}
                }
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// An error after the stream started, as the one `error` event before it ends: the data is
/// the JSON body any route answers an error with.
fn error_event(e: ApiError) -> Event {
    engram_telemetry::metrics::GATEWAY_ERRORS
        .with_label_values(&[e.code])
        .inc();
    let body = serde_json::json!({"error": {"code": e.code, "message": e.message}});
    Event::default().event("error").data(body.to_string())
}

/// A stream fed by a task: it ends when the task returns or the client goes (the task's
/// next send fails, and it returns).
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Event>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) },
    )
}

impl Gateway {
    /// A slot for one open tail of key `id`, or 429 past the per-key or total bound.
    fn tail_permit(&self, id: &str) -> Result<TailPermit, ApiError> {
        let mut open = self.tails.lock().unwrap_or_else(|p| p.into_inner());
        let total: usize = open.values().sum();
        let mine = open.get(id).copied().unwrap_or(0);
        if mine >= self.config.max_tails_per_key || total >= self.config.max_tails {
            let mut err = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!(
                    "too many open tails ({mine} of this key, {total} in all; gateway.max_tails_per_key, gateway.max_tails); close one first"
                ),
            );
            err.retry_after = Some(Duration::from_secs(5));
            return Err(err);
        }
        *open.entry(id.to_owned()).or_default() += 1;
        Ok(TailPermit {
            tails: self.tails.clone(),
            id: id.to_owned(),
        })
    }
}

/// One open tail; dropping it frees its slot.
pub(crate) struct TailPermit {
    tails: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    id: String,
}

impl Drop for TailPermit {
    fn drop(&mut self) {
        let mut open = self.tails.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.id);
            }
        }
    }
}

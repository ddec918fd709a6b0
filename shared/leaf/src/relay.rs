//! The leaf's two relays, each a durable pull consumer on one of its own streams:
//! - **up**: the leaf's events stream, filtered to the scopes it may write, to its outbox.
//!   Only events first stored here go (no [`ORIGIN_HEADER`]): one that came down from the hub
//!   never goes back up.
//! - **down**: the inbox to the leaf's events stream, as a publish on the event's own subject
//!   (the leaf's stream computes its partition again). An event whose origin is this leaf
//!   is one that went up and came back: it is already here, and is dropped.
//!
//! Each hop keeps the event's `Nats-Msg-Id`, and a message is acknowledged only once its
//! publish is: a relay killed between the two sends it again on restart, and the target
//! stream drops the copy as a duplicate.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::pull};
use engram_access::leaf::{
    INBOX_STREAM, LeafCredentials, ORIGIN_HEADER, outbox_subject, publish_subject, scope_filter,
};
use engram_schema::SUBJECT_PREFIX;
use engram_telemetry::metrics::{LEAF_PENDING, LEAF_RELAYED};
use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;

use crate::{LeafError, js_err};

/// The up relay's durable consumer on the events stream.
pub const UP_CONSUMER: &str = "engram_leaf_up";
/// The down relay's durable consumer on the inbox.
pub const DOWN_CONSUMER: &str = "engram_leaf_down";

/// How many messages a relay moves per round trip.
const BATCH: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Up,
    Down,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Up => "up",
            Self::Down => "down",
        }
    }
}

/// Runs both relays until `stop`; each retries on its own after an error (the link or a
/// server going away is routine for a leaf).
pub fn spawn(
    js: jetstream::Context,
    events_stream: String,
    creds: LeafCredentials,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    engram_telemetry::metrics::touch_leaf();
    tokio::spawn(async move {
        let up = run(
            js.clone(),
            Direction::Up,
            events_stream.clone(),
            creds.clone(),
            stop.clone(),
        );
        let down = run(js, Direction::Down, events_stream, creds, stop);
        tokio::join!(up, down);
    })
}

async fn run(
    js: jetstream::Context,
    direction: Direction,
    events_stream: String,
    creds: LeafCredentials,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(200);
    while !stop.is_cancelled() {
        let result = tokio::select! {
            r = relay(&js, direction, &events_stream, &creds, &stop) => r,
            () = stop.cancelled() => Ok(()),
        };
        match result {
            Ok(()) => backoff = Duration::from_millis(200),
            Err(e) => {
                tracing::warn!(direction = direction.as_str(), error = %e, "leaf relay failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stop.cancelled() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// The consumer a relay reads with.
pub fn consumer_config(
    direction: Direction,
    creds: &LeafCredentials,
) -> (&'static str, pull::Config) {
    match direction {
        Direction::Up => (
            UP_CONSUMER,
            pull::Config {
                durable_name: Some(UP_CONSUMER.into()),
                description: Some("engram leaf: this leaf's own events to its outbox".into()),
                filter_subjects: engram_access::leaf::normalize(creds.writes.clone())
                    .iter()
                    .map(|p| scope_filter(SUBJECT_PREFIX, &creds.tenant, p))
                    .collect(),
                ack_policy: jetstream::consumer::AckPolicy::All,
                ack_wait: Duration::from_secs(30),
                max_ack_pending: 4 * BATCH as i64,
                ..Default::default()
            },
        ),
        Direction::Down => (
            DOWN_CONSUMER,
            pull::Config {
                durable_name: Some(DOWN_CONSUMER.into()),
                description: Some(
                    "engram leaf: the hub's events into this leaf's events stream".into(),
                ),
                ack_policy: jetstream::consumer::AckPolicy::All,
                ack_wait: Duration::from_secs(30),
                max_ack_pending: 4 * BATCH as i64,
                ..Default::default()
            },
        ),
    }
}

/// One relay's session: reads batches until an error or `stop`.
async fn relay(
    js: &jetstream::Context,
    direction: Direction,
    events_stream: &str,
    creds: &LeafCredentials,
    stop: &CancellationToken,
) -> Result<(), LeafError> {
    let source = match direction {
        Direction::Up => events_stream,
        Direction::Down => INBOX_STREAM,
    };
    let stream = js
        .get_stream(source)
        .await
        .map_err(|_| LeafError::Missing {
            stream: source.to_owned(),
        })?;
    let (name, config) = consumer_config(direction, creds);
    // Create or update in place: a changed filter keeps the consumer's position.
    let consumer: jetstream::consumer::PullConsumer =
        stream.create_consumer(config).await.map_err(js_err)?;
    let dir = direction.as_str();
    tracing::info!(direction = dir, consumer = name, "leaf relay started");
    while !stop.is_cancelled() {
        let mut batch = consumer
            .fetch()
            .max_messages(BATCH)
            .expires(Duration::from_secs(2))
            .messages()
            .await
            .map_err(js_err)?;
        // Acknowledged once per batch, with its last message (ack-all): every message is
        // either published or dropped by then.
        let mut pending = Vec::new();
        let mut last = None;
        while let Some(message) = batch.next().await {
            let message = message.map_err(js_err)?;
            if let Some(pending_count) = message.info().ok().map(|i| i.pending) {
                LEAF_PENDING
                    .with_label_values(&[dir])
                    .set(i64::try_from(pending_count).unwrap_or(i64::MAX));
            }
            match route(direction, &message, creds) {
                Route::Drop(outcome) => {
                    LEAF_RELAYED.with_label_values(&[dir, outcome]).inc();
                }
                Route::Send { subject, headers } => {
                    let ack = js
                        .publish_with_headers(subject, headers, message.payload.clone())
                        .await
                        .map_err(js_err)?;
                    pending.push(ack);
                }
            }
            last = Some(message);
        }
        // Acknowledged only once stored: after a publish that failed nothing of the batch
        // is acked, and all of it comes again after the consumer's ack wait (the copies
        // that were stored are dropped as duplicates).
        for ack in pending {
            if let Err(e) = ack.await {
                LEAF_RELAYED.with_label_values(&[dir, "failed"]).inc();
                if let Some(last) = &last {
                    let _ = last
                        .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                        .await;
                }
                return Err(js_err(e));
            }
            LEAF_RELAYED.with_label_values(&[dir, "sent"]).inc();
        }
        if let Some(last) = last {
            last.ack().await.map_err(js_err)?;
        }
    }
    Ok(())
}

enum Route {
    Drop(&'static str),
    Send { subject: String, headers: HeaderMap },
}

fn header<'a>(message: &'a jetstream::Message, name: &str) -> Option<&'a str> {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str())
}

fn route(direction: Direction, message: &jetstream::Message, creds: &LeafCredentials) -> Route {
    let subject = message.subject.as_str();
    let Some(msg_id) = header(message, "Nats-Msg-Id") else {
        return Route::Drop("invalid");
    };
    // Only the leaf's own tenant crosses, whatever a filter let through.
    let tenant_prefix = format!("{SUBJECT_PREFIX}.{}.", creds.tenant);
    if !subject.starts_with(&tenant_prefix) {
        return Route::Drop("invalid");
    }
    let origin = header(message, ORIGIN_HEADER);
    // The event's own headers go with it (its kind, its trace context); the server's
    // (`Nats-…`: where it was sourced from, what it expected) stay behind, but for its id.
    let mut headers = HeaderMap::new();
    if let Some(own) = &message.headers {
        for (name, values) in own.iter() {
            let name: &str = name.as_ref();
            if name.starts_with("Nats-") || name.eq_ignore_ascii_case(ORIGIN_HEADER) {
                continue;
            }
            for value in values {
                headers.append(name, value.as_str());
            }
        }
    }
    headers.insert("Nats-Msg-Id", msg_id);
    match direction {
        Direction::Up => {
            if origin.is_some() {
                return Route::Drop("not_local");
            }
            let Some(out) = outbox_subject(subject) else {
                return Route::Drop("invalid");
            };
            headers.insert(ORIGIN_HEADER, creds.leaf.as_str());
            Route::Send {
                subject: out,
                headers,
            }
        }
        Direction::Down => {
            if origin == Some(creds.leaf.as_str()) {
                return Route::Drop("echo");
            }
            let Some(publish) = publish_subject(subject) else {
                return Route::Drop("invalid");
            };
            headers.insert(ORIGIN_HEADER, origin.unwrap_or(&creds.hub_domain));
            Route::Send {
                subject: publish,
                headers,
            }
        }
    }
}

/// The relays' consumers' pending counts: (up, down).
pub async fn pending(js: &jetstream::Context, events_stream: &str) -> (u64, u64) {
    let mut out = [0u64; 2];
    for (i, (stream, consumer)) in [(events_stream, UP_CONSUMER), (INBOX_STREAM, DOWN_CONSUMER)]
        .into_iter()
        .enumerate()
    {
        if let Ok(stream) = js.get_stream(stream).await
            && let Ok(mut c) = stream.get_consumer::<pull::Config>(consumer).await
            && let Ok(info) = c.info().await
        {
            out[i] = info.num_pending + info.num_ack_pending as u64;
        }
    }
    (out[0], out[1])
}

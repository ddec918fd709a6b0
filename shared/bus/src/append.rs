//! Appending events.
//!
//! Every publish carries `Nats-Msg-Id = <tenant>:<event_id>` ([`dedup_key`]), so the stream
//! stores a retried append once within its duplicate window and acks the retry with the
//! original sequence. The stream deduplicates across all its subjects, so the key names the
//! tenant: two tenants that choose the same event id never collide, and no append of one
//! tenant can be taken for a retry of another's.

use std::error::Error as _;
use std::time::Instant;

use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::{self, context::PublishErrorKind};
use bytes::Bytes;
use engram_schema::{Envelope, subject_for};
use engram_telemetry::metrics;
use engram_telemetry::trace_context::{self, TraceContext};
use futures::stream::{FuturesOrdered, StreamExt};

use crate::{AppendError, Bus};

/// Header naming the event kind, so consumers can filter without decoding the payload.
pub const KIND_HEADER: &str = "Engram-Kind";

/// Header of an optimistic-concurrency append: what it expected to follow, in terms that
/// mean the same in every JetStream domain. Sequences do not (a leaf's stream numbers its
/// events its own way), event ids do: the id of the subject's last event when the append
/// was checked, or [`EXPECTS_EMPTY`]. Two events that expected the same predecessor were
/// written concurrently, on two sides of a cut link; whoever reads both sees the conflict
/// ([`crate::conflicts`]).
pub const EXPECTS_HEADER: &str = "Engram-Expects";
/// [`EXPECTS_HEADER`] of an append that expected an empty subject.
pub const EXPECTS_EMPTY: &str = "-";

/// The `Nats-Msg-Id` the stream deduplicates `event` by: `<tenant>:<event_id>`. A tenant
/// is a subject token, so it holds no `:` and the key splits one way only.
pub fn dedup_key(event: &Envelope) -> String {
    format!("{}:{}", event.tenant, event.event_id)
}

/// Per-append options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppendOptions {
    /// Optimistic concurrency: store only if the subject's last sequence is exactly this
    /// (0 means the subject must be empty). A mismatch is [`AppendError::Conflict`].
    pub expected_last_subject_seq: Option<u64>,
    /// The caller's trace; the event becomes a child span of it. `None` starts a new trace.
    pub trace: Option<TraceContext>,
}

/// Proof that an event is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendReceipt {
    /// Stream sequence: the consistency token for read-your-writes.
    pub seq: u64,
    /// True if this id was already stored; `seq` is then the original's sequence.
    pub duplicate: bool,
    pub subject: String,
    pub event_id: String,
    /// Encoded size of the event (the message payload), in bytes.
    pub bytes: usize,
}

/// What is kept of an event while its ack is pending; the message itself is handed over.
struct Prepared {
    subject: String,
    event_id: String,
    layer: &'static str,
    payload_len: usize,
    /// The stream's cap, reported when the server refuses the size.
    server_max: usize,
    /// How long to wait for the ack. async-nats bounds a publish ack by the context's
    /// *request* timeout, not its `ack_timeout`, so the bus enforces its own.
    ack_timeout: std::time::Duration,
}

impl Bus {
    fn prepare(
        &self,
        event: &Envelope,
        opts: &AppendOptions,
    ) -> Result<(Prepared, jetstream::message::PublishMessage), AppendError> {
        let payload = self.codec.encode(event)?;
        let payload_len = payload.len();
        let trace = opts
            .trace
            .map_or_else(TraceContext::new_root, |t| t.child());
        let mut message = jetstream::message::PublishMessage::build()
            .payload(Bytes::from(payload))
            .message_id(dedup_key(event).as_str())
            .header(KIND_HEADER, event.kind.as_str())
            .header(trace_context::HEADER, trace.to_string().as_str());
        if let Some(seq) = opts.expected_last_subject_seq {
            message = message.expected_last_subject_sequence(seq);
        }
        let prepared = Prepared {
            subject: subject_for(event),
            event_id: event.event_id.to_string(),
            layer: event.layer.as_str(),
            payload_len,
            server_max: usize::try_from(self.config.stream.max_msg_size).unwrap_or_default(),
            ack_timeout: self.config.ack_timeout,
        };
        Ok((prepared, message))
    }

    async fn send(
        &self,
        p: &Prepared,
        message: jetstream::message::PublishMessage,
    ) -> Result<Pending, AppendError> {
        // Subscribed before the publish, so a refusal of it cannot be missed.
        let refused = self.refused.subscribe();
        let ack = self
            .js
            .send_publish(p.subject.clone(), message)
            .await
            .map_err(|e| publish_error(e, p, None))?;
        Ok(Pending { ack, refused })
    }

    /// Stores one event and waits for its ack.
    // Debug level: at info, building this span for every event costs more than the encoding.
    #[tracing::instrument(
        name = "append",
        level = "debug",
        skip_all,
        fields(tenant = %event.tenant, scope = %event.scope, event_id = %event.event_id, seq)
    )]
    pub async fn append(
        &self,
        event: &Envelope,
        opts: AppendOptions,
    ) -> Result<AppendReceipt, AppendError> {
        let started = Instant::now();
        let result = async {
            let (prepared, mut message) = self.prepare(event, &opts)?;
            if let Some(seq) = opts.expected_last_subject_seq {
                let expects = self.event_id_at(seq, &prepared.subject).await?;
                message = message.header(EXPECTS_HEADER, expects.as_str());
            }
            let ack = self.send(&prepared, message).await?;
            finish(ack, &prepared, opts.expected_last_subject_seq).await
        }
        .await;
        record(&result, started, event.layer.as_str());
        if let Ok(receipt) = &result {
            tracing::Span::current().record("seq", receipt.seq);
        }
        result
    }

    /// Stores many events, pipelining publishes with at most `max_inflight` acks pending.
    /// Results come back in input order; one failure does not stop the others.
    #[tracing::instrument(name = "append_batch", level = "debug", skip_all, fields(events = events.len()))]
    pub async fn append_batch(
        &self,
        events: &[Envelope],
        max_inflight: usize,
    ) -> Vec<Result<AppendReceipt, AppendError>> {
        let max_inflight = max_inflight.max(1);
        let mut results: Vec<Option<Result<AppendReceipt, AppendError>>> =
            (0..events.len()).map(|_| None).collect();
        let mut inflight = FuturesOrdered::new();
        for (index, event) in events.iter().enumerate() {
            let started = Instant::now();
            let (prepared, message) = match self.prepare(event, &AppendOptions::default()) {
                Ok(p) => p,
                Err(e) => {
                    let r = Err(e);
                    record(&r, started, event.layer.as_str());
                    results[index] = Some(r);
                    continue;
                }
            };
            let ack = self.send(&prepared, message).await;
            inflight.push_back(async move {
                let r = match ack {
                    Ok(ack) => finish(ack, &prepared, None).await,
                    Err(e) => Err(e),
                };
                record(&r, started, prepared.layer);
                (index, r)
            });
            while inflight.len() >= max_inflight {
                if let Some((i, r)) = inflight.next().await {
                    results[i] = Some(r);
                }
            }
        }
        while let Some((i, r)) = inflight.next().await {
            results[i] = Some(r);
        }
        results
            .into_iter()
            .map(|r| r.expect("every index is filled exactly once"))
            .collect()
    }
}

impl Bus {
    /// The id of the event stored at `seq` ([`EXPECTS_EMPTY`] for 0), for an append that
    /// expects it to be the last on `subject`. One that is not an event of `subject` is
    /// named by its sequence (`#<seq>`): the server refuses the append anyway, since it is
    /// not the subject's last.
    async fn event_id_at(&self, seq: u64, subject: &str) -> Result<String, AppendError> {
        if seq == 0 {
            return Ok(EXPECTS_EMPTY.to_owned());
        }
        let stream = self
            .events_stream()
            .await
            .map_err(|e| AppendError::Unavailable(e.to_string()))?;
        match stream.direct_get(seq).await {
            Ok(message) => {
                let on_subject = message
                    .subject
                    .as_str()
                    .strip_prefix(subject)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'));
                match self.codec.decode(&message.payload) {
                    Ok(event) if on_subject => Ok(event.event_id.to_string()),
                    _ => Ok(format!("#{seq}")),
                }
            }
            Err(e) if e.kind() == async_nats::jetstream::stream::DirectGetErrorKind::NotFound => {
                Ok(format!("#{seq}"))
            }
            Err(e) => Err(AppendError::Unavailable(format!(
                "cannot read the event an optimistic append expects (seq {seq}): {e}"
            ))),
        }
    }
}

/// A sent publish: its ack, and the refusals the server reported since it was sent.
struct Pending {
    ack: PublishAckFuture,
    refused: tokio::sync::broadcast::Receiver<String>,
}

async fn finish(
    pending: Pending,
    p: &Prepared,
    expected: Option<u64>,
) -> Result<AppendReceipt, AppendError> {
    let Pending { ack, mut refused } = pending;
    let subject = p.subject.clone();
    let refusal = async move {
        loop {
            match refused.recv().await {
                Ok(s) if s == subject => return,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                // No refusals can come (a connection made elsewhere): only the ack decides.
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    std::future::pending::<()>().await
                }
            }
        }
    };
    let ack = tokio::select! {
        ack = tokio::time::timeout(p.ack_timeout, ack) => ack
            .map_err(|_| AppendError::Unavailable(format!("no ack within {:?}", p.ack_timeout)))?
            .map_err(|e| publish_error(e, p, expected))?,
        () = refusal => {
            return Err(AppendError::Forbidden {
                subject: p.subject.clone(),
                reason: "an agent writes only to its own tenant and to the scopes its key was issued for (`engram agent list`)".into(),
            })
        }
    };
    Ok(AppendReceipt {
        seq: ack.sequence,
        duplicate: ack.duplicate,
        subject: p.subject.clone(),
        event_id: p.event_id.clone(),
        bytes: p.payload_len,
    })
}

fn record(result: &Result<AppendReceipt, AppendError>, started: Instant, layer: &str) {
    let elapsed = started.elapsed().as_secs_f64();
    match result {
        Ok(r) if r.duplicate => {
            metrics::EVENTS_DUPLICATE.with_label_values(&[layer]).inc();
            metrics::APPEND_LATENCY
                .with_label_values(&["duplicate"])
                .observe(elapsed);
        }
        Ok(_) => {
            metrics::EVENTS_APPENDED.with_label_values(&[layer]).inc();
            metrics::APPEND_LATENCY
                .with_label_values(&["ok"])
                .observe(elapsed);
        }
        Err(e) => {
            metrics::APPEND_ERRORS.with_label_values(&[e.kind()]).inc();
            metrics::APPEND_LATENCY
                .with_label_values(&["error"])
                .observe(elapsed);
            tracing::debug!(error = %e, "append failed");
        }
    }
}

fn publish_error(
    e: jetstream::context::PublishError,
    p: &Prepared,
    expected: Option<u64>,
) -> AppendError {
    let server_code = e
        .source()
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(|j| j.error_code());
    match e.kind() {
        PublishErrorKind::WrongLastSequence => AppendError::Conflict {
            subject: p.subject.clone(),
            expected: expected.unwrap_or_default(),
        },
        PublishErrorKind::MaxPayloadExceeded => AppendError::TooLarge {
            size: p.payload_len,
            max: p.server_max,
        },
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::StreamNotFound
        | PublishErrorKind::MaxAckPending => AppendError::Unavailable(e.to_string()),
        // The stream cannot decide now, and will: an earlier attempt with this event id is
        // still being replicated (a retry that overtook it, typically while the leader has
        // lost its quorum), or the cluster has no leader for the stream yet. Another try
        // with the same id either finds it stored (a duplicate) or stores it once.
        _ if server_code.is_some_and(|code| {
            [
                jetstream::ErrorCode::STREAM_DUPLICATE_MESSAGE_CONFLICT,
                jetstream::ErrorCode::CLUSTER_NOT_AVAILABLE,
                jetstream::ErrorCode::CLUSTER_NOT_LEADER,
                jetstream::ErrorCode::CLUSTER_NOT_ACTIVE,
                jetstream::ErrorCode::STREAM_OFFLINE,
            ]
            .contains(&code)
        }) =>
        {
            AppendError::Unavailable(match e.source() {
                Some(source) => format!("{e}: {source}"),
                None => e.to_string(),
            })
        }
        _ if server_code == Some(jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
            AppendError::TooLarge {
                size: p.payload_len,
                max: p.server_max,
            }
        }
        _ => match e.source() {
            Some(source) => AppendError::Rejected(format!("{e}: {source}")),
            None => AppendError::Rejected(e.to_string()),
        },
    }
}

//! Phase 2: the physical reference. Plain JetStream publishes of the very sizes the engram
//! phase appended, to subjects of the same shape, each with a `Nats-Msg-Id` so the server does
//! the same dedup work. The gap between the two phases is what Engram's client side costs.
//!
//! The raw stream is a copy of the events stream's config (file storage, replicas, duplicate
//! window, max message size) under another name and subject space. It is deleted after the
//! run: it holds nothing but filler.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishErrorKind};
use bytes::Bytes;
use engram_bus::Bus;
use engram_schema::EventId;

use crate::BenchError;
use crate::driver::{Outcome, Sender};
use crate::engram::{RAW_SUBJECT_PREFIX, Trace};

/// Name of the reference stream.
pub const RAW_STREAM: &str = "BENCH_RAW";

/// Creates the reference stream, replacing a leftover from an interrupted run.
pub(crate) async fn create_stream(bus: &Bus) -> Result<(), BenchError> {
    let mut config = bus.wanted_stream_config();
    config.name = RAW_STREAM.to_owned();
    config.description = Some("engram bench-append raw reference; safe to delete".to_owned());
    config.subjects = vec![format!("{RAW_SUBJECT_PREFIX}>")];
    let js = bus.jetstream();
    // A stream of the same name can only be our own leftover: its content is filler.
    let _ = js.delete_stream(RAW_STREAM).await;
    js.create_stream(config)
        .await
        .map_err(|e| BenchError::RawStream(format!("cannot create {RAW_STREAM}: {e}")))?;
    Ok(())
}

pub(crate) async fn delete_stream(bus: &Bus) -> Result<(), BenchError> {
    bus.jetstream()
        .delete_stream(RAW_STREAM)
        .await
        .map_err(|e| BenchError::RawStream(format!("cannot delete {RAW_STREAM}: {e}")))?;
    Ok(())
}

/// One publisher of the raw phase, replaying one engram agent's trace.
pub(crate) struct RawPublisher {
    js: jetstream::Context,
    trace: Trace,
    /// Filler at least as long as the largest event; payloads are zero-copy slices of it.
    filler: Bytes,
    /// Next trace entry to replay. It restarts at 0 when measuring starts, so that a count
    /// run replays the engram phase's sizes exactly, in order; warm-up and longer runs cycle.
    next: usize,
    measuring: bool,
}

impl RawPublisher {
    pub(crate) fn new(js: jetstream::Context, trace: Trace, filler: Bytes) -> Self {
        assert!(
            !trace.events.is_empty(),
            "a raw publisher needs sizes to replay"
        );
        Self {
            js,
            trace,
            filler,
            next: 0,
            measuring: false,
        }
    }
}

pub(crate) struct RawMessage {
    subject: String,
    payload: Bytes,
    headers: HeaderMap,
}

impl Sender for RawPublisher {
    type Item = RawMessage;

    fn prepare(&mut self, measured: bool) -> RawMessage {
        if measured && !self.measuring {
            self.measuring = true;
            self.next = 0;
        }
        let (slot, size) = self.trace.events[self.next % self.trace.events.len()];
        self.next += 1;
        let mut headers = HeaderMap::new();
        // The same id format and length as an event id.
        headers.insert(async_nats::header::NATS_MESSAGE_ID, EventId::new().as_str());
        RawMessage {
            subject: self.trace.subjects[usize::from(slot)].clone(),
            payload: self.filler.slice(..size as usize),
            headers,
        }
    }

    async fn send(&self, message: RawMessage) -> Outcome {
        let bytes = message.payload.len();
        let published = self
            .js
            .publish_with_headers(message.subject, message.headers, message.payload)
            .await;
        let ack = match published {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match ack {
            Ok(ack) => Outcome::Stored {
                bytes,
                duplicate: ack.duplicate,
            },
            Err(e) => Outcome::Failed {
                kind: error_kind(e.kind()),
                message: e.to_string(),
            },
        }
    }
}

/// The engram bus's grouping of publish failures, so both phases' error kinds compare.
fn error_kind(kind: PublishErrorKind) -> &'static str {
    match kind {
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::StreamNotFound
        | PublishErrorKind::MaxAckPending => "unavailable",
        PublishErrorKind::MaxPayloadExceeded => "too_large",
        PublishErrorKind::WrongLastSequence => "conflict",
        _ => "rejected",
    }
}

/// Builds the shared filler buffer for payloads up to `max_size` bytes.
pub(crate) fn filler(max_size: usize) -> Bytes {
    Bytes::from(crate::workload::filler_text(max_size))
}

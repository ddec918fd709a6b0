//! Durable pull consumers for projectors, and the dead-letter stream.
//!
//! A projector owns its checkpoint (read-model state plus the last applied sequence, saved
//! together). The durable consumer only carries delivery: it is positioned from the
//! checkpoint, never the other way round. Acks use `AckPolicy::All` and are sent only after a
//! checkpoint, so the consumer's ack floor never passes what the projector has saved.
//!
//! Messages delivered but not acked before a crash would come back only after `ack_wait`,
//! behind newer ones, which would apply events out of order. So on open, a consumer that has
//! delivered past the checkpoint is deleted and recreated at `checkpoint + 1`: a restarted
//! projector always resumes in order, with no gap and nothing applied twice.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, consumer::AckPolicy, consumer::DeliverPolicy, consumer::pull};
use futures::StreamExt;

use crate::provision::{js_err, unavailable};
use crate::read::{StoredEvent, decode_message};
use crate::{Bus, BusError, ReadError};

/// Subjects of dead letters: `engram.dlq.<projector>`.
pub const DLQ_SUBJECT_PREFIX: &str = "engram.dlq";
/// The stream that keeps dead letters for inspection (`engram dlq` / `nats stream view`).
pub const DLQ_STREAM: &str = "ENGRAM_DLQ";

/// How long the server waits for an ack before redelivering. Acks follow checkpoints, so this
/// must be far longer than the checkpoint interval; redeliveries are skipped by sequence anyway.
const ACK_WAIT: Duration = Duration::from_secs(10 * 60);
/// A projector's consumer that nobody has pulled from for this long is deleted by the server:
/// the consumer of a partition's model on a node that has handed the partition over, or died.
/// A projector that comes back later recreates it at its checkpoint.
const INACTIVE_THRESHOLD: Duration = Duration::from_secs(60 * 60);
/// Events a projector may hold between checkpoints.
pub const MAX_ACK_PENDING: i64 = 1_000_000;

/// Whether `e` (from getting a consumer) says the server has no such consumer, as opposed
/// to not answering.
fn is_consumer_not_found(e: &async_nats::Error) -> bool {
    let text = e.to_string();
    text.contains("consumer not found") || text.contains("10014")
}

/// One delivered message of a durable consumer.
#[derive(Debug)]
pub struct Delivery {
    pub seq: u64,
    /// Messages after this one that the consumer has still to deliver.
    pub pending: u64,
    /// Times the server has delivered this message to the consumer, this time included:
    /// above 1 it is a redelivery (unacknowledged past the ack wait, or sent again by a new
    /// consumer leader).
    pub delivered: u64,
    /// The decoded event, or why it does not decode (a poison message).
    pub event: Result<StoredEvent, ReadError>,
    message: jetstream::Message,
}

impl Delivery {
    pub fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    pub fn payload(&self) -> &[u8] {
        &self.message.payload
    }

    /// Acks this message and, under `AckPolicy::All`, every one before it.
    pub async fn ack_through(&self) -> Result<(), BusError> {
        self.message
            .ack()
            .await
            .map_err(|e| BusError::Unavailable(format!("ack failed: {e}")))
    }
}

/// A durable consumer over every event, delivering in stream order.
pub struct DurableReader {
    name: String,
    messages: pull::Stream,
    codec: std::sync::Arc<engram_schema::Codec>,
    /// [`Bus::reconnections`]: after a reconnection the consumer, kept in the server's
    /// memory, may be gone with a restarted server; the reader then ends with an error so
    /// that its owner opens it again (recreating it at what it applied), rather than wait
    /// for missed heartbeats.
    reconnected: tokio::sync::watch::Receiver<u64>,
    /// The consumer sequence of the last delivery received. The server numbers every
    /// delivery of a consumer (redeliveries too) one after another, so a jump means
    /// deliveries were made that never arrived: on a cluster, sent by a consumer leader that
    /// died with them in flight, and counted as delivered by the leader after it. Acking
    /// past them (`AckPolicy::All`) would lose their events, so the reader ends instead and
    /// is opened again at what was applied.
    last_delivery: u64,
    /// A jump seen inside a batch, reported by the next call.
    gap: Option<(u64, u64)>,
}

impl std::fmt::Debug for DurableReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableReader")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Bus {
    /// Opens the durable consumer `name` so that its first delivery is the first event after
    /// `checkpoint` (0 means from the beginning). See the module docs for why an existing
    /// consumer that is ahead of the checkpoint is recreated.
    pub async fn durable_reader(
        &self,
        name: &str,
        checkpoint: u64,
        batch: usize,
    ) -> Result<DurableReader, BusError> {
        self.durable_reader_of(name, engram_schema::STORED_SUBJECTS, checkpoint, batch)
            .await
    }

    /// [`Bus::durable_reader`] over the events of `filter` only (a stored-subject filter,
    /// such as one partition's: [`engram_schema::partition_filter`]). Stream order holds
    /// within it.
    #[tracing::instrument(skip(self))]
    pub async fn durable_reader_of(
        &self,
        name: &str,
        filter: &str,
        checkpoint: u64,
        batch: usize,
    ) -> Result<DurableReader, BusError> {
        // Watched from before the consumer is checked: a reconnection after this point
        // makes the reader check again.
        let mut reconnected = self.reconnections();
        reconnected.mark_unchanged();
        let stream = self.events_stream().await?;
        let wanted = pull::Config {
            durable_name: Some(name.to_owned()),
            description: Some(format!("engram projector {name}")),
            filter_subject: filter.to_owned(),
            deliver_policy: if checkpoint == 0 {
                DeliverPolicy::All
            } else {
                DeliverPolicy::ByStartSequence {
                    start_sequence: checkpoint + 1,
                }
            },
            ack_policy: AckPolicy::All,
            ack_wait: ACK_WAIT,
            max_ack_pending: MAX_ACK_PENDING,
            inactive_threshold: INACTIVE_THRESHOLD,
            // The server would otherwise write a consumer's state to a file about ten times a
            // second while it delivers, for every model of every partition: a thousand file
            // creations and renames a second at 600 appends/s, most of nats-server's CPU. The
            // state is the projector's to keep (above), so one that a server restart loses
            // is recreated at what the projector has applied.
            memory_storage: true,
            ..Default::default()
        };
        // The consumer used is one seen to have delivered nothing past the checkpoint:
        // checked on every path, since a creation the server answers with an identical
        // existing consumer (its answer to a repeated create) may be ahead, and a request that
        // timed out may have been carried out.
        let mut last_delivery = 0;
        let mut positioned = false;
        // At most: delete one ahead, create, check.
        for _ in 0..4 {
            let mut existing = match stream.get_consumer::<pull::Config>(name).await {
                Ok(existing) => existing,
                Err(e) if is_consumer_not_found(&e) => {
                    stream
                        .create_consumer(wanted.clone())
                        .await
                        .map_err(js_err)?;
                    continue;
                }
                // Not knowing is no reason to create one: that could skip events.
                Err(e) => return Err(unavailable(e)),
            };
            let info = existing.info().await.map_err(js_err)?;
            let delivered = info.delivered.stream_sequence;
            let acked = info.ack_floor.stream_sequence;
            // Ahead of the checkpoint: unacked deliveries would come back out of order, and
            // ones that never arrived would be skipped. Behind it is fine: the projector
            // skips what it has already applied. A consumer made by an older engram, or for
            // another partition, filters on other subjects; it is recreated at the same point.
            let stale_filter = info.config.filter_subject != filter;
            // One kept on disk (made by an older engram) cannot be switched in place.
            let stale_storage = info.config.memory_storage != wanted.memory_storage;
            if delivered > checkpoint || acked > checkpoint || stale_filter || stale_storage {
                tracing::info!(
                    consumer = name,
                    checkpoint,
                    delivered,
                    acked,
                    stale_filter,
                    stale_storage,
                    "repositioning projector consumer at its checkpoint"
                );
                match stream.delete_consumer(name).await {
                    Ok(_) => {}
                    Err(e) if e.to_string().contains("not found") => {}
                    Err(e) => return Err(js_err(e)),
                }
                continue;
            }
            last_delivery = info.delivered.consumer_sequence;
            positioned = true;
            break;
        }
        if !positioned {
            return Err(BusError::Unavailable(format!(
                "consumer {name} could not be positioned at {checkpoint} (it kept being ahead of it); retrying"
            )));
        }
        let consumer: jetstream::consumer::Consumer<pull::Config> =
            stream.get_consumer(name).await.map_err(js_err)?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch)
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await
            .map_err(js_err)?;
        Ok(DurableReader {
            name: name.to_owned(),
            messages,
            codec: self.codec.clone(),
            reconnected,
            last_delivery,
            gap: None,
        })
    }

    /// Removes a projector's durable consumer (rebuild, or a projector taken out of service).
    pub async fn delete_durable(&self, name: &str) -> Result<bool, BusError> {
        let stream = self.events_stream().await?;
        match stream.delete_consumer(name).await {
            Ok(_) => Ok(true),
            Err(e) if e.to_string().contains("not found") => Ok(false),
            Err(e) => Err(js_err(e)),
        }
    }

    /// Records a message a projector cannot apply, so that it can skip it without losing it.
    /// The original bytes are kept; headers say where it came from and why it failed.
    /// `msg_id` makes a repeated dead-lettering of the same sequence a no-op, so it must be
    /// the same on every try and one no client can guess ahead (a client that published it
    /// first would have the real dead letter dropped as a duplicate): the projector framework
    /// uses a keyed hash of (projector, seq). A dead-letter stream found missing (deleted
    /// by hand) is recreated and the publish tried once more.
    pub async fn dead_letter(
        &self,
        projector: &str,
        seq: u64,
        msg_id: &str,
        subject: &str,
        payload: &[u8],
        reason: &str,
    ) -> Result<(), BusError> {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        headers.insert("Engram-Dlq-Seq", seq.to_string().as_str());
        headers.insert("Engram-Dlq-Subject", subject);
        // Header values are single-line.
        let reason: String = reason
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        headers.insert("Engram-Dlq-Reason", reason.as_str());
        let subject = format!("{DLQ_SUBJECT_PREFIX}.{projector}");
        let payload = bytes::Bytes::copy_from_slice(payload);
        match self.publish_dead_letter(&subject, &headers, &payload).await {
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                tracing::warn!(
                    stream = DLQ_STREAM,
                    projector,
                    seq,
                    "dead-letter stream is missing, recreating it"
                );
                self.provision_dead_letters().await?;
                self.publish_dead_letter(&subject, &headers, &payload)
                    .await
                    .map_err(unavailable)
            }
            other => other.map_err(unavailable),
        }
    }

    async fn publish_dead_letter(
        &self,
        subject: &str,
        headers: &HeaderMap,
        payload: &bytes::Bytes,
    ) -> Result<(), PublishError> {
        self.js
            .publish_with_headers(subject.to_owned(), headers.clone(), payload.clone())
            .await?
            .await?;
        Ok(())
    }

    /// Messages in the dead-letter stream for `projector`.
    pub async fn dead_letter_count(&self, projector: &str) -> Result<u64, BusError> {
        let stream = self.js.get_stream(DLQ_STREAM).await.map_err(js_err)?;
        let info = stream
            .info_with_subjects(format!("{DLQ_SUBJECT_PREFIX}.{projector}"))
            .await
            .map_err(js_err)?;
        let mut total = 0;
        let mut subjects = info;
        while let Some(entry) = subjects.next().await {
            total += entry.map_err(js_err)?.1 as u64;
        }
        Ok(total)
    }
}

impl DurableReader {
    /// Waits for the next message, then returns it with every message already buffered
    /// behind it (up to `max`): batches are large under load and single at the tail, so
    /// batching never adds latency. `None` means the consumer ended.
    pub async fn next_batch(&mut self, max: usize) -> Option<Result<Vec<Delivery>, BusError>> {
        if let Some(gap) = self.gap {
            return Some(Err(self.gap_error(gap)));
        }
        let first = tokio::select! {
            next = self.messages.next() => match next? {
                Ok(m) => m,
                Err(e) => return Some(Err(unavailable(e))),
            },
            Ok(()) = self.reconnected.changed() => {
                return Some(Err(BusError::Unavailable(format!(
                    "reconnected to nats: consumer {} is opened again, in case a restarted server lost it",
                    self.name
                ))));
            }
        };
        if let Err(gap) = self.in_sequence(&first) {
            return Some(Err(self.gap_error(gap)));
        }
        let mut batch = Vec::with_capacity(max.min(1024));
        batch.push(self.delivery(first));
        while batch.len() < max {
            match futures::FutureExt::now_or_never(self.messages.next()) {
                Some(Some(Ok(m))) => {
                    if let Err(gap) = self.in_sequence(&m) {
                        // What came before the jump is in order; the rest is not applied.
                        self.gap = Some(gap);
                        break;
                    }
                    batch.push(self.delivery(m));
                }
                Some(Some(Err(e))) => {
                    tracing::warn!(consumer = %self.name, error = %e, "consumer hiccup inside a batch");
                    break;
                }
                Some(None) | None => break,
            }
        }
        Some(Ok(batch))
    }

    /// Checks that `message` is the delivery after the last one received (or an earlier
    /// one again, from a consumer leader that had not heard of the later ones); the missing
    /// consumer sequences if it is not.
    fn in_sequence(&mut self, message: &jetstream::Message) -> Result<(), (u64, u64)> {
        let Ok(info) = message.info() else {
            return Ok(());
        };
        let delivery = info.consumer_sequence;
        if delivery > self.last_delivery + 1 {
            return Err((self.last_delivery + 1, delivery - 1));
        }
        self.last_delivery = delivery;
        Ok(())
    }

    fn gap_error(&self, (from, to): (u64, u64)) -> BusError {
        engram_telemetry::metrics::CONSUMER_GAPS.inc();
        tracing::warn!(
            consumer = %self.name,
            from,
            to,
            "deliveries of a projector consumer never arrived (its leader changed); opening it again at what was applied"
        );
        BusError::Unavailable(format!(
            "consumer {} skipped deliveries {from}..={to}; it is opened again at what was applied",
            self.name
        ))
    }

    fn delivery(&self, message: jetstream::Message) -> Delivery {
        let (pending, event) = decode_message(&self.codec, "project", &message);
        let info = message.info().ok();
        let seq = match &event {
            Ok(e) => e.seq,
            Err(ReadError::Decode { seq, .. }) => *seq,
            Err(ReadError::Consumer(_)) => info.as_ref().map_or(0, |i| i.stream_sequence),
        };
        // A message without JetStream info reads as a first delivery: it is no redelivery
        // anyone could act on.
        let delivered = info.map_or(1, |i| u64::try_from(i.delivered).unwrap_or(1));
        Delivery {
            seq,
            pending,
            delivered,
            event,
            message,
        }
    }
}

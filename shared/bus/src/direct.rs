//! Reading a page of the events stream without a consumer: batched direct gets
//! (`$JS.API.DIRECT.GET.<stream>` with `batch` and `next_by_subj`, nats-server 2.11+).
//!
//! A page read through an ordered consumer leaves that consumer on the server until its
//! inactivity threshold, and the server caps a stream's consumers (1,000 by default), so
//! pages from one caller could use up every other caller's. A direct get keeps no state on
//! the server: its answers are plain messages to the requester's inbox, ending with a
//! `204 EOB` status message that says how many messages of the filter are left.
//!
//! On a replicated stream any current replica may answer a direct get, and a replica can lag
//! the leader by a few messages: what a batch returns is a complete prefix of the filter's
//! messages, but "nothing more" may be stale. [`Bus::leader_next_seq`] asks the leader.

use chrono::{DateTime, Utc};
use futures::StreamExt as _;
use serde::Deserialize;

use crate::read::{Stored, decode_stored};
use crate::{Bus, BusError, ReadError, StoredEvent};

/// The events stream's bounds and replication, as its leader reported them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPosition {
    pub first_seq: u64,
    pub last_seq: u64,
    pub replicas: usize,
}

/// One batch of a filter's messages, in stream order.
#[derive(Debug)]
pub struct DirectBatch {
    /// One item per message; a [`ReadError::Decode`] item is a message that is no
    /// trustworthy event, which readers skip.
    pub items: Vec<Result<StoredEvent, ReadError>>,
    /// The sequence of the last message delivered (0 when none was).
    pub last_seq: u64,
    /// Messages of the filter after the batch when the server answered: 0 means the
    /// answering server held no more.
    pub pending: u64,
}

/// What a batch's end-of-batch message says.
const EOB_STATUS: u16 = 204;
const NUM_PENDING: &str = "Nats-Num-Pending";
const LAST_SEQUENCE: &str = "Nats-Last-Sequence";

impl Bus {
    /// The events stream's first and last sequence and its replicas: one stream-info
    /// request, no consumer list.
    pub async fn stream_position(&self) -> Result<StreamPosition, BusError> {
        let stream = self.events_stream().await?;
        let info = stream.cached_info();
        Ok(StreamPosition {
            first_seq: info.state.first_sequence,
            last_seq: info.state.last_sequence,
            replicas: info.config.num_replicas,
        })
    }

    /// At most `max_messages` messages on `filter` (a subject, wildcards allowed) from
    /// sequence `from_seq` on, and at most about `max_bytes` of them (the server stops after
    /// the message that reaches it): one batched direct get, answered at this connection's
    /// inbox. No consumer is created.
    pub async fn direct_batch(
        &self,
        filter: &str,
        from_seq: u64,
        max_messages: usize,
        max_bytes: usize,
    ) -> Result<DirectBatch, BusError> {
        let subject = format!("$JS.API.DIRECT.GET.{}", self.config.stream.name);
        let body = serde_json::json!({
            "seq": from_seq.max(1),
            "next_by_subj": filter,
            "batch": max_messages.max(1),
            "max_bytes": max_bytes.max(1),
        });
        let inbox = self.client.new_inbox();
        // Subscribed before the request is published, on the same connection, so no answer
        // can arrive before the subscription does. Dropping it unsubscribes.
        let mut answers = self.client.subscribe(inbox.clone()).await.map_err(|e| {
            BusError::Unavailable(format!("subscribing to a direct get's inbox: {e}"))
        })?;
        self.client
            .publish_with_reply(subject.clone(), inbox, body.to_string().into())
            .await
            .map_err(|e| BusError::Unavailable(format!("sending a direct get: {e}")))?;
        let deadline = tokio::time::Instant::now() + self.config.request_timeout;
        let mut batch = DirectBatch {
            items: Vec::new(),
            last_seq: 0,
            pending: 0,
        };
        loop {
            let message = match tokio::time::timeout_at(deadline, answers.next()).await {
                Ok(Some(message)) => message,
                Ok(None) => {
                    return Err(BusError::Unavailable(
                        "the connection closed during a direct get".into(),
                    ));
                }
                Err(_) => {
                    return Err(BusError::Unavailable(format!(
                        "a direct get of {filter} from seq {from_seq} was not answered within {:?}",
                        self.config.request_timeout
                    )));
                }
            };
            match message.status.map(|s| s.as_u16()) {
                None => batch.push(self, &message)?,
                Some(EOB_STATUS) => {
                    batch.pending = header_u64(&message, NUM_PENDING).unwrap_or(0);
                    if let Some(last) = header_u64(&message, LAST_SEQUENCE) {
                        batch.last_seq = batch.last_seq.max(last);
                    }
                    return Ok(batch);
                }
                // Nothing on the filter from `from_seq` on.
                Some(404) => return Ok(batch),
                Some(503) => {
                    return Err(BusError::Unavailable(format!(
                        "no server answers direct gets of stream {}: it is missing, or does not allow direct gets (allow_direct); `engram up` provisions it with them, or run `nats stream edit {} --allow-direct`",
                        self.config.stream.name, self.config.stream.name
                    )));
                }
                Some(code) => {
                    return Err(BusError::JetStream(format!(
                        "direct get of {filter} from seq {from_seq} refused: {code} {}",
                        message.description.as_deref().unwrap_or("")
                    )));
                }
            }
        }
    }

    /// The sequence of the first message on `filter` at or after `from_seq` that the server
    /// answering a direct get holds (`None`: it holds none). A direct get is answered apart
    /// from the JetStream API's queue, which requests wait in under load. A message found is
    /// certain (a replica holds a prefix of the stream, so none before it was missed); "none"
    /// may come from a replica that lags.
    pub async fn direct_next_seq(
        &self,
        filter: &str,
        from_seq: u64,
    ) -> Result<Option<u64>, BusError> {
        let subject = format!("$JS.API.DIRECT.GET.{}", self.config.stream.name);
        let body = serde_json::json!({"seq": from_seq.max(1), "next_by_subj": filter});
        let request = async_nats::Request::new()
            .payload(body.to_string().into())
            .timeout(Some(self.config.request_timeout));
        let message = self
            .client
            .send_request(subject, request)
            .await
            .map_err(|e| BusError::Unavailable(format!("a direct get of {filter}: {e}")))?;
        match message.status.map(|s| s.as_u16()) {
            None => header_u64(&message, "Nats-Sequence")
                .map(Some)
                .ok_or_else(|| {
                    BusError::JetStream(
                        "a direct get answered a message without Nats-Sequence".into(),
                    )
                }),
            Some(404) => Ok(None),
            Some(code) => Err(BusError::JetStream(format!(
                "direct get of {filter} from seq {from_seq} refused: {code} {}",
                message.description.as_deref().unwrap_or("")
            ))),
        }
    }

    /// The sequence of the first message on `filter` at or after `from_seq`, as the stream's
    /// leader holds it (`None`: there is none). A direct get first (see
    /// [`Bus::direct_next_seq`]), whose answer is certain when it finds one, or on a stream
    /// of one replica; else one JetStream API request to the leader.
    pub async fn leader_next_seq(
        &self,
        filter: &str,
        from_seq: u64,
    ) -> Result<Option<u64>, BusError> {
        match self.direct_next_seq(filter, from_seq).await {
            Ok(Some(seq)) => return Ok(Some(seq)),
            Ok(None) if self.config.stream.replicas <= 1 => return Ok(None),
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "direct get failed; asking the leader"),
        }
        #[derive(Deserialize)]
        struct Answer {
            message: Option<Found>,
            error: Option<ApiError>,
        }
        #[derive(Deserialize)]
        struct Found {
            seq: u64,
        }
        #[derive(Deserialize)]
        struct ApiError {
            err_code: u64,
            #[serde(default)]
            description: String,
        }
        /// JetStream's "no message found".
        const NO_MESSAGE_FOUND: u64 = 10037;
        let body = serde_json::json!({"seq": from_seq.max(1), "next_by_subj": filter});
        let answer: Answer = self
            .js
            .request(format!("STREAM.MSG.GET.{}", self.config.stream.name), &body)
            .await
            .map_err(|e| BusError::Unavailable(format!("asking the stream leader: {e}")))?;
        match (answer.message, answer.error) {
            (Some(found), _) => Ok(Some(found.seq)),
            (None, Some(e)) if e.err_code == NO_MESSAGE_FOUND => Ok(None),
            (None, Some(e)) => Err(BusError::JetStream(format!(
                "the stream leader refused a message get of {filter}: {} ({})",
                e.description, e.err_code
            ))),
            (None, None) => Err(BusError::JetStream(
                "the stream leader answered a message get with neither a message nor an error"
                    .into(),
            )),
        }
    }
}

impl DirectBatch {
    /// One answered message, from the stream's headers on it.
    fn push(&mut self, bus: &Bus, message: &async_nats::Message) -> Result<(), BusError> {
        let bad = |what: &str| {
            BusError::JetStream(format!("a direct get answered a message without {what}"))
        };
        let headers = message.headers.as_ref().ok_or_else(|| bad("headers"))?;
        let get = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
        let seq = get("Nats-Sequence")
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| bad("Nats-Sequence"))?;
        let subject = get("Nats-Subject").ok_or_else(|| bad("Nats-Subject"))?;
        let stored_at = get("Nats-Time-Stamp")
            .and_then(|v| DateTime::parse_from_rfc3339(&v).ok())
            .map(|t| t.with_timezone(&Utc))
            .ok_or_else(|| bad("Nats-Time-Stamp"))?;
        let pending = get(NUM_PENDING)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        self.last_seq = self.last_seq.max(seq);
        self.pending = pending;
        self.items.push(decode_stored(
            bus.codec(),
            "replay",
            Stored {
                seq,
                subject,
                stored_at,
                pending,
                headers: Some(headers),
                payload: &message.payload,
            },
        ));
        Ok(())
    }
}

fn header_u64(message: &async_nats::Message, name: &str) -> Option<u64> {
    message.headers.as_ref()?.get(name)?.as_str().parse().ok()
}

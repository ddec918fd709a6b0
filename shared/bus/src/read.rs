//! Reading the stream: `replay` up to the live end, and `tail` from now on.
//!
//! Both use ordered consumers: ephemeral, flow-controlled, and recreated by the client on a
//! gap, so they deliver each message once and in stream order without server-side state.

use std::pin::Pin;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use chrono::{DateTime, Utc};
use engram_schema::subject::subject_matches;
use engram_schema::{Envelope, SchemaError, SubjectFilter, subject_for};
use engram_telemetry::metrics;
use engram_telemetry::trace_context::{self, TraceContext};
use futures::{Stream, StreamExt};

use crate::provision::{is_not_found, js_err, unavailable};
use crate::{Bus, BusError, ReadError};

/// Where a replay starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartAt {
    /// From the first event still in the stream.
    Beginning,
    /// From this stream sequence on (inclusive).
    Seq(u64),
    /// From the first event stored at or after this time.
    Time(DateTime<Utc>),
}

/// An event as stored, with where and when the stream stored it.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredEvent {
    pub seq: u64,
    pub subject: String,
    /// Server time of storage.
    pub stored_at: DateTime<Utc>,
    /// Events matching the filter after this one, when it was delivered.
    pub pending: u64,
    pub trace: Option<TraceContext>,
    /// What an optimistic-concurrency append expected to follow
    /// ([`crate::append::EXPECTS_HEADER`]); `None` for an ordinary append.
    pub expects: Option<String>,
    pub event: Envelope,
}

/// Items of [`Bus::replay`] and [`Bus::tail`]. A `ReadError::Decode` item is one bad message
/// (bytes that are no event, or an event on a subject that is not its own); the stream goes
/// on after it.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<StoredEvent, ReadError>> + Send>>;

impl Bus {
    /// Replays matching events from `start` until the reader has caught up with the stream's
    /// end, then ends. Events appended during the replay are included until it catches up.
    pub async fn replay(
        &self,
        filter: &SubjectFilter,
        start: StartAt,
    ) -> Result<EventStream, BusError> {
        Ok(self.replay_counted(filter, start).await?.1)
    }

    /// [`Bus::replay`], plus how many matching events existed when it started (the replay
    /// may deliver more, if more are appended before it catches up). For progress bars.
    #[tracing::instrument(skip(self), fields(filter = %filter))]
    pub async fn replay_counted(
        &self,
        filter: &SubjectFilter,
        start: StartAt,
    ) -> Result<(u64, EventStream), BusError> {
        let policy = match start {
            StartAt::Beginning => DeliverPolicy::All,
            StartAt::Seq(seq) => DeliverPolicy::ByStartSequence {
                start_sequence: seq.max(1),
            },
            StartAt::Time(t) => DeliverPolicy::ByStartTime {
                start_time: time::OffsetDateTime::from_unix_timestamp_nanos(
                    t.timestamp_nanos_opt().unwrap_or_default().into(),
                )
                .map_err(|e| BusError::JetStream(format!("invalid start time: {e}")))?,
            },
        };
        self.read(filter, policy, "replay", true).await
    }

    /// Delivers matching events appended from now on, until dropped.
    #[tracing::instrument(skip(self), fields(filter = %filter))]
    pub async fn tail(&self, filter: &SubjectFilter) -> Result<EventStream, BusError> {
        Ok(self
            .read(filter, DeliverPolicy::New, "tail", false)
            .await?
            .1)
    }

    async fn read(
        &self,
        filter: &SubjectFilter,
        policy: DeliverPolicy,
        mode: &'static str,
        stop_when_caught_up: bool,
    ) -> Result<(u64, EventStream), BusError> {
        let stream = self.events_stream().await?;
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: filter.to_subject(),
                deliver_policy: policy,
                ..Default::default()
            })
            .await
            .map_err(js_err)?;
        let pending = consumer.cached_info().num_pending;
        if stop_when_caught_up && pending == 0 {
            return Ok((0, Box::pin(futures::stream::empty())));
        }
        let messages = consumer.messages().await.map_err(js_err)?;
        let codec = self.codec.clone();
        let decoded = messages.map(move |message| match message {
            Ok(message) => decode_message(&codec, mode, &message),
            // A consumer error ends a replay: report it as the last item.
            Err(e) => (0, Err(ReadError::Consumer(e.to_string()))),
        });
        let stream: EventStream = if stop_when_caught_up {
            // `pending` counts matching messages after this one; 0 means this is the last
            // one that existed when it was delivered. Undecodable messages count too.
            // Ends right after the last item instead of waiting for one more message, which
            // might never come.
            Box::pin(futures::stream::unfold(
                (Box::pin(decoded), false),
                |(mut inner, done)| async move {
                    if done {
                        return None;
                    }
                    let (pending, item) = inner.next().await?;
                    Some((item, (inner, pending == 0)))
                },
            ))
        } else {
            Box::pin(decoded.map(|(_, item)| item))
        };
        Ok((pending, stream))
    }

    pub(crate) async fn events_stream(
        &self,
    ) -> Result<async_nats::jetstream::stream::Stream, BusError> {
        self.js
            .get_stream(&self.config.stream.name)
            .await
            .map_err(|e| {
                if is_not_found(&e) {
                    BusError::StreamMissing(self.config.stream.name.clone())
                } else {
                    unavailable(e)
                }
            })
    }

    /// The events stream's replication as the server reports it now (its leader and each
    /// replica's state), with its message count: one stream-info request. `None` on a
    /// stream kept on one server.
    pub async fn events_cluster(
        &self,
    ) -> Result<Option<(async_nats::jetstream::stream::ClusterInfo, u64)>, BusError> {
        let stream = self.events_stream().await?;
        let info = stream.cached_info();
        Ok(info.cluster.clone().map(|c| (c, info.state.messages)))
    }

    /// Whether `server` (a `server_name`) holds a current copy of the stream `raft` describes:
    /// it leads it, or follows it with nothing left to catch up.
    pub fn holds_current_copy(
        raft: &async_nats::jetstream::stream::ClusterInfo,
        server: &str,
    ) -> bool {
        raft.leader.as_deref() == Some(server)
            || raft
                .replicas
                .iter()
                .any(|r| r.name == server && r.current && r.lag.unwrap_or(0) == 0)
    }

    /// The events stream's last sequence: one stream-info request, for lag samplers.
    pub async fn stream_last_seq(&self) -> Result<u64, BusError> {
        let stream = self.events_stream().await?;
        Ok(stream.cached_info().state.last_sequence)
    }

    /// Stream state and its consumers, for `engram streams` and health checks.
    /// Removes every event on `subject` (a filter such as `engram.evt.acme.task.t1.*`) below
    /// sequence `below` from the events stream (erasure); returns how many. Each is deleted
    /// with an erase, which overwrites its bytes in the store (a purge only unlinks them);
    /// a final purge by subject takes anything the listing missed. Admin only: no other
    /// identity may delete or purge.
    pub async fn purge_events(&self, subject: &str, below: u64) -> Result<u64, BusError> {
        let stream = self.events_stream().await?;
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: subject.to_owned(),
                deliver_policy: DeliverPolicy::All,
                headers_only: true,
                ..Default::default()
            })
            .await
            .map_err(js_err)?;
        let mut seqs = Vec::new();
        if consumer.cached_info().num_pending > 0 {
            let mut messages = consumer.messages().await.map_err(js_err)?;
            while let Some(message) = messages.next().await {
                let message = message.map_err(js_err)?;
                let info = message.info().map_err(js_err)?;
                if info.stream_sequence < below {
                    seqs.push(info.stream_sequence);
                }
                if info.pending == 0 || info.stream_sequence + 1 >= below {
                    break;
                }
            }
        }
        let mut erased = 0;
        for seq in seqs {
            if stream
                .delete_message(seq)
                .await
                .map_err(|e| BusError::JetStream(format!("erasing seq {seq}: {e}")))?
            {
                erased += 1;
            }
        }
        let purged = stream
            .purge()
            .filter(subject)
            .sequence(below)
            .await
            .map_err(|e| BusError::JetStream(format!("purging {subject}: {e}")))?;
        Ok(erased + purged.purged)
    }

    /// How many events the stream holds on `subject` (a filter): one stream-info request.
    pub async fn events_on(&self, subject: &str) -> Result<u64, BusError> {
        use futures::StreamExt as _;
        let stream = self.events_stream().await?;
        let mut subjects = stream.info_with_subjects(subject).await.map_err(js_err)?;
        let mut n = 0;
        while let Some(entry) = subjects.next().await {
            n += entry.map_err(js_err)?.1 as u64;
        }
        Ok(n)
    }

    /// The subjects the events stream holds under `filter`, with their counts: at most
    /// `max`, and whether there were more. One stream-info request per page of subjects.
    pub async fn subject_counts(
        &self,
        filter: &str,
        max: usize,
    ) -> Result<(Vec<(String, u64)>, bool), BusError> {
        use futures::StreamExt as _;
        let stream = self.events_stream().await?;
        let mut subjects = stream.info_with_subjects(filter).await.map_err(js_err)?;
        let mut out = Vec::new();
        while let Some(entry) = subjects.next().await {
            if out.len() == max {
                return Ok((out, true));
            }
            let (subject, n) = entry.map_err(js_err)?;
            out.push((subject, n as u64));
        }
        Ok((out, false))
    }

    /// The events stream's first and last sequence: one stream-info request, no consumer
    /// list.
    pub async fn stream_bounds(&self) -> Result<(u64, u64), BusError> {
        let state = self.stream_state().await?;
        Ok((state.first_seq, state.last_seq))
    }

    /// The events stream's sequences and size: one stream-info request. What every hot path
    /// asks (read-your-writes checks, replays, health, metrics) instead of
    /// [`stream_summary`](Self::stream_summary), whose consumer list makes the server count
    /// every consumer's pending events: with a consumer per partition and model that was
    /// most of the server's work under load.
    pub async fn stream_state(&self) -> Result<StreamState, BusError> {
        let stream = self.events_stream().await?;
        let info = stream.cached_info();
        let state = &info.state;
        Ok(StreamState {
            first_seq: state.first_sequence,
            last_seq: state.last_sequence,
            messages: state.messages,
            bytes: state.bytes,
            leader: info
                .cluster
                .as_ref()
                .and_then(|c| c.leader.clone())
                .filter(|l| !l.is_empty()),
        })
    }

    pub async fn stream_summary(&self) -> Result<StreamSummary, BusError> {
        let mut stream = self.events_stream().await?;
        let info = stream.info().await.map_err(js_err)?.clone();
        let mut consumers = Vec::new();
        let mut list = stream.consumers();
        while let Some(c) = list.next().await {
            let c = c.map_err(js_err)?;
            consumers.push(ConsumerSummary {
                name: c.name,
                filter: c.config.filter_subject,
                num_pending: c.num_pending,
                num_ack_pending: c.num_ack_pending as u64,
                delivered_seq: c.delivered.stream_sequence,
            });
        }
        Ok(StreamSummary {
            name: info.config.name,
            subjects: info.config.subjects,
            replicas: info.config.num_replicas,
            messages: info.state.messages,
            bytes: info.state.bytes,
            first_seq: info.state.first_sequence,
            last_seq: info.state.last_sequence,
            subjects_count: info.state.subjects_count,
            duplicate_window_secs: info.config.duplicate_window.as_secs(),
            max_msg_size: info.config.max_message_size,
            consumers,
        })
    }
}

/// The events stream's sequences, size and leader ([`Bus::stream_state`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StreamState {
    pub first_seq: u64,
    pub last_seq: u64,
    pub messages: u64,
    pub bytes: u64,
    /// The server leading the stream (its `server_name`), as the server that answered knows
    /// it: the one server of a stream kept on one; `None` while an election is under way.
    pub leader: Option<String>,
}

/// What `engram streams` shows (its consumer list is costly: see [`Bus::stream_state`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct StreamSummary {
    pub name: String,
    pub subjects: Vec<String>,
    pub replicas: usize,
    pub messages: u64,
    pub bytes: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub subjects_count: u64,
    pub duplicate_window_secs: u64,
    pub max_msg_size: i32,
    pub consumers: Vec<ConsumerSummary>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ConsumerSummary {
    pub name: String,
    pub filter: String,
    pub num_pending: u64,
    pub num_ack_pending: u64,
    pub delivered_seq: u64,
}

/// Decodes one delivered message; returns the consumer's pending count with the result.
pub(crate) fn decode_message(
    codec: &engram_schema::Codec,
    mode: &'static str,
    message: &async_nats::jetstream::Message,
) -> (u64, Result<StoredEvent, ReadError>) {
    let info = match message.info() {
        Ok(info) => info,
        Err(e) => {
            return (
                0,
                Err(ReadError::Consumer(format!(
                    "message without jetstream info: {e}"
                ))),
            );
        }
    };
    let (seq, pending) = (info.stream_sequence, info.pending);
    let stored_at = DateTime::<Utc>::from_timestamp_nanos(
        i64::try_from(info.published.unix_timestamp_nanos()).unwrap_or_default(),
    );
    let stored = Stored {
        seq,
        subject: message.subject.to_string(),
        stored_at,
        pending,
        headers: message.headers.as_ref(),
        payload: &message.payload,
    };
    (pending, decode_stored(codec, mode, stored))
}

/// A message as the stream stored it, however it was read (a consumer's delivery or a
/// direct get).
pub(crate) struct Stored<'a> {
    pub seq: u64,
    pub subject: String,
    pub stored_at: DateTime<Utc>,
    pub pending: u64,
    pub headers: Option<&'a async_nats::HeaderMap>,
    pub payload: &'a [u8],
}

/// Decodes one stored message into an event, or says why it is no trustworthy event.
pub(crate) fn decode_stored(
    codec: &engram_schema::Codec,
    mode: &'static str,
    stored: Stored<'_>,
) -> Result<StoredEvent, ReadError> {
    let Stored {
        seq,
        subject,
        stored_at,
        pending,
        headers,
        payload,
    } = stored;
    let trace = headers
        .and_then(|h| h.get(trace_context::HEADER))
        .and_then(|v| TraceContext::parse(v.as_str()));
    // Sourced from a leaf's outbox: the hub wrote this header itself (it drops any a
    // message came with), naming the filter of the source it came through and the subject
    // the leaf delivered it on. A leaf server that does not honour the filter (a modified
    // binary) could deliver any subject; one outside the filter is no event of this leaf.
    if let Some(source) = headers.and_then(|h| h.get("Nats-Stream-Source"))
        && !leaf_source_kept_its_filter(source.as_str())
    {
        metrics::EVENTS_READ
            .with_label_values(&[mode, "forged_source"])
            .inc();
        tracing::warn!(seq, subject = %subject, source = source.as_str(), "skipping event a leaf delivered outside its source's filter");
        return Err(ReadError::Decode {
            seq,
            subject,
            source: SchemaError::InvalidField {
                field: "Nats-Stream-Source",
                reason: "a leaf delivered it on a subject its source's filter does not take".into(),
            },
        });
    }
    match codec.decode(payload) {
        // Decoded, but published where it does not belong: the subject is what stream
        // permissions, filters and optimistic concurrency went by, the envelope is what every
        // reader trusts, and a message whose two disagree is neither's. Poison, never applied.
        Ok(event) if !subject_matches(&event, &subject) => {
            let expected = subject_for(&event);
            metrics::EVENTS_READ
                .with_label_values(&[mode, "subject_mismatch"])
                .inc();
            tracing::warn!(seq, subject = %subject, expected = %expected, "skipping event published on a subject that is not its own");
            Err(ReadError::Decode {
                seq,
                subject,
                source: SchemaError::InvalidField {
                    field: "subject",
                    reason: format!(
                        "the envelope (tenant, scope, layer) belongs on {expected}; an event is only trusted on its own subject, so publish it there (the SDK and `engram append` do)"
                    ),
                },
            })
        }
        // Its dedup key names another tenant: published to take the place of that tenant's
        // append (the stream would drop the real one as a retry). Never applied, so the
        // attempt gains nothing but a dead letter. The bare event id is the key before
        // tenant-qualified keys, and collides with no qualified one.
        Ok(event) if !dedup_key_matches(&event, headers) => {
            metrics::EVENTS_READ
                .with_label_values(&[mode, "forged_dedup_key"])
                .inc();
            tracing::warn!(seq, subject = %subject, "skipping event whose dedup key names another tenant");
            Err(ReadError::Decode {
                seq,
                subject,
                source: SchemaError::InvalidField {
                    field: "Nats-Msg-Id",
                    reason: format!(
                        "an event's Nats-Msg-Id is <tenant>:<event id>, here {}; publish it with that header (the SDK and `engram append` do)",
                        crate::append::dedup_key(&event)
                    ),
                },
            })
        }
        Ok(event) => {
            metrics::EVENTS_READ.with_label_values(&[mode, "ok"]).inc();
            Ok(StoredEvent {
                seq,
                subject,
                stored_at,
                pending,
                trace,
                expects: headers
                    .and_then(|h| h.get(crate::append::EXPECTS_HEADER))
                    .map(|v| v.as_str().chars().take(128).collect()),
                event,
            })
        }
        Err(source) => {
            metrics::EVENTS_READ
                .with_label_values(&[mode, "undecodable"])
                .inc();
            tracing::warn!(seq, subject = %subject, error = %source, "skipping undecodable event");
            Err(ReadError::Decode {
                seq,
                subject,
                source,
            })
        }
    }
}

/// Whether a `Nats-Stream-Source` header (`<stream>:<hash> <seq> <filter> <transform>
/// <delivered subject> …`, written by the sourcing server) of a message sourced from a
/// leaf's outbox names a delivered subject its filter takes. Any other source is not a
/// leaf's, and passes.
fn leaf_source_kept_its_filter(source: &str) -> bool {
    let tokens: Vec<&str> = source.split(' ').collect();
    let from_outbox = tokens
        .first()
        .and_then(|s| s.split(':').next())
        .is_some_and(|s| s == engram_access::leaf::OUTBOX_STREAM);
    if !from_outbox {
        return true;
    }
    match (tokens.get(2), tokens.get(4)) {
        (Some(filter), Some(delivered)) => subject_in(delivered, filter),
        _ => false,
    }
}

/// NATS subject matching: `*` one token, `>` the rest (at least one).
fn subject_in(subject: &str, filter: &str) -> bool {
    let (mut s, mut f) = (subject.split('.'), filter.split('.'));
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Whether `headers` carry no dedup key, `event`'s own ([`crate::append::dedup_key`]), or
/// the bare event id that keyed events before keys named their tenant.
fn dedup_key_matches(
    event: &engram_schema::Envelope,
    headers: Option<&async_nats::HeaderMap>,
) -> bool {
    let Some(key) = headers.and_then(|h| h.get("Nats-Msg-Id")) else {
        return true;
    };
    let key = key.as_str();
    let id = event.event_id.as_str();
    key == id
        || key
            .strip_suffix(id)
            .and_then(|k| k.strip_suffix(':'))
            .is_some_and(|tenant| tenant == event.tenant.as_str())
}

#[cfg(test)]
mod leaf_source_tests {
    use super::*;

    #[test]
    fn a_leaf_delivery_outside_its_filter_is_refused_and_others_pass() {
        let kept = "ENGRAM_LEAF_OUTBOX:KULbcpqa 1 engram.out.acme.task.*.*.* engram.evt.acme.task.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}} engram.out.acme.task.t1.episodic.1 gwQVb3mm";
        let forged = "ENGRAM_LEAF_OUTBOX:KULbcpqa 2 engram.out.acme.task.*.*.* engram.evt.acme.task.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}} engram.evt.beta.task.t1.episodic.1 gwQVb3mm";
        let other = "SOMETHING:x 1 > > a.b";
        assert!(leaf_source_kept_its_filter(kept));
        assert!(!leaf_source_kept_its_filter(forged));
        assert!(!leaf_source_kept_its_filter("ENGRAM_LEAF_OUTBOX:x 1"));
        assert!(leaf_source_kept_its_filter(other));
        assert!(
            subject_in("a.b.c", "a.>") && !subject_in("a", "a.>") && !subject_in("a.b", "a.*.c")
        );
    }
}

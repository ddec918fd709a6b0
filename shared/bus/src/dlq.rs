//! Reading and clearing the dead-letter stream: what `engram dlq` lists and shows, and what
//! a redrive removes before it rebuilds a projector.
//!
//! A dead letter (see [`Bus::dead_letter`]) is the original event bytes on
//! `engram.dlq.<projector>`, with headers saying which event it was (`Engram-Dlq-Seq`,
//! `Engram-Dlq-Subject`) and why it failed (`Engram-Dlq-Reason`). This module only reads
//! them and purges one projector's letters; it never writes one and never touches the events
//! stream, which keeps every event whatever happens here.

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::{self, RawMessageErrorKind};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use engram_schema::{Codec, Envelope, SchemaError};
use futures::StreamExt;
use thiserror::Error;

use crate::provision::is_not_found;
use crate::{Bus, BusError, DLQ_STREAM, DLQ_SUBJECT_PREFIX};

/// How many dead letters a listing returns when the caller names no limit.
pub const DEFAULT_LIST_LIMIT: usize = 100;
/// The most a listing returns: a listing holds every letter (payload included) in memory.
pub const MAX_LIST_LIMIT: usize = 10_000;

/// One message of the dead-letter stream.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetter {
    /// Its sequence in the dead-letter stream: what `engram dlq show` takes.
    pub dlq_seq: u64,
    /// The projector that could not apply the event (the last token of its subject).
    pub projector: String,
    /// The event's sequence in the events stream; `None` if the header is missing.
    pub event_seq: Option<u64>,
    /// The subject the event was published on; `None` if the header is missing.
    pub subject: Option<String>,
    /// Why the projector refused it.
    pub reason: String,
    /// When the dead-letter stream stored it.
    pub stored_at: DateTime<Utc>,
    /// The original event bytes, as published.
    pub payload: Bytes,
}

impl DeadLetter {
    /// Decodes the original bytes as an event; an error says why they are no event (the
    /// usual reason it was dead-lettered).
    pub fn decode(&self, codec: &Codec) -> Result<Envelope, SchemaError> {
        codec.decode(&self.payload)
    }

    fn from_parts(
        dlq_seq: u64,
        subject: &str,
        headers: Option<&HeaderMap>,
        stored_at: DateTime<Utc>,
        payload: Bytes,
    ) -> Option<Self> {
        let projector = subject
            .strip_prefix(DLQ_SUBJECT_PREFIX)?
            .strip_prefix('.')?
            .to_owned();
        let header = |name: &str| {
            headers
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
        Some(Self {
            dlq_seq,
            projector,
            event_seq: header("Engram-Dlq-Seq").and_then(|s| s.parse().ok()),
            subject: header("Engram-Dlq-Subject"),
            reason: header("Engram-Dlq-Reason").unwrap_or_default(),
            stored_at,
            payload,
        })
    }
}

/// Which event one dead letter is for, without its payload: what a verifier needs to tell a
/// dead-lettered event from a lost one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterRef {
    pub dlq_seq: u64,
    pub projector: String,
    /// `None` if the letter lacks the `Engram-Dlq-Seq` header (not written by a projector).
    pub event_seq: Option<u64>,
    /// The subject the event was published on (`Engram-Dlq-Subject`), if the letter says.
    pub subject: Option<String>,
}

/// A page of dead letters, oldest first.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetters {
    pub letters: Vec<DeadLetter>,
    /// Matching letters in the stream when the listing started; more than `letters.len()`
    /// when the limit cut the listing short.
    pub total: u64,
}

/// Why reading or purging dead letters failed.
#[derive(Debug, Error)]
pub enum DlqError {
    #[error("limit {limit} is out of range; use 1 to {MAX_LIST_LIMIT}")]
    LimitOutOfRange { limit: usize },
    #[error(
        "projector name {name:?} cannot name a dead-letter subject; use a projector name such as vector, keyword, facts or skills"
    )]
    InvalidProjector { name: String },
    #[error(
        "the dead-letter stream {DLQ_STREAM} does not exist; `engram up` creates it (and a projector recreates it when it dead-letters an event)"
    )]
    StreamMissing,
    #[error(
        "no dead letter at seq {dlq_seq} in {DLQ_STREAM}; `engram dlq list` shows the ones there are"
    )]
    NotFound { dlq_seq: u64 },
    #[error(
        "message {dlq_seq} in {DLQ_STREAM} is on {subject}, not engram.dlq.<projector>; it was not written by a projector"
    )]
    NotADeadLetter { dlq_seq: u64, subject: String },
    #[error("nats is unavailable: {0}; try again once the server answers")]
    Unavailable(String),
    #[error("jetstream request on {DLQ_STREAM} failed: {0}")]
    JetStream(String),
}

impl DlqError {
    /// True when trying again later can succeed without any change by the user.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

impl From<BusError> for DlqError {
    fn from(e: BusError) -> Self {
        if e.is_retryable() {
            Self::Unavailable(e.to_string())
        } else {
            Self::JetStream(e.to_string())
        }
    }
}

/// The subject of one projector's dead letters, or of all of them.
fn subject_of(projector: Option<&str>) -> Result<String, DlqError> {
    match projector {
        None => Ok(format!("{DLQ_SUBJECT_PREFIX}.>")),
        Some(name) => {
            // A subject token: `.`, `*`, `>` or whitespace would widen or break the filter.
            engram_schema::Ident::parse("projector", name).map_err(|_| {
                DlqError::InvalidProjector {
                    name: name.to_owned(),
                }
            })?;
            Ok(format!("{DLQ_SUBJECT_PREFIX}.{name}"))
        }
    }
}

fn published(t: time::OffsetDateTime) -> DateTime<Utc> {
    DateTime::<Utc>::from_timestamp_nanos(
        i64::try_from(t.unix_timestamp_nanos()).unwrap_or_default(),
    )
}

impl Bus {
    async fn dead_letter_stream(&self) -> Result<stream::Stream, DlqError> {
        self.js.get_stream(DLQ_STREAM).await.map_err(|e| {
            if is_not_found(&e) {
                DlqError::StreamMissing
            } else {
                DlqError::Unavailable(e.to_string())
            }
        })
    }

    /// The oldest `limit` dead letters (1..=[`MAX_LIST_LIMIT`]), of one projector or of all.
    pub async fn dead_letters(
        &self,
        projector: Option<&str>,
        limit: usize,
    ) -> Result<DeadLetters, DlqError> {
        if !(1..=MAX_LIST_LIMIT).contains(&limit) {
            return Err(DlqError::LimitOutOfRange { limit });
        }
        let filter = subject_of(projector)?;
        let stream = self.dead_letter_stream().await?;
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: filter,
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| DlqError::JetStream(e.to_string()))?;
        let total = consumer.cached_info().num_pending;
        let mut letters = Vec::new();
        if total == 0 {
            return Ok(DeadLetters { letters, total });
        }
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| DlqError::JetStream(e.to_string()))?;
        while letters.len() < limit {
            let Some(message) = messages.next().await else {
                break;
            };
            let message = message.map_err(|e| DlqError::Unavailable(e.to_string()))?;
            let info = message
                .info()
                .map_err(|e| DlqError::JetStream(format!("message without jetstream info: {e}")))?;
            let (seq, pending, stored_at) = (
                info.stream_sequence,
                info.pending,
                published(info.published),
            );
            // The filter only matches engram.dlq.<token>, so every message parses.
            if let Some(letter) = DeadLetter::from_parts(
                seq,
                message.subject.as_str(),
                message.headers.as_ref(),
                stored_at,
                message.payload.clone(),
            ) {
                letters.push(letter);
            }
            if pending == 0 {
                break;
            }
        }
        Ok(DeadLetters { letters, total })
    }

    /// Every dead letter stored after `after` (a sequence of the dead-letter stream, such as
    /// one [`dead_letters_last_seq`](Self::dead_letters_last_seq) returned earlier), oldest
    /// first, read headers only: a letter costs a few dozen bytes here however large its
    /// event was. Reads up to the stream's last sequence when the read starts.
    pub async fn dead_letter_refs(&self, after: u64) -> Result<Vec<DeadLetterRef>, DlqError> {
        let stream = match self.dead_letter_stream().await {
            Err(DlqError::StreamMissing) => return Ok(Vec::new()),
            other => other?,
        };
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: subject_of(None)?,
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: after + 1,
                },
                headers_only: true,
                ..Default::default()
            })
            .await
            .map_err(|e| DlqError::JetStream(e.to_string()))?;
        let mut refs = Vec::new();
        if consumer.cached_info().num_pending == 0 {
            return Ok(refs);
        }
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| DlqError::JetStream(e.to_string()))?;
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| DlqError::Unavailable(e.to_string()))?;
            let info = message
                .info()
                .map_err(|e| DlqError::JetStream(format!("message without jetstream info: {e}")))?;
            let (seq, pending) = (info.stream_sequence, info.pending);
            if let Some(letter) = DeadLetter::from_parts(
                seq,
                message.subject.as_str(),
                message.headers.as_ref(),
                published(info.published),
                Bytes::new(),
            ) {
                refs.push(DeadLetterRef {
                    dlq_seq: letter.dlq_seq,
                    projector: letter.projector,
                    event_seq: letter.event_seq,
                    subject: letter.subject,
                });
            }
            if pending == 0 {
                break;
            }
        }
        Ok(refs)
    }

    /// Deletes one dead letter, overwriting its bytes on disk (a message erase): erasure's
    /// way to remove the copy a projector kept of an erased scope's event.
    pub async fn erase_dead_letter(&self, dlq_seq: u64) -> Result<bool, DlqError> {
        let stream = self.dead_letter_stream().await?;
        stream
            .delete_message(dlq_seq)
            .await
            .map_err(|e| DlqError::JetStream(e.to_string()))
    }

    /// One dead letter by its sequence in the dead-letter stream.
    pub async fn dead_letter_at(&self, dlq_seq: u64) -> Result<DeadLetter, DlqError> {
        let stream = self.dead_letter_stream().await?;
        let message = stream
            .get_raw_message(dlq_seq)
            .await
            .map_err(|e| match e.kind() {
                RawMessageErrorKind::NoMessageFound => DlqError::NotFound { dlq_seq },
                RawMessageErrorKind::JetStream(_) | RawMessageErrorKind::InvalidSubject => {
                    DlqError::JetStream(e.to_string())
                }
                RawMessageErrorKind::Other => DlqError::Unavailable(e.to_string()),
            })?;
        DeadLetter::from_parts(
            message.sequence,
            message.subject.as_str(),
            Some(&message.headers),
            published(message.time),
            message.payload,
        )
        .ok_or_else(|| DlqError::NotADeadLetter {
            dlq_seq,
            subject: message.subject.to_string(),
        })
    }

    /// The dead-letter stream's last sequence (0 when it is empty or missing): a boundary
    /// between the letters sent so far and the ones sent after.
    pub async fn dead_letters_last_seq(&self) -> Result<u64, DlqError> {
        match self.dead_letter_stream().await {
            Ok(stream) => Ok(stream.cached_info().state.last_sequence),
            Err(DlqError::StreamMissing) => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Removes the dead letters of `projector` stored at or before `through` (a sequence of
    /// the dead-letter stream); returns how many there were. Only a redrive should call this,
    /// once a rebuild has dead-lettered again whatever still fails: the events themselves
    /// stay in the events stream.
    pub async fn purge_dead_letters(&self, projector: &str, through: u64) -> Result<u64, DlqError> {
        let filter = subject_of(Some(projector))?;
        if through == 0 {
            return Ok(0);
        }
        let stream = match self.dead_letter_stream().await {
            Err(DlqError::StreamMissing) => return Ok(0),
            other => other?,
        };
        // `sequence` purges up to, not including, the one given.
        let response = stream
            .purge()
            .filter(filter)
            .sequence(through + 1)
            .await
            .map_err(|e| DlqError::JetStream(e.to_string()))?;
        Ok(response.purged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_projector_name_is_one_subject_token() {
        assert_eq!(subject_of(None).unwrap(), "engram.dlq.>");
        assert_eq!(subject_of(Some("facts")).unwrap(), "engram.dlq.facts");
        for bad in ["", "a.b", "*", ">", "a b"] {
            assert!(
                matches!(
                    subject_of(Some(bad)),
                    Err(DlqError::InvalidProjector { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn headers_become_fields_and_other_subjects_are_no_dead_letters() {
        let mut headers = HeaderMap::new();
        headers.insert("Engram-Dlq-Seq", "42");
        headers.insert("Engram-Dlq-Subject", "engram.evt.acme.task.t1.episodic");
        headers.insert("Engram-Dlq-Reason", "not a msgpack event map");
        let letter = DeadLetter::from_parts(
            7,
            "engram.dlq.keyword",
            Some(&headers),
            Utc::now(),
            Bytes::from_static(b"junk"),
        )
        .unwrap();
        assert_eq!(letter.projector, "keyword");
        assert_eq!(letter.event_seq, Some(42));
        assert_eq!(
            letter.subject.as_deref(),
            Some("engram.evt.acme.task.t1.episodic")
        );
        assert_eq!(letter.reason, "not a msgpack event map");
        assert!(
            DeadLetter::from_parts(7, "engram.dlqx.keyword", None, Utc::now(), Bytes::new())
                .is_none()
        );
    }
}

use engram_schema::SchemaError;
use thiserror::Error;

use crate::provision::ConfigDiff;

/// Failures of connecting, provisioning and inspecting.
#[derive(Debug, Error)]
pub enum BusError {
    #[error(
        "cannot connect to nats at {url}: {reason}; is nats-server running? start one with `engram up`, or pass --nats <url>"
    )]
    Connect { url: String, reason: String },
    #[error(
        "nats at {url} refused these credentials ({reason}); on the machine running `engram up` the CLI uses its admin credentials by itself; elsewhere pass --creds <file> from `engram agent add`, and check the agent was not revoked"
    )]
    Unauthorized { url: String, reason: String },
    #[error(
        "{resource} exists with a different configuration; engram will not change it. differences (existing -> wanted): {}. {fix}",
        .diffs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    )]
    ConfigDrift {
        resource: String,
        diffs: Vec<ConfigDiff>,
        /// What the operator should do, with the command when there is one.
        fix: String,
    },
    #[error(
        "stream {0} does not exist; run `engram up` (or any engram command with provisioning) first"
    )]
    StreamMissing(String),
    /// The events stream is split into another number of partitions than configured, or
    /// was made by an engram before partitions.
    #[error(
        "the events stream {stream} is {}, but bus.stream.partitions is {wanted}; {}",
        .existing.map_or_else(|| "not partitioned (an older engram created it)".to_owned(), |n| format!("split into {n} partitions")),
        match .existing {
            Some(n) => format!("set bus.stream.partitions = {n} (ENGRAM_BUS__STREAM__PARTITIONS={n}); changing the count re-hashes every scope, which is a migration of the stream (see the README's Partitions section)"),
            None => "its events must be copied into a partitioned stream before this engram can read them (see the README's Partitions section)".to_owned(),
        }
    )]
    Partitions {
        stream: String,
        existing: Option<u32>,
        wanted: u32,
    },
    #[error("nats is unavailable: {0}")]
    Unavailable(String),
    #[error("invalid bus configuration: {0}")]
    InvalidConfig(String),
    /// These credentials may not do this (an agent's key reaches no stream directly).
    #[error("{0}")]
    Forbidden(String),
    #[error("jetstream request failed: {0}")]
    JetStream(String),
    #[error(transparent)]
    Schema(#[from] SchemaError),
}

impl BusError {
    /// True when trying again later can succeed without any change by the user.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Connect { .. } | Self::Unavailable(_))
    }
}

/// Why an append was not stored.
#[derive(Debug, Error)]
pub enum AppendError {
    /// The event broke the contract; nothing was sent.
    #[error("event rejected: {0}")]
    Invalid(#[source] SchemaError),
    /// The event exceeds the client or server size limit; nothing was stored.
    #[error("event of {size} bytes exceeds the limit of {max} bytes; shorten its content")]
    TooLarge { size: usize, max: usize },
    /// Optimistic concurrency: the subject moved on since the caller read it.
    #[error(
        "concurrency conflict on {subject}: expected last sequence {expected}; re-read the subject and retry with its current sequence"
    )]
    Conflict { subject: String, expected: u64 },
    /// No ack in time, connection lost, or the stream not answering. The event may or may
    /// not be stored; retrying with the same event id is safe (it is deduplicated).
    #[error("append not acknowledged: {0}; it is safe to retry with the same event id")]
    Unavailable(String),
    /// The server refused it for another reason.
    #[error("append rejected by the server: {0}")]
    Rejected(String),
    /// The credentials may not append this event: another tenant or agent, or a scope the
    /// agent's key does not cover. Nothing was stored.
    #[error("these credentials may not append to {subject}: {reason}; nothing was stored")]
    Forbidden { subject: String, reason: String },
}

impl AppendError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }

    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid",
            Self::TooLarge { .. } => "too_large",
            Self::Conflict { .. } => "conflict",
            Self::Unavailable(_) => "unavailable",
            Self::Rejected(_) => "rejected",
            Self::Forbidden { .. } => "forbidden",
        }
    }
}

impl From<SchemaError> for AppendError {
    fn from(e: SchemaError) -> Self {
        match e {
            SchemaError::TooLarge { size, max } => Self::TooLarge { size, max },
            other => Self::Invalid(other),
        }
    }
}

/// Failures while reading the stream.
#[derive(Debug, Error)]
pub enum ReadError {
    /// One message is not a trustworthy event: it does not decode, or its envelope belongs
    /// on another subject. Readers skip it and go on; it is never fatal.
    #[error("event at seq {seq} on {subject} is refused: {source}")]
    Decode {
        seq: u64,
        subject: String,
        #[source]
        source: SchemaError,
    },
    /// The consumer failed; the stream ends after this.
    #[error("reading the stream failed: {0}")]
    Consumer(String),
}

//! The `ENGRAM_ACCESS` stream: the access records, in order.
//!
//! Only the admin can append (every other identity is denied `engram.access.>`), and only the
//! admin and the query service can read it. Appends are serialised with the stream's
//! expected-last-sequence check: an admin appends only on the state it checked the record
//! against, so two admins at once cannot both grant on a stale view.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt as _;
use tokio::sync::{RwLock, watch};
use tokio_util::sync::CancellationToken;

use crate::AccessError;
use crate::registry::{ENTRY_VERSION, Entry, Record, Registry};

pub const ACCESS_STREAM: &str = "ENGRAM_ACCESS";
pub const ACCESS_SUBJECT_PREFIX: &str = "engram.access";

/// The most records one registry holds: access records are few (tenants, keys, grants), so a
/// log past this is a mistake or an attack, and is refused rather than folded without end.
pub const MAX_RECORDS: i64 = 1_000_000;
/// The largest record.
const MAX_RECORD_BYTES: i32 = 16 * 1024;

/// The registry, as one process folds the log, with a way to wait for a sequence.
#[derive(Clone)]
pub struct SharedRegistry {
    state: Arc<RwLock<Registry>>,
    applied: watch::Receiver<u64>,
    notify: Arc<watch::Sender<u64>>,
}

impl Default for SharedRegistry {
    fn default() -> Self {
        let (notify, applied) = watch::channel(0);
        Self {
            state: Arc::default(),
            applied,
            notify: Arc::new(notify),
        }
    }
}

impl SharedRegistry {
    pub async fn read(&self) -> tokio::sync::RwLockReadGuard<'_, Registry> {
        self.state.read().await
    }

    pub fn applied(&self) -> u64 {
        *self.applied.borrow()
    }

    /// Waits until the log is folded up to `seq`, at most `timeout`; false if it was not.
    pub async fn wait_applied(&self, seq: u64, timeout: Duration) -> bool {
        let mut rx = self.applied.clone();
        tokio::time::timeout(timeout, rx.wait_for(|s| *s >= seq))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// A receiver that changes each time a record is folded in.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.applied.clone()
    }

    async fn apply(&self, seq: u64, entry: &Entry) {
        let mut state = self.state.write().await;
        // Two folds (a follower and a catch-up) may read the same record: apply it once.
        if seq <= state.applied {
            return;
        }
        state.apply(seq, entry);
        self.notify.send_replace(seq);
    }

    async fn skip(&self, seq: u64) {
        let mut state = self.state.write().await;
        state.applied = state.applied.max(seq);
        self.notify.send_replace(seq);
    }
}

/// Appends to and reads the access log.
#[derive(Clone)]
pub struct AccessLog {
    js: jetstream::Context,
    stream: String,
}

fn log_err(reason: impl std::fmt::Display) -> AccessError {
    AccessError::Log {
        stream: ACCESS_STREAM.into(),
        reason: reason.to_string(),
    }
}

impl AccessLog {
    pub fn new(client: async_nats::Client) -> Self {
        Self {
            js: jetstream::new(client),
            stream: ACCESS_STREAM.into(),
        }
    }

    /// Creates the stream if it is missing (admin only).
    pub async fn provision(&self, replicas: usize) -> Result<(), AccessError> {
        self.js
            .get_or_create_stream(stream::Config {
                name: self.stream.clone(),
                description: Some("engram access registry: tenants, agent keys, grants".into()),
                subjects: vec![format!("{ACCESS_SUBJECT_PREFIX}.*")],
                storage: stream::StorageType::File,
                num_replicas: replicas.max(1),
                max_messages: MAX_RECORDS,
                max_message_size: MAX_RECORD_BYTES,
                discard: stream::DiscardPolicy::New,
                deny_delete: true,
                deny_purge: true,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .map_err(log_err)?;
        Ok(())
    }

    async fn last_seq(&self) -> Result<u64, AccessError> {
        let mut stream = self.js.get_stream(&self.stream).await.map_err(|e| {
            log_err(format!(
                "{e}; is `engram up` running, and are these admin credentials?"
            ))
        })?;
        Ok(stream.info().await.map_err(log_err)?.state.last_sequence)
    }

    /// Folds the whole log.
    pub async fn load(&self) -> Result<Registry, AccessError> {
        let shared = SharedRegistry::default();
        self.catch_up(&shared).await?;
        Ok(shared.read().await.clone())
    }

    /// Folds what `shared` has not seen, up to the log's current end.
    pub async fn catch_up(&self, shared: &SharedRegistry) -> Result<(), AccessError> {
        let last = self.last_seq().await?;
        let from = shared.applied() + 1;
        if last < from {
            return Ok(());
        }
        let mut messages = self.consumer(from).await?;
        while shared.applied() < last {
            let Some(message) = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .map_err(|_| log_err("reading the log timed out"))?
            else {
                return Err(log_err("the log ended early"));
            };
            let message = message.map_err(log_err)?;
            fold(shared, &message).await;
        }
        Ok(())
    }

    async fn consumer(&self, from: u64) -> Result<pull::Ordered, AccessError> {
        let stream = self.js.get_stream(&self.stream).await.map_err(log_err)?;
        stream
            .create_consumer(pull::OrderedConfig {
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                ..Default::default()
            })
            .await
            .map_err(log_err)?
            .messages()
            .await
            .map_err(log_err)
    }

    /// Checks `record` against the current state and appends it, returning its sequence.
    /// `by` says who, for the audit trail. Another admin's record landing between the read
    /// and the append makes it read and check again ([`AccessLog::append_on`]).
    pub async fn append(&self, record: Record, by: &str) -> Result<u64, AccessError> {
        for _ in 0..8 {
            let view = self.load().await?;
            match self.append_on(&view, record.clone(), by).await {
                Err(AccessError::Stale { .. }) => {}
                done => return done,
            }
        }
        Err(log_err(
            "another admin kept appending at the same time; try again",
        ))
    }

    /// Checks `record` against `view`, a registry this admin read, and appends it only if
    /// the log still ends where `view` does (the stream's expected last sequence): when
    /// another record was appended since, nothing is written and the answer is
    /// [`AccessError::Stale`], so no admin acts on a view another admin has changed.
    pub async fn append_on(
        &self,
        view: &Registry,
        record: Record,
        by: &str,
    ) -> Result<u64, AccessError> {
        view.check(&record)?;
        let subject = format!("{ACCESS_SUBJECT_PREFIX}.{}", record.tenant());
        let entry = Entry {
            v: ENTRY_VERSION,
            at: chrono::Utc::now(),
            by: by.chars().take(256).collect(),
            record,
        };
        let body = serde_json::to_vec(&entry).map_err(log_err)?;
        let publish = jetstream::message::PublishMessage::build()
            .payload(body.into())
            .expected_last_sequence(view.applied);
        let ack = self
            .js
            .send_publish(subject, publish)
            .await
            .map_err(log_err)?
            .await;
        match ack {
            Ok(ack) => Ok(ack.sequence),
            Err(e)
                if e.kind()
                    == async_nats::jetstream::context::PublishErrorKind::WrongLastSequence =>
            {
                Err(AccessError::Stale { read: view.applied })
            }
            Err(e) => Err(log_err(e)),
        }
    }

    /// Folds the log into `shared` from where it is, then keeps folding new records until
    /// `stop`. The ordered consumer recreates itself after a reconnect.
    pub fn follow(
        self,
        shared: SharedRegistry,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                let from = shared.applied() + 1;
                let messages = tokio::select! {
                    _ = stop.cancelled() => return,
                    m = self.consumer(from) => m,
                };
                match messages {
                    Ok(mut messages) => loop {
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            next = messages.next() => match next {
                                Some(Ok(message)) => {
                                    backoff = Duration::from_millis(100);
                                    fold(&shared, &message).await;
                                }
                                Some(Err(e)) => {
                                    tracing::debug!(error = %e, "access log consumer failed, recreating it");
                                    break;
                                }
                                None => break,
                            }
                        }
                    },
                    Err(e) => tracing::warn!(error = %e, "cannot follow the access log, retrying"),
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        })
    }
}

async fn fold(shared: &SharedRegistry, message: &jetstream::Message) {
    let seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
    if seq <= shared.applied() {
        return;
    }
    match serde_json::from_slice::<Entry>(&message.payload) {
        Ok(entry) if entry.v == ENTRY_VERSION => shared.apply(seq, &entry).await,
        Ok(entry) => {
            tracing::warn!(
                seq,
                v = entry.v,
                "access record of an unknown version skipped"
            );
            shared.skip(seq).await;
        }
        Err(e) => {
            tracing::warn!(seq, error = %e, "access record does not decode, skipped");
            shared.skip(seq).await;
        }
    }
}

//! The JetStream layer every Engram component talks through.
//!
//! # Layout
//! - [`config`]: what the bus provisions and how it publishes ([`BusConfig`]).
//! - [`provision`]: idempotent creation of the events stream and the working-memory bucket;
//!   an existing resource with a different config is reported field by field, never changed.
//! - [`append`]: `append` and `append_batch`. `Nats-Msg-Id` is `<tenant>:<event id>`, so a
//!   retried append is stored once and no tenant's id collides with another's; the returned stream sequence is the consistency token.
//! - [`read`]: `replay` (ordered consumer, ends when caught up) and `tail` (live).
//! - [`direct`]: pages read with batched direct gets, which leave no consumer behind: what
//!   serves agents' replay pages, whose number nobody bounds.
//! - [`durable`]: durable consumers positioned from a projector's checkpoint, and the
//!   dead-letter stream for messages a projector cannot apply.
//! - [`working`]: working memory, a KV bucket with per-key TTL.
//! - [`error`]: typed errors, each marked retryable or not.
//!
//! The bus never interprets events beyond decoding them: projection is other crates' job.

pub mod append;
pub mod config;
pub mod conflicts;
pub mod direct;
pub mod dlq;
pub mod durable;
pub mod error;
pub mod head;
pub mod lease;
pub mod provision;
pub mod read;
pub mod working;

use std::sync::Arc;

use async_nats::jetstream;
use engram_schema::Codec;
use engram_telemetry::metrics;

pub use append::{AppendOptions, AppendReceipt};
pub use config::{BusConfig, DeadLetterSettings, NkeyAuth, StreamSettings, WorkingMemorySettings};
pub use direct::{DirectBatch, StreamPosition};
pub use durable::{DLQ_STREAM, DLQ_SUBJECT_PREFIX, Delivery, DurableReader};
pub use error::{AppendError, BusError, ReadError};
pub use head::StreamHead;
pub use lease::{Leases, keys_with_prefix};
pub use provision::{ConfigDiff, ProvisionReport, ReplicaShortfall};
pub use read::{EventStream, StartAt, StoredEvent, StreamState};
pub use working::{Entries, EntryBounds, WorkingMemory};

/// How many times a handshake the server refused is tried: see [`handshake`].
const UNAUTHORIZED_ATTEMPTS: u32 = 3;

/// Runs `connect` (one handshake with a server) and, when the server refuses it as an
/// authorization violation, runs it again, at most [`UNAUTHORIZED_ATTEMPTS`] times in all.
///
/// A config reload re-checks every connection the server holds, and one whose CONNECT it
/// has not read yet has no credentials to check: the server refuses it as an authorization
/// violation even though its key is listed before and after (nats-server's
/// `reloadAuthorization`). Engram reloads whenever a key is added or revoked, so every
/// connection Engram makes goes through here, not only [`Bus::connect`]'s: a key that really
/// is refused still fails, well under a second later. Other errors are returned at once.
pub async fn handshake<F, Fut>(
    mut connect: F,
) -> Result<async_nats::Client, async_nats::ConnectError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<async_nats::Client, async_nats::ConnectError>>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        // The client logs each refused handshake as an error: only the last one is worth a
        // line, the ones tried again are counted and logged below.
        let result = if attempt < UNAUTHORIZED_ATTEMPTS {
            tracing::instrument::WithSubscriber::with_subscriber(
                connect(),
                tracing::subscriber::NoSubscriber::default(),
            )
            .await
        } else {
            connect().await
        };
        let error = match result {
            Ok(client) => return Ok(client),
            Err(e) => e,
        };
        let refused = error.kind() == async_nats::ConnectErrorKind::AuthorizationViolation
            || error
                .to_string()
                .to_ascii_lowercase()
                .contains("authorization");
        if !refused || attempt >= UNAUTHORIZED_ATTEMPTS {
            return Err(error);
        }
        metrics::NATS_CONNECT_REFUSED_RETRIES.inc();
        tracing::debug!(attempt, error = %error, "nats refused the handshake; trying again in case a config reload raced it");
        tokio::time::sleep(std::time::Duration::from_millis(100 * u64::from(attempt))).await;
    }
}

/// A connection to NATS plus the JetStream context and codec the bus uses.
///
/// Cheap to clone: clones share one connection.
#[derive(Clone, Debug)]
pub struct Bus {
    client: async_nats::Client,
    js: jetstream::Context,
    codec: Arc<Codec>,
    config: Arc<BusConfig>,
    /// Subjects the server refused this connection's publishes to (a permissions violation
    /// is reported on the connection, not on the publish): an append waiting for its ack
    /// learns from it that no ack will come, and why.
    refused: tokio::sync::broadcast::Sender<String>,
    /// Counts the connection's reconnections; see [`Bus::reconnections`].
    reconnected: Arc<tokio::sync::watch::Sender<u64>>,
}

/// The subject of a `Permissions Violation for Publish to "<subject>"` server error.
fn refused_subject(error: &str) -> Option<String> {
    let rest = error
        .trim_matches('\'')
        .strip_prefix("Permissions Violation for Publish to ")?;
    Some(rest.trim().trim_matches('"').to_owned())
}

impl Bus {
    /// Connects to `config.url`. Fails fast, with a hint, when no server answers.
    pub async fn connect(config: BusConfig) -> Result<Self, BusError> {
        let url = config.url.clone();
        // The client reports the first connection as `Connected` too; only later ones are
        // recoveries worth an info line.
        let was_connected = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (refused, _) = tokio::sync::broadcast::channel(64);
        let refused_tx = refused.clone();
        let reconnected_tx = Arc::new(tokio::sync::watch::channel(0u64).0);
        let reconnected_cb = reconnected_tx.clone();
        // Logs and errors show where, never with which credentials.
        let server = config::redact_url(&url);
        let server_shown = server.clone();
        let addrs = config::server_addrs(&url).map_err(|reason| BusError::Connect {
            url: server_shown.clone(),
            reason,
        })?;
        let options = || {
            let was_connected = was_connected.clone();
            let server = server.clone();
            let refused_tx = refused_tx.clone();
            let reconnected_cb = reconnected_cb.clone();
            let options = match (&config.nkey, config::url_credentials(&url)) {
                (Some(nkey), _) => async_nats::ConnectOptions::with_nkey(nkey.seed.clone())
                    .custom_inbox_prefix(&nkey.inbox_prefix),
                (None, Some(config::UrlCredentials::UserPassword { user, password })) => {
                    async_nats::ConnectOptions::with_user_and_password(user, password)
                }
                (None, Some(config::UrlCredentials::Token(token))) => {
                    async_nats::ConnectOptions::with_token(token)
                }
                (None, None) => async_nats::ConnectOptions::new(),
            };
            options
                .name(&config.client_name)
                .connection_timeout(config.connect_timeout)
                .ping_interval(config.ping_interval)
                // Appends wait for their ack; the client keeps reconnecting forever in the
                // background so that a restarted server is picked up without user action.
                .max_reconnects(None)
                .event_callback(move |event| {
                    let was_connected = was_connected.clone();
                    let server = server.clone();
                    let refused = refused_tx.clone();
                    let reconnected = reconnected_cb.clone();
                    async move {
                        match event {
                            async_nats::Event::ServerError(async_nats::ServerError::Other(e))
                                if refused_subject(&e).is_some() =>
                            {
                                tracing::warn!(error = %e, "the server refused a publish: these credentials do not allow it");
                                let _ = refused.send(refused_subject(&e).unwrap_or_default());
                            }
                            async_nats::Event::Connected => {
                                metrics::NATS_CONNECTED.set(1);
                                if was_connected.swap(true, std::sync::atomic::Ordering::Relaxed) {
                                    tracing::info!(url = %server, "nats connection restored");
                                    reconnected.send_modify(|n| *n += 1);
                                } else {
                                    tracing::debug!("nats connection up");
                                }
                            }
                            async_nats::Event::Disconnected => {
                                metrics::NATS_CONNECTED.set(0);
                                tracing::warn!(url = %server, "nats connection lost, reconnecting");
                            }
                            other => tracing::debug!(event = %other, "nats client event"),
                        }
                    }
                })
        };
        let client = handshake(|| options().connect(addrs.clone()))
            .await
            .map_err(|source| {
                let reason = source.to_string();
                if source.kind() == async_nats::ConnectErrorKind::AuthorizationViolation
                    || reason.to_ascii_lowercase().contains("authorization")
                {
                    BusError::Unauthorized {
                        url: server_shown.clone(),
                        reason,
                    }
                } else {
                    BusError::Connect {
                        url: server_shown.clone(),
                        reason,
                    }
                }
            })?;
        metrics::NATS_CONNECTED.set(1);
        let mut bus = Self::from_client(client, config);
        bus.refused = refused;
        bus.reconnected = reconnected_tx;
        Ok(bus)
    }

    /// Wraps an existing connection (for callers that manage their own).
    pub fn from_client(client: async_nats::Client, config: BusConfig) -> Self {
        let js = jetstream::ContextBuilder::new()
            .ack_timeout(config.ack_timeout)
            .timeout(config.request_timeout)
            .max_ack_inflight(config.max_inflight)
            .backpressure_on_inflight(true)
            .build(client.clone());
        let codec = Codec::new(config.limits);
        Self {
            client,
            js,
            codec: Arc::new(codec),
            config: Arc::new(config),
            refused: tokio::sync::broadcast::channel(1).0,
            reconnected: Arc::new(tokio::sync::watch::channel(0).0),
        }
    }

    /// Changes each time the connection is restored after a loss. Whatever the server kept
    /// only in memory (a projector's consumer) may be gone then, if the server restarted:
    /// a durable reader watches this to check its consumer at once instead of waiting for
    /// missed heartbeats.
    pub fn reconnections(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reconnected.subscribe()
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The subjects the server refuses this connection's publishes to from now on. The server
    /// reports a permissions violation on the connection, not on the request, which otherwise
    /// just times out: a caller watching this learns at once that no answer will come, and why.
    pub fn refused_publishes(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.refused.subscribe()
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    pub fn config(&self) -> &BusConfig {
        &self.config
    }

    /// True while the connection is up.
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Sends everything buffered and waits for the server to have it.
    pub async fn flush(&self) -> Result<(), BusError> {
        self.client
            .flush()
            .await
            .map_err(|e| BusError::Unavailable(format!("flush failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_publish_permissions_violation_names_its_subject() {
        assert_eq!(
            super::refused_subject(
                r#"Permissions Violation for Publish to "engram.evt.b.task.t.episodic""#
            )
            .as_deref(),
            Some("engram.evt.b.task.t.episodic")
        );
        assert_eq!(
            super::refused_subject("'Permissions Violation for Publish to \"x.y\"'").as_deref(),
            Some("x.y")
        );
        assert!(
            super::refused_subject("Permissions Violation for Subscription to \"x\"").is_none()
        );
    }
}

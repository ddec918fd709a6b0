//! The harness every Engram test uses: one real nats-server per test, on a random port, with a
//! temporary store that is deleted when the test ends. No mock bus exists.
//!
//! Helpers panic with a readable message instead of returning errors: they run only in tests.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use engram_bus::{Bus, BusConfig};
use engram_natsd::{NatsServer, ServerOptions};
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};

/// A private nats-server for one test.
pub struct TestNats {
    pub server: NatsServer,
    /// Holds the store and run dirs; removed on drop, after the server is killed.
    dir: tempfile::TempDir,
}

impl TestNats {
    /// Starts a nats-server with JetStream on a random port.
    pub async fn start() -> Self {
        let _ = engram_telemetry::init_logging(engram_telemetry::LogFormat::Text, "warn");
        let bin = tokio::task::spawn_blocking(engram_natsd::locate)
            .await
            .expect("locate task panicked")
            .unwrap_or_else(|e| panic!("{e}"));
        let dir = tempfile::Builder::new()
            .prefix("engram-test-")
            .tempdir()
            .expect("cannot create temp dir");
        let opts = ServerOptions::new(bin, dir.path().join("store"), dir.path().join("run"));
        let server = NatsServer::start(opts)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        Self { server, dir }
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A bus config pointing at this server, with short timeouts suited to tests.
    pub fn bus_config(&self) -> BusConfig {
        BusConfig {
            url: self.url(),
            ack_timeout: Duration::from_secs(2),
            ..BusConfig::default()
        }
    }

    /// A connected bus with the stream and bucket provisioned.
    pub async fn bus(&self) -> Bus {
        self.bus_with(self.bus_config()).await
    }

    pub async fn bus_with(&self, config: BusConfig) -> Bus {
        let bus = Bus::connect(config).await.unwrap_or_else(|e| panic!("{e}"));
        bus.provision().await.unwrap_or_else(|e| panic!("{e}"));
        bus
    }

    /// SIGKILL, as a crash would.
    pub async fn kill(&mut self) {
        self.server.kill().await;
    }

    /// Restarts on the same port and store.
    pub async fn restart(&mut self) {
        self.server
            .restart()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Polls `check` every 20 ms until it returns true; panics naming `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn ident(s: &str) -> Ident {
    Ident::parse("test identifier", s).unwrap_or_else(|e| panic!("{e}"))
}

/// A valid episodic observation in `tenant`/`task:<task>` with the given text.
pub fn event(tenant: &str, task: &str, text: &str) -> Envelope {
    Envelope::new(
        ident(tenant),
        Scope::new(ScopeKind::Task, task).unwrap_or_else(|e| panic!("{e}")),
        ident("test-agent"),
        ident("i-1"),
        Layer::Episodic,
        EventKind::Observation,
        Content::text(text),
    )
}

/// `events` as a projector reads them from the stream, at sequences `first_seq`,
/// `first_seq + 1`, ...: for given/when/then tests that feed a read model without a server.
pub fn stored(events: &[Envelope], first_seq: u64) -> Vec<engram_bus::StoredEvent> {
    events
        .iter()
        .enumerate()
        .map(|(i, event)| engram_bus::StoredEvent {
            seq: first_seq + i as u64,
            subject: engram_schema::subject_for(event),
            stored_at: chrono::Utc::now(),
            pending: 0,
            trace: None,
            event: event.clone(),
        })
        .collect()
}

/// Every event in the stream, and the sequences of those whose bytes hold `needle`: in the
/// event as JSON, or in the automerge changes a `doc_changed` event carries (decoded from
/// base64). What a test of secret redaction asserts is empty.
pub async fn events_holding(bus: &engram_bus::Bus, needle: &str) -> (usize, Vec<u64>) {
    use base64::Engine as _;
    use futures::StreamExt as _;
    let mut events = bus
        .replay(
            &engram_schema::SubjectFilter::all(),
            engram_bus::StartAt::Beginning,
        )
        .await
        .unwrap_or_else(|e| panic!("replay: {e}"));
    let holds = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle.as_bytes());
    let (mut seen, mut holding) = (0, Vec::new());
    while let Some(event) = events.next().await {
        let stored = event.unwrap_or_else(|e| panic!("replay: {e}"));
        seen += 1;
        let mut bytes = serde_json::to_vec(&stored.event).unwrap_or_default();
        if let Some(changes) = stored
            .event
            .content
            .data
            .as_ref()
            .and_then(|d| d["changes"].as_array())
        {
            for change in changes.iter().filter_map(|c| c.as_str()) {
                bytes.extend(
                    base64::engine::general_purpose::STANDARD
                        .decode(change)
                        .unwrap_or_default(),
                );
            }
        }
        if holds(&bytes) {
            holding.push(stored.seq);
        }
    }
    (seen, holding)
}

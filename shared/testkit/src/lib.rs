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

/// The server's query routing for an events stream of the default partition count.
fn routing() -> String {
    engram_access::conf::query_routing(engram_bus::BusConfig::default().stream.partitions)
}

/// A private nats-server for one test.
pub struct TestNats {
    pub server: NatsServer,
    /// Holds the store and run dirs; removed on drop, after the server is killed.
    dir: tempfile::TempDir,
}

impl TestNats {
    /// Starts a nats-server with JetStream on a random port, routing agents' queries to
    /// memory nodes as `engram up`'s server does (for a stream of the default partitions).
    pub async fn start() -> Self {
        Self::start_with(|dir| {
            let conf = dir.join("run").join("nats.conf");
            std::fs::write(&conf, routing()).expect("cannot write config");
            Some(conf)
        })
        .await
    }

    /// Starts one with the config file `config` writes into the run dir (given the temp
    /// dir), if any.
    async fn start_with(config: impl FnOnce(&Path) -> Option<std::path::PathBuf>) -> Self {
        let _ = engram_telemetry::init_logging(engram_telemetry::LogFormat::Text, "warn");
        let bin = tokio::task::spawn_blocking(engram_natsd::locate)
            .await
            .expect("locate task panicked")
            .unwrap_or_else(|e| panic!("{e}"));
        let dir = tempfile::Builder::new()
            .prefix("engram-test-")
            .tempdir()
            .expect("cannot create temp dir");
        std::fs::create_dir_all(dir.path().join("run")).expect("cannot create run dir");
        let mut opts = ServerOptions::new(bin, dir.path().join("store"), dir.path().join("run"));
        opts.config_file = config(dir.path());
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

    /// A bus config pointing at this server, with the production timeouts: tests append
    /// through the bus without retries, and a shorter ack timeout would turn a slow fsync
    /// on a busy machine into a failed test. A test about lost acks sets its own.
    pub fn bus_config(&self) -> BusConfig {
        BusConfig {
            url: self.url(),
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

/// Waits until each of `projectors` has dead-lettered at least `n` events.
pub async fn wait_dead_lettered(bus: &Bus, projectors: &[&str], n: u64) {
    for projector in projectors {
        wait_until(
            &format!("{projector} to dead-letter {n} events"),
            Duration::from_secs(30),
            || {
                let bus = bus.clone();
                async move { bus.dead_letter_count(projector).await.unwrap_or(0) >= n }
            },
        )
        .await;
    }
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
            expects: None,
            event: event.clone(),
        })
        .collect()
}

/// Every event in the stream, and the sequences of those that hold `needle`: in the event as
/// JSON, or in what the automerge changes of a `doc_changed` event write (decoded and
/// inflated as the docs model reads them, text typed one character at a time joined back).
/// What a test of secret redaction asserts is empty.
///
/// A search that cannot read an event is no evidence that the secret is absent, so an event
/// the reader refuses, or a document change that does not decode, panics naming its subject
/// and seq. A `doc_changed` event whose changes were removed (the scrubber empties
/// `changes` when they write a secret) has nothing left to read.
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
        let stored = event.unwrap_or_else(|e| panic!("the secret search cannot read: {e}"));
        let at = format!("seq {} on {}", stored.seq, stored.subject);
        seen += 1;
        let mut bytes = serde_json::to_vec(&stored.event)
            .unwrap_or_else(|e| panic!("the event at {at} does not encode as JSON: {e}"));
        let changes_field = stored
            .event
            .content
            .data
            .as_ref()
            .and_then(|d| d.get("changes"))
            .and_then(|c| c.as_array());
        if stored.event.kind != EventKind::DocChanged {
            // Not a document change, so nothing says these are base64: the ones that are
            // are searched decoded too, the rest are in the JSON already.
            for change in changes_field
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str())
            {
                if let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(change) {
                    bytes.extend(decoded);
                }
            }
        } else if !changes_field.is_some_and(Vec::is_empty) {
            let (doc, changes) = engram_schema::DocChanged::from_event(&stored.event)
                .unwrap_or_else(|e| {
                    panic!("the document changes at {at} do not decode, so a secret in them cannot be searched: {e}")
                });
            // The bytes as sent, for a needle in an uncompressed change's raw columns...
            for encoded in &doc.changes {
                bytes.extend(
                    base64::engine::general_purpose::STANDARD
                        .decode(encoded)
                        .unwrap_or_else(|e| panic!("a change at {at} is not base64: {e}")),
                );
            }
            // ...and the strings the changes write, however they were compressed or typed.
            bytes.extend(engram_schema::DocChanged::written_text(&changes).into_bytes());
        }
        if holds(&bytes) {
            holding.push(stored.seq);
        }
    }
    (seen, holding)
}

/// A private nats-server that authenticates every connection, as `engram up` runs it: the
/// admin and service keys in a home dir, agents' keys from the access registry, and the
/// server's `authorization` reloaded after each registry change.
pub struct SecureNats {
    pub nats: TestNats,
    /// `<dir>/home`: `auth/<role>.creds`, as `engram up` keeps them.
    pub home: std::path::PathBuf,
    creds: Vec<(engram_access::RoleName, engram_access::Credentials)>,
    pub registry: engram_access::SharedRegistry,
    pub log: engram_access::AccessLog,
    /// The admin's connection, with the stream, bucket and registry provisioned.
    pub admin: Bus,
    /// How far the server's authorization has caught up with the registry.
    pub enforced: engram_access::conf::Enforced,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for SecureNats {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl TestNats {
    /// A server that refuses anonymous connections; see [`SecureNats`].
    pub async fn start_secured() -> SecureNats {
        use engram_access::{Names, conf};
        let mut creds = Vec::new();
        let mut fixed = Vec::new();
        let mut home = std::path::PathBuf::new();
        let mut auth_conf = std::path::PathBuf::new();
        let nats = Self::start_with(|dir| {
            home = dir.join("home");
            creds = engram_access::creds::ensure_service_credentials(&home)
                .unwrap_or_else(|e| panic!("{e}"));
            fixed = creds
                .iter()
                .filter_map(|(r, c)| Some((c.public_key(), r.fixed_role()?)))
                .collect();
            auth_conf = dir.join("run").join("auth.conf");
            conf::write_if_changed(&auth_conf, &conf::render(&fixed, &Names::default()))
                .unwrap_or_else(|e| panic!("{e}"));
            let main_conf = dir.join("run").join("nats.conf");
            std::fs::write(&main_conf, format!("include \"auth.conf\"\n{}", routing()))
                .expect("cannot write config");
            Some(main_conf)
        })
        .await;

        let admin_creds = creds
            .iter()
            .find(|(r, _)| *r == engram_access::RoleName::Admin)
            .map(|(_, c)| c.clone())
            .expect("admin credentials");
        let mut config = nats.bus_config();
        config.nkey = Some(engram_bus::NkeyAuth::of(&admin_creds));
        let admin = nats.bus_with(config).await;
        let log = engram_access::AccessLog::new(admin.client().clone());
        log.provision(1).await.unwrap_or_else(|e| panic!("{e}"));
        let registry = engram_access::SharedRegistry::default();
        let stop = tokio_util::sync::CancellationToken::new();
        log.clone().follow(registry.clone(), stop.clone());
        let reloader = nats.server.reloader().unwrap_or_else(|e| panic!("{e}"));
        let reload: conf::Reload = Box::new(move || {
            let reloader = reloader.clone();
            Box::pin(async move {
                reloader
                    .reload(Duration::from_secs(10))
                    .await
                    .map_err(|e| e.to_string())
            })
        });
        let enforced = conf::enforce(
            registry.clone(),
            fixed,
            Names::default(),
            auth_conf,
            reload,
            stop.clone(),
        );
        SecureNats {
            nats,
            home,
            creds,
            registry,
            log,
            admin,
            enforced,
            stop,
        }
    }
}

impl SecureNats {
    pub fn url(&self) -> String {
        self.nats.url()
    }

    pub fn dir(&self) -> &Path {
        self.nats.dir()
    }

    /// The credentials of a service role (or the admin).
    pub fn service(&self, role: engram_access::RoleName) -> engram_access::Credentials {
        self.creds
            .iter()
            .find(|(r, _)| *r == role)
            .map(|(_, c)| c.clone())
            .expect("every service role has credentials")
    }

    /// A bus config connecting as `creds`.
    pub fn config_as(&self, creds: &engram_access::Credentials) -> BusConfig {
        BusConfig {
            nkey: Some(engram_bus::NkeyAuth::of(creds)),
            ..self.nats.bus_config()
        }
    }

    /// Connects as `creds`, without provisioning anything.
    pub async fn connect_as(&self, creds: &engram_access::Credentials) -> Result<Bus, String> {
        Bus::connect(self.config_as(creds))
            .await
            .map_err(|e| e.to_string())
    }

    pub async fn add_tenant(&self, tenant: &str) {
        self.log
            .append(
                engram_access::Record::TenantAdded {
                    tenant: ident(tenant),
                },
                "test",
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Issues a key for `agent` of `tenant` (scopes as `kind:id`/`kind:*`; none: the
    /// defaults) and returns its credentials once the server accepts them.
    pub async fn add_agent(
        &self,
        tenant: &str,
        agent: &str,
        scopes: &[&str],
    ) -> engram_access::Credentials {
        let creds = engram_access::Credentials::generate_agent(ident(tenant), ident(agent));
        let scopes = if scopes.is_empty() {
            engram_access::ScopePattern::defaults(&ident(agent))
        } else {
            scopes
                .iter()
                .map(|s| s.parse().unwrap_or_else(|e| panic!("{e}")))
                .collect()
        };
        let seq = self
            .log
            .append(
                engram_access::Record::AgentKeyAdded {
                    tenant: ident(tenant),
                    agent: ident(agent),
                    key: creds.public_key(),
                    scopes,
                    expires_at: None,
                },
                "test",
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        self.wait_connectable(&creds, true, seq).await;
        creds
    }

    /// Waits until connecting as `creds` succeeds (`true`) or is refused (`false`), after
    /// the registry has folded `seq`; returns how long from the call.
    pub async fn wait_connectable(
        &self,
        creds: &engram_access::Credentials,
        wanted: bool,
        seq: u64,
    ) -> Duration {
        let started = Instant::now();
        assert!(
            self.registry
                .wait_applied(seq, Duration::from_secs(10))
                .await,
            "the registry did not fold seq {seq}"
        );
        let mut config = self.config_as(creds);
        config.connect_timeout = Duration::from_secs(2);
        wait_until(
            &format!(
                "connecting to be {}",
                if wanted { "accepted" } else { "refused" }
            ),
            Duration::from_secs(15),
            || {
                let config = config.clone();
                async move {
                    let result = async_connect_once(config).await;
                    result == wanted
                }
            },
        )
        .await;
        started.elapsed()
    }

    /// The access registry's last sequence: whether anything (an audit record) was appended.
    pub async fn registry_last_seq(&self) -> u64 {
        self.admin
            .jetstream()
            .get_stream(engram_access::log::ACCESS_STREAM)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .last_sequence
    }

    pub async fn append_record(&self, record: engram_access::Record) -> u64 {
        self.log
            .append(record, "test")
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Sets `deny_delete` and `deny_purge` on the events stream, as an older engram created it
/// (nats-server sets them on an update and never lifts them).
pub async fn deny_erasure(bus: &Bus, deny_delete: bool, deny_purge: bool) {
    let js = bus.jetstream();
    let mut stream = js.get_stream(&bus.config().stream.name).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.deny_delete = deny_delete;
    config.deny_purge = deny_purge;
    js.update_stream(&config).await.unwrap();
}

/// Whether one connection as `creds` is accepted.
pub async fn connects_once(nats: &SecureNats, creds: &engram_access::Credentials) -> bool {
    let mut config = nats.config_as(creds);
    config.connect_timeout = Duration::from_secs(2);
    async_connect_once(config).await
}

async fn async_connect_once(config: BusConfig) -> bool {
    match Bus::connect(config).await {
        Ok(bus) => {
            // A connection the server closes while this runs (its key was just revoked)
            // reconnects forever: bounded, so the answer is "refused", not a hang.
            let ok = tokio::time::timeout(Duration::from_secs(2), bus.client().flush())
                .await
                .is_ok_and(|r| r.is_ok());
            let _ = tokio::time::timeout(Duration::from_secs(1), bus.client().drain()).await;
            ok
        }
        Err(_) => false,
    }
}

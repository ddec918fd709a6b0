//! `engram up`: everything on one machine.
//!
//! Start-up order: nats-server (managed unless a URL is configured), connection, provisioning,
//! projectors (each with its own connection), query service, HTTP. Shutdown runs in reverse:
//! stop serving HTTP, stop the projectors (each checkpoints), drain the NATS connection
//! (flushes pending publishes), stop the child server with SIGTERM, and return.

use std::net::SocketAddr;
use std::time::Duration;

use crate::config::Config;
use engram_bus::{Bus, BusError};
use engram_natsd::{NatsServer, NatsdError, ServerOptions};
use tokio_util::sync::CancellationToken;

/// The nats-server config shipped in `deploy/`, written into the data dir for the managed server.
const NATS_CONF: &str = include_str!("../../../deploy/nats-server.conf");

#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(transparent)]
    Natsd(#[from] NatsdError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error(
        "port {port} is already in use (another `engram up` or nats-server?); connect to it with --nats nats://127.0.0.1:{port}, or pick another port with --nats-port"
    )]
    PortInUse { port: u16 },
    #[error(transparent)]
    Projectors(#[from] engram_projectors::StartError),
    #[error(transparent)]
    Node(#[from] engram_node::NodeError),
    #[error("cannot start the query service: {0}")]
    Query(String),
    #[error("cannot serve http on {addr}: {source}; pick another address with --http")]
    Http {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up authentication: {0}")]
    Access(#[from] engram_access::AccessError),
    #[error("cannot run as a leaf node: {0}")]
    Leaf(String),
    #[error("cannot prepare data dir {path}: {source}")]
    Home {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A running single-machine Engram.
pub struct Running {
    pub nats_url: String,
    pub http_addr: SocketAddr,
    pub bus: Bus,
    /// The managed server or cluster; `None` when `--nats` pointed at an external one.
    server: Option<Managed>,
    /// This process's memory node: every read model of the partitions it owns, and the
    /// query service; `None` with `--nodes N`.
    pub node: Option<crate::node::LocalNode>,
    /// The node processes of `--nodes N`.
    pub nodes: Option<crate::nodes::Children>,
    /// Each part stops on its own token, in the order [`Running::shutdown`] cancels them.
    http_stop: CancellationToken,
    http_task: tokio::task::JoinHandle<()>,
    /// Samples projector lag for `/healthz`; aborted with the http server.
    lag_sampler: tokio::task::JoinHandle<()>,
    /// Follows the access registry and keeps the server's authorization in step.
    access_stop: CancellationToken,
    /// How far the managed server's authorization has caught up with the registry; `None`
    /// without a managed server that authenticates.
    pub access_enforced: Option<engram_access::conf::Enforced>,
    /// A leaf's relays and beats (`--leaf`), or a hub's beats to its leaves
    /// (`--leaf-listen`); stopped before the connection drains.
    leaf: Option<(CancellationToken, tokio::task::JoinHandle<()>)>,
}

/// What `engram up --leaf` runs with: the credentials from the hub, and where the hub is.
#[derive(Clone, Debug)]
pub struct LeafMode {
    pub hub: String,
    pub creds: engram_access::leaf::LeafCredentials,
    pub retention: engram_leaf::local::Retention,
}

impl LeafMode {
    /// The leaf mode `config` asks for, checked; `None` when it is not a leaf.
    pub fn of(config: &Config) -> Result<Option<Self>, UpError> {
        let Some(hub) = config.leaf.hub.clone() else {
            return Ok(None);
        };
        let path = config.leaf.creds.as_ref().ok_or_else(|| {
            UpError::Leaf(
                "--leaf needs the leaf's credentials: --creds <file from `engram leaf add`>".into(),
            )
        })?;
        if config.nats.url.is_some() {
            return Err(UpError::Leaf(
                "a leaf runs its own nats-server; drop --nats / nats.url".into(),
            ));
        }
        if config.nats.cluster > 0 || config.nats.leafnodes_listen.is_some() {
            return Err(UpError::Leaf(
                "a leaf is one server: drop --cluster and --leaf-listen".into(),
            ));
        }
        if !(hub.starts_with("nats-leaf://")
            || hub.starts_with("tls://")
            || hub.starts_with("nats://"))
        {
            return Err(UpError::Leaf(format!(
                "{hub:?} is not a leafnode URL; use nats-leaf://<hub host>:<its --leaf-listen port>"
            )));
        }
        let creds = engram_access::leaf::LeafCredentials::load(path)?;
        let mut retention = engram_leaf::local::Retention::default();
        if let Some(age) = config.leaf.outbox_max_age {
            retention.outbox_max_age = age;
        }
        Ok(Some(Self {
            hub,
            creds,
            retention,
        }))
    }

    /// `config` as a leaf runs it: the hub's partition count, so that an event's partition
    /// is the same on both sides.
    fn adjust(&self, config: &Config) -> Config {
        let mut config = config.clone();
        config.bus.stream.partitions = self.creds.partitions;
        // The hub's working memory comes down into the bucket of the same name.
        config.bus.working_memory.bucket = self.creds.working_bucket.clone();
        // Consolidation writes events (summaries, merges): done on both sides it would be
        // done twice, and each side's results would sync to the other. The hub consolidates;
        // its results come down like any event.
        let before = config.projectors.run.len();
        config
            .projectors
            .run
            .retain(|p| *p != engram_projectors::ProjectorName::CONSOLIDATOR);
        if config.projectors.run.len() != before {
            tracing::info!(
                "leaf node: the consolidator runs on the hub only; its results sync down"
            );
        }
        config
    }
}

/// The managed server's JetStream domain: a leaf's name, else `nats.domain`.
pub fn js_domain(config: &Config) -> String {
    match (&config.leaf.hub, &config.leaf.creds) {
        (Some(_), Some(path)) => engram_access::leaf::LeafCredentials::load(path)
            .map(|c| c.leaf.to_string())
            .unwrap_or_else(|_| config.nats.domain.clone()),
        _ => config.nats.domain.clone(),
    }
}

/// `conf` (the shipped config) with `domain` as its JetStream domain.
fn with_domain(conf: &str, domain: &str) -> String {
    // The shipped file has one `jetstream {` block; the domain goes first in it.
    conf.replacen(
        "jetstream {",
        &format!("jetstream {{\n  # A leaf node reaches this server's JetStream API as $JS.{domain}.API.\n  domain: \"{domain}\""),
        1,
    )
}

/// What `engram up` runs of NATS itself: one server, or the nodes of a cluster.
pub enum Managed {
    Single(Box<NatsServer>),
    Cluster(engram_natsd::Cluster),
}

impl Managed {
    /// Every node's client URL, comma-separated.
    pub fn url(&self) -> String {
        match self {
            Managed::Single(server) => server.url(),
            Managed::Cluster(cluster) => cluster.url(),
        }
    }

    fn servers(&self) -> Vec<&NatsServer> {
        match self {
            Managed::Single(server) => vec![server],
            Managed::Cluster(cluster) => cluster.nodes().iter().collect(),
        }
    }

    /// Makes every node read the rendered authorization again: a key revoked is refused on
    /// all of them, whichever one its connection is on.
    fn reload(&self) -> Result<engram_access::conf::Reload, NatsdError> {
        let reloaders = self
            .servers()
            .into_iter()
            .map(NatsServer::reloader)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Box::new(move || {
            let reloaders = reloaders.clone();
            Box::pin(async move {
                let results = futures::future::join_all(
                    reloaders.iter().map(|r| r.reload(Duration::from_secs(10))),
                )
                .await;
                let failed: Vec<String> = results
                    .iter()
                    .enumerate()
                    .filter_map(|(i, r)| r.as_ref().err().map(|e| format!("node {i}: {e}")))
                    .collect();
                if failed.is_empty() {
                    Ok(results.into_iter().flatten().max().unwrap_or_default())
                } else {
                    Err(failed.join("; "))
                }
            })
        }))
    }

    async fn shutdown(&mut self, grace: Duration) {
        match self {
            Managed::Single(server) => server.shutdown(grace).await,
            Managed::Cluster(cluster) => cluster.shutdown(grace).await,
        }
    }
}

/// The identities of a managed server with authentication, from `<home>/auth/`.
struct Identities {
    creds: Vec<(engram_access::RoleName, engram_access::Credentials)>,
    auth_conf: std::path::PathBuf,
}

impl Identities {
    fn get(&self, role: engram_access::RoleName) -> Option<&engram_access::Credentials> {
        self.creds.iter().find(|(r, _)| *r == role).map(|(_, c)| c)
    }

    fn fixed(&self) -> Vec<(String, engram_access::Role)> {
        self.creds
            .iter()
            .filter_map(|(r, c)| Some((c.public_key(), r.fixed_role()?)))
            .collect()
    }
}

/// The names the permissions refer to, from the configuration.
pub fn access_names(config: &Config) -> engram_access::Names {
    engram_access::Names {
        events_stream: config.bus.stream.name.clone(),
        working_bucket: config.bus.working_memory.bucket.clone(),
        snapshots_bucket: config.projectors.snapshots.bucket.clone(),
        snapshots_index: config.projectors.snapshots.index.clone(),
        js_domain: js_domain(config),
        ..engram_access::Names::default()
    }
}

/// Starts every component and returns once all are ready.
pub async fn start(config: &Config, nodes: usize) -> Result<Running, UpError> {
    let leaf_mode = LeafMode::of(config)?;
    let adjusted;
    let config = match &leaf_mode {
        Some(leaf) => {
            adjusted = leaf.adjust(config);
            &adjusted
        }
        None => config,
    };
    let layers: Vec<&str> = engram_schema::Layer::ALL
        .iter()
        .map(|l| l.as_str())
        .collect();
    engram_telemetry::metrics::touch_all(&layers);
    use engram_access::RoleName;
    let managed_auth = config.nats.url.is_none() && !config.nats.insecure_no_auth;
    let identities = if managed_auth {
        let creds = engram_access::creds::ensure_service_credentials(&config.home)?;
        Some(Identities {
            creds,
            auth_conf: config.home.join("nats").join("auth.conf"),
        })
    } else {
        // Against an external server, services use the identities in home if an `engram up`
        // made them (the server then enforces the auth.conf it wrote).
        let creds: Vec<_> = std::iter::once(RoleName::Admin)
            .chain(RoleName::SERVICES)
            .filter_map(|r| {
                let path = engram_access::creds::service_path(&config.home, r);
                let creds = engram_access::Credentials::load(&path).ok()?;
                Some((r, creds))
            })
            .collect();
        (!config.nats.insecure_no_auth && config.nats.url.is_some() && !creds.is_empty()).then(
            || Identities {
                creds,
                auth_conf: config.home.join("nats").join("auth.conf"),
            },
        )
    };
    if config.nats.insecure_no_auth {
        tracing::warn!(
            "authentication is off (--insecure-no-auth): anything that reaches the nats server can read, forge and delete every tenant's memory"
        );
        eprintln!(
            "WARNING: engram is running without authentication (--insecure-no-auth); loopback only"
        );
    }
    let (server, nats_url) = match &config.nats.url {
        Some(url) => (None, url.clone()),
        None => {
            let server =
                start_managed_server(config, identities.as_ref(), leaf_mode.as_ref()).await?;
            let url = server.url();
            (Some(server), url)
        }
    };
    let bus_as = |role: RoleName, name: String| {
        let mut c = match identities.as_ref().and_then(|i| i.get(role)) {
            Some(creds) => config.bus_config_as(nats_url.clone(), creds),
            None => config.bus_config(nats_url.clone()),
        };
        c.client_name = name;
        c
    };
    let bus = Bus::connect(bus_as(RoleName::Admin, "engram".into())).await?;
    // A cluster's nodes find each other and elect a meta leader after they listen.
    bus.wait_for_jetstream(Duration::from_secs(60)).await?;
    let report = bus.provision().await?;
    tracing::info!(
        stream = %config.bus.stream.name,
        created = report.stream_created,
        "events stream ready"
    );
    let access_log = engram_access::AccessLog::new(bus.client().clone());
    if let Err(e) = access_log.provision(bus.replicas()).await {
        tracing::warn!(error = %e, "cannot provision the access registry stream");
    }
    warn_replica_shortfalls(&bus).await;
    let leaf = match &leaf_mode {
        Some(mode) => {
            // The server is managed when running as a leaf.
            let reconnect = match server.as_ref().map(|s| s.servers()[0].reloader()) {
                Some(Ok(reloader)) => Some(leaf_reconnector(
                    config.home.join("nats"),
                    mode.clone(),
                    reloader,
                )),
                _ => None,
            };
            Some(start_leaf(&bus, &access_log, config, mode, reconnect).await?)
        }
        None => {
            reconcile_leaf_sources(&bus, &access_log, config).await;
            config.nats.leafnodes_listen.map(|_| {
                // The managed hub has a system account to close leaf connections with.
                let kick = (server.is_some() && identities.is_some())
                    .then(|| system_credentials(&config.home.join("nats")).ok())
                    .flatten()
                    .map(|creds| leaf_kicker(nats_url.clone(), creds));
                start_hub_link(&bus, &access_log, config, kick)
            })
        }
    };
    let access_stop = CancellationToken::new();
    // One memory node in this process owning every partition it may (all, by default),
    // which takes them before it returns, each answering once caught up; or, with
    // `--nodes N`, N node processes of their own, supervised here.
    let (local, nodes) = if nodes == 0 {
        let local = crate::node::start(
            config,
            &bus_as,
            identities.is_some(),
            &engram_projectors::state_dir(&config.home),
            None,
        )
        .await?;
        (Some(local), None)
    } else {
        let nodes = crate::nodes::Children::spawn(config, &nats_url, nodes)?;
        (None, Some(nodes))
    };
    let mut access_enforced = None;
    if let (Some(identities), Some(server)) = (&identities, &server) {
        // The server's authorization follows the registry: the node's copy of it, or one
        // of this process's own when the nodes are processes of their own.
        let registry = match local.as_ref().and_then(|l| l.registry.clone()) {
            Some(registry) => registry,
            None => {
                let registry = engram_access::SharedRegistry::default();
                access_log.catch_up(&registry).await?;
                access_log
                    .clone()
                    .follow(registry.clone(), access_stop.clone());
                registry
            }
        };
        let reload = server.reload()?;
        access_enforced = Some(engram_access::conf::enforce(
            registry,
            identities.fixed(),
            access_names(config),
            identities.auth_conf.clone(),
            reload,
            access_stop.clone(),
        ));
    }
    if let Some(nodes) = &nodes {
        nodes.wait_serving(&bus, config).await?;
    }
    let listener = tokio::net::TcpListener::bind(config.http.listen)
        .await
        .map_err(|source| UpError::Http {
            addr: config.http.listen,
            source,
        })?;
    let http_addr = listener.local_addr().map_err(|source| UpError::Http {
        addr: config.http.listen,
        source,
    })?;
    let http_stop = CancellationToken::new();
    let stopped = http_stop.clone().cancelled_owned();
    let lag = crate::http::LagCheck::new(
        // Per partition's instance: an idle partition reads as visible through the stream's
        // end once proved to hold nothing newer. Node processes serve their own.
        match &local {
            Some(local) => local.visible_seqs(),
            None => Box::new(Vec::new),
        },
        crate::http::LagLimits {
            max_lag_events: config.http.health_max_lag_events,
            grace: config.http.health_lag_grace,
        },
    );
    let lag_sampler = lag.spawn_sampler(bus.clone());
    // The HTTP API beside /healthz and /metrics; it has nothing to serve without agent keys.
    let gateway = config.gateway(nats_url.clone());
    let mut mcp = config.mcp.http(http_addr);
    mcp.shutdown = http_stop.clone();
    let app = crate::http::router(bus.clone(), nats_url.clone(), lag)
        .merge(engram_gateway::router(
            gateway.clone(),
            engram_gateway::Probes::Host,
        ))
        .merge(engram_mcp::router(gateway, mcp));
    let limits = config.serve_limits();
    let http_task = tokio::spawn(async move {
        if let Err(e) = engram_gateway::serve(listener, app, limits, stopped).await {
            tracing::error!(error = %e, "http server failed");
        }
    });
    Ok(Running {
        nats_url,
        http_addr,
        bus,
        server,
        node: local,
        nodes,
        http_stop,
        http_task,
        lag_sampler,
        leaf,
        access_stop,
        access_enforced,
    })
}

/// The leaf's remote (`leaf.conf`, included by the server's config). `disabled` drops the
/// link at the next reload; enabling it again connects anew.
fn write_leaf_conf(
    nats_dir: &std::path::Path,
    leaf: &LeafMode,
    disabled: bool,
) -> Result<(), engram_access::AccessError> {
    // The seed is a secret: in a file of its own, mode 0600.
    let remote = nats_dir.join("leaf.conf");
    let block = serde_json::json!({
        "remotes": [{ "url": leaf.hub, "nkey": leaf.creds.seed, "disabled": disabled }],
        // Retry a lost link every few seconds: the relays wait, nothing is lost.
        "reconnect": 2,
    });
    engram_access::conf::write_if_changed(
        &remote,
        &format!(
            "# Written by engram up --leaf: this server is a leaf node of the hub below.\nleafnodes: {}\n",
            serde_json::to_string_pretty(&block).expect("json values serialize")
        ),
    )
    .map(|_| ())
}

/// Connects the leaf to its hub anew: the hub tells a leaf connection its permissions only
/// when it connects (its INFO), and the leaf's server enforces those on what it sends up, so
/// a scope the leaf may read since then is reachable only over a new connection.
fn leaf_reconnector(
    nats_dir: std::path::PathBuf,
    mode: LeafMode,
    reloader: engram_natsd::Reloader,
) -> engram_leaf::link::Reconnect {
    std::sync::Arc::new(move || {
        let (nats_dir, mode, reloader) = (nats_dir.clone(), mode.clone(), reloader.clone());
        Box::pin(async move {
            for disabled in [true, false] {
                write_leaf_conf(&nats_dir, &mode, disabled).map_err(|e| e.to_string())?;
                reloader
                    .reload(Duration::from_secs(10))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    })
}

/// A leaf's own streams and relays; its tenant registered locally, so that the local admin
/// can issue keys for it.
async fn start_leaf(
    bus: &Bus,
    access_log: &engram_access::AccessLog,
    config: &Config,
    mode: &LeafMode,
    reconnect: Option<engram_leaf::link::Reconnect>,
) -> Result<(CancellationToken, tokio::task::JoinHandle<()>), UpError> {
    let leaf_err = |e: engram_leaf::LeafError| UpError::Leaf(e.to_string());
    let tenant = &mode.creds.tenant;
    let registry = access_log.load().await?;
    if !registry.tenants.contains_key(tenant) {
        match access_log
            .append(
                engram_access::Record::TenantAdded {
                    tenant: tenant.clone(),
                },
                "engram up --leaf",
            )
            .await
        {
            Ok(_) | Err(engram_access::AccessError::TenantExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    engram_leaf::local::provision(bus.jetstream(), &mode.creds, &mode.retention)
        .await
        .map_err(leaf_err)?;
    let stop = CancellationToken::new();
    let relays = engram_leaf::relay::spawn(
        bus.jetstream().clone(),
        config.bus.stream.name.clone(),
        mode.creds.clone(),
        stop.clone(),
    );
    let link = engram_leaf::link::spawn_leaf(
        bus.client().clone(),
        bus.jetstream().clone(),
        mode.creds.clone(),
        mode.retention.clone(),
        reconnect,
        stop.clone(),
    );
    let task = tokio::spawn(async move {
        let _ = tokio::join!(relays, link);
    });
    tracing::info!(
        leaf = %mode.creds.leaf,
        tenant = %tenant,
        hub = %mode.hub,
        writes = mode.creds.writes.len(),
        reads = mode.creds.reads.len(),
        "running as a leaf node: the tenant's scopes sync with the hub whenever the link is up"
    );
    Ok((stop, task))
}

/// The hub's beats to its leaves, which resume a leaf's sources as soon as its link is back
/// ([`engram_leaf::link`]).
fn start_hub_link(
    bus: &Bus,
    access_log: &engram_access::AccessLog,
    config: &Config,
    kick: Option<engram_leaf::link::Kick>,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let stop = CancellationToken::new();
    let log = access_log.clone();
    let task = engram_leaf::link::spawn_hub(
        bus.client().clone(),
        bus.jetstream().clone(),
        config.bus.stream.name.clone(),
        move || {
            let log = log.clone();
            async move {
                match log.load().await {
                    Ok(registry) => Some(registry.live_leaves().map(|(_, l)| l).collect()),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read the leaves from the access registry");
                        None
                    }
                }
            }
        },
        kick,
        stop.clone(),
    );
    (stop, task)
}

/// The hub's system account user (`nats/system.creds`, made once): the only identity that
/// may close a connection. Not an Engram role: nothing but `engram up` uses it.
fn system_credentials(nats_dir: &std::path::Path) -> Result<engram_access::Credentials, UpError> {
    let path = nats_dir.join("system.creds");
    if let Ok(creds) = engram_access::Credentials::load(&path) {
        return Ok(creds);
    }
    let creds = engram_access::Credentials::generate(engram_access::RoleName::Admin);
    creds.save(&path)?;
    Ok(creds)
}

/// How long the hub waits for its servers' leaf lists.
const LEAFZ_WITHIN: Duration = Duration::from_secs(1);

/// Closes every leaf connection (the global account's) on every server of the hub, through
/// the system account: `$SYS.REQ.SERVER.PING.LEAFZ`, then `$SYS.REQ.SERVER.<id>.KICK`.
/// Every leaf, not only the one whose permissions changed: a leaf connection names no key.
fn leaf_kicker(url: String, creds: engram_access::Credentials) -> engram_leaf::link::Kick {
    std::sync::Arc::new(move || {
        let (url, seed) = (url.clone(), creds.seed.clone());
        Box::pin(async move {
            let nc = engram_bus::handshake(|| {
                async_nats::ConnectOptions::with_nkey(seed.clone())
                    .name("engram up (system)")
                    .connect(&url)
            })
            .await
            .map_err(|e| format!("cannot connect as the system account: {e}"))?;
            let inbox = nc.new_inbox();
            let mut answers = nc
                .subscribe(inbox.clone())
                .await
                .map_err(|e| e.to_string())?;
            nc.publish_with_reply("$SYS.REQ.SERVER.PING.LEAFZ", inbox, "{}".into())
                .await
                .map_err(|e| e.to_string())?;
            let mut targets = Vec::new();
            let deadline = tokio::time::Instant::now() + LEAFZ_WITHIN;
            while let Ok(Some(answer)) =
                tokio::time::timeout_at(deadline, futures::StreamExt::next(&mut answers)).await
            {
                let v: serde_json::Value =
                    serde_json::from_slice(&answer.payload).unwrap_or_default();
                let Some(server) = v["server"]["id"].as_str() else {
                    continue;
                };
                for leaf in v["data"]["leafs"].as_array().into_iter().flatten() {
                    if leaf["account"] == "$G"
                        && let Some(cid) = leaf["id"].as_u64()
                    {
                        targets.push((server.to_owned(), cid));
                    }
                }
            }
            let mut closed = 0;
            for (server, cid) in targets {
                let subject = format!("$SYS.REQ.SERVER.{server}.KICK");
                let body = serde_json::json!({ "cid": cid }).to_string();
                match tokio::time::timeout(Duration::from_secs(2), nc.request(subject, body.into()))
                    .await
                {
                    Ok(Ok(_)) => closed += 1,
                    Ok(Err(e)) => {
                        return Err(format!("closing leaf connection {cid} on {server}: {e}"));
                    }
                    Err(_) => {
                        return Err(format!(
                            "closing leaf connection {cid} on {server}: no answer"
                        ));
                    }
                }
            }
            Ok(closed)
        })
    })
}

/// The hub's side: its events stream sources every live leaf's outbox. Done again by every
/// `engram leaf add` and `remove`; here in case one of those could not reach the stream.
async fn reconcile_leaf_sources(bus: &Bus, access_log: &engram_access::AccessLog, config: &Config) {
    let registry = match access_log.load().await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the access registry for leaf sources");
            return;
        }
    };
    let leaves: Vec<_> = registry.live_leaves().map(|(_, l)| l).collect();
    if let Err(e) =
        engram_leaf::hub::reconcile_sources(bus.jetstream(), &config.bus.stream.name, &leaves).await
    {
        tracing::warn!(error = %e, "cannot bring the events stream's leaf sources up to date");
    }
    if let Err(e) =
        engram_leaf::hub::reconcile_artifacts(bus.jetstream(), &leaves, bus.replicas()).await
    {
        tracing::warn!(error = %e, "cannot bring the leaves' artifacts buckets up to date");
    }
}

/// Says which streams are kept on fewer servers than configured, and the command that
/// fixes them. Checked once the node or nodes have made their buckets.
async fn warn_replica_shortfalls(bus: &Bus) {
    match bus.replica_shortfalls().await {
        Ok(short) => {
            for s in short {
                tracing::warn!(
                    stream = %s.stream,
                    replicas = s.replicas,
                    wanted = s.wanted,
                    "a stream has fewer replicas than bus.stream.replicas, so losing one server can lose it; fix: engram streams --replicas {}",
                    s.wanted
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot check the streams' replicas"),
    }
}

/// The identity and client name of one of a service's two connections.
pub(crate) fn service_link(
    worker: engram_access::RoleName,
    link: engram_rpc::Link,
    name: &str,
) -> (engram_access::RoleName, String) {
    match (link, worker.responder()) {
        (engram_rpc::Link::Responder, Some(responder)) => (responder, format!("{name}-responder")),
        _ => (worker, name.to_owned()),
    }
}

async fn start_managed_server(
    config: &Config,
    identities: Option<&Identities>,
    leaf: Option<&LeafMode>,
) -> Result<Managed, UpError> {
    let home = &config.home;
    let nats_dir = home.join("nats");
    let home_err = |source| UpError::Home {
        path: home.display().to_string(),
        source,
    };
    std::fs::create_dir_all(&nats_dir).map_err(home_err)?;
    let conf = nats_dir.join("nats-server.conf");
    let domain = match leaf {
        Some(leaf) => leaf.creds.leaf.to_string(),
        None => config.nats.domain.clone(),
    };
    let mut text = with_domain(NATS_CONF, &domain);
    text.push('\n');
    if let Some(listen) = config.nats.leafnodes_listen {
        text.push_str(&format!(
            "\n# Leaf nodes (engram up --leaf) connect here with the keys `engram leaf add` issues.\nleafnodes {{\n  listen: \"{listen}\"\n  no_advertise: {}\n}}\n",
            !config.nats.leafnodes_advertise
        ));
    }
    if config.nats.leafnodes_listen.is_some() && identities.is_some() {
        // A hub: leaf connections keep the permissions they connected with (the server
        // never re-checks them), so `engram up` closes them through the system account
        // when a leaf's permissions change, and they connect again under the new ones.
        let system = system_credentials(&nats_dir)?;
        text.push_str(&format!(
            "\n# The system account: engram up closes leaf connections with it when their permissions change.\naccounts {{\n  SYS: {{ users: [ {{ nkey: \"{}\" }} ] }}\n}}\nsystem_account: SYS\n",
            system.public_key()
        ));
    }
    if let Some(leaf) = leaf {
        write_leaf_conf(&nats_dir, leaf, false)?;
        text.push_str("\ninclude \"leaf.conf\"\n");
    } else {
        let _ = std::fs::remove_file(nats_dir.join("leaf.conf"));
    }
    text.push_str(&engram_access::conf::query_routing(
        config.bus.stream.partitions,
    ));
    if let Some(identities) = identities {
        // The admin and the services only, until the registry is followed and its agents'
        // keys are added (a reload, moments after start-up).
        engram_access::conf::write_if_changed(
            &identities.auth_conf,
            &engram_access::conf::render(&identities.fixed(), &access_names(config)),
        )?;
        text.push_str("\n# Every connection authenticates with an nkey (engram up, access registry).\ninclude \"auth.conf\"\n");
    }
    std::fs::write(&conf, text).map_err(home_err)?;
    let port = config.nats.managed_port;
    let size = config.nats.cluster.max(1) as u16;
    if port != 0 {
        for port in (0..size).map(|i| port.saturating_add(i)) {
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
                return Err(UpError::PortInUse { port });
            }
        }
    }
    let bin = tokio::task::spawn_blocking(engram_natsd::locate)
        .await
        .expect("locate task panicked")?;
    let version = engram_natsd::server_version(&bin).unwrap_or_default();
    if config.nats.cluster > 0 {
        let mut opts =
            engram_natsd::ClusterOptions::new(bin, nats_dir.join("cluster"), config.nats.cluster);
        opts.ports = (port != 0).then(|| (0..size).map(|i| port + i).collect());
        opts.config_file = Some(conf);
        opts.host = config.nats.managed_host;
        let cluster = engram_natsd::Cluster::start(opts).await?;
        tracing::info!(
            version = %format!("{}.{}.{}", version.0, version.1, version.2),
            nodes = cluster.len(),
            urls = %cluster.url(),
            store = %nats_dir.join("cluster").display(),
            "managed nats-server cluster started"
        );
        return Ok(Managed::Cluster(cluster));
    }
    let mut opts = ServerOptions::new(bin, nats_dir.join("store"), nats_dir.clone());
    opts.port = (port != 0).then_some(port);
    opts.config_file = Some(conf);
    opts.host = config.nats.managed_host;
    let server = NatsServer::start(opts).await?;
    tracing::info!(
        version = %format!("{}.{}.{}", version.0, version.1, version.2),
        url = %server.url(),
        store = %server.store_dir().display(),
        log = %server.log_path().display(),
        "managed nats-server started"
    );
    Ok(Managed::Single(Box::new(server)))
}

impl Running {
    /// Orderly shutdown: http, then the connection (drained), then the managed server.
    pub async fn shutdown(self) {
        let Running {
            server,
            node,
            nodes,
            http_stop,
            mut http_task,
            lag_sampler,
            bus,
            access_stop,
            leaf,
            ..
        } = self;
        tracing::info!("shutting down");
        if let Some((stop, task)) = leaf {
            stop.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        lag_sampler.abort();
        http_stop.cancel();
        if tokio::time::timeout(Duration::from_secs(5), &mut http_task)
            .await
            .is_err()
        {
            http_task.abort();
        }
        if let Some(node) = node {
            node.shutdown().await;
        }
        if let Some(nodes) = nodes {
            nodes.shutdown().await;
        }
        access_stop.cancel();
        if let Err(e) = tokio::time::timeout(Duration::from_secs(5), bus.client().drain()).await {
            tracing::warn!(error = %e, "nats connection did not drain in time");
        }
        if let Some(mut server) = server {
            server.shutdown(Duration::from_secs(10)).await;
            tracing::info!("managed nats-server stopped");
        }
        tracing::info!("engram stopped");
    }
}

/// Runs until `shutdown` is cancelled, then stops in order.
pub async fn run(
    config: Config,
    demo: bool,
    nodes: usize,
    shutdown: CancellationToken,
) -> Result<(), UpError> {
    let running = start(&config, nodes).await?;
    println!(
        "engram is up  nats={}  http=http://{}  home={}  (ctrl-c to stop)",
        engram_bus::config::redact_url(&running.nats_url),
        running.http_addr,
        config.home.display()
    );
    if demo {
        tokio::select! {
            result = crate::demo::run(&running) => {
                let outcome = match result {
                    Ok(()) => "the demo is done",
                    Err(e) => {
                        eprintln!("demo failed: {e:#}");
                        "the demo stopped at the error above"
                    }
                };
                let exe = std::env::current_exe()
                    .map_or_else(|_| "engram".to_owned(), |p| p.display().to_string());
                println!(
                    "\n{outcome}; engram keeps running. try, in another terminal:\n  {exe} replay --tenant acme --scope task:fix-login-bug\n  {exe} tail --tenant acme\n  curl -s http://{}/metrics | grep ^engram_\nctrl-c here stops engram",
                    running.http_addr
                );
            }
            () = shutdown.cancelled() => {
                running.shutdown().await;
                return Ok(());
            }
        }
    }
    shutdown.cancelled().await;
    running.shutdown().await;
    Ok(())
}

/// [`run`] with SIGINT/SIGTERM: the first starts an orderly shutdown, a second exits at once.
pub async fn run_until_signalled(config: Config, demo: bool, nodes: usize) -> Result<(), UpError> {
    let shutdown = CancellationToken::new();
    let signalled = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        signalled.cancel();
        eprintln!("stopping (press ctrl-c again to exit at once)");
        wait_for_signal().await;
        eprintln!("exiting at once");
        // The managed nats-server dies with us (PR_SET_PDEATHSIG); its store is crash-safe.
        std::process::exit(130);
    });
    run(config, demo, nodes, shutdown).await
}

/// `engram gateway`: the HTTP API as its own process, with its own `/healthz` and
/// `/metrics` (no key needed), until SIGINT or SIGTERM.
pub async fn run_gateway(
    config: &Config,
    listen: SocketAddr,
) -> anyhow::Result<std::process::ExitCode> {
    let url = config.client_url();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| UpError::Http {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr()?;
    println!(
        "engram gateway is up  http=http://{addr}  nats={}",
        engram_bus::config::redact_url(&url)
    );
    let gateway = config.gateway(url);
    let mcp = config.mcp.http(addr);
    let mcp_stop = mcp.shutdown.clone();
    let app = engram_gateway::router(gateway.clone(), engram_gateway::Probes::Gateway)
        .merge(engram_mcp::router(gateway, mcp));
    engram_gateway::serve(listener, app, config.serve_limits(), async move {
        wait_for_signal().await;
        mcp_stop.cancel();
    })
    .await?;
    Ok(std::process::ExitCode::SUCCESS)
}

pub(crate) async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("cannot install sigterm handler");
    let mut int = signal(SignalKind::interrupt()).expect("cannot install sigint handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

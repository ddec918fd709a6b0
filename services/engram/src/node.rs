//! A memory node in this process: every read model of the partitions it owns, the query
//! service answering from them in process, and the access registry it checks agents
//! against. `engram up` runs one (or none, with `--nodes N`, whose children each run one);
//! `engram node` runs one as its own process.

use std::path::Path;
use std::time::Duration;

use engram_access::RoleName;
use engram_bus::{Bus, BusConfig};
use engram_memory::proto::read_models::ModelRole;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::up::{UpError, service_link};

/// A running memory node and what it was started with.
pub struct LocalNode {
    pub node: engram_node::RunningNode,
    /// The registry the query service checks agents against, followed from the log;
    /// `None` without authentication.
    pub registry: Option<engram_access::SharedRegistry>,
    node_stop: CancellationToken,
    query_stop: CancellationToken,
    registry_stop: CancellationToken,
    query_task: tokio::task::JoinHandle<()>,
    /// Drained at shutdown, once nothing uses them.
    connections: Vec<Bus>,
}

/// Starts a memory node: its read models (each model connected as its service identity,
/// `bus_as`), the query service, and the node's loop, which takes the partitions free for
/// it before this returns. `secured`: agents are checked against the access registry.
pub async fn start(
    config: &Config,
    bus_as: &(dyn Fn(RoleName, String) -> BusConfig + Sync),
    secured: bool,
    state_dir: &Path,
    http: Option<String>,
) -> Result<LocalNode, UpError> {
    let node_stop = CancellationToken::new();
    // Each node reads its partitions with consumers of its own (`<model>-p<i>-<node>`). A
    // node that lost its lease (cut off, frozen, slow) keeps pulling until it notices, and
    // on a consumer shared by name it would take events the new owner then never sees.
    let mut projectors_config = config.projectors.clone();
    if projectors_config.replica.is_none() {
        projectors_config.replica = Some(engram_node::node_ident(
            state_dir,
            config.node.name.as_ref(),
        )?);
    }
    // The read models, hosting no partition yet: the node takes its partitions below.
    let projectors = engram_projectors::open(
        &projectors_config,
        state_dir,
        |name, link| {
            let worker = match ModelRole::of(name) {
                ModelRole::Consolidator => RoleName::Consolidator,
                ModelRole::Projector => RoleName::Projectors,
            };
            let (role, client) = service_link(worker, link, &format!("engram-projector-{name}"));
            Bus::connect(bus_as(role, client))
        },
        node_stop.clone(),
    )
    .await?;
    let query_bus = Bus::connect(bus_as(RoleName::Query, "engram-query".into())).await?;
    let (role, name) = service_link(RoleName::Query, engram_rpc::Link::Responder, "engram-query");
    // Connected on the front door's thread: the requests' reads and the replies' writes are
    // not queued behind the work they admit (see `engram_rpc::front`).
    let query_responder = engram_rpc::front::run(Bus::connect(bus_as(role, name))).await?;
    let query = engram_query::Query::new(query_bus.clone(), config.query.clone())
        .await
        .map_err(|e| UpError::Query(e.to_string()))?;
    query.set_snapshots(config.projectors.snapshots.clone());
    // The read models run in this process: the query service asks them in process.
    query.set_local(projectors.local.clone());
    let registry_stop = CancellationToken::new();
    let registry = if secured {
        let registry = engram_access::SharedRegistry::default();
        let log = engram_access::AccessLog::new(query_bus.client().clone());
        log.catch_up(&registry).await?;
        log.clone().follow(registry.clone(), registry_stop.clone());
        query.set_access(engram_query::access::Guard::new(registry.clone(), log));
        Some(registry)
    } else {
        None
    };
    let query_stop = CancellationToken::new();
    let query_task = query
        .serve(query_responder.client(), query_stop.clone())
        .await
        .map_err(|e| UpError::Query(e.to_string()))?;
    let node_bus = Bus::connect(bus_as(RoleName::Projectors, "engram-node".into())).await?;
    let node = engram_node::start(
        &config.node,
        config.projectors.partitions.clone(),
        state_dir,
        http,
        engram_node::Parts {
            projectors,
            query,
            responder: query_responder.client().clone(),
            bus: node_bus.clone(),
        },
        node_stop.clone(),
    )
    .await?;
    tracing::info!(
        projectors = ?config.projectors.run,
        node = %node.name,
        partitions = ?node.serving_now(),
        "memory node and query service ready"
    );
    Ok(LocalNode {
        node,
        registry,
        node_stop,
        query_stop,
        registry_stop,
        query_task,
        connections: vec![node_bus, query_responder, query_bus],
    })
}

impl LocalNode {
    /// Messages the query service has published on its own connection (its requests to read
    /// models of other nodes, appends, stream lookups), from the NATS client's statistics:
    /// what a benchmark counts the round trips of a query by.
    pub fn query_messages_sent(&self) -> u64 {
        self.connections
            .iter()
            .find(|b| b.config().client_name == "engram-query")
            .map_or(0, |b| {
                b.client()
                    .statistics()
                    .out_messages
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
    }

    /// What `/healthz` reads: every hosted instance's visible sequence.
    pub fn visible_seqs(&self) -> crate::http::VisibleSeqs {
        let instances = self.node.instances.clone();
        Box::new(move || engram_projectors::visible_now(&instances))
    }

    /// Stops in order: the node first (it hands its partitions back, their routed endpoints
    /// ending and each model checkpointing) while the query service still answers; then the
    /// query service, the registry follower and the connections.
    pub async fn shutdown(self) {
        self.node_stop.cancel();
        if let Err(e) = self.node.join().await {
            tracing::warn!(error = %e, "a projector stopped with an error");
        }
        self.query_stop.cancel();
        let _ = self.query_task.await;
        self.registry_stop.cancel();
        for bus in self.connections {
            let _ = tokio::time::timeout(Duration::from_secs(5), bus.client().drain()).await;
        }
    }
}

/// `engram node`: a memory node as its own process, against `--nats`, until SIGINT or
/// SIGTERM. Its read models and query service connect as the service identities `engram
/// up` keeps in this home (unless `--creds` names one); its state is in `state_dir`.
pub async fn run(
    config: &Config,
    state_dir: Option<&Path>,
    http: Option<std::net::SocketAddr>,
) -> anyhow::Result<std::process::ExitCode> {
    // Every series from the start, as `engram up` has them: a dashboard or an alert on a
    // node finds zeros, not nothing, before its first event.
    let layers: Vec<&str> = engram_schema::Layer::ALL
        .iter()
        .map(|l| l.as_str())
        .collect();
    engram_telemetry::metrics::touch_all(&layers);
    let url = config.client_url();
    let service = |role: RoleName| {
        if config.nats.creds.is_some() {
            return None;
        }
        engram_access::Credentials::load(&engram_access::creds::service_path(&config.home, role))
            .ok()
    };
    let identities: Vec<(RoleName, engram_access::Credentials)> = RoleName::SERVICES
        .into_iter()
        .filter_map(|r| Some((r, service(r)?)))
        .collect();
    let secured = !identities.is_empty();
    let bus_as = |role: RoleName, name: String| {
        let mut c = match identities.iter().find(|(r, _)| *r == role) {
            Some((_, creds)) => config.bus_config_as(url.clone(), creds),
            None => config.bus_config(url.clone()),
        };
        c.client_name = name;
        c
    };
    let state_dir = state_dir.map_or_else(
        || engram_projectors::state_dir(&config.home),
        Path::to_path_buf,
    );
    let listener = match http {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| UpError::Http { addr, source })?,
        ),
        None => None,
    };
    let http_addr = listener.as_ref().and_then(|l| l.local_addr().ok());
    let local = start(
        config,
        &bus_as,
        secured,
        &state_dir,
        http_addr.map(|a| a.to_string()),
    )
    .await?;
    println!(
        "engram node {} is up  nats={}  partitions={:?}{}",
        local.node.name,
        engram_bus::config::redact_url(&url),
        local.node.serving_now(),
        http_addr.map_or_else(String::new, |a| format!("  http=http://{a}"))
    );
    let http_stop = CancellationToken::new();
    let http_task = match listener {
        Some(listener) => {
            let bus =
                Bus::connect(bus_as(RoleName::Projectors, "engram-node-health".into())).await?;
            let lag = crate::http::LagCheck::new(
                local.visible_seqs(),
                crate::http::LagLimits {
                    max_lag_events: config.http.health_max_lag_events,
                    grace: config.http.health_lag_grace,
                },
            );
            let sampler = lag.spawn_sampler(bus.clone());
            let app = crate::http::router(bus, url.clone(), lag);
            let (limits, stopped) = (config.serve_limits(), http_stop.clone().cancelled_owned());
            Some(tokio::spawn(async move {
                if let Err(e) = engram_gateway::serve(listener, app, limits, stopped).await {
                    tracing::error!(error = %e, "http server failed");
                }
                sampler.abort();
            }))
        }
        None => None,
    };
    crate::up::wait_for_signal().await;
    http_stop.cancel();
    if let Some(task) = http_task {
        let _ = task.await;
    }
    local.shutdown().await;
    Ok(std::process::ExitCode::SUCCESS)
}

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
    #[error("cannot start the query service: {0}")]
    Query(String),
    #[error("cannot serve http on {addr}: {source}; pick another address with --http")]
    Http {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
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
    /// The managed server; `None` when `--nats` pointed at an external one.
    server: Option<NatsServer>,
    pub projectors: engram_projectors::RunningProjectors,
    /// Each part stops on its own token, in the order [`Running::shutdown`] cancels them.
    projectors_stop: CancellationToken,
    query_stop: CancellationToken,
    query_task: tokio::task::JoinHandle<()>,
    http_stop: CancellationToken,
    http_task: tokio::task::JoinHandle<()>,
    /// Samples projector lag for `/healthz`; aborted with the http server.
    lag_sampler: tokio::task::JoinHandle<()>,
}

/// Starts every component and returns once all are ready.
pub async fn start(config: &Config) -> Result<Running, UpError> {
    let layers: Vec<&str> = engram_schema::Layer::ALL
        .iter()
        .map(|l| l.as_str())
        .collect();
    engram_telemetry::metrics::touch_all(&layers);
    let (server, nats_url) = match &config.nats.url {
        Some(url) => (None, url.clone()),
        None => {
            let server = start_managed_server(config).await?;
            let url = server.url();
            (Some(server), url)
        }
    };
    let bus = Bus::connect(config.bus_config(nats_url.clone())).await?;
    let report = bus.provision().await?;
    tracing::info!(
        stream = %config.bus.stream.name,
        created = report.stream_created,
        "events stream ready"
    );
    let projectors_stop = CancellationToken::new();
    let state_dir = engram_projectors::state_dir(&config.home);
    let bus_config = config.bus_config(nats_url.clone());
    let projectors = engram_projectors::start(
        &config.projectors,
        &state_dir,
        |name| {
            let mut c = bus_config.clone();
            c.client_name = format!("engram-projector-{name}");
            Bus::connect(c)
        },
        projectors_stop.clone(),
    )
    .await?;
    let query = engram_query::Query::new(bus.clone(), config.query.clone())
        .await
        .map_err(|e| UpError::Query(e.to_string()))?;
    let query_stop = CancellationToken::new();
    let query_task = query
        .serve(query_stop.clone())
        .await
        .map_err(|e| UpError::Query(e.to_string()))?;
    tracing::info!(projectors = ?config.projectors.run, "projectors and query service ready");
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
        projectors
            .visibility
            .values()
            .map(|v| {
                let (name, v) = (v.projector(), v.clone());
                let seq: crate::http::VisibleSeq = Box::new(move || v.current());
                (name, seq)
            })
            .collect(),
        crate::http::LagLimits {
            max_lag_events: config.http.health_max_lag_events,
            grace: config.http.health_lag_grace,
        },
    );
    let lag_sampler = lag.spawn_sampler(bus.clone());
    let app = crate::http::router(bus.clone(), nats_url.clone(), lag);
    let http_task = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(stopped);
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "http server failed");
        }
    });
    Ok(Running {
        nats_url,
        http_addr,
        bus,
        server,
        projectors,
        projectors_stop,
        query_stop,
        query_task,
        http_stop,
        http_task,
        lag_sampler,
    })
}

async fn start_managed_server(config: &Config) -> Result<NatsServer, UpError> {
    let home = &config.home;
    let nats_dir = home.join("nats");
    let home_err = |source| UpError::Home {
        path: home.display().to_string(),
        source,
    };
    std::fs::create_dir_all(&nats_dir).map_err(home_err)?;
    let conf = nats_dir.join("nats-server.conf");
    std::fs::write(&conf, NATS_CONF).map_err(home_err)?;
    let port = config.nats.managed_port;
    if port != 0 && std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
        return Err(UpError::PortInUse { port });
    }
    let bin = tokio::task::spawn_blocking(engram_natsd::locate)
        .await
        .expect("locate task panicked")?;
    let version = engram_natsd::server_version(&bin).unwrap_or_default();
    let mut opts = ServerOptions::new(bin, nats_dir.join("store"), nats_dir.clone());
    opts.port = (port != 0).then_some(port);
    opts.config_file = Some(conf);
    let server = NatsServer::start(opts).await?;
    tracing::info!(
        version = %format!("{}.{}.{}", version.0, version.1, version.2),
        url = %server.url(),
        store = %server.store_dir().display(),
        log = %server.log_path().display(),
        "managed nats-server started"
    );
    Ok(server)
}

impl Running {
    /// Orderly shutdown: http, then the connection (drained), then the managed server.
    pub async fn shutdown(self) {
        let Running {
            server,
            projectors,
            projectors_stop,
            query_stop,
            query_task,
            http_stop,
            mut http_task,
            lag_sampler,
            bus,
            ..
        } = self;
        tracing::info!("shutting down");
        lag_sampler.abort();
        http_stop.cancel();
        if tokio::time::timeout(Duration::from_secs(5), &mut http_task)
            .await
            .is_err()
        {
            http_task.abort();
        }
        query_stop.cancel();
        let _ = query_task.await;
        projectors_stop.cancel();
        if let Err(e) = projectors.join().await {
            tracing::warn!(error = %e, "a projector stopped with an error");
        }
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
pub async fn run(config: Config, demo: bool, shutdown: CancellationToken) -> Result<(), UpError> {
    let running = start(&config).await?;
    println!(
        "engram is up  nats={}  http=http://{}  home={}  (ctrl-c to stop)",
        engram_bus::config::redact_url(&running.nats_url),
        running.http_addr,
        config.home.display()
    );
    if demo {
        tokio::select! {
            result = crate::demo::run(&running.bus) => {
                if let Err(e) = result {
                    eprintln!("demo failed: {e:#}");
                }
                let exe = std::env::current_exe()
                    .map_or_else(|_| "engram".to_owned(), |p| p.display().to_string());
                println!(
                    "\nthe demo is done; engram keeps running. try, in another terminal:\n  {exe} replay --tenant acme --scope task:fix-login-bug\n  {exe} tail --tenant acme\n  curl -s http://{}/metrics | grep ^engram_\nctrl-c here stops engram",
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
pub async fn run_until_signalled(config: Config, demo: bool) -> Result<(), UpError> {
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
    run(config, demo, shutdown).await
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

//! Several local nats-servers forming one JetStream cluster, on loopback.
//!
//! Each node is a [`NatsServer`] with its own store, client port and route port, a unique
//! `server_name`, and routes to every node. Route ports are leased ([`PortLease`]) for the
//! cluster's life, so a node killed and restarted comes back on the same addresses and its
//! peers reconnect to it. Whether JetStream is ready (a meta leader elected) is a NATS
//! question, asked by the bus, not here.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{ClusterMembership, NatsServer, NatsdError, PortLease, ServerOptions};

/// How to run a local cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub bin: PathBuf,
    /// Node `i` keeps its store in `<dir>/node-<i>/store` and its log in `<dir>/node-<i>`.
    pub dir: PathBuf,
    /// How many nodes (3 is the smallest that survives losing one).
    pub size: usize,
    /// `cluster.name`; node names are `<name>-<i>`.
    pub name: String,
    /// The config file every node reads (listen address, ports and names come as flags).
    pub config_file: Option<PathBuf>,
    /// Client ports, one per node; `None` leases them.
    pub ports: Option<Vec<u16>>,
    pub host: std::net::IpAddr,
    /// Where each node runs, one per node: its own address and network namespace, so that
    /// one can be cut off the network. `None` runs every node on `host` in ours.
    pub placement: Option<Vec<Placement>>,
}

/// One node's own address and the network namespace it runs in.
#[derive(Clone, Debug)]
pub struct Placement {
    pub host: std::net::IpAddr,
    /// A network namespace's path, such as `/run/netns/<name>`.
    pub netns: PathBuf,
}

impl ClusterOptions {
    pub fn new(bin: PathBuf, dir: PathBuf, size: usize) -> Self {
        Self {
            bin,
            dir,
            size,
            name: "engram".into(),
            config_file: None,
            ports: None,
            host: std::net::IpAddr::from([127, 0, 0, 1]),
            placement: None,
        }
    }
}

/// A running local cluster; dropping it kills every node.
#[derive(Debug)]
pub struct Cluster {
    nodes: Vec<NatsServer>,
    /// Keeps the route ports free for restarts.
    _routes: Vec<PortLease>,
}

impl Cluster {
    /// Starts every node. It returns once each listens for clients; the nodes find each other
    /// over their routes moments later (see the bus's wait for a JetStream meta leader).
    pub async fn start(opts: ClusterOptions) -> Result<Self, NatsdError> {
        if opts.size == 0 {
            return Err(NatsdError::StartFailed {
                reason: "a cluster needs at least one node".into(),
                log_tail: String::new(),
            });
        }
        if let Some(ports) = &opts.ports
            && ports.len() != opts.size
        {
            return Err(NatsdError::StartFailed {
                reason: format!("{} client ports given for {} nodes", ports.len(), opts.size),
                log_tail: String::new(),
            });
        }
        if let Some(placement) = &opts.placement
            && placement.len() != opts.size
        {
            return Err(NatsdError::StartFailed {
                reason: format!(
                    "{} placements given for {} nodes",
                    placement.len(),
                    opts.size
                ),
                log_tail: String::new(),
            });
        }
        let host = |i: usize| {
            opts.placement
                .as_ref()
                .map_or(opts.host, |placement| placement[i].host)
        };
        let routes = (0..opts.size)
            .map(|_| PortLease::acquire())
            .collect::<Result<Vec<_>, _>>()?;
        let route_urls: Vec<String> = routes
            .iter()
            .enumerate()
            .map(|(i, l)| {
                format!(
                    "nats-route://{}",
                    std::net::SocketAddr::new(host(i), l.port())
                )
            })
            .collect();
        let mut nodes = Vec::with_capacity(opts.size);
        for (i, route) in routes.iter().enumerate() {
            let dir = node_dir(&opts.dir, i);
            let mut server = ServerOptions::new(opts.bin.clone(), dir.join("store"), dir);
            server.port = opts.ports.as_ref().map(|p| p[i]);
            server.config_file = opts.config_file.clone();
            server.host = host(i);
            server.netns = opts.placement.as_ref().map(|p| p[i].netns.clone());
            server.server_name = Some(format!("{}-{i}", opts.name));
            server.cluster = Some(ClusterMembership {
                name: opts.name.clone(),
                port: route.port(),
                routes: route_urls.clone(),
            });
            nodes.push(NatsServer::start(server).await?);
        }
        Ok(Self {
            nodes,
            _routes: routes,
        })
    }

    /// Every node's client URL, comma-separated: what clients connect with, so that they
    /// fail over to another node when theirs goes.
    pub fn url(&self) -> String {
        self.urls().join(",")
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`: kill, restart, pause or reload it on its own.
    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    pub fn node_mut(&mut self, i: usize) -> &mut NatsServer {
        &mut self.nodes[i]
    }

    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// The index of the node named `server_name` (as the servers report it), if it is one.
    pub fn index_of(&self, server_name: &str) -> Option<usize> {
        let (_, i) = server_name.rsplit_once('-')?;
        let i: usize = i.parse().ok()?;
        (i < self.nodes.len()).then_some(i)
    }

    /// SIGTERM to every node, then SIGKILL to those still up after `grace`.
    pub async fn shutdown(&mut self, grace: Duration) {
        for node in &mut self.nodes {
            node.shutdown(grace).await;
        }
    }
}

fn node_dir(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("node-{i}"))
}

//! A private nats-server (or a local cluster of them) for a run without `--nats`: fresh stores
//! in a temp dir, so that both phases start from empty streams and nothing is left behind.

use std::time::Duration;

use engram_natsd::{Cluster, ClusterOptions, NatsServer, ServerOptions};

use crate::BenchError;

#[derive(Debug)]
enum Servers {
    One(Box<NatsServer>),
    Cluster(Cluster),
}

/// A running nats-server or cluster and the temp dir holding its stores.
#[derive(Debug)]
pub struct EmbeddedNats {
    servers: Servers,
    /// Store and run dirs; deleted after the server stops.
    dir: tempfile::TempDir,
    /// `major.minor.patch` of the binary, as `nats-server --version` reports it.
    version: String,
}

impl EmbeddedNats {
    /// Finds (or installs) nats-server and starts it on a random port.
    ///
    /// Call it from the runtime's main thread: the child is tied to the spawning thread's life
    /// (see `engram_natsd`), and that thread must outlive the run.
    pub async fn start() -> Result<Self, BenchError> {
        Self::start_cluster(1).await
    }

    /// [`EmbeddedNats::start`], or with `size` above 1 that many servers on loopback forming
    /// one JetStream cluster (whose meta leader the run waits for before it provisions).
    pub async fn start_cluster(size: usize) -> Result<Self, BenchError> {
        let bin = tokio::task::spawn_blocking(engram_natsd::locate)
            .await
            .map_err(|e| BenchError::Server(format!("locating nats-server panicked: {e}")))?
            .map_err(|e| BenchError::Server(e.to_string()))?;
        let (major, minor, patch) =
            engram_natsd::server_version(&bin).map_err(BenchError::Server)?;
        let dir = tempfile::Builder::new()
            .prefix("engram-bench-")
            .tempdir()
            .map_err(|e| BenchError::Server(format!("cannot create a temp dir: {e}")))?;
        let servers = if size > 1 {
            let opts = ClusterOptions::new(bin, dir.path().join("cluster"), size);
            Servers::Cluster(
                Cluster::start(opts)
                    .await
                    .map_err(|e| BenchError::Server(e.to_string()))?,
            )
        } else {
            let opts = ServerOptions::new(bin, dir.path().join("store"), dir.path().join("run"));
            Servers::One(Box::new(
                NatsServer::start(opts)
                    .await
                    .map_err(|e| BenchError::Server(e.to_string()))?,
            ))
        };
        Ok(Self {
            servers,
            dir,
            version: format!("{major}.{minor}.{patch}"),
        })
    }

    /// Every server's URL, comma-separated.
    pub fn url(&self) -> String {
        match &self.servers {
            Servers::One(server) => server.url(),
            Servers::Cluster(cluster) => cluster.url(),
        }
    }

    /// The pid whose CPU the report counts: the only server, or a cluster's first node.
    pub fn pid(&self) -> Option<u32> {
        match &self.servers {
            Servers::One(server) => server.pid(),
            Servers::Cluster(cluster) => cluster.node(0).pid(),
        }
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn store_dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Stops the server gracefully, then deletes its store.
    pub async fn stop(mut self) {
        match &mut self.servers {
            Servers::One(server) => server.shutdown(Duration::from_secs(5)).await,
            Servers::Cluster(cluster) => cluster.shutdown(Duration::from_secs(5)).await,
        }
        if let Err(e) = self.dir.close() {
            tracing::warn!(error = %e, "cannot delete the embedded server's temp dir");
        }
    }
}

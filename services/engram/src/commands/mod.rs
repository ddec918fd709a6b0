//! One module per subcommand that talks to a running Engram.

pub mod access;
pub mod access_render;
pub mod append;
pub mod conflicts;
pub mod consolidate;
pub mod digest;
pub mod dlq;
pub mod doc;
pub mod erase;
pub mod facts;
pub mod forget;
pub mod leaf;
pub mod mcp;
pub mod projector;
pub mod query;
pub mod read;
pub mod resume;
pub mod run;
pub mod session;
pub mod skills;
pub mod snapshot;
pub mod streams;
pub mod task;

use crate::config::Config;
use engram_sdk::{Client, RetryPolicy};

/// Connects to the configured NATS without provisioning: only `engram up` creates resources.
pub async fn connect(config: &Config) -> anyhow::Result<Client> {
    let bus = engram_bus::Bus::connect(config.bus_config(config.client_url())).await?;
    Ok(Client::from_bus(bus, RetryPolicy::default()).with_scrub(&config.projectors.scrub))
}

//! Telemetry shared by every Engram service.
//!
//! # Layout
//! - [`init_logging`]: the tracing subscriber (text or JSON lines, `RUST_LOG`-style filter).
//! - [`metrics`]: every Prometheus metric Engram exports, in one module so that a switch to
//!   another metrics crate stays cheap, and the text exposition for `/metrics`.
//! - [`trace_context`]: the W3C `traceparent` carried in NATS headers, so that one append can
//!   be followed from the agent through every consumer that applies it.

pub mod metrics;
pub mod trace_context;

use serde::{Deserialize, Serialize};
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines on stderr.
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(
        "invalid log filter {filter:?}: {reason}; use e.g. \"info\" or \"engram=debug,async_nats=warn\""
    )]
    BadFilter { filter: String, reason: String },
}

/// Installs the global subscriber. `RUST_LOG`, when set, overrides `filter`.
/// A second call is a no-op, so tests and embedded services may all call it.
pub fn init_logging(format: LogFormat, filter: &str) -> Result<(), TelemetryError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if !env.is_empty() => env,
        _ => filter.to_owned(),
    };
    let env_filter = EnvFilter::try_new(&filter).map_err(|e| TelemetryError::BadFilter {
        filter: filter.clone(),
        reason: e.to_string(),
    })?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    Ok(())
}

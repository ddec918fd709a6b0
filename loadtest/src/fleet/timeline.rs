//! What a fleet run looked like second by second: the data behind the charts and the
//! "over time" parts of the report.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One row per second of the run, plus the moments chaos struck.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Timeline {
    /// Seconds since the load started, one entry per sample; every series below has one
    /// value per entry (`None` where nothing was measured in that second).
    pub t_secs: Vec<f64>,
    /// Appends acknowledged in the second.
    pub appends_per_sec: Vec<f64>,
    /// Queries (retrieve, context, facts) answered in the second.
    pub queries_per_sec: Vec<f64>,
    /// Ack latency of appends acknowledged in the second, measured from when each append was
    /// due (open loop), in milliseconds.
    pub ack_p50_ms: Vec<Option<f64>>,
    pub ack_p99_ms: Vec<Option<f64>>,
    /// Ack until the writer's read-your-writes retrieve returned the write, in milliseconds.
    pub visibility_p50_ms: Vec<Option<f64>>,
    pub visibility_p99_ms: Vec<Option<f64>>,
    /// Per projector: stream last sequence minus the projector's visible sequence.
    pub lag_events: BTreeMap<String, Vec<Option<u64>>>,
    /// Per process (for example "engram", "nats-server", "projector"): CPU use in percent of
    /// one core over the second, and resident memory in MiB.
    pub cpu_percent: BTreeMap<String, Vec<Option<f64>>>,
    pub rss_mib: BTreeMap<String, Vec<Option<f64>>>,
    /// Chaos and lifecycle markers: (seconds since start, label), e.g. "kill -9 nats-server".
    pub markers: Vec<(f64, String)>,
}

//! Whether the embedders of this process are failing, and why: the state a health check reads
//! with [`failing`], mirrored in `engram_embedder_failing{reason}`.
//!
//! An outage of the embedding server (a revoked key, a renamed model, a wrong url) makes the
//! projectors wait and retry rather than reject events, so nothing else would show it: this
//! module is where it becomes visible. It owns the warn line an operator acts on, logged once
//! when an embedder starts failing (or fails for a new reason), not on every retry.

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};
use std::time::SystemTime;

use engram_telemetry::metrics;

use crate::EmbedError;

/// Why one embedder is failing, since when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedderFailure {
    /// Where requests go, e.g. `http://127.0.0.1:8080/v1/embeddings`.
    pub endpoint: String,
    pub model: String,
    /// [`EmbedError::reason`]: `auth`, `not_found`, `unreachable`, ...
    pub reason: &'static str,
    /// The last error, with what to check.
    pub message: String,
    /// When the current run of failures began.
    pub since: SystemTime,
}

/// Failing embedders, by (endpoint, model). Several embedders can share a process (the
/// projectors' and the query service's); each keeps its own entry.
static FAILING: LazyLock<Mutex<BTreeMap<(String, String), EmbedderFailure>>> =
    LazyLock::new(Default::default);

/// The embedders of this process whose last call failed, oldest failure first. Empty when all
/// are well (or none has been called).
pub fn failing() -> Vec<EmbedderFailure> {
    let failing = FAILING.lock().unwrap_or_else(|p| p.into_inner());
    let mut all: Vec<EmbedderFailure> = failing.values().cloned().collect();
    all.sort_by_key(|f| f.since);
    all
}

/// Records a failed call. Input faults are the texts' business, not the embedder's health.
pub(crate) fn record_failure(endpoint: &str, model: &str, error: &EmbedError) {
    if error.is_input_fault() {
        return;
    }
    let reason = error.reason();
    metrics::EMBEDDER_FAILURES
        .with_label_values(&[reason])
        .inc();
    let mut failing = FAILING.lock().unwrap_or_else(|p| p.into_inner());
    let key = (endpoint.to_owned(), model.to_owned());
    let previous = failing.get(&key).map(|f| (f.reason, f.since));
    let since = match previous {
        Some((old, since)) if old == reason => {
            tracing::debug!(endpoint, model, reason, %error, "embedder still failing");
            since
        }
        _ => {
            tracing::warn!(
                endpoint,
                model,
                reason,
                %error,
                "embedder is failing; events wait and are retried until it answers"
            );
            SystemTime::now()
        }
    };
    failing.insert(
        key,
        EmbedderFailure {
            endpoint: endpoint.to_owned(),
            model: model.to_owned(),
            reason,
            message: error.to_string(),
            since,
        },
    );
    publish(&failing);
}

/// Records a call that succeeded.
pub(crate) fn record_success(endpoint: &str, model: &str) {
    let mut failing = FAILING.lock().unwrap_or_else(|p| p.into_inner());
    if failing.is_empty() {
        return;
    }
    if let Some(failure) = failing.remove(&(endpoint.to_owned(), model.to_owned())) {
        tracing::info!(
            endpoint,
            model,
            reason = failure.reason,
            "embedder answers again"
        );
        publish(&failing);
    }
}

/// Sets the gauge from the map: one series per reason seen, counting embedders failing for it.
fn publish(failing: &BTreeMap<(String, String), EmbedderFailure>) {
    let mut counts: BTreeMap<&'static str, i64> = BTreeMap::new();
    for failure in failing.values() {
        *counts.entry(failure.reason).or_default() += 1;
    }
    // Reasons that cleared go back to 0 rather than vanish, so an alert sees the recovery.
    for reason in REASONS {
        metrics::EMBEDDER_FAILING
            .with_label_values(&[reason])
            .set(counts.get(reason).copied().unwrap_or(0));
    }
    for (reason, count) in counts {
        metrics::EMBEDDER_FAILING
            .with_label_values(&[reason])
            .set(count);
    }
}

/// Every reason [`record_failure`] can see from an HTTP embedder, created up front by
/// [`publish`] so dashboards see zeros instead of gaps.
const REASONS: [&str; 8] = [
    "auth",
    "not_found",
    "rate_limited",
    "server",
    "refused",
    "unreachable",
    "bad_response",
    "dimension",
];

//! `/healthz` and `/metrics`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use engram_bus::Bus;

#[derive(Clone)]
struct AppState {
    bus: Bus,
    nats_url: String,
    lag: Arc<LagCheck>,
}

/// When a projector counts as stalled for `/healthz`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LagLimits {
    /// Events a projector's visible sequence may trail the stream's last sequence by...
    pub max_lag_events: u64,
    /// ...for at most this long, before `/healthz` answers 503 naming it. A projector
    /// catching up after a restart trails briefly; one that receives nothing keeps trailing.
    pub grace: Duration,
}

/// The running projectors' lag against the stream, tracked between samples so that
/// `/healthz` can say how long each has been behind. A projector that stopped receiving
/// events (its consumer or dead-letter stream gone) looks idle from the inside; only the
/// stream's last sequence shows that it is not.
pub struct LagCheck {
    projectors: VisibleSeqs,
    limits: LagLimits,
    /// Since when each projector has trailed by more than `max_lag_events`, at every sample.
    behind_since: Mutex<BTreeMap<&'static str, Instant>>,
}

/// Reads the visible sequence of every projector instance this process hosts now: a memory
/// node's partitions come and go.
pub type VisibleSeqs = Box<dyn Fn() -> Vec<(&'static str, u64)> + Send + Sync>;

/// One projector's place against the stream, as `/healthz` reports it.
struct Trailing {
    projector: &'static str,
    visible: u64,
    lag: u64,
    behind_for: Option<Duration>,
}

impl LagCheck {
    pub fn new(projectors: VisibleSeqs, limits: LagLimits) -> Arc<Self> {
        Arc::new(Self {
            projectors,
            limits,
            behind_since: Mutex::new(BTreeMap::new()),
        })
    }

    /// Samples the lag every quarter of the grace period (between 100 ms and 5 s) until the
    /// returned task is aborted, so that a stall is seen even when nobody asks `/healthz`.
    /// The same stream-info request shows the events stream's leader, whose moves it counts
    /// in `engram_stream_leader_changes_total`.
    pub fn spawn_sampler(self: &Arc<Self>, bus: Bus) -> tokio::task::JoinHandle<()> {
        let check = self.clone();
        let every =
            (self.limits.grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
        let stream = bus.config().stream.name.clone();
        // Created at 0 now: a dashboard sees no move rather than no series.
        let leader_changes =
            engram_telemetry::metrics::STREAM_LEADER_CHANGES.with_label_values(&[&stream]);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut leader = LeaderWatch::default();
            loop {
                tick.tick().await;
                match bus.stream_state().await {
                    Ok(state) => {
                        check.observe(state.last_seq);
                        if let Some(from) = leader.moved(state.leader) {
                            leader_changes.inc();
                            tracing::info!(stream = %stream, from = %from, to = ?leader.current(), "events stream leader moved");
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "lag sample failed"),
                }
            }
        })
    }

    /// Compares every projector with the stream's `last_seq` and updates how long each has
    /// been behind.
    fn observe(&self, last_seq: u64) -> Vec<Trailing> {
        let now = Instant::now();
        let mut since = self.behind_since.lock().expect("lag check lock poisoned");
        let hosted = (self.projectors)();
        // An instance no longer hosted (its partition moved away) is no longer behind here.
        since.retain(|projector, _| hosted.iter().any(|(p, _)| p == projector));
        hosted
            .into_iter()
            .map(|(projector, visible)| {
                let lag = last_seq.saturating_sub(visible);
                let behind_for = if lag > self.limits.max_lag_events {
                    Some(now - *since.entry(projector).or_insert(now))
                } else {
                    since.remove(projector);
                    None
                };
                Trailing {
                    projector,
                    visible,
                    lag,
                    behind_for,
                }
            })
            .collect()
    }
}

/// The last leader of a stream seen by a sampler, to tell when it moved.
#[derive(Debug, Default)]
struct LeaderWatch {
    last: Option<String>,
}

impl LeaderWatch {
    /// Takes the leader seen now; returns the previous one if the leader moved. A sample
    /// without a leader (an election under way, or a server that does not know yet) is no
    /// move: the next leader is compared with the last one seen, so an election that puts
    /// the same server back counts nothing, and one that picks another counts once.
    fn moved(&mut self, seen: Option<String>) -> Option<String> {
        let seen = seen.filter(|l| !l.is_empty())?;
        if self.last.as_ref() == Some(&seen) {
            return None;
        }
        // The first leader seen is no move: there was none before it to move from.
        self.last.replace(seen)
    }

    fn current(&self) -> Option<&str> {
        self.last.as_deref()
    }
}

pub fn router(bus: Bus, nats_url: String, lag: Arc<LagCheck>) -> Router {
    // Served to anyone who can reach the port: the URL's credentials must not be.
    let nats_url = engram_bus::config::redact_url(&nats_url);
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(AppState { bus, nats_url, lag })
}

/// 200 when the NATS connection is up, the events stream answers, no projector has trailed
/// the stream by more than the configured number of events for longer than the grace period
/// and no embedder has been failing for that long; 503 otherwise, with the reason, so a load
/// balancer and a human both learn something. Failing embedders are listed either way.
async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    let connected = state.bus.is_connected();
    let stream = if connected {
        state.bus.stream_state().await.map_err(|e| e.to_string())
    } else {
        Err("nats connection is down".to_owned())
    };
    let (status, body) = match stream {
        Ok(s) => {
            let trailing = state.lag.observe(s.last_seq);
            let projectors: serde_json::Map<String, serde_json::Value> = trailing
                .iter()
                .map(|t| {
                    let value = serde_json::json!({
                        "visible_seq": t.visible,
                        "lag": t.lag,
                        "behind_secs": t.behind_for.map(|d| d.as_secs_f64()),
                    });
                    (t.projector.to_owned(), value)
                })
                .collect();
            let mut stalled: Vec<String> = trailing
                .iter()
                .filter(|t| t.behind_for.is_some_and(|d| d >= state.lag.limits.grace))
                .map(|t| {
                    format!(
                        "projector {} trails the stream by {} events (visible seq {}, stream last seq {}) and has been more than {} behind for {:.0?}; see its logs and engram_projector_lag_events",
                        t.projector,
                        t.lag,
                        t.visible,
                        s.last_seq,
                        state.lag.limits.max_lag_events,
                        t.behind_for.unwrap_or_default(),
                    )
                })
                .collect();
            // An embedding server that refuses or is down makes the projectors wait, not
            // reject events: shown at once, and a reason for 503 after the same grace as a
            // projector's lag, so that one failed call does not take the service out.
            let embedders = engram_embed::health::failing();
            let now = std::time::SystemTime::now();
            let failing_for = |f: &engram_embed::health::EmbedderFailure| {
                now.duration_since(f.since).unwrap_or_default()
            };
            stalled.extend(
                embedders
                    .iter()
                    .filter(|f| failing_for(f) >= state.lag.limits.grace)
                    .map(|f| {
                        format!(
                            "embedder {} (model {}) has failed ({}) for {:.0?}: {}",
                            f.endpoint,
                            f.model,
                            f.reason,
                            failing_for(f),
                            f.message
                        )
                    }),
            );
            let embedders: Vec<serde_json::Value> = embedders
                .iter()
                .map(|f| {
                    serde_json::json!({
                        "endpoint": f.endpoint,
                        "model": f.model,
                        "reason": f.reason,
                        "message": f.message,
                        "failing_secs": failing_for(f).as_secs_f64(),
                    })
                })
                .collect();
            let status = if stalled.is_empty() {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            let mut body = serde_json::json!({
                "status": if stalled.is_empty() { "ok" } else { "unavailable" },
                "nats": {"url": state.nats_url, "connected": true},
                "stream": {"name": state.bus.config().stream.name, "messages": s.messages, "last_seq": s.last_seq},
                "projectors": projectors,
                "embedders_failing": embedders,
            });
            if !stalled.is_empty() {
                body["reason"] = stalled.join("; ").into();
            }
            (status, body)
        }
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({
                "status": "unavailable",
                "reason": reason,
                "nats": {"url": state.nats_url, "connected": connected},
            }),
        ),
    };
    (status, axum::Json(body))
}

async fn metrics(State(state): State<AppState>) -> axum::response::Response {
    use engram_telemetry::metrics as m;
    // Stream gauges are read from the server at scrape time: it is the source of truth, and
    // a scrape every few seconds costs one request.
    if let Ok(s) = state.bus.stream_state().await {
        m::STREAM_MESSAGES.set(i64::try_from(s.messages).unwrap_or(i64::MAX));
        m::STREAM_BYTES.set(i64::try_from(s.bytes).unwrap_or(i64::MAX));
        m::STREAM_LAST_SEQ.set(i64::try_from(s.last_seq).unwrap_or(i64::MAX));
    }
    engram_gateway::ops::metrics().await
}

#[cfg(test)]
mod tests {
    use super::LeaderWatch;

    #[test]
    fn a_leader_moves_when_another_server_leads_not_during_an_election() {
        let mut watch = LeaderWatch::default();
        let seen = |l: &str| (!l.is_empty()).then(|| l.to_owned());
        // The first leader seen is no move, nor is the same one again.
        assert_eq!(watch.moved(seen("n1")), None);
        assert_eq!(watch.moved(seen("n1")), None);
        // No leader (an election), then another: one move, from the last one seen.
        assert_eq!(watch.moved(None), None);
        assert_eq!(watch.moved(seen("")), None);
        assert_eq!(watch.moved(seen("n2")), Some("n1".to_owned()));
        assert_eq!(watch.current(), Some("n2"));
        // An election that puts the same server back is no move.
        assert_eq!(watch.moved(None), None);
        assert_eq!(watch.moved(seen("n2")), None);
        assert_eq!(watch.moved(seen("n3")), Some("n2".to_owned()));
    }
}

//! `/healthz` and `/metrics`.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use engram_bus::Bus;

#[derive(Clone)]
struct AppState {
    bus: Bus,
    nats_url: String,
}

pub fn router(bus: Bus, nats_url: String) -> Router {
    // Served to anyone who can reach the port: the URL's credentials must not be.
    let nats_url = engram_bus::config::redact_url(&nats_url);
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(AppState { bus, nats_url })
}

/// 200 when the NATS connection is up and the events stream answers; 503 otherwise, with the
/// reason, so a load balancer and a human both learn something.
async fn healthz(State(state): State<AppState>) -> impl IntoResponse {
    let connected = state.bus.is_connected();
    let stream = if connected {
        state.bus.stream_summary().await.map_err(|e| e.to_string())
    } else {
        Err("nats connection is down".to_owned())
    };
    let (status, body) = match stream {
        Ok(s) => (
            StatusCode::OK,
            serde_json::json!({
                "status": "ok",
                "nats": {"url": state.nats_url, "connected": true},
                "stream": {"name": s.name, "messages": s.messages, "last_seq": s.last_seq},
            }),
        ),
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

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    use engram_telemetry::metrics as m;
    // Stream gauges are read from the server at scrape time: it is the source of truth, and
    // a scrape every few seconds costs one request.
    if let Ok(s) = state.bus.stream_summary().await {
        m::STREAM_MESSAGES.set(i64::try_from(s.messages).unwrap_or(i64::MAX));
        m::STREAM_BYTES.set(i64::try_from(s.bytes).unwrap_or(i64::MAX));
        m::STREAM_LAST_SEQ.set(i64::try_from(s.last_seq).unwrap_or(i64::MAX));
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        engram_telemetry::metrics::render(),
    )
}

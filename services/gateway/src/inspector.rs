//! The memory inspector: a static page (HTML, one script, one stylesheet, no build step)
//! that reads `/v1` with the API key the user pastes in, so it sees exactly what that key
//! may read. The files are compiled in: the gateway serves them with no directory to find.

use std::sync::Arc;

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::Gateway;

const INDEX: &str = include_str!("inspector/index.html");
const APP: &str = include_str!("inspector/app.js");
const STYLE: &str = include_str!("inspector/style.css");

/// Every page of the inspector forbids framing and loads nothing but its own files.
const CSP: &str = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

fn page(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

pub(crate) fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route(
            "/inspector",
            get(|| async { page("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/inspector/app.js",
            get(|| async { page("text/javascript; charset=utf-8", APP) }),
        )
        .route(
            "/inspector/style.css",
            get(|| async { page("text/css; charset=utf-8", STYLE) }),
        )
}

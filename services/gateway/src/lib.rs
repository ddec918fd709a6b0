//! Engram's HTTP API (`/v1`): appends and the query protocol over HTTP, for agents that do not
//! speak NATS.
//!
//! **Authentication is the agent's own identity.** An API key (`engram key add`) is the
//! agent's credentials in one line (`egk.<tenant>.<agent>.<seed>`): the gateway connects to
//! NATS with that key, so the server enforces exactly the permissions an agent's NATS
//! credentials have, and a revoked key stops working here the moment the server closes its
//! connection. The gateway never holds a wider identity for a caller, and so can never
//! widen one.
//!
//! # Layout
//! - this module: the gateway's state (one NATS connection per key, bounded; a token bucket
//!   per key), errors, and the router.
//! - [`routes`]: the handlers, one per route.
//! - [`openapi`]: the OpenAPI document, generated from the same Rust types as the NATS
//!   protocol's JSON Schema.
//! - [`serve`]: the HTTP server loop, with header and body read timeouts and a connection
//!   limit ([`ServeLimits`]).
//! - [`ops`]: `/healthz` and `/metrics`, when the gateway runs as its own process
//!   ([`Probes`]).
//!
//! **A key is exactly one identity.** The tenant and agent tokens of an API key are claims;
//! the seed is the proof of its public key only. So a new connection is verified before it
//! serves anything: its `whoami` must answer (the server lets a key publish only on its own
//! agent's query subject, so edited tokens cannot ask), for those tokens, with this public
//! key among the registry's live keys of that agent. Connections are cached by the whole
//! identity and never serve another.

pub mod inspector;
pub mod openapi;
pub mod ops;
pub mod routes;
pub mod serve;
pub mod tail;

pub use serve::{BodyTimedOut, ServeLimits, serve};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use engram_access::Credentials;
use engram_bus::BusConfig;
use engram_sdk::{Client, RetryPolicy};
use serde::{Deserialize, Serialize};

/// `[gateway]` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Largest request body; a larger one is answered 413.
    pub max_body_bytes: usize,
    /// API keys with a NATS connection open at once; the least recently used is closed
    /// past it (and reopened on its next request).
    pub max_identities: usize,
    /// Requests per second one key may make, on average...
    pub rate_per_second: f64,
    /// ...and in a burst. Beyond it: 429 with `Retry-After`.
    pub burst: f64,
    /// Live tails (`GET /v1/tail`) one key may hold open at once...
    pub max_tails_per_key: usize,
    /// ...and all keys together.
    pub max_tails: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            max_identities: 1024,
            rate_per_second: 50.0,
            burst: 100.0,
            max_tails_per_key: 4,
            max_tails: 256,
        }
    }
}

impl GatewayConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_body_bytes == 0
            || self.max_identities == 0
            || self.max_tails == 0
            || self.max_tails_per_key == 0
        {
            return Err(
                "gateway.max_body_bytes, max_identities, max_tails and max_tails_per_key must be at least 1".into(),
            );
        }
        if !(self.rate_per_second > 0.0 && self.burst >= 1.0) {
            return Err(
                "gateway.rate_per_second must be above 0 and gateway.burst at least 1".into(),
            );
        }
        Ok(())
    }
}

/// Every code the gateway's own routes answer an error with: the body's `code`, and the
/// `code` label of `engram_gateway_errors_total`.
pub const ERROR_CODES: [&str; 12] = [
    "invalid",
    "unauthenticated",
    "forbidden",
    "not_yet_visible",
    "busy",
    "rate_limited",
    "too_large",
    "conflict",
    "unavailable",
    "internal",
    "timeout",
    "too_many_connections",
];

/// A failed request, as the caller sees it: a status, a stable code and a message.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<Duration>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid", message)
    }

    fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
    }

    /// The one answer to a key the server or the registry does not know as it claims to be:
    /// revoked, never issued, or with tokens that are not its own.
    fn refused_key() -> Self {
        Self::unauthenticated(
            "the server refused this key: it was revoked, or never issued (`engram agent list`)",
        )
    }
}

impl From<engram_sdk::RpcError> for ApiError {
    fn from(e: engram_sdk::RpcError) -> Self {
        use engram_sdk::ErrorCode as C;
        let (status, code) = match e.code() {
            C::Invalid => (StatusCode::BAD_REQUEST, "invalid"),
            C::Forbidden => (StatusCode::FORBIDDEN, "forbidden"),
            C::NotYetVisible => (StatusCode::REQUEST_TIMEOUT, "not_yet_visible"),
            C::Busy => (StatusCode::TOO_MANY_REQUESTS, "busy"),
            C::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            C::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        let mut err = Self::new(status, code, e.to_string());
        if code == "busy" {
            err.retry_after = Some(Duration::from_secs(1));
        }
        err
    }
}

impl From<engram_sdk::AppendError> for ApiError {
    fn from(e: engram_sdk::AppendError) -> Self {
        use engram_sdk::AppendError as A;
        let (status, code) = match &e {
            A::Invalid(_) | A::Rejected(_) => (StatusCode::BAD_REQUEST, "invalid"),
            A::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            A::Conflict { .. } => (StatusCode::CONFLICT, "conflict"),
            A::Forbidden { .. } => (StatusCode::FORBIDDEN, "forbidden"),
            A::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        };
        Self::new(status, code, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        engram_telemetry::metrics::GATEWAY_ERRORS
            .with_label_values(&[self.code])
            .inc();
        let body = serde_json::json!({"error": {"code": self.code, "message": self.message}});
        let mut response = (self.status, axum::Json(body)).into_response();
        // Whole seconds, rounded up: rounded down, a client that waits exactly as told comes
        // back before its token is there and is refused again.
        if let Some(after) = self.retry_after
            && let Ok(v) = HeaderValue::from_str(&after.as_secs_f64().ceil().max(1.0).to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// A key's token bucket.
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// A key's open connection, verified for the identity it is cached under.
struct Open {
    client: Client,
    /// The public key it connected with, when the registry verified it: a public key
    /// belongs to one identity only (the registry never gives one to a second), so another
    /// identity claiming it is refused without asking anyone. `None` without a registry.
    verified_key: Option<String>,
    used: Instant,
}

/// The gateway's state.
pub struct Gateway {
    bus: BusConfig,
    config: GatewayConfig,
    scrub: engram_scrub::ScrubConfig,
    clients: tokio::sync::Mutex<HashMap<String, Open>>,
    buckets: Mutex<HashMap<String, Bucket>>,
    /// New NATS connections being made at once. Any well-formed key passes the format
    /// check (seeds are free to make), so connecting for a key the server will refuse must
    /// not be unbounded.
    connecting: tokio::sync::Semaphore,
    /// Open tails by key.
    tails: Arc<Mutex<HashMap<String, usize>>>,
    /// One connect-and-verify at a time per public key: concurrent first requests of a key
    /// wait for one connection, and the identities one seed can claim (any tokens) cost
    /// one verification slot at a time, not one of [`MAX_CONNECTING`] each.
    verifying: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The last check of whether a NATS server answers, for `/healthz` ([`ops`]).
    nats_check: ops::NatsCheck,
}

/// New connections made at once, at most.
const MAX_CONNECTING: usize = 16;

/// How long a new connection's `whoami` may take. A key whose tokens are not its own can
/// neither publish on those tokens' subject nor receive on their inbox (the server denies
/// both), so it gets no answer at all: past this it is refused like an unknown key.
pub const VERIFY_TIMEOUT: Duration = Duration::from_secs(5);

/// The caller of one request: its credentials and its connection, verified. The
/// authenticating middleware ([`authenticate`]) puts it in the request's extensions.
#[derive(Clone)]
pub struct Caller {
    pub creds: Credentials,
    pub client: Client,
}

impl Caller {
    /// The whole identity, `<tenant>.<agent>.<public key>`: what connections and MCP
    /// sessions are bound to.
    pub fn identity(&self) -> String {
        identity_of(&self.creds)
    }

    pub fn tenant(&self) -> &engram_schema::Ident {
        self.creds
            .agent_identity()
            .expect("an API key is an agent's")
            .0
    }

    pub fn agent(&self) -> &engram_schema::Ident {
        self.creds
            .agent_identity()
            .expect("an API key is an agent's")
            .1
    }
}

impl Gateway {
    /// `bus` is the connection template (URL, timeouts); each key connects with its own
    /// credentials on top of it.
    pub fn new(
        bus: BusConfig,
        config: GatewayConfig,
        scrub: engram_scrub::ScrubConfig,
    ) -> Arc<Self> {
        // Every code's series from the start: a dashboard or an alert on the gateway finds
        // zeros before its first error, not nothing.
        for code in ERROR_CODES {
            engram_telemetry::metrics::GATEWAY_ERRORS.with_label_values(&[code]);
        }
        Arc::new(Self {
            bus,
            config,
            scrub,
            clients: tokio::sync::Mutex::default(),
            buckets: Mutex::default(),
            connecting: tokio::sync::Semaphore::new(MAX_CONNECTING),
            tails: Arc::default(),
            verifying: Mutex::default(),
            nats_check: ops::NatsCheck::default(),
        })
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    /// Who is asking: the bearer API key, rate-limited, with its connection.
    pub async fn caller(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| {
                ApiError::unauthenticated(
                    "send `Authorization: Bearer <API key>`; an admin issues keys with `engram key add --tenant <t> --agent <a>`",
                )
            })?;
        let creds =
            Credentials::from_api_key(key).map_err(|e| ApiError::unauthenticated(e.to_string()))?;
        let id = creds.public_key();
        self.take_token(&id)?;
        let client = self.client_for(&creds).await?;
        Ok(Caller { creds, client })
    }

    fn take_token(&self, id: &str) -> Result<(), ApiError> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        // Bounded like the connections: a flood of made-up keys cannot grow the map. Past
        // the bound, buckets idle for a minute go; if that is not enough, all do (a flood
        // then resets everyone's budget, which costs less than the memory).
        let cap = self.config.max_identities * 4;
        if buckets.len() >= cap && !buckets.contains_key(id) {
            buckets.retain(|_, b| b.at.elapsed() < Duration::from_secs(60));
            if buckets.len() >= cap {
                buckets.clear();
            }
        }
        let now = Instant::now();
        let (rate, burst) = (self.config.rate_per_second, self.config.burst);
        let bucket = buckets.entry(id.to_owned()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        bucket.tokens =
            (bucket.tokens + now.duration_since(bucket.at).as_secs_f64() * rate).min(burst);
        bucket.at = now;
        if bucket.tokens < 1.0 {
            let wait = Duration::from_secs_f64((1.0 - bucket.tokens) / rate);
            let mut err = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!(
                    "this key makes more than {rate} requests per second (burst {burst}); retry after the Retry-After header's seconds"
                ),
            );
            err.retry_after = Some(wait);
            return Err(err);
        }
        bucket.tokens -= 1.0;
        Ok(())
    }

    /// The verified connection of `creds`' identity: the cached one, or one connected and
    /// verified now.
    async fn client_for(&self, creds: &Credentials) -> Result<Client, ApiError> {
        let identity = identity_of(creds);
        let public_key = creds.public_key();
        if let Some(client) = self.cached(&identity, &public_key).await? {
            return Ok(client);
        }
        let _turn = self.verify_turn(&public_key).await?;
        // The request that held the turn before may have connected this identity.
        if let Some(client) = self.cached(&identity, &public_key).await? {
            return Ok(client);
        }
        let Ok(_permit) = self.connecting.try_acquire() else {
            let mut err = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the gateway is opening many connections at once; retry after the Retry-After header's seconds",
            );
            err.retry_after = Some(Duration::from_secs(1));
            return Err(err);
        };
        // Connected without holding the map: one slow connect must not hold every other
        // key's requests.
        let config = BusConfig {
            nkey: Some(engram_bus::NkeyAuth::of(creds)),
            client_name: format!(
                "engram-gateway-{}",
                &public_key[public_key.len().saturating_sub(8)..]
            ),
            ..self.bus.clone()
        };
        let client = Client::with_config(config, RetryPolicy::default(), false)
            .await
            .map_err(|e| match e {
                engram_bus::BusError::Unauthorized { .. } => ApiError::refused_key(),
                other => ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    other.to_string(),
                ),
            })?
            .with_scrub(&self.scrub);
        // Before its first use: an unverified connection never serves a request. A refused
        // one is dropped here, which closes it.
        let registry = verify(&client, creds).await?;
        let mut clients = self.clients.lock().await;
        if clients.len() >= self.config.max_identities
            && let Some(oldest) = clients
                .iter()
                .min_by_key(|(_, o)| o.used)
                .map(|(k, _)| k.clone())
        {
            clients.remove(&oldest);
        }
        clients.insert(
            identity,
            Open {
                client: client.clone(),
                verified_key: registry.then_some(public_key),
                used: Instant::now(),
            },
        );
        Ok(client)
    }

    /// The cached connection of `identity`, if it is still connected; a refusal if the
    /// registry verified `public_key` for another identity (the same seed with edited
    /// tokens), without asking anyone.
    async fn cached(&self, identity: &str, public_key: &str) -> Result<Option<Client>, ApiError> {
        let mut clients = self.clients.lock().await;
        if let Some(open) = clients.get_mut(identity) {
            // A connection the server closed (the key was revoked) is not reused: connecting
            // again tells a revoked key from a live one.
            if open.client.bus().client().connection_state()
                == async_nats::connection::State::Connected
            {
                open.used = Instant::now();
                return Ok(Some(open.client.clone()));
            }
            clients.remove(identity);
            return Ok(None);
        }
        if clients
            .values()
            .any(|o| o.verified_key.as_deref() == Some(public_key))
        {
            return Err(ApiError::refused_key());
        }
        Ok(None)
    }

    /// This public key's turn to connect and verify; waits for the one before it, and
    /// answers 503 if that takes longer than a connect and a verification can.
    async fn verify_turn(&self, public_key: &str) -> Result<VerifyTurn<'_>, ApiError> {
        let lock = {
            let mut verifying = self.verifying.lock().unwrap_or_else(|p| p.into_inner());
            verifying.entry(public_key.to_owned()).or_default().clone()
        };
        let wait = VERIFY_TIMEOUT + self.bus.connect_timeout;
        let guard = tokio::time::timeout(wait, lock.lock_owned()).await;
        let turn = VerifyTurn {
            gateway: self,
            public_key: public_key.to_owned(),
            guard: guard.ok(),
        };
        if turn.guard.is_none() {
            let mut err = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "this key's connection is still being verified; retry after the Retry-After header's seconds",
            );
            err.retry_after = Some(Duration::from_secs(1));
            return Err(err);
        }
        Ok(turn)
    }
}

/// One key's turn to connect and verify; the last turn of a key removes its lock.
struct VerifyTurn<'a> {
    gateway: &'a Gateway,
    public_key: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for VerifyTurn<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut verifying = self
            .gateway
            .verifying
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Only the map holds it: no request waits for this key's turn.
        if verifying
            .get(&self.public_key)
            .is_some_and(|lock| Arc::strong_count(lock) == 1)
        {
            verifying.remove(&self.public_key);
        }
    }
}

/// `<tenant>.<agent>.<public key>`: the whole identity an API key claims.
fn identity_of(creds: &Credentials) -> String {
    let (tenant, agent) = creds.agent_identity().expect("an API key is an agent's");
    format!("{tenant}.{agent}.{}", creds.public_key())
}

/// Whether `client`, connected with `creds`' seed, is the identity its tokens claim: its
/// `whoami` answers for those tokens, with its public key among the registry's live keys of
/// that agent. `Ok(true)` when verified against the registry; `Ok(false)` when the query
/// service has none.
async fn verify(client: &Client, creds: &Credentials) -> Result<bool, ApiError> {
    use engram_sdk::{ErrorCode, RpcError};
    let (tenant, agent) = creds.agent_identity().expect("an API key is an agent's");
    let public_key = creds.public_key();
    let refused = |reason: &str| {
        tracing::info!(%tenant, %agent, key = %public_key, reason, "api key refused");
        ApiError::refused_key()
    };
    let me = match tokio::time::timeout(VERIFY_TIMEOUT, client.whoami()).await {
        // The server dropped the request (its subject or its reply inbox is not this key's).
        Err(_) | Ok(Err(RpcError::Timeout { .. })) => {
            return Err(refused("whoami was not answered"));
        }
        Ok(Err(RpcError::NoResponders { .. })) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "no query service answers, so this key cannot be verified; is `engram up` (or the query service) running?",
            ));
        }
        Ok(Err(e)) if e.code() == ErrorCode::Forbidden => {
            return Err(refused(
                "the registry holds no live credentials for its agent",
            ));
        }
        Ok(Err(e)) => return Err(e.into()),
        Ok(Ok(me)) => me,
    };
    if me.tenant != *tenant || me.agent != *agent {
        return Err(refused("whoami answered for another identity"));
    }
    match me.public_keys {
        // No registry behind the query service: the server authenticates nobody
        // (`--insecure-no-auth`), so there is nothing to check a key against, and its tokens
        // are taken as they are, as they always were without authentication.
        None => Ok(false),
        Some(keys) if keys.contains(&public_key) => Ok(true),
        Some(_) => Err(refused("its public key is not a live key of its agent")),
    }
}

/// Authenticates a request from its headers alone, before any byte of its body is read:
/// the key, its rate limit and its verified connection, put in the request's extensions as
/// the [`Caller`] the handler takes. An unauthenticated request is answered here; its body
/// is never read.
pub async fn authenticate(
    State(gateway): State<Arc<Gateway>>,
    mut request: Request,
    next: Next,
) -> Response {
    match gateway.caller(request.headers()).await {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(e) => e.into_response(),
    }
}

/// Who answers `/healthz` and `/metrics` on the gateway's port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probes {
    /// The gateway ([`ops`]): it runs as its own process (`engram gateway`).
    Gateway,
    /// The process the gateway is part of (`engram up`), whose `/healthz` also reports its
    /// projectors; a path has one handler, so the gateway adds neither.
    Host,
}

/// The `/v1` routes, `/openapi.json` and, as `probes` says, `/healthz` and `/metrics`, with
/// the body limit applied.
pub fn router(gateway: Arc<Gateway>, probes: Probes) -> axum::Router {
    let limit = gateway.config.max_body_bytes;
    routes::routes(&gateway, probes)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .with_state(gateway)
}

//! Streamable HTTP at `/mcp`, beside the HTTP API on the same address.
//!
//! Each request is authenticated before it reaches the MCP session: the bearer API key goes
//! through [`Gateway::caller`] (rate-limited, one NATS connection per key), so a missing,
//! malformed or revoked key is a 401 with the gateway's error body, and nothing about MCP is
//! revealed to it. The request's [`Identity`] (the key's agent, the `Engram-Scope` it writes,
//! the `Engram-Read` scopes it reads) then travels in the request's extensions, where the
//! tools find it; it never comes from a tool's arguments.
//!
//! The `Host` header is checked against `[mcp] allowed_hosts` (by rmcp), so a web page that
//! rebinds its DNS name to this address cannot drive the server from a browser; the `Origin`
//! header a browser sends is checked against `[mcp] allowed_origins` before anything else
//! (the MCP specification's "servers MUST validate the Origin header"), so a page of another
//! site cannot use a key the browser holds.
//!
//! **A session belongs to the key that opened it.** rmcp's sessions know nothing of keys, so
//! [`BoundSessions`] records each session's identity when its `initialize` is answered, and a
//! request naming a session of another key is answered exactly like one naming no session
//! (404), before rmcp sees it: it can neither use nor close it. Open sessions are bounded per
//! key (`mcp.max_sessions_per_key`) and in all (`mcp.max_sessions`).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use engram_gateway::{ApiError, Gateway};
use engram_sdk::Scope;
use futures::Stream;
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_server::session::local::{LocalSessionManager, SessionConfig};
use rmcp::transport::streamable_http_server::session::{EventStore, ServerSseMessage};
use rmcp::transport::streamable_http_server::{
    RestoreOutcome, SessionId, SessionManager, StreamableHttpServerConfig, StreamableHttpService,
};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{EngramMcp, Identity, McpError, parse_scope};

/// The header naming the scope an HTTP client's tools write to (`kind:id`); default
/// `agent:<agent>`.
pub const SCOPE_HEADER: &str = "engram-scope";
/// Granted scopes the tools read too: `kind:id`, comma-separated, the header repeatable.
pub const READ_HEADER: &str = "engram-read";
/// The instance id written into events (default `mcp-http`).
pub const INSTANCE_HEADER: &str = "engram-instance";

/// Keys whose read-your-writes token is kept; past it they are all dropped (a key then reads
/// without waiting for its last write once).
const MAX_TOKENS: usize = 4096;

/// The header carrying an MCP session's id.
const SESSION_HEADER: &str = "mcp-session-id";

/// `[mcp]` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// `Host` header values `/mcp` answers, as `host` (any port) or `host:port`: the defence
    /// against DNS rebinding. Empty (the default): the HTTP listen address, `localhost`,
    /// `127.0.0.1` and `[::1]`, at the listen port. Behind a proxy or on a public name, list
    /// the names clients use. `["*"]` accepts any host (turns the defence off).
    pub allowed_hosts: Vec<String>,
    /// `Origin` header values `/mcp` accepts, as `scheme://host[:port]` (a port left out is
    /// the scheme's default), or `"null"`; a request without `Origin` (not from a browser)
    /// passes. Empty (the default): `http://` and `https://` of `localhost`, `127.0.0.1`,
    /// `[::1]` and the listen address as for `allowed_hosts`, at the listen port. `["*"]`
    /// accepts any origin (turns the check off). Another origin is answered 403.
    pub allowed_origins: Vec<String>,
    /// MCP sessions one API key may hold open at once; one more `initialize` is 429.
    pub max_sessions_per_key: usize,
    /// MCP sessions open at once, all keys together.
    pub max_sessions: usize,
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            // A harness opens one per conversation; idle ones close after five minutes.
            max_sessions_per_key: 16,
            max_sessions: 1024,
        }
    }
}

impl McpConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_sessions_per_key == 0 || self.max_sessions == 0 {
            return Err("mcp.max_sessions_per_key and mcp.max_sessions must be at least 1".into());
        }
        for origin in &self.allowed_origins {
            let origin = origin.trim();
            if origin != "*" && Origin::parse(origin).is_none() {
                return Err(format!(
                    "mcp.allowed_origins entry {origin:?} is not an origin: use scheme://host or scheme://host:port with scheme http or https and no path (for example \"https://app.example.com\"), \"null\", or \"*\" for any"
                ));
            }
        }
        for host in &self.allowed_hosts {
            let host = host.trim();
            if host == "*" {
                continue;
            }
            if host.is_empty()
                || host.contains(['/', ' ', '@'])
                || axum::http::uri::Authority::try_from(host).is_err()
            {
                return Err(format!(
                    "mcp.allowed_hosts entry {host:?} is not a host or host:port (for example \"engram.internal\" or \"10.0.0.5:7077\")"
                ));
            }
        }
        Ok(())
    }

    /// The runtime settings for a server listening on `listen` (the address actually bound,
    /// so a port 0 is resolved).
    pub fn http(&self, listen: SocketAddr) -> McpHttpConfig {
        let allowed_hosts = if self.allowed_hosts.is_empty() {
            default_hosts(listen)
        } else if self.allowed_hosts.iter().any(|h| h.trim() == "*") {
            Vec::new()
        } else {
            self.allowed_hosts
                .iter()
                .map(|h| h.trim().to_owned())
                .collect()
        };
        let allowed_origins = if self.allowed_origins.is_empty() {
            Some(default_origins(listen))
        } else if self.allowed_origins.iter().any(|o| o.trim() == "*") {
            None
        } else {
            Some(
                self.allowed_origins
                    .iter()
                    .filter_map(|o| Origin::parse(o.trim()))
                    .collect(),
            )
        };
        McpHttpConfig {
            allowed_hosts,
            allowed_origins,
            max_sessions_per_key: self.max_sessions_per_key,
            max_sessions: self.max_sessions,
            shutdown: CancellationToken::new(),
        }
    }
}

/// `http://` and `https://` of the loopback names and the listen address itself (as
/// [`default_hosts`]), at the listen port.
fn default_origins(listen: SocketAddr) -> Vec<Origin> {
    default_hosts(listen)
        .iter()
        .flat_map(|host| ["http", "https"].map(|scheme| format!("{scheme}://{host}")))
        .filter_map(|origin| Origin::parse(&origin))
        .collect()
}

/// A browser origin as RFC 6454 compares them: scheme, host and port, the port filled in
/// from the scheme when left out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `Origin: null`: a sandboxed frame, a file, a redirect across origins.
    Null,
    Tuple {
        scheme: String,
        host: String,
        port: u16,
    },
}

impl Origin {
    /// `scheme://host[:port]` with scheme http or https and nothing after, or `null`.
    pub fn parse(text: &str) -> Option<Self> {
        if text == "null" {
            return Some(Self::Null);
        }
        let (scheme, rest) = text.split_once("://")?;
        let scheme = scheme.to_ascii_lowercase();
        let default_port = match scheme.as_str() {
            "http" => 80,
            "https" => 443,
            _ => return None,
        };
        if rest.is_empty() || rest.contains(['/', '@', '?', '#', ' ']) {
            return None;
        }
        let authority = axum::http::uri::Authority::try_from(rest).ok()?;
        Some(Self::Tuple {
            scheme,
            host: authority.host().to_ascii_lowercase(),
            port: authority.port_u16().unwrap_or(default_port),
        })
    }
}

/// Loopback names and the listen address itself, at the listen port.
fn default_hosts(listen: SocketAddr) -> Vec<String> {
    let port = listen.port();
    let mut hosts = vec![
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
    ];
    if !listen.ip().is_unspecified() && !listen.ip().is_loopback() {
        hosts.push(listen.to_string());
    }
    hosts
}

/// What [`router`] serves with.
#[derive(Clone, Debug)]
pub struct McpHttpConfig {
    /// `Host` values accepted, `host` or `host:port`; empty accepts any (not recommended).
    pub allowed_hosts: Vec<String>,
    /// `Origin` values accepted (a request without one passes); `None` accepts any.
    pub allowed_origins: Option<Vec<Origin>>,
    /// Open sessions per key, and in all.
    pub max_sessions_per_key: usize,
    pub max_sessions: usize,
    /// Cancelled on shutdown: ends open MCP streams, so a graceful HTTP shutdown does not
    /// wait for clients to hang up.
    pub shutdown: CancellationToken,
}

/// The router's state: the gateway that authenticates keys, and each key's last write.
struct HttpState {
    gateway: Arc<Gateway>,
    /// By key and scope: the read-your-writes token shared by the requests of one client.
    tokens: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// Every open session and the key that opened it.
    sessions: Arc<BoundSessions>,
    /// `None`: any origin.
    origins: Option<Vec<Origin>>,
}

impl HttpState {
    fn token(&self, key: String) -> Arc<AtomicU64> {
        let mut tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        if tokens.len() >= MAX_TOKENS && !tokens.contains_key(&key) {
            tokens.clear();
        }
        tokens.entry(key).or_default().clone()
    }
}

/// `/mcp`: the MCP server over streamable HTTP, each request authenticated by its API key.
pub fn router(gateway: Arc<Gateway>, config: McpHttpConfig) -> axum::Router {
    let sessions = Arc::new(BoundSessions {
        inner: LocalSessionManager::default(),
        owners: Mutex::default(),
        max_per_key: config.max_sessions_per_key,
        max_total: config.max_sessions,
    });
    let state = Arc::new(HttpState {
        gateway: gateway.clone(),
        tokens: Mutex::default(),
        sessions: sessions.clone(),
        origins: config.allowed_origins,
    });
    // Origins are checked by `authenticate`, first and with the JSON error body; rmcp's own
    // Origin check stays off (its empty default).
    let server = StreamableHttpServerConfig::default()
        .with_allowed_hosts(config.allowed_hosts)
        .with_max_request_body_bytes(gateway.config().max_body_bytes)
        .with_cancellation_token(config.shutdown);
    let service = StreamableHttpService::new(|| Ok(EngramMcp::per_request()), sessions, server);
    axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(state, authenticate))
}

/// Puts the request's [`Identity`] in its extensions, or answers 403 (a cross-site
/// `Origin`), 401 (no or bad key), 400 (a malformed scope header), the gateway's rate limit,
/// 404 (a session this key did not open) or 429 (too many sessions).
async fn authenticate(
    State(state): State<Arc<HttpState>>,
    mut request: Request,
    next: Next,
) -> Response {
    if let Err(e) = check_origin(state.origins.as_deref(), request.headers()) {
        return e.into_response();
    }
    let caller = match state.gateway.caller(request.headers()).await {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let owner = caller.identity();
    let identity = match identity_of(&state, caller, request.headers()) {
        Ok(identity) => identity,
        Err(e) => return e.into_response(),
    };
    request.extensions_mut().insert(identity);
    let session = request
        .headers()
        .get(SESSION_HEADER)
        .map(|v| v.to_str().map(SessionId::from));
    match session {
        Some(Ok(id)) if state.sessions.owner(&id).as_deref() == Some(owner.as_str()) => {
            next.run(request).await
        }
        // Another key's session, or none: the same answer, so a key learns nothing of
        // sessions it did not open, and rmcp never sees the request (no use, no DELETE).
        Some(_) => unknown_session().into_response(),
        None if request.method() == Method::POST => {
            // Without a session, a POST may be an `initialize`, which opens one: its slot is
            // taken before, and kept only if the answer names a session.
            let opening = match state.sessions.reserve(&owner).await {
                Ok(opening) => opening,
                Err(e) => return e.into_response(),
            };
            let response = next.run(request).await;
            if let Some(id) = response
                .headers()
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
            {
                opening.opened(SessionId::from(id)).await;
            }
            response
        }
        None => next.run(request).await,
    }
}

fn unknown_session() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no open MCP session of this key has this Mcp-Session-Id (it ended, or was never opened by this key); start a new one with an initialize request without the header",
    )
}

/// Refuses a browser request from an origin not in `allowed` (`None`: any is allowed).
fn check_origin(allowed: Option<&[Origin]>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(allowed) = allowed else {
        return Ok(());
    };
    for value in headers.get_all(header::ORIGIN) {
        let text = value.to_str().unwrap_or("(not text)");
        if !Origin::parse(text).is_some_and(|o| allowed.contains(&o)) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "a page from origin {text:?} may not use /mcp: only the origins in mcp.allowed_origins may (by default this server's own loopback address); a client that is not a browser sends no Origin header"
                ),
            ));
        }
    }
    Ok(())
}

/// rmcp's in-memory sessions, each bound to the identity (`Caller::identity`) of the key
/// that opened it, with the number open bounded per key and in all.
struct BoundSessions {
    inner: LocalSessionManager,
    owners: Mutex<Owners>,
    max_per_key: usize,
    max_total: usize,
}

#[derive(Default)]
struct Owners {
    /// Open sessions and their identity; a session leaves when it closes (DELETE, idle,
    /// shutdown: rmcp closes every ending session through [`SessionManager::close_session`]).
    by_session: HashMap<SessionId, String>,
    /// `initialize` requests in flight, by identity: each holds a slot until answered.
    opening: HashMap<String, usize>,
}

impl Owners {
    fn of(&self, identity: &str) -> usize {
        self.by_session.values().filter(|o| *o == identity).count()
            + self.opening.get(identity).copied().unwrap_or(0)
    }

    fn total(&self) -> usize {
        self.by_session.len() + self.opening.values().sum::<usize>()
    }
}

impl BoundSessions {
    fn owners(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.owners.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn owner(&self, id: &SessionId) -> Option<String> {
        self.owners().by_session.get(id).cloned()
    }

    /// A slot for one more session of `identity`, or 429 past either bound. At a bound,
    /// sessions rmcp no longer holds are dropped first (one that ended while its
    /// `initialize` was being answered), and the count is taken again.
    async fn reserve(self: &Arc<Self>, identity: &str) -> Result<Opening, ApiError> {
        for pruned in [false, true] {
            let candidates: Vec<SessionId> = {
                let mut owners = self.owners();
                let (mine, total) = (owners.of(identity), owners.total());
                if mine < self.max_per_key && total < self.max_total {
                    *owners.opening.entry(identity.to_owned()).or_default() += 1;
                    return Ok(Opening {
                        sessions: self.clone(),
                        identity: identity.to_owned(),
                    });
                }
                if pruned {
                    let mut err = ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "rate_limited",
                        format!(
                            "too many open MCP sessions ({mine} of this key, {total} in all; mcp.max_sessions_per_key {}, mcp.max_sessions {}): end one with DELETE /mcp and its Mcp-Session-Id, or wait for an idle one to close (after {}s)",
                            self.max_per_key,
                            self.max_total,
                            SESSION_IDLE.as_secs()
                        ),
                    );
                    err.retry_after = Some(Duration::from_secs(5));
                    return Err(err);
                }
                owners
                    .by_session
                    .iter()
                    .filter(|(_, o)| mine < self.max_per_key || *o == identity)
                    .map(|(id, _)| id.clone())
                    .collect()
            };
            for id in candidates {
                if !self.inner.has_session(&id).await.unwrap_or(false) {
                    self.owners().by_session.remove(&id);
                }
            }
        }
        unreachable!("the second pass answers")
    }
}

/// How long an idle session lives: rmcp's default, which the sessions here keep.
const SESSION_IDLE: Duration = SessionConfig::DEFAULT_KEEP_ALIVE;

/// One `initialize` in flight: its slot is freed on drop, after [`Opening::opened`] has
/// bound the session it opened, if any.
struct Opening {
    sessions: Arc<BoundSessions>,
    identity: String,
}

impl Opening {
    async fn opened(self, id: SessionId) {
        self.sessions
            .owners()
            .by_session
            .insert(id.clone(), self.identity.clone());
        // A session that ended before it was bound would hold its slot for ever.
        if !self.sessions.inner.has_session(&id).await.unwrap_or(false) {
            self.sessions.owners().by_session.remove(&id);
        }
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        let mut owners = self.sessions.owners();
        if let Some(n) = owners.opening.get_mut(&self.identity) {
            *n -= 1;
            if *n == 0 {
                owners.opening.remove(&self.identity);
            }
        }
    }
}

/// rmcp's local sessions, with the binding dropped when one closes.
impl SessionManager for BoundSessions {
    type Error = <LocalSessionManager as SessionManager>::Error;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    fn create_session(
        &self,
    ) -> impl Future<Output = Result<(SessionId, Self::Transport), Self::Error>> + Send {
        self.inner.create_session()
    }

    fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> impl Future<Output = Result<ServerJsonRpcMessage, Self::Error>> + Send {
        self.inner.initialize_session(id, message)
    }

    fn has_session(
        &self,
        id: &SessionId,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        self.inner.has_session(id)
    }

    fn close_session(
        &self,
        id: &SessionId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.owners().by_session.remove(id);
        self.inner.close_session(id)
    }

    fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> impl Future<
        Output = Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error>,
    > + Send {
        self.inner.create_stream(id, message)
    }

    fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.accept_message(id, message)
    }

    fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> impl Future<
        Output = Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error>,
    > + Send {
        self.inner.create_standalone_stream(id)
    }

    fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> impl Future<
        Output = Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error>,
    > + Send {
        self.inner.resume(id, last_event_id)
    }

    fn restore_session(
        &self,
        id: SessionId,
    ) -> impl Future<Output = Result<RestoreOutcome<Self::Transport>, Self::Error>> + Send {
        self.inner.restore_session(id)
    }

    fn event_store(&self) -> Option<Arc<dyn EventStore>> {
        self.inner.event_store()
    }
}

fn identity_of(
    state: &HttpState,
    caller: engram_gateway::Caller,
    headers: &HeaderMap,
) -> Result<Identity, ApiError> {
    let invalid = |e: McpError| ApiError::invalid(e.to_string());
    let header = |name: &str| -> Result<Option<&str>, ApiError> {
        headers
            .get(name)
            .map(|v| {
                v.to_str()
                    .map_err(|_| ApiError::invalid(format!("the {name} header is not text")))
            })
            .transpose()
    };
    let scope: Option<Scope> = header(SCOPE_HEADER)?
        .map(|v| parse_scope("Engram-Scope header", v))
        .transpose()
        .map_err(invalid)?;
    let mut reads = Vec::new();
    for value in headers.get_all(READ_HEADER) {
        let value = value
            .to_str()
            .map_err(|_| ApiError::invalid("the Engram-Read header is not text"))?;
        for part in value.split(',').filter(|p| !p.trim().is_empty()) {
            reads.push(parse_scope("Engram-Read header", part).map_err(invalid)?);
        }
    }
    let instance = header(INSTANCE_HEADER)?.unwrap_or("mcp-http").to_owned();
    let token_key = format!(
        "{}/{}",
        caller.creds.public_key(),
        scope.as_ref().map(Scope::to_string).unwrap_or_default()
    );
    let seen = state.token(token_key);
    Identity::with_seen(caller.client, scope, reads, &instance, seen).map_err(|e| match e {
        McpError::NotAnAgent => {
            ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", e.to_string())
        }
        other => invalid(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_hosts_default_to_loopback_and_the_listen_address_at_its_port() {
        let config = McpConfig::default();
        let local = config.http("127.0.0.1:7077".parse().unwrap());
        assert_eq!(
            local.allowed_hosts,
            ["localhost:7077", "127.0.0.1:7077", "[::1]:7077"]
        );
        let lan = config.http("10.0.0.5:7077".parse().unwrap());
        assert_eq!(lan.allowed_hosts.last().unwrap(), "10.0.0.5:7077");
        // Every address of an unspecified listen is unknown: loopback only until configured.
        let any = config.http("0.0.0.0:7077".parse().unwrap());
        assert_eq!(any.allowed_hosts.len(), 3);
    }

    #[test]
    fn configured_hosts_replace_the_default_and_a_star_accepts_any() {
        let named = McpConfig {
            allowed_hosts: vec![" engram.internal ".into(), "10.0.0.5:7077".into()],
            ..McpConfig::default()
        };
        named.validate().unwrap();
        assert_eq!(
            named.http("0.0.0.0:7077".parse().unwrap()).allowed_hosts,
            ["engram.internal", "10.0.0.5:7077"]
        );
        let any = McpConfig {
            allowed_hosts: vec!["*".into()],
            ..McpConfig::default()
        };
        any.validate().unwrap();
        assert!(
            any.http("0.0.0.0:1".parse().unwrap())
                .allowed_hosts
                .is_empty()
        );
    }

    #[test]
    fn a_host_that_is_no_authority_is_refused_at_load() {
        for bad in ["", "http://engram.internal", "a b", "user@host"] {
            let config = McpConfig {
                allowed_hosts: vec![bad.into()],
                ..McpConfig::default()
            };
            let err = config.validate().unwrap_err();
            assert!(err.contains("mcp.allowed_hosts"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn origins_default_to_loopback_at_the_listen_port_and_a_star_accepts_any() {
        let config = McpConfig::default();
        let local = config
            .http("127.0.0.1:7077".parse().unwrap())
            .allowed_origins
            .unwrap();
        let parse = |o: &str| Origin::parse(o).unwrap();
        for ok in [
            "http://localhost:7077",
            "http://127.0.0.1:7077",
            "https://[::1]:7077",
            "HTTP://LOCALHOST:7077",
        ] {
            assert!(local.contains(&parse(ok)), "{ok}");
        }
        for refused in [
            "http://localhost:3000",
            "https://evil.example",
            "http://127.0.0.1",
            "null",
        ] {
            assert!(!local.contains(&parse(refused)), "{refused}");
        }
        let headers = |origin: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::ORIGIN, origin.parse().unwrap());
            h
        };
        assert!(check_origin(Some(&local), &HeaderMap::new()).is_ok());
        assert!(check_origin(Some(&local), &headers("http://localhost:7077")).is_ok());
        let err = check_origin(Some(&local), &headers("https://evil.example")).unwrap_err();
        assert_eq!((err.status, err.code), (StatusCode::FORBIDDEN, "forbidden"));
        assert!(
            err.message.contains("mcp.allowed_origins"),
            "{}",
            err.message
        );
        assert!(check_origin(Some(&local), &headers("not an origin")).is_err());
        assert!(check_origin(None, &headers("https://evil.example")).is_ok());

        let named = McpConfig {
            allowed_origins: vec!["https://app.example.com".into(), "null".into()],
            ..McpConfig::default()
        };
        named.validate().unwrap();
        let named = named
            .http("0.0.0.0:1".parse().unwrap())
            .allowed_origins
            .unwrap();
        assert_eq!(named, [parse("https://app.example.com:443"), Origin::Null]);
        let any = McpConfig {
            allowed_origins: vec!["*".into()],
            ..McpConfig::default()
        };
        assert!(
            any.http("0.0.0.0:1".parse().unwrap())
                .allowed_origins
                .is_none()
        );
    }

    #[test]
    fn an_origin_that_is_no_origin_and_zero_session_bounds_are_refused_at_load() {
        for bad in [
            "",
            "example.com",
            "ftp://example.com",
            "https://example.com/path",
            "https://user@example.com",
        ] {
            let config = McpConfig {
                allowed_origins: vec![bad.into()],
                ..McpConfig::default()
            };
            let err = config.validate().unwrap_err();
            assert!(err.contains("mcp.allowed_origins"), "{bad:?}: {err}");
        }
        for (per_key, all) in [(0, 10), (10, 0)] {
            let config = McpConfig {
                max_sessions_per_key: per_key,
                max_sessions: all,
                ..McpConfig::default()
            };
            assert!(config.validate().unwrap_err().contains("max_sessions"));
        }
    }
}

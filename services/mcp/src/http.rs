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
//! rebinds its DNS name to this address cannot drive the server from a browser.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use engram_gateway::{ApiError, Gateway};
use engram_sdk::Scope;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
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

/// `[mcp]` settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// `Host` header values `/mcp` answers, as `host` (any port) or `host:port`: the defence
    /// against DNS rebinding. Empty (the default): the HTTP listen address, `localhost`,
    /// `127.0.0.1` and `[::1]`, at the listen port. Behind a proxy or on a public name, list
    /// the names clients use. `["*"]` accepts any host (turns the defence off).
    pub allowed_hosts: Vec<String>,
}

impl McpConfig {
    pub fn validate(&self) -> Result<(), String> {
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
        McpHttpConfig {
            allowed_hosts,
            shutdown: CancellationToken::new(),
        }
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
    /// Cancelled on shutdown: ends open MCP streams, so a graceful HTTP shutdown does not
    /// wait for clients to hang up.
    pub shutdown: CancellationToken,
}

/// The router's state: the gateway that authenticates keys, and each key's last write.
struct HttpState {
    gateway: Arc<Gateway>,
    /// By key and scope: the read-your-writes token shared by the requests of one client.
    tokens: Mutex<HashMap<String, Arc<AtomicU64>>>,
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
    let state = Arc::new(HttpState {
        gateway: gateway.clone(),
        tokens: Mutex::default(),
    });
    let server = StreamableHttpServerConfig::default()
        .with_allowed_hosts(config.allowed_hosts)
        .with_max_request_body_bytes(gateway.config().max_body_bytes)
        .with_cancellation_token(config.shutdown);
    let service = StreamableHttpService::new(
        || Ok(EngramMcp::per_request()),
        LocalSessionManager::default().into(),
        server,
    );
    axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(state, authenticate))
}

/// Puts the request's [`Identity`] in its extensions, or answers 401 (no or bad key), 400
/// (a malformed scope header) or the gateway's rate limit.
async fn authenticate(
    State(state): State<Arc<HttpState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let caller = match state.gateway.caller(request.headers()).await {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let identity = match identity_of(&state, caller, request.headers()) {
        Ok(identity) => identity,
        Err(e) => return e.into_response(),
    };
    request.extensions_mut().insert(identity);
    next.run(request).await
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
        };
        named.validate().unwrap();
        assert_eq!(
            named.http("0.0.0.0:7077".parse().unwrap()).allowed_hosts,
            ["engram.internal", "10.0.0.5:7077"]
        );
        let any = McpConfig {
            allowed_hosts: vec!["*".into()],
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
            };
            let err = config.validate().unwrap_err();
            assert!(err.contains("mcp.allowed_hosts"), "{bad:?}: {err}");
        }
    }
}

//! Engram's MCP server: memory tools for model harnesses (Claude Code, Cursor, the OpenAI
//! Agents SDK, ...), over stdio (`engram mcp`) and streamable HTTP (`/mcp` on `engram up`'s
//! HTTP address).
//!
//! **Who the server acts as is configuration, never an argument.** Every tool call runs as one
//! [`Identity`]: an agent's key (tenant and agent), the scope it writes to and the granted
//! scopes it also reads. Over stdio it is fixed when the server starts (`--key`, `--scope`,
//! `--read`); over HTTP each request brings it (`Authorization: Bearer <API key>`,
//! `Engram-Scope`, `Engram-Read`). No tool argument names a tenant, an agent or a scope, and
//! an argument the schema does not list is refused, so a prompt-injected model cannot reach
//! another scope. What the key may do is enforced by the NATS server regardless.
//!
//! # Layout
//! - this module: [`Identity`], the server handler ([`EngramMcp`]) and [`serve_stdio`].
//! - [`tools`]: the tools, their arguments and results, and the bounds on both.
//! - [`http`]: the `/mcp` router, authenticated by API key per request, with its
//!   DNS-rebinding defence (`[mcp] allowed_hosts`).

pub mod http;
pub mod tools;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use engram_sdk::{Agent, Client, Ident, Scope, ScopeKind};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::{Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler, ServiceExt, tool_handler};

pub use http::{McpConfig, McpHttpConfig, router};

/// Most granted scopes an identity reads besides its own: the query protocol takes at most
/// six scopes per request.
pub const MAX_READS: usize = 5;

/// Why an identity or a server could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error(
        "these credentials are not an agent's: the MCP server runs as one agent, so give it an agent's API key (`engram key add --tenant <t> --agent <a>`) or credentials file (`engram agent add`), never the admin's"
    )]
    NotAnAgent,
    #[error("invalid {what} {value:?}: {reason}")]
    Invalid {
        what: &'static str,
        value: String,
        reason: String,
    },
    #[error("the MCP transport failed: {0}")]
    Transport(String),
}

/// Who the tools act as, and where: the tenant and agent of a key, the scope it writes, the
/// granted scopes it also reads.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Stamps events with the key's tenant and agent and this server's instance id.
    agent: Agent,
    agent_id: Ident,
    /// Every write goes here: `agent:<agent>` unless configured.
    scope: Scope,
    /// Read besides `scope` (`ScopeRequest::grants`); each of a wider kind.
    reads: Vec<Scope>,
    /// The highest stream sequence this identity appended through this server. Every read
    /// waits until the read models have applied it, so a model always reads its own writes.
    seen: Arc<AtomicU64>,
}

impl Identity {
    /// The identity of `client`'s agent key writing to `scope` (default `agent:<agent>`)
    /// and reading `reads` too. `instance` names this server in the events it writes.
    pub fn new(
        client: Client,
        scope: Option<Scope>,
        reads: Vec<Scope>,
        instance: &str,
    ) -> Result<Self, McpError> {
        Self::with_seen(client, scope, reads, instance, Arc::default())
    }

    /// [`Identity::new`] sharing a read-your-writes token with earlier identities of the same
    /// key and scope (HTTP requests, each with an identity of its own).
    pub(crate) fn with_seen(
        client: Client,
        scope: Option<Scope>,
        reads: Vec<Scope>,
        instance: &str,
        seen: Arc<AtomicU64>,
    ) -> Result<Self, McpError> {
        let (tenant, agent_id) = client
            .agent_identity()
            .cloned()
            .ok_or(McpError::NotAnAgent)?;
        let scope = match scope {
            Some(scope) => scope,
            None => Scope {
                kind: ScopeKind::Agent,
                id: agent_id.clone(),
            },
        };
        if reads.len() > MAX_READS {
            return Err(McpError::Invalid {
                what: "read scopes",
                value: format!("{} scopes", reads.len()),
                reason: format!("at most {MAX_READS} besides the own scope"),
            });
        }
        for read in &reads {
            // The query service refuses a grant that is not wider than the own scope; say so
            // at start-up rather than on every tool call.
            if read.kind >= scope.kind {
                return Err(McpError::Invalid {
                    what: "read scope",
                    value: read.to_string(),
                    reason: format!(
                        "a read scope must be of a wider kind than the own scope {scope} (org > team > user > agent > task > session)"
                    ),
                });
            }
        }
        let agent = client
            .agent(tenant.as_str(), agent_id.as_str(), instance)
            .map_err(|e| McpError::Invalid {
                what: "instance id",
                value: instance.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            agent,
            agent_id,
            scope,
            reads,
            seen,
        })
    }

    pub fn tenant(&self) -> &Ident {
        self.agent.tenant()
    }

    pub fn agent_id(&self) -> &Ident {
        &self.agent_id
    }

    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    pub fn reads(&self) -> &[Scope] {
        &self.reads
    }

    pub(crate) fn agent(&self) -> &Agent {
        &self.agent
    }

    pub(crate) fn client(&self) -> &Client {
        self.agent.client()
    }

    /// The read-your-writes token: the last sequence written, if any.
    pub(crate) fn min_seq(&self) -> Option<u64> {
        Some(self.seen.load(Ordering::Acquire)).filter(|&s| s > 0)
    }

    pub(crate) fn wrote(&self, seq: u64) {
        self.seen.fetch_max(seq, Ordering::AcqRel);
    }
}

/// Parses `kind:id` scopes as the configuration gives them (`--scope`, `--read`, headers).
pub fn parse_scope(what: &'static str, value: &str) -> Result<Scope, McpError> {
    value
        .trim()
        .parse()
        .map_err(|e: engram_sdk::SchemaError| McpError::Invalid {
            what,
            value: value.to_owned(),
            reason: e.to_string(),
        })
}

/// The MCP server handler: the tools of [`tools`], run as a fixed identity (stdio) or as the
/// identity each HTTP request brings.
#[derive(Clone)]
pub struct EngramMcp {
    /// `None` over HTTP: the identity is in each request's extensions.
    fixed: Option<Identity>,
    tool_router: ToolRouter<Self>,
}

impl EngramMcp {
    /// A server that acts as `identity` for every call.
    pub fn new(identity: Identity) -> Self {
        Self {
            fixed: Some(identity),
            tool_router: Self::tool_router(),
        }
    }

    /// A server that takes its identity from each request (put there by [`http`]).
    pub(crate) fn per_request() -> Self {
        Self {
            fixed: None,
            tool_router: Self::tool_router(),
        }
    }

    fn identity(&self, ctx: &RequestContext<RoleServer>) -> Result<Identity, tools::ToolError> {
        if let Some(identity) = &self.fixed {
            return Ok(identity.clone());
        }
        ctx.extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Identity>())
            .cloned()
            .ok_or_else(|| {
                tools::ToolError::new(
                    "this request carries no identity: send `Authorization: Bearer <API key>` with every request",
                )
            })
    }
}

const INSTRUCTIONS: &str = "Engram is your long-term memory, shared with the other agents of your team. \
Before a step, call `build_context` (or `recall` for a specific question) to get what is already known. \
When you learn, decide or finish something worth keeping, call `remember`; for a stable fact about an \
entity (a subject's predicate has a value) use `assert_fact`; for a reusable procedure use `record_skill`. \
Coordinate work on the shared `task_board`. Use `forget` to withdraw a memory that is wrong or must not be \
kept. Who you are and which scope you write to are fixed by the server: never pass them.";

#[tool_handler(router = self.tool_router)]
impl ServerHandler for EngramMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("engram", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }
}

/// Serves `identity`'s tools over stdin and stdout until the client closes stdin. Nothing
/// else may write to stdout: logs go to stderr.
pub async fn serve_stdio(identity: Identity) -> Result<(), McpError> {
    tracing::info!(
        tenant = %identity.tenant(),
        agent = %identity.agent_id(),
        scope = %identity.scope(),
        reads = identity.reads().len(),
        "mcp server on stdio"
    );
    let running = EngramMcp::new(identity)
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| McpError::Transport(e.to_string()))?;
    running
        .waiting()
        .await
        .map_err(|e| McpError::Transport(e.to_string()))?;
    Ok(())
}

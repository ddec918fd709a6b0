//! Who is asking, and may they: the checks on requests that arrive from agents.
//!
//! An agent sends to `engram.q.<tenant>.<agent>.<op>`; its key's permissions allow no other
//! tenant or agent token, so the subject is the caller's authenticated identity. The tenant
//! named in the body must be that tenant, and every scope the request reads (its own and each
//! it lists in `grants`) must be one the registry lets that agent read. A refusal names the
//! scope and the command that would allow it. Requests on the bare `engram.q.<op>` subjects
//! come from the admin or a service, whose permissions are what keeps agents off them.

use std::time::Duration;

use engram_access::registry::Grantee;
use engram_access::{AccessLog, SharedRegistry, perms::caller_of};
use engram_memory::proto::{ErrorCode, ScopeRequest, WhoamiResponse};
use engram_rpc::Failure;
use engram_schema::{Ident, Scope};
use engram_telemetry::metrics;

/// How long a refused scope waits for the registry to catch up with the log before it is
/// refused: a grant an admin just added is visible to the next query.
const FRESHNESS_WAIT: Duration = Duration::from_secs(2);

/// The registry as this service folds it, and the log to catch up from.
pub struct Guard {
    registry: SharedRegistry,
    log: AccessLog,
}

impl Guard {
    pub fn new(registry: SharedRegistry, log: AccessLog) -> Self {
        Self { registry, log }
    }

    /// Refuses a request from the agent named by `subject` that reads anything it may not.
    pub async fn authorize(&self, subject: &str, scopes: &ScopeRequest) -> Result<(), Failure> {
        let (tenant, agent) = authenticated_tenant(subject, scopes)?;
        let wanted = scopes.resolve().map_err(Failure::invalid)?;
        let mut fresh = false;
        loop {
            let denied = {
                let registry = self.registry.read().await;
                if !registry.is_active(&tenant, &agent) {
                    Some(None)
                } else {
                    wanted
                        .iter()
                        .find(|k| !registry.may_read(&tenant, &agent, &k.scope()))
                        .map(|k| Some(k.scope()))
                }
            };
            let Some(denied) = denied else {
                return Ok(());
            };
            if !fresh {
                // What the registry has not folded yet may be the grant that allows it.
                fresh = true;
                if tokio::time::timeout(FRESHNESS_WAIT, self.log.catch_up(&self.registry))
                    .await
                    .is_ok_and(|r| r.is_ok())
                {
                    continue;
                }
            }
            return Err(match denied {
                None => {
                    metrics::ACCESS_DENIED.with_label_values(&["revoked"]).inc();
                    Failure::new(
                        ErrorCode::Forbidden,
                        format!("agent {agent} of tenant {tenant} has no live credentials"),
                    )
                }
                Some(scope) => {
                    metrics::ACCESS_DENIED.with_label_values(&["scope"]).inc();
                    Failure::new(
                        ErrorCode::Forbidden,
                        format!(
                            "agent {agent} of tenant {tenant} may not read {scope}; an admin can allow it with `engram grant add --tenant {tenant} --agent {agent} --scope {scope}`"
                        ),
                    )
                }
            });
        }
    }
}

impl Guard {
    /// Whether `agent` of `tenant` may write `scope`: its key's own scopes cover it.
    pub async fn may_write(&self, tenant: &Ident, agent: &Ident, scope: &Scope) -> bool {
        self.registry.read().await.may_write(tenant, agent, scope)
    }

    /// Refuses a write to `scope` by the agent named by `subject` unless its own scopes
    /// cover it.
    pub async fn authorize_write(
        &self,
        subject: &str,
        scopes: &ScopeRequest,
    ) -> Result<(), Failure> {
        let (tenant, agent) = authenticated_tenant(subject, scopes)?;
        if self
            .registry
            .read()
            .await
            .may_write(&tenant, &agent, &scopes.scope)
        {
            return Ok(());
        }
        metrics::ACCESS_DENIED.with_label_values(&["scope"]).inc();
        Err(Failure::new(
            ErrorCode::Forbidden,
            format!(
                "agent {agent} of tenant {tenant} may not write {}: its key covers only the scopes it was issued for (`engram agent list --tenant {tenant}`)",
                scopes.scope
            ),
        ))
    }
}

impl Guard {
    /// The agent of `subject` as the registry holds it: its scopes, its grants and its live
    /// public keys. The registry catches up with the log first (bounded), so a key issued a
    /// moment ago is known: the gateway refuses a key whose public key is not listed.
    pub async fn whoami(&self, subject: &str) -> Result<WhoamiResponse, Failure> {
        let (tenant, agent) = caller(subject)?;
        // A failed or slow catch-up answers from the registry as folded so far.
        let _ = tokio::time::timeout(FRESHNESS_WAIT, self.log.catch_up(&self.registry)).await;
        let registry = self.registry.read().await;
        let Some(a) = registry
            .agent(&tenant, &agent)
            .filter(|_| registry.is_active(&tenant, &agent))
        else {
            return Err(Failure::new(
                ErrorCode::Forbidden,
                format!("agent {agent} of tenant {tenant} has no live credentials"),
            ));
        };
        let grants = registry
            .tenants
            .get(&tenant)
            .map(|t| {
                t.grants
                    .keys()
                    .filter(|(to, _)| {
                        *to == Grantee::AllAgents || *to == Grantee::Agent(agent.clone())
                    })
                    .map(|(_, pattern)| pattern.to_string())
                    .collect()
            })
            .unwrap_or_default();
        Ok(WhoamiResponse {
            scopes: a.scopes.iter().map(ToString::to_string).collect(),
            grants,
            public_keys: Some(registry.live_keys_of(&tenant, &agent)),
            tenant,
            agent,
        })
    }

    /// `items` less those whose scope the agent of `subject` may not read (and those of no
    /// scope); the registry is read once for all of them.
    pub async fn readable<T>(
        &self,
        subject: &str,
        tenant: &Ident,
        items: Vec<T>,
        scope_of: impl Fn(&T) -> Option<Scope>,
    ) -> Result<Vec<T>, Failure> {
        let (own, agent) = caller(subject)?;
        check_tenant(&own, tenant)?;
        let registry = self.registry.read().await;
        Ok(items
            .into_iter()
            .filter(|item| scope_of(item).is_some_and(|s| registry.may_read(tenant, &agent, &s)))
            .collect())
    }
}

/// The tenant and agent an agent subject names.
pub fn caller(subject: &str) -> Result<(Ident, Ident), Failure> {
    caller_of(subject).ok_or_else(|| {
        Failure::new(
            ErrorCode::Forbidden,
            format!("{subject} is not an agent subject (engram.q.<tenant>.<agent>.<op>)"),
        )
    })
}

/// Refuses a request naming a tenant other than the caller's.
pub fn check_tenant(own: &Ident, named: &Ident) -> Result<(), Failure> {
    if own == named {
        return Ok(());
    }
    metrics::ACCESS_DENIED.with_label_values(&["tenant"]).inc();
    Err(Failure::new(
        ErrorCode::Forbidden,
        format!(
            "these credentials are of tenant {own}; the request names tenant {named}, which they cannot read"
        ),
    ))
}

/// The caller of an agent subject, when the body names the same tenant.
pub fn authenticated_tenant(
    subject: &str,
    scopes: &ScopeRequest,
) -> Result<(Ident, Ident), Failure> {
    let (tenant, agent) = caller(subject)?;
    check_tenant(&tenant, &scopes.tenant)?;
    Ok((tenant, agent))
}

/// Requests that read scopes.
pub trait Scoped {
    fn scope_request(&self) -> &ScopeRequest;
}

macro_rules! scoped {
    ($($t:ty),+) => {
        $(impl Scoped for $t {
            fn scope_request(&self) -> &ScopeRequest {
                &self.scopes
            }
        })+
    };
}

use engram_memory::proto::{
    BootstrapRequest, BriefRequest, ConsolidateRequest, ContextRequest, DocRequest, FactsRequest,
    ReplayRequest, RetrieveRequest, SkillsRequest, WorkingRequest,
};
scoped!(
    BriefRequest,
    ReplayRequest,
    WorkingRequest,
    RetrieveRequest,
    ContextRequest,
    FactsRequest,
    SkillsRequest,
    DocRequest,
    BootstrapRequest,
    ConsolidateRequest
);

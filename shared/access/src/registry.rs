//! The access records and the state they fold into.
//!
//! Tenants, agents' keys and grants are facts in a log (`ENGRAM_ACCESS`), not claims in a
//! request: the server's `authorization` block ([`crate::conf`]) and the query service's scope
//! checks are both folds of the same records. [`Registry::check`] refuses a record that does
//! not fit the state before it is appended; [`Registry::apply`] skips one that slipped in
//! anyway (two admins at once), so every reader folds the log to the same state.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use engram_schema::{Ident, Scope};
use serde::{Deserialize, Serialize};

use crate::AccessError;
use crate::perms::{Role, ScopePattern};

/// Who a grant is for: one agent, or every agent of the tenant.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grantee {
    Agent(Ident),
    AllAgents,
}

impl std::fmt::Display for Grantee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Agent(a) => f.write_str(a.as_str()),
            Self::AllAgents => f.write_str("*"),
        }
    }
}

impl std::str::FromStr for Grantee {
    type Err = AccessError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "*" {
            return Ok(Self::AllAgents);
        }
        Ident::parse("agent", s)
            .map(Self::Agent)
            .map_err(|e| AccessError::Invalid(e.to_string()))
    }
}

/// One change to who may do what.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Record {
    TenantAdded {
        tenant: Ident,
    },
    /// A key for `agent`, which may write and read `scopes`. A second key for one agent
    /// (rotation) replaces the agent's scopes with the new list.
    AgentKeyAdded {
        tenant: Ident,
        agent: Ident,
        key: String,
        scopes: Vec<ScopePattern>,
        /// When the key stops working by itself (`engram run`'s keys), unless renewed;
        /// `None`: until revoked. Left out of the record when `None`, so a log of keys
        /// without expiry reads the same to older builds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_at: Option<DateTime<Utc>>,
    },
    /// Moves a live key's expiry to `expires_at`: a run alive to renew its key keeps it, a
    /// run that died stops renewing and its key expires. An expired or revoked key is never
    /// renewed, so a key, once dead, stays dead.
    AgentKeyRenewed {
        tenant: Ident,
        agent: Ident,
        key: String,
        expires_at: DateTime<Utc>,
    },
    /// `key: None` revokes every key of the agent.
    AgentRevoked {
        tenant: Ident,
        agent: Ident,
        #[serde(default)]
        key: Option<String>,
    },
    /// `to` may read `scope` (and only read: writes follow the agent's own scopes).
    GrantAdded {
        tenant: Ident,
        to: Grantee,
        scope: ScopePattern,
    },
    GrantRevoked {
        tenant: Ident,
        to: Grantee,
        scope: ScopePattern,
    },
    /// A leaf node of the tenant ([`crate::leaf`]): its key, and the scopes whose events it
    /// sends up and receives (plus, down only, what is granted to every agent). A second
    /// record for one leaf replaces its key and scopes.
    LeafAdded {
        tenant: Ident,
        leaf: Ident,
        key: String,
        scopes: Vec<ScopePattern>,
    },
    LeafRevoked {
        tenant: Ident,
        leaf: Ident,
    },
    /// The audit trail of an erasure: which scopes, when, and (once done) how much went.
    /// It names no content, so it outlives what it erased.
    ErasureStarted {
        tenant: Ident,
        scopes: Vec<Scope>,
    },
    ErasureFinished {
        tenant: Ident,
        scopes: Vec<Scope>,
        removed: u64,
        /// What could not be done (a projector that did not answer); empty when complete.
        #[serde(default)]
        incomplete: Vec<String>,
    },
}

impl Record {
    pub fn tenant(&self) -> &Ident {
        match self {
            Self::TenantAdded { tenant }
            | Self::AgentKeyAdded { tenant, .. }
            | Self::AgentKeyRenewed { tenant, .. }
            | Self::AgentRevoked { tenant, .. }
            | Self::GrantAdded { tenant, .. }
            | Self::GrantRevoked { tenant, .. }
            | Self::LeafAdded { tenant, .. }
            | Self::LeafRevoked { tenant, .. }
            | Self::ErasureStarted { tenant, .. }
            | Self::ErasureFinished { tenant, .. } => tenant,
        }
    }
}

/// A record as stored: what, when and by whom.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The record format's version.
    pub v: u32,
    pub at: DateTime<Utc>,
    /// Who appended it (the operator's own words, for the audit trail).
    pub by: String,
    pub record: Record,
}

pub const ENTRY_VERSION: u32 = 1;

/// An agent's key, live, expired or revoked.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Key {
    pub key: String,
    pub added_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// When it stops working by itself; `None`: never.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

impl Key {
    /// Whether the key works at `at`: not revoked, and not expired by then.
    pub fn is_live_at(&self, at: DateTime<Utc>) -> bool {
        self.revoked_at.is_none() && self.expires_at.is_none_or(|e| at < e)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Agent {
    pub scopes: Vec<ScopePattern>,
    pub keys: Vec<Key>,
}

impl Agent {
    /// The keys that work now: not revoked, not expired.
    pub fn active_keys(&self) -> impl Iterator<Item = &Key> {
        let now = Utc::now();
        self.keys.iter().filter(move |k| k.is_live_at(now))
    }

    /// The keys not revoked, expired or not: what a revocation may name (a run's key is
    /// revoked at its end even when it expired first, for the audit trail).
    pub fn unrevoked_keys(&self) -> impl Iterator<Item = &Key> {
        self.keys.iter().filter(|k| k.revoked_at.is_none())
    }
}

/// A leaf node of a tenant.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Leaf {
    pub key: String,
    pub scopes: Vec<ScopePattern>,
    pub added_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Tenant {
    pub added_at: Option<DateTime<Utc>>,
    pub agents: BTreeMap<Ident, Agent>,
    /// Leaf nodes, live or revoked.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub leaves: BTreeMap<Ident, Leaf>,
    /// Grants in force, with when each was given.
    pub grants: BTreeMap<(Grantee, ScopePattern), DateTime<Utc>>,
}

/// Every tenant, agent key and grant, as of sequence `applied` of the log.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Registry {
    pub tenants: BTreeMap<Ident, Tenant>,
    /// Erasures, oldest first: the audit trail.
    pub erasures: Vec<Erasure>,
    pub applied: u64,
}

/// One erasure as the log records it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Erasure {
    pub tenant: Ident,
    pub scopes: Vec<Scope>,
    pub started_at: DateTime<Utc>,
    /// `None` until it finished with nothing left undone.
    pub finished_at: Option<DateTime<Utc>>,
    pub removed: u64,
}

impl Registry {
    /// Why `record` does not fit the current state, if it does not, appended now.
    pub fn check(&self, record: &Record) -> Result<(), AccessError> {
        self.check_at(record, Utc::now())
    }

    /// Why `record`, appended at `at`, does not fit the current state. Expiry is judged at
    /// `at`, the record's own time, never the reader's clock: every reader folds a log to
    /// the same state whenever it reads it.
    fn check_at(&self, record: &Record, at: DateTime<Utc>) -> Result<(), AccessError> {
        let tenant = record.tenant();
        if matches!(
            record,
            Record::ErasureStarted { .. } | Record::ErasureFinished { .. }
        ) {
            // An erasure is recorded whatever the registry knows of the tenant (one run
            // without authentication never registered it).
            return Ok(());
        }
        if let Record::TenantAdded { tenant } = record {
            if self.tenants.contains_key(tenant) {
                return Err(AccessError::TenantExists {
                    tenant: tenant.to_string(),
                });
            }
            if let Some(existing) = self
                .tenants
                .keys()
                .find(|t| t.as_str().eq_ignore_ascii_case(tenant.as_str()))
            {
                return Err(AccessError::Confusable {
                    tenant: tenant.to_string(),
                    existing: existing.to_string(),
                });
            }
            return Ok(());
        }
        let Some(t) = self.tenants.get(tenant) else {
            return Err(AccessError::NoTenant {
                tenant: tenant.to_string(),
            });
        };
        let no_agent = |agent: &Ident| AccessError::NoAgent {
            tenant: tenant.to_string(),
            agent: agent.to_string(),
        };
        match record {
            Record::TenantAdded { .. }
            | Record::ErasureStarted { .. }
            | Record::ErasureFinished { .. } => unreachable!("handled above"),
            Record::AgentKeyAdded {
                key,
                scopes,
                expires_at,
                ..
            } => {
                if scopes.is_empty() {
                    return Err(AccessError::Invalid(
                        "an agent needs at least one scope".into(),
                    ));
                }
                if self.key_owner(key).is_some() || self.leaf_of_key(key).is_some() {
                    return Err(AccessError::Invalid(format!("key {key} is already in use")));
                }
                if let Some(expires_at) = expires_at
                    && *expires_at <= at
                {
                    return Err(AccessError::Invalid(format!(
                        "key {key} would expire at {expires_at}, before it is added ({at}); give a later expiry"
                    )));
                }
                Ok(())
            }
            Record::AgentKeyRenewed {
                agent,
                key,
                expires_at,
                ..
            } => {
                let a = t.agents.get(agent).ok_or_else(|| no_agent(agent))?;
                let Some(k) = a.keys.iter().find(|k| k.key == *key) else {
                    return Err(AccessError::Invalid(format!(
                        "agent {agent} of tenant {tenant} has no key {key}"
                    )));
                };
                if k.expires_at.is_none() {
                    return Err(AccessError::Invalid(format!(
                        "key {key} does not expire; there is nothing to renew"
                    )));
                }
                if !k.is_live_at(at) {
                    return Err(AccessError::Invalid(format!(
                        "key {key} of agent {agent} is revoked or expired; a dead key is never renewed, issue a new one"
                    )));
                }
                if *expires_at <= at {
                    return Err(AccessError::Invalid(format!(
                        "renewing key {key} to {expires_at} would end it now ({at}); revoke it instead"
                    )));
                }
                Ok(())
            }
            Record::AgentRevoked { agent, key, .. } => {
                let a = t.agents.get(agent).ok_or_else(|| no_agent(agent))?;
                let live = a
                    .unrevoked_keys()
                    .any(|k| key.as_ref().is_none_or(|want| *want == k.key));
                if live { Ok(()) } else { Err(no_agent(agent)) }
            }
            Record::GrantAdded { to, scope, .. } => {
                if t.grants.contains_key(&(to.clone(), scope.clone())) {
                    return Err(AccessError::Invalid(format!(
                        "{to} already holds a grant of {scope} in tenant {tenant}"
                    )));
                }
                Ok(())
            }
            Record::LeafAdded {
                leaf, key, scopes, ..
            } => {
                if scopes.is_empty() {
                    return Err(AccessError::Invalid(
                        "a leaf needs at least one scope".into(),
                    ));
                }
                if self.key_owner(key).is_some() || self.leaf_of_key(key).is_some() {
                    return Err(AccessError::Invalid(format!("key {key} is already in use")));
                }
                // A leaf's name is its JetStream domain: one per hub, whatever the tenant.
                if let Some((other, _)) = self
                    .live_leaves()
                    .find(|(t, l)| l.name == *leaf && *t != tenant)
                {
                    return Err(AccessError::Invalid(format!(
                        "leaf {leaf} already belongs to tenant {other}; leaf names are unique per hub"
                    )));
                }
                Ok(())
            }
            Record::LeafRevoked { leaf, .. } => {
                if t.leaves.get(leaf).is_some_and(|l| l.revoked_at.is_none()) {
                    Ok(())
                } else {
                    Err(AccessError::Invalid(format!(
                        "tenant {tenant} has no live leaf {leaf}; see `engram leaf list`"
                    )))
                }
            }
            Record::GrantRevoked { to, scope, .. } => {
                if t.grants.contains_key(&(to.clone(), scope.clone())) {
                    Ok(())
                } else {
                    Err(AccessError::Invalid(format!(
                        "{to} holds no grant of {scope} in tenant {tenant}; see `engram grant list --tenant {tenant}`"
                    )))
                }
            }
        }
    }

    /// Folds one entry in; one that does not fit the state is skipped (and logged).
    pub fn apply(&mut self, seq: u64, entry: &Entry) {
        self.applied = self.applied.max(seq);
        if let Err(e) = self.check_at(&entry.record, entry.at) {
            tracing::warn!(seq, error = %e, "access record skipped: it does not fit the registry");
            return;
        }
        let at = entry.at;
        match &entry.record {
            Record::TenantAdded { tenant } => {
                self.tenants.insert(
                    tenant.clone(),
                    Tenant {
                        added_at: Some(at),
                        ..Tenant::default()
                    },
                );
            }
            Record::AgentKeyAdded {
                tenant,
                agent,
                key,
                scopes,
                expires_at,
            } => {
                let a = self
                    .tenant_mut(tenant)
                    .agents
                    .entry(agent.clone())
                    .or_default();
                a.scopes = scopes.clone();
                a.keys.push(Key {
                    key: key.clone(),
                    added_at: at,
                    revoked_at: None,
                    expires_at: *expires_at,
                });
            }
            Record::AgentKeyRenewed {
                tenant,
                agent,
                key,
                expires_at,
            } => {
                if let Some(k) = self
                    .tenant_mut(tenant)
                    .agents
                    .get_mut(agent)
                    .and_then(|a| a.keys.iter_mut().find(|k| k.key == *key))
                {
                    k.expires_at = Some(*expires_at);
                }
            }
            Record::AgentRevoked { tenant, agent, key } => {
                if let Some(a) = self.tenant_mut(tenant).agents.get_mut(agent) {
                    for k in a.keys.iter_mut().filter(|k| k.revoked_at.is_none()) {
                        if key.as_ref().is_none_or(|want| *want == k.key) {
                            k.revoked_at = Some(at);
                        }
                    }
                }
            }
            Record::GrantAdded { tenant, to, scope } => {
                self.tenant_mut(tenant)
                    .grants
                    .insert((to.clone(), scope.clone()), at);
            }
            Record::GrantRevoked { tenant, to, scope } => {
                self.tenant_mut(tenant)
                    .grants
                    .remove(&(to.clone(), scope.clone()));
            }
            Record::LeafAdded {
                tenant,
                leaf,
                key,
                scopes,
            } => {
                self.tenant_mut(tenant).leaves.insert(
                    leaf.clone(),
                    Leaf {
                        key: key.clone(),
                        scopes: scopes.clone(),
                        added_at: at,
                        revoked_at: None,
                    },
                );
            }
            Record::LeafRevoked { tenant, leaf } => {
                if let Some(l) = self.tenant_mut(tenant).leaves.get_mut(leaf) {
                    l.revoked_at = Some(at);
                }
            }
            Record::ErasureStarted { tenant, scopes } => self.erasures.push(Erasure {
                tenant: tenant.clone(),
                scopes: scopes.clone(),
                started_at: at,
                finished_at: None,
                removed: 0,
            }),
            Record::ErasureFinished {
                tenant,
                scopes,
                removed,
                incomplete,
            } => {
                if let Some(e) =
                    self.erasures.iter_mut().rev().find(|e| {
                        e.tenant == *tenant && e.scopes == *scopes && e.finished_at.is_none()
                    })
                {
                    e.removed = *removed;
                    e.finished_at = incomplete.is_empty().then_some(at);
                }
            }
        }
    }

    fn tenant_mut(&mut self, tenant: &Ident) -> &mut Tenant {
        self.tenants.entry(tenant.clone()).or_default()
    }

    /// The tenant and agent a key belongs to, live or revoked.
    pub fn key_owner(&self, key: &str) -> Option<(&Ident, &Ident)> {
        self.tenants.iter().find_map(|(t, tenant)| {
            tenant
                .agents
                .iter()
                .find(|(_, a)| a.keys.iter().any(|k| k.key == key))
                .map(|(a, _)| (t, a))
        })
    }

    /// Whether `agent` of `tenant` holds a live key.
    pub fn is_active(&self, tenant: &Ident, agent: &Ident) -> bool {
        self.agent(tenant, agent)
            .is_some_and(|a| a.active_keys().next().is_some())
    }

    pub fn agent(&self, tenant: &Ident, agent: &Ident) -> Option<&Agent> {
        self.tenants.get(tenant)?.agents.get(agent)
    }

    /// Whether `agent` of `tenant` may read `scope`: one of its own scopes, or granted to it
    /// or to every agent of the tenant. Never another tenant's: scopes are per tenant.
    pub fn may_read(&self, tenant: &Ident, agent: &Ident, scope: &Scope) -> bool {
        let Some(t) = self.tenants.get(tenant) else {
            return false;
        };
        let Some(a) = t
            .agents
            .get(agent)
            .filter(|a| a.active_keys().next().is_some())
        else {
            return false;
        };
        a.scopes.iter().any(|p| p.matches(scope))
            || t.grants.keys().any(|(to, pattern)| {
                (*to == Grantee::AllAgents || *to == Grantee::Agent(agent.clone()))
                    && pattern.matches(scope)
            })
    }

    /// Whether `agent` of `tenant` may write `scope`: its own scopes only (a grant is read
    /// only), which are also what its key may publish to.
    pub fn may_write(&self, tenant: &Ident, agent: &Ident, scope: &Scope) -> bool {
        self.agent(tenant, agent)
            .filter(|a| a.active_keys().next().is_some())
            .is_some_and(|a| a.scopes.iter().any(|p| p.matches(scope)))
    }

    /// The public keys of `agent` of `tenant` that are live: a key claiming to be that agent
    /// must be one of them (a key's tokens are claims; its seed proves only its public key).
    pub fn live_keys_of(&self, tenant: &Ident, agent: &Ident) -> Vec<String> {
        self.agent(tenant, agent)
            .map(|a| a.active_keys().map(|k| k.key.clone()).collect())
            .unwrap_or_default()
    }

    /// The tenant and name of the leaf a key belongs to, live or revoked.
    pub fn leaf_of_key(&self, key: &str) -> Option<(&Ident, &Ident)> {
        self.tenants.iter().find_map(|(t, tenant)| {
            tenant
                .leaves
                .iter()
                .find(|(_, l)| l.key == key)
                .map(|(name, _)| (t, name))
        })
    }

    /// Every live leaf, with what its key may read and write: its scopes, and (read only)
    /// what is granted to every agent of its tenant.
    pub fn live_leaves(&self) -> impl Iterator<Item = (&Ident, crate::leaf::LeafSpec)> {
        self.tenants.iter().flat_map(|(tenant, t)| {
            t.leaves
                .iter()
                .filter(|(_, l)| l.revoked_at.is_none())
                .map(move |(name, l)| {
                    let mut reads = l.scopes.clone();
                    reads.extend(
                        t.grants
                            .keys()
                            .filter(|(to, _)| *to == Grantee::AllAgents)
                            .map(|(_, p)| p.clone()),
                    );
                    (
                        tenant,
                        crate::leaf::LeafSpec {
                            name: name.clone(),
                            tenant: tenant.clone(),
                            writes: crate::leaf::normalize(l.scopes.clone()),
                            reads: crate::leaf::normalize(reads),
                        },
                    )
                })
        })
    }

    /// The next time a key stops working by itself after `now`: when the server's
    /// configuration must be rendered again without any new record ([`crate::conf::enforce`]).
    pub fn next_expiry(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.tenants
            .values()
            .flat_map(|t| t.agents.values())
            .flat_map(|a| a.unrevoked_keys())
            .filter_map(|k| k.expires_at)
            .filter(|e| *e > now)
            .min()
    }

    /// Every live agent and leaf key and the role it connects as: what the server's config
    /// lists. A key past its expiry is left out, as a revoked one is.
    pub fn live_keys(&self) -> Vec<(String, Role)> {
        let mut keys = Vec::new();
        for (tenant, leaf) in self.live_leaves() {
            if let Some(l) = self.tenants[tenant].leaves.get(&leaf.name) {
                keys.push((l.key.clone(), Role::Leaf(leaf)));
            }
        }
        for (tenant, t) in &self.tenants {
            for (agent, a) in &t.agents {
                for k in a.active_keys() {
                    keys.push((
                        k.key.clone(),
                        Role::Agent {
                            tenant: tenant.clone(),
                            agent: agent.clone(),
                            scopes: a.scopes.clone(),
                        },
                    ));
                }
            }
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Ident {
        Ident::parse("id", s).unwrap()
    }

    fn entry(record: Record) -> Entry {
        Entry {
            v: ENTRY_VERSION,
            at: Utc::now(),
            by: "test".into(),
            record,
        }
    }

    fn with_agent() -> Registry {
        let mut r = Registry::default();
        r.apply(1, &entry(Record::TenantAdded { tenant: id("acme") }));
        r.apply(
            2,
            &entry(Record::AgentKeyAdded {
                tenant: id("acme"),
                agent: id("planner"),
                key: "UKEY1".into(),
                scopes: ScopePattern::defaults(&id("planner")),
                expires_at: None,
            }),
        );
        r
    }

    #[test]
    fn an_agent_reads_its_scopes_and_granted_ones_only() {
        let mut r = with_agent();
        let team: Scope = "team:core".parse().unwrap();
        let task: Scope = "task:payroll".parse().unwrap();
        assert!(r.may_read(&id("acme"), &id("planner"), &task));
        assert!(!r.may_read(&id("acme"), &id("planner"), &team));
        assert!(!r.may_read(&id("acme2"), &id("planner"), &task));
        assert!(!r.may_read(&id("acme"), &id("coder"), &task));
        let grant = Record::GrantAdded {
            tenant: id("acme"),
            to: Grantee::Agent(id("planner")),
            scope: ScopePattern::exact(&team),
        };
        r.check(&grant).unwrap();
        r.apply(3, &entry(grant.clone()));
        assert!(r.may_read(&id("acme"), &id("planner"), &team));
        assert!(!r.may_read(&id("acme"), &id("planner"), &"team:core2".parse().unwrap()));
        assert!(r.check(&grant).is_err(), "a grant twice is refused");
        r.apply(
            4,
            &entry(Record::GrantRevoked {
                tenant: id("acme"),
                to: Grantee::Agent(id("planner")),
                scope: ScopePattern::exact(&team),
            }),
        );
        assert!(!r.may_read(&id("acme"), &id("planner"), &team));
    }

    #[test]
    fn a_revoked_agent_reads_nothing_and_has_no_live_key() {
        let mut r = with_agent();
        assert_eq!(r.live_keys_of(&id("acme"), &id("planner")), ["UKEY1"]);
        assert!(r.live_keys_of(&id("acme"), &id("coder")).is_empty());
        assert!(r.live_keys_of(&id("acme2"), &id("planner")).is_empty());
        r.apply(
            3,
            &entry(Record::AgentRevoked {
                tenant: id("acme"),
                agent: id("planner"),
                key: None,
            }),
        );
        assert!(r.live_keys().is_empty());
        assert!(r.live_keys_of(&id("acme"), &id("planner")).is_empty());
        assert!(!r.may_read(&id("acme"), &id("planner"), &"task:x".parse().unwrap()));
        assert!(
            r.key_owner("UKEY1").is_some(),
            "a revoked key is never reused"
        );
    }

    #[test]
    fn tenants_differing_only_in_case_and_records_for_missing_tenants_are_refused() {
        let r = with_agent();
        assert!(matches!(
            r.check(&Record::TenantAdded { tenant: id("ACME") }),
            Err(AccessError::Confusable { .. })
        ));
        assert!(matches!(
            r.check(&Record::GrantAdded {
                tenant: id("nobody"),
                to: Grantee::AllAgents,
                scope: ScopePattern::any(engram_schema::ScopeKind::Team),
            }),
            Err(AccessError::NoTenant { .. })
        ));
        // A record that does not fit is skipped when folded, so every reader agrees.
        let mut r2 = r.clone();
        r2.apply(
            9,
            &entry(Record::AgentKeyAdded {
                tenant: id("nobody"),
                agent: id("x"),
                key: "UKEY2".into(),
                scopes: vec![ScopePattern::any(engram_schema::ScopeKind::Task)],
                expires_at: None,
            }),
        );
        assert_eq!(r2.tenants, r.tenants);
        assert_eq!(r2.applied, 9);
    }

    fn entry_at(record: Record, at: DateTime<Utc>) -> Entry {
        Entry {
            at,
            ..entry(record)
        }
    }

    fn run_key(expires_at: DateTime<Utc>) -> Record {
        Record::AgentKeyAdded {
            tenant: id("acme"),
            agent: id("run-1"),
            key: "URUN1".into(),
            scopes: vec!["task:fix".parse().unwrap()],
            expires_at: Some(expires_at),
        }
    }

    #[test]
    fn a_key_past_its_expiry_drops_out_and_the_next_expiry_is_known() {
        let now = Utc::now();
        let mut r = with_agent();
        let soon = now + chrono::Duration::milliseconds(300);
        r.apply(3, &entry_at(run_key(soon), now));
        let task: Scope = "task:fix".parse().unwrap();
        assert!(r.may_write(&id("acme"), &id("run-1"), &task));
        assert_eq!(r.live_keys().len(), 2);
        assert_eq!(r.next_expiry(now), Some(soon));
        assert_eq!(
            r.next_expiry(soon),
            None,
            "nothing expires after the last expiry"
        );
        std::thread::sleep(std::time::Duration::from_millis(400));
        // Expired: no longer admitted, no longer allowed, and no expiry left to wait for
        assert_eq!(r.live_keys().len(), 1);
        assert_eq!(r.live_keys()[0].0, "UKEY1");
        assert!(!r.may_write(&id("acme"), &id("run-1"), &task));
        assert!(r.live_keys_of(&id("acme"), &id("run-1")).is_empty());
        assert_eq!(r.next_expiry(Utc::now()), None);
        // It can still be revoked (the run's end, for the audit trail), never renewed
        let renew = Record::AgentKeyRenewed {
            tenant: id("acme"),
            agent: id("run-1"),
            key: "URUN1".into(),
            expires_at: Utc::now() + chrono::Duration::hours(1),
        };
        assert!(r.check(&renew).is_err(), "an expired key stays dead");
        let revoke = Record::AgentRevoked {
            tenant: id("acme"),
            agent: id("run-1"),
            key: Some("URUN1".into()),
        };
        r.check(&revoke).unwrap();
        r.apply(4, &entry(revoke));
        assert!(
            r.agent(&id("acme"), &id("run-1")).unwrap().keys[0]
                .revoked_at
                .is_some()
        );
    }

    #[test]
    fn renewing_moves_the_expiry_of_a_live_key_only() {
        let now = Utc::now();
        let mut r = with_agent();
        r.apply(
            3,
            &entry_at(run_key(now + chrono::Duration::seconds(10)), now),
        );
        let later = now + chrono::Duration::hours(1);
        let renew = |key: &str, expires_at| Record::AgentKeyRenewed {
            tenant: id("acme"),
            agent: id("run-1"),
            key: key.into(),
            expires_at,
        };
        r.check(&renew("URUN1", later)).unwrap();
        r.apply(4, &entry_at(renew("URUN1", later), now));
        assert_eq!(r.next_expiry(now), Some(later));
        // Refused: an unknown key, a key without expiry, an expiry in the past
        assert!(r.check(&renew("UNONE", later)).is_err());
        let permanent = Record::AgentKeyRenewed {
            tenant: id("acme"),
            agent: id("planner"),
            key: "UKEY1".into(),
            expires_at: later,
        };
        assert!(r.check(&permanent).is_err());
        assert!(r.check(&renew("URUN1", now)).is_err());
        let born_expired = Record::AgentKeyAdded {
            tenant: id("acme"),
            agent: id("run-2"),
            key: "URUN2".into(),
            scopes: vec!["task:fix".parse().unwrap()],
            expires_at: Some(Utc::now() - chrono::Duration::seconds(1)),
        };
        assert!(r.check(&born_expired).is_err(), "a key born expired");
        // Folding judges expiry at the record's own time: a renewal appended after the
        // expiry is skipped by every reader, whenever it reads
        let mut r2 = with_agent();
        r2.apply(
            3,
            &entry_at(run_key(now + chrono::Duration::seconds(1)), now),
        );
        r2.apply(
            4,
            &entry_at(renew("URUN1", later), now + chrono::Duration::seconds(2)),
        );
        assert_eq!(
            r2.agent(&id("acme"), &id("run-1")).unwrap().keys[0].expires_at,
            Some(now + chrono::Duration::seconds(1))
        );
    }

    #[test]
    fn a_key_record_without_expiry_reads_as_before() {
        // What older builds wrote, and what they can still read: no `expires_at` key
        let old = r#"{"v":1,"at":"2026-01-01T00:00:00Z","by":"x","record":{"type":"agent_key_added","tenant":"acme","agent":"a","key":"UK","scopes":["task:*"]}}"#;
        let e: Entry = serde_json::from_str(old).unwrap();
        assert!(matches!(
            e.record,
            Record::AgentKeyAdded {
                expires_at: None,
                ..
            }
        ));
        assert!(!serde_json::to_string(&e).unwrap().contains("expires_at"));
    }

    #[test]
    fn entries_round_trip_and_unknown_fields_are_refused() {
        let e = entry(Record::GrantAdded {
            tenant: id("acme"),
            to: Grantee::AllAgents,
            scope: "team:core".parse().unwrap(),
        });
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<Entry>(&json).unwrap(), e);
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["extra"] = serde_json::json!(1);
        assert!(serde_json::from_value::<Entry>(v).is_err());
    }
}

//! Each role's NATS permissions, in one place.
//!
//! Everything is allow-listed: a subject no list names is refused by the server. Agents get
//! no JetStream API subject at all, because most of that API takes its subject filter in the
//! request body (stream info with `subjects_filter`, direct get with `next_by_subj`, message
//! get by sequence), where no permission can see it. Agents reach their memory through the
//! query service instead, whose subjects carry the tenant and agent as tokens the server
//! checks ([`query_subject`]).

use std::fmt;
use std::str::FromStr;

use engram_schema::{Ident, Scope, ScopeKind};
use serde::{Deserialize, Serialize};

use crate::AccessError;

/// The names of what the server holds, from the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    pub events_stream: String,
    pub working_bucket: String,
    pub dead_letters: String,
    pub snapshots_bucket: String,
    pub snapshots_index: String,
    pub leases_bucket: String,
    /// Memory nodes and the partitions they own (`engram_node`).
    pub nodes_bucket: String,
    pub access_stream: String,
    /// The server's JetStream domain, which leaf nodes reach its API by
    /// (`$JS.<domain>.API`).
    pub js_domain: String,
}

impl Default for Names {
    fn default() -> Self {
        Self {
            events_stream: "ENGRAM_EVENTS".into(),
            working_bucket: "engram_working".into(),
            dead_letters: "ENGRAM_DLQ".into(),
            snapshots_bucket: "ENGRAM_SNAPSHOTS".into(),
            snapshots_index: "ENGRAM_SNAPSHOT_INDEX".into(),
            leases_bucket: "ENGRAM_LEASES".into(),
            nodes_bucket: "ENGRAM_NODES".into(),
            access_stream: crate::log::ACCESS_STREAM.into(),
            js_domain: crate::leaf::DEFAULT_HUB_DOMAIN.into(),
        }
    }
}

/// Scopes an agent may write to, and read: `kind:id`, or `kind:*` for every scope of a kind.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopePattern {
    pub kind: ScopeKind,
    /// `None`: any id.
    pub id: Option<Ident>,
}

impl ScopePattern {
    pub fn exact(scope: &Scope) -> Self {
        Self {
            kind: scope.kind,
            id: Some(scope.id.clone()),
        }
    }

    pub fn any(kind: ScopeKind) -> Self {
        Self { kind, id: None }
    }

    pub fn matches(&self, scope: &Scope) -> bool {
        self.kind == scope.kind && self.id.as_ref().is_none_or(|id| *id == scope.id)
    }

    /// What an agent of `agent` may use when `agent add` names no scope: every task and
    /// session of its tenant (many instances share those by design) and its own agent scope.
    /// Users, teams and the org are wider memories that others write: those take a scope
    /// named at `agent add`, or a grant.
    pub fn defaults(agent: &Ident) -> Vec<Self> {
        vec![
            Self::any(ScopeKind::Task),
            Self::any(ScopeKind::Session),
            Self {
                kind: ScopeKind::Agent,
                id: Some(agent.clone()),
            },
        ]
    }

    /// The id token of a subject: the id, or `*`.
    fn id_token(&self) -> &str {
        self.id.as_ref().map_or("*", Ident::as_str)
    }
}

impl fmt::Display for ScopePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.id_token())
    }
}

impl FromStr for ScopePattern {
    type Err = AccessError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, id) = s.split_once(':').ok_or_else(|| {
            AccessError::Invalid(format!(
                "scope {s:?} is not of the form kind:id or kind:*, for example task:build-42 or task:*"
            ))
        })?;
        let kind: ScopeKind = kind
            .parse()
            .map_err(|e: engram_schema::SchemaError| AccessError::Invalid(e.to_string()))?;
        let id = match id {
            "*" => None,
            id => Some(
                Ident::parse("scope.id", id).map_err(|e| AccessError::Invalid(e.to_string()))?,
            ),
        };
        Ok(Self { kind, id })
    }
}

impl Serialize for ScopePattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ScopePattern {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Who a key acts as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// The operator: everything, including stream and consumer management.
    Admin,
    /// The read-model projectors: consume the events stream, dead-letter, cut snapshots and
    /// serve `engram.p.*`.
    Projectors,
    /// The consolidator: a projector that also appends what it consolidates.
    Consolidator,
    /// The query service: asks the projectors, reads the registry, appends usage and writes
    /// working memory for agents. It answers `engram.q.>` on its [`Role::Responder`].
    Query,
    /// The connection a service answers requests on, apart from the one it works with: it
    /// receives the service's requests and publishes only to inboxes. A reply subject is
    /// whatever the requester wrote, so the identity that follows it must hold no right a
    /// request could borrow (the confused deputy: a reply aimed at `engram.evt.<other
    /// tenant>…` with the query service's rights). The service also checks every reply
    /// subject before it does any work (`engram_rpc`): this identity is the server's second
    /// line.
    Responder(Service),
    /// One agent of one tenant.
    Agent {
        tenant: Ident,
        agent: Ident,
        scopes: Vec<ScopePattern>,
    },
    /// A leaf node's connection: its events go up and the hub's come down by JetStream
    /// sourcing, for its scopes only ([`crate::leaf`]).
    Leaf(crate::leaf::LeafSpec),
}

/// A service that answers requests: each has a worker identity ([`Role::Projectors`],
/// [`Role::Consolidator`], [`Role::Query`]) and a [`Role::Responder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Service {
    Projectors,
    Consolidator,
    Query,
}

impl Service {
    pub const ALL: [Service; 3] = [Self::Projectors, Self::Consolidator, Self::Query];

    /// The worker role of this service.
    pub fn worker(self) -> Role {
        match self {
            Self::Projectors => Role::Projectors,
            Self::Consolidator => Role::Consolidator,
            Self::Query => Role::Query,
        }
    }

    /// The request subjects this service answers (besides `$SRV` discovery).
    fn requests(self) -> (Vec<String>, Vec<String>) {
        match self {
            // Every read model but the consolidator, whose endpoints are its own.
            Self::Projectors => (
                vec![format!("{PROJECTOR_PREFIX}.>")],
                vec![format!("{PROJECTOR_PREFIX}.consolidator.>")],
            ),
            // Each op of each partition: `engram.p.consolidator.<op>.<partition>`.
            Self::Consolidator => (vec![format!("{PROJECTOR_PREFIX}.consolidator.*.*")], vec![]),
            Self::Query => (
                vec![format!("{QUERY_PREFIX}.>"), format!("{NODE_PREFIX}.>")],
                vec![],
            ),
        }
    }
}

/// The first tokens of projector request subjects (`engram.p.<model>.<op>.<partition>`).
pub const PROJECTOR_PREFIX: &str = "engram.p";

/// The prefix every reply subject of a request to an agent subject must have: the caller's
/// own inbox, which only the caller may subscribe to. `None` for a subject that names no
/// agent.
pub fn caller_inbox(subject: &str) -> Option<String> {
    let (tenant, agent) = caller_of(subject)?;
    Some(format!(
        "{}.",
        inbox_prefix(&Role::Agent {
            tenant,
            agent,
            scopes: Vec::new(),
        })
    ))
}

/// Whether a service may answer a request that arrived on `subject` at `reply`: a request
/// on an agent's subject only at that agent's inbox; any other (the admin's and the
/// services' own subjects, which no agent may publish to) only at an inbox that is not an
/// agent's. A request without a reply subject is never served: nobody would read the
/// answer, and its work (a write, a cut) would be done for nobody.
pub fn reply_allowed(subject: &str, reply: Option<&str>) -> bool {
    let Some(reply) = reply else {
        return false;
    };
    // A reply subject with wildcards or empty tokens is no inbox.
    let well_formed = !reply.is_empty()
        && reply
            .split('.')
            .all(|t| !t.is_empty() && t != "*" && t != ">" && !t.contains(char::is_whitespace));
    if !well_formed {
        return false;
    }
    let privileged = || reply.starts_with("_INBOX.") && !reply.starts_with(AGENT_INBOX_PREFIX);
    match caller_inbox(subject) {
        Some(prefix) => reply.starts_with(&prefix),
        // A privileged routed query: the admin's or a service's, as on `engram.q.<op>`.
        None if routed_of(subject).is_some_and(|r| r.agent.is_none()) => privileged(),
        None if (subject.starts_with(&format!("{QUERY_PREFIX}."))
            && subject.split('.').count() > 3)
            || subject.starts_with(&format!("{NODE_PREFIX}.")) =>
        {
            // Looks like an agent subject but does not parse as one: nobody's.
            false
        }
        None => privileged(),
    }
}

/// The first tokens of every agent's inbox (`_INBOX.a.<tenant>.<agent>`).
const AGENT_INBOX_PREFIX: &str = "_INBOX.a.";

/// The subject an agent sends `op` to: tenant and agent are tokens the server's permissions
/// pin to the key, so the query service reads them from the subject and never from the body.
pub fn query_subject(tenant: &Ident, agent: &Ident, op: &str) -> String {
    format!("{QUERY_PREFIX}.{tenant}.{agent}.{op}")
}

/// What the query service subscribes to for `op` from every agent.
pub fn query_subject_any(op: &str) -> String {
    format!("{QUERY_PREFIX}.*.*.{op}")
}

/// The first tokens of agent query subjects.
pub const QUERY_PREFIX: &str = "engram.q";

/// The tenant and agent of an agent query subject: `engram.q.<tenant>.<agent>.<op>`, or a
/// routed one ([`routed_of`]).
pub fn caller_of(subject: &str) -> Option<(Ident, Ident)> {
    if let Some(routed) = routed_of(subject) {
        return Some((routed.tenant, routed.agent?));
    }
    let rest = subject.strip_prefix(QUERY_PREFIX)?.strip_prefix('.')?;
    let mut tokens = rest.split('.');
    let (tenant, agent, _op) = (tokens.next()?, tokens.next()?, tokens.next()?);
    if tokens.next().is_some() {
        return None;
    }
    Some((
        Ident::parse("tenant", tenant).ok()?,
        Ident::parse("agent", agent).ok()?,
    ))
}

/// The first tokens of the subjects memory nodes answer routed queries on:
/// `engram.n.<partition>.<tenant>.<agent>.<op>.<kind>.<id>` for an agent's, and
/// `engram.n.<partition>.<op>.<tenant>.<kind>.<id>` for the admin's and the services'. The
/// server's mapping ([`crate::conf::query_routing`]) makes them of the routed query subjects
/// ([`routed_query_subject`], [`privileged_routed_subject`]), with the partition of the
/// tenant's scope computed as the events stream's own transform does.
pub const NODE_PREFIX: &str = "engram.n";

/// The subject an agent sends `op` about its own `scope` to, for the memory node that owns
/// the scope's partition: `engram.q.<tenant>.<agent>.<op>.<kind>.<id>`. The server maps it
/// to `engram.n.<partition>.…`; a server without the mapping delivers it to the query
/// service as it is.
pub fn routed_query_subject(tenant: &Ident, agent: &Ident, op: &str, scope: &Scope) -> String {
    format!(
        "{QUERY_PREFIX}.{tenant}.{agent}.{op}.{}.{}",
        scope.kind, scope.id
    )
}

/// [`routed_query_subject`] for the admin and the services, which ask as no agent:
/// `engram.q.<op>.<tenant>.<kind>.<id>`. No agent's key may publish to it, nor to what the
/// server maps it to.
pub fn privileged_routed_subject(op: &str, tenant: &Ident, scope: &Scope) -> String {
    format!("{QUERY_PREFIX}.{op}.{tenant}.{}.{}", scope.kind, scope.id)
}

/// What the query service subscribes to for routed `op` requests a server without the
/// mapping delivers unmapped: the agents' and the privileged form.
pub fn routed_subjects_any(op: &str) -> [String; 2] {
    [
        format!("{QUERY_PREFIX}.*.*.{op}.*.*"),
        format!("{QUERY_PREFIX}.{op}.*.*.*"),
    ]
}

/// What the owner of `partition` subscribes to for routed `op` requests: the agents' and
/// the privileged form.
pub fn node_subjects_any(partition: u32, op: &str) -> [String; 2] {
    [
        format!("{NODE_PREFIX}.{partition}.*.*.{op}.*.*"),
        format!("{NODE_PREFIX}.{partition}.{op}.*.*.*"),
    ]
}

/// A routed query subject, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routed {
    /// The partition the server's mapping put in the subject; `None` for a subject that
    /// arrived unmapped.
    pub partition: Option<u32>,
    pub tenant: Ident,
    /// The asking agent; `None` for the privileged form (the admin's and the services').
    pub agent: Option<Ident>,
    pub op: String,
    /// The request's own scope, which decided the partition.
    pub scope: Scope,
}

/// Parses a routed query subject, mapped (`engram.n.<partition>.…`) or not (`engram.q.…`),
/// an agent's (`<tenant>.<agent>.<op>.<kind>.<id>`) or privileged (`<op>.<tenant>.<kind>.
/// <id>`); `None` for anything else.
pub fn routed_of(subject: &str) -> Option<Routed> {
    let (partition, rest) = if let Some(rest) = subject
        .strip_prefix(NODE_PREFIX)
        .and_then(|r| r.strip_prefix('.'))
    {
        let (partition, rest) = rest.split_once('.')?;
        // Digits only: `+5` or `05` would parse, and name the same partition twice.
        if partition.is_empty()
            || !partition.bytes().all(|b| b.is_ascii_digit())
            || (partition.len() > 1 && partition.starts_with('0'))
        {
            return None;
        }
        (Some(partition.parse::<u32>().ok()?), rest)
    } else {
        (None, subject.strip_prefix(QUERY_PREFIX)?.strip_prefix('.')?)
    };
    let tokens: Vec<&str> = rest.split('.').collect();
    let (tenant, agent, op, kind, id) = match tokens[..] {
        [tenant, agent, op, kind, id] => (tenant, Some(agent), op, kind, id),
        [op, tenant, kind, id] => (tenant, None, op, kind, id),
        _ => return None,
    };
    if op.is_empty() || !op.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
        return None;
    }
    Some(Routed {
        partition,
        tenant: Ident::parse("tenant", tenant).ok()?,
        agent: match agent {
            Some(agent) => Some(Ident::parse("agent", agent).ok()?),
            None => None,
        },
        op: op.to_owned(),
        scope: Scope::new(kind.parse().ok()?, id).ok()?,
    })
}

/// The inbox prefix of a role's connections: replies come back only there.
pub fn inbox_prefix(role: &Role) -> String {
    match role {
        Role::Admin => "_INBOX".into(),
        Role::Agent { tenant, agent, .. } => format!("{AGENT_INBOX_PREFIX}{tenant}.{agent}"),
        // A leaf connection makes no requests of its own: the servers' sourcing does.
        Role::Leaf(leaf) => format!("_INBOX.l.{}", leaf.name),
        service => format!("_INBOX.s.{}", RoleName::of(service).as_str()),
    }
}

use crate::creds::RoleName;

/// One direction's lists, as nats-server reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Rule {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
}

/// A user's permissions block. `None` for the admin: no restriction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Permissions {
    pub publish: Rule,
    pub subscribe: Rule,
    /// Lets a service reply to a request it received without a general publish right on
    /// other inboxes.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub allow_responses: bool,
}

/// The permissions of `role`, or `None` for unrestricted (admin only).
pub fn permissions(role: &Role, names: &Names) -> Option<Permissions> {
    let Names {
        events_stream: events,
        working_bucket: working,
        dead_letters: dlq,
        snapshots_bucket: snaps,
        snapshots_index: snap_index,
        leases_bucket: leases,
        nodes_bucket: nodes,
        access_stream: access,
        js_domain: _,
    } = names;
    let inbox = format!("{}.>", inbox_prefix(role));
    let s = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    match role {
        Role::Admin => None,
        Role::Leaf(leaf) => Some(crate::leaf::permissions(leaf, names)),
        Role::Agent {
            tenant,
            agent,
            scopes: _,
        } => {
            // Its own query subjects, nothing else: appends too go through the query service
            // (`engram.q.<tenant>.<agent>.append`), which checks each event against
            // `scopes`. A key that could publish to the log directly could have the server
            // acknowledge the publish at any reply subject it names: another tenant's events,
            // a KV bucket, the registry, the JetStream API. The server publishes those acks
            // itself, outside every permission.
            // Routed queries too: `engram.q.<tenant>.<agent>.<op>.<kind>.<id>`, which the
            // server maps to `engram.n.<partition>.<tenant>.<agent>.…` (permissions are
            // checked on the mapped subject). A key that names another partition than
            // its scope's reaches no node: each checks the partition against the scope.
            let publish = vec![
                query_subject(tenant, agent, "*"),
                format!("{QUERY_PREFIX}.{tenant}.{agent}.*.*.*"),
                format!("{NODE_PREFIX}.*.{tenant}.{agent}.*.*.*"),
            ];
            Some(Permissions {
                publish: Rule {
                    allow: publish,
                    deny: Vec::new(),
                },
                subscribe: Rule {
                    allow: vec![inbox],
                    deny: Vec::new(),
                },
                allow_responses: false,
            })
        }
        Role::Responder(service) => {
            let (requests, deny) = service.requests();
            Some(Permissions {
                publish: Rule {
                    // Answers go to inboxes only; which inbox is checked before any work
                    // (`reply_allowed`). No right to the log, KV, the object store, the
                    // JetStream API or acks: a reply aimed there is refused by the server.
                    allow: vec!["_INBOX.>".to_owned()],
                    deny: Vec::new(),
                },
                subscribe: Rule {
                    allow: requests.into_iter().chain(["$SRV.>".to_owned()]).collect(),
                    deny,
                },
                // Not needed (inboxes are allowed) and not wanted: it would let a reply
                // subject outside `_INBOX` through.
                allow_responses: false,
            })
        }
        service => {
            // What every service's worker does: read streams through consumers and direct
            // gets, and answer flow control. It receives no requests (its responder does),
            // so nothing a client sends decides where it publishes.
            let mut publish = s(&[
                "$JS.API.INFO",
                "$JS.API.STREAM.INFO.*",
                "$JS.API.CONSUMER.>",
                "$JS.API.DIRECT.GET.>",
                "$JS.API.STREAM.MSG.GET.*",
                "$JS.FC.>",
            ]);
            let subscribe = vec![inbox];
            // Destructive or structural operations on the log are the admin's alone.
            let mut deny = vec![
                "$JS.API.STREAM.DELETE.>".to_owned(),
                "$JS.API.ACCOUNT.PURGE.>".to_owned(),
                format!("$JS.API.CONSUMER.*.{access}.>"),
            ];
            let projector = |publish: &mut Vec<String>| {
                publish.extend([
                    // Acks of its own durable consumers on the events stream; an ack
                    // elsewhere would make another consumer skip a message.
                    format!("$JS.ACK.{events}.>"),
                    format!("{}.>", engram_telemetry_dlq_prefix()),
                    format!("$JS.API.STREAM.CREATE.{dlq}"),
                    format!("$O.{snaps}.>"),
                    format!("$KV.{snap_index}.>"),
                    format!("$JS.API.STREAM.PURGE.OBJ_{snaps}"),
                    format!("$JS.API.STREAM.MSG.DELETE.OBJ_{snaps}"),
                    format!("$JS.API.STREAM.CREATE.OBJ_{snaps}"),
                    format!("$JS.API.STREAM.CREATE.KV_{snap_index}"),
                    format!("$KV.{leases}.>"),
                    format!("$JS.API.STREAM.CREATE.KV_{leases}"),
                    // A memory node's membership and partition leases.
                    format!("$KV.{nodes}.>"),
                    format!("$JS.API.STREAM.CREATE.KV_{nodes}"),
                ]);
            };
            match service {
                Role::Projectors => projector(&mut publish),
                Role::Consolidator => {
                    projector(&mut publish);
                    publish.push(format!("{}.>", engram_schema::SUBJECT_PREFIX));
                    // Asks the vector model for close pairs, and nothing else of it.
                    publish.push(format!("{PROJECTOR_PREFIX}.vector.neighbours.*"));
                }
                Role::Query => {
                    publish.push(format!("{PROJECTOR_PREFIX}.>"));
                    publish.push(format!("{}.>", engram_schema::SUBJECT_PREFIX));
                    publish.push(format!("$KV.{working}.>"));
                    // Erasure is the admin's: the service that answers agents cannot erase.
                    deny.push(format!("{PROJECTOR_PREFIX}.*.erase"));
                    deny.push(format!("{PROJECTOR_PREFIX}.*.erase.>"));
                    // The query service reads the registry: it is the one that checks grants.
                    deny.retain(|d| !d.contains(access.as_str()));
                }
                Role::Admin | Role::Agent { .. } | Role::Leaf(_) | Role::Responder(_) => {
                    unreachable!("matched above")
                }
            }
            // No service writes to or reshapes the events stream other than by publishing.
            deny.extend([
                format!("$JS.API.STREAM.PURGE.{events}"),
                format!("$JS.API.STREAM.MSG.DELETE.{events}"),
                format!("$JS.API.STREAM.UPDATE.{events}"),
                format!("$JS.API.STREAM.PURGE.{access}"),
                format!("$JS.API.STREAM.MSG.DELETE.{access}"),
                format!("$JS.API.STREAM.UPDATE.{access}"),
                "engram.access.>".to_owned(),
            ]);
            Some(Permissions {
                publish: Rule {
                    allow: publish,
                    deny,
                },
                subscribe: Rule {
                    allow: subscribe,
                    deny: Vec::new(),
                },
                allow_responses: false,
            })
        }
    }
}

fn engram_telemetry_dlq_prefix() -> &'static str {
    // Kept in step with engram_bus::DLQ_SUBJECT_PREFIX (this crate does not depend on the
    // bus); a test of the bus checks the two agree.
    "engram.dlq"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(tenant: &str, name: &str) -> Role {
        let agent = Ident::parse("agent", name).unwrap();
        Role::Agent {
            tenant: Ident::parse("tenant", tenant).unwrap(),
            scopes: ScopePattern::defaults(&agent),
            agent,
        }
    }

    #[test]
    fn an_agent_publishes_only_on_its_tenant_and_receives_only_on_its_inbox() {
        let p = permissions(&agent("acme", "planner"), &Names::default()).unwrap();
        assert_eq!(
            p.publish.allow,
            vec![
                "engram.q.acme.planner.*",
                "engram.q.acme.planner.*.*.*",
                "engram.n.*.acme.planner.*.*.*"
            ],
            "appends go through the query service: a key that publishes to the log chooses where the server acks it"
        );
        assert_eq!(p.subscribe.allow, vec!["_INBOX.a.acme.planner.>"]);
        assert!(!p.allow_responses);
        for list in [&p.publish.allow, &p.subscribe.allow] {
            assert!(list.iter().all(|s| !s.starts_with("$JS")), "{list:?}");
        }
    }

    #[test]
    fn scope_patterns_parse_show_and_match() {
        let any: ScopePattern = "task:*".parse().unwrap();
        let one: ScopePattern = "team:core".parse().unwrap();
        assert_eq!(any.to_string(), "task:*");
        assert_eq!(one.to_string(), "team:core");
        assert!(any.matches(&"task:x".parse().unwrap()));
        assert!(!any.matches(&"team:x".parse().unwrap()));
        assert!(one.matches(&"team:core".parse().unwrap()));
        assert!(!one.matches(&"team:core2".parse().unwrap()));
        for bad in [
            "task", "task:a.b", "task:>", "galaxy:x", "task:a b", "task:",
        ] {
            assert!(bad.parse::<ScopePattern>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn a_caller_is_read_from_an_agent_subject_only() {
        let (t, a) = caller_of("engram.q.acme.planner.retrieve").unwrap();
        assert_eq!((t.as_str(), a.as_str()), ("acme", "planner"));
        assert!(caller_of("engram.q.retrieve").is_none());
        assert!(caller_of("engram.q.acme.planner.retrieve.x").is_none());
        assert!(caller_of("engram.qx.acme.planner.retrieve").is_none());
    }

    #[test]
    fn a_routed_subject_names_its_partition_caller_op_and_scope() {
        let mapped = routed_of("engram.n.5.acme.planner.retrieve.task.t1").unwrap();
        assert_eq!(mapped.partition, Some(5));
        assert_eq!(mapped.tenant.as_str(), "acme");
        assert_eq!(mapped.agent.as_ref().map(Ident::as_str), Some("planner"));
        assert_eq!(mapped.op, "retrieve");
        assert_eq!(mapped.scope.to_string(), "task:t1");
        let unmapped = routed_of("engram.q.acme.planner.retrieve.task.t1").unwrap();
        assert_eq!(unmapped.partition, None);
        assert_eq!(
            caller_of("engram.n.5.acme.planner.retrieve.task.t1")
                .map(|(t, a)| (t.to_string(), a.to_string())),
            Some(("acme".into(), "planner".into()))
        );
        let agent = mapped.agent.clone().unwrap();
        assert_eq!(
            routed_query_subject(&mapped.tenant, &agent, "retrieve", &mapped.scope),
            "engram.q.acme.planner.retrieve.task.t1"
        );
        // The privileged form names no agent, and is answered at no agent's inbox.
        let privileged = routed_of("engram.n.5.retrieve.acme.task.t1").unwrap();
        assert_eq!(privileged.agent, None);
        assert_eq!(privileged.tenant.as_str(), "acme");
        assert_eq!(privileged.op, "retrieve");
        assert!(caller_of("engram.n.5.retrieve.acme.task.t1").is_none());
        assert_eq!(
            privileged_routed_subject("retrieve", &privileged.tenant, &privileged.scope),
            "engram.q.retrieve.acme.task.t1"
        );
        assert!(reply_allowed(
            "engram.n.5.retrieve.acme.task.t1",
            Some("_INBOX.abc")
        ));
        assert!(!reply_allowed(
            "engram.n.5.retrieve.acme.task.t1",
            Some("_INBOX.a.acme.planner.abc")
        ));
        for bad in [
            "engram.n.05.acme.planner.retrieve.task.t1",
            "engram.n.+5.acme.planner.retrieve.task.t1",
            "engram.n.x.acme.planner.retrieve.task.t1",
            "engram.n.5.acme.planner.retrieve.galaxy.t1",
            "engram.n.5.acme.planner.retrieve.task",
            "engram.n.5.acme.planner.retrieve.task.t1.x",
            "engram.n.5.acme.planner.re-trieve.task.t1",
            "engram.n.5.acme.planner.Retrieve.task.t1",
            "engram.n.5.retrieve.acme.task",
        ] {
            assert!(routed_of(bad).is_none(), "{bad}");
            assert!(!reply_allowed(bad, Some("_INBOX.x.y")), "{bad}");
        }
        // Answered at the caller's own inbox only.
        let subject = "engram.n.5.acme.planner.retrieve.task.t1";
        assert!(reply_allowed(subject, Some("_INBOX.a.acme.planner.abc")));
        assert!(!reply_allowed(subject, Some("_INBOX.a.acme.other.abc")));
        assert!(!reply_allowed(subject, Some("_INBOX.s.query.abc")));
    }

    #[test]
    fn every_restricted_role_has_a_non_empty_allow_list() {
        // An empty allow list is read by nats-server as "allow all": it must never render.
        for role in [
            Role::Projectors,
            Role::Consolidator,
            Role::Query,
            agent("a", "b"),
        ] {
            let p = permissions(&role, &Names::default()).unwrap();
            assert!(!p.publish.allow.is_empty() && !p.subscribe.allow.is_empty());
        }
    }
}

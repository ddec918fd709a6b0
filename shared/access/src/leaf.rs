//! Leaf nodes: a local Engram (a laptop) whose nats-server is a leaf node of a hub's, with a
//! JetStream domain of its own. Everything both sides must agree on is named here, once:
//! the streams, the subjects that cross the link, and the permissions the hub gives the
//! leaf's connection ([`permissions`]), which are derived from the registry as an agent's are.
//!
//! # How events cross
//! Both directions are JetStream sourcing across domains; no event subject crosses the link
//! itself, so neither side's events stream captures the other's publishes ("one subject
//! captured in two domains").
//! - **Down** (hub to leaf): the leaf's inbox stream ([`INBOX_STREAM`]) sources the hub's
//!   events stream, one source per scope the leaf may read, delivered on
//!   `engram.leaf.<leaf>.down.…`. The leaf's relay moves each event into the leaf's events
//!   stream, skipping the ones that went up from this leaf (their [`ORIGIN_HEADER`] names it).
//! - **Up** (leaf to hub): the leaf's relay copies each event first stored on the leaf (no
//!   [`ORIGIN_HEADER`]) to the leaf's outbox stream ([`OUTBOX_STREAM`]) on
//!   `engram.out.<tenant>.<kind>.<id>.<layer>.<partition>`, tagged with the leaf's name. The
//!   hub's events stream sources the outbox, one source per scope the leaf may write, and
//!   maps each subject back to `engram.evt.…`. Only the hub's own configuration decides
//!   which subjects it takes: a leaf that stores another tenant's subject in its outbox is
//!   never sourced from.
//!
//! Every event keeps its `Nats-Msg-Id` (`<tenant>:<event id>`) on every hop, so each stream
//! deduplicates a hop retried after a crash; the origin header is what keeps an event from
//! coming back to the side that wrote it, however long the link was down.

use engram_schema::{Ident, SUBJECT_PREFIX};
use serde::{Deserialize, Serialize};

use crate::AccessError;
use crate::perms::{Names, Permissions, Rule, ScopePattern};

/// The leaf's stream of events waiting to go up to the hub.
pub const OUTBOX_STREAM: &str = "ENGRAM_LEAF_OUTBOX";
/// The leaf's stream of the hub's events, waiting to be moved into the leaf's events stream.
pub const INBOX_STREAM: &str = "ENGRAM_LEAF_INBOX";
/// The first two tokens of an outbox subject.
pub const OUTBOX_PREFIX: &str = "engram.out";
/// The header naming where an event was first stored when it is not where it is read: the
/// leaf's name, or the hub's domain. Absent on an event stored first on this side.
pub const ORIGIN_HEADER: &str = "Engram-Origin";
/// The JetStream domain a hub runs with unless configured otherwise.
pub const DEFAULT_HUB_DOMAIN: &str = "hub";

/// One leaf as the hub knows it: what its key may read and write.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeafSpec {
    pub name: Ident,
    pub tenant: Ident,
    /// Scopes whose events go up (and come down).
    pub writes: Vec<ScopePattern>,
    /// Scopes whose events come down: `writes` plus what is granted to every agent of the
    /// tenant.
    pub reads: Vec<ScopePattern>,
}

/// Whether a leaf that may read `reads` receives its tenant's artifacts: the tenant's
/// bucket is synced whole (object names cannot be filtered by task), so only to a leaf that
/// may read every task.
pub fn syncs_artifacts(reads: &[ScopePattern]) -> bool {
    reads
        .iter()
        .any(|p| p.kind == engram_schema::ScopeKind::Task && p.id.is_none())
}

/// The Object Store bucket of the artifacts `engram run` stores on leaf `leaf`: sourced by
/// the hub into a bucket of the same name, so that a session run on the leaf resumes on the
/// hub with its artifacts. A bucket of its own (not the tenant's, which comes down from the
/// hub) so that nothing goes round: the hub's copy is never sourced back down.
pub fn leaf_artifacts_bucket(leaf: &Ident) -> String {
    format!("{LEAF_ARTIFACTS_PREFIX}{leaf}")
}

/// What every leaf's artifacts bucket name starts with.
pub const LEAF_ARTIFACTS_PREFIX: &str = "ENGRAM_LEAF_ARTIFACTS_";

/// The stream behind [`leaf_artifacts_bucket`].
pub fn leaf_artifacts_stream(leaf: &Ident) -> String {
    format!("OBJ_{}", leaf_artifacts_bucket(leaf))
}

/// The stream behind the working-memory bucket `bucket`.
pub fn working_stream(bucket: &str) -> String {
    format!("KV_{bucket}")
}

/// The subjects of one scope pattern's working-memory entries in `bucket` (keys are
/// `<tenant>.<kind>.<id>.<key>`).
pub fn working_filter(bucket: &str, tenant: &Ident, pattern: &ScopePattern) -> String {
    format!("$KV.{bucket}.{tenant}.{}.>", tokens(pattern))
}

/// The working-memory bucket a hub runs with unless configured otherwise.
pub fn default_working_bucket() -> String {
    "engram_working".into()
}

/// The stream behind the Object Store bucket of `tenant`'s artifacts.
pub fn artifacts_stream(tenant: &Ident) -> String {
    format!("OBJ_{}", engram_schema::session::artifacts_bucket(tenant))
}

/// The `deliver` prefix of the hub's events coming down to `leaf`.
pub fn down_prefix(leaf: &Ident) -> String {
    format!("engram.leaf.{leaf}.down")
}

/// The `deliver` prefix of `leaf`'s outbox going up to the hub.
pub fn up_prefix(leaf: &Ident) -> String {
    format!("engram.leaf.{leaf}.up")
}

/// The JetStream API prefix of a domain.
pub fn api_prefix(domain: &str) -> String {
    format!("$JS.{domain}.API")
}

/// The stored-subject filter of one scope pattern's events (`engram.evt.<tenant>.<kind>.
/// <id|*>.*.*`), or with `prefix` [`OUTBOX_PREFIX`], of its outbox subjects.
pub fn scope_filter(prefix: &str, tenant: &Ident, pattern: &ScopePattern) -> String {
    format!(
        "{prefix}.{tenant}.{pattern_tokens}.*.*",
        pattern_tokens = tokens(pattern)
    )
}

fn tokens(pattern: &ScopePattern) -> String {
    pattern.to_string().replace(':', ".")
}

/// The transform of an outbox subject matching `scope_filter(OUTBOX_PREFIX, …)` to the
/// hub's stored subject: every wildcard token kept, in order.
pub fn up_transform(tenant: &Ident, pattern: &ScopePattern) -> (String, String) {
    let src = scope_filter(OUTBOX_PREFIX, tenant, pattern);
    let mut n = 0;
    let dest: Vec<String> = src
        .split('.')
        .skip(2)
        .map(|t| {
            if t == "*" {
                n += 1;
                format!("{{{{wildcard({n})}}}}")
            } else {
                t.to_owned()
            }
        })
        .collect();
    (src, format!("{SUBJECT_PREFIX}.{}", dest.join(".")))
}

/// The outbox subject of an event stored on `stored` (`engram.evt.<t>.<k>.<id>.<layer>.<p>`),
/// `None` for anything else.
pub fn outbox_subject(stored: &str) -> Option<String> {
    let rest = stored.strip_prefix(SUBJECT_PREFIX)?.strip_prefix('.')?;
    (rest.split('.').count() == 5).then(|| format!("{OUTBOX_PREFIX}.{rest}"))
}

/// The publish subject (`engram.evt.<t>.<k>.<id>.<layer>`) of a stored subject: the
/// partition token dropped, for the receiving side's own stream to compute again.
pub fn publish_subject(stored: &str) -> Option<String> {
    let rest = stored.strip_prefix(SUBJECT_PREFIX)?.strip_prefix('.')?;
    let tokens: Vec<&str> = rest.split('.').collect();
    (tokens.len() == 5
        && tokens
            .iter()
            .all(|t| !t.is_empty() && *t != "*" && *t != ">"))
    .then(|| format!("{SUBJECT_PREFIX}.{}", tokens[..4].join(".")))
}

/// Drops the patterns another pattern of the list already covers (`task:x` beside
/// `task:*`), so that no event is sourced twice, and sorts the rest.
pub fn normalize(mut patterns: Vec<ScopePattern>) -> Vec<ScopePattern> {
    patterns.sort();
    patterns.dedup();
    let wide: Vec<_> = patterns
        .iter()
        .filter(|p| p.id.is_none())
        .map(|p| p.kind)
        .collect();
    patterns.retain(|p| p.id.is_none() || !wide.contains(&p.kind));
    patterns
}

/// The permissions the hub gives `leaf`'s connection, from the leaf's side (what it may
/// publish into the hub, what it may receive from it; the server reverses them for a leaf
/// connection). Nothing else of the hub is reachable: no event, query, KV or inbox subject,
/// and of the JetStream API only creating a consumer on the events stream or the working-
/// memory bucket whose filter is one of the leaf's readable scopes (since 2.10 the filter
/// is a token of the subject), and one on its tenant's artifacts bucket.
pub fn permissions(leaf: &LeafSpec, names: &Names) -> Permissions {
    let hub_api = api_prefix(&names.js_domain);
    let events = &names.events_stream;
    let mut publish: Vec<String> = normalize(leaf.reads.clone())
        .iter()
        .map(|p| {
            format!(
                "{hub_api}.CONSUMER.CREATE.{events}.*.{}",
                scope_filter(SUBJECT_PREFIX, &leaf.tenant, p)
            )
        })
        .collect();
    // The readable scopes' working-memory entries (the key's first tokens are the scope's).
    let working = working_stream(&names.working_bucket);
    publish.extend(normalize(leaf.reads.clone()).iter().map(|p| {
        format!(
            "{hub_api}.CONSUMER.CREATE.{working}.*.{}",
            working_filter(&names.working_bucket, &leaf.tenant, p)
        )
    }));
    publish.push(format!("$JS.FC.{working}.>"));
    if syncs_artifacts(&leaf.reads) {
        // The tenant's artifacts bucket, whole (no filter: the subject is the stream's).
        let artifacts = artifacts_stream(&leaf.tenant);
        publish.push(format!("{hub_api}.CONSUMER.CREATE.{artifacts}"));
        publish.push(format!("$JS.FC.{artifacts}.>"));
    }
    publish.extend([
        // The outbox's events, heartbeats and flow control, to the hub's sourcing.
        format!("{}.>", up_prefix(&leaf.name)),
        // Flow-control answers to the hub's consumer of its events stream.
        format!("$JS.FC.{events}.>"),
        // Answers to the hub's consumer-create requests to the leaf's API (the server
        // chooses these reply subjects; a leaf cannot subscribe to them, see below).
        "$JSC.R.*".to_owned(),
    ]);
    let subscribe = vec![
        // The hub's requests to the leaf's own JetStream API (its domain is its name).
        format!("{}.>", api_prefix(leaf.name.as_str())),
        format!("{}.>", down_prefix(&leaf.name)),
        // Answers to the leaf's consumer-create requests.
        "$JSC.R.*".to_owned(),
        format!("$JS.FC.{OUTBOX_STREAM}.>"),
        format!("$JS.FC.{}.>", leaf_artifacts_stream(&leaf.name)),
    ];
    Permissions {
        publish: Rule {
            allow: publish,
            deny: Vec::new(),
        },
        subscribe: Rule {
            allow: subscribe,
            deny: Vec::new(),
        },
        allow_responses: false,
    }
}

/// Checks a leaf name: an [`Ident`] that is also a JetStream domain (no dot, no wildcard,
/// no space) and not the hub's.
pub fn check_name(name: &Ident, hub_domain: &str) -> Result<(), AccessError> {
    if name.as_str() == hub_domain {
        return Err(AccessError::Invalid(format!(
            "a leaf cannot be named {name}: that is the hub's own JetStream domain"
        )));
    }
    if name.as_str().contains(['.', '*', '>', ' ']) {
        return Err(AccessError::Invalid(format!(
            "leaf name {name} is not a valid JetStream domain (no dots, wildcards or spaces)"
        )));
    }
    Ok(())
}

/// What `engram leaf add` hands to the laptop: the leaf's key and everything its
/// `engram up --leaf` must agree on with the hub. The seed is the secret; the rest is
/// informational to the hub, which enforces its own copy (the registry).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeafCredentials {
    pub leaf: Ident,
    pub tenant: Ident,
    /// The hub's JetStream domain.
    pub hub_domain: String,
    /// The hub's events stream, which the leaf's inbox sources.
    pub events_stream: String,
    /// The hub's events stream's partition count: the leaf's own stream takes the same, so
    /// that an event's partition is the same on both sides.
    pub partitions: u32,
    /// The hub's working-memory bucket, whose entries of the readable scopes come down to
    /// the leaf's bucket of the same name.
    #[serde(default = "default_working_bucket")]
    pub working_bucket: String,
    pub writes: Vec<ScopePattern>,
    pub reads: Vec<ScopePattern>,
    /// The nkey seed (`SU…`).
    pub seed: String,
}

impl std::fmt::Debug for LeafCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafCredentials")
            .field("leaf", &self.leaf)
            .field("tenant", &self.tenant)
            .field("hub_domain", &self.hub_domain)
            .finish_non_exhaustive()
    }
}

impl LeafCredentials {
    /// A new key for `spec`'s leaf.
    pub fn generate(spec: &LeafSpec, names: &Names, partitions: u32) -> Self {
        Self {
            leaf: spec.name.clone(),
            tenant: spec.tenant.clone(),
            hub_domain: names.js_domain.clone(),
            events_stream: names.events_stream.clone(),
            partitions,
            working_bucket: names.working_bucket.clone(),
            writes: spec.writes.clone(),
            reads: spec.reads.clone(),
            seed: crate::creds::new_seed(),
        }
    }

    pub fn public_key(&self) -> String {
        nkeys::KeyPair::from_seed(&self.seed)
            .map(|k| k.public_key())
            .unwrap_or_default()
    }

    pub fn spec(&self) -> LeafSpec {
        LeafSpec {
            name: self.leaf.clone(),
            tenant: self.tenant.clone(),
            writes: self.writes.clone(),
            reads: self.reads.clone(),
        }
    }

    pub fn save(&self, path: &std::path::Path) -> Result<(), AccessError> {
        let body = toml::to_string(self).map_err(|e| AccessError::File {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let text = format!(
            "# Engram leaf credentials: leaf {} of tenant {} (public key {}).\n# Run `engram up --leaf <hub leafnode url> --creds <this file>` on the leaf's machine.\n# Whoever holds this file can sync the tenant's scopes below: keep it secret.\n{body}",
            self.leaf,
            self.tenant,
            self.public_key()
        );
        crate::creds::save_private(path, &text)
    }

    /// Reads and checks a leaf credentials file (mode 0600, a user seed, a valid domain).
    pub fn load(path: &std::path::Path) -> Result<Self, AccessError> {
        let text = crate::creds::read_private(path)?;
        let bad = |reason: String| AccessError::BadCredentials {
            path: path.display().to_string(),
            reason,
        };
        let creds: Self = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let key = nkeys::KeyPair::from_seed(&creds.seed)
            .map_err(|e| bad(format!("the seed is not an nkey seed: {e}")))?;
        if !key.public_key().starts_with('U') {
            return Err(bad("the seed is not a user nkey seed (SU…)".into()));
        }
        check_name(&creds.leaf, &creds.hub_domain).map_err(|e| bad(e.to_string()))?;
        if creds.partitions == 0 || creds.partitions > engram_schema::MAX_PARTITIONS {
            return Err(bad(format!(
                "partitions is {}, not 1..={}",
                creds.partitions,
                engram_schema::MAX_PARTITIONS
            )));
        }
        if creds.writes.is_empty() && creds.reads.is_empty() {
            return Err(bad("it names no scope to sync".into()));
        }
        Ok(creds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Ident {
        Ident::parse("id", s).unwrap()
    }

    #[test]
    fn outbox_subjects_map_back_to_the_hubs_stored_subjects() {
        let p: ScopePattern = "task:*".parse().unwrap();
        let (src, dest) = up_transform(&id("acme"), &p);
        assert_eq!(src, "engram.out.acme.task.*.*.*");
        assert_eq!(
            dest,
            "engram.evt.acme.task.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}"
        );
        let exact: ScopePattern = "agent:bob".parse().unwrap();
        assert_eq!(
            up_transform(&id("acme"), &exact).1,
            "engram.evt.acme.agent.bob.{{wildcard(1)}}.{{wildcard(2)}}"
        );
        assert_eq!(
            outbox_subject("engram.evt.acme.task.t1.episodic.3").unwrap(),
            "engram.out.acme.task.t1.episodic.3"
        );
        assert_eq!(outbox_subject("engram.evt.acme.task.t1.episodic"), None);
        assert_eq!(
            publish_subject("engram.evt.acme.task.t1.episodic.3").unwrap(),
            "engram.evt.acme.task.t1.episodic"
        );
        assert_eq!(publish_subject("engram.evt.acme.task.*.episodic.3"), None);
    }

    #[test]
    fn a_pattern_a_wider_one_covers_is_dropped() {
        let ps = ["task:x", "task:*", "agent:a", "agent:a"]
            .iter()
            .map(|p| p.parse().unwrap())
            .collect();
        let got: Vec<String> = normalize(ps).iter().map(|p| p.to_string()).collect();
        assert_eq!(got, ["agent:a", "task:*"]);
    }

    #[test]
    fn a_leaf_may_create_consumers_only_on_its_readable_scopes() {
        let leaf = LeafSpec {
            name: id("laptop"),
            tenant: id("acme"),
            writes: vec!["task:*".parse().unwrap()],
            reads: vec!["task:*".parse().unwrap(), "team:core".parse().unwrap()],
        };
        let perms = permissions(&leaf, &Names::default());
        let text = serde_json::to_string(&perms).unwrap();
        assert!(
            text.contains("$JS.hub.API.CONSUMER.CREATE.ENGRAM_EVENTS.*.engram.evt.acme.task.*.*.*")
        );
        assert!(
            text.contains(
                "$JS.hub.API.CONSUMER.CREATE.ENGRAM_EVENTS.*.engram.evt.acme.team.core.*.*"
            )
        );
        // No event, query, inbox or other tenant's subject, and no wildcard API right.
        for forbidden in [
            "engram.evt.>",
            "engram.q",
            "_INBOX",
            "$JS.hub.API.>",
            "beta",
        ] {
            assert!(
                !perms.publish.allow.iter().any(|s| s.starts_with(forbidden)),
                "{forbidden} in {text}"
            );
            assert!(
                !perms
                    .subscribe
                    .allow
                    .iter()
                    .any(|s| s.starts_with(forbidden)),
                "{forbidden} in {text}"
            );
        }
    }
}

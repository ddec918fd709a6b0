//! Subject layout: events are published on `engram.evt.<tenant>.<scope_kind>.<scope_id>.<layer>`
//! and stored on the same subject with the partition appended,
//! `engram.evt.<tenant>.<scope_kind>.<scope_id>.<layer>.<partition>`.
//!
//! Every token is a validated [`Ident`] or a closed enum, so a subject can never contain a
//! wildcard or an extra separator. Filters use `*` only for tokens the caller left open,
//! which makes scope matching exact token by token: `team-a` never matches `team-ab`.
//!
//! # Partitions
//! The events stream is split into a fixed number of partitions by tenant and scope: the
//! stream's subject transform ([`stream_transform`]) has nats-server append
//! `partition(N, tenant, scope_kind, scope_id)` to every subject it stores. A scope's events
//! are therefore all in one partition, in stream order, and a partition's events are read by
//! filtering on the last token ([`partition_filter`]). The server computes the partition, so a
//! client cannot choose one: the stream captures only the four-token publish subjects. The
//! same function is [`partition_of`] here, for routing a query to the partition's owner, and
//! for the query routing mapping, which hashes the same three tokens.
//!
//! The count is fixed when the stream is provisioned; changing it re-hashes every scope, which
//! is a migration of the stream, never a silent change.

use std::fmt;

use crate::envelope::{Envelope, Layer, ScopeKind};
use crate::ident::Ident;

/// First two tokens of every event subject.
pub const SUBJECT_PREFIX: &str = "engram.evt";
/// What the events stream captures: exactly the four tokens of [`subject_for`]. A `>` would
/// also store (and feed every projector) `engram.evt.x` or `engram.evt.a.b.c.d.e.f.g`,
/// subjects no valid event is ever published on.
pub const STREAM_SUBJECTS: &str = "engram.evt.*.*.*.*";

/// What the events stream stores: the publish subjects with their partition appended. A
/// durable reader of every partition filters on this.
pub const STORED_SUBJECTS: &str = "engram.evt.*.*.*.*.*";

/// Partitions a new events stream is provisioned with.
pub const DEFAULT_PARTITIONS: u32 = 16;

/// The most partitions a stream may have: each is a durable consumer per read model on the
/// node that owns it, so thousands would cost more than they spread.
pub const MAX_PARTITIONS: u32 = 1024;

/// The partition of a tenant's scope among `partitions`: FNV-1a (32 bits) of the three tokens
/// written one after the other without separator, modulo the count. This is nats-server's
/// `partition(N, …)` subject-transform function exactly, which stores the events, so that
/// whoever computes it here routes to where the server put them.
pub fn partition_of(tenant: &Ident, kind: ScopeKind, id: &Ident, partitions: u32) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let mut hash = OFFSET;
    for token in [tenant.as_str(), kind.as_str(), id.as_str()] {
        for byte in token.bytes() {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(PRIME);
        }
    }
    hash % partitions.max(1)
}

/// The partition `event` is stored in.
pub fn partition_of_event(event: &Envelope, partitions: u32) -> u32 {
    partition_of(&event.tenant, event.scope.kind, &event.scope.id, partitions)
}

/// The events stream's subject transform for `partitions`: (source, destination).
pub fn stream_transform(partitions: u32) -> (String, String) {
    (
        STREAM_SUBJECTS.to_owned(),
        format!(
            "{SUBJECT_PREFIX}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}.{{{{wildcard(4)}}}}.{{{{partition({partitions},1,2,3)}}}}"
        ),
    )
}

/// The partition count a stream's transform destination names, if it is one of
/// [`stream_transform`]'s.
pub fn transform_partitions(destination: &str) -> Option<u32> {
    let (_, rest) = destination.split_once("{{partition(")?;
    let (count, args) = rest.split_once(',')?;
    let count: u32 = count.trim().parse().ok()?;
    (args.replace(' ', "").starts_with("1,2,3)}}")
        && stream_transform(count).1 == destination.replace(' ', ""))
    .then_some(count)
}

/// The filter subject of partition `partition`'s events.
pub fn partition_filter(partition: u32) -> String {
    format!("{SUBJECT_PREFIX}.*.*.*.*.{partition}")
}

/// The subject `event` is stored on in a stream of `partitions`.
pub fn stored_subject_for(event: &Envelope, partitions: u32) -> String {
    format!(
        "{}.{}",
        subject_for(event),
        partition_of_event(event, partitions)
    )
}

/// The partition token of a stored subject, `None` for a publish subject or anything else.
pub fn subject_partition(subject: &str) -> Option<u32> {
    let rest = subject.strip_prefix(SUBJECT_PREFIX)?.strip_prefix('.')?;
    let mut tokens = rest.split('.');
    for _ in 0..4 {
        tokens.next()?;
    }
    let partition = tokens.next()?;
    if tokens.next().is_some()
        || partition.is_empty()
        || !partition.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    partition.parse().ok()
}

/// The subject an envelope is published on.
pub fn subject_for(event: &Envelope) -> String {
    format!(
        "{SUBJECT_PREFIX}.{}.{}.{}.{}",
        event.tenant, event.scope.kind, event.scope.id, event.layer
    )
}

/// Whether `subject` is exactly the one `event` belongs on: its publish subject
/// ([`subject_for`]), or that with a partition appended as the stream stores it. The stream
/// takes any bytes on any matching subject, so a reader must not trust a subject to say whose
/// an event is, nor an envelope to say where it was published: a message on
/// `engram.evt.attacker...` whose body names tenant `victim` is neither's. Which partition is
/// right is the stream's to say (it computes it), and [`partition_of_event`]'s to check.
pub fn subject_matches(event: &Envelope, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    let mut next_is = |want: &str| tokens.next() == Some(want);
    let prefix_ok = SUBJECT_PREFIX.split('.').all(&mut next_is);
    let ours = prefix_ok
        && next_is(event.tenant.as_str())
        && next_is(event.scope.kind.as_str())
        && next_is(event.scope.id.as_str())
        && next_is(event.layer.as_str());
    ours && match tokens.next() {
        None => true,
        Some(partition) => {
            tokens.next().is_none()
                && !partition.is_empty()
                && partition.bytes().all(|b| b.is_ascii_digit())
        }
    }
}

/// The tenant, scope and layer an event subject names ([`subject_for`]'s inverse, and
/// [`stored_subject_for`]'s), or `None` for anything else: a listing of the stream's subjects
/// reads scopes from this.
pub fn parse_subject(subject: &str) -> Option<(Ident, crate::Scope, Layer)> {
    let rest = subject.strip_prefix(SUBJECT_PREFIX)?.strip_prefix('.')?;
    let mut tokens = rest.split('.');
    let (Some(tenant), Some(kind), Some(id), Some(layer)) =
        (tokens.next(), tokens.next(), tokens.next(), tokens.next())
    else {
        return None;
    };
    if tokens.next().is_some() && subject_partition(subject).is_none() {
        return None;
    }
    let tenant = Ident::parse("tenant", tenant).ok()?;
    let scope = format!("{kind}:{id}").parse().ok()?;
    let layer = layer.parse().ok()?;
    Some((tenant, scope, layer))
}

/// Which events to replay or tail. `None` means any value for that token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SubjectFilter {
    pub tenant: Option<Ident>,
    pub scope_kind: Option<ScopeKind>,
    pub scope_id: Option<Ident>,
    pub layer: Option<Layer>,
    pub partition: Option<u32>,
}

impl SubjectFilter {
    pub fn all() -> Self {
        Self::default()
    }

    pub fn tenant(mut self, tenant: Ident) -> Self {
        self.tenant = Some(tenant);
        self
    }

    pub fn scope(mut self, kind: ScopeKind, id: Ident) -> Self {
        self.scope_kind = Some(kind);
        self.scope_id = Some(id);
        self
    }

    pub fn layer(mut self, layer: Layer) -> Self {
        self.layer = Some(layer);
        self
    }

    pub fn partition(mut self, partition: u32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// The NATS filter subject over stored subjects. With nothing set it is
    /// [`STORED_SUBJECTS`].
    pub fn to_subject(&self) -> String {
        if *self == Self::default() {
            return STORED_SUBJECTS.to_owned();
        }
        let tok = |t: Option<String>| t.unwrap_or_else(|| "*".to_owned());
        format!(
            "{SUBJECT_PREFIX}.{}.{}.{}.{}.{}",
            tok(self.tenant.as_ref().map(ToString::to_string)),
            tok(self.scope_kind.map(|k| k.to_string())),
            tok(self.scope_id.as_ref().map(ToString::to_string)),
            tok(self.layer.map(|l| l.to_string())),
            tok(self.partition.map(|p| p.to_string())),
        )
    }
}

impl fmt::Display for SubjectFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_subject())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Content, EventKind, Scope};

    fn id(s: &str) -> Ident {
        Ident::parse("id", s).unwrap()
    }

    #[test]
    fn a_subject_parses_back_to_its_tenant_scope_and_layer_and_nothing_else_parses() {
        let e = Envelope::new(
            id("acme"),
            Scope::new(ScopeKind::Team, "team-a").unwrap(),
            id("agent-1"),
            id("i-1"),
            Layer::Semantic,
            EventKind::FactAsserted,
            Content::text("x"),
        );
        let (tenant, scope, layer) = parse_subject(&subject_for(&e)).unwrap();
        assert_eq!((tenant, scope, layer), (e.tenant, e.scope, e.layer));
        for bad in [
            "engram.evt.acme.team.team-a",
            "engram.evt.acme.team.team-a.semantic.extra",
            "engram.evt.acme.galaxy.team-a.semantic",
            "engram.evt.acme.team.team-a.nonsense",
            "engram.evt.ac*me.team.team-a.semantic",
            "engram.dlq.vector",
            "engram.evtx.acme.team.team-a.semantic",
        ] {
            assert!(parse_subject(bad).is_none(), "{bad} parsed");
        }
    }

    #[test]
    fn subject_encodes_tenant_scope_and_layer() {
        let e = Envelope::new(
            id("acme"),
            Scope::new(ScopeKind::Team, "team-a").unwrap(),
            id("planner"),
            id("i-1"),
            Layer::Episodic,
            EventKind::Observation,
            Content::text("saw a thing"),
        );
        assert_eq!(subject_for(&e), "engram.evt.acme.team.team-a.episodic");
    }

    #[test]
    fn a_subject_matches_only_its_own_envelope() {
        let e = Envelope::new(
            id("victim"),
            Scope::new(ScopeKind::Task, "mine").unwrap(),
            id("planner"),
            id("i-1"),
            Layer::Episodic,
            EventKind::Observation,
            Content::text("x"),
        );
        assert!(subject_matches(&e, &subject_for(&e)));
        for other in [
            "engram.evt.attacker.task.mine.episodic",
            "engram.evt.victim.team.mine.episodic",
            "engram.evt.victim.task.other.episodic",
            "engram.evt.victim.task.mine.semantic",
            "engram.evt.victim.task.mine.episodic.extra",
            "engram.evt.victim.task.mine",
            "engram.dlq.victim.task.mine.episodic",
        ] {
            assert!(!subject_matches(&e, other), "{other} matched");
        }
    }

    #[test]
    fn filters_leave_open_tokens_as_single_token_wildcards() {
        // Filters are over stored subjects: the partition is a fifth token.
        assert_eq!(SubjectFilter::all().to_subject(), "engram.evt.*.*.*.*.*");
        assert_eq!(
            SubjectFilter::all().tenant(id("acme")).to_subject(),
            "engram.evt.acme.*.*.*.*"
        );
        assert_eq!(
            SubjectFilter::all()
                .tenant(id("acme"))
                .scope(ScopeKind::Team, id("team-a"))
                .to_subject(),
            "engram.evt.acme.team.team-a.*.*"
        );
        assert_eq!(
            SubjectFilter::all().partition(7).to_subject(),
            partition_filter(7)
        );
    }

    fn event(tenant: &str, kind: ScopeKind, scope: &str) -> Envelope {
        Envelope::new(
            id(tenant),
            Scope::new(kind, scope).unwrap(),
            id("agent-1"),
            id("i-1"),
            Layer::Episodic,
            EventKind::Observation,
            Content::text("x"),
        )
    }

    #[test]
    fn a_stored_subject_carries_the_partition_and_still_names_its_envelope() {
        let e = event("acme", ScopeKind::Task, "t1");
        let stored = stored_subject_for(&e, 16);
        let p = partition_of_event(&e, 16);
        assert_eq!(stored, format!("engram.evt.acme.task.t1.episodic.{p}"));
        assert_eq!(subject_partition(&stored), Some(p));
        assert_eq!(subject_partition(&subject_for(&e)), None);
        assert!(subject_matches(&e, &stored));
        assert_eq!(
            parse_subject(&stored).unwrap(),
            (e.tenant.clone(), e.scope.clone(), e.layer)
        );
        for bad in [
            "engram.evt.acme.task.t1.episodic.x",
            "engram.evt.acme.task.t1.episodic.",
            "engram.evt.acme.task.t1.episodic.1.2",
            "engram.evt.acme.task.t1.episodic.-1",
        ] {
            assert!(!subject_matches(&e, bad), "{bad} matched");
            assert!(parse_subject(bad).is_none(), "{bad} parsed");
            assert!(subject_partition(bad).is_none(), "{bad} has a partition");
        }
    }

    #[test]
    fn partitions_spread_scopes_and_depend_on_the_tenant_kind_and_id_only() {
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..200 {
            let scope = format!("t{i}");
            let p = partition_of(&id("acme"), ScopeKind::Task, &id(&scope), 16);
            assert!(p < 16);
            seen.insert(p);
            // The layer and the writer do not move a scope.
            let mut e = event("acme", ScopeKind::Task, &scope);
            assert_eq!(partition_of_event(&e, 16), p);
            e.layer = Layer::Semantic;
            e.agent_id = id("other");
            assert_eq!(partition_of_event(&e, 16), p);
        }
        assert_eq!(
            seen.len(),
            16,
            "200 scopes reach every one of 16 partitions"
        );
        // FNV-1a of "" is the offset basis: one partition is all there is of 1.
        assert_eq!(partition_of(&id("a"), ScopeKind::Task, &id("b"), 1), 0);
    }

    #[test]
    fn the_stream_transform_names_its_partition_count_and_nothing_else_does() {
        for n in [1, 16, 1024] {
            let (source, dest) = stream_transform(n);
            assert_eq!(source, STREAM_SUBJECTS);
            assert_eq!(
                dest,
                format!(
                    "engram.evt.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}.{{{{wildcard(4)}}}}.{{{{partition({n},1,2,3)}}}}"
                )
            );
            assert_eq!(transform_partitions(&dest), Some(n));
        }
        for other in [
            "engram.evt.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}.{{wildcard(4)}}.{{partition(16,1,2)}}",
            "engram.evt.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}.{{wildcard(4)}}",
            "foo.{{partition(16,1,2,3)}}",
        ] {
            assert_eq!(transform_partitions(other), None, "{other}");
        }
    }
}

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;
    use crate::envelope::{Content, EventKind, Scope};

    proptest! {
        /// Whatever string a client sends, it is either refused or becomes exactly one
        /// subject token: no escape, no extra token, no wildcard.
        #[test]
        fn any_accepted_identifier_is_exactly_one_safe_token(raw in "\\PC{0,80}", tenant in "[A-Za-z0-9_-]{1,64}") {
            let Ok(id) = Ident::parse("scope.id", raw.as_str()) else {
                prop_assert!(
                    raw.is_empty()
                        || raw.len() > crate::ident::MAX_IDENT_LEN
                        || raw.bytes().any(|b| !(b.is_ascii_alphanumeric() || b == b'_' || b == b'-'))
                );
                return Ok(());
            };
            prop_assert_eq!(id.as_str(), raw.as_str());
            let e = Envelope::new(
                Ident::parse("tenant", tenant.as_str()).unwrap(),
                Scope { kind: ScopeKind::Team, id: id.clone() },
                Ident::parse("agent", "a").unwrap(),
                Ident::parse("instance", "i").unwrap(),
                Layer::Episodic,
                EventKind::Observation,
                Content::text("x"),
            );
            let subject = subject_for(&e);
            let tokens: Vec<&str> = subject.split('.').collect();
            prop_assert_eq!(tokens.len(), 6);
            prop_assert_eq!(tokens[4], raw.as_str());
            prop_assert!(!tokens.iter().any(|t| t.is_empty() || *t == "*" || *t == ">"));
        }

        /// Filters never match a sibling whose id merely starts with the same characters.
        #[test]
        fn scope_filters_match_exact_tokens(a in "[a-z]{1,8}", suffix in "[a-z0-9-]{1,8}") {
            let id = |s: &str| Ident::parse("id", s).unwrap();
            let filter = SubjectFilter::all().tenant(id("t")).scope(ScopeKind::Team, id(&a)).to_subject();
            // As stored: with the partition token.
            let sibling = format!("engram.evt.t.team.{a}{suffix}.episodic.3");
            prop_assert!(!nats_subject_matches(&filter, &sibling));
            let own = format!("engram.evt.t.team.{a}.episodic.3");
            prop_assert!(nats_subject_matches(&filter, &own));
        }
    }

    /// NATS matching rules: `*` matches one token, `>` the rest; otherwise tokens are equal.
    fn nats_subject_matches(filter: &str, subject: &str) -> bool {
        let (f, s): (Vec<&str>, Vec<&str>) =
            (filter.split('.').collect(), subject.split('.').collect());
        for (i, ft) in f.iter().enumerate() {
            match *ft {
                ">" => return s.len() > i,
                "*" if i < s.len() => {}
                t if s.get(i) == Some(&t) => {}
                _ => return false,
            }
        }
        f.len() == s.len()
    }
}

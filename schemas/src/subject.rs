//! Subject layout: `engram.evt.<tenant>.<scope_kind>.<scope_id>.<layer>`.
//!
//! Every token is a validated [`Ident`] or a closed enum, so a subject can never contain a
//! wildcard or an extra separator. Filters use `*` only for tokens the caller left open,
//! which makes scope matching exact token by token: `team-a` never matches `team-ab`.

use std::fmt;

use crate::envelope::{Envelope, Layer, ScopeKind};
use crate::ident::Ident;

/// First two tokens of every event subject.
pub const SUBJECT_PREFIX: &str = "engram.evt";
/// What the events stream captures: exactly the four tokens of [`subject_for`]. A `>` would
/// also store (and feed every projector) `engram.evt.x` or `engram.evt.a.b.c.d.e.f.g`,
/// subjects no valid event is ever published on.
pub const STREAM_SUBJECTS: &str = "engram.evt.*.*.*.*";

/// The subject an envelope is published on.
pub fn subject_for(event: &Envelope) -> String {
    format!(
        "{SUBJECT_PREFIX}.{}.{}.{}.{}",
        event.tenant, event.scope.kind, event.scope.id, event.layer
    )
}

/// Whether `subject` is exactly the one `event` belongs on ([`subject_for`]). The stream
/// takes any bytes on any matching subject, so a reader must not trust a subject to say whose
/// an event is, nor an envelope to say where it was published: a message on
/// `engram.evt.attacker...` whose body names tenant `victim` is neither's.
pub fn subject_matches(event: &Envelope, subject: &str) -> bool {
    let mut tokens = subject.split('.');
    let mut next_is = |want: &str| tokens.next() == Some(want);
    let prefix_ok = SUBJECT_PREFIX.split('.').all(&mut next_is);
    prefix_ok
        && next_is(event.tenant.as_str())
        && next_is(event.scope.kind.as_str())
        && next_is(event.scope.id.as_str())
        && next_is(event.layer.as_str())
        && tokens.next().is_none()
}

/// The tenant, scope and layer an event subject names ([`subject_for`]'s inverse), or
/// `None` for anything else: a listing of the stream's subjects reads scopes from this.
pub fn parse_subject(subject: &str) -> Option<(Ident, crate::Scope, Layer)> {
    let rest = subject.strip_prefix(SUBJECT_PREFIX)?.strip_prefix('.')?;
    let mut tokens = rest.split('.');
    let (Some(tenant), Some(kind), Some(id), Some(layer), None) = (
        tokens.next(),
        tokens.next(),
        tokens.next(),
        tokens.next(),
        tokens.next(),
    ) else {
        return None;
    };
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

    /// The NATS filter subject. With nothing set it is [`STREAM_SUBJECTS`].
    pub fn to_subject(&self) -> String {
        if *self == Self::default() {
            return STREAM_SUBJECTS.to_owned();
        }
        let tok = |t: Option<String>| t.unwrap_or_else(|| "*".to_owned());
        format!(
            "{SUBJECT_PREFIX}.{}.{}.{}.{}",
            tok(self.tenant.as_ref().map(ToString::to_string)),
            tok(self.scope_kind.map(|k| k.to_string())),
            tok(self.scope_id.as_ref().map(ToString::to_string)),
            tok(self.layer.map(|l| l.to_string())),
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
        assert_eq!(SubjectFilter::all().to_subject(), "engram.evt.*.*.*.*");
        assert_eq!(
            SubjectFilter::all().tenant(id("acme")).to_subject(),
            "engram.evt.acme.*.*.*"
        );
        assert_eq!(
            SubjectFilter::all()
                .tenant(id("acme"))
                .scope(ScopeKind::Team, id("team-a"))
                .to_subject(),
            "engram.evt.acme.team.team-a.*"
        );
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
            let sibling = format!("engram.evt.t.team.{a}{suffix}.episodic");
            prop_assert!(!nats_subject_matches(&filter, &sibling));
            let own = format!("engram.evt.t.team.{a}.episodic");
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

//! Given/when/then helpers: events with chosen times, applied at increasing seqs.

#![allow(dead_code)]

use chrono::{DateTime, Utc};
use engram_memory::{ScopeKey, Seq};
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_skills::{Applied, SkillError, SkillRegistry};
use serde_json::{Value, json};

/// `2024-01-01` or a full RFC 3339 timestamp.
pub fn t(text: &str) -> DateTime<Utc> {
    let full = if text.len() == 10 {
        format!("{text}T00:00:00Z")
    } else {
        text.to_owned()
    };
    DateTime::parse_from_rfc3339(&full)
        .unwrap_or_else(|e| panic!("bad test time {text}: {e}"))
        .with_timezone(&Utc)
}

pub fn scope(tenant: &str, team: &str) -> ScopeKey {
    ScopeKey::new(
        Ident::parse("tenant", tenant).unwrap(),
        Scope::new(ScopeKind::Team, team).unwrap(),
    )
}

pub fn event(scope: &ScopeKey, kind: EventKind, data: Option<Value>, at: &str) -> Envelope {
    let mut event = Envelope::new(
        scope.tenant.clone(),
        scope.scope(),
        Ident::parse("agent_id", "agent-1").unwrap(),
        Ident::parse("instance_id", "inst-1").unwrap(),
        Layer::Procedural,
        kind,
        Content {
            text: "event".into(),
            data,
        },
    );
    event.occurred_at = t(at);
    event.recorded_at = t(at);
    event
}

pub fn recorded(scope: &ScopeKey, data: Value, at: &str) -> Envelope {
    event(scope, EventKind::SkillRecorded, Some(data), at)
}

/// A skill record with just a name and description.
pub fn skill(scope: &ScopeKey, name: &str, description: &str, at: &str) -> Envelope {
    recorded(scope, json!({"name": name, "description": description}), at)
}

pub fn outcome(scope: &ScopeKey, data: Value, at: &str) -> Envelope {
    event(scope, EventKind::Outcome, Some(data), at)
}

pub fn used(scope: &ScopeKey, name: &str, success: bool, at: &str) -> Envelope {
    outcome(scope, json!({"skill": name, "success": success}), at)
}

/// A registry fed at seqs 1, 2, 3, … like a projector reading the stream.
#[derive(Default)]
pub struct Stream {
    pub registry: SkillRegistry,
    pub seq: Seq,
}

impl Stream {
    pub fn apply(&mut self, event: &Envelope) -> Result<Applied, SkillError> {
        self.seq += 1;
        self.registry.apply(self.seq, event)
    }

    pub fn given(events: &[Envelope]) -> Self {
        let mut stream = Self::default();
        for event in events {
            stream.apply(event).expect("given events apply");
        }
        stream
    }
}

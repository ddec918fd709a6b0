//! Given/when/then helpers: events with chosen times, applied at increasing seqs.

#![allow(dead_code)]

use chrono::{DateTime, Utc};
use engram_facts::{Applied, Fact, FactError, FactTable};
use engram_memory::{ScopeKey, Seq};
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use serde_json::Value;

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

/// An event that occurred, and was recorded, at `at`.
pub fn event(scope: &ScopeKey, kind: EventKind, data: Value, at: &str) -> Envelope {
    let mut event = Envelope::new(
        scope.tenant.clone(),
        scope.scope(),
        Ident::parse("agent_id", "agent-1").unwrap(),
        Ident::parse("instance_id", "inst-1").unwrap(),
        Layer::Semantic,
        kind,
        Content {
            text: String::new(),
            data: Some(data),
        },
    );
    event.occurred_at = t(at);
    event.recorded_at = t(at);
    event
}

pub fn asserted(scope: &ScopeKey, data: Value, at: &str) -> Envelope {
    event(scope, EventKind::FactAsserted, data, at)
}

pub fn retracted(scope: &ScopeKey, data: Value, at: &str) -> Envelope {
    event(scope, EventKind::FactRetracted, data, at)
}

pub fn recorded(mut event: Envelope, at: &str) -> Envelope {
    event.recorded_at = t(at);
    event
}

/// A table fed at seqs 1, 2, 3, … like a projector reading the stream.
#[derive(Default)]
pub struct Stream {
    pub table: FactTable,
    pub seq: Seq,
}

impl Stream {
    pub fn apply(&mut self, event: &Envelope) -> Result<Applied, FactError> {
        self.seq += 1;
        self.table.apply(self.seq, event)
    }

    pub fn given(events: &[Envelope]) -> Self {
        let mut stream = Self::default();
        for event in events {
            stream.apply(event).expect("given events apply");
        }
        stream
    }
}

pub fn objects(facts: &[&Fact]) -> Vec<Value> {
    facts.iter().map(|fact| fact.object.clone()).collect()
}

//! Given/when/then helpers: fact events with chosen times, applied at increasing seqs. The
//! parts every scoped model shares are `engram_fixtures::models`'s.

#![allow(dead_code)]

use engram_facts::{Fact, FactTable};
pub use engram_fixtures::models::{scope, t};
use engram_memory::ScopeKey;
use engram_schema::{Envelope, EventKind, Layer};
use serde_json::Value;

/// A table fed at seqs 1, 2, 3, … like a projector reading the stream.
pub type Stream = engram_fixtures::models::Stream<FactTable>;

/// A semantic event that occurred, and was recorded, at `at`.
pub fn event(scope: &ScopeKey, kind: EventKind, data: Value, at: &str) -> Envelope {
    engram_fixtures::models::event(scope, Layer::Semantic, kind, Some(data), t(at))
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

pub fn objects(facts: &[&Fact]) -> Vec<Value> {
    facts.iter().map(|fact| fact.object.clone()).collect()
}

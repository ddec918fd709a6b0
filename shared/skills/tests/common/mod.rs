//! Given/when/then helpers: skill events with chosen times, applied at increasing seqs. The
//! parts every scoped model shares are `engram_fixtures::models`'s.

#![allow(dead_code)]

pub use engram_fixtures::models::{scope, t};
use engram_memory::ScopeKey;
use engram_schema::{Envelope, EventKind, Layer};
use engram_skills::SkillRegistry;
use serde_json::{Value, json};

/// A registry fed at seqs 1, 2, 3, … like a projector reading the stream.
pub type Stream = engram_fixtures::models::Stream<SkillRegistry>;

/// A procedural event that occurred, and was recorded, at `at`.
pub fn event(scope: &ScopeKey, kind: EventKind, data: Option<Value>, at: &str) -> Envelope {
    engram_fixtures::models::event(scope, Layer::Procedural, kind, data, t(at))
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

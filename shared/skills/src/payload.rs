//! Skill payloads, read through the contract's types ([`engram_schema::payload`]).
//!
//! Appends are checked against the same types, so a malformed payload only gets here by a raw
//! publish or from before the contract: it is a [`SkillError`], never a panic.

use engram_memory::Seq;
use engram_schema::payload::PayloadError;
use engram_schema::{Envelope, SkillOutcome, SkillRecorded};

use crate::SkillError;

/// What to send when an event has no payload object at all.
const HINT: &str =
    r#"send the skill there, for example {"name": "deploy-service", "description": "…"}"#;

/// A checked `skill_recorded` payload; the version is resolved later, against the registry.
pub(crate) fn recording(seq: Seq, event: &Envelope) -> Result<SkillRecorded, SkillError> {
    SkillRecorded::from_event(event).map_err(|e| refused(seq, event, e))
}

/// `Ok(None)` for an outcome that names no skill: it is about something else.
pub(crate) fn outcome(seq: Seq, event: &Envelope) -> Result<Option<SkillOutcome>, SkillError> {
    SkillOutcome::from_event(event).map_err(|e| refused(seq, event, e))
}

fn refused(seq: Seq, event: &Envelope, e: PayloadError) -> SkillError {
    SkillError::of(seq, event, e, HINT)
}

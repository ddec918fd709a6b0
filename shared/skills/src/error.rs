use engram_memory::Seq;
use engram_schema::{EventId, EventKind};
use thiserror::Error;

/// Why an event could not be applied. Every variant is permanent: the same event fails the
/// same way on every replay, so the projector dead-letters it and moves on. A failed apply
/// leaves the registry exactly as it was.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SkillError {
    #[error(
        "seq {seq}: {kind} event {event_id} has no JSON object in content.data; send the skill there, for example {{\"name\": \"deploy-service\", \"description\": \"…\"}}"
    )]
    MissingData {
        seq: Seq,
        event_id: EventId,
        kind: EventKind,
    },
    #[error("seq {seq}: {kind} event {event_id} has an invalid content.data.{field}: {reason}")]
    InvalidField {
        seq: Seq,
        event_id: EventId,
        kind: EventKind,
        field: &'static str,
        reason: String,
    },
}

impl SkillError {
    /// The payload field at fault, if the payload was an object at all.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::MissingData { .. } => None,
            Self::InvalidField { field, .. } => Some(field),
        }
    }

    /// The stream sequence of the event that failed.
    pub fn seq(&self) -> Seq {
        match self {
            Self::MissingData { seq, .. } | Self::InvalidField { seq, .. } => *seq,
        }
    }
}

use thiserror::Error;

/// Why an event, identifier or filter was refused. Every variant says what to change.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SchemaError {
    #[error(
        "invalid {field} {value:?}: {reason}; use 1-{max} characters from [A-Za-z0-9_-] (no '.', '*', '>' or whitespace)",
        max = crate::ident::MAX_IDENT_LEN
    )]
    InvalidIdent {
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("invalid event id {value:?}: expected a UUID (v7 preferred) or a ULID")]
    InvalidEventId { value: String },
    #[error(
        "unknown schema version {found}: this build reads versions 1..={supported}; upgrade engram to read newer events"
    )]
    UnknownSchemaVersion { found: u16, supported: u16 },
    #[error(
        "event is {size} bytes, over the limit of {max} bytes; shorten content or raise limits.max_event_bytes"
    )]
    TooLarge { size: usize, max: usize },
    #[error("invalid field {field}: {reason}")]
    InvalidField { field: &'static str, reason: String },
    /// A field holds more than it may once expanded (document changes that inflate past
    /// [`crate::payload::MAX_DOC_INFLATED_BYTES`]), though the event itself fits: a size
    /// refusal, answered like [`SchemaError::TooLarge`] where the caller tells them apart.
    #[error("oversized field {field}: {reason}")]
    PayloadTooLarge { field: &'static str, reason: String },
    #[error("malformed event: {0}")]
    Malformed(String),
}

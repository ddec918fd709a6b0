//! Fact payloads, read through the contract's types ([`engram_schema::payload`]), with their
//! defaults filled in against the event.
//!
//! Appends are checked against the same types, so a malformed payload only gets here by a raw
//! publish or from before the contract: it is a [`FactError`], never a panic.

use chrono::{DateTime, Utc};
use engram_memory::Seq;
use engram_schema::payload::PayloadError;
use engram_schema::{Cardinality, Envelope, FactAsserted, FactRetracted};
use serde_json::Value;

use crate::FactError;

/// What to send when an event has no payload object at all.
const HINT: &str = r#"send the fact there, for example {"subject": "alice", "predicate": "lives_in", "object": "paris"}"#;

/// A checked `fact_asserted` payload, with its defaults filled in.
pub(crate) struct Assertion {
    pub(crate) subject: String,
    pub(crate) predicate: String,
    pub(crate) object: Value,
    pub(crate) valid_from: DateTime<Utc>,
    pub(crate) valid_to: Option<DateTime<Utc>>,
    pub(crate) confidence: f64,
    pub(crate) cardinality: Cardinality,
}

pub(crate) fn assertion(seq: Seq, event: &Envelope) -> Result<Assertion, FactError> {
    let fact = FactAsserted::from_event(event).map_err(|e| refused(seq, event, e))?;
    Ok(Assertion {
        valid_from: fact.valid_from.unwrap_or(event.occurred_at),
        valid_to: fact.valid_to,
        confidence: fact.confidence(),
        cardinality: fact.cardinality(),
        subject: fact.subject,
        predicate: fact.predicate,
        object: fact.object,
    })
}

/// A checked `fact_retracted` payload; no object means every object.
pub(crate) fn retraction(seq: Seq, event: &Envelope) -> Result<FactRetracted, FactError> {
    FactRetracted::from_event(event).map_err(|e| refused(seq, event, e))
}

fn refused(seq: Seq, event: &Envelope, e: PayloadError) -> FactError {
    FactError::of(seq, event, e, HINT)
}

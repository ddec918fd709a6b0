//! Parsing and checking the `content.data` of fact events, before anything is changed.

use chrono::{DateTime, Utc};
use engram_memory::Seq;
use engram_schema::Envelope;
use serde_json::{Map, Value};

use crate::error::FactError;
use crate::fact::Cardinality;

/// Longest subject or predicate, in characters, after trimming.
pub const MAX_TERM_CHARS: usize = 256;

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

/// A checked `fact_retracted` payload; no object means every object.
pub(crate) struct Retraction {
    pub(crate) subject: String,
    pub(crate) predicate: String,
    pub(crate) object: Option<Value>,
}

/// Reads one event's payload and turns problems into [`FactError`]s naming the field.
struct Reader<'a> {
    seq: Seq,
    event: &'a Envelope,
    data: &'a Map<String, Value>,
}

impl<'a> Reader<'a> {
    fn new(seq: Seq, event: &'a Envelope) -> Result<Self, FactError> {
        match &event.content.data {
            Some(Value::Object(data)) => Ok(Self { seq, event, data }),
            _ => Err(FactError::MissingData {
                seq,
                event_id: event.event_id.clone(),
                kind: event.kind,
            }),
        }
    }

    fn invalid(&self, field: &'static str, reason: impl Into<String>) -> FactError {
        FactError::InvalidField {
            seq: self.seq,
            event_id: self.event.event_id.clone(),
            kind: self.event.kind,
            field,
            reason: reason.into(),
        }
    }

    /// An explicit `null` counts as absent, so clients may always send every key.
    fn optional(&self, field: &str) -> Option<&'a Value> {
        self.data.get(field).filter(|value| !value.is_null())
    }

    fn term(&self, field: &'static str) -> Result<String, FactError> {
        let value = self
            .optional(field)
            .ok_or_else(|| self.invalid(field, "it is missing; it must be a non-empty string"))?;
        let text = value
            .as_str()
            .ok_or_else(|| {
                self.invalid(
                    field,
                    format!("expected a string, found {}", kind_of(value)),
                )
            })?
            .trim();
        if text.is_empty() {
            return Err(self.invalid(field, "it is empty after trimming whitespace"));
        }
        let chars = text.chars().count();
        if chars > MAX_TERM_CHARS {
            return Err(self.invalid(
                field,
                format!("it has {chars} characters, at most {MAX_TERM_CHARS} are allowed"),
            ));
        }
        Ok(text.to_owned())
    }

    fn time(&self, field: &'static str) -> Result<Option<DateTime<Utc>>, FactError> {
        let Some(value) = self.optional(field) else {
            return Ok(None);
        };
        let text = value.as_str().ok_or_else(|| {
            self.invalid(
                field,
                format!(
                    "expected an RFC 3339 timestamp string, found {}",
                    kind_of(value)
                ),
            )
        })?;
        DateTime::parse_from_rfc3339(text)
            .map(|t| Some(t.with_timezone(&Utc)))
            .map_err(|e| {
                self.invalid(
                    field,
                    format!("{text:?} is not an RFC 3339 timestamp ({e}); use for example 2026-03-01T12:00:00Z"),
                )
            })
    }
}

pub(crate) fn assertion(seq: Seq, event: &Envelope) -> Result<Assertion, FactError> {
    let reader = Reader::new(seq, event)?;
    let subject = reader.term("subject")?;
    let predicate = reader.term("predicate")?;
    let object = reader.optional("object").cloned().ok_or_else(|| {
        reader.invalid(
            "object",
            "it is missing or null; to withdraw a fact, send fact_retracted",
        )
    })?;
    let valid_from = reader.time("valid_from")?.unwrap_or(event.occurred_at);
    let valid_to = reader.time("valid_to")?;
    if let Some(valid_to) = valid_to
        && valid_to <= valid_from
    {
        return Err(reader.invalid(
            "valid_to",
            format!("{valid_to} is not after valid_from {valid_from}; validity is the half-open interval [valid_from, valid_to)"),
        ));
    }
    let confidence = match reader.optional("confidence") {
        None => 1.0,
        Some(value) => match value.as_f64() {
            Some(c) if (0.0..=1.0).contains(&c) => c,
            _ => {
                return Err(reader.invalid(
                    "confidence",
                    format!("{value} is not a number in 0.0..=1.0"),
                ));
            }
        },
    };
    let cardinality = match reader.optional("cardinality") {
        None => Cardinality::Single,
        Some(value) => match value.as_str() {
            Some("single") => Cardinality::Single,
            Some("multi") => Cardinality::Multi,
            _ => {
                return Err(reader.invalid(
                    "cardinality",
                    format!("{value} is neither \"single\" nor \"multi\""),
                ));
            }
        },
    };
    Ok(Assertion {
        subject,
        predicate,
        object,
        valid_from,
        valid_to,
        confidence,
        cardinality,
    })
}

pub(crate) fn retraction(seq: Seq, event: &Envelope) -> Result<Retraction, FactError> {
    let reader = Reader::new(seq, event)?;
    Ok(Retraction {
        subject: reader.term("subject")?,
        predicate: reader.term("predicate")?,
        object: reader.optional("object").cloned(),
    })
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

//! Identifiers that become NATS subject tokens.
//!
//! They are validated, never escaped: silently rewriting `team.a` to `team_a` would make two
//! distinct scopes collide, which is exactly the kind of leak scoping exists to prevent.

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::SchemaError;

/// Longest identifier accepted. Subjects carry three of them, so this bounds subject length.
pub const MAX_IDENT_LEN: usize = 64;

/// A subject-safe identifier: 1..=64 characters from `[A-Za-z0-9_-]`.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
#[schemars(extend("pattern" = "^[A-Za-z0-9_-]{1,64}$", "minLength" = 1, "maxLength" = 64))]
pub struct Ident(String);

impl Ident {
    /// Validates `value` as the identifier named `field` (the name appears in the error).
    pub fn parse(field: &'static str, value: impl Into<String>) -> Result<Self, SchemaError> {
        let value = value.into();
        let reason = if value.is_empty() {
            Some("it is empty")
        } else if value.len() > MAX_IDENT_LEN {
            Some("it is too long")
        } else if value.contains(['.', '*', '>']) {
            Some("it contains a NATS subject token character")
        } else if value.chars().any(char::is_whitespace) {
            Some("it contains whitespace")
        } else if !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            Some("it contains a character outside [A-Za-z0-9_-]")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(SchemaError::InvalidIdent {
                field,
                value,
                reason,
            }),
            None => Ok(Self(value)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Ident {
    type Error = SchemaError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse("identifier", value)
    }
}

impl From<Ident> for String {
    fn from(value: Ident) -> Self {
        value.0
    }
}

impl FromStr for Ident {
    type Err = SchemaError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse("identifier", s)
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Ident {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A client-chosen event id: a UUID (v7 preferred, for time order) or a ULID.
///
/// Qualified by its tenant (`<tenant>:<event id>`), it is the JetStream `Nats-Msg-Id`, which
/// is what makes a retried append idempotent,
/// so it is kept in canonical form: a UUID lowercase and hyphenated, a ULID uppercase.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(try_from = "String", into = "String")]
#[schemars(extend(
    "description" = "UUID (v7 preferred) in hyphenated form, or a 26-character ULID"
))]
pub struct EventId(String);

impl EventId {
    /// A fresh UUIDv7: unique and roughly time-ordered.
    pub fn new() -> Self {
        Self(uuid::Uuid::now_v7().to_string())
    }

    /// The id of an output derived from `parts` (a consolidation step's name and its
    /// inputs): the same parts give the same id on every replica and every run, so an
    /// output appended twice is stored once (the stream deduplicates by id) and is
    /// recognisable as already there. A UUIDv8 of the first 16 bytes of blake3.
    pub fn derived(parts: &[&str]) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"engram-derived-id/1");
        for part in parts {
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part.as_bytes());
        }
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
        Self(uuid::Uuid::new_v8(bytes).hyphenated().to_string())
    }

    pub fn parse(value: &str) -> Result<Self, SchemaError> {
        if let Ok(uuid) = uuid::Uuid::parse_str(value)
            && value.len() == 36
        {
            return Ok(Self(uuid.hyphenated().to_string()));
        }
        if value.len() == 26
            && let Ok(ulid) = ulid::Ulid::from_string(value)
        {
            return Ok(Self(ulid.to_string()));
        }
        Err(SchemaError::InvalidEventId {
            value: value.to_owned(),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl TryFrom<String> for EventId {
    type Error = SchemaError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<EventId> for String {
    fn from(value: EventId) -> Self {
        value.0
    }
}

impl FromStr for EventId {
    type Err = SchemaError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_subject_safe_identifiers() {
        for ok in ["a", "team-a", "Team_B-9", &"x".repeat(MAX_IDENT_LEN)] {
            assert!(Ident::parse("tenant", ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_wildcards_separators_whitespace_and_length() {
        for bad in [
            "",
            "a.b",
            "*",
            "team>",
            "a b",
            "tab\t",
            "ü",
            "a/b",
            &"x".repeat(MAX_IDENT_LEN + 1),
        ] {
            let err = Ident::parse("tenant", bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    SchemaError::InvalidIdent {
                        field: "tenant",
                        ..
                    }
                ),
                "{bad:?}"
            );
            assert!(err.to_string().contains("[A-Za-z0-9_-]"));
        }
    }

    #[test]
    fn event_ids_are_uuid_or_ulid_in_canonical_form() {
        let v7 = EventId::new();
        assert_eq!(EventId::parse(v7.as_str()).unwrap(), v7);
        let upper = v7.as_str().to_uppercase();
        assert_eq!(EventId::parse(&upper).unwrap(), v7);
        let ulid = "01ARZ3NDEKTSV4RRFFQ69G5FAV";
        assert_eq!(EventId::parse(&ulid.to_lowercase()).unwrap().as_str(), ulid);
        for bad in [
            "",
            "abc",
            "01ARZ3NDEKTSV4RRFFQ69G5FA*",
            "not-a-uuid-at-all-xxxxxxxxxxxxxxxxxx",
        ] {
            assert!(EventId::parse(bad).is_err(), "{bad}");
        }
    }
}

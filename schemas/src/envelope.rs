//! The v1 experience-event envelope.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::SchemaError;
use crate::ident::{EventId, Ident};
use crate::payload::{Forgotten, Payload};

/// One experience event, as appended by an agent instance.
///
/// Optional fields carry `#[serde(default)]` so that an event written by a newer minor
/// revision, with fields this build does not know, still decodes: unknown fields are skipped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Envelope {
    /// Client-chosen UUIDv7 or ULID; a retried append with the same id is stored once.
    pub event_id: EventId,
    /// Envelope version; readers refuse versions newer than they know.
    pub schema_version: u16,
    pub tenant: Ident,
    pub scope: Scope,
    pub agent_id: Ident,
    pub instance_id: Ident,
    pub layer: Layer,
    pub kind: EventKind,
    /// When the experience happened, by the agent's clock.
    pub occurred_at: DateTime<Utc>,
    /// When the client handed the event to Engram.
    pub recorded_at: DateTime<Utc>,
    /// 0.0 (trivia) to 1.0 (must not forget); consolidation decays by it.
    #[serde(default = "default_importance")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub importance: f64,
    #[serde(default)]
    pub tags: Vec<String>,
    pub content: Content,
    /// A vector the client computed itself, with the model that made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Embedding>,
    /// The event that caused this one (for example the action an outcome reports on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<EventId>,
    /// Groups the events of one logical operation across instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
}

fn default_importance() -> f64 {
    0.5
}

/// Who shares a memory: the scope's kind plus its id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct Scope {
    pub kind: ScopeKind,
    pub id: Ident,
}

impl Scope {
    pub fn new(kind: ScopeKind, id: &str) -> Result<Self, SchemaError> {
        Ok(Self {
            kind,
            id: Ident::parse("scope.id", id)?,
        })
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.id)
    }
}

impl FromStr for Scope {
    type Err = SchemaError;
    /// Parses `kind:id`, for example `task:refactor-42`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, id) = s.split_once(':').ok_or_else(|| SchemaError::InvalidField {
            field: "scope",
            reason: format!("{s:?} is not of the form kind:id, for example task:build-42"),
        })?;
        Scope::new(kind.parse()?, id)
    }
}

/// Text plus an optional structured payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Content {
    #[serde(default)]
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

impl Content {
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            data: None,
        }
    }
}

/// A client-supplied embedding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Embedding {
    /// The model that produced the vector; vectors of different models are never compared.
    pub model: String,
    pub vector: Vec<f32>,
}

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident, $what:literal { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = SchemaError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(SchemaError::InvalidField {
                        field: $what,
                        reason: format!(
                            "unknown value {s:?}; expected one of: {}",
                            [$($text),+].join(", ")
                        ),
                    }),
                }
            }
        }
    };
}

string_enum!(
    /// Who shares a memory, from widest to narrowest.
    ScopeKind, "scope.kind" {
        Org => "org",
        Team => "team",
        User => "user",
        Agent => "agent",
        Task => "task",
        Session => "session",
    }
);

string_enum!(
    /// The memory layer an event feeds.
    Layer, "layer" {
        Working => "working",
        Episodic => "episodic",
        Semantic => "semantic",
        Procedural => "procedural",
    }
);

string_enum!(
    /// What happened, in the past tense of the event-sourcing convention.
    EventKind, "kind" {
        Observation => "observation",
        Action => "action",
        Outcome => "outcome",
        FactAsserted => "fact_asserted",
        FactRetracted => "fact_retracted",
        SkillRecorded => "skill_recorded",
        Preference => "preference",
        Feedback => "feedback",
        Checkpoint => "checkpoint",
        Forgotten => "forgotten",
        DocChanged => "doc_changed",
        Consolidated => "consolidated",
    }
);

impl Envelope {
    /// A `forgotten` event: withdraws the memories recorded by `event_ids` from every read
    /// model. Only memories of this event's own tenant and scope are withdrawn; ids of other
    /// scopes, or not (yet) in the stream, are ignored. `reason` is kept as the text.
    #[allow(clippy::too_many_arguments)]
    pub fn forget(
        tenant: Ident,
        scope: Scope,
        agent_id: Ident,
        instance_id: Ident,
        layer: Layer,
        event_ids: &[EventId],
        reason: impl Into<String>,
    ) -> Self {
        let ids: Vec<&str> = event_ids.iter().map(EventId::as_str).collect();
        let content = Content {
            text: reason.into(),
            data: Some(serde_json::json!({ "event_ids": ids })),
        };
        Self::new(
            tenant,
            scope,
            agent_id,
            instance_id,
            layer,
            EventKind::Forgotten,
            content,
        )
    }

    /// The event ids a `forgotten` event withdraws: `content.data.event_ids`, 1 to
    /// [`MAX_FORGOTTEN`](crate::payload::MAX_FORGOTTEN) valid event ids. An error for any
    /// other kind.
    pub fn forgotten_ids(&self) -> Result<Vec<EventId>, SchemaError> {
        if self.kind != EventKind::Forgotten {
            return Err(SchemaError::InvalidField {
                field: "content.data.event_ids",
                reason: format!("a {} event forgets nothing", self.kind),
            });
        }
        Ok(Forgotten::from_event(self)?.event_ids)
    }

    /// A new v1 event with a fresh id, stamped now, importance 0.5 and no tags.
    pub fn new(
        tenant: Ident,
        scope: Scope,
        agent_id: Ident,
        instance_id: Ident,
        layer: Layer,
        kind: EventKind,
        content: Content,
    ) -> Self {
        let now = Utc::now();
        Self {
            event_id: EventId::new(),
            schema_version: crate::SCHEMA_VERSION,
            tenant,
            scope,
            agent_id,
            instance_id,
            layer,
            kind,
            occurred_at: now,
            recorded_at: now,
            importance: default_importance(),
            tags: Vec::new(),
            content,
            embedding: None,
            causation_id: None,
            correlation_id: None,
        }
    }

    /// Everything an append must satisfy: the envelope ([`Envelope::validate_envelope`]) and
    /// the typed payload of the kinds that carry one ([`Payload::of`]). Every append path
    /// (SDK, CLI, bus) runs it before publishing.
    pub fn validate(&self) -> Result<(), SchemaError> {
        self.validate_envelope()?;
        // The typed payloads first, whose refusals name the field within the data.
        Payload::of(self)?;
        // Then any kind's data: decoding refuses an event nested deeper than
        // `codec::MAX_NESTING`, and an event acknowledged here must decode.
        if let Some(data) = &self.content.data {
            crate::payload::within_depth("content.data", data, crate::payload::MAX_DATA_DEPTH)?;
        }
        Ok(())
    }

    /// Checks what serde cannot: ranges, tag shape, vector sanity and the version; not the
    /// payload. Decoding runs only this, so that an event stored before the payload contract
    /// (or published raw) still reaches every reader; the read model that interprets a
    /// payload refuses a bad one itself. Identifiers are already valid by construction
    /// ([`Ident`] refuses bad input).
    pub fn validate_envelope(&self) -> Result<(), SchemaError> {
        if self.schema_version == 0 || self.schema_version > crate::SCHEMA_VERSION {
            return Err(SchemaError::UnknownSchemaVersion {
                found: self.schema_version,
                supported: crate::SCHEMA_VERSION,
            });
        }
        if !(0.0..=1.0).contains(&self.importance) {
            return Err(SchemaError::InvalidField {
                field: "importance",
                reason: format!("{} is outside 0.0..=1.0", self.importance),
            });
        }
        if self.tags.len() > MAX_TAGS {
            return Err(SchemaError::InvalidField {
                field: "tags",
                reason: format!("{} tags, at most {MAX_TAGS} allowed", self.tags.len()),
            });
        }
        if let Some(tag) = self
            .tags
            .iter()
            .find(|t| t.is_empty() || t.len() > MAX_TAG_LEN || t.chars().any(char::is_control))
        {
            return Err(SchemaError::InvalidField {
                field: "tags",
                reason: format!(
                    "tag {tag:?} must be 1-{MAX_TAG_LEN} bytes without control characters"
                ),
            });
        }
        if self.content.text.trim().is_empty() && self.content.data.is_none() {
            return Err(SchemaError::InvalidField {
                field: "content",
                reason: "an event needs content.text or content.data".into(),
            });
        }
        if let Some(embedding) = &self.embedding {
            if embedding.model.trim().is_empty() {
                return Err(SchemaError::InvalidField {
                    field: "embedding.model",
                    reason: "name the model that produced the vector".into(),
                });
            }
            if embedding.vector.is_empty() || embedding.vector.len() > MAX_EMBEDDING_DIMS {
                return Err(SchemaError::InvalidField {
                    field: "embedding.vector",
                    reason: format!(
                        "{} dimensions, expected 1..={MAX_EMBEDDING_DIMS}",
                        embedding.vector.len()
                    ),
                });
            }
            if embedding.vector.iter().any(|x| !x.is_finite()) {
                return Err(SchemaError::InvalidField {
                    field: "embedding.vector",
                    reason: "contains NaN or infinity".into(),
                });
            }
        }
        Ok(())
    }
}

pub const MAX_TAGS: usize = 64;
pub const MAX_TAG_LEN: usize = 128;
pub const MAX_EMBEDDING_DIMS: usize = 8192;

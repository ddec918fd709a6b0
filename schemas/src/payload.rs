//! The structured payloads (`content.data`) that read models interpret, and their checks.
//!
//! Nine kinds carry a typed payload: `fact_asserted`, `fact_retracted`, `skill_recorded`,
//! `outcome` (when it names a skill), `forgotten`, `doc_changed`, `consolidated`,
//! `feedback` (when it reports use or retrieval) and `checkpoint` (when it names a session:
//! [`crate::session`]). An outcome or feedback may also name the memories it contradicts,
//! and a feedback a faulty instance ([`Contradicts`], [`FaultyInstance`]), beside its own
//! payload. Each type here is the wire shape (serde and JSON Schema); its `from_event` is
//! the check. [`Envelope::validate`] runs that check on
//! every append, so a payload a read model could not apply is refused before anything is
//! published. The read models run it again on what they read: an event can still reach the
//! stream by a raw publish, or from before this contract existed, and they must reject it
//! (dead letter), never panic. Decoding does not run it, so such an event still reaches the
//! read models that only want its text.
//!
//! Rules shared by every payload:
//! - An explicit `null` counts as an absent field, so a client may always send every key.
//! - Unknown fields are ignored, so a newer client can add some.
//! - Names (subject, predicate, skill name) are trimmed, then must be 1 to 256 characters;
//!   case matters. Limits count characters, not bytes.
//! - Free JSON values (a fact's `object`) are nested at most [`MAX_OBJECT_DEPTH`] deep.
//!
//! A refusal is a [`PayloadError`] naming the field, `content.data.<name>`, or
//! `content.data` itself when the payload is not a JSON object.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use serde_path_to_error::Segment;
use thiserror::Error;

use crate::envelope::{Envelope, EventKind};
use crate::error::SchemaError;
use crate::ident::EventId;

/// Longest fact subject or predicate, in characters, after trimming.
pub const MAX_TERM_CHARS: usize = 256;
/// Longest skill name, in characters, after trimming.
pub const MAX_NAME_CHARS: usize = 256;
/// Longest skill description, and longest single step or precondition, in characters.
pub const MAX_TEXT_CHARS: usize = 4096;
/// Longest skill script, in characters.
pub const MAX_SCRIPT_CHARS: usize = 65_536;
/// Most steps, and most preconditions, one skill record may list.
pub const MAX_LIST_ITEMS: usize = 256;
/// Deepest nesting of a free JSON value: a scalar is 0 deep, `[1]` is 1, `{"a": [1]}` is 2.
/// Read models walk these values recursively (equality, hashing, snapshots); the bound keeps
/// a hostile value from exhausting their stack.
pub const MAX_OBJECT_DEPTH: usize = 32;
/// Deepest nesting of any event's `content.data`: one level more than a payload's free value,
/// which sits inside the payload object.
pub const MAX_DATA_DEPTH: usize = MAX_OBJECT_DEPTH + 1;
/// Most memories one `forgotten` event may withdraw.
pub const MAX_FORGOTTEN: usize = 1_000;
/// Most automerge changes one `doc_changed` event carries; more go in further events.
pub const MAX_DOC_CHANGES: usize = 1_024;
/// Most bytes the changes of one `doc_changed` event may take once inflated, all of them
/// together: the default event size limit. automerge compresses a large change (deflate), and
/// a few kilobytes of deflate can stand for gigabytes; every reader parses the changes under
/// this bound instead, reading no further than one byte past it. An uncompressed change
/// counts its own size.
pub const MAX_DOC_INFLATED_BYTES: usize = crate::codec::DEFAULT_MAX_EVENT_BYTES;
/// Most heads one `doc_changed` event names. A document has one head per concurrent branch
/// not yet merged; a writer past this many has not merged what it saw.
pub const MAX_DOC_HEADS: usize = 64;
/// Most memories one `feedback` event's `retrieved` counts; more go in further events.
pub const MAX_RETRIEVED: usize = 1_000;

/// Why a payload was refused. `field` is `content.data.<name>`, or `content.data` when the
/// payload is missing or not a JSON object; `reason` says what to send instead.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("{} {field}: {reason}", if *.too_large { "oversized field" } else { "invalid field" })]
pub struct PayloadError {
    pub field: &'static str,
    pub reason: String,
    /// Refused for its size (changes that inflate past [`MAX_DOC_INFLATED_BYTES`]), not its
    /// shape: it becomes [`SchemaError::PayloadTooLarge`].
    too_large: bool,
}

impl PayloadError {
    /// The payload field at fault (`subject`, `steps`, ...), or `None` when the payload as a
    /// whole is missing or not a JSON object.
    pub fn payload_field(&self) -> Option<&'static str> {
        self.field.strip_prefix("content.data.")
    }

    /// Whether the payload was refused for its size rather than its shape: sending the same
    /// content in smaller pieces would pass.
    pub fn is_too_large(&self) -> bool {
        self.too_large
    }

    pub(crate) fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
            too_large: false,
        }
    }
}

impl From<PayloadError> for SchemaError {
    fn from(e: PayloadError) -> Self {
        if e.too_large {
            return SchemaError::PayloadTooLarge {
                field: e.field,
                reason: e.reason,
            };
        }
        SchemaError::InvalidField {
            field: e.field,
            reason: e.reason,
        }
    }
}

/// Whether a subject has one value of a predicate at a time, or several.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Cardinality {
    /// A later assertion with another object ends the earlier ones (`lives_in`).
    #[default]
    Single,
    /// Assertions accumulate (`speaks`, `tag`).
    Multi,
}

/// `content.data` of `fact_asserted`: a subject's predicate has an object, over a valid time.
/// The bi-temporal semantics are in the docs of the `engram-facts` crate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FactAsserted {
    /// Who or what the fact is about. Trimmed, then 1-256 characters; case matters.
    #[schemars(length(min = 1, max = MAX_TERM_CHARS), regex(pattern = r"\S"))]
    pub subject: String,
    /// The property or relation. Trimmed, then 1-256 characters; case matters.
    #[schemars(length(min = 1, max = MAX_TERM_CHARS), regex(pattern = r"\S"))]
    pub predicate: String,
    /// The value: any JSON but null, nested at most 32 deep. Compared by JSON equality.
    #[schemars(extend("not" = {"type": "null"}))]
    pub object: Value,
    /// When it became true in the world (RFC 3339); default: the event's `occurred_at`.
    #[serde(
        default,
        deserialize_with = "rfc3339",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<DateTime<Utc>>")]
    pub valid_from: Option<DateTime<Utc>>,
    /// When it stopped being true (RFC 3339), after `valid_from`; default: open-ended.
    #[serde(
        default,
        deserialize_with = "rfc3339",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<DateTime<Utc>>")]
    pub valid_to: Option<DateTime<Utc>>,
    /// How sure the asserting agent is, 0-1; default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub confidence: Option<f64>,
    /// `single` (default): a later value of the predicate ends this one; `multi`: values
    /// accumulate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cardinality: Option<Cardinality>,
}

/// `content.data` of `fact_retracted`: "we were wrong" about a subject's predicate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FactRetracted {
    /// Trimmed, then 1-256 characters; case matters.
    #[schemars(length(min = 1, max = MAX_TERM_CHARS), regex(pattern = r"\S"))]
    pub subject: String,
    /// Trimmed, then 1-256 characters; case matters.
    #[schemars(length(min = 1, max = MAX_TERM_CHARS), regex(pattern = r"\S"))]
    pub predicate: String,
    /// Retract only this object (nested at most 32 deep); absent or null: every object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<Value>,
}

/// `content.data` of `skill_recorded`: a version of a skill, for the skill registry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SkillRecorded {
    /// Unique per scope. Trimmed, then 1-256 characters; case matters.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), regex(pattern = r"\S"))]
    pub name: String,
    /// What the skill does; search depends on it. Trimmed, then 1-4096 characters.
    #[schemars(length(min = 1, max = MAX_TEXT_CHARS), regex(pattern = r"\S"))]
    pub description: String,
    /// 1 or more; default: one above the highest version recorded under the name, or 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub version: Option<u32>,
    /// How to do it: at most 256 steps of at most 4096 characters each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_LIST_ITEMS), inner(length(max = MAX_TEXT_CHARS)))]
    pub steps: Option<Vec<String>>,
    /// A runnable form of it, at most 65536 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_SCRIPT_CHARS))]
    pub script: Option<String>,
    /// What must hold before using it: at most 256 of at most 4096 characters each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_LIST_ITEMS), inner(length(max = MAX_TEXT_CHARS)))]
    pub preconditions: Option<Vec<String>>,
    /// Outcomes of this way of working seen before it was recorded (the consolidator
    /// promotes recurring successful action sequences with theirs): the version starts with
    /// these counts instead of untried. At least one outcome; default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservedOutcomes>,
}

/// How often a skill worked before it was recorded, for `skill_recorded`'s `observed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ObservedOutcomes {
    /// Times it worked.
    pub successes: u32,
    /// Times it did not. Together with `successes`, at least 1.
    pub failures: u32,
}

/// `content.data` of an `outcome` that reports on a skill: it counts towards that skill's
/// success rate. An outcome whose data is not an object, or has no (or a null) `skill`, is
/// about something else: its data is free and unchecked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SkillOutcome {
    /// The skill used. Trimmed, then 1-256 characters.
    #[schemars(length(min = 1, max = MAX_NAME_CHARS), regex(pattern = r"\S"))]
    pub skill: String,
    /// Whether using it worked.
    pub success: bool,
    /// The version used, 1 or more; default: the latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub version: Option<u32>,
}

/// `content.data` of `forgotten`: the memories to withdraw (`content.text` is the reason).
/// Only memories of the event's own tenant and scope are withdrawn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Forgotten {
    /// 1-1000 event ids.
    #[schemars(length(min = 1, max = MAX_FORGOTTEN))]
    pub event_ids: Vec<EventId>,
}

/// `content.data` of `doc_changed`: automerge changes to one shared document of the event's
/// own tenant and scope (never of one named in the body). Change bytes are what automerge's
/// `Change::raw_bytes` gives, base64-encoded (standard alphabet, padded); each is parsed at
/// append, so every acknowledged event carries changes a reader can apply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DocChanged {
    /// The document's type: `task_board`, `profile`, `scratchpad`, or one of the user's own.
    pub doc_type: crate::Ident,
    /// The document's name within its scope and type.
    pub name: crate::Ident,
    /// 1-1024 base64-encoded automerge changes, in causal order.
    #[schemars(length(min = 1, max = MAX_DOC_CHANGES))]
    pub changes: Vec<String>,
    /// The writer's heads after these changes: hex change hashes, at most 64.
    #[serde(default)]
    #[schemars(length(max = MAX_DOC_HEADS))]
    pub heads: Vec<String>,
}

/// What a consolidation output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConsolidationOp {
    /// Near-duplicate memories merged into this one (the text is the representative's);
    /// the sources are superseded by a `forgotten` event caused by this one.
    Merged,
    /// A finished session or task distilled into this semantic memory.
    Summary,
    /// An archived memory brought back into default retrieval, as this copy of it.
    Restored,
}

/// `content.data` of `consolidated`: an output of the consolidator, with the memories it
/// was made from. Only memories of the event's own tenant and scope count as sources.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Consolidated {
    pub op: ConsolidationOp,
    /// 1-1000 event ids of the memories it was made from.
    #[schemars(length(min = 1, max = MAX_FORGOTTEN))]
    pub sources: Vec<EventId>,
    /// How many times the memory occurred (merged: the number of sources); default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub recurrences: Option<u32>,
}

/// `content.data` of a `feedback` event that reports use: the memories an agent used in a
/// step (it acted on them, quoted them, found them right). One event per step, not one per
/// memory. The consolidator reinforces them: their decay restarts and they gain importance.
/// Feedback without a `used` key is about something else: its data is free and unchecked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Used {
    /// 1-1000 event ids of memories of the event's own tenant and scope.
    #[schemars(length(min = 1, max = MAX_FORGOTTEN))]
    pub used: Vec<EventId>,
}

/// The `contradicts` key an `outcome` or `feedback` may carry (beside any other key of its
/// data): memories this outcome showed wrong. Each loses confidence in the vector and
/// keyword read models, so retrieval can leave it out (`filter.min_confidence`) and a
/// context leaves it out by default. Only memories of the event's own tenant and scope,
/// recorded before it, are affected; other ids are ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Contradicts {
    /// 1-1000 event ids of memories of the event's own tenant and scope. An id named twice
    /// counts once.
    #[schemars(length(min = 1, max = MAX_FORGOTTEN))]
    pub contradicts: Vec<EventId>,
}

/// The `faulty_instance` key a `feedback` may carry (beside any other key of its data): an
/// agent instance found faulty (hallucinating, compromised, misconfigured). Every memory it
/// wrote before this event, in the event's own tenant and scope, loses confidence; what it
/// writes afterwards does not (the report is about what it did, and instance ids are reused
/// after a restart). Scope-limited like `forgotten`: instance ids are the client's own names,
/// not unique across tenants or scopes, and a writer of one scope has no say over what
/// another reads, so a flag can never be turned against another scope's memories. To distrust
/// an instance in several scopes, send one flag in each.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FaultyInstance {
    /// The `instance_id` of the faulty instance, as its events carry it.
    pub faulty_instance: crate::Ident,
}

/// `content.data` of a `feedback` event that reports retrieval: how many times each memory
/// was returned by `retrieve` or `build_context` since the previous report. The query
/// service writes these, one per scope per `query.usage_interval`, never one per query.
/// Being returned is not evidence that a memory helped: the consolidator counts it but
/// reinforces only on `used`. A feedback event may carry `used`, `retrieved`, or both; each
/// is checked on its own. Feedback without either key is free and unchecked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Retrieved {
    /// 1-1000 event ids of memories of the event's own tenant and scope, each with the
    /// number of times it was returned (at least 1).
    #[schemars(extend(
        "minProperties" = 1,
        "maxProperties" = MAX_RETRIEVED,
        "additionalProperties" = {"type": "integer", "format": "uint32", "minimum": 1, "maximum": u32::MAX},
    ))]
    pub retrieved: BTreeMap<EventId, u32>,
}

/// A checked payload of any of the kinds that carry one.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    FactAsserted(FactAsserted),
    FactRetracted(FactRetracted),
    SkillRecorded(SkillRecorded),
    SkillOutcome(SkillOutcome),
    Forgotten(Forgotten),
    DocChanged(DocChanged),
    Consolidated(Consolidated),
    Used(Used),
    Retrieved(Retrieved),
    /// A feedback event that reports both use and retrieval.
    UsedAndRetrieved(Used, Retrieved),
    /// A `checkpoint` that names a session: one record of an `engram run` session.
    Session(crate::session::SessionRecord),
}

impl Payload {
    /// The checked payload of `event`, or `None` for a kind without one (and for an outcome
    /// that names no skill, or a checkpoint that names no session).
    ///
    /// The keys an outcome or feedback may carry beside its own payload, `contradicts` and
    /// (feedback) `faulty_instance`, are checked here too, each on its own; they are read with
    /// [`Contradicts::from_event`] and [`FaultyInstance::from_event`].
    pub fn of(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        Contradicts::from_event(event)?;
        FaultyInstance::from_event(event)?;
        Ok(Some(match event.kind {
            EventKind::FactAsserted => Self::FactAsserted(FactAsserted::from_event(event)?),
            EventKind::FactRetracted => Self::FactRetracted(FactRetracted::from_event(event)?),
            EventKind::SkillRecorded => Self::SkillRecorded(SkillRecorded::from_event(event)?),
            EventKind::Outcome => match SkillOutcome::from_event(event)? {
                Some(outcome) => Self::SkillOutcome(outcome),
                None => return Ok(None),
            },
            EventKind::Forgotten => Self::Forgotten(Forgotten::from_event(event)?),
            EventKind::DocChanged => Self::DocChanged(DocChanged::from_event(event)?.0),
            EventKind::Consolidated => Self::Consolidated(Consolidated::from_event(event)?),
            EventKind::Feedback => {
                match (Used::from_event(event)?, Retrieved::from_event(event)?) {
                    (Some(used), None) => Self::Used(used),
                    (None, Some(retrieved)) => Self::Retrieved(retrieved),
                    (Some(used), Some(retrieved)) => Self::UsedAndRetrieved(used, retrieved),
                    (None, None) => return Ok(None),
                }
            }
            EventKind::Checkpoint => match crate::session::SessionRecord::from_event(event)? {
                Some(record) => Self::Session(record),
                None => return Ok(None),
            },
            EventKind::Observation | EventKind::Action | EventKind::Preference => {
                return Ok(None);
            }
        }))
    }
}

/// One payload field: its key, its path in errors, and what a valid value looks like.
pub(crate) struct Field {
    pub(crate) name: &'static str,
    pub(crate) path: &'static str,
    pub(crate) required: bool,
    pub(crate) expected: &'static str,
}

macro_rules! fields {
    (@required) => { true };
    (@optional) => { false };
    ($($presence:ident $name:literal => $expected:literal;)+) => {
        &[$(Field {
            name: $name,
            path: concat!("content.data.", $name),
            required: fields!(@$presence),
            expected: $expected,
        }),+]
    };
}
pub(crate) use fields;

const FACT_ASSERTED_FIELDS: &[Field] = fields! {
    required "subject" => "a non-empty string";
    required "predicate" => "a non-empty string";
    required "object" => "any JSON value but null (to withdraw a fact, send fact_retracted)";
    optional "valid_from" => "an RFC 3339 timestamp such as 2026-03-01T12:00:00Z";
    optional "valid_to" => "an RFC 3339 timestamp such as 2026-03-01T12:00:00Z";
    optional "confidence" => "a number in 0.0..=1.0";
    optional "cardinality" => "\"single\" or \"multi\"";
};

const FACT_RETRACTED_FIELDS: &[Field] = fields! {
    required "subject" => "a non-empty string";
    required "predicate" => "a non-empty string";
    optional "object" => "the JSON value to retract, or nothing to retract every object";
};

const SKILL_RECORDED_FIELDS: &[Field] = fields! {
    required "name" => "a non-empty string";
    required "description" => "a non-empty string saying what the skill does";
    optional "version" => "a whole number of at least 1";
    optional "steps" => "an array of strings";
    optional "script" => "a string";
    optional "preconditions" => "an array of strings";
    optional "observed" => "an object such as {\"successes\": 3, \"failures\": 1} (whole numbers, at least one outcome)";
};

const SKILL_OUTCOME_FIELDS: &[Field] = fields! {
    required "skill" => "a non-empty string";
    required "success" => "true or false: an outcome naming a skill must say whether it worked";
    optional "version" => "a whole number of at least 1";
};

const FORGOTTEN_FIELDS: &[Field] = fields! {
    required "event_ids" => "an array of event ids (UUIDs or ULIDs)";
};

const USED_FIELDS: &[Field] = fields! {
    required "used" => "an array of event ids (UUIDs or ULIDs)";
};

const RETRIEVED_FIELDS: &[Field] = fields! {
    required "retrieved" => "an object of event ids (UUIDs or ULIDs) to counts of at least 1";
};

const CONSOLIDATED_FIELDS: &[Field] = fields! {
    required "op" => "\"merged\", \"summary\" or \"restored\"";
    required "sources" => "an array of event ids (UUIDs or ULIDs)";
    optional "recurrences" => "a whole number of at least 1";
};

const DOC_CHANGED_FIELDS: &[Field] = fields! {
    required "doc_type" => "an identifier such as task_board (1-64 of A-Z a-z 0-9 _ -)";
    required "name" => "an identifier (1-64 of A-Z a-z 0-9 _ -)";
    required "changes" => "an array of base64-encoded automerge changes";
    optional "heads" => "an array of hex change hashes";
};

impl FactAsserted {
    /// Checks `event.content.data` and returns it with subject and predicate trimmed. The
    /// validity check uses the event's `occurred_at` when `valid_from` is left out.
    pub fn from_event(event: &Envelope) -> Result<Self, PayloadError> {
        let example = r#"{"subject": "alice", "predicate": "lives_in", "object": "paris"}"#;
        let mut fact: Self = read(event, FACT_ASSERTED_FIELDS, example)?;
        fact.subject = term("content.data.subject", &fact.subject, MAX_TERM_CHARS)?;
        fact.predicate = term("content.data.predicate", &fact.predicate, MAX_TERM_CHARS)?;
        shallow("content.data.object", &fact.object)?;
        let valid_from = fact.valid_from.unwrap_or(event.occurred_at);
        if let Some(valid_to) = fact.valid_to
            && valid_to <= valid_from
        {
            return Err(PayloadError::new(
                "content.data.valid_to",
                format!(
                    "{valid_to} is not after valid_from {valid_from} (which defaults to occurred_at); validity is the half-open interval [valid_from, valid_to)"
                ),
            ));
        }
        if let Some(confidence) = fact.confidence
            && !(0.0..=1.0).contains(&confidence)
        {
            return Err(PayloadError::new(
                "content.data.confidence",
                format!("{confidence} is not a number in 0.0..=1.0"),
            ));
        }
        Ok(fact)
    }

    /// The asserted confidence, 1 when left out.
    pub fn confidence(&self) -> f64 {
        self.confidence.unwrap_or(1.0)
    }

    /// The asserted cardinality, single when left out.
    pub fn cardinality(&self) -> Cardinality {
        self.cardinality.unwrap_or_default()
    }
}

impl FactRetracted {
    /// Checks `event.content.data` and returns it with subject and predicate trimmed.
    pub fn from_event(event: &Envelope) -> Result<Self, PayloadError> {
        let example = r#"{"subject": "alice", "predicate": "lives_in"}"#;
        let mut retraction: Self = read(event, FACT_RETRACTED_FIELDS, example)?;
        retraction.subject = term("content.data.subject", &retraction.subject, MAX_TERM_CHARS)?;
        retraction.predicate = term(
            "content.data.predicate",
            &retraction.predicate,
            MAX_TERM_CHARS,
        )?;
        if let Some(object) = &retraction.object {
            shallow("content.data.object", object)?;
        }
        Ok(retraction)
    }
}

impl SkillRecorded {
    /// Checks `event.content.data` and returns it with name and description trimmed.
    pub fn from_event(event: &Envelope) -> Result<Self, PayloadError> {
        let example = r#"{"name": "deploy-service", "description": "roll out a service"}"#;
        let mut skill: Self = read(event, SKILL_RECORDED_FIELDS, example)?;
        skill.name = term("content.data.name", &skill.name, MAX_NAME_CHARS)?;
        skill.description = term(
            "content.data.description",
            &skill.description,
            MAX_TEXT_CHARS,
        )
        .map_err(|e| PayloadError {
            reason: format!(
                "{}; say what the skill does, search depends on it",
                e.reason
            ),
            ..e
        })?;
        at_least_one("content.data.version", skill.version)?;
        list("content.data.steps", skill.steps.as_deref())?;
        list("content.data.preconditions", skill.preconditions.as_deref())?;
        if let Some(script) = &skill.script {
            at_most("content.data.script", script, MAX_SCRIPT_CHARS)?;
        }
        if let Some(observed) = skill.observed
            && observed.successes == 0
            && observed.failures == 0
        {
            return Err(PayloadError::new(
                "content.data.observed",
                "it counts no outcome; leave it out when nothing was observed",
            ));
        }
        Ok(skill)
    }

    pub fn steps(&self) -> &[String] {
        self.steps.as_deref().unwrap_or_default()
    }

    pub fn preconditions(&self) -> &[String] {
        self.preconditions.as_deref().unwrap_or_default()
    }
}

impl SkillOutcome {
    /// Checks the `content.data` of an outcome: `None` when it names no skill (data absent,
    /// not an object, or without a non-null `skill`), else the report, its skill trimmed.
    pub fn from_event(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        let names_a_skill = matches!(
            &event.content.data,
            Some(Value::Object(data)) if data.get("skill").is_some_and(|s| !s.is_null())
        );
        if !names_a_skill {
            return Ok(None);
        }
        let example = r#"{"skill": "deploy-service", "success": true}"#;
        let mut outcome: Self = read(event, SKILL_OUTCOME_FIELDS, example)?;
        outcome.skill = term("content.data.skill", &outcome.skill, MAX_NAME_CHARS)?;
        at_least_one("content.data.version", outcome.version)?;
        Ok(Some(outcome))
    }
}

impl Forgotten {
    /// Checks `event.content.data`: 1 to [`MAX_FORGOTTEN`] valid event ids.
    pub fn from_event(event: &Envelope) -> Result<Self, PayloadError> {
        let example = r#"{"event_ids": ["0192f0c4-7a6e-7cc1-9a43-5a1bd3f2e0a1"]}"#;
        let forgotten: Self = read(event, FORGOTTEN_FIELDS, example)?;
        let count = forgotten.event_ids.len();
        if count == 0 || count > MAX_FORGOTTEN {
            return Err(PayloadError::new(
                "content.data.event_ids",
                format!("{count} ids; give 1..={MAX_FORGOTTEN} per event"),
            ));
        }
        Ok(forgotten)
    }
}

impl Used {
    /// Checks the `content.data` of a feedback event: `None` when it reports no use (data
    /// absent, not an object, or without a non-null `used`), else 1 to [`MAX_FORGOTTEN`]
    /// event ids.
    pub fn from_event(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        let reports_use = matches!(
            &event.content.data,
            Some(Value::Object(data)) if data.get("used").is_some_and(|u| !u.is_null())
        );
        if !reports_use {
            return Ok(None);
        }
        let example = r#"{"used": ["0192f0c4-7a6e-7cc1-9a43-5a1bd3f2e0a1"]}"#;
        let used: Self = read(event, USED_FIELDS, example)?;
        let count = used.used.len();
        if count == 0 || count > MAX_FORGOTTEN {
            return Err(PayloadError::new(
                "content.data.used",
                format!("{count} ids; give 1..={MAX_FORGOTTEN} per event"),
            ));
        }
        Ok(Some(used))
    }
}

impl Retrieved {
    /// Checks the `content.data` of a feedback event: `None` when it reports no retrieval
    /// (data absent, not an object, or without a non-null `retrieved`), else 1 to
    /// [`MAX_RETRIEVED`] event ids, each counted at least once.
    pub fn from_event(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        let reports_retrieval = matches!(
            &event.content.data,
            Some(Value::Object(data)) if data.get("retrieved").is_some_and(|r| !r.is_null())
        );
        if !reports_retrieval {
            return Ok(None);
        }
        let example = r#"{"retrieved": {"0192f0c4-7a6e-7cc1-9a43-5a1bd3f2e0a1": 3}}"#;
        let retrieved: Self = read(event, RETRIEVED_FIELDS, example)?;
        let count = retrieved.retrieved.len();
        if count == 0 || count > MAX_RETRIEVED {
            return Err(PayloadError::new(
                "content.data.retrieved",
                format!(
                    "{count} ids; give 1..={MAX_RETRIEVED} per event, the rest in further events"
                ),
            ));
        }
        if let Some((id, _)) = retrieved.retrieved.iter().find(|(_, n)| **n == 0) {
            return Err(PayloadError::new(
                "content.data.retrieved",
                format!("{id} is counted 0 times; leave out what was not returned"),
            ));
        }
        Ok(Some(retrieved))
    }
}

impl Consolidated {
    /// Checks `event.content.data`: an op, 1 to [`MAX_FORGOTTEN`] source ids, and a text to
    /// be the memory.
    pub fn from_event(event: &Envelope) -> Result<Self, PayloadError> {
        let example = r#"{"op": "merged", "sources": ["0192f0c4-7a6e-7cc1-9a43-5a1bd3f2e0a1"], "recurrences": 2}"#;
        let out: Self = read(event, CONSOLIDATED_FIELDS, example)?;
        let count = out.sources.len();
        if count == 0 || count > MAX_FORGOTTEN {
            return Err(PayloadError::new(
                "content.data.sources",
                format!("{count} sources; give 1..={MAX_FORGOTTEN}"),
            ));
        }
        at_least_one("content.data.recurrences", out.recurrences)?;
        if event.content.text.trim().is_empty() {
            return Err(PayloadError::new(
                "content.text",
                "a consolidated memory needs its text",
            ));
        }
        Ok(out)
    }

    /// How many times the memory occurred, 1 when left out.
    pub fn recurrences(&self) -> u32 {
        self.recurrences.unwrap_or(1)
    }
}

impl DocChanged {
    /// Checks `event.content.data` and returns it with its changes decoded and parsed: 1 to
    /// [`MAX_DOC_CHANGES`] base64 automerge changes, and at most [`MAX_DOC_HEADS`] heads of
    /// 64 hex digits.
    pub fn from_event(event: &Envelope) -> Result<(Self, Vec<automerge::Change>), PayloadError> {
        let example = r#"{"doc_type": "task_board", "name": "sprint", "changes": ["<base64>"]}"#;
        let doc: Self = read(event, DOC_CHANGED_FIELDS, example)?;
        let count = doc.changes.len();
        if count == 0 || count > MAX_DOC_CHANGES {
            return Err(PayloadError::new(
                "content.data.changes",
                format!(
                    "{count} changes; send 1..={MAX_DOC_CHANGES} per event, the rest in further events"
                ),
            ));
        }
        if doc.heads.len() > MAX_DOC_HEADS {
            return Err(PayloadError::new(
                "content.data.heads",
                format!("{} heads; at most {MAX_DOC_HEADS}", doc.heads.len()),
            ));
        }
        if let Some((i, head)) = doc.heads.iter().enumerate().find(|(_, h)| {
            h.len() != 64
                || !h
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        }) {
            return Err(PayloadError::new(
                "content.data.heads",
                format!("item {i}: {head:?} is not a change hash (64 lowercase hex digits)"),
            ));
        }
        // One budget for the whole event: each change takes what it inflates to, so no
        // number of small compressed changes adds up to more than one bound.
        let mut budget = MAX_DOC_INFLATED_BYTES;
        let changes = doc
            .changes
            .iter()
            .enumerate()
            .map(|(i, encoded)| {
                use base64::Engine as _;
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|e| {
                        PayloadError::new(
                            "content.data.changes",
                            format!("item {i}: not base64 ({e}); send standard, padded base64"),
                        )
                    })?;
                crate::chunk::parse_change(&bytes, &mut budget).map_err(|e| match e {
                    crate::chunk::ChunkError::OverBudget => PayloadError {
                        too_large: true,
                        ..PayloadError::new(
                            "content.data.changes",
                            format!(
                                "item {i}: the changes inflate to more than {MAX_DOC_INFLATED_BYTES} bytes, the most one event's changes may hold once decompressed; send fewer or smaller changes per event, the rest in further events"
                            ),
                        )
                    },
                    crate::chunk::ChunkError::Invalid(reason) => PayloadError::new(
                        "content.data.changes",
                        format!(
                            "item {i}: not an automerge change ({reason}); send Change::raw_bytes"
                        ),
                    ),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((doc, changes))
    }

    /// The strings `changes` write, as one text: each value put into a map or list on a line
    /// of its own, and text typed into a text object (one character per operation) joined
    /// back. What a reader searches for secrets in, the scrubber's and the tests' alike.
    pub fn written_text(changes: &[automerge::Change]) -> String {
        use automerge::ScalarValue;
        use automerge::legacy::OpType;
        let mut text = String::new();
        for change in changes {
            for op in change.decode().operations {
                if let OpType::Put(ScalarValue::Str(s)) = &op.action {
                    if op.insert && s.chars().count() == 1 {
                        text.push_str(s);
                    } else {
                        text.push('\n');
                        text.push_str(s);
                        text.push('\n');
                    }
                }
            }
            text.push('\n');
        }
        text
    }

    /// `event` with each compressed change of its data replaced by the uncompressed chunk
    /// it stands for (what `Change::raw_bytes` gives: the same change, of the same hash), or
    /// `None` when none was compressed. `changes` are the event's, as [`DocChanged::from_event`]
    /// returned them. A reader that has checked the changes hands this copy on, so that
    /// parsing them again inflates nothing.
    pub fn uncompressed(event: &Envelope, changes: &[automerge::Change]) -> Option<Envelope> {
        use base64::Engine as _;
        let encoded = event.content.data.as_ref()?.get("changes")?.as_array()?;
        if encoded.len() != changes.len() {
            return None;
        }
        let plain: Vec<String> = changes
            .iter()
            .map(|c| base64::engine::general_purpose::STANDARD.encode(c.raw_bytes()))
            .collect();
        if plain
            .iter()
            .zip(encoded)
            .all(|(p, e)| e.as_str() == Some(p.as_str()))
        {
            return None;
        }
        let mut copy = event.clone();
        let data = copy.content.data.as_mut()?.as_object_mut()?;
        data.insert(
            "changes".into(),
            Value::Array(plain.into_iter().map(Value::String).collect()),
        );
        Some(copy)
    }
}

const CONTRADICTS_FIELDS: &[Field] = fields! {
    required "contradicts" => "an array of event ids (UUIDs or ULIDs) of memories of this scope";
};

const FAULTY_INSTANCE_FIELDS: &[Field] = fields! {
    required "faulty_instance" => "the faulty instance's id (1-64 of A-Z a-z 0-9 _ -)";
};

/// Whether `event` is of one of `kinds` and its data is an object with a non-null `key`: an
/// optional key of those kinds, to be checked.
pub(crate) fn carries(event: &Envelope, kinds: &[EventKind], key: &str) -> bool {
    kinds.contains(&event.kind)
        && matches!(
            &event.content.data,
            Some(Value::Object(data)) if data.get(key).is_some_and(|v| !v.is_null())
        )
}

impl Contradicts {
    /// Checks the `contradicts` key of an outcome or feedback: `None` for other kinds, and
    /// when the data is absent, not an object or has no (or a null) `contradicts`; else 1 to
    /// [`MAX_FORGOTTEN`] event ids, each named once (in the order first named).
    pub fn from_event(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        if !carries(
            event,
            &[EventKind::Outcome, EventKind::Feedback],
            "contradicts",
        ) {
            return Ok(None);
        }
        let example = r#"{"contradicts": ["0192f0c4-7a6e-7cc1-9a43-5a1bd3f2e0a1"]}"#;
        let mut contradicts: Self = read(event, CONTRADICTS_FIELDS, example)?;
        let count = contradicts.contradicts.len();
        if count == 0 || count > MAX_FORGOTTEN {
            return Err(PayloadError::new(
                "content.data.contradicts",
                format!("{count} ids; give 1..={MAX_FORGOTTEN} per event"),
            ));
        }
        let mut seen = std::collections::HashSet::with_capacity(count);
        contradicts.contradicts.retain(|id| seen.insert(id.clone()));
        Ok(Some(contradicts))
    }
}

impl FaultyInstance {
    /// Checks the `faulty_instance` key of a feedback event: `None` for other kinds, and when
    /// the data is absent, not an object or has no (or a null) `faulty_instance`; else the
    /// instance id, an identifier.
    pub fn from_event(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        if !carries(event, &[EventKind::Feedback], "faulty_instance") {
            return Ok(None);
        }
        let example = r#"{"faulty_instance": "worker-7"}"#;
        read(event, FAULTY_INSTANCE_FIELDS, example).map(Some)
    }
}

/// Deserialises `event.content.data` as `T`, naming the field at fault. Required fields are
/// checked first, so that a missing one gets its own message instead of serde's.
pub(crate) fn read<T: DeserializeOwned>(
    event: &Envelope,
    fields: &[Field],
    example: &str,
) -> Result<T, PayloadError> {
    let (value, data) = match &event.content.data {
        Some(value @ Value::Object(data)) => (value, data),
        other => {
            let found = other.as_ref().map_or("nothing", kind_of);
            return Err(PayloadError::new(
                "content.data",
                format!(
                    "a {} event needs a JSON object here, found {found}; send for example {example}",
                    event.kind
                ),
            ));
        }
    };
    if let Some(missing) = fields
        .iter()
        .find(|f| f.required && data.get(f.name).is_none_or(Value::is_null))
    {
        return Err(PayloadError::new(
            missing.path,
            format!("it is missing or null; send {}", missing.expected),
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let mut segments = e.path().iter();
        let field = match segments.next() {
            Some(Segment::Map { key }) => fields.iter().find(|f| f.name == key),
            _ => None,
        };
        let item = match segments.next() {
            Some(Segment::Seq { index }) => format!("item {index}: "),
            _ => String::new(),
        };
        match field {
            Some(field) => PayloadError::new(
                field.path,
                format!("{item}{}; send {}", e.inner(), field.expected),
            ),
            None => PayloadError::new("content.data", e.inner().to_string()),
        }
    })
}

/// A name: trimmed, then 1 to `max` characters.
pub(crate) fn term(field: &'static str, value: &str, max: usize) -> Result<String, PayloadError> {
    let trimmed = value.trim();
    if trimmed.is_empty() {
        return Err(PayloadError::new(
            field,
            "it is empty after trimming whitespace; send a non-empty string",
        ));
    }
    at_most(field, trimmed, max)?;
    Ok(trimmed.to_owned())
}

pub(crate) fn at_most(field: &'static str, value: &str, max: usize) -> Result<(), PayloadError> {
    let chars = value.chars().count();
    if chars > max {
        return Err(PayloadError::new(
            field,
            format!("it has {chars} characters, at most {max} are allowed; shorten it"),
        ));
    }
    Ok(())
}

fn at_least_one(field: &'static str, version: Option<u32>) -> Result<(), PayloadError> {
    if version == Some(0) {
        return Err(PayloadError::new(
            field,
            format!("0 is not a whole number in 1..={}", u32::MAX),
        ));
    }
    Ok(())
}

fn list(field: &'static str, items: Option<&[String]>) -> Result<(), PayloadError> {
    let items = items.unwrap_or_default();
    if items.len() > MAX_LIST_ITEMS {
        return Err(PayloadError::new(
            field,
            format!(
                "{} items, at most {MAX_LIST_ITEMS} are allowed; merge some",
                items.len()
            ),
        ));
    }
    for (index, item) in items.iter().enumerate() {
        at_most(field, item, MAX_TEXT_CHARS).map_err(|e| PayloadError {
            reason: format!("item {index}: {}", e.reason),
            ..e
        })?;
    }
    Ok(())
}

/// Refuses a value nested deeper than [`MAX_OBJECT_DEPTH`]. Stops descending at the limit,
/// so its own recursion is bounded whatever the input.
fn shallow(field: &'static str, value: &Value) -> Result<(), PayloadError> {
    within_depth(field, value, MAX_OBJECT_DEPTH)
}

/// Refuses a value nested deeper than `max`, without descending further than that.
pub(crate) fn within_depth(
    field: &'static str,
    value: &Value,
    max: usize,
) -> Result<(), PayloadError> {
    fn within(value: &Value, budget: usize) -> bool {
        match value {
            Value::Array(items) => budget > 0 && items.iter().all(|v| within(v, budget - 1)),
            Value::Object(map) => budget > 0 && map.values().all(|v| within(v, budget - 1)),
            _ => true,
        }
    }
    if within(value, max) {
        return Ok(());
    }
    Err(PayloadError::new(
        field,
        format!(
            "it is nested more than {max} levels deep; flatten it, or put the detail in content.text"
        ),
    ))
}

/// An optional RFC 3339 timestamp, parsed strictly (chrono's own `Deserialize` also takes
/// other forms, which JSON Schema's `date-time` does not).
fn rfc3339<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
    let Some(text) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    DateTime::parse_from_rfc3339(&text)
        .map(|t| Some(t.with_timezone(&Utc)))
        .map_err(|e| D::Error::custom(format!("{text:?} is not an RFC 3339 timestamp ({e})")))
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::envelope::{Content, Layer, Scope, ScopeKind};
    use crate::ident::Ident;

    fn event(kind: EventKind, data: Option<Value>) -> Envelope {
        let id = |s: &str| Ident::parse("id", s).unwrap();
        Envelope::new(
            id("acme"),
            Scope::new(ScopeKind::Team, "core").unwrap(),
            id("planner"),
            id("i-1"),
            Layer::Semantic,
            kind,
            Content {
                text: "some text".into(),
                data,
            },
        )
    }

    /// `validate` refuses `data` for `kind`, naming `field`; returns the reason.
    fn refused(kind: EventKind, data: Option<Value>, field: &str) -> String {
        let err = event(kind, data.clone())
            .validate()
            .expect_err(&format!("{kind} {data:?} must be refused"));
        match err {
            SchemaError::InvalidField {
                field: named,
                reason,
            } => {
                assert_eq!(named, field, "{kind} {data:?}: {reason}");
                assert!(!reason.is_empty());
                reason
            }
            other => panic!("{kind} {data:?}: expected InvalidField {field}, got {other:?}"),
        }
    }

    fn nested(depth: usize) -> Value {
        (0..depth).fold(json!("leaf"), |inner, _| json!([inner]))
    }

    #[test]
    fn a_valid_fact_assertion_is_accepted_trimmed_with_its_defaults() {
        let e = event(
            EventKind::FactAsserted,
            Some(json!({
                "subject": "  alice\n", "predicate": "lives_in", "object": {"city": "paris"},
                "valid_to": null, "confidence": null, "extra": [1, 2],
            })),
        );
        e.validate().unwrap();
        let fact = FactAsserted::from_event(&e).unwrap();
        assert_eq!(fact.subject, "alice");
        assert_eq!(fact.object, json!({"city": "paris"}));
        assert_eq!(fact.confidence(), 1.0);
        assert_eq!(fact.cardinality(), Cardinality::Single);
        assert_eq!(fact.valid_from, None);

        let full = event(
            EventKind::FactAsserted,
            Some(json!({
                "subject": "alice", "predicate": "speaks", "object": "french",
                "valid_from": "2024-01-01T00:00:00Z", "valid_to": "2025-01-01T00:00:00+01:00",
                "confidence": 0.5, "cardinality": "multi",
            })),
        );
        let fact = FactAsserted::from_event(&full).unwrap();
        assert_eq!(fact.cardinality(), Cardinality::Multi);
        assert_eq!(fact.confidence(), 0.5);
        assert_eq!(
            fact.valid_to.unwrap().to_rfc3339(),
            "2024-12-31T23:00:00+00:00"
        );
    }

    #[test]
    fn every_missing_or_ill_typed_fact_field_is_named() {
        let fact = |extra: Value| {
            let mut data = json!({"subject": "s", "predicate": "p", "object": 1});
            for (k, v) in extra.as_object().unwrap() {
                data[k] = v.clone();
            }
            Some(data)
        };
        let cases = [
            (None, "content.data"),
            (Some(json!("alice lives in paris")), "content.data"),
            (
                Some(json!({"predicate": "p", "object": 1})),
                "content.data.subject",
            ),
            (fact(json!({"subject": null})), "content.data.subject"),
            (fact(json!({"subject": 7})), "content.data.subject"),
            (fact(json!({"subject": " \t"})), "content.data.subject"),
            (
                Some(json!({"subject": "s", "object": 1})),
                "content.data.predicate",
            ),
            (fact(json!({"predicate": ["p"]})), "content.data.predicate"),
            (
                Some(json!({"subject": "s", "predicate": "p"})),
                "content.data.object",
            ),
            (fact(json!({"object": null})), "content.data.object"),
            (fact(json!({"valid_from": 2024})), "content.data.valid_from"),
            (
                fact(json!({"valid_from": "yesterday"})),
                "content.data.valid_from",
            ),
            (
                fact(json!({"valid_from": "2024-01-01 00:00:00"})),
                "content.data.valid_from",
            ),
            (
                fact(
                    json!({"valid_from": "2024-02-01T00:00:00Z", "valid_to": "2024-02-01T00:00:00Z"}),
                ),
                "content.data.valid_to",
            ),
            (fact(json!({"confidence": 1.5})), "content.data.confidence"),
            (fact(json!({"confidence": -0.1})), "content.data.confidence"),
            (
                fact(json!({"confidence": "high"})),
                "content.data.confidence",
            ),
            (
                fact(json!({"cardinality": "many"})),
                "content.data.cardinality",
            ),
        ];
        for (data, field) in cases {
            refused(EventKind::FactAsserted, data, field);
        }
        let reason = refused(
            EventKind::FactAsserted,
            Some(json!({"subject": "s", "predicate": "p"})),
            "content.data.object",
        );
        assert!(
            reason.contains("fact_retracted"),
            "says what to do: {reason}"
        );
        let reason = refused(EventKind::FactAsserted, None, "content.data");
        assert!(reason.contains("\"subject\""), "gives an example: {reason}");
    }

    #[test]
    fn valid_to_defaults_its_bound_to_occurred_at() {
        let mut e = event(
            EventKind::FactAsserted,
            Some(
                json!({"subject": "s", "predicate": "p", "object": 1, "valid_to": "2024-01-01T00:00:00Z"}),
            ),
        );
        e.occurred_at = "2024-06-01T00:00:00Z".parse().unwrap();
        refused(e.kind, e.content.data.clone(), "content.data.valid_to");
        assert!(FactAsserted::from_event(&e).is_err());
        e.occurred_at = "2023-06-01T00:00:00Z".parse().unwrap();
        assert!(FactAsserted::from_event(&e).is_ok());
    }

    #[test]
    fn fact_terms_are_limited_in_characters_after_trimming() {
        let at_limit = "é".repeat(MAX_TERM_CHARS);
        let e = event(
            EventKind::FactAsserted,
            Some(json!({"subject": format!(" {at_limit} "), "predicate": "p", "object": 1})),
        );
        assert_eq!(FactAsserted::from_event(&e).unwrap().subject, at_limit);
        let over = "x".repeat(MAX_TERM_CHARS + 1);
        for (kind, data, field) in [
            (
                EventKind::FactAsserted,
                json!({"subject": over, "predicate": "p", "object": 1}),
                "content.data.subject",
            ),
            (
                EventKind::FactAsserted,
                json!({"subject": "s", "predicate": over, "object": 1}),
                "content.data.predicate",
            ),
            (
                EventKind::FactRetracted,
                json!({"subject": over, "predicate": "p"}),
                "content.data.subject",
            ),
        ] {
            let reason = refused(kind, Some(data), field);
            assert!(reason.contains("257 characters"), "{reason}");
        }
    }

    #[test]
    fn a_fact_object_nested_too_deep_is_refused() {
        for kind in [EventKind::FactAsserted, EventKind::FactRetracted] {
            let ok = json!({"subject": "s", "predicate": "p", "object": nested(MAX_OBJECT_DEPTH)});
            event(kind, Some(ok)).validate().unwrap();
            let deep =
                json!({"subject": "s", "predicate": "p", "object": nested(MAX_OBJECT_DEPTH + 1)});
            let reason = refused(kind, Some(deep), "content.data.object");
            assert!(reason.contains("32 levels"), "{reason}");
            let deep_map = (0..=MAX_OBJECT_DEPTH).fold(json!(1), |inner, _| json!({"k": inner}));
            let deep_map = json!({"subject": "s", "predicate": "p", "object": deep_map});
            refused(kind, Some(deep_map), "content.data.object");
        }
    }

    #[test]
    fn a_retraction_needs_subject_and_predicate_and_may_name_an_object() {
        let e = event(
            EventKind::FactRetracted,
            Some(json!({"subject": "alice ", "predicate": "lives_in", "object": null})),
        );
        let retraction = FactRetracted::from_event(&e).unwrap();
        assert_eq!(retraction.subject, "alice");
        assert_eq!(retraction.object, None);
        refused(EventKind::FactRetracted, None, "content.data");
        refused(
            EventKind::FactRetracted,
            Some(json!({"subject": "alice"})),
            "content.data.predicate",
        );
        refused(
            EventKind::FactRetracted,
            Some(json!({"subject": false, "predicate": "p"})),
            "content.data.subject",
        );
    }

    #[test]
    fn a_valid_skill_record_is_accepted_trimmed() {
        let e = event(
            EventKind::SkillRecorded,
            Some(json!({
                "name": " deploy ", "description": " roll out a service ", "version": 3,
                "steps": ["build", "ship"], "script": "make deploy", "preconditions": null,
                "observed": {"successes": 4, "failures": 0, "since": "ignored"},
            })),
        );
        e.validate().unwrap();
        let skill = SkillRecorded::from_event(&e).unwrap();
        assert_eq!(skill.name, "deploy");
        assert_eq!(skill.description, "roll out a service");
        assert_eq!(skill.version, Some(3));
        assert_eq!(skill.steps(), ["build", "ship"]);
        assert!(skill.preconditions().is_empty());
        assert_eq!(
            skill.observed,
            Some(ObservedOutcomes {
                successes: 4,
                failures: 0
            })
        );
    }

    #[test]
    fn every_missing_ill_typed_or_oversized_skill_field_is_named() {
        let skill = |extra: Value| {
            let mut data = json!({"name": "lint", "description": "run the linter"});
            for (k, v) in extra.as_object().unwrap() {
                data[k] = v.clone();
            }
            Some(data)
        };
        let long = |n: usize| "x".repeat(n);
        let cases = [
            (None, "content.data"),
            (Some(json!(["lint"])), "content.data"),
            (Some(json!({"description": "d"})), "content.data.name"),
            (skill(json!({"name": " "})), "content.data.name"),
            (skill(json!({"name": 5})), "content.data.name"),
            (
                skill(json!({"name": long(MAX_NAME_CHARS + 1)})),
                "content.data.name",
            ),
            (Some(json!({"name": "lint"})), "content.data.description"),
            (
                skill(json!({"description": ""})),
                "content.data.description",
            ),
            (skill(json!({"description": 3})), "content.data.description"),
            (
                skill(json!({"description": long(MAX_TEXT_CHARS + 1)})),
                "content.data.description",
            ),
            (skill(json!({"version": 0})), "content.data.version"),
            (skill(json!({"version": -1})), "content.data.version"),
            (skill(json!({"version": 1.5})), "content.data.version"),
            (skill(json!({"version": "2"})), "content.data.version"),
            (
                skill(json!({"version": 4_294_967_296u64})),
                "content.data.version",
            ),
            (skill(json!({"steps": "run it"})), "content.data.steps"),
            (skill(json!({"steps": ["ok", 1]})), "content.data.steps"),
            (
                skill(json!({"steps": vec!["s"; MAX_LIST_ITEMS + 1]})),
                "content.data.steps",
            ),
            (
                skill(json!({"steps": ["ok", long(MAX_TEXT_CHARS + 1)]})),
                "content.data.steps",
            ),
            (skill(json!({"script": 5})), "content.data.script"),
            (
                skill(json!({"script": long(MAX_SCRIPT_CHARS + 1)})),
                "content.data.script",
            ),
            (
                skill(json!({"preconditions": {"a": 1}})),
                "content.data.preconditions",
            ),
            (
                skill(json!({"preconditions": vec!["p"; MAX_LIST_ITEMS + 1]})),
                "content.data.preconditions",
            ),
            (
                skill(json!({"observed": {"successes": 0, "failures": 0}})),
                "content.data.observed",
            ),
            (
                skill(json!({"observed": {"successes": 3}})),
                "content.data.observed",
            ),
            (
                skill(json!({"observed": {"successes": -1, "failures": 2}})),
                "content.data.observed",
            ),
            (
                skill(json!({"observed": {"successes": 4_294_967_296u64, "failures": 0}})),
                "content.data.observed",
            ),
            (skill(json!({"observed": 3})), "content.data.observed"),
        ];
        for (data, field) in cases {
            refused(EventKind::SkillRecorded, data, field);
        }
        let reason = refused(
            EventKind::SkillRecorded,
            skill(json!({"steps": ["ok", 1]})),
            "content.data.steps",
        );
        assert!(reason.starts_with("item 1:"), "{reason}");
    }

    #[test]
    fn an_outcome_is_checked_only_when_it_names_a_skill() {
        for data in [
            None,
            Some(json!("done")),
            Some(json!({"status": "ok", "success": "partially"})),
            Some(json!({"skill": null, "success": 3})),
        ] {
            let e = event(EventKind::Outcome, data.clone());
            e.validate().unwrap();
            assert_eq!(SkillOutcome::from_event(&e).unwrap(), None, "{data:?}");
        }
        let e = event(
            EventKind::Outcome,
            Some(json!({"skill": " lint ", "success": false, "version": 2, "exit_code": 1})),
        );
        assert_eq!(
            SkillOutcome::from_event(&e).unwrap(),
            Some(SkillOutcome {
                skill: "lint".into(),
                success: false,
                version: Some(2),
            })
        );
        let cases = [
            (json!({"skill": 5, "success": true}), "content.data.skill"),
            (json!({"skill": "", "success": true}), "content.data.skill"),
            (
                json!({"skill": "x".repeat(MAX_NAME_CHARS + 1), "success": true}),
                "content.data.skill",
            ),
            (json!({"skill": "lint"}), "content.data.success"),
            (
                json!({"skill": "lint", "success": "yes"}),
                "content.data.success",
            ),
            (
                json!({"skill": "lint", "success": true, "version": 0}),
                "content.data.version",
            ),
            (
                json!({"skill": "lint", "success": true, "version": "x"}),
                "content.data.version",
            ),
        ];
        for (data, field) in cases {
            refused(EventKind::Outcome, Some(data), field);
        }
    }

    #[test]
    fn a_forgotten_event_needs_1_to_1000_valid_ids() {
        let ids: Vec<EventId> = (0..3).map(|_| EventId::new()).collect();
        let e = event(EventKind::Forgotten, Some(json!({"event_ids": ids})));
        assert_eq!(Forgotten::from_event(&e).unwrap().event_ids, ids);
        let too_many: Vec<EventId> = (0..=MAX_FORGOTTEN).map(|_| EventId::new()).collect();
        for data in [
            None,
            Some(json!({})),
            Some(json!({"event_ids": []})),
            Some(json!({"event_ids": too_many})),
            Some(json!({"event_ids": [7]})),
            Some(json!({"event_ids": ["not-an-id"]})),
        ] {
            let field = if data.is_none() {
                "content.data"
            } else {
                "content.data.event_ids"
            };
            refused(EventKind::Forgotten, data, field);
        }
    }

    #[test]
    fn a_retrieval_report_counts_1_to_1000_ids_each_at_least_once() {
        let (a, b) = (EventId::new(), EventId::new());
        let e = event(
            EventKind::Feedback,
            Some(json!({"retrieved": {a.as_str(): 3, b.as_str(): 1}, "window": 7})),
        );
        e.validate().unwrap();
        let retrieved = Retrieved::from_event(&e).unwrap().unwrap();
        assert_eq!(
            retrieved.retrieved,
            BTreeMap::from([(a.clone(), 3), (b.clone(), 1)])
        );
        assert_eq!(
            Payload::of(&e).unwrap(),
            Some(Payload::Retrieved(retrieved))
        );
        let at_limit: BTreeMap<String, u32> = (0..MAX_RETRIEVED)
            .map(|_| (EventId::new().to_string(), 1))
            .collect();
        let e = event(EventKind::Feedback, Some(json!({ "retrieved": at_limit })));
        e.validate().unwrap();
        let over: BTreeMap<String, u32> = (0..=MAX_RETRIEVED)
            .map(|_| (EventId::new().to_string(), 1))
            .collect();
        for data in [
            json!({"retrieved": {}}),
            json!({"retrieved": over}),
            json!({"retrieved": [a.as_str()]}),
            json!({"retrieved": {"not-an-id": 1}}),
            json!({"retrieved": {a.as_str(): 0}}),
            json!({"retrieved": {a.as_str(): -1}}),
            json!({"retrieved": {a.as_str(): 1.5}}),
            json!({"retrieved": {a.as_str(): 4_294_967_296u64}}),
            json!({"retrieved": {a.as_str(): "3"}}),
        ] {
            refused(EventKind::Feedback, Some(data), "content.data.retrieved");
        }
        // Feedback that reports neither use nor retrieval is free.
        for data in [None, Some(json!("fine")), Some(json!({"retrieved": null}))] {
            let e = event(EventKind::Feedback, data);
            e.validate().unwrap();
            assert_eq!(Payload::of(&e).unwrap(), None);
        }
    }

    #[test]
    fn feedback_may_report_use_and_retrieval_each_checked_on_its_own() {
        let (a, b) = (EventId::new(), EventId::new());
        let both = json!({"used": [a.as_str()], "retrieved": {a.as_str(): 2, b.as_str(): 5}});
        let e = event(EventKind::Feedback, Some(both));
        assert_eq!(
            Payload::of(&e).unwrap(),
            Some(Payload::UsedAndRetrieved(
                Used {
                    used: vec![a.clone()]
                },
                Retrieved {
                    retrieved: BTreeMap::from([(a.clone(), 2), (b.clone(), 5)])
                }
            ))
        );
        // A bad half is refused, naming its own field, whatever the other half holds.
        refused(
            EventKind::Feedback,
            Some(json!({"used": [a.as_str()], "retrieved": {a.as_str(): 0}})),
            "content.data.retrieved",
        );
        refused(
            EventKind::Feedback,
            Some(json!({"used": [], "retrieved": {a.as_str(): 1}})),
            "content.data.used",
        );
        let retrieved = Retrieved {
            retrieved: BTreeMap::from([(b.clone(), 9)]),
        };
        let e = event(
            EventKind::Feedback,
            Some(serde_json::to_value(&retrieved).unwrap()),
        );
        assert_eq!(Used::from_event(&e).unwrap(), None);
        assert_eq!(
            Payload::of(&e).unwrap(),
            Some(Payload::Retrieved(retrieved))
        );
    }

    #[test]
    fn contradicts_names_1_to_1000_memories_on_an_outcome_or_feedback() {
        let ids: Vec<EventId> = (0..3).map(|_| EventId::new()).collect();
        for kind in [EventKind::Outcome, EventKind::Feedback] {
            let e = event(kind, Some(json!({"contradicts": ids, "note": "free"})));
            e.validate().unwrap();
            assert_eq!(
                Contradicts::from_event(&e).unwrap().unwrap().contradicts,
                ids
            );
            // Named twice, counted once, in the order first named
            let twice = json!({"contradicts": [ids[1], ids[0], ids[1]]});
            let e = event(kind, Some(twice));
            assert_eq!(
                Contradicts::from_event(&e).unwrap().unwrap().contradicts,
                [ids[1].clone(), ids[0].clone()]
            );
            for data in [
                None,
                Some(json!("it failed")),
                Some(json!({"contradicts": null})),
            ] {
                let e = event(kind, data.clone());
                e.validate().unwrap();
                assert_eq!(Contradicts::from_event(&e).unwrap(), None, "{data:?}");
            }
            let too_many: Vec<EventId> = (0..=MAX_FORGOTTEN).map(|_| EventId::new()).collect();
            let at_most: Vec<EventId> = too_many[..MAX_FORGOTTEN].to_vec();
            event(kind, Some(json!({"contradicts": at_most})))
                .validate()
                .unwrap();
            for data in [
                json!({"contradicts": []}),
                json!({"contradicts": too_many}),
                json!({"contradicts": ids[0]}),
                json!({"contradicts": [7]}),
                json!({"contradicts": ["*"]}),
                json!({"contradicts": [ids[0], ">"]}),
                json!({"contradicts": ["not-an-id"]}),
                json!({"contradicts": {"id": ids[0]}}),
            ] {
                refused(kind, Some(data), "content.data.contradicts");
            }
        }
        // Another kind's data is free: the key means nothing there
        let e = event(EventKind::Observation, Some(json!({"contradicts": [7]})));
        e.validate().unwrap();
        assert_eq!(Contradicts::from_event(&e).unwrap(), None);
    }

    #[test]
    fn contradicts_is_checked_on_its_own_beside_a_skill_outcome_or_used() {
        let id = EventId::new();
        let both = json!({"skill": "lint", "success": false, "contradicts": [id]});
        let e = event(EventKind::Outcome, Some(both));
        e.validate().unwrap();
        assert!(matches!(
            Payload::of(&e).unwrap(),
            Some(Payload::SkillOutcome(_))
        ));
        assert_eq!(
            Contradicts::from_event(&e).unwrap().unwrap().contradicts,
            std::slice::from_ref(&id)
        );
        // A good skill report does not carry a bad contradiction, nor the other way round
        refused(
            EventKind::Outcome,
            Some(json!({"skill": "lint", "success": true, "contradicts": []})),
            "content.data.contradicts",
        );
        refused(
            EventKind::Outcome,
            Some(json!({"skill": "lint", "contradicts": [id]})),
            "content.data.success",
        );
        // An outcome about no skill but naming a contradiction
        let e = event(EventKind::Outcome, Some(json!({"contradicts": [id]})));
        e.validate().unwrap();
        assert_eq!(SkillOutcome::from_event(&e).unwrap(), None);
        let with_use = json!({"used": [id], "contradicts": [id], "faulty_instance": "i-2"});
        let e = event(EventKind::Feedback, Some(with_use));
        e.validate().unwrap();
        assert!(Used::from_event(&e).unwrap().is_some());
        assert!(Contradicts::from_event(&e).unwrap().is_some());
        assert!(FaultyInstance::from_event(&e).unwrap().is_some());
        refused(
            EventKind::Feedback,
            Some(json!({"used": [id], "contradicts": "all of them"})),
            "content.data.contradicts",
        );
    }

    #[test]
    fn a_faulty_instance_flag_is_an_identifier_on_feedback() {
        let e = event(
            EventKind::Feedback,
            Some(json!({"faulty_instance": "worker-7", "why": "hallucinated prices"})),
        );
        e.validate().unwrap();
        assert_eq!(
            FaultyInstance::from_event(&e).unwrap(),
            Some(FaultyInstance {
                faulty_instance: Ident::parse("i", "worker-7").unwrap()
            })
        );
        for data in [
            None,
            Some(json!("bad")),
            Some(json!({"faulty_instance": null})),
        ] {
            let e = event(EventKind::Feedback, data.clone());
            assert_eq!(FaultyInstance::from_event(&e).unwrap(), None, "{data:?}");
        }
        for value in [
            json!(""),
            json!("*"),
            json!("worker.7"),
            json!("worker >"),
            json!("x".repeat(65)),
            json!(7),
            json!(["worker-7"]),
            json!({"id": "worker-7"}),
        ] {
            let reason = refused(
                EventKind::Feedback,
                Some(json!({"faulty_instance": value})),
                "content.data.faulty_instance",
            );
            assert!(reason.contains("send the faulty instance's id"), "{reason}");
        }
        // Only feedback flags an instance: an outcome's data is free
        let e = event(EventKind::Outcome, Some(json!({"faulty_instance": 7})));
        e.validate().unwrap();
        assert_eq!(FaultyInstance::from_event(&e).unwrap(), None);
    }

    #[test]
    fn distrust_payloads_built_from_the_types_pass_their_own_check() {
        let contradicts = Contradicts {
            contradicts: vec![EventId::new(), EventId::new()],
        };
        let e = event(
            EventKind::Outcome,
            Some(serde_json::to_value(&contradicts).unwrap()),
        );
        assert_eq!(Contradicts::from_event(&e).unwrap(), Some(contradicts));
        let flag = FaultyInstance {
            faulty_instance: Ident::parse("i", "i-9").unwrap(),
        };
        let e = event(
            EventKind::Feedback,
            Some(serde_json::to_value(&flag).unwrap()),
        );
        assert_eq!(FaultyInstance::from_event(&e).unwrap(), Some(flag));
    }

    #[test]
    fn kinds_without_a_payload_type_take_any_data() {
        for kind in [
            EventKind::Observation,
            EventKind::Action,
            EventKind::Preference,
        ] {
            let e = event(kind, Some(json!({"subject": 7, "anything": [null]})));
            e.validate().unwrap();
            assert_eq!(Payload::of(&e).unwrap(), None);
        }
    }

    #[test]
    fn payloads_built_from_the_types_pass_their_own_check() {
        let fact = FactAsserted {
            subject: "alice".into(),
            predicate: "lives_in".into(),
            object: json!("paris"),
            valid_from: Some("2024-01-01T00:00:00Z".parse().unwrap()),
            valid_to: None,
            confidence: Some(0.9),
            cardinality: Some(Cardinality::Multi),
        };
        let e = event(
            EventKind::FactAsserted,
            Some(serde_json::to_value(&fact).unwrap()),
        );
        assert_eq!(Payload::of(&e).unwrap(), Some(Payload::FactAsserted(fact)));
        let skill = SkillRecorded {
            name: "lint".into(),
            description: "run the linter".into(),
            version: None,
            steps: Some(vec!["cargo clippy".into()]),
            script: None,
            preconditions: None,
            observed: Some(ObservedOutcomes {
                successes: 3,
                failures: 1,
            }),
        };
        let e = event(
            EventKind::SkillRecorded,
            Some(serde_json::to_value(&skill).unwrap()),
        );
        assert_eq!(
            Payload::of(&e).unwrap(),
            Some(Payload::SkillRecorded(skill))
        );
    }

    #[test]
    fn decoding_leaves_the_payload_to_the_read_models() {
        // An event stored before the contract (or published raw) still decodes, so readers
        // that only want its text get it; the append path refuses it.
        let codec = crate::Codec::default();
        let old = event(EventKind::FactAsserted, None);
        let bytes = rmp_serde::to_vec_named(&old).unwrap();
        assert_eq!(codec.decode(&bytes).unwrap(), old);
        assert!(matches!(
            codec.encode(&old),
            Err(SchemaError::InvalidField {
                field: "content.data",
                ..
            })
        ));
        let json = serde_json::to_string(&old).unwrap();
        assert!(matches!(
            codec.decode_json(&json),
            Err(SchemaError::InvalidField {
                field: "content.data",
                ..
            })
        ));
    }
}

//! The Engram event contract. Nothing else in the workspace defines an event type.
//!
//! # Layout
//! - [`ident`]: validated identifiers (tenant, scope id, agent, instance) and event ids.
//! - [`envelope`]: the v1 envelope every agent instance appends, and its enums.
//! - [`payload`]: the typed `content.data` of the kinds read models interpret (facts, skills,
//!   skill outcomes, forgetting), with their limits and the check every append runs.
//! - [`session`]: the records of an `engram run` session (started, heartbeats, checkpoints,
//!   artifacts, ended), typed `checkpoint` payloads.
//! - [`subject`]: how an envelope maps to a NATS subject, and subject filters for replay.
//! - [`codec`]: MessagePack encoding, size limits, schema-version checks and upcasting.
//!
//! The wire format is MessagePack with named fields (rmp-serde `to_vec_named`), so readers of
//! an older version skip fields they do not know. A reader never accepts a `schema_version`
//! newer than [`SCHEMA_VERSION`]: it cannot know what such an event means.

mod chunk;
pub mod codec;
pub mod envelope;
pub mod error;
pub mod ident;
pub mod payload;
pub mod session;
pub mod subject;

/// The CRDT library of `doc_changed` payloads, so every crate parses them with one version.
pub use automerge;
pub use codec::{Codec, Limits, Upcaster};
pub use envelope::{Content, Embedding, Envelope, EventKind, Layer, Scope, ScopeKind};
pub use error::SchemaError;
pub use ident::{EventId, Ident};
pub use payload::{
    Cardinality, Consolidated, ConsolidationOp, Contradicts, DocChanged, FactAsserted,
    FactRetracted, FaultyInstance, Forgotten, ObservedOutcomes, Payload, PayloadError, Retrieved,
    SkillOutcome, SkillRecorded, Used,
};
pub use session::{
    ArtifactStored, CheckpointVia, SessionCheckpointed, SessionEnded, SessionEvent,
    SessionHeartbeat, SessionRecord, SessionStarted, SessionStep,
};
pub use subject::{
    DEFAULT_PARTITIONS, MAX_PARTITIONS, STORED_SUBJECTS, STREAM_SUBJECTS, SUBJECT_PREFIX,
    SubjectFilter, parse_subject, partition_filter, partition_of, partition_of_event,
    stored_subject_for, stream_transform, subject_for, subject_partition, transform_partitions,
};

/// The envelope version this build writes and the newest it reads.
pub const SCHEMA_VERSION: u16 = 1;

/// The JSON Schema of the envelope, published as `json/envelope.v1.json`. Besides the
/// envelope it states, per kind, the shape of `content.data`: an `allOf` of `if kind is K
/// then content.data is K's payload`, the payloads under `$defs`. What JSON Schema cannot
/// say (trimming, the nesting depth of a fact's object, `valid_to` after `valid_from`) is in
/// the field descriptions and checked by [`Envelope::validate`].
pub fn json_schema() -> schemars::Schema {
    let mut generator = schemars::SchemaGenerator::default();
    let data_is = |kind: EventKind, payload: schemars::Schema| {
        serde_json::json!({
            "if": { "properties": { "kind": { "const": kind.as_str() } }, "required": ["kind"] },
            "then": { "properties": { "content": {
                "properties": { "data": payload },
                "required": ["data"],
            } } },
        })
    };
    let mut rules = vec![
        data_is(
            EventKind::FactAsserted,
            generator.subschema_for::<FactAsserted>(),
        ),
        data_is(
            EventKind::FactRetracted,
            generator.subschema_for::<FactRetracted>(),
        ),
        data_is(
            EventKind::SkillRecorded,
            generator.subschema_for::<SkillRecorded>(),
        ),
        data_is(EventKind::Forgotten, generator.subschema_for::<Forgotten>()),
        data_is(
            EventKind::Consolidated,
            generator.subschema_for::<Consolidated>(),
        ),
        data_is(
            EventKind::DocChanged,
            generator.subschema_for::<DocChanged>(),
        ),
    ];
    // An outcome's data is free unless it names a skill; then it is a skill outcome.
    let skill_outcome = generator.subschema_for::<SkillOutcome>();
    rules.push(serde_json::json!({
        "if": { "properties": { "kind": { "const": EventKind::Outcome.as_str() } }, "required": ["kind"] },
        "then": { "properties": { "content": { "properties": { "data": {
            "if": {
                "type": "object",
                "properties": { "skill": { "not": { "type": "null" } } },
                "required": ["skill"],
            },
            "then": skill_outcome,
        } } } } },
    }));
    // Feedback's data is free unless it reports use (the memories used) or retrieval (how
    // often each memory was returned); it may report both, each checked on its own.
    let reports = |key: &str, payload: schemars::Schema| {
        serde_json::json!({
            "if": {
                "type": "object",
                "properties": { key: { "not": { "type": "null" } } },
                "required": [key],
            },
            "then": payload,
        })
    };
    let used = reports("used", generator.subschema_for::<Used>());
    let retrieved = reports("retrieved", generator.subschema_for::<Retrieved>());
    rules.push(serde_json::json!({
        "if": { "properties": { "kind": { "const": EventKind::Feedback.as_str() } }, "required": ["kind"] },
        "then": { "properties": { "content": { "properties": { "data": {
            "allOf": [used, retrieved],
        } } } } },
    }));
    // An outcome or feedback may also name memories it contradicts, and feedback a faulty
    // instance: each key checked on its own, beside the kind's own payload.
    let mut distrust = |kinds: &[EventKind], key: &str, payload: schemars::Schema| {
        let kinds: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
        rules.push(serde_json::json!({
            "if": { "properties": { "kind": { "enum": kinds } }, "required": ["kind"] },
            "then": { "properties": { "content": { "properties": { "data": {
                "if": {
                    "type": "object",
                    "properties": { key: { "not": { "type": "null" } } },
                    "required": [key],
                },
                "then": payload,
            } } } } },
        }));
    };
    distrust(
        &[EventKind::Outcome, EventKind::Feedback],
        "contradicts",
        generator.subschema_for::<Contradicts>(),
    );
    distrust(
        &[EventKind::Feedback],
        "faulty_instance",
        generator.subschema_for::<FaultyInstance>(),
    );
    rules.push(session::schema_rule(&mut generator));
    let mut schema = generator.into_root_schema_for::<Envelope>();
    schema.insert("allOf".into(), rules.into());
    schema
}

#[cfg(test)]
mod tests {
    /// The published JSON Schema is generated from these types; a stale copy would mislead
    /// every client written in another language. Regenerate with `just schema`.
    #[test]
    fn committed_json_schema_is_current() {
        let schema = crate::json_schema();
        let mut generated = serde_json::to_string_pretty(&schema).unwrap();
        generated.push('\n');
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/json/envelope.v1.json");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == generated,
            "{path} is stale; run `cargo run -p engram-schema --bin engram-schema-gen -- {path}`"
        );
    }
}

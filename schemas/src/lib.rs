//! The Engram event contract. Nothing else in the workspace defines an event type.
//!
//! # Layout
//! - [`ident`]: validated identifiers (tenant, scope id, agent, instance) and event ids.
//! - [`envelope`]: the v1 envelope every agent instance appends, and its enums.
//! - [`subject`]: how an envelope maps to a NATS subject, and subject filters for replay.
//! - [`codec`]: MessagePack encoding, size limits, schema-version checks and upcasting.
//!
//! The wire format is MessagePack with named fields (rmp-serde `to_vec_named`), so readers of
//! an older version skip fields they do not know. A reader never accepts a `schema_version`
//! newer than [`SCHEMA_VERSION`]: it cannot know what such an event means.

pub mod codec;
pub mod envelope;
pub mod error;
pub mod ident;
pub mod subject;

pub use codec::{Codec, Limits, Upcaster};
pub use envelope::{Content, Embedding, Envelope, EventKind, Layer, Scope, ScopeKind};
pub use error::SchemaError;
pub use ident::{EventId, Ident};
pub use subject::{STREAM_SUBJECTS, SUBJECT_PREFIX, SubjectFilter, subject_for};

/// The envelope version this build writes and the newest it reads.
pub const SCHEMA_VERSION: u16 = 1;

#[cfg(test)]
mod tests {
    /// The published JSON Schema is generated from these types; a stale copy would mislead
    /// every client written in another language. Regenerate with `just schema`.
    #[test]
    fn committed_json_schema_is_current() {
        let schema = schemars::schema_for!(crate::Envelope);
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

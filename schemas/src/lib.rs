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

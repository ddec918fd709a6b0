//! Leaf nodes: a local Engram whose nats-server is a leaf node of a hub's, syncing the
//! tenant's scopes both ways by JetStream sourcing across domains. What both sides agree on
//! (stream names, subjects, the leaf's permissions) is [`engram_access::leaf`]; this crate
//! does the work:
//! - [`hub`]: the hub's events stream sources every live leaf's outbox;
//! - [`local`]: the leaf's outbox and inbox streams;
//! - [`relay`]: the leaf's two relays between its events stream and those;
//! - [`link`]: each side's beats, which resume the sources as soon as the link is back.

pub mod hub;
pub mod link;
pub mod local;
pub mod relay;

use thiserror::Error;

/// A leaf operation that failed.
#[derive(Debug, Error)]
pub enum LeafError {
    #[error("jetstream: {0}")]
    JetStream(String),
    #[error(
        "stream {stream} is missing; start the leaf with `engram up --leaf <hub url> --creds <file>`, which creates it"
    )]
    Missing { stream: String },
}

pub(crate) fn js_err(e: impl std::fmt::Display) -> LeafError {
    LeafError::JetStream(e.to_string())
}

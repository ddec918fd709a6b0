//! Who may do what on the NATS server Engram runs on.
//!
//! Every connection authenticates with an nkey (an ed25519 key pair: the server holds only the
//! public half and checks a signature of its nonce, so no secret is ever stored server-side).
//! Each key belongs to one [`Role`], and each role maps to publish and subscribe allow lists
//! ([`perms`]) that the server enforces: an agent of tenant `acme` can publish only on
//! `engram.evt.acme.<its scopes>` and `engram.q.acme.<agent>.*`, and receive only on its own
//! inbox prefix. Nothing else of the server is reachable with its key, so a missing check in a
//! service cannot widen what an agent reaches.
//!
//! # Layout
//! - [`creds`]: the credentials file a key pair lives in.
//! - [`perms`]: role to NATS permissions, in one place.
//! - [`registry`]: the access records (tenants, agents, grants) and the state they fold into.
//! - [`log`]: the `ENGRAM_ACCESS` stream those records are appended to and read from.
//! - [`leaf`]: what a hub and its leaf nodes share: streams, subjects, the leaf's permissions.
//! - [`conf`]: the nats-server `authorization` block rendered from the registry.

pub mod conf;
pub mod creds;
pub mod leaf;
pub mod log;
pub mod perms;
pub mod registry;

pub use creds::{Credentials, RoleName};
pub use log::{AccessLog, SharedRegistry};
pub use perms::{Names, Role, ScopePattern};
pub use registry::{Grantee, Record, Registry};

use thiserror::Error;

/// An access operation that cannot be carried out.
#[derive(Debug, Error)]
pub enum AccessError {
    #[error("{0}")]
    Invalid(String),
    #[error("tenant {tenant} does not exist; create it with `engram tenant add {tenant}`")]
    NoTenant { tenant: String },
    #[error("tenant {tenant} already exists")]
    TenantExists { tenant: String },
    #[error(
        "tenant name {tenant} differs from the existing tenant {existing} only in letter case; names that look alike are refused, pick another"
    )]
    Confusable { tenant: String, existing: String },
    #[error(
        "agent {agent} of tenant {tenant} has no active credentials; list them with `engram agent list --tenant {tenant}`"
    )]
    NoAgent { tenant: String, agent: String },
    #[error("cannot read or write {path}: {reason}")]
    File { path: String, reason: String },
    #[error("credentials file {path} is not valid: {reason}")]
    BadCredentials { path: String, reason: String },
    #[error("access registry ({stream}): {reason}")]
    Log { stream: String, reason: String },
    /// The record was checked against a view of the registry that another admin's record
    /// has since made stale; nothing was appended. Read the registry again and re-check.
    #[error(
        "the access registry changed after it was read (read through seq {read}); nothing was appended: read it again and re-check the change"
    )]
    Stale { read: u64 },
}

/// Writes `text` to `path` atomically (a reader sees the old file or the new, never half),
/// readable by its owner only: credentials and the server's authorization block.
pub(crate) fn write_private(path: &std::path::Path, text: &str) -> Result<(), AccessError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let err = |e: std::io::Error| AccessError::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(text.as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

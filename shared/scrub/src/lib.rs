//! Credential scrubbing: finds secrets in text and replaces them with `[REDACTED:<kind>]`
//! before anything is persisted.
//!
//! Memories are agents' notes and conversations, and the event log keeps them for good, so
//! an API key pasted into a conversation must be caught on the way in: the SDK, the CLI and
//! the projectors all run text through a [`Scrubber`] built from the `[scrub]`
//! [`ScrubPolicy`] (per tenant). False positives matter as much as misses, since a redacted
//! note is a lost note: the generic detectors only fire next to a key-like name, and values
//! that describe or reference a secret (`token: none`, `password: <redacted>`,
//! `api_key: self.api_key`) are left alone.
//!
//! ```
//! use engram_scrub::{Kind, Scrubber};
//!
//! let scrubber = Scrubber::default();
//! let out = scrubber.scrub("db password=hunter2, see https://bob:s3cret@db.example.com/x");
//! assert_eq!(
//!     out.text,
//!     "db password=[REDACTED:key_value_secret], see https://bob:[REDACTED:url_password]@db.example.com/x"
//! );
//! assert_eq!(out.redactions[0].kind, Kind::KeyValueSecret);
//! // Scrubbing is idempotent, and clean text is borrowed, not copied.
//! assert!(scrubber.scrub(&out.text).is_clean());
//! ```
//!
//! # Layout
//! - `policy`: [`ScrubPolicy`] and the [`Kind`]s of secret.
//! - `scrubber`: [`Scrubber`], [`Scrubbed`], [`Redaction`] and rendering the markers.
//! - `detect`: the detectors (compiled `regex` patterns, linear time), the gate, segments and
//!   rescans, and resolving overlaps.
//! - `names`: key-like names (`DB_PASSWORD`, `apiKey`, `x-api-key`), judged by their parts.
//! - `value`: judging candidates: values after names, and random-looking tokens.
//! - `json`: [`scrub_json`], every string of a JSON value.
//! - `tenants`: [`ScrubConfig`] (`[scrub]`, with per-tenant policies) and [`Scrubbers`],
//!   which scrub a whole event by its tenant's policy.
//!
//! # Rules
//! - Only the secret is replaced, not the name or the scheme around it:
//!   `password=[REDACTED:key_value_secret]`, `https://bob:[REDACTED:url_password]@host`,
//!   `Authorization: Bearer [REDACTED:bearer_token]`.
//! - When detectors overlap, the earliest-starting, then longest, match names the
//!   redaction (ties go to the more specific kind, in [`Kind`]'s order), and it covers the
//!   union of the overlapping matches, so no part of a secret stays visible.
//! - `[REDACTED:<kind>]` markers are never matched again: they split the text into segments
//!   scanned on their own. The pieces left around new finds are scanned once more (a value
//!   cut by a redaction may read differently), so that scrubbing is idempotent by
//!   construction: the result is what a second scrub would leave.
//! - Clean text is returned borrowed, without allocating; a cheap gate (one pass looking for
//!   any prefix or name a detector needs) skips the detectors for most of it.

mod detect;
mod json;
mod names;
mod policy;
mod scrubber;
mod tenants;
mod value;

pub use json::scrub_json;
pub use policy::{Kind, ScrubPolicy};
pub use scrubber::{Redaction, Scrubbed, Scrubber};
pub use tenants::{DocChanges, ScrubConfig, Scrubbers};

//! Policies per tenant, and scrubbing a whole event.

use std::collections::BTreeMap;
use std::sync::Arc;

use engram_schema::{Envelope, EventKind};
use serde::{Deserialize, Serialize};

use crate::{Kind, ScrubPolicy, Scrubber, scrub_json};

/// `[scrub]` in engram.toml: the policy every tenant gets, and the tenants that differ
/// (`[scrub.tenants.acme]`, a whole policy of their own).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrubConfig {
    #[serde(flatten)]
    pub policy: ScrubPolicy,
    pub tenants: BTreeMap<String, ScrubPolicy>,
}

impl ScrubConfig {
    pub fn validate(&self) -> Result<(), String> {
        self.policy.validate()?;
        for (tenant, policy) in &self.tenants {
            policy
                .validate()
                .map_err(|e| format!("{e} (in scrub.tenants.{tenant})"))?;
        }
        Ok(())
    }
}

/// The compiled scrubbers of a [`ScrubConfig`], one per distinct policy; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Scrubbers {
    default: Arc<Scrubber>,
    tenants: Arc<BTreeMap<String, Scrubber>>,
}

impl Scrubbers {
    pub fn new(config: &ScrubConfig) -> Self {
        Self {
            default: Arc::new(Scrubber::new(&config.policy)),
            tenants: Arc::new(
                config
                    .tenants
                    .iter()
                    .map(|(t, p)| (t.clone(), Scrubber::new(p)))
                    .collect(),
            ),
        }
    }

    /// The scrubber of `tenant`'s policy.
    pub fn for_tenant(&self, tenant: &str) -> &Scrubber {
        self.tenants.get(tenant).unwrap_or(&self.default)
    }

    /// `event` with its secrets redacted ([`Scrubbers::scrub_event`]) and the kinds redacted,
    /// or `None` when it has none, without copying the event: the usual case on the append
    /// path. (Only its data, usually small, is copied to be checked.)
    pub fn scrubbed(&self, event: &Envelope) -> Option<(Envelope, Vec<Kind>)> {
        self.scrubbed_with(event, DocChanges::Decode)
    }

    /// [`Scrubbers::scrubbed`], with the changes of a `doc_changed` event treated as `docs`
    /// says. They are decoded at most once, however many secrets the event holds.
    pub fn scrubbed_with(
        &self,
        event: &Envelope,
        docs: DocChanges<'_>,
    ) -> Option<(Envelope, Vec<Kind>)> {
        let scrubber = self.for_tenant(event.tenant.as_str());
        let doc_found = doc_secrets(scrubber, event, docs);
        let dirty = |s: &str| !scrubber.scrub(s).is_clean();
        let data_dirty = || {
            if event.kind == EventKind::DocChanged {
                return !doc_found.is_empty();
            }
            event
                .content
                .data
                .as_ref()
                .is_some_and(|data| !scrub_json(scrubber, &mut data.clone()).is_empty())
        };
        if !dirty(&event.content.text) && !event.tags.iter().any(|t| dirty(t)) && !data_dirty() {
            return None;
        }
        let mut copy = event.clone();
        let kinds = self.redact(&mut copy, doc_found);
        Some((copy, kinds))
    }

    fn scrub_text_and_tags(&self, event: &mut Envelope) -> Vec<Kind> {
        let scrubber = self.for_tenant(event.tenant.as_str());
        let mut kinds = Vec::new();
        let text = |s: &mut String, kinds: &mut Vec<Kind>| {
            let out = scrubber.scrub(s);
            if !out.is_clean() {
                kinds.extend(out.redactions.iter().map(|r| r.kind));
                *s = out.text.into_owned();
            }
        };
        text(&mut event.content.text, &mut kinds);
        for tag in &mut event.tags {
            text(tag, &mut kinds);
        }
        kinds
    }

    /// Redacts the secrets in `event`'s text, data (but a document change's) and tags, by its
    /// tenant's policy; returns the kinds redacted, in order (none: the event is unchanged).
    pub fn scrub_event(&self, event: &mut Envelope) -> Vec<Kind> {
        let found = doc_secrets(
            self.for_tenant(event.tenant.as_str()),
            event,
            DocChanges::Decode,
        );
        self.redact(event, found)
    }

    /// [`Scrubbers::scrub_event`] with the secrets of its document changes already found.
    fn redact(&self, event: &mut Envelope, doc_found: Vec<Kind>) -> Vec<Kind> {
        let scrubber = self.for_tenant(event.tenant.as_str());
        let mut kinds = self.scrub_text_and_tags(event);
        // A document change's data is automerge change bytes in base64, which no redaction
        // can rewrite (a change is named by its hash, and later changes depend on it). The
        // strings the changes write are checked instead: a change that writes a secret is
        // dropped from the event, whose `changes` is left empty (so the docs model refuses
        // it, and its dead-letter copy holds no secret). Writers using the SDK never get
        // here: their edits are redacted before the change is made.
        if event.kind == EventKind::DocChanged {
            if !doc_found.is_empty()
                && let Some(data) = event.content.data.as_mut().and_then(|d| d.as_object_mut())
            {
                data.insert("changes".into(), serde_json::Value::Array(Vec::new()));
                data.insert(
                    "redacted".into(),
                    serde_json::Value::String(format!(
                        "the changes wrote {} secret(s) and were removed; write documents through the SDK, which redacts before the change is made",
                        doc_found.len()
                    )),
                );
                kinds.extend(doc_found);
            }
        } else if let Some(data) = event.content.data.as_mut() {
            kinds.extend(scrub_json(scrubber, data));
        }
        kinds
    }
}

/// What scrubbing does with the changes of a `doc_changed` event. Decoding them inflates the
/// compressed ones (up to [`engram_schema::payload::MAX_DOC_INFLATED_BYTES`] per event), so
/// it is done once per event, by the one reader that applies them.
#[derive(Clone, Copy, Debug)]
pub enum DocChanges<'a> {
    /// Decode them and check the strings they write: what the append path does, where the
    /// event is about to be stored.
    Decode,
    /// The event's changes, already decoded by the caller
    /// ([`engram_schema::DocChanged::from_event`]): checked without decoding them again.
    Decoded(&'a [engram_schema::automerge::Change]),
    /// Leave them alone, unchecked: for a reader that never applies document changes (every
    /// read model but the docs model ignores `doc_changed` events), whose copy of the event
    /// keeps or shows nothing of them.
    Leave,
}

/// The kinds of secrets the changes of `event` write, if it is a `doc_changed` event, found
/// as `docs` says.
fn doc_secrets(scrubber: &Scrubber, event: &Envelope, docs: DocChanges<'_>) -> Vec<Kind> {
    if event.kind != EventKind::DocChanged {
        return Vec::new();
    }
    match docs {
        DocChanges::Leave => Vec::new(),
        DocChanges::Decoded(changes) => doc_change_secrets(scrubber, changes),
        // A change that does not decode holds no readable strings; the docs model refuses it.
        DocChanges::Decode => match engram_schema::DocChanged::from_event(event) {
            Ok((_, changes)) => doc_change_secrets(scrubber, &changes),
            Err(_) => Vec::new(),
        },
    }
}

/// The kinds of secrets the strings of document changes write: values put in maps and
/// lists, and text typed into a text object (one character per operation, joined back).
fn doc_change_secrets(
    scrubber: &Scrubber,
    changes: &[engram_schema::automerge::Change],
) -> Vec<Kind> {
    let text = engram_schema::DocChanged::written_text(changes);
    scrubber
        .scrub(&text)
        .redactions
        .iter()
        .map(|r| r.kind)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_reads_the_default_policy_and_per_tenant_ones() {
        let config: ScrubConfig = serde_json::from_value(serde_json::json!({
            "min_entropy_len": 24,
            "tenants": {"acme": {"enabled": false}},
        }))
        .unwrap();
        assert_eq!(config.policy.min_entropy_len, 24);
        assert!(!config.tenants["acme"].enabled);
        config.validate().unwrap();
        let scrubbers = Scrubbers::new(&config);
        let text = "db password=hunter2hunter2";
        assert!(!scrubbers.for_tenant("other").scrub(text).is_clean());
        assert!(scrubbers.for_tenant("acme").scrub(text).is_clean());
        // A misspelt key is an error, not silently ignored.
        let bad = serde_json::from_value::<ScrubConfig>(serde_json::json!({"enabeld": false}));
        assert!(bad.is_err(), "{bad:?}");
    }
}

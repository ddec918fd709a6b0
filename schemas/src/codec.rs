//! MessagePack encoding and decoding with size limits, version checks and upcasting.
//!
//! Decoding reads only `schema_version` first. The current version decodes straight into
//! [`Envelope`]; an older one goes through the registered [`Upcaster`] chain as a dynamic
//! value; a newer one is refused, since this build cannot know what it means.

use serde::Deserialize;

use crate::SCHEMA_VERSION;
use crate::envelope::Envelope;
use crate::error::SchemaError;

/// Deepest nesting of maps and arrays an encoded event may have. An envelope nests its
/// content's data two levels down, and [`crate::payload::MAX_DATA_DEPTH`] bounds that data at
/// encode, so a valid event stays far below this; anything near it is hostile. The decoders
/// recurse once per level (rmp-serde's own limit is 1024, more than a 2 MiB thread stack holds
/// in a debug build), so deeper input is refused before they see it.
pub const MAX_NESTING: usize = 64;

/// The default of [`Limits::max_event_bytes`]: 512 KiB.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 512 * 1024;

/// Size limits enforced before anything is published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest encoded envelope accepted, in bytes. Keep it below the stream's
    /// `max_msg_size` minus header room, so the server never has to be the one to refuse.
    pub max_event_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
        }
    }
}

/// Rewrites an event of version `source_version()` into version `source_version() + 1`.
///
/// Upcasters work on the dynamic MessagePack value so that the Rust type of an old version
/// need not be kept around; they must set `schema_version` on what they return.
pub trait Upcaster: Send + Sync {
    fn source_version(&self) -> u16;
    fn upcast(&self, event: rmpv::Value) -> Result<rmpv::Value, SchemaError>;
}

/// Encodes and decodes envelopes under a set of limits and upcasters.
#[derive(Default)]
pub struct Codec {
    limits: Limits,
    upcasters: Vec<Box<dyn Upcaster>>,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec")
            .field("limits", &self.limits)
            .field("upcasters", &self.upcasters.len())
            .finish()
    }
}

#[derive(Deserialize)]
struct VersionProbe {
    schema_version: Option<u16>,
}

impl Codec {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            upcasters: Vec::new(),
        }
    }

    pub fn with_upcaster(mut self, upcaster: impl Upcaster + 'static) -> Self {
        self.upcasters.push(Box::new(upcaster));
        self
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Validates and encodes; refuses events over the size limit.
    pub fn encode(&self, event: &Envelope) -> Result<Vec<u8>, SchemaError> {
        event.validate()?;
        // Sized up front: growing the buffer field by field showed up as the top cost of the
        // append path (realloc and memmove) in profiles.
        let mut bytes = Vec::with_capacity(estimated_size(event));
        rmp_serde::encode::write_named(&mut bytes, event)
            .map_err(|e| SchemaError::Malformed(format!("cannot encode event: {e}")))?;
        self.check_size(bytes.len())?;
        Ok(bytes)
    }

    /// Decodes MessagePack bytes, upcasting older versions, and validates the envelope. The
    /// payload is left to the read models that interpret it (see [`crate::payload`]).
    pub fn decode(&self, bytes: &[u8]) -> Result<Envelope, SchemaError> {
        self.check_size(bytes.len())?;
        check_nesting(bytes)?;
        let probe: VersionProbe = rmp_serde::from_slice(bytes)
            .map_err(|e| SchemaError::Malformed(format!("not a msgpack event map: {e}")))?;
        let version = probe
            .schema_version
            .ok_or_else(|| SchemaError::Malformed("missing schema_version".into()))?;
        let event = if version == SCHEMA_VERSION {
            rmp_serde::from_slice::<Envelope>(bytes)
                .map_err(|e| SchemaError::Malformed(e.to_string()))?
        } else if version > SCHEMA_VERSION {
            return Err(SchemaError::UnknownSchemaVersion {
                found: version,
                supported: SCHEMA_VERSION,
            });
        } else {
            let value = rmpv::decode::read_value(&mut &bytes[..])
                .map_err(|e| SchemaError::Malformed(e.to_string()))?;
            let value = self.upcast(version, value)?;
            // Re-encode rather than use rmpv's deserializer, which reads enums differently
            // from rmp-serde; one decoder means one set of rules for every version.
            let mut upcast = Vec::with_capacity(bytes.len());
            rmpv::encode::write_value(&mut upcast, &value)
                .map_err(|e| SchemaError::Malformed(e.to_string()))?;
            rmp_serde::from_slice::<Envelope>(&upcast)
                .map_err(|e| SchemaError::Malformed(format!("after upcasting: {e}")))?
        };
        event.validate_envelope()?;
        Ok(event)
    }

    /// Parses one JSON event as a client would write it. `event_id`, `schema_version`,
    /// `occurred_at` and `recorded_at` may be left out and are filled in here; everything
    /// else is checked as strictly as on the binary path, with the failing field named.
    pub fn decode_json(&self, json: &str) -> Result<Envelope, SchemaError> {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| SchemaError::Malformed(format!("invalid JSON: {e}")))?;
        self.decode_value(value)
    }

    /// [`Codec::decode_json`] of JSON already parsed (the HTTP gateway's batch items).
    pub fn decode_value(&self, mut value: serde_json::Value) -> Result<Envelope, SchemaError> {
        let object = value
            .as_object_mut()
            .ok_or_else(|| SchemaError::Malformed("an event must be a JSON object".into()))?;
        let now = serde_json::Value::String(chrono::Utc::now().to_rfc3339());
        object
            .entry("event_id")
            .or_insert_with(|| crate::EventId::new().to_string().into());
        object
            .entry("schema_version")
            .or_insert_with(|| SCHEMA_VERSION.into());
        object.entry("occurred_at").or_insert_with(|| now.clone());
        object.entry("recorded_at").or_insert(now);
        let version = object
            .get("schema_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| SchemaError::InvalidField {
                field: "schema_version",
                reason: "must be a positive integer".into(),
            })?;
        if version != u64::from(SCHEMA_VERSION) {
            return Err(SchemaError::UnknownSchemaVersion {
                found: u16::try_from(version).unwrap_or(u16::MAX),
                supported: SCHEMA_VERSION,
            });
        }
        let event: Envelope = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            SchemaError::Malformed(format!("field {path}: {}", e.into_inner()))
        })?;
        event.validate()?;
        self.check_size(
            rmp_serde::to_vec_named(&event)
                .map_err(|e| SchemaError::Malformed(e.to_string()))?
                .len(),
        )?;
        Ok(event)
    }

    fn upcast(&self, mut version: u16, mut value: rmpv::Value) -> Result<rmpv::Value, SchemaError> {
        while version < SCHEMA_VERSION {
            let upcaster = self
                .upcasters
                .iter()
                .find(|u| u.source_version() == version)
                .ok_or(SchemaError::UnknownSchemaVersion {
                    found: version,
                    supported: SCHEMA_VERSION,
                })?;
            value = upcaster.upcast(value)?;
            version += 1;
        }
        Ok(value)
    }

    fn check_size(&self, size: usize) -> Result<(), SchemaError> {
        if size > self.limits.max_event_bytes {
            return Err(SchemaError::TooLarge {
                size,
                max: self.limits.max_event_bytes,
            });
        }
        Ok(())
    }
}

/// Refuses MessagePack whose first value nests maps and arrays deeper than [`MAX_NESTING`].
/// A scan, not a decode: one pass, no recursion and no allocation beyond a stack of at most
/// `MAX_NESTING` counters, whatever counts the headers claim. Input that ends early passes
/// here; the decoder reports it.
fn check_nesting(bytes: &[u8]) -> Result<(), SchemaError> {
    // Values still to read in each open container; the bottom entry is the one top-level value.
    let mut open: Vec<u64> = vec![1];
    let mut at = 0usize;
    while let Some(left) = open.last_mut() {
        if *left == 0 {
            open.pop();
            continue;
        }
        *left -= 1;
        let Some(&marker) = bytes.get(at) else {
            return Ok(());
        };
        at += 1;
        let be = |n: usize| -> Option<u64> {
            let raw = bytes.get(at..at + n)?;
            Some(raw.iter().fold(0u64, |v, b| (v << 8) | u64::from(*b)))
        };
        // (bytes to skip after the marker, values this one contains)
        let (skip, children) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0..=0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(marker & 0x0f)),
            0x90..=0x9f => (0, u64::from(marker & 0x0f)),
            0xa0..=0xbf => (u64::from(marker & 0x1f), 0),
            0xc4 | 0xd9 => (1 + be(1).unwrap_or(0), 0),
            0xc5 | 0xda => (2 + be(2).unwrap_or(0), 0),
            0xc6 | 0xdb => (4 + be(4).unwrap_or(0), 0),
            0xc7 => (2 + be(1).unwrap_or(0), 0),
            0xc8 => (3 + be(2).unwrap_or(0), 0),
            0xc9 => (5 + be(4).unwrap_or(0), 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xca | 0xce | 0xd2 => (4, 0),
            0xcb | 0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (2, be(2).unwrap_or(0)),
            0xdd => (4, be(4).unwrap_or(0)),
            0xde => (2, 2 * be(2).unwrap_or(0)),
            0xdf => (4, 2 * be(4).unwrap_or(0)),
        };
        let Some(next) = usize::try_from(skip).ok().and_then(|s| at.checked_add(s)) else {
            return Ok(());
        };
        at = next;
        if children > 0 {
            // `open` holds the top-level entry plus one per open container.
            if open.len() > MAX_NESTING {
                return Err(SchemaError::Malformed(format!(
                    "maps and arrays are nested more than {MAX_NESTING} levels deep"
                )));
            }
            open.push(children);
        }
    }
    Ok(())
}

/// An upper-ish estimate of the encoded size: fixed fields and names plus the variable parts.
fn estimated_size(event: &Envelope) -> usize {
    let tags: usize = event.tags.iter().map(|t| t.len() + 2).sum();
    let vector = event
        .embedding
        .as_ref()
        .map_or(0, |e| e.vector.len() * 5 + e.model.len() + 32);
    // Structured data is not measured (that would cost a pass); 256 bytes covers the usual.
    let data = if event.content.data.is_some() { 256 } else { 0 };
    512 + event.content.text.len() + tags + vector + data
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Content, EventKind, Layer, Scope, ScopeKind};
    use crate::ident::Ident;

    fn event() -> Envelope {
        let id = |s: &str| Ident::parse("id", s).unwrap();
        let mut e = Envelope::new(
            id("acme"),
            Scope::new(ScopeKind::Task, "t-1").unwrap(),
            id("coder"),
            id("i-7"),
            Layer::Episodic,
            EventKind::Outcome,
            Content::text("tests pass after the fix"),
        );
        e.tags = vec!["ci".into()];
        e.content.data = Some(serde_json::json!({"exit_code": 0, "files": ["a.rs"]}));
        e
    }

    /// `depth` arrays, one inside the other, around a nil.
    fn nested_arrays(depth: usize) -> Vec<u8> {
        let mut bytes = vec![0x91; depth];
        bytes.push(0xc0);
        bytes
    }

    #[test]
    fn nesting_beyond_the_limit_is_refused_before_any_decoder_sees_it() {
        assert_eq!(check_nesting(&nested_arrays(MAX_NESTING)), Ok(()));
        assert!(matches!(
            check_nesting(&nested_arrays(MAX_NESTING + 1)),
            Err(SchemaError::Malformed(m)) if m.contains("nested more than 64 levels")
        ));
        // Maps count too, and a hundred thousand levels cost a scan, not a stack.
        let deep_maps: Vec<u8> = std::iter::repeat_n([0x81, 0xa1, b'k'], 100_000)
            .flatten()
            .chain([0xc0])
            .collect();
        assert!(matches!(
            Codec::default().decode(&deep_maps),
            Err(SchemaError::Malformed(m)) if m.contains("nested more than")
        ));
        // Headers that claim more than there is end the scan at the input's end.
        for lying in [
            vec![0xdd, 0xff, 0xff, 0xff, 0xff],
            vec![0xdf, 0xff, 0xff, 0xff, 0xff],
            vec![0xdb, 0xff, 0xff, 0xff, 0xff, b'a'],
            vec![0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
        ] {
            assert_eq!(check_nesting(&lying), Ok(()), "{lying:x?}");
        }
        // Siblings are not depth: a wide, shallow value passes.
        let wide: Vec<u8> = [0xdc, 0x01, 0x00]
            .into_iter()
            .chain(std::iter::repeat_n([0x91, 0xc0], 256).flatten())
            .collect();
        assert_eq!(check_nesting(&wide), Ok(()));
    }

    #[test]
    fn data_nested_deeper_than_decoding_allows_is_refused_at_encode() {
        let nest = |depth: usize| {
            (0..depth).fold(serde_json::json!(1), |inner, _| serde_json::json!([inner]))
        };
        let codec = Codec::default();
        let mut e = event();
        e.content.data = Some(nest(crate::payload::MAX_DATA_DEPTH));
        let bytes = codec.encode(&e).expect("as deep as allowed");
        assert_eq!(codec.decode(&bytes).unwrap().content.data, e.content.data);
        e.content.data = Some(nest(crate::payload::MAX_DATA_DEPTH + 1));
        assert!(matches!(
            codec.encode(&e),
            Err(SchemaError::InvalidField {
                field: "content.data",
                ..
            })
        ));
    }

    fn named_value(e: &Envelope) -> rmpv::Value {
        let bytes = rmp_serde::to_vec_named(e).unwrap();
        rmpv::decode::read_value(&mut &bytes[..]).unwrap()
    }

    #[test]
    fn a_forgotten_event_round_trips_and_a_bad_one_is_refused_naming_the_field() {
        let codec = Codec::default();
        let base = event();
        let ids = [crate::EventId::new(), crate::EventId::new()];
        let forget = Envelope::forget(
            base.tenant.clone(),
            base.scope.clone(),
            base.agent_id.clone(),
            base.instance_id.clone(),
            Layer::Episodic,
            &ids,
            "superseded",
        );
        let decoded = codec.decode(&codec.encode(&forget).unwrap()).unwrap();
        assert_eq!(decoded.forgotten_ids().unwrap(), ids);
        assert!(base.forgotten_ids().is_err(), "an outcome forgets nothing");

        let too_many: Vec<String> = (0..=crate::payload::MAX_FORGOTTEN)
            .map(|_| crate::EventId::new().to_string())
            .collect();
        for data in [
            serde_json::json!({}),
            serde_json::json!({ "event_ids": [] }),
            serde_json::json!({ "event_ids": [7] }),
            serde_json::json!({ "event_ids": ["not-an-id"] }),
            serde_json::json!({ "event_ids": too_many }),
        ] {
            let mut bad = forget.clone();
            bad.content.data = Some(data.clone());
            let err = codec.encode(&bad).unwrap_err();
            assert!(
                err.to_string().contains("event_ids") || err.to_string().contains("event id"),
                "{data}: {err}"
            );
        }
    }

    #[test]
    fn round_trips_through_msgpack() {
        let codec = Codec::default();
        let e = event();
        assert_eq!(codec.decode(&codec.encode(&e).unwrap()).unwrap(), e);
    }

    #[test]
    fn old_reader_tolerates_new_optional_fields() {
        // A newer writer of the same major version adds a field this build has never seen.
        let e = event();
        let mut value = named_value(&e);
        if let rmpv::Value::Map(entries) = &mut value {
            entries.push(("sentiment".into(), "positive".into()));
        }
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();
        assert_eq!(Codec::default().decode(&bytes).unwrap(), e);
    }

    #[test]
    fn refuses_newer_schema_versions() {
        let mut e = event();
        e.schema_version = SCHEMA_VERSION + 1;
        let bytes = rmp_serde::to_vec_named(&e).unwrap();
        assert!(matches!(
            Codec::default().decode(&bytes),
            Err(SchemaError::UnknownSchemaVersion { found, .. }) if found == SCHEMA_VERSION + 1
        ));
        assert!(matches!(
            Codec::default().encode(&e),
            Err(SchemaError::UnknownSchemaVersion { .. })
        ));
    }

    /// A pre-release format (version 0) kept the text at the top level. The upcaster hook
    /// moves it into `content` and the event then decodes as v1.
    struct TextToContent;
    impl Upcaster for TextToContent {
        fn source_version(&self) -> u16 {
            0
        }
        fn upcast(&self, event: rmpv::Value) -> Result<rmpv::Value, SchemaError> {
            let rmpv::Value::Map(entries) = event else {
                return Err(SchemaError::Malformed("v0 event is not a map".into()));
            };
            let mut out = Vec::new();
            let mut text = rmpv::Value::from("");
            for (k, v) in entries {
                match k.as_str() {
                    Some("text") => text = v,
                    Some("schema_version") => out.push((k, rmpv::Value::from(1))),
                    _ => out.push((k, v)),
                }
            }
            out.push((
                "content".into(),
                rmpv::Value::Map(vec![("text".into(), text)]),
            ));
            Ok(rmpv::Value::Map(out))
        }
    }

    #[test]
    fn upcaster_chain_lifts_old_versions() {
        let e = event();
        let mut value = named_value(&e);
        let rmpv::Value::Map(entries) = &mut value else {
            panic!("not a map")
        };
        entries.retain(|(k, _)| k.as_str() != Some("content"));
        for (k, v) in entries.iter_mut() {
            if k.as_str() == Some("schema_version") {
                *v = 0.into();
            }
        }
        entries.push(("text".into(), "legacy text".into()));
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();

        assert!(matches!(
            Codec::default().decode(&bytes),
            Err(SchemaError::UnknownSchemaVersion { found: 0, .. })
        ));
        let decoded = Codec::default()
            .with_upcaster(TextToContent)
            .decode(&bytes)
            .unwrap();
        assert_eq!(decoded.schema_version, 1);
        assert_eq!(decoded.content.text, "legacy text");
        assert_eq!(decoded.event_id, e.event_id);
    }

    #[test]
    fn rejects_oversized_events_both_ways() {
        let codec = Codec::new(Limits {
            max_event_bytes: 1024,
        });
        let mut e = event();
        e.content.text = "x".repeat(2000);
        assert!(matches!(
            codec.encode(&e),
            Err(SchemaError::TooLarge { .. })
        ));
        let bytes = Codec::default().encode(&e).unwrap();
        assert!(matches!(
            codec.decode(&bytes),
            Err(SchemaError::TooLarge { .. })
        ));
    }

    #[test]
    fn rejects_garbage_bytes() {
        let codec = Codec::default();
        assert!(matches!(
            codec.decode(b"\xc1\xff garbage"),
            Err(SchemaError::Malformed(_))
        ));
        assert!(matches!(codec.decode(&[]), Err(SchemaError::Malformed(_))));
    }

    #[test]
    fn json_input_fills_defaults_and_names_bad_fields() {
        let codec = Codec::default();
        let ok = r#"{"tenant":"acme","scope":{"kind":"task","id":"t-1"},"agent_id":"a","instance_id":"i",
                     "layer":"episodic","kind":"observation","content":{"text":"hello"}}"#;
        let e = codec.decode_json(ok).unwrap();
        assert_eq!(e.schema_version, SCHEMA_VERSION);
        assert_eq!(e.importance, 0.5);

        let wildcard = ok.replace("\"t-1\"", "\"t.*\"");
        let err = codec.decode_json(&wildcard).unwrap_err().to_string();
        assert!(err.contains("scope.id"), "{err}");

        let missing_tenant = ok.replace("\"tenant\":\"acme\",", "");
        let err = codec.decode_json(&missing_tenant).unwrap_err().to_string();
        assert!(err.contains("tenant"), "{err}");

        assert!(matches!(
            codec.decode_json(&ok.replace("{\"tenant\"", "{\"schema_version\":9,\"tenant\"")),
            Err(SchemaError::UnknownSchemaVersion { found: 9, .. })
        ));
        assert!(matches!(
            codec.decode_json("{not json"),
            Err(SchemaError::Malformed(_))
        ));
        assert!(matches!(
            codec.decode_json("[1,2]"),
            Err(SchemaError::Malformed(_))
        ));
    }
}

//! Every decoder and request type, fed arbitrary and hostile input: the event codec (MessagePack
//! and JSON, random bytes and values shaped like an envelope), each query-protocol request,
//! the fact and skill payload readers, and, live, every `engram.q.*` endpoint of a running
//! stack and every `engram.p.*.*.<partition>` one of the partition holding its memories.
//!
//! What must hold: no panic, no hang (each live request answers within a bound), every live
//! request gets a reply (a result or a typed error, never silence), and memory stays bounded.
//!
//! Cases per decoder target come from `PROPTEST_CASES`, bodies per live endpoint from
//! `ENGRAM_FUZZ_LIVE_BODIES`; the defaults keep the file under a minute in a debug build on two
//! cores. For a long run:
//! `PROPTEST_CASES=100000 ENGRAM_FUZZ_LIVE_BODIES=2000 cargo test --release -p engram-tests --test fuzz`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use engram_memory::proto::{
    self, Consistency, ContextRequest, FactsRequest, Ranking, RetrieveRequest, ScopeRequest,
    SearchRequest, SkillsRequest,
};
use engram_schema::{Codec, Content, Envelope, EventKind, Ident, Layer, Limits, Scope, ScopeKind};
use engram_testkit::TestNats;
use engram_tests::Engram;
use futures::StreamExt;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use serde::Deserialize;
use serde_json::{Value, json};

/// Cases per decoder target unless `PROPTEST_CASES` says otherwise.
const DEFAULT_CASES: u32 = 256;
/// Bodies sent to each live endpoint unless `ENGRAM_FUZZ_LIVE_BODIES` says otherwise (a few
/// thousand in all, over the endpoints).
const DEFAULT_LIVE_BODIES: u32 = 150;
/// Resident memory the test process may hold after the live run. With the stack (four
/// projectors, the query service, their caches) it sits near 100 MiB in a debug build; a reader
/// that allocated what a hostile length field asked for would blow far past this.
const MAX_RSS_MIB: f64 = 512.0;

fn cases(default: u32) -> u32 {
    env_count("PROPTEST_CASES", default)
}

fn env_count(var: &str, default: u32) -> u32 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(DEFAULT_CASES),
        // Failures are shrunk and reported by proptest itself; no regression files in the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies: hostile leaves, arbitrary JSON and MessagePack values, and values shaped like
// the real types (the right field names, random types and sizes).

/// Numbers a length, a count or a weight should never be trusted with.
fn hostile_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("json has no nan or infinity", |f| f.is_finite())
            .prop_map(Value::from),
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1e300)),
        Just(json!(-1e300)),
        Just(json!(1e-300)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(u32::MAX as u64 + 1)),
        Just(json!(65_535)),
        Just(json!(65_536)),
        Just(json!(0.5)),
        (0u64..100).prop_map(Value::from),
    ]
}

/// Strings from empty to large, with the characters identifiers and subjects forbid.
fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "[a-z0-9_-]{1,12}",
        8 => any::<String>(),
        2 => Just(String::new()),
        1 => Just(" ".into()),
        1 => Just("a.b".into()),
        1 => Just("*".into()),
        1 => Just(">".into()),
        1 => Just("task:t1".into()),
        1 => Just("NaN".into()),
        1 => Just("2026-12-01T00:00:00Z".into()),
        1 => Just("+275760-09-13T00:00:00Z".into()),
        1 => Just("\u{0}\u{ffff}\u{10ffff}".into()),
        // Huge: past every byte limit (16 KiB queries, 512 KiB events).
        1 => (1usize..600_000).prop_map(|n| "x".repeat(n)),
        1 => (1usize..2_000).prop_map(|n| "é🦀".repeat(n)),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        hostile_number(),
        hostile_string().prop_map(Value::String),
    ]
}

/// Any JSON value, nested a few levels, with object keys drawn from `keys` or at random.
fn json_value(keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 64, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((key(keys), inner), 0..8)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
}

fn key(keys: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(keys).prop_map(str::to_owned),
        1 => hostile_string(),
    ]
}

/// Shapes that stress a parser rather than a type: deep nesting and huge arrays.
fn stress_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        // Past serde_json's recursion limit (128), yet shallow enough for the test's own stack
        // to build and drop as a `Value`; deeper input is sent as raw bytes (see `bytes`).
        (1usize..400).prop_map(|depth| {
            let mut v = json!(1);
            for _ in 0..depth {
                v = json!([v]);
            }
            v
        }),
        (1usize..400).prop_map(|depth| {
            let mut v = json!("x");
            for _ in 0..depth {
                v = json!({ "a": v });
            }
            v
        }),
        (1usize..100_001).prop_map(|n| Value::Array(vec![json!(1e300); n])),
        (1usize..100_001).prop_map(|n| Value::Array(vec![json!(-1); n])),
        (1usize..20_000).prop_map(|n| Value::Array(vec![json!({"kind": "task", "id": "t"}); n])),
    ]
}

/// Field names of a type, each with a strategy for plausible values.
type Fields = &'static [(&'static str, fn() -> BoxedStrategy<Value>)];

/// A JSON object with (some of) `fields`, each either plausible or anything at all.
fn shaped_object(fields: Fields, keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let per_field: Vec<BoxedStrategy<Option<Value>>> = fields
        .iter()
        .map(|(_, plausible)| {
            prop_oneof![
                4 => plausible().prop_map(Some),
                2 => json_value(keys).prop_map(Some),
                1 => stress_value().prop_map(Some),
                1 => Just(None),
            ]
            .boxed()
        })
        .collect();
    (
        per_field,
        prop::collection::vec((key(keys), json_value(keys)), 0..3),
    )
        .prop_map(move |(values, extra)| {
            let mut object = serde_json::Map::new();
            for ((name, _), value) in fields.iter().zip(values) {
                if let Some(value) = value {
                    object.insert((*name).to_owned(), value);
                }
            }
            for (k, v) in extra {
                object.insert(k, v);
            }
            Value::Object(object)
        })
}

// Plausible values, so that decoding often succeeds and validation is reached.

fn p_ident() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => "[a-z0-9_-]{1,12}".prop_map(Value::String),
        1 => hostile_string().prop_map(Value::String),
    ]
    .boxed()
}
fn p_scope_kind() -> BoxedStrategy<Value> {
    prop::sample::select(&["org", "team", "user", "agent", "task", "session", "galaxy"][..])
        .prop_map(|k| json!(k))
        .boxed()
}
fn p_scope() -> BoxedStrategy<Value> {
    (p_scope_kind(), p_ident())
        .prop_map(|(kind, id)| json!({"kind": kind, "id": id}))
        .boxed()
}
fn p_scopes() -> BoxedStrategy<Value> {
    prop::collection::vec(p_scope(), 0..8)
        .prop_map(Value::Array)
        .boxed()
}
fn p_scope_keys() -> BoxedStrategy<Value> {
    prop::collection::vec((p_ident(), p_scope_kind(), p_ident()), 0..8)
        .prop_map(|keys| {
            Value::Array(
                keys.into_iter()
                    .map(|(tenant, kind, id)| json!({"tenant": tenant, "kind": kind, "id": id}))
                    .collect(),
            )
        })
        .boxed()
}
fn p_text() -> BoxedStrategy<Value> {
    hostile_string().prop_map(Value::String).boxed()
}
fn p_count() -> BoxedStrategy<Value> {
    prop_oneof![(0u64..2_000).prop_map(Value::from), hostile_number()].boxed()
}
fn p_float() -> BoxedStrategy<Value> {
    prop_oneof![(0.0f64..2.0).prop_map(Value::from), hostile_number()].boxed()
}
fn p_vector() -> BoxedStrategy<Value> {
    prop_oneof![
        prop::collection::vec(-1.0f32..1.0, 0..80).prop_map(|v| json!(v)),
        (0usize..70_000).prop_map(|n| json!(vec![1e30f32; n])),
        Just(Value::Null),
    ]
    .boxed()
}
fn p_time() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(json!("2026-12-01T00:00:00Z")),
        Just(json!("1970-01-01T00:00:00Z")),
        Just(json!("+262142-12-31T23:59:59Z")),
        Just(json!("-262143-01-01T00:00:00Z")),
        hostile_string().prop_map(Value::String),
    ]
    .boxed()
}
fn p_bool() -> BoxedStrategy<Value> {
    any::<bool>().prop_map(Value::Bool).boxed()
}
fn p_filter() -> BoxedStrategy<Value> {
    (
        prop::collection::vec(
            prop::sample::select(&["episodic", "semantic", "working", "procedural", "x"][..]),
            0..70,
        ),
        prop::collection::vec(
            prop::sample::select(&["observation", "fact_asserted", "forgotten", "x"][..]),
            0..70,
        ),
        prop::collection::vec(hostile_string(), 0..70),
        prop::option::of(p_time()),
        prop::option::of(p_float()),
    )
        .prop_map(|(layers, kinds, tags, since, min_importance)| {
            json!({"layers": layers, "kinds": kinds, "tags": tags, "since": since, "min_importance": min_importance})
        })
        .boxed()
}
fn p_mode() -> BoxedStrategy<Value> {
    prop::sample::select(&["hybrid", "dense", "keyword", "sparse"][..])
        .prop_map(|m| json!(m))
        .boxed()
}
fn p_ranking() -> BoxedStrategy<Value> {
    (
        prop::sample::select(&["rrf", "weighted", "linear", "x"][..]),
        p_float(),
        p_float(),
        p_count(),
        p_float(),
        p_float(),
        p_float(),
        p_float(),
        p_float(),
    )
        .prop_map(|(fusion, kw, rrf, cf, half, rw, iw, dw, dh)| {
            json!({"fusion": fusion, "keyword_weight": kw, "rrf_k": rrf, "candidates_factor": cf,
                   "recency_half_life_hours": half, "recency_weight": rw, "importance_weight": iw,
                   "date_weight": dw, "date_half_life_days": dh})
        })
        .boxed()
}
fn p_seqs() -> BoxedStrategy<Value> {
    prop_oneof![
        prop::collection::vec(any::<u64>(), 0..50).prop_map(|v| json!(v)),
        (0usize..10_000).prop_map(|n| json!(vec![1u64; n])),
    ]
    .boxed()
}

/// Every field name of every request type, used as random object keys too.
const REQUEST_KEYS: &[&str] = &[
    "tenant",
    "scope",
    "grants",
    "query",
    "vector",
    "top_k",
    "filter",
    "min_seq",
    "wait_ms",
    "mode",
    "ranking",
    "agent_id",
    "task",
    "token_budget",
    "subject",
    "predicate",
    "text",
    "valid_at",
    "known_at",
    "history",
    "limit",
    "name",
    "scopes",
    "k",
    "score_also",
    "kind",
    "id",
    "layers",
    "kinds",
    "tags",
    "fusion",
];

const SCOPE_FIELDS: Fields = &[
    ("tenant", p_ident),
    ("scope", p_scope),
    ("grants", p_scopes),
    ("min_seq", p_count),
    ("wait_ms", p_count),
];
const RETRIEVE_FIELDS: Fields = &[
    ("tenant", p_ident),
    ("scope", p_scope),
    ("grants", p_scopes),
    ("query", p_text),
    ("vector", p_vector),
    ("top_k", p_count),
    ("filter", p_filter),
    ("min_seq", p_count),
    ("wait_ms", p_count),
    ("mode", p_mode),
    ("ranking", p_ranking),
];
const CONTEXT_FIELDS: Fields = &[
    ("tenant", p_ident),
    ("scope", p_scope),
    ("grants", p_scopes),
    ("agent_id", p_ident),
    ("task", p_text),
    ("query", p_text),
    ("vector", p_vector),
    ("token_budget", p_count),
    ("min_seq", p_count),
    ("wait_ms", p_count),
];
const FACTS_FIELDS: Fields = &[
    ("tenant", p_ident),
    ("scope", p_scope),
    ("grants", p_scopes),
    ("subject", p_text),
    ("predicate", p_text),
    ("text", p_text),
    ("valid_at", p_time),
    ("known_at", p_time),
    ("history", p_bool),
    ("limit", p_count),
    ("min_seq", p_count),
    ("wait_ms", p_count),
];
const SKILLS_FIELDS: Fields = &[
    ("tenant", p_ident),
    ("scope", p_scope),
    ("grants", p_scopes),
    ("task", p_text),
    ("name", p_text),
    ("limit", p_count),
    ("min_seq", p_count),
    ("wait_ms", p_count),
];
const SEARCH_FIELDS: Fields = &[
    ("scopes", p_scope_keys),
    ("query", p_text),
    ("vector", p_vector),
    ("k", p_count),
    ("filter", p_filter),
    ("min_seq", p_count),
    ("wait_ms", p_count),
    ("score_also", p_seqs),
];
const RANKING_FIELDS: Fields = &[
    ("fusion", p_mode),
    ("keyword_weight", p_float),
    ("rrf_k", p_float),
    ("candidates_factor", p_count),
    ("recency_half_life_hours", p_float),
    ("recency_weight", p_float),
    ("importance_weight", p_float),
    ("date_weight", p_float),
    ("date_half_life_days", p_float),
];

/// Arbitrary bytes, some of them almost-JSON.
fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..2_048),
        json_value(REQUEST_KEYS).prop_map(|v| {
            let mut b = serde_json::to_vec(&v).unwrap();
            // Cut it somewhere: truncated and unbalanced input.
            let cut = b.len() / 2;
            b.truncate(cut);
            b
        }),
        Just(b"[".repeat(100_000)),
        Just(b"{\"a\":".repeat(50_000)),
        Just(b"1e99999999".to_vec()),
        Just(b"-0.0e-99999999999".to_vec()),
    ]
}

// ---------------------------------------------------------------------------------------------
// The event codec.

const ENVELOPE_FIELDS: Fields = &[
    ("event_id", p_event_id),
    ("schema_version", p_version),
    ("tenant", p_ident),
    ("scope", p_scope),
    ("agent_id", p_ident),
    ("instance_id", p_ident),
    ("layer", p_layer),
    ("kind", p_kind),
    ("occurred_at", p_time),
    ("recorded_at", p_time),
    ("importance", p_float),
    ("tags", p_tags),
    ("content", p_content),
    ("embedding", p_embedding),
    ("causation_id", p_event_id),
    ("correlation_id", p_text),
];

const ENVELOPE_KEYS: &[&str] = &[
    "event_id",
    "schema_version",
    "tenant",
    "scope",
    "agent_id",
    "instance_id",
    "layer",
    "kind",
    "occurred_at",
    "recorded_at",
    "importance",
    "tags",
    "content",
    "text",
    "data",
    "embedding",
    "model",
    "vector",
    "causation_id",
    "correlation_id",
    "id",
];

fn p_event_id() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(json!(engram_schema::EventId::new().as_str())),
        Just(json!("01ARZ3NDEKTSV4RRFFQ69G5FAV")),
        hostile_string().prop_map(Value::String),
    ]
    .boxed()
}
fn p_version() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => Just(json!(engram_schema::SCHEMA_VERSION)),
        1 => Just(json!(0)),
        1 => (2u64..70_000).prop_map(Value::from),
        1 => hostile_number(),
    ]
    .boxed()
}
fn p_layer() -> BoxedStrategy<Value> {
    prop::sample::select(&["episodic", "semantic", "working", "procedural", "limbic"][..])
        .prop_map(|l| json!(l))
        .boxed()
}
fn p_kind() -> BoxedStrategy<Value> {
    prop::sample::select(
        &[
            "observation",
            "action",
            "outcome",
            "fact_asserted",
            "fact_retracted",
            "preference",
            "skill_recorded",
            "outcome_x",
            "feedback",
            "forgotten",
            "dreamt",
        ][..],
    )
    .prop_map(|k| json!(k))
    .boxed()
}
fn p_tags() -> BoxedStrategy<Value> {
    prop::collection::vec(hostile_string(), 0..40)
        .prop_map(|t| json!(t))
        .boxed()
}
fn p_content() -> BoxedStrategy<Value> {
    (p_text(), prop::option::of(payload_data()))
        .prop_map(|(text, data)| json!({"text": text, "data": data}))
        .boxed()
}
fn p_embedding() -> BoxedStrategy<Value> {
    (p_text(), p_vector())
        .prop_map(|(model, vector)| json!({"model": model, "vector": vector}))
        .boxed()
}

fn codec() -> Codec {
    Codec::new(Limits::default())
}

/// Decoding anything must end in a valid envelope or a typed error; a decoded envelope's
/// payload is then read and validated, and if that passes it must survive a round trip.
fn check_decoded(result: Result<Envelope, engram_schema::SchemaError>) {
    if let Ok(event) = result {
        event
            .validate_envelope()
            .expect("decode returned an envelope that does not validate");
        let _ = event.forgotten_ids();
        let _ = engram_schema::payload::Payload::of(&event);
        if event.validate().is_ok()
            && let Ok(bytes) = codec().encode(&event)
        {
            let again = codec().decode(&bytes).expect("an encoded event decodes");
            assert_eq!(again.event_id, event.event_id);
        }
    }
}

/// A MessagePack value of any type, NaN, binary and extension types included.
fn msgpack_leaf() -> impl Strategy<Value = rmpv::Value> {
    prop_oneof![
        Just(rmpv::Value::Nil),
        any::<bool>().prop_map(rmpv::Value::Boolean),
        any::<i64>().prop_map(rmpv::Value::from),
        any::<u64>().prop_map(rmpv::Value::from),
        any::<f64>().prop_map(rmpv::Value::F64),
        any::<f32>().prop_map(rmpv::Value::F32),
        Just(rmpv::Value::F64(f64::NAN)),
        Just(rmpv::Value::F64(f64::INFINITY)),
        hostile_string().prop_map(rmpv::Value::from),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(rmpv::Value::Binary),
        (any::<i8>(), prop::collection::vec(any::<u8>(), 0..16))
            .prop_map(|(t, d)| rmpv::Value::Ext(t, d)),
    ]
}

fn msgpack_value() -> impl Strategy<Value = rmpv::Value> {
    msgpack_leaf().prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(rmpv::Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        3 => prop::sample::select(ENVELOPE_KEYS).prop_map(rmpv::Value::from),
                        1 => inner.clone(),
                    ],
                    inner
                ),
                0..8
            )
            .prop_map(rmpv::Value::Map),
        ]
    })
}

/// A MessagePack map with the envelope's field names: some from plausible JSON (so that
/// decoding gets far), some of any MessagePack type.
fn shaped_msgpack() -> impl Strategy<Value = Vec<u8>> {
    (
        shaped_object(ENVELOPE_FIELDS, ENVELOPE_KEYS),
        prop::collection::vec((prop::sample::select(ENVELOPE_KEYS), msgpack_value()), 0..4),
        prop::option::of(msgpack_leaf()),
    )
        .prop_map(|(object, overrides, version)| {
            let mut map: Vec<(rmpv::Value, rmpv::Value)> = match json_to_msgpack(&object) {
                rmpv::Value::Map(map) => map,
                _ => unreachable!("shaped_object makes objects"),
            };
            for (name, value) in overrides {
                map.retain(|(k, _)| k.as_str() != Some(name));
                map.push((rmpv::Value::from(name), value));
            }
            if let Some(version) = version {
                map.retain(|(k, _)| k.as_str() != Some("schema_version"));
                map.push((rmpv::Value::from("schema_version"), version));
            }
            let mut bytes = Vec::new();
            rmpv::encode::write_value(&mut bytes, &rmpv::Value::Map(map)).unwrap();
            bytes
        })
}

fn json_to_msgpack(value: &Value) -> rmpv::Value {
    match value {
        Value::Null => rmpv::Value::Nil,
        Value::Bool(b) => rmpv::Value::Boolean(*b),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                rmpv::Value::from(u)
            } else if let Some(i) = n.as_i64() {
                rmpv::Value::from(i)
            } else {
                rmpv::Value::F64(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => rmpv::Value::from(s.as_str()),
        Value::Array(a) => rmpv::Value::Array(a.iter().map(json_to_msgpack).collect()),
        Value::Object(o) => rmpv::Value::Map(
            o.iter()
                .map(|(k, v)| (rmpv::Value::from(k.as_str()), json_to_msgpack(v)))
                .collect(),
        ),
    }
}

/// MessagePack that claims to hold far more than it does: a map or array header with a count
/// of 2^32 - 1, a string of 4 GiB, nesting a hundred thousand deep.
fn lying_msgpack() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(vec![0xdf, 0xff, 0xff, 0xff, 0xff]),
        Just(vec![0xdd, 0xff, 0xff, 0xff, 0xff]),
        Just(vec![0xdb, 0xff, 0xff, 0xff, 0xff, b'a']),
        Just(vec![0xc6, 0xff, 0xff, 0xff, 0xff]),
        (1usize..100_000).prop_map(|n| vec![0x91; n]),
        (1usize..100_000).prop_map(|n| {
            // {"schema_version": 0, "x": [[[[...]]]]}: reaches the upcasting path.
            let mut b = vec![0x82];
            rmpv::encode::write_value(&mut b, &rmpv::Value::from("schema_version")).unwrap();
            b.push(0x00);
            rmpv::encode::write_value(&mut b, &rmpv::Value::from("x")).unwrap();
            b.extend(std::iter::repeat_n(0x91, n));
            b.push(0xc0);
            b
        }),
        (1usize..100_000).prop_map(|n| {
            // The same with the current version, reaching the typed decoder.
            let mut b = vec![0x82];
            rmpv::encode::write_value(&mut b, &rmpv::Value::from("schema_version")).unwrap();
            b.push(engram_schema::SCHEMA_VERSION as u8);
            rmpv::encode::write_value(&mut b, &rmpv::Value::from("content")).unwrap();
            b.extend(std::iter::repeat_n(0x81, n).flat_map(|m| [m, 0xa1, b'a']));
            b.push(0xc0);
            b
        }),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn codec_decodes_arbitrary_bytes(bytes in bytes()) {
        check_decoded(codec().decode(&bytes));
    }

    #[test]
    fn codec_decodes_arbitrary_msgpack(value in msgpack_value()) {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &value).unwrap();
        check_decoded(codec().decode(&bytes));
    }

    #[test]
    fn codec_decodes_msgpack_shaped_like_an_envelope(bytes in shaped_msgpack()) {
        check_decoded(codec().decode(&bytes));
    }

    #[test]
    fn codec_decodes_lying_msgpack(bytes in lying_msgpack()) {
        check_decoded(codec().decode(&bytes));
    }

    #[test]
    fn json_shaped_like_an_envelope_decodes_or_is_refused(
        value in shaped_object(ENVELOPE_FIELDS, ENVELOPE_KEYS)
    ) {
        // The CLI reads events as JSON; the bus then encodes them.
        let bytes = serde_json::to_vec(&value).unwrap();
        if let Ok(event) = serde_json::from_slice::<Envelope>(&bytes)
            && event.validate().is_ok()
        {
            let encoded = codec().encode(&event);
            if let Ok(encoded) = encoded {
                let decoded = codec().decode(&encoded).expect("an encoded event decodes");
                prop_assert_eq!(decoded.event_id, event.event_id);
            }
        }
        // And the same value as MessagePack, through the codec.
        let mut msgpack = Vec::new();
        rmpv::encode::write_value(&mut msgpack, &json_to_msgpack(&value)).unwrap();
        check_decoded(codec().decode(&msgpack));
    }
}

// ---------------------------------------------------------------------------------------------
// Query-protocol requests.

/// Decodes `bytes` as `T`; if that works, runs every check the service runs.
fn check_request<T: for<'de> Deserialize<'de>>(bytes: &[u8], checks: impl Fn(&T)) {
    if let Ok(request) = serde_json::from_slice::<T>(bytes) {
        checks(&request);
    }
}

fn check_scopes(scopes: &ScopeRequest) {
    if let Ok(keys) = scopes.resolve() {
        assert!(!keys.is_empty() && keys.len() <= 1 + scopes.grants.len());
    }
}

fn check_retrieve(r: &RetrieveRequest) {
    check_scopes(&r.scopes);
    if r.validate(proto::limits::MAX_TOP_K).is_ok() {
        // What validation lets through must be safe to size by.
        let depth = r.ranking.clone().unwrap_or_default().depth(r.top_k);
        assert!(depth <= proto::limits::MAX_SEARCH_K);
    }
}
fn check_context(r: &ContextRequest) {
    check_scopes(&r.scopes);
    let _ = r.validate();
}
fn check_facts(r: &FactsRequest) {
    check_scopes(&r.scopes);
    let _ = r.validate();
}
fn check_skills(r: &SkillsRequest) {
    check_scopes(&r.scopes);
    let _ = r.validate();
}
fn check_search(r: &SearchRequest) {
    let _ = r.validate();
}
fn check_consistency(r: &Consistency) {
    let _ = r.validate();
}
fn check_ranking(r: &Ranking) {
    if r.validate().is_ok() {
        assert!(r.depth(usize::MAX) <= proto::limits::MAX_SEARCH_K);
    }
}

/// Every request type, from the same bytes.
fn check_all_requests(bytes: &[u8]) {
    check_request(bytes, check_retrieve);
    check_request(bytes, check_context);
    check_request(bytes, check_facts);
    check_request(bytes, check_skills);
    check_request(bytes, check_search);
    check_request(bytes, check_consistency);
    check_request(bytes, check_ranking);
    check_request(bytes, check_scopes);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn requests_decode_arbitrary_bytes(bytes in bytes()) {
        check_all_requests(&bytes);
    }

    #[test]
    fn requests_decode_arbitrary_json(value in json_value(REQUEST_KEYS)) {
        check_all_requests(&serde_json::to_vec(&value).unwrap());
    }

    #[test]
    fn retrieve_requests_shaped_json(value in shaped_object(RETRIEVE_FIELDS, REQUEST_KEYS)) {
        check_request(&serde_json::to_vec(&value).unwrap(), check_retrieve);
    }

    #[test]
    fn context_requests_shaped_json(value in shaped_object(CONTEXT_FIELDS, REQUEST_KEYS)) {
        check_request(&serde_json::to_vec(&value).unwrap(), check_context);
    }

    #[test]
    fn facts_requests_shaped_json(value in shaped_object(FACTS_FIELDS, REQUEST_KEYS)) {
        check_request(&serde_json::to_vec(&value).unwrap(), check_facts);
    }

    #[test]
    fn skills_requests_shaped_json(value in shaped_object(SKILLS_FIELDS, REQUEST_KEYS)) {
        check_request(&serde_json::to_vec(&value).unwrap(), check_skills);
    }

    #[test]
    fn search_requests_shaped_json(value in shaped_object(SEARCH_FIELDS, REQUEST_KEYS)) {
        check_request(&serde_json::to_vec(&value).unwrap(), check_search);
    }

    #[test]
    fn consistency_and_scopes_shaped_json(value in shaped_object(SCOPE_FIELDS, REQUEST_KEYS)) {
        let bytes = serde_json::to_vec(&value).unwrap();
        check_request(&bytes, check_consistency);
        check_request(&bytes, check_scopes);
    }

    #[test]
    fn rankings_shaped_json(value in shaped_object(RANKING_FIELDS, REQUEST_KEYS)) {
        check_request(&serde_json::to_vec(&value).unwrap(), check_ranking);
    }
}

// ---------------------------------------------------------------------------------------------
// Fact and skill payloads, through the tables that read them.

const PAYLOAD_KEYS: &[&str] = &[
    "subject",
    "predicate",
    "object",
    "valid_from",
    "valid_to",
    "confidence",
    "cardinality",
    "name",
    "description",
    "version",
    "steps",
    "script",
    "preconditions",
    "skill",
    "success",
    "event_ids",
];

const PAYLOAD_FIELDS: Fields = &[
    ("subject", p_term),
    ("predicate", p_term),
    ("object", p_object),
    ("valid_from", p_time),
    ("valid_to", p_time),
    ("confidence", p_float),
    ("cardinality", p_cardinality),
    ("name", p_term),
    ("description", p_text),
    ("version", p_count),
    ("steps", p_tags),
    ("script", p_text),
    ("preconditions", p_tags),
    ("skill", p_term),
    ("success", p_bool),
    ("event_ids", p_event_ids),
];

fn p_term() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => prop::sample::select(&["db", "login", "deploy", "colour"][..]).prop_map(|t| json!(t)),
        1 => hostile_string().prop_map(Value::String),
    ]
    .boxed()
}
fn p_object() -> BoxedStrategy<Value> {
    prop_oneof![
        prop::sample::select(&["postgres", "blue"][..]).prop_map(|t| json!(t)),
        json_value(PAYLOAD_KEYS),
    ]
    .boxed()
}
fn p_cardinality() -> BoxedStrategy<Value> {
    prop::sample::select(&["single", "multi", "many"][..])
        .prop_map(|c| json!(c))
        .boxed()
}
fn p_event_ids() -> BoxedStrategy<Value> {
    prop_oneof![
        prop::collection::vec(p_event_id(), 0..5).prop_map(Value::Array),
        (0usize..5_000)
            .prop_map(|n| json!(vec![engram_schema::EventId::new().as_str().to_owned(); n])),
    ]
    .boxed()
}

fn payload_data() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => shaped_object(PAYLOAD_FIELDS, PAYLOAD_KEYS),
        1 => json_value(PAYLOAD_KEYS),
    ]
}

const PAYLOAD_KINDS: [EventKind; 6] = [
    EventKind::FactAsserted,
    EventKind::FactRetracted,
    EventKind::SkillRecorded,
    EventKind::Outcome,
    EventKind::Forgotten,
    EventKind::Observation,
];

fn payload_event(kind: usize, data: Value, scope: usize) -> Envelope {
    let ident = |s: &str| Ident::parse("test", s).unwrap();
    let kind = PAYLOAD_KINDS[kind % PAYLOAD_KINDS.len()];
    let layer = match kind {
        EventKind::SkillRecorded | EventKind::Outcome => Layer::Procedural,
        EventKind::Observation => Layer::Episodic,
        _ => Layer::Semantic,
    };
    let mut event = Envelope::new(
        ident("acme"),
        Scope::new(ScopeKind::Task, &format!("t{}", scope % 2)).unwrap(),
        ident("agent"),
        ident("i-1"),
        layer,
        kind,
        Content {
            text: "payload".into(),
            data: Some(data),
        },
    );
    event.importance = 0.5;
    event
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fact_and_skill_payloads_apply_or_are_refused(
        events in prop::collection::vec((0usize..6, payload_data(), 0usize..2), 1..12)
    ) {
        let mut facts = engram_facts::FactTable::new();
        let mut skills = engram_skills::SkillRegistry::new();
        for (seq, (kind, data, scope)) in events.into_iter().enumerate() {
            let event = payload_event(kind, data, scope);
            let seq = seq as u64 + 1;
            let _ = engram_schema::payload::Payload::of(&event);
            // A refused event changes nothing: not the state, not the applied sequence.
            let before = facts.state_hash();
            if let Err(e) = facts.apply(seq, &event) {
                prop_assert_eq!(facts.state_hash(), before, "the facts changed on a refusal: {}", e);
            }
            let before = skills.state_hash();
            if let Err(e) = skills.apply(seq, &event) {
                prop_assert_eq!(skills.state_hash(), before, "the skills changed on a refusal: {}", e);
            }
            let _ = event.forgotten_ids();
        }
        // And the tables still answer, over whatever went in.
        let scopes: Vec<engram_memory::ScopeKey> = (0..2)
            .map(|i| engram_memory::ScopeKey::new(
                Ident::parse("test", "acme").unwrap(),
                Scope::new(ScopeKind::Task, &format!("t{i}")).unwrap(),
            ))
            .collect();
        let _ = facts.search(&scopes, "db login", 10);
        let _ = facts.history(&scopes[0], "db", "colour");
        let _ = facts.state_hash();
        let _ = skills.get(&scopes[0], "deploy");
        let _ = skills.versions(&scopes[0], "deploy");
        let _ = skills.state_hash();
    }
}

// ---------------------------------------------------------------------------------------------
// Live: every endpoint of a running stack.

/// Every endpoint a client can reach: the query service and each projector's on `partition`
/// (every partition's instance serves the same code).
fn endpoints(partition: u32) -> Vec<String> {
    let mut all: Vec<String> = [proto::RETRIEVE, proto::CONTEXT, proto::FACTS, proto::SKILLS]
        .map(str::to_owned)
        .to_vec();
    for (projector, op) in [
        ("vector", "search"),
        ("keyword", "search"),
        ("facts", "query"),
        ("skills", "search"),
    ] {
        all.push(proto::partition_subject(projector, op, partition));
    }
    for projector in ["vector", "keyword", "facts", "skills"] {
        for op in ["status", "ledger"] {
            all.push(proto::partition_subject(projector, op, partition));
        }
    }
    all
}

/// Bodies for the live run: random bytes, random JSON, and hostile JSON shaped like each
/// request, all within the server's 1 MiB payload limit.
fn live_body() -> impl Strategy<Value = Vec<u8>> {
    let shaped = |fields: Fields| {
        shaped_object(fields, REQUEST_KEYS).prop_map(|v| serde_json::to_vec(&v).unwrap())
    };
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..512),
        1 => json_value(REQUEST_KEYS).prop_map(|v| serde_json::to_vec(&v).unwrap()),
        1 => stress_value().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        2 => shaped(RETRIEVE_FIELDS),
        1 => shaped(CONTEXT_FIELDS),
        1 => shaped(FACTS_FIELDS),
        1 => shaped(SKILLS_FIELDS),
        2 => shaped(SEARCH_FIELDS),
        1 => shaped(SCOPE_FIELDS),
    ]
    .prop_filter("fits in a nats message", |b| b.len() < 900 * 1024)
}

/// Resident memory of this process in MiB, from `/proc/self/status`.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .expect("VmRSS in /proc/self/status")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kb / 1024.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_answers_every_body() {
    // Given a running stack with a few memories
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let scope = Scope::new(ScopeKind::Task, "fuzz").unwrap();
    let mut last = 0;
    for i in 0..5 {
        let text = format!("fuzz memory {i} about the login page");
        let mut event = Envelope::new(
            Ident::parse("test", "acme").unwrap(),
            scope.clone(),
            Ident::parse("test", "agent").unwrap(),
            Ident::parse("test", "i-1").unwrap(),
            Layer::Episodic,
            EventKind::Observation,
            Content::text(&text),
        );
        event.embedding = Some(engram_schema::Embedding {
            model: engram_tests::embedder_model(),
            vector: engram_tests::embedder().embed_one(&text),
        });
        last = engram.client.append(&event).await.unwrap().seq;
    }
    let client = async_nats::connect(nats.url()).await.unwrap();
    let rss_before = rss_mib();

    // When every endpoint gets arbitrary bodies
    let per_endpoint = env_count("ENGRAM_FUZZ_LIVE_BODIES", DEFAULT_LIVE_BODIES) as usize;
    let partitions = nats.bus().await.config().stream.partitions;
    let partition =
        engram_memory::ScopeKey::new(Ident::parse("test", "acme").unwrap(), scope.clone())
            .partition(partitions);
    let subjects = endpoints(partition);
    let total = subjects.len() * per_endpoint;
    // Bodies are made as they are sent, not up front: thousands of bodies of up to 900 KiB
    // held at once would measure the test, not the services.
    let mut runner = TestRunner::new(Config::default());
    let strategy = live_body();
    let requests = (0..total).map(move |i| {
        let body = strategy.new_tree(&mut runner).unwrap().current();
        (subjects[i % subjects.len()].clone(), body)
    });
    let answered = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicUsize::new(0));
    let silent: Vec<String> = futures::stream::iter(requests)
        .map(|(subject, body)| {
            let (client, answered, errors) = (client.clone(), answered.clone(), errors.clone());
            async move {
                let request = async_nats::Request::new()
                    .payload(body.clone().into())
                    // Longer than the longest read-your-writes wait a request may ask for.
                    .timeout(Some(Duration::from_millis(
                        proto::limits::MAX_WAIT_MS + 15_000,
                    )));
                match client.send_request(subject.clone(), request).await {
                    Ok(reply) => {
                        answered.fetch_add(1, Ordering::Relaxed);
                        let is_error = reply
                            .headers
                            .as_ref()
                            .is_some_and(|h| h.get("Nats-Service-Error-Code").is_some());
                        if is_error {
                            errors.fetch_add(1, Ordering::Relaxed);
                            // A typed error: a known code and a JSON body saying why.
                            let code: usize = reply
                                .headers
                                .as_ref()
                                .unwrap()
                                .get("Nats-Service-Error-Code")
                                .unwrap()
                                .as_str()
                                .parse()
                                .unwrap_or(0);
                            assert!(
                                [400, 408, 429, 503].contains(&code),
                                "{subject} answered code {code} to {}: {}",
                                String::from_utf8_lossy(&body[..body.len().min(300)]),
                                String::from_utf8_lossy(&reply.payload),
                            );
                        } else {
                            assert!(
                                serde_json::from_slice::<Value>(&reply.payload).is_ok(),
                                "{subject} answered a body that is not json"
                            );
                        }
                        None
                    }
                    Err(e) => Some(format!(
                        "{subject}: {e} for {}",
                        String::from_utf8_lossy(&body[..body.len().min(300)])
                    )),
                }
            }
        })
        .buffer_unordered(32)
        .filter_map(|r| async move { r })
        .collect()
        .await;

    // Then every one was answered
    assert!(
        silent.is_empty(),
        "{} of {total} unanswered: {:#?}",
        silent.len(),
        &silent[..silent.len().min(10)]
    );
    assert_eq!(answered.load(Ordering::Relaxed), total);
    let rss_after = rss_mib();
    eprintln!(
        "fuzz live: {total} bodies over {} endpoints, {} typed errors; rss {rss_before:.0} MiB before, {rss_after:.0} MiB after",
        endpoints(partition).len(),
        errors.load(Ordering::Relaxed)
    );

    // And memory stayed bounded
    assert!(
        rss_after < MAX_RSS_MIB,
        "rss grew to {rss_after:.0} MiB (from {rss_before:.0} MiB)"
    );

    // And an ordinary retrieval still answers
    let response = engram
        .client
        .retrieve(&RetrieveRequest {
            scopes: ScopeRequest {
                tenant: Ident::parse("test", "acme").unwrap(),
                scope: scope.clone(),
                grants: vec![],
            },
            query: "login page".into(),
            vector: Some(engram_tests::embedder().embed_one("login page")),
            top_k: 3,
            filter: Default::default(),
            consistency: Consistency {
                min_seq: Some(last),
                wait_ms: Some(10_000),
            },
            mode: Default::default(),
            ranking: None,
        })
        .await
        .unwrap();
    assert!(!response.results.is_empty());
    engram.stop().await;
}

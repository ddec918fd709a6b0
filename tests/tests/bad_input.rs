//! Every kind of bad input gets a typed error, and nothing is written to the stream.

use std::time::Duration;

use engram_bus::{AppendError, AppendOptions, BusConfig, BusError};
use engram_schema::{Codec, Limits, SchemaError};
use engram_testkit::{TestNats, event};

const VALID: &str = r#"{"tenant":"acme","scope":{"kind":"task","id":"t-1"},"agent_id":"a","instance_id":"i",
    "layer":"episodic","kind":"observation","content":{"text":"hello"}}"#;

/// Which kind of [`SchemaError`] a case must produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Malformed,
    UnknownSchemaVersion,
    InvalidField,
}

impl Kind {
    fn of(err: &SchemaError) -> Option<Kind> {
        match err {
            SchemaError::Malformed(_) => Some(Kind::Malformed),
            SchemaError::UnknownSchemaVersion { .. } => Some(Kind::UnknownSchemaVersion),
            SchemaError::InvalidField { .. } => Some(Kind::InvalidField),
            _ => None,
        }
    }
}

/// The field an error names: its `field`, or for a malformed event the path the decoder
/// stopped at (`field scope.id: ...`), or the field it found missing.
fn named_field(err: &SchemaError) -> Option<String> {
    match err {
        SchemaError::InvalidField { field, .. } | SchemaError::InvalidIdent { field, .. } => {
            Some((*field).to_owned())
        }
        SchemaError::UnknownSchemaVersion { .. } => Some("schema_version".to_owned()),
        SchemaError::Malformed(message) => {
            let rest = message.strip_prefix("field ")?;
            let (path, reason) = rest.split_once(": ")?;
            if path != "." {
                return Some(path.to_owned());
            }
            let missing = reason.strip_prefix("missing field `")?;
            Some(missing.split('`').next()?.to_owned())
        }
        _ => None,
    }
}

async fn stream_messages(bus: &engram_bus::Bus) -> u64 {
    bus.stream_summary().await.unwrap().messages
}

#[tokio::test]
async fn malformed_json_and_msgpack_are_rejected() {
    let codec = Codec::default();
    for bad in ["", "{", "not json", "[]", "42", r#"{"tenant": 5}"#] {
        assert!(
            matches!(codec.decode_json(bad), Err(SchemaError::Malformed(_))),
            "{bad:?}"
        );
    }
    // msgpack: garbage, a wrong type, a map without schema_version, a truncated event.
    let good = codec.encode(&event("acme", "t1", "x")).unwrap();
    let no_version = rmp_serde::to_vec_named(&serde_json::json!({"tenant": "acme"})).unwrap();
    for bad in [
        b"\xde\xad\xbe\xef".to_vec(),
        rmp_serde::to_vec(&42).unwrap(),
        no_version,
        good[..good.len() / 2].to_vec(),
    ] {
        assert!(
            matches!(codec.decode(&bad), Err(SchemaError::Malformed(_))),
            "{bad:?}"
        );
    }
}

#[tokio::test]
async fn invalid_events_are_refused_before_anything_is_written() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let codec = Codec::default();

    // (what, event, the error's kind, the field it names)
    let cases: Vec<(&str, String, Kind, &str)> = vec![
        (
            "unknown schema version",
            VALID.replacen('{', r#"{"schema_version":2,"#, 1),
            Kind::UnknownSchemaVersion,
            "schema_version",
        ),
        (
            "wildcard tenant",
            VALID.replace(r#""acme""#, r#""acme.*""#),
            Kind::Malformed,
            "tenant",
        ),
        (
            "full wildcard scope id",
            VALID.replace(r#""t-1""#, r#"">""#),
            Kind::Malformed,
            "scope.id",
        ),
        (
            "dot in agent id",
            VALID.replace(r#""agent_id":"a""#, r#""agent_id":"a.b""#),
            Kind::Malformed,
            "agent_id",
        ),
        (
            "whitespace in instance",
            VALID.replace(r#""instance_id":"i""#, r#""instance_id":"i 1""#),
            Kind::Malformed,
            "instance_id",
        ),
        (
            "empty scope id",
            VALID.replace(r#""t-1""#, r#""""#),
            Kind::Malformed,
            "scope.id",
        ),
        (
            "missing tenant",
            VALID.replace(r#""tenant":"acme","#, ""),
            Kind::Malformed,
            "tenant",
        ),
        (
            "missing scope",
            VALID.replace(r#""scope":{"kind":"task","id":"t-1"},"#, ""),
            Kind::Malformed,
            "scope",
        ),
        (
            "unknown scope kind",
            VALID.replace(r#""kind":"task""#, r#""kind":"galaxy""#),
            Kind::Malformed,
            "scope.kind",
        ),
        (
            "unknown layer",
            VALID.replace("episodic", "limbic"),
            Kind::Malformed,
            "layer",
        ),
        (
            "importance out of range",
            VALID.replacen('{', r#"{"importance":7.5,"#, 1),
            Kind::InvalidField,
            "importance",
        ),
        (
            "bad event id",
            VALID.replacen('{', r#"{"event_id":"not-an-id","#, 1),
            Kind::Malformed,
            "event_id",
        ),
        (
            "empty content",
            VALID.replace(r#""text":"hello""#, r#""text":"  ""#),
            Kind::InvalidField,
            "content",
        ),
    ];
    for (what, json, kind, field) in &cases {
        let err = codec.decode_json(json).expect_err(what);
        assert_eq!(
            (Kind::of(&err), named_field(&err).as_deref()),
            (Some(*kind), Some(*field)),
            "{what}: {err}"
        );
    }
    // The same checks hold on the binary path: an envelope built in code with a bad field is
    // refused by append itself.
    let mut e = event("acme", "t1", "x");
    e.schema_version = 99;
    assert!(matches!(
        bus.append(&e, AppendOptions::default()).await,
        Err(AppendError::Invalid(SchemaError::UnknownSchemaVersion {
            found: 99,
            ..
        }))
    ));
    let mut e = event("acme", "t1", "x");
    e.importance = f64::NAN;
    let refused = bus.append(&e, AppendOptions::default()).await;
    assert!(
        matches!(
            &refused,
            Err(AppendError::Invalid(SchemaError::InvalidField {
                field: "importance",
                ..
            }))
        ),
        "{refused:?}"
    );
    let mut e = event("acme", "t1", "x");
    e.embedding = Some(engram_schema::Embedding {
        model: "m".into(),
        vector: vec![f32::INFINITY],
    });
    let refused = bus.append(&e, AppendOptions::default()).await;
    assert!(
        matches!(
            &refused,
            Err(AppendError::Invalid(SchemaError::InvalidField {
                field: "embedding.vector",
                ..
            }))
        ),
        "{refused:?}"
    );
    assert_eq!(stream_messages(&bus).await, 0, "nothing written");
}

#[tokio::test]
async fn oversized_events_are_refused_by_client_and_server() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let mut big = event("acme", "t1", "x");
    big.content.text = "y".repeat(600 * 1024); // over the default 512 KiB client limit
    match bus.append(&big, AppendOptions::default()).await {
        Err(AppendError::TooLarge { size, max }) => {
            assert!(size > max);
            assert_eq!(max, Limits::default().max_event_bytes);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }

    // A client whose own limit is lax still cannot get past the stream's max_msg_size: the
    // server refuses the message and the error is typed the same way.
    let lax = BusConfig {
        limits: Limits {
            max_event_bytes: 4 * 1024 * 1024,
        },
        ..nats.bus_config()
    };
    let lax_bus = engram_bus::Bus::connect(lax).await.unwrap();
    big.content.text = "y".repeat(1024 * 1024 + 10);
    assert!(matches!(
        lax_bus.append(&big, AppendOptions::default()).await,
        Err(AppendError::TooLarge { .. })
    ));
    // And a lax config is refused at provisioning, where it is cheap to fix.
    assert!(matches!(
        lax_bus.provision().await,
        Err(BusError::InvalidConfig(_))
    ));
    assert_eq!(stream_messages(&bus).await, 0, "nothing written");
}

#[tokio::test]
async fn identifiers_with_subject_characters_never_reach_a_subject() {
    use engram_sdk::{Client, RetryPolicy};
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let client = Client::from_bus(bus.clone(), RetryPolicy::none());
    for bad in ["a.b", "*", ">", "a b", "", "team\n", "ü"] {
        assert!(
            matches!(
                client.agent(bad, "agent", "i"),
                Err(SchemaError::InvalidIdent {
                    field: "tenant",
                    ..
                })
            ),
            "{bad:?}"
        );
        assert!(client.agent("acme", bad, "i").is_err());
        assert!(engram_schema::Scope::new(engram_schema::ScopeKind::Team, bad).is_err());
    }
    assert_eq!(stream_messages(&bus).await, 0);
}

#[tokio::test]
async fn server_down_is_a_clear_retryable_error() {
    let mut nats = TestNats::start().await;
    let url = nats.url();
    nats.kill().await;
    match engram_bus::Bus::connect(BusConfig {
        url: url.clone(),
        connect_timeout: Duration::from_secs(1),
        ..BusConfig::default()
    })
    .await
    {
        Err(e @ BusError::Connect { .. }) => {
            assert!(e.is_retryable());
            let msg = e.to_string();
            assert!(msg.contains(&url) && msg.contains("engram up"), "{msg}");
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
}

#[tokio::test]
async fn existing_stream_with_different_config_is_reported_not_clobbered() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    bus.append(&event("acme", "t1", "keep me"), AppendOptions::default())
        .await
        .unwrap();
    let mut other = nats.bus_config();
    other.stream.duplicate_window = Duration::from_secs(30);
    other.stream.max_msg_size = 2 * 1024 * 1024;
    let other_bus = engram_bus::Bus::connect(other).await.unwrap();
    match other_bus.provision().await {
        Err(BusError::ConfigDrift { diffs, .. }) => {
            let fields: Vec<_> = diffs.iter().map(|d| d.field).collect();
            assert_eq!(fields, ["duplicate_window", "max_msg_size"]);
        }
        other => panic!("expected drift, got {other:?}"),
    }
    // Provisioning again with the original config is a no-op.
    let again = bus.provision().await.unwrap();
    assert!(!again.stream_created && !again.bucket_created);
    assert_eq!(stream_messages(&bus).await, 1);
    let info = bus.stream_summary().await.unwrap();
    assert_eq!(info.duplicate_window_secs, 600);
}

#[tokio::test]
async fn existing_working_memory_bucket_with_different_config_is_reported_not_clobbered() {
    // Given the bucket as the default config makes it, holding a key
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let wm = bus.working_memory().await.unwrap();
    let (acme, scope) = (
        engram_testkit::ident("acme"),
        engram_schema::Scope::new(engram_schema::ScopeKind::Task, "t1").unwrap(),
    );
    wm.put(&acme, &scope, "plan", "keep me".into(), None)
        .await
        .unwrap();

    // When an engram with other working-memory settings provisions
    let mut other = nats.bus_config();
    other.working_memory.max_value_size = 1024;
    let other_bus = engram_bus::Bus::connect(other).await.unwrap();
    match other_bus.provision().await {
        // Then the difference is reported, field by field, with what to do
        Err(BusError::ConfigDrift {
            resource,
            diffs,
            fix,
        }) => {
            assert!(resource.contains("engram_working"), "{resource}");
            let fields: Vec<_> = diffs.iter().map(|d| d.field).collect();
            assert_eq!(fields, ["max_value_size"]);
            assert!(fix.contains("nats stream rm KV_engram_working"), "{fix}");
        }
        other => panic!("expected drift, got {other:?}"),
    }
    // And the bucket is left as it was: its settings and its key
    let again = bus.provision().await.unwrap();
    assert!(!again.bucket_created);
    let info = bus
        .jetstream()
        .get_stream("KV_engram_working")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    assert_eq!(info.max_message_size, 256 * 1024);
    assert_eq!(
        wm.get(&acme, &scope, "plan").await.unwrap().as_deref(),
        Some(&b"keep me"[..])
    );
}

//! Every kind of bad input gets a typed error, and nothing is written to the stream.

use std::time::Duration;

use engram_bus::{AppendError, AppendOptions, BusConfig, BusError};
use engram_schema::{Codec, Limits, SchemaError};
use engram_testkit::{TestNats, event};

const VALID: &str = r#"{"tenant":"acme","scope":{"kind":"task","id":"t-1"},"agent_id":"a","instance_id":"i",
    "layer":"episodic","kind":"observation","content":{"text":"hello"}}"#;

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

    let cases: Vec<(&str, String)> = vec![
        (
            "unknown schema version",
            VALID.replacen('{', r#"{"schema_version":2,"#, 1),
        ),
        ("wildcard tenant", VALID.replace(r#""acme""#, r#""acme.*""#)),
        (
            "full wildcard scope id",
            VALID.replace(r#""t-1""#, r#"">""#),
        ),
        (
            "dot in agent id",
            VALID.replace(r#""agent_id":"a""#, r#""agent_id":"a.b""#),
        ),
        (
            "whitespace in instance",
            VALID.replace(r#""instance_id":"i""#, r#""instance_id":"i 1""#),
        ),
        ("empty scope id", VALID.replace(r#""t-1""#, r#""""#)),
        ("missing tenant", VALID.replace(r#""tenant":"acme","#, "")),
        (
            "missing scope",
            VALID.replace(r#""scope":{"kind":"task","id":"t-1"},"#, ""),
        ),
        (
            "unknown scope kind",
            VALID.replace(r#""kind":"task""#, r#""kind":"galaxy""#),
        ),
        ("unknown layer", VALID.replace("episodic", "limbic")),
        (
            "importance out of range",
            VALID.replacen('{', r#"{"importance":7.5,"#, 1),
        ),
        (
            "bad event id",
            VALID.replacen('{', r#"{"event_id":"not-an-id","#, 1),
        ),
        (
            "empty content",
            VALID.replace(r#""text":"hello""#, r#""text":"  ""#),
        ),
    ];
    for (what, json) in &cases {
        let err = codec.decode_json(json).expect_err(what);
        assert!(!err.to_string().is_empty(), "{what}");
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
    assert!(matches!(
        bus.append(&e, AppendOptions::default()).await,
        Err(AppendError::Invalid(_))
    ));
    let mut e = event("acme", "t1", "x");
    e.embedding = Some(engram_schema::Embedding {
        model: "m".into(),
        vector: vec![f32::INFINITY],
    });
    assert!(matches!(
        bus.append(&e, AppendOptions::default()).await,
        Err(AppendError::Invalid(_))
    ));
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

//! The event contract is checked at the door: a payload a read model could not apply is
//! refused by every append path with an error naming the field, before anything is
//! published; a valid one is stored.

use std::time::Duration;

use engram_bus::{AppendError, AppendOptions, StartAt, StoredEvent};
use engram_schema::{
    EventKind, FactAsserted, Layer, Payload, SchemaError, Scope, ScopeKind, SubjectFilter,
    subject_for,
};
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::{TestNats, event};
use futures::StreamExt;
use serde_json::json;

async fn stream_messages(bus: &engram_bus::Bus) -> u64 {
    bus.stream_summary().await.unwrap().messages
}

async fn replay_all(bus: &engram_bus::Bus) -> Vec<StoredEvent> {
    let mut stream = bus
        .replay(&SubjectFilter::all(), StartAt::Beginning)
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("replay stalled")
    {
        out.push(item.unwrap());
    }
    out
}

fn invalid_field(err: &AppendError) -> Option<&'static str> {
    match err {
        AppendError::Invalid(SchemaError::InvalidField { field, .. }) => Some(field),
        _ => None,
    }
}

#[tokio::test]
async fn a_malformed_fact_is_refused_naming_the_field_and_a_valid_one_is_stored() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let client = Client::from_bus(bus.clone(), RetryPolicy::default());
    let agent = client.agent("acme", "planner", "i-1").unwrap();
    let team = Scope::new(ScopeKind::Team, "core").unwrap();
    let fact = |data| {
        agent
            .event(
                team.clone(),
                Layer::Semantic,
                EventKind::FactAsserted,
                "the db is postgres 16",
            )
            .data(data)
    };

    // When the SDK appends facts whose payload the fact table could not apply
    let cases = [
        (
            json!({"predicate": "runs", "object": "postgres 16"}),
            "content.data.subject",
        ),
        (
            json!({"subject": 7, "predicate": "runs", "object": "postgres 16"}),
            "content.data.subject",
        ),
        (
            json!({"subject": "db", "predicate": "runs"}),
            "content.data.object",
        ),
        (
            json!({"subject": "db", "predicate": "runs", "object": "pg", "confidence": 2}),
            "content.data.confidence",
        ),
        (json!("the db is postgres 16"), "content.data"),
    ];
    for (data, field) in cases {
        let err = fact(data.clone()).append().await.unwrap_err();

        // Then each is refused with a typed error naming the field, and saying what to send
        assert_eq!(invalid_field(&err), Some(field), "{data}: {err}");
        assert!(!err.is_retryable(), "{data}: {err}");
        assert!(err.to_string().contains(field), "{err}");
    }
    let reason = fact(json!({"subject": "db", "predicate": "runs"}))
        .append()
        .await
        .unwrap_err()
        .to_string();
    assert!(reason.contains("fact_retracted"), "{reason}");
    // A fact with no payload at all, built by hand and appended without the builder's check,
    // is refused by the client's append just the same.
    let mut bare = event("acme", "t-1", "the db is postgres 16");
    bare.kind = EventKind::FactAsserted;
    let err = client.append(&bare).await.unwrap_err();
    assert_eq!(invalid_field(&err), Some("content.data"), "{err}");
    // And nothing was written
    assert_eq!(stream_messages(&bus).await, 0);

    // When a valid fact is appended
    let receipt = fact(json!({"subject": " db ", "predicate": "runs", "object": "postgres 16"}))
        .append()
        .await
        .unwrap();

    // Then it is stored, and reads back with its typed payload
    assert_eq!(receipt.seq, 1);
    let stored = replay_all(&bus).await;
    assert_eq!(stored.len(), 1);
    let fact = FactAsserted::from_event(&stored[0].event).unwrap();
    assert_eq!(
        (fact.subject.as_str(), fact.object),
        ("db", json!("postgres 16"))
    );
}

#[tokio::test]
async fn the_bus_refuses_every_malformed_payload_kind_before_publishing() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let deep = (0..=engram_schema::payload::MAX_OBJECT_DEPTH).fold(json!(1), |v, _| json!([v]));
    let cases = [
        (
            EventKind::FactAsserted,
            json!({"subject": "db", "predicate": "runs", "object": deep}),
            "content.data.object",
        ),
        (
            EventKind::FactRetracted,
            json!({"subject": "db"}),
            "content.data.predicate",
        ),
        (
            EventKind::SkillRecorded,
            json!({"name": "deploy"}),
            "content.data.description",
        ),
        (
            EventKind::Outcome,
            json!({"skill": "deploy", "success": "yes"}),
            "content.data.success",
        ),
        (
            EventKind::Forgotten,
            json!({"event_ids": []}),
            "content.data.event_ids",
        ),
    ];
    for (kind, data, field) in cases {
        let mut bad = event("acme", "t-1", "text");
        bad.kind = kind;
        bad.content.data = Some(data);

        let err = bus
            .append(&bad, AppendOptions::default())
            .await
            .unwrap_err();
        let batch = bus.append_batch(std::slice::from_ref(&bad), 4).await;

        assert_eq!(invalid_field(&err), Some(field), "{kind}: {err}");
        assert!(matches!(&batch[..], [Err(e)] if invalid_field(e) == Some(field)));
    }
    assert_eq!(stream_messages(&bus).await, 0);
}

/// An event can still reach the stream without the check: a raw publish, or an append from
/// before the contract. Readers still decode it (its text is a memory like any other), and
/// the payload check a read model runs refuses it.
#[tokio::test]
async fn a_raw_published_malformed_fact_still_decodes_and_its_payload_is_refused() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let mut raw = event("acme", "t-1", "the db is postgres 16");
    raw.kind = EventKind::FactAsserted;
    raw.content.data = Some(json!({"subject": "db"}));
    let nc = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(nc);

    js.publish(
        subject_for(&raw),
        rmp_serde::to_vec_named(&raw).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let stored = replay_all(&bus).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].event, raw);
    let err = Payload::of(&stored[0].event).unwrap_err();
    assert_eq!(err.field, "content.data.predicate");
}

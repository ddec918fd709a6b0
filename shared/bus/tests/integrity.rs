//! The events stream keeps its integrity against a client with raw NATS access: readers trust
//! no event published on a subject other than its own, the stream stores only event subjects,
//! and the dead-letter stream recovers from being deleted and stays bounded. (Who may purge or
//! delete is NATS permissions' business: `tests/tests/access.rs`.)

use std::time::Duration;

use async_nats::jetstream::stream;
use engram_bus::{BusError, DLQ_STREAM, ReadError};
use engram_schema::{SubjectFilter, subject_for};
use engram_testkit::{TestNats, event, wait_until};
use futures::StreamExt;

async fn stream_messages(bus: &engram_bus::Bus) -> u64 {
    bus.stream_summary().await.unwrap().messages
}

/// Publishes `payload` on `subject` as any NATS client could, bypassing the SDK's checks.
async fn raw_publish(bus: &engram_bus::Bus, subject: &str, payload: Vec<u8>) -> u64 {
    bus.jetstream()
        .publish(subject.to_owned(), payload.into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence
}

#[tokio::test]
async fn an_event_on_another_tenants_subject_is_an_error_item_in_replay_and_tail() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let mut tail = bus.tail(&SubjectFilter::all()).await.unwrap();

    // Given an envelope of tenant victim, published raw on the attacker's subject
    let forged = event("victim", "mine", "planted in victim's memory");
    let payload = bus.codec().encode(&forged).unwrap();
    let forged_seq = raw_publish(&bus, "engram.evt.attacker.task.mine.episodic", payload).await;
    // And an honest event after it
    let honest = event("victim", "mine", "honest");
    let honest_seq = bus.append(&honest, Default::default()).await.unwrap().seq;

    // When the stream is replayed
    let items: Vec<_> = bus
        .replay(&SubjectFilter::all(), engram_bus::StartAt::Beginning)
        .await
        .unwrap()
        .collect()
        .await;

    // Then the forged message is an error item naming the subject it belongs on, never an event
    assert_eq!(items.len(), 2, "{items:?}");
    match &items[0] {
        Err(ReadError::Decode {
            seq,
            subject,
            source,
        }) => {
            assert_eq!(*seq, forged_seq);
            // Stored where it was published, with the partition of the subject's own tokens.
            let p = engram_schema::partition_of(
                &engram_testkit::ident("attacker"),
                engram_schema::ScopeKind::Task,
                &engram_testkit::ident("mine"),
                bus.config().stream.partitions,
            );
            assert_eq!(
                subject,
                &format!("engram.evt.attacker.task.mine.episodic.{p}")
            );
            assert!(
                source.to_string().contains(&subject_for(&forged)),
                "{source}"
            );
        }
        other => panic!("the forged event was trusted: {other:?}"),
    }
    assert_eq!(items[1].as_ref().unwrap().seq, honest_seq);

    // And so it is for a live tail
    let first = tokio::time::timeout(Duration::from_secs(10), tail.next())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(first, Err(ReadError::Decode { seq, .. }) if seq == forged_seq),
        "{first:?}"
    );
    let second = tokio::time::timeout(Duration::from_secs(10), tail.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.unwrap().seq, honest_seq);
}

#[tokio::test]
async fn only_four_token_event_subjects_are_stored() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;

    for subject in [
        "engram.evt.x",
        "engram.evt.a.b.c",
        "engram.evt.a.b.c.d.e.f.g",
    ] {
        let ack = bus
            .jetstream()
            .publish(subject, "junk".into())
            .await
            .unwrap()
            .await;
        assert!(ack.is_err(), "{subject} was stored: {ack:?}");
    }
    assert_eq!(stream_messages(&bus).await, 0);

    // An event's own subject is still stored.
    bus.append(&event("acme", "t1", "kept"), Default::default())
        .await
        .unwrap();
    assert_eq!(stream_messages(&bus).await, 1);
}

#[tokio::test]
async fn a_wider_stream_from_an_older_version_is_reported_with_the_command_that_fixes_it() {
    let nats = TestNats::start().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let bus = engram_bus::Bus::connect(nats.bus_config()).await.unwrap();
    // Given the events stream as an older engram made it
    let wanted = bus.wanted_stream_config();
    let old = stream::Config {
        subjects: vec!["engram.evt.>".into()],
        ..wanted.clone()
    };
    js.create_stream(old).await.unwrap();
    let old_event = bus
        .codec()
        .encode(&event("acme", "t1", "old event"))
        .unwrap();
    js.publish("engram.evt.acme.task.t1.episodic", old_event.into())
        .await
        .unwrap()
        .await
        .unwrap();
    // And a projector's consumer as an older engram made it
    js.get_stream(&wanted.name)
        .await
        .unwrap()
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("old-projector".into()),
            filter_subject: "engram.evt.>".into(),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();

    // When this version provisions, it refuses, naming the fields and the command
    let err = bus.provision().await.unwrap_err();
    match &err {
        BusError::ConfigDrift { diffs, .. } => {
            let fields: Vec<_> = diffs.iter().map(|d| d.field).collect();
            assert_eq!(fields, ["subjects"]);
        }
        other => panic!("expected drift, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains(&format!(
            "nats stream edit {} --subjects 'engram.evt.*.*.*.*'",
            wanted.name
        )),
        "{message}"
    );

    // Then making exactly those changes in place is accepted, keeps the events, and
    // provisioning passes
    js.update_stream(&wanted).await.unwrap();
    bus.provision().await.unwrap();
    assert_eq!(stream_messages(&bus).await, 1);

    // And the old consumer is replaced by one on the new subjects, from the same point
    let mut reader = bus.durable_reader("old-projector", 0, 10).await.unwrap();
    let batch = tokio::time::timeout(Duration::from_secs(10), reader.next_batch(10))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(batch[0].seq, 1);
    assert_eq!(
        batch[0].event.as_ref().unwrap().event.content.text,
        "old event"
    );
    let summary = bus.stream_summary().await.unwrap();
    let consumer = summary
        .consumers
        .iter()
        .find(|c| c.name == "old-projector")
        .unwrap();
    // Over what the stream stores: the publish subjects with their partition.
    assert_eq!(consumer.filter, engram_schema::STORED_SUBJECTS);
}

#[tokio::test]
async fn a_deleted_dead_letter_stream_is_recreated_by_the_next_dead_letter() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    bus.jetstream().delete_stream(DLQ_STREAM).await.unwrap();

    bus.dead_letter(
        "p",
        7,
        "id-7",
        "engram.evt.a.task.b.episodic",
        b"bad",
        "why",
    )
    .await
    .expect("the dead-letter stream is recreated");
    assert_eq!(bus.dead_letter_count("p").await.unwrap(), 1);
    let mut dlq = bus.jetstream().get_stream(DLQ_STREAM).await.unwrap();
    let config = dlq.info().await.unwrap().config.clone();
    assert_eq!(config.max_bytes, bus.config().dead_letters.max_bytes);
}

#[tokio::test]
async fn the_dead_letter_stream_is_bounded_and_drops_the_oldest() {
    let nats = TestNats::start().await;
    let mut config = nats.bus_config();
    config.dead_letters.max_bytes = 16 * 1024;
    let bus = nats.bus_with(config).await;

    let payload = vec![b'x'; 1024];
    for seq in 1..=64u64 {
        bus.dead_letter(
            "p",
            seq,
            &format!("id-{seq}"),
            "engram.evt.a.task.b.episodic",
            &payload,
            "poison",
        )
        .await
        .unwrap();
    }
    let mut dlq = bus.jetstream().get_stream(DLQ_STREAM).await.unwrap();
    let info = dlq.info().await.unwrap().clone();
    assert!(info.state.bytes <= 16 * 1024, "{} bytes", info.state.bytes);
    assert!(info.state.messages < 64);
    // The newest is kept: old ones make room.
    assert_eq!(info.state.last_sequence, 64);
    wait_until("dead letters counted", Duration::from_secs(5), || async {
        bus.dead_letter_count("p").await.unwrap_or(0) == info.state.messages
    })
    .await;
}

/// Deliveries that the server counts as made but that never reached the reader (on a
/// cluster: sent by a consumer leader that died with them in flight) must not be acked past
/// by `AckPolicy::All`: the reader stops at the jump in consumer sequence, and opened again
/// at what it applied it gets them all. Here another client of the same durable takes three
/// deliveries, which is the same jump seen from the reader.
#[tokio::test]
async fn deliveries_that_never_reached_the_reader_end_it_and_a_reopen_gets_them() {
    use async_nats::jetstream::consumer::pull;
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    for i in 0..10 {
        bus.append(&event("acme", "t1", &format!("n{i}")), Default::default())
            .await
            .unwrap();
    }
    let mut reader = bus.durable_reader("gappy", 0, 2).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), reader.next_batch(2))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let applied = first.last().unwrap().seq;
    assert_eq!(applied, first.len() as u64);

    // Another client of the same durable takes the next three deliveries away.
    let stream = bus.jetstream().get_stream("ENGRAM_EVENTS").await.unwrap();
    let thief: async_nats::jetstream::consumer::Consumer<pull::Config> =
        stream.get_consumer("gappy").await.unwrap();
    let mut stolen = thief.fetch().max_messages(3).messages().await.unwrap();
    let mut taken = 0;
    while let Some(m) = stolen.next().await {
        m.unwrap();
        taken += 1;
    }
    assert_eq!(taken, 3);

    // The reader hands over what it received in order (deliveries it had pulled before the
    // theft), never an event after the jump...
    let mut handed = applied;
    let after = loop {
        let next = tokio::time::timeout(Duration::from_secs(10), reader.next_batch(100))
            .await
            .unwrap()
            .unwrap();
        match next {
            Ok(batch) => {
                for d in &batch {
                    assert_eq!(d.seq, handed + 1, "an event after skipped deliveries");
                    handed = d.seq;
                }
            }
            Err(e) => break e,
        }
    };
    assert!(matches!(after, BusError::Unavailable(_)), "{after}");
    assert!(after.to_string().contains("skipped deliveries"), "{after}");
    assert!(handed < 10, "the jump was never seen");

    // ...and opened again at what it applied, it gets every event after it, in order.
    let mut reader = bus.durable_reader("gappy", handed, 100).await.unwrap();
    let mut seqs = Vec::new();
    while seqs.len() < 10 - handed as usize {
        let batch = tokio::time::timeout(Duration::from_secs(10), reader.next_batch(100))
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seqs.extend(batch.iter().map(|d| d.seq));
    }
    assert_eq!(seqs, ((handed + 1)..=10).collect::<Vec<_>>());
}

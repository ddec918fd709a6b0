//! Append, dedup, optimistic concurrency and replay against a real nats-server.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use engram_bus::{AppendError, AppendOptions, StartAt};
use engram_schema::SubjectFilter;
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::{TestNats, event, ident};
use futures::StreamExt;

async fn replay_all(bus: &engram_bus::Bus, filter: &SubjectFilter) -> Vec<engram_bus::StoredEvent> {
    let mut stream = bus.replay(filter, StartAt::Beginning).await.unwrap();
    let mut out = Vec::new();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("replay stalled")
    {
        out.push(item.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_append_ten_thousand_events_replayed_exactly_once_in_order() {
    const CLIENTS: usize = 50;
    const PER_CLIENT: usize = 200;
    let nats = TestNats::start().await;
    nats.bus().await; // provision once
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let config = nats.bus_config();
        tasks.push(tokio::spawn(async move {
            // Each client has its own connection, as separate agent instances would.
            let client = Client::with_config(config, RetryPolicy::default(), false)
                .await
                .unwrap();
            let task = format!("task-{}", c % 10);
            let events: Vec<_> = (0..PER_CLIENT)
                .map(|i| {
                    let mut e = event("acme", &task, &format!("client {c} step {i}"));
                    e.instance_id = ident(&format!("client-{c}"));
                    e.tags = vec![format!("n={i}")];
                    e
                })
                .collect();
            // Half the clients pipeline a batch, half append one at a time.
            let receipts: Vec<_> = if c % 2 == 0 {
                client
                    .append_batch(&events)
                    .await
                    .into_iter()
                    .map(Result::unwrap)
                    .collect()
            } else {
                let mut r = Vec::new();
                for e in &events {
                    r.push(client.append(e).await.unwrap());
                }
                r
            };
            assert!(receipts.iter().all(|r| !r.duplicate));
            events
                .into_iter()
                .map(|e| e.event_id.to_string())
                .collect::<Vec<_>>()
        }));
    }
    let mut acked = HashSet::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    assert_eq!(acked.len(), CLIENTS * PER_CLIENT);

    let bus = nats.bus().await;
    let replayed = replay_all(&bus, &SubjectFilter::all()).await;
    assert_eq!(replayed.len(), CLIENTS * PER_CLIENT, "replay count");
    let ids: HashSet<_> = replayed
        .iter()
        .map(|s| s.event.event_id.to_string())
        .collect();
    assert_eq!(ids, acked, "replay returns each acked event exactly once");
    // Per-subject order: each client's own steps appear in the order it appended them, and
    // sequences increase strictly along the replay.
    let mut last_step: HashMap<String, i64> = HashMap::new();
    let mut last_seq = 0;
    for s in &replayed {
        assert!(s.seq > last_seq);
        last_seq = s.seq;
        let step: i64 = s.event.tags[0].trim_start_matches("n=").parse().unwrap();
        let prev = last_step
            .insert(s.event.instance_id.to_string(), step)
            .unwrap_or(-1);
        assert_eq!(step, prev + 1, "order within {}", s.subject);
    }
}

#[tokio::test]
async fn retried_append_is_stored_once_and_reported_as_duplicate() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let e = event("acme", "t1", "same event twice");
    let first = bus.append(&e, AppendOptions::default()).await.unwrap();
    let second = bus.append(&e, AppendOptions::default()).await.unwrap();
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(first.seq, second.seq);
    // A batch containing the same id again is also deduplicated.
    let batch = bus
        .append_batch(&[e.clone(), event("acme", "t1", "other")], 8)
        .await;
    assert!(batch[0].as_ref().unwrap().duplicate);
    assert!(!batch[1].as_ref().unwrap().duplicate);
    let stored = replay_all(&bus, &SubjectFilter::all()).await;
    assert_eq!(stored.len(), 2);
    assert_eq!(bus.stream_summary().await.unwrap().messages, 2);
}

#[tokio::test]
async fn optimistic_concurrency_conflict_is_typed() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let expect = |seq| AppendOptions {
        expected_last_subject_seq: Some(seq),
        ..Default::default()
    };
    // 0 = the subject must be empty.
    let a = bus
        .append(&event("acme", "t1", "first"), expect(0))
        .await
        .unwrap();
    // Another subject moving on does not affect this one.
    bus.append(&event("acme", "t2", "elsewhere"), AppendOptions::default())
        .await
        .unwrap();
    let b = bus
        .append(&event("acme", "t1", "second"), expect(a.seq))
        .await
        .unwrap();
    let stale = bus
        .append(&event("acme", "t1", "stale writer"), expect(a.seq))
        .await;
    match stale {
        Err(AppendError::Conflict { subject, expected }) => {
            assert_eq!(subject, "engram.evt.acme.task.t1.episodic");
            assert_eq!(expected, a.seq);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert!(!stale_is_retryable());
    let filter = SubjectFilter::all()
        .tenant(ident("acme"))
        .scope(engram_schema::ScopeKind::Task, ident("t1"));
    let stored: Vec<_> = replay_all(&bus, &filter)
        .await
        .into_iter()
        .map(|s| s.seq)
        .collect();
    assert_eq!(stored, vec![a.seq, b.seq]);
}

fn stale_is_retryable() -> bool {
    AppendError::Conflict {
        subject: String::new(),
        expected: 0,
    }
    .is_retryable()
}

#[tokio::test]
async fn replay_from_sequence_and_time_and_tail_sees_new_events() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let mut seqs = Vec::new();
    for i in 0..5 {
        seqs.push(
            bus.append(
                &event("acme", "t1", &format!("e{i}")),
                AppendOptions::default(),
            )
            .await
            .unwrap()
            .seq,
        );
    }
    let mut from3 = bus
        .replay(&SubjectFilter::all(), StartAt::Seq(seqs[3]))
        .await
        .unwrap();
    let mut got = Vec::new();
    while let Some(e) = from3.next().await {
        got.push(e.unwrap().seq);
    }
    assert_eq!(got, seqs[3..].to_vec());

    let (expected, _) = bus
        .replay_counted(&SubjectFilter::all(), StartAt::Seq(seqs[3]))
        .await
        .unwrap();
    assert_eq!(
        expected, 2,
        "matching events known up front, for progress bars"
    );

    let later = chrono::Utc::now() + chrono::Duration::seconds(3600);
    let mut none = bus
        .replay(&SubjectFilter::all(), StartAt::Time(later))
        .await
        .unwrap();
    assert!(none.next().await.is_none());

    // An empty filter match ends immediately rather than waiting forever.
    let other = SubjectFilter::all().tenant(ident("nobody"));
    assert!(
        bus.replay(&other, StartAt::Beginning)
            .await
            .unwrap()
            .next()
            .await
            .is_none()
    );

    let mut tail = bus
        .tail(&SubjectFilter::all().tenant(ident("acme")))
        .await
        .unwrap();
    let e = event("acme", "t9", "live");
    bus.append(&e, AppendOptions::default()).await.unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(5), tail.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(seen.event.event_id, e.event_id);
    assert!(seen.trace.is_some(), "traceparent travels in headers");
}

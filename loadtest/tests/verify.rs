//! The verification itself must catch what it exists to catch: an acknowledged event missing
//! from the stream, an ack whose sequence is wrong, and projectors that cannot vouch for
//! what they applied.

use engram_loadtest::fleet::Acked;
use engram_loadtest::fleet::verify::{Baseline, verify};
use engram_schema::Envelope;
use engram_testkit::TestNats;

fn event(i: usize) -> Envelope {
    engram_testkit::event("bench", "t1", &format!("observation {i}"))
}

#[tokio::test]
async fn given_a_ledger_with_a_lost_and_a_misplaced_event_verification_counts_both() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    bus.provision().await.unwrap();
    let mut ledger = Vec::new();
    for i in 0..5 {
        let e = event(i);
        let receipt = bus.append(&e, Default::default()).await.unwrap();
        ledger.push(Acked {
            event_id: receipt.event_id,
            seq: receipt.seq,
            bytes: receipt.bytes as u32,
        });
    }
    // Never stored, but "acknowledged".
    ledger.push(Acked {
        event_id: event(99).event_id.as_str().to_owned(),
        seq: 6,
        bytes: 100,
    });
    // Stored, but acknowledged with the wrong sequence.
    ledger[1].seq = 42;

    let v = verify(&bus, &ledger, "bench", &Baseline::default())
        .await
        .unwrap();
    assert_eq!(v.acked, 6);
    assert_eq!(v.stream_events, 5);
    assert_eq!(v.lost, 1);
    assert_eq!(v.seq_mismatch, 1);
    assert_eq!(v.duplicated, 0);
    // No projector runs here: each is reported as not verifiable, which fails the run.
    assert_eq!(v.projectors.len(), 4);
    assert!(v.projectors.iter().all(|p| p.error.is_some()));
    assert_eq!(v.failures(), 1 + 1 + 4);
}

/// A remote deployment's stream holds history from before the run, and retention may already
/// have removed the oldest of it: only what came after the baseline is checked.
#[tokio::test]
async fn given_history_partly_purged_before_the_run_only_the_run_is_verified() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    bus.provision().await.unwrap();
    for i in 0..10 {
        bus.append(&event(i), Default::default()).await.unwrap();
    }
    // Retention removed seqs 1..=6. (The stream refuses purges: a message limit does it.)
    let mut limited = bus.wanted_stream_config();
    limited.max_messages = 4;
    bus.jetstream().update_stream(&limited).await.unwrap();
    bus.jetstream()
        .update_stream(&bus.wanted_stream_config())
        .await
        .unwrap();

    // Given a baseline taken now (no projector answers, so none has one)
    let baseline = Baseline::take(&bus).await.unwrap();
    assert_eq!(baseline.stream_seq, 10);
    assert!(baseline.projectors.is_empty());
    // When the run appends three events and acknowledges them
    let mut ledger = Vec::new();
    for i in 10..13 {
        let receipt = bus.append(&event(i), Default::default()).await.unwrap();
        ledger.push(Acked {
            event_id: receipt.event_id,
            seq: receipt.seq,
            bytes: receipt.bytes as u32,
        });
    }
    // Then exactly those are the run's stream events, all found where their acks said
    let v = verify(&bus, &ledger, "bench", &baseline).await.unwrap();
    assert_eq!(v.baseline_seq, 10);
    assert_eq!((v.stream_messages, v.stream_events), (3, 3));
    assert_eq!((v.lost, v.duplicated, v.seq_mismatch), (0, 0, 0));
    assert_eq!(v.stored_unacked, 0);
    // And a projector without a baseline is checked against what is left of the stream
    // (seqs 7..=13), which is not verifiable here: nothing answers.
    for p in &v.projectors {
        assert_eq!((p.baseline_seq, p.expected_events), (0, 7), "{p:?}");
        assert!(p.error.is_some());
    }
}

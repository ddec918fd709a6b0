//! The verification itself must catch what it exists to catch: an acknowledged event missing
//! from the stream, an ack whose sequence is wrong, and projectors that cannot vouch for
//! what they applied.

use engram_loadtest::fleet::Acked;
use engram_loadtest::fleet::verify::verify;
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_testkit::TestNats;

fn event(i: usize) -> Envelope {
    Envelope::new(
        Ident::parse("tenant", "bench").unwrap(),
        Scope::new(ScopeKind::Task, "t1").unwrap(),
        Ident::parse("agent_id", "a").unwrap(),
        Ident::parse("instance_id", "i").unwrap(),
        Layer::Episodic,
        EventKind::Observation,
        Content {
            text: format!("observation {i}"),
            data: None,
        },
    )
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

    let v = verify(&bus, &ledger, "bench").await.unwrap();
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

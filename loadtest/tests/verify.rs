//! The verification itself must catch what it exists to catch, and only that: an acknowledged
//! event missing from the stream, an ack whose sequence is wrong, a projector that skipped an
//! event, applied one twice or applied the wrong one, and projectors that cannot vouch for
//! what they applied; but not an event a projector dead-lettered, nor events other clients
//! append after a projector's final ledger.
//!
//! The projectors here are stand-ins: each answers `engram.p.<name>.ledger.<p>` with a ledger this
//! test computes from what it appended, with one known defect or none. A real projector cannot
//! be made to miscount on purpose; its ledger is tested in the projection runtime's own tests.

use engram_bus::Bus;
use engram_loadtest::fleet::Acked;
use engram_loadtest::fleet::target::projectors;
use engram_loadtest::fleet::verify::{Baseline, Verification, verify};
use engram_memory::proto::partition_subject;
use engram_projection_runtime::ApplyLedger;
use engram_projectors::ProjectorLedger;
use engram_schema::Envelope;
use engram_testkit::TestNats;
use futures::StreamExt;

fn event(i: usize) -> Envelope {
    engram_testkit::event("bench", "t1", &format!("observation {i}"))
}

async fn append(bus: &Bus, range: std::ops::Range<usize>) -> Vec<Acked> {
    let mut acked = Vec::new();
    for i in range {
        let receipt = bus.append(&event(i), Default::default()).await.unwrap();
        acked.push(Acked {
            event_id: receipt.event_id,
            seq: receipt.seq,
            bytes: receipt.bytes as u32,
        });
    }
    acked
}

/// The ledger of applying exactly `events`.
fn ledger_of<'a>(events: impl IntoIterator<Item = &'a Acked>) -> ApplyLedger {
    let mut ledger = ApplyLedger::default();
    for a in events {
        ledger.add(a.seq, &a.event_id);
    }
    ledger
}

/// Answers `name`'s ledger requests with `ledger`, visible up to its own sequence, until the
/// returned task is dropped.
async fn stand_in(bus: &Bus, name: &str, ledger: ApplyLedger) -> tokio::task::JoinHandle<()> {
    stand_in_answering(bus, name, vec![(ledger.seq, ledger)]).await
}

/// Answers `name`'s ledger requests with `(visible seq, ledger)` pairs in turn, the last one
/// from then on.
async fn stand_in_answering(
    bus: &Bus,
    name: &str,
    answers: Vec<(u64, ApplyLedger)>,
) -> tokio::task::JoinHandle<()> {
    let client = bus.client().clone();
    // Every partition is asked; partition 0 holds all the events, the others none, so the
    // merged ledger is the one given.
    let mut requests = client
        .subscribe(format!("engram.p.{name}.ledger.*"))
        .await
        .unwrap();
    client.flush().await.unwrap();
    let answers: Vec<(u64, ApplyLedger)> = answers;
    let name = name.to_owned();
    tokio::spawn(async move {
        let mut next = 0;
        while let Some(request) = requests.next().await {
            let Some(reply) = request.reply else {
                continue;
            };
            let (visible_seq, ledger) = answers[next.min(answers.len() - 1)];
            let holds_all = request.subject.as_str() == partition_subject(&name, "ledger", 0);
            let answer = ProjectorLedger {
                projector: name.clone(),
                partition: request
                    .subject
                    .rsplit('.')
                    .next()
                    .and_then(|p| p.parse().ok()),
                visible_seq,
                ledger: if holds_all {
                    ledger
                } else {
                    ApplyLedger::default()
                },
            };
            let _ = client
                .publish(reply, serde_json::to_vec(&answer).unwrap().into())
                .await;
            if holds_all {
                next += 1;
            }
        }
    })
}

/// Every projector answers with `steady`, but `name`, which answers `answers` in turn (see
/// [`stand_in_answering`]).
async fn stand_ins_with_one_answering(
    bus: &Bus,
    steady: ApplyLedger,
    name: &str,
    answers: Vec<(u64, ApplyLedger)>,
) -> Vec<AbortOnDrop> {
    let mut out = Vec::new();
    for p in projectors() {
        if p != name {
            out.push(AbortOnDrop(stand_in(bus, p, steady).await));
        }
    }
    out.push(AbortOnDrop(stand_in_answering(bus, name, answers).await));
    out
}

/// Every projector answers with `correct`, but the one `wrong` names, which answers with its
/// ledger.
async fn stand_ins(
    bus: &Bus,
    correct: ApplyLedger,
    wrong: Option<(&str, ApplyLedger)>,
) -> Vec<AbortOnDrop> {
    let mut out = Vec::new();
    for p in projectors() {
        let ledger = match wrong {
            Some((name, ledger)) if name == p => ledger,
            _ => correct,
        };
        out.push(AbortOnDrop(stand_in(bus, p, ledger).await));
    }
    out
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn check<'a>(
    v: &'a Verification,
    name: &str,
) -> &'a engram_loadtest::fleet::verify::ProjectorCheck {
    v.projectors.iter().find(|p| p.projector == name).unwrap()
}

fn clean(v: &Verification, name: &str) -> bool {
    let p = check(v, name);
    p.error.is_none() && p.digest_matches && p.lost == 0 && p.duplicated == 0
}

#[tokio::test]
async fn given_a_ledger_with_a_lost_and_a_misplaced_event_verification_counts_both() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let mut ledger = append(&bus, 0..5).await;
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
    let every = projectors().len();
    assert_eq!(v.projectors.len(), every);
    assert!(v.projectors.iter().all(|p| p.error.is_some()));
    assert_eq!(v.failures(), 1 + 1 + every as u64);
}

#[tokio::test]
async fn a_projector_that_skipped_an_event_is_short_by_one() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let acked = append(&bus, 0..8).await;
    let mut skipped = ledger_of(acked.iter().filter(|a| a.seq != 4));
    skipped.seq = acked.last().unwrap().seq;
    let _projectors = stand_ins(&bus, ledger_of(&acked), Some(("vector", skipped))).await;

    let v = verify(&bus, &acked, "bench", &Baseline::default())
        .await
        .unwrap();
    let p = check(&v, "vector");
    assert_eq!((p.expected_events, p.applied_events), (8, 7), "{p:?}");
    assert_eq!((p.lost, p.duplicated, p.digest_matches), (1, 0, false));
    for name in ["keyword", "facts", "skills"] {
        assert!(clean(&v, name), "{:?}", check(&v, name));
    }
    assert_eq!(v.failures(), 1);
}

#[tokio::test]
async fn a_projector_that_applied_an_event_twice_is_over_by_one() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let acked = append(&bus, 0..8).await;
    let mut twice = ledger_of(&acked);
    twice.add(acked[2].seq, &acked[2].event_id);
    let _projectors = stand_ins(&bus, ledger_of(&acked), Some(("keyword", twice))).await;

    let v = verify(&bus, &acked, "bench", &Baseline::default())
        .await
        .unwrap();
    let p = check(&v, "keyword");
    assert_eq!((p.expected_events, p.applied_events), (8, 9), "{p:?}");
    assert_eq!((p.lost, p.duplicated, p.digest_matches), (0, 1, false));
    assert_eq!(v.failures(), 1);
}

/// Equal counts, different events: one skipped and another applied twice, or one applied
/// under the wrong id. Only the digest can tell.
#[tokio::test]
async fn a_projector_with_the_right_count_of_the_wrong_events_fails_on_its_digest() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let acked = append(&bus, 0..8).await;
    let mut swapped: Vec<Acked> = acked.clone();
    swapped[5].event_id = event(1000).event_id.as_str().to_owned();
    let _projectors = stand_ins(
        &bus,
        ledger_of(&acked),
        Some(("facts", ledger_of(&swapped))),
    )
    .await;

    let v = verify(&bus, &acked, "bench", &Baseline::default())
        .await
        .unwrap();
    let p = check(&v, "facts");
    assert_eq!((p.expected_events, p.applied_events), (8, 8), "{p:?}");
    assert!(!p.digest_matches);
    assert_eq!((p.lost, p.duplicated), (0, 1));
    assert_eq!(v.failures(), 1);
}

/// An event a projector refused is in the dead-letter stream, not in its ledger: that is not
/// a loss. One it neither applied nor dead-lettered is.
#[tokio::test]
async fn dead_lettered_events_are_expected_of_no_projector_and_silently_skipped_ones_are_lost() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let baseline = Baseline::take(&bus).await.unwrap();
    let acked = append(&bus, 0..6).await;
    // Given the skills projector dead-lettered seq 3 (as the projection runtime does)
    let payload = bus.codec().encode(&event(3)).unwrap();
    bus.dead_letter(
        "skills",
        3,
        "dlq-test-3",
        "engram.evt.bench.task.t1.episodic",
        &payload,
        "no skill payload",
    )
    .await
    .unwrap();
    // ...and a message that is no event is in the stream, which every projector must
    // dead-letter; only skills did.
    let garbage_seq = bus
        .jetstream()
        .publish("engram.evt.bench.task.t1.episodic", "not msgpack".into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    bus.dead_letter(
        "skills",
        garbage_seq,
        "dlq-test-garbage",
        "engram.evt.bench.task.t1.episodic",
        b"not msgpack",
        "does not decode",
    )
    .await
    .unwrap();
    let mut all = ledger_of(&acked);
    all.seq = garbage_seq;
    let mut without_3 = ledger_of(acked.iter().filter(|a| a.seq != 3));
    without_3.seq = garbage_seq;
    let _projectors = stand_ins(&bus, all, Some(("skills", without_3))).await;

    let v = verify(&bus, &acked, "bench", &baseline).await.unwrap();
    // Then skills is clean: its two letters account for the two messages it did not apply
    let p = check(&v, "skills");
    assert!(clean(&v, "skills"), "{p:?}");
    assert_eq!((p.expected_events, p.dead_lettered), (5, 2), "{p:?}");
    // And the others, which have no letter for the garbage, lost it
    let others: Vec<&str> = projectors()
        .into_iter()
        .filter(|p| *p != "skills")
        .collect();
    for &name in &others {
        let p = check(&v, name);
        assert_eq!(
            (p.expected_events, p.lost, p.duplicated),
            (6, 1, 0),
            "{p:?}"
        );
        assert!(
            p.digest_matches,
            "the events they did apply are right: {p:?}"
        );
    }
    assert!(
        v.examples.iter().any(|e| e.contains("do not decode")),
        "{:?}",
        v.examples
    );
    assert_eq!(v.failures(), others.len() as u64);
}

/// Another client keeps appending after the projectors' final ledgers were read: its events
/// are neither expected of a projector nor counted as duplicates.
#[tokio::test]
async fn events_appended_after_the_final_ledgers_are_not_held_against_the_projectors() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let acked = append(&bus, 0..6).await;
    let _projectors = stand_ins(&bus, ledger_of(&acked), None).await;
    let other = append(&bus, 100..110).await;
    assert!(other[0].seq > acked.last().unwrap().seq);

    let v = verify(&bus, &acked, "bench", &Baseline::default())
        .await
        .unwrap();
    for name in projectors() {
        let p = check(&v, name);
        assert!(clean(&v, name), "{p:?}");
        assert_eq!((p.through_seq, p.expected_events), (6, 6), "{p:?}");
    }
    assert_eq!(v.failures(), 0);
}

/// A projector that other clients keep busy: when first asked, its ledger is a batch ahead of
/// what it has published (so that batch's dead letters may not be sent yet); by the time it
/// has published that far, it has applied more. It is checked on the first ledger that is
/// published whole, from one answer: a model's ledger sums its partitions', and one read
/// while a partition was behind lacks events that partition applies later, below its
/// sequence (the first ledger, kept, counted them lost).
#[tokio::test]
async fn a_projector_kept_busy_is_checked_on_the_first_ledger_it_has_published_whole() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let acked = append(&bus, 0..6).await;
    let other = append(&bus, 100..104).await;
    let first = ledger_of(&acked);
    let later = ledger_of(acked.iter().chain(&other));
    let _projectors = stand_ins_with_one_answering(
        &bus,
        first,
        "skills",
        vec![
            (first.seq - 2, first),
            (first.seq - 1, later),
            (later.seq, later),
        ],
    )
    .await;

    let v = verify(&bus, &acked, "bench", &Baseline::default())
        .await
        .unwrap();
    let p = check(&v, "skills");
    assert!(clean(&v, "skills"), "{p:?}");
    assert_eq!(
        (p.through_seq, p.expected_events),
        (later.seq, later.events),
        "{p:?}"
    );
    assert_eq!(v.failures(), 0);
}

/// A model read while one of its partitions is behind: the merged ledger is at the highest
/// partition's sequence but lacks the events the lagging partition holds below it, and its
/// visible sequence is that partition's. A moment later the partition has applied them. The
/// first ledger is not a cut of the stream; checked on it, those events were lost (as the
/// vector projector's were in two 1,000-instance runs).
#[tokio::test]
async fn a_model_read_while_a_partition_is_behind_is_checked_on_a_later_whole_answer() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let acked = append(&bus, 0..6).await;
    let whole = ledger_of(&acked);
    // The partition holding the third and fourth events had applied neither.
    let partial = ledger_of(acked[..2].iter().chain(&acked[4..]));
    assert_eq!((partial.seq, partial.events), (whole.seq, 4));
    let _projectors = stand_ins_with_one_answering(
        &bus,
        whole,
        "vector",
        vec![(acked[1].seq, partial), (whole.seq, whole)],
    )
    .await;

    let v = verify(&bus, &acked, "bench", &Baseline::default())
        .await
        .unwrap();
    let p = check(&v, "vector");
    assert!(clean(&v, "vector"), "{p:?}");
    assert_eq!((p.through_seq, p.applied_events), (whole.seq, 6), "{p:?}");
    assert_eq!(v.failures(), 0);
}

#[tokio::test]
async fn a_projector_behind_the_last_acknowledged_write_cannot_be_verified() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let acked = append(&bus, 0..6).await;
    let _projectors = stand_ins(
        &bus,
        ledger_of(&acked),
        Some(("vector", ledger_of(&acked[..4]))),
    )
    .await;

    let v = verify(&bus, &acked, "bench", &Baseline::default())
        .await
        .unwrap();
    let p = check(&v, "vector");
    assert!(
        p.error
            .as_deref()
            .is_some_and(|e| e.contains("only up to seq 4")),
        "{p:?}"
    );
    assert_eq!(v.failures(), 1);
}

/// A remote deployment's stream holds history from before the run, and retention may already
/// have removed the oldest of it: only what came after the baseline is checked.
#[tokio::test]
async fn given_history_partly_purged_before_the_run_only_the_run_is_verified() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    append(&bus, 0..10).await;
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
    let ledger = append(&bus, 10..13).await;
    // And each projector, started from nothing, applied what the stream still holds
    // (seqs 7..=13): all but vector, which missed seq 8
    let left: Vec<Acked> = {
        let mut replayed = Vec::new();
        let mut events = bus
            .replay(
                &engram_schema::SubjectFilter::all(),
                engram_bus::StartAt::Beginning,
            )
            .await
            .unwrap();
        while let Some(e) = events.next().await {
            let e = e.unwrap();
            replayed.push(Acked {
                event_id: e.event.event_id.as_str().to_owned(),
                seq: e.seq,
                bytes: 0,
            });
        }
        replayed
    };
    assert_eq!(left.first().map(|a| a.seq), Some(7));
    let mut missed_8 = ledger_of(left.iter().filter(|a| a.seq != 8));
    missed_8.seq = 13;
    let _projectors = stand_ins(&bus, ledger_of(&left), Some(("vector", missed_8))).await;

    // Then exactly those are the run's stream events, all found where their acks said
    let v = verify(&bus, &ledger, "bench", &baseline).await.unwrap();
    assert_eq!(v.baseline_seq, 10);
    assert_eq!((v.stream_messages, v.stream_events), (3, 3));
    assert_eq!((v.lost, v.duplicated, v.seq_mismatch), (0, 0, 0));
    assert_eq!(v.stored_unacked, 0);
    // And a projector without a baseline is checked against what is left of the stream
    for p in &v.projectors {
        assert_eq!((p.baseline_seq, p.expected_events), (0, 7), "{p:?}");
    }
    for name in ["keyword", "facts", "skills"] {
        assert!(clean(&v, name), "{:?}", check(&v, name));
    }
    assert_eq!(check(&v, "vector").lost, 1);
}

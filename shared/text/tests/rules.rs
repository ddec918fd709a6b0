//! The text-memory rules, given/when/then: what a stream of memories, forgettings, signals
//! and consolidation outputs leaves, and the index operations it asks for.

use std::collections::HashSet;

use engram_memory::ScopeKey;
use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_text::{IndexOp, TextMemories};
use proptest::prelude::*;
use serde_json::json;

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn event(task: &str, instance: &str, kind: EventKind, text: &str) -> Envelope {
    Envelope::new(
        ident("acme"),
        Scope::new(ScopeKind::Task, task).unwrap(),
        ident("agent"),
        ident(instance),
        Layer::Episodic,
        kind,
        Content::text(text),
    )
}

fn memory(task: &str, instance: &str, text: &str) -> Envelope {
    event(task, instance, EventKind::Observation, text)
}

fn with_data(mut event: Envelope, data: serde_json::Value) -> Envelope {
    event.content.data = Some(data);
    event
}

fn forgetting(task: &str, ids: &[&EventId]) -> Envelope {
    with_data(
        event(task, "i-1", EventKind::Forgotten, "archived"),
        json!({"event_ids": ids}),
    )
}

fn key(task: &str) -> ScopeKey {
    ScopeKey::new(ident("acme"), Scope::new(ScopeKind::Task, task).unwrap())
}

/// Applies `events` at the seqs after the model's; returns every op, in order. A refused
/// event adds none (generated streams hold some: a forgetting of nothing, say).
fn apply_all(model: &mut TextMemories, events: &[Envelope]) -> Vec<IndexOp> {
    let first = model.applied() + 1;
    let mut ops = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let seq = first + i as u64;
        match model.apply(seq, e) {
            Ok(applied) => ops.extend(applied.ops),
            // As the indexes do at the end of a batch: past the refused event.
            Err(_) => model.advance_to(seq),
        }
    }
    ops
}

fn confidence(model: &TextMemories, id: &EventId) -> Option<f64> {
    model
        .seq_of(id)
        .and_then(|s| model.get(s))
        .map(|m| m.meta.confidence)
}

#[test]
fn a_scope_forgets_only_its_own_memories_and_a_late_retry_stays_out() {
    // Given a memory in t1 and one in t2
    let (a, b) = (memory("t1", "i-1", "alpha"), memory("t2", "i-1", "beta"));
    let mut model = TextMemories::default();
    apply_all(&mut model, &[a.clone(), b.clone()]);
    // When t1 forgets both
    let ops = apply_all(&mut model, &[forgetting("t1", &[&a.event_id, &b.event_id])]);
    // Then only its own goes, and the index is told to remove exactly it
    assert_eq!(
        ops,
        vec![IndexOp::Unindex {
            seq: 1,
            scope: key("t1"),
            event_id: a.event_id.clone()
        }]
    );
    assert!(model.get(1).is_none() && model.get(2).is_some());
    // And a retry of the forgotten memory, stored again at a new seq, is not indexed again
    assert!(!model.wants(&a));
    assert!(apply_all(&mut model, std::slice::from_ref(&a)).is_empty());
    assert_eq!(model.len(), 1);
}

#[test]
fn a_signal_lowers_its_scopes_earlier_memories_once() {
    // Given i-2's memories in t1 and t2, and a claim
    let claim = memory("t1", "i-1", "the key is in vault");
    let bad = memory("t1", "i-2", "prices doubled");
    let elsewhere = memory("t2", "i-2", "the cache warms");
    let mut model = TextMemories::default();
    apply_all(&mut model, &[claim.clone(), bad.clone(), elsewhere.clone()]);
    // When a feedback in t1 contradicts the claim and flags i-2, and is stored twice
    let flag = with_data(
        event("t1", "i-9", EventKind::Feedback, ""),
        json!({"contradicts": [claim.event_id], "faulty_instance": "i-2"}),
    );
    let first = model.apply(4, &flag).unwrap();
    let again = model.apply(5, &flag).unwrap();
    // Then the claim halves, i-2's t1 memory drops to a quarter, t2 stays, each reweighted
    // once; the retry changes nothing
    assert_eq!(
        first.ops,
        vec![IndexOp::Reweight { seq: 1 }, IndexOp::Reweight { seq: 2 }]
    );
    assert_eq!(first.signal, Some(flag.event_id.clone()));
    assert_eq!(again, Default::default());
    assert_eq!(confidence(&model, &claim.event_id), Some(0.5));
    assert_eq!(confidence(&model, &bad.event_id), Some(0.25));
    assert_eq!(confidence(&model, &elsewhere.event_id), Some(1.0));
    // And what i-2 writes after the flag starts trusted
    let after = memory("t1", "i-2", "the office moved");
    apply_all(&mut model, std::slice::from_ref(&after));
    assert_eq!(confidence(&model, &after.event_id), Some(1.0));
}

#[test]
fn a_restored_copy_of_a_distrusted_memory_stays_distrusted() {
    // Given a contradicted memory, then archived
    let claim = memory("t1", "i-1", "the key is in vault");
    let outcome = with_data(
        event("t1", "i-3", EventKind::Outcome, ""),
        json!({"contradicts": [claim.event_id]}),
    );
    let mut model = TextMemories::default();
    apply_all(
        &mut model,
        &[claim.clone(), outcome, forgetting("t1", &[&claim.event_id])],
    );
    // When the consolidator restores a copy of it
    let copy = with_data(
        event(
            "t1",
            "consolidator",
            EventKind::Consolidated,
            "the key is in vault",
        ),
        json!({"op": "restored", "sources": [claim.event_id]}),
    );
    let ops = apply_all(&mut model, std::slice::from_ref(&copy));
    // Then the copy is indexed, naming its source, at the confidence it was withdrawn at
    assert!(
        matches!(&ops[..], [IndexOp::Index { inherits: Some(i), .. }] if i.sources == vec![claim.event_id.clone()])
    );
    assert_eq!(confidence(&model, &copy.event_id), Some(0.5));
}

#[test]
fn an_event_that_does_not_check_changes_nothing() {
    let mut model = TextMemories::default();
    apply_all(&mut model, &[memory("t1", "i-1", "alpha")]);
    let before = (model.state_hash(), model.applied());
    // A consolidation output whose sources do not decode, with text of its own
    let bad = with_data(
        event("t1", "consolidator", EventKind::Consolidated, "merged text"),
        json!({"op": "merged", "sources": "not a list"}),
    );
    assert!(model.apply(2, &bad).is_err());
    assert_eq!((model.state_hash(), model.applied()), before);
}

#[test]
fn an_erasure_removes_everything_of_its_scopes_and_only_that() {
    let (a, b) = (memory("t1", "i-1", "alpha"), memory("t2", "i-1", "beta"));
    let gone = memory("t1", "i-2", "gamma");
    let flag = with_data(
        event("t1", "i-9", EventKind::Feedback, ""),
        json!({"faulty_instance": "i-2"}),
    );
    let mut model = TextMemories::default();
    apply_all(
        &mut model,
        &[
            a.clone(),
            b.clone(),
            gone.clone(),
            flag,
            forgetting("t1", &[&gone.event_id]),
        ],
    );
    let t1 = HashSet::from([key("t1")]);
    let held = model.held(&t1);
    // a, the forgotten (and withdrawn) gamma, the flag
    assert_eq!((held.memories, held.events), (1, 3));
    let erased = model.erase(&t1);
    assert_eq!((erased.seqs, erased.events), (vec![1], 3));
    assert_eq!(model.held(&t1), Default::default());
    assert!(model.forgotten().is_empty() && model.distrusted().is_empty());
    assert!(model.withdrawn().is_empty() && model.id_scopes().is_empty());
    assert!(model.get(2).is_some());
}

/// One step of a generated stream: a memory, a forgetting, a signal or a consolidation
/// output, naming earlier events by index.
#[derive(Clone, Debug)]
enum Step {
    Memory {
        task: u8,
        instance: u8,
    },
    Forget {
        task: u8,
        of: Vec<usize>,
    },
    Contradict {
        task: u8,
        of: Vec<usize>,
    },
    Flag {
        task: u8,
        instance: u8,
    },
    Merge {
        task: u8,
        of: Vec<usize>,
    },
    /// The same event as an earlier one, stored again.
    Retry {
        of: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let ids = prop::collection::vec(0usize..64, 1..4);
    prop_oneof![
        4 => (0u8..2, 0u8..3).prop_map(|(task, instance)| Step::Memory { task, instance }),
        1 => (0u8..2, ids.clone()).prop_map(|(task, of)| Step::Forget { task, of }),
        1 => (0u8..2, ids.clone()).prop_map(|(task, of)| Step::Contradict { task, of }),
        1 => (0u8..2, 0u8..3).prop_map(|(task, instance)| Step::Flag { task, instance }),
        1 => (0u8..2, ids).prop_map(|(task, of)| Step::Merge { task, of }),
        1 => (0usize..64).prop_map(|of| Step::Retry { of }),
    ]
}

fn events_of(steps: &[Step]) -> Vec<Envelope> {
    let mut events: Vec<Envelope> = Vec::new();
    let task = |t: &u8| format!("t{t}");
    for (n, s) in steps.iter().enumerate() {
        let ids = |of: &Vec<usize>, events: &Vec<Envelope>| -> Vec<EventId> {
            of.iter()
                .filter_map(|i| events.get(i % events.len().max(1)))
                .map(|e| e.event_id.clone())
                .collect()
        };
        let e = match s {
            Step::Memory { task: t, instance } => {
                memory(&task(t), &format!("i-{instance}"), &format!("memory {n}"))
            }
            Step::Forget { task: t, of } => {
                let of = ids(of, &events);
                forgetting(&task(t), &of.iter().collect::<Vec<_>>())
            }
            Step::Contradict { task: t, of } => with_data(
                event(&task(t), "i-9", EventKind::Outcome, &format!("outcome {n}")),
                json!({"contradicts": ids(of, &events)}),
            ),
            Step::Flag { task: t, instance } => with_data(
                event(&task(t), "i-9", EventKind::Feedback, ""),
                json!({"faulty_instance": format!("i-{instance}")}),
            ),
            Step::Merge { task: t, of } => with_data(
                event(
                    &task(t),
                    "consolidator",
                    EventKind::Consolidated,
                    &format!("merged {n}"),
                ),
                json!({"op": "merged", "sources": ids(of, &events)}),
            ),
            Step::Retry { of } => match events.get(of % events.len().max(1)) {
                Some(e) => e.clone(),
                None => memory("t0", "i-0", "first"),
            },
        };
        events.push(e);
    }
    events
}

proptest! {
    /// A model restored from its parts at any point goes on exactly as the one that never
    /// stopped: the same index operations for the rest of the stream, and the same state.
    /// This is what lets a checkpoint, a snapshot or a partition handoff stand in for a
    /// replay.
    #[test]
    fn a_model_restored_from_its_parts_goes_on_as_the_original(
        steps in prop::collection::vec(step(), 1..48),
        cut in 0usize..48,
    ) {
        let events = events_of(&steps);
        let cut = cut.min(events.len());
        let mut whole = TextMemories::default();
        apply_all(&mut whole, &events[..cut]);
        let mut restored = TextMemories::from_parts(whole.to_parts());
        prop_assert_eq!(restored.state_hash(), whole.state_hash());
        let rest_whole = apply_all(&mut whole, &events[cut..]);
        let rest_restored = apply_all(&mut restored, &events[cut..]);
        prop_assert_eq!(rest_whole, rest_restored);
        prop_assert_eq!(restored.state_hash(), whole.state_hash());
        // And every op names a memory as the model holds it: indexed and reweighted ones
        // are held, unindexed ones are not.
        let mut model = TextMemories::default();
        for (i, e) in events.iter().enumerate() {
            let seq = i as u64 + 1;
            let ops = model.apply(seq, e).map(|a| a.ops).unwrap_or_default();
            model.advance_to(seq);
            for op in ops {
                match op {
                    IndexOp::Unindex { seq, .. } => prop_assert!(model.get(seq).is_none()),
                    op => prop_assert!(model.get(op.seq()).is_some()),
                }
            }
        }
    }
}

//! Rebuilding equals incremental: the state hash of one pass equals that of two halves with a
//! snapshot round trip in between, and validity does not depend on arrival order.

mod common;

use common::*;
use engram_facts::FactTable;
use engram_fixtures::models::{self, day};
use engram_schema::{Envelope, EventKind};
use proptest::prelude::*;
use serde_json::{Value, json};

fn scenario(confidence: f64) -> Vec<Envelope> {
    let a = scope("acme", "team-a");
    let ab = scope("acme", "team-ab");
    let fact = |subject: &str, predicate: &str, object: Value| json!({"subject": subject, "predicate": predicate, "object": object, "confidence": confidence});
    vec![
        asserted(&a, fact("alice", "lives_in", json!("london")), "2024-01-01"),
        asserted(&ab, fact("alice", "lives_in", json!("rome")), "2024-01-02"),
        asserted(&a, fact("alice", "lives_in", json!("london")), "2024-01-03"),
        event(
            &a,
            EventKind::Observation,
            json!({"note": "ignored"}),
            "2024-01-04",
        ),
        asserted(&a, json!({"subject": "alice"}), "2024-01-05"),
        asserted(&a, fact("alice", "lives_in", json!("paris")), "2024-06-01"),
        asserted(
            &a,
            fact("alice", "pets", json!({"kind": "cat", "age": 3})),
            "2024-02-01",
        ),
        recorded(
            retracted(
                &a,
                json!({"subject": "alice", "predicate": "lives_in", "object": "paris"}),
                "2024-07-01",
            ),
            "2024-07-02",
        ),
        asserted(&a, fact("alice", "lives_in", json!("berlin")), "2024-03-01"),
        asserted(
            &a,
            json!({"subject": "bob", "predicate": "speaks", "object": "en", "cardinality": "multi", "valid_to": "2030-01-01T00:00:00Z"}),
            "2024-04-01",
        ),
    ]
}

/// A table fed `events` at seqs 1, 2, 3, … in one pass.
fn one_pass(events: &[Envelope]) -> FactTable {
    models::one_pass(events)
}

#[test]
fn a_rebuild_in_one_pass_hashes_like_two_halves_with_a_snapshot_between() {
    let events = scenario(0.8);
    let whole = one_pass(&events);
    assert!(whole.len() >= 5, "the scenario exercises the table");

    models::assert_rebuild_equals_incremental::<FactTable>(&events);
}

#[test]
fn the_hash_tells_different_states_apart() {
    let events = scenario(0.8);
    let whole = one_pass(&events);

    assert_ne!(one_pass(&scenario(0.7)).state_hash(), whole.state_hash());
    assert_ne!(
        one_pass(&events[..events.len() - 1]).state_hash(),
        whole.state_hash()
    );
    assert_eq!(one_pass(&events).state_hash(), whole.state_hash());
}

#[derive(Clone, Debug)]
struct Op {
    kind: u8,
    scope: bool,
    subject: u8,
    predicate: u8,
    object: u8,
    occurred_day: i64,
    recorded_delay: i64,
    valid_from_day: Option<i64>,
    confidence: u8,
    multi: bool,
}

fn op() -> impl Strategy<Value = Op> {
    (
        (0u8..6, any::<bool>(), 0u8..2, 0u8..2, 0u8..3),
        (
            0i64..40,
            0i64..5,
            proptest::option::of(0i64..40),
            0u8..=10,
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (kind, scope, subject, predicate, object),
                (occurred_day, recorded_delay, valid_from_day, confidence, multi),
            )| Op {
                kind,
                scope,
                subject,
                predicate,
                object,
                occurred_day,
                recorded_delay,
                valid_from_day,
                confidence,
                multi,
            },
        )
}

fn envelope(op: &Op) -> Envelope {
    let team = if op.scope {
        scope("acme", "team-a")
    } else {
        scope("acme", "team-ab")
    };
    let subject = format!("s{}", op.subject);
    let predicate = format!("p{}", op.predicate);
    let mut data =
        json!({"subject": subject, "predicate": predicate, "object": format!("o{}", op.object)});
    let kind = match op.kind {
        0..=2 => {
            data["confidence"] = json!(f64::from(op.confidence) / 10.0);
            data["cardinality"] = json!(if op.multi { "multi" } else { "single" });
            if let Some(valid_from) = op.valid_from_day {
                data["valid_from"] = json!(day(valid_from));
            }
            EventKind::FactAsserted
        }
        3 => {
            if op.object == 0 {
                data.as_object_mut().unwrap().remove("object");
            }
            EventKind::FactRetracted
        }
        4 => {
            data.as_object_mut().unwrap().remove("object");
            EventKind::FactAsserted
        }
        _ => EventKind::Observation,
    };
    let mut event = event(&team, kind, data, &day(op.occurred_day));
    event.recorded_at = t(&day(op.occurred_day + op.recorded_delay));
    event
}

proptest! {
    #[test]
    fn any_split_with_a_snapshot_between_hashes_like_one_pass(
        ops in proptest::collection::vec(op(), 0..40),
        split in 0usize..40,
    ) {
        let events: Vec<Envelope> = ops.iter().map(envelope).collect();
        let split = split.min(events.len());
        let whole = one_pass(&events);
        let halves: FactTable = models::in_two_halves(&events, split, models::named);
        prop_assert_eq!(halves.state_hash(), whole.state_hash());
        prop_assert_eq!(&halves, &whole);
    }

    #[test]
    fn single_valued_validity_does_not_depend_on_arrival_order(
        starts in proptest::collection::vec(proptest::option::of(0i64..30), 1..8),
        order in Just((0..8usize).collect::<Vec<_>>()).prop_shuffle(),
    ) {
        let team = scope("acme", "team-a");
        // Distinct objects and occurred_at, so no merges and no ties.
        let events: Vec<Envelope> = starts.iter().enumerate().map(|(i, start)| {
            let mut data = json!({"subject": "s", "predicate": "p", "object": i});
            if let Some(start) = start {
                data["valid_from"] = json!(day(*start));
            }
            asserted(&team, data, &day(i as i64 * 2))
        }).collect();
        let shuffled: Vec<Envelope> =
            order.iter().filter(|&&i| i < events.len()).map(|&i| events[i].clone()).collect();
        let spans = |table: &FactTable| {
            let mut spans: Vec<_> = table
                .history(&team, "s", "p")
                .iter()
                .map(|f| {
                    let next = f.superseded_by.map(|id| {
                        table.history(&team, "s", "p").iter().find(|g| g.id == id).unwrap().object.clone()
                    });
                    (f.object.to_string(), f.valid_from, f.valid_to, next)
                })
                .collect();
            spans.sort_by(|a, b| a.0.cmp(&b.0));
            spans
        };
        prop_assert_eq!(spans(&one_pass(&shuffled)), spans(&one_pass(&events)));
    }
}

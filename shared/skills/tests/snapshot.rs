//! Rebuilding equals incremental: the state hash of one pass equals that of two halves with a
//! snapshot round trip in between.

mod common;

use common::*;
use engram_fixtures::models::{self, day};
use engram_schema::{Envelope, EventKind};
use engram_skills::SkillRegistry;
use proptest::prelude::*;
use serde_json::json;

fn scenario(last_success: bool) -> Vec<Envelope> {
    let a = scope("acme", "team-a");
    let ab = scope("acme", "team-ab");
    vec![
        used(&a, "lint", true, "2024-01-01"),
        recorded(
            &a,
            json!({"name": "lint", "description": "Run the linter", "steps": ["cargo clippy"], "script": "just lint", "preconditions": ["rust"]}),
            "2024-01-02",
        ),
        outcome(
            &a,
            json!({"skill": "lint", "success": false, "version": 3}),
            "2024-01-03",
        ),
        skill(&ab, "lint", "Run another linter", "2024-01-03"),
        event(
            &a,
            EventKind::Observation,
            Some(json!({"note": 1})),
            "2024-01-04",
        ),
        recorded(&a, json!({"name": "lint", "description": 5}), "2024-01-05"),
        recorded(
            &a,
            json!({"name": "lint", "version": 3, "description": "v3"}),
            "2024-01-06",
        ),
        recorded(
            &a,
            json!({"name": "lint", "version": 2, "description": "v2"}),
            "2024-01-07",
        ),
        used(&ab, "deploy", true, "2024-01-08"),
        used(&a, "lint", last_success, "2024-01-09"),
    ]
}

/// A registry fed `events` at seqs 1, 2, 3, … in one pass.
fn one_pass(events: &[Envelope]) -> SkillRegistry {
    models::one_pass(events)
}

#[test]
fn a_rebuild_in_one_pass_hashes_like_two_halves_with_a_snapshot_between() {
    let events = scenario(true);
    let whole = one_pass(&events);
    assert_eq!(whole.len(), 2, "the scenario exercises the registry");
    assert!(whole.pending(&scope("acme", "team-ab"), "deploy").is_some());

    models::assert_rebuild_equals_incremental::<SkillRegistry>(&events);
}

#[test]
fn the_hash_tells_different_states_apart() {
    let events = scenario(true);
    let whole = one_pass(&events);

    assert_ne!(one_pass(&scenario(false)).state_hash(), whole.state_hash());
    assert_ne!(
        one_pass(&events[..events.len() - 1]).state_hash(),
        whole.state_hash()
    );
    assert_eq!(one_pass(&events).state_hash(), whole.state_hash());
}

fn envelope(
    (kind, team, name, version, flag, when): (u8, bool, u8, Option<u32>, bool, i64),
) -> Envelope {
    let team = if team {
        scope("acme", "team-a")
    } else {
        scope("acme", "team-ab")
    };
    let name = format!("skill-{name}");
    match kind {
        0 | 1 => recorded(
            &team,
            json!({"name": name, "version": version, "description": format!("does {name} things"), "steps": [format!("step {when}")]}),
            &day(when),
        ),
        2 | 3 => outcome(
            &team,
            json!({"skill": name, "success": flag, "version": version}),
            &day(when),
        ),
        4 => recorded(
            &team,
            json!({"name": name, "version": 0, "description": "bad"}),
            &day(when),
        ),
        _ => outcome(&team, json!({"success": flag}), &day(when)),
    }
}

proptest! {
    #[test]
    fn any_split_with_a_snapshot_between_hashes_like_one_pass(
        ops in proptest::collection::vec(
            (0u8..6, any::<bool>(), 0u8..3, proptest::option::of(1u32..4), any::<bool>(), 0i64..30),
            0..40,
        ),
        split in 0usize..40,
    ) {
        let events: Vec<Envelope> = ops.into_iter().map(envelope).collect();
        let split = split.min(events.len());
        let whole = one_pass(&events);
        let halves: SkillRegistry = models::in_two_halves(&events, split, models::named);
        prop_assert_eq!(halves.state_hash(), whole.state_hash());
        prop_assert_eq!(&halves, &whole);
    }
}

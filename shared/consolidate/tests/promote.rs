//! Given/when/then tests of skill promotion: which episodes make a skill, what it records,
//! that it is planned once per piece of evidence, deterministically, in bounded state.

use engram_consolidate::model::{MAX_ACTION_BYTES, MAX_EPISODE_ACTIONS, MAX_OPEN_EPISODES};
use engram_consolidate::promote::{normalise, skill_name};
use engram_consolidate::{Memories, Policy, plan};
use engram_fixtures::models::{Stream, day, scope, t};
use engram_memory::ScopeKey;
use engram_memory::model::EventModel;
use engram_schema::{Envelope, EventKind, Layer, SkillRecorded};
use serde_json::{Value, json};

/// An action of episode `episode` (its correlation id).
fn action(scope: &ScopeKey, episode: &str, text: &str, at: &str) -> Envelope {
    let mut e =
        engram_fixtures::models::event(scope, Layer::Episodic, EventKind::Action, None, t(at));
    e.content.text = text.into();
    e.correlation_id = Some(episode.into());
    e
}

/// An outcome of episode `episode` with `data`.
fn outcome_with(scope: &ScopeKey, episode: &str, data: Value, at: &str) -> Envelope {
    let mut e = engram_fixtures::models::event(
        scope,
        Layer::Episodic,
        EventKind::Outcome,
        Some(data),
        t(at),
    );
    e.content.text = "done".into();
    e.correlation_id = Some(episode.into());
    e
}

/// The outcome that ends episode `episode`.
fn outcome(scope: &ScopeKey, episode: &str, success: bool, at: &str) -> Envelope {
    outcome_with(scope, episode, json!({"success": success}), at)
}

/// Episode `n`: `steps` on day `n`, then its outcome.
fn episode(scope: &ScopeKey, n: i64, steps: &[&str], success: bool) -> Vec<Envelope> {
    let name = format!("episode-{n}");
    let mut events: Vec<Envelope> = steps
        .iter()
        .map(|s| action(scope, &name, s, &day(n)))
        .collect();
    events.push(outcome(scope, &name, success, &day(n)));
    events
}

/// Episodes 0, 1, … of one sequence (with varying numbers), with these successes.
fn episodes(scope: &ScopeKey, successes: &[bool]) -> Vec<Envelope> {
    successes
        .iter()
        .enumerate()
        .flat_map(|(i, &success)| {
            let open = format!("open file {}", i + 10);
            let edit = format!("edit line {}", 3 * i + 1);
            episode(scope, i as i64, &[&open, &edit, "run tests"], success)
        })
        .collect()
}

/// Applies a plan's events, as appending them would.
fn apply_plan(stream: &mut Stream<Memories>, events: &[Envelope]) {
    for e in events {
        e.validate().expect("planned events pass the append check");
        stream.apply(e).unwrap();
    }
}

fn promote(stream: &Stream<Memories>, scope: &ScopeKey) -> Vec<Envelope> {
    plan(&stream.model, scope, &Policy::default(), &["promote"]).events
}

fn recorded(event: &Envelope) -> SkillRecorded {
    SkillRecorded::from_event(event).expect("a valid skill record")
}

#[test]
fn action_texts_are_normalised_to_steps() {
    assert_eq!(normalise("Open  file 12\t"), "open file #");
    assert_eq!(normalise("open file 7"), "open file #");
    assert_eq!(normalise("bump v1.20.3"), "bump v#.#.#");
    assert_eq!(normalise("ÉDIT  line\n4"), "édit line #");
    let key = "open file #\nedit line #\nrun tests";
    let name = skill_name(key);
    assert!(
        name.starts_with("promoted-open-file-edit-line-run-tests-"),
        "{name}"
    );
    assert_eq!(
        name.len(),
        "promoted-open-file-edit-line-run-tests-".len() + 12
    );
    assert_eq!(name, skill_name(key), "deterministic");
}

#[test]
fn three_successful_episodes_of_one_sequence_become_a_skill_with_their_outcomes() {
    let team = scope("acme", "core");
    // Given three successful episodes of one procedure, worded with other numbers and
    // case; the last two interleave (by correlation id), and a skill's outcome and an
    // outcome without a boolean success in the middle end nothing.
    let mut events = episode(
        &team,
        0,
        &["Open file 12", "edit line 4", "run tests"],
        true,
    );
    events.extend([
        action(&team, "episode-1", "open file 7", "2024-01-02"),
        action(&team, "episode-2", "open FILE 3", "2024-01-03"),
        action(&team, "episode-1", "edit   line 40", "2024-01-04"),
        outcome_with(
            &team,
            "episode-1",
            json!({"skill": "lint", "success": false}),
            "2024-01-04",
        ),
        outcome_with(&team, "episode-1", json!({"status": "ok"}), "2024-01-04"),
        action(&team, "episode-2", "edit line 1", "2024-01-05"),
        action(&team, "episode-1", "run tests", "2024-01-06"),
        action(&team, "episode-2", "Run Tests", "2024-01-07"),
        outcome(&team, "episode-1", true, "2024-01-08"),
    ]);
    let last = outcome(&team, "episode-2", true, "2024-01-09");
    events.push(last.clone());
    let stream = Stream::<Memories>::given(&events);

    // When consolidation plans promotion...
    let planned = promote(&stream, &team);

    // ...then one skill is recorded, by the consolidator, in the procedural layer, with
    // the three successes, the steps as the latest episode wrote them, and caused by its
    // outcome.
    assert_eq!(planned.len(), 1, "{planned:#?}");
    let event = &planned[0];
    event.validate().unwrap();
    assert_eq!(
        (event.kind, event.layer),
        (EventKind::SkillRecorded, Layer::Procedural)
    );
    assert_eq!(event.agent_id.as_str(), "consolidator");
    assert_eq!(event.causation_id.as_ref(), Some(&last.event_id));
    assert_eq!(
        event.correlation_id.as_deref(),
        Some(format!("consolidation/{}", team.scope()).as_str())
    );
    assert_eq!(event.occurred_at, t("2024-01-09"), "the scope's clock");
    let skill = recorded(event);
    assert_eq!(
        skill.name,
        skill_name("open file #\nedit line #\nrun tests")
    );
    assert_eq!(skill.steps(), ["open FILE 3", "edit line 1", "Run Tests"]);
    let observed = skill.observed.unwrap();
    assert_eq!((observed.successes, observed.failures), (3, 0));
    assert_eq!(skill.version, None, "the registry numbers the versions");
    assert!(
        skill
            .description
            .contains("open file #; then edit line #; then run tests"),
        "{}",
        skill.description
    );
}

#[test]
fn a_sequence_seen_twice_is_not_promoted() {
    let team = scope("acme", "core");
    let stream = Stream::<Memories>::given(&episodes(&team, &[true, true]));
    assert!(promote(&stream, &team).is_empty());
}

#[test]
fn a_sequence_that_works_half_the_time_is_not_promoted() {
    let team = scope("acme", "core");
    // Given three successes and three failures (a rate of 0.5, below 0.6)...
    let stream =
        Stream::<Memories>::given(&episodes(&team, &[true, false, true, false, true, false]));
    // ...nothing is promoted.
    assert!(promote(&stream, &team).is_empty());
    // At three in five (exactly 0.6) it is, with its failures.
    let stream = Stream::<Memories>::given(&episodes(&team, &[true, false, true, false, true]));
    let planned = promote(&stream, &team);
    assert_eq!(planned.len(), 1);
    let observed = recorded(&planned[0]).observed.unwrap();
    assert_eq!((observed.successes, observed.failures), (3, 2));
}

#[test]
fn a_promotion_once_applied_is_not_planned_again_and_new_evidence_is_a_new_version() {
    let team = scope("acme", "core");
    let mut stream = Stream::<Memories>::given(&episodes(&team, &[true, true, true]));
    let first = promote(&stream, &team);
    assert_eq!(first.len(), 1);
    // Re-planning before it is applied gives the same event: the stream stores it once.
    assert_eq!(promote(&stream, &team), first);
    // When it is applied, it is planned no more.
    apply_plan(&mut stream, &first);
    assert!(promote(&stream, &team).is_empty());
    assert!(
        plan(&stream.model, &team, &Policy::default(), &[])
            .events
            .iter()
            .all(|e| e.kind != EventKind::SkillRecorded)
    );
    // A fourth and fifth success are not yet a new version: versions come as the evidence
    // doubles, not with every episode of a hot sequence.
    let more = |n: i64, stream: &mut Stream<Memories>| {
        for e in episode(
            &team,
            n,
            &["open file 99", "edit line 9", "run tests"],
            true,
        ) {
            stream.apply(&e).unwrap();
        }
    };
    more(9, &mut stream);
    more(10, &mut stream);
    assert!(promote(&stream, &team).is_empty(), "5 of a milestone of 6");
    // The sixth doubles it: the same skill gets a new record with the new count.
    more(11, &mut stream);
    let second = promote(&stream, &team);
    assert_eq!(second.len(), 1);
    assert_ne!(second[0].event_id, first[0].event_id);
    let (a, b) = (recorded(&first[0]), recorded(&second[0]));
    assert_eq!(a.name, b.name);
    assert_eq!(b.observed.unwrap().successes, 6);
}

#[test]
fn promotions_come_at_each_doubling_of_the_evidence() {
    use engram_consolidate::promote::milestone;
    let at: Vec<u32> = (3..=25).map(|n| milestone(n, 3)).collect();
    assert_eq!(&at[..4], &[3, 3, 3, 6], "3, 4, 5 share one; 6 is the next");
    assert_eq!(milestone(11, 3), 6);
    assert_eq!(milestone(12, 3), 12);
    assert_eq!(milestone(24, 3), 24);
    assert_eq!(milestone(u32::MAX, 3), 3 << 30);
}

#[test]
fn the_same_episodes_plan_byte_identical_promotions() {
    let team = scope("acme", "core");
    let mut events = episodes(&team, &[true, true, false, true]);
    events.extend(episode(
        &team,
        20,
        &["fetch issue 4", "write fix", "open pull request"],
        true,
    ));
    events.extend(episode(
        &team,
        21,
        &["fetch issue 17", "write fix", "open pull request"],
        true,
    ));
    events.extend(episode(
        &team,
        22,
        &["fetch issue 3", "write fix", "open pull request"],
        true,
    ));
    let a = Stream::<Memories>::given(&events).model;
    // A replica that restored a checkpoint half-way, mid-episode.
    let b: Memories =
        engram_fixtures::models::in_two_halves(&events, 7, engram_fixtures::models::named);
    let c: Memories =
        engram_fixtures::models::in_two_halves(&events, 13, engram_fixtures::models::as_json);
    assert_eq!(a.state_hash(), b.state_hash());
    assert_eq!(a.state_hash(), c.state_hash());
    let planned = |m: &Memories| {
        serde_json::to_vec(&plan(m, &team, &Policy::default(), &["promote"]).events).unwrap()
    };
    let pa = plan(&a, &team, &Policy::default(), &["promote"]).events;
    assert_eq!(pa.len(), 2, "both sequences");
    assert_eq!(planned(&a), planned(&b));
    assert_eq!(planned(&a), planned(&c));
}

#[test]
fn the_state_hash_covers_the_episodes() {
    let team = scope("acme", "core");
    let events = episodes(&team, &[true]);
    let (steps, ended) = (&events[..events.len() - 1], &events[..]);
    let hash = |events: &[Envelope]| Stream::<Memories>::given(events).model.state_hash();
    assert_ne!(hash(steps), hash(ended));
    let mut failed = events.clone();
    *failed.last_mut().unwrap() = outcome(&team, "episode-0", false, &day(0));
    failed.last_mut().unwrap().event_id = events.last().unwrap().event_id.clone();
    assert_ne!(hash(&failed), hash(ended), "the outcome's success counts");
}

#[test]
fn a_hostile_episode_stays_bounded_and_is_not_promoted() {
    let team = scope("acme", "core");
    // Given an episode of 10,000 actions with long texts...
    let long = "x".repeat(10 * MAX_ACTION_BYTES);
    let mut stream = Stream::<Memories>::default();
    for i in 0..10_000 {
        let text = if i == 0 {
            long.clone()
        } else {
            format!("step {i}")
        };
        stream
            .apply(&action(&team, "flood", &text, "2024-01-01"))
            .unwrap();
    }
    // ...the scope holds at most 32 of them, each at most 256 bytes.
    let state = stream.model.scope(&team).unwrap();
    let open: Vec<_> = state.episodes.open().collect();
    assert_eq!(open.len(), 1);
    let (_, flood) = open[0];
    assert_eq!(flood.actions.len(), MAX_EPISODE_ACTIONS);
    assert_eq!(flood.actions[0].len(), MAX_ACTION_BYTES);
    assert!(flood.overflowed);
    // When it ends, even three times over, it is dropped: it is not known whole.
    for _ in 0..3 {
        stream
            .apply(&outcome(&team, "flood", true, "2024-01-02"))
            .unwrap();
        for i in 0..(MAX_EPISODE_ACTIONS + 1) {
            stream
                .apply(&action(&team, "flood", &format!("step {i}"), "2024-01-02"))
                .unwrap();
        }
    }
    stream
        .apply(&outcome(&team, "flood", true, "2024-01-02"))
        .unwrap();
    let state = stream.model.scope(&team).unwrap();
    assert_eq!(state.episodes.ended().count(), 0);
    assert!(promote(&stream, &team).is_empty());
    // And a flood of episodes that never end keeps at most MAX_OPEN_EPISODES open, the
    // most recent ones.
    for i in 0..(MAX_OPEN_EPISODES + 100) {
        stream
            .apply(&action(&team, &format!("g-{i}"), "poke", "2024-01-03"))
            .unwrap();
    }
    let state = stream.model.scope(&team).unwrap();
    assert_eq!(state.episodes.open().count(), MAX_OPEN_EPISODES);
    assert!(state.episodes.open().all(|(_, e)| e.actions == ["poke"]));
}

#[test]
fn the_promotion_policy_is_validated() {
    assert_eq!(Policy::default().validate(), Ok(()));
    let once = Policy {
        promote_min_occurrences: 1,
        ..Policy::default()
    };
    assert!(
        once.validate()
            .unwrap_err()
            .contains("promote_min_occurrences")
    );
    let over = Policy {
        promote_min_success: 1.5,
        ..Policy::default()
    };
    assert!(over.validate().unwrap_err().contains("promote_min_success"));
}

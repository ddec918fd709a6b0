//! Given/when/then tests of the consolidation steps: the dedup rule, the extractive
//! summariser, decay and archiving, and that the same stream plans byte-identical outputs.

use engram_consolidate::model::Origin;
use engram_consolidate::steps::decayed;
use engram_consolidate::{Memories, Policy, plan, plan_with};
use engram_fixtures::models::{Stream, scope, t};
use engram_memory::ScopeKey;
use engram_memory::model::EventModel;
use engram_memory::proto::Neighbour;
use engram_schema::{Envelope, EventKind, Layer};
use serde_json::json;

fn memory(scope: &ScopeKey, text: &str, at: &str) -> Envelope {
    let mut e =
        engram_fixtures::models::event(scope, Layer::Episodic, EventKind::Observation, None, t(at));
    e.content.text = text.into();
    e
}

fn finished(scope: &ScopeKey, at: &str) -> Envelope {
    engram_fixtures::models::event(
        scope,
        Layer::Working,
        EventKind::Checkpoint,
        Some(json!({"finished": true})),
        t(at),
    )
}

/// Applies a plan's events, as appending them would.
fn apply_plan(stream: &mut Stream<Memories>, events: &[Envelope]) {
    for e in events {
        e.validate().expect("planned events pass the append check");
        stream.apply(e).unwrap();
    }
}

#[test]
fn near_duplicates_merge_into_one_memory_that_counts_them_and_supersedes_them() {
    let team = scope("acme", "core");
    // Given three wordings of one lesson and one unrelated memory.
    let mut stream = Stream::<Memories>::given(&[
        memory(
            &team,
            "the deploy to staging fails when the migration lock is held by another job",
            "2026-01-01",
        ),
        memory(
            &team,
            "The deploy to staging fails when the migration lock is held by another job!",
            "2026-01-02",
        ),
        memory(
            &team,
            "the cache warms up slowly after a restart of the api pods",
            "2026-01-03",
        ),
        memory(
            &team,
            "the deploy to staging fails when the migration lock is held by another job again",
            "2026-01-04",
        ),
    ]);
    // When consolidation plans dedup.
    let p = plan(&stream.model, &team, &Policy::default(), &["dedup"]);
    // Then one merged memory names the three, counts three recurrences and is more
    // important than any of them; a forgotten event caused by it supersedes them.
    assert_eq!(p.events.len(), 2, "{:#?}", p.events);
    let merged = &p.events[0];
    assert_eq!(merged.kind, EventKind::Consolidated);
    let data = merged.content.data.as_ref().unwrap();
    assert_eq!(data["op"], "merged");
    assert_eq!(data["recurrences"], 3);
    assert_eq!(data["sources"].as_array().unwrap().len(), 3);
    assert!(
        (merged.importance - 0.7).abs() < 1e-9,
        "0.5 + 2 x 0.1, got {}",
        merged.importance
    );
    let superseded = &p.events[1];
    assert_eq!(superseded.kind, EventKind::Forgotten);
    assert_eq!(superseded.causation_id.as_ref(), Some(&merged.event_id));
    assert_eq!(
        superseded.content.data.as_ref().unwrap()["event_ids"],
        data["sources"]
    );
    // And once applied, the scope shows one memory of the lesson, and plans nothing more.
    apply_plan(&mut stream, &p.events);
    let state = stream.model.scope(&team).unwrap();
    let visible: Vec<_> = state.visible().map(|(_, m)| m).collect();
    assert_eq!(visible.len(), 2);
    assert!(
        visible
            .iter()
            .any(|m| m.origin == Origin::Merged && m.recurrences == 3)
    );
    assert!(
        plan(&stream.model, &team, &Policy::default(), &["dedup"])
            .events
            .is_empty()
    );
}

#[test]
fn a_scope_flooded_with_one_text_merges_it_once_in_bounded_work() {
    let team = scope("acme", "core");
    let text = "retry the upload when the gateway answers 502";
    let events: Vec<Envelope> = (0..3_000)
        .map(|_| memory(&team, text, "2026-01-01"))
        .collect();
    let stream = Stream::<Memories>::given(&events);
    let started = std::time::Instant::now();
    let p = plan(&stream.model, &team, &Policy::default(), &["dedup"]);
    // Every copy in one merge (sources capped at the payload's 1000), and its supersession.
    assert_eq!(p.events.len(), 2);
    let data = p.events[0].content.data.as_ref().unwrap();
    assert_eq!(data["sources"].as_array().unwrap().len(), 1_000);
    // Not a timing assertion on the machine's speed: all pairs would be 4.5 million
    // comparisons per band; the bound keeps it near 3,000 x 32.
    eprintln!("planned in {:?}", started.elapsed());
}

fn close(a: &Envelope, b: &Envelope, similarity: f32) -> Neighbour {
    Neighbour {
        a: a.event_id.clone(),
        b: b.event_id.clone(),
        similarity,
    }
}

#[test]
fn a_reworded_memory_the_vector_model_finds_close_merges_into_the_fuller_one() {
    let team = scope("acme", "core");
    // Given a reordered telling (few shared shingles), a fuller one, a near miss that
    // differs in one word, and a pair the vector model finds not close enough.
    let short = memory(&team, "deploy failed: disk full on node-3", "2026-01-01");
    let fuller = memory(
        &team,
        "disk full on node-3, so the deploy failed",
        "2026-01-02",
    );
    let staging = memory(&team, "the deploy to staging succeeded", "2026-01-03");
    let production = memory(&team, "the deploy to production succeeded", "2026-01-04");
    let cache = memory(&team, "the cache is cold after a restart", "2026-01-05");
    let cache_again = memory(&team, "after a restart the cache is cold", "2026-01-06");
    let stream = Stream::<Memories>::given(&[
        short.clone(),
        fuller.clone(),
        staging.clone(),
        production.clone(),
        cache.clone(),
        cache_again.clone(),
    ]);
    let policy = Policy::default();
    // MinHash alone sees no duplicates among them.
    assert!(
        plan(&stream.model, &team, &policy, &["dedup"])
            .events
            .is_empty()
    );
    // When the vector model offers all three pairs.
    let pairs = [
        close(&short, &fuller, 0.95),
        close(&staging, &production, 0.97),
        close(&cache, &cache_again, 0.80),
    ];
    let p = plan_with(&stream.model, &team, &policy, &["dedup"], &pairs);
    // Then only the telling whose words the other holds is merged, into the fuller text.
    assert_eq!(p.events.len(), 2, "{:#?}", p.events);
    let merged = &p.events[0];
    let data = merged.content.data.as_ref().unwrap();
    assert_eq!(data["op"], "merged");
    assert_eq!(merged.content.text, fuller.content.text);
    let mut sources: Vec<&str> = data["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    sources.sort_unstable();
    let mut wanted = vec![short.event_id.as_str(), fuller.event_id.as_str()];
    wanted.sort_unstable();
    assert_eq!(sources, wanted);
    // And a stricter vector threshold offers none of them.
    let strict = Policy {
        dedup_vector_similarity: 0.99,
        ..Policy::default()
    };
    assert!(
        plan_with(&stream.model, &team, &strict, &["dedup"], &pairs)
            .events
            .is_empty()
    );
}

#[test]
fn short_texts_that_differ_in_the_word_that_matters_are_not_merged() {
    let team = scope("acme", "core");
    let (a, b) = (
        "deploy failed: disk full on node-3",
        "deploy failed: disk full on node-4",
    );
    // Their signatures' estimate says near-duplicate (the reason the sets decide)...
    let sig = |t| engram_consolidate::minhash::Signature::of(t).unwrap();
    assert!(sig(a).similarity(&sig(b)) >= Policy::default().dedup_similarity);
    // ...but 4 of their 6 shingles are shared: 0.67, under the 0.75 a merge takes.
    let stream = Stream::<Memories>::given(&[
        memory(&team, a, "2026-01-01"),
        memory(&team, b, "2026-01-02"),
    ]);
    assert!(
        plan(&stream.model, &team, &Policy::default(), &["dedup"])
            .events
            .is_empty()
    );
}

#[test]
fn memories_that_only_share_a_topic_are_not_merged() {
    let team = scope("acme", "core");
    let stream = Stream::<Memories>::given(&[
        memory(
            &team,
            "the deploy to staging fails when the migration lock is held",
            "2026-01-01",
        ),
        memory(
            &team,
            "the deploy to production succeeded after the lock was released by hand",
            "2026-01-02",
        ),
    ]);
    assert!(
        plan(&stream.model, &team, &Policy::default(), &["dedup"])
            .events
            .is_empty()
    );
}

#[test]
fn a_finished_session_becomes_a_summary_of_what_it_kept_coming_back_to() {
    let session = scope("acme", "s-1");
    let mut events = vec![
        memory(
            &session,
            "We looked at the billing export. The billing export drops rows with a null region.",
            "2026-01-01",
        ),
        memory(&session, "Lunch was late today.", "2026-01-01T01:00:00Z"),
        memory(
            &session,
            "The null region rows come from the legacy importer. The billing export needs a default region.",
            "2026-01-01T02:00:00Z",
        ),
    ];
    let mut stream = Stream::<Memories>::given(&events);
    // Given no checkpoint yet, nothing is summarised.
    assert!(
        plan(&stream.model, &session, &Policy::default(), &["summarise"])
            .events
            .is_empty()
    );
    // When the session is marked finished...
    events.push(finished(&session, "2026-01-01T03:00:00Z"));
    stream.apply(events.last().unwrap()).unwrap();
    let p = plan(&stream.model, &session, &Policy::default(), &["summarise"]);
    // ...then one semantic summary names every memory, and keeps the sentences about the
    // billing export and its null regions before the aside about lunch.
    assert_eq!(p.events.len(), 1);
    let summary = &p.events[0];
    assert_eq!(
        (summary.kind, summary.layer),
        (EventKind::Consolidated, Layer::Semantic)
    );
    assert_eq!(
        summary.content.data.as_ref().unwrap()["sources"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    let text = &summary.content.text;
    assert!(
        text.starts_with("We looked at the billing export."),
        "{text}"
    );
    assert!(text.contains("needs a default region"), "{text}");
    let lunch = text.find("Lunch").map_or(usize::MAX, |i| i);
    assert!(lunch > text.find("null region").unwrap(), "{text}");
    // And it is planned once.
    apply_plan(&mut stream, &p.events);
    assert!(
        plan(&stream.model, &session, &Policy::default(), &["summarise"])
            .events
            .is_empty()
    );
}

#[test]
fn importance_halves_every_half_life_and_what_falls_below_the_threshold_is_archived() {
    // The rule itself.
    let now = t("2026-03-02");
    assert!((decayed(0.8, t("2026-01-31"), now, 30.0) - 0.4).abs() < 1e-9);
    assert!((decayed(0.8, now, now, 30.0) - 0.8).abs() < 1e-9);
    let team = scope("acme", "core");
    // Given an old unimportant memory, an old important one, and a fresh unimportant one.
    let mut old_minor = memory(
        &team,
        "the coffee machine on floor two is broken",
        "2025-06-01",
    );
    old_minor.importance = 0.3;
    let mut old_major = memory(
        &team,
        "never run the schema migration without a backup",
        "2025-06-01",
    );
    old_major.importance = 1.0;
    let mut fresh_minor = memory(&team, "standup moved to ten", "2026-03-01");
    fresh_minor.importance = 0.3;
    let mut stream =
        Stream::<Memories>::given(&[old_minor.clone(), old_major.clone(), fresh_minor.clone()]);
    // When decay runs at the scope's clock (its newest event, 2026-03-01)...
    let p = plan(&stream.model, &team, &Policy::default(), &["decay"]);
    // ...then both old ones are archived (0.3 x 0.5^(273/30) and 1.0 x 0.5^(273/30) are
    // both below 0.05: importance alone does not save a memory nobody used in nine
    // months), and the fresh one stays.
    assert_eq!(p.events.len(), 1);
    let archived = &p.events[0];
    assert_eq!(archived.kind, EventKind::Forgotten);
    let data = archived.content.data.as_ref().unwrap();
    assert_eq!(data["archived"], true);
    let ids: Vec<&str> = data["event_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [old_minor.event_id.as_str(), old_major.event_id.as_str()]
    );
    apply_plan(&mut stream, &p.events);
    let state = stream.model.scope(&team).unwrap();
    assert!(
        state.memory(old_minor.event_id.as_str()).unwrap().hidden,
        "archived, still held"
    );
    assert!(!state.memory(fresh_minor.event_id.as_str()).unwrap().hidden);
}

#[test]
fn a_memory_reported_used_is_reinforced_and_not_archived() {
    let team = scope("acme", "core");
    let mut old = memory(
        &team,
        "the release checklist lives in the ops wiki",
        "2025-06-01",
    );
    old.importance = 0.3;
    let fresh = memory(&team, "standup moved to ten", "2026-03-01");
    // Given an old memory that decay would archive...
    let stream = Stream::<Memories>::given(&[old.clone(), fresh.clone()]);
    assert_eq!(
        plan(&stream.model, &team, &Policy::default(), &["decay"])
            .events
            .len(),
        1
    );
    // ...when an agent reports using it (one feedback event for its step)...
    let mut used = engram_fixtures::models::event(
        &team,
        Layer::Episodic,
        EventKind::Feedback,
        Some(json!({"used": [old.event_id.as_str()]})),
        t("2026-02-20"),
    );
    used.content.text = "used in step 12".into();
    used.validate().unwrap();
    let mut stream = Stream::<Memories>::given(&[old.clone(), fresh.clone()]);
    stream.apply(&used).unwrap();
    // ...then its decay restarts from the use, and it stays in default retrieval.
    let m = stream
        .model
        .scope(&team)
        .unwrap()
        .memory(old.event_id.as_str())
        .unwrap();
    assert_eq!((m.uses, m.last_useful), (1, t("2026-02-20")));
    assert!(
        plan(&stream.model, &team, &Policy::default(), &["decay"])
            .events
            .is_empty()
    );
    // A use report naming no memory list is refused at append, naming the field.
    used.content.data = Some(json!({"used": []}));
    assert!(
        used.validate()
            .unwrap_err()
            .to_string()
            .contains("content.data.used")
    );
}

#[test]
fn each_use_adds_reinforcement_so_a_memory_used_more_outlasts_one_used_once() {
    let team = scope("acme", "core");
    let mut once = memory(&team, "the cache key includes the region", "2026-01-01");
    let mut thrice = memory(&team, "the deploy bot needs a fresh token", "2026-01-01");
    once.importance = 0.3;
    thrice.importance = 0.3;
    let use_of = |m: &Envelope| {
        let mut used = engram_fixtures::models::event(
            &team,
            Layer::Episodic,
            EventKind::Feedback,
            Some(json!({"used": [m.event_id.as_str()]})),
            t("2026-01-02"),
        );
        used.content.text = String::new();
        used
    };
    // Given both used on the same day (so their decay restarts together), one three times...
    let mut events = vec![once.clone(), thrice.clone(), use_of(&once)];
    events.extend((0..3).map(|_| use_of(&thrice)));
    // ...when 100 days pass (half-life 30: 0.4 decays to 0.04, 0.6 to 0.06)...
    events.push(memory(&team, "the clock moves on", "2026-04-12"));
    let stream = Stream::<Memories>::given(&events);
    // ...then only the one used once falls below 0.05 and is archived.
    let archived: Vec<String> = plan(&stream.model, &team, &Policy::default(), &["decay"])
        .events
        .iter()
        .flat_map(|e| {
            e.content.data.as_ref().unwrap()["event_ids"]
                .as_array()
                .unwrap()
                .clone()
        })
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(archived, [once.event_id.as_str().to_owned()]);
}

#[test]
fn the_same_stream_plans_byte_identical_outputs() {
    let team = scope("acme", "core");
    let events = vec![
        memory(
            &team,
            "the flaky test is the one that sleeps for a second",
            "2026-01-01",
        ),
        memory(
            &team,
            "the flaky test is the one that sleeps for a second!",
            "2026-01-02",
        ),
        memory(&team, "rotate the api keys every ninety days", "2025-01-01"),
        finished(&team, "2026-01-03"),
    ];
    let encode = |events: &[Envelope]| -> Vec<u8> {
        let codec = engram_schema::Codec::default();
        events
            .iter()
            .flat_map(|e| codec.encode(e).unwrap())
            .collect()
    };
    let a = Stream::<Memories>::given(&events).model;
    // A replica that restored a checkpoint half-way.
    let b: Memories =
        engram_fixtures::models::in_two_halves(&events, 2, engram_fixtures::models::named);
    assert_eq!(a.state_hash(), b.state_hash());
    let (pa, pb) = (
        plan(&a, &team, &Policy::default(), &[]),
        plan(&b, &team, &Policy::default(), &[]),
    );
    assert!(!pa.events.is_empty());
    assert_eq!(encode(&pa.events), encode(&pb.events));
}

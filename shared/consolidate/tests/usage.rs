//! Given/when/then tests of retrieval usage in the consolidator's model: `feedback` with
//! `retrieved` is counted per memory and never reinforces; with `used` as well, only the
//! use does.

use engram_consolidate::{Memories, Policy, plan};
use engram_fixtures::models::{Stream, scope, t};
use engram_memory::model::EventModel;
use engram_memory::{ScopeKey, is_text_memory};
use engram_schema::{Envelope, EventKind, Layer};
use serde_json::{Value, json};

fn memory(scope: &ScopeKey, text: &str, at: &str) -> Envelope {
    let mut e =
        engram_fixtures::models::event(scope, Layer::Episodic, EventKind::Observation, None, t(at));
    e.content.text = text.into();
    e.importance = 0.3;
    e
}

fn feedback(scope: &ScopeKey, data: Value, at: &str) -> Envelope {
    let e = engram_fixtures::models::event(
        scope,
        Layer::Episodic,
        EventKind::Feedback,
        Some(data),
        t(at),
    );
    e.validate().expect("a valid usage report");
    assert!(!is_text_memory(&e), "a usage report is not a memory");
    e
}

#[test]
fn retrieval_is_counted_but_only_use_reinforces() {
    let team = scope("acme", "core");
    let old = memory(
        &team,
        "the release checklist lives in the ops wiki",
        "2025-06-01",
    );
    let other = memory(&team, "the build cache is on the second disk", "2025-06-02");
    let id = |e: &Envelope| e.event_id.as_str().to_owned();
    // Given two old memories that decay would archive...
    let mut stream = Stream::<Memories>::given(&[old.clone(), other.clone()]);
    let hash_before = stream.model.state_hash();
    // ...when queries returned both, many times, reported in aggregate...
    stream
        .apply(&feedback(
            &team,
            json!({"retrieved": {id(&old): 40, id(&other): 2}}),
            "2026-03-01",
        ))
        .unwrap();
    stream
        .apply(&feedback(
            &team,
            json!({"retrieved": {id(&old): 10}}),
            "2026-03-01T00:01:00Z",
        ))
        .unwrap();
    // ...then the retrievals are counted, and change the state hash...
    let state = stream.model.scope(&team).unwrap();
    let m = state.memory(&id(&old)).unwrap();
    assert_eq!(
        (m.retrievals, m.uses, m.last_useful),
        (50, 0, t("2025-06-01"))
    );
    assert_eq!(state.memory(&id(&other)).unwrap().retrievals, 2);
    assert_ne!(stream.model.state_hash(), hash_before);
    // ...but being returned is not being useful: both still decay into the archive.
    let archived = plan(&stream.model, &team, &Policy::default(), &["decay"]).events;
    assert_eq!(archived.len(), 1);
    let names = &archived[0].content.data.as_ref().unwrap()["event_ids"];
    assert_eq!(names, &json!([id(&old), id(&other)]));

    // When a report says one of them was retrieved and then used, only the use reinforces.
    stream
        .apply(&feedback(
            &team,
            json!({"used": [id(&old)], "retrieved": {id(&old): 1}}),
            "2026-03-02",
        ))
        .unwrap();
    let m = stream
        .model
        .scope(&team)
        .unwrap()
        .memory(&id(&old))
        .unwrap();
    assert_eq!(
        (m.retrievals, m.uses, m.last_useful),
        (51, 1, t("2026-03-02"))
    );
    let archived = plan(&stream.model, &team, &Policy::default(), &["decay"]).events;
    assert_eq!(
        archived[0].content.data.as_ref().unwrap()["event_ids"],
        json!([id(&other)])
    );
}

#[test]
fn a_retrieval_report_names_only_its_own_scopes_memories() {
    let (core, ops) = (scope("acme", "core"), scope("acme", "ops"));
    let theirs = memory(&ops, "the pager rota is in the ops calendar", "2026-01-01");
    let mut stream = Stream::<Memories>::given(std::slice::from_ref(&theirs));
    // A report in another scope naming it counts nothing (and is no memory of its own).
    stream
        .apply(&feedback(
            &core,
            json!({"retrieved": {theirs.event_id.as_str(): 5}}),
            "2026-01-02",
        ))
        .unwrap();
    let ops_state = stream.model.scope(&ops).unwrap();
    assert_eq!(
        ops_state
            .memory(theirs.event_id.as_str())
            .unwrap()
            .retrievals,
        0
    );
    assert!(stream.model.scope(&core).unwrap().memories.is_empty());
    // A malformed report is refused by the model too, not applied.
    let mut bad = feedback(
        &core,
        json!({"retrieved": {theirs.event_id.as_str(): 1}}),
        "2026-01-03",
    );
    bad.content.data = Some(json!({"retrieved": {theirs.event_id.as_str(): 0}}));
    assert!(stream.model.apply(99, &bad).is_err());
}

//! Given/when/then tests of the shared-document store and a writer's local copy.

use engram_docs::local::Outgoing;
use engram_docs::store::{Applied, DocError};
use engram_docs::{DocId, DocStore, LocalDoc, TaskBoard, TaskItem, TaskStatus};
use engram_fixtures::models::{Stream, compact, named, scope, t};
use engram_memory::ScopeKey;
use engram_memory::model::EventModel;
use engram_schema::{EventKind, Ident, Layer};

const MAX: usize = 256 * 1024;

fn board() -> DocId {
    DocId {
        doc_type: Ident::parse("doc_type", "task_board").unwrap(),
        name: Ident::parse("name", "sprint").unwrap(),
    }
}

fn event_of(scope: &ScopeKey, instance: &str, out: &Outgoing) -> engram_schema::Envelope {
    let mut event = engram_fixtures::models::event(
        scope,
        Layer::Working,
        EventKind::DocChanged,
        Some(out.data.clone()),
        t("2026-01-01"),
    );
    event.instance_id = Ident::parse("instance_id", instance).unwrap();
    event
        .validate()
        .expect("a writer's payload passes the append check");
    event
}

/// Everything `doc` has not sent, as events, marked sent.
fn push(doc: &mut LocalDoc, scope: &ScopeKey, instance: &str) -> Vec<engram_schema::Envelope> {
    let outgoing = doc.outgoing("task_board", "sprint", MAX).unwrap();
    outgoing
        .iter()
        .map(|out| {
            doc.mark_sent(&out.synced_after);
            event_of(scope, instance, out)
        })
        .collect()
}

fn item(title: &str) -> TaskItem {
    TaskItem {
        title: title.into(),
        ..TaskItem::default()
    }
}

fn state(store: &DocStore, scope: &ScopeKey) -> TaskBoard {
    store
        .get(scope, &board())
        .expect("the board exists")
        .hydrate()
        .unwrap()
}

#[test]
fn concurrent_edits_to_different_fields_merge_and_to_one_field_conflict() {
    let team = scope("acme", "core");
    // Given a board with one item that two instances both loaded.
    let mut creator = LocalDoc::genesis::<TaskBoard>().unwrap();
    creator
        .edit(|b: &mut TaskBoard| {
            b.items.insert("t-1".into(), item("fix login"));
        })
        .unwrap();
    let mut stream = Stream::<DocStore>::given(&push(&mut creator, &team, "i-0"));
    let saved = stream.model.get(&team, &board()).unwrap().saved().to_vec();
    let (mut a, mut b) = (
        LocalDoc::load(&saved).unwrap(),
        LocalDoc::load(&saved).unwrap(),
    );

    // When one sets the owner and the other adds a note, and both set the status at once.
    a.edit(|x: &mut TaskBoard| {
        let it = x.items.get_mut("t-1").unwrap();
        it.owner = Some("i-a".into());
        it.status = TaskStatus::Doing;
    })
    .unwrap();
    b.edit(|x: &mut TaskBoard| {
        let it = x.items.get_mut("t-1").unwrap();
        it.notes.push("repro: 500 on /login".into());
        it.status = TaskStatus::Blocked;
    })
    .unwrap();
    for e in push(&mut a, &team, "i-a")
        .iter()
        .chain(&push(&mut b, &team, "i-b"))
    {
        assert!(matches!(
            stream.apply(e).unwrap(),
            Applied::Merged { held: 0, .. }
        ));
    }

    // Then the owner and the note both landed, and the status shows both values.
    let merged = state(&stream.model, &team);
    let it = &merged.items["t-1"];
    assert_eq!(it.owner.as_deref(), Some("i-a"));
    assert_eq!(it.notes, vec!["repro: 500 on /login".to_string()]);
    let view = stream.model.get(&team, &board()).unwrap().view();
    assert_eq!(view.conflicts.len(), 1, "{:?}", view.conflicts);
    let conflict = &view.conflicts[0];
    assert_eq!(conflict.path, "/items/t-1/status");
    let mut values: Vec<&str> = conflict
        .values
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(values[0], it.status.as_str(), "the winner is listed first");
    values.sort();
    assert_eq!(values, ["blocked", "doing"]);
}

#[test]
fn an_offline_writer_merges_cleanly_when_it_comes_back() {
    let team = scope("acme", "core");
    let mut online = LocalDoc::genesis::<TaskBoard>().unwrap();
    online
        .edit(|b: &mut TaskBoard| {
            b.items.insert("t-1".into(), item("base"));
        })
        .unwrap();
    let first = push(&mut online, &team, "i-on");
    let mut stream = Stream::<DocStore>::given(&first);
    let saved = stream.model.get(&team, &board()).unwrap().saved().to_vec();
    // Given an instance that goes offline with the board as it was...
    let mut offline = LocalDoc::load(&saved).unwrap();
    // ...while the other keeps pushing for an hour...
    for i in 0..60 {
        online
            .edit(|b: &mut TaskBoard| {
                b.items.insert(format!("on-{i}"), item("online work"));
            })
            .unwrap();
        for e in push(&mut online, &team, "i-on") {
            stream.apply(&e).unwrap();
        }
    }
    // When the offline one made 60 edits of its own and sends them all at once.
    for i in 0..60 {
        offline
            .edit(|b: &mut TaskBoard| {
                b.items.insert(format!("off-{i}"), item("offline work"));
                b.items
                    .get_mut("t-1")
                    .unwrap()
                    .notes
                    .push(format!("offline note {i}"));
            })
            .unwrap();
    }
    assert_eq!(offline.unsent(), 60);
    for e in push(&mut offline, &team, "i-off") {
        stream.apply(&e).unwrap();
    }
    // Then every edit of both is in the merged board, with no conflict.
    let merged = state(&stream.model, &team);
    assert_eq!(merged.items.len(), 121);
    assert_eq!(merged.items["t-1"].notes.len(), 60);
    assert!(
        stream
            .model
            .get(&team, &board())
            .unwrap()
            .view()
            .conflicts
            .is_empty()
    );
    // And the offline writer, merging the stream back, sees what everyone sees.
    let saved = stream.model.get(&team, &board()).unwrap().saved().to_vec();
    offline.merge_remote(&saved).unwrap();
    assert_eq!(offline.value::<TaskBoard>().unwrap(), merged);
    assert_eq!(offline.unsent(), 0, "nothing is left to send");
}

#[test]
fn a_change_arriving_before_its_dependency_is_held_then_applied() {
    let team = scope("acme", "core");
    let mut w = LocalDoc::genesis::<TaskBoard>().unwrap();
    w.edit(|b: &mut TaskBoard| {
        b.items.insert("t-1".into(), item("one"));
    })
    .unwrap();
    let first = push(&mut w, &team, "i-1");
    w.edit(|b: &mut TaskBoard| {
        b.items.insert("t-2".into(), item("two"));
    })
    .unwrap();
    let second = push(&mut w, &team, "i-1");
    // Given the second event stored first.
    let mut stream = Stream::<DocStore>::default();
    assert_eq!(
        stream.apply(&second[0]).unwrap(),
        Applied::Merged {
            applied: 0,
            held: 1
        }
    );
    let held = stream.model.get(&team, &board()).unwrap();
    assert_eq!(held.held(), 1);
    // The held change survives a checkpoint.
    stream.model = named(&stream.model);
    // When the first arrives (genesis and first edit), then all three are applied.
    assert_eq!(
        stream.apply(&first[0]).unwrap(),
        Applied::Merged {
            applied: 3,
            held: 0
        }
    );
    assert_eq!(state(&stream.model, &team).items.len(), 2);
}

#[test]
fn a_change_delivered_twice_is_applied_once() {
    let team = scope("acme", "core");
    let mut w = LocalDoc::genesis::<TaskBoard>().unwrap();
    w.edit(|b: &mut TaskBoard| {
        b.items.insert("t-1".into(), item("one"));
    })
    .unwrap();
    let events = push(&mut w, &team, "i-1");
    let mut stream = Stream::<DocStore>::given(&events);
    let heads = stream.model.get(&team, &board()).unwrap().heads();
    // A second event with the same changes (another id: a resend after a crash).
    let mut again = events[0].clone();
    again.event_id = engram_schema::EventId::new();
    assert_eq!(stream.apply(&again).unwrap(), Applied::AlreadyApplied);
    let entry = stream.model.get(&team, &board()).unwrap();
    assert_eq!(entry.heads(), heads);
    // The genesis change and the edit, from one event.
    assert_eq!((entry.changes(), entry.events()), (2, 1));
}

#[test]
fn a_reused_actor_sequence_is_refused_and_changes_nothing() {
    let team = scope("acme", "core");
    let mut w = LocalDoc::genesis::<TaskBoard>().unwrap();
    w.edit(|b: &mut TaskBoard| {
        b.items.insert("t-1".into(), item("one"));
    })
    .unwrap();
    let good = push(&mut w, &team, "i-1");
    let mut stream = Stream::<DocStore>::given(&good);
    let before = stream.model.state_hash();
    // Given a second copy of the same writer (same actor) that never saw its first change:
    // its first change has the same actor and seq, different content.
    let mut clone = LocalDoc::new();
    clone.raw().set_actor(w.raw().get_actor().clone());
    clone
        .edit(|b: &mut TaskBoard| {
            b.items.insert("t-9".into(), item("other"));
        })
        .unwrap();
    let bad = push(&mut clone, &team, "i-1");
    // When it is applied, then it is refused, and the model is as it was.
    let err = stream.apply(&bad[0]).unwrap_err();
    assert!(matches!(err, DocError::Apply { .. }), "{err}");
    assert_eq!(stream.model.state_hash(), before);
    assert_eq!(state(&stream.model, &team).items.len(), 1);
}

#[test]
fn a_malformed_payload_is_refused_with_the_field_named() {
    let team = scope("acme", "core");
    let mut event = engram_fixtures::models::event(
        &team,
        Layer::Working,
        EventKind::DocChanged,
        Some(
            serde_json::json!({"doc_type": "task_board", "name": "sprint", "changes": ["bm90IGEgY2hhbmdl"]}),
        ),
        t("2026-01-01"),
    );
    let err = event.validate().unwrap_err().to_string();
    assert!(
        err.contains("content.data.changes") && err.contains("not an automerge change"),
        "{err}"
    );
    event.content.data =
        Some(serde_json::json!({"doc_type": "task board", "name": "s", "changes": []}));
    let err = event.validate().unwrap_err().to_string();
    assert!(err.contains("content.data.doc_type"), "{err}");
    let mut store = DocStore::default();
    assert!(store.apply(1, &event).is_err());
    assert!(store.is_empty());
}

#[test]
fn large_pushes_are_cut_into_events_and_a_half_sent_push_resends_only_the_rest() {
    let team = scope("acme", "core");
    let mut w = LocalDoc::genesis::<TaskBoard>().unwrap();
    for i in 0..40 {
        w.edit(|b: &mut TaskBoard| {
            b.items.insert(format!("t-{i}"), item(&"x".repeat(200)));
        })
        .unwrap();
    }
    let outgoing = w.outgoing("task_board", "sprint", 2_000).unwrap();
    assert!(outgoing.len() > 4, "{} payloads", outgoing.len());
    // Only the first two are acknowledged before the writer is cut off.
    let mut stream = Stream::<DocStore>::default();
    for out in &outgoing[..2] {
        stream.apply(&event_of(&team, "i-1", out)).unwrap();
        w.mark_sent(&out.synced_after);
    }
    let sent: usize = outgoing[..2].iter().map(|o| o.changes).sum();
    assert_eq!(w.unsent(), 41 - sent, "40 edits and the genesis");
    for e in push(&mut w, &team, "i-1") {
        assert!(matches!(
            stream.apply(&e).unwrap(),
            Applied::Merged { held: 0, .. }
        ));
    }
    assert_eq!(state(&stream.model, &team).items.len(), 40);
    assert_eq!(stream.model.get(&team, &board()).unwrap().changes(), 41);
}

#[test]
fn a_checkpoint_round_trip_keeps_the_state_hash() {
    let team = scope("acme", "core");
    let mut events = Vec::new();
    let mut writers: Vec<LocalDoc> = (0..5)
        .map(|_| LocalDoc::genesis::<TaskBoard>().unwrap())
        .collect();
    for round in 0..4 {
        for (i, w) in writers.iter_mut().enumerate() {
            w.edit(|b: &mut TaskBoard| {
                b.items.insert(format!("w{i}-r{round}"), item("work"));
            })
            .unwrap();
            events.extend(push(w, &team, &format!("i-{i}")));
        }
    }
    engram_fixtures::models::assert_rebuild_equals_incremental_by_hash::<DocStore>(&events);
    // Writers that started at once share one genesis, so nobody's items hide another's.
    let whole = Stream::<DocStore>::given(&events).model;
    assert_eq!(compact(&whole).state_hash(), whole.state_hash());
    assert_eq!(state(&whole, &team).items.len(), 20);
}

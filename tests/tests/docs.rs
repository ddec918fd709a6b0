//! Shared documents end to end, against a real nats-server: many instances editing one task
//! board at once through the SDK, the document projector merging in stream order, and what
//! every reader then sees.

use std::collections::BTreeSet;

use engram_memory::proto::{Consistency, ContextRequest, DocRead, DocRequest, ScopeRequest};
use engram_schema::{Ident, Scope, ScopeKind};
use engram_sdk::doc::{TaskBoard, TaskItem, TaskStatus};
use engram_testkit::TestNats;
use engram_tests::Engram;

fn team() -> Scope {
    Scope::new(ScopeKind::Team, "core").unwrap()
}

fn state_request(min_seq: u64) -> DocRequest {
    DocRequest {
        scopes: ScopeRequest {
            tenant: Ident::parse("tenant", "acme").unwrap(),
            scope: team(),
            grants: vec![],
        },
        read: DocRead::State,
        doc_type: Some(Ident::parse("doc_type", "task_board").unwrap()),
        name: Some(Ident::parse("name", "sprint").unwrap()),
        include_bytes: false,
        include_values: false,
        limit: 1,
        consistency: Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(30_000),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_writers_edit_one_board_and_every_reader_sees_every_change() {
    const WRITERS: usize = 200;
    // Every fifth writer works offline: several edits, pushed together after the others.
    const OFFLINE_EDITS: usize = 5;
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let client = engram.client.clone();

    // Given a board with one shared item, created before anyone else opens it.
    let lead = client.agent("acme", "lead", "i-lead").unwrap();
    let mut board = lead
        .open_doc::<TaskBoard>(team(), "sprint", None)
        .await
        .unwrap();
    board
        .edit(|b| {
            b.items.insert(
                "shared".into(),
                TaskItem {
                    title: "release".into(),
                    ..TaskItem::default()
                },
            );
        })
        .unwrap();
    let created = board.push().await.unwrap().unwrap().seq;

    // When 200 instances open it at once (all before any pushes), each adds an item of its
    // own, notes the shared one and claims its owner field; a fifth of them keep editing
    // offline before pushing.
    let opened = std::sync::Arc::new(tokio::sync::Barrier::new(WRITERS));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (client, opened) = (client.clone(), opened.clone());
        writers.push(tokio::spawn(async move {
            let agent = client.agent("acme", "worker", &format!("i-{w}")).unwrap();
            let mut doc = agent
                .open_doc::<TaskBoard>(team(), "sprint", Some(created))
                .await
                .unwrap();
            opened.wait().await;
            let offline = w % 5 == 0;
            let edits = if offline { OFFLINE_EDITS } else { 1 };
            for e in 0..edits {
                doc.edit(|b| {
                    b.items.insert(
                        format!("w{w}-e{e}"),
                        TaskItem {
                            title: format!("work {w}.{e}"),
                            owner: Some(format!("i-{w}")),
                            status: TaskStatus::Doing,
                            notes: vec![],
                        },
                    );
                    let shared = b.items.get_mut("shared").expect("the shared item exists");
                    shared.notes.push(format!("note from i-{w} #{e}"));
                    shared.owner = Some(format!("i-{w}"));
                })
                .unwrap();
            }
            if offline {
                assert_eq!(doc.unsent(), OFFLINE_EDITS);
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            doc.push().await.unwrap().unwrap().seq
        }));
    }
    let mut last = created;
    for w in writers {
        last = last.max(w.await.unwrap());
    }

    // Then the merged board holds every writer's items and every note, once.
    let response = client.doc(&state_request(last)).await.unwrap();
    let summary = response.doc.as_ref().unwrap();
    assert_eq!(summary.held, 0, "no change waits for a dependency");
    let value = summary.value.as_ref().unwrap();
    let items = value["items"].as_object().unwrap();
    let offline_writers = WRITERS / 5;
    let expected_items = 1 + (WRITERS - offline_writers) + offline_writers * OFFLINE_EDITS;
    assert_eq!(items.len(), expected_items);
    for w in 0..WRITERS {
        assert!(
            items.contains_key(&format!("w{w}-e0")),
            "writer {w}'s item is missing"
        );
    }
    let notes: BTreeSet<&str> = items["shared"]["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert_eq!(notes.len(), expected_items - 1, "every note, none twice");
    // And the owner field everyone set at once is a conflict holding all 200 claims.
    let owner = response
        .conflicts
        .iter()
        .find(|c| c.path == "/items/shared/owner")
        .expect("the concurrent owner claims are exposed as a conflict");
    let claims: BTreeSet<&str> = owner.values.iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(claims.len(), WRITERS);
    assert_eq!(
        value["items"]["shared"]["owner"], owner.values[0],
        "the state shows the conflict's first value"
    );

    // And every reader at that sequence holds the same state: writers refreshing their
    // copies, and the service's view.
    let mut heads = BTreeSet::new();
    for w in (0..WRITERS).step_by(20) {
        let agent = client.agent("acme", "reader", &format!("r-{w}")).unwrap();
        let mut copy = agent
            .open_doc::<TaskBoard>(team(), "sprint", Some(last))
            .await
            .unwrap();
        heads.insert(copy.heads());
        let read = copy.value().unwrap();
        assert_eq!(read.items.len(), expected_items);
        assert_eq!(
            read.items["shared"].owner.as_deref(),
            value["items"]["shared"]["owner"].as_str()
        );
    }
    heads.insert(summary.heads.clone());
    assert_eq!(heads.len(), 1, "readers disagree on the heads: {heads:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_shows_the_open_items_of_the_task_board() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let agent = engram.client.agent("acme", "planner", "i-1").unwrap();
    let mut board = agent
        .open_doc::<TaskBoard>(team(), "sprint", None)
        .await
        .unwrap();
    board
        .edit(|b| {
            for (id, title, status) in [
                ("t-1", "migrate the billing schema", TaskStatus::Doing),
                ("t-2", "ship the login fix", TaskStatus::Done),
            ] {
                b.items.insert(
                    id.into(),
                    TaskItem {
                        title: title.into(),
                        owner: Some("i-1".into()),
                        status,
                        notes: vec!["waiting on review".into()],
                    },
                );
            }
        })
        .unwrap();
    let seq = board.push().await.unwrap().unwrap().seq;
    let context = engram
        .client
        .build_context(&ContextRequest {
            scopes: ScopeRequest {
                tenant: Ident::parse("tenant", "acme").unwrap(),
                scope: team(),
                grants: vec![],
            },
            agent_id: Ident::parse("agent_id", "planner").unwrap(),
            task: "billing".into(),
            query: "what is left this sprint".into(),
            vector: Some(engram_tests::embedder().embed_one("what is left this sprint")),
            token_budget: 400,
            consistency: Consistency {
                min_seq: Some(seq),
                wait_ms: Some(10_000),
            },
        })
        .await
        .unwrap();
    assert!(
        context.rendered.contains("## task board")
            && context
                .rendered
                .contains("[doing] migrate the billing schema (owner i-1): waiting on review"),
        "{}",
        context.rendered
    );
    assert!(
        !context.rendered.contains("ship the login fix"),
        "done items are left out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_written_into_a_board_is_redacted_before_its_change_is_made() {
    const PASSWORD: &str = "hunter2hunter2";
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let agent = engram.client.agent("acme", "ops", "i-1").unwrap();
    let mut board = agent
        .open_doc::<TaskBoard>(team(), "sprint", None)
        .await
        .unwrap();
    // Given one clean edit, then one that writes a password into an item's notes.
    board
        .edit(|b| {
            b.items.insert(
                "t-1".into(),
                TaskItem {
                    title: "rotate the db credentials".into(),
                    ..TaskItem::default()
                },
            );
        })
        .unwrap();
    board
        .edit(|b| {
            let item = b.items.get_mut("t-1").unwrap();
            item.notes.push(format!("new db password={PASSWORD}"));
            item.owner = Some("i-1".into());
        })
        .unwrap();
    // Then the copy holds the note redacted, with the rest of the edit.
    let item = board.value().unwrap().items["t-1"].clone();
    assert_eq!(item.owner.as_deref(), Some("i-1"));
    assert_eq!(
        item.notes,
        vec!["new db password=[REDACTED:key_value_secret]"]
    );
    let seq = board.push().await.unwrap().unwrap().seq;
    // And no byte of what reached the stream holds the password.
    let (seen, holding) = engram_testkit::events_holding(engram.client.bus(), PASSWORD).await;
    assert!(seen >= 1 && seq > 0);
    assert!(holding.is_empty(), "the password is stored at {holding:?}");
}

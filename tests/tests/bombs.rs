//! Decompression bombs against a real Engram: a `doc_changed` event whose compressed change
//! inflates to megabytes is refused for its inflated size, whether it is published raw (the
//! docs projector dead-letters it, its document unchanged) or sent to `POST /v1/events` (a 4xx
//! naming the bound, nothing stored). A real compressed change still goes through.

use base64::Engine as _;
use engram_gateway::GatewayConfig;
use engram_memory::proto::{Consistency, DocRead, DocRequest, DocResponse, ScopeRequest};
use engram_schema::automerge::{self, transaction::Transactable as _};
use engram_schema::payload::MAX_DOC_INFLATED_BYTES;
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_testkit::TestNats;
use engram_tests::Engram;
use serde_json::{Value, json};

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn team() -> Scope {
    Scope::new(ScopeKind::Team, "core").unwrap()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A real automerge change writing `mib` MiB of one letter, as automerge sends it
/// (`Change::bytes`, deflate-compressed): about a thousandth of that on the wire.
fn bomb(mib: usize) -> Vec<u8> {
    let mut doc = automerge::AutoCommit::new();
    doc.put(automerge::ROOT, "filler", "a".repeat(mib << 20))
        .unwrap();
    let bytes = doc.get_last_local_change().unwrap().bytes().into_owned();
    assert_eq!(bytes[8], 2, "automerge compressed it");
    bytes
}

fn board_data(changes: &[&[u8]]) -> Value {
    let changes: Vec<String> = changes.iter().map(|c| b64(c)).collect();
    json!({"doc_type": "task_board", "name": "sprint", "changes": changes})
}

fn state_request(min_seq: u64) -> DocRequest {
    DocRequest {
        scopes: ScopeRequest {
            tenant: ident("acme"),
            scope: team(),
            grants: vec![],
        },
        read: DocRead::State,
        doc_type: Some(ident("task_board")),
        name: Some(ident("sprint")),
        include_bytes: false,
        include_values: true,
        limit: 1,
        consistency: Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(30_000),
        },
    }
}

/// What a reader sees of the board: heads, counts and value.
fn seen(response: &DocResponse) -> Value {
    let doc = response.doc.as_ref().expect("the board exists");
    json!({
        "heads": doc.heads, "changes": doc.changes, "events": doc.events,
        "held": doc.held, "value": doc.value,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_bomb_doc_change_is_dead_lettered_for_its_size_and_the_board_is_unchanged() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let bus = nats.bus().await;
    let client = engram.client.clone();

    // Given a board with one item
    let created = engram_tests::board_with_item(&client, "acme", team(), "sprint", "release").await;
    let before = seen(&client.doc(&state_request(created)).await.unwrap());

    // When a change of it that inflates to 16 MiB is published raw (16 kB on the wire),
    // past every append check
    let bomb = bomb(16);
    assert!(bomb.len() < 32 * 1024, "{} bytes", bomb.len());
    let mut event = Envelope::new(
        ident("acme"),
        team(),
        ident("lead"),
        ident("i-attacker"),
        Layer::Working,
        EventKind::DocChanged,
        Content {
            text: "1 change(s) to task_board/sprint".into(),
            data: Some(board_data(&[&bomb])),
        },
    );
    let bomb_seq = bus
        .jetstream()
        .publish(
            engram_schema::subject_for(&event),
            rmp_serde::to_vec_named(&event).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;

    // Then the docs projector dead-letters it, saying it inflates past the bound
    engram_testkit::wait_dead_lettered(&bus, &["docs"], 1).await;
    let letters = bus.dead_letters(Some("docs"), 10).await.unwrap();
    assert_eq!(letters.total, 1, "{letters:?}");
    let letter = &letters.letters[0];
    assert_eq!(letter.event_seq, Some(bomb_seq));
    assert!(
        letter.reason.contains("content.data.changes")
            && letter
                .reason
                .contains(&format!("more than {MAX_DOC_INFLATED_BYTES} bytes")),
        "{}",
        letter.reason
    );
    // and the board is as it was, read at a sequence past the bomb
    let after_seq = client
        .append(&engram_tests::embedded(
            "acme",
            team(),
            "lead",
            "after the bomb",
        ))
        .await
        .unwrap()
        .seq;
    assert_eq!(
        seen(&client.doc(&state_request(after_seq)).await.unwrap()),
        before
    );

    // And a real compressed change of the board, published raw the same way, is applied
    let mut local = automerge::AutoCommit::load(
        &client
            .doc(&DocRequest {
                include_bytes: true,
                ..state_request(after_seq)
            })
            .await
            .unwrap()
            .bytes
            .map(|b| base64::engine::general_purpose::STANDARD.decode(b).unwrap())
            .expect("the board's bytes"),
    )
    .unwrap();
    local
        .put(automerge::ROOT, "notes", "a long note. ".repeat(200))
        .unwrap();
    let mut change = local.get_last_local_change().unwrap().clone();
    let compressed = change.bytes().into_owned();
    assert_eq!(compressed[8], 2, "automerge compressed it");
    event.event_id = engram_schema::EventId::new();
    event.content.data = Some(board_data(&[&compressed]));
    let good_seq = bus
        .jetstream()
        .publish(
            engram_schema::subject_for(&event),
            rmp_serde::to_vec_named(&event).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    let now = client.doc(&state_request(good_seq)).await.unwrap();
    let doc = now.doc.as_ref().unwrap();
    assert_eq!(doc.heads, vec![engram_docs::hex(&change.hash())]);
    assert_eq!(
        bus.dead_letters(Some("docs"), 10).await.unwrap().total,
        1,
        "only the bomb was dead-lettered"
    );
    engram.stop().await;
}

async fn post_event(base: &str, key: &str, data: Value) -> (u16, Value) {
    let body = json!({
        "scope": {"kind": "task", "id": "t1"},
        "layer": "working",
        "kind": "doc_changed",
        "content": {"text": "1 change(s) to task_board/sprint", "data": data},
    });
    engram_tests::post_json(base, "/v1/events", key, &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bomb_sent_to_post_events_is_refused_for_its_size_and_nothing_is_stored() {
    let (nats, _engram, key) = engram_tests::secured_with_key("acme", "planner").await;
    let base = engram_tests::serve_http(&nats, GatewayConfig::default()).await;
    let messages = || async { nats.admin.stream_summary().await.unwrap().messages };
    let before = messages().await;

    // A body of about 43 kB whose one change inflates to 32 MiB
    let bomb = bomb(32);
    let (status, body) = post_event(&base, &key, board_data(&[&bomb])).await;
    // A size error (413 `too_large`) naming the field and the bound
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "too_large", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("content.data.changes")
            && message.contains(&format!("more than {MAX_DOC_INFLATED_BYTES} bytes")),
        "{message}"
    );
    assert_eq!(messages().await, before, "the refused event was stored");

    // While a real compressed change is appended
    let mut doc = automerge::AutoCommit::new();
    doc.put(automerge::ROOT, "notes", "a long note. ".repeat(200))
        .unwrap();
    let compressed = doc.get_last_local_change().unwrap().bytes().into_owned();
    assert_eq!(compressed[8], 2, "automerge compressed it");
    let (status, body) = post_event(&base, &key, board_data(&[&compressed])).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(messages().await, before + 1);
}

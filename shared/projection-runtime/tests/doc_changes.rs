//! The changes of a `doc_changed` event are decoded (inflated) by the projector of the model
//! that applies them only, once: it dead-letters those that inflate past the bound before the
//! model sees them, and hands the model the rest uncompressed. Every other projector gets them
//! as stored, undecoded. Against a real nats-server.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use engram_bus::{Bus, StoredEvent};
use engram_projection_runtime::{
    ApplyLedger, Projection, ProjectionError, Projector, ProjectorSettings, Rejected,
};
use engram_schema::automerge::{self, transaction::Transactable as _};
use engram_schema::payload::MAX_DOC_INFLATED_BYTES;
use engram_schema::{Envelope, EventKind, Layer};
use engram_testkit::{TestNats, event};

/// Keeps every event it is handed.
struct Recorder {
    name: &'static str,
    doc_changes: bool,
    seen: Mutex<Vec<StoredEvent>>,
}

#[async_trait::async_trait]
impl Projection for Recorder {
    fn name(&self) -> &'static str {
        self.name
    }
    fn applies_doc_changes(&self) -> bool {
        self.doc_changes
    }
    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        Ok(ApplyLedger::default())
    }
    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        self.seen.lock().unwrap().extend(events.iter().cloned());
        Ok(Vec::new())
    }
    async fn checkpoint(&self, _: &ApplyLedger) -> Result<(), ProjectionError> {
        Ok(())
    }
    async fn reset(&self) -> Result<(), ProjectionError> {
        Ok(())
    }
    async fn state_hash(&self) -> [u8; 32] {
        [0; 32]
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn doc_event(changes: &[Vec<u8>]) -> Envelope {
    let mut e = event("acme", "t1", "an edit");
    e.layer = Layer::Working;
    e.kind = EventKind::DocChanged;
    let changes: Vec<String> = changes.iter().map(|c| b64(c)).collect();
    e.content.data = Some(serde_json::json!({
        "doc_type": "scratchpad", "name": "notes", "changes": changes,
    }));
    e
}

/// One change writing `text`, as automerge sends it: compressed, being over 256 bytes.
fn compressed_change(text: &str) -> (Vec<u8>, automerge::ChangeHash) {
    let mut doc = automerge::AutoCommit::new();
    doc.put(automerge::ROOT, "note", text).unwrap();
    let change = doc.get_last_local_change().unwrap().clone();
    let bytes = change.clone().bytes().into_owned();
    assert_eq!(bytes[8], 2, "automerge compressed it");
    (bytes, change.hash())
}

/// A compressed change chunk whose deflate body inflates to 16 MiB of zeros.
fn bomb() -> Vec<u8> {
    use std::io::Write as _;
    let mut encoder = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
    for _ in 0..16 {
        encoder.write_all(&[0u8; 1 << 20]).unwrap();
    }
    let deflated = encoder.finish().unwrap();
    let mut chunk = vec![0x85, 0x6f, 0x4a, 0x83, 1, 2, 3, 4, 2];
    let mut len = deflated.len();
    while len >= 0x80 {
        chunk.push((len as u8 & 0x7f) | 0x80);
        len >>= 7;
    }
    chunk.push(len as u8);
    chunk.extend(deflated);
    chunk
}

/// Publishes `event` raw (no append check), as any client with publish rights could.
async fn publish_raw(bus: &Bus, event: &Envelope) -> u64 {
    bus.jetstream()
        .publish(
            engram_schema::subject_for(event),
            rmp_serde::to_vec_named(event).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence
}

fn changes_of(event: &Envelope) -> Vec<String> {
    event.content.data.as_ref().unwrap()["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn only_the_docs_projector_decodes_doc_changes_and_its_model_gets_them_inflated_once() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;

    // Given a legitimate compressed change, a bomb, and a compressed change writing a secret
    let (good, good_hash) = compressed_change(&"a long note about the sprint. ".repeat(100));
    let good_event = doc_event(std::slice::from_ref(&good));
    let good_seq = publish_raw(&bus, &good_event).await;
    let bomb_event = doc_event(&[bomb()]);
    let bomb_seq = publish_raw(&bus, &bomb_event).await;
    let (secret, _) = compressed_change(&format!(
        "db password=hunter2hunter2 {}",
        "pad ".repeat(100)
    ));
    let secret_seq = publish_raw(&bus, &doc_event(&[secret])).await;
    let last = bus
        .append(&event("acme", "t1", "after"), Default::default())
        .await
        .unwrap()
        .seq;

    // When a projector whose model applies document changes, and one whose model does not,
    // both with the scrubber, read them
    let settings = || ProjectorSettings {
        publish_interval: Duration::ZERO,
        tail_publish_gap: Duration::ZERO,
        scrubbers: Some(engram_scrub::Scrubbers::default()),
        ..ProjectorSettings::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = Vec::new();
    let mut run = |name, doc_changes| {
        let recorder = Arc::new(Recorder {
            name,
            doc_changes,
            seen: Mutex::new(Vec::new()),
        });
        let projector = Projector::new(recorder.clone(), bus.clone(), settings());
        let visibility = projector.visibility();
        tasks.push(tokio::spawn(projector.run(stop.clone())));
        (recorder, visibility)
    };
    let (docs, docs_visible) = run("docs-like", true);
    let (other, other_visible) = run("other", false);
    for visible in [&docs_visible, &other_visible] {
        visible
            .wait_for(last, Duration::from_secs(30))
            .await
            .unwrap();
    }
    engram_testkit::wait_dead_lettered(&bus, &["docs-like"], 1).await;

    // Then the docs model got the good change uncompressed, the same change by its hash
    let docs_seen = docs.seen.lock().unwrap().clone();
    let at = |seen: &[StoredEvent], seq| seen.iter().find(|e| e.seq == seq).cloned();
    let handed = at(&docs_seen, good_seq).expect("the good change reached the docs model");
    let plain = base64::engine::general_purpose::STANDARD
        .decode(&changes_of(&handed.event)[0])
        .unwrap();
    assert_eq!(plain[8], 1, "an uncompressed change chunk");
    let change = automerge::Change::try_from(&plain[..]).unwrap();
    assert_eq!(change.hash(), good_hash);
    // the bomb never reached it: it was dead-lettered for its inflated size
    assert!(at(&docs_seen, bomb_seq).is_none());
    let letters = bus.dead_letters(Some("docs-like"), 10).await.unwrap();
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
    // and the secret's change was removed before it did
    let redacted = at(&docs_seen, secret_seq).unwrap();
    assert!(changes_of(&redacted.event).is_empty());

    // And the other model got all three as stored, their changes undecoded and unchanged,
    // and dead-lettered nothing
    let other_seen = other.seen.lock().unwrap().clone();
    for (seq, sent) in [(good_seq, &good_event), (bomb_seq, &bomb_event)] {
        let got = at(&other_seen, seq).expect("every event reaches every model");
        assert_eq!(changes_of(&got.event), changes_of(sent));
    }
    assert!(at(&other_seen, secret_seq).is_some());
    assert_eq!(bus.dead_letter_count("other").await.unwrap(), 0);

    stop.cancel();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
}

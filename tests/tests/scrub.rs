//! Secret scrubbing end to end, against a real nats-server: what the SDK appends is
//! redacted before it reaches the stream, and what a raw client publishes is redacted in
//! every read model and in the dead-letter copy, and counted.

use std::time::Duration;

use engram_bus::{AppendOptions, StartAt};
use engram_memory::proto::{
    Consistency, FactsRequest, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_schema::SubjectFilter;
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_testkit::TestNats;
use engram_tests::{Engram, embedder, embedder_model};
use futures::StreamExt;

const AWS: &str = "AKIAIOSFODNN7EXAMPLE";
const PASSWORD: &str = "hunter2hunter2";

fn github() -> String {
    format!("ghp_{}", "a1B2c3D4e5".repeat(4))
}

fn secrets() -> Vec<String> {
    vec![AWS.to_owned(), PASSWORD.to_owned(), github()]
}

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn team() -> Scope {
    Scope::new(ScopeKind::Team, "core").unwrap()
}

/// An observation carrying all three secrets: in its text and in its data.
fn leaky(text: &str, with_vector: bool) -> Envelope {
    let text = format!("{text}: key {AWS}, db password={PASSWORD}");
    let mut e = Envelope::new(
        ident("acme"),
        team(),
        ident("agent-1"),
        ident("i-1"),
        Layer::Episodic,
        EventKind::Observation,
        Content {
            text: text.clone(),
            data: Some(serde_json::json!({"github_token": github(), "note": "rotated"})),
        },
    );
    if with_vector {
        e.embedding = Some(engram_schema::Embedding {
            model: embedder_model(),
            vector: embedder().embed_one(&text),
        });
    }
    e
}

fn assert_clean(what: &str, text: &str) {
    for secret in secrets() {
        assert!(!text.contains(&secret), "{what} holds {secret}: {text}");
    }
}

async fn retrieved(engram: &Engram, mode: RetrievalMode, min_seq: u64) -> Vec<String> {
    let response = engram
        .client
        .retrieve(&RetrieveRequest {
            scopes: ScopeRequest {
                tenant: ident("acme"),
                scope: team(),
                grants: vec![],
            },
            query: "deploy credentials key password".into(),
            vector: Some(embedder().embed_one("deploy credentials key password")),
            top_k: 10,
            filter: Default::default(),
            consistency: Consistency {
                min_seq: Some(min_seq),
                wait_ms: Some(20_000),
            },
            mode,
            ranking: None,
        })
        .await
        .unwrap();
    response.results.into_iter().map(|r| r.text).collect()
}

/// Redactions are counted process-wide, by kind and where (`sdk`, a projector's name,
/// `dead_letter`), and every test here redacts under some of the same labels. Each test holds
/// this for its whole run, so a count one test reads moved by that test alone.
static COUNTED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Redactions counted at `at` so far, of every kind.
/// Redactions counted at `at`: a read model's are its partition instances'.
fn redactions(at: &str) -> u64 {
    let places: Vec<String> = std::iter::once(at.to_owned())
        .chain(
            (0..engram_schema::DEFAULT_PARTITIONS)
                .map(|p| engram_memory::proto::instance_name(at, p)),
        )
        .collect();
    engram_scrub::Kind::ALL
        .iter()
        .flat_map(|k| places.iter().map(move |place| (k, place)))
        .map(|(k, place)| {
            engram_telemetry::metrics::SCRUB_REDACTIONS
                .with_label_values(&[k.as_str(), place])
                .get()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_sdk_write_reaches_the_stream_with_its_secrets_redacted() {
    let _counted = COUNTED.lock().await;
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let before = redactions("sdk");
    let event = leaky("deploy credentials", true);
    let seq = engram.client.append(&event).await.unwrap().seq;
    assert!(redactions("sdk") >= before + 3);
    // The stream holds the redacted event: text and data.
    let mut stored = engram
        .client
        .replay(&SubjectFilter::all(), StartAt::Beginning)
        .await
        .unwrap();
    let got = stored.next().await.unwrap().unwrap();
    assert_eq!(got.seq, seq);
    assert_eq!(got.event.event_id, event.event_id);
    let raw = serde_json::to_string(&got.event).unwrap();
    assert_clean("the stream", &raw);
    assert!(raw.contains("[REDACTED:aws_access_key]"), "{raw}");
    assert!(raw.contains("[REDACTED:github_token]"), "{raw}");
    // A retry of the same append is the same event, stored once.
    let again = engram.client.append(&event).await.unwrap();
    assert!(again.duplicate && again.seq == seq);
    for mode in [RetrievalMode::Dense, RetrievalMode::Keyword] {
        let texts = retrieved(&engram, mode, seq).await;
        assert_eq!(texts.len(), 1, "{mode:?}: {texts:?}");
        assert_clean("retrieval", &texts[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_raw_publish_is_redacted_in_every_read_model_and_the_dead_letter_copy() {
    let _counted = COUNTED.lock().await;
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let bus = engram.client.bus().clone();
    let (before, dead_lettered_before) = (redactions("keyword"), redactions("dead_letter"));
    // Given raw publishes that bypass the SDK: one memory with its vector, one without
    // (which this deployment's vector model dead-letters), and a fact whose value is a
    // secret.
    let with_vector = leaky("deploy credentials", true);
    let without = leaky("staging credentials", false);
    let mut fact = Envelope::new(
        ident("acme"),
        team(),
        ident("agent-1"),
        ident("i-1"),
        Layer::Semantic,
        EventKind::FactAsserted,
        Content {
            text: String::new(),
            data: Some(serde_json::json!({
                "subject": "db", "predicate": "password", "object": format!("password={PASSWORD}"),
            })),
        },
    );
    fact.tags = vec![];
    let mut last = 0;
    for e in [&with_vector, &without, &fact] {
        last = bus.append(e, AppendOptions::default()).await.unwrap().seq;
    }
    // The stream holds what the raw client sent (nothing in front of it to redact)...
    // ...but no read model shows a secret, and each counted what it redacted.
    for mode in [
        RetrievalMode::Dense,
        RetrievalMode::Keyword,
        RetrievalMode::Hybrid,
    ] {
        let texts = retrieved(&engram, mode, last).await;
        assert!(!texts.is_empty(), "{mode:?}");
        for t in &texts {
            assert_clean("retrieval", t);
        }
    }
    assert!(redactions("keyword") > before);
    let facts = engram
        .client
        .facts(&FactsRequest {
            scopes: ScopeRequest {
                tenant: ident("acme"),
                scope: team(),
                grants: vec![],
            },
            subject: Some("db".into()),
            predicate: None,
            text: None,
            valid_at: None,
            known_at: None,
            history: false,
            limit: 10,
            consistency: Consistency {
                min_seq: Some(last),
                wait_ms: Some(20_000),
            },
        })
        .await
        .unwrap();
    let facts = serde_json::to_string(&facts).unwrap();
    assert!(facts.contains("[REDACTED"), "{facts}");
    assert_clean("the facts", &facts);
    // The dead-letter copy of the memory without a vector is redacted too.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let letter = loop {
        let letters = bus.dead_letters(Some("vector"), 10).await.unwrap();
        if let Some(letter) = letters.letters.into_iter().next() {
            break letter;
        }
        assert!(std::time::Instant::now() < deadline, "no dead letter");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let copy = letter.decode(bus.codec()).unwrap();
    assert_eq!(copy.event_id, without.event_id);
    assert_clean("the dead letter", &serde_json::to_string(&copy).unwrap());
    assert!(
        redactions("dead_letter") >= dead_lettered_before + 3,
        "the dead letter's three secrets were not counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_message_with_a_secret_is_dead_lettered_redacted() {
    let _counted = COUNTED.lock().await;
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let bus = engram.client.bus().clone();
    // Bytes that are no event at all, published raw, carrying a password.
    let poison = format!("not an event: db password={PASSWORD}");
    bus.jetstream()
        .publish(
            "engram.evt.acme.team.core.episodic",
            poison.into_bytes().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let letters = loop {
        let letters = bus.dead_letters(None, 50).await.unwrap().letters;
        if letters.len() >= 6 {
            break letters;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} dead letters",
            letters.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for letter in letters {
        let copy = String::from_utf8_lossy(&letter.payload);
        assert!(!copy.contains(PASSWORD), "{}: {copy}", letter.projector);
        assert!(copy.contains("[REDACTED:key_value_secret]"), "{copy}");
    }
}

/// A raw client's `doc_changed` event: changes made without the SDK's redaction.
fn raw_doc_change(name: &str, title: &str) -> Envelope {
    let mut doc = engram_docs::LocalDoc::genesis::<engram_docs::TaskBoard>().unwrap();
    doc.edit::<engram_docs::TaskBoard>(|b| {
        b.items.insert(
            "t1".into(),
            engram_docs::TaskItem {
                title: title.to_owned(),
                ..Default::default()
            },
        );
    })
    .unwrap();
    let out = doc.outgoing("task_board", name, 192 * 1024).unwrap();
    Envelope::new(
        ident("acme"),
        team(),
        ident("agent-1"),
        ident("i-1"),
        Layer::Working,
        EventKind::DocChanged,
        Content {
            text: String::new(),
            data: Some(out[0].data.clone()),
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_raw_document_change_writing_a_secret_never_reaches_the_documents_or_their_snapshot() {
    let _counted = COUNTED.lock().await;
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let bus = engram.client.bus().clone();
    let before = redactions("docs");
    // Given raw document changes (no SDK in front to redact them): one clean, one whose
    // title is a key.
    let clean = raw_doc_change("clean", "ship the release");
    let leaky = raw_doc_change("leaky", &format!("use key {AWS} for the deploy"));
    bus.append(&clean, AppendOptions::default()).await.unwrap();
    let last = bus
        .append(&leaky, AppendOptions::default())
        .await
        .unwrap()
        .seq;
    // The clean document is there; the leaky change was refused, so no document holds it.
    let listed = engram
        .client
        .doc(
            &serde_json::from_value(serde_json::json!({
                "tenant": "acme", "scope": {"kind": "team", "id": "core"},
                "read": "list", "include_values": true, "min_seq": last, "wait_ms": 10000,
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let shown = serde_json::to_string(&listed).unwrap();
    assert!(shown.contains("ship the release"), "{shown}");
    assert!(!shown.contains(AWS) && !shown.contains("leaky"), "{shown}");
    // Its dead-letter copy holds no secret either, and the redaction was counted.
    engram_testkit::wait_until(
        "docs to dead-letter the change",
        Duration::from_secs(30),
        || {
            let bus = bus.clone();
            async move { bus.dead_letter_count("docs").await.unwrap_or(0) >= 1 }
        },
    )
    .await;
    let letters = bus.dead_letters(Some("docs"), 100).await.unwrap();
    for letter in &letters.letters {
        let bytes = String::from_utf8_lossy(&letter.payload);
        let decoded = letter
            .decode(bus.codec())
            .map(|e| serde_json::to_string(&e).unwrap())
            .unwrap_or_default();
        assert!(!bytes.contains(AWS) && !decoded.contains(AWS));
        assert!(decoded.contains("were removed"), "{decoded}");
    }
    assert!(redactions("docs") > before);
    // And the docs model's snapshot, cut now, holds no trace of it in any form.
    let cut = engram
        .client
        .snapshot(
            &ScopeRequest {
                tenant: ident("acme"),
                scope: team(),
                grants: vec![],
            },
            Some("after-raw-doc"),
        )
        .await
        .unwrap();
    assert!(!cut.snapshots.is_empty());
    let store = engram_snapshots::SnapshotStore::open(&bus, Default::default())
        .await
        .unwrap();
    // The snapshot of the docs instance of the partition that holds the team.
    let instance = engram_memory::proto::instance_name(
        "docs",
        engram_memory::ScopeKey::new(ident("acme"), team())
            .partition(bus.config().stream.partitions),
    );
    let meta = store.list(Some(&instance)).await.unwrap().pop().unwrap();
    let blob = store.load(&meta).await.unwrap();
    assert!(
        !blob.windows(AWS.len()).any(|w| w == AWS.as_bytes()),
        "the docs snapshot holds the key"
    );
}

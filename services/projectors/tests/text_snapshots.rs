//! The text read models' snapshots, given/when/then: a vector or keyword model exported and
//! imported into a fresh replica has the exporter's state (hash and answers), keeps it over a
//! restart, and goes on from it like the exporter; a blob that does not check, or one of
//! another embedding model, is refused and changes nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use engram_bus::StoredEvent;
use engram_fixtures::HashEmbedder;
use engram_memory::proto::{Consistency, SearchRequest, SearchResponse};
use engram_memory::{MemoryFilter, ScopeKey};
use engram_projection_runtime::{ApplyLedger, Projection, ProjectionError};
use engram_projectors::keyword::KeywordProjection;
use engram_projectors::vector::VectorProjection;
use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_testkit::stored;
use engram_vector::HnswParams;
use serde_json::json;

const DIM: usize = 16;

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn event(task: &str, instance: &str, kind: EventKind, text: &str) -> Envelope {
    Envelope::new(
        ident("acme"),
        Scope::new(ScopeKind::Task, task).unwrap(),
        ident("agent"),
        ident(instance),
        Layer::Episodic,
        kind,
        Content::text(text),
    )
}

fn with_data(mut event: Envelope, data: serde_json::Value) -> Envelope {
    event.content.data = Some(data);
    event
}

const TOPICS: [&str; 5] = [
    "deploys",
    "the cache",
    "billing",
    "the on-call rota",
    "backups",
];

/// A few hundred memories over three scopes, with a forgetting, a contradiction, a flagged
/// instance and a merge among them.
fn head() -> Vec<Envelope> {
    let mut events: Vec<Envelope> = (0..240)
        .map(|i| {
            event(
                &format!("t{}", i % 3),
                &format!("i-{}", i % 4),
                EventKind::Observation,
                &format!("memory {i} about {}", TOPICS[i % TOPICS.len()]),
            )
        })
        .collect();
    let id = |events: &[Envelope], i: usize| events[i].event_id.clone();
    let forgotten = Envelope::forget(
        ident("acme"),
        Scope::new(ScopeKind::Task, "t0").unwrap(),
        ident("agent"),
        ident("i-0"),
        Layer::Episodic,
        &[id(&events, 0), id(&events, 3)],
        "wrong",
    );
    let outcome = with_data(
        event(
            "t1",
            "i-3",
            EventKind::Outcome,
            "memory the outcome of a deploy",
        ),
        json!({"success": false, "contradicts": [id(&events, 1), id(&events, 4)]}),
    );
    let flag = with_data(
        event("t2", "i-9", EventKind::Feedback, ""),
        json!({"faulty_instance": "i-2"}),
    );
    let merged = with_data(
        event(
            "t1",
            "consolidator",
            EventKind::Consolidated,
            "memory 1 about the cache (merged)",
        ),
        json!({"op": "merged", "sources": [id(&events, 1), id(&events, 7)]}),
    );
    events.extend([forgotten, outcome, flag, merged]);
    events
}

/// What arrives after the snapshot: new memories, a second contradiction of an exported
/// memory, and late retries of the forgotten memory and of the flag, which must change
/// nothing.
fn tail(head: &[Envelope]) -> Vec<Envelope> {
    let mut events: Vec<Envelope> = (240..300)
        .map(|i| {
            event(
                &format!("t{}", i % 3),
                &format!("i-{}", i % 4),
                EventKind::Observation,
                &format!("memory {i} about {}", TOPICS[i % TOPICS.len()]),
            )
        })
        .collect();
    let again = with_data(
        event("t1", "i-3", EventKind::Outcome, ""),
        json!({"contradicts": [head[1].event_id, head[10].event_id]}),
    );
    let flag = head.iter().find(|e| e.kind == EventKind::Feedback).unwrap();
    events.extend([again, head[0].clone(), flag.clone()]);
    events
}

/// The vector model's hits (id, score, confidence) and the keyword model's (id, confidence).
type Answer = (Vec<(EventId, f32, f64)>, BTreeMap<EventId, f64>);

struct Models {
    dir: tempfile::TempDir,
    vector: VectorProjection,
    keyword: KeywordProjection,
    ledger: ApplyLedger,
}

impl Models {
    /// The models of a state dir, restored from what it holds.
    async fn open(dir: tempfile::TempDir, embedder: HashEmbedder) -> Self {
        let vector = VectorProjection::new(dir.path(), Arc::new(embedder), HnswParams::default());
        let keyword = KeywordProjection::new(dir.path());
        let ledger = vector.restore().await.unwrap();
        assert_eq!(keyword.restore().await.unwrap(), ledger);
        Self {
            dir,
            vector,
            keyword,
            ledger,
        }
    }

    /// The same state dir opened again, as by a restarted process.
    async fn restart(self) -> Self {
        let Self {
            dir,
            vector,
            keyword,
            ..
        } = self;
        // The keyword writer's lock goes with it.
        drop((vector, keyword));
        Self::open(dir, HashEmbedder::new(DIM)).await
    }

    async fn new() -> Self {
        Self::open(tempfile::tempdir().unwrap(), HashEmbedder::new(DIM)).await
    }

    /// Applies `events` in batches of 50, publishing and checkpointing each, as the loop
    /// does.
    async fn apply(&mut self, events: &[StoredEvent]) {
        for batch in events.chunks(50) {
            let v = self.vector.apply(batch).await.unwrap();
            let k = self.keyword.apply(batch).await.unwrap();
            assert!(v.is_empty() && k.is_empty(), "{v:?} {k:?}");
            for e in batch {
                self.ledger.add(e.seq, e.event.event_id.as_str());
            }
            self.keyword.publish(&self.ledger).await.unwrap();
            self.vector.checkpoint(&self.ledger).await.unwrap();
        }
    }

    /// Applies `events` as one batch, not published: the keyword index has them staged.
    async fn apply_unpublished(&mut self, events: &[StoredEvent]) {
        assert!(self.vector.apply(events).await.unwrap().is_empty());
        assert!(self.keyword.apply(events).await.unwrap().is_empty());
        for e in events {
            self.ledger.add(e.seq, e.event.event_id.as_str());
        }
    }

    async fn export(&self) -> (Vec<u8>, Vec<u8>) {
        (
            self.vector.export(&self.ledger).await.unwrap().unwrap(),
            self.keyword.export(&self.ledger).await.unwrap().unwrap(),
        )
    }

    async fn hashes(&self) -> ([u8; 32], [u8; 32]) {
        (
            self.vector.state_hash().await,
            self.keyword.state_hash().await,
        )
    }

    /// What each model answers for every topic: the vector model's hits in order, with
    /// scores; the keyword model's as a set (BM25 statistics count deleted documents until
    /// segments merge, so an index rebuilt without them may rank ties otherwise).
    async fn answers(&self) -> Vec<Answer> {
        let embedder = HashEmbedder::new(DIM);
        let scopes: Vec<ScopeKey> = ["t0", "t1", "t2"]
            .into_iter()
            .map(|t| ScopeKey::of(&event(t, "i-0", EventKind::Observation, "x")))
            .collect();
        let mut answers: Vec<Answer> = Vec::new();
        for topic in TOPICS {
            let request = SearchRequest {
                scopes: scopes.clone(),
                query: topic.into(),
                vector: Some(embedder.embed_one(topic)),
                k: 1000,
                filter: MemoryFilter::default(),
                consistency: Consistency::default(),
                score_also: Vec::new(),
                rest: 0,
            };
            let vector: SearchResponse = self.vector.search(&request).await.unwrap();
            let keyword: SearchResponse = self.keyword.search(&request).await.unwrap();
            answers.push((
                vector
                    .hits
                    .into_iter()
                    .map(|h| (h.meta.event_id, h.hit.score, h.meta.confidence))
                    .collect(),
                keyword
                    .hits
                    .into_iter()
                    .map(|h| (h.meta.event_id, h.meta.confidence))
                    .collect(),
            ));
        }
        assert!(answers.iter().all(|(v, k)| !v.is_empty() && !k.is_empty()));
        answers
    }

    async fn import(&mut self, (vector, keyword): &(Vec<u8>, Vec<u8>)) {
        let ledger = self.vector.import(vector).await.unwrap();
        assert_eq!(self.keyword.import(keyword).await.unwrap(), ledger);
        // As the runtime does after the tail (an import itself need not checkpoint).
        self.vector.checkpoint(&ledger).await.unwrap();
        self.keyword.checkpoint(&ledger).await.unwrap();
        self.ledger = ledger;
    }
}

#[tokio::test]
async fn an_imported_text_model_has_the_exporters_state_and_goes_on_like_it() {
    // Given vector and keyword models of a few hundred events, a forgotten, a contradicted,
    // a flagged and a merged memory among them
    let head = head();
    let mut exporter = Models::new().await;
    exporter.apply(&stored(&head, 1)).await;
    let blobs = exporter.export().await;

    // When a fresh replica imports their snapshots
    let mut replica = Models::new().await;
    replica.import(&blobs).await;

    // Then it holds the exporter's state, ledger included, and answers as it does, with
    // the exporter's keyword index installed rather than built again
    assert_eq!(replica.keyword.indexes_installed(), 1);
    assert_eq!(replica.ledger, exporter.ledger);
    assert_eq!(replica.hashes().await, exporter.hashes().await);
    assert_eq!(replica.answers().await, exporter.answers().await);
    assert_eq!(replica.vector.len(), exporter.vector.len());
    assert_eq!(replica.keyword.len(), exporter.keyword.len());

    // And when the same tail reaches both (new memories, a second contradiction of an
    // exported memory, late retries of a forgotten memory and of the flag: the snapshot
    // carries the ids of both, so neither counts again), they stay equal
    let tail = stored(&tail(&head), head.len() as u64 + 1);
    exporter.apply(&tail).await;
    replica.apply(&tail).await;
    assert_eq!(replica.hashes().await, exporter.hashes().await);
    assert_eq!(replica.answers().await, exporter.answers().await);

    // And after a restart
    let replica = replica.restart().await;
    assert_eq!(replica.ledger, exporter.ledger);
    assert_eq!(replica.hashes().await, exporter.hashes().await);

    // And equal to a replay of the whole stream: the snapshot lost nothing
    let mut replayed = Models::new().await;
    replayed.apply(&stored(&head, 1)).await;
    replayed.apply(&tail).await;
    assert_eq!(replayed.hashes().await, exporter.hashes().await);
}

#[tokio::test]
async fn a_keyword_snapshot_of_uncommitted_changes_is_indexed_by_its_importer() {
    // Given an exporter whose last batch is applied but not yet committed to its index
    let head = head();
    let mut exporter = Models::new().await;
    let events = stored(&head, 1);
    let (committed, staged) = events.split_at(events.len() - 20);
    exporter.apply(committed).await;
    exporter.apply_unpublished(staged).await;
    let blobs = exporter.export().await;

    // When a fresh replica imports it
    let mut replica = Models::new().await;
    replica.import(&blobs).await;

    // Then the snapshot carried no index files (its commit lags the model), the replica
    // indexed the memories itself, and holds the exporter's state all the same
    assert_eq!(replica.keyword.indexes_installed(), 0);
    assert_eq!(replica.hashes().await, exporter.hashes().await);
    assert_eq!(replica.answers().await, exporter.answers().await);
}

#[tokio::test]
async fn a_blob_that_does_not_check_is_refused_and_the_model_is_unchanged() {
    // Given a snapshot of the head, and a replica that has applied more than it
    let head = head();
    let mut exporter = Models::new().await;
    exporter.apply(&stored(&head, 1)).await;
    let (vector, keyword) = exporter.export().await;
    let mut replica = Models::new().await;
    replica.apply(&stored(&head, 1)).await;
    replica
        .apply(&stored(&tail(&head), head.len() as u64 + 1))
        .await;
    let before = (replica.hashes().await, replica.answers().await);

    // When it is handed a flipped byte, a truncated blob, or the other model's blob
    let flipped = |blob: &[u8]| {
        let mut blob = blob.to_vec();
        let middle = blob.len() / 2;
        blob[middle] ^= 0x55;
        blob
    };
    for (what, v, k) in [
        ("flipped", flipped(&vector), flipped(&keyword)),
        (
            "truncated",
            vector[..vector.len() - 100].to_vec(),
            keyword[..keyword.len() - 100].to_vec(),
        ),
        ("swapped", keyword.clone(), vector.clone()),
    ] {
        // Then both refuse it, saying to rebuild, and change nothing
        for err in [
            replica.vector.import(&v).await.unwrap_err(),
            replica.keyword.import(&k).await.unwrap_err(),
        ] {
            let ProjectionError::Fatal(message) = err else {
                panic!("{what}: a bad blob is fatal, not {err:?}");
            };
            assert!(message.contains("engram rebuild"), "{what}: {message}");
        }
        assert_eq!(
            (replica.hashes().await, replica.answers().await),
            before,
            "{what}"
        );
    }

    // And a vector snapshot of another embedding model is refused, naming both models
    let other = VectorProjection::new(
        replica.dir.path().join("other"),
        Arc::new(HashEmbedder::new(DIM * 2)),
        HnswParams::default(),
    );
    other.restore().await.unwrap();
    let empty = other.state_hash().await;
    let ProjectionError::Fatal(message) = other.import(&vector).await.unwrap_err() else {
        panic!("a snapshot of another model is fatal");
    };
    assert!(
        message.contains(&format!("hash-{DIM}"))
            && message.contains(&format!("hash-{}", DIM * 2))
            && message.contains("rebuild"),
        "{message}"
    );
    assert_eq!(other.state_hash().await, empty);

    // And the good blob, older than what the replica holds, still replaces it
    replica.import(&(vector, keyword)).await;
    assert_eq!(replica.hashes().await, exporter.hashes().await);
    let restarted = replica.restart().await;
    assert_eq!(restarted.ledger, exporter.ledger);
    assert_eq!(restarted.hashes().await, exporter.hashes().await);
}

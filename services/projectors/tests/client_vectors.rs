//! With vectors supplied by clients, the vector projector cannot embed what the consolidator
//! writes (it supplies none): a merged memory or a summary gets the normalised mean of its
//! sources' vectors instead of a dead letter, the same in any batches; an output with no
//! source held is still refused, saying why.

use std::sync::Arc;

use engram_bus::StoredEvent;
use engram_embed::ClientSupplied;
use engram_memory::proto::{Consistency, SearchRequest};
use engram_memory::{MemoryFilter, ScopeKey};
use engram_projection_runtime::{ApplyLedger, Projection};
use engram_projectors::vector::VectorProjection;
use engram_schema::{
    Content, Embedding, Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind,
};
use engram_testkit::stored;
use engram_vector::HnswParams;
use serde_json::json;

const MODEL: &str = "client-model";

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn event(layer: Layer, kind: EventKind, text: &str) -> Envelope {
    Envelope::new(
        ident("acme"),
        Scope::new(ScopeKind::Task, "t1").unwrap(),
        ident("agent"),
        ident("i-1"),
        layer,
        kind,
        Content::text(text),
    )
}

fn with_vector(text: &str, vector: [f32; 4]) -> Envelope {
    let mut e = event(Layer::Episodic, EventKind::Observation, text);
    e.embedding = Some(Embedding {
        model: MODEL.into(),
        vector: vector.to_vec(),
    });
    e
}

fn output(op: &str, text: &str, sources: &[&EventId]) -> Envelope {
    let mut e = event(Layer::Semantic, EventKind::Consolidated, text);
    e.content.data = Some(json!({"op": op, "sources": sources}));
    e.agent_id = ident("consolidator");
    e
}

async fn projection() -> (tempfile::TempDir, VectorProjection) {
    let dir = tempfile::tempdir().unwrap();
    let vector = VectorProjection::new(
        dir.path(),
        Arc::new(ClientSupplied::new(MODEL, 4)),
        HnswParams::default(),
    );
    vector.restore().await.unwrap();
    (dir, vector)
}

/// Applies `batches` in order; returns the sequences each rejected.
async fn apply(vector: &VectorProjection, all: &[StoredEvent], cuts: &[usize]) -> Vec<u64> {
    let mut rejected = Vec::new();
    let mut from = 0;
    for &to in cuts.iter().chain([all.len()].iter()) {
        let batch = &all[from..to];
        from = to;
        if batch.is_empty() {
            continue;
        }
        for r in vector.apply(batch).await.unwrap() {
            rejected.push(batch[r.index].seq);
        }
        let ledger = ApplyLedger {
            seq: batch.last().unwrap().seq,
            ..ApplyLedger::default()
        };
        vector.publish(&ledger).await.unwrap();
    }
    rejected
}

#[tokio::test]
async fn consolidation_outputs_take_their_sources_vectors_when_clients_supply_them() {
    // Given two memories with client vectors, a summary of both, a merged copy of one, and
    // a restored copy whose source the model does not hold...
    let a = with_vector("the build cache lives in s3", [1.0, 0.0, 0.0, 0.0]);
    let b = with_vector("the build cache is warmed nightly", [0.0, 1.0, 0.0, 0.0]);
    let gone = EventId::new();
    let summary = output(
        "summary",
        "the build cache lives in s3 and is warmed nightly",
        &[&a.event_id, &b.event_id],
    );
    let merged = output("merged", "the build cache lives in s3", &[&a.event_id]);
    let restored = output("restored", "an old memory", &[&gone]);
    let events = stored(&[a, b, summary.clone(), merged.clone(), restored], 1);

    // ...when the vector projector applies them, all at once or one by one...
    let (_d1, whole) = projection().await;
    let (_d2, single) = projection().await;
    let rejected = apply(&whole, &events, &[]).await;
    let rejected_single = apply(&single, &events, &[1, 2, 3, 4]).await;

    // ...then only the restored copy is refused, and both ways reach one state.
    assert_eq!(rejected, [5]);
    assert_eq!(rejected_single, [5]);
    assert_eq!(whole.state_hash().await, single.state_hash().await);

    // The summary's vector is the normalised mean of its sources', the merged copy's its
    // source's: a query along the mean finds the summary with cosine 1.
    let h = std::f32::consts::FRAC_1_SQRT_2;
    let scope = ScopeKey {
        tenant: ident("acme"),
        kind: ScopeKind::Task,
        id: ident("t1"),
    };
    let search = |v: Vec<f32>| SearchRequest {
        scopes: vec![scope.clone()],
        query: String::new(),
        vector: Some(v),
        k: 10,
        filter: MemoryFilter::default(),
        consistency: Consistency::default(),
        score_also: Vec::new(),
        rest: 0,
    };
    let hits = whole
        .search(&search(vec![h, h, 0.0, 0.0]))
        .await
        .unwrap()
        .hits;
    assert_eq!(hits[0].meta.event_id, summary.event_id);
    assert!(
        (hits[0].hit.score - 1.0).abs() < 1e-5,
        "{}",
        hits[0].hit.score
    );
    let hits = whole
        .search(&search(vec![1.0, 0.0, 0.0, 0.0]))
        .await
        .unwrap()
        .hits;
    let merged_hit = hits
        .iter()
        .find(|h| h.meta.event_id == merged.event_id)
        .expect("the merged copy is indexed");
    assert!((merged_hit.hit.score - 1.0).abs() < 1e-5);
}

//! Pollution defence in the text read models, given/when/then: a contradicted memory's
//! confidence halves, a faulty instance's earlier memories drop to a quarter, and nothing of
//! another tenant or scope moves. The vector and keyword projectors agree, and a replay in
//! other batches gives the same state.

use std::collections::BTreeMap;
use std::sync::Arc;

use engram_bus::StoredEvent;
use engram_fixtures::HashEmbedder;
use engram_memory::proto::{Consistency, SearchRequest, SearchResponse};
use engram_memory::{MemoryFilter, ScopeKey};
use engram_projection_runtime::{ApplyLedger, Projection};
use engram_projectors::keyword::KeywordProjection;
use engram_projectors::vector::VectorProjection;
use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_testkit::stored;
use engram_vector::HnswParams;
use serde_json::json;

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

/// An event of `tenant`, task scope `task`, written by instance `instance`.
fn event(tenant: &str, task: &str, instance: &str, kind: EventKind, text: &str) -> Envelope {
    Envelope::new(
        ident(tenant),
        Scope::new(ScopeKind::Task, task).unwrap(),
        ident("agent"),
        ident(instance),
        Layer::Episodic,
        kind,
        Content::text(text),
    )
}

fn memory(tenant: &str, task: &str, instance: &str, text: &str) -> Envelope {
    event(
        tenant,
        task,
        instance,
        EventKind::Observation,
        &format!("memory {text}"),
    )
}

fn with_data(mut event: Envelope, data: serde_json::Value) -> Envelope {
    event.content.data = Some(data);
    event
}

struct Models {
    dir: tempfile::TempDir,
    vector: VectorProjection,
    keyword: KeywordProjection,
    embedder: HashEmbedder,
}

impl Models {
    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let embedder = HashEmbedder::new(32);
        let vector = VectorProjection::new(
            dir.path(),
            Arc::new(embedder.clone()),
            HnswParams::default(),
        );
        let keyword = KeywordProjection::new(dir.path());
        vector.restore().await.unwrap();
        keyword.restore().await.unwrap();
        Self {
            dir,
            vector,
            keyword,
            embedder,
        }
    }

    /// Applies `batch` to both models and publishes it; returns the indexes each rejected.
    async fn apply(&self, batch: &[StoredEvent]) -> (Vec<usize>, Vec<usize>) {
        let v = self.vector.apply(batch).await.unwrap();
        let k = self.keyword.apply(batch).await.unwrap();
        let ledger = ApplyLedger {
            seq: batch.last().unwrap().seq,
            ..ApplyLedger::default()
        };
        self.vector.publish(&ledger).await.unwrap();
        self.keyword.publish(&ledger).await.unwrap();
        (
            v.iter().map(|r| r.index).collect(),
            k.iter().map(|r| r.index).collect(),
        )
    }

    /// The confidence of every memory of `scopes` that passes `filter`, by event id; the
    /// vector and keyword models must agree on it.
    async fn confidences(
        &self,
        scopes: &[ScopeKey],
        filter: MemoryFilter,
    ) -> BTreeMap<EventId, f64> {
        let request = SearchRequest {
            scopes: scopes.to_vec(),
            query: "memory".into(),
            vector: Some(self.embedder.embed_one("memory")),
            k: 100,
            filter,
            consistency: Consistency::default(),
            score_also: Vec::new(),
            rest: 0,
        };
        let by_id = |r: SearchResponse| -> BTreeMap<EventId, f64> {
            r.hits
                .into_iter()
                .map(|h| (h.meta.event_id, h.meta.confidence))
                .collect()
        };
        let dense = by_id(self.vector.search(&request).await.unwrap());
        let keyword = by_id(self.keyword.search(&request).await.unwrap());
        assert_eq!(dense, keyword, "vector and keyword disagree");
        dense
    }
}

fn trusted(min: f64) -> MemoryFilter {
    MemoryFilter {
        min_confidence: Some(min),
        ..MemoryFilter::default()
    }
}

/// Memories of two tenants and two scopes, then the signals, then a memory the flagged
/// instance writes after its flag.
struct World {
    events: Vec<Envelope>,
    /// Event ids by name.
    ids: BTreeMap<&'static str, EventId>,
    scopes: Vec<ScopeKey>,
}

impl World {
    fn add(&mut self, name: &'static str, event: Envelope) {
        self.ids.insert(name, event.event_id.clone());
        self.events.push(event);
    }

    fn id(&self, name: &str) -> EventId {
        self.ids[name].clone()
    }
}

fn world() -> World {
    let key = |tenant: &str, task: &str| ScopeKey {
        tenant: ident(tenant),
        kind: ScopeKind::Task,
        id: ident(task),
    };
    let mut w = World {
        events: Vec::new(),
        ids: BTreeMap::new(),
        scopes: vec![key("acme", "t1"), key("acme", "t2"), key("umbrella", "t1")],
    };
    w.add(
        "claim",
        memory("acme", "t1", "i-1", "the api key is in vault"),
    );
    w.add(
        "bad-1",
        memory("acme", "t1", "i-2", "prices doubled overnight"),
    );
    w.add("bad-2", memory("acme", "t1", "i-2", "the ceo resigned"));
    w.add(
        "sound",
        memory("acme", "t1", "i-3", "deploys run on fridays"),
    );
    w.add(
        "t2-i2",
        memory("acme", "t2", "i-2", "the cache warms at start"),
    );
    w.add(
        "other-tenant",
        memory("umbrella", "t1", "i-2", "the lab opens at nine"),
    );
    // When an outcome in t1 (itself a memory) contradicts the claim, a memory of t2 and an
    // unknown id
    let outcome = with_data(
        event(
            "acme",
            "t1",
            "i-3",
            EventKind::Outcome,
            "memory: the api key was not in vault",
        ),
        json!({"success": false, "contradicts": [w.id("claim"), w.id("t2-i2"), EventId::new()]}),
    );
    w.add("outcome", outcome);
    // and an outcome of t2 names t1's sound memory, and feedback of the other tenant the claim
    let t2 = with_data(
        event("acme", "t2", "i-3", EventKind::Outcome, ""),
        json!({"contradicts": [w.id("sound")]}),
    );
    w.add("t2-outcome", t2);
    let other = with_data(
        event("umbrella", "t1", "i-3", EventKind::Feedback, ""),
        json!({"contradicts": [w.id("claim")]}),
    );
    w.add("tenant-feedback", other);
    // and a feedback in t1 (reporting a use too) flags i-2
    let flag = with_data(
        event("acme", "t1", "i-9", EventKind::Feedback, ""),
        json!({"faulty_instance": "i-2", "used": [w.id("sound")]}),
    );
    w.add("flag", flag);
    // and i-2 writes again after the flag
    w.add("after", memory("acme", "t1", "i-2", "the office moved"));
    w
}

#[tokio::test]
async fn contradicted_and_flagged_memories_lose_confidence_only_in_their_own_scope() {
    // Given memories of two tenants and scopes, when the signals arrive in one batch
    let World {
        events,
        ids,
        scopes,
    } = world();
    let models = Models::new().await;
    let (v, k) = models.apply(&stored(&events, 1)).await;
    assert!(v.is_empty() && k.is_empty(), "{v:?} {k:?}");

    // Then the claim halves, i-2's memories in t1 before the flag drop to a quarter, and
    // nothing else moves: not i-2 elsewhere, not what it wrote after the flag, not a memory
    // named from another scope or tenant
    let all = models.confidences(&scopes, MemoryFilter::default()).await;
    let expected: BTreeMap<EventId, f64> = [
        ("claim", 0.5),
        ("bad-1", 0.25),
        ("bad-2", 0.25),
        ("sound", 1.0),
        ("t2-i2", 1.0),
        ("other-tenant", 1.0),
        ("outcome", 1.0),
        ("after", 1.0),
    ]
    .into_iter()
    .map(|(name, c)| (ids[name].clone(), c))
    .collect();
    assert_eq!(all, expected);

    // And a filter leaves them out, in both models
    let kept = models.confidences(&scopes, trusted(0.6)).await;
    let mut without = expected.clone();
    without.retain(|_, c| *c >= 0.6);
    assert_eq!(kept, without);
    assert!(!kept.contains_key(&ids["claim"]) && !kept.contains_key(&ids["bad-1"]));

    // When a second outcome contradicts the claim, and a late retry of the first one (the
    // same event id, stored again) arrives
    let again = with_data(
        event("acme", "t1", "i-3", EventKind::Outcome, ""),
        json!({"contradicts": [ids["claim"]]}),
    );
    let retry = events
        .iter()
        .find(|e| e.event_id == ids["outcome"])
        .unwrap();
    let mut tail = stored(&[again, retry.clone()], 1);
    for (i, e) in tail.iter_mut().enumerate() {
        e.seq = events.len() as u64 + 1 + i as u64;
    }
    models.apply(&tail).await;

    // Then it halves once more, and only once
    let all = models.confidences(&scopes, MemoryFilter::default()).await;
    assert_eq!(all[&ids["claim"]], 0.25);
    assert_eq!(all[&ids["bad-1"]], 0.25);
}

#[tokio::test]
async fn a_replay_in_other_batches_gives_the_same_state() {
    let World { events, .. } = world();
    let all = stored(&events, 1);
    let whole = Models::new().await;
    whole.apply(&all).await;
    let one_by_one = Models::new().await;
    for event in &all {
        one_by_one.apply(std::slice::from_ref(event)).await;
    }
    assert_eq!(
        whole.vector.state_hash().await,
        one_by_one.vector.state_hash().await
    );
    assert_eq!(
        whole.keyword.state_hash().await,
        one_by_one.keyword.state_hash().await
    );
    // And the signals changed what the state hashes cover
    let unsignalled = Models::new().await;
    let stripped: Vec<StoredEvent> = all
        .iter()
        .cloned()
        .map(|mut e| {
            e.event.content.data = None;
            e
        })
        .collect();
    unsignalled.apply(&stripped).await;
    assert_ne!(
        whole.vector.state_hash().await,
        unsignalled.vector.state_hash().await
    );
    assert_ne!(
        whole.keyword.state_hash().await,
        unsignalled.keyword.state_hash().await
    );
}

#[tokio::test]
async fn confidences_and_applied_signals_survive_a_restart_of_either_model() {
    let World {
        events,
        ids,
        scopes,
    } = world();
    let all = stored(&events, 1);
    let models = Models::new().await;
    models.apply(&all).await;
    let ledger = ApplyLedger {
        seq: all.len() as u64,
        ..ApplyLedger::default()
    };
    models.vector.checkpoint(&ledger).await.unwrap();
    let before = models.confidences(&scopes, MemoryFilter::default()).await;

    // When the vector model restarts from its checkpoint, and the flag is retried late
    let restarted = VectorProjection::new(
        models.dir.path(),
        Arc::new(models.embedder.clone()),
        HnswParams::default(),
    );
    restarted.restore().await.unwrap();
    let flag = events.iter().find(|e| e.event_id == ids["flag"]).unwrap();
    let mut retry = stored(std::slice::from_ref(flag), 1);
    retry[0].seq = all.len() as u64 + 1;
    restarted.apply(&retry).await.unwrap();

    // Then every confidence is as it was: the flag is not applied twice
    let request = SearchRequest {
        scopes: scopes.clone(),
        query: "memory".into(),
        vector: Some(models.embedder.embed_one("memory")),
        k: 100,
        filter: MemoryFilter::default(),
        consistency: Consistency::default(),
        score_also: Vec::new(),
        rest: 0,
    };
    let after: BTreeMap<EventId, f64> = restarted
        .search(&request)
        .await
        .unwrap()
        .hits
        .into_iter()
        .map(|h| (h.meta.event_id, h.meta.confidence))
        .collect();
    assert_eq!(after, before);

    // And the same for the keyword model, whose signal ids live in its ids log
    let Models { dir, keyword, .. } = models;
    drop(keyword);
    let keyword = KeywordProjection::new(dir.path());
    keyword.restore().await.unwrap();
    assert!(keyword.apply(&retry).await.unwrap().is_empty());
    keyword
        .publish(&ApplyLedger {
            seq: retry[0].seq,
            ..ApplyLedger::default()
        })
        .await
        .unwrap();
    let after: BTreeMap<EventId, f64> = keyword
        .search(&request)
        .await
        .unwrap()
        .hits
        .into_iter()
        .map(|h| (h.meta.event_id, h.meta.confidence))
        .collect();
    assert_eq!(after, before);
}

#[tokio::test]
async fn a_signal_that_does_not_check_is_refused_whole() {
    // Given an outcome published raw (the append path would refuse it), with text
    let models = Models::new().await;
    let claim = memory("acme", "t1", "i-1", "the api key is in vault");
    let bad = with_data(
        event(
            "acme",
            "t1",
            "i-3",
            EventKind::Outcome,
            "memory of a bad outcome",
        ),
        json!({"contradicts": [claim.event_id, "*"]}),
    );
    let bad_id = bad.event_id.clone();
    // When both models apply it, then both refuse it: the claim keeps its confidence and the
    // outcome's text is not indexed
    let (v, k) = models.apply(&stored(&[claim.clone(), bad], 1)).await;
    assert_eq!((v, k), (vec![1], vec![1]));
    let all = models
        .confidences(&[ScopeKey::of(&claim)], MemoryFilter::default())
        .await;
    assert_eq!(all.get(&claim.event_id), Some(&1.0));
    assert!(!all.contains_key(&bad_id));
}

/// A `consolidated` event of acme/t1 (a merged, summary or restored memory) with `sources`.
fn consolidated(op: &str, text: &str, sources: &[EventId]) -> Envelope {
    with_data(
        event(
            "acme",
            "t1",
            "consolidator",
            EventKind::Consolidated,
            &format!("memory {text}"),
        ),
        json!({"op": op, "sources": sources}),
    )
}

/// A contradicted claim and a clean copy of it, a flagged instance's memory, and the
/// consolidation outputs made from them.
fn consolidation_world() -> World {
    let mut w = World {
        events: Vec::new(),
        ids: BTreeMap::new(),
        scopes: vec![ScopeKey::of(&memory("acme", "t1", "i-1", "x"))],
    };
    w.add(
        "claim",
        memory("acme", "t1", "i-1", "the api key is in vault"),
    );
    w.add(
        "copy",
        memory("acme", "t1", "i-3", "the api key is in the vault"),
    );
    w.add(
        "bad",
        memory("acme", "t1", "i-2", "prices doubled overnight"),
    );
    // Of another scope, distrusted there: no say over what t1 reads
    w.add("t2", memory("acme", "t2", "i-2", "the api key is in vault"));
    let outcome = with_data(
        event("acme", "t1", "i-3", EventKind::Outcome, ""),
        json!({"success": false, "contradicts": [w.id("claim")]}),
    );
    w.add("outcome", outcome);
    let flag = with_data(
        event("acme", "t1", "i-9", EventKind::Feedback, ""),
        json!({"faulty_instance": "i-2"}),
    );
    w.add("flag", flag);
    let t2_flag = with_data(
        event("acme", "t2", "i-9", EventKind::Feedback, ""),
        json!({"faulty_instance": "i-2"}),
    );
    w.add("t2-flag", t2_flag);
    // When the consolidator merges the claim with its copy (naming t2's memory too), a copy
    // of the merged memory is restored at once (before the merge's sources are superseded,
    // so in the same chunk of inserts), and the flagged memory is restored as a copy
    let merged = consolidated(
        "merged",
        "the api key is in vault (merged)",
        &[w.id("claim"), w.id("copy"), w.id("t2")],
    );
    w.add("merged", merged);
    w.add(
        "restored-merged",
        consolidated("restored", "the api key is in vault", &[w.id("merged")]),
    );
    let superseded = with_data(
        event(
            "acme",
            "t1",
            "consolidator",
            EventKind::Forgotten,
            "superseded",
        ),
        json!({"event_ids": [w.id("claim"), w.id("copy")]}),
    );
    w.add("superseded", superseded);
    w.add(
        "restored",
        consolidated("restored", "prices doubled overnight", &[w.id("bad")]),
    );
    // and summarises a clean memory and one it does not hold
    w.add(
        "clean",
        memory("acme", "t1", "i-3", "deploys run on fridays"),
    );
    w.add(
        "summary",
        consolidated(
            "summary",
            "a session on deploys",
            &[w.id("clean"), EventId::new()],
        ),
    );
    w
}

#[tokio::test]
async fn a_consolidation_output_keeps_the_least_confidence_of_its_sources() {
    // Given a contradicted claim (0.5), a clean copy and a flagged instance's memory (0.25)
    let World {
        events,
        ids,
        scopes,
    } = consolidation_world();
    // When the consolidation outputs arrive, in one batch with their sources
    let models = Models::new().await;
    let (v, k) = models.apply(&stored(&events, 1)).await;
    assert!(v.is_empty() && k.is_empty(), "{v:?} {k:?}");

    // Then the merged memory is no more trusted than the claim, the restored copy than the
    // flagged memory, a copy of the merged memory than the merged memory; the summary of clean
    // memories is trusted; t2's distrust counts for nothing in t1
    let all = models.confidences(&scopes, MemoryFilter::default()).await;
    let expected: BTreeMap<EventId, f64> = [
        ("bad", 0.25),
        ("merged", 0.5),
        ("restored", 0.25),
        ("restored-merged", 0.5),
        ("clean", 1.0),
        ("summary", 1.0),
    ]
    .into_iter()
    .map(|(name, c)| (ids[name].clone(), c))
    .collect();
    assert_eq!(all, expected);
    // And a context's threshold leaves the laundered copies out as it does their sources
    let kept = models.confidences(&scopes, trusted(0.3)).await;
    assert!(!kept.contains_key(&ids["restored"]) && kept.contains_key(&ids["merged"]));
}

#[tokio::test]
async fn a_consolidation_output_inherits_the_same_in_any_batches() {
    let World { events, ids, .. } = consolidation_world();
    let all = stored(&events, 1);
    let whole = Models::new().await;
    whole.apply(&all).await;
    // One event at a time, and in batches that cut between sources and outputs
    let one_by_one = Models::new().await;
    for event in &all {
        one_by_one.apply(std::slice::from_ref(event)).await;
    }
    let split = Models::new().await;
    let cut = events
        .iter()
        .position(|e| e.event_id == ids["merged"])
        .unwrap()
        + 1;
    for batch in [&all[..3], &all[3..cut], &all[cut..]] {
        split.apply(batch).await;
    }
    for models in [&one_by_one, &split] {
        assert_eq!(
            whole.vector.state_hash().await,
            models.vector.state_hash().await
        );
        assert_eq!(
            whole.keyword.state_hash().await,
            models.keyword.state_hash().await
        );
    }
}

#[tokio::test]
async fn a_consolidation_output_whose_sources_do_not_check_is_refused_whole() {
    // Given a merged memory published raw with no sources (the append path would refuse it)
    let models = Models::new().await;
    let claim = memory("acme", "t1", "i-1", "the api key is in vault");
    let bad = consolidated("merged", "the api key is in vault", &[]);
    // When both models apply it, then both refuse it
    let (v, k) = models.apply(&stored(&[claim.clone(), bad], 1)).await;
    assert_eq!((v, k), (vec![1], vec![1]));
    let all = models
        .confidences(&[ScopeKey::of(&claim)], MemoryFilter::default())
        .await;
    assert_eq!(all.keys().collect::<Vec<_>>(), vec![&claim.event_id]);
}

/// Checkpoints written before confidence and instance ids existed still load: the vector
/// checkpoint holds metadata as arrays, the keyword index as maps, both without the new
/// trailing fields.
#[test]
fn metadata_of_older_checkpoints_loads_with_full_confidence() {
    #[derive(serde::Serialize)]
    struct OldMeta {
        seq: u64,
        event_id: EventId,
        scope: ScopeKey,
        agent_id: Ident,
        layer: Layer,
        kind: EventKind,
        occurred_at: chrono::DateTime<chrono::Utc>,
        importance: f64,
        tags: Vec<String>,
    }
    let event = memory("acme", "t1", "i-1", "old");
    let old = OldMeta {
        seq: 3,
        event_id: event.event_id.clone(),
        scope: ScopeKey::of(&event),
        agent_id: ident("agent"),
        layer: Layer::Episodic,
        kind: EventKind::Observation,
        occurred_at: event.occurred_at,
        importance: 0.5,
        tags: vec![],
    };
    let as_array = rmp_serde::to_vec(&(&old, "old")).unwrap();
    let as_map = rmp_serde::to_vec_named(&(&old, "old")).unwrap();
    for bytes in [as_array, as_map] {
        let (meta, _): (engram_memory::MemoryMeta, String) = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(meta.confidence, 1.0);
        assert_eq!(meta.instance_id, None);
        assert_eq!(meta.event_id, event.event_id);
    }
}

/// A contradicted memory, archived, then restored as a copy.
fn archive_and_restore() -> World {
    let mut w = World {
        events: Vec::new(),
        ids: BTreeMap::new(),
        scopes: vec![ScopeKey::of(&memory("acme", "t1", "i-1", "x"))],
    };
    w.add(
        "claim",
        memory("acme", "t1", "i-1", "the api key is in vault"),
    );
    w.add(
        "outcome",
        with_data(
            event("acme", "t1", "i-3", EventKind::Outcome, ""),
            json!({"success": false, "contradicts": [w.id("claim")]}),
        ),
    );
    w.add(
        "archived",
        with_data(
            event(
                "acme",
                "t1",
                "consolidator",
                EventKind::Forgotten,
                "archived",
            ),
            json!({"event_ids": [w.id("claim")], "archived": true}),
        ),
    );
    w.add(
        "restored",
        consolidated("restored", "the api key is in vault", &[w.id("claim")]),
    );
    w
}

#[tokio::test]
async fn a_restored_copy_of_an_archived_distrusted_memory_stays_distrusted() {
    let World {
        events,
        ids,
        scopes,
    } = archive_and_restore();
    let all = stored(&events, 1);
    let expect = |all: &BTreeMap<EventId, f64>| {
        assert_eq!(
            all.get(&ids["restored"]).copied(),
            Some(engram_memory::confidence::CONTRADICTED),
            "{all:?}"
        );
        assert!(!all.contains_key(&ids["claim"]), "{all:?}");
    };
    // Given it all in one batch, or one event at a time
    for batches in [vec![&all[..]], all.chunks(1).collect()] {
        let models = Models::new().await;
        for batch in batches {
            models.apply(batch).await;
        }
        expect(&models.confidences(&scopes, MemoryFilter::default()).await);
    }
    // And with both models restarted between the archive and the restore
    let models = Models::new().await;
    models.apply(&all[..3]).await;
    models
        .vector
        .checkpoint(&ApplyLedger {
            seq: 3,
            ..ApplyLedger::default()
        })
        .await
        .unwrap();
    let Models {
        dir,
        vector,
        keyword,
        embedder,
    } = models;
    drop((vector, keyword));
    let restarted = Models {
        vector: VectorProjection::new(
            dir.path(),
            Arc::new(embedder.clone()),
            HnswParams::default(),
        ),
        keyword: KeywordProjection::new(dir.path()),
        dir,
        embedder,
    };
    restarted.vector.restore().await.unwrap();
    restarted.keyword.restore().await.unwrap();
    restarted.apply(&all[3..]).await;
    expect(
        &restarted
            .confidences(&scopes, MemoryFilter::default())
            .await,
    );
}

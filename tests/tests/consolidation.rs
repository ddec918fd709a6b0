//! Consolidation end to end, against a real nats-server: planned by the consolidator,
//! appended through the SDK or on its schedule, and seen by retrieval.

use std::time::Duration;

use engram_memory::proto::{
    Consistency, ConsolidateRequest, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_query::QueryConfig;
use engram_schema::{Content, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_testkit::TestNats;
use engram_tests::{Engram, embedder, embedder_model, projectors_config};

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn team() -> Scope {
    Scope::new(ScopeKind::Team, "core").unwrap()
}

fn memory(text: &str) -> Envelope {
    Envelope::new(
        ident("acme"),
        team(),
        ident("agent-1"),
        ident("i-1"),
        Layer::Episodic,
        EventKind::Observation,
        Content::text(text),
    )
}

fn scopes() -> ScopeRequest {
    ScopeRequest {
        tenant: ident("acme"),
        scope: team(),
        grants: vec![],
    }
}

fn at(min_seq: u64) -> Consistency {
    Consistency {
        min_seq: Some(min_seq),
        wait_ms: Some(20_000),
    }
}

async fn keyword_search(
    engram: &Engram,
    query: &str,
    min_seq: u64,
    filter: engram_memory::MemoryFilter,
) -> engram_memory::proto::RetrieveResponse {
    engram
        .client
        .retrieve(&RetrieveRequest {
            scopes: scopes(),
            query: query.into(),
            vector: None,
            top_k: 20,
            filter,
            consistency: at(min_seq),
            mode: RetrievalMode::Keyword,
            ranking: None,
        })
        .await
        .unwrap()
}

/// The texts retrieval returns: the results, then the session summaries beside them.
async fn keyword_hits(engram: &Engram, query: &str, min_seq: u64) -> Vec<String> {
    let response = keyword_search(engram, query, min_seq, Default::default()).await;
    response
        .results
        .into_iter()
        .chain(response.summaries)
        .map(|r| r.text)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consolidating_a_scope_merges_duplicates_for_retrieval_and_never_stores_twice() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let lesson = "the deploy to staging fails when the migration lock is held by another job";
    let mut last = 0;
    for text in [
        lesson.to_owned(),
        format!("{lesson}!"),
        format!("{lesson} again"),
        "the cache warms up slowly after a restart of the api pods".to_owned(),
    ] {
        last = engram.client.append(&memory(&text)).await.unwrap().seq;
    }
    assert_eq!(
        keyword_hits(&engram, "staging migration lock", last)
            .await
            .len(),
        3
    );

    // When the scope is consolidated...
    let request = ConsolidateRequest {
        scopes: scopes(),
        steps: vec![],
        restore: vec![],
        apply: false,
        consistency: at(last),
    };
    let (events, receipts) = engram.client.consolidate(&request).await.unwrap();
    assert_eq!(
        events.len(),
        2,
        "a merged memory and the supersession of its sources"
    );
    let seqs: Vec<u64> = receipts.iter().map(|r| r.as_ref().unwrap().seq).collect();
    let done = *seqs.iter().max().unwrap();
    // ...then retrieval finds the lesson once, as the merged memory counting three, in its
    // fullest telling (whose words hold the others').
    let hits = keyword_hits(&engram, "staging migration lock", done).await;
    assert_eq!(hits, vec![format!("{lesson} again")], "{hits:?}");
    // And appending the same plan again stores nothing new; planning again plans nothing.
    for (event, first) in events.iter().zip(&seqs) {
        let again = engram.client.append(event).await.unwrap();
        assert!(again.duplicate && again.seq == *first);
    }
    let (replanned, _) = engram
        .client
        .consolidate(&ConsolidateRequest {
            consistency: at(done),
            ..request.clone()
        })
        .await
        .unwrap();
    assert!(replanned.is_empty(), "{replanned:?}");
    // A superseded memory can be brought back: a copy naming it, in retrieval again.
    let original = events[0].content.data.as_ref().unwrap()["sources"][1]
        .as_str()
        .unwrap()
        .to_owned();
    let (restored, receipts) = engram
        .client
        .consolidate(&ConsolidateRequest {
            restore: vec![engram_schema::EventId::parse(&original).unwrap()],
            apply: false,
            consistency: at(done),
            ..request.clone()
        })
        .await
        .unwrap();
    assert_eq!(restored.len(), 1);
    assert_eq!(restored[0].content.data.as_ref().unwrap()["op"], "restored");
    assert_eq!(
        restored[0].causation_id.as_ref().map(|c| c.as_str()),
        Some(original.as_str())
    );
    let back = receipts[0].as_ref().unwrap().seq;
    let hits = keyword_hits(&engram, "staging migration lock", back).await;
    assert_eq!(
        hits.len(),
        2,
        "the merged memory and the restored copy: {hits:?}"
    );
    // A request for a step that does not exist, or with grants, is refused.
    let bad = engram
        .client
        .consolidate(&ConsolidateRequest {
            steps: vec!["forget-everything".into()],
            ..request.clone()
        })
        .await
        .unwrap_err();
    assert!(bad.to_string().contains("unknown step"), "{bad}");
}

/// `memory(text)` with its vector, as a client embedding its own texts sends it.
fn embedded(text: &str) -> Envelope {
    let mut e = memory(text);
    e.embedding = Some(engram_schema::Embedding {
        model: embedder_model(),
        vector: embedder().embed_one(text),
    });
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reordered_memory_is_found_by_the_vector_model_and_merged() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    // Given one lesson told in two orders (the same words, few shared shingles, so MinHash
    // alone never pairs them), and one that differs from it in a word that matters.
    let first = embedded("deploy failed: disk full on node-3");
    let reordered = embedded("disk full on node-3, deploy failed");
    let other = embedded("deploy failed: disk full on node-4");
    let shingles = |e: &Envelope| {
        engram_consolidate::minhash::Signature::of(&e.content.text).expect("a text with words")
    };
    assert!(
        shingles(&first).similarity(&shingles(&reordered))
            < engram_consolidate::Policy::default().dedup_similarity,
        "the pair must be one MinHash alone does not merge"
    );
    let mut last = 0;
    for e in [&first, &reordered, &other] {
        last = engram.client.append(e).await.unwrap().seq;
    }
    let request = ConsolidateRequest {
        scopes: scopes(),
        steps: vec!["dedup".into()],
        restore: vec![],
        apply: false,
        consistency: at(last),
    };
    let (events, receipts) = engram.client.consolidate(&request).await.unwrap();
    // Then the two tellings are merged, and the one about another node is left alone.
    assert_eq!(events.len(), 2, "{events:#?}");
    let data = events[0].content.data.as_ref().unwrap();
    assert_eq!(data["op"], "merged");
    let mut sources: Vec<&str> = data["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    sources.sort_unstable();
    let mut wanted = vec![first.event_id.as_str(), reordered.event_id.as_str()];
    wanted.sort_unstable();
    assert_eq!(sources, wanted);
    let done = receipts
        .iter()
        .map(|r| r.as_ref().unwrap().seq)
        .max()
        .unwrap();
    // And once applied, planning again finds nothing more to merge.
    let (again, _) = engram
        .client
        .consolidate(&ConsolidateRequest {
            consistency: at(done),
            ..request
        })
        .await
        .unwrap();
    assert!(again.is_empty(), "{again:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_schedule_summarises_a_finished_session_without_being_asked() {
    let nats = TestNats::start().await;
    let mut config = projectors_config();
    config.consolidator.interval = Duration::from_millis(300);
    let engram = Engram::start_with(&nats, config, QueryConfig::default()).await;
    for text in [
        "We looked at the billing export. The billing export drops rows with a null region.",
        "The null region rows come from the legacy importer. The billing export needs a default region.",
    ] {
        engram.client.append(&memory(text)).await.unwrap();
    }
    let mut finished = memory("session over");
    finished.kind = EventKind::Checkpoint;
    finished.layer = Layer::Working;
    finished.content.data = Some(serde_json::json!({"finished": true}));
    let last = engram.client.append(&finished).await.unwrap().seq;
    // The summary appears on its own, at a later sequence, as a semantic memory.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let bus = engram.client.bus();
        let head = bus.stream_summary().await.unwrap().last_seq;
        if head > last {
            let query = "billing export default region";
            let response = keyword_search(&engram, query, head, Default::default()).await;
            let is_summary = |r: &&engram_memory::proto::MemoryResult| {
                r.text.starts_with("We looked at the billing export.")
                    && r.text.contains("default region")
            };
            if let Some(summary) = response.summaries.iter().find(is_summary) {
                // Beside the results, not among them: it quotes what they already say.
                assert!(!response.results.iter().any(|r| is_summary(&r)));
                assert_eq!(summary.tags, [engram_memory::SUMMARY_TAG]);
                // Dated when its session's last memory was written, not when planned.
                let newest = response.results.iter().map(|r| r.occurred_at).max();
                assert_eq!(Some(summary.occurred_at), newest);
                // A filter that asks for summaries ranks them as results.
                let asked = keyword_search(
                    &engram,
                    query,
                    head,
                    engram_memory::MemoryFilter {
                        tags: vec![engram_memory::SUMMARY_TAG.into()],
                        ..Default::default()
                    },
                )
                .await;
                assert!(asked.results.iter().any(|r| is_summary(&r)), "{asked:?}");
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no summary was appended"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

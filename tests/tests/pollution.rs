//! Pollution defence end to end, against a real nats-server: an outcome contradicts a memory
//! and a feedback flags a faulty instance; retrieval with `min_confidence` leaves exactly
//! those memories out, retrieval without it still returns them with their lowered
//! confidence, and a context leaves out what fell below its threshold.

use std::collections::BTreeMap;

use engram_memory::MemoryFilter;
use engram_memory::proto::{
    Consistency, ContextRequest, MemoryResult, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_schema::{EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::{Agent, AppendError};
use engram_testkit::TestNats;
use engram_tests::{Engram, embedder, embedder_model};
use serde_json::json;

fn core() -> Scope {
    Scope::new(ScopeKind::Team, "core").unwrap()
}

fn ops() -> Scope {
    Scope::new(ScopeKind::Team, "ops").unwrap()
}

fn own(tenant: &str, scope: Scope) -> ScopeRequest {
    ScopeRequest {
        tenant: Ident::parse("tenant", tenant).unwrap(),
        scope,
        grants: vec![],
    }
}

/// Appends an episodic observation with a client-supplied vector; returns its id and seq.
async fn remember(agent: &Agent, scope: Scope, text: &str) -> (EventId, u64) {
    let event = agent
        .event(scope, Layer::Episodic, EventKind::Observation, text)
        .embedding(embedder_model(), embedder().embed_one(text))
        .build()
        .unwrap();
    let seq = agent.client().append(&event).await.unwrap().seq;
    (event.event_id, seq)
}

/// Every deploy memory of `scopes` that `filter` lets through, by event id, in `mode`.
async fn retrieve(
    engram: &Engram,
    scopes: ScopeRequest,
    filter: MemoryFilter,
    mode: RetrievalMode,
    min_seq: u64,
) -> BTreeMap<EventId, MemoryResult> {
    let query = "deploy";
    engram
        .client
        .retrieve(&RetrieveRequest {
            scopes,
            query: query.into(),
            vector: Some(embedder().embed_one(query)),
            top_k: 50,
            filter,
            consistency: Consistency {
                min_seq: Some(min_seq),
                wait_ms: Some(20_000),
            },
            mode,
            ranking: None,
        })
        .await
        .unwrap()
        .results
        .into_iter()
        .map(|r| (r.event_id.clone(), r))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contradicted_and_faulty_memories_lose_confidence_and_can_be_left_out() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let planner = engram.client.agent("acme", "planner", "i-1").unwrap();
    let faulty = engram.client.agent("acme", "planner", "i-2").unwrap();
    let reviewer = engram.client.agent("acme", "reviewer", "i-3").unwrap();
    let elsewhere = engram.client.agent("umbrella", "planner", "i-2").unwrap();

    // Given memories of two instances in team:core, and of the faulty one elsewhere
    let (claim, _) = remember(&planner, core(), "deploy: run migrations after the rollout").await;
    let (sound, _) = remember(&planner, core(), "deploy needs two approvals").await;
    let (bad_1, _) = remember(&faulty, core(), "deploy window is sunday at 3am").await;
    let (bad_2, _) = remember(&faulty, core(), "deploy rollback needs no approval").await;
    let (in_ops, _) = remember(&faulty, ops(), "deploy ops runbook lives in the wiki").await;
    let (other_tenant, _) = remember(&elsewhere, core(), "deploy on mondays").await;

    // When an outcome contradicts the claim (and, from team:ops, names a core memory)
    let outcome = "deploy failed: migrations must run before the rollout";
    let (outcome_id, _) = {
        let event = reviewer
            .event(core(), Layer::Episodic, EventKind::Outcome, outcome)
            .embedding(embedder_model(), embedder().embed_one(outcome))
            .data(json!({"success": false, "contradicts": [claim]}))
            .build()
            .unwrap();
        let seq = engram.client.append(&event).await.unwrap().seq;
        (event.event_id, seq)
    };
    reviewer
        .event(ops(), Layer::Episodic, EventKind::Outcome, "")
        .data(json!({"contradicts": [sound]}))
        .append()
        .await
        .unwrap();
    // and a feedback flags i-2 in team:core. Its text comes without a vector, which this
    // deployment needs: the vector projector dead-letters the text but applies the flag.
    reviewer
        .event(
            core(),
            Layer::Episodic,
            EventKind::Feedback,
            "i-2 hallucinated its schedule",
        )
        .data(json!({"faulty_instance": "i-2"}))
        .append()
        .await
        .unwrap();
    // and i-2 writes again afterwards
    let (later, last) = remember(&faulty, core(), "deploy freeze starts friday").await;

    // Then without a filter every memory is still returned, with its confidence: the claim
    // halved, what i-2 wrote before the flag at a quarter, everything else whole
    let expected: BTreeMap<EventId, f64> = [
        (claim.clone(), 0.5),
        (sound.clone(), 1.0),
        (bad_1.clone(), 0.25),
        (bad_2.clone(), 0.25),
        (outcome_id.clone(), 1.0),
        (later.clone(), 1.0),
    ]
    .into();
    let trusted = MemoryFilter {
        min_confidence: Some(0.6),
        ..MemoryFilter::default()
    };
    for mode in [
        RetrievalMode::Hybrid,
        RetrievalMode::Dense,
        RetrievalMode::Keyword,
    ] {
        let all = retrieve(
            &engram,
            own("acme", core()),
            MemoryFilter::default(),
            mode,
            last,
        )
        .await;
        let confidences: BTreeMap<EventId, f64> = all
            .iter()
            .map(|(id, r)| (id.clone(), r.confidence))
            .collect();
        assert_eq!(confidences, expected, "{mode:?}");

        // And with min_confidence 0.6 exactly the contradicted and the faulty ones are left out
        let kept = retrieve(&engram, own("acme", core()), trusted.clone(), mode, last).await;
        let kept: Vec<&EventId> = kept.keys().collect();
        let mut wanted = vec![&sound, &outcome_id, &later];
        wanted.sort();
        assert_eq!(kept, wanted, "{mode:?}");

        // And the flagged instance's memories of another scope and tenant are untouched
        let ops_side = retrieve(&engram, own("acme", ops()), trusted.clone(), mode, last).await;
        assert_eq!(ops_side[&in_ops].confidence, 1.0, "{mode:?}");
        let other = retrieve(
            &engram,
            own("umbrella", core()),
            trusted.clone(),
            mode,
            last,
        )
        .await;
        assert_eq!(other[&other_tenant].confidence, 1.0, "{mode:?}");
    }

    // And a context (threshold 0.3) keeps the once-contradicted claim but not the faulty
    // instance's memories
    let context = engram
        .client
        .build_context(&ContextRequest {
            scopes: own("acme", core()),
            agent_id: Ident::parse("agent", "planner").unwrap(),
            task: "release".into(),
            query: "deploy".into(),
            vector: Some(embedder().embed_one("deploy")),
            token_budget: 2_000,
            consistency: Consistency {
                min_seq: Some(last),
                wait_ms: Some(20_000),
            },
        })
        .await
        .unwrap();
    let sources: Vec<&str> = context.items.iter().map(|i| i.source.as_str()).collect();
    for id in [&claim, &sound, &outcome_id, &later] {
        assert!(sources.contains(&id.as_str()), "{id} missing: {sources:?}");
    }
    for id in [&bad_1, &bad_2] {
        assert!(!sources.contains(&id.as_str()), "{id} in the context");
    }

    // And a malformed signal is refused at append, naming the field
    let refused = reviewer
        .event(core(), Layer::Episodic, EventKind::Feedback, "")
        .data(json!({"faulty_instance": "i.2"}))
        .append()
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, AppendError::Invalid(e) if e.to_string().contains("content.data.faulty_instance")),
        "{refused:?}"
    );
    let refused = reviewer
        .event(core(), Layer::Episodic, EventKind::Outcome, "")
        .data(json!({"contradicts": ["*"]}))
        .append()
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, AppendError::Invalid(e) if e.to_string().contains("content.data.contradicts")),
        "{refused:?}"
    );
    engram.stop().await;
}

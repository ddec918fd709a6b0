//! Projectors and the query service end to end, against a real nats-server: read-your-writes
//! under concurrent writers, scope isolation (a property test), facts, skills and contexts.

use engram_memory::proto::{
    Consistency, ContextRequest, ErrorCode, FactsRequest, RetrievalMode, RetrieveRequest,
    ScopeRequest, SkillsRequest,
};
use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::RpcError;
use engram_testkit::TestNats;
use engram_tests::{Engram, embedder, embedder_model};
use proptest::prelude::*;

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn memory(tenant: &str, scope: Scope, text: &str) -> Envelope {
    let mut e = Envelope::new(
        ident(tenant),
        scope,
        ident("agent-1"),
        ident("i-1"),
        Layer::Episodic,
        EventKind::Observation,
        Content::text(text),
    );
    e.embedding = Some(engram_schema::Embedding {
        model: embedder_model(),
        vector: embedder().embed_one(text),
    });
    e
}

fn retrieve(
    scopes: ScopeRequest,
    query: &str,
    mode: RetrievalMode,
    min_seq: u64,
) -> RetrieveRequest {
    RetrieveRequest {
        scopes,
        query: query.to_owned(),
        vector: Some(embedder().embed_one(query)),
        top_k: 50,
        filter: Default::default(),
        consistency: Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(10_000),
        },
        mode,
        ranking: None,
    }
}

fn own(tenant: &str, scope: &Scope) -> ScopeRequest {
    ScopeRequest {
        tenant: ident(tenant),
        scope: scope.clone(),
        grants: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_is_visible_to_its_writer_under_concurrent_writers() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let scope = Scope::new(ScopeKind::Task, "ryw").unwrap();
    let mut writers = Vec::new();
    for w in 0..8 {
        let client = engram.client.clone();
        let scope = scope.clone();
        writers.push(tokio::spawn(async move {
            let mut misses = Vec::new();
            for i in 0..15 {
                let marker = format!("marker{w}x{i} zebra");
                let event = memory("acme", scope.clone(), &marker);
                let seq = client.append(&event).await.unwrap().seq;
                for mode in [
                    RetrievalMode::Keyword,
                    RetrievalMode::Dense,
                    RetrievalMode::Hybrid,
                ] {
                    let found = client
                        .retrieve(&retrieve(own("acme", &scope), &marker, mode, seq))
                        .await
                        .unwrap();
                    assert!(found.visible.iter().all(|(_, v)| *v >= seq), "{found:?}");
                    if !found.results.iter().any(|r| r.event_id == event.event_id) {
                        misses.push((marker.clone(), mode));
                    }
                }
            }
            misses
        }));
    }
    for w in writers {
        let misses = w.await.unwrap();
        assert!(
            misses.is_empty(),
            "writes not visible to their writer: {misses:?}"
        );
    }
    engram.stop().await;
}

#[tokio::test]
async fn a_token_beyond_the_stream_is_refused_with_a_typed_error() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let scope = Scope::new(ScopeKind::Task, "t").unwrap();
    let seq = engram
        .client
        .append(&memory("acme", scope.clone(), "hello"))
        .await
        .unwrap()
        .seq;
    let mut request = retrieve(
        own("acme", &scope),
        "hello",
        RetrievalMode::Hybrid,
        seq + 100,
    );
    request.consistency.wait_ms = Some(200);
    // No append returned it, so waiting could only time out: refused at once.
    let err = engram.client.retrieve(&request).await.unwrap_err();
    assert!(
        matches!(
            &err,
            RpcError::Service {
                code: ErrorCode::Invalid,
                message,
            } if message.contains("min_seq")
        ),
        "{err:?}"
    );
    // Sibling grants are refused, not silently read.
    let mut request = retrieve(own("acme", &scope), "hello", RetrievalMode::Hybrid, seq);
    request.scopes.grants = vec![Scope::new(ScopeKind::Task, "other").unwrap()];
    let err = engram.client.retrieve(&request).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Invalid, "{err:?}");
    engram.stop().await;
}

/// Scope ids built to collide: prefixes, case variants, separators.
fn colliding_ids() -> impl Strategy<Value = Vec<String>> {
    "[a-c]{1,2}".prop_map(|base| {
        vec![
            base.clone(),
            format!("{base}b"),
            base.to_uppercase(),
            format!("{base}-x"),
            format!("{base}_x"),
        ]
    })
}

#[test]
fn no_query_reads_another_tenant_or_a_sibling_scope() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (nats, engram) = runtime.block_on(async {
        let nats = TestNats::start().await;
        let engram = Engram::start(&nats).await;
        (nats, engram)
    });
    let case = std::sync::atomic::AtomicU32::new(0);
    proptest!(ProptestConfig::with_cases(6), |(ids in colliding_ids(), kind in 0usize..3)| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let kind = [ScopeKind::Team, ScopeKind::Task, ScopeKind::Session][kind];
        // Tenants collide too: a prefix and a case variant.
        let tenants = [format!("t{case}"), format!("t{case}b"), format!("T{case}")];
        let org = Scope::new(ScopeKind::Org, "shared").unwrap();
        runtime.block_on(async {
            let mut last = 0;
            for tenant in &tenants {
                last = last.max(engram.client.append(&memory(tenant, org.clone(), "secret plan org")).await.unwrap().seq);
                for id in &ids {
                    let scope = Scope::new(kind, id).unwrap();
                    let text = format!("secret plan of {tenant} {id}");
                    last = last.max(engram.client.append(&memory(tenant, scope, &text)).await.unwrap().seq);
                }
            }
            for tenant in &tenants {
                for id in &ids {
                    let scope = Scope::new(kind, id).unwrap();
                    for (grants, allowed_org) in [(vec![], false), (vec![org.clone()], true)] {
                        let scopes = ScopeRequest { tenant: ident(tenant), scope: scope.clone(), grants };
                        for mode in [RetrievalMode::Keyword, RetrievalMode::Dense, RetrievalMode::Hybrid] {
                            let found = engram.client
                                .retrieve(&retrieve(scopes.clone(), "secret plan", mode, last))
                                .await
                                .unwrap();
                            let expected = 1 + usize::from(allowed_org);
                            assert_eq!(found.results.len(), expected, "{tenant}/{scope} {mode:?}: {found:?}");
                            for r in &found.results {
                                assert_eq!(r.tenant.as_str(), tenant.as_str(), "other tenant leaked");
                                assert!(r.scope == scope || (allowed_org && r.scope == org), "scope {} leaked into {scope}", r.scope);
                            }
                        }
                    }
                }
            }
        });
    });
    runtime.block_on(async move {
        engram.stop().await;
        drop(nats);
    });
}

#[tokio::test]
async fn facts_skills_and_contexts_end_to_end() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let tenant = ident("acme");
    let task = Scope::new(ScopeKind::Task, "deploy").unwrap();
    let event = |layer, kind, text: &str, data: serde_json::Value| {
        let mut e = memory("acme", task.clone(), text);
        e.layer = layer;
        e.kind = kind;
        e.content.data = Some(data);
        e
    };
    let t0 = chrono::Utc::now() - chrono::Duration::hours(2);
    let mut old = event(
        Layer::Semantic,
        EventKind::FactAsserted,
        "",
        serde_json::json!({"subject": "service", "predicate": "region", "object": "eu-west-1"}),
    );
    old.occurred_at = t0;
    let mut new = event(
        Layer::Semantic,
        EventKind::FactAsserted,
        "",
        serde_json::json!({"subject": "service", "predicate": "region", "object": "us-east-2"}),
    );
    new.occurred_at = t0 + chrono::Duration::hours(1);
    let skill = event(
        Layer::Procedural,
        EventKind::SkillRecorded,
        "",
        serde_json::json!({"name": "rollback", "description": "roll back a failed deploy to the previous release", "steps": ["find previous release", "redeploy it"]}),
    );
    let outcome = event(
        Layer::Procedural,
        EventKind::Outcome,
        "",
        serde_json::json!({"skill": "rollback", "success": true}),
    );
    let note = memory(
        "acme",
        task.clone(),
        "the deploy failed because the database migration timed out",
    );
    let mut last = 0;
    for e in [&new, &old, &skill, &outcome, &note] {
        last = engram.client.append(e).await.unwrap().seq;
    }
    let wm = engram.client.working_memory().await.unwrap();
    wm.put(
        &tenant,
        &task,
        "current-step",
        "verify the rollback".into(),
        None,
    )
    .await
    .unwrap();

    let scopes = ScopeRequest {
        tenant: tenant.clone(),
        scope: task.clone(),
        grants: vec![],
    };
    let consistency = Consistency {
        min_seq: Some(last),
        wait_ms: Some(10_000),
    };
    let facts = engram
        .client
        .facts(&FactsRequest {
            scopes: scopes.clone(),
            subject: Some("service".into()),
            predicate: Some("region".into()),
            text: None,
            valid_at: None,
            known_at: None,
            history: false,
            limit: 10,
            consistency,
        })
        .await
        .unwrap();
    assert_eq!(facts.facts.len(), 1, "{facts:?}");
    assert_eq!(
        facts.facts[0]["object"], "us-east-2",
        "the later occurred_at wins, though it arrived first"
    );
    let then = engram
        .client
        .facts(&FactsRequest {
            scopes: scopes.clone(),
            subject: Some("service".into()),
            predicate: Some("region".into()),
            text: None,
            valid_at: Some(t0 + chrono::Duration::minutes(30)),
            known_at: None,
            history: false,
            limit: 10,
            consistency,
        })
        .await
        .unwrap();
    assert_eq!(then.facts[0]["object"], "eu-west-1", "as it stood then");

    let skills = engram
        .client
        .skills(&SkillsRequest {
            scopes: scopes.clone(),
            task: Some("deploy failed, need to roll back".into()),
            name: None,
            limit: 3,
            consistency,
        })
        .await
        .unwrap();
    assert_eq!(skills.skills[0]["name"], "rollback", "{skills:?}");

    for budget in [400, 60, 20] {
        let context = engram
            .client
            .build_context(&ContextRequest {
                scopes: scopes.clone(),
                agent_id: ident("agent-1"),
                task: "deploy".into(),
                query: "why did the service deploy fail in its region".into(),
                vector: Some(embedder().embed_one("why did the service deploy fail in its region")),
                token_budget: budget,
                consistency,
            })
            .await
            .unwrap();
        assert!(
            context.tokens <= budget,
            "{} tokens over a budget of {budget}",
            context.tokens
        );
        if budget == 400 {
            let layers: Vec<Layer> = context.items.iter().map(|i| i.layer).collect();
            for layer in [
                Layer::Working,
                Layer::Procedural,
                Layer::Semantic,
                Layer::Episodic,
            ] {
                assert!(
                    layers.contains(&layer),
                    "{layer} missing from {}",
                    context.rendered
                );
            }
            assert!(context.rendered.contains("verify the rollback"));
            assert!(context.rendered.contains("migration timed out"));
            assert!(context.rendered.contains("us-east-2"));
            assert!(
                !context.rendered.contains("eu-west-1"),
                "superseded fact in context"
            );
        }
    }
    engram.stop().await;
}

#[tokio::test]
async fn a_forgotten_memory_leaves_every_index_and_a_scope_forgets_only_its_own() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let mine = Scope::new(ScopeKind::Task, "mine").unwrap();
    let other = Scope::new(ScopeKind::Task, "other").unwrap();
    let a = memory(
        "acme",
        mine.clone(),
        "the staging password rotates on fridays",
    );
    let b = memory(
        "acme",
        mine.clone(),
        "the staging password lives in the vault",
    );
    let c = memory("acme", other.clone(), "the staging password is hunter2");
    let mut before = 0;
    for event in [&a, &b, &c] {
        before = engram.client.append(event).await.unwrap().seq;
    }
    let modes = [
        RetrievalMode::Keyword,
        RetrievalMode::Dense,
        RetrievalMode::Hybrid,
    ];
    let found = |scope: &Scope, mode: RetrievalMode, min_seq: u64| {
        let request = retrieve(own("acme", scope), "staging password", mode, min_seq);
        let client = engram.client.clone();
        async move {
            let response = client.retrieve(&request).await.unwrap();
            response
                .results
                .into_iter()
                .map(|r| r.event_id)
                .collect::<Vec<_>>()
        }
    };
    for mode in modes {
        assert!(found(&mine, mode, before).await.contains(&a.event_id));
    }

    // Given a forget in `mine` that names its own memory a, another scope's memory c and an
    // id that was never stored
    let forget = Envelope::forget(
        ident("acme"),
        mine.clone(),
        ident("agent-1"),
        ident("i-1"),
        Layer::Episodic,
        &[a.event_id.clone(), c.event_id.clone(), EventId::new()],
        "rotated out",
    );
    let seq = engram.client.append(&forget).await.unwrap().seq;

    // Then a is gone from every mode, b stays, and c stays in its own scope
    for mode in modes {
        let in_mine = found(&mine, mode, seq).await;
        assert!(!in_mine.contains(&a.event_id), "{mode:?}: a was forgotten");
        assert!(in_mine.contains(&b.event_id), "{mode:?}: b was not");
        assert!(!in_mine.contains(&forget.event_id), "a forget is no memory");
        assert!(
            found(&other, mode, seq).await.contains(&c.event_id),
            "{mode:?}: another scope cannot forget c"
        );
    }

    // And a forget without ids is refused at the client, with nothing sent
    let mut empty = forget.clone();
    empty.event_id = EventId::new();
    empty.content.data = Some(serde_json::json!({ "event_ids": [] }));
    let err = engram.client.append(&empty).await.unwrap_err();
    assert!(err.to_string().contains("content.data.event_ids"), "{err}");
    engram.stop().await;
}

/// A question that names a date ranks the memories from that date first, in every mode,
/// and says so in each result's score parts; the same question without the date, or with
/// `date_weight` 0, ranks by the text alone.
#[tokio::test]
async fn a_date_the_question_names_ranks_the_memories_from_then_first() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let scope = Scope::new(ScopeKind::Task, "dated").unwrap();
    let at = |s: &str| s.parse::<chrono::DateTime<chrono::Utc>>().unwrap();
    // The May memory matches the question's words better; the October one happened on the
    // day the question names.
    let mut may = memory(
        "acme",
        scope.clone(),
        "Melanie did show Caroline a painting",
    );
    may.occurred_at = at("2023-05-08T13:56:00Z");
    let mut october = memory(
        "acme",
        scope.clone(),
        "Melanie told Caroline about her week",
    );
    october.occurred_at = at("2023-10-13T10:31:00Z");
    // Far from both in meaning and in time: dense scores are normalised over the
    // candidates, and without it the weaker of two would score 0, which no lift moves.
    let mut other = memory(
        "acme",
        scope.clone(),
        "the build server runs out of disk on mondays",
    );
    other.occurred_at = at("2021-01-04T09:00:00Z");
    let mut last = 0;
    for event in [&may, &october, &other] {
        last = engram.client.append(event).await.unwrap().seq;
    }
    let ranked = |query: &str, mode: RetrievalMode, date_weight: f32| {
        let mut request = retrieve(own("acme", &scope), query, mode, last);
        request.ranking = Some(engram_memory::proto::Ranking {
            date_weight,
            ..Default::default()
        });
        let client = engram.client.clone();
        async move {
            let response = client.retrieve(&request).await.unwrap();
            response
                .results
                .into_iter()
                .map(|r| (r.event_id, r.parts.date_boost))
                .collect::<Vec<_>>()
        }
    };
    let dated = "What painting did Melanie show to Caroline on October 13, 2023?";
    let undated = "What painting did Melanie show to Caroline?";
    // Process-wide and only rising (other tests share the process): at least the dated
    // retrievals below with a weight above 0 count.
    let counted_before = engram_telemetry::metrics::RETRIEVE_DATED.get();
    for mode in [
        RetrievalMode::Keyword,
        RetrievalMode::Dense,
        RetrievalMode::Hybrid,
    ] {
        let plain = ranked(undated, mode, 1.0).await;
        assert_eq!(plain[0].0, may.event_id, "{mode:?}: by text, May first");
        assert!(plain.iter().all(|(_, boost)| *boost == 0.0), "{mode:?}");
        let off = ranked(dated, mode, 0.0).await;
        assert_eq!(
            off[0].0, may.event_id,
            "{mode:?}: weight 0 ignores the date"
        );
        // The largest weight, so the check does not hang on how close the two texts
        // score; what the default weight does to recall is the LoCoMo benchmark's to say.
        let on = ranked(dated, mode, 10.0).await;
        assert_eq!(on[0], (october.event_id.clone(), 10.0), "{mode:?}: {on:?}");
    }
    assert!(engram_telemetry::metrics::RETRIEVE_DATED.get() >= counted_before + 3);
    engram.stop().await;
}

/// Hybrid score fusion asks the keyword side for its hits plus the scores of the memories
/// ranked after them (`rest`), in one search. Those must be exactly the next ranks of a
/// deeper search, or fusion would score dense-only candidates wrongly.
#[tokio::test]
async fn the_keyword_ranks_after_the_hits_are_those_of_a_deeper_search() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let scope = Scope::new(ScopeKind::Task, "rest").unwrap();
    let mut last = 0;
    for i in 0..12 {
        // Different term frequencies give distinct BM25 scores.
        let text = format!("{} filler words number {i}", "needle ".repeat(i % 6 + 1));
        last = engram
            .client
            .append(&memory("acme", scope.clone(), &text))
            .await
            .unwrap()
            .seq;
    }
    let bus = nats.bus().await;
    let search = |k: usize, rest: usize| engram_memory::proto::SearchRequest {
        scopes: vec![engram_memory::ScopeKey::new(ident("acme"), scope.clone())],
        query: "needle".into(),
        vector: None,
        k,
        filter: Default::default(),
        consistency: Consistency {
            min_seq: Some(last),
            wait_ms: Some(10_000),
        },
        score_also: Vec::new(),
        rest,
    };
    // The instance of the partition that holds the scope.
    let subject = engram_memory::proto::partition_subject(
        "keyword",
        "search",
        engram_memory::ScopeKey::new(ident("acme"), scope.clone())
            .partition(bus.config().stream.partitions),
    );
    let ask = |request: engram_memory::proto::SearchRequest| {
        let (client, subject) = (bus.client().clone(), subject.clone());
        async move {
            engram_rpc::call::<_, engram_memory::proto::SearchResponse>(
                &client,
                &subject,
                &request,
                std::time::Duration::from_secs(15),
            )
            .await
            .unwrap()
        }
    };
    let deep = ask(search(12, 0)).await;
    let split = ask(search(4, 9)).await;
    let scores = |hits: &[engram_memory::Hit]| hits.iter().map(|h| h.score).collect::<Vec<_>>();
    let deep_hits: Vec<_> = deep.hits.iter().map(|h| h.hit).collect();
    let split_hits: Vec<_> = split.hits.iter().map(|h| h.hit).collect();
    // The same scores in the same ranks...
    assert_eq!(scores(&split_hits), scores(&deep_hits[..4]));
    assert_eq!(scores(&split.also), scores(&deep_hits[4..9]));
    // ...each of a memory a deeper search ranks with that score. Memories of equal score may
    // come in another order (and one of them may fill the last place): a segment merge
    // between two searches renumbers the documents tantivy breaks ties by.
    let deeper = ask(search(40, 0)).await;
    for hit in split_hits.iter().chain(&split.also) {
        assert!(
            deeper
                .hits
                .iter()
                .any(|d| d.hit.seq == hit.seq && d.hit.score == hit.score),
            "{hit:?} is not ranked so by a deep search: {:?}",
            deeper.hits
        );
    }
    assert!(deep.also.is_empty(), "{:?}", deep.also);
    engram.stop().await;
}

/// Score fusion asks the vector side to score the keyword hits too (`score_also`), whatever
/// their dense rank. Each such score must be the memory's own dense score (as a deep search
/// ranks it), and only memories of the requested scopes are scored.
#[tokio::test]
async fn the_vector_side_scores_the_memories_it_is_asked_about_as_a_deep_search_would() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let scope = Scope::new(ScopeKind::Task, "also").unwrap();
    let other = Scope::new(ScopeKind::Task, "elsewhere").unwrap();
    let mut seqs = Vec::new();
    for i in 0..10 {
        let text = format!("the deploy failed on step {i} of the release pipeline");
        seqs.push(
            engram
                .client
                .append(&memory("acme", scope.clone(), &text))
                .await
                .unwrap()
                .seq,
        );
    }
    let foreign = engram
        .client
        .append(&memory("acme", other, "the deploy failed elsewhere"))
        .await
        .unwrap()
        .seq;
    let bus = nats.bus().await;
    let query = "why did the release pipeline fail";
    let search = |k: usize, score_also: Vec<u64>| engram_memory::proto::SearchRequest {
        scopes: vec![engram_memory::ScopeKey::new(ident("acme"), scope.clone())],
        query: query.into(),
        vector: Some(embedder().embed_one(query)),
        k,
        filter: Default::default(),
        consistency: Consistency {
            min_seq: Some(foreign),
            wait_ms: Some(10_000),
        },
        score_also,
        rest: 0,
    };
    // The instance of the partition that holds the scope.
    let subject = engram_memory::proto::partition_subject(
        "vector",
        "search",
        engram_memory::ScopeKey::new(ident("acme"), scope.clone())
            .partition(bus.config().stream.partitions),
    );
    let ask = |request: engram_memory::proto::SearchRequest| {
        let (client, subject) = (bus.client().clone(), subject.clone());
        async move {
            engram_rpc::call::<_, engram_memory::proto::SearchResponse>(
                &client,
                &subject,
                &request,
                std::time::Duration::from_secs(15),
            )
            .await
            .unwrap()
        }
    };
    let deep = ask(search(10, Vec::new())).await;
    let ranked: Vec<u64> = deep.hits.iter().map(|h| h.hit.seq).collect();
    // Ask for the top 2, and about the two lowest-ranked memories plus one of another scope
    let (low, lower) = (ranked[8], ranked[9]);
    let shallow = ask(search(2, vec![low, lower, foreign])).await;
    assert_eq!(shallow.hits.len(), 2);
    let mut also: Vec<(u64, f32)> = shallow.also.iter().map(|h| (h.seq, h.score)).collect();
    also.sort_by_key(|(seq, _)| *seq);
    let mut wanted: Vec<(u64, f32)> = deep
        .hits
        .iter()
        .filter(|h| h.hit.seq == low || h.hit.seq == lower)
        .map(|h| (h.hit.seq, h.hit.score))
        .collect();
    wanted.sort_by_key(|(seq, _)| *seq);
    assert_eq!(
        also.len(),
        2,
        "{also:?}: the other scope's memory is not scored"
    );
    for ((seq, score), (want_seq, want)) in also.iter().zip(&wanted) {
        assert_eq!(seq, want_seq);
        assert!((score - want).abs() < 1e-5, "seq {seq}: {score} vs {want}");
    }
    assert!(seqs.contains(&low) && seqs.contains(&lower));
    engram.stop().await;
}

//! Memory nodes against a real nats-server: the read models' stream partitions split between
//! several nodes (each its own projectors, state and query service). A query answers the
//! same whichever nodes hold which partitions, and one that needs a partition no node serves
//! says so at once instead of answering with part of the memory.

use std::time::Duration;

use engram_memory::proto::{
    Consistency, ErrorCode, FactsRequest, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_projectors::{ProjectorName, ProjectorsConfig};
use engram_query::QueryConfig;
use engram_schema::{Ident, Scope, ScopeKind};
use engram_testkit::TestNats;
use engram_tests::{Engram, embedded, embedder, fact, projectors_config};

const TOPICS: [&str; 4] = ["deploys", "the cache", "billing", "backups"];
const TASKS: usize = 12;

fn ident(s: &str) -> Ident {
    Ident::parse("id", s).unwrap()
}

fn task(i: usize) -> Scope {
    Scope::new(ScopeKind::Task, &format!("t-{i}")).unwrap()
}

/// Task `i`'s scope, with its team's and the org's granted: three scopes, most often on
/// three partitions.
fn scopes(i: usize) -> ScopeRequest {
    ScopeRequest {
        tenant: ident("acme"),
        scope: task(i),
        grants: vec![
            Scope::new(ScopeKind::Team, &format!("team-{}", i % 3)).unwrap(),
            Scope::new(ScopeKind::Org, "acme").unwrap(),
        ],
    }
}

/// A node serving `partitions` with every read model but the consolidator (which would
/// write to the stream while the layouts are compared).
fn node_config(partitions: &str) -> ProjectorsConfig {
    ProjectorsConfig {
        run: ProjectorName::all()
            .into_iter()
            .filter(|n| *n != ProjectorName::CONSOLIDATOR)
            .collect(),
        partitions: partitions.parse().unwrap(),
        ..projectors_config()
    }
}

async fn nodes(nats: &TestNats, layout: &[&str]) -> Vec<Engram> {
    let mut nodes = Vec::new();
    for partitions in layout {
        nodes.push(Engram::start_with(nats, node_config(partitions), QueryConfig::default()).await);
    }
    nodes
}

fn retrieve(i: usize, topic: &str, mode: RetrievalMode, min_seq: u64) -> RetrieveRequest {
    RetrieveRequest {
        scopes: scopes(i),
        query: topic.to_owned(),
        vector: Some(embedder().embed_one(topic)),
        top_k: 20,
        filter: Default::default(),
        consistency: Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(20_000),
        },
        mode,
        ranking: None,
    }
}

fn facts(i: usize, min_seq: u64) -> FactsRequest {
    FactsRequest {
        scopes: scopes(i),
        subject: None,
        predicate: None,
        text: None,
        valid_at: None,
        known_at: None,
        history: false,
        limit: 100,
        consistency: Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(20_000),
        },
    }
}

/// Every query of `tasks`' answer, as comparable text: results in order with their scores,
/// and the facts.
async fn answers(node: &Engram, tasks: &[usize], min_seq: u64) -> Vec<String> {
    let mut out = Vec::new();
    for &i in tasks {
        for topic in TOPICS {
            for mode in [
                RetrievalMode::Keyword,
                RetrievalMode::Dense,
                RetrievalMode::Hybrid,
            ] {
                let found = node
                    .client
                    .retrieve(&retrieve(i, topic, mode, min_seq))
                    .await
                    .unwrap();
                let ranked: Vec<String> = found
                    .results
                    .iter()
                    .map(|r| format!("{}@{}:{}", r.event_id, r.scope, r.score))
                    .collect();
                out.push(format!("t-{i} {topic} {mode:?}: {}", ranked.join(" ")));
            }
        }
        let known = node.client.facts(&facts(i, min_seq)).await.unwrap();
        // The facts themselves: `visible_seq` moves with the usage events queries append.
        out.push(format!(
            "t-{i} facts: {}",
            serde_json::to_string(&known.facts).unwrap()
        ));
    }
    out
}

/// A dense retrieval of everything in task `i`'s scopes finds every memory written there,
/// from whichever partitions they are on, and nothing else.
async fn finds_all(node: &Engram, events: &[engram_schema::Envelope], min_seq: u64) {
    for i in 0..TASKS {
        let s = scopes(i);
        let readable: Vec<Scope> = std::iter::once(s.scope.clone()).chain(s.grants).collect();
        let mut expected: Vec<String> = events
            .iter()
            .filter(|e| e.embedding.is_some() && readable.contains(&e.scope))
            .map(|e| e.event_id.to_string())
            .collect();
        let mut request = retrieve(i, TOPICS[0], RetrievalMode::Dense, min_seq);
        request.top_k = 1_000;
        let mut found: Vec<String> = node
            .client
            .retrieve(&request)
            .await
            .unwrap()
            .results
            .iter()
            .map(|r| r.event_id.to_string())
            .collect();
        expected.sort();
        found.sort();
        assert!(expected.len() > 20, "t-{i}: {}", expected.len());
        assert_eq!(found, expected, "t-{i}");
    }
}

async fn stop(nodes: Vec<Engram>) {
    for node in nodes {
        node.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_query_answers_the_same_from_one_node_or_partitions_split_over_two_or_three() {
    let nats = TestNats::start().await;
    // Given memories and facts of twelve tasks, three teams and the org...
    let writer = nodes(&nats, &["all"]).await;
    let mut events = Vec::new();
    for n in 0..360 {
        let scope = match n % 4 {
            0 => Scope::new(ScopeKind::Team, &format!("team-{}", n % 3)).unwrap(),
            1 if n % 8 == 1 => Scope::new(ScopeKind::Org, "acme").unwrap(),
            _ => task((n / 4) % TASKS),
        };
        // Each task's memories cover every topic over time.
        let topic = TOPICS[(n + n / 4 / TASKS) % TOPICS.len()];
        events.push(if n % 9 == 0 {
            fact(
                "acme",
                scope,
                &format!("svc-{}", n % 5),
                "owner",
                &format!("team-{n}"),
            )
        } else {
            embedded(
                "acme",
                scope,
                "agent-1",
                &format!("note {n} about {topic}, take {}", n % 7),
            )
        });
    }
    let mut last = 0;
    for r in writer[0].client.append_batch(&events).await {
        last = last.max(r.unwrap().seq);
    }
    // The queries reach several partitions each, and the layouts below split them.
    let partitions = nats.bus_config().stream.partitions;
    let touched: std::collections::BTreeSet<u32> = (0..TASKS)
        .flat_map(|i| {
            let s = scopes(i);
            std::iter::once(s.scope.clone())
                .chain(s.grants)
                .map(|scope| {
                    engram_memory::ScopeKey::new(ident("acme"), scope).partition(partitions)
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        touched.iter().any(|&p| p < 8) && touched.iter().any(|&p| p >= 8),
        "{touched:?}"
    );

    // ...when one node holding every partition answers a set of queries...
    let all: Vec<usize> = (0..TASKS).collect();
    finds_all(&writer[0], &events, last).await;
    let one = answers(&writer[0], &all, last).await;
    let empty = one.iter().filter(|line| line.ends_with(": ")).count();
    assert!(
        empty * 10 < one.len(),
        "{empty} of {} found nothing",
        one.len()
    );
    stop(writer).await;
    // ...then two nodes, and three, each holding some partitions, answer them alike.
    for layout in [&["0-7", "8-15"][..], &["0-4", "5-10", "11-15"]] {
        let split = nodes(&nats, layout).await;
        for (n, node) in split.iter().enumerate() {
            finds_all(node, &events, last).await;
            let answered = answers(node, &all, last).await;
            for (a, b) in one.iter().zip(&answered) {
                assert_eq!(a, b, "layout {layout:?}, through node {n}");
            }
            assert_eq!(one.len(), answered.len());
        }
        stop(split).await;
    }

    // And with no node serving partitions 8-15, a query of a scope there is refused at
    // once, saying which partition is unserved, while one within 0-7 still answers alike.
    let half = nodes(&nats, &["0-7"]).await;
    let (inside, outside): (Vec<usize>, Vec<usize>) = (0..TASKS).partition(|&i| {
        let s = scopes(i);
        std::iter::once(s.scope.clone())
            .chain(s.grants)
            .all(|scope| {
                engram_memory::ScopeKey::new(ident("acme"), scope).partition(partitions) < 8
            })
    });
    assert!(!outside.is_empty());
    for i in outside {
        let mut request = retrieve(i, TOPICS[0], RetrievalMode::Hybrid, last);
        request.consistency.wait_ms = Some(60_000);
        let started = std::time::Instant::now();
        let err = half[0].client.retrieve(&request).await.unwrap_err();
        assert_eq!(err.code(), ErrorCode::Unavailable, "{err:?}");
        assert!(err.to_string().contains("partition"), "{err}");
        // Not a wait for the consistency deadline: nothing answers, so nothing waits.
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }
    let answered = answers(&half[0], &inside, last).await;
    let expected: Vec<&String> = one
        .iter()
        .filter(|line| inside.iter().any(|i| line.starts_with(&format!("t-{i} "))))
        .collect();
    assert_eq!(answered.iter().collect::<Vec<_>>(), expected);
    stop(half).await;
}

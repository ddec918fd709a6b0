//! Memory usage end to end, against a real nats-server: what queries return reaches the log
//! as a few aggregated `feedback {retrieved}` events (never one per query), an agent's use
//! reports are aggregated the same way, and the consolidator reinforces only what was used.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use engram_memory::proto::{
    Consistency, ConsolidateRequest, ContextRequest, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_query::QueryConfig;
use engram_schema::{
    Content, Envelope, EventId, EventKind, Ident, Layer, Retrieved, Scope, ScopeKind,
    SubjectFilter, Used,
};
use engram_sdk::StartAt;
use engram_testkit::TestNats;
use engram_tests::{Engram, embedder, embedder_model, projectors_config};
use futures::StreamExt;

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn team(id: &str) -> Scope {
    Scope::new(ScopeKind::Team, id).unwrap()
}

fn memory(scope: Scope, text: &str) -> Envelope {
    let mut e = Envelope::new(
        ident("acme"),
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

fn scopes(scope: Scope) -> ScopeRequest {
    ScopeRequest {
        tenant: ident("acme"),
        scope,
        grants: vec![],
    }
}

fn at(min_seq: u64) -> Consistency {
    Consistency {
        min_seq: Some(min_seq),
        wait_ms: Some(20_000),
    }
}

/// Every event of `scope` so far.
async fn events_of(engram: &Engram, scope: &Scope) -> Vec<Envelope> {
    let filter = SubjectFilter::all()
        .tenant(ident("acme"))
        .scope(scope.kind, scope.id.clone());
    let mut stream = engram
        .client
        .replay(&filter, StartAt::Beginning)
        .await
        .unwrap();
    let mut out = Vec::new();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("replay stalled")
    {
        out.push(item.unwrap().event);
    }
    out
}

/// Polls `check` until it returns `Some`, failing after `timeout`.
async fn wait_for<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_retrievals_reach_the_log_as_a_few_events_that_count_every_return() {
    const INTERVAL: Duration = Duration::from_millis(200);
    let nats = TestNats::start().await;
    let query = QueryConfig {
        usage_interval: INTERVAL,
        ..QueryConfig::default()
    };
    let engram = Engram::start_with(&nats, projectors_config(), query).await;
    let core = team("core");
    let lesson = memory(
        core.clone(),
        "the staging deploy waits for the migration lock",
    );
    engram.client.append(&lesson).await.unwrap();
    let last = engram
        .client
        .append(&memory(
            core.clone(),
            "the cache warms up slowly after a restart",
        ))
        .await
        .unwrap()
        .seq;

    // When 50 retrievals and 5 contexts return the lesson...
    let request = RetrieveRequest {
        scopes: scopes(core.clone()),
        query: "staging migration lock".into(),
        vector: None,
        top_k: 5,
        filter: Default::default(),
        consistency: at(last),
        mode: RetrievalMode::Keyword,
        ranking: None,
    };
    let started = Instant::now();
    let responses =
        futures::future::join_all((0..50).map(|_| engram.client.retrieve(&request))).await;
    let mut returned: BTreeMap<EventId, u32> = BTreeMap::new();
    for response in responses {
        for result in response.unwrap().results {
            *returned.entry(result.event_id).or_default() += 1;
        }
    }
    let context = ContextRequest {
        scopes: scopes(core.clone()),
        agent_id: ident("agent-1"),
        task: "deploy".into(),
        query: "staging migration lock".into(),
        vector: Some(embedder().embed_one("staging migration lock")),
        token_budget: 400,
        consistency: at(last),
    };
    for _ in 0..5 {
        for item in engram.client.build_context(&context).await.unwrap().items {
            if let Ok(id) = EventId::parse(&item.source) {
                *returned.entry(id).or_default() += 1;
            }
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(
        returned.get(&lesson.event_id),
        Some(&55),
        "every call returned the lesson"
    );

    // ...then the log gets their counts, summed exactly, in a few events written by the
    // query service, none of them a memory.
    let usage = wait_for("the retrieval counts", Duration::from_secs(30), || async {
        let usage: Vec<Envelope> = events_of(&engram, &core)
            .await
            .into_iter()
            .filter(|e| e.kind == EventKind::Feedback)
            .collect();
        let mut counted: BTreeMap<EventId, u32> = BTreeMap::new();
        for event in &usage {
            for (id, n) in Retrieved::from_event(event).unwrap().unwrap().retrieved {
                *counted.entry(id).or_default() += n;
            }
        }
        (counted == returned).then_some(usage)
    })
    .await;
    // One event per scope per flush: flushes with counts fall within the calls' time and
    // the flush after them.
    let flushes = (elapsed.as_millis() / INTERVAL.as_millis()) as usize + 2;
    eprintln!("{} usage events for 55 calls in {elapsed:?}", usage.len());
    assert!(
        usage.len() <= flushes && usage.len() < 50,
        "{} usage events for 55 calls in {elapsed:?}",
        usage.len()
    );
    for event in &usage {
        assert_eq!(
            (event.agent_id.as_str(), event.instance_id.as_str()),
            ("query", "query")
        );
        assert!(!engram_memory::is_text_memory(event));
    }
    // Nothing returned later counts twice: the counts stay exact once flushed.
    tokio::time::sleep(INTERVAL * 3).await;
    let again: usize = events_of(&engram, &core)
        .await
        .iter()
        .filter(|e| e.kind == EventKind::Feedback)
        .count();
    assert_eq!(again, usage.len());
    engram.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_use_reports_aggregate_into_one_event_per_scope_and_reinforce() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let long_ago = chrono::Utc::now() - chrono::Duration::days(120);
    // Given, in two scopes, two old memories each that decay would archive.
    let mut memories = BTreeMap::new();
    for scope in [team("core"), team("ops")] {
        for name in ["used", "unused"] {
            let mut e = memory(
                scope.clone(),
                &format!("{name} lesson of {} about the rollback script", scope.id),
            );
            e.occurred_at = long_ago;
            e.importance = 0.3;
            engram.client.append(&e).await.unwrap();
            memories.insert((scope.id.to_string(), name), e.event_id);
        }
    }
    let agent = engram.client.agent("acme", "agent-1", "i-1").unwrap();

    // When 20 steps report using one memory each, through a reporter...
    let reporter = agent.usage_reporter(Duration::from_secs(3600));
    for step in 0..20 {
        let scope = if step % 2 == 0 { "core" } else { "ops" };
        let used = &memories[&(scope.to_owned(), "used")];
        reporter.used(team(scope), &[used.clone(), used.clone()]);
    }
    let receipts = reporter.close().await.unwrap();
    // ...then one event per scope is appended, listing one use per report.
    assert_eq!(receipts.len(), 2, "{receipts:?}");
    let last = receipts.iter().map(|r| r.seq).max().unwrap();
    for scope in ["core", "ops"] {
        let reports: Vec<Used> = events_of(&engram, &team(scope))
            .await
            .iter()
            .filter_map(|e| Used::from_event(e).unwrap())
            .collect();
        let used = &memories[&(scope.to_owned(), "used")];
        assert_eq!(
            reports,
            vec![Used {
                used: vec![used.clone(); 10]
            }]
        );
    }

    // And consolidation archives each scope's unused memory, never the used one.
    for scope in ["core", "ops"] {
        let (events, receipts) = engram
            .client
            .consolidate(&ConsolidateRequest {
                scopes: scopes(team(scope)),
                steps: vec!["decay".into()],
                restore: vec![],
                apply: false,
                consistency: at(last),
            })
            .await
            .unwrap();
        assert!(receipts.iter().all(Result::is_ok));
        let archived: Vec<&str> = events
            .iter()
            .flat_map(|e| e.forgotten_ids().unwrap())
            .map(|id| memories.iter().find(|(_, v)| **v == id).unwrap().0.1)
            .collect();
        assert_eq!(archived, vec!["unused"], "{scope}");
    }

    // A reporter on a schedule flushes without being asked.
    let ticking = agent.usage_reporter(Duration::from_millis(200));
    let used = memories[&("core".to_owned(), "used")].clone();
    for _ in 0..5 {
        ticking.used(team("core"), std::slice::from_ref(&used));
    }
    let uses = wait_for("a scheduled flush", Duration::from_secs(30), || async {
        let uses: usize = events_of(&engram, &team("core"))
            .await
            .iter()
            .filter_map(|e| Used::from_event(e).unwrap())
            .map(|u| u.used.len())
            .sum();
        (uses >= 15).then_some(uses)
    })
    .await;
    assert_eq!(uses, 15);
    drop(ticking);
    engram.stop().await;
}

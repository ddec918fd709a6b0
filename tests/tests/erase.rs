//! Verified erasure end to end, on a server with authentication: one user of many is erased
//! from every place Engram keeps memory, `erasure_traces` finds nothing of them afterwards
//! (and finds the others, so the search is not blind), and nobody else lost anything.

use engram_memory::proto::{Consistency, RetrievalMode, RetrieveRequest, ScopeRequest};
use engram_schema::{Envelope, Ident, Scope};
use engram_testkit::TestNats;
use engram_tests::{Engram, embedder};

fn ident(s: &str) -> Ident {
    Ident::parse("test", s).unwrap()
}

fn user(n: usize) -> Scope {
    format!("user:u{n}").parse().unwrap()
}

/// A marker no other user's text contains (`u1~` is not in `u10~`).
fn secret(tenant: &str, n: usize) -> String {
    format!("secret~{tenant}~u{n}~")
}

fn memory(tenant: &str, scope: Scope, text: &str) -> Envelope {
    engram_tests::embedded(tenant, scope, "assistant", text)
}

fn retrieve(tenant: &str, scope: Scope, query: &str, min_seq: u64) -> RetrieveRequest {
    RetrieveRequest {
        scopes: ScopeRequest {
            tenant: ident(tenant),
            scope,
            grants: vec![],
        },
        query: query.to_owned(),
        vector: Some(embedder().embed_one(query)),
        top_k: 50,
        filter: Default::default(),
        consistency: Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(10_000),
        },
        mode: RetrievalMode::Keyword,
        ranking: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn erasing_one_user_of_many_leaves_no_trace_of_them_and_touches_nobody_else() {
    const USERS: usize = 12;
    let nats = TestNats::start_secured().await;
    let engram = Engram::start_secured(&nats).await;
    let admin = &engram.client;
    let snapshots = engram_snapshots::SnapshotsConfig::default();
    // Every user of two tenants (prefix-colliding names, the same user ids) holds memories,
    // a fact, a document and working memory, each marked with the user's secret.
    let mut last = 0;
    let scope_req = ScopeRequest {
        tenant: ident("acme"),
        scope: user(0),
        grants: vec![],
    };
    for tenant in ["acme", "acme2"] {
        if tenant == "acme2" {
            // A labelled snapshot of acme, older than the erasure: it holds the user too.
            admin
                .snapshot(&scope_req, Some("before-erasure"))
                .await
                .unwrap();
        }
        for n in 0..USERS {
            let mark = secret(tenant, n);
            for i in 0..3 {
                admin
                    .append(&memory(
                        tenant,
                        user(n),
                        &format!("{mark} note {i} about billing"),
                    ))
                    .await
                    .unwrap();
            }
            admin
                .append(&engram_tests::fact(
                    tenant,
                    user(n),
                    "billing",
                    "card",
                    &mark,
                ))
                .await
                .unwrap();
            last = engram_tests::board_with_item(admin, tenant, user(n), "todo", &mark).await;
            admin
                .bus()
                .working_memory()
                .await
                .unwrap()
                .put(
                    &ident(tenant),
                    &user(n),
                    "plan",
                    mark.clone().into_bytes().into(),
                    None,
                )
                .await
                .unwrap();
        }
    }
    // A poison event in the erased user's scope: every projector keeps a dead-letter copy.
    let js = async_nats::jetstream::new(admin.bus().client().clone());
    js.publish(
        "engram.evt.acme.user.u3.episodic".to_owned(),
        format!("not an event {}", secret("acme", 3))
            .into_bytes()
            .into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    engram_testkit::wait_dead_lettered(&nats.admin, &["vector", "keyword", "facts", "skills"], 1)
        .await;
    // And the newest snapshots, cut now, hold the user as well.
    admin.snapshot(&scope_req, None).await.unwrap();

    let erased = [user(3)];
    let before = admin
        .erasure_traces(&ident("acme"), &erased, &snapshots)
        .await
        .unwrap();
    let places: Vec<&str> = before.iter().map(|t| t.place.as_str()).collect();
    for place in [
        "stream",
        "dead letters",
        "working memory",
        "read model keyword",
        "read model facts",
        "read model docs",
    ] {
        assert!(
            places.contains(&place),
            "no trace in {place} before the erasure: {before:#?}"
        );
    }
    assert!(
        places.iter().any(|p| p.starts_with("snapshot facts-p")),
        "{before:#?}"
    );

    // When user u3 of acme is erased
    let started = std::time::Instant::now();
    let report = admin
        .erase(&ident("acme"), &erased, &snapshots, "test")
        .await
        .unwrap();
    println!(
        "erasure of {} events took {} ms",
        report.events_purged,
        started.elapsed().as_millis()
    );
    assert!(report.incomplete.is_empty(), "{report:#?}");
    assert!(
        report.events_purged >= 6,
        "three notes, a fact, a doc change, the poison: {report:#?}"
    );
    assert!(report.dead_letters_erased >= 4, "{report:#?}");
    assert!(report.snapshots_deleted >= 6, "{report:#?}");

    // Then nothing of them is found anywhere...
    let after = admin
        .erasure_traces(&ident("acme"), &erased, &snapshots)
        .await
        .unwrap();
    assert!(after.is_empty(), "traces left: {after:#?}");
    let (_, holding) = engram_testkit::events_holding(admin.bus(), &secret("acme", 3)).await;
    assert!(
        holding.is_empty(),
        "events still hold the secret: {holding:?}"
    );
    let dead = admin.bus().dead_letters(None, 1000).await.unwrap();
    assert!(
        dead.letters
            .iter()
            .all(|l| !String::from_utf8_lossy(&l.payload).contains(&secret("acme", 3))),
        "a dead letter still holds the secret"
    );
    let found = admin
        .retrieve(&retrieve("acme", user(3), "billing note", last))
        .await
        .unwrap();
    assert!(found.results.is_empty(), "{found:?}");
    // ...while every other user, and the same user id of the other tenant, keeps everything.
    for (tenant, n) in (0..USERS)
        .filter(|n| *n != 3)
        .map(|n| ("acme", n))
        .chain([("acme2", 3)])
    {
        let found = admin
            .retrieve(&retrieve(tenant, user(n), "billing note", last))
            .await
            .unwrap();
        assert_eq!(found.results.len(), 3, "{tenant} u{n}: {found:?}");
        assert!(
            found
                .results
                .iter()
                .all(|r| r.text.contains(&secret(tenant, n)))
        );
        let traces = admin
            .erasure_traces(&ident(tenant), &[user(n)], &snapshots)
            .await
            .unwrap();
        assert!(
            traces.iter().any(|t| t.place == "stream" && t.count >= 5),
            "{tenant} u{n}: {traces:#?}"
        );
    }
    // The audit trail names the erasure, finished.
    let registry = nats.log.load().await.unwrap();
    let done = registry.erasures.last().expect("an erasure record");
    assert!(
        done.finished_at.is_some() && done.scopes == erased,
        "{done:?}"
    );
}

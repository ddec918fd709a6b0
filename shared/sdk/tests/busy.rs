//! A query answered `busy`, against a real nats-server and a responder whose one in-flight
//! slot a held request fills: the SDK asks again by default, and hands the refusal to a
//! caller whose policy says not to (`RetryPolicy::retry_busy`), which is how the load test
//! times and counts refusals itself.

use std::time::Duration;

use engram_memory::proto::{
    self, Consistency, ErrorCode, RetrievalMode, RetrieveRequest, RetrieveResponse, ScopeRequest,
};
use engram_rpc::EndpointLimits;
use engram_schema::{Ident, Scope, ScopeKind};
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::TestNats;

fn request() -> RetrieveRequest {
    RetrieveRequest {
        scopes: ScopeRequest {
            tenant: Ident::parse("tenant", "acme").unwrap(),
            scope: Scope::new(ScopeKind::Task, "t1").unwrap(),
            grants: vec![],
        },
        query: "anything".into(),
        vector: None,
        top_k: 5,
        filter: Default::default(),
        consistency: Consistency::default(),
        mode: RetrievalMode::Keyword,
        ranking: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_query_is_asked_again_unless_the_policy_says_not_to() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let service = engram_rpc::start_service(bus.client(), "busy-test", "one slot")
        .await
        .unwrap();
    // The handler holds its request until released, and says when it has one.
    let (entered, mut has_one) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (release, released) = tokio::sync::watch::channel(false);
    let limits = EndpointLimits {
        max_in_flight: 1,
        ..EndpointLimits::default()
    };
    engram_rpc::serve(
        &service,
        proto::RETRIEVE,
        "retrieve",
        limits,
        move |_: RetrieveRequest| {
            let (entered, mut released) = (entered.clone(), released.clone());
            async move {
                let _ = entered.send(());
                let _ = released.wait_for(|r| *r).await;
                Ok(RetrieveResponse {
                    results: vec![],
                    summaries: vec![],
                    visible: vec![],
                })
            }
        },
    )
    .await
    .unwrap();
    let patient = Client::from_bus(bus.clone(), RetryPolicy::default());
    // Ten minutes to retry in: had it retried busy, the minute's wait below would run out.
    let refusing = Client::from_bus(
        bus.clone(),
        RetryPolicy {
            retry_busy: false,
            max_elapsed: Duration::from_secs(600),
            ..RetryPolicy::default()
        },
    );

    // Given the only slot held
    let holder = tokio::spawn({
        let patient = patient.clone();
        async move { patient.retrieve(&request()).await }
    });
    tokio::time::timeout(Duration::from_secs(30), has_one.recv())
        .await
        .expect("the first request reaches the handler")
        .unwrap();

    // A caller that does not retry busy gets the refusal itself, typed and retryable
    let refused = tokio::time::timeout(Duration::from_secs(60), refusing.retrieve(&request()))
        .await
        .expect("refused, not retried")
        .expect_err("the slot is held");
    assert_eq!(refused.code(), ErrorCode::Busy, "{refused:?}");
    assert!(refused.is_retryable(), "{refused:?}");

    // while the default policy asks again until the slot is free, and is answered
    let waiting = tokio::spawn({
        let patient = patient.clone();
        async move { patient.retrieve(&request()).await }
    });
    // (the slot is still held, so its first tries are refused, however fast they come)
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "answered while the slot was held");
    release.send(true).unwrap();
    holder
        .await
        .unwrap()
        .expect("the holder is answered once released");
    tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the retried request is answered")
        .unwrap()
        .expect("answered, not refused");
}

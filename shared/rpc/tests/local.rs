//! In-process routes against a real nats-server: an endpoint served with [`Routes`] answers
//! callers in the process without NATS, under the same in-flight bound, and stops answering
//! either way when its token is cancelled.

use std::time::Duration;

use engram_memory::proto::ErrorCode;
use engram_rpc::{EndpointLimits, Failure, LocalRoutes, Routes};
use engram_testkit::TestNats;
use tokio_util::sync::CancellationToken;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Ask(u32);

#[tokio::test]
async fn a_routed_endpoint_answers_in_process_within_its_bounds_until_stopped() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let client = bus.client().clone();
    let service = engram_rpc::start_service(&client, "local-test", "test")
        .await
        .unwrap();
    let (local, stop) = (LocalRoutes::default(), CancellationToken::new());
    let routes = Routes::new(local.clone(), stop.clone());
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let held = gate.clone();
    let limits = EndpointLimits {
        max_in_flight: 1,
        max_duration: Duration::from_secs(30),
    };
    engram_rpc::serve_with(
        &service,
        &routes,
        "test.double",
        "double",
        limits,
        move |a: Ask| {
            let held = held.clone();
            async move {
                // Ask(0) holds its slot until the test lets it go.
                if a.0 == 0 {
                    let _ = held.acquire().await;
                }
                Ok::<_, Failure>(a.0 * 2)
            }
        },
    )
    .await
    .unwrap();
    client.flush().await.unwrap();

    // In process, the handler's own answer, and the same over NATS.
    let route = local.route("test.double").expect("served here");
    let doubled: u32 = route.call(Ask(21), Duration::from_secs(5)).await.unwrap();
    assert_eq!(doubled, 42);
    let over_nats: u32 = engram_rpc::call(&client, "test.double", &Ask(4), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(over_nats, 8);

    // A request of another type is a typed internal failure, not a panic.
    let wrong = local
        .route("test.double")
        .unwrap()
        .call::<String, u32>("x".into(), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(wrong.code, ErrorCode::Internal);

    // One slot: while a held request has it, an in-process call is busy, as a NATS one is.
    let holding = tokio::spawn(
        local
            .route("test.double")
            .unwrap()
            .call::<Ask, u32>(Ask(0), Duration::from_secs(30)),
    );
    engram_testkit::wait_until(
        "the held request to take the slot",
        Duration::from_secs(10),
        || {
            let busy = local
                .route("test.double")
                .unwrap()
                .call::<Ask, u32>(Ask(1), Duration::from_secs(1));
            async move { matches!(busy.await, Err(f) if f.code == ErrorCode::Busy) }
        },
    )
    .await;
    let busy = engram_rpc::call::<_, u32>(&client, "test.double", &Ask(1), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(busy.code(), ErrorCode::Busy);
    gate.add_permits(1);
    assert_eq!(holding.await.unwrap().unwrap(), 0);

    // Stopped: gone from the table and from the server.
    stop.cancel();
    engram_testkit::wait_until("the route to be removed", Duration::from_secs(10), || {
        let gone = local.route("test.double").is_none();
        async move { gone }
    })
    .await;
    let gone = engram_rpc::call::<_, u32>(&client, "test.double", &Ask(1), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(
        matches!(gone, engram_rpc::RpcError::NoResponders { .. }),
        "{gone:?}"
    );
}

//! [`engram_rpc::settle`] against a real nats-server: once it returns, a request from a
//! third connection finds every endpoint the responder subscribed before the call. A flush
//! alone left a window in which such a request found no responders.

use std::time::Duration;

use engram_rpc::EndpointLimits;
use engram_testkit::TestNats;

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Ask(u32);

#[tokio::test]
async fn endpoints_answer_every_connection_once_settled() {
    let nats = TestNats::start().await;
    let (responder, witness, caller) = (nats.bus().await, nats.bus().await, nats.bus().await);
    let service = engram_rpc::start_service(responder.client(), "settle-test", "test")
        .await
        .unwrap();
    let limits = EndpointLimits {
        max_in_flight: 4,
        max_duration: Duration::from_secs(30),
    };
    // Many rounds: the window a flush left open was hit about one start in five.
    for round in 0..100u32 {
        let subject = format!("test.settle.{round}");
        engram_rpc::serve(&service, &subject, "settle", limits, |a: Ask| async move {
            Ok(a.0 + 1)
        })
        .await
        .unwrap();
        engram_rpc::settle(
            responder.client(),
            witness.client(),
            engram_rpc::SETTLE_WITHIN,
        )
        .await
        .unwrap();
        let answer: u32 = engram_rpc::call(
            caller.client(),
            &subject,
            &Ask(round),
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(answer, round + 1);
    }
}

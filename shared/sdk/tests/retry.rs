//! The SDK's append promise against a real nats-server: an append whose acknowledgement never
//! comes is retried with the same event id, returns no error once the server answers, and is
//! stored once. The server is frozen with SIGSTOP while the appends are in flight, so the
//! first attempts' acks cannot come back however fast the machine is; SIGCONT lets it read
//! every attempt, store the first and deduplicate the rest.
//!
//! One test in this binary: it watches the process-wide append error counter.

use std::collections::HashMap;
use std::time::Duration;

use engram_sdk::{AppendError, Client, RetryPolicy, StartAt, SubjectFilter};
use engram_telemetry::metrics::APPEND_ERRORS;
use engram_testkit::{TestNats, event, wait_until};
use futures::StreamExt;

fn signal(nats: &TestNats, signal: libc::c_int) {
    let pid = nats.server.pid().expect("the server runs");
    // SAFETY: kill(2) on our own child's pid, which is not yet reaped.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
}

fn unacknowledged() -> u64 {
    APPEND_ERRORS.with_label_values(&["unavailable"]).get()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_whose_acks_are_lost_are_retried_by_id_without_error_and_stored_once() {
    let nats = TestNats::start().await;
    // Acks time out after the bus default (5 s); retries go on for a minute.
    let retrying = Client::with_config(
        nats.bus_config(),
        RetryPolicy {
            max_elapsed: Duration::from_secs(60),
            ..RetryPolicy::default()
        },
        true,
    )
    .await
    .unwrap();
    let single = event("acme", "t1", "the one append");
    let batch: Vec<_> = (0..5)
        .map(|i| event("acme", "t1", &format!("batch append {i}")))
        .collect();

    // Given a server that reads nothing while the appends are sent
    let errors_before = unacknowledged();
    signal(&nats, libc::SIGSTOP);
    let one = tokio::spawn({
        let (client, single) = (retrying.clone(), single.clone());
        async move { client.append(&single).await }
    });
    let many = tokio::spawn({
        let (client, batch) = (retrying.clone(), batch.clone());
        async move { client.append_batch(&batch).await }
    });
    // When their first attempts go unacknowledged (one for the single append, five for the
    // batch), and only then the server wakes up
    wait_until(
        "the first attempts to time out",
        Duration::from_secs(60),
        || async move { unacknowledged() >= errors_before + 6 },
    )
    .await;
    signal(&nats, libc::SIGCONT);

    // Then every append returns a receipt, not an error
    let receipt = one.await.unwrap().expect("the retried append succeeds");
    let receipts: Vec<_> = many
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.expect("every retried batch append succeeds"))
        .collect();
    assert_eq!(receipt.event_id, single.event_id.as_str());
    // And the stream holds each event once, at the sequence its receipt names
    let bus = nats.bus().await;
    let mut stored: HashMap<String, Vec<u64>> = HashMap::new();
    let mut replay = bus
        .replay(&SubjectFilter::all(), StartAt::Beginning)
        .await
        .unwrap();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(10), replay.next())
        .await
        .expect("replay stalled")
    {
        let item = item.unwrap();
        stored
            .entry(item.event.event_id.to_string())
            .or_default()
            .push(item.seq);
    }
    assert_eq!(stored.len(), 6, "{stored:?}");
    for r in std::iter::once(&receipt).chain(&receipts) {
        assert_eq!(stored[&r.event_id], [r.seq], "{}", r.event_id);
    }
    // The attempt that succeeded was a retry, which the stream recognised
    assert!(receipt.duplicate, "{receipt:?}");

    // While a client that does not retry gets the outage as a typed, retryable error
    let once = Client::with_config(nats.bus_config(), RetryPolicy::none(), false)
        .await
        .unwrap();
    signal(&nats, libc::SIGSTOP);
    let refused = once.append(&event("acme", "t1", "not retried")).await;
    signal(&nats, libc::SIGCONT);
    match refused {
        Err(e @ AppendError::Unavailable(_)) => {
            assert!(e.is_retryable());
            assert!(e.to_string().contains("safe to retry"), "{e}");
        }
        other => panic!("expected an unacknowledged append, got {other:?}"),
    }
}

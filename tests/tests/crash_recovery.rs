//! `kill -9` the nats-server mid-append and restart it on the same store: no acked event is
//! lost, every append is either acked or surfaced as an error, never silently dropped, and
//! writers that retry ride the outage out without a single error or a duplicate.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use engram_bus::StartAt;
use engram_schema::SubjectFilter;
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::{TestNats, event, ident};
use futures::StreamExt;
use tokio::sync::Mutex;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acked_event_is_lost_when_the_server_is_killed_mid_append() {
    const WRITERS: usize = 8;
    let mut nats = TestNats::start().await;
    nats.bus().await;

    #[derive(Default)]
    struct Ledger {
        acked: HashSet<String>,
        failed: HashSet<String>,
        /// Failures seen by writers that retry: must stay empty.
        failed_retrying: Vec<String>,
        attempted: usize,
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let mut writers = Vec::new();
    for w in 0..WRITERS {
        // Odd writers never retry, so the outage (longer than the 2 s ack timeout) must
        // surface as errors for them; even writers retry through it.
        let retrying = w % 2 == 0;
        let retry = if retrying {
            RetryPolicy {
                max_elapsed: Duration::from_secs(20),
                ..RetryPolicy::default()
            }
        } else {
            RetryPolicy::none()
        };
        let client = Client::with_config(nats.bus_config(), retry, false)
            .await
            .unwrap();
        let ledger = ledger.clone();
        let stopping = stopping.clone();
        writers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stopping.load(std::sync::atomic::Ordering::Relaxed) {
                let mut e = event("acme", &format!("w{w}"), &format!("writer {w} event {i}"));
                e.instance_id = ident(&format!("w{w}"));
                let id = e.event_id.to_string();
                ledger.lock().await.attempted += 1;
                match client.append(&e).await {
                    Ok(_) => ledger.lock().await.acked.insert(id),
                    Err(err) => {
                        assert!(
                            err.is_retryable(),
                            "only availability errors expected: {err}"
                        );
                        let mut ledger = ledger.lock().await;
                        if retrying {
                            ledger.failed_retrying.push(format!("{id}: {err}"));
                        }
                        ledger.failed.insert(id)
                    }
                };
                i += 1;
            }
        }));
    }

    // Let writes flow, crash the server mid-stream, keep it down a moment, bring it back.
    engram_testkit::wait_until("some acks", Duration::from_secs(20), || {
        let ledger = ledger.clone();
        async move { ledger.lock().await.acked.len() > 500 }
    })
    .await;
    let acked_before_crash = ledger.lock().await.acked.len();
    nats.kill().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    nats.restart().await;
    engram_testkit::wait_until("acks after restart", Duration::from_secs(30), || {
        let ledger = ledger.clone();
        async move { ledger.lock().await.acked.len() > acked_before_crash + 500 }
    })
    .await;
    stopping.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }

    let ledger = ledger.lock().await;
    assert_eq!(
        ledger.acked.len() + ledger.failed.len(),
        ledger.attempted,
        "every append was either acked or surfaced as an error"
    );

    assert!(
        !ledger.failed.is_empty(),
        "writers without retries saw the outage"
    );
    // The SDK's promise: an append it retries (same event id) through the outage returns no
    // error, and is stored once (checked below for every event).
    assert!(
        ledger.failed_retrying.is_empty(),
        "writers that retry saw {} errors, e.g. {:?}",
        ledger.failed_retrying.len(),
        ledger.failed_retrying.first()
    );

    let bus = nats.bus().await;
    let mut replay = bus
        .replay(&SubjectFilter::all(), StartAt::Beginning)
        .await
        .unwrap();
    let mut stored = Vec::new();
    while let Some(item) = tokio::time::timeout(Duration::from_secs(10), replay.next())
        .await
        .expect("replay stalled")
    {
        stored.push(item.unwrap().event.event_id.to_string());
    }
    let stored_set: HashSet<_> = stored.iter().cloned().collect();
    assert_eq!(stored.len(), stored_set.len(), "no event is stored twice");
    let lost: Vec<_> = ledger.acked.difference(&stored_set).collect();
    assert!(
        lost.is_empty(),
        "{} acked events lost, e.g. {:?}",
        lost.len(),
        lost.first()
    );
    // Stored but not acked is allowed only for appends that were reported as failed.
    let unaccounted: Vec<_> = stored_set
        .iter()
        .filter(|id| !ledger.acked.contains(*id) && !ledger.failed.contains(*id))
        .collect();
    assert!(
        unaccounted.is_empty(),
        "stored events nobody appended: {unaccounted:?}"
    );
    eprintln!(
        "crash test: attempted {}, acked {}, surfaced as errors {}, stored {}",
        ledger.attempted,
        ledger.acked.len(),
        ledger.failed.len(),
        stored.len()
    );
}

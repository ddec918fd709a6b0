//! `kill -9` the nats-server mid-append and restart it on the same store: no acked event is
//! lost, every append is either acked or surfaced as an error, never silently dropped, and
//! writers that retry ride the outage out without a single error or a duplicate.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use engram_bus::{BusConfig, StartAt};
use engram_schema::SubjectFilter;
use engram_sdk::{Client, RetryPolicy};
use engram_testkit::{TestNats, event, ident};
use futures::StreamExt;
use tokio::sync::Mutex;

/// Each writer's schedule: this many appends before the restart, then this many after it.
const BEFORE: usize = 60;
const AFTER: usize = 60;
const WRITERS: usize = 8;
/// The server is killed once this many appends have returned: a sixth of those scheduled
/// before the restart, so the writers are still mid-schedule when it dies.
const KILL_AT: usize = WRITERS * BEFORE / 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acked_event_is_lost_when_the_server_is_killed_mid_append() {
    let mut nats = TestNats::start().await;
    nats.bus().await;
    // Short, so the outage outlasts it: the append in flight when the server dies can never
    // be acked, and the next ones time out while it is down. Slow fsyncs that outlast it
    // on a busy machine are surfaced or retried like the outage, which the ledger allows.
    let config = BusConfig {
        ack_timeout: Duration::from_secs(2),
        ..nats.bus_config()
    };
    let outage = config.ack_timeout + Duration::from_secs(1);

    #[derive(Default)]
    struct Ledger {
        acked: HashSet<String>,
        failed: HashSet<String>,
        /// Failures seen by writers that retry: must stay empty.
        failed_retrying: Vec<String>,
        /// Appends that did not return within their bound: must stay empty.
        hung: Vec<String>,
        attempted: usize,
        /// Appends that have returned, acked or not: what the kill waits for.
        returned: usize,
        /// Acks per writer of appends started after the restart.
        acked_after_restart: [usize; WRITERS],
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    // Set once the server is back: each writer waits for it between its two halves.
    let (restarted_tx, restarted) = tokio::sync::watch::channel(false);

    let mut writers = Vec::new();
    for w in 0..WRITERS {
        // Odd writers never retry, so the outage must surface as errors for them; even
        // writers retry through it.
        let retrying = w % 2 == 0;
        let retry = if retrying {
            RetryPolicy {
                max_elapsed: Duration::from_secs(20),
                ..RetryPolicy::default()
            }
        } else {
            RetryPolicy::none()
        };
        // The SDK's promise: an append returns within its retry budget plus the one attempt
        // it started last (an ack timeout). The rest is room for a busy machine.
        let bound = retry.max_elapsed + config.ack_timeout + Duration::from_secs(10);
        let client = Client::with_config(config.clone(), retry, false)
            .await
            .unwrap();
        let ledger = ledger.clone();
        let mut restarted = restarted.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..BEFORE + AFTER {
                if i == BEFORE {
                    restarted.wait_for(|r| *r).await.unwrap();
                }
                let mut e = event("acme", &format!("w{w}"), &format!("writer {w} event {i}"));
                e.instance_id = ident(&format!("w{w}"));
                let id = e.event_id.to_string();
                ledger.lock().await.attempted += 1;
                let started = tokio::time::Instant::now();
                let result = tokio::time::timeout(bound, client.append(&e)).await;
                let mut book = ledger.lock().await;
                book.returned += 1;
                match result {
                    Ok(Ok(_)) => {
                        book.acked.insert(id);
                        if i >= BEFORE {
                            book.acked_after_restart[w] += 1;
                        }
                    }
                    Ok(Err(err)) => {
                        assert!(
                            err.is_retryable(),
                            "only availability errors expected: {err}"
                        );
                        if retrying {
                            book.failed_retrying.push(format!("{id}: {err}"));
                        }
                        book.failed.insert(id);
                    }
                    Err(_) => book.hung.push(format!(
                        "{id}: still unanswered after {:?}",
                        started.elapsed()
                    )),
                }
            }
        }));
    }

    // Let writes flow, crash the server mid-stream, keep it down a moment, bring it back.
    // The kill waits for a count of returned appends, however long the machine takes: every
    // append returns within its bound, and a writer that stops early fails the test here.
    loop {
        if ledger.lock().await.returned >= KILL_AT {
            break;
        }
        if let Some(done) = writers.iter().position(|w| w.is_finished()) {
            panic!("writer {done} ended before the server was killed");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    nats.kill().await;
    tokio::time::sleep(outage).await;
    nats.restart().await;
    restarted_tx.send(true).unwrap();
    for w in writers {
        w.await.unwrap();
    }

    let ledger = ledger.lock().await;
    assert!(
        ledger.hung.is_empty(),
        "{} appends hung past their retry budget, e.g. {:?}",
        ledger.hung.len(),
        ledger.hung.first()
    );
    assert_eq!(ledger.attempted, WRITERS * (BEFORE + AFTER));
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
    // Every writer is acked again once the server is back, those that do not retry too.
    assert!(
        ledger.acked_after_restart.iter().all(|&n| n > 0),
        "acks per writer after the restart: {:?}",
        ledger.acked_after_restart
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
        "crash test: attempted {}, acked {}, surfaced as errors {}, stored {}; acked per writer after the restart {:?}",
        ledger.attempted,
        ledger.acked.len(),
        ledger.failed.len(),
        stored.len(),
        ledger.acked_after_restart
    );
}

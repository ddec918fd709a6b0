//! The projector loop against a real nats-server: ordered application, checkpoint and resume,
//! poison messages, read-your-writes waits, rebuild-equals-incremental and the apply ledger.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use engram_bus::Bus;
use engram_bus::StoredEvent;
use engram_memory::Seq;
use engram_projection_runtime::model::{SnapshotModel, SnapshotProjection};
use engram_projection_runtime::{
    ApplyLedger, Projection, ProjectionError, Projector, ProjectorSettings, Rejected, ledger_entry,
};
use engram_schema::Envelope;
use engram_testkit::{TestNats, event, wait_until};
use serde::{Deserialize, Serialize};

/// Remembers every applied event by seq, and refuses events tagged `poison`.
#[derive(Default, Serialize, Deserialize)]
struct Ledger {
    applied: BTreeMap<Seq, String>,
    /// Times each event id was applied: must end at 1 for all.
    times: BTreeMap<String, u32>,
}

impl SnapshotModel for Ledger {
    fn apply_event(&mut self, seq: Seq, event: &Envelope) -> Result<(), String> {
        if event.tags.iter().any(|t| t == "poison") {
            return Err("tagged poison".into());
        }
        self.applied.insert(seq, event.content.text.clone());
        *self.times.entry(event.event_id.to_string()).or_default() += 1;
        Ok(())
    }

    fn hash(&self) -> [u8; 32] {
        let bytes = rmp_serde::to_vec(&self.applied).unwrap();
        *blake3::hash(&bytes).as_bytes()
    }
}

/// The ledger model, except that a batch holding the event with text `hold` waits in `apply`
/// until `gate` opens (or its sender is dropped): a projector held mid-stream for as long as
/// a test needs, however fast the machine.
struct Gated {
    inner: SnapshotProjection<Ledger>,
    hold: &'static str,
    gate: tokio::sync::watch::Receiver<bool>,
    /// Set once a batch is held.
    held: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl Projection for Gated {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn state_dir(&self) -> Option<&std::path::Path> {
        self.inner.state_dir()
    }

    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        self.inner.restore().await
    }

    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        if events.iter().any(|e| e.event.content.text == self.hold) {
            self.held.store(true, Ordering::SeqCst);
            let mut gate = self.gate.clone();
            let _ = gate.wait_for(|open| *open).await;
        }
        self.inner.apply(events).await
    }

    async fn publish(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        self.inner.publish(applied).await
    }

    async fn checkpoint(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        self.inner.checkpoint(applied).await
    }

    async fn reset(&self) -> Result<(), ProjectionError> {
        self.inner.reset().await
    }

    async fn state_hash(&self) -> [u8; 32] {
        self.inner.state_hash().await
    }
}

fn settings() -> ProjectorSettings {
    ProjectorSettings {
        batch: 64,
        checkpoint_interval: Duration::from_millis(200),
        checkpoint_every: 100,
        max_backoff: Duration::from_millis(200),
        publish_interval: Duration::ZERO,
        tail_publish_gap: Duration::ZERO,
        ..ProjectorSettings::default()
    }
}

struct Running {
    projection: Arc<SnapshotProjection<Ledger>>,
    visibility: engram_projection_runtime::Visibility,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Result<(), engram_projection_runtime::ProjectorError>>,
}

async fn start(bus: &Bus, dir: &std::path::Path) -> Running {
    start_named(bus, dir, "ledger").await
}

/// [`start`] under the projector name `name`: metrics are process-wide and labelled by
/// projector name, so a test that reads one runs under a name no other test uses.
async fn start_named(bus: &Bus, dir: &std::path::Path, name: &'static str) -> Running {
    let projection = Arc::new(SnapshotProjection::<Ledger>::new(name, dir));
    let projector = Projector::new(projection.clone(), bus.clone(), settings());
    let visibility = projector.visibility();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(projector.run(stop.clone()));
    Running {
        projection,
        visibility,
        stop,
        task,
    }
}

async fn append_n(bus: &Bus, n: usize, prefix: &str) -> Seq {
    let events: Vec<Envelope> = (0..n)
        .map(|i| event("acme", "t1", &format!("{prefix} {i}")))
        .collect();
    let receipts = bus.append_batch(&events, 64).await;
    receipts.into_iter().map(|r| r.unwrap().seq).max().unwrap()
}

#[tokio::test]
async fn applies_in_order_resumes_from_checkpoint_and_waits_for_tokens() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();

    let running = start(&bus, dir.path()).await;
    let last = append_n(&bus, 300, "first").await;
    running
        .visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .expect("all 300 visible");
    assert_eq!(running.projection.read().applied.len(), 300);
    let seqs: Vec<Seq> = running.projection.read().applied.keys().copied().collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));

    // A token beyond anything stored times out with a typed error instead of answering.
    let err = running
        .visibility
        .wait_for(last + 1, Duration::from_millis(100))
        .await
        .unwrap_err();
    assert_eq!((err.wanted, err.visible), (last + 1, last));

    running.stop.cancel();
    running.task.await.unwrap().unwrap();

    // Written while the projector is down; a restart resumes from its checkpoint.
    let last = append_n(&bus, 50, "second").await;
    let running = start(&bus, dir.path()).await;
    running
        .visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .unwrap();
    let ledger = running.projection.read();
    assert_eq!(ledger.applied.len(), 350);
    assert!(
        ledger.times.values().all(|&n| n == 1),
        "an event applied twice"
    );
}

#[tokio::test]
async fn poison_messages_are_dead_lettered_and_skipped() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    // Its own name: the dead-letter metric counts this test's letters and no other's.
    const NAME: &str = "poisoned";
    let running = start_named(&bus, dir.path(), NAME).await;

    // Bytes that are no event at all, straight onto an event subject.
    bus.jetstream()
        .publish("engram.evt.acme.task.t1.episodic", "not msgpack".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // A valid envelope the model refuses.
    let mut refused = event("acme", "t1", "refused");
    refused.tags.push("poison".into());
    bus.append(&refused, Default::default()).await.unwrap();
    let last = append_n(&bus, 10, "after").await;

    running
        .visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .expect("the projector went past both poison messages");
    assert_eq!(running.projection.read().applied.len(), 10);
    wait_until("two dead letters", Duration::from_secs(5), || async {
        bus.dead_letter_count(NAME).await.unwrap_or(0) == 2
    })
    .await;
    // Counted once each, after the dead-letter stream took it.
    let dead = || {
        engram_telemetry::metrics::PROJECTOR_DEAD_LETTERED
            .with_label_values(&[NAME])
            .get()
    };
    wait_until(
        "the metric to count two",
        Duration::from_secs(5),
        || async { dead() >= 2 },
    )
    .await;
    assert_eq!(dead(), 2, "the dead-letter metric counted other letters");
}

#[tokio::test]
async fn rebuild_gives_the_same_state_as_incremental_application() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&bus, dir.path()).await;
    append_n(&bus, 120, "a").await;
    let last = append_n(&bus, 80, "b").await;
    running
        .visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .unwrap();
    let incremental = running.projection.state_hash().await;
    running.stop.cancel();
    running.task.await.unwrap().unwrap();

    let projection = Arc::new(SnapshotProjection::<Ledger>::new("ledger", dir.path()));
    let projector = Projector::new(projection.clone(), bus.clone(), settings());
    let mut calls = 0;
    let applied = projector.rebuild(|_, _| calls += 1).await.unwrap();
    assert_eq!(applied.seq, last);
    assert!(calls > 0, "progress was reported");
    assert_eq!(projection.state_hash().await, incremental);
    assert_eq!(projection.read().applied.len(), 200);
}

/// A ledger that counts publishes and checks that a checkpoint never holds more than was
/// published.
struct Counting {
    inner: SnapshotProjection<Ledger>,
    publishes: AtomicU64,
    published: AtomicU64,
    checkpointed_beyond_published: AtomicU64,
}

impl Counting {
    fn new(name: &'static str, dir: &std::path::Path) -> Self {
        Self {
            inner: SnapshotProjection::<Ledger>::new(name, dir),
            publishes: AtomicU64::new(0),
            published: AtomicU64::new(0),
            checkpointed_beyond_published: AtomicU64::new(0),
        }
    }
}

#[async_trait::async_trait]
impl Projection for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        self.inner.restore().await
    }
    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        self.inner.apply(events).await
    }
    async fn publish(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        self.publishes.fetch_add(1, Ordering::SeqCst);
        self.published.store(applied.seq, Ordering::SeqCst);
        Ok(())
    }
    async fn checkpoint(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        if applied.seq > self.published.load(Ordering::SeqCst) {
            self.checkpointed_beyond_published
                .fetch_add(1, Ordering::SeqCst);
        }
        self.inner.checkpoint(applied).await
    }
    async fn reset(&self) -> Result<(), ProjectionError> {
        self.inner.reset().await
    }
    async fn state_hash(&self) -> [u8; 32] {
        self.inner.state_hash().await
    }
}

#[tokio::test]
async fn a_backlog_is_published_at_the_interval_and_at_the_tail_not_every_batch() {
    // Given 3,000 events already in the stream (47 batches of 64)
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let last = append_n(&bus, 3_000, "backlog").await;

    // When a projector with a long publish interval works through them
    let projection = Arc::new(Counting::new("counting", dir.path()));
    let projector = Projector::new(
        projection.clone(),
        bus.clone(),
        ProjectorSettings {
            publish_interval: Duration::from_secs(3_600),
            checkpoint_interval: Duration::from_secs(3_600),
            checkpoint_every: 1_000_000,
            ..settings()
        },
    );
    let visibility = projector.visibility();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(projector.run(stop.clone()));

    // Then the tail becomes visible, and the backlog cost no publish of its own
    visibility
        .wait_for(last, Duration::from_secs(20))
        .await
        .expect("the tail is published once reached");
    let publishes = projection.publishes.load(Ordering::SeqCst);
    let batches = 3_000 / 64;
    assert!(
        publishes <= 2,
        "{publishes} publishes for {batches} batches"
    );

    // And a new event at the tail is published at once, without waiting for the interval
    let more = append_n(&bus, 1, "tail").await;
    visibility
        .wait_for(more, Duration::from_secs(5))
        .await
        .expect("an event at the tail is visible without waiting an hour");
    stop.cancel();
    task.await.unwrap().unwrap();
    // The final checkpoint held nothing unpublished.
    assert_eq!(
        projection
            .checkpointed_beyond_published
            .load(Ordering::SeqCst),
        0
    );
}

/// Appends `events` and notes each (seq, event id) in `applied`.
async fn append_noted(bus: &Bus, events: &[Envelope], applied: &mut Vec<(Seq, String)>) -> Seq {
    let receipts = bus.append_batch(events, 64).await;
    let mut last = 0;
    for (event, receipt) in events.iter().zip(receipts) {
        last = receipt.unwrap().seq;
        applied.push((last, event.event_id.to_string()));
    }
    last
}

/// The ledger of `applied` after processing up to `seq`, straight from the definition.
fn ledger_of(applied: &[(Seq, String)], seq: Seq) -> ApplyLedger {
    ApplyLedger {
        seq,
        events: applied.len() as u64,
        digest: applied.iter().fold(0u64, |sum, (seq, id)| {
            sum.wrapping_add(ledger_entry(*seq, id))
        }),
    }
}

fn good(prefix: &str, n: usize) -> Vec<Envelope> {
    (0..n)
        .map(|i| event("acme", "t1", &format!("{prefix} {i}")))
        .collect()
}

fn refused(text: &str) -> Envelope {
    let mut e = event("acme", "t1", text);
    e.tags.push("poison".into());
    e
}

#[tokio::test]
async fn the_ledger_counts_every_applied_event_once_across_restarts_and_rebuild() {
    // Given good events around an undecodable message and one the model refuses
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let mut applied = Vec::new();
    append_noted(&bus, &good("before", 40), &mut applied).await;
    bus.jetstream()
        .publish("engram.evt.acme.task.t1.episodic", "not msgpack".into())
        .await
        .unwrap()
        .await
        .unwrap();
    bus.append(&refused("refused"), Default::default())
        .await
        .unwrap();
    let last = append_noted(&bus, &good("after", 40), &mut applied).await;

    // When a projector applies them
    let running = start(&bus, dir.path()).await;
    running
        .visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .unwrap();

    // Then the ledger counts the 80 good ones, and the digest is theirs
    let ledger = running.visibility.ledger();
    assert_eq!(ledger.events, 80);
    assert_eq!(ledger, ledger_of(&applied, last));
    assert_eq!(running.visibility.current(), ledger.seq);

    // When it stops, misses events (a refused one last), restarts from its checkpoint...
    running.stop.cancel();
    running.task.await.unwrap().unwrap();
    append_noted(&bus, &good("while down", 30), &mut applied).await;
    let refused_last = bus
        .append(&refused("refused last"), Default::default())
        .await
        .unwrap()
        .seq;
    let running = start(&bus, dir.path()).await;
    running
        .visibility
        .wait_for(refused_last, Duration::from_secs(10))
        .await
        .unwrap();
    // (a batch ending in a refused event still moves the ledger's sequence past it)
    assert_eq!(
        running.visibility.ledger(),
        ledger_of(&applied, refused_last)
    );

    // ...and is killed mid-stream, without a final checkpoint: held at the batch holding
    // "crash 150", so a backlog is certain to be left whatever the machine's speed
    running.stop.cancel();
    running.task.await.unwrap().unwrap();
    let (open_gate, gate) = tokio::sync::watch::channel(false);
    let gated = Arc::new(Gated {
        inner: SnapshotProjection::<Ledger>::new("ledger", dir.path()),
        hold: "crash 150",
        gate,
        held: Default::default(),
    });
    let projector = Projector::new(gated.clone(), bus.clone(), settings());
    let visibility = projector.visibility();
    let task = tokio::spawn(projector.run(tokio_util::sync::CancellationToken::new()));
    let last = append_noted(&bus, &good("crash", 300), &mut applied).await;
    let held_at = applied[applied.len() - 150].0;
    wait_until(
        "the projector to reach the held batch",
        Duration::from_secs(10),
        || {
            let (ledger, held) = (visibility.ledger(), gated.held.load(Ordering::SeqCst));
            async move { ledger.seq > refused_last && held }
        },
    )
    .await;
    task.abort();
    let _ = task.await;
    drop(open_gate);
    // Some of the backlog was applied, and the rest, from the held batch on, was not.
    let at_abort = visibility.ledger();
    assert!(
        refused_last < at_abort.seq && at_abort.seq < held_at,
        "aborted at seq {} (refused last {refused_last}, held at {held_at}, last {last})",
        at_abort.seq
    );

    // Then after the next restart each event has still been applied exactly once
    let running = start(&bus, dir.path()).await;
    running
        .visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .unwrap();
    let incremental = running.visibility.ledger();
    assert_eq!(incremental.events, 80 + 30 + 300);
    assert_eq!(incremental, ledger_of(&applied, last));
    assert!(
        running.projection.read().times.values().all(|&n| n == 1),
        "an event applied twice"
    );
    running.stop.cancel();
    running.task.await.unwrap().unwrap();

    // And a rebuild arrives at the same ledger, and saves it
    let projection = Arc::new(SnapshotProjection::<Ledger>::new("ledger", dir.path()));
    let projector = Projector::new(projection.clone(), bus.clone(), settings());
    let rebuilt = projector.rebuild(|_, _| {}).await.unwrap();
    assert_eq!(rebuilt, incremental);
    assert_eq!(projector.visibility().ledger(), incremental);
    let reopened = SnapshotProjection::<Ledger>::new("ledger", dir.path());
    assert_eq!(reopened.restore().await.unwrap(), incremental);
}

/// At the tail, a steady trickle of single events must not cost a publish each when the
/// projection sets a tail gap; every event still becomes visible within about the gap.
#[tokio::test]
async fn a_trickle_at_the_tail_is_published_at_most_once_per_tail_gap() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let projection = Arc::new(Counting::new("trickle", dir.path()));
    let gap = Duration::from_millis(300);
    let projector = Projector::new(
        projection.clone(),
        bus.clone(),
        ProjectorSettings {
            publish_interval: Duration::from_secs(3_600),
            tail_publish_gap: gap,
            checkpoint_interval: Duration::from_secs(3_600),
            checkpoint_every: 1_000_000,
            ..settings()
        },
    );
    let visibility = projector.visibility();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(projector.run(stop.clone()));

    // Given 30 single events appended 20 ms apart (600 ms: about two gaps)
    let started = std::time::Instant::now();
    let mut last = 0;
    for _ in 0..30 {
        last = append_n(&bus, 1, "trickle").await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Then the last is visible about one gap after it was appended, not an hour
    visibility
        .wait_for(last, Duration::from_secs(5))
        .await
        .expect("the tail is published after the gap");
    let elapsed = started.elapsed();
    // And the trickle cost a handful of publishes, not thirty
    let publishes = projection.publishes.load(Ordering::SeqCst);
    let most = elapsed.as_millis() as u64 / gap.as_millis() as u64 + 2;
    assert!(
        publishes <= most,
        "{publishes} publishes in {elapsed:?} with a {gap:?} gap"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// The durable consumer keeps its state in the server's memory (writing it to a file ten
/// times a second per consumer was most of nats-server's CPU under load): a server killed
/// and restarted on its store loses it, and the projector recreates it at what it has
/// applied. Nothing is skipped and nothing applied twice.
#[tokio::test]
async fn a_server_killed_and_restarted_under_a_running_projector_loses_no_event() {
    // Given a projector that has applied a first run of events
    let mut nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let mut applied = Vec::new();
    let first = append_noted(&bus, &good("before the kill", 50), &mut applied).await;
    let running = start(&bus, dir.path()).await;
    running
        .visibility
        .wait_for(first, Duration::from_secs(10))
        .await
        .unwrap();
    let consumer = bus
        .jetstream()
        .get_stream(&bus.config().stream.name)
        .await
        .unwrap()
        .consumer_info("ledger")
        .await
        .unwrap();
    assert!(consumer.config.memory_storage, "{:?}", consumer.config);

    // When the server is killed and restarted on the same store, and more events come
    nats.kill().await;
    nats.restart().await;
    let bus = nats.bus().await;
    let last = append_noted(&bus, &good("after the restart", 50), &mut applied).await;

    // Then the projector applies them too, each once, and its ledger is the stream's
    running
        .visibility
        .wait_for(last, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(running.visibility.ledger(), ledger_of(&applied, last));
    assert!(
        running.projection.read().times.values().all(|&n| n == 1),
        "an event applied twice"
    );
    assert_eq!(running.projection.read().times.len(), 100);
    running.stop.cancel();
    running.task.await.unwrap().unwrap();
}

/// One series' value in the registry's text exposition, as `/metrics` serves it (`series` is
/// its name and labels, `name{label="value"}`); `None` when the registry has no such series.
fn scraped(series: &str) -> Option<f64> {
    engram_telemetry::metrics::render()
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn events_written_while_a_projector_runs_are_measured_from_stored_to_visible() {
    // Given a projector started over 5 events already in the stream, once it has applied them
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    // Its own name: the histogram counts this test's events and no other's.
    const NAME: &str = "visible";
    let backlog = append_n(&bus, 5, "backlog").await;
    let running = start_named(&bus, dir.path(), NAME).await;
    running
        .visibility
        .wait_for(backlog, Duration::from_secs(10))
        .await
        .unwrap();
    let series = |suffix: &str| {
        scraped(&format!(
            "engram_projector_visibility_seconds{suffix}{{projector=\"{NAME}\"}}"
        ))
    };
    // Then the backlog, written before it ran, is not measured
    assert_eq!(series("_count"), None, "the backlog was measured");

    // When 10 more are written while it runs and become visible
    let last = append_n(&bus, 10, "live").await;
    running
        .visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .unwrap();

    // Then each of them is measured once, in well under a minute
    assert_eq!(series("_count"), Some(10.0));
    let le_minute = scraped(&format!(
        "engram_projector_visibility_seconds_bucket{{projector=\"{NAME}\",le=\"60\"}}"
    ));
    assert_eq!(le_minute, Some(10.0));
    let sum = series("_sum").expect("a sum");
    assert!(sum > 0.0 && sum < 600.0, "sum of waits {sum}");
    running.stop.cancel();
    running.task.await.unwrap().unwrap();
}

#[tokio::test]
async fn messages_jetstream_delivers_again_are_counted_and_applied_once() {
    use async_nats::jetstream::consumer::{AckPolicy, pull};

    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    const NAME: &str = "redelivered";
    // Given the projector's consumer made with an ack wait of one second (the runtime makes
    // it with ten minutes, and reuses one whose filter and storage match): what a
    // checkpoint that takes longer than the ack wait looks like, in a second
    bus.jetstream()
        .get_stream(&bus.config().stream.name)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            durable_name: Some(NAME.to_owned()),
            filter_subject: engram_schema::STORED_SUBJECTS.to_owned(),
            ack_policy: AckPolicy::All,
            ack_wait: Duration::from_secs(1),
            memory_storage: true,
            ..Default::default()
        })
        .await
        .unwrap();
    // And a projector that checkpoints, and so acks, only when it stops
    let projection = Arc::new(SnapshotProjection::<Ledger>::new(NAME, dir.path()));
    let projector = Projector::new(
        projection.clone(),
        bus.clone(),
        ProjectorSettings {
            checkpoint_interval: Duration::from_secs(3_600),
            checkpoint_every: 1_000_000,
            ..settings()
        },
    );
    let visibility = projector.visibility();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(projector.run(stop.clone()));
    let redelivered = || {
        scraped(&format!(
            "engram_projector_redelivered_total{{projector=\"{NAME}\"}}"
        ))
    };
    // (created at 0 with the projector's other series)
    assert_eq!(redelivered(), Some(0.0));

    // When three events are delivered and left unacknowledged past the ack wait
    let last = append_n(&bus, 3, "again").await;
    visibility
        .wait_for(last, Duration::from_secs(10))
        .await
        .unwrap();

    // Then the server delivers them again, and each arrival is counted
    wait_until(
        "redeliveries to be counted",
        Duration::from_secs(20),
        || async { redelivered().unwrap_or_default() >= 3.0 },
    )
    .await;
    // And none is applied twice
    {
        let ledger = projection.read();
        assert_eq!(ledger.applied.len(), 3);
        assert!(
            ledger.times.values().all(|&n| n == 1),
            "an event applied twice"
        );
    }
    stop.cancel();
    task.await.unwrap().unwrap();
}

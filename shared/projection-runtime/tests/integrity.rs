//! The projector loop against a hostile or broken stream: events whose subject disagrees with
//! their envelope, a dead-letter stream deleted or refusing, dead-letter ids claimed in
//! advance, and a projector that stalls while its lag has to show it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_trait::async_trait;
use engram_bus::{Bus, DLQ_STREAM, DLQ_SUBJECT_PREFIX, StoredEvent};
use engram_memory::Seq;
use engram_projection_runtime::model::{SnapshotModel, SnapshotProjection};
use engram_projection_runtime::{
    ApplyLedger, Projection, ProjectionError, Projector, ProjectorSettings, Rejected,
};
use engram_schema::Envelope;
use engram_telemetry::metrics;
use engram_testkit::{TestNats, event, wait_until};
use serde::{Deserialize, Serialize};

/// Remembers every applied event's text by seq; refuses events tagged `poison`.
#[derive(Default, Serialize, Deserialize)]
struct Texts {
    applied: BTreeMap<Seq, String>,
}

impl SnapshotModel for Texts {
    fn apply_event(&mut self, seq: Seq, event: &Envelope) -> Result<(), String> {
        if event.tags.iter().any(|t| t == "poison") {
            return Err("tagged poison".into());
        }
        self.applied.insert(seq, event.content.text.clone());
        Ok(())
    }

    fn hash(&self) -> [u8; 32] {
        *blake3::hash(&rmp_serde::to_vec(&self.applied).unwrap()).as_bytes()
    }
}

fn settings(dir: &std::path::Path) -> ProjectorSettings {
    ProjectorSettings {
        batch: 64,
        checkpoint_interval: Duration::from_millis(200),
        checkpoint_every: 100,
        max_backoff: Duration::from_millis(100),
        lag_sample_interval: Duration::from_millis(50),
        state_dir: Some(dir.to_owned()),
        ..ProjectorSettings::default()
    }
}

struct Running {
    projection: Arc<SnapshotProjection<Texts>>,
    visibility: engram_projection_runtime::Visibility,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Result<(), engram_projection_runtime::ProjectorError>>,
}

fn start(
    bus: &Bus,
    name: &'static str,
    dir: &std::path::Path,
    settings: ProjectorSettings,
) -> Running {
    let projection = Arc::new(SnapshotProjection::<Texts>::new(name, dir));
    let projector = Projector::new(projection.clone(), bus.clone(), settings);
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

impl Running {
    async fn wait_for(&self, seq: Seq) {
        self.visibility
            .wait_for(seq, Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

fn poison(text: &str) -> Envelope {
    let mut e = event("acme", "t1", text);
    e.tags.push("poison".into());
    e
}

async fn append(bus: &Bus, events: &[Envelope]) -> Seq {
    let mut last = 0;
    for e in events {
        last = bus.append(e, Default::default()).await.unwrap().seq;
    }
    last
}

/// Every dead letter stored for `projector`, as (headers, subject it came from).
async fn dead_letters(bus: &Bus, projector: &str) -> Vec<HeaderMap> {
    let mut dlq = bus.jetstream().get_stream(DLQ_STREAM).await.unwrap();
    let last = dlq.info().await.unwrap().state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = dlq.get_raw_message(seq).await
            && m.subject.as_str() == format!("{DLQ_SUBJECT_PREFIX}.{projector}")
        {
            out.push(m.headers);
        }
    }
    out
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers.get(name).map_or("", |v| v.as_str())
}

#[tokio::test]
async fn an_event_whose_subject_disagrees_with_its_envelope_is_dead_lettered_not_applied() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&bus, "forged", dir.path(), settings(dir.path()));

    // Given victim's envelope published raw on the attacker's subject
    let forged = event("victim", "mine", "planted");
    let payload = bus.codec().encode(&forged).unwrap();
    let forged_seq = bus
        .jetstream()
        .publish("engram.evt.attacker.task.mine.episodic", payload.into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    let last = append(&bus, &[event("victim", "mine", "honest")]).await;

    // When the projector has passed both
    running.wait_for(last).await;

    // Then only the honest one is applied, and the forged one is a dead letter saying why
    let applied: Vec<String> = running
        .projection
        .read()
        .applied
        .values()
        .cloned()
        .collect();
    assert_eq!(applied, ["honest"]);
    let letters = dead_letters(&bus, "forged").await;
    assert_eq!(letters.len(), 1);
    assert_eq!(
        header(&letters[0], "Engram-Dlq-Seq"),
        forged_seq.to_string()
    );
    let reason = header(&letters[0], "Engram-Dlq-Reason");
    assert!(
        reason.contains("engram.evt.victim.task.mine.episodic"),
        "{reason}"
    );
    running.stop().await;
}

#[tokio::test]
async fn a_deleted_dead_letter_stream_is_recreated_and_the_projector_goes_on() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let running = start(&bus, "dlq-deleted", dir.path(), settings(dir.path()));
    bus.jetstream().delete_stream(DLQ_STREAM).await.unwrap();

    let last = append(&bus, &[poison("bad"), event("acme", "t1", "good")]).await;

    running.wait_for(last).await;
    assert_eq!(running.projection.read().applied.len(), 1);
    assert_eq!(bus.dead_letter_count("dlq-deleted").await.unwrap(), 1);
    running.stop().await;
}

#[tokio::test]
async fn a_dead_letter_the_stream_refuses_is_dropped_after_bounded_tries_not_retried_forever() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    // Given a dead-letter stream that takes no dead letter (every one is too large for it)
    let js = bus.jetstream();
    let mut config = bus.wanted_dead_letter_config();
    js.delete_stream(DLQ_STREAM).await.unwrap();
    config.max_message_size = 16;
    js.create_stream(config).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let running = start(
        &bus,
        "dlq-refusing",
        dir.path(),
        ProjectorSettings {
            dead_letter_attempts: 3,
            ..settings(dir.path())
        },
    );

    // When a poison event comes before good ones
    let last = append(
        &bus,
        &[
            poison("bad"),
            event("acme", "t1", "good 1"),
            event("acme", "t1", "good 2"),
        ],
    )
    .await;

    // Then the projector gives the dead letter up, counts it, and applies the rest
    running.wait_for(last).await;
    assert_eq!(running.projection.read().applied.len(), 2);
    let dropped = metrics::PROJECTOR_DEAD_LETTERS_DROPPED
        .with_label_values(&["dlq-refusing"])
        .get();
    assert_eq!(dropped, 1);
    assert_eq!(bus.dead_letter_count("dlq-refusing").await.unwrap(), 0);
    running.stop().await;
}

#[tokio::test]
async fn a_preclaimed_dead_letter_id_does_not_suppress_the_real_dead_letter() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let poison_seq = append(&bus, &[poison("bad")]).await;
    // Given an attacker who published the id the dead letter used to have, first
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("preclaim-{poison_seq}").as_str());
    bus.jetstream()
        .publish_with_headers(
            format!("{DLQ_SUBJECT_PREFIX}.preclaim"),
            headers,
            "decoy".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    // When the projector dead-letters the poison event
    let dir = tempfile::tempdir().unwrap();
    let last = append(&bus, &[event("acme", "t1", "good")]).await;
    let running = start(&bus, "preclaim", dir.path(), settings(dir.path()));
    running.wait_for(last).await;

    // Then the real dead letter is stored beside the decoy
    let letters = dead_letters(&bus, "preclaim").await;
    assert_eq!(letters.len(), 2);
    assert!(
        letters
            .iter()
            .any(|h| header(h, "Engram-Dlq-Seq") == poison_seq.to_string()
                && header(h, "Engram-Dlq-Reason") == "tagged poison"),
        "no real dead letter"
    );
    running.stop().await;
}

#[tokio::test]
async fn a_dead_letter_sent_again_after_a_crash_is_stored_once() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    // Checkpoints far apart, so a crash replays the poison event; the key is kept where the
    // model keeps its state
    let rarely = ProjectorSettings {
        checkpoint_interval: Duration::from_secs(3_600),
        checkpoint_every: 1_000_000,
        state_dir: None,
        ..settings(dir.path())
    };
    let last = append(&bus, &[poison("bad"), event("acme", "t1", "good")]).await;
    let running = start(&bus, "resend", dir.path(), rarely.clone());
    running.wait_for(last).await;
    assert_eq!(bus.dead_letter_count("resend").await.unwrap(), 1);

    // When the projector crashes before a checkpoint, and a new process replays
    running.task.abort();
    let _ = running.task.await;
    let running = start(&bus, "resend", dir.path(), rarely);
    running.wait_for(last).await;

    // Then the second dead letter had the same id, and was deduplicated
    assert_eq!(bus.dead_letter_count("resend").await.unwrap(), 1);
    running.stop().await;
}

/// A model whose every batch fails, as one waiting on an embedding service that is down.
struct Stuck;

#[async_trait]
impl Projection for Stuck {
    fn name(&self) -> &'static str {
        "stuck"
    }
    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        Ok(ApplyLedger::default())
    }
    async fn apply(&self, _: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        Err(ProjectionError::Transient("the model is down".into()))
    }
    async fn checkpoint(&self, _: &ApplyLedger) -> Result<(), ProjectionError> {
        Ok(())
    }
    async fn reset(&self) -> Result<(), ProjectionError> {
        Ok(())
    }
    async fn state_hash(&self) -> [u8; 32] {
        [0; 32]
    }
}

#[tokio::test]
async fn the_lag_metric_counts_stream_events_a_stalled_projector_has_not_made_visible() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();
    let projector = Projector::new(Arc::new(Stuck), bus.clone(), settings(dir.path()));
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(projector.run(stop.clone()));

    let last = append(
        &bus,
        &(0..5)
            .map(|i| event("acme", "t1", &format!("e{i}")))
            .collect::<Vec<_>>(),
    )
    .await;

    wait_until(
        "the lag to count every event",
        Duration::from_secs(10),
        || async { metrics::PROJECTOR_LAG.with_label_values(&["stuck"]).get() == last as i64 },
    )
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
}

//! A projector process killed with SIGKILL mid-stream and restarted: afterwards every read
//! model equals a from-scratch rebuild, and every projector's apply ledger counts each event
//! exactly once (no event lost, none applied twice, even to a model where applying twice
//! would leave the same state).

mod common;
use common::KillOnDrop;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use engram_bus::Bus;
use engram_fixtures::HashEmbedder;
use engram_memory::proto::Consistency;
use engram_projection_runtime::ApplyLedger;
use engram_projectors::{ProjectorName, ProjectorStatus, ProjectorsConfig};
use engram_schema::{Content, Embedding, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_testkit::TestNats;

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");
/// Until the first kill: a checkpoint after every 1,000 events and never for idleness. Batches
/// hold at most 64 events, so once a projector has applied 1,500 it has checkpointed at most
/// 1,063 of them, and holds the rest only in memory.
const CHECKPOINT_EVERY_1000: &str = "checkpoint_interval = \"1h\"\ncheckpoint_every = 1000";
/// Afterwards: idle checkpoints too, so a caught-up projector saves everything.
const CHECKPOINT_WHEN_IDLE: &str = "checkpoint_interval = \"300ms\"\ncheckpoint_every = 500";
const CONFIG: &str = r#"
[projectors]
checkpoint_interval = "300ms"
checkpoint_every = 500
batch = 64

# Small enough that every scope has a graph, so checkpoints save graphs and the restart
# loads them.
[projectors.hnsw]
exact_below = 40

[projectors.embedder]
kind = "client_supplied"
model = "hash-32"
dim = 32
"#;

/// Writes the projectors' config, with `checkpoints` as its checkpoint interval line.
fn write_config(home: &std::path::Path, checkpoints: &str) {
    assert!(
        CONFIG.contains(CHECKPOINT_WHEN_IDLE),
        "CONFIG lost its checkpoint lines"
    );
    let config = CONFIG.replace(CHECKPOINT_WHEN_IDLE, checkpoints);
    std::fs::write(home.join("engram.toml"), config).unwrap();
}

fn spawn(home: &std::path::Path, url: &str) -> KillOnDrop {
    let child = Command::new(ENGRAM)
        .arg("--home")
        .arg(home)
        .args(["--log-format", "json"])
        .arg("--config")
        .arg(home.join("engram.toml"))
        .args(["--nats", url, "projector"])
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(home.join("projector.log"))
                .unwrap(),
        )
        .spawn()
        .expect("spawn engram projector");
    KillOnDrop(child)
}

/// Facts, skills and episodic memories over 7 scopes; every tenth event forgets the text
/// memories 7 and 14 events back (same scope), so forgetting and compaction replay too.
fn events(n: usize, from: usize) -> Vec<Envelope> {
    let embedder = HashEmbedder::new(32);
    let mut out: Vec<Envelope> = Vec::with_capacity(n);
    for i in from..from + n {
        let event = {
            let scope = Scope::new(ScopeKind::Task, &format!("t{}", i % 7)).unwrap();
            let text = format!("event {i} about topic {}", i % 13);
            let (layer, kind, data) = match i % 10 {
                0 | 5 => (
                    Layer::Semantic,
                    EventKind::FactAsserted,
                    Some(
                        serde_json::json!({"subject": format!("s{}", i % 11), "predicate": "value", "object": i}),
                    ),
                ),
                1 | 6 => (
                    Layer::Procedural,
                    EventKind::SkillRecorded,
                    Some(
                        serde_json::json!({"name": format!("skill{}", i % 3), "description": text.clone()}),
                    ),
                ),
                9 if i - from >= 14 => {
                    let ids: Vec<&str> = [7, 14]
                        .iter()
                        .map(|back| out[i - from - back].event_id.as_str())
                        .collect();
                    (
                        Layer::Episodic,
                        EventKind::Forgotten,
                        Some(serde_json::json!({ "event_ids": ids })),
                    )
                }
                _ => (Layer::Episodic, EventKind::Observation, None),
            };
            let mut e = Envelope::new(
                Ident::parse("t", "acme").unwrap(),
                scope,
                Ident::parse("a", "agent").unwrap(),
                Ident::parse("i", "i1").unwrap(),
                layer,
                kind,
                Content {
                    text: text.clone(),
                    data,
                },
            );
            e.embedding = Some(Embedding {
                model: "hash-32".into(),
                vector: embedder.embed_one(&text),
            });
            e
        };
        out.push(event);
    }
    out
}

async fn status(
    bus: &Bus,
    name: ProjectorName,
    min_seq: u64,
    log: &std::path::Path,
) -> ProjectorStatus {
    let partitions = bus.config().stream.partitions;
    // The restarted process may still be starting.
    for _ in 0..100 {
        match engram_projectors::status_of(
            bus.client(),
            name.as_str(),
            partitions,
            &Consistency::default(),
            Duration::from_secs(5),
        )
        .await
        {
            Err(f) if f.code == engram_memory::proto::ErrorCode::Unavailable => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => break,
        }
    }
    let log = std::fs::read_to_string(log).unwrap_or_default();
    engram_projectors::status_of(
        bus.client(),
        name.as_str(),
        partitions,
        &Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(60_000),
        },
        Duration::from_secs(90),
    )
    .await
    .unwrap_or_else(|e| panic!("status of {name}: {e}\nprojector log:\n{log}"))
}

/// How far each partition's durable consumer of the projector acknowledged (acks follow
/// checkpoints), for the partitions in `last` (each with its last event's sequence).
async fn ack_floors(
    bus: &Bus,
    name: ProjectorName,
    last: &BTreeMap<u32, u64>,
) -> BTreeMap<u32, u64> {
    let stream = bus
        .jetstream()
        .get_stream(&bus.config().stream.name)
        .await
        .unwrap();
    let mut floors = BTreeMap::new();
    for &p in last.keys() {
        let consumer = engram_memory::proto::instance_name(name.as_str(), p);
        let floor = match stream
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(&consumer)
            .await
        {
            Ok(mut consumer) => consumer
                .info()
                .await
                .map(|i| i.ack_floor.stream_sequence)
                .unwrap_or(0),
            Err(_) => 0,
        };
        floors.insert(p, floor);
    }
    floors
}

fn killed(process: &mut KillOnDrop) {
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(process.0.id() as i32, libc::SIGKILL);
    }
    let _ = process.0.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_killed_mid_batch_resumes_without_duplicates_or_gaps() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let home = tempfile::tempdir().unwrap();
    let log = home.path().join("projector.log");
    write_config(home.path(), CHECKPOINT_EVERY_1000);

    let mut process = spawn(home.path(), &nats.url());
    // What every projector must have applied, each event once: the ledger of the stream.
    let mut expected = ApplyLedger::default();
    let mut last = 0;
    // Each partition's last event: the partitions' instances checkpoint apart.
    let partitions = bus.config().stream.partitions;
    let mut last_in: BTreeMap<u32, u64> = BTreeMap::new();
    for chunk in 0..6 {
        let events = events(500, chunk * 500);
        for (event, r) in events.iter().zip(bus.append_batch(&events, 256).await) {
            let seq = r.unwrap().seq;
            expected.add(seq, event.event_id.as_str());
            last = last.max(seq);
            last_in.insert(
                engram_memory::ScopeKey::of(event).partition(partitions),
                seq,
            );
        }
        if chunk == 2 {
            // Mid-stream: once every projector has applied the 1,500 events so far, each has
            // checkpointed at most 1,063 of them and holds the rest only in memory. Then the
            // kill.
            for name in ProjectorName::all() {
                status(&bus, name, last, &log).await;
                let saved = ack_floors(&bus, name, &last_in).await;
                assert!(
                    saved.iter().any(|(p, floor)| *floor < last_in[p]),
                    "{name} acknowledged (checkpointed) {saved:?} of {last_in:?}: nothing unsaved to lose"
                );
            }
            killed(&mut process);
            write_config(home.path(), CHECKPOINT_WHEN_IDLE);
            process = spawn(home.path(), &nats.url());
        }
    }

    // Ground truth: each model rebuilt from sequence 1 in a fresh directory.
    let config: ProjectorsConfig = {
        #[derive(serde::Deserialize)]
        struct File {
            projectors: ProjectorsConfig,
        }
        toml::from_str::<File>(CONFIG).unwrap().projectors
    };
    let mut after_crash = Vec::new();
    for name in ProjectorName::all() {
        let status = status(&bus, name, last, &log).await;
        // Every event applied exactly once, across the kill and the replay after it.
        assert_eq!(
            status.ledger, expected,
            "{name}: the apply ledger after kill -9"
        );
        after_crash.push((name, status));
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    // The restart found deliveries past its checkpoint, and replayed from the checkpoint.
    let repositioned = text.matches("repositioning projector consumer").count();
    assert!(
        repositioned >= 1,
        "no projector was repositioned at its checkpoint:\n{text}"
    );
    // Once caught up and checkpointed (acknowledged through the last event), another kill -9:
    // this restart must load the vector graphs the checkpoint saved, not build them, and
    // come back to the same state.
    for name in ProjectorName::all() {
        engram_testkit::wait_until(
            &format!("{name} to checkpoint the whole stream"),
            Duration::from_secs(60),
            || {
                let (bus, last_in) = (bus.clone(), last_in.clone());
                async move {
                    let floors = ack_floors(&bus, name, &last_in).await;
                    floors.iter().all(|(p, floor)| *floor >= last_in[p])
                }
            },
        )
        .await;
    }
    killed(&mut process);
    process = spawn(home.path(), &nats.url());
    let again = status(&bus, ProjectorName::VECTOR, last, &log).await;
    let vector_before = &after_crash
        .iter()
        .find(|(name, _)| *name == ProjectorName::VECTOR)
        .unwrap()
        .1;
    assert_eq!(again.state_hash, vector_before.state_hash);
    assert_eq!(
        again.ledger, expected,
        "vector: the apply ledger after a restart"
    );
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let graphs_loaded: Vec<u64> = text
        .lines()
        .filter(|l| l.contains("vector checkpoint restored"))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["graphs_loaded"].as_u64())
        .collect();
    // One line per partition's instance and start: the last start's lines are the last
    // ones, and before the last checkpoint no partition had a graph to load.
    let last_start: u64 = graphs_loaded
        .iter()
        .rev()
        .take(bus.config().stream.partitions as usize)
        .sum();
    assert!(
        last_start > 0,
        "the vector graphs were not loaded on restart ({graphs_loaded:?}):\n{text}"
    );
    // Stopped before the rebuilds: a rebuild takes over the projector's durable consumer.
    drop(process);
    for (name, status) in after_crash {
        let fresh = tempfile::tempdir().unwrap();
        let (applied, hash) =
            engram_projectors::rebuild(name, &config, fresh.path(), nats.bus().await, |_, _| {})
                .await
                .unwrap();
        assert_eq!(applied, last);
        let hash: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            status.state_hash, hash,
            "{name}: the model after kill -9 and restart differs from a rebuild"
        );
    }
}

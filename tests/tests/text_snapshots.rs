//! Snapshots of the text read models (vector, keyword) against a real nats-server: cut by
//! the running projectors, loaded by a new replica of each that replays only the tail, which
//! then has the running projector's state and answers its searches alike, also after a
//! restart.

use std::collections::BTreeMap;
use std::time::Duration;

use engram_embed::EmbedderConfig;
use engram_fixtures::HashEmbedder;
use engram_memory::proto::{Consistency, SearchRequest, SearchResponse, partition_subject};
use engram_memory::{MemoryFilter, ScopeKey};
use engram_projectors::{ProjectorName, ProjectorStatus, ProjectorsConfig, SnapshotRequest};
use engram_query::QueryConfig;
use engram_schema::{Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_snapshots::SnapshotMeta;
use engram_testkit::TestNats;
use engram_tests::{Engram, projectors_config};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const TEXT: [ProjectorName; 2] = [ProjectorName::VECTOR, ProjectorName::KEYWORD];

const DIM: usize = 4;

const TOPICS: [&str; 5] = [
    "deploys",
    "the cache",
    "billing",
    "the on-call rota",
    "backups",
];

/// Only the text models, with vectors supplied by the client.
fn config() -> ProjectorsConfig {
    ProjectorsConfig {
        run: TEXT.to_vec(),
        embedder: EmbedderConfig::ClientSupplied {
            model: format!("hash-{DIM}"),
            dim: DIM,
        },
        ..projectors_config()
    }
}

fn scope(i: usize) -> Scope {
    Scope::new(ScopeKind::Team, &format!("team-{}", i % 3)).unwrap()
}

fn ident(s: &str) -> Ident {
    Ident::parse("id", s).unwrap()
}

/// A text memory of `scope`, by `instance`, with its client-supplied vector.
fn memory(scope: Scope, instance: &str, kind: EventKind, text: &str) -> Envelope {
    let mut e = Envelope::new(
        ident("acme"),
        scope,
        ident("agent"),
        ident(instance),
        Layer::Episodic,
        kind,
        engram_schema::Content::text(text),
    );
    e.embedding = Some(engram_schema::Embedding {
        model: format!("hash-{DIM}"),
        vector: HashEmbedder::new(DIM).embed_one(text),
    });
    e
}

fn observation(i: usize) -> Envelope {
    memory(
        scope(i),
        &format!("i-{}", i % 4),
        EventKind::Observation,
        &format!("memory {i} about {}", TOPICS[i % TOPICS.len()]),
    )
}

fn with_data(mut event: Envelope, data: serde_json::Value) -> Envelope {
    event.content.data = Some(data);
    event
}

/// Memories `range`, then a forgetting, a contradiction, a faulty-instance flag and a merge
/// of some of them.
fn events(range: std::ops::Range<usize>) -> Vec<Envelope> {
    let mut events: Vec<Envelope> = range.map(observation).collect();
    let id = |i: usize| events[i].event_id.clone();
    let forgotten = Envelope::forget(
        ident("acme"),
        scope(0),
        ident("agent"),
        ident("i-0"),
        Layer::Episodic,
        &[id(0), id(3)],
        "wrong",
    );
    let outcome = with_data(
        memory(
            scope(1),
            "i-3",
            EventKind::Outcome,
            "memory a deploy failed",
        ),
        json!({"success": false, "contradicts": [id(1), id(4)]}),
    );
    let mut flag = memory(scope(2), "i-9", EventKind::Feedback, "");
    flag.embedding = None;
    let flag = with_data(flag, json!({"faulty_instance": "i-2"}));
    let merged = with_data(
        memory(
            scope(1),
            "consolidator",
            EventKind::Consolidated,
            "memory 1 about the cache, merged",
        ),
        json!({"op": "merged", "sources": [id(1), id(7)], "recurrences": 2}),
    );
    events.extend([forgotten, outcome, flag, merged]);
    events
}

async fn append(engram: &Engram, events: &[Envelope]) -> u64 {
    let mut last = 0;
    for r in engram.client.append_batch(events).await {
        last = last.max(r.unwrap().seq);
    }
    last
}

fn partitions(bus: &engram_bus::Bus) -> u32 {
    bus.config().stream.partitions
}

/// The whole model's status, every partition's merged, once each has reached `min_seq`.
async fn status(bus: &engram_bus::Bus, name: ProjectorName, min_seq: u64) -> ProjectorStatus {
    engram_projectors::status_of(
        bus.client(),
        name.as_str(),
        partitions(bus),
        &Consistency {
            min_seq: Some(min_seq),
            wait_ms: Some(30_000),
        },
        Duration::from_secs(40),
    )
    .await
    .unwrap()
}

/// A snapshot of every partition's instance of `name`, in partition order.
async fn cut(bus: &engram_bus::Bus, name: ProjectorName) -> Vec<SnapshotMeta> {
    engram_projectors::ask_partitions(
        bus.client(),
        name.as_str(),
        "snapshot",
        partitions(bus),
        &SnapshotRequest::default(),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
}

/// Every topic's hits from the search endpoint of `name`'s instance of each partition that
/// holds one of the scopes: in order with scores for the vector model, as a set for the
/// keyword model (BM25 statistics count deleted documents until segments merge, so an index
/// built without them may order near-ties otherwise).
async fn answers(
    bus: &engram_bus::Bus,
    name: ProjectorName,
    min_seq: u64,
) -> Vec<Vec<(EventId, String, String)>> {
    let scopes: Vec<ScopeKey> = (0..3)
        .map(|i| ScopeKey::new(ident("acme"), scope(i)))
        .collect();
    let mut answers = Vec::new();
    for topic in TOPICS {
        let mut about = Vec::new();
        for (partition, scopes) in engram_memory::proto::by_partition(&scopes, partitions(bus)) {
            about.push(search(bus, name, partition, scopes, topic, min_seq).await);
        }
        assert!(
            about.iter().any(|hits| !hits.is_empty()),
            "{name}: nothing about {topic}"
        );
        answers.extend(about);
    }
    answers
}

/// One partition's hits about `topic`, as [`answers`] keeps them.
async fn search(
    bus: &engram_bus::Bus,
    name: ProjectorName,
    partition: u32,
    scopes: Vec<ScopeKey>,
    topic: &str,
    min_seq: u64,
) -> Vec<(EventId, String, String)> {
    {
        let request = SearchRequest {
            scopes,
            query: topic.into(),
            vector: Some(HashEmbedder::new(DIM).embed_one(topic)),
            k: 1000,
            filter: MemoryFilter::default(),
            consistency: Consistency {
                min_seq: Some(min_seq),
                wait_ms: Some(30_000),
            },
            score_also: Vec::new(),
            rest: 0,
        };
        let response: SearchResponse = engram_rpc::call(
            bus.client(),
            &partition_subject(name.as_str(), "search", partition),
            &request,
            Duration::from_secs(40),
        )
        .await
        .unwrap();
        let mut hits: Vec<(EventId, String, String)> = response
            .hits
            .into_iter()
            .map(|h| {
                let score = if name == ProjectorName::VECTOR {
                    h.hit.score.to_string()
                } else {
                    String::new()
                };
                (h.meta.event_id, score, h.meta.confidence.to_string())
            })
            .collect();
        if name == ProjectorName::KEYWORD {
            hits.sort();
        }
        hits
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_text_model_replica_from_a_snapshot_plus_the_tail_equals_the_running_one() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let engram = Engram::start_with(&nats, config(), QueryConfig::default()).await;

    // Given vector and keyword snapshots of a few hundred memories, a forgotten, a
    // contradicted, a flagged and a merged one among them...
    let head = events(0..240);
    let at_cut = append(&engram, &head).await;
    let mut cuts = BTreeMap::new();
    for name in TEXT {
        status(&bus, name, at_cut).await;
        cuts.insert(name, cut(&bus, name).await);
    }
    // ...and a tail after them that contradicts a memory the snapshots hold, and one of its
    // own
    let mut tail = events(240..330);
    let again = with_data(
        memory(
            scope(1),
            "i-3",
            EventKind::Outcome,
            "memory the cache failed",
        ),
        json!({"contradicts": [head[10].event_id, tail[1].event_id]}),
    );
    tail.push(again);
    let end = append(&engram, &tail).await;
    let mut live = BTreeMap::new();
    for name in TEXT {
        let hash = status(&bus, name, end).await.state_hash;
        live.insert(name, (hash, answers(&bus, name, end).await));
    }
    engram.stop().await;

    for name in TEXT {
        let (hash, answered) = &live[&name];
        // When a new replica starts from the snapshot
        let dir = tempfile::tempdir().unwrap();
        let replica = engram_projectors::rebuild_from_snapshot(
            name,
            &config(),
            dir.path(),
            engram_bus::Bus::connect(nats.bus_config()).await.unwrap(),
            None,
            |_, _| {},
        )
        .await
        .unwrap();
        // Then every partition loaded its snapshot, replayed the tail, and reached the
        // running state
        let loaded: Vec<Option<u64>> = replica
            .partitions
            .iter()
            .map(|p| p.snapshot.as_ref().map(|m| m.version))
            .collect();
        let cut: Vec<Option<u64>> = cuts[&name].iter().map(|m| Some(m.version)).collect();
        assert_eq!(loaded, cut, "{name}");
        assert!(cuts[&name].iter().all(|m| m.version >= at_cut), "{name}");
        assert_eq!(replica.seq, end, "{name}");
        assert_eq!(&replica.state_hash, hash, "{name}: snapshot + tail differs");

        // And started from its state dir, it answers as the running projector did
        let stop = CancellationToken::new();
        let bus_config = nats.bus_config();
        let running = engram_projectors::start(
            &ProjectorsConfig {
                run: vec![name],
                ..config()
            },
            dir.path(),
            move |_, _| engram_bus::Bus::connect(bus_config.clone()),
            stop.clone(),
        )
        .await
        .unwrap();
        // Its endpoints were subscribed on its own connection: answered once the server
        // has them.
        let partitions = partitions(&bus);
        engram_testkit::wait_until("the replica's endpoints", Duration::from_secs(10), || {
            let client = bus.client().clone();
            async move {
                engram_projectors::status_of(
                    &client,
                    name.as_str(),
                    partitions,
                    &Consistency::default(),
                    Duration::from_secs(5),
                )
                .await
                .is_ok()
            }
        })
        .await;
        assert_eq!(&status(&bus, name, end).await.state_hash, hash, "{name}");
        assert_eq!(&answers(&bus, name, end).await, answered, "{name}");
        stop.cancel();
        running.join().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_projector_named_in_skip_periodic_cuts_no_periodic_snapshots() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let mut config = config();
    config.snapshots.interval = Duration::from_millis(100);
    config.snapshots.min_events = 1;
    config.snapshots.skip_periodic = vec!["vector".into()];
    config.validate().unwrap();
    let engram = Engram::start_with(&nats, config.clone(), QueryConfig::default()).await;
    let at = append(&engram, &events(0..20)).await;
    for name in TEXT {
        status(&bus, name, at).await;
    }
    // When keyword has cut a periodic snapshot of what was appended...
    let store = engram_snapshots::SnapshotStore::open(&bus, config.snapshots.clone())
        .await
        .unwrap();
    let cut_by = |model: &'static str| {
        let store = store.clone();
        async move {
            store
                .list(None)
                .await
                .unwrap()
                .into_iter()
                .filter(|m| m.projector.starts_with(&format!("{model}-p")))
                .count()
        }
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while cut_by("keyword").await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "keyword cut no periodic snapshot"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ...vector, named in skip_periodic, has cut none (it was due as often), and still cuts
    // one when asked.
    assert_eq!(cut_by("vector").await, 0);
    let asked = cut(&bus, ProjectorName::VECTOR).await;
    assert!(asked.iter().all(|m| m.version >= at));
    engram.stop().await;
    // And a name that is no projector is refused with the known ones.
    config.snapshots.skip_periodic = vec!["vectors".into()];
    let err = config.validate().unwrap_err();
    assert!(
        err.contains("skip_periodic") && err.contains("vector"),
        "{err}"
    );
}

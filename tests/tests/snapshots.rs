//! Versioned snapshots against a real nats-server: cut by running projectors, stored in the
//! Object Store, loaded by a new replica that replays only the tail, and what happens when
//! a snapshot is corrupt or retention has removed history.

use std::time::Duration;

use engram_memory::proto::Consistency;
use engram_projectors::{ProjectorName, ProjectorStatus, SnapshotRequest};
use engram_schema::{Envelope, EventKind, Layer, Scope, ScopeKind};
use engram_snapshots::{SnapshotMeta, SnapshotStore};
use engram_testkit::TestNats;
use engram_tests::{Engram, projectors_config};
use serde_json::json;

const EXPORTING: [ProjectorName; 3] = [
    ProjectorName::FACTS,
    ProjectorName::SKILLS,
    ProjectorName::DOCS,
];

/// Event `i` of a mixed stream: facts (some contradicting earlier ones), skills with
/// outcomes, shared-document edits and plain observations, over three scopes.
fn event(i: usize, board: &mut engram_docs::LocalDoc) -> Envelope {
    let scope = Scope::new(ScopeKind::Team, &format!("team-{}", i % 3)).unwrap();
    let mut e = engram_testkit::event("acme", "t1", &format!("observation {i}"));
    e.scope = scope;
    match i % 5 {
        0 => {
            e.kind = EventKind::FactAsserted;
            e.layer = Layer::Semantic;
            e.content.data = Some(
                json!({"subject": format!("svc-{}", i % 7), "predicate": "owner", "object": format!("team-{i}")}),
            );
        }
        1 => {
            e.kind = EventKind::SkillRecorded;
            e.layer = Layer::Procedural;
            e.content.data = Some(
                json!({"name": format!("skill-{}", i % 4), "description": format!("does thing {i}")}),
            );
        }
        2 => {
            e.kind = EventKind::Outcome;
            e.content.data =
                Some(json!({"skill": format!("skill-{}", i % 4), "success": i.is_multiple_of(3)}));
        }
        3 => {
            board
                .edit(|b: &mut engram_docs::TaskBoard| {
                    b.items.insert(
                        format!("t-{}", i % 11),
                        engram_docs::TaskItem {
                            title: format!("task {i}"),
                            ..Default::default()
                        },
                    );
                })
                .unwrap();
            let out = board
                .outgoing("task_board", "sprint", 200_000)
                .unwrap()
                .remove(0);
            board.mark_sent(&out.synced_after);
            e.kind = EventKind::DocChanged;
            e.layer = Layer::Working;
            e.scope = Scope::new(ScopeKind::Team, "team-0").unwrap();
            e.content.data = Some(out.data);
        }
        _ => {}
    }
    e.validate().unwrap();
    e
}

async fn append_events(
    engram: &Engram,
    range: std::ops::Range<usize>,
    board: &mut engram_docs::LocalDoc,
) -> u64 {
    let events: Vec<Envelope> = range.map(|i| event(i, board)).collect();
    let mut last = 0;
    for r in engram.client.append_batch(&events).await {
        last = last.max(r.unwrap().seq);
    }
    last
}

fn partitions(bus: &engram_bus::Bus) -> u32 {
    bus.config().stream.partitions
}

/// The stream partition that holds `tenant`'s `scope`.
fn partition_of(bus: &engram_bus::Bus, tenant: &str, scope: &str) -> usize {
    let key = engram_memory::ScopeKey::new(
        engram_schema::Ident::parse("tenant", tenant).unwrap(),
        Scope::new(ScopeKind::Team, scope).unwrap(),
    );
    key.partition(partitions(bus)) as usize
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
async fn cut(bus: &engram_bus::Bus, name: ProjectorName, label: Option<&str>) -> Vec<SnapshotMeta> {
    engram_projectors::ask_partitions(
        bus.client(),
        name.as_str(),
        "snapshot",
        partitions(bus),
        &SnapshotRequest {
            label: label.map(str::to_owned),
            force: false,
        },
        Duration::from_secs(60),
    )
    .await
    .unwrap()
}

/// The version of each partition's snapshot.
fn versions(cuts: &[SnapshotMeta]) -> Vec<u64> {
    cuts.iter().map(|m| m.version).collect()
}

/// The version of each partition's snapshot a replica loaded (`None`: it replayed all).
fn loaded(replica: &engram_projectors::Bootstrapped) -> Vec<Option<u64>> {
    replica
        .partitions
        .iter()
        .map(|p| p.snapshot.as_ref().map(|m| m.version))
        .collect()
}

/// A connection that leaves the stream as it is (the tests change its retention).
async fn connect(nats: &TestNats) -> engram_bus::Bus {
    engram_bus::Bus::connect(nats.bus_config()).await.unwrap()
}

/// A fresh replica of `name` in its own state dir, from the newest good snapshot.
async fn new_replica(nats: &TestNats, name: ProjectorName) -> engram_projectors::Bootstrapped {
    let dir = tempfile::tempdir().unwrap();
    engram_projectors::rebuild_from_snapshot(
        name,
        &projectors_config(),
        dir.path(),
        connect(nats).await,
        None,
        |_, _| {},
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_from_a_snapshot_plus_the_tail_equals_the_full_replay() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    // Split points that vary from run to run: the property holds at any k.
    let total = 300;
    for k in [1 + rand::random_range(0..total - 1), total] {
        let engram = Engram::start(&nats).await;
        let mut board = engram_docs::LocalDoc::genesis::<engram_docs::TaskBoard>().unwrap();
        let start = bus.stream_summary().await.unwrap().last_seq as usize;
        // Given a snapshot of every exporting projector at k events...
        let at_k = append_events(&engram, start..start + k, &mut board).await;
        let mut cuts = Vec::new();
        for name in EXPORTING {
            status(&bus, name, at_k).await;
            cuts.push(cut(&bus, name, None).await);
        }
        // ...and the rest of the stream after it.
        let end = append_events(&engram, start + k..start + total, &mut board)
            .await
            .max(at_k);
        let mut live = Vec::new();
        for name in EXPORTING {
            live.push(status(&bus, name, end).await.state_hash);
        }
        engram.stop().await;
        for ((name, metas), live) in EXPORTING.into_iter().zip(&cuts).zip(&live) {
            // Every partition's cut covers the stream up to k, idle partitions included.
            assert_eq!(metas.len(), partitions(&bus) as usize);
            for (p, meta) in metas.iter().enumerate() {
                assert!(
                    meta.version >= at_k,
                    "{name} partition {p}: cut at {} before {at_k}",
                    meta.version
                );
            }
            // When a new replica starts from them, then it reaches the full replay's state.
            let replica = new_replica(&nats, name).await;
            assert_eq!(
                loaded(&replica),
                versions(metas).into_iter().map(Some).collect::<Vec<_>>(),
                "{name}"
            );
            assert_eq!(replica.seq, end, "{name}");
            assert_eq!(
                &replica.state_hash,
                live,
                "{name}: snapshots at {:?} + tail differ",
                versions(metas)
            );
            // And so does a replay of everything into an empty model.
            let dir = tempfile::tempdir().unwrap();
            let (seq, hash) = engram_projectors::rebuild(
                name,
                &projectors_config(),
                dir.path(),
                nats.bus().await,
                |_, _| {},
            )
            .await
            .unwrap();
            assert_eq!(
                (seq, engram_snapshots::hex(&hash)),
                (end, live.clone()),
                "{name}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupt_snapshot_is_skipped_for_the_previous_good_one_or_a_full_replay() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let engram = Engram::start(&nats).await;
    let mut board = engram_docs::LocalDoc::genesis::<engram_docs::TaskBoard>().unwrap();
    let first = append_events(&engram, 0..40, &mut board).await;
    status(&bus, ProjectorName::FACTS, first).await;
    // The partition of team-0, which both batches write to.
    let p = partition_of(&bus, "acme", "team-0");
    let older = cut(&bus, ProjectorName::FACTS, Some("before-release")).await[p].clone();
    let second = append_events(&engram, 40..80, &mut board).await;
    status(&bus, ProjectorName::FACTS, second).await;
    let newer_cuts = cut(&bus, ProjectorName::FACTS, None).await;
    let newer = newer_cuts[p].clone();
    assert!(newer.version > older.version);
    let live = status(&bus, ProjectorName::FACTS, second).await.state_hash;
    engram.stop().await;

    // Given the newest snapshot's object overwritten with other bytes (truncated).
    let store = SnapshotStore::open(&bus, projectors_config().snapshots)
        .await
        .unwrap();
    let objects = bus
        .jetstream()
        .get_object_store("ENGRAM_SNAPSHOTS")
        .await
        .unwrap();
    let mut truncated = &store.load(&newer).await.unwrap()[..100];
    objects
        .put(newer.object.as_str(), &mut truncated)
        .await
        .unwrap();
    assert!(
        store.load(&newer).await.is_err(),
        "the corruption is detected"
    );

    // Then a new replica skips it, loads the partition's older one, and still reaches the
    // same state; the other partitions load their newest.
    let replica = new_replica(&nats, ProjectorName::FACTS).await;
    let mut expected: Vec<Option<u64>> = versions(&newer_cuts).into_iter().map(Some).collect();
    expected[p] = Some(older.version);
    assert_eq!(loaded(&replica), expected);
    let booted = &replica.partitions[p];
    assert_eq!(booted.skipped.len(), 1);
    assert_eq!(booted.skipped[0].0.version, newer.version);
    assert!(
        replica
            .partitions
            .iter()
            .filter(|b| b.partition as usize != p)
            .all(|b| b.skipped.is_empty())
    );
    assert_eq!(replica.state_hash, live);

    // And with the older one corrupt too (a flipped byte, same length), a full replay.
    let mut bytes = store.load(&older).await.unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    objects
        .put(older.object.as_str(), &mut &bytes[..])
        .await
        .unwrap();
    let replica = new_replica(&nats, ProjectorName::FACTS).await;
    expected[p] = None;
    assert_eq!(loaded(&replica), expected);
    assert_eq!(replica.partitions[p].skipped.len(), 2);
    assert_eq!(replica.state_hash, live);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn once_retention_removes_covered_history_a_replica_still_reaches_the_full_state() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let engram = Engram::start(&nats).await;
    let mut board = engram_docs::LocalDoc::genesis::<engram_docs::TaskBoard>().unwrap();
    let early = append_events(&engram, 0..50, &mut board).await;
    for name in EXPORTING {
        status(&bus, name, early).await;
        cut(&bus, name, Some("early")).await;
    }
    let covered = append_events(&engram, 50..150, &mut board).await;
    let mut snapshots = Vec::new();
    for name in EXPORTING {
        status(&bus, name, covered).await;
        snapshots.push(cut(&bus, name, None).await);
    }
    let end = append_events(&engram, 150..200, &mut board).await;
    let mut live = Vec::new();
    for name in EXPORTING {
        live.push(status(&bus, name, end).await.state_hash);
    }
    engram.stop().await;

    // Given a byte limit on the events stream, applied now, that keeps only the newest
    // events: the server removes the oldest, all of them covered by the second snapshots.
    let mut stream = bus.jetstream().get_stream("ENGRAM_EVENTS").await.unwrap();
    let info = stream.info().await.unwrap().clone();
    let per_event = info.state.bytes / info.state.messages;
    let mut config = info.config.clone();
    config.max_bytes = i64::try_from(per_event * (end - covered + 20)).unwrap();
    bus.jetstream().update_stream(config).await.unwrap();
    let first = stream.info().await.unwrap().state.first_sequence;
    assert!(
        first > early + 1 && first <= covered + 1,
        "retention kept from seq {first}"
    );

    for (name, live) in EXPORTING.into_iter().zip(&live) {
        // Then a new replica from the newest snapshot still reaches the full-history state.
        let replica = new_replica(&nats, name).await;
        assert_eq!(&replica.state_hash, live, "{name}");
        assert_eq!(replica.seq, end);
        // And a bootstrap from the early snapshot, whose tail is gone, is refused, as is a
        // replay from nothing: never a state with a gap.
        let dir = tempfile::tempdir().unwrap();
        let early_version = SnapshotStore::open(&bus, projectors_config().snapshots)
            .await
            .unwrap()
            .list(None)
            .await
            .unwrap()
            .into_iter()
            .filter(|m| {
                m.projector.starts_with(&format!("{name}-p")) && m.label.as_deref() == Some("early")
            })
            .map(|m| m.version)
            .max()
            .unwrap();
        let err = engram_projectors::rebuild_from_snapshot(
            name,
            &projectors_config(),
            dir.path(),
            connect(&nats).await,
            Some(early_version),
            |_, _| {},
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("retention removed"), "{err}");
        let err = engram_projectors::rebuild(
            name,
            &projectors_config(),
            dir.path(),
            connect(&nats).await,
            |_, _| {},
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("retention removed"), "{err}");
    }
}

fn team_scope(tenant: &str, team: &str) -> engram_memory::proto::ScopeRequest {
    engram_memory::proto::ScopeRequest {
        tenant: engram_schema::Ident::parse("tenant", tenant).unwrap(),
        scope: Scope::new(ScopeKind::Team, team).unwrap(),
        grants: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instance_bootstraps_its_scope_from_snapshots_and_the_tail() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let engram = Engram::start(&nats).await;
    let mut board = engram_docs::LocalDoc::genesis::<engram_docs::TaskBoard>().unwrap();
    // Another tenant's facts, on the same scope name, are in the same snapshots.
    let mut other = event(0, &mut board);
    other.tenant = engram_schema::Ident::parse("tenant", "globex").unwrap();
    other.scope = Scope::new(ScopeKind::Team, "team-0").unwrap();
    engram.client.append(&other).await.unwrap();
    let k = append_events(&engram, 0..120, &mut board).await;
    // The snapshots of team-0's partition are the ones its bootstrap uses.
    let p = partition_of(&bus, "acme", "team-0");
    let mut versions = Vec::new();
    for name in EXPORTING {
        status(&bus, name, k).await;
        versions.push(cut(&bus, name, None).await[p].version);
    }
    let end = append_events(&engram, 120..200, &mut board).await;
    for name in EXPORTING {
        status(&bus, name, end).await;
    }

    // When a new instance of team-0 bootstraps from snapshots (a scope this small would
    // otherwise be replayed, see below)...
    let scope = team_scope("acme", "team-0");
    let booted = engram.client.bootstrap_with(&scope, None, 0).await.unwrap();
    // ...then it says which snapshot each model came from, and replayed only the tail...
    let used: Vec<Option<u64>> = booted
        .snapshots
        .iter()
        .map(|(_, s)| s.as_ref().map(|s| s.version))
        .collect();
    assert_eq!(used, versions.iter().copied().map(Some).collect::<Vec<_>>());
    let full = engram.client.replay_scope(&scope).await.unwrap();
    let scope_events = 1 + (0..200).filter(|i| i % 3 == 0 || i % 5 == 3).count();
    assert!(
        booted.replayed < scope_events as u64 / 2,
        "{} of {scope_events} replayed",
        booted.replayed
    );
    // ...and its memory equals a replay of the scope's whole history.
    assert_eq!(booted.memory.state_hash(), full.state_hash());
    assert!(!booted.memory.facts.is_empty() && booted.memory.docs.len() == 1);
    // The other tenant's facts were never handed to it.
    let globex = engram_memory::ScopeKey::new(other.tenant.clone(), other.scope.clone());
    assert!(
        booted
            .memory
            .facts
            .as_of(&globex, chrono::Utc::now(), None, None, None)
            .is_empty()
    );
    // A scope this small is bootstrapped by replaying it, to the same memory.
    let replayed = engram.client.bootstrap(&scope, None).await.unwrap();
    assert!(replayed.snapshots.iter().all(|(_, s)| s.is_none()));
    assert!(
        replayed.replayed > booted.replayed,
        "the whole history ({}), not a tail ({})",
        replayed.replayed,
        booted.replayed
    );
    assert_eq!(replayed.memory.state_hash(), full.state_hash());
    // A grant the request may not hold is refused before anything is read.
    let mut sibling = scope.clone();
    sibling.grants = vec![Scope::new(ScopeKind::Team, "team-1").unwrap()];
    let err = engram
        .client
        .bootstrap(&sibling, None)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an ancestor"), "{err}");
}

/// SDK `client.snapshot(scope, label)`: every model that can export itself cuts one with the
/// label (a bootstrap can then start exactly there); a bad label is refused before anything
/// is cut; and labelled snapshots, which retention never deletes, are bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_cuts_labelled_snapshots_through_the_sdk_within_bounds() {
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let engram = Engram::start(&nats).await;
    let mut board = engram_docs::LocalDoc::genesis::<engram_docs::TaskBoard>().unwrap();
    let end = append_events(&engram, 0..30, &mut board).await;
    for name in EXPORTING {
        status(&bus, name, end).await;
    }
    let scope = team_scope("acme", "team-0");
    let cut = engram
        .client
        .snapshot(&scope, Some("before-deploy"))
        .await
        .unwrap();
    let labelled: Vec<&str> = cut
        .snapshots
        .iter()
        .filter(|m| m["label"] == "before-deploy")
        .map(|m| m["projector"].as_str().unwrap())
        .collect();
    // Every partition's instance of every model cut one.
    let p = partition_of(&bus, "acme", "team-0");
    for name in EXPORTING {
        for partition in 0..partitions(&bus) {
            let instance = engram_memory::proto::instance_name(name.as_str(), partition);
            assert!(labelled.contains(&instance.as_str()), "{instance}: {cut:?}");
        }
    }
    // The labelled versions are the ones a bootstrap can ask for.
    let facts_instance = engram_memory::proto::instance_name("facts", p as u32);
    let facts = cut
        .snapshots
        .iter()
        .find(|m| m["projector"] == facts_instance.as_str())
        .unwrap();
    let version = facts["version"].as_u64().unwrap();
    let booted = engram
        .client
        .bootstrap(&scope, Some(version))
        .await
        .unwrap();
    assert_eq!(
        booted.snapshots[0].1.as_ref().map(|s| s.label.clone()),
        Some(Some("before-deploy".to_owned()))
    );

    // A cut copies every model: within query.snapshot_min_interval another request gets
    // the last cut's answer, however much was written since.
    append_events(&engram, 200..210, &mut board).await;
    let again = engram.client.snapshot(&scope, None).await.unwrap();
    assert_eq!(again, cut);

    for bad in ["", "a b", "../x", "x*", &"y".repeat(65)] {
        let err = engram
            .client
            .snapshot(&scope, Some(bad))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("label"), "{bad:?}: {err}");
    }

    // Labelled snapshots are bounded per instance: once MAX_LABELLED are kept, another
    // label is refused with what to do, and nothing is stored.
    let mut seq = end;
    let mut refused = None;
    for i in 0..=engram_snapshots::MAX_LABELLED {
        seq = append_events(&engram, 30 + i..31 + i, &mut board).await;
        status(&bus, ProjectorName::FACTS, seq).await;
        let answer: Result<SnapshotMeta, _> = engram_rpc::call(
            bus.client(),
            &engram_memory::proto::partition_subject("facts", "snapshot", p as u32),
            &engram_projectors::SnapshotRequest {
                label: Some(format!("l{i}")),
                force: false,
            },
            Duration::from_secs(60),
        )
        .await;
        if let Err(e) = answer {
            refused = Some((i, e.to_string()));
            break;
        }
    }
    let (at, why) = refused.expect("a label beyond the bound is refused");
    assert_eq!(
        at,
        engram_snapshots::MAX_LABELLED - 1,
        "the one from the SDK counts"
    );
    assert!(why.contains("labelled snapshots"), "{why}");
    let _ = seq;
}

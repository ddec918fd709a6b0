//! A three-node JetStream cluster on loopback, its events stream's leader killed with
//! SIGKILL while an agent appends: every acknowledged event survives, each retried append
//! counts once, and the killed node catches up when it comes back.

use std::collections::HashMap;
use std::time::Duration;

use engram_bus::{Bus, BusConfig, StartAt};
use engram_natsd::{Cluster, ClusterOptions};
use engram_schema::Scope;
use engram_schema::SubjectFilter;
use engram_sdk::{Client, RetryPolicy};
use futures::StreamExt as _;

/// Events appended before the kill, and in all.
const BEFORE_KILL: usize = 40;
const EVENTS: usize = 200;

async fn cluster(dir: &std::path::Path) -> Cluster {
    let bin = tokio::task::spawn_blocking(engram_natsd::locate)
        .await
        .unwrap()
        .unwrap();
    Cluster::start(ClusterOptions::new(bin, dir.to_path_buf(), 3))
        .await
        .unwrap()
}

/// The node leading the events stream now, by index.
async fn leader(bus: &Bus, cluster: &Cluster) -> usize {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let info = bus.events_cluster().await.ok().flatten();
        if let Some(leader) = info.and_then(|(c, _)| c.leader)
            && let Some(i) = cluster.index_of(&leader)
        {
            return i;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no leader for the events stream"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every stored event's id, with how often it is stored.
async fn stored_ids(bus: &Bus) -> HashMap<String, usize> {
    let mut ids = HashMap::new();
    let mut events = bus
        .replay(&SubjectFilter::all(), StartAt::Beginning)
        .await
        .unwrap();
    while let Some(event) = events.next().await {
        *ids.entry(event.unwrap().event.event_id.to_string())
            .or_default() += 1;
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_stream_leader_loses_no_acknowledged_append_and_a_retry_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = cluster(dir.path()).await;
    let mut config = BusConfig {
        url: cluster.url(),
        ..BusConfig::default()
    };
    config.stream.replicas = 3;
    let bus = Bus::connect(config).await.unwrap();
    bus.wait_for_jetstream(Duration::from_secs(60))
        .await
        .unwrap();
    bus.provision().await.unwrap();
    assert_eq!(bus.replica_shortfalls().await.unwrap(), vec![]);
    let client = Client::from_bus(
        bus.clone(),
        RetryPolicy {
            max_elapsed: Duration::from_secs(90),
            ..RetryPolicy::default()
        },
    );

    let scope = Scope::new(engram_schema::ScopeKind::Task, "t1").unwrap();
    let event = |i: usize| engram_tests::embedded("acme", scope.clone(), "a1", &format!("n{i}"));
    let mut acked = Vec::new();
    let mut first = None;
    let mut killed = None;
    for i in 0..EVENTS {
        if i == BEFORE_KILL {
            let victim = leader(&bus, &cluster).await;
            cluster.node_mut(victim).kill().await;
            killed = Some(victim);
        }
        let e = event(i);
        let receipt = client
            .append(&e)
            .await
            .unwrap_or_else(|err| panic!("append {i} failed after the leader was killed: {err}"));
        assert!(!receipt.duplicate, "event {i} was new");
        first.get_or_insert((e.clone(), receipt.seq));
        acked.push(e.event_id.to_string());
    }
    let victim = killed.unwrap();
    let new_leader = leader(&bus, &cluster).await;
    assert_ne!(new_leader, victim, "the killed node cannot lead");

    // The first event, acknowledged by the old leader, appended again as a retry would be:
    // the new leader knows its id and stores nothing.
    let (e, seq) = first.unwrap();
    let again = client.append(&e).await.unwrap();
    assert!(again.duplicate, "a retried append was stored twice");
    assert_eq!(again.seq, seq);

    let ids = stored_ids(&bus).await;
    assert_eq!(ids.len(), EVENTS, "events stored");
    for id in &acked {
        assert_eq!(ids.get(id), Some(&1), "acknowledged event {id}");
    }

    // The killed node comes back on its store and catches up with the others.
    cluster.node_mut(victim).restart().await.unwrap();
    let victim_name = format!("engram-{victim}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (raft, messages) = bus.events_cluster().await.unwrap().expect("replicated");
        let caught_up = Bus::holds_current_copy(&raft, &victim_name);
        if caught_up && messages == EVENTS as u64 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the restarted node never caught up: {raft:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

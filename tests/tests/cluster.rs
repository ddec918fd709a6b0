//! A three-node JetStream cluster, faulted while agents append:
//! - on loopback, the events stream's leader killed with SIGKILL: every acknowledged event
//!   survives, each retried append counts once, and the killed node catches up when it
//!   comes back;
//! - each node in a network namespace of its own, the leader cut off the network while
//!   agents write on both sides: the cut-off side acknowledges nothing, the majority goes on,
//!   and after the heal every acknowledged event is stored exactly once, the retried ones
//!   from the cut-off side included.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Every stored event's id, with how often it is stored. A replay that finds the stream
/// between leaders (as just after a node rejoins) is tried again.
async fn stored_ids(bus: &Bus) -> HashMap<String, usize> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    'replay: loop {
        let mut ids = HashMap::new();
        let retry = |e: &dyn std::fmt::Display| {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the stream cannot be replayed: {e}"
            );
        };
        let mut events = match bus.replay(&SubjectFilter::all(), StartAt::Beginning).await {
            Ok(events) => events,
            Err(e) => {
                retry(&e);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => *ids.entry(event.event.event_id.to_string()).or_default() += 1,
                Err(e) => {
                    retry(&e);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue 'replay;
                }
            }
        }
        return ids;
    }
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

/// Events the majority side appends while the leader is cut off, and the cut-off side.
const MAJORITY: usize = 60;
const MINORITY: usize = 20;
/// How long the cut lasts at least: past the routes' ping timeout (2 s x 2) and the
/// majority's election of a new leader.
const CUT_FOR: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_the_network_acknowledges_nothing_that_is_later_lost() {
    let lan = match engram_natsd::lan::Lan::create(3) {
        Ok(lan) => lan,
        Err(why) => {
            eprintln!("skipped: this machine cannot make network namespaces ({why})");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("cluster.conf");
    // A cut route is found dead within 4 s rather than the default 4 minutes.
    std::fs::write(&conf, "ping_interval: \"2s\"\nping_max: 2\n").unwrap();
    let bin = tokio::task::spawn_blocking(engram_natsd::locate)
        .await
        .unwrap()
        .unwrap();
    let mut opts = ClusterOptions::new(bin, dir.path().join("cluster"), 3);
    opts.config_file = Some(conf);
    opts.placement = Some(lan.placement());
    let cluster = Cluster::start(opts).await.unwrap();
    let connect = |url: String| async move {
        let mut config = BusConfig {
            url,
            ..BusConfig::default()
        };
        config.stream.replicas = 3;
        config.ping_interval = Duration::from_secs(1);
        Bus::connect(config).await.unwrap()
    };
    let bus = connect(cluster.url()).await;
    bus.wait_for_jetstream(Duration::from_secs(60))
        .await
        .unwrap();
    bus.provision().await.unwrap();
    let retrying = RetryPolicy {
        max_elapsed: Duration::from_secs(120),
        ..RetryPolicy::default()
    };
    let scope = Scope::new(engram_schema::ScopeKind::Task, "t1").unwrap();
    let event = move |side: &str, i: usize| {
        engram_tests::embedded("acme", scope.clone(), "a1", &format!("{side} {i}"))
    };
    let client = Client::from_bus(bus.clone(), retrying);
    for i in 0..10 {
        client.append(&event("before", i)).await.unwrap();
    }

    // The cut-off side: the leader, and an agent connected to it alone from inside its
    // namespace, so that the agent's side of the network is the leader's.
    let victim = leader(&bus, &cluster).await;
    let victim_url = cluster.node(victim).url();
    let netns = lan.netns(victim);
    let healed = Arc::new(AtomicBool::new(false));
    let (cut_tx, cut_rx) = std::sync::mpsc::channel::<()>();
    let (connected_tx, connected_rx) = tokio::sync::oneshot::channel::<()>();
    let minority = std::thread::spawn({
        let healed = healed.clone();
        let event = event.clone();
        move || {
            engram_natsd::lan::enter(&netns);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let mut config = BusConfig {
                    url: victim_url,
                    ..BusConfig::default()
                };
                config.stream.replicas = 3;
                let client = Client::from_bus(Bus::connect(config).await.unwrap(), retrying);
                connected_tx.send(()).unwrap();
                tokio::task::spawn_blocking(move || cut_rx.recv().unwrap())
                    .await
                    .unwrap();
                // Every append retries (same event id) until the heal lets it through.
                let appends = (0..MINORITY).map(|i| {
                    let (client, e, healed) = (client.clone(), event("minority", i), &healed);
                    async move {
                        let result = client.append(&e).await;
                        let before_heal = !healed.load(Ordering::SeqCst);
                        (e.event_id.to_string(), result.map(|_| before_heal))
                    }
                });
                futures::future::join_all(appends).await
            })
        }
    });
    connected_rx.await.expect("the cut-off agent connected");

    lan.cut(victim);
    let cut_at = tokio::time::Instant::now();
    cut_tx.send(()).unwrap();
    // The majority side: an agent connected to the other two nodes only.
    let others: Vec<String> = (0..3)
        .filter(|&i| i != victim)
        .map(|i| cluster.node(i).url())
        .collect();
    let majority_bus = connect(others.join(",")).await;
    let majority = Client::from_bus(majority_bus.clone(), retrying);
    let mut acked: Vec<String> = Vec::new();
    for i in 0..MAJORITY {
        let e = event("majority", i);
        majority.append(&e).await.unwrap_or_else(|err| {
            panic!("append {i} on the majority side failed with the leader cut off: {err}")
        });
        acked.push(e.event_id.to_string());
    }
    let new_leader = leader(&majority_bus, &cluster).await;
    assert_ne!(new_leader, victim, "the cut-off node still leads");
    tokio::time::sleep_until(cut_at + CUT_FOR).await;
    healed.store(true, Ordering::SeqCst);
    lan.heal(victim);

    let results = tokio::task::spawn_blocking(move || minority.join().unwrap())
        .await
        .unwrap();
    for (id, result) in &results {
        match result {
            Ok(false) => acked.push(id.clone()),
            Ok(true) => panic!("the cut-off side acknowledged {id} before the heal"),
            Err(e) => panic!("the cut-off side's append {id} never went through: {e}"),
        }
    }

    // Every acknowledged event once, on every node: the healed one catches up.
    let total = 10 + MAJORITY + MINORITY;
    let victim_name = format!("engram-{victim}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (raft, messages) = majority_bus
            .events_cluster()
            .await
            .unwrap()
            .expect("replicated");
        if Bus::holds_current_copy(&raft, &victim_name) && messages == total as u64 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the healed node never caught up ({messages} of {total} events): {raft:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ids = stored_ids(&majority_bus).await;
    assert_eq!(ids.len(), total, "events stored");
    for id in &acked {
        assert_eq!(ids.get(id), Some(&1), "acknowledged event {id}");
    }
    drop(cluster);
}

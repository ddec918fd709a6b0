//! `engram up --cluster 3`: three managed nats-servers forming one JetStream cluster, every
//! stream kept on all three, and one authorization enforced by every node.

mod common;

use std::time::{Duration, Instant};

use common::{cli, ok, spawn_up, token};
use futures::TryStreamExt as _;

/// A connection to the one server `url` as the identity in `creds`.
async fn connect(url: &str, creds: &std::path::Path) -> Result<engram_bus::Bus, String> {
    let creds = engram_access::Credentials::load(creds).map_err(|e| e.to_string())?;
    let config = engram_bus::BusConfig {
        url: url.to_owned(),
        nkey: Some(engram_bus::NkeyAuth::of(&creds)),
        connect_timeout: Duration::from_secs(5),
        ..engram_bus::BusConfig::default()
    };
    engram_bus::Bus::connect(config)
        .await
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_keeps_every_stream_on_three_servers_and_every_node_enforces_one_registry() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let (_up, ready) = spawn_up(
        h,
        &["--cluster", "3", "--nats-port", "0"],
        Duration::from_secs(180),
    );
    let nats = token(&ready, "nats=").to_owned();
    let nodes: Vec<&str> = nats.split(',').collect();
    assert_eq!(nodes.len(), 3, "clients are given every node: {ready}");

    // Every stream Engram made (events, dead letters, the access registry, and the streams
    // behind working memory, leases, the memory nodes' bucket and snapshots) is on all
    // three servers.
    let admin = engram_access::creds::service_path(h, engram_access::RoleName::Admin);
    let bus = connect(&nats, &admin).await.unwrap();
    let mut replicas = std::collections::BTreeMap::new();
    let mut streams = bus.jetstream().streams();
    while let Some(info) = streams.try_next().await.unwrap() {
        replicas.insert(info.config.name.clone(), info.config.num_replicas);
    }
    for name in [
        "ENGRAM_EVENTS",
        "ENGRAM_DLQ",
        "ENGRAM_ACCESS",
        "KV_engram_working",
        "KV_ENGRAM_LEASES",
        "KV_ENGRAM_NODES",
        "KV_ENGRAM_SNAPSHOT_INDEX",
        "OBJ_ENGRAM_SNAPSHOTS",
    ] {
        assert_eq!(replicas.get(name), Some(&3), "{name}: {replicas:?}");
    }
    assert!(
        replicas.values().all(|r| *r == 3),
        "every stream has 3 replicas: {replicas:?}"
    );
    let streams: serde_json::Value =
        serde_json::from_str(&ok(cli(h).args(["--nats", &nats, "--json", "streams"]))).unwrap();
    assert_eq!(streams["replicas"], 3, "{streams}");
    assert_eq!(
        streams["replica_shortfalls"],
        serde_json::json!([]),
        "{streams}"
    );

    // An agent added while the cluster runs reaches every node: each one read the new
    // authorization.
    ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme"]));
    let added: serde_json::Value = serde_json::from_str(&ok(cli(h).args([
        "--nats", &nats, "--json", "agent", "add", "--tenant", "acme", "--agent", "planner",
    ])))
    .unwrap();
    let creds = std::path::PathBuf::from(added["creds"].as_str().unwrap());
    for node in &nodes {
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = connect(node, &creds).await {
            assert!(Instant::now() < deadline, "{node} never took the key: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // Connected to node 2, the key is revoked: that connection is closed, and no node lets
    // the key in again.
    let held = connect(nodes[2], &creds).await.unwrap();
    held.client().flush().await.unwrap();
    ok(cli(h).args([
        "--nats", &nats, "agent", "revoke", "--tenant", "acme", "--agent", "planner",
    ]));
    let deadline = Instant::now() + Duration::from_secs(30);
    while held.client().connection_state() == async_nats::connection::State::Connected {
        assert!(
            Instant::now() < deadline,
            "node 2 kept the revoked key's connection"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for node in &nodes {
        let error = connect(node, &creds)
            .await
            .err()
            .unwrap_or_else(|| panic!("{node} let a revoked key in"));
        assert!(error.contains("authoriz"), "{node}: {error}");
    }
}

//! Series engram's own process exports about where things run: the partitions its memory
//! node owns, one series each while it holds the lease; and the moves of the events
//! stream's leader, which its health sampler counts on a stream kept on three servers.
//!
//! A file of its own: metrics are process-wide, and a second in-process node (as the
//! `engram up` tests of health.rs start) would set and remove the same partitions' series.

mod common;

use std::time::Duration;

use engram::http::{LagCheck, LagLimits};
use engram_bus::{Bus, BusConfig};
use engram_natsd::{Cluster, ClusterOptions};
use engram_testkit::{TestNats, wait_until};

/// One series' value in the registry's text exposition, as `/metrics` serves it (`series` is
/// its name and labels); `None` when the registry has no such series.
fn scraped(series: &str) -> Option<f64> {
    engram_telemetry::metrics::render()
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The partitions with an `engram_node_partition_owned` series, and each one's value.
fn owned_series() -> Vec<(String, f64)> {
    engram_telemetry::metrics::render()
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("engram_node_partition_owned{partition=\"")?;
            let (partition, value) = rest.split_once("\"} ")?;
            Some((partition.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reports_each_partition_it_owns_and_drops_the_series_when_it_lets_go() {
    // Given engram up, whose one memory node takes every partition
    let nats = TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let config = common::in_process_up(home.path(), &nats.url());
    assert!(owned_series().is_empty(), "{:?}", owned_series());
    let running = engram::up::start(&config, 0).await.unwrap();

    // Then each partition has one series, at 1, and the count agrees
    let partitions = running.bus.config().stream.partitions;
    let mut owned = owned_series();
    owned.sort_by_key(|(p, _)| p.parse::<u32>().unwrap());
    let every: Vec<(String, f64)> = (0..partitions).map(|p| (p.to_string(), 1.0)).collect();
    assert_eq!(owned, every);
    assert_eq!(
        scraped("engram_node_partitions_owned"),
        Some(f64::from(partitions))
    );

    // When it stops, handing every partition back, then no series is left: a partition let
    // go is no series rather than a 0 beside its new owner's 1
    running.shutdown().await;
    assert_eq!(owned_series(), Vec::new());
    assert_eq!(scraped("engram_node_partitions_owned"), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_sampler_counts_each_move_of_the_events_streams_leader() {
    // Given the events stream kept on three servers, under a process's health sampler
    let dir = tempfile::tempdir().unwrap();
    let bin = tokio::task::spawn_blocking(engram_natsd::locate)
        .await
        .unwrap()
        .unwrap();
    let cluster = Cluster::start(ClusterOptions::new(bin, dir.path().to_owned(), 3))
        .await
        .unwrap();
    let mut config = BusConfig {
        url: cluster.url(),
        ..BusConfig::default()
    };
    // Its own name: the counter's series is labelled by stream, and no other test's moves.
    const STREAM: &str = "LEADER_MOVES";
    config.stream.name = STREAM.into();
    config.stream.replicas = 3;
    let bus = Bus::connect(config).await.unwrap();
    bus.wait_for_jetstream(Duration::from_secs(60))
        .await
        .unwrap();
    bus.provision().await.unwrap();
    let lag = LagCheck::new(
        Box::new(Vec::new),
        LagLimits {
            max_lag_events: 1_000,
            // Samples every 100 ms.
            grace: Duration::from_millis(400),
        },
    );
    let sampler = lag.spawn_sampler(bus.clone());
    let moves = || {
        scraped(&format!(
            "engram_stream_leader_changes_total{{stream=\"{STREAM}\"}}"
        ))
    };
    // (at 0 from the start)
    assert_eq!(moves(), Some(0.0));
    let leader = || async { bus.stream_state().await.ok().and_then(|s| s.leader) };
    wait_until(
        "a leader of the stream",
        Duration::from_secs(30),
        || async { leader().await.is_some() },
    )
    .await;
    // Several samples of the first leader: no move
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(moves(), Some(0.0));

    for expected in [1.0, 2.0] {
        // When the leader steps down and another server is elected
        let before = leader().await;
        let answer = bus
            .client()
            .request(
                format!("$JS.API.STREAM.LEADER.STEPDOWN.{STREAM}"),
                Default::default(),
            )
            .await
            .unwrap();
        let answer: serde_json::Value = serde_json::from_slice(&answer.payload).unwrap();
        assert_eq!(answer["success"], true, "{answer}");
        wait_until("another leader", Duration::from_secs(30), || async {
            let now = leader().await;
            now.is_some() && now != before
        })
        .await;

        // Then the sampler counts one move
        wait_until(
            "the move to be counted",
            Duration::from_secs(10),
            || async { moves() == Some(expected) },
        )
        .await;
    }
    sampler.abort();
}

//! The load test and the benchmarks this crate ships, run as their binaries on inputs small
//! enough for the test suite: the published figures come from code known to work. Speed is
//! not checked (a debug build on a shared machine says nothing about it); that each run
//! completes, verifies what it must and reports what it measured is.

use std::process::Command;
use std::time::Duration;

use engram_embed::EmbedderConfig;
use engram_loadtest::fleet::target::{CLIENT_DIM, CLIENT_MODEL};
use engram_projectors::ProjectorsConfig;
use serde_json::Value;

fn run(bin: &str, args: &[&str]) -> std::process::Output {
    let out = Command::new(bin).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{bin} {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json_file(path: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn bench_append_measures_engram_and_raw_publishes_of_the_same_events() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("append.json");
    run(
        env!("CARGO_BIN_EXE_bench-append"),
        &[
            "--agents",
            "4",
            "--events-per-agent",
            "5",
            "--warmup",
            "0",
            "--connections",
            "1",
            "--seed",
            "1",
            "--json",
            report.to_str().unwrap(),
        ],
    );
    let report = json_file(&report);
    for phase in ["engram", "raw"] {
        assert_eq!(report[phase]["events"], 20, "{phase}: {report:#}");
        assert_eq!(report[phase]["errors"], 0, "{phase}: {report:#}");
        assert_eq!(
            report[phase]["bytes"], report["engram"]["bytes"],
            "{report:#}"
        );
    }
}

#[test]
fn bench_project_rebuilds_every_projector_beside_a_raw_replay() {
    let out = run(
        env!("CARGO_BIN_EXE_bench-project"),
        &[
            "--events",
            "300",
            "--embed-events",
            "0",
            "--scopes",
            "3",
            "--seed",
            "1",
            "--json",
        ],
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = &report["projectors"];
    assert_eq!(p["raw_ordered"]["count"], 300, "{report:#}");
    let rebuilds = p["rebuilds"].as_array().expect("rebuilds");
    let names: Vec<&str> = rebuilds
        .iter()
        .filter_map(|r| r["projector"].as_str())
        .collect();
    let registered: Vec<&str> = engram_projectors::ProjectorName::all()
        .into_iter()
        .map(|n| n.as_str())
        .collect();
    assert_eq!(names, registered, "{report:#}");
    for r in rebuilds {
        assert_eq!(r["applied"], 300, "{r:#}");
    }
}

/// The `loadtest` binary against a deployment it did not start (Engram in this process), as
/// `loadtest --nats <url>` runs: a short run that must verify clean and write its report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadtest_drives_a_deployment_and_verifies_it() {
    let nats = engram_testkit::TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let config = engram::config::Config {
        home: home.path().to_owned(),
        nats: engram::config::NatsConfig {
            url: Some(nats.url()),
            ..Default::default()
        },
        http: engram::config::HttpConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..Default::default()
        },
        projectors: ProjectorsConfig {
            embedder: EmbedderConfig::ClientSupplied {
                model: CLIENT_MODEL.into(),
                dim: CLIENT_DIM,
            },
            embed_cache_memory_mb: 4,
            embed_cache_disk_mb: 8,
            ..ProjectorsConfig::default()
        },
        ..Default::default()
    };
    let running = engram::up::start(&config).await.unwrap();
    let out_dir = home.path().join("report");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["--nats", &nats.url(), "--embedder", "client"])
        .args(["--instances", "6", "--team-size", "3", "--rate", "12"])
        .args(["--duration", "3", "--reference", "1", "--drain-limit", "60"])
        .args(["--seed", "11", "--out"])
        .arg(&out_dir)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), out)
        .await
        .expect("the load test finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("# Engram load test: PASSED"), "{stdout}");
    let report = json_file(&out_dir.join("report.json"));
    assert_eq!(report["verification"]["lost"], 0);
    assert!(
        report["appends"].as_u64().is_some_and(|n| n > 0),
        "{report:#}"
    );
    for chart in ["latency.svg", "lag.svg", "throughput.svg", "resources.svg"] {
        assert!(out_dir.join(chart).is_file(), "no {chart}");
    }
    running.shutdown().await;
}

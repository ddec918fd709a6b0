//! The load test and the benchmarks this crate ships, run as their binaries on inputs small
//! enough for the test suite: the published figures come from code known to work. Speed is
//! not checked (a debug build on a shared machine says nothing about it); that each run
//! completes, verifies what it must and reports what it measured is.

mod common;

use std::process::Command;
use std::time::Duration;

use engram_projectors::consolidator::ConsolidatorConfig;
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
/// `loadtest --nats <url> --metrics <url>` runs: a short run that must verify clean and write
/// its report. Every identity dies once and its successor bootstraps; the consolidator runs
/// every second; each projector is asked for snapshots during the load and once after it.
/// The new figures must be there and make sense; none is timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadtest_drives_a_deployment_and_verifies_it() {
    let nats = engram_testkit::TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let config = common::deployment(home.path(), nats.url(), |projectors| {
        projectors.consolidator = ConsolidatorConfig {
            interval: Duration::from_secs(1),
            ..ConsolidatorConfig::default()
        };
    });
    let running = engram::up::start(&config, 0).await.unwrap();
    let out_dir = home.path().join("report");
    let metrics = format!("http://{}/metrics", running.http_addr);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["--nats", &nats.url(), "--embedder", "client"])
        .args(["--metrics", &metrics])
        .args(["--instances", "6", "--team-size", "3", "--rate", "12"])
        .args(["--duration", "4", "--reference", "1", "--drain-limit", "60"])
        .args(["--churn", "1", "--snapshot-every", "1", "--doc-edit", "0.5"])
        .args(["--duplicates", "0.3", "--finish-every", "4"])
        // Keeping up is the machine's speed, which this test does not check.
        .arg("--allow-overload")
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
    let headline = stdout.lines().next().unwrap_or_default();
    assert!(
        headline.starts_with("# Engram load test: ")
            && headline.contains(" — correctness PASSED; load "),
        "{stdout}"
    );
    let report = json_file(&out_dir.join("report.json"));
    assert_eq!(report["verification"]["lost"], 0);
    assert!(
        report["appends"].as_u64().is_some_and(|n| n > 0),
        "{report:#}"
    );
    for chart in ["latency.svg", "lag.svg", "throughput.svg", "resources.svg"] {
        assert!(out_dir.join(chart).is_file(), "no {chart}");
    }
    for section in ["## Takeovers", "## Consolidation", "## Snapshots"] {
        assert!(stdout.contains(section), "no {section}: {stdout}");
    }

    // Takeovers bootstrap, and are timed beside the replay of the same scopes.
    let takeovers = report["takeovers"].as_u64().unwrap();
    assert!(takeovers >= 1, "{report:#}");
    let bootstraps = &report["bootstraps"];
    assert_eq!(
        bootstraps["completed"].as_u64(),
        Some(takeovers),
        "{bootstraps:#}"
    );
    assert_eq!(bootstraps["failed"], 0, "{bootstraps:#}");
    assert!(bootstraps["from_snapshot"].as_u64().unwrap() <= takeovers);
    let latency = &report["latency_ms"];
    assert_eq!(
        latency["takeover_bootstrap"]["count"].as_u64(),
        Some(takeovers)
    );
    assert_eq!(
        latency["takeover_replay"]["count"].as_u64(),
        Some(takeovers)
    );

    // The consolidator ran during the load, and what it hid is counted.
    let c = &report["consolidation"];
    assert!(c["runs"].as_u64().is_some_and(|n| n >= 1), "{c:#}");
    assert!(
        c["run_secs_total"].as_f64().is_some_and(|s| s >= 0.0),
        "{c:#}"
    );
    assert!(c["events_applied"].as_u64().is_some_and(|n| n > 0), "{c:#}");
    assert!(c["run_us_per_event"].as_f64().is_some(), "{c:#}");
    assert!(c["lag_max_events"].as_u64().is_some(), "{c:#}");
    assert!(c["caught_up_secs_after_load"].as_f64().is_some(), "{c:#}");
    // Engram runs in this process, not in one of its own: its CPU is not the consolidator's.
    assert!(c["process_cpu_us_per_event"].is_null(), "{c:#}");
    assert!(c["absent"]["process_cpu_us_per_event"].is_string(), "{c:#}");
    let shrink = &c["shrink"];
    let (before, after) = (
        shrink["before"].as_u64().unwrap(),
        shrink["after"].as_u64().unwrap(),
    );
    assert!(before > 0, "{shrink:#}");
    assert_eq!(
        after + shrink["hidden"].as_u64().unwrap(),
        before + shrink["added"].as_u64().unwrap(),
        "{shrink:#}"
    );
    let docs = &report["docs_merge"];
    assert!(
        docs["doc_changes"].as_u64().is_some_and(|n| n > 0),
        "{docs:#}"
    );
    assert!(docs["busy_secs"].as_f64().is_some(), "{docs:#}");

    // Every projector is in the snapshot table: those whose model exports itself with a cut
    // after the load, the others with the reason they keep none.
    let snapshots = report["snapshots"].as_array().unwrap();
    let names: Vec<&str> = snapshots
        .iter()
        .filter_map(|s| s["projector"].as_str())
        .collect();
    assert_eq!(
        names,
        engram_loadtest::fleet::target::projectors(),
        "{:#}",
        report["snapshots"]
    );
    for s in snapshots {
        if s["refused"].is_string() {
            assert!(s["final_cut"].is_null(), "{s:#}");
            continue;
        }
        assert!(
            s["final_cut"]["bytes"].as_u64().is_some_and(|b| b > 0),
            "{s:#}"
        );
        assert!(
            s["final_cut"]["version"].as_u64().is_some_and(|v| v > 0),
            "{s:#}"
        );
    }
    for exporting in ["facts", "skills", "docs", "consolidator"] {
        let s = snapshots
            .iter()
            .find(|s| s["projector"] == exporting)
            .unwrap();
        assert!(s["refused"].is_null(), "{s:#}");
    }
    running.shutdown().await;
}

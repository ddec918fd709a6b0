//! A run that does not sustain its target rate says so in its headline, beside its verdict on
//! correctness, and the `loadtest` binary exits non-zero for it unless `--allow-overload` is
//! given.
//!
//! The shortfall is made certain by the schedule, not by the machine's speed: each instance
//! runs its steps in order, one acknowledged append at least each, so 2 instances at a target
//! of 1,000,000 appends/s would have to finish every step, a JetStream write acknowledged over
//! TCP, within 2 µs. No machine does; nearly all of the 2,000,000 scheduled steps are missed.

mod common;

use std::time::Duration;

use serde_json::Value;

/// Runs the binary against `nats` with an unreachable target, `extra` appended to its flags
/// (a seed of its own each time: see below).
async fn overloaded_run(nats: &str, out_dir: &std::path::Path, extra: &[&str]) -> (i32, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["--nats", nats, "--embedder", "client"])
        .args(["--instances", "2", "--team-size", "2", "--rate", "1000000"])
        .args(["--duration", "2", "--reference", "0.001"])
        .args(["--drain-limit", "60"])
        .args(["--churn", "0", "--snapshot-every", "0"])
        .args(extra)
        .arg("--out")
        .arg(out_dir)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), out)
        .await
        .expect("the load test finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code().expect("exited, not killed");
    (code, format!("{stdout}\n--- stderr ---\n{stderr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_does_not_sustain_its_target_says_so_and_fails_unless_allowed() {
    let nats = engram_testkit::TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let config = common::deployment(home.path(), nats.url(), |_| {});
    let running = engram::up::start(&config, 0).await.unwrap();

    // Without the flag: correct, not sustained, exit code 3.
    let strict = home.path().join("strict");
    let (code, output) = overloaded_run(&nats.url(), &strict, &["--seed", "5"]).await;
    assert_eq!(code, 3, "{output}");
    let headline = output.lines().next().unwrap();
    assert!(
        headline.starts_with(
            "# Engram load test: NOT SUSTAINED — correctness PASSED; load NOT SUSTAINED: "
        ),
        "{output}"
    );
    assert!(
        output.contains("**The target rate was not sustained**"),
        "{output}"
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(strict.join("report.json")).unwrap())
            .unwrap();
    let load = &report["load"];
    assert_eq!(load["sustained"], false, "{load:#}");
    // Every scheduled step is accounted for. 2 instances, one step every 2 µs each for 2 s:
    // each identity's steps start at an offset within its first period, so it holds the
    // load's length in periods, rounded down or up (the period is 2 µs as f64 makes it).
    let period = Duration::from_secs_f64(2.0 / 1_000_000.0).as_nanos();
    let periods = Duration::from_secs(2).as_nanos() / period;
    let (least, most) = (2 * periods, 2 * (periods + 1));
    let problems = &report["problems"];
    let due = problems["steps_due"].as_u64().unwrap();
    assert!(
        (least..=most).contains(&u128::from(due)),
        "{due} steps due, not {least} to {most}"
    );
    let (run, missed) = (
        problems["steps_run"].as_u64().unwrap(),
        problems["missed_steps"].as_u64().unwrap(),
    );
    assert_eq!(run + missed, due, "{problems:#}");
    assert!(run > 0, "{problems:#}");
    assert_eq!(load["steps_reached"].as_u64(), Some(due), "{load:#}");
    assert_eq!(load["steps_missed"].as_u64(), Some(missed), "{load:#}");
    assert!(
        headline.contains(&format!("{missed} of {due} scheduled steps never ran")),
        "{headline}"
    );
    assert_eq!(report["verification"]["lost"], 0, "{output}");

    // With it: the same verdicts in the headline, and exit code 0. (Another seed: the same
    // one would write the same markers again, and a recall would find the first run's write.)
    let allowed = home.path().join("allowed");
    let (code, output) =
        overloaded_run(&nats.url(), &allowed, &["--seed", "6", "--allow-overload"]).await;
    assert_eq!(code, 0, "{output}");
    let headline = output.lines().next().unwrap();
    assert!(
        headline.starts_with(
            "# Engram load test: NOT SUSTAINED — correctness PASSED; load NOT SUSTAINED: "
        ) && headline.ends_with("(accepted: --allow-overload)"),
        "{output}"
    );
    running.shutdown().await;
}

/// `--find-capacity` against a deployment: each rate's run in a directory of its own, the
/// capacity report beside them. The verdicts are made certain by the schedule: 2 instances at
/// 0.5 steps/s for 4 s have one step each (a period of 4 s), so there is no later step to
/// miss and the run holds if it passes; the one search run allowed ends the search there, and
/// the overload run at 10× the capacity is judged against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capacity_search_reports_each_rate_and_judges_the_overload_run() {
    let nats = engram_testkit::TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let config = common::deployment(home.path(), nats.url(), |_| {});
    let running = engram::up::start(&config, 0).await.unwrap();
    let out_dir = home.path().join("capacity");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["--nats", &nats.url(), "--embedder", "client"])
        .args(["--instances", "2", "--team-size", "2", "--rate", "0.5"])
        .args([
            "--duration",
            "4",
            "--reference",
            "0.001",
            "--drain-limit",
            "60",
        ])
        .args(["--churn", "0", "--snapshot-every", "0", "--seed", "21"])
        .args([
            "--find-capacity",
            "--capacity-runs",
            "1",
            "--overload",
            "10",
        ])
        .arg("--out")
        .arg(&out_dir)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), out)
        .await
        .expect("the search finishes")
        .unwrap();
    let output = format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{output}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("capacity.json")).unwrap())
            .unwrap();
    assert_eq!(report["capacity"], 0.5, "{report:#}");
    let rates: Vec<f64> = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rate"].as_f64().unwrap())
        .collect();
    assert_eq!(rates, vec![0.5, 5.0], "{report:#}");
    for (rate, dir) in [(0.5, "rate-0.5"), (5.0, "rate-5")] {
        let run: Value = serde_json::from_str(
            &std::fs::read_to_string(out_dir.join(dir).join("report.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(run["config"]["rate"], rate, "{dir}");
        assert_eq!(run["verification"]["lost"], 0, "{dir}");
    }
    let overload = &report["overload"][0];
    assert_eq!(overload["rate"], 5.0, "{report:#}");
    assert_eq!(overload["factor"], 10.0, "{report:#}");
    let markdown = std::fs::read_to_string(out_dir.join("capacity.md")).unwrap();
    assert!(
        markdown.starts_with("# Capacity: 0.5 steps/s held with 2 instances (seed 21)"),
        "{markdown}"
    );
    assert!(markdown.contains("## Above capacity"), "{markdown}");
    running.shutdown().await;
}

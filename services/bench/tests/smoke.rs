//! The benchmarks run, on inputs small enough for the test suite, and report what they
//! measured: the published figures come from code known to work. The numbers themselves are
//! not checked here (a debug build on a shared machine says nothing about speed); their
//! presence and their counts are.

use std::process::Command;

use serde_json::{Value, json};

const BENCH: &str = env!("CARGO_BIN_EXE_engram-bench");

fn run(args: &[&str], home: &std::path::Path) -> Value {
    let out = Command::new(BENCH)
        .arg("--home")
        .arg(home)
        .args(args)
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_HOME")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "engram-bench {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "engram-bench {args:?} printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// A conversation in LoCoMo's format: two sessions of three turns, three questions.
fn tiny_locomo() -> Value {
    let turn = |speaker: &str, id: &str, text: &str| json!({"speaker": speaker, "dia_id": id, "text": text});
    json!([{
        "sample_id": "conv-tiny",
        "conversation": {
            "speaker_a": "Ada",
            "speaker_b": "Bo",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [
                turn("Ada", "D1:1", "I adopted a grey cat called Pixel last week."),
                turn("Bo", "D1:2", "Lovely! I started learning the cello in April."),
                turn("Ada", "D1:3", "Pixel sleeps on my keyboard all day."),
            ],
            "session_2_date_time": "9:10 am on 20 May, 2023",
            "session_2": [
                turn("Bo", "D2:1", "My cello teacher says I am improving fast."),
                turn("Ada", "D2:2", "We are moving to Lisbon in the autumn."),
                turn("Bo", "D2:3", "Lisbon is beautiful, you will love the trams."),
            ],
        },
        "qa": [
            {"question": "What is the name of Ada's cat?", "answer": "Pixel", "evidence": ["D1:1"], "category": 4},
            {"question": "When did Bo start learning the cello?", "answer": "April 2023", "evidence": ["D1:2"], "category": 2},
            {"question": "Where is Ada moving?", "answer": "Lisbon", "evidence": ["D2:2"], "category": 4},
        ],
    }])
}

#[test]
fn locomo_ingests_a_conversation_and_scores_every_mode() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tiny.json");
    std::fs::write(&data, tiny_locomo().to_string()).unwrap();
    let report = run(
        &[
            "--json",
            "locomo",
            "--data",
            data.to_str().unwrap(),
            "--top-k",
            "20",
            "--consolidation",
        ],
        &dir.path().join("home"),
    );
    assert_eq!(report["dataset"]["questions_asked"], 3, "{report:#}");
    // Every mode asked all three; with 20 results from a scope of 6 turns, each retriever
    // returns every turn that matches at all, and each question's evidence turn does; so
    // does the consolidated tenant's, whose summaries stand for turns they quote.
    for mode in [
        "dense-cold",
        "hybrid",
        "hybrid-rrf",
        "dense",
        "bm25",
        "hybrid-consolidated",
    ] {
        let overall = &report["modes"][mode]["overall"];
        assert_eq!(overall["questions"], 3, "{mode}: {report:#}");
        assert_eq!(overall["turn_recall"]["20"], 1.0, "{mode}: {report:#}");
    }
}

#[test]
fn query_measures_the_service_beside_exact_and_graph_search() {
    let dir = tempfile::tempdir().unwrap();
    let report = run(
        &[
            "--json",
            "query",
            "--memories",
            "300",
            "--queries",
            "5",
            "--top-k",
            "5",
        ],
        &dir.path().join("home"),
    );
    for field in [
        "index_exact",
        "index_graph",
        "index_graph_recall",
        "service_dense_recall",
    ] {
        assert!(report.get(field).is_some(), "no {field} in {report:#}");
    }
    assert!(
        report["service_dense_recall"]
            .as_f64()
            .is_some_and(|r| r > 0.0)
    );
}

#[test]
fn facts_measures_the_fact_table_and_its_snapshot_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let report = run(
        &[
            "--json",
            "facts",
            "--events",
            "500",
            "--queries",
            "50",
            "--repeated",
            "20",
        ],
        &dir.path().join("home"),
    );
    let runs = report["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{report:#}");
    for run in runs {
        assert_eq!(run["events"], 500, "{run:#}");
        assert!(
            run["fact_versions"].as_u64().is_some_and(|n| n > 0),
            "{run:#}"
        );
        assert_eq!(run["snapshot_restores_equal"], true, "{run:#}");
    }
    assert_eq!(report["repeated"]["times"], 20, "{report:#}");
}

#[test]
fn bootstrap_compares_a_replica_from_a_snapshot_with_a_full_replay() {
    let dir = tempfile::tempdir().unwrap();
    let report = run(
        &[
            "--json",
            "bootstrap",
            "--events",
            "1500",
            "--tail",
            "100",
            "--scopes",
            "5",
        ],
        &dir.path().join("home"),
    );
    assert_eq!(report["events"], 1500, "{report:#}");
    let models = report["models"].as_array().expect("models");
    let names: Vec<&str> = models
        .iter()
        .map(|m| m["projector"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["vector", "keyword", "facts", "skills", "docs"],
        "{report:#}"
    );
    for m in models {
        assert_eq!(m["equal"], true, "{m:#}");
        assert_eq!(m["snapshot_version"], 1400, "{m:#}");
    }
    assert!(
        report["ratio"].as_f64().is_some_and(|r| r > 0.0),
        "{report:#}"
    );
}

#[test]
fn docs_merges_a_team_editing_one_board() {
    let dir = tempfile::tempdir().unwrap();
    let report = run(
        &[
            "--json",
            "docs",
            "--writers",
            "10",
            "--edits",
            "4",
            "--items",
            "5",
        ],
        &dir.path().join("home"),
    );
    assert_eq!(report["complete"], true, "{report:#}");
    assert_eq!(report["held"], 0, "{report:#}");
    assert!(
        report["conflicts"].as_u64().is_some_and(|c| c > 0),
        "concurrent owners: {report:#}"
    );
}

#[test]
fn gateway_measures_the_http_api_beside_the_native_path() {
    let dir = tempfile::tempdir().unwrap();
    let report = run(
        &[
            "--json",
            "gateway",
            "--memories",
            "40",
            "--requests",
            "5",
            "--top-k",
            "5",
        ],
        &dir.path().join("home"),
    );
    assert_eq!(report["memories"], 40, "{report:#}");
    assert_eq!(report["requests"], 5, "{report:#}");
    let pairs = report["pairs"].as_array().expect("pairs");
    let operations: Vec<&str> = pairs
        .iter()
        .map(|p| p["operation"].as_str().unwrap())
        .collect();
    assert_eq!(operations, ["append", "retrieve"], "{report:#}");
    for pair in pairs {
        for path in ["native", "gateway"] {
            assert!(
                pair[path]["p50_ms"].as_f64().is_some_and(|ms| ms > 0.0),
                "{path}: {report:#}"
            );
        }
        assert!(
            pair["p99_ratio"].as_f64().is_some_and(|r| r > 0.0),
            "{report:#}"
        );
    }
    assert!(
        report["http_floor"]["p50_ms"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0),
        "{report:#}"
    );
}

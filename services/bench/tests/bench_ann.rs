//! `bench-ann` runs, on an index small enough for the test suite, and reports exact search
//! beside HNSW of the same vectors, with the recall of each swept ef against exact.

use std::process::Command;

#[test]
fn bench_ann_reports_graph_search_against_exact_search() {
    let out = Command::new(env!("CARGO_BIN_EXE_bench-ann"))
        .args([
            "--sizes",
            "300",
            "--dim",
            "16",
            "--queries",
            "5",
            "--k",
            "5",
        ])
        .args([
            "--ef",
            "16,32",
            "--inserts",
            "10",
            "--filter-fractions",
            "0.5",
        ])
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let size = &report["sizes"][0];
    assert_eq!(size["vectors"], 300, "{report:#}");
    assert!(size["exact"]["p50_ms"].as_f64().is_some(), "{report:#}");
    let efs: Vec<u64> = size["ann"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|run| run["ef"].as_u64())
        .collect();
    assert_eq!(efs, [16, 32], "{report:#}");
    for run in size["ann"].as_array().unwrap() {
        let recall = run["recall"].as_f64().unwrap();
        assert!(recall > 0.0 && recall <= 1.0, "{run:#}");
    }
    assert_eq!(size["filtered"][0]["allowed_fraction"], 0.5, "{report:#}");
}

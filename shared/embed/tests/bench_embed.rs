//! `bench-embed` runs on a handful of sentences and reports MiniLM bare, behind a cold cache,
//! a warm one and a reopened one, with the hits and misses each phase must have.

use std::process::Command;

#[test]
fn bench_embed_reports_every_phase_with_its_cache_hits() {
    let out = Command::new(env!("CARGO_BIN_EXE_bench-embed"))
        .args(["--sentences", "4", "--batch", "2", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["sentences"], 4, "{report:#}");
    let phases = report["results"].as_array().expect("results");
    let hits = |name: &str| {
        let phase = phases
            .iter()
            .find(|p| p["phase"].as_str().is_some_and(|n| n.starts_with(name)))
            .unwrap_or_else(|| panic!("no {name} phase in {report:#}"));
        (phase["hits"].as_u64(), phase["misses"].as_u64())
    };
    assert_eq!(hits("cache cold"), (Some(0), Some(4)));
    assert_eq!(hits("cache warm"), (Some(4), Some(0)));
    assert_eq!(hits("cache reopened"), (Some(4), Some(0)));
}

//! `bench-embed` runs on a handful of sentences and reports MiniLM bare, behind a cold cache,
//! a warm one and a reopened one, with the hits and misses each phase must have.

use std::process::Command;

#[test]
fn bench_embed_reports_every_phase_with_its_cache_hits() {
    let out = Command::new(env!("CARGO_BIN_EXE_bench-embed"))
        .args([
            "--sentences",
            "4",
            "--queries",
            "5",
            "--batch",
            "2",
            "--json",
            "--gemm-seconds",
            "0.05",
        ])
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

/// The roofline: the model's arithmetic per text, the GEMM rate at each of the model's three
/// dense shapes, and the efficiency between them; and a baseline binary run on the same
/// sentences (here this build itself).
#[test]
fn bench_embed_reports_its_roofline_and_a_baseline_beside_it() {
    let me = env!("CARGO_BIN_EXE_bench-embed");
    let out = Command::new(me)
        .args([
            "--sentences",
            "3",
            "--queries",
            "5",
            "--batch",
            "3",
            "--json",
            "--agent-length",
        ])
        .args(["--gemm-seconds", "0.05", "--baseline", me])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Agent-length: 70 to 95 words, about 87 to 120 tokens.
    let tokens = report["mean_tokens"].as_f64().unwrap();
    assert!((80.0..=140.0).contains(&tokens), "{report:#}");
    // MiniLM: 6 layers of 384 and 1536; about 2.2 GFLOP at 100 tokens.
    let per_text = report["model_gflop_per_text"].as_f64().unwrap();
    assert!((1.5..3.5).contains(&per_text), "{report:#}");
    let gemm = report["gemm"].as_array().unwrap();
    assert_eq!(gemm.len(), 3, "{report:#}");
    let shapes: Vec<(u64, u64)> = gemm
        .iter()
        .map(|g| (g["k"].as_u64().unwrap(), g["n"].as_u64().unwrap()))
        .collect();
    assert_eq!(shapes, [(384, 384), (384, 1536), (1536, 384)]);
    let efficiency = report["efficiency"].as_f64().unwrap();
    assert!(efficiency > 0.0, "{report:#}");
    // The precision the model ran in (auto: the best this CPU has), and with a narrow
    // kernel (bf16 or int8) that kernel's own peak beside f32's.
    let precision = report["precision"].as_str().unwrap();
    assert_eq!(
        precision,
        engram_embed::Precision::Auto.resolve().unwrap().as_str(),
        "{report:#}"
    );
    match precision {
        "bf16" | "int8" => {
            assert!(
                report["kernel_peak_gflops"].as_f64().unwrap() > 0.0,
                "{report:#}"
            );
            assert_eq!(report["kernel"].as_array().unwrap().len(), 3);
        }
        "f32" => assert!(report["kernel_peak_gflops"].is_null(), "{report:#}"),
        other => panic!("precision {other}"),
    }
    assert!(report["baseline_sentences_per_sec"].as_f64().unwrap() > 0.0);
    assert!(report["speedup_vs_baseline"].as_f64().unwrap() > 0.0);
    // A query's latency: one short text at a time.
    let (p50, p99) = (
        report["query_ms_p50"].as_f64().unwrap(),
        report["query_ms_p99"].as_f64().unwrap(),
    );
    assert!(p50 > 0.0 && p99 >= p50, "{report:#}");
}

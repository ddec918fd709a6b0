//! Measures MiniLM throughput bare and behind the embedding cache (cold, warm, after reopen),
//! and its roofline: the model's achieved FLOP/s against the f32 GEMM peak that candle (the
//! library the model runs on) reaches at the model's shapes on this machine, in the same run.
//! With `--baseline <another bench-embed>`, that binary (an earlier build) embeds the same
//! sentences in the same run, for a speed-up measured side by side.
//!
//! `cargo run --release -p engram-embed --bin bench-embed -- --sentences 1000 --agent-length`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use engram_embed::{CacheConfig, CachedEmbedder, Embedder, MiniLm};

#[derive(Parser)]
#[command(about = "measure MiniLM embedding throughput, bare and through the embedding cache")]
struct Args {
    /// How many sentences to embed.
    #[arg(long, default_value_t = 1000)]
    sentences: usize,
    /// Read sentences from this file, one per line, instead of generating them.
    #[arg(long)]
    file: Option<PathBuf>,
    /// The dense products' arithmetic: auto (bf16, else int8, where the CPU has it), f32, bf16
    /// or int8.
    #[arg(long, default_value = "auto", value_parser = parse_precision)]
    precision: engram_embed::Precision,
    /// Texts per forward pass; default: the embedder's own (and the baseline's own).
    #[arg(long)]
    batch: Option<usize>,
    /// Cache directory; default: a fresh temporary directory, removed afterwards.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Generate agent-length texts (about 87 to 120 tokens) instead of 8 to 40 words.
    #[arg(long)]
    agent_length: bool,
    /// Skip the GEMM peak measurement (the roofline).
    #[arg(long)]
    no_roofline: bool,
    /// Seconds spent on each GEMM shape when measuring the peak.
    #[arg(long, default_value_t = 2.0)]
    gemm_seconds: f64,
    /// How many short texts (6 to 14 words) to embed one at a time, as a retrieve embeds its
    /// question; their latency is reported as the query's.
    #[arg(long, default_value_t = 200)]
    queries: usize,
    /// Another bench-embed binary (an earlier build) to run on the same sentences in this run;
    /// its bare rate is reported beside this one's.
    #[arg(long, value_name = "BINARY")]
    baseline: Option<PathBuf>,
}

struct Phase {
    name: &'static str,
    seconds: f64,
    /// Process CPU time (all threads); unlike wall time it barely moves when other work
    /// competes for the cores, so runs on a busy machine stay comparable.
    cpu_seconds: Option<f64>,
    hits: u64,
    misses: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let sentences = match &args.file {
        Some(path) => std::fs::read_to_string(path)?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .take(args.sentences)
            .map(String::from)
            .collect(),
        None if args.agent_length => generate_sentences(args.sentences, 70, 95),
        None => generate_sentences(args.sentences, 6, 38),
    };
    if sentences.is_empty() {
        return Err("no sentences to embed".into());
    }
    let n = sentences.len();

    let started = Instant::now();
    let precision = args.precision;
    let mut model =
        tokio::task::spawn_blocking(move || MiniLm::load_default_in(precision)).await??;
    if let Some(batch) = args.batch {
        model = model.with_batch_size(batch);
    }
    let load_seconds = started.elapsed().as_secs_f64();
    let counter = model.token_counter();
    // Counting is what `build_context` does for every candidate memory: the tokenizer
    // against the count cache, which the first pass fills.
    let started = Instant::now();
    let total_tokens: usize = sentences.iter().map(|s| counter.count_uncached(s)).sum();
    let count_us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    sentences.iter().for_each(|s| {
        counter.count(s);
    });
    let started = Instant::now();
    let cached_tokens: usize = sentences.iter().map(|s| counter.count(s)).sum();
    let cached_count_us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    if cached_tokens != total_tokens {
        return Err(format!(
            "cached counts ({cached_tokens}) differ from the tokenizer's ({total_tokens})"
        )
        .into());
    }
    let mean_tokens = total_tokens as f64 / n as f64;
    // What the model computes on each text: its tokens with [CLS] and [SEP], at most 256.
    let shape = model.shape();
    let model_flops: f64 = sentences
        .iter()
        .map(|s| shape.flops((counter.count(s) + 2).min(engram_embed::minilm::MINILM_MAX_TOKENS)))
        .sum();
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();

    // The first forward pass allocates and faults in the weights; keep it out of the numbers.
    model.embed_blocking(&refs[..n.min(16)])?;

    // A query's cost: one short text at a time, as a retrieve embeds its question.
    let queries = generate_sentences(args.queries.max(1), 6, 14);
    let mut query_ms: Vec<f64> = Vec::with_capacity(queries.len());
    for query in &queries {
        let started = Instant::now();
        model.embed_blocking(&[query.as_str()])?;
        query_ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    query_ms.sort_by(f64::total_cmp);
    let query_p50 = quantile(&query_ms, 0.5);
    let query_p99 = quantile(&query_ms, 0.99);

    let mut phases = Vec::new();
    let started = Instant::now();
    let cpu_started = cpu_seconds();
    let bare = model.embed_blocking(&refs)?;
    phases.push(Phase {
        name: "bare forward pass",
        seconds: started.elapsed().as_secs_f64(),
        cpu_seconds: cpu_since(cpu_started),
        hits: 0,
        misses: 0,
    });

    let (dir, temporary) = match &args.cache_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("engram-bench-embed-{}", std::process::id())),
            true,
        ),
    };
    let config = CacheConfig {
        memory_bytes: 256 * 1024 * 1024,
        disk_bytes: 1024 * 1024 * 1024,
        ..CacheConfig::new(&dir)
    };
    let inner: Arc<dyn Embedder> = Arc::new(model.clone());
    let cached = CachedEmbedder::open(inner.clone(), &config).await?;
    for name in ["cache cold (all misses)", "cache warm (memory hits)"] {
        let before = cached.stats();
        let started = Instant::now();
        let cpu_started = cpu_seconds();
        let vectors = cached.embed(&sentences).await?;
        let seconds = started.elapsed().as_secs_f64();
        let cpu = cpu_since(cpu_started);
        let after = cached.stats();
        check_same(&bare, &vectors)?;
        phases.push(Phase {
            name,
            seconds,
            cpu_seconds: cpu,
            hits: after.hits - before.hits,
            misses: after.misses - before.misses,
        });
    }
    cached.close().await?;
    drop(cached);

    let reopened = CachedEmbedder::open(inner, &config).await?;
    let started = Instant::now();
    let cpu_started = cpu_seconds();
    let vectors = reopened.embed(&sentences).await?;
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_since(cpu_started);
    check_same(&bare, &vectors)?;
    let stats = reopened.stats();
    phases.push(Phase {
        name: "cache reopened (disk hits)",
        seconds,
        cpu_seconds: cpu,
        hits: stats.hits,
        misses: stats.misses,
    });
    reopened.close().await?;
    drop(reopened);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }

    let bare_rate = n as f64 / phases[0].seconds;
    let achieved_gflops = model_flops / phases[0].seconds / 1e9;
    let tokens_per_sec = (total_tokens + 2 * n) as f64 / phases[0].seconds;
    // The peak at the model's shapes: a batch's token rows against its weights.
    let batch = model.batch_size();
    let rows = ((mean_tokens + 2.0) * batch.min(n) as f64)
        .round()
        .clamp(1.0, engram_embed::minilm::MAX_PASS_TOKENS as f64) as usize;
    let gemm = if args.no_roofline {
        Vec::new()
    } else {
        engram_embed::roofline::gemm_rates(&shape.gemms(rows), args.gemm_seconds)?
    };
    let peak = gemm.iter().map(|g| g.gflops).fold(0.0f64, f64::max);
    // The narrow kernel's own peak at the same shapes, where the model runs on one (bf16 or
    // int8): the roofline of the path in use (against the f32 peak alone, a narrow kernel
    // would score above 1).
    let narrow = if args.no_roofline {
        None
    } else {
        engram_embed::roofline::kernel_rates(
            model.precision(),
            &shape.gemms(rows),
            args.gemm_seconds,
        )
    };
    let narrow_peak = narrow
        .iter()
        .flatten()
        .map(|g| g.gflops)
        .fold(0.0f64, f64::max);
    // The peak of the arithmetic the model ran in.
    let path_peak = if narrow_peak > 0.0 { narrow_peak } else { peak };
    let baseline = match &args.baseline {
        Some(binary) => Some(run_baseline(binary, &sentences, args.batch)?),
        None => None,
    };
    if args.json {
        let results: Vec<_> = phases
            .iter()
            .map(|p| {
                serde_json::json!({
                    "phase": p.name,
                    "seconds": p.seconds,
                    "sentences_per_sec": n as f64 / p.seconds,
                    "ratio_to_bare": (n as f64 / p.seconds) / bare_rate,
                    "cpu_seconds": p.cpu_seconds,
                    "hits": p.hits,
                    "misses": p.misses,
                })
            })
            .collect();
        let report = serde_json::json!({
            "sentences": n,
            "mean_tokens": mean_tokens,
            "tokens_per_sec": tokens_per_sec,
            "model_gflop_per_text": model_flops / n as f64 / 1e9,
            "achieved_gflops": achieved_gflops,
            "gemm": gemm,
            "gemm_peak_gflops": (peak > 0.0).then_some(peak),
            "kernel": narrow,
            "kernel_peak_gflops": (narrow_peak > 0.0).then_some(narrow_peak),
            "efficiency": (path_peak > 0.0).then(|| achieved_gflops / path_peak),
            "f32_peak_ratio": (peak > 0.0).then(|| achieved_gflops / peak),
            "baseline_sentences_per_sec": baseline,
            "speedup_vs_baseline": baseline.map(|b| bare_rate / b),
            "batch": batch,
            "precision": model.precision().as_str(),
            "query_ms_p50": query_p50,
            "query_ms_p99": query_p99,
            "model_load_seconds": load_seconds,
            "token_count_us": count_us,
            "token_count_cached_us": cached_count_us,
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{n} sentences, {mean_tokens:.1} tokens on average, batch {batch}, {} products, model loaded in {load_seconds:.2}s",
            model.precision().as_str()
        );
        println!(
            "one query at a time ({} texts of 6 to 14 words): p50 {query_p50:.2} ms, p99 {query_p99:.2} ms",
            queries.len()
        );
        println!(
            "{:<28} {:>9} {:>14} {:>9} {:>9} {:>7} {:>7}",
            "phase", "seconds", "sentences/s", "vs bare", "cpu s", "hits", "misses"
        );
        for p in &phases {
            let rate = n as f64 / p.seconds;
            let cpu = p.cpu_seconds.map_or("-".to_string(), |c| format!("{c:.2}"));
            println!(
                "{:<28} {:>9.3} {:>14.1} {:>8.2}x {:>9} {:>7} {:>7}",
                p.name,
                p.seconds,
                rate,
                rate / bare_rate,
                cpu,
                p.hits,
                p.misses
            );
        }
        println!(
            "token counts: tokenizer {count_us:.1} µs per sentence, count cache {cached_count_us:.2} µs ({:.0}x)",
            count_us / cached_count_us.max(1e-9)
        );
        println!(
            "roofline: {:.2} GFLOP per text, {tokens_per_sec:.0} tokens/s, {achieved_gflops:.1} GFLOP/s achieved",
            model_flops / n as f64 / 1e9
        );
        for g in &gemm {
            println!(
                "  f32 GEMM (candle) {}x{}x{}: {:.1} GFLOP/s",
                g.m, g.k, g.n, g.gflops
            );
        }
        for g in narrow.iter().flatten() {
            println!(
                "  {} kernel {}x{}x{}: {:.1} GFLOP/s",
                model.precision().as_str(),
                g.m,
                g.k,
                g.n,
                g.gflops
            );
        }
        if path_peak > 0.0 {
            println!(
                "  efficiency: {:.3} of the measured {} peak ({path_peak:.1} GFLOP/s); {:.2}x the f32 GEMM peak ({peak:.1} GFLOP/s)",
                achieved_gflops / path_peak,
                model.precision().as_str(),
                achieved_gflops / peak.max(1e-9)
            );
        }
        if let Some(b) = baseline {
            println!(
                "baseline: {b:.1} sentences/s on the same sentences; this build {:.2}x",
                bare_rate / b
            );
        }
    }
    Ok(())
}

/// Runs `binary` (an earlier bench-embed) on `sentences`, written to a file, and returns its
/// bare forward pass's sentences/s. Only flags every build has are passed.
fn run_baseline(
    binary: &std::path::Path,
    sentences: &[String],
    batch: Option<usize>,
) -> Result<f64, Box<dyn std::error::Error>> {
    let file = std::env::temp_dir().join(format!(
        "engram-bench-embed-baseline-{}.txt",
        std::process::id()
    ));
    std::fs::write(&file, sentences.join("\n"))?;
    let mut command = std::process::Command::new(binary);
    command
        .args(["--file", &file.display().to_string()])
        .args(["--sentences", &sentences.len().to_string()])
        .arg("--json");
    if let Some(batch) = batch {
        command.args(["--batch", &batch.to_string()]);
    }
    let out = command.output();
    let _ = std::fs::remove_file(&file);
    let out = out.map_err(|e| format!("cannot run the baseline {}: {e}", binary.display()))?;
    if !out.status.success() {
        return Err(format!(
            "the baseline {} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    report["results"][0]["sentences_per_sec"]
        .as_f64()
        .ok_or_else(|| format!("the baseline's report has no bare rate: {report}").into())
}

/// The `q` quantile of sorted values (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// User plus system CPU time of this process, all threads, from `/proc/self/stat` (Linux only).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may contain spaces; fields resume after its closing parenthesis.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // Linux reports these in USER_HZ ticks, which is 100 on every mainstream architecture.
    Some((utime + stime) / 100.0)
}

fn cpu_since(start: Option<f64>) -> Option<f64> {
    Some(cpu_seconds()? - start?)
}

/// The cache must hand back what the model computed; a benchmark of wrong answers is worthless.
fn check_same(expected: &[Vec<f32>], got: &[Vec<f32>]) -> Result<(), Box<dyn std::error::Error>> {
    let worst = expected
        .iter()
        .zip(got)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0.0f32, f32::max);
    if expected.len() != got.len() || worst > 1e-4 {
        return Err(format!("cached vectors differ from the bare ones (max diff {worst})").into());
    }
    Ok(())
}

/// Varied, realistic agent-memory sentences of `min_words` to `max_words` words (plus a
/// closing note), deterministic for a given `n`.
fn generate_sentences(n: usize, min_words: usize, max_words: usize) -> Vec<String> {
    const SUBJECTS: &[&str] = &[
        "The user",
        "Our billing service",
        "The deployment pipeline",
        "Alice from support",
        "The on-call engineer",
        "The customer in Berlin",
        "The nightly backup job",
        "Bob",
        "The research agent",
        "The product team",
        "A new contributor",
        "The database migration",
    ];
    const VERBS: &[&str] = &[
        "prefers",
        "reported",
        "scheduled",
        "rejected",
        "asked about",
        "fixed",
        "rolled back",
        "documented",
        "is waiting for",
        "complained about",
        "approved",
        "benchmarked",
    ];
    const OBJECTS: &[&str] = &[
        "dark mode in the dashboard",
        "the invoice for March",
        "a flaky integration test",
        "the vegetarian menu options",
        "a refund for order 4417",
        "the Kubernetes upgrade",
        "weekly summaries by email",
        "the latency regression in search",
        "the onboarding guide",
        "meetings before ten in the morning",
        "the API rate limits",
        "a trip to Lisbon in May",
    ];
    const TAILS: &[&str] = &[
        "after the outage last Tuesday",
        "because the previous attempt timed out twice",
        "and wants a follow-up by Friday",
        "although nobody could reproduce the problem locally",
        "so the team decided to revisit it next sprint",
        "while travelling with a slow connection",
        "which should reduce support tickets noticeably",
        "before the quarterly review with the finance department",
        "and mentioned that the previous vendor handled it better",
        "since the staging environment was already busy with load tests",
    ];
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move |bound: usize| {
        // xorshift64*: fast, deterministic, and good enough to vary templates.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % bound
    };
    (0..n)
        .map(|i| {
            let target = min_words + next(max_words - min_words + 1);
            let mut words: Vec<String> = Vec::new();
            while words.len() < target {
                if !words.is_empty() {
                    words.push(if next(2) == 0 { "Also," } else { "Then" }.to_string());
                }
                let clause = format!(
                    "{} {} {} {}",
                    SUBJECTS[next(SUBJECTS.len())],
                    VERBS[next(VERBS.len())],
                    OBJECTS[next(OBJECTS.len())],
                    TAILS[next(TAILS.len())],
                );
                words.extend(clause.split(' ').map(String::from));
            }
            words.truncate(target);
            format!("{} (note {i}).", words.join(" "))
        })
        .collect()
}

fn parse_precision(s: &str) -> Result<engram_embed::Precision, String> {
    match s {
        "auto" => Ok(engram_embed::Precision::Auto),
        "f32" => Ok(engram_embed::Precision::F32),
        "bf16" => Ok(engram_embed::Precision::Bf16),
        "int8" => Ok(engram_embed::Precision::Int8),
        other => Err(format!("{other:?}: expected auto, f32, bf16 or int8")),
    }
}

//! Measures MiniLM throughput bare and behind the embedding cache (cold, warm, after reopen).
//!
//! `cargo run --release -p engram-embed --bin bench-embed -- --sentences 1000`

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
    /// Texts per forward pass.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Cache directory; default: a fresh temporary directory, removed afterwards.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
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
        None => generate_sentences(args.sentences),
    };
    if sentences.is_empty() {
        return Err("no sentences to embed".into());
    }
    let n = sentences.len();

    let started = Instant::now();
    let model = tokio::task::spawn_blocking(MiniLm::load_default)
        .await??
        .with_batch_size(args.batch);
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
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();

    // The first forward pass allocates and faults in the weights; keep it out of the numbers.
    model.embed_blocking(&refs[..n.min(16)])?;

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
            "batch": args.batch,
            "model_load_seconds": load_seconds,
            "token_count_us": count_us,
            "token_count_cached_us": cached_count_us,
            "results": results,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{n} sentences, {mean_tokens:.1} tokens on average, batch {}, model loaded in {load_seconds:.2}s",
            args.batch
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
    }
    Ok(())
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

/// Varied, realistic agent-memory sentences of 8 to 40 words, deterministic for a given `n`.
fn generate_sentences(n: usize) -> Vec<String> {
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
            let target = 6 + next(33);
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

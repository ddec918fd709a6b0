//! `bench-project`: projector rebuilds against a bare replay of the same stream, and the
//! embedder inside the vector projector against a bare MiniLM forward pass.
//!
//! Parses the flags, runs [`engram_loadtest::project::run`] (which starts its own embedded
//! nats-servers) and prints the table, or JSON with `--json`.
//!
//! `cargo run --release -p engram-loadtest --bin bench-project -- --events 100000 --embed-events 500`

use anyhow::Context as _;
use clap::Parser;
use engram_loadtest::project::{self, ProjectBenchConfig};

#[derive(Debug, Parser)]
#[command(
    name = "bench-project",
    about = "Measures projector rebuilds against a bare replay, and the embedder inside the vector projector against a bare forward pass"
)]
struct Cli {
    /// Events with client-supplied vectors for the projector comparison.
    #[arg(long, env = "ENGRAM_BENCH_EVENTS", default_value_t = 100_000)]
    events: usize,

    /// Text events without vectors for the embedder comparison; 0 skips it.
    #[arg(long, env = "ENGRAM_BENCH_EMBED_EVENTS", default_value_t = 500)]
    embed_events: usize,

    /// Task scopes the projector comparison's events are spread over (unevenly).
    #[arg(long, env = "ENGRAM_BENCH_SCOPES", default_value_t = 20)]
    scopes: usize,

    /// Seed of the event content and vectors [default: random].
    #[arg(long, env = "ENGRAM_BENCH_SEED")]
    seed: Option<u64>,

    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    engram_telemetry::init_logging(engram_telemetry::LogFormat::Text, "warn")
        .context("failed to set up logging")?;
    let config = ProjectBenchConfig {
        events: cli.events,
        embed_events: cli.embed_events,
        scopes: cli.scopes,
        seed: cli.seed.unwrap_or_else(rand::random),
    };
    // Awaited on the main thread, which starts the embedded servers and outlives them.
    let report = project::run(config).await.context("benchmark failed")?;
    if cli.json {
        let json =
            serde_json::to_string_pretty(&report).context("failed to serialise the report")?;
        println!("{json}");
    } else {
        print!("{}", report.render());
    }
    Ok(())
}

//! `bench-leaf`: a leaf and its hub syncing, beside the JetStream sourcing under it, and a
//! leaf's catch-up after an outage. Starts its own hub and leaf (`engram up`, the binary
//! next to this one or `$ENGRAM_BIN`).
//!
//! `cargo run --release -p engram-loadtest --bin bench-leaf -- --burst 20000 --outage 10m --rate 20`

use anyhow::Context as _;
use clap::Parser;
use engram_loadtest::leaf::{self, LeafBenchConfig};

#[derive(Debug, Parser)]
#[command(
    name = "bench-leaf",
    about = "Measures leaf-hub sync beside raw JetStream sourcing, and catch-up after an outage"
)]
struct Cli {
    /// Events per burst (each direction, and each reference).
    #[arg(long, default_value_t = 20_000)]
    burst: usize,
    /// How long the link stays cut, e.g. 10m.
    #[arg(long, default_value = "10m")]
    outage: humantime::Duration,
    /// Appends per second on each side while the link is cut.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Text bytes per event.
    #[arg(long, default_value_t = 400)]
    text_bytes: usize,
    /// The engram binary (default: next to this one, else $ENGRAM_BIN, else PATH).
    #[arg(long, env = "ENGRAM_BIN")]
    engram_bin: Option<std::path::PathBuf>,
    #[arg(long)]
    seed: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    engram_telemetry::init_logging(engram_telemetry::LogFormat::Text, "warn")
        .context("failed to set up logging")?;
    let report = leaf::run(LeafBenchConfig {
        engram_bin: cli.engram_bin,
        burst: cli.burst,
        outage: *cli.outage,
        rate: cli.rate,
        text_bytes: cli.text_bytes,
        seed: cli.seed.unwrap_or_else(rand::random),
    })
    .await
    .context("benchmark failed")?;
    if cli.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    Ok(())
}

//! The `engram` binary: parses flags, loads config, sets up logging, and hands off to the
//! library. Everything else lives in `engram::*`.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = engram::cli::Cli::parse();
    match engram::cli::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

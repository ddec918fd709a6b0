//! `engram mcp`: Engram's memory tools for a model harness, as an MCP server on stdin and
//! stdout. The harness starts it (`claude mcp add engram -- engram mcp --key ...`); it runs as
//! one agent's key, writes to one scope and reads that scope plus the granted ones given with
//! `--read`. Stdout carries the protocol only; logs go to stderr.

use std::process::ExitCode;

use anyhow::Context;
use engram_access::Credentials;
use engram_sdk::{Client, RetryPolicy};

use crate::config::Config;

#[derive(Debug, clap::Args)]
pub struct McpArgs {
    /// The agent's API key (`engram key add`), `egk.<tenant>.<agent>.<seed>`. Or give a
    /// credentials file with --creds (`engram agent add`). The admin's credentials are
    /// refused: a model gets one agent's rights, never everyone's.
    #[arg(
        long,
        env = "ENGRAM_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    pub key: Option<String>,
    /// The scope the tools write to and read, as kind:id (one the key may write: by default
    /// task:*, session:* or agent:<agent>). Default: agent:<agent>.
    #[arg(long, value_name = "KIND:ID")]
    pub scope: Option<String>,
    /// A granted scope the tools read too (a wider kind, e.g. team:core); repeatable.
    #[arg(long = "read", value_name = "KIND:ID")]
    pub read: Vec<String>,
    /// The instance id written into events (default: mcp-<pid>).
    #[arg(long, value_name = "ID")]
    pub instance: Option<String>,
}

pub async fn run(config: &Config, args: McpArgs) -> anyhow::Result<ExitCode> {
    let creds = match (&args.key, &config.nats.creds) {
        (Some(_), Some(_)) => {
            anyhow::bail!("give either --key (or ENGRAM_API_KEY) or --creds, not both")
        }
        (Some(key), None) => Credentials::from_api_key(key.trim())
            .context("--key (or ENGRAM_API_KEY) is not an API key")?,
        (None, Some(path)) => Credentials::load(path)
            .with_context(|| format!("cannot read the credentials file {}", path.display()))?,
        (None, None) => anyhow::bail!(
            "engram mcp needs an agent's key: --key <API key> (or ENGRAM_API_KEY), from `engram key add --tenant <t> --agent <a>`, or --creds <file> from `engram agent add`"
        ),
    };
    anyhow::ensure!(
        creds.agent_identity().is_some(),
        engram_mcp::McpError::NotAnAgent
    );
    let scope = args
        .scope
        .as_deref()
        .map(|s| engram_mcp::parse_scope("--scope", s))
        .transpose()?;
    let reads = args
        .read
        .iter()
        .map(|s| engram_mcp::parse_scope("--read", s))
        .collect::<Result<Vec<_>, _>>()?;
    let instance = args
        .instance
        .unwrap_or_else(|| format!("mcp-{}", std::process::id()));
    let url = config.client_url();
    let mut bus = config.bus_config_as(url.clone(), &creds);
    bus.client_name = format!("engram-mcp-{instance}");
    let client = Client::with_config(bus, RetryPolicy::default(), false)
        .await
        .map_err(|e| match e {
            engram_bus::BusError::Unauthorized { .. } => anyhow::anyhow!(
                "the server at {} refused this key: it was revoked, or never issued (`engram agent list`)",
                engram_bus::config::redact_url(&url)
            ),
            other => anyhow::Error::new(other).context("cannot connect to NATS"),
        })?
        .with_scrub(&config.projectors.scrub);
    let identity = engram_mcp::Identity::new(client, scope, reads, &instance)?;
    engram_mcp::serve_stdio(identity).await?;
    Ok(ExitCode::SUCCESS)
}

//! Command-line interface. Flags are the last configuration layer (see [`crate::config`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::config::{Config, FlagOverrides};
use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use engram_schema::{Layer, Scope, SubjectFilter};
use engram_telemetry::LogFormat;

use crate::commands;

#[derive(Debug, Parser)]
#[command(
    name = "engram",
    version,
    about = "Durable, shared memory for agent fleets, on NATS JetStream"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// TOML config file (default: $ENGRAM_CONFIG, else <home>/engram.toml if present).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// NATS URL of a running server. Without it, `up` starts a managed nats-server and the other
    /// commands connect to it on 127.0.0.1:<nats.managed_port>.
    #[arg(long, global = true, value_name = "URL")]
    pub nats: Option<String>,
    /// Data dir (default: $ENGRAM_HOME, else ~/.local/share/engram).
    #[arg(long, global = true, value_name = "DIR")]
    pub home: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormatArg>,
    /// Machine-readable output: one JSON object per line on stdout.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormatArg {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run everything on this machine: nats-server (unless --nats), stream provisioning,
    /// /healthz and /metrics. Ctrl-C stops in order; a second Ctrl-C exits at once.
    Up(UpArgs),
    /// Append events: JSON objects as arguments, or one per line on stdin (a line may also hold
    /// a JSON array). All are validated before any is sent.
    Append(AppendArgs),
    /// Print matching events as they are appended, until interrupted.
    Tail(FilterArgs),
    /// Print stored events from a point in the stream up to its current end.
    Replay(ReplayArgs),
    /// Show the events stream and its consumers.
    Streams,
    /// Retrieve memories (hybrid dense + BM25) through the query service.
    Retrieve(RetrieveArgs),
    /// Assemble the context an agent gets at the start of a step, within a token budget.
    Context(ContextArgs),
    /// Run projectors as a process of their own (a deployment's projector service), until
    /// SIGINT/SIGTERM. Default: those in `projectors.run`.
    Projector {
        /// vector, keyword, facts or skills.
        names: Vec<engram_projectors::ProjectorName>,
    },
    /// Rebuild a projector's read model from sequence 1. Stop the projector first (`engram
    /// up` or `engram projector`): its state is locked while it runs.
    Rebuild {
        /// vector, keyword, facts or skills.
        projector: engram_projectors::ProjectorName,
    },
    /// Configuration tools.
    #[command(subcommand)]
    Config(ConfigCommand),
}

/// Who asks and which scopes they may read.
#[derive(Debug, Args)]
pub struct ScopeArgs {
    #[arg(long)]
    pub tenant: String,
    /// The own scope, as kind:id.
    #[arg(long)]
    pub scope: String,
    /// An ancestor scope to read as well (wider kind: org > team > user > agent > task);
    /// repeatable.
    #[arg(long)]
    pub grant: Vec<String>,
    /// Read-your-writes: wait until this stream sequence is applied.
    #[arg(long, value_name = "SEQ")]
    pub min_seq: Option<u64>,
    /// Longest read-your-writes wait, in milliseconds (default 5000).
    #[arg(long, value_name = "MS")]
    pub wait_ms: Option<u64>,
}

#[derive(Debug, Args)]
pub struct RetrieveArgs {
    pub query: String,
    #[command(flatten)]
    pub scope: ScopeArgs,
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
    /// hybrid, dense or keyword.
    #[arg(long, default_value = "hybrid")]
    pub mode: String,
    /// Only these layers (repeatable).
    #[arg(long)]
    pub layer: Vec<String>,
    /// Only memories with one of these tags (repeatable).
    #[arg(long)]
    pub tag: Vec<String>,
    #[arg(long)]
    pub min_importance: Option<f64>,
}

#[derive(Debug, Args)]
pub struct ContextArgs {
    pub query: String,
    #[command(flatten)]
    pub scope: ScopeArgs,
    #[arg(long, default_value = "cli")]
    pub agent: String,
    /// The task id (its working memory is included when the task scope is readable).
    #[arg(long)]
    pub task: String,
    /// Token budget, counted with the embedding model's tokenizer.
    #[arg(long, default_value_t = 1024)]
    pub budget: usize,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Client port of the managed nats-server (0 picks a free one).
    #[arg(long, value_name = "PORT")]
    pub nats_port: Option<u16>,
    /// Address for /healthz and /metrics.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// After start-up, run a short demo against the running system and print it.
    #[arg(long)]
    pub demo: bool,
}

#[derive(Debug, Args)]
pub struct AppendArgs {
    /// Events as JSON objects. Without any, events are read from stdin, one per line.
    pub events: Vec<String>,
    /// Instead of JSON: append one event with this text, using the flags below.
    #[arg(long, conflicts_with = "events")]
    pub text: Option<String>,
    /// Tenant for --text, or the default for JSON events that leave it out.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Scope as kind:id (e.g. task:fix-login) for --text, or the default for JSON events.
    #[arg(long)]
    pub scope: Option<String>,
    /// Layer for --text, or the default for JSON events.
    #[arg(long, default_value = "episodic")]
    pub layer: String,
    /// Event kind for --text, or the default for JSON events (observation, action, outcome,
    /// fact_asserted, fact_retracted, skill_recorded, preference, feedback, checkpoint).
    #[arg(long, default_value = "observation")]
    pub kind: String,
    /// Agent id for --text, or the default for JSON events.
    #[arg(long, default_value = "cli")]
    pub agent: String,
    /// Instance id for --text, or the default for JSON events.
    #[arg(long, default_value = "cli")]
    pub instance: String,
    /// Optimistic concurrency: fail unless the subject's last sequence is this (0 = empty).
    #[arg(long, value_name = "SEQ")]
    pub expect_last_seq: Option<u64>,
}

#[derive(Debug, Args, Clone)]
pub struct FilterArgs {
    /// Only this tenant's events.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only this scope, as kind:id (e.g. team:platform); matched exactly.
    #[arg(long)]
    pub scope: Option<String>,
    /// Only this layer: working, episodic, semantic or procedural.
    #[arg(long)]
    pub layer: Option<String>,
}

impl FilterArgs {
    pub fn to_filter(&self) -> anyhow::Result<SubjectFilter> {
        let mut filter = SubjectFilter::all();
        if let Some(t) = &self.tenant {
            filter = filter.tenant(engram_schema::Ident::parse("tenant", t.as_str())?);
        }
        if let Some(s) = &self.scope {
            let scope: Scope = s.parse()?;
            filter = filter.scope(scope.kind, scope.id);
        }
        if let Some(l) = &self.layer {
            filter = filter.layer(l.parse::<Layer>()?);
        }
        Ok(filter)
    }
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Start at this stream sequence.
    #[arg(long, conflicts_with_all = ["since", "from_time"])]
    pub from_seq: Option<u64>,
    /// Start this long ago, e.g. 15m or 2h.
    #[arg(long, conflicts_with = "from_time")]
    pub since: Option<humantime::Duration>,
    /// Start at this RFC 3339 time.
    #[arg(long)]
    pub from_time: Option<chrono::DateTime<chrono::Utc>>,
    /// Stop after this many events.
    #[arg(long)]
    pub limit: Option<u64>,
    /// Only count and time the replay; print no events.
    #[arg(long)]
    pub count: bool,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the configuration in force, after every layer.
    Dump,
}

impl GlobalArgs {
    /// The flags as the last configuration layer.
    pub fn overrides(&self) -> FlagOverrides {
        FlagOverrides {
            home: self.home.clone(),
            nats_url: self.nats.clone(),
            log_format: self.log_format.map(|f| match f {
                LogFormatArg::Text => LogFormat::Text,
                LogFormatArg::Json => LogFormat::Json,
            }),
            ..FlagOverrides::default()
        }
    }
}

/// Loads config, sets up logging and runs the subcommand.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let mut overrides = cli.global.overrides();
    if let Command::Up(up) = &cli.command {
        overrides.managed_port = up.nats_port;
        overrides.http_listen = up.http;
    }
    let config = Config::load(cli.global.config.as_deref(), &overrides)?;
    engram_telemetry::init_logging(config.log.format, &config.log.filter)?;
    let json = cli.global.json;
    match cli.command {
        Command::Up(args) => {
            crate::up::run_until_signalled(config, args.demo).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Append(args) => commands::append::run(&config, args, json).await,
        Command::Tail(args) => commands::read::tail(&config, &args, json).await,
        Command::Replay(args) => commands::read::replay(&config, &args, json).await,
        Command::Streams => commands::streams::run(&config, json).await,
        Command::Retrieve(args) => commands::query::retrieve(&config, args, json).await,
        Command::Context(args) => commands::query::context(&config, args, json).await,
        Command::Projector { names } => commands::projector::run(&config, names).await,
        Command::Rebuild { projector } => {
            commands::projector::rebuild(&config, projector, json).await
        }
        Command::Config(ConfigCommand::Dump) => {
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&config).context("serialising config")?
                );
            } else {
                print!("{}", config.to_toml());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

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
    /// Credentials file to connect with (from `engram agent add`). Default: the admin
    /// credentials `engram up` keeps in <home>/auth/, when present.
    #[arg(long, global = true, value_name = "FILE", env = "ENGRAM_CREDS")]
    pub creds: Option<PathBuf>,
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
    /// Optimistic appends (--expect-last-seq) that expected the same last event: both
    /// accepted, on a leaf and its hub while their link was down. Each conflict lists its
    /// events; the same list on every side once they have synced.
    Conflicts(FilterArgs),
    /// One scope's state per read model (events, facts, docs, skills) as digests that
    /// leave out stream sequences: equal on every side that holds the same events, such as
    /// a leaf and its hub once synced.
    Digest(ScopeArgs),
    /// A task's agents as local processes, from a YAML spec: `apply` starts each role's
    /// replicas through `engram run`, restarts a failed one by resuming its session, stops
    /// them at the ttl and shows progress; `status` shows every session of the task.
    #[command(subcommand)]
    Task(commands::task::TaskCommand),
    /// Demos that start their own Engrams: `continuity` runs a hub and a leaf on this
    /// machine, an agent working in the cloud, and its successor resuming on the laptop.
    #[command(subcommand)]
    Demo(DemoCommand),
    /// Show the events stream and its consumers, and every stream kept on fewer servers
    /// than `bus.stream.replicas`.
    Streams {
        /// Keep every stream, bucket and object store of Engram's account on N servers of
        /// the cluster (admin). Raising it copies what they hold; nothing stored changes.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=5))]
        replicas: Option<u16>,
    },
    /// Tenants: `add` creates one, `list` shows them (admin).
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Agent credentials: `add` issues a key and writes its credentials file, `list` shows
    /// agents and their keys, `revoke` ends a key (its connections are closed) (admin).
    #[command(subcommand)]
    Agent(AgentCommand),
    /// Grants: which agents may read which wider scopes (admin).
    #[command(subcommand)]
    Grant(GrantCommand),
    /// The access registry as a nats-server sees it: `render` writes the `authorization`
    /// block for servers `engram up` does not run, once or following every change (admin).
    #[command(subcommand)]
    Access(commands::access_render::AccessCommand),
    /// Leaf nodes of this hub: `add` registers one and writes the credentials its
    /// `engram up --leaf` runs with, `list` shows them and their sync, `remove` ends one
    /// (admin). `status` on a leaf shows its link and what waits to sync.
    #[command(subcommand)]
    Leaf(LeafCommand),
    /// API keys for the HTTP API: `add` issues an agent key and prints it as one line
    /// (admin). Revoke it like any agent key: `engram agent revoke --key <public key>`.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Run the HTTP API (`/v1`, `/openapi.json`) as its own process against --nats, with
    /// /healthz (200 while a NATS server answers, 503 with the reason) and /metrics.
    Gateway {
        /// Address to serve on.
        #[arg(long, default_value = "127.0.0.1:7078")]
        listen: SocketAddr,
    },
    /// Erase a scope (or a user's scope) of a tenant everywhere: audit record, every read
    /// model and document, the events and their dead letters, working memory, snapshots
    /// (admin). `engram erase verify` searches all of them for what is left.
    Erase(EraseArgs),
    /// Retrieve memories (hybrid dense + BM25) through the query service.
    Retrieve(RetrieveArgs),
    /// Assemble the context an agent gets at the start of a step, within a token budget.
    Context(ContextArgs),
    /// Facts as they are now, as they stood at a valid time (--as-of), as Engram knew them at
    /// a transaction time (--known-at), or one fact's history (--history).
    Facts(FactsArgs),
    /// Skills: one by --name, or the ones best matching a --task description.
    Skills(SkillsArgs),
    /// Withdraw memories of one scope from retrieval: appends a `forgotten` event naming their
    /// event ids. The events stay in the stream (it is the audit log); only memories recorded
    /// in this tenant and scope are withdrawn, other ids are ignored. Prints the receipt: wait
    /// on its seq (--min-seq) to see the memories gone.
    Forget(ForgetArgs),
    /// Consolidate one scope now: merge near-duplicate memories, summarise a finished
    /// session or task, archive what decayed. Every output is an event naming its sources;
    /// `--dry-run` prints the plan without appending it.
    Consolidate {
        #[command(flatten)]
        scope: ScopeArgs,
        /// Only these steps (dedup, summarise, promote, decay); repeatable.
        #[arg(long)]
        step: Vec<String>,
        /// Instead: bring this archived or superseded memory back into default retrieval
        /// (as a copy naming it); repeatable.
        #[arg(long, value_name = "EVENT_ID", conflicts_with = "step")]
        restore: Vec<String>,
        #[arg(long)]
        dry_run: bool,
    },
    /// Shared documents (task boards, profiles, scratchpads, and types of your own) that many
    /// instances edit at once: show the merged state, list a scope's documents, edit one, and
    /// see its conflicts and history.
    #[command(subcommand)]
    Doc(DocCommand),
    /// Dead letters: events a projector could not apply (stream ENGRAM_DLQ).
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Run projectors as a process of their own (a deployment's projector service), until
    /// SIGINT/SIGTERM. Default: those in `projectors.run`.
    Projector {
        /// vector, keyword, facts, skills or docs.
        names: Vec<engram_projectors::ProjectorName>,
        /// Only these stream partitions ("0-7,12"; default `projectors.partitions`, all):
        /// one process of several, each serving its share.
        #[arg(long, value_name = "PARTITIONS")]
        partitions: Option<engram_projectors::PartitionSet>,
    },
    /// Run a memory node as a process of its own, until SIGINT/SIGTERM: every read model
    /// of the partitions it comes to own (by lease, shared with the other nodes on the same
    /// server), and the query service answering from them. Nodes joining or leaving move
    /// partitions between them; `engram up --nodes N` starts N on this machine.
    Node(NodeArgs),
    /// Rebuild a projector's read model from sequence 1. Stop the projector first (`engram
    /// up` or `engram projector`): its state is locked while it runs.
    Rebuild {
        /// vector, keyword, facts, skills or docs.
        projector: engram_projectors::ProjectorName,
        /// Start from the newest snapshot that checks (see `engram snapshot list`), then
        /// replay only the stream after it; with none that checks, replay everything.
        #[arg(long)]
        from_snapshot: bool,
        /// With --from-snapshot: this version (its sequence), or the newest good one below.
        #[arg(long, requires = "from_snapshot", value_name = "VERSION")]
        version: Option<u64>,
    },
    /// Versioned snapshots of the read models, kept in the JetStream Object Store: what new
    /// replicas start from, and what lets stream retention remove old events.
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Configuration tools.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Serve Engram's memory tools (remember, recall, build_context, facts, skills, the task
    /// board, forget) to a model harness as an MCP server on stdin/stdout, as one agent's key.
    Mcp(commands::mcp::McpArgs),
    /// Run any agent program as a session of a task: `engram run --tenant T --task ID
    /// --role R -- <command …>`. It gets a short-lived key of its own and ENGRAM_* variables;
    /// its start, heartbeats, checkpoints (SIGUSR1, `engram session checkpoint`), artifacts
    /// (`engram session artifact`) and exit are recorded in the task's scope (admin).
    Run(commands::run::RunArgs),
    /// Sessions of `engram run`: `list` shows a task's with their state (running, exited,
    /// dead); `checkpoint` and `artifact` are called from inside a run.
    #[command(subcommand)]
    Session(commands::session::SessionCommand),
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
    /// Leave out memories below this confidence (0..=1): ones later outcomes contradicted
    /// (each halves it) or a faulty instance wrote (a quarter).
    #[arg(long)]
    pub min_confidence: Option<f64>,
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
pub struct FactsArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// Only facts about this subject (exact; case matters).
    #[arg(long)]
    pub subject: Option<String>,
    /// Only this predicate (exact; case matters).
    #[arg(long)]
    pub predicate: Option<String>,
    /// Free-text match over subject, predicate and object (current facts only).
    #[arg(long, conflicts_with_all = ["as_of", "known_at", "history"])]
    pub text: Option<String>,
    /// Valid time: the facts true in the world at this RFC 3339 time (default: now).
    #[arg(long, value_name = "RFC3339")]
    pub as_of: Option<chrono::DateTime<chrono::Utc>>,
    /// Transaction time: the facts as Engram knew them at this RFC 3339 time (default: latest
    /// knowledge).
    #[arg(long, value_name = "RFC3339")]
    pub known_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Every version of one fact, superseded and retracted ones included (needs --subject and
    /// --predicate).
    #[arg(long, requires_all = ["subject", "predicate"], conflicts_with_all = ["as_of", "known_at"])]
    pub history: bool,
    /// At most this many facts (1..=1000).
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
}

#[derive(Debug, Args)]
pub struct SkillsArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// A task description to match skills against.
    #[arg(long, required_unless_present = "name", conflicts_with = "name")]
    pub task: Option<String>,
    /// One skill by name (its latest version).
    #[arg(long)]
    pub name: Option<String>,
    /// At most this many skills (1..=1000).
    #[arg(long, default_value_t = 5)]
    pub limit: usize,
}

#[derive(Debug, Args)]
pub struct ForgetArgs {
    /// The event ids of the memories to withdraw (1 to 1000).
    #[arg(required = true, value_name = "EVENT_ID")]
    pub event_ids: Vec<String>,
    #[arg(long)]
    pub tenant: String,
    /// The scope the memories were recorded in, as kind:id.
    #[arg(long)]
    pub scope: String,
    /// The layer the `forgotten` event is appended on; memories of every layer of the scope
    /// are withdrawn.
    #[arg(long, default_value = "episodic")]
    pub layer: String,
    /// Why: kept as the event's text, in the audit log.
    #[arg(long)]
    pub reason: String,
    #[arg(long, default_value = "cli")]
    pub agent: String,
    #[arg(long, default_value = "cli")]
    pub instance: String,
}

/// Which document: its type and name, in the scope of `--tenant` and `--scope`.
#[derive(Debug, Args)]
pub struct DocArgs {
    /// task_board, profile, scratchpad, or a type of your own.
    pub doc_type: String,
    pub name: String,
    #[command(flatten)]
    pub scope: ScopeArgs,
}

#[derive(Debug, Subcommand)]
pub enum DocCommand {
    /// The merged state, with a count of conflicting fields.
    Show(DocArgs),
    /// Every field written concurrently, with all of its values (the shown one first).
    Conflicts(DocArgs),
    /// The document's latest `doc_changed` events, oldest first.
    History {
        #[command(flatten)]
        doc: DocArgs,
        /// At most this many (1..=256).
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// The documents of the scope and its grants.
    List {
        #[command(flatten)]
        scope: ScopeArgs,
        /// Only documents of this type.
        #[arg(long = "type", value_name = "TYPE")]
        doc_type: Option<String>,
        /// At most this many (1..=256).
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Edit a document: each --set and --delete, in order, as one change, appended as one
    /// `doc_changed` event. A new document of a built-in type starts from its genesis. An edit
    /// after which a built-in type no longer reads as that type is refused, nothing sent.
    Edit {
        #[command(flatten)]
        doc: DocArgs,
        /// PATH=JSON: set the value at a JSON pointer, creating maps on the way, for example
        /// --set '/items/t-7={"title":"fix login","status":"todo"}' or --set /items/t-7/owner='"i-3"'.
        /// A value that is not JSON is taken as a string. In a list, - appends.
        #[arg(long, value_name = "PATH=JSON")]
        set: Vec<String>,
        /// PATH: delete a field or list item.
        #[arg(long, value_name = "PATH")]
        delete: Vec<String>,
        #[arg(long, default_value = "cli")]
        agent: String,
        #[arg(long, default_value = "cli")]
        instance: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Cut a snapshot of running projectors now (default: every one: vector, keyword,
    /// facts, skills, docs, consolidator). Labelled snapshots are kept by retention.
    Create {
        projectors: Vec<engram_projectors::ProjectorName>,
        #[arg(long)]
        label: Option<String>,
    },
    /// The snapshots kept, oldest first.
    List {
        #[arg(long)]
        projector: Option<engram_projectors::ProjectorName>,
    },
    /// One snapshot's index entry, after checking its object against its content hash.
    Show {
        projector: engram_projectors::ProjectorName,
        version: u64,
    },
    /// Build a stopped projector's state from a snapshot and the stream after it (the same
    /// as `engram rebuild <projector> --from-snapshot`).
    Restore {
        projector: engram_projectors::ProjectorName,
        /// This version, or the newest good one below it (default: the newest good one).
        #[arg(long)]
        version: Option<u64>,
    },
    /// What changed between two snapshots of one projector.
    Diff {
        projector: engram_projectors::ProjectorName,
        from: u64,
        to: u64,
    },
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first: their dlq seq, projector, event seq, subject and reason.
    List {
        /// Only this projector's (vector, keyword, facts, skills or docs).
        #[arg(long)]
        projector: Option<engram_projectors::ProjectorName>,
        /// At most this many (1..=10000).
        #[arg(long, default_value_t = engram_bus::dlq::DEFAULT_LIST_LIMIT)]
        limit: usize,
    },
    /// Show one dead letter: why it failed, where it came from, and the event (or the size of
    /// its bytes when they are no event).
    Show {
        /// Its sequence in ENGRAM_DLQ, as `engram dlq list` shows it.
        dlq_seq: u64,
    },
    /// Re-drive a projector's dead letters after a fix (a projector bug fixed, an embedder
    /// restored). The projector must be stopped (`engram up` or `engram projector`): like
    /// `engram rebuild`, this takes its state lock and fails if it is running, changing
    /// nothing. It deletes the projector's dead-letter id key `<state dir>/<projector>.dlq-key`
    /// (so that letters the rebuild sends again get fresh ids instead of being dropped as
    /// duplicates of the old ones), rebuilds the projector from sequence 1 with a progress
    /// bar, then counts and removes its old dead letters from ENGRAM_DLQ (subject
    /// engram.dlq.<projector>, those stored before the rebuild), and reports how many were
    /// re-driven and how many were dead-lettered again (those still fail). If the rebuild
    /// fails, the old letters stay. The events themselves never leave the events stream.
    Redrive {
        /// vector, keyword, facts, skills or docs.
        projector: engram_projectors::ProjectorName,
    },
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
    /// Run N memory nodes as processes of their own (`engram node`, state in
    /// <home>/nodes/<i>), sharing the partitions, instead of one in this process; a node that
    /// dies is started again.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=64))]
    pub nodes: u16,
    /// Run N managed nats-servers forming one JetStream cluster (3 to 9; node i on
    /// --nats-port + i), with every stream kept on 3 of them (`nats.cluster`).
    #[arg(long, value_name = "N")]
    pub cluster: Option<usize>,
    /// Run the managed nats-server without authentication. Anyone who reaches it can read
    /// and write every tenant's memory; refused unless everything listens on loopback.
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// Run as a leaf node of the hub at this leafnode URL (`nats-leaf://host:7422`), with
    /// the leaf credentials given by --creds (from `engram leaf add` on the hub). Local
    /// agents append and query here, online or not; the tenant's scopes sync both ways.
    #[arg(long, value_name = "URL", requires = "creds")]
    pub leaf: Option<String>,
    /// Accept leaf node connections on this address (the hub's side), e.g. 0.0.0.0:7422.
    #[arg(long, value_name = "ADDR")]
    pub leaf_listen: Option<SocketAddr>,
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The partitions this node may own ("0-7,12"; default `projectors.partitions`, all).
    #[arg(long, value_name = "PARTITIONS")]
    pub partitions: Option<engram_projectors::PartitionSet>,
    /// This node's name among the nodes (default `node.name`, else one made up once and
    /// kept in its state dir).
    #[arg(long, value_name = "NAME")]
    pub name: Option<engram_schema::Ident>,
    /// Where this node keeps its read models (default <home>/projectors). Nodes on one
    /// machine each need their own.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Serve /healthz (each partition's lag) and /metrics here.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct EraseArgs {
    #[command(subcommand)]
    pub command: Option<EraseCommand>,
    #[command(flatten)]
    pub target: EraseTarget,
}

#[derive(Debug, Subcommand)]
pub enum EraseCommand {
    /// Search every read model, document, the newest snapshots, the stream, the dead
    /// letters and working memory for the target; exits 1 if anything is left.
    Verify(EraseTarget),
}

#[derive(Debug, Args)]
pub struct EraseTarget {
    #[arg(long, required = true)]
    pub tenant: Option<String>,
    /// A scope: kind:id (repeatable).
    #[arg(long, required_unless_present = "user", conflicts_with = "user")]
    pub scope: Vec<String>,
    /// A user: their `user:<id>` scope.
    #[arg(long)]
    pub user: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum DemoCommand {
    /// Memory that follows a task from the cloud to a laptop: a hub and a leaf (two homes,
    /// two `engram up`), an agent that decides, fails, fixes and learns in the cloud while
    /// the laptop is offline, and its successor's handoff brief on the laptop, each answer
    /// checked against the events the first wrote.
    Continuity(crate::demo::continuity::ContinuityArgs),
}

#[derive(Debug, Subcommand)]
pub enum LeafCommand {
    /// Register leaf NAME of a tenant and write its credentials file (keep it secret: it
    /// syncs the tenant's scopes). Its events stream sources the leaf's from then on.
    Add {
        /// The leaf's name, which is also its JetStream domain (unique on this hub).
        name: String,
        #[arg(long)]
        tenant: String,
        /// Scopes it syncs both ways: kind:id or kind:* (repeatable; default task:* and
        /// session:*). What is granted to every agent of the tenant comes down too.
        #[arg(long)]
        scope: Vec<String>,
        /// Where to write the credentials (default <home>/leaves/<name>.creds).
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// The tenant's leaves (every tenant's without --tenant), with each one's sync lag.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    /// End leaf NAME: its connection is closed, its key refused, and its events no longer
    /// sourced.
    Remove {
        name: String,
        #[arg(long)]
        tenant: String,
    },
    /// On a leaf: whether the hub is reachable and how many events wait in each direction.
    Status,
}

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Issue an API key for an agent (the same identity and permissions as its NATS
    /// credentials); printed once, keep it secret.
    Add {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        agent: String,
        /// Scopes it may write and read: kind:id or kind:* (repeatable).
        #[arg(long)]
        scope: Vec<String>,
        /// Also grant the agent read access to every scope of the tenant (`kind:*` for each
        /// kind), writing none: an operator's key for the memory inspector.
        #[arg(long)]
        read_all: bool,
    },
    /// The keys issued (public keys only: an API key is shown once, at `add`), live first.
    List {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        agent: Option<String>,
        /// Revoked keys too.
        #[arg(long)]
        all: bool,
    },
    /// Revoke one key (its public key, from `engram key list`); the agent's other keys
    /// keep working. The server closes its connections at once.
    Revoke {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        agent: String,
        #[arg(long)]
        key: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Create a tenant.
    Add { tenant: String },
    /// List tenants with their agent and grant counts.
    List,
}

#[derive(Debug, Subcommand)]
pub enum AgentCommand {
    /// Issue credentials for an agent; prints the credentials file's path. Adding a key to an
    /// agent that has one rotates: both work until the old one is revoked (`--key`).
    Add {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        agent: String,
        /// Scopes it may write and read: kind:id or kind:* (repeatable). Default: task:*,
        /// session:* and agent:<agent>.
        #[arg(long)]
        scope: Vec<String>,
        /// Where to write the credentials (default: <home>/auth/agents/<tenant>/).
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// List agents and their keys.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Revoke an agent's keys (or one, with --key): the server closes their connections.
    Revoke {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        agent: String,
        /// One public key (U…) instead of all.
        #[arg(long)]
        key: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum GrantCommand {
    /// Let an agent (or every agent of the tenant, `--agent '*'`) read a scope.
    Add {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        agent: String,
        /// kind:id or kind:*.
        #[arg(long)]
        scope: String,
    },
    /// Take a grant back.
    Revoke {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        agent: String,
        #[arg(long)]
        scope: String,
    },
    /// The grants in force.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
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
    /// Agent id for --text, or the default for JSON events. Default: the agent of the
    /// credentials (`--creds`; an agent's key appends only events naming it), else `cli`.
    #[arg(long)]
    pub agent: Option<String>,
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
            creds: self.creds.clone(),
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
        overrides.insecure_no_auth = up.insecure_no_auth.then_some(true);
        overrides.cluster = up.cluster;
        overrides.leafnodes_listen = up.leaf_listen;
        if let Some(hub) = &up.leaf {
            // With --leaf, --creds is the leaf's credentials, not a key to connect with.
            overrides.leaf_hub = Some(hub.clone());
            overrides.leaf_creds = overrides.creds.take();
        }
    }
    let config = Config::load(cli.global.config.as_deref(), &overrides)?;
    engram_telemetry::init_logging(config.log.format, &config.log.filter)?;
    let json = cli.global.json;
    match cli.command {
        Command::Up(args) => {
            crate::up::run_until_signalled(config, args.demo, usize::from(args.nodes)).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Node(args) => {
            let mut config = config;
            if let Some(partitions) = args.partitions {
                config.projectors.partitions = partitions;
            }
            if let Some(name) = args.name {
                config.node.name = Some(name);
            }
            crate::node::run(&config, args.state_dir.as_deref(), args.http).await
        }
        Command::Append(args) => commands::append::run(&config, args, json).await,
        Command::Tail(args) => commands::read::tail(&config, &args, json).await,
        Command::Replay(args) => commands::read::replay(&config, &args, json).await,
        Command::Conflicts(args) => commands::conflicts::run(&config, &args, json).await,
        Command::Digest(args) => commands::digest::run(&config, &args, json).await,
        Command::Task(command) => commands::task::run(&config, command, json).await,
        Command::Demo(DemoCommand::Continuity(args)) => {
            crate::demo::continuity::run(args, json).await
        }
        Command::Streams { replicas } => {
            commands::streams::run(&config, replicas.map(usize::from), json).await
        }
        Command::Tenant(command) => commands::access::tenant(&config, command, json).await,
        Command::Agent(command) => commands::access::agent(&config, command, json).await,
        Command::Grant(command) => commands::access::grant(&config, command, json).await,
        Command::Key(command) => commands::access::key(&config, command, json).await,
        Command::Leaf(command) => commands::leaf::run(&config, command, json).await,
        Command::Access(command) => commands::access_render::run(&config, command, json).await,
        Command::Gateway { listen } => crate::up::run_gateway(&config, listen).await,
        Command::Erase(args) => commands::erase::run(&config, args, json).await,
        Command::Retrieve(args) => commands::query::retrieve(&config, args, json).await,
        Command::Context(args) => commands::query::context(&config, args, json).await,
        Command::Facts(args) => commands::facts::run(&config, args, json).await,
        Command::Skills(args) => commands::skills::run(&config, args, json).await,
        Command::Forget(args) => commands::forget::run(&config, args, json).await,
        Command::Doc(command) => commands::doc::run(&config, command, json).await,
        Command::Consolidate {
            scope,
            step,
            restore,
            dry_run,
        } => commands::consolidate::run(&config, scope, step, restore, dry_run, json).await,
        Command::Dlq(command) => commands::dlq::run(&config, command, json).await,
        Command::Projector { names, partitions } => {
            commands::projector::run(&config, names, partitions).await
        }
        Command::Rebuild {
            projector,
            from_snapshot,
            version,
        } => {
            if from_snapshot {
                commands::snapshot::restore(&config, projector, version, json).await
            } else {
                commands::projector::rebuild(&config, projector, json).await
            }
        }
        Command::Snapshot(command) => commands::snapshot::run(&config, command, json).await,
        Command::Mcp(args) => commands::mcp::run(&config, args).await,
        Command::Run(args) => commands::run::run(&config, args).await,
        Command::Session(command) => commands::session::run(&config, command, json).await,
        Command::Config(ConfigCommand::Dump) => {
            let config = config.redacted();
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

//! `engram run`: any agent program gets a session.
//!
//! `engram run --tenant T --task ID --role R -- <command …>` runs the command in the current
//! directory as one session of task `ID`, and records what happens to it as session records
//! ([`engram_schema::session`]: `checkpoint` events of the task's scope, layer `working`):
//! 1. It issues a key for this run alone: agent `run-<session>`, which may write and read
//!    `task:<ID>` and `session:<session>` (with `--context isolated`, `session:<session>`
//!    alone, and the scopes of the sessions it resumes: a replica that shares nothing with
//!    the task's others), and which expires `--key-ttl` after it was issued
//!    unless renewed. `engram run` renews it every third of the ttl while it lives and
//!    revokes it when the program ends; a run killed outright (SIGKILL) renews nothing, and
//!    its key stops working by itself when the ttl runs out (`engram up` renders the
//!    server's authorization again at each expiry).
//! 2. It starts the program with the variables below, and records `started`.
//! 3. While the program runs: a `heartbeat` every `--heartbeat`; a `checkpoint` on SIGUSR1
//!    or on request through the session's socket; an `artifact` for each file the program
//!    declares there, stored in the Object Store (the tenant's bucket, [`artifacts_bucket`]) and read back to
//!    check its SHA-256 before the record is appended. SIGINT, SIGTERM and SIGHUP sent to
//!    `engram run` are passed on to the program (SIGINT not when `engram run` is in the
//!    terminal's foreground: the terminal sent ctrl-c to the program already).
//! 4. When the program exits: `ended`, with its exit code or the signal that killed it;
//!    the key is revoked, and `engram run` exits with the program's code (128 + the signal's
//!    number when a signal ended it, as shells do).
//!
//! A run whose supervisor dies without an `ended` record stops heartbeating:
//! `engram session list` reports it dead after three intervals.
//!
//! It connects with the admin's credentials (the default on the machine running
//! `engram up`, or `--creds`): it issues keys.
//!
//! # The program's environment
//! | variable | value |
//! |---|---|
//! | `ENGRAM_URL` | the HTTP API (`--http-url`, default `http://<http.listen>`), as the Python client reads it |
//! | `ENGRAM_API_KEY` | the run's key, one line (`egk.<tenant>.<agent>.<seed>`), as the Python client and `engram mcp` read it |
//! | `ENGRAM_NATS_URL` | the NATS server, for SDK clients |
//! | `ENGRAM_NATS__URL` | the same, as the `engram` CLI's configuration reads it |
//! | `ENGRAM_TENANT`, `ENGRAM_TASK`, `ENGRAM_ROLE` | as given |
//! | `ENGRAM_SCOPE` | the scope to write: `task:<ID>`, or `session:<id>` when isolated |
//! | `ENGRAM_CONTEXT` | `shared` or `isolated` |
//! | `ENGRAM_SESSION`, `ENGRAM_SESSION_SCOPE` | the session's id, and `session:<id>` |
//! | `ENGRAM_AGENT`, `ENGRAM_INSTANCE` | the key's agent (events must name it) and the instance id to use |
//! | `ENGRAM_SESSION_SOCKET` | the session's socket |
//!
//! `ENGRAM_CREDS` is removed: the `engram` CLI inside the run must not act as the admin whose
//! credentials started it, and `engram mcp` takes the key from `ENGRAM_API_KEY`.
//!
//! # The session's socket
//! A unix socket in a directory of its own (mode 0700; `$XDG_RUNTIME_DIR`, else the temp
//! dir), accepting connections from this user only. Each connection carries one request,
//! a JSON object on one line of at most [`MAX_REQUEST_BYTES`], and gets one JSON line back:
//! - `{"checkpoint": {"note": "tests pass"}}` records a checkpoint;
//! - `{"artifact": {"path": "out/report.txt", "name": "report.txt"}}` stores a file as an
//!   artifact: a regular file under the run's working directory once every symlink is
//!   resolved, at most `--max-artifact-bytes`, at most `--max-artifacts` per session; the
//!   name defaults to the file's.
//!
//! The answer is `{"ok": true, "seq": …, …}` or `{"ok": false, "error": {"code": …,
//! "message": …}}`; a refused request writes nothing. Every request is treated as hostile:
//! at most [`MAX_CONNECTIONS`] at once (more are answered `busy`), a request line within
//! 5 s, one artifact upload at a time. `engram session checkpoint` and
//! `engram session artifact` are the client.

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::object_store::{self, ObjectStore};
use chrono::{DateTime, Utc};
use engram_access::{AccessError, AccessLog, Credentials, Record, ScopePattern};
use engram_schema::session::{
    ArtifactStored, CheckpointVia, MAX_HEARTBEAT_MS, MAX_NOTE_CHARS, MIN_HEARTBEAT_MS,
    SessionCheckpointed, SessionContext, SessionEnded, SessionEvent, SessionHeartbeat,
    SessionRecord, SessionStarted, check_artifact_name,
};
use engram_schema::{Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_sdk::{AppendReceipt, Client};
use engram_telemetry::metrics;
use futures::FutureExt as _;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use tracing::instrument::WithSubscriber as _;

use crate::config::Config;

/// The Object Store bucket artifacts are kept in, created by the first `engram run` that
/// needs it.
pub use engram_schema::session::{LEGACY_ARTIFACTS_BUCKET, artifacts_bucket};
/// Longest request line on a session's socket, newline included.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;
/// Longest answer line the client reads.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024;
/// Connections a session's socket serves at once; one more is answered `busy`.
pub const MAX_CONNECTIONS: usize = 8;
/// How long a connection may take to send its request line.
const REQUEST_LINE_WITHIN: Duration = Duration::from_secs(5);
/// How long an artifact waits for the upload slot (one upload at a time) before `busy`.
const UPLOAD_SLOT_WITHIN: Duration = Duration::from_secs(60);
/// The longest a request may take once read; the client waits a little longer.
pub const REQUEST_WITHIN: Duration = Duration::from_secs(300);
/// How long requests and records in flight when the program exits may take to finish
/// before `ended` is recorded without them.
const DRAIN_WITHIN: Duration = Duration::from_secs(30);
/// One record's append, retries included (the SDK retries for 30 s).
const APPEND_WITHIN: Duration = Duration::from_secs(35);
/// How long the run's key may take to be admitted by the server before the program starts.
const KEY_ADMITTED_WITHIN: Duration = Duration::from_secs(30);
/// Shortest and longest key ttl.
const MIN_KEY_TTL: Duration = Duration::from_secs(3);
const MAX_KEY_TTL: Duration = Duration::from_secs(30 * 24 * 3600);
/// Longest unix socket path (`sun_path` holds 108 bytes with its terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[arg(long)]
    pub tenant: String,
    /// The task this run works on: its records go to `task:<ID>`, and its key writes there.
    #[arg(long, value_name = "ID")]
    pub task: String,
    /// The role the program plays (planner, coder, reviewer, …).
    #[arg(long)]
    pub role: String,
    /// How often a heartbeat is recorded (1s to 1h). A session silent for three intervals
    /// without an end is dead.
    #[arg(long, default_value = "30s", value_name = "DURATION")]
    pub heartbeat: humantime::Duration,
    /// How long the run's key lives without renewal (3s to 30 days). It is renewed every
    /// third of this while the run lives, and revoked when it ends.
    #[arg(long, default_value = "1h", value_name = "DURATION")]
    pub key_ttl: humantime::Duration,
    /// Largest artifact, in bytes (held in memory while it is stored and checked).
    #[arg(long, default_value_t = 64 * 1024 * 1024, value_name = "BYTES",
          value_parser = clap::value_parser!(u64).range(1..=1024 * 1024 * 1024))]
    pub max_artifact_bytes: u64,
    /// Most artifacts one session may declare.
    #[arg(long, default_value_t = 256, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_artifacts: u64,
    /// `shared`: the run's key reads and writes the task's scope and the session's.
    /// `isolated`: the session's scope alone (and, when resuming, the resumed sessions'),
    /// so the program neither sees nor changes what the task's other runs remember. The
    /// session's records go to the task's scope either way (`engram run` writes them).
    #[arg(long, default_value = "shared", value_name = "shared|isolated", value_parser = parse_context)]
    pub context: SessionContext,
    /// The HTTP API's URL for the program (`ENGRAM_URL`). Default: http://<http.listen>.
    #[arg(long, value_name = "URL")]
    pub http_url: Option<String>,
    /// Serve this run's metrics (`/metrics`) here while it lives.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// The program and its arguments, after `--`.
    #[arg(required = true, last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Who and what this run is: fixed for its life.
#[derive(Debug)]
struct Ids {
    tenant: Ident,
    task: Ident,
    role: Ident,
    session: Ident,
    /// The agent the run's key belongs to: one per run, so that concurrent runs (and an
    /// operator's own agent named like the role) never replace each other's scopes.
    agent: Ident,
    scope: Scope,
    context: SessionContext,
    /// Earlier sessions' scopes the key may use too (an isolated run that resumes them).
    resumed_scopes: Vec<Scope>,
}

fn parse_context(s: &str) -> Result<SessionContext, String> {
    match s {
        "shared" => Ok(SessionContext::Shared),
        "isolated" => Ok(SessionContext::Isolated),
        other => Err(format!("{other:?}: give shared or isolated")),
    }
}

/// Most earlier sessions an isolated run's key may also use (the latest are kept).
pub const MAX_RESUMED_SCOPES: usize = 32;

impl Ids {
    fn new(
        tenant: &str,
        task: &str,
        role: &str,
        context: SessionContext,
        resumed_scopes: Vec<Scope>,
    ) -> anyhow::Result<Self> {
        let session = ulid::Ulid::new().to_string();
        let keep = resumed_scopes.len().saturating_sub(MAX_RESUMED_SCOPES);
        Ok(Self {
            context,
            resumed_scopes: match context {
                SessionContext::Shared => Vec::new(),
                SessionContext::Isolated => resumed_scopes.into_iter().skip(keep).collect(),
            },
            tenant: Ident::parse("tenant", tenant)?,
            task: Ident::parse("task", task)?,
            role: Ident::parse("role", role)?,
            agent: Ident::parse("agent", format!("run-{session}"))?,
            scope: Scope::new(ScopeKind::Task, task)?,
            session: Ident::parse("session", session)?,
        })
    }

    fn session_scope(&self) -> Scope {
        Scope {
            kind: ScopeKind::Session,
            id: self.session.clone(),
        }
    }

    /// The scope the program writes to (`ENGRAM_SCOPE`).
    fn working_scope(&self) -> Scope {
        match self.context {
            SessionContext::Shared => self.scope.clone(),
            SessionContext::Isolated => self.session_scope(),
        }
    }

    /// Every scope the run's key may read and write.
    fn key_scopes(&self) -> Vec<ScopePattern> {
        let mut scopes = vec![ScopePattern::exact(&self.session_scope())];
        match self.context {
            SessionContext::Shared => scopes.insert(0, ScopePattern::exact(&self.scope)),
            SessionContext::Isolated => {
                scopes.extend(self.resumed_scopes.iter().map(ScopePattern::exact));
            }
        }
        scopes
    }

    /// Who appends the access records, for their audit trail.
    fn by(&self) -> String {
        let user = std::env::var("USER").unwrap_or_else(|_| "admin".into());
        format!("engram run {} ({user})", self.session)
    }
}

pub async fn run(config: &Config, args: RunArgs) -> anyhow::Result<ExitCode> {
    run_with(config, args, Resuming::default()).await
}

/// What `engram session resume --exec` adds to a run: variables for the program beside
/// the `ENGRAM_*` ones above (the brief's paths), and the session it resumes, recorded as
/// the new session's first checkpoint (`resumes session <id>`), right after `started`.
#[derive(Clone, Debug, Default)]
pub struct Resuming {
    pub session: Option<Ident>,
    pub env: Vec<(String, String)>,
    /// The scopes of the sessions resumed (the one named and those it resumed in turn),
    /// which an isolated run's key may use as its own.
    pub scopes: Vec<Scope>,
}

/// The note of the checkpoint that says which session a run resumes.
pub fn resumes_note(session: &Ident) -> String {
    format!("resumes session {session}")
}

/// [`run`], resuming a session.
pub async fn run_with(
    config: &Config,
    args: RunArgs,
    resuming: Resuming,
) -> anyhow::Result<ExitCode> {
    let heartbeat: Duration = args.heartbeat.into();
    anyhow::ensure!(
        (MIN_HEARTBEAT_MS..=MAX_HEARTBEAT_MS).contains(&(heartbeat.as_millis() as u64)),
        "--heartbeat {} is outside 1s..=1h",
        args.heartbeat
    );
    let ttl: Duration = args.key_ttl.into();
    anyhow::ensure!(
        (MIN_KEY_TTL..=MAX_KEY_TTL).contains(&ttl),
        "--key-ttl {} is outside 3s..=30days",
        args.key_ttl
    );
    let ids = Arc::new(Ids::new(
        &args.tenant,
        &args.task,
        &args.role,
        args.context,
        resuming.scopes.clone(),
    )?);
    let span = tracing::info_span!(
        "session",
        tenant = %ids.tenant,
        task = %ids.task,
        role = %ids.role,
        session = %ids.session,
    );
    supervise(config, args, ids, heartbeat, ttl, resuming)
        .instrument(span)
        .await
}

async fn supervise(
    config: &Config,
    args: RunArgs,
    ids: Arc<Ids>,
    heartbeat: Duration,
    ttl: Duration,
    resuming: Resuming,
) -> anyhow::Result<ExitCode> {
    metrics::touch_sessions();
    let workdir = std::env::current_dir().context("cannot read the working directory")?;
    let canonical_workdir = std::fs::canonicalize(&workdir)
        .with_context(|| format!("cannot resolve the working directory {}", workdir.display()))?;
    let url = config.client_url();
    let client = super::connect(config).await?;
    anyhow::ensure!(
        client.agent_identity().is_none(),
        "engram run issues a key for the run, so it connects as the admin (the default on the machine running engram up, or --creds <the admin's credentials>), not as an agent"
    );
    let log = AccessLog::new(client.bus().client().clone());
    // Signals are caught before anything can send them: SIGUSR1's default is to exit.
    let mut signals = Signals::new()?;

    let (creds, expires_at) = issue_key(&log, &ids, ttl).await?;
    let key = creds.public_key();
    let outcome = async {
        tokio::select! {
            admitted = wait_until_admitted(&url, &creds) => admitted?,
            () = signals.stop_requested() => anyhow::bail!("interrupted before the program started"),
        }
        let dir = RunDir::create(&ids.session)?;
        let listener = dir.listen()?;
        let metrics_listener = match args.metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot serve metrics on {addr}"))?,
            ),
            None => None,
        };
        let api_key = creds.api_key().expect("agent credentials have an API key");
        let http_url = args
            .http_url
            .clone()
            .unwrap_or_else(|| default_http_url(config.http.listen));
        let mut command = tokio::process::Command::new(&args.command[0]);
        command
            .args(&args.command[1..])
            .current_dir(&workdir)
            .env_remove("ENGRAM_CREDS")
            .env("ENGRAM_URL", &http_url)
            .env("ENGRAM_API_KEY", &api_key)
            .env("ENGRAM_NATS_URL", &url)
            .env("ENGRAM_NATS__URL", &url)
            .env("ENGRAM_TENANT", ids.tenant.as_str())
            .env("ENGRAM_TASK", ids.task.as_str())
            .env("ENGRAM_ROLE", ids.role.as_str())
            .env("ENGRAM_SCOPE", ids.working_scope().to_string())
            .env("ENGRAM_CONTEXT", ids.context.as_str())
            .env("ENGRAM_SESSION", ids.session.as_str())
            .env("ENGRAM_SESSION_SCOPE", ids.session_scope().to_string())
            .env("ENGRAM_AGENT", ids.agent.as_str())
            .env("ENGRAM_INSTANCE", ids.session.as_str())
            .env("ENGRAM_SESSION_SOCKET", dir.socket())
            .envs(resuming.env.iter().map(|(k, v)| (k, v)));
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                // As shells answer: 127 for a program not found, 126 for one not runnable.
                let code = if e.kind() == std::io::ErrorKind::NotFound {
                    127
                } else {
                    126
                };
                eprintln!("engram run: cannot start {:?}: {e}", args.command[0]);
                return Ok(ExitCode::from(code));
            }
        };
        let recorder = Recorder {
            client: client.clone(),
            ids: ids.clone(),
        };
        let shared = Arc::new(Shared {
            recorder: recorder.clone(),
            client: client.clone(),
            store: tokio::sync::OnceCell::new(),
            workdir: canonical_workdir,
            max_artifact_bytes: args.max_artifact_bytes,
            max_artifacts: usize::try_from(args.max_artifacts).unwrap_or(usize::MAX),
            declared: AtomicUsize::new(0),
            upload: tokio::sync::Semaphore::new(1),
        });
        let run = Run {
            ids: ids.clone(),
            recorder,
            shared,
            log: log.clone(),
            key: key.clone(),
            ttl,
            expires_at,
            heartbeat,
            metrics_listener,
            serve_limits: config.serve_limits(),
            resumes: resuming.session.clone(),
        };
        let (command, truncated) = SessionStarted::bounded_command(&args.command);
        let started = SessionStarted {
            role: ids.role.clone(),
            command,
            command_truncated: truncated,
            machine: hostname(),
            pid: child.id().unwrap_or(1),
            heartbeat_ms: heartbeat.as_millis() as u64,
            workdir: Some(workdir.display().to_string())
                .filter(|w| w.chars().count() <= engram_schema::session::MAX_WORKDIR_CHARS),
            context: Some(ids.context),
            resumes: resuming.session.clone(),
        };
        let code = run
            .supervise(child, started, listener, &mut signals)
            .await?;
        drop(dir);
        Ok(code)
    }
    .await;
    // Whatever happened, the key ends with the run.
    match revoke_key(&log, &ids, &key).await {
        Ok(seq) => tracing::info!(key = %key, registry_seq = seq, "run's key revoked"),
        Err(e) => {
            tracing::error!(key = %key, error = %e, "cannot revoke the run's key; it expires by itself")
        }
    }
    outcome
}

/// The signals `engram run` handles: SIGUSR1 records a checkpoint, the others are passed on.
struct Signals {
    usr1: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        let on = |kind| signal(kind).context("cannot handle signals");
        Ok(Self {
            usr1: on(SignalKind::user_defined1())?,
            int: on(SignalKind::interrupt())?,
            term: on(SignalKind::terminate())?,
            hup: on(SignalKind::hangup())?,
        })
    }

    /// Until SIGINT, SIGTERM or SIGHUP: what stops the run before its program started.
    async fn stop_requested(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
            _ = self.hup.recv() => {}
        }
    }
}

/// One run under way: what its tasks share.
struct Run {
    ids: Arc<Ids>,
    recorder: Recorder,
    shared: Arc<Shared>,
    log: AccessLog,
    key: String,
    ttl: Duration,
    expires_at: DateTime<Utc>,
    heartbeat: Duration,
    /// Where `/metrics` is served while the run lives, if asked (`--metrics-listen`).
    metrics_listener: Option<tokio::net::TcpListener>,
    serve_limits: engram_gateway::ServeLimits,
    /// The session this run resumes (`engram session resume --exec`), if any.
    resumes: Option<Ident>,
}

impl Run {
    async fn supervise(
        self,
        mut child: tokio::process::Child,
        started: SessionStarted,
        listener: UnixListener,
        signals: &mut Signals,
    ) -> anyhow::Result<ExitCode> {
        let began = std::time::Instant::now();
        let pid = started.pid;
        if let Err(e) = self
            .recorder
            .record(SessionEvent::Started(started.clone()))
            .await
        {
            // A session nobody can see is no session: stop the program rather than run it
            // unrecorded.
            let _ = child.start_kill();
            let _ = child.wait().await;
            return Err(e.context("cannot record the session's start; the program was stopped"));
        }
        metrics::SESSIONS_STARTED.inc();
        if let Some(resumed) = &self.resumes {
            // Not fatal: the run is recorded, only the link to its predecessor is missing.
            let note = resumes_note(resumed);
            if let Err(e) = self.recorder.checkpoint(note, CheckpointVia::Request).await {
                tracing::warn!(resumed = %resumed, error = %e, "cannot record which session this run resumes");
            }
        }
        eprintln!(
            "engram run: session {} of task {} (tenant {}), role {}, context {}, pid {pid}",
            self.ids.session,
            self.ids.task,
            self.ids.tenant,
            self.ids.role,
            self.ids.context.as_str()
        );
        tracing::info!(pid, agent = %self.ids.agent, key_expires_at = %self.expires_at, "session started");

        let stop = CancellationToken::new();
        let mut background = JoinSet::new();
        background.spawn(heartbeats(
            self.recorder.clone(),
            self.heartbeat,
            stop.clone(),
        ));
        background.spawn(renewals(
            self.log.clone(),
            self.ids.clone(),
            self.key.clone(),
            self.ttl,
            stop.clone(),
        ));
        background.spawn(serve_socket(listener, self.shared.clone(), stop.clone()));
        if let Some(listener) = self.metrics_listener {
            if let Ok(addr) = listener.local_addr() {
                eprintln!("engram run: metrics on http://{addr}/metrics");
            }
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(|| async { metrics::render() }),
            );
            let limits = self.serve_limits;
            let stopped = stop.clone();
            background.spawn(async move {
                let _ =
                    engram_gateway::serve(listener, app, limits, stopped.cancelled_owned()).await;
            });
        }

        // Checkpoints asked for by signal, recorded beside the supervision: one at a time,
        // and signals that arrive meanwhile make one more, so a program sending SIGUSR1 in
        // a loop costs one append at a time, never a task per signal.
        let mut records = JoinSet::new();
        let mut another = false;
        let checkpoint = |recorder: Recorder| async move {
            let note = CheckpointVia::Signal.as_str().to_owned();
            if let Err(e) = recorder.checkpoint(note, CheckpointVia::Signal).await {
                tracing::warn!(error = %e, "cannot record the checkpoint SIGUSR1 asked for");
            }
        };
        let pid = i32::try_from(pid).unwrap_or(0);
        let status = loop {
            // Signals first: one sent just before the program exited is still handled.
            tokio::select! {
                biased;
                Some(()) = signals.usr1.recv() => {
                    if records.is_empty() {
                        records.spawn(checkpoint(self.recorder.clone()));
                    } else {
                        another = true;
                    }
                }
                Some(()) = signals.int.recv() => {
                    if terminal_sent_it() {
                        tracing::debug!("ctrl-c reached the program from the terminal");
                    } else {
                        forward(pid, libc::SIGINT);
                    }
                }
                Some(()) = signals.term.recv() => forward(pid, libc::SIGTERM),
                Some(()) = signals.hup.recv() => forward(pid, libc::SIGHUP),
                status = child.wait() => break status.context("cannot wait for the program")?,
                Some(_) = records.join_next(), if !records.is_empty() => {
                    if std::mem::take(&mut another) {
                        records.spawn(checkpoint(self.recorder.clone()));
                    }
                }
            }
        };
        // A SIGUSR1 sent just before the program exited still counts.
        if signals.usr1.recv().now_or_never().flatten().is_some() {
            another = true;
        }
        if records.is_empty() && std::mem::take(&mut another) {
            records.spawn(checkpoint(self.recorder.clone()));
        }
        // What was asked before the end is recorded before `ended`, within a bound.
        stop.cancel();
        let drained = tokio::time::timeout(DRAIN_WITHIN, async {
            while records.join_next().await.is_some() {
                if std::mem::take(&mut another) {
                    records.spawn(checkpoint(self.recorder.clone()));
                }
            }
            while background.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                "requests still in flight {DRAIN_WITHIN:?} after the program exited were dropped"
            );
            records.abort_all();
            background.abort_all();
        }

        let ended = SessionEnded {
            exit_code: status.code(),
            signal: status.signal().filter(|_| status.code().is_none()),
            duration_ms: began.elapsed().as_millis() as u64,
        };
        let outcome = match (ended.exit_code, ended.signal) {
            (Some(0), _) => "exited",
            (Some(_), _) => "failed",
            _ => "signalled",
        };
        match self.recorder.record(SessionEvent::Ended(ended)).await {
            Ok(receipt) => {
                metrics::SESSIONS_ENDED.with_label_values(&[outcome]).inc();
                tracing::info!(
                    exit_code = ?ended.exit_code,
                    signal = ?ended.signal,
                    seq = receipt.seq,
                    "session ended"
                );
            }
            Err(e) => {
                metrics::SESSIONS_ENDED
                    .with_label_values(&["unrecorded"])
                    .inc();
                tracing::error!(error = %e, "cannot record the session's end; it will read as dead");
            }
        }
        let code = match (ended.exit_code, ended.signal) {
            (Some(code), _) => code & 0xff,
            (None, Some(signal)) => 128 + signal,
            (None, None) => 1,
        };
        Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
    }
}

/// Whether a SIGINT most likely came from the terminal: `engram run` is in the terminal's
/// foreground process group, and so is the program, which then got it too.
fn terminal_sent_it() -> bool {
    // SAFETY: plain queries of this process's terminal and process group.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

fn forward(pid: i32, signal: i32) {
    if pid <= 0 {
        return;
    }
    // SAFETY: kill(2) on the program's own pid; a program already gone gives ESRCH.
    let sent = unsafe { libc::kill(pid, signal) } == 0;
    tracing::info!(signal, sent, "signal passed on to the program");
}

/// Appends the session's records.
#[derive(Clone)]
struct Recorder {
    client: Client,
    ids: Arc<Ids>,
}

impl Recorder {
    async fn record(&self, event: SessionEvent) -> anyhow::Result<AppendReceipt> {
        let record = SessionRecord {
            session: self.ids.session.clone(),
            event,
        };
        let step = record.step();
        let mut envelope = Envelope::new(
            self.ids.tenant.clone(),
            self.ids.scope.clone(),
            self.ids.agent.clone(),
            self.ids.session.clone(),
            Layer::Working,
            EventKind::Checkpoint,
            record.content(),
        );
        envelope.tags = vec!["session".into()];
        let result = match tokio::time::timeout(APPEND_WITHIN, self.client.append(&envelope)).await
        {
            Ok(Ok(receipt)) => Ok(receipt),
            Ok(Err(e)) => Err(anyhow::Error::new(e)),
            Err(_) => Err(anyhow::anyhow!(
                "no acknowledgement within {APPEND_WITHIN:?}"
            )),
        };
        let outcome = if result.is_ok() { "ok" } else { "error" };
        metrics::SESSION_RECORDS
            .with_label_values(&[step.as_str(), outcome])
            .inc();
        result.with_context(|| format!("cannot record the session's {step}"))
    }

    async fn checkpoint(&self, note: String, via: CheckpointVia) -> anyhow::Result<AppendReceipt> {
        self.record(SessionEvent::Checkpoint(SessionCheckpointed { note, via }))
            .await
    }
}

async fn heartbeats(recorder: Recorder, every: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beat = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        beat += 1;
        if let Err(e) = recorder
            .record(SessionEvent::Heartbeat(SessionHeartbeat { beat }))
            .await
        {
            tracing::warn!(beat, error = %e, "heartbeat not recorded");
        }
    }
}

/// A fresh key pair for the run's agent, registered with the run's two scopes and an expiry.
async fn issue_key(
    log: &AccessLog,
    ids: &Ids,
    ttl: Duration,
) -> anyhow::Result<(Credentials, DateTime<Utc>)> {
    let creds = Credentials::generate_agent(ids.tenant.clone(), ids.agent.clone());
    let expires_at = Utc::now() + chrono::Duration::from_std(ttl)?;
    let seq = log
        .append(
            Record::AgentKeyAdded {
                tenant: ids.tenant.clone(),
                agent: ids.agent.clone(),
                key: creds.public_key(),
                scopes: ids.key_scopes(),
                expires_at: Some(expires_at),
            },
            &ids.by(),
        )
        .await
        .context("cannot issue the run's key")?;
    tracing::info!(key = %creds.public_key(), registry_seq = seq, %expires_at, "run's key issued");
    Ok((creds, expires_at))
}

/// Renews the key every third of its ttl until `stop`: two renewals may fail before it
/// expires under a live run.
async fn renewals(
    log: AccessLog,
    ids: Arc<Ids>,
    key: String,
    ttl: Duration,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(ttl / 3) => {}
        }
        let Ok(ttl_chrono) = chrono::Duration::from_std(ttl) else {
            return;
        };
        let expires_at = Utc::now() + ttl_chrono;
        let renewal = Record::AgentKeyRenewed {
            tenant: ids.tenant.clone(),
            agent: ids.agent.clone(),
            key: key.clone(),
            expires_at,
        };
        match log.append(renewal, &ids.by()).await {
            Ok(seq) => tracing::debug!(registry_seq = seq, %expires_at, "run's key renewed"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot renew the run's key; the program loses it at its expiry unless a later renewal succeeds")
            }
        }
    }
}

/// Revokes the run's key; a lost connection to the registry is tried again for a while.
async fn revoke_key(log: &AccessLog, ids: &Ids, key: &str) -> Result<u64, AccessError> {
    let mut wait = Duration::from_millis(200);
    let mut attempt = 1;
    loop {
        let revocation = Record::AgentRevoked {
            tenant: ids.tenant.clone(),
            agent: ids.agent.clone(),
            key: Some(key.to_owned()),
        };
        match log.append(revocation, &ids.by()).await {
            Err(AccessError::Log { reason, .. }) if attempt < 6 => {
                tracing::warn!(attempt, error = %reason, "revoking the run's key failed; trying again");
                tokio::time::sleep(wait).await;
                wait *= 2;
                attempt += 1;
            }
            done => return done,
        }
    }
}

/// Waits until the server admits the key, so the program's first connection is not
/// refused: `engram up` reloads the server's authorization moments after the record.
async fn wait_until_admitted(url: &str, creds: &Credentials) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + KEY_ADMITTED_WITHIN;
    loop {
        let attempt = async {
            let client = async_nats::ConnectOptions::with_nkey(creds.seed.clone())
                .custom_inbox_prefix(creds.inbox_prefix())
                .connection_timeout(Duration::from_secs(2))
                .connect(url)
                .await
                .ok()?;
            client.flush().await.ok()
        };
        // A refusal here is expected until the server reloads: no error line for it (the
        // client logs each refused connection as an error).
        let attempt = attempt.with_subscriber(tracing::subscriber::NoSubscriber::default());
        if let Ok(Some(())) = tokio::time::timeout(Duration::from_secs(3), attempt).await {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the server did not admit the run's key within {KEY_ADMITTED_WITHIN:?}: is `engram up` (or `engram access render --follow`) keeping its authorization in step with the registry?"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The leaf's own artifacts bucket when this server is a leaf node of `tenant` (it goes up
/// to the hub), else the tenant's, created when missing.
async fn open_artifacts_bucket(
    client: &Client,
    tenant: &Ident,
) -> anyhow::Result<(String, ObjectStore)> {
    let js = client.bus().jetstream();
    if let Some(leaf) = leaf_of(js, tenant).await {
        let bucket = engram_access::leaf::leaf_artifacts_bucket(&leaf);
        if let Ok(store) = js.get_object_store(&bucket).await {
            return Ok((bucket, store));
        }
    }
    let bucket = artifacts_bucket(tenant);
    if let Ok(store) = js.get_object_store(&bucket).await {
        return Ok((bucket, store));
    }
    js.create_object_store(object_store::Config {
        bucket: bucket.clone(),
        description: Some("engram run: the artifacts sessions declared".into()),
        storage: async_nats::jetstream::stream::StorageType::File,
        num_replicas: client.bus().replicas(),
        ..Default::default()
    })
    .await
    .map(|store| (bucket.clone(), store))
    .with_context(|| format!("cannot open or create the object store {bucket}"))
}

/// This server's leaf name when it is a leaf node syncing `tenant` (its inbox sources that
/// tenant's events; its JetStream domain is its name).
async fn leaf_of(js: &async_nats::jetstream::Context, tenant: &Ident) -> Option<Ident> {
    let mut inbox = js
        .get_stream(engram_access::leaf::INBOX_STREAM)
        .await
        .ok()?;
    let info = inbox.info().await.ok()?;
    let mine = format!("{}.{tenant}.", engram_schema::SUBJECT_PREFIX);
    let syncs = info.config.sources.iter().flatten().any(|s| {
        s.filter_subject
            .as_deref()
            .is_some_and(|f| f.starts_with(&mine))
    });
    if !syncs {
        return None;
    }
    let domain = js.query_account().await.ok()?.domain?;
    let leaf = Ident::parse("leaf", domain).ok()?;
    // The bucket's name goes into the record, an identifier of at most 64 characters.
    (engram_access::leaf::leaf_artifacts_bucket(&leaf).len() <= 64).then_some(leaf)
}

fn default_http_url(listen: std::net::SocketAddr) -> String {
    let ip = match listen.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    format!("http://{}", std::net::SocketAddr::new(ip, listen.port()))
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).trim().to_owned();
    if ok && !name.is_empty() && !name.chars().any(char::is_control) {
        name.chars()
            .take(engram_schema::session::MAX_MACHINE_CHARS)
            .collect()
    } else {
        "unknown".into()
    }
}

/// The run's private directory, holding its socket; removed when the run ends.
struct RunDir {
    path: PathBuf,
}

impl RunDir {
    fn create(session: &Ident) -> anyhow::Result<Self> {
        use std::os::unix::fs::DirBuilderExt as _;
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|d| d.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        let path = base.join(format!("engram-run-{session}"));
        // A fresh directory, never an existing one (another user's, in a shared temp dir).
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("cannot create the run's directory {}", path.display()))?;
        let dir = Self { path };
        let socket = dir.socket();
        anyhow::ensure!(
            socket.as_os_str().len() <= MAX_SOCKET_PATH,
            "the session's socket path {} is longer than {MAX_SOCKET_PATH} bytes; set TMPDIR (or XDG_RUNTIME_DIR) to a shorter directory",
            socket.display()
        );
        Ok(dir)
    }

    fn socket(&self) -> PathBuf {
        self.path.join("session.sock")
    }

    fn listen(&self) -> anyhow::Result<UnixListener> {
        use std::os::unix::fs::PermissionsExt as _;
        let socket = self.socket();
        let listener = UnixListener::bind(&socket)
            .with_context(|| format!("cannot listen on {}", socket.display()))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))?;
        Ok(listener)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A request on the session's socket: one JSON object on one line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Record a checkpoint; the note defaults to `requested`.
    Checkpoint {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        note: Option<String>,
    },
    /// Store a file of the working directory as an artifact, named `name` (default: the
    /// file's name).
    Artifact {
        path: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
}

/// The answer to a [`Request`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    /// The record's stream sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// The stored artifact, as its record names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<ArtifactStored>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ResponseError>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResponseError {
    /// `invalid`, `too_large`, `outside_workdir`, `not_a_file`, `not_found`, `too_many`,
    /// `busy`, `timeout` (refused: nothing written), or `unavailable` (storing or recording
    /// failed; a retry may work).
    pub code: String,
    pub message: String,
}

/// Why a request was refused before anything was written.
#[derive(Debug)]
struct Refusal {
    code: &'static str,
    message: String,
}

impl Refusal {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl Response {
    fn refused(refusal: Refusal) -> Self {
        if refusal.code != "unavailable" {
            metrics::SESSION_REQUESTS_REFUSED
                .with_label_values(&[refusal.code])
                .inc();
        }
        // Debug only: a hostile program could otherwise fill the terminal; the metric counts.
        tracing::debug!(code = refusal.code, reason = %refusal.message, "session request refused");
        Self {
            ok: false,
            error: Some(ResponseError {
                code: refusal.code.into(),
                message: refusal.message,
            }),
            ..Self::default()
        }
    }
}

/// What every request handler of one run shares.
struct Shared {
    recorder: Recorder,
    /// Opens the artifacts bucket at the first artifact: a run that declares none does not
    /// depend on the Object Store.
    client: Client,
    /// The bucket artifacts go to, and the store: opened at the first artifact.
    store: tokio::sync::OnceCell<(String, ObjectStore)>,
    /// The program's working directory, every symlink resolved: artifacts come from under it.
    workdir: PathBuf,
    max_artifact_bytes: u64,
    max_artifacts: usize,
    /// Artifacts declared so far (or being stored): at most `max_artifacts`.
    declared: AtomicUsize,
    /// One upload at a time, so memory holds at most one artifact.
    upload: tokio::sync::Semaphore,
}

async fn serve_socket(listener: UnixListener, shared: Arc<Shared>, stop: CancellationToken) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut handlers = JoinSet::new();
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    if stream.peer_cred().map(|c| c.uid()).ok() != Some(uid) {
                        tracing::warn!("session socket: a connection of another user closed");
                        continue;
                    }
                    match slots.clone().try_acquire_owned() {
                        Ok(slot) => {
                            let shared = shared.clone();
                            handlers.spawn(async move {
                                handle(stream, &shared).await;
                                drop(slot);
                            });
                        }
                        Err(_) => {
                            let busy = Response::refused(Refusal::new(
                                "busy",
                                format!("{MAX_CONNECTIONS} requests are in progress; try again"),
                            ));
                            let mut stream = stream;
                            let _ = tokio::time::timeout(Duration::from_millis(100), respond(&mut stream, &busy)).await;
                        }
                    }
                }
                Err(e) => {
                    // Out of descriptors, say: no tight loop.
                    tracing::warn!(error = %e, "session socket: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = handlers.join_next(), if !handlers.is_empty() => {}
        }
    }
    drop(listener);
    // Requests under way finish (their records come before `ended`), within the run's
    // drain bound, which aborts this task.
    while handlers.join_next().await.is_some() {}
}

async fn handle(mut stream: UnixStream, shared: &Shared) {
    let response = match read_request(&mut stream).await {
        Err(refusal) => Response::refused(refusal),
        Ok(request) => {
            let served = tokio::time::timeout(REQUEST_WITHIN, shared.serve(request)).await;
            match served {
                Ok(Ok(response)) => response,
                Ok(Err(refusal)) => Response::refused(refusal),
                Err(_) => Response::refused(Refusal::new(
                    "timeout",
                    format!("not done within {REQUEST_WITHIN:?}"),
                )),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), respond(&mut stream, &response)).await;
}

async fn respond(stream: &mut UnixStream, response: &Response) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(response).expect("responses serialise");
    line.push(b'\n');
    stream.write_all(&line).await?;
    stream.shutdown().await
}

/// One request line, at most [`MAX_REQUEST_BYTES`], within [`REQUEST_LINE_WITHIN`].
async fn read_request(stream: &mut UnixStream) -> Result<Request, Refusal> {
    let mut line = Vec::new();
    let mut reader = tokio::io::BufReader::new(stream).take(MAX_REQUEST_BYTES as u64 + 1);
    match tokio::time::timeout(REQUEST_LINE_WITHIN, reader.read_until(b'\n', &mut line)).await {
        Err(_) => {
            return Err(Refusal::new(
                "timeout",
                format!("no request line within {REQUEST_LINE_WITHIN:?}"),
            ));
        }
        Ok(Err(e)) => {
            return Err(Refusal::new(
                "invalid",
                format!("cannot read the request: {e}"),
            ));
        }
        Ok(Ok(_)) => {}
    }
    if line.len() > MAX_REQUEST_BYTES {
        return Err(Refusal::new(
            "too_large",
            format!("the request line is longer than {MAX_REQUEST_BYTES} bytes"),
        ));
    }
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    serde_json::from_slice(&line).map_err(|e| {
        Refusal::new(
            "invalid",
            format!(
                "{e}; send one JSON object on one line: {{\"checkpoint\": {{\"note\": \"…\"}}}} or {{\"artifact\": {{\"path\": \"…\", \"name\": \"…\"}}}}"
            ),
        )
    })
}

impl Shared {
    async fn serve(&self, request: Request) -> Result<Response, Refusal> {
        match request {
            Request::Checkpoint { note } => {
                let note = note
                    .map(|n| n.trim().to_owned())
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| "requested".into());
                let chars = note.chars().count();
                if chars > MAX_NOTE_CHARS {
                    return Err(Refusal::new(
                        "too_large",
                        format!("the note has {chars} characters, at most {MAX_NOTE_CHARS}"),
                    ));
                }
                let receipt = self
                    .recorder
                    .checkpoint(note, CheckpointVia::Request)
                    .await
                    .map_err(|e| Refusal::new("unavailable", format!("{e:#}")))?;
                Ok(Response {
                    ok: true,
                    seq: Some(receipt.seq),
                    event_id: Some(receipt.event_id),
                    ..Response::default()
                })
            }
            Request::Artifact { path, name } => {
                // Counted before anything is read, and given back unless it was stored.
                let declared = self.declared.fetch_add(1, Ordering::SeqCst);
                if declared >= self.max_artifacts {
                    self.declared.fetch_sub(1, Ordering::SeqCst);
                    return Err(Refusal::new(
                        "too_many",
                        format!(
                            "this session has declared {} artifacts, the most it may",
                            self.max_artifacts
                        ),
                    ));
                }
                let stored = self.artifact(path, name).await;
                if stored.is_err() {
                    self.declared.fetch_sub(1, Ordering::SeqCst);
                }
                stored
            }
        }
    }

    async fn artifact(&self, path: PathBuf, name: Option<String>) -> Result<Response, Refusal> {
        let name = match name {
            Some(name) => name,
            None => path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .ok_or_else(|| {
                    Refusal::new("invalid", format!("{} names no file", path.display()))
                })?,
        };
        check_artifact_name(&name).map_err(|e| {
            Refusal::new(
                "invalid",
                format!("artifact name {e}; give another with --name"),
            )
        })?;
        let _slot = tokio::time::timeout(UPLOAD_SLOT_WITHIN, self.upload.acquire())
            .await
            .map_err(|_| {
                Refusal::new(
                    "busy",
                    format!("another artifact was being stored for {UPLOAD_SLOT_WITHIN:?}"),
                )
            })?
            .expect("the upload semaphore is never closed");
        let (workdir, max) = (self.workdir.clone(), self.max_artifact_bytes);
        let bytes = tokio::task::spawn_blocking(move || read_artifact(&workdir, &path, max))
            .await
            .map_err(|e| Refusal::new("unavailable", format!("reading the file failed: {e}")))??;
        let sha256 = sha256_hex(&bytes);
        let ids = &self.recorder.ids;
        let object = format!(
            "{}/{}/{}/{name}/{sha256}",
            ids.tenant, ids.task, ids.session
        );
        let (bucket, store) = self
            .store
            .get_or_try_init(|| open_artifacts_bucket(&self.client, &ids.tenant))
            .await
            .map_err(|e| Refusal::new("unavailable", format!("{e:#}")))?;
        let unavailable = |what: &str, e: &dyn std::fmt::Display| {
            Refusal::new("unavailable", format!("{what} {object} in {bucket}: {e}"))
        };
        async {
            let mut reader = &bytes[..];
            store
                .put(object.as_str(), &mut reader)
                .await
                .map_err(|e| unavailable("cannot store", &e))?;
            // Read back: the record names only what the store holds, byte for byte.
            let (size, stored_sha) = stored_hash(store, &object, bytes.len() as u64)
                .await
                .map_err(|e| unavailable("cannot read back", &e))?;
            if size != bytes.len() as u64 || stored_sha != sha256 {
                let _ = store.delete(object.as_str()).await;
                return Err(unavailable(
                    "the stored copy does not match the file (removed):",
                    &format!("{size} bytes, sha256 {stored_sha}"),
                ));
            }
            Ok::<_, Refusal>(())
        }
        .instrument(tracing::info_span!("artifact", name = %name, bytes = bytes.len()))
        .await?;
        let artifact = ArtifactStored {
            name,
            size: bytes.len() as u64,
            sha256,
            bucket: Ident::parse("bucket", bucket.as_str())
                .expect("an artifacts bucket name is an identifier"),
            object,
        };
        let receipt = self
            .recorder
            .record(SessionEvent::Artifact(artifact.clone()))
            .await
            .map_err(|e| Refusal::new("unavailable", format!("{e:#}")))?;
        metrics::SESSION_ARTIFACT_BYTES.inc_by(artifact.size);
        tracing::info!(name = %artifact.name, size = artifact.size, sha256 = %artifact.sha256, seq = receipt.seq, "artifact stored");
        Ok(Response {
            ok: true,
            seq: Some(receipt.seq),
            event_id: Some(receipt.event_id),
            artifact: Some(artifact),
            ..Response::default()
        })
    }
}

/// The size and SHA-256 of what `store` holds under `object`, reading no more than one
/// chunk past `expected`.
async fn stored_hash(
    store: &ObjectStore,
    object: &str,
    expected: u64,
) -> anyhow::Result<(u64, String)> {
    use sha2::Digest as _;
    let mut reader = store.get(object).await?;
    let mut hasher = sha2::Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        size += n as u64;
        anyhow::ensure!(size <= expected, "the object is larger than the file");
        hasher.update(&buf[..n]);
    }
    Ok((size, hex(&hasher.finalize())))
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex(&sha2::Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of the regular file `path` names (relative to `workdir`, or absolute), if it
/// lies under `workdir` once every symlink is resolved and holds at most `max` bytes.
/// What is checked is the file actually opened, so a path swapped for a symlink between
/// the check and the open cannot lead outside.
fn read_artifact(workdir: &Path, path: &Path, max: u64) -> Result<Vec<u8>, Refusal> {
    use std::io::Read as _;
    use std::os::fd::AsRawFd as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let joined = if path.is_absolute() {
        path.to_owned()
    } else {
        workdir.join(path)
    };
    let resolved = std::fs::canonicalize(&joined)
        .map_err(|e| Refusal::new("not_found", format!("{}: {e}", joined.display())))?;
    let outside = |real: &Path| {
        Refusal::new(
            "outside_workdir",
            format!(
                "{} resolves to {}, outside the run's working directory {}; artifacts come from under it",
                path.display(),
                real.display(),
                workdir.display()
            ),
        )
    };
    if !resolved.starts_with(workdir) {
        return Err(outside(&resolved));
    }
    // O_NOFOLLOW: the last component is no symlink; O_NONBLOCK: a FIFO does not hang the open.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&resolved)
        .map_err(|e| Refusal::new("not_a_file", format!("{}: {e}", resolved.display())))?;
    if let Ok(real) = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        && !real.starts_with(workdir)
    {
        return Err(outside(&real));
    }
    let meta = file
        .metadata()
        .map_err(|e| Refusal::new("not_a_file", format!("{}: {e}", resolved.display())))?;
    if !meta.is_file() {
        return Err(Refusal::new(
            "not_a_file",
            format!("{} is not a regular file", resolved.display()),
        ));
    }
    let too_large = |size: u64| {
        Refusal::new(
            "too_large",
            format!(
                "{} holds {size} bytes or more, over the most an artifact may (--max-artifact-bytes {max})",
                resolved.display()
            ),
        )
    };
    if meta.len() > max {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Refusal::new("not_a_file", format!("{}: {e}", resolved.display())))?;
    if bytes.len() as u64 > max {
        // It grew while being read.
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_read_as_documented_and_unknown_fields_are_refused() {
        let checkpoint: Request = serde_json::from_str(r#"{"checkpoint": {"note": "x"}}"#).unwrap();
        assert_eq!(
            checkpoint,
            Request::Checkpoint {
                note: Some("x".into())
            }
        );
        let bare: Request = serde_json::from_str(r#"{"checkpoint": {}}"#).unwrap();
        assert_eq!(bare, Request::Checkpoint { note: None });
        let artifact: Request =
            serde_json::from_str(r#"{"artifact": {"path": "out/r.txt"}}"#).unwrap();
        assert_eq!(
            artifact,
            Request::Artifact {
                path: "out/r.txt".into(),
                name: None
            }
        );
        for bad in [
            r#"{"checkpoint": {"note": "x", "extra": 1}}"#,
            r#"{"delete": {}}"#,
            r#"{"artifact": {}}"#,
            r#"[]"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_artifact_must_be_a_bounded_regular_file_under_the_working_directory() {
        let root = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(root.path()).unwrap();
        let work = root.join("work");
        std::fs::create_dir_all(work.join("out")).unwrap();
        std::fs::write(work.join("out/report.txt"), b"twelve bytes").unwrap();
        std::fs::write(root.join("secret"), b"outside").unwrap();
        std::os::unix::fs::symlink(root.join("secret"), work.join("escape")).unwrap();
        std::os::unix::fs::symlink(work.join("out/report.txt"), work.join("inside")).unwrap();
        std::os::unix::fs::symlink(&root, work.join("up")).unwrap();

        assert_eq!(
            read_artifact(&work, Path::new("out/report.txt"), 64).unwrap(),
            b"twelve bytes"
        );
        assert_eq!(
            read_artifact(&work, &work.join("inside"), 64).unwrap(),
            b"twelve bytes",
            "a symlink to a file inside is that file"
        );
        let code = |path: &Path, max| read_artifact(&work, path, max).unwrap_err().code;
        assert_eq!(code(Path::new("escape"), 64), "outside_workdir");
        assert_eq!(code(Path::new("up/secret"), 64), "outside_workdir");
        assert_eq!(code(Path::new("../secret"), 64), "outside_workdir");
        assert_eq!(code(&root.join("secret"), 64), "outside_workdir");
        assert_eq!(code(Path::new("out"), 64), "not_a_file");
        assert_eq!(code(Path::new("missing"), 64), "not_found");
        assert_eq!(code(Path::new("out/report.txt"), 11), "too_large");
    }

    #[test]
    fn the_default_http_url_is_reachable_from_this_machine() {
        assert_eq!(
            default_http_url("0.0.0.0:7077".parse().unwrap()),
            "http://127.0.0.1:7077"
        );
        assert_eq!(
            default_http_url("10.0.0.5:80".parse().unwrap()),
            "http://10.0.0.5:80"
        );
    }

    #[test]
    fn sha256_is_lowercase_hex() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}

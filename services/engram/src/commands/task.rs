//! `engram task apply|status`: a task's agents as local processes, from a YAML spec.
//!
//! ```yaml
//! tenant: acme
//! task: fix-login
//! ttl: 2h                 # everything is stopped then
//! context: shared         # every role's default: shared or isolated
//! memory:
//!   scope: task:fix-login # default task:<task>
//!   persistence: durable  # durable, or session
//! max_restarts: 5         # per replica
//! roles:
//!   - name: planner
//!     replicas: 1
//!     command: ["./planner.sh"]
//!   - name: coder
//!     replicas: 20
//!     context: isolated   # this role's own
//!     command: ["python3", "coder.py"]
//! ```
//!
//! - **context** is what each replica's key may use (`engram run --context`). `shared`:
//!   the task's scope and the replica's session scope, so replicas see and build on each
//!   other's memory. `isolated`: its session's scope alone (and those of the sessions it
//!   resumes after a failure), so it neither sees nor changes the others'; it is told to
//!   write there by `ENGRAM_SCOPE`. The session records (`engram task status`) go to the
//!   task's scope either way.
//! - **persistence** is how long what the task wrote is kept. `durable`: until erased
//!   (`engram erase`). `session`: as long as the task runs. When `apply` ends (the ttl,
//!   ctrl-c, or every replica done) it erases, with the verified erasure of `engram
//!   erase`, the task's scope and every session scope its replicas ran with, and deletes
//!   their artifacts; the ledger keeps the erasure's report, and `task status` shows it.
//!
//! `apply` starts every replica through `engram run` (each its own session and key, all on
//! the task's scope), restarts a replica that fails by resuming its session (`engram session
//! resume <id> --exec`, so the new run starts with the handoff brief), stops everything at
//! the ttl (SIGTERM, then SIGKILL after a grace), and prints progress. `status` shows each
//! session of the task with its role, state and last checkpoint, from the log, and the
//! replica it ran as when this machine's `apply` recorded it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use engram_schema::session::SessionContext;
use engram_schema::{Ident, Layer, Scope, ScopeKind, SubjectFilter};
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Bounds on a spec: it is read from a file anyone may hand over.
pub const MAX_SPEC_BYTES: u64 = 1024 * 1024;
pub const MAX_ROLES: usize = 32;
pub const MAX_REPLICAS: u32 = 256;
pub const MAX_ARGV: usize = 64;
pub const MAX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
pub const MAX_RESTARTS: u32 = 100;
/// How long replicas get to stop after SIGTERM, at the ttl or on ctrl-c.
const GRACE: Duration = Duration::from_secs(20);
/// The longest a failing replica waits before it is started again.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Subcommand)]
pub enum TaskCommand {
    /// Start the task's replicas from a spec, keep them running until the ttl, and show
    /// progress (ctrl-c stops them all).
    Apply {
        spec: PathBuf,
        /// Print progress every this often.
        #[arg(long, default_value = "10s")]
        progress: humantime::Duration,
    },
    /// Every session of the task: its role, replica, state and last checkpoint.
    Status {
        #[arg(long)]
        tenant: String,
        #[arg(long, value_name = "ID")]
        task: String,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Persistence {
    #[default]
    Durable,
    Session,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySpec {
    /// `kind:id`; only the task's own scope is accepted.
    #[serde(default)]
    pub scope: Option<String>,
    #[serde(default)]
    pub persistence: Persistence,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleSpec {
    pub name: Ident,
    pub replicas: u32,
    /// This role's context; default: the spec's.
    #[serde(default)]
    pub context: Option<SessionContext>,
    pub command: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    pub tenant: Ident,
    pub task: Ident,
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    #[serde(default)]
    pub context: SessionContext,
    #[serde(default)]
    pub memory: MemorySpec,
    #[serde(default = "default_restarts")]
    pub max_restarts: u32,
    pub roles: Vec<RoleSpec>,
}

fn default_restarts() -> u32 {
    5
}

impl TaskSpec {
    /// Reads and checks a spec file: every bound, with the field that breaks it.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let meta = std::fs::metadata(path)
            .with_context(|| format!("cannot read the task spec {}", path.display()))?;
        anyhow::ensure!(
            meta.len() <= MAX_SPEC_BYTES,
            "the task spec {} is {} bytes; at most {MAX_SPEC_BYTES}",
            path.display(),
            meta.len()
        );
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the task spec {}", path.display()))?;
        let spec: Self = serde_norway::from_str(&text)
            .with_context(|| format!("{} is not a task spec", path.display()))?;
        spec.check()?;
        Ok(spec)
    }

    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.ttl.is_zero() && self.ttl <= MAX_TTL,
            "ttl must be more than 0 and at most 7 days"
        );
        anyhow::ensure!(
            !self.roles.is_empty() && self.roles.len() <= MAX_ROLES,
            "roles: 1 to {MAX_ROLES}"
        );
        anyhow::ensure!(
            self.max_restarts <= MAX_RESTARTS,
            "max_restarts: at most {MAX_RESTARTS}"
        );
        let mut names = std::collections::BTreeSet::new();
        for role in &self.roles {
            anyhow::ensure!(
                names.insert(role.name.clone()),
                "role {} appears twice",
                role.name
            );
            anyhow::ensure!(
                !role.command.is_empty() && role.command.len() <= MAX_ARGV,
                "role {}: command must have 1 to {MAX_ARGV} items, the program first",
                role.name
            );
            anyhow::ensure!(
                role.command
                    .iter()
                    .all(|a| a.len() <= 4096 && !a.contains('\0')),
                "role {}: a command item is longer than 4096 bytes or holds a NUL",
                role.name
            );
        }
        let total: u64 = self.roles.iter().map(|r| u64::from(r.replicas)).sum();
        anyhow::ensure!(
            (1..=u64::from(MAX_REPLICAS)).contains(&total),
            "replicas: 1 to {MAX_REPLICAS} in all roles together, here {total}"
        );
        if let Some(scope) = &self.memory.scope {
            let scope: Scope = scope
                .parse()
                .map_err(|e| anyhow::anyhow!("memory.scope: {e}"))?;
            anyhow::ensure!(
                scope.kind == ScopeKind::Task && scope.id == self.task,
                "memory.scope must be the task's own scope, task:{}: `engram run` gives each replica that scope and its session's",
                self.task
            );
        }
        Ok(())
    }
}

/// What this machine's `apply` remembers of a task's replicas: which sessions each ran as.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Ledger {
    replicas: BTreeMap<String, Vec<String>>,
    /// Set when `persistence: session` erased the task's memory at the end of an apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    erased: Option<Erased>,
}

/// What the end of a `persistence: session` task erased.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Erased {
    at: chrono::DateTime<chrono::Utc>,
    scopes: Vec<String>,
    events_purged: u64,
    artifacts_deleted: u64,
    /// What could not be done: run `engram erase` with the same scopes to finish it.
    incomplete: Vec<String>,
}

fn ledger_path(config: &Config, tenant: &Ident, task: &Ident) -> PathBuf {
    config
        .home
        .join("tasks")
        .join(tenant.as_str())
        .join(format!("{task}.json"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum ReplicaState {
    Starting,
    Running,
    Restarting,
    Done,
    Failed,
    Stopped,
}

#[derive(Debug)]
struct Replica {
    role: Ident,
    context: SessionContext,
    index: u32,
    command: Vec<String>,
    state: ReplicaState,
    restarts: u32,
    sessions: Vec<String>,
    last_exit: Option<i32>,
}

impl Replica {
    fn name(&self) -> String {
        format!("{}-{}", self.role, self.index)
    }
}

/// One `engram run` (or `session resume --exec`) of a replica, to the end. Sends the session
/// id it prints as soon as it does; returns the exit code (128 + signal for a signal).
async fn run_once(
    args: Vec<String>,
    env: Vec<(String, String)>,
    label: String,
    session_tx: tokio::sync::mpsc::UnboundedSender<(usize, String)>,
    at: usize,
    stop: CancellationToken,
) -> i32 {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("engram"));
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(&args)
        .envs(env)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("[{label}] cannot start engram run: {e}");
            return 127;
        }
    };
    let stderr = child.stderr.take().expect("piped");
    let forward = tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            // "engram run: session <id> of task …"
            if let Some(rest) = line.strip_prefix("engram run: session ")
                && let Some(id) = rest.split_whitespace().next()
            {
                let _ = session_tx.send((at, id.to_owned()));
            }
            eprintln!("[{label}] {line}");
        }
    });
    let status = tokio::select! {
        s = child.wait() => s,
        () = stop.cancelled() => {
            if let Some(pid) = child.id() {
                // SAFETY: kill(2) on our own child's pid, not yet reaped.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            }
            match tokio::time::timeout(GRACE, child.wait()).await {
                Ok(s) => s,
                Err(_) => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            }
        }
    };
    let _ = forward.await;
    match status {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt as _;
            s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
        }
        Err(_) => 1,
    }
}

fn global_args(config: &Config) -> Vec<String> {
    let mut args = vec!["--nats".to_owned(), config.client_url()];
    if let Some(creds) = &config.nats.creds {
        args.push("--creds".into());
        args.push(creds.display().to_string());
    }
    args
}

pub async fn run(config: &Config, command: TaskCommand, json: bool) -> anyhow::Result<ExitCode> {
    match command {
        TaskCommand::Apply { spec, progress } => apply(config, &spec, *progress, json).await,
        TaskCommand::Status { tenant, task } => status(config, &tenant, &task, json).await,
    }
}

async fn apply(
    config: &Config,
    spec_path: &Path,
    every: Duration,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let spec = TaskSpec::load(spec_path)?;
    let (tenant, task) = (spec.tenant.clone(), spec.task.clone());
    let ledger_file = ledger_path(config, &tenant, &task);
    let mut ledger: Ledger = std::fs::read(&ledger_file)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let mut replicas: Vec<Replica> = spec
        .roles
        .iter()
        .flat_map(|r| {
            (0..r.replicas).map(|i| Replica {
                role: r.name.clone(),
                context: r.context.unwrap_or(spec.context),
                index: i,
                command: r.command.clone(),
                state: ReplicaState::Starting,
                restarts: 0,
                sessions: Vec::new(),
                last_exit: None,
            })
        })
        .collect();
    let stop = CancellationToken::new();
    let started = Instant::now();
    let deadline = started + spec.ttl;
    let (session_tx, mut session_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, String)>();
    let mut runs: JoinSet<(usize, i32)> = JoinSet::new();
    let base = global_args(config);
    let env = |r: &Replica| -> Vec<(String, String)> {
        vec![
            ("ENGRAM_HOME".into(), config.home.display().to_string()),
            ("ENGRAM_REPLICA".into(), r.name()),
            (
                "ENGRAM_PERSISTENCE".into(),
                serde_json::to_value(spec.memory.persistence)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default(),
            ),
        ]
    };
    let start_args = |r: &Replica| -> Vec<String> {
        let mut a = base.clone();
        match r.sessions.last() {
            // A failed replica resumes its last session: the next run gets its brief.
            Some(previous) => a.extend([
                "session".into(),
                "resume".into(),
                previous.clone(),
                "--tenant".into(),
                tenant.to_string(),
                "--task".into(),
                task.to_string(),
                "--into".into(),
                config
                    .home
                    .join("tasks")
                    .join(tenant.as_str())
                    .join(format!("{task}-resume-{}-{}", r.name(), r.restarts))
                    .display()
                    .to_string(),
                "--context".into(),
                r.context.as_str().into(),
                "--exec".into(),
                "--".into(),
            ]),
            None => a.extend([
                "run".into(),
                "--tenant".into(),
                tenant.to_string(),
                "--task".into(),
                task.to_string(),
                "--role".into(),
                r.role.to_string(),
                "--context".into(),
                r.context.as_str().into(),
                "--".into(),
            ]),
        }
        a.extend(r.command.iter().cloned());
        a
    };
    for (i, r) in replicas.iter_mut().enumerate() {
        r.state = ReplicaState::Running;
        runs.spawn(run_task(
            start_args(r),
            env(r),
            r.name(),
            session_tx.clone(),
            i,
            stop.clone(),
            None,
        ));
    }
    eprintln!(
        "task {task} of tenant {tenant}: {} replicas started, stopping in {}",
        replicas.len(),
        humantime::format_duration(spec.ttl)
    );
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    let mut stopping = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(deadline.into()), if !stopping => {
                eprintln!("task {task}: ttl reached; stopping every replica");
                stopping = true;
                stop.cancel();
            }
            () = crate::up::wait_for_signal(), if !stopping => {
                eprintln!("task {task}: stopping every replica");
                stopping = true;
                stop.cancel();
            }
            Some((i, session)) = session_rx.recv() => {
                replicas[i].sessions.push(session);
                ledger.replicas.insert(replicas[i].name(), replicas[i].sessions.clone());
                save_ledger(&ledger_file, &ledger);
            }
            _ = tick.tick() => {
                report(&task, &replicas, started, deadline, json);
            }
            done = runs.join_next() => {
                let Some(done) = done else { break };
                let (i, code) = done.context("a replica's supervisor panicked")?;
                let r = &mut replicas[i];
                r.last_exit = Some(code);
                if stopping {
                    r.state = ReplicaState::Stopped;
                } else if code == 0 {
                    r.state = ReplicaState::Done;
                } else if r.restarts < spec.max_restarts {
                    r.restarts += 1;
                    r.state = ReplicaState::Restarting;
                    let backoff = Duration::from_secs(1u64 << r.restarts.min(5)).min(MAX_BACKOFF);
                    eprintln!(
                        "[{}] exited with {code}; restart {} of {} in {backoff:?}{}",
                        r.name(),
                        r.restarts,
                        spec.max_restarts,
                        r.sessions.last().map_or(String::new(), |s| format!(", resuming session {s}"))
                    );
                    runs.spawn(run_task(start_args(r), env(r), r.name(), session_tx.clone(), i, stop.clone(), Some(backoff)));
                    r.state = ReplicaState::Running;
                } else {
                    r.state = ReplicaState::Failed;
                    eprintln!("[{}] exited with {code}; no restarts left", r.name());
                }
            }
        }
    }
    report(&task, &replicas, started, deadline, json);
    let failed = replicas
        .iter()
        .filter(|r| r.state == ReplicaState::Failed)
        .count();
    let mut forgotten = true;
    if spec.memory.persistence == Persistence::Session {
        let erased = forget(config, &tenant, &task, &ledger).await?;
        forgotten = erased.incomplete.is_empty();
        ledger.erased = Some(erased);
        save_ledger(&ledger_file, &ledger);
    }
    Ok(if failed == 0 && forgotten {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[allow(clippy::too_many_arguments)]
async fn run_task(
    args: Vec<String>,
    env: Vec<(String, String)>,
    label: String,
    session_tx: tokio::sync::mpsc::UnboundedSender<(usize, String)>,
    at: usize,
    stop: CancellationToken,
    after: Option<Duration>,
) -> (usize, i32) {
    if let Some(after) = after {
        tokio::select! {
            () = tokio::time::sleep(after) => {}
            () = stop.cancelled() => return (at, 0),
        }
    }
    (at, run_once(args, env, label, session_tx, at, stop).await)
}

/// `persistence: session`: erases the task's scope and its replicas' session scopes (the
/// verified erasure of `engram erase`), and deletes their artifacts.
async fn forget(
    config: &Config,
    tenant: &Ident,
    task: &Ident,
    ledger: &Ledger,
) -> anyhow::Result<Erased> {
    let mut scopes = vec![Scope::new(ScopeKind::Task, task.as_str())?];
    let mut sessions: Vec<&String> = ledger.replicas.values().flatten().collect();
    sessions.sort();
    sessions.dedup();
    for s in sessions {
        scopes.push(Scope::new(ScopeKind::Session, s)?);
    }
    eprintln!(
        "task {task}: persistence session: erasing its memory ({} scopes: task:{task} and {} session(s))",
        scopes.len(),
        scopes.len() - 1
    );
    let client = super::connect(config).await?;
    let by = format!(
        "engram task apply {task} ({})",
        std::env::var("USER").unwrap_or_else(|_| "admin".into())
    );
    let mut erased = Erased {
        at: chrono::Utc::now(),
        scopes: scopes.iter().map(ToString::to_string).collect(),
        ..Erased::default()
    };
    for chunk in scopes.chunks(engram_sdk::proto::limits::MAX_ERASE_SCOPES) {
        match client
            .erase(tenant, chunk, &config.projectors.snapshots, &by)
            .await
        {
            Ok(report) => {
                erased.events_purged += report.events_purged;
                erased.incomplete.extend(report.incomplete);
            }
            Err(e) => erased.incomplete.push(format!("{e}")),
        }
    }
    match delete_artifacts(&client, tenant, task).await {
        Ok(n) => erased.artifacts_deleted = n,
        Err(e) => erased
            .incomplete
            .push(format!("artifacts of task {task}: {e:#}")),
    }
    if erased.incomplete.is_empty() {
        eprintln!(
            "task {task}: memory erased: {} event(s), {} artifact(s); check with `engram erase verify --tenant {tenant} --scope task:{task}`",
            erased.events_purged, erased.artifacts_deleted
        );
    } else {
        eprintln!(
            "task {task}: the erasure is incomplete; once this is fixed, run `engram erase --tenant {tenant}` with a --scope for each scope in the task's ledger:"
        );
        for gap in &erased.incomplete {
            eprintln!("  NOT DONE: {gap}");
        }
    }
    Ok(erased)
}

/// Deletes the task's artifacts (`<tenant>/<task>/…` in the tenant's bucket and the
/// legacy one); a bucket that does not exist holds none.
async fn delete_artifacts(
    client: &engram_sdk::Client,
    tenant: &Ident,
    task: &Ident,
) -> anyhow::Result<u64> {
    let prefix = format!("{tenant}/{task}/");
    let js = client.bus().jetstream();
    let mut deleted = 0;
    for bucket in [
        super::run::artifacts_bucket(tenant),
        super::run::LEGACY_ARTIFACTS_BUCKET.to_owned(),
    ] {
        let store = match js.get_object_store(&bucket).await {
            Ok(store) => store,
            Err(e)
                if e.kind() == async_nats::jetstream::context::ObjectStoreErrorKind::GetStore =>
            {
                continue;
            }
            Err(e) => return Err(anyhow::anyhow!("bucket {bucket}: {e}")),
        };
        let mut names = Vec::new();
        let mut list = store
            .list()
            .await
            .with_context(|| format!("cannot list bucket {bucket}"))?;
        while let Some(info) = list.next().await {
            let info = info.with_context(|| format!("cannot list bucket {bucket}"))?;
            if info.name.starts_with(&prefix) {
                names.push(info.name);
            }
        }
        for name in names {
            store
                .delete(&name)
                .await
                .with_context(|| format!("cannot delete {name} from {bucket}"))?;
            deleted += 1;
        }
    }
    Ok(deleted)
}

fn save_ledger(path: &Path, ledger: &Ledger) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Ok(bytes) = serde_json::to_vec_pretty(ledger) {
        let tmp = path.with_extension("json.tmp");
        if std::fs::write(&tmp, bytes).is_ok() {
            let _ = std::fs::rename(tmp, path);
        }
    }
}

fn report(task: &Ident, replicas: &[Replica], started: Instant, deadline: Instant, json: bool) {
    let mut by_role: BTreeMap<String, BTreeMap<&'static str, usize>> = BTreeMap::new();
    for r in replicas {
        let state = match r.state {
            ReplicaState::Starting => "starting",
            ReplicaState::Running => "running",
            ReplicaState::Restarting => "restarting",
            ReplicaState::Done => "done",
            ReplicaState::Failed => "failed",
            ReplicaState::Stopped => "stopped",
        };
        *by_role
            .entry(r.role.to_string())
            .or_default()
            .entry(state)
            .or_default() += 1;
    }
    let restarts: u32 = replicas.iter().map(|r| r.restarts).sum();
    let left = deadline.saturating_duration_since(Instant::now());
    if json {
        println!(
            "{}",
            serde_json::json!({
                "task": task, "elapsed_s": started.elapsed().as_secs(),
                "ttl_left_s": left.as_secs(), "restarts": restarts, "roles": by_role,
            })
        );
    } else {
        let roles: Vec<String> = by_role
            .iter()
            .map(|(role, states)| {
                let s: Vec<String> = states.iter().map(|(k, n)| format!("{n} {k}")).collect();
                format!("{role}: {}", s.join(", "))
            })
            .collect();
        eprintln!(
            "task {task} +{}s  {}  restarts {restarts}  ttl left {}",
            started.elapsed().as_secs(),
            roles.join("  "),
            humantime::format_duration(Duration::from_secs(left.as_secs()))
        );
    }
}

async fn status(config: &Config, tenant: &str, task: &str, json: bool) -> anyhow::Result<ExitCode> {
    let tenant = Ident::parse("tenant", tenant)?;
    let task = Ident::parse("task", task)?;
    let client = super::connect(config).await?;
    let filter = SubjectFilter {
        tenant: Some(tenant.clone()),
        scope_kind: Some(ScopeKind::Task),
        scope_id: Some(task.clone()),
        layer: Some(Layer::Working),
        partition: None,
    };
    let mut sessions = super::session::Sessions::default();
    let mut events = client
        .replay(&filter, engram_bus::StartAt::Beginning)
        .await?;
    while let Some(item) = events.next().await {
        if let Ok(stored) = item {
            sessions.apply(&stored.event, stored.stored_at);
        }
    }
    let ledger: Ledger = std::fs::read(ledger_path(config, &tenant, &task))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let replica_of = |session: &str| {
        ledger
            .replicas
            .iter()
            .find(|(_, s)| s.iter().any(|x| x == session))
            .map(|(name, _)| name.clone())
    };
    let views = sessions.judged(chrono::Utc::now());
    if json {
        let rows: Vec<serde_json::Value> = views
            .iter()
            .map(|v| {
                serde_json::json!({
                    "session": v.session, "replica": replica_of(v.session.as_str()),
                    "role": v.role, "state": v.state, "exit_code": v.exit_code,
                    "signal": v.signal, "started_at": v.started_at,
                    "last_checkpoint": v.last_checkpoint, "checkpoints": v.checkpoints,
                    "machine": v.machine,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
    } else if views.is_empty() {
        match &ledger.erased {
            Some(e) => println!(
                "no sessions of task {task} of tenant {tenant}: its memory was erased at {} (persistence: session; {} scopes, {} events, {} artifacts{})",
                e.at,
                e.scopes.len(),
                e.events_purged,
                e.artifacts_deleted,
                if e.incomplete.is_empty() {
                    ""
                } else {
                    "; INCOMPLETE, see the ledger"
                }
            ),
            None => println!("no sessions of task {task} of tenant {tenant}"),
        }
    } else {
        for v in &views {
            println!(
                "{}  {:<12} {:<10} {:<10} last checkpoint: {}",
                v.session,
                replica_of(v.session.as_str()).unwrap_or_else(|| "-".into()),
                v.role.as_ref().map_or("-", Ident::as_str),
                serde_json::to_value(v.state)
                    .ok()
                    .and_then(|s| s.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                v.last_checkpoint.as_deref().unwrap_or("-"),
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> anyhow::Result<TaskSpec> {
        let spec: TaskSpec = serde_norway::from_str(text)?;
        spec.check()?;
        Ok(spec)
    }

    #[test]
    fn a_spec_in_the_seeds_shape_reads_and_bad_ones_name_their_fault() {
        let ok = spec(
            "tenant: acme\ntask: fix-login\nttl: 2h\ncontext: shared\nmemory:\n  scope: task:fix-login\n  persistence: durable\nroles:\n  - name: planner\n    replicas: 1\n    command: [\"./plan.sh\"]\n  - name: coder\n    replicas: 20\n    command: [\"python3\", \"coder.py\"]\n  - name: reviewer\n    replicas: 4\n    command: [\"./review.sh\"]\n",
        )
        .unwrap();
        assert_eq!(ok.roles.iter().map(|r| r.replicas).sum::<u32>(), 25);
        assert_eq!(ok.ttl, Duration::from_secs(7200));
        for (bad, says) in [
            ("tenant: acme\ntask: t\nttl: 1h\nroles: []\n", "roles"),
            (
                "tenant: acme\ntask: t\nttl: 1h\nroles:\n  - {name: a, replicas: 300, command: [x]}\n",
                "replicas",
            ),
            (
                "tenant: acme\ntask: t\nttl: 30d\nroles:\n  - {name: a, replicas: 1, command: [x]}\n",
                "ttl",
            ),
            (
                "tenant: acme\ntask: t\nttl: 1h\nroles:\n  - {name: a, replicas: 1, command: []}\n",
                "command",
            ),
            (
                "tenant: acme\ntask: t\nttl: 1h\nmemory: {scope: task:other}\nroles:\n  - {name: a, replicas: 1, command: [x]}\n",
                "memory.scope",
            ),
            (
                "tenant: acme\ntask: t\nttl: 1h\nroles:\n  - {name: a, replicas: 1, command: [x], shell: true}\n",
                "unknown field",
            ),
        ] {
            let e = spec(bad).unwrap_err();
            assert!(format!("{e:#}").contains(says), "{bad}: {e:#}");
        }
    }
}

//! `engram session`: the sessions `engram run` records ([`engram_schema::session`]).
//!
//! - `list` folds a task's session records (or every task's of a tenant) into one line per
//!   session: its role, when it started, its last heartbeat, and its state: `running`,
//!   `exited` (with its code or signal), or `dead`: no `ended` record, and nothing recorded
//!   for three heartbeat intervals (its supervisor was killed, or its machine is gone). It
//!   replays the task scope's `working` layer only, where the records are.
//! - `resume` picks a session's task up anywhere: its brief, artifacts and working memory,
//!   and with `--exec` the next run ([`super::resume`]).
//! - `checkpoint` and `artifact` are what a program running under `engram run` calls: they
//!   send one request to the session's socket (`$ENGRAM_SESSION_SOCKET`) and print the
//!   answer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use engram_bus::{ReadError, StartAt};
use engram_schema::session::{ArtifactStored, SessionContext, SessionEvent, SessionRecord};
use engram_schema::{Envelope, EventKind, Ident, Layer, Scope, ScopeKind, SubjectFilter};
use futures::StreamExt as _;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};

use super::run::{MAX_RESPONSE_BYTES, REQUEST_WITHIN, Request, Response};
use crate::config::Config;

/// A session silent for this many heartbeat intervals, without an `ended` record, is dead.
pub const DEAD_AFTER_INTERVALS: u32 = 3;
/// The interval assumed for a session whose `started` record was not read (it is older
/// than what the stream keeps): `engram run`'s default.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(30);
/// Artifacts listed per session; more are counted.
const MAX_LISTED_ARTIFACTS: usize = 100;

#[derive(Debug, clap::Subcommand)]
pub enum SessionCommand {
    /// The sessions of a task (or of every task of the tenant) with their state: running,
    /// exited (code or signal), or dead (silent for three heartbeat intervals, no end).
    List {
        #[arg(long)]
        tenant: String,
        /// Only this task's sessions: one replay of its scope (without it, every task's
        /// scope of the tenant is read).
        #[arg(long, value_name = "ID")]
        task: Option<String>,
    },
    /// Pick a session's task up here: write its handoff brief (what the task is, what was
    /// decided and why, what failed and how it was fixed, what is open, which skills apply,
    /// each citing its events), fetch its artifacts checked by hash, and write its working
    /// memory; with `--exec -- <command …>`, start the next run with ENGRAM_BRIEF.
    Resume(super::resume::ResumeArgs),
    /// From inside `engram run`: record a checkpoint of this session.
    Checkpoint {
        /// What the point is (default: "requested"); at most 4096 characters.
        #[arg(long)]
        note: Option<String>,
        #[command(flatten)]
        socket: SocketArg,
    },
    /// From inside `engram run`: store a file under the run's working directory as an
    /// artifact of this session (Object Store, with its SHA-256).
    Artifact {
        path: PathBuf,
        /// The artifact's name (default: the file's): 1-128 of A-Z a-z 0-9 . _ -.
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        socket: SocketArg,
    },
}

#[derive(Debug, clap::Args)]
pub struct SocketArg {
    /// The session's socket; `engram run` sets ENGRAM_SESSION_SOCKET for its program.
    #[arg(long, env = "ENGRAM_SESSION_SOCKET", value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

impl SocketArg {
    fn path(&self) -> anyhow::Result<&Path> {
        self.socket.as_deref().context(
            "no session socket: run this from a program started by `engram run` (which sets ENGRAM_SESSION_SOCKET), or give --socket",
        )
    }
}

pub async fn run(config: &Config, command: SessionCommand, json: bool) -> anyhow::Result<ExitCode> {
    match command {
        SessionCommand::List { tenant, task } => list(config, &tenant, task.as_deref(), json).await,
        SessionCommand::Resume(args) => super::resume::run(config, args, json).await,
        SessionCommand::Checkpoint { note, socket } => {
            let response = ask(socket.path()?, &Request::Checkpoint { note }).await?;
            Ok(answer(&response, json, |r| {
                format!("checkpoint recorded  seq={}", r.seq.unwrap_or_default())
            }))
        }
        SessionCommand::Artifact { path, name, socket } => {
            // Relative to where this runs, which the program may have changed.
            let path = std::path::absolute(&path)
                .with_context(|| format!("cannot resolve {}", path.display()))?;
            let response = ask(socket.path()?, &Request::Artifact { path, name }).await?;
            Ok(answer(&response, json, |r| match &r.artifact {
                Some(a) => format!(
                    "artifact {} stored  size={}  sha256={}  object={}  seq={}",
                    a.name,
                    a.size,
                    a.sha256,
                    a.object,
                    r.seq.unwrap_or_default()
                ),
                None => "artifact stored".into(),
            }))
        }
    }
}

/// Prints the answer; exit 1 when it is a refusal.
fn answer(response: &Response, json: bool, done: impl Fn(&Response) -> String) -> ExitCode {
    if json {
        println!(
            "{}",
            serde_json::to_string(response).expect("responses serialise")
        );
    }
    match &response.error {
        None if response.ok => {
            if !json {
                println!("{}", done(response));
            }
            ExitCode::SUCCESS
        }
        error => {
            if !json {
                let (code, message) = error
                    .as_ref()
                    .map_or(("unknown", "no reason given"), |e| (&*e.code, &*e.message));
                eprintln!("error: the session refused it ({code}): {message}");
            }
            ExitCode::from(1)
        }
    }
}

/// One request to the session's socket, and its answer.
async fn ask(socket: &Path, request: &Request) -> anyhow::Result<Response> {
    let connect = tokio::net::UnixStream::connect(socket);
    let mut stream = tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| anyhow::anyhow!("the session's socket did not accept within 5 s"))?
        .with_context(|| {
            format!(
                "cannot reach the session's socket {}; has its `engram run` ended?",
                socket.display()
            )
        })?;
    let mut line = serde_json::to_vec(request)?;
    line.push(b'\n');
    // A line the session refuses is answered before it is all read: a failed write is not
    // the end, the answer is.
    let _ = stream.write_all(&line).await;
    let mut reader = tokio::io::BufReader::new(stream).take(MAX_RESPONSE_BYTES as u64);
    let mut answer = Vec::new();
    let within = REQUEST_WITHIN + Duration::from_secs(10);
    tokio::time::timeout(within, reader.read_until(b'\n', &mut answer))
        .await
        .map_err(|_| anyhow::anyhow!("no answer from the session within {within:?}"))?
        .context("reading the session's answer")?;
    serde_json::from_slice(answer.trim_ascii_end()).with_context(|| {
        format!(
            "the session's answer is not one: {:?}",
            String::from_utf8_lossy(&answer)
        )
    })
}

/// What `engram session list` says of one session.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SessionView {
    pub session: Ident,
    pub tenant: Ident,
    pub task: Ident,
    /// The run's agent (its key's).
    pub agent: Ident,
    pub role: Option<Ident>,
    pub machine: Option<String>,
    pub pid: Option<u32>,
    pub command: Vec<String>,
    pub workdir: Option<String>,
    /// `shared` or `isolated` (absent: a run older than the field, which ran shared).
    pub context: Option<SessionContext>,
    /// The session this one resumes.
    pub resumes: Option<Ident>,
    pub heartbeat_ms: Option<u64>,
    pub started_at: Option<DateTime<Utc>>,
    pub last_heartbeat_at: Option<DateTime<Utc>>,
    /// The latest record of any step, by the server's clock: what liveness is judged by.
    pub last_seen_at: DateTime<Utc>,
    pub heartbeats: u64,
    pub checkpoints: u64,
    pub last_checkpoint: Option<String>,
    pub artifacts: Vec<ArtifactStored>,
    pub artifact_count: u64,
    pub ended_at: Option<DateTime<Utc>>,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// `running`, `exited` or `dead`, as of when the list was made.
    pub state: SessionState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    Running,
    Exited,
    Dead,
}

impl SessionView {
    fn new(record: &SessionRecord, event: &Envelope, stored_at: DateTime<Utc>) -> Self {
        Self {
            session: record.session.clone(),
            tenant: event.tenant.clone(),
            task: event.scope.id.clone(),
            agent: event.agent_id.clone(),
            role: None,
            machine: None,
            pid: None,
            command: Vec::new(),
            workdir: None,
            context: None,
            resumes: None,
            heartbeat_ms: None,
            started_at: None,
            last_heartbeat_at: None,
            last_seen_at: stored_at,
            heartbeats: 0,
            checkpoints: 0,
            last_checkpoint: None,
            artifacts: Vec::new(),
            artifact_count: 0,
            ended_at: None,
            exit_code: None,
            signal: None,
            state: SessionState::Running,
        }
    }

    fn apply(&mut self, record: SessionRecord, stored_at: DateTime<Utc>) {
        self.last_seen_at = self.last_seen_at.max(stored_at);
        match record.event {
            SessionEvent::Started(s) => {
                self.role = Some(s.role);
                self.machine = Some(s.machine);
                self.pid = Some(s.pid);
                self.command = s.command;
                self.workdir = s.workdir;
                self.context = s.context;
                self.resumes = s.resumes;
                self.heartbeat_ms = Some(s.heartbeat_ms);
                self.started_at = Some(stored_at);
            }
            SessionEvent::Heartbeat(_) => {
                self.heartbeats += 1;
                self.last_heartbeat_at = Some(stored_at);
            }
            SessionEvent::Checkpoint(c) => {
                self.checkpoints += 1;
                self.last_checkpoint = Some(c.note);
            }
            SessionEvent::Artifact(a) => {
                self.artifact_count += 1;
                if self.artifacts.len() < MAX_LISTED_ARTIFACTS {
                    self.artifacts.push(a);
                }
            }
            SessionEvent::Ended(e) => {
                self.ended_at = Some(stored_at);
                self.exit_code = e.exit_code;
                self.signal = e.signal;
            }
        }
    }

    /// Its state at `now`: exited once an `ended` record is read; dead when nothing was
    /// recorded for [`DEAD_AFTER_INTERVALS`] heartbeat intervals.
    fn judge(&mut self, now: DateTime<Utc>) {
        let interval = self
            .heartbeat_ms
            .map_or(DEFAULT_HEARTBEAT, Duration::from_millis);
        let silent = (now - self.last_seen_at).to_std().unwrap_or_default();
        self.state = if self.ended_at.is_some() {
            SessionState::Exited
        } else if silent > interval * DEAD_AFTER_INTERVALS {
            SessionState::Dead
        } else {
            SessionState::Running
        };
    }

    fn state_text(&self) -> String {
        match (self.state, self.exit_code, self.signal) {
            (SessionState::Running, ..) => "running".into(),
            (SessionState::Dead, ..) => "dead".into(),
            (SessionState::Exited, Some(code), _) => format!("exited({code})"),
            (SessionState::Exited, None, Some(signal)) => format!("exited(signal {signal})"),
            (SessionState::Exited, None, None) => "exited".into(),
        }
    }
}

/// Folds session records into one view per session, in the order they started.
#[derive(Debug, Default)]
pub struct Sessions {
    views: BTreeMap<(Ident, Ident, Ident), SessionView>,
    /// Records whose payload does not check (a raw publish): skipped.
    pub refused: u64,
}

impl Sessions {
    pub fn apply(&mut self, event: &Envelope, stored_at: DateTime<Utc>) {
        if event.kind != EventKind::Checkpoint || event.scope.kind != ScopeKind::Task {
            return;
        }
        let record = match SessionRecord::from_event(event) {
            Ok(Some(record)) => record,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(event_id = %event.event_id, error = %e, "session record refused");
                self.refused += 1;
                return;
            }
        };
        let key = (
            event.tenant.clone(),
            event.scope.id.clone(),
            record.session.clone(),
        );
        self.views
            .entry(key)
            .or_insert_with(|| SessionView::new(&record, event, stored_at))
            .apply(record, stored_at);
    }

    /// Every session, judged at `now`, oldest start first.
    pub fn judged(self, now: DateTime<Utc>) -> Vec<SessionView> {
        let mut views: Vec<SessionView> = self.views.into_values().collect();
        for view in &mut views {
            view.judge(now);
        }
        views.sort_by_key(|v| (v.started_at.unwrap_or(v.last_seen_at), v.session.clone()));
        views
    }
}

async fn list(
    config: &Config,
    tenant: &str,
    task: Option<&str>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let tenant = Ident::parse("tenant", tenant)?;
    let task = task.map(|t| Ident::parse("task", t)).transpose()?;
    let client = super::connect(config).await?;
    let mut sessions = Sessions::default();
    if client.agent_identity().is_some() {
        // An agent (a run's own key) reads through the query service, one scope at a time.
        let task = task.context(
            "with agent credentials, name the task (--task): the query service checks the agent may read it",
        )?;
        let scopes = engram_sdk::ScopeRequest {
            tenant,
            scope: Scope {
                kind: ScopeKind::Task,
                id: task,
            },
            grants: Vec::new(),
        };
        let mut after = 0;
        loop {
            let page = client
                .replay_page(&engram_sdk::proto::ReplayRequest {
                    scopes: scopes.clone(),
                    after_seq: after,
                    limit: engram_sdk::proto::limits::MAX_REPLAY_EVENTS,
                })
                .await?;
            for e in &page.events {
                if e.event.layer == Layer::Working {
                    sessions.apply(&e.event, e.stored_at);
                }
            }
            if page.done || page.next_after <= after {
                break;
            }
            after = page.next_after;
        }
    } else {
        let filter = SubjectFilter {
            tenant: Some(tenant),
            scope_kind: Some(ScopeKind::Task),
            scope_id: task,
            layer: Some(Layer::Working),
            partition: None,
        };
        let mut events = client.replay(&filter, StartAt::Beginning).await?;
        while let Some(item) = events.next().await {
            match item {
                Ok(stored) => sessions.apply(&stored.event, stored.stored_at),
                Err(ReadError::Decode { seq, subject, .. }) => {
                    tracing::debug!(seq, subject, "undecodable event skipped");
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    if sessions.refused > 0 {
        eprintln!(
            "warning: {} session records did not check and were skipped",
            sessions.refused
        );
    }
    let now = Utc::now();
    for view in sessions.judged(now) {
        if json {
            println!(
                "{}",
                serde_json::to_string(&view).expect("session views serialise")
            );
            continue;
        }
        let ago = |t: Option<DateTime<Utc>>| match t {
            Some(t) => format!(
                "{} ({}s ago)",
                t.format("%Y-%m-%d %H:%M:%S"),
                (now - t).num_seconds().max(0)
            ),
            None => "-".into(),
        };
        println!(
            "{}  task {}  role {}  {}  started {}  last heartbeat {}  {} pid {}  checkpoints {}  artifacts {}",
            view.session,
            view.task,
            view.role.as_ref().map_or("?", Ident::as_str),
            view.state_text(),
            ago(view.started_at),
            ago(view.last_heartbeat_at),
            view.machine.as_deref().unwrap_or("?"),
            view.pid.map_or("?".into(), |p| p.to_string()),
            view.checkpoints,
            view.artifact_count,
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use engram_schema::Envelope;
    use engram_schema::session::{
        CheckpointVia, SessionCheckpointed, SessionEnded, SessionHeartbeat, SessionStarted,
    };

    use super::*;

    fn id(s: &str) -> Ident {
        Ident::parse("id", s).unwrap()
    }

    fn record(session: &str, event: SessionEvent) -> Envelope {
        let record = SessionRecord {
            session: id(session),
            event,
        };
        Envelope::new(
            id("acme"),
            Scope::new(ScopeKind::Task, "fix").unwrap(),
            id(&format!("run-{session}")),
            id(session),
            Layer::Working,
            EventKind::Checkpoint,
            record.content(),
        )
    }

    fn started(heartbeat_ms: u64) -> SessionEvent {
        SessionEvent::Started(SessionStarted {
            role: id("coder"),
            command: vec!["make".into()],
            command_truncated: false,
            machine: "box".into(),
            pid: 7,
            heartbeat_ms,
            workdir: None,
            context: None,
            resumes: None,
        })
    }

    #[test]
    fn given_records_then_each_session_is_running_exited_or_dead() {
        let t0 = Utc::now();
        let at = |s: i64| t0 + chrono::Duration::seconds(s);
        let mut sessions = Sessions::default();
        // Given a session that ended with code 3, one whose heartbeats stopped, and one
        // still beating
        for (event, stored) in [
            (record("a", started(1_000)), at(0)),
            (
                record(
                    "a",
                    SessionEvent::Checkpoint(SessionCheckpointed {
                        note: "half way".into(),
                        via: CheckpointVia::Request,
                    }),
                ),
                at(1),
            ),
            (
                record(
                    "a",
                    SessionEvent::Ended(SessionEnded {
                        exit_code: Some(3),
                        signal: None,
                        duration_ms: 2_000,
                    }),
                ),
                at(2),
            ),
            (record("b", started(1_000)), at(0)),
            (
                record("b", SessionEvent::Heartbeat(SessionHeartbeat { beat: 1 })),
                at(1),
            ),
            (record("c", started(10_000)), at(0)),
            (
                record("c", SessionEvent::Heartbeat(SessionHeartbeat { beat: 1 })),
                at(10),
            ),
        ] {
            sessions.apply(&event, stored);
        }
        // And events that are no session records
        let mut other = record("d", started(1_000));
        other.content.data = Some(serde_json::json!({"finished": true}));
        sessions.apply(&other, at(0));
        let mut observation = record("e", started(1_000));
        observation.kind = EventKind::Observation;
        sessions.apply(&observation, at(0));

        // When judged 20 s on
        let views = sessions.judged(at(20));

        // Then
        let states: Vec<(&str, SessionState, String)> = views
            .iter()
            .map(|v| (v.session.as_str(), v.state, v.state_text()))
            .collect();
        assert_eq!(
            states,
            [
                ("a", SessionState::Exited, "exited(3)".to_owned()),
                ("b", SessionState::Dead, "dead".to_owned()),
                ("c", SessionState::Running, "running".to_owned()),
            ]
        );
        assert_eq!(views[0].checkpoints, 1);
        assert_eq!(views[0].last_checkpoint.as_deref(), Some("half way"));
        assert_eq!(views[1].heartbeats, 1);
        assert_eq!(views[1].last_heartbeat_at, Some(at(1)));
        assert_eq!(views[2].role.as_ref().map(Ident::as_str), Some("coder"));
    }

    #[test]
    fn a_record_that_does_not_check_is_counted_and_skipped() {
        let mut bad = record("a", started(1_000));
        bad.content.data = Some(serde_json::json!({"session": "a", "event": "started"}));
        let mut sessions = Sessions::default();
        sessions.apply(&bad, Utc::now());
        assert_eq!(sessions.refused, 1);
        assert!(sessions.judged(Utc::now()).is_empty());
    }
}

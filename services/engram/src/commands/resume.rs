//! `engram session resume <id>`: pick a session's task up anywhere (another machine, a
//! leaf node).
//!
//! 1. The session's task: `--task`, else the task whose scope holds the session's records.
//! 2. The brief ([`engram_brief`]): the task's events and the session's own (one bounded
//!    replay of `task:<ID>`, then one of `session:<id>` and of each session it resumed in
//!    turn, where an isolated run kept its work), the task boards of the task's scope
//!    (docs read model) and its skills (skills read model, by name), both read at the
//!    replay's last sequence or later, so the brief never cites what the read models have
//!    not seen. Written as `brief.md` and `brief.json`.
//! 3. The session's artifacts, fetched from the Object Store into `artifacts/`, each
//!    checked against the SHA-256 and size its record names; a file that does not match is
//!    removed and the resume fails naming it. A leaf node holds its tenant's artifacts
//!    only when it may read every task (the bucket is synced whole): an artifact it lacks
//!    is reported as stored on the hub and the resume goes on (`--require-artifacts` makes
//!    that an error).
//! 4. The session's working memory, written to `working.json`: the working-layer events of
//!    `session:<id>` (the log's, so every copy of it has them, leaves included) and the
//!    live entries of that scope's working-memory KV, as read now. They are not put back
//!    into the KV: a run resumed gets a new session, hence a new scope; on the machine that
//!    held the entries they are still there until their ttl. A leaf's bucket receives the
//!    hub's entries of the scopes it may read (not the other way), so a hub session's
//!    entries are there too.
//! 5. With `--exec -- <command …>`: the next run, exactly as `engram run` starts it (a new
//!    session and key, the same task, the same role unless `--role`, the same context
//!    unless `--context`; an isolated one's key also holds the resumed sessions' scopes), with `ENGRAM_BRIEF`
//!    (brief.md), `ENGRAM_BRIEF_JSON`, `ENGRAM_RESUME_DIR` and `ENGRAM_RESUMED_SESSION`
//!    in its environment; its first checkpoint after `started` is `resumes session <id>`.
//!
//! Everything is bounded: the events read (`--max-events`, the rest noted in the brief),
//! the items per section, the skills asked for, the artifacts fetched and their sizes.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use engram_brief::{BoardState, Brief, Input, Limits, SkillState, SourceEvent};
use engram_bus::{EntryBounds, ReadError, StartAt};
use engram_memory::brief_inputs::Asks;
use engram_schema::session::{SessionContext, SessionEvent, SessionRecord, check_artifact_name};
use engram_schema::{Ident, Layer, Scope, ScopeKind, SubjectFilter};
use engram_sdk::{Client, proto};
use futures::StreamExt as _;
use serde::Serialize;
use tokio::io::AsyncReadExt as _;

use super::run::{
    LEGACY_ARTIFACTS_BUCKET, MAX_RESUMED_SCOPES, Resuming, RunArgs, artifacts_bucket,
};
use crate::config::Config;

/// How long the read models may take to reach the replay's last sequence.
/// Most skills asked of the read model (one request each).
/// Largest artifact fetched: `engram run`'s own ceiling.
const MAX_ARTIFACT_BYTES: u64 = 1024 * 1024 * 1024;

#[derive(Debug, clap::Args)]
pub struct ResumeArgs {
    /// The session to resume (as `engram session list` shows it).
    pub session: String,
    #[arg(long)]
    pub tenant: String,
    /// The session's task; without it, the tenant's task scopes are searched for the
    /// session's records (admin only).
    #[arg(long, value_name = "ID")]
    pub task: Option<String>,
    /// Where the brief, the artifacts and the working memory go (default:
    /// ./engram-resume-<session>).
    #[arg(long, value_name = "DIR")]
    pub into: Option<PathBuf>,
    /// Fail when an artifact cannot be fetched (on a leaf node, they are on the hub).
    #[arg(long)]
    pub require_artifacts: bool,
    /// Most events the brief is built from; past it, the replay stops and the brief says so.
    #[arg(long, default_value_t = 100_000, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_events: u64,
    /// Most items per section of the brief (the latest are kept).
    #[arg(long, default_value_t = 50, value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub max_items: u64,
    /// With --exec: the next run's context, shared or isolated (default: the resumed
    /// session's). An isolated run's key also reads and writes the scopes of the sessions
    /// it resumes.
    #[arg(long, requires = "exec", value_name = "shared|isolated")]
    pub context: Option<String>,
    /// With --exec: the role of the next run (default: the resumed session's).
    #[arg(long, requires = "exec")]
    pub role: Option<String>,
    /// Start the next run of the task with the brief: `--exec -- <command …>`.
    #[arg(long, requires = "command")]
    pub exec: bool,
    /// The next run's program and its arguments, after `--`.
    #[arg(last = true, value_name = "COMMAND", requires = "exec")]
    pub command: Vec<String>,
}

/// What a resume did, as `--json` prints it.
#[derive(Debug, Serialize)]
struct Resumed {
    session: Ident,
    tenant: Ident,
    task: Ident,
    dir: PathBuf,
    brief: PathBuf,
    brief_json: PathBuf,
    working: PathBuf,
    events_read: usize,
    through_seq: u64,
    artifacts: Vec<Fetched>,
    notes: Vec<String>,
}

/// One artifact's fate.
#[derive(Debug, Serialize)]
struct Fetched {
    name: String,
    sha256: String,
    size: u64,
    /// `fetched` (checked by hash), `missing` (not in this server's Object Store),
    /// `unreachable` (the store could not be read), or `mismatch` (removed).
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

pub async fn run(config: &Config, args: ResumeArgs, json: bool) -> anyhow::Result<ExitCode> {
    let tenant = Ident::parse("tenant", &args.tenant)?;
    let session = Ident::parse("session", &args.session)?;
    let client = super::connect(config).await?;
    let limits = Limits {
        max_events: usize::try_from(args.max_events).unwrap_or(usize::MAX),
        max_items: usize::try_from(args.max_items).unwrap_or(usize::MAX),
        ..Limits::default()
    };
    let task = match &args.task {
        Some(task) => Ident::parse("task", task)?,
        None => find_task(&client, &tenant, &session, limits.max_events).await?,
    };
    let dir = args
        .into
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("engram-resume-{session}")));
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the resume directory {}", dir.display()))?;
    let dir =
        std::fs::canonicalize(&dir).with_context(|| format!("cannot resolve {}", dir.display()))?;

    let gathered = gather(&client, &tenant, &task, &session, limits).await?;
    let brief = engram_brief::build(&Input {
        tenant: tenant.clone(),
        task: task.clone(),
        session: Some(session.clone()),
        events: &gathered.events,
        boards: &gathered.boards,
        skills: &gathered.skills,
        notes: gathered.notes.clone(),
        limits,
    });
    if !brief.sessions.iter().any(|s| s.session == session) {
        anyhow::bail!(
            "no record of session {session} in task {task} of tenant {tenant} (among {} events read); check the id with `engram session list --tenant {tenant} --task {task}`",
            brief.events_read
        );
    }
    let brief_md = dir.join("brief.md");
    let brief_json = dir.join("brief.json");
    write_file(&brief_md, brief.markdown().as_bytes())?;
    write_file(
        &brief_json,
        &serde_json::to_vec_pretty(&brief).expect("briefs serialise"),
    )?;
    let working = dir.join("working.json");
    let kv = working_entries(&client, &tenant, &session).await;
    write_file(
        &working,
        &serde_json::to_vec_pretty(&working_memory(&gathered.events, &session, kv))
            .expect("working memory serialises"),
    )?;

    let artifacts = fetch_artifacts(&client, config, &brief, &session, &dir).await;
    let mut notes = brief.notes.clone();
    if brief.left_out.contains_key("artifacts") {
        notes.push("more artifacts than the brief holds: only those it lists were fetched".into());
    }
    let resumed = Resumed {
        session: session.clone(),
        tenant: tenant.clone(),
        task: task.clone(),
        dir: dir.clone(),
        brief: brief_md.clone(),
        brief_json: brief_json.clone(),
        working,
        events_read: brief.events_read,
        through_seq: brief.through_seq,
        artifacts,
        notes,
    };
    report(&resumed, &brief, json);
    let mismatched: Vec<&str> = resumed
        .artifacts
        .iter()
        .filter(|a| a.status == "mismatch")
        .map(|a| a.name.as_str())
        .collect();
    anyhow::ensure!(
        mismatched.is_empty(),
        "artifacts whose bytes do not match their recorded SHA-256 (removed): {}",
        mismatched.join(", ")
    );
    let unfetched: Vec<&str> = resumed
        .artifacts
        .iter()
        .filter(|a| a.status != "fetched")
        .map(|a| a.name.as_str())
        .collect();
    if args.require_artifacts && !unfetched.is_empty() {
        anyhow::bail!("--require-artifacts: not fetched: {}", unfetched.join(", "));
    }

    if !args.exec {
        return Ok(ExitCode::SUCCESS);
    }
    let role = match &args.role {
        Some(role) => role.clone(),
        None => brief
            .sessions
            .iter()
            .find(|s| s.session == session)
            .and_then(|s| s.role.as_ref())
            .map(|r| r.to_string())
            .context(
                "the resumed session's role is not recorded (its `started` record was not read): give --role",
            )?,
    };
    let context = args
        .context
        .clone()
        .unwrap_or_else(|| gathered.context.unwrap_or_default().as_str().to_owned());
    let run_args = next_run(&tenant, &task, &role, &context, &args.command)?;
    drop(client);
    let resuming = Resuming {
        session: Some(session.clone()),
        scopes: gathered
            .chain
            .iter()
            .rev()
            .map(|id| Scope {
                kind: ScopeKind::Session,
                id: id.clone(),
            })
            .collect(),
        env: vec![
            ("ENGRAM_BRIEF".into(), brief_md.display().to_string()),
            ("ENGRAM_BRIEF_JSON".into(), brief_json.display().to_string()),
            ("ENGRAM_RESUME_DIR".into(), dir.display().to_string()),
            ("ENGRAM_RESUMED_SESSION".into(), session.to_string()),
        ],
    };
    super::run::run_with(config, run_args, resuming).await
}

/// The arguments `engram run --tenant T --task ID --role R -- <command …>` would have:
/// parsed by `engram run`'s own parser, so every default is its.
fn next_run(
    tenant: &Ident,
    task: &Ident,
    role: &str,
    context: &str,
    command: &[String],
) -> anyhow::Result<RunArgs> {
    #[derive(clap::Parser)]
    struct Run {
        #[command(flatten)]
        args: RunArgs,
    }
    let mut argv: Vec<String> = [
        "run",
        "--tenant",
        tenant.as_str(),
        "--task",
        task.as_str(),
        "--role",
        role,
        "--context",
        context,
        "--",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend(command.iter().cloned());
    use clap::Parser as _;
    Ok(Run::try_parse_from(argv)
        .map_err(|e| anyhow::anyhow!("the next run's arguments: {e}"))?
        .args)
}

fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

fn report(resumed: &Resumed, brief: &Brief, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::to_string(resumed).expect("resume reports serialise")
        );
        return;
    }
    println!(
        "session {} of task {} (tenant {}): brief from {} events through seq {}: {} decisions, {} failures ({} unresolved), {} open items, {} skills",
        resumed.session,
        resumed.task,
        resumed.tenant,
        brief.events_read,
        brief.through_seq,
        brief.decisions.len(),
        brief.failures.len(),
        brief.failures.iter().filter(|f| f.fix.is_none()).count(),
        brief.open.len(),
        brief.skills.len(),
    );
    println!("brief       {}", resumed.brief.display());
    println!("brief json  {}", resumed.brief_json.display());
    println!("working     {}", resumed.working.display());
    for a in &resumed.artifacts {
        match &a.path {
            Some(path) => println!(
                "artifact    {}  {} bytes  sha256 {}  checked  {}",
                a.name,
                a.size,
                a.sha256,
                path.display()
            ),
            None => println!(
                "artifact    {}  {}: {}",
                a.name,
                a.status,
                a.reason.as_deref().unwrap_or("")
            ),
        }
    }
    for note in &resumed.notes {
        eprintln!("note: {note}");
    }
}

/// The task whose scope holds the session's records: the tenant's task scopes, working
/// layer, read until the first record of the session (at most `max` events).
async fn find_task(
    client: &Client,
    tenant: &Ident,
    session: &Ident,
    max: usize,
) -> anyhow::Result<Ident> {
    anyhow::ensure!(
        client.agent_identity().is_none(),
        "with agent credentials, name the session's task (--task)"
    );
    let filter = SubjectFilter {
        tenant: Some(tenant.clone()),
        scope_kind: Some(ScopeKind::Task),
        scope_id: None,
        layer: Some(Layer::Working),
        partition: None,
    };
    let mut events = client.replay(&filter, StartAt::Beginning).await?;
    let mut read = 0usize;
    while let Some(item) = events.next().await {
        let stored = match item {
            Ok(stored) => stored,
            Err(ReadError::Decode { .. }) => continue,
            Err(e) => return Err(e.into()),
        };
        if let Ok(Some(record)) = SessionRecord::from_event(&stored.event)
            && &record.session == session
        {
            return Ok(stored.event.scope.id);
        }
        read += 1;
        anyhow::ensure!(
            read < max,
            "no record of session {session} in the first {max} session records of tenant {tenant}; name its task (--task)"
        );
    }
    anyhow::bail!(
        "no record of session {session} in tenant {tenant}'s tasks; check the id with `engram session list --tenant {tenant}`"
    )
}

/// The session and those it resumed in turn, newest first, from the task's `started`
/// records; and the context the session ran in. A cycle or a missing record ends it.
fn resumed_chain(events: &[SourceEvent], session: &Ident) -> (Vec<Ident>, Option<SessionContext>) {
    let mut started = std::collections::HashMap::new();
    for e in events {
        if let Ok(Some(SessionRecord {
            session,
            event: SessionEvent::Started(s),
        })) = SessionRecord::from_event(&e.event)
        {
            started.entry(session).or_insert(s);
        }
    }
    let context = started.get(session).and_then(|s| s.context);
    let mut chain = vec![session.clone()];
    while chain.len() < MAX_RESUMED_SCOPES {
        let last = chain.last().expect("never empty");
        match started.get(last).and_then(|s| s.resumes.clone()) {
            Some(previous) if !chain.contains(&previous) => chain.push(previous),
            _ => break,
        }
    }
    (chain, context)
}

/// What the brief is built from.
struct Gathered {
    events: Vec<SourceEvent>,
    /// The session resumed, then the session it resumed, and so on (at most
    /// [`MAX_RESUMED_SCOPES`] of them, as far as the task's records tell).
    chain: Vec<Ident>,
    /// The context the resumed session ran in, as its `started` record says.
    context: Option<SessionContext>,
    boards: Vec<BoardState>,
    skills: Vec<SkillState>,
    notes: Vec<String>,
}

async fn gather(
    client: &Client,
    tenant: &Ident,
    task: &Ident,
    session: &Ident,
    limits: Limits,
) -> anyhow::Result<Gathered> {
    let task_scope = Scope {
        kind: ScopeKind::Task,
        id: task.clone(),
    };
    let session_scope = Scope {
        kind: ScopeKind::Session,
        id: session.clone(),
    };
    let mut notes = Vec::new();
    let mut events = Vec::new();
    replay(
        client,
        tenant,
        &task_scope,
        limits.max_events,
        &mut events,
        &mut notes,
    )
    .await?;
    let (chain, context) = resumed_chain(&events, session);
    // The session's own scope, then those of the sessions it resumed: an isolated run
    // kept its work there, not in the task's scope. A key that may not read them (a
    // resumer's own agent) still gets the task's brief, without them.
    for (i, id) in chain.iter().enumerate() {
        let room = limits.max_events.saturating_sub(events.len());
        if room == 0 {
            break;
        }
        let scope = if i == 0 {
            session_scope.clone()
        } else {
            Scope {
                kind: ScopeKind::Session,
                id: id.clone(),
            }
        };
        if let Err(e) = replay(client, tenant, &scope, room, &mut events, &mut notes).await {
            notes.push(format!(
                "the session's scope {scope} could not be read: {e:#}"
            ));
        }
    }
    let asks = Asks::new(tenant, &task_scope, &events);
    let listed = client
        .doc(&asks.boards())
        .await
        .map(|l| l.docs)
        .map_err(|e| e.to_string());
    let boards = asks.boards_of(listed, &mut notes);
    let mut skills = Vec::new();
    for request in asks.skills(&events, &mut notes) {
        let answer = client
            .skills(&request)
            .await
            .map(|a| a.skills)
            .map_err(|e| e.to_string());
        skills.extend(Asks::skills_of(&request, answer, &mut notes));
    }
    Ok(Gathered {
        chain,
        context,
        events,
        boards,
        skills,
        notes,
    })
}

/// Appends the events of `scope` to `out`, at most `max`; past it, says so in `notes`.
async fn replay(
    client: &Client,
    tenant: &Ident,
    scope: &Scope,
    max: usize,
    out: &mut Vec<SourceEvent>,
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    let start = out.len();
    let full = |out: &Vec<SourceEvent>| out.len() - start >= max;
    let cut = |notes: &mut Vec<String>| {
        notes.push(format!(
            "the replay of {scope} stopped at {max} events (--max-events): later events are not in the brief"
        ));
    };
    if client.agent_identity().is_some() {
        let scopes = proto::ScopeRequest {
            tenant: tenant.clone(),
            scope: scope.clone(),
            grants: Vec::new(),
        };
        let mut after = 0;
        loop {
            let page = client
                .replay_page(&proto::ReplayRequest {
                    scopes: scopes.clone(),
                    after_seq: after,
                    limit: proto::limits::MAX_REPLAY_EVENTS,
                })
                .await?;
            for e in page.events {
                if full(out) {
                    cut(notes);
                    return Ok(());
                }
                out.push(SourceEvent {
                    seq: e.seq,
                    event: e.event,
                });
            }
            if page.done || page.next_after <= after {
                return Ok(());
            }
            after = page.next_after;
        }
    }
    let filter = SubjectFilter {
        tenant: Some(tenant.clone()),
        scope_kind: Some(scope.kind),
        scope_id: Some(scope.id.clone()),
        layer: None,
        partition: None,
    };
    let mut events = client.replay(&filter, StartAt::Beginning).await?;
    let mut undecodable = 0u64;
    while let Some(item) = events.next().await {
        match item {
            Ok(stored) => {
                if full(out) {
                    cut(notes);
                    return Ok(());
                }
                out.push(SourceEvent {
                    seq: stored.seq,
                    event: stored.event,
                });
            }
            Err(ReadError::Decode { seq, subject, .. }) => {
                tracing::debug!(seq, subject, "undecodable event skipped");
                undecodable += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
    if undecodable > 0 {
        notes.push(format!(
            "{undecodable} events of {scope} could not be decoded and were skipped"
        ));
    }
    Ok(())
}

/// The live working-memory entries of `session:<id>`, or why they could not be read.
async fn working_entries(
    client: &Client,
    tenant: &Ident,
    session: &Ident,
) -> Result<(Vec<(String, String)>, usize), String> {
    let scope = Scope {
        kind: ScopeKind::Session,
        id: session.clone(),
    };
    if client.agent_identity().is_some() {
        let answer = client
            .working(&proto::WorkingRequest {
                scopes: proto::ScopeRequest {
                    tenant: tenant.clone(),
                    scope,
                    grants: Vec::new(),
                },
                op: proto::WorkingOp::List,
                key: None,
                value: None,
                ttl_ms: None,
            })
            .await
            .map_err(|e| e.to_string())?;
        return Ok((
            answer
                .entries
                .into_iter()
                .map(|e| (e.key, e.value))
                .collect(),
            answer.left_out,
        ));
    }
    let memory = client.working_memory().await.map_err(|e| e.to_string())?;
    let entries = memory
        .entries(tenant, &scope, EntryBounds::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok((
        entries
            .items
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
            .collect(),
        entries.left_out,
    ))
}

/// `working.json`: the session scope's working-layer events, and its KV entries as read now.
fn working_memory(
    events: &[SourceEvent],
    session: &Ident,
    kv: Result<(Vec<(String, String)>, usize), String>,
) -> serde_json::Value {
    let mut working: Vec<&SourceEvent> = events
        .iter()
        .filter(|s| {
            s.event.scope.kind == ScopeKind::Session
                && &s.event.scope.id == session
                && s.event.layer == Layer::Working
        })
        .collect();
    working.sort_by(|a, b| {
        (a.event.occurred_at, &a.event.event_id).cmp(&(b.event.occurred_at, &b.event.event_id))
    });
    working.dedup_by(|a, b| a.event.event_id == b.event.event_id);
    let events: Vec<serde_json::Value> = working
        .iter()
        .map(|s| serde_json::json!({"seq": s.seq, "event": s.event}))
        .collect();
    let kv = match kv {
        Ok((mut entries, left_out)) => {
            entries.sort();
            serde_json::json!({
                "entries": entries.into_iter().map(|(key, value)| serde_json::json!({"key": key, "value": value})).collect::<Vec<_>>(),
                "left_out": left_out,
            })
        }
        Err(reason) => serde_json::json!({"error": reason}),
    };
    serde_json::json!({
        "scope": format!("session:{session}"),
        "about": "the session's working memory: its scope's working-layer events (from the log) and its working-memory entries as read when resumed (they expire by their ttl, and are not copied into the next run's scope)",
        "events": events,
        "kv": kv,
    })
}

/// Fetches the session's artifacts into `dir/artifacts`, each checked by size and SHA-256.
async fn fetch_artifacts(
    client: &Client,
    config: &Config,
    brief: &Brief,
    session: &Ident,
    dir: &Path,
) -> Vec<Fetched> {
    let artifacts: Vec<_> = brief
        .artifacts
        .iter()
        .filter(|a| &a.session == session)
        .collect();
    if artifacts.is_empty() {
        return Vec::new();
    }
    let on_leaf = config.leaf.hub.is_some();
    let missing_reason = || {
        if on_leaf {
            "not on this leaf yet (the tenant's artifacts sync down to a leaf that may read every task; try again once it has synced)"
                .to_owned()
        } else {
            "not in this server's Object Store (on a leaf node: stored on the hub, not on this leaf)"
                .to_owned()
        }
    };
    let folder = dir.join("artifacts");
    let mut fetched = Vec::new();
    let agent = client.agent_identity().is_some();
    let mut stores = std::collections::BTreeMap::new();
    for a in artifacts {
        let mut out = Fetched {
            name: a.name.clone(),
            sha256: a.sha256.clone(),
            size: a.size,
            status: "unreachable",
            path: None,
            reason: None,
        };
        if agent {
            out.reason = Some(
                "an agent's key reaches no Object Store: resume with the admin's credentials to fetch artifacts".into(),
            );
            fetched.push(out);
            continue;
        }
        let own = artifacts_bucket(&brief.tenant);
        // A leaf's bucket (a session run on a leaf) holds what its tenant's runs stored
        // there: the object must be named under this tenant, and its bytes still match
        // the record's hash, whichever bucket they came from.
        let from_leaf = a
            .bucket
            .as_str()
            .starts_with(engram_access::leaf::LEAF_ARTIFACTS_PREFIX)
            && a.object.starts_with(&format!("{}/", brief.tenant));
        if a.bucket.as_str() != own && a.bucket.as_str() != LEGACY_ARTIFACTS_BUCKET && !from_leaf {
            out.reason = Some(format!(
                "its record names bucket {}, not the tenant's {own} or a leaf's: not fetched",
                a.bucket
            ));
            fetched.push(out);
            continue;
        }
        // Recorded names were checked at append; checked again, since this one becomes a
        // file name.
        if let Err(e) = check_artifact_name(&a.name) {
            out.reason = Some(e);
            fetched.push(out);
            continue;
        }
        if a.size > MAX_ARTIFACT_BYTES {
            out.reason = Some(format!(
                "{} bytes, over the {MAX_ARTIFACT_BYTES} an artifact may hold",
                a.size
            ));
            fetched.push(out);
            continue;
        }
        let store = match stores.get(a.bucket.as_str()) {
            Some(store) => Ok(store),
            None => match client
                .bus()
                .jetstream()
                .get_object_store(a.bucket.as_str())
                .await
            {
                Ok(store) => Ok(&*stores.entry(a.bucket.to_string()).or_insert(store)),
                Err(e) => Err(e),
            },
        };
        let store = match store {
            Ok(store) => store,
            Err(e) => {
                tracing::debug!(error = %e, bucket = %a.bucket, "artifact bucket not opened");
                out.status = "missing";
                out.reason = Some(missing_reason());
                fetched.push(out);
                continue;
            }
        };
        if let Err(e) = std::fs::create_dir_all(&folder) {
            out.reason = Some(format!("cannot create {}: {e}", folder.display()));
            fetched.push(out);
            continue;
        }
        let path = folder.join(&a.name);
        match fetch_one(store, &a.object, a.size, &a.sha256, &path).await {
            Ok(()) => {
                out.status = "fetched";
                out.path = Some(path);
            }
            Err(FetchError::Missing) => {
                out.status = "missing";
                out.reason = Some(missing_reason());
            }
            Err(FetchError::Mismatch(reason)) => {
                out.status = "mismatch";
                out.reason = Some(reason);
            }
            Err(FetchError::Unreachable(reason)) => out.reason = Some(reason),
        }
        fetched.push(out);
    }
    fetched
}

enum FetchError {
    Missing,
    Mismatch(String),
    Unreachable(String),
}

/// Streams `object` into `path` through a temporary file, hashing it; only a file of the
/// recorded size and SHA-256 is left at `path`.
async fn fetch_one(
    store: &async_nats::jetstream::object_store::ObjectStore,
    object: &str,
    size: u64,
    sha256: &str,
    path: &Path,
) -> Result<(), FetchError> {
    use async_nats::jetstream::object_store::GetErrorKind;
    use sha2::Digest as _;
    use tokio::io::AsyncWriteExt as _;
    let mut reader = match store.get(object).await {
        Ok(reader) => reader,
        Err(e) if e.kind() == GetErrorKind::NotFound => return Err(FetchError::Missing),
        Err(e) => {
            return Err(FetchError::Unreachable(format!(
                "cannot read {object}: {e}"
            )));
        }
    };
    // A hidden name: no artifact's name starts with a dot, so none is overwritten.
    let partial = path.with_file_name(format!(
        ".{}.partial",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    let result = async {
        let mut file = tokio::fs::File::create(&partial)
            .await
            .map_err(|e| FetchError::Unreachable(format!("{}: {e}", partial.display())))?;
        let mut hasher = sha2::Sha256::new();
        let mut read = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = tokio::time::timeout(Duration::from_secs(60), reader.read(&mut buf))
                .await
                .map_err(|_| FetchError::Unreachable(format!("{object}: no bytes for 60 s")))?
                .map_err(|e| FetchError::Unreachable(format!("reading {object}: {e}")))?;
            if n == 0 {
                break;
            }
            read += n as u64;
            if read > size {
                return Err(FetchError::Mismatch(format!(
                    "the stored object is larger than the {size} bytes recorded"
                )));
            }
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n])
                .await
                .map_err(|e| FetchError::Unreachable(format!("{}: {e}", partial.display())))?;
        }
        file.flush()
            .await
            .map_err(|e| FetchError::Unreachable(format!("{}: {e}", partial.display())))?;
        let got: String = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if read != size || got != sha256 {
            return Err(FetchError::Mismatch(format!(
                "{read} bytes with sha256 {got}; the record says {size} bytes with sha256 {sha256}"
            )));
        }
        tokio::fs::rename(&partial, path)
            .await
            .map_err(|e| FetchError::Unreachable(format!("{}: {e}", path.display())))
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&partial).await;
    }
    result
}

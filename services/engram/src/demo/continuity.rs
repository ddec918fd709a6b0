//! `engram demo continuity`: memory that follows a task from the cloud to a laptop.
//!
//! Two Engram homes on this machine, two `engram up` processes: the cloud's hub
//! (`--leaf-listen`) and a laptop's leaf (`--leaf`, with the credentials `engram leaf add`
//! wrote). The laptop comes online, then goes offline. Instance A works on a task in the
//! cloud, as any program would under `engram run`: it decides (and says why), hits a
//! failure, fixes it, records a skill, leaves an item open on the task board and stores its
//! notes as an artifact; then it is gone. The laptop comes back, syncs, and instance B runs
//! `engram session resume` there: its brief must answer "what did we decide and why, what
//! failed and how was it fixed, what is next", each answer citing the events A wrote. Every
//! answer is checked against the ids A recorded; one that differs ends the demo with an
//! error saying what.

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// The task instance A works on.
const TASK: &str = "fix-login";
const TENANT: &str = "acme";

#[derive(Debug, clap::Args)]
pub struct ContinuityArgs {
    /// Keep the two homes and the work directory here (default: a temp dir, removed after).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// Instance A: what a scripted agent does in the cloud. It records each event's id in
/// `ids` (the demo checks the brief against them).
const INSTANCE_A: &str = r#"set -e
id() { sed -n 's/.*"event_id":"\([^"]*\)".*/\1/p'; }
append() { engram --json append --tenant "$ENGRAM_TENANT" --scope "$ENGRAM_SCOPE" --agent "$ENGRAM_AGENT" --instance "$ENGRAM_INSTANCE" "$@"; }
d=$(append --kind observation '{"tags":["decision"],"content":{"text":"refresh the login token in the client instead of lengthening the session ttl","data":{"why":"a longer ttl widens the window in which a stolen token works"}}}' | id)
echo "decision=$d" >> ids
f=$(append --kind outcome '{"tags":["failure"],"content":{"text":"integration tests fail: a token refresh races the logout","data":{"success":false,"action":"run-tests"}}}' | id)
echo "failure=$f" >> ids
engram session checkpoint --note "tests red: refresh races logout" >/dev/null
x=$(append --kind outcome "{\"causation_id\":\"$f\",\"tags\":[\"fix\"],\"content\":{\"text\":\"hold the session lock while refreshing; the race is gone and the tests pass\",\"data\":{\"success\":true,\"action\":\"run-tests\"}}}" | id)
echo "fix=$x" >> ids
s=$(append --kind skill_recorded --layer procedural '{"content":{"text":"serialise token refresh with logout","data":{"name":"serialise-token-refresh","description":"hold the session lock while refreshing a token, so that a logout cannot race the refresh"}}}' | id)
echo "skill=$s" >> ids
engram doc edit task_board main --tenant "$ENGRAM_TENANT" --scope "$ENGRAM_SCOPE" --agent "$ENGRAM_AGENT" --instance "$ENGRAM_INSTANCE" \
  --set '/items/t-1={"title":"ship the refresh fix","status":"done"}' \
  --set '/items/t-2={"title":"add a regression test for the logout race","status":"todo"}' >/dev/null
printf 'refresh under the session lock; see the failing run of the integration tests\n' > notes.md
engram session artifact notes.md >/dev/null
engram session checkpoint --note "fix in; regression test still to write" >/dev/null
"#;

/// A child `engram up`, stopped with SIGTERM (killed on drop).
struct Up {
    child: tokio::process::Child,
}

impl Up {
    async fn start(home: &Path, args: &[String]) -> anyhow::Result<(Self, String)> {
        let exe = std::env::current_exe().context("cannot find this engram binary")?;
        let mut child = tokio::process::Command::new(exe)
            .arg("up")
            .args(args)
            .args(["--http", "127.0.0.1:0"])
            .env("ENGRAM_HOME", home)
            .env("ENGRAM_NATS__LEAFNODES_ADVERTISE", "false")
            .env("ENGRAM_LOG__FILTER", "warn")
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_CREDS")
            .env_remove("ENGRAM_API_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start engram up")?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let ready = tokio::time::timeout(Duration::from_secs(300), async {
            while let Some(line) = lines.next_line().await? {
                if line.contains("engram is up") {
                    return Ok::<_, std::io::Error>(Some(line));
                }
            }
            Ok(None)
        })
        .await;
        let line = match ready {
            Ok(Ok(Some(line))) => line,
            _ => anyhow::bail!(
                "engram up {args:?} did not come up; its log is {}/nats/nats-server.log",
                home.display()
            ),
        };
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok((Self { child }, line))
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on our own child's pid, not yet reaped.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        }
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }
}

/// The `engram` CLI against the Engram in `home` at `nats`.
fn engram(home: &Path, nats: &str) -> std::process::Command {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("engram"));
    let mut c = std::process::Command::new(exe);
    c.args(["--nats", nats])
        .env("ENGRAM_HOME", home)
        .env_remove("ENGRAM_CONFIG")
        .env_remove("ENGRAM_CREDS")
        .env_remove("ENGRAM_API_KEY");
    c
}

fn ok(c: &mut std::process::Command) -> anyhow::Result<String> {
    let out = c.output().context("cannot run engram")?;
    anyhow::ensure!(
        out.status.success(),
        "engram {:?} failed: {}",
        c.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// What the demo found, as `--json` prints it.
#[derive(Debug, serde::Serialize)]
pub struct Outcome {
    pub session: String,
    pub synced_events: usize,
    pub sync_seconds: f64,
    pub decision: String,
    pub failure: String,
    pub fix: String,
    pub skill: String,
    pub open: Vec<String>,
    pub artifacts_on_leaf: usize,
    pub brief: PathBuf,
}

pub async fn run(args: ContinuityArgs, json: bool) -> anyhow::Result<ExitCode> {
    let temp;
    let root = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            dir.clone()
        }
        None => {
            temp = tempfile::tempdir()?;
            temp.path().to_owned()
        }
    };
    let say = |line: String| {
        if !json {
            println!("{line}");
        }
    };
    let (hub_home, leaf_home, work) = (root.join("cloud"), root.join("laptop"), root.join("work"));
    std::fs::create_dir_all(&work)?;
    let (hub_port, leaf_port, leafnodes) = (free_port()?, free_port()?, free_port()?);
    let (hub_nats, leaf_nats) = (
        format!("nats://127.0.0.1:{hub_port}"),
        format!("nats://127.0.0.1:{leaf_port}"),
    );
    say(format!(
        "continuity: a hub (the cloud) and a leaf (a laptop), two Engram homes under {}",
        root.display()
    ));
    let (hub, _) = Up::start(
        &hub_home,
        &[
            "--nats-port".into(),
            hub_port.to_string(),
            "--leaf-listen".into(),
            format!("127.0.0.1:{leafnodes}"),
        ],
    )
    .await?;
    ok(engram(&hub_home, &hub_nats).args(["tenant", "add", TENANT]))?;
    let creds = hub_home.join("laptop.creds");
    ok(engram(&hub_home, &hub_nats).args([
        "leaf",
        "add",
        "laptop",
        "--tenant",
        TENANT,
        "--out",
        &creds.display().to_string(),
    ]))?;
    let leaf_args = vec![
        "--nats-port".into(),
        leaf_port.to_string(),
        "--leaf".into(),
        format!("nats-leaf://127.0.0.1:{leafnodes}"),
        "--creds".into(),
        creds.display().to_string(),
    ];
    let (leaf, _) = Up::start(&leaf_home, &leaf_args).await?;
    say("1. the laptop joins as leaf `laptop` of tenant acme (task:* and session:* sync both ways), then goes offline".into());
    leaf.stop().await;

    say(format!(
        "2. instance A works on task {TASK} in the cloud under `engram run`: it decides, fails, fixes, records a skill, leaves an item open, stores its notes"
    ));
    let exe = std::env::current_exe()?;
    let path = format!(
        "{}:{}",
        exe.parent()
            .map(Path::display)
            .map(|d| d.to_string())
            .unwrap_or_default(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = engram(&hub_home, &hub_nats)
        .args([
            "run", "--tenant", TENANT, "--task", TASK, "--role", "coder", "--", "sh", "-c",
            INSTANCE_A,
        ])
        .current_dir(&work)
        .env("PATH", &path)
        .stdout(Stdio::null())
        .output()
        .context("cannot run instance A")?;
    let stderr = String::from_utf8_lossy(&run.stderr);
    anyhow::ensure!(run.status.success(), "instance A failed: {stderr}");
    let session = stderr
        .lines()
        .find_map(|l| l.strip_prefix("engram run: session "))
        .and_then(|r| r.split_whitespace().next())
        .context("engram run did not say which session it was")?
        .to_owned();
    let ids = std::fs::read_to_string(work.join("ids"))?;
    let id = |key: &str| -> anyhow::Result<String> {
        ids.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
            .with_context(|| format!("instance A recorded no {key} id"))
    };
    let (decision, failure, fix, skill) =
        (id("decision")?, id("failure")?, id("fix")?, id("skill")?);
    say(format!(
        "   instance A was session {session}; it is gone now"
    ));

    let (leaf, _) = Up::start(&leaf_home, &leaf_args).await?;
    let synced_from = Instant::now();
    let hub_count = count(&hub_home, &hub_nats)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if count(&leaf_home, &leaf_nats)? >= hub_count {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the laptop never received the task's events"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let sync_seconds = synced_from.elapsed().as_secs_f64();
    say(format!(
        "3. the laptop is back online: the task's {hub_count} events reached it in {sync_seconds:.1} s"
    ));

    // The artifact comes down beside the events (the tenant's bucket is synced to a leaf
    // that may read every task): resumed with --require-artifacts once it has.
    let into = work.join("resume");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let out = engram(&leaf_home, &leaf_nats)
            .args([
                "--json", "session", "resume", &session, "--tenant", TENANT, "--task", TASK,
            ])
            .args(["--require-artifacts", "--into"])
            .arg(&into)
            .output()?;
        if out.status.success() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "engram session resume failed on the laptop: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let brief: engram_brief::Brief =
        serde_json::from_slice(&std::fs::read(into.join("brief.json"))?)
            .context("the resume wrote no brief.json")?;
    say(format!(
        "4. instance B on the laptop: engram session resume {session}\n   what did we decide and why?"
    ));
    let d = brief
        .decisions
        .iter()
        .find(|d| d.event_id.as_str() == decision)
        .with_context(|| format!("the brief does not give the decision {decision}"))?;
    say(format!(
        "     {} (because {}) [{}]",
        d.text,
        d.why.as_deref().unwrap_or("-"),
        d.event_id
    ));
    say("   what failed, and how was it fixed?".into());
    let f = brief
        .failures
        .iter()
        .find(|f| f.event_id.as_str() == failure)
        .with_context(|| format!("the brief does not give the failure {failure}"))?;
    let fixed = f
        .fix
        .as_ref()
        .with_context(|| format!("the brief says failure {failure} is unresolved"))?;
    anyhow::ensure!(
        fixed.event_id.as_str() == fix,
        "the brief names {} as the fix of {failure}, not {fix}",
        fixed.event_id
    );
    say(format!(
        "     {} [{}]\n     fixed: {} [{}]",
        f.text, f.event_id, fixed.text, fixed.event_id
    ));
    say("   what is next?".into());
    let open: Vec<String> = brief.open.iter().map(|o| o.title.clone()).collect();
    anyhow::ensure!(
        open.iter().any(|t| t.contains("regression test"))
            && !open.iter().any(|t| t.contains("ship the refresh fix")),
        "the brief's open items are {open:?}: the regression test is open, the fix shipped"
    );
    for o in &brief.open {
        say(format!(
            "     {} ({}) [{}]",
            o.title,
            o.status,
            o.sources
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let s = brief
        .skills
        .iter()
        .find(|s| s.sources.iter().any(|e| e.as_str() == skill))
        .with_context(|| format!("the brief does not give the skill {skill}"))?;
    say(format!(
        "   skills that apply: {}: {} [{}]",
        s.name, s.description, skill
    ));
    let artifacts_on_leaf = std::fs::read_dir(into.join("artifacts"))
        .map(|d| d.count())
        .unwrap_or(0);
    say(format!(
        "   its notes came down with it: {artifacts_on_leaf} artifact fetched on the laptop, checked by SHA-256"
    ));
    say(format!(
        "   the brief is in {}; every answer cites an event instance A wrote (checked)",
        into.join("brief.md").display()
    ));
    leaf.stop().await;
    hub.stop().await;
    if json {
        println!(
            "{}",
            serde_json::to_string(&Outcome {
                session,
                synced_events: hub_count,
                sync_seconds,
                decision,
                failure,
                fix,
                skill,
                open,
                artifacts_on_leaf,
                brief: into.join("brief.md"),
            })?
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Events of the task's scope the Engram in `home` holds.
fn count(home: &Path, nats: &str) -> anyhow::Result<usize> {
    let out = ok(engram(home, nats).args([
        "--json",
        "replay",
        "--tenant",
        TENANT,
        "--scope",
        &format!("task:{TASK}"),
    ]))?;
    Ok(out.lines().filter(|l| l.starts_with('{')).count())
}

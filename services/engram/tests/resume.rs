//! `engram session resume` as a user runs it: a real `engram up` (its own home, free ports,
//! the skills and docs read models), a scripted program under a real `engram run` that
//! records a decision, a failure and its fix, a skill, an open task-board item, a note in
//! its working memory and an artifact, all through the `engram` CLI with the run's own key;
//! then the resume, whose brief must hold exactly those, citing the ids the test chose.
//! Every assertion comes from the events the test wrote; waits poll with a deadline.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{KillOnDrop, Lines, cli, http_exchange, ok, token};
use engram_access::Credentials;
use engram_schema::EventId;
use serde_json::{Value, json};

const TENANT: &str = "acme";
const TASK: &str = "fix-login";

struct Up {
    _child: KillOnDrop,
    home: tempfile::TempDir,
    /// The runs' private directories (TMPDIR).
    runs: tempfile::TempDir,
    nats: String,
    /// The HTTP API's address (`host:port`).
    http: String,
}

impl Up {
    /// `engram up` running the two read models the brief reads (no embedder to load).
    fn start() -> Self {
        let home = tempfile::tempdir().unwrap();
        let (child, ready) = common::spawn_up_with(
            home.path(),
            &["--nats-port", "0"],
            &[("ENGRAM_PROJECTORS__RUN", r#"["skills","docs"]"#)],
            Duration::from_secs(120),
        );
        let up = Self {
            nats: token(&ready, "nats=").to_owned(),
            http: token(&ready, "http=http://").to_owned(),
            _child: child,
            home,
            runs: tempfile::tempdir().unwrap(),
        };
        ok(up.cli().args(["tenant", "add", TENANT]));
        up
    }

    fn cli(&self) -> Command {
        let mut c = cli(self.home.path());
        c.args(["--nats", &self.nats]);
        c
    }

    fn admin_creds(&self) -> PathBuf {
        self.home.path().join("auth").join("admin.creds")
    }

    /// The CLI as `engram run` is started: the admin's credentials through ENGRAM_CREDS,
    /// the runs' directories under the test's TMPDIR, ENGRAM_BIN for the scripts.
    fn as_runner(&self, work: &Path) -> Command {
        let mut c = self.cli();
        c.current_dir(work)
            .env("ENGRAM_CREDS", self.admin_creds())
            .env("ENGRAM_BIN", env!("CARGO_BIN_EXE_engram"))
            .env("TMPDIR", self.runs.path())
            .env_remove("XDG_RUNTIME_DIR");
        c
    }
}

fn wait_for<T>(what: &str, within: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The artifacts bucket, as the admin: `change` does what it likes with it.
fn with_store(up: &Up, change: impl AsyncFnOnce(async_nats::jetstream::object_store::ObjectStore)) {
    let admin = Credentials::load(&up.admin_creds()).unwrap();
    runtime().block_on(async {
        let client = engram_bus::handshake(|| {
            async_nats::ConnectOptions::with_nkey(admin.seed.clone()).connect(up.nats.as_str())
        })
        .await
        .unwrap();
        let store = async_nats::jetstream::new(client)
            .get_object_store("ENGRAM_ARTIFACTS_acme")
            .await
            .unwrap();
        change(store).await;
    });
}

/// The script waits (bounded) for this file before writing its events.
const WAIT_FOR_GO: &str =
    "i=0; while [ ! -e go ]; do i=$((i+1)); [ $i -lt 1200 ] || exit 99; sleep 0.05; done";

/// A program that records, with the run's own key and the `engram` CLI: the events of
/// `events.jsonl` (the test writes them once it knows the session), an open item and a
/// done one on the task board, and an artifact; then exits 0.
fn script() -> String {
    format!(
        r#"set -e
env | grep '^ENGRAM_' | sort > env.txt
{WAIT_FOR_GO}
IFS=. read -r _ tenant agent seed <<KEY
$ENGRAM_API_KEY
KEY
umask 077
printf 'role = "agent"\ntenant = "%s"\nagent = "%s"\nseed = "%s"\n' "$tenant" "$agent" "$seed" > agent.creds
umask 022
"$ENGRAM_BIN" --creds agent.creds --json append --tenant "$ENGRAM_TENANT" < events.jsonl > appended.jsonl
"$ENGRAM_BIN" --creds agent.creds --json doc edit task_board main --tenant "$ENGRAM_TENANT" --scope "$ENGRAM_SCOPE" --agent "$ENGRAM_AGENT" \
  --set '/items/t-1={{"title":"add an SSO regression test","status":"doing","owner":"coder","notes":["after the skew fix"]}}' \
  --set '/items/t-0={{"title":"reproduce the bug","status":"done","notes":[]}}' > board.json
mkdir -p out && printf 'the report, 26 bytes long' > out/report.txt
"$ENGRAM_BIN" --json session artifact out/report.txt > artifact.json
exit 0"#
    )
}

/// The ids the test chose for the events the program records.
struct Ids {
    observed: EventId,
    decided: EventId,
    failed: EventId,
    fixed: EventId,
    skill: EventId,
    scratch: EventId,
}

/// The program's events: a decision caused by an observation, a failed outcome and the
/// action it caused, a skill, and a note in the session's working memory; one second apart.
fn events(session: &str) -> (Ids, String) {
    let ids = Ids {
        observed: EventId::new(),
        decided: EventId::new(),
        failed: EventId::new(),
        fixed: EventId::new(),
        skill: EventId::new(),
        scratch: EventId::new(),
    };
    let at = |n: i64| (chrono::Utc::now() - chrono::Duration::seconds(600 - n)).to_rfc3339();
    let task = json!({"kind": "task", "id": TASK});
    let lines = [
        json!({"event_id": ids.observed, "occurred_at": at(1), "scope": task, "kind": "observation",
               "content": {"text": "login fails for SSO users"}}),
        json!({"event_id": ids.decided, "occurred_at": at(2), "scope": task, "kind": "action",
               "tags": ["decision"], "causation_id": ids.observed,
               "content": {"text": "use the OIDC library, not hand-rolled JWT parsing",
                           "data": {"why": "it validates the issuer and the expiry"}}}),
        json!({"event_id": ids.failed, "occurred_at": at(3), "scope": task, "kind": "outcome",
               "content": {"text": "tests failed: token rejected, clock skew",
                           "data": {"success": false, "action": "run-tests"}}}),
        json!({"event_id": ids.fixed, "occurred_at": at(4), "scope": task, "kind": "action",
               "causation_id": ids.failed,
               "content": {"text": "allowed 60 s of clock skew in token validation"}}),
        json!({"event_id": ids.skill, "occurred_at": at(5), "scope": task, "kind": "skill_recorded",
               "layer": "procedural",
               "content": {"text": "sso-login-check",
                           "data": {"name": "sso-login-check",
                                    "description": "check an SSO login end to end against the staging IdP",
                                    "steps": ["start the IdP mock", "log in", "check the session cookie"]}}}),
        json!({"event_id": ids.scratch, "occurred_at": at(6),
               "scope": {"kind": "session", "id": session}, "kind": "observation", "layer": "working",
               "content": {"text": "scratch: the staging IdP answers on port 8081"}}),
    ];
    let text = lines
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n")
        + "\n";
    (ids, text)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids_of(value: &Value) -> Vec<String> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_resumed_session_gets_a_brief_citing_its_events_its_artifacts_and_a_next_run() {
    let up = Up::start();
    let work = tempfile::tempdir().unwrap();
    let content = b"the report, 26 bytes long";

    // Given a scripted run that waits for the test, then records its events and exits
    let mut run = KillOnDrop(
        up.as_runner(work.path())
            .args(["run", "--tenant", TENANT, "--task", TASK, "--role", "coder"])
            .args(["--", "sh", "-c", &script()])
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stderr = Lines::of(run.0.stderr.take().unwrap());
    let line = stderr
        .until("engram run: session", Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}; stderr: {:#?}", stderr.seen()));
    let session = line.split_whitespace().nth(3).unwrap().to_owned();
    wait_for("the program's env.txt", Duration::from_secs(60), || {
        work.path().join("env.txt").exists().then_some(())
    });
    let (ids, lines) = events(&session);
    std::fs::write(work.path().join("events.jsonl"), lines).unwrap();
    std::fs::write(work.path().join("go"), "").unwrap();
    let status = wait_for("engram run's exit", Duration::from_secs(120), || {
        run.0.try_wait().unwrap()
    });
    // (the rest of its output, for the message if it failed)
    let _ = stderr.until("\u{0}", Duration::from_secs(1));
    assert_eq!(
        status.code(),
        Some(0),
        "stderr: {:#?}; appended: {:?}",
        stderr.seen(),
        std::fs::read_to_string(work.path().join("appended.jsonl"))
    );
    let appended: Vec<Value> = std::fs::read_to_string(work.path().join("appended.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(appended.len(), 6, "{appended:?}");
    let board_event = read_json(&work.path().join("board.json"))["event_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let artifact_event = read_json(&work.path().join("artifact.json"))["event_id"]
        .as_str()
        .unwrap()
        .to_owned();

    // When the session is resumed elsewhere (another directory; its task found from its
    // records)
    let elsewhere = tempfile::tempdir().unwrap();
    let dir = elsewhere.path().join("resume");
    let said: Value = serde_json::from_str(
        ok(up.as_runner(elsewhere.path()).args([
            "--json",
            "session",
            "resume",
            &session,
            "--tenant",
            TENANT,
            "--into",
            dir.to_str().unwrap(),
        ]))
        .trim(),
    )
    .unwrap();

    // Then the brief holds exactly what the run recorded, citing the events
    assert_eq!(said["task"], TASK, "{said}");
    let brief = read_json(&dir.join("brief.json"));
    assert_eq!(brief["task"], TASK);
    let sessions = brief["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 1, "{brief:#}");
    assert_eq!(sessions[0]["session"], session);
    assert_eq!(sessions[0]["role"], "coder");
    assert_eq!(sessions[0]["state"], "exited(0)");

    let decisions = brief["decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 1, "{brief:#}");
    let decision = &decisions[0];
    assert_eq!(decision["event_id"], ids.decided.as_str());
    assert_eq!(
        decision["text"],
        "use the OIDC library, not hand-rolled JWT parsing"
    );
    assert_eq!(decision["why"], "it validates the issuer and the expiry");
    assert_eq!(decision["caused_by"], ids.observed.as_str());
    assert_eq!(decision["caused_by_text"], "login fails for SSO users");
    assert_eq!(
        ids_of(&decision["sources"]),
        [ids.decided.to_string(), ids.observed.to_string()]
    );

    let failures = brief["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 1, "{brief:#}");
    assert_eq!(failures[0]["event_id"], ids.failed.as_str());
    assert_eq!(failures[0]["subject"], "run-tests");
    assert_eq!(failures[0]["fix"]["event_id"], ids.fixed.as_str());
    assert_eq!(failures[0]["fix"]["found_by"], "caused_by");
    assert_eq!(
        failures[0]["fix"]["text"],
        "allowed 60 s of clock skew in token validation"
    );

    let open = brief["open"].as_array().unwrap();
    assert_eq!(open.len(), 1, "only the item not done: {brief:#}");
    assert_eq!(open[0]["id"], "t-1");
    assert_eq!(open[0]["title"], "add an SSO regression test");
    assert_eq!(open[0]["status"], "doing");
    assert_eq!(open[0]["last_note"], "after the skew fix");
    assert_eq!(
        ids_of(&open[0]["sources"]),
        std::slice::from_ref(&board_event)
    );

    let skills = brief["skills"].as_array().unwrap();
    assert_eq!(skills.len(), 1, "{brief:#}");
    assert_eq!(skills[0]["name"], "sso-login-check");
    assert_eq!(skills[0]["version"], 1);
    assert_eq!(skills[0]["from_read_model"], true, "{brief:#}");
    assert_eq!(ids_of(&skills[0]["sources"]), [ids.skill.to_string()]);

    let artifacts = brief["artifacts"].as_array().unwrap();
    assert_eq!(artifacts.len(), 1, "{brief:#}");
    assert_eq!(artifacts[0]["name"], "report.txt");
    assert_eq!(artifacts[0]["sha256"], sha256_hex(content));
    assert_eq!(artifacts[0]["event_id"], artifact_event);

    let working = brief["working"].as_array().unwrap();
    assert_eq!(working.len(), 1, "{brief:#}");
    assert_eq!(working[0]["event_id"], ids.scratch.as_str());

    // And the Markdown says it, each line with its events
    let md = std::fs::read_to_string(dir.join("brief.md")).unwrap();
    for wanted in [
        format!(
            "- use the OIDC library, not hand-rolled JWT parsing. Why: it validates the issuer and the expiry. In answer to: login fails for SSO users [events: {}, {}]",
            ids.decided, ids.observed
        ),
        format!(
            "- Failed: tests failed: token rejected, clock skew (run-tests). Fixed: allowed 60 s of clock skew in token validation (caused by the failure) [events: {}, {}]",
            ids.failed, ids.fixed
        ),
        format!(
            "- [doing] add an SSO regression test (task:{TASK}/main#t-1), owner coder: after the skew fix [events: {board_event}]"
        ),
    ] {
        assert!(
            md.lines().any(|l| l == wanted),
            "no line {wanted:?} in\n{md}"
        );
    }
    assert!(md.contains(&format!("[events: {}]", ids.skill)), "{md}");
    assert!(
        md.contains("scratch: the staging IdP answers on port 8081"),
        "{md}"
    );

    // And the artifact was fetched, its hash checked
    assert_eq!(said["artifacts"][0]["status"], "fetched", "{said}");
    assert_eq!(
        std::fs::read(dir.join("artifacts").join("report.txt")).unwrap(),
        content
    );
    // And the working memory travelled as a file
    let working = read_json(&dir.join("working.json"));
    assert_eq!(
        working["events"][0]["event"]["event_id"],
        ids.scratch.as_str()
    );

    // And a second resume of the quiet task writes a byte-identical brief
    let again = elsewhere.path().join("again");
    ok(up.as_runner(elsewhere.path()).args([
        "session",
        "resume",
        &session,
        "--tenant",
        TENANT,
        "--task",
        TASK,
        "--into",
        again.to_str().unwrap(),
    ]));
    for file in ["brief.md", "brief.json"] {
        assert_eq!(
            std::fs::read(dir.join(file)).unwrap(),
            std::fs::read(again.join(file)).unwrap(),
            "{file} differs"
        );
    }

    // When the next run is started from the brief
    let next = elsewhere.path().join("next");
    let out = up
        .as_runner(elsewhere.path())
        .args([
            "session",
            "resume",
            &session,
            "--tenant",
            TENANT,
            "--task",
            TASK,
            "--into",
            next.to_str().unwrap(),
            "--exec",
            "--",
            "sh",
            "-c",
            r#"cat "$ENGRAM_BRIEF" > seen-brief.md && cat "$ENGRAM_BRIEF_JSON" > seen-brief.json && echo "$ENGRAM_RESUMED_SESSION $ENGRAM_SESSION" > seen-session.txt"#,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Then its program read the brief from ENGRAM_BRIEF
    let seen = std::fs::read(elsewhere.path().join("seen-brief.md")).unwrap();
    assert_eq!(seen, std::fs::read(next.join("brief.md")).unwrap());
    assert!(String::from_utf8_lossy(&seen).contains(ids.decided.as_str()));
    let seen_json: Value =
        serde_json::from_slice(&std::fs::read(elsewhere.path().join("seen-brief.json")).unwrap())
            .unwrap();
    assert_eq!(seen_json["decisions"][0]["event_id"], ids.decided.as_str());
    let seen_session = std::fs::read_to_string(elsewhere.path().join("seen-session.txt")).unwrap();
    let (resumed, new_session) = seen_session.trim().split_once(' ').unwrap();
    assert_eq!(resumed, session);
    assert_ne!(new_session, session, "the next run is a session of its own");
    // And the new session, of the same task and role, records which one it resumed
    let listed: Vec<Value> = ok(up.cli().args([
        "--json", "session", "list", "--tenant", TENANT, "--task", TASK,
    ]))
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect();
    let new = listed
        .iter()
        .find(|s| s["session"] == new_session)
        .unwrap_or_else(|| panic!("{listed:#?}"));
    assert_eq!(new["role"], "coder", "{new}");
    assert_eq!(new["state"], "exited", "{new}");
    assert_eq!(
        new["last_checkpoint"],
        format!("resumes session {session}"),
        "{new}"
    );

    // When an agent asks for the brief with its own key, over `/v1` and MCP
    let issued: Value = serde_json::from_str(&ok(up.cli().args([
        "--json", "key", "add", "--tenant", TENANT, "--agent", "reader",
    ])))
    .unwrap();
    let key = issued["api_key"].as_str().unwrap().to_owned();
    let auth = format!("Authorization: Bearer {key}");
    let post = |path: &str, body: &Value| {
        http_exchange(
            &up.http,
            &up.http,
            &format!("POST {path} HTTP/1.1\r\n{auth}\r\nContent-Type: application/json"),
            &body.to_string(),
        )
    };
    let asked = json!({"scope": {"kind": "task", "id": TASK}, "session": session});
    let (status, body) = wait_for("the key admitted", Duration::from_secs(60), || {
        let (status, body) = post("/v1/brief", &asked);
        (status != 401).then_some((status, body))
    });
    assert_eq!(status, 200, "{body}");
    let served: Value = serde_json::from_str(&body).unwrap();
    // Then it is the brief the CLI writes, byte for byte
    let now = elsewhere.path().join("now");
    ok(up.as_runner(elsewhere.path()).args([
        "session",
        "resume",
        &session,
        "--tenant",
        TENANT,
        "--task",
        TASK,
        "--into",
        now.to_str().unwrap(),
    ]));
    let cli_md = std::fs::read_to_string(now.join("brief.md")).unwrap();
    assert_eq!(served["markdown"], cli_md.as_str());
    assert_eq!(served["brief"], read_json(&now.join("brief.json")));
    assert_eq!(
        served["brief"]["decisions"][0]["event_id"],
        ids.decided.as_str()
    );
    // And a scope the key may not read, one that is no task, or another tenant's, is
    // refused
    let (status, body) = post(
        "/v1/brief",
        &json!({"scope": {"kind": "team", "id": "core"}}),
    );
    assert_eq!(status, 403, "{body}");
    let (status, body) = post(
        "/v1/brief",
        &json!({"scope": {"kind": "agent", "id": "reader"}}),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("no task"), "{body}");
    let (status, body) = post(
        "/v1/brief",
        &json!({"tenant": "other", "scope": {"kind": "task", "id": TASK}}),
    );
    assert_eq!(status, 403, "{body}");
    // And the MCP tool of a server scoped to the task gives the same brief
    runtime().block_on(async {
        use rmcp::ServiceExt as _;
        use rmcp::transport::{ConfigureCommandExt as _, TokioChildProcess};
        let command = tokio::process::Command::new(env!("CARGO_BIN_EXE_engram")).configure(|c| {
            c.args(["--nats", &up.nats, "mcp", "--key", &key, "--scope"])
                .arg(format!("task:{TASK}"))
                .env("ENGRAM_HOME", up.home.path())
                .env_remove("ENGRAM_CONFIG")
                .env_remove("ENGRAM_CREDS")
                .env_remove("ENGRAM_API_KEY");
        });
        let client = rmcp::model::ClientConfig::default()
            .serve(TokioChildProcess::new(command).unwrap())
            .await
            .unwrap();
        let params = rmcp::model::CallToolRequestParams::new("handoff_brief")
            .with_arguments(json!({"session": session}).as_object().unwrap().clone());
        let result = client.call_tool(params).await.unwrap();
        assert_ne!(result.is_error, Some(true), "{result:?}");
        let answer = result.structured_content.expect("a structured result");
        assert_eq!(answer["markdown"], cli_md.as_str());
        let _ = client.cancel().await;
    });

    // When the stored artifact no longer matches its record
    let object = artifacts[0]["object"].as_str().unwrap().to_owned();
    with_store(&up, async |store| {
        let mut forged = &b"a forged report, 26 bytes!"[..];
        store.put(object.as_str(), &mut forged).await.unwrap();
    });
    let forged = elsewhere.path().join("forged");
    let out = up
        .as_runner(elsewhere.path())
        .args([
            "session",
            "resume",
            &session,
            "--tenant",
            TENANT,
            "--task",
            TASK,
            "--into",
            forged.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    // Then the resume fails naming it, and leaves no such file
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("report.txt") && err.contains("SHA-256"),
        "{err}"
    );
    assert!(!forged.join("artifacts").join("report.txt").exists());
    assert_eq!(
        std::fs::read_dir(forged.join("artifacts")).unwrap().count(),
        0,
        "a partial file was left"
    );

    // When the artifact is not in this server's store (a leaf holds events only)
    with_store(&up, async |store| {
        store.delete(object.as_str()).await.unwrap();
    });
    let missing = elsewhere.path().join("missing");
    let said: Value = serde_json::from_str(
        ok(up.as_runner(elsewhere.path()).args([
            "--json",
            "session",
            "resume",
            &session,
            "--tenant",
            TENANT,
            "--task",
            TASK,
            "--into",
            missing.to_str().unwrap(),
        ]))
        .trim(),
    )
    .unwrap();
    // Then the brief is written and the artifact reported as stored on the hub
    assert_eq!(said["artifacts"][0]["status"], "missing", "{said}");
    assert!(
        said["artifacts"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("stored on the hub, not on this leaf"),
        "{said}"
    );
    assert!(missing.join("brief.md").exists());
    // And --require-artifacts makes it an error
    let out = up
        .as_runner(elsewhere.path())
        .args([
            "session",
            "resume",
            &session,
            "--tenant",
            TENANT,
            "--task",
            TASK,
            "--into",
            missing.to_str().unwrap(),
            "--require-artifacts",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("report.txt"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

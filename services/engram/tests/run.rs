//! `engram run` as a user runs it: a real `engram up` (its own home, free ports), a real
//! `engram run` process supervising a scripted `sh` program, and the CLI reading what was
//! recorded. Counts come from what the scripts did; waits poll with a deadline.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{KillOnDrop, Lines, cli, ok, token};
use engram_access::Credentials;
use serde_json::Value;

const TENANT: &str = "acme";

/// `engram up` with no projectors (nothing here reads a read model: no embedder to load),
/// its NATS and HTTP on free ports.
struct Up {
    _child: KillOnDrop,
    home: tempfile::TempDir,
    /// The runs' private directories go here (TMPDIR), so that one whose `engram run` was
    /// killed is cleaned up with the test.
    runs: tempfile::TempDir,
    nats: String,
    http: String,
}

impl Up {
    fn start() -> Self {
        let home = tempfile::tempdir().unwrap();
        let (child, ready) = common::spawn_up_with(
            home.path(),
            &["--nats-port", "0"],
            &[("ENGRAM_PROJECTORS__RUN", "[]")],
            Duration::from_secs(120),
        );
        let nats = token(&ready, "nats=").to_owned();
        let http = format!("http://{}", token(&ready, "http=http://"));
        let up = Self {
            _child: child,
            home,
            runs: tempfile::tempdir().unwrap(),
            nats,
            http,
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

    /// `engram run` of `script` (`sh -c`) in `work`, with the admin's credentials given
    /// through ENGRAM_CREDS (which the program must not inherit); stderr is read for the
    /// session line.
    fn run(&self, work: &Path, task: &str, extra: &[&str], script: &str) -> Running {
        let mut child = KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_engram"))
                .args([
                    "--nats", &self.nats, "run", "--tenant", TENANT, "--task", task,
                ])
                .args(["--role", "coder"])
                .args(extra)
                .args(["--", "sh", "-c", script])
                .current_dir(work)
                .env("ENGRAM_HOME", self.home.path())
                .env("ENGRAM_CREDS", self.admin_creds())
                .env("ENGRAM_BIN", env!("CARGO_BIN_EXE_engram"))
                .env("TMPDIR", self.runs.path())
                .env_remove("XDG_RUNTIME_DIR")
                .env_remove("ENGRAM_CONFIG")
                .env_remove("ENGRAM_API_KEY")
                .stdout(Stdio::inherit())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut stderr = Lines::of(child.0.stderr.take().unwrap());
        let line = stderr
            .until("engram run: session", Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}; stderr: {:#?}", stderr.seen()));
        let session = line
            .split_whitespace()
            .nth(3)
            .expect("engram run: session <id> …")
            .to_owned();
        Running {
            child,
            stderr,
            session,
        }
    }

    /// `engram session list --json` of `task`.
    fn sessions(&self, task: &str) -> Vec<Value> {
        ok(self.cli().args([
            "--json", "session", "list", "--tenant", TENANT, "--task", task,
        ]))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
    }

    /// The session as the list shows it now, or `None` if the list cannot be read at this
    /// moment (a poll tries again; its deadline decides).
    fn poll_session(&self, task: &str, session: &str) -> Option<Value> {
        let out = self
            .cli()
            .args([
                "--json", "session", "list", "--tenant", TENANT, "--task", task,
            ])
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!(
                "session list failed, polling on: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .find(|s| s["session"] == session)
    }

    /// The run's key's expiry, or `None` if the registry cannot be read at this moment.
    fn poll_key_expiry(&self, session: &str) -> Option<chrono::DateTime<chrono::Utc>> {
        let out = self
            .cli()
            .args(["--json", "agent", "list", "--tenant", TENANT])
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!(
                "agent list failed, polling on: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .find(|a| a["agent"] == format!("run-{session}"))
            .and_then(|a| serde_json::from_value(a["keys"][0]["expires_at"].clone()).ok())
    }

    fn session(&self, task: &str, session: &str) -> Value {
        self.sessions(task)
            .into_iter()
            .find(|s| s["session"] == session)
            .unwrap_or_else(|| panic!("no session {session} in task {task}"))
    }

    /// The data of the session records of `session`, in stream order, read with `replay`.
    fn records(&self, task: &str, session: &str) -> Vec<Value> {
        ok(self.cli().args([
            "--json",
            "replay",
            "--tenant",
            TENANT,
            "--scope",
            &format!("task:{task}"),
        ]))
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["event"].clone())
        .filter(|e| e["kind"] == "checkpoint" && e["content"]["data"]["session"] == session)
        .map(|e| {
            assert_eq!(e["layer"], "working", "{e}");
            assert_eq!(e["agent_id"], format!("run-{session}"), "{e}");
            e["content"]["data"].clone()
        })
        .collect()
    }

    /// The run's key as the registry shows it (`engram agent list --json`).
    fn run_key(&self, session: &str) -> Value {
        ok(self
            .cli()
            .args(["--json", "agent", "list", "--tenant", TENANT]))
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|a| a["agent"] == format!("run-{session}"))
        .unwrap_or_else(|| panic!("no agent run-{session}"))["keys"][0]
            .clone()
    }
}

struct Running {
    child: KillOnDrop,
    stderr: Lines,
    session: String,
}

impl Running {
    /// Its exit code, waited for at most `within`.
    fn exit_code(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.0.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "engram run did not exit within {within:?}; stderr: {:#?}",
                self.stderr.seen()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Polls `check` every 100 ms until it returns a value, at most `within`; panics naming
/// `what`.
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

/// The `ENGRAM_*` variables the program saw, from the `env.txt` its script wrote.
fn program_env(work: &Path) -> BTreeMap<String, String> {
    let path = work.join("env.txt");
    let text = wait_for("the program's env.txt", Duration::from_secs(60), || {
        std::fs::read_to_string(&path)
            .ok()
            .filter(|t| t.contains("ENGRAM_SESSION_SOCKET="))
    });
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Whether a connection to `url` as `creds` is accepted and answers a round trip.
fn connects(url: &str, creds: &Credentials) -> bool {
    runtime().block_on(async {
        let connecting = async_nats::ConnectOptions::with_nkey(creds.seed.clone())
            .custom_inbox_prefix(creds.inbox_prefix())
            .connection_timeout(Duration::from_secs(2))
            .connect(url);
        let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(3), connecting).await else {
            return false;
        };
        let ok = tokio::time::timeout(Duration::from_secs(2), client.flush())
            .await
            .is_ok_and(|r| r.is_ok());
        let _ = tokio::time::timeout(Duration::from_secs(1), client.drain()).await;
        ok
    })
}

/// The bytes of `object` in the artifacts bucket, read as the admin.
fn stored_object(up: &Up, object: &str) -> Vec<u8> {
    let admin = Credentials::load(&up.admin_creds()).unwrap();
    runtime().block_on(async {
        use tokio::io::AsyncReadExt as _;
        let client = engram_bus::handshake(|| {
            async_nats::ConnectOptions::with_nkey(admin.seed.clone()).connect(up.nats.as_str())
        })
        .await
        .unwrap();
        let store = async_nats::jetstream::new(client)
            .get_object_store("ENGRAM_ARTIFACTS_acme")
            .await
            .unwrap();
        let mut bytes = Vec::new();
        store
            .get(object)
            .await
            .unwrap()
            .read_to_end(&mut bytes)
            .await
            .unwrap();
        bytes
    })
}

/// The names of the objects the artifacts bucket holds under `prefix` (none when there is
/// no bucket: `engram run` creates it at the first artifact it stores).
fn stored_objects(up: &Up, prefix: &str) -> Vec<String> {
    let admin = Credentials::load(&up.admin_creds()).unwrap();
    runtime().block_on(async {
        use futures::{StreamExt as _, TryStreamExt as _};
        let client = engram_bus::handshake(|| {
            async_nats::ConnectOptions::with_nkey(admin.seed.clone()).connect(up.nats.as_str())
        })
        .await
        .unwrap();
        let js = async_nats::jetstream::new(client);
        let streams: Vec<String> = js.stream_names().try_collect().await.unwrap();
        if !streams.iter().any(|s| s == "OBJ_ENGRAM_ARTIFACTS_acme") {
            return Vec::new();
        }
        let store = js.get_object_store("ENGRAM_ARTIFACTS_acme").await.unwrap();
        let mut names = Vec::new();
        let mut list = store.list().await.unwrap();
        while let Some(info) = list.next().await {
            let info = info.unwrap();
            if info.name.starts_with(prefix) {
                names.push(info.name);
            }
        }
        names
    })
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Waits (bounded) for the file `go` the test creates: the script's pause while the test
/// looks at the running session.
const WAIT_FOR_GO: &str =
    "i=0; while [ ! -e go ]; do i=$((i+1)); [ $i -lt 1200 ] || exit 99; sleep 0.05; done";

#[test]
fn a_scripted_program_checkpoints_declares_an_artifact_and_its_exit_is_recorded() {
    let up = Up::start();
    let work = tempfile::tempdir().unwrap();
    let task = "fix-login";
    // Given a program that reads its environment, waits for the test, asks for a
    // checkpoint by signal and by the CLI, declares an artifact, and exits 3
    let script = format!(
        "set -e
         env | grep '^ENGRAM_' | sort > env.txt
         {WAIT_FOR_GO}
         kill -USR1 $PPID
         \"$ENGRAM_BIN\" session checkpoint --note 'tests pass' > checkpoint.txt
         mkdir -p out && printf 'the report, 26 bytes long' > out/report.txt
         \"$ENGRAM_BIN\" --json session artifact out/report.txt > artifact.json
         exit 3"
    );
    // (engram up took a free HTTP port: the run is told where)
    let mut run = up.run(work.path(), task, &["--http-url", &up.http], &script);
    let session = run.session.clone();

    // Then it runs with the session's variables, and its key is scoped to the run
    let env = program_env(work.path());
    assert_eq!(env["ENGRAM_TENANT"], TENANT);
    assert_eq!(env["ENGRAM_TASK"], task);
    assert_eq!(env["ENGRAM_ROLE"], "coder");
    assert_eq!(env["ENGRAM_SCOPE"], format!("task:{task}"));
    assert_eq!(env["ENGRAM_SESSION"], session);
    assert_eq!(env["ENGRAM_SESSION_SCOPE"], format!("session:{session}"));
    assert_eq!(env["ENGRAM_AGENT"], format!("run-{session}"));
    assert_eq!(env["ENGRAM_INSTANCE"], session);
    assert_eq!(env["ENGRAM_NATS_URL"], up.nats);
    assert_eq!(env["ENGRAM_NATS__URL"], up.nats);
    assert_eq!(env["ENGRAM_URL"], up.http);
    assert!(
        !env.contains_key("ENGRAM_CREDS"),
        "the admin's credentials reached the program"
    );
    let socket = Path::new(&env["ENGRAM_SESSION_SOCKET"]);
    {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::fs::metadata(socket.parent().unwrap()).unwrap();
        assert_eq!(dir.permissions().mode() & 0o777, 0o700);
    }
    let key = Credentials::from_api_key(&env["ENGRAM_API_KEY"]).unwrap();
    assert_eq!(
        key.agent_identity()
            .map(|(t, a)| (t.to_string(), a.to_string())),
        Some((TENANT.to_owned(), format!("run-{session}")))
    );
    assert!(
        connects(&up.nats, &key),
        "the run's key works while it runs"
    );
    runtime().block_on(async {
        use engram_schema::{EventKind, Layer, Scope, ScopeKind};
        let bus = engram_bus::Bus::connect(engram_bus::BusConfig {
            url: up.nats.clone(),
            nkey: Some(engram_bus::NkeyAuth::of(&key)),
            ..engram_bus::BusConfig::default()
        })
        .await
        .unwrap();
        let client = engram_sdk::Client::from_bus(bus, engram_sdk::RetryPolicy::none());
        let agent = client
            .agent(TENANT, &env["ENGRAM_AGENT"], &env["ENGRAM_INSTANCE"])
            .unwrap();
        let own = Scope::new(ScopeKind::Task, task).unwrap();
        agent
            .event(
                own,
                Layer::Episodic,
                EventKind::Observation,
                "written by the run",
            )
            .append()
            .await
            .expect("the run's key writes its task");
        let other = Scope::new(ScopeKind::Task, "someone-elses").unwrap();
        let refused = agent
            .event(other, Layer::Episodic, EventKind::Observation, "not mine")
            .append()
            .await;
        assert!(refused.is_err(), "the run's key wrote another task");
    });
    let running = up.session(task, &session);
    assert_eq!(running["state"], "running", "{running}");
    assert_eq!(running["role"], "coder");
    assert_eq!(running["command"][0], "sh");

    // When the test lets it go on
    std::fs::write(work.path().join("go"), "").unwrap();

    // Then engram run exits with the program's code
    assert_eq!(run.exit_code(Duration::from_secs(120)), Some(3));
    let said = std::fs::read_to_string(work.path().join("checkpoint.txt")).unwrap();
    assert!(said.contains("checkpoint recorded"), "{said}");

    // And the records are started, two checkpoints, the artifact, and the end with code 3
    let records: Vec<Value> = up
        .records(task, &session)
        .into_iter()
        .filter(|r| r["event"] != "heartbeat")
        .collect();
    let steps: Vec<&str> = records
        .iter()
        .map(|r| r["event"].as_str().unwrap())
        .collect();
    assert_eq!(steps.first(), Some(&"started"), "{records:#?}");
    assert_eq!(steps.last(), Some(&"ended"), "{records:#?}");
    let mut sorted = steps.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        ["artifact", "checkpoint", "checkpoint", "ended", "started"],
        "{records:#?}"
    );
    let started = &records[0];
    assert_eq!(started["role"], "coder");
    assert_eq!(started["command"][0], "sh");
    assert!(started["pid"].as_u64().unwrap() > 0);
    assert!(!started["machine"].as_str().unwrap().is_empty());
    let mut notes: Vec<(&str, &str)> = records
        .iter()
        .filter(|r| r["event"] == "checkpoint")
        .map(|r| (r["via"].as_str().unwrap(), r["note"].as_str().unwrap()))
        .collect();
    notes.sort_unstable();
    assert_eq!(notes, [("request", "tests pass"), ("signal", "signal")]);
    let ended = records.last().unwrap();
    assert_eq!(ended["exit_code"], 3, "{ended}");
    assert!(ended.get("signal").is_none(), "{ended}");

    // And the artifact's bytes and hash are in the Object Store, as its record says
    let content = b"the report, 26 bytes long";
    let artifact = records.iter().find(|r| r["event"] == "artifact").unwrap();
    assert_eq!(artifact["name"], "report.txt");
    assert_eq!(artifact["size"], content.len());
    assert_eq!(artifact["sha256"], sha256_hex(content));
    assert_eq!(artifact["bucket"], "ENGRAM_ARTIFACTS_acme");
    let object = artifact["object"].as_str().unwrap();
    assert_eq!(stored_object(&up, object), content);
    let answer: Value =
        serde_json::from_str(&std::fs::read_to_string(work.path().join("artifact.json")).unwrap())
            .unwrap();
    assert_eq!(answer["ok"], true, "{answer}");
    assert_eq!(answer["artifact"]["sha256"], sha256_hex(content));

    // And the list says it exited with 3
    let listed = up.session(task, &session);
    assert_eq!(listed["state"], "exited", "{listed}");
    assert_eq!(listed["exit_code"], 3);
    assert_eq!(listed["checkpoints"], 2);
    assert_eq!(listed["artifact_count"], 1);

    // And the key was revoked: the registry says so and the server refuses it
    let registered = up.run_key(&session);
    assert!(!registered["revoked_at"].is_null(), "{registered}");
    assert!(!registered["expires_at"].is_null(), "{registered}");
    wait_for(
        "the server refusing the revoked key",
        Duration::from_secs(30),
        || (!connects(&up.nats, &key)).then_some(()),
    );
}

#[test]
fn a_run_killed_with_its_program_reads_dead_and_its_key_expires_by_itself() {
    let up = Up::start();
    let work = tempfile::tempdir().unwrap();
    let task = "long-job";
    // Given a run that heartbeats every second, with a key living 6 s between renewals
    let script = "echo $$ > program.pid; env | grep '^ENGRAM_' | sort > env.txt; exec sleep 600";
    let mut run = up.run(
        work.path(),
        task,
        &["--heartbeat", "1s", "--key-ttl", "6s"],
        script,
    );
    let session = run.session.clone();
    let env = program_env(work.path());
    let key = Credentials::from_api_key(&env["ENGRAM_API_KEY"]).unwrap();
    let program: i32 = wait_for("the program's pid", Duration::from_secs(30), || {
        std::fs::read_to_string(work.path().join("program.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    });
    struct KillProgram(i32);
    impl Drop for KillProgram {
        fn drop(&mut self) {
            // SAFETY: kill(2) of the test's own grandchild.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
    let _program = KillProgram(program);

    // And it has heartbeated and renewed its key past the first expiry
    wait_for("two heartbeats, running", Duration::from_secs(60), || {
        let s = up.poll_session(task, &session)?;
        (s["heartbeats"].as_u64() >= Some(2) && s["state"] == "running").then_some(())
    });
    let first_expiry = wait_for("the run's key", Duration::from_secs(60), || {
        up.poll_key_expiry(&session)
    });
    wait_for(
        "a renewal of the run's key",
        Duration::from_secs(60),
        || (up.poll_key_expiry(&session)? > first_expiry).then_some(()),
    );
    assert!(connects(&up.nats, &key), "a renewed key works");

    // When engram run and its program are both killed outright
    run.child.0.kill().unwrap();
    run.child.0.wait().unwrap();
    // SAFETY: kill(2) of the test's own grandchild.
    assert_eq!(unsafe { libc::kill(program, libc::SIGKILL) }, 0);

    // Then, once its heartbeats have stopped for three intervals, the list says dead
    let dead = wait_for("the session read as dead", Duration::from_secs(60), || {
        let s = up.poll_session(task, &session)?;
        (s["state"] == "dead").then_some(s)
    });
    assert!(
        dead["exit_code"].is_null() && dead["ended_at"].is_null(),
        "{dead}"
    );

    // And its key, never revoked, stops working by itself at its expiry
    wait_for(
        "the server refusing the expired key",
        Duration::from_secs(60),
        || (!connects(&up.nats, &key)).then_some(()),
    );
    let registered = up.run_key(&session);
    assert!(registered["revoked_at"].is_null(), "{registered}");
    let expired: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(registered["expires_at"].clone()).unwrap();
    assert!(expired <= chrono::Utc::now(), "{registered}");
}

/// One raw request line to the socket, and its answer.
fn ask(socket: &Path, line: &[u8]) -> Value {
    let mut stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // An oversized line is answered before it is all read: the write may fail.
    let _ = stream.write_all(line);
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).unwrap();
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer:?}"))
}

fn refused_with(answer: &Value, code: &str) {
    assert_eq!(answer["ok"], false, "{answer}");
    assert_eq!(answer["error"]["code"], code, "{answer}");
    assert!(
        !answer["error"]["message"].as_str().unwrap().is_empty(),
        "{answer}"
    );
}

#[test]
fn hostile_requests_on_the_session_socket_are_refused_and_write_nothing() {
    let up = Up::start();
    let root = tempfile::tempdir().unwrap();
    let root = std::fs::canonicalize(root.path()).unwrap();
    let work = root.join("work");
    std::fs::create_dir_all(work.join("adir")).unwrap();
    std::fs::write(root.join("outside.txt"), "a secret outside the run").unwrap();
    std::os::unix::fs::symlink(root.join("outside.txt"), work.join("escape")).unwrap();
    std::os::unix::fs::symlink(&root, work.join("up")).unwrap();
    std::fs::write(work.join("big.bin"), [7u8; 17]).unwrap();
    let task = "hostile";
    // Given a run whose program waits for the test, with artifacts of at most 16 bytes
    let script = format!("env | grep '^ENGRAM_' | sort > env.txt; {WAIT_FOR_GO}; exit 0");
    let mut run = up.run(&work, task, &["--max-artifact-bytes", "16"], &script);
    let session = run.session.clone();
    let env = program_env(&work);
    let socket = PathBuf::from(&env["ENGRAM_SESSION_SOCKET"]);

    // When hostile requests arrive, each is refused with a reason
    let mut huge = vec![b'x'; 1024 * 1024];
    huge.push(b'\n');
    refused_with(&ask(&socket, &huge), "too_large");
    refused_with(&ask(&socket, b"{\"checkpoint\": \n"), "invalid");
    refused_with(&ask(&socket, b"{\"shutdown\": {}}\n"), "invalid");
    let long_note = format!(
        "{{\"checkpoint\": {{\"note\": \"{}\"}}}}\n",
        "n".repeat(5000)
    );
    refused_with(&ask(&socket, long_note.as_bytes()), "too_large");
    let artifact = |path: &Path, name: Option<&str>| {
        let request = serde_json::json!({"artifact": {"path": path, "name": name}});
        ask(&socket, format!("{request}\n").as_bytes())
    };
    refused_with(
        &artifact(&root.join("outside.txt"), None),
        "outside_workdir",
    );
    refused_with(
        &artifact(Path::new("../outside.txt"), None),
        "outside_workdir",
    );
    refused_with(&artifact(Path::new("escape"), None), "outside_workdir");
    refused_with(
        &artifact(Path::new("up/outside.txt"), None),
        "outside_workdir",
    );
    refused_with(&artifact(Path::new("adir"), None), "not_a_file");
    refused_with(&artifact(Path::new("missing.txt"), None), "not_found");
    refused_with(&artifact(Path::new("big.bin"), None), "too_large");
    refused_with(
        &artifact(&work.join("big.bin"), Some("../../etc/passwd")),
        "invalid",
    );
    // And through the CLI a program would use, with its exit code and the reason
    let out = cli(up.home.path())
        .args(["session", "artifact", "escape"])
        .current_dir(&work)
        .env("ENGRAM_SESSION_SOCKET", &socket)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("outside_workdir"), "{said}");

    // And connections past the bound are answered busy at once, idle ones time out
    let idle: Vec<UnixStream> = (0..8)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    refused_with(
        &ask(&socket, b"{\"checkpoint\": {\"note\": \"one too many\"}}\n"),
        "busy",
    );
    for stream in idle {
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut answer = String::new();
        BufReader::new(stream).read_line(&mut answer).unwrap();
        refused_with(&serde_json::from_str(&answer).unwrap(), "timeout");
    }

    // Then nothing was written: the run ends with only its start and end recorded, and no
    // object of the session in the store
    std::fs::write(work.join("go"), "").unwrap();
    assert_eq!(run.exit_code(Duration::from_secs(120)), Some(0));
    let steps: Vec<Value> = up
        .records(task, &session)
        .into_iter()
        .map(|r| r["event"].clone())
        .filter(|s| s != "heartbeat")
        .collect();
    assert_eq!(steps, ["started", "ended"]);
    let listed = up.session(task, &session);
    assert_eq!(listed["state"], "exited", "{listed}");
    assert_eq!(listed["exit_code"], 0);
    assert_eq!(listed["checkpoints"], 0);
    assert_eq!(listed["artifact_count"], 0);
    assert!(
        stored_objects(&up, &format!("{TENANT}/{task}/{session}/")).is_empty(),
        "an object of the session was stored"
    );
    assert!(!socket.exists(), "the session's socket outlived the run");
}

#[test]
fn signals_to_engram_run_reach_the_program_and_a_death_by_signal_is_recorded() {
    let up = Up::start();
    let work = tempfile::tempdir().unwrap();
    let task = "signals";
    // Given programs that exit with their own code on SIGTERM and on SIGINT
    for (signal, code) in [(libc::SIGTERM, 42), (libc::SIGINT, 43)] {
        let _ = std::fs::remove_file(work.path().join("ready"));
        let script = "trap 'exit 42' TERM; trap 'exit 43' INT; echo ready > ready; \
                      i=0; while [ $i -lt 2400 ]; do i=$((i+1)); sleep 0.05; done; exit 99";
        let mut run = up.run(work.path(), task, &[], script);
        wait_for("the program's traps set", Duration::from_secs(60), || {
            work.path().join("ready").exists().then_some(())
        });
        // When engram run gets the signal
        let pid = i32::try_from(run.child.0.id()).unwrap();
        // SAFETY: kill(2) of the test's own child.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        // Then the program got it, and its code is engram run's and the session's
        assert_eq!(run.exit_code(Duration::from_secs(60)), Some(code));
        let listed = up.session(task, &run.session);
        assert_eq!(listed["exit_code"], code, "{listed}");
    }
    // And a program killed by a signal exits engram run with 128 + its number, the signal
    // recorded
    let mut run = up.run(work.path(), task, &[], "kill -KILL $$");
    assert_eq!(run.exit_code(Duration::from_secs(60)), Some(128 + 9));
    let listed = up.session(task, &run.session);
    assert_eq!(listed["state"], "exited", "{listed}");
    assert_eq!(listed["signal"], 9, "{listed}");
    assert!(listed["exit_code"].is_null(), "{listed}");
}

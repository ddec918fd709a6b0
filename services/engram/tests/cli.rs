//! The query and operator commands as a user runs them: `engram facts`, `skills`, `forget`
//! and `dlq` against a real `engram up` process on a test nats-server.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use engram_bus::Bus;
use engram_testkit::TestNats;
use serde_json::{Value, json};

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");

/// `engram up` on a test server, killed if the test fails half-way.
struct Up {
    child: Child,
    log: PathBuf,
}

impl Up {
    /// Starts `engram up --nats <url>` with its state in `home`; returns once it is ready.
    fn start(home: &Path, url: &str) -> Self {
        let log = home.join("up.log");
        let mut child = Command::new(ENGRAM)
            .arg("--home")
            .arg(home)
            .args(["--nats", url, "--log-format", "json"])
            .args(["up", "--http", "127.0.0.1:0"])
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_HOME")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut stdout = common::Lines::of(child.stdout.take().unwrap());
        if let Err(e) = stdout.until("engram is up", Duration::from_secs(120)) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "engram up: {e}; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        Self { child, log }
    }

    /// SIGTERM, then waits for the orderly shutdown (projectors checkpoint, locks released).
    fn stop(mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "engram up exited with {status:?}:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
                return;
            }
            assert!(Instant::now() < deadline, "engram up did not stop");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One test's server, `engram up` and data dir.
struct Setup {
    nats: TestNats,
    home: tempfile::TempDir,
    up: Option<Up>,
}

impl Setup {
    async fn start() -> Self {
        let nats = TestNats::start().await;
        let home = tempfile::tempdir().unwrap();
        let up = Up::start(home.path(), &nats.url());
        Self {
            nats,
            home,
            up: Some(up),
        }
    }

    /// A server with the stream provisioned, and no `engram up`: for commands that need no
    /// projector.
    async fn bare() -> Self {
        let nats = TestNats::start().await;
        nats.bus().await;
        Self {
            nats,
            home: tempfile::tempdir().unwrap(),
            up: None,
        }
    }

    async fn stream_messages(&self) -> u64 {
        self.nats
            .bus()
            .await
            .stream_summary()
            .await
            .unwrap()
            .messages
    }

    /// Runs `engram --home <home> --nats <url> <args>`, with `stdin` on its standard input.
    fn run_with_stdin(&self, args: &[&str], stdin: &str) -> Output {
        let mut child = Command::new(ENGRAM)
            .arg("--home")
            .arg(self.home.path())
            .args(["--nats", &self.nats.url()])
            .args(args)
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_HOME")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    fn run(&self, args: &[&str]) -> Output {
        self.run_with_stdin(args, "")
    }

    /// Runs a command that must succeed; returns its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "engram {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs a `--json` command that must succeed; returns its JSON lines.
    fn json(&self, args: &[&str]) -> Vec<Value> {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        lines(&self.ok(&all))
    }

    /// Appends JSON events on stdin; returns their receipts.
    fn append(&self, events: &[Value]) -> Vec<Value> {
        let stdin: String = events.iter().map(|e| format!("{e}\n")).collect();
        let out = self.run_with_stdin(&["--json", "append"], &stdin);
        assert!(
            out.status.success(),
            "append failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        lines(&String::from_utf8(out.stdout).unwrap())
    }

    fn stop_up(&mut self) {
        self.up.take().expect("engram up is running").stop();
    }
}

fn lines(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

fn refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn seq(receipt: &Value) -> String {
    receipt["seq"].as_u64().expect("receipt seq").to_string()
}

fn fact(agent: &str, object: &str, valid_from: &str) -> Value {
    json!({
        "tenant": "acme", "scope": {"kind": "task", "id": "t1"}, "agent_id": agent,
        "layer": "semantic", "kind": "fact_asserted",
        "content": {"text": format!("the db runs {object}"), "data": {
            "subject": "db", "predicate": "runs", "object": object, "valid_from": valid_from,
        }},
    })
}

const SCOPE: [&str; 4] = ["--tenant", "acme", "--scope", "task:t1"];

fn observation(text: &str) -> Value {
    json!({
        "tenant": "acme", "scope": {"kind": "task", "id": "t1"}, "agent_id": "a",
        "layer": "episodic", "kind": "observation", "content": {"text": text},
    })
}

#[tokio::test]
async fn a_batch_with_one_bad_event_appends_nothing_and_names_it() {
    let setup = Setup::bare().await;
    let mut bad = observation("bad");
    bad["tenant"] = json!("acme.*");
    // Given three lines whose second is invalid, and a line holding an array with a bad event
    for (stdin, named) in [
        (
            format!(
                "{}\n{bad}\n{}\n",
                observation("first"),
                observation("third")
            ),
            "line 2: malformed event: field tenant",
        ),
        (
            format!("{}\n", json!([observation("one"), bad, observation("two")])),
            "line 1: malformed event: field tenant",
        ),
        (
            format!("{}\nnot json\n", observation("first")),
            "line 2: invalid JSON",
        ),
    ] {
        // When they are appended as one batch
        let out = setup.run_with_stdin(&["append"], &stdin);
        // Then the command fails, says nothing was appended and names the bad line
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(stderr.contains("nothing was appended"), "{stderr}");
        assert!(stderr.contains(named), "{stderr}");
        // And the stream holds nothing
        assert_eq!(setup.stream_messages().await, 0, "{stdin}");
    }
    // While a good batch is appended whole
    let receipts = setup.append(&[observation("a"), observation("b"), observation("c")]);
    assert_eq!(receipts.len(), 3);
    assert_eq!(setup.stream_messages().await, 3);
}

#[tokio::test]
async fn a_replay_piped_into_an_append_copies_a_stream_once_with_its_event_ids() {
    // Given events of two scopes in one server's stream
    let from = Setup::bare().await;
    let mut other = observation("elsewhere");
    other["scope"] = json!({"kind": "task", "id": "t2"});
    from.append(&[observation("first"), observation("second"), other]);
    let replayed = from.ok(&["--json", "replay"]);
    // When its replay is appended into another server's stream, twice (a retried copy)
    let to = Setup::bare().await;
    for _ in 0..2 {
        let out = to.run_with_stdin(&["append"], &replayed);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Then it holds each event once, with the same ids, scopes and texts, partitioned anew
    let source: Vec<Value> = lines(&replayed)
        .into_iter()
        .map(|l| l["event"].clone())
        .collect();
    let copied: Vec<Value> = to
        .json(&["replay"])
        .into_iter()
        .map(|l| {
            assert!(
                engram_schema::subject_partition(l["subject"].as_str().unwrap()).is_some(),
                "{l}"
            );
            l["event"].clone()
        })
        .collect();
    assert_eq!(copied.len(), 3);
    let key = |e: &Value| {
        (
            e["event_id"].clone(),
            e["scope"].clone(),
            e["content"]["text"].clone(),
        )
    };
    assert_eq!(
        copied.iter().map(key).collect::<Vec<_>>(),
        source.iter().map(key).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_fact_with_a_malformed_payload_is_refused_naming_the_field() {
    let setup = Setup::bare().await;
    let mut no_subject = fact("a1", "postgres 16", "2026-06-01T00:00:00Z");
    no_subject["content"]["data"]
        .as_object_mut()
        .unwrap()
        .remove("subject");
    let out = setup.run_with_stdin(&["append"], &format!("{no_subject}\n"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("content.data.subject"), "{stderr}");
    assert!(stderr.contains("nothing was appended"), "{stderr}");
    assert_eq!(setup.stream_messages().await, 0);
}

#[tokio::test]
async fn expect_last_seq_appends_only_on_the_sequence_it_names() {
    let setup = Setup::bare().await;
    let receipts = setup.append(&[observation("a"), observation("b")]);
    let last = seq(&receipts[1]);
    // A writer that read the subject before "b" is refused, and nothing is stored
    let stale = setup.run(&[
        "--json",
        "append",
        "--tenant",
        "acme",
        "--scope",
        "task:t1",
        "--text",
        "stale",
        "--expect-last-seq",
        &seq(&receipts[0]),
    ]);
    assert!(!stale.status.success());
    let answer = lines(&String::from_utf8_lossy(&stale.stdout));
    assert_eq!(answer[0]["kind"], "conflict", "{answer:?}");
    assert_eq!(answer[0]["retryable"], false, "{answer:?}");
    assert_eq!(setup.stream_messages().await, 2);
    // One that read it after "b" appends
    let current = setup.json(&[
        "append",
        "--tenant",
        "acme",
        "--scope",
        "task:t1",
        "--text",
        "current",
        "--expect-last-seq",
        &last,
    ]);
    assert_eq!(current[0]["seq"], 3, "{current:?}");
    // And a batch cannot take the option: it names one subject's sequence
    let out = setup.run_with_stdin(
        &["append", "--expect-last-seq", "3"],
        &format!("{}\n{}\n", observation("x"), observation("y")),
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--expect-last-seq applies to a single event")
    );
    assert_eq!(setup.stream_messages().await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn facts_show_the_current_value_and_the_history_after_a_contradiction() {
    let setup = Setup::start().await;
    // Given two agents asserting different values of one single-valued fact
    let first = setup.append(&[fact("a1", "postgres 15", "2026-01-01T00:00:00Z")]);
    // Between the two: what Engram knew then had only the first.
    std::thread::sleep(Duration::from_millis(20));
    let between = chrono::Utc::now().to_rfc3339();
    std::thread::sleep(Duration::from_millis(20));
    let second = setup.append(&[fact("a2", "postgres 16", "2026-06-01T00:00:00Z")]);
    let min_seq = seq(&second[0]);
    let facts = |extra: &[&str]| {
        let mut args = vec!["facts"];
        args.extend_from_slice(&SCOPE);
        args.extend_from_slice(&[
            "--min-seq",
            &min_seq,
            "--subject",
            "db",
            "--predicate",
            "runs",
        ]);
        args.extend_from_slice(extra);
        setup.json(&args)
    };

    // Then the current fact is the later one
    let current = facts(&[]);
    assert_eq!(current.len(), 1, "{current:?}");
    assert_eq!(current[0]["object"], "postgres 16");
    assert_eq!(current[0]["id"].to_string(), seq(&second[0]));

    // And the history holds both, the first superseded by the second
    let history = facts(&["--history"]);
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(history[0]["object"], "postgres 15");
    assert_eq!(history[0]["superseded_by"].to_string(), seq(&second[0]));
    assert_eq!(history[1]["object"], "postgres 16");
    assert!(history[1]["superseded_by"].is_null());

    // And valid time and transaction time each give the first value back
    let in_march = facts(&["--as-of", "2026-03-01T00:00:00Z"]);
    assert_eq!(in_march.len(), 1, "{in_march:?}");
    assert_eq!(in_march[0]["object"], "postgres 15");
    let known_then = facts(&["--known-at", &between]);
    assert_eq!(known_then.len(), 1, "{known_then:?}");
    assert_eq!(known_then[0]["object"], "postgres 15");
    assert_eq!(known_then[0]["id"].to_string(), seq(&first[0]));

    // And the text table says the same
    let mut args = vec!["facts"];
    args.extend_from_slice(&SCOPE);
    args.extend_from_slice(&["--subject", "db", "--predicate", "runs", "--history"]);
    let table = setup.ok(&args);
    let rows: Vec<&str> = table.lines().collect();
    assert_eq!(rows.len(), 3, "{table}");
    assert!(
        rows[1].contains("postgres 15") && rows[1].contains("superseded by"),
        "{table}"
    );
    assert!(
        rows[2].contains("postgres 16") && rows[2].contains("current"),
        "{table}"
    );

    // And a history without its fact is refused before anything is asked
    let mut args = vec!["facts"];
    args.extend_from_slice(&SCOPE);
    args.extend_from_slice(&["--subject", "db", "--history"]);
    let refused = setup.run(&args);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--predicate"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skills_are_found_by_name_and_by_task() {
    let setup = Setup::start().await;
    let skill = |name: &str, description: &str| {
        json!({
            "tenant": "acme", "scope": {"kind": "task", "id": "t1"},
            "layer": "procedural", "kind": "skill_recorded",
            "content": {"text": description, "data": {
                "name": name, "description": description,
                "steps": ["find it", "fix it"],
            }},
        })
    };
    let receipts = setup.append(&[
        skill(
            "fix-sql-injection",
            "find string-built SQL queries, parameterise them, rerun the tests",
        ),
        skill(
            "rotate-credentials",
            "issue a new api key, deploy it, revoke the old key",
        ),
    ]);
    let min_seq = seq(&receipts[1]);
    let skills = |extra: &[&str]| -> Vec<String> {
        ["skills"]
            .iter()
            .chain(&SCOPE)
            .chain(&["--min-seq", min_seq.as_str()])
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };

    let by_name = setup.json(&refs(&skills(&["--name", "rotate-credentials"])));
    assert_eq!(by_name.len(), 1, "{by_name:?}");
    assert_eq!(by_name[0]["name"], "rotate-credentials");
    assert_eq!(by_name[0]["version"], 1);

    let by_task = setup.json(&refs(&skills(&["--task", "parameterise the SQL query"])));
    assert!(!by_task.is_empty());
    assert_eq!(by_task[0]["name"], "fix-sql-injection", "{by_task:?}");

    let text = setup.ok(&refs(&skills(&["--name", "fix-sql-injection"])));
    assert!(text.starts_with("fix-sql-injection v1"), "{text}");
    assert!(text.contains("1. find it"), "{text}");

    let neither = setup.run(&refs(&skills(&[])));
    assert!(!neither.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_makes_a_memory_disappear_from_retrieve() {
    let setup = Setup::start().await;
    let text = |t: &str| {
        let mut args = vec!["--json", "append", "--text", t];
        args.extend_from_slice(&SCOPE);
        lines(&setup.ok(&args)).remove(0)
    };
    let secret = text("the staging database password is hunter2");
    let kept = text("the staging database runs on port 5433");
    let retrieve = |min_seq: &str| {
        let mut args = vec!["retrieve", "staging database password"];
        args.extend_from_slice(&SCOPE);
        args.extend_from_slice(&["--min-seq", min_seq]);
        let response = setup.json(&args).remove(0);
        response["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["event_id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let secret_id = secret["event_id"].as_str().unwrap();
    let kept_id = kept["event_id"].as_str().unwrap();
    let before = retrieve(&seq(&kept));
    assert!(before.iter().any(|id| id == secret_id), "{before:?}");

    // When the memory is forgotten
    let mut args = vec!["forget", secret_id, "--reason", "a secret got in"];
    args.extend_from_slice(&SCOPE);
    let receipt = setup.json(&args).remove(0);
    assert_eq!(receipt["ok"], true);
    assert_eq!(receipt["forgotten"], json!([secret_id]));
    assert!(
        receipt["subject"]
            .as_str()
            .unwrap()
            .ends_with(".task.t1.episodic")
    );

    // Then retrieval no longer returns it, and still returns the other one
    let after = retrieve(&seq(&receipt));
    assert!(!after.iter().any(|id| id == secret_id), "{after:?}");
    assert!(after.iter().any(|id| id == kept_id), "{after:?}");

    // And the event stays in the stream, which is the audit log
    let mut args = vec!["replay"];
    args.extend_from_slice(&SCOPE);
    let replayed = setup.json(&args);
    assert_eq!(replayed.len(), 3);
    assert_eq!(replayed[2]["event"]["kind"], "forgotten");
    assert_eq!(replayed[2]["event"]["content"]["text"], "a secret got in");
}

/// Publishes `payload` raw on `subject`, as a client without the SDK could; returns its seq.
async fn publish_raw(bus: &Bus, subject: &str, payload: Vec<u8>) -> u64 {
    bus.jetstream()
        .publish(subject.to_owned(), payload.into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence
}

/// Polls `engram dlq list` until `projector` has `n` dead letters; returns them.
fn wait_for_letters(setup: &Setup, projector: &str, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let letters = setup.json(&["dlq", "list", "--projector", projector]);
        if letters.len() >= n {
            assert_eq!(letters.len(), n, "{letters:?}");
            return letters;
        }
        assert!(
            Instant::now() < deadline,
            "{projector} has {} dead letters, not {n}",
            letters.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The subject an event published on acme's task `task` is stored on: with its partition.
fn stored_on(task: &str) -> String {
    let partition = engram_schema::partition_of(
        &engram_testkit::ident("acme"),
        engram_schema::ScopeKind::Task,
        &engram_testkit::ident(task),
        engram_schema::DEFAULT_PARTITIONS,
    );
    format!("engram.evt.acme.task.{task}.episodic.{partition}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_and_show_raw_published_poison_events() {
    let setup = Setup::start().await;
    let bus = Bus::connect(setup.nats.bus_config()).await.unwrap();
    // Given bytes that are no event, and a valid event on a subject that is not its own
    let junk_seq = publish_raw(
        &bus,
        "engram.evt.acme.task.t1.episodic",
        b"definitely not msgpack".to_vec(),
    )
    .await;
    let misplaced = engram_testkit::event("acme", "t1", "published on the wrong scope");
    let misplaced_seq = publish_raw(
        &bus,
        "engram.evt.acme.task.t2.episodic",
        bus.codec().encode(&misplaced).unwrap(),
    )
    .await;

    // When every projector has dead-lettered both
    let mut letters = wait_for_letters(&setup, "keyword", 2);
    // Two partitions' instances dead-letter each its own, in either order.
    letters.sort_by_key(|l| l["event_seq"].as_u64());
    let projectors = engram_projectors::ProjectorName::all();
    for projector in &projectors {
        wait_for_letters(&setup, projector.as_str(), 2);
    }

    // Then the list names each one's projector, event seq, subject and reason
    assert_eq!(letters[0]["projector"], "keyword");
    assert_eq!(letters[0]["event_seq"], junk_seq);
    // The subject it is stored on: where it was published, with its partition.
    assert_eq!(letters[0]["subject"], stored_on("t1"));
    assert!(!letters[0]["reason"].as_str().unwrap().is_empty());
    assert_eq!(letters[1]["event_seq"], misplaced_seq);
    assert!(
        letters[1]["reason"].as_str().unwrap().contains("subject"),
        "{letters:?}"
    );
    let all = setup.json(&["dlq", "list"]);
    assert_eq!(all.len(), 2 * projectors.len());
    assert_eq!(setup.json(&["dlq", "list", "--limit", "3"]).len(), 3);
    let text = setup.ok(&["dlq", "list", "--limit", "3"]);
    assert!(
        text.contains(&format!("showing the oldest 3 of {}", 2 * projectors.len())),
        "{text}"
    );
    let refused = setup.run(&["dlq", "list", "--limit", "10001"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("use 1 to 10000"));

    // And show decodes the event when it is one, and gives the size when it is not
    let junk = setup.json(&["dlq", "show", &letters[0]["dlq_seq"].to_string()]);
    assert!(junk[0]["event"].is_null());
    assert_eq!(junk[0]["payload_bytes"], 22);
    assert!(junk[0]["decode_error"].as_str().is_some());
    let text = setup.ok(&["dlq", "show", &letters[0]["dlq_seq"].to_string()]);
    assert!(text.contains("22 bytes that are no event"), "{text}");
    let shown = setup.json(&["dlq", "show", &letters[1]["dlq_seq"].to_string()]);
    assert_eq!(
        shown[0]["event"]["event_id"],
        misplaced.event_id.to_string()
    );
    assert_eq!(
        shown[0]["event"]["content"]["text"],
        "published on the wrong scope"
    );
    assert_eq!(shown[0]["subject"], stored_on("t2"));
    let missing = setup.run(&["dlq", "show", "999"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no dead letter at seq 999"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_redrive_needs_the_projector_stopped_then_purges_and_rebuilds() {
    let mut setup = Setup::start().await;
    let bus = Bus::connect(setup.nats.bus_config()).await.unwrap();
    setup.ok(&[
        "append",
        "--text",
        "a good memory",
        "--tenant",
        "acme",
        "--scope",
        "task:t1",
    ]);
    publish_raw(&bus, "engram.evt.acme.task.t1.episodic", b"poison".to_vec()).await;
    let before = wait_for_letters(&setup, "keyword", 1);
    wait_for_letters(&setup, "facts", 1);
    // The instance of the scope's partition keeps its key in its own directory.
    let partition = engram_memory::ScopeKey::of(&engram_testkit::event("acme", "t1", "x"))
        .partition(bus.config().stream.partitions);
    let key = engram_projectors::partition_dir(&setup.home.path().join("projectors"), partition)
        .join("keyword.dlq-key");
    assert!(key.exists());

    // While `engram up` runs the projector, a redrive is refused and removes nothing
    let refused = setup.run(&["dlq", "redrive", "keyword"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("in use by another process") && stderr.contains("stop it first"),
        "{stderr}"
    );
    assert_eq!(
        setup.json(&["dlq", "list", "--projector", "keyword"]),
        before
    );
    assert!(key.exists());

    // With it stopped, the redrive purges, rebuilds, and counts what fails again
    setup.stop_up();
    let report = setup.json(&["dlq", "redrive", "keyword"]);
    assert_eq!(report.len(), 1, "{report:?}");
    assert_eq!(report[0]["projector"], "keyword");
    assert_eq!(report[0]["redriven"], 1, "{report:?}");
    assert_eq!(report[0]["dead_lettered_again"], 1, "{report:?}");
    assert_eq!(report[0]["applied_seq"], 2);

    // The poison is dead-lettered again as a new letter (a fresh key, so no duplicate)
    let after = setup.json(&["dlq", "list", "--projector", "keyword"]);
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0]["event_seq"], before[0]["event_seq"]);
    assert!(after[0]["dlq_seq"].as_u64() > before[0]["dlq_seq"].as_u64());
    assert!(key.exists());
    // Other projectors' letters are left alone
    assert_eq!(
        setup.json(&["dlq", "list", "--projector", "facts"]).len(),
        1
    );

    // The text report says both numbers
    let text = setup.ok(&["dlq", "redrive", "keyword"]);
    assert!(
        text.contains("re-drove 1 dead letter of keyword")
            && text.contains("1 dead-lettered again"),
        "{text}"
    );

    // And the rebuilt projector serves the good memory once engram up is back
    setup.up = Some(Up::start(setup.home.path(), &setup.nats.url()));
    let mut args = vec![
        "retrieve",
        "good memory",
        "--mode",
        "keyword",
        "--min-seq",
        "2",
    ];
    args.extend_from_slice(&SCOPE);
    let found = setup.json(&args).remove(0);
    assert_eq!(found["results"][0]["text"], "a good memory", "{found}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doc_edit_show_conflicts_and_history_of_a_task_board() {
    let setup = Setup::start().await;
    let doc = |cmd: &str, extra: &[&str]| -> Vec<String> {
        [
            "doc",
            cmd,
            "task_board",
            "sprint",
            "--tenant",
            "acme",
            "--scope",
            "team:core",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    // Given a board edited from the command line, as two instances.
    let first = setup.json(&refs(&doc(
        "edit",
        &[
            "--set",
            r#"/items/t-1={"title":"fix login","status":"todo","notes":[]}"#,
            "--instance",
            "i-1",
        ],
    )));
    let min = seq(&first[0]);
    let second = setup.json(&refs(&doc(
        "edit",
        &[
            "--set",
            "/items/t-1/owner=i-2",
            "--set",
            "/items/t-1/notes/-=repro attached",
            "--instance",
            "i-2",
            "--min-seq",
            &min,
        ],
    )));
    let min = seq(&second[0]);

    // Then show has both edits merged.
    let shown = setup.json(&refs(&doc("show", &["--min-seq", &min])));
    let value = &shown[0]["doc"]["value"];
    assert_eq!(value["items"]["t-1"]["title"], "fix login");
    assert_eq!(value["items"]["t-1"]["owner"], "i-2");
    assert_eq!(value["items"]["t-1"]["notes"], json!(["repro attached"]));
    assert_eq!(shown[0]["doc"]["events"], 2);
    let text = setup.ok(&refs(&doc("show", &["--min-seq", &min])));
    assert!(text.contains("0 conflicting field(s)"), "{text}");

    // And history lists the two events, by instance.
    let history = setup.json(&refs(&doc("history", &["--min-seq", &min])));
    let instances: Vec<&str> = history
        .iter()
        .map(|h| h["instance_id"].as_str().unwrap())
        .collect();
    assert_eq!(instances, ["i-1", "i-2"]);

    // An edit after which the board no longer reads as a task board is refused, unsent.
    let before = setup.stream_messages().await;
    let bad = setup.run(&refs(&doc("edit", &["--set", "/items/t-1/status=42"])));
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("no longer reads as a task_board") && err.contains("nothing was sent"),
        "{err}"
    );
    assert_eq!(setup.stream_messages().await, before);

    // A document that does not exist says how to find the ones that do.
    let missing = setup.run(&[
        "doc",
        "show",
        "task_board",
        "nope",
        "--tenant",
        "acme",
        "--scope",
        "team:core",
    ]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("engram doc list"));
    let listed = setup.json(&[
        "doc",
        "list",
        "--tenant",
        "acme",
        "--scope",
        "team:core",
        "--min-seq",
        &min,
    ]);
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["name"], "sprint");
    assert_eq!(
        setup
            .json(&refs(&doc("conflicts", &["--min-seq", &min])))
            .len(),
        0
    );
}

#[tokio::test]
async fn a_secret_appended_through_the_cli_reaches_the_stream_redacted() {
    let setup = Setup::bare().await;
    let token = format!("ghp_{}", "a1B2c3D4e5".repeat(4));
    let text = format!("ci token {token}, db password=hunter2hunter2, key AKIAIOSFODNN7EXAMPLE");
    setup.append(&[observation(&text)]);
    let _ = setup.ok(&[
        "append", "--tenant", "acme", "--scope", "task:t1", "--agent", "a", "--text", &text,
    ]);
    let bus = setup.nats.bus().await;
    for secret in [token.as_str(), "hunter2hunter2", "AKIAIOSFODNN7EXAMPLE"] {
        let (seen, holding) = engram_testkit::events_holding(&bus, secret).await;
        assert_eq!(seen, 2, "both writes, as JSON and with --text");
        assert!(holding.is_empty(), "{secret} is stored at {holding:?}");
    }
    let (_, redacted) = engram_testkit::events_holding(&bus, "[REDACTED:github_token]").await;
    assert_eq!(redacted.len(), 2);
}

#[tokio::test]
async fn a_secret_set_in_a_document_from_the_cli_is_redacted_before_the_change_is_made() {
    let setup = Setup::start().await;
    let doc = |cmd: &str, extra: &[&str]| -> Vec<String> {
        [
            "doc",
            cmd,
            "task_board",
            "ops",
            "--tenant",
            "acme",
            "--scope",
            "team:core",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    let edited = setup.json(&refs(&doc(
        "edit",
        &[
            "--set",
            r#"/items/t-1={"title":"rotate db creds","status":"todo","notes":["db password=hunter2hunter2"]}"#,
        ],
    )));
    let min = seq(&edited[0]);
    let shown = setup.json(&refs(&doc("show", &["--min-seq", &min])));
    let notes = shown[0]["doc"]["value"]["items"]["t-1"]["notes"].to_string();
    assert!(!notes.contains("hunter2hunter2"), "{notes}");
    assert!(notes.contains("[REDACTED:key_value_secret]"), "{notes}");
    // Nor is it anywhere in the stream: not in the change bytes either.
    let bus = setup.nats.bus().await;
    let (seen, holding) = engram_testkit::events_holding(&bus, "hunter2hunter2").await;
    assert!(seen >= 1);
    assert!(holding.is_empty(), "the secret is stored at {holding:?}");
}

//! `engram task apply` as a user runs it: a real `engram up`, a YAML spec, and scripted
//! replicas that each do what the spec's roles say: one finishes, one fails once and then
//! finishes from the brief of the session it resumes, one runs until the ttl stops it.
//! What is asserted comes from what the scripts did (their sessions, exits and markers),
//! never from timing.

mod common;

use std::time::Duration;

use common::{cli, ok, spawn_up, token};

/// `engram up` on free ports with tenant `acme`, and a working directory for the task.
struct Up {
    _child: common::KillOnDrop,
    home: tempfile::TempDir,
    work: tempfile::TempDir,
    nats: String,
}

impl Up {
    fn start() -> Self {
        let home = tempfile::tempdir().unwrap();
        let (child, ready) = spawn_up(home.path(), &["--nats-port", "0"], Duration::from_secs(120));
        let up = Self {
            nats: token(&ready, "nats=").to_owned(),
            _child: child,
            home,
            work: tempfile::tempdir().unwrap(),
        };
        ok(&mut up.engram(&["tenant", "add", "acme"]));
        up
    }

    fn engram(&self, args: &[&str]) -> std::process::Command {
        let mut c = cli(self.home.path());
        c.args(["--nats", &self.nats]).args(args);
        c
    }

    /// `engram task apply` of `spec` in the working directory, its programs finding the
    /// `engram` under test on PATH; what it printed on stderr, once it succeeded.
    fn apply(&self, spec: &str) -> String {
        let path = self.work.path().join("task.yaml");
        std::fs::write(&path, spec).unwrap();
        let out = self
            .engram(&["task", "apply", path.to_str().unwrap(), "--progress", "2s"])
            .current_dir(self.work.path())
            .env("PATH", common::path_with_engram())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "task apply failed: {stderr}");
        stderr
    }
}
use serde_json::Value;

#[test]
fn a_task_spec_runs_its_replicas_restarts_a_failed_one_from_its_brief_and_stops_at_the_ttl() {
    let up = Up::start();
    let (work, engram) = (&up.work, |args: &[&str]| up.engram(args));

    let marks = work.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    // worker-0 finishes; worker-1 fails on its first run and finishes on the next, which
    // resumes its session and must be handed the brief; the watcher runs until stopped.
    let worker = format!(
        r#"m={marks}/$ENGRAM_REPLICA
engram session checkpoint --note "$ENGRAM_REPLICA at work" >/dev/null
if [ "$ENGRAM_REPLICA" = worker-1 ] && [ ! -e "$m.failed" ]; then touch "$m.failed"; exit 3; fi
if [ -n "$ENGRAM_BRIEF" ] && [ -s "$ENGRAM_BRIEF" ]; then touch "$m.briefed"; fi
touch "$m.done"; exit 0"#,
        marks = marks.display()
    );
    let watcher = format!(
        r#"trap 'touch {marks}/watcher.stopped; exit 0' TERM; while true; do sleep 0.2; done"#,
        marks = marks.display()
    );
    let stderr = up.apply(&format!(
            "tenant: acme\ntask: release-7\nttl: 25s\ncontext: shared\nmemory:\n  scope: task:release-7\nmax_restarts: 2\nroles:\n  - name: worker\n    replicas: 2\n    command: [\"sh\", \"-c\", {worker:?}]\n  - name: watcher\n    replicas: 1\n    command: [\"sh\", \"-c\", {watcher:?}]\n"
    ));

    for mark in [
        "worker-0.done",
        "worker-1.failed",
        "worker-1.done",
        "worker-1.briefed",
        "watcher.stopped",
    ] {
        assert!(
            marks.join(mark).exists(),
            "no {mark}; task apply said:\n{stderr}"
        );
    }
    assert!(
        !marks.join("worker-0.briefed").exists(),
        "a first run was handed a brief"
    );
    assert!(stderr.contains("ttl reached"), "{stderr}");

    // The log: four sessions (worker-1 twice), with their exits and the replica each ran as.
    let status: Value = serde_json::from_str(
        ok(&mut engram(&[
            "--json",
            "task",
            "status",
            "--tenant",
            "acme",
            "--task",
            "release-7",
        ]))
        .trim(),
    )
    .unwrap();
    let rows = status.as_array().unwrap();
    let of = |replica: &str| -> Vec<&Value> {
        rows.iter().filter(|r| r["replica"] == replica).collect()
    };
    assert_eq!(of("worker-0").len(), 1, "{status}");
    assert_eq!(of("worker-0")[0]["exit_code"], 0, "{status}");
    let w1 = of("worker-1");
    assert_eq!(w1.len(), 2, "{status}");
    let mut codes: Vec<i64> = w1
        .iter()
        .map(|r| r["exit_code"].as_i64().unwrap())
        .collect();
    codes.sort();
    assert_eq!(codes, [0, 3], "{status}");
    assert_eq!(of("watcher-0").len(), 1, "{status}");
    assert_eq!(of("watcher-0")[0]["state"], "exited", "{status}");
    assert!(rows.iter().all(|r| r["state"] == "exited"), "{status}");
    assert!(
        w1.iter().any(|r| r["last_checkpoint"]
            .as_str()
            .is_some_and(|c| c.contains("at work"))),
        "{status}"
    );
}

/// `context: isolated` and `persistence: session`, as a user writes them: an isolated role's
/// key writes its session's scope and is refused the task's (while a shared role writes
/// there), keeps its earlier session's scope when it is resumed after a failure; and when the
/// task ends, every scope it wrote is erased, verifiably.
#[test]
fn an_isolated_replica_keeps_to_its_session_and_session_persistence_erases_the_task_at_its_end() {
    let up = Up::start();
    let (work, engram) = (&up.work, |args: &[&str]| up.engram(args));

    let marks = work.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    // Every append names the run's agent; a refused one must fail, not hang (timeout 60).
    let append = r#"timeout 60 engram append --tenant acme --agent "$ENGRAM_AGENT" --instance "$ENGRAM_INSTANCE" --text"#;
    let scout = format!(
        r#"m={marks}/$ENGRAM_REPLICA
[ "$ENGRAM_CONTEXT" = isolated ] && [ "$ENGRAM_SCOPE" = "session:$ENGRAM_SESSION" ] && touch "$m.isolated"
{append} "scout note $ENGRAM_SESSION" --scope "$ENGRAM_SCOPE" >/dev/null && touch "$m.wrote-own"
{append} "scout trespass" --scope "task:$ENGRAM_TASK" >/dev/null 2>&1 || touch "$m.task-refused"
if [ ! -e "$m.failed" ]; then touch "$m.failed"; exit 3; fi
timeout 60 engram --json replay --tenant acme --scope "session:$ENGRAM_RESUMED_SESSION" | grep -q "scout note $ENGRAM_RESUMED_SESSION" && touch "$m.read-previous"
exit 0"#,
        marks = marks.display()
    );
    let lead = format!(
        r#"m={marks}/$ENGRAM_REPLICA
[ "$ENGRAM_CONTEXT" = shared ] && [ "$ENGRAM_SCOPE" = "task:$ENGRAM_TASK" ] && touch "$m.shared"
{append} "lead decision" --scope "$ENGRAM_SCOPE" >/dev/null && touch "$m.wrote-task"
exit 0"#,
        marks = marks.display()
    );
    let stderr = up.apply(&format!(
            "tenant: acme\ntask: probe-3\nttl: 5m\ncontext: shared\nmemory:\n  persistence: session\nmax_restarts: 1\nroles:\n  - name: lead\n    replicas: 1\n    command: [\"sh\", \"-c\", {lead:?}]\n  - name: scout\n    replicas: 1\n    context: isolated\n    command: [\"sh\", \"-c\", {scout:?}]\n"
    ));
    for mark in [
        "lead-0.shared",
        "lead-0.wrote-task",
        "scout-0.isolated",
        "scout-0.wrote-own",
        "scout-0.task-refused",
        "scout-0.failed",
        "scout-0.read-previous",
    ] {
        assert!(
            marks.join(mark).exists(),
            "no {mark}; task apply said:\n{stderr}"
        );
    }
    assert!(!stderr.contains("ttl reached"), "{stderr}");
    assert!(stderr.contains("memory erased"), "{stderr}");

    // The ledger names the three sessions (lead once, scout twice) and what was erased:
    // at least their started and ended records and the three appends that were taken.
    let ledger: Value = serde_json::from_slice(
        &std::fs::read(up.home.path().join("tasks/acme/probe-3.json")).unwrap(),
    )
    .unwrap();
    let sessions: Vec<String> = ledger["replicas"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|v| v.as_array().unwrap().iter())
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(sessions.len(), 3, "{ledger}");
    let erased = &ledger["erased"];
    assert_eq!(
        erased["incomplete"].as_array().unwrap().len(),
        0,
        "{ledger}"
    );
    assert_eq!(erased["scopes"].as_array().unwrap().len(), 4, "{ledger}");
    assert!(
        erased["events_purged"].as_u64().unwrap() >= 3 * 2 + 3,
        "{ledger}"
    );

    // Nothing of the task is left anywhere Engram keeps memory.
    let mut verify = engram(&[
        "erase",
        "verify",
        "--tenant",
        "acme",
        "--scope",
        "task:probe-3",
    ]);
    for s in &sessions {
        verify.args(["--scope", &format!("session:{s}")]);
    }
    let said = ok(&mut verify);
    assert!(said.contains("no trace"), "{said}");
    let said = ok(&mut engram(&[
        "task", "status", "--tenant", "acme", "--task", "probe-3",
    ]));
    assert!(said.contains("its memory was erased"), "{said}");
}

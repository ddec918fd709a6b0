//! `engram up --demo` as a new user first runs it: every section, in order, and no warning.

mod common;
use common::KillOnDrop;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engram::demo::SECTIONS;
use engram_testkit::TestNats;

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_the_main_job_in_order_and_warns_about_nothing() {
    let nats = TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let log = home.path().join("up.log");
    let mut up = KillOnDrop(
        Command::new(ENGRAM)
            .arg("--home")
            .arg(home.path())
            .args(["--nats", &nats.url(), "--log-format", "json"])
            .args(["up", "--http", "127.0.0.1:0", "--demo"])
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_HOME")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    // Read on a thread, so that a demo that hangs fails the test instead of blocking it.
    let mut stdout = common::Lines::of(up.0.stdout.take().unwrap());
    if let Err(e) = stdout.until("the demo is done", Duration::from_secs(180)) {
        panic!(
            "demo did not finish ({e}); it printed:\n{}\nlog:\n{}",
            stdout.seen().join("\n"),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    let printed = stdout.seen().join("\n");

    // Every section, in order
    let mut at = 0;
    for section in SECTIONS {
        let found = printed[at..]
            .find(section)
            .unwrap_or_else(|| panic!("no {section:?} after byte {at} in:\n{printed}"));
        at += found + section.len();
    }
    // Retrieval shows its score parts; the facts, the current value and the history
    for part in ["dense ", "bm25 ", "fusion ", "recency +", "importance +"] {
        assert!(printed.contains(part), "no {part:?} in:\n{printed}");
    }
    let facts = &printed[printed.find(SECTIONS[3]).unwrap()..printed.find(SECTIONS[4]).unwrap()];
    assert!(
        facts.contains("parameterised statements") && facts.contains("current"),
        "{facts}"
    );
    assert!(
        facts.contains("string concatenation") && facts.contains("superseded by fact@"),
        "{facts}"
    );
    assert!(printed.contains("duplicate=true"), "{printed}");
    assert!(printed.contains("replayed 7 events"), "{printed}");
    assert!(printed.contains("(expired)"), "{printed}");

    // SIGTERM, then: nothing from start to stop was a warning or an error
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(up.0.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while up.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "engram up did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
    let logs = std::fs::read_to_string(&log).unwrap();
    assert!(!logs.contains("demo failed"), "{logs}");
    let before_shutdown = logs
        .lines()
        .take_while(|l| !l.contains("\"shutting down\""))
        .collect::<Vec<_>>();
    assert!(
        before_shutdown.len() < logs.lines().count(),
        "no shutdown line in:\n{logs}"
    );
    // The check reads JSON log lines: make sure that is what they are.
    assert!(
        before_shutdown
            .iter()
            .any(|l| l.contains("\"level\":\"INFO\"")),
        "{logs}"
    );
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("\"level\":\"WARN\"") || l.contains("\"level\":\"ERROR\""))
        .collect();
    assert!(warnings.is_empty(), "the demo logged: {warnings:#?}");
}

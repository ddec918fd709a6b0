//! `engram up` as a user runs it: a real process with a managed nats-server, probed over HTTP,
//! driven with the CLI, and stopped with SIGTERM.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{KillOnDrop, Lines, cli, http_exchange, ok, token};

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");

fn http_get(addr: &str, path: &str) -> (u16, String) {
    http_exchange(addr, addr, &format!("GET {path} HTTP/1.1"), "")
}

/// A JSON POST with a bearer key, as an HTTP client would send it; the status and body.
fn http_post(
    addr: &str,
    path: &str,
    key: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json"
    );
    let (status, body) = http_exchange(addr, addr, &head, &body);
    (
        status,
        serde_json::from_str(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// Starts `engram up` with its data in `home` and returns it with its "engram is up" line.
fn spawn_up(home: &std::path::Path, nats_port: u16) -> (KillOnDrop, String) {
    common::spawn_up(
        home,
        &["--nats-port", &nats_port.to_string()],
        Duration::from_secs(120),
    )
}

#[test]
fn up_serves_health_and_metrics_accepts_cli_appends_and_stops_cleanly_on_sigterm() {
    let home = tempfile::tempdir().unwrap();
    // Leased: nobody else takes the port while this test stops and starts engram up on it.
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let nats_port = lease.port();
    let (mut child, ready) = spawn_up(home.path(), nats_port);
    let http = token(&ready, "http=http://").to_owned();
    let nats = token(&ready, "nats=").to_owned();
    assert_eq!(nats, format!("nats://127.0.0.1:{nats_port}"));

    let (status, body) = http_get(&http, "/healthz");
    assert_eq!(status, 200, "{body}");
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["stream"]["messages"], 0);

    // The CLI appends through the managed server, and the stream and metrics show it.
    // Without credentials the server refuses the connection; the CLI on this machine finds
    // the admin's in its home.
    let anonymous = Command::new(ENGRAM)
        .args(["--nats", &nats, "streams"])
        .env("ENGRAM_HOME", home.path().join("elsewhere"))
        .output()
        .unwrap();
    assert!(!anonymous.status.success());
    assert!(
        String::from_utf8_lossy(&anonymous.stderr).contains("refused these credentials"),
        "{}",
        String::from_utf8_lossy(&anonymous.stderr)
    );
    let append = cli(home.path())
        .args([
            "--nats", &nats, "--json", "append", "--tenant", "acme", "--scope", "task:t1",
            "--text", "hello",
        ])
        .output()
        .unwrap();
    assert!(
        append.status.success(),
        "{}",
        String::from_utf8_lossy(&append.stderr)
    );
    let receipt: serde_json::Value = serde_json::from_slice(&append.stdout).unwrap();
    assert_eq!(receipt["seq"], 1);
    let bad = cli(home.path())
        .args([
            "--nats", &nats, "append", "--tenant", "acme.*", "--scope", "task:t1", "--text", "x",
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid tenant"));
    let replay = cli(home.path())
        .args(["--nats", &nats, "--json", "replay", "--tenant", "acme"])
        .output()
        .unwrap();
    assert!(replay.status.success());
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&replay.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["event"]["content"]["text"], "hello");

    let (status, body) = http_get(&http, "/healthz");
    assert_eq!(status, 200);
    assert!(body.contains("\"messages\":1"), "{body}");
    let (status, metrics) = http_get(&http, "/metrics");
    assert_eq!(status, 200);
    assert!(metrics.contains("engram_nats_connected 1"), "{metrics}");
    assert!(
        metrics.contains("engram_events_appended_total"),
        "{metrics}"
    );

    // SIGTERM: orderly shutdown, exit 0, and the managed nats-server is gone with it.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "engram up did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status:?}");
    assert!(
        TcpStream::connect(("127.0.0.1", nats_port)).is_err(),
        "nats-server still listening"
    );

    // The store survives: a second `up` on the same home sees the event.
    let (mut again, ready) = spawn_up(home.path(), nats_port);
    let (_, body) = http_get(token(&ready, "http=http://"), "/healthz");
    assert!(body.contains("\"messages\":1"), "{body}");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(again.0.id() as libc::pid_t, libc::SIGINT) };
    assert!(again.0.wait().unwrap().success());
}

#[test]
fn up_against_a_server_with_a_password_never_shows_the_password() {
    // Given a nats-server that requires a user and password
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("auth.conf");
    std::fs::write(
        &conf,
        "authorization { user: engram, password: s3cret-pass }\n",
    )
    .unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.block_on(async {
        let bin = engram_natsd::locate().unwrap();
        let mut opts =
            engram_natsd::ServerOptions::new(bin, dir.path().join("store"), dir.path().join("run"));
        opts.config_file = Some(conf);
        engram_natsd::NatsServer::start(opts).await.unwrap()
    });
    let port = server.port();

    // When engram up connects with the credentials in its --nats URL
    let home = dir.path().join("home");
    let mut child = KillOnDrop(
        Command::new(ENGRAM)
            .args([
                "up",
                "--nats",
                &format!("nats://engram:s3cret-pass@127.0.0.1:{port}"),
                "--http",
                "127.0.0.1:0",
            ])
            .env("ENGRAM_HOME", &home)
            .env_remove("ENGRAM_CONFIG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stdout = Lines::of(child.0.stdout.take().unwrap());
    let ready = match stdout.until("engram is up", Duration::from_secs(120)) {
        Ok(line) => line,
        Err(e) => {
            let _ = child.0.kill();
            let mut logs = String::new();
            let _ = child.0.stderr.take().unwrap().read_to_string(&mut logs);
            panic!("engram up: {e}; its logs:\n{logs}");
        }
    };

    // Then the banner and /healthz show where it connects, without the credentials
    let shown = format!("nats://***@127.0.0.1:{port}");
    assert_eq!(token(&ready, "nats="), shown);
    let (status, body) = http_get(token(&ready, "http=http://"), "/healthz");
    assert_eq!(status, 200, "{body}");
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["nats"]["url"], shown.as_str(), "{body}");
    assert!(!body.contains("s3cret"), "{body}");

    // And neither do its logs
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    let mut logs = String::new();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut logs)
        .unwrap();
    assert!(child.0.wait().unwrap().success(), "{logs}");
    assert!(!logs.contains("s3cret"), "{logs}");
    drop(server);
}

#[test]
fn agents_get_credentials_from_the_cli_and_lose_them_on_revoke() {
    let home = tempfile::tempdir().unwrap();
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let nats_port = lease.port();
    let (mut child, ready) = spawn_up(home.path(), nats_port);
    let nats = token(&ready, "nats=").to_owned();
    let h = home.path();
    ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme"]));
    ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme2"]));
    let added: serde_json::Value = serde_json::from_str(&ok(cli(h).args([
        "--nats", &nats, "--json", "agent", "add", "--tenant", "acme", "--agent", "planner",
    ])))
    .unwrap();
    let creds = added["creds"].as_str().unwrap().to_owned();
    assert!(std::path::Path::new(&creds).is_file(), "{added}");
    // The agent appends to its own tenant with its credentials file...
    let as_agent = |args: &[&str]| {
        let mut c = cli(&h.join("agent-machine"));
        c.args(["--nats", &nats, "--creds", &creds]).args(args);
        c
    };
    let mut appended = None;
    for _ in 0..100 {
        let out = as_agent(&[
            "--json",
            "append",
            "--tenant",
            "acme",
            "--scope",
            "task:t1",
            "--text",
            "login fails",
        ])
        .output()
        .unwrap();
        if out.status.success() {
            appended = Some(String::from_utf8_lossy(&out.stdout).into_owned());
            break;
        }
        // The server takes the new key with its next reload, moments after the append.
        std::thread::sleep(Duration::from_millis(50));
    }
    let receipt: serde_json::Value =
        serde_json::from_str(&appended.expect("the agent never connected")).unwrap();
    let seq = receipt["seq"].as_u64().unwrap().to_string();
    // ...reads it back through its own query subjects...
    let found = ok(&mut as_agent(&[
        "--json",
        "retrieve",
        "login",
        "--tenant",
        "acme",
        "--scope",
        "task:t1",
        "--mode",
        "keyword",
        "--min-seq",
        &seq,
    ]));
    assert!(found.contains("login fails"), "{found}");
    // ...replays it through the query service (its key reaches no stream)...
    let replayed = ok(&mut as_agent(&[
        "--json", "replay", "--tenant", "acme", "--scope", "task:t1",
    ]));
    assert!(replayed.contains("login fails"), "{replayed}");
    let tail = as_agent(&["tail", "--tenant", "acme"]).output().unwrap();
    assert!(!tail.status.success());
    assert!(
        String::from_utf8_lossy(&tail.stderr).contains("cannot tail"),
        "{}",
        String::from_utf8_lossy(&tail.stderr)
    );
    // ...and can neither write to nor read another tenant.
    let other = as_agent(&[
        "append", "--tenant", "acme2", "--scope", "task:t1", "--text", "x",
    ])
    .output()
    .unwrap();
    assert!(!other.status.success());
    assert!(
        String::from_utf8_lossy(&other.stderr).contains("may not append"),
        "{}",
        String::from_utf8_lossy(&other.stderr)
    );
    let other = as_agent(&["retrieve", "x", "--tenant", "acme2", "--scope", "task:t1"])
        .output()
        .unwrap();
    assert!(!other.status.success());
    assert!(
        String::from_utf8_lossy(&other.stderr).contains("tenant acme"),
        "{}",
        String::from_utf8_lossy(&other.stderr)
    );
    // A wider scope needs a grant, which an admin records; then the agent reads it.
    ok(cli(h).args([
        "--nats",
        &nats,
        "append",
        "--tenant",
        "acme",
        "--scope",
        "team:core",
        "--text",
        "the team deploys on tuesdays",
    ]));
    let team = |grant: &str| {
        as_agent(&[
            "retrieve", "deploys", "--tenant", "acme", "--scope", "task:t1", "--grant", grant,
            "--mode", "keyword",
        ])
        .output()
        .unwrap()
    };
    let refused = team("team:core");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("engram grant add"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    ok(cli(h).args([
        "--nats",
        &nats,
        "grant",
        "add",
        "--tenant",
        "acme",
        "--agent",
        "planner",
        "--scope",
        "team:core",
    ]));
    let granted = ok(cli(h).args(["--nats", &nats, "grant", "list", "--tenant", "acme"]));
    assert!(granted.contains("planner  reads team:core"), "{granted}");
    let mut read = String::new();
    for _ in 0..100 {
        let out = team("team:core");
        if out.status.success() && String::from_utf8_lossy(&out.stdout).contains("tuesdays") {
            read = String::from_utf8_lossy(&out.stdout).into_owned();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(read.contains("tuesdays"), "the grant never took");
    ok(cli(h).args([
        "--nats",
        &nats,
        "grant",
        "revoke",
        "--tenant",
        "acme",
        "--agent",
        "planner",
        "--scope",
        "team:core",
    ]));
    // Listed, then revoked: its credentials stop working.
    let listed = ok(cli(h).args(["--nats", &nats, "agent", "list", "--tenant", "acme"]));
    assert!(
        listed.contains("acme/planner") && listed.contains("live since"),
        "{listed}"
    );
    ok(cli(h).args([
        "--nats", &nats, "agent", "revoke", "--tenant", "acme", "--agent", "planner",
    ]));
    let mut refused = false;
    for _ in 0..100 {
        if !as_agent(&[
            "append", "--tenant", "acme", "--scope", "task:t1", "--text", "again",
        ])
        .output()
        .unwrap()
        .status
        .success()
        {
            refused = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(refused, "a revoked agent still appends");
    let listed = ok(cli(h).args(["--nats", &nats, "agent", "list", "--tenant", "acme"]));
    assert!(listed.contains("revoked"), "{listed}");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

#[test]
fn insecure_no_auth_is_loopback_only_and_says_so() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(ENGRAM)
        .args([
            "up",
            "--insecure-no-auth",
            "--nats-port",
            "0",
            "--http",
            "0.0.0.0:0",
        ])
        .env("ENGRAM_HOME", home.path())
        .env_remove("ENGRAM_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("loopback only"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(ENGRAM)
        .args([
            "up",
            "--insecure-no-auth",
            "--nats-port",
            "0",
            "--http",
            "127.0.0.1:0",
        ])
        .env("ENGRAM_HOME", home.path())
        .env("ENGRAM_NATS__MANAGED_HOST", "0.0.0.0")
        .env_remove("ENGRAM_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("loopback only"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // On loopback it starts, says so on start-up, and takes anonymous connections.
    let log = home.path().join("up.log");
    let mut child = KillOnDrop(
        Command::new(ENGRAM)
            .args([
                "up",
                "--insecure-no-auth",
                "--nats-port",
                "0",
                "--http",
                "127.0.0.1:0",
            ])
            .env("ENGRAM_HOME", home.path())
            .env_remove("ENGRAM_CONFIG")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let ready = Lines::of(child.0.stdout.take().unwrap())
        .until("engram is up", Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("engram up: {e}"));
    let nats = token(&ready, "nats=").to_owned();
    let logs = std::fs::read_to_string(&log).unwrap();
    assert!(
        logs.contains("WARNING: engram is running without authentication"),
        "{logs}"
    );
    assert!(
        !home.path().join("auth").exists(),
        "no credentials are made for an open server"
    );
    let anonymous = Command::new(ENGRAM)
        .args(["--nats", &nats, "streams"])
        .env("ENGRAM_HOME", home.path().join("elsewhere"))
        .output()
        .unwrap();
    assert!(
        anonymous.status.success(),
        "{}",
        String::from_utf8_lossy(&anonymous.stderr)
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

#[test]
fn erase_from_the_cli_leaves_no_trace_and_verify_says_so() {
    let home = tempfile::tempdir().unwrap();
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let (mut child, ready) = spawn_up(home.path(), lease.port());
    let nats = token(&ready, "nats=").to_owned();
    let h = home.path();
    let mut last = String::new();
    for (who, text) in [
        ("u1", "u1 pays with card 4111"),
        ("u2", "u2 pays by invoice"),
    ] {
        let receipt: serde_json::Value = serde_json::from_str(&ok(cli(h).args([
            "--nats",
            &nats,
            "--json",
            "append",
            "--tenant",
            "acme",
            "--scope",
            &format!("user:{who}"),
            "--text",
            text,
        ])))
        .unwrap();
        last = receipt["seq"].to_string();
    }
    // Both are in the read models before anything is erased.
    let found = ok(cli(h).args([
        "--nats",
        &nats,
        "--json",
        "retrieve",
        "pays",
        "--tenant",
        "acme",
        "--scope",
        "user:u1",
        "--mode",
        "keyword",
        "--min-seq",
        &last,
    ]));
    assert!(found.contains("4111"), "{found}");
    let erased = ok(cli(h).args(["--nats", &nats, "erase", "--tenant", "acme", "--user", "u1"]));
    assert!(erased.contains("erased user:u1 of tenant acme"), "{erased}");
    assert!(!erased.contains("NOT DONE"), "{erased}");
    let verified = ok(cli(h).args([
        "--nats", &nats, "erase", "verify", "--tenant", "acme", "--user", "u1",
    ]));
    assert!(verified.contains("no trace of user:u1"), "{verified}");
    // The other user is untouched, and verify finds them: it is not blind.
    let other = cli(h)
        .args([
            "--nats", &nats, "erase", "verify", "--tenant", "acme", "--user", "u2",
        ])
        .output()
        .unwrap();
    assert_eq!(other.status.code(), Some(1));
    let listed = String::from_utf8_lossy(&other.stdout);
    assert!(
        listed.contains("stream") && listed.contains("read model keyword"),
        "{listed}"
    );
    // An agent cannot erase: its key reaches no projector endpoint or the registry.
    ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme"]));
    let added: serde_json::Value = serde_json::from_str(&ok(cli(h).args([
        "--nats", &nats, "--json", "agent", "add", "--tenant", "acme", "--agent", "bot",
    ])))
    .unwrap();
    let creds = added["creds"].as_str().unwrap();
    // Until the server's authorization reload takes the new key, it refuses the connection;
    // after that, the server itself refuses the erasure's first request, which no agent's
    // key may publish (the events stream's info), and the CLI exits 1 saying so and what to
    // do instead, with nothing erased.
    let mut outcome = None;
    for _ in 0..100 {
        let out = cli(&h.join("agent-machine"))
            .args([
                "--nats", &nats, "--creds", creds, "erase", "--tenant", "acme", "--user", "u2",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() || !err.contains("refused these credentials") {
            outcome = Some((
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                err,
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, stdout, stderr) = outcome.expect("the agent's key never connected");
    assert_eq!(
        code,
        Some(1),
        "an agent's erase was not refused: {stdout}{stderr}"
    );
    assert!(
        stderr.contains("the server refused a publish: these credentials do not allow it")
            && stderr.contains(
                r#"Permissions Violation for Publish to "$JS.API.STREAM.INFO.ENGRAM_EVENTS""#
            ),
        "refused for something other than the agent's permissions: {stderr}"
    );
    assert!(
        stderr.contains(
            r#"these credentials may not erase (the server refused a publish to $JS.API.STREAM.INFO.ENGRAM_EVENTS)"#
        ) && stderr.contains("run `engram erase` on the machine running `engram up`")
            && stderr.contains("nothing was changed"),
        "the refusal does not say why, or what to do: {stderr}"
    );
    assert!(!stdout.contains("erased"), "{stdout}");
    let still = ok(cli(h).args([
        "--nats", &nats, "--json", "retrieve", "pays", "--tenant", "acme", "--scope", "user:u2",
        "--mode", "keyword",
    ]));
    assert!(still.contains("invoice"), "{still}");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

#[test]
fn an_api_key_from_the_cli_appends_and_retrieves_through_the_http_api_of_engram_up() {
    let home = tempfile::tempdir().unwrap();
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let (mut child, ready) = spawn_up(home.path(), lease.port());
    let (nats, http) = (
        token(&ready, "nats=").to_owned(),
        token(&ready, "http=http://").to_owned(),
    );
    let h = home.path();
    ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme"]));
    let issued: serde_json::Value = serde_json::from_str(&ok(cli(h).args([
        "--nats", &nats, "--json", "key", "add", "--tenant", "acme", "--agent", "web",
    ])))
    .unwrap();
    let key = issued["api_key"].as_str().unwrap().to_owned();
    let event = serde_json::json!({
        "scope": {"kind": "task", "id": "t1"}, "layer": "episodic", "kind": "observation",
        "content": {"text": "the checkout page times out"},
    });
    let mut appended = None;
    for _ in 0..100 {
        let (status, body) = http_post(&http, "/v1/events", &key, &event);
        if status == 200 {
            appended = Some(body);
            break;
        }
        // The server takes the new key with its next reload, moments after it is issued.
        assert_eq!(status, 401, "{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let appended = appended.expect("the key never worked");
    let seq = appended["results"][0]["seq"].as_u64().unwrap();
    let (status, found) = http_post(
        &http,
        "/v1/retrieve",
        &key,
        &serde_json::json!({"scope": {"kind": "task", "id": "t1"}, "query": "checkout times out",
            "mode": "keyword", "min_seq": seq, "wait_ms": 20000}),
    );
    assert_eq!(status, 200, "{found}");
    assert!(
        found.to_string().contains("checkout page times out"),
        "{found}"
    );
    // `key list` shows the key (its public half only), `key revoke` ends it.
    let public = issued["key"].as_str().unwrap();
    let listed = ok(cli(h).args(["--nats", &nats, "key", "list", "--tenant", "acme"]));
    assert!(
        listed.contains(public) && listed.contains("live"),
        "{listed}"
    );
    assert!(
        !listed.contains(&key),
        "key list printed a secret: {listed}"
    );
    ok(cli(h).args([
        "--nats", &nats, "key", "revoke", "--tenant", "acme", "--agent", "web", "--key", public,
    ]));
    let listed = ok(cli(h).args(["--nats", &nats, "key", "list", "--tenant", "acme"]));
    assert!(
        !listed.contains(public),
        "a revoked key is listed as live: {listed}"
    );
    let listed = ok(cli(h).args(["--nats", &nats, "key", "list", "--tenant", "acme", "--all"]));
    assert!(
        listed.contains(public) && listed.contains("revoked"),
        "{listed}"
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

/// `engram up --nodes 1`: a memory node stopped with SIGTERM after running a while (what a
/// rolling restart does) hands its partitions back and is started again at once, not after
/// `node.restart_after` (a killed node's wait, here ten minutes).
#[test]
fn a_memory_node_stopped_with_sigterm_is_started_again_at_once() {
    let home = tempfile::tempdir().unwrap();
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let (_up, _ready) = common::spawn_up_with(
        home.path(),
        &["--nodes", "1", "--nats-port", &lease.port().to_string()],
        &[
            ("ENGRAM_NODE__RESTART_AFTER", "600s"),
            // Client-supplied vectors: no model for the node to load.
            ("ENGRAM_PROJECTORS__EMBEDDER__KIND", "client_supplied"),
            ("ENGRAM_PROJECTORS__EMBEDDER__MODEL", "test-hash-64"),
            ("ENGRAM_PROJECTORS__EMBEDDER__DIM", "64"),
        ],
        Duration::from_secs(120),
    );
    let pid_file = home.path().join("nodes").join("0").join("pid");
    let pid = || -> Option<i32> { std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok() };
    let first = pid().expect("the node's pid file");
    // "engram is up" came once the node served; past the supervisor's 10 s of a steady run
    // the stop counts as one on purpose.
    std::thread::sleep(Duration::from_secs(11));
    // SAFETY: kill(2) on the node process engram up started for this test.
    assert_eq!(unsafe { libc::kill(first, libc::SIGTERM) }, 0);
    let stopped = Instant::now();
    let deadline = stopped + Duration::from_secs(300);
    let second = loop {
        match pid() {
            Some(p) if p != first => break p,
            _ if Instant::now() > deadline => {
                panic!("the node was not started again within 300 s of its SIGTERM")
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    // SAFETY: signal 0 only asks whether the restarted node lives.
    assert_eq!(
        unsafe { libc::kill(second, 0) },
        0,
        "the restarted node is running"
    );
}

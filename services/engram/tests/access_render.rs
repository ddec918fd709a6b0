//! `engram access render` as an operator runs it next to a nats-server Engram does not run:
//! real `engram up` and `engram access render` processes, and a second, plain nats-server
//! that includes the file the renderer keeps and is reloaded by its `--then`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{KillOnDrop, cli, ok, spawn_up, token};
use engram_access::Credentials;

fn up(home: &Path, nats_port: u16) -> (KillOnDrop, String) {
    spawn_up(
        home,
        &["--nats-port", &nats_port.to_string()],
        Duration::from_secs(120),
    )
}

/// Polls `check` every 50 ms until it holds, at most `within`; panics naming `what`.
fn wait_until(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The public keys an `authorization` block admits; `Err` if it is not a whole block.
fn admitted(text: &str) -> Result<Vec<String>, String> {
    let json = text
        .split_once("authorization: ")
        .ok_or_else(|| format!("no authorization block in {text:?}"))?
        .1;
    let block: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("{e} in {text:?}"))?;
    Ok(block["users"]
        .as_array()
        .ok_or_else(|| format!("no users in {text:?}"))?
        .iter()
        .filter_map(|u| u["nkey"].as_str().map(str::to_owned))
        .collect())
}

/// Adds an agent with the CLI; its credentials file and public key.
fn add_agent(home: &Path, nats: &str, tenant: &str, agent: &str) -> (PathBuf, String) {
    let added: serde_json::Value = serde_json::from_str(&ok(cli(home).args([
        "--nats", nats, "--json", "agent", "add", "--tenant", tenant, "--agent", agent,
    ])))
    .unwrap();
    (
        PathBuf::from(added["creds"].as_str().unwrap()),
        added["key"].as_str().unwrap().to_owned(),
    )
}

/// Whether one connection to `url` as `creds` is accepted (and stays up for a round trip).
fn connects(url: &str, creds: &Credentials) -> bool {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let connecting = async_nats::ConnectOptions::with_nkey(creds.seed.clone())
            .connection_timeout(Duration::from_secs(2))
            .connect(url);
        let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(3), connecting).await else {
            return false;
        };
        // A connection the server closes in a reload reconnects forever: bounded.
        let ok = tokio::time::timeout(Duration::from_secs(2), client.flush())
            .await
            .is_ok_and(|r| r.is_ok());
        let _ = tokio::time::timeout(Duration::from_secs(1), client.drain()).await;
        ok
    })
}

#[test]
fn render_prints_exactly_the_block_engram_up_enforces() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let (mut child, ready) = up(h, lease.port());
    let nats = token(&ready, "nats=").to_owned();
    ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme"]));
    let (_, planner) = add_agent(h, &nats, "acme", "planner");
    let (_, coder) = add_agent(h, &nats, "acme", "coder");
    ok(cli(h).args([
        "--nats", &nats, "agent", "revoke", "--tenant", "acme", "--agent", "coder",
    ]));
    // engram up's own block, once it has folded the revocation.
    let managed = h.join("nats").join("auth.conf");
    wait_until(
        "engram up enforcing the registry",
        Duration::from_secs(15),
        || {
            let text = read(&managed);
            text.contains(&planner) && !text.contains(&coder)
        },
    );

    let printed = ok(cli(h).args(["--nats", &nats, "access", "render"]));
    assert_eq!(printed, read(&managed));

    // To a file: the same bytes, private, and nothing rewritten when nothing changed.
    let out = h.join("external").join("auth.conf");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let said = ok(cli(h)
        .args(["--nats", &nats, "access", "render", "--out"])
        .arg(&out));
    assert!(said.contains("written to"), "{said}");
    assert_eq!(read(&out), read(&managed));
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    let said = ok(cli(h)
        .args(["--nats", &nats, "--json", "access", "render", "--out"])
        .arg(&out));
    let said: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(said["changed"], false, "{said}");

    // A --then that fails or hangs: the file is written, the exit code says it was not
    // applied, and the message says what to do.
    for (then, said) in [
        ("echo no such pid >&2; exit 3", "run it by hand"),
        ("sleep 30", "raise --then-timeout"),
    ] {
        let started = Instant::now();
        let failed = cli(h)
            .args([
                "--nats",
                &nats,
                "access",
                "render",
                "--then-timeout",
                "300ms",
            ])
            .arg("--out")
            .arg(&out)
            .args(["--then", then])
            .output()
            .unwrap();
        assert!(!failed.status.success());
        let stderr = String::from_utf8_lossy(&failed.stderr);
        assert!(stderr.contains(said), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(20), "{then}");
    }
    assert_eq!(read(&out), read(&managed));

    // An unreachable registry: a non-zero exit that says so, and the good file untouched.
    let closed = engram_natsd::PortLease::acquire().unwrap();
    let good = read(&out);
    let failed = cli(h)
        .args([
            "--nats",
            &format!("nats://127.0.0.1:{}", closed.port()),
            "access",
            "render",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(!failed.status.success());
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(stderr.contains("cannot connect"), "{stderr}");
    assert_eq!(read(&out), good);

    // A home without the services' credentials would lock them out: refused, naming one.
    let bare = tempfile::tempdir().unwrap();
    let failed = cli(bare.path())
        .args(["--nats", &nats, "--creds"])
        .arg(h.join("auth").join("admin.creds"))
        .args(["access", "render"])
        .output()
        .unwrap();
    assert!(!failed.status.success());
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(stderr.contains("projectors service"), "{stderr}");

    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

#[test]
fn follow_keeps_a_server_engram_does_not_run_in_step_through_a_lost_connection() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let lease = engram_natsd::PortLease::acquire().unwrap();
    let (mut engram_up, ready) = up(h, lease.port());
    let nats = token(&ready, "nats=").to_owned();
    ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme"]));
    let admin = Credentials::load(&h.join("auth").join("admin.creds")).unwrap();

    // The external server includes the file the renderer keeps; a first render makes it.
    let external = tempfile::tempdir().unwrap();
    let conf_dir = external.path().join("conf");
    std::fs::create_dir_all(&conf_dir).unwrap();
    let auth_conf = conf_dir.join("auth.conf");
    ok(cli(h)
        .args(["--nats", &nats, "access", "render", "--out"])
        .arg(&auth_conf));
    let server_conf = conf_dir.join("nats.conf");
    std::fs::write(&server_conf, "include \"auth.conf\"\n").unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut opts = engram_natsd::ServerOptions::new(
        engram_natsd::locate().unwrap(),
        external.path().join("store"),
        external.path().join("run"),
    );
    opts.config_file = Some(server_conf);
    let mut server = runtime
        .block_on(engram_natsd::NatsServer::start(opts))
        .unwrap();
    let server_url = server.url();
    let server_pid = server.pid().unwrap();
    assert!(connects(&server_url, &admin), "the admin is refused");
    let stranger = Credentials::generate_agent(
        engram_schema::Ident::parse("tenant", "acme").unwrap(),
        engram_schema::Ident::parse("agent", "stranger").unwrap(),
    );
    assert!(
        !connects(&server_url, &stranger),
        "a key of no registry is admitted"
    );

    let log = external.path().join("render.log");
    let mut render = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_engram"))
            .args(["--nats", &nats, "access", "render", "--follow", "--out"])
            .arg(&auth_conf)
            .arg("--then")
            .arg(format!("kill -HUP {server_pid}"))
            .env("ENGRAM_HOME", h)
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_CREDS")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let logs = || read(&log);
    wait_until("the renderer following", Duration::from_secs(30), || {
        logs().contains("following the access registry")
    });

    // Every read of the file, all along, is a whole block that admits the admin.
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (path, watching, admin) = (auth_conf.clone(), watching.clone(), admin.public_key());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while watching.load(Ordering::Relaxed) {
                let text = std::fs::read_to_string(&path).expect("the file is always there");
                let keys = admitted(&text).unwrap_or_else(|e| panic!("a partial file: {e}"));
                assert!(keys.contains(&admin), "a block without the admin: {text}");
                reads += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            reads
        })
    };

    // An agent added against the cluster is admitted by the external server...
    let (planner_creds, planner) = add_agent(h, &nats, "acme", "planner");
    let planner_creds = Credentials::load(&planner_creds).unwrap();
    wait_until("the new key in the file", Duration::from_secs(15), || {
        read(&auth_conf).contains(&planner)
    });
    wait_until(
        "the external server admitting the new key",
        Duration::from_secs(15),
        || connects(&server_url, &planner_creds),
    );
    assert!(
        logs().contains("server authorization reloaded"),
        "{}",
        logs()
    );
    // ...and refused once revoked.
    ok(cli(h).args([
        "--nats", &nats, "agent", "revoke", "--tenant", "acme", "--agent", "planner",
    ]));
    wait_until(
        "the revoked key gone from the file",
        Duration::from_secs(15),
        || !read(&auth_conf).contains(&planner),
    );
    wait_until(
        "the external server refusing the revoked key",
        Duration::from_secs(15),
        || !connects(&server_url, &planner_creds),
    );

    // The registry's server goes away: the renderer keeps running and the file as it was.
    let before = read(&auth_conf);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(engram_up.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(engram_up.0.wait().unwrap().success());
    wait_until("the renderer noticing", Duration::from_secs(15), || {
        logs().contains("nats connection lost")
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        render.0.try_wait().unwrap().is_none(),
        "the renderer exited on a lost connection: {}",
        logs()
    );
    assert_eq!(read(&auth_conf), before);

    // Back on the same port and store: it reconnects and follows the next change.
    let (mut engram_up, _) = up(h, lease.port());
    let (coder_creds, coder) = add_agent(h, &nats, "acme", "coder");
    let coder_creds = Credentials::load(&coder_creds).unwrap();
    wait_until(
        "the key added after the reconnect in the file",
        Duration::from_secs(30),
        || read(&auth_conf).contains(&coder),
    );
    wait_until(
        "the external server admitting it",
        Duration::from_secs(15),
        || connects(&server_url, &coder_creds),
    );
    assert!(!read(&auth_conf).contains(&planner));

    watching.store(false, Ordering::Relaxed);
    let reads = watcher.join().expect("the file was always a whole block");
    assert!(reads > 100, "the file was read only {reads} times");

    // SIGTERM: the renderer stops cleanly.
    // SAFETY: kill(2) on our own children.
    unsafe { libc::kill(render.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(render.0.wait().unwrap().success(), "{}", logs());
    unsafe { libc::kill(engram_up.0.id() as libc::pid_t, libc::SIGTERM) };
    assert!(engram_up.0.wait().unwrap().success());
    runtime.block_on(server.shutdown(Duration::from_secs(5)));
}

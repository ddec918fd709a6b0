//! The MCP server as a harness uses it: a real `engram up` (managed nats-server, temp home,
//! random ports), an API key from `engram key add`, and an rmcp client over both transports:
//! `engram mcp` spawned as a child process (stdio), and `/mcp` on the HTTP address.
//!
//! Reads never sleep for a write to show: the server passes its last write's sequence as the
//! read-your-writes token (`min_seq`) of every read.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{KillOnDrop, Lines, cli, http_exchange, ok, token};
use rmcp::model::{CallToolRequestParams, ClientConfig};
use rmcp::service::RunningService;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Value, json};

const ENGRAM: &str = env!("CARGO_BIN_EXE_engram");

/// The tools every client must see.
const TOOLS: [&str; 10] = [
    "assert_fact",
    "build_context",
    "facts",
    "forget",
    "handoff_brief",
    "recall",
    "record_skill",
    "remember",
    "skills",
    "task_board",
];

/// A running `engram up` with one tenant and one agent API key.
struct Up {
    child: KillOnDrop,
    home: tempfile::TempDir,
    nats: String,
    http: String,
    key: String,
    _lease: engram_natsd::PortLease,
}

/// An MCP `initialize` POST to `/mcp` with `headers` (each `Name: value`).
fn mcp_post(addr: &str, host: &str, headers: &[&str]) -> (u16, String) {
    let body = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "raw", "version": "0"}},
    })
    .to_string();
    let mut head = "POST /mcp HTTP/1.1\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream".to_owned();
    for h in headers {
        head.push_str("\r\n");
        head.push_str(h);
    }
    http_exchange(addr, host, &head, &body)
}

impl Up {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// With `env` (`ENGRAM_*` settings) on top.
    fn start_with(env: &[(&str, &str)]) -> Self {
        let home = tempfile::tempdir().unwrap();
        let lease = engram_natsd::PortLease::acquire().unwrap();
        let mut child = KillOnDrop(
            Command::new(ENGRAM)
                .args([
                    "up",
                    "--nats-port",
                    &lease.port().to_string(),
                    "--http",
                    "127.0.0.1:0",
                ])
                .env("ENGRAM_HOME", home.path())
                .env_remove("ENGRAM_CONFIG")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
        let mut stdout = Lines::of(child.0.stdout.take().unwrap());
        let ready = stdout
            .until("engram is up", Duration::from_secs(180))
            .unwrap_or_else(|e| panic!("engram up: {e}"));
        let nats = token(&ready, "nats=").to_owned();
        let http = token(&ready, "http=http://").to_owned();
        let h = home.path();
        ok(cli(h).args(["--nats", &nats, "tenant", "add", "acme"]));
        let issued: Value = serde_json::from_str(&ok(cli(h).args([
            "--nats", &nats, "--json", "key", "add", "--tenant", "acme", "--agent", "coder",
        ])))
        .unwrap();
        let key = issued["api_key"].as_str().unwrap().to_owned();
        let up = Self {
            child,
            home,
            nats,
            http,
            key,
            _lease: lease,
        };
        up.wait_for_key();
        up
    }

    /// The server takes a new key with its next config reload, moments after it is issued:
    /// until then `/mcp` answers 401.
    fn wait_for_key(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let auth = format!("Authorization: Bearer {}", self.key);
        loop {
            let (status, body) = mcp_post(&self.http, &self.http, &[&auth]);
            if status == 200 {
                return;
            }
            assert_eq!(status, 401, "{body}");
            assert!(Instant::now() < deadline, "the key never worked: {body}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stop(mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.0.id() as libc::pid_t, libc::SIGTERM) };
        assert!(self.child.0.wait().unwrap().success());
    }

    async fn stdio_client(&self, scope: &str) -> RunningService<RoleClient, ClientConfig> {
        let command = tokio::process::Command::new(ENGRAM).configure(|c| {
            c.args([
                "--nats", &self.nats, "mcp", "--key", &self.key, "--scope", scope,
            ])
            .env("ENGRAM_HOME", self.home.path())
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_CREDS")
            .env_remove("ENGRAM_API_KEY");
        });
        let transport = TokioChildProcess::new(command).unwrap();
        ClientConfig::default().serve(transport).await.unwrap()
    }

    async fn http_client(&self, scope: &str) -> RunningService<RoleClient, ClientConfig> {
        let headers = HashMap::from([("engram-scope".parse().unwrap(), scope.parse().unwrap())]);
        let config =
            StreamableHttpClientTransportConfig::with_uri(format!("http://{}/mcp", self.http))
                .auth_header(self.key.clone())
                .custom_headers(headers);
        let transport = StreamableHttpClientTransport::from_config(config);
        ClientConfig::default().serve(transport).await.unwrap()
    }
}

/// Calls `tool`: its structured result, or the tool error's text.
async fn call(
    client: &RunningService<RoleClient, ClientConfig>,
    tool: &'static str,
    args: Value,
) -> Result<Value, String> {
    let params = CallToolRequestParams::new(tool)
        .with_arguments(args.as_object().expect("arguments are an object").clone());
    let result = client
        .call_tool(params)
        .await
        .unwrap_or_else(|e| panic!("{tool}: the call itself failed: {e}"));
    let text = result
        .content
        .first()
        .and_then(|c| c.as_text())
        .map(|t| t.text.clone())
        .unwrap_or_default();
    if result.is_error == Some(true) {
        return Err(text);
    }
    Ok(result
        .structured_content
        .unwrap_or_else(|| serde_json::from_str(&text).expect("a JSON result")))
}

async fn ok_call(
    client: &RunningService<RoleClient, ClientConfig>,
    tool: &'static str,
    args: Value,
) -> Value {
    call(client, tool, args)
        .await
        .unwrap_or_else(|e| panic!("{tool} failed: {e}"))
}

/// Lists the tools and calls each one, checking what it did through the others.
async fn every_tool_works(client: &RunningService<RoleClient, ClientConfig>, label: &str) {
    let tools = client.list_all_tools().await.unwrap();
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort();
    assert_eq!(names, TOOLS, "{label}");
    for tool in &tools {
        let description = tool.description.as_deref().unwrap_or_default();
        assert!(
            description.len() > 80,
            "{label}: {} is undescribed",
            tool.name
        );
        assert_eq!(
            tool.input_schema.get("type"),
            Some(&json!("object")),
            "{label}"
        );
        let properties = tool
            .input_schema
            .get("properties")
            .and_then(Value::as_object);
        for identity in ["tenant", "agent", "agent_id", "scope", "grants"] {
            assert!(
                !properties.is_some_and(|p| p.contains_key(identity)),
                "{label}: {} takes {identity}",
                tool.name
            );
        }
    }

    // remember, then recall it, and find it in the context of a step.
    let marker = format!("{label}-zebra");
    let stored = ok_call(
        client,
        "remember",
        json!({"text": format!("the checkout page times out because the payments API is slow ({marker})"),
               "kind": "observation", "importance": 0.8, "tags": ["checkout"]}),
    )
    .await;
    let event_id = stored["event_id"].as_str().unwrap().to_owned();
    assert!(stored["seq"].as_u64().unwrap() > 0, "{stored}");
    let recalled = ok_call(
        client,
        "recall",
        json!({"query": "why does the checkout page time out", "limit": 5}),
    )
    .await;
    let memories = recalled["memories"].as_array().unwrap();
    let found = memories
        .iter()
        .find(|m| m["event_id"] == event_id)
        .unwrap_or_else(|| panic!("{label}: the memory is not recalled: {recalled}"));
    assert!(found["text"].as_str().unwrap().contains(&marker), "{found}");
    assert!(found["when"].as_str().is_some() && found["score"].as_f64().is_some());
    let context = ok_call(
        client,
        "build_context",
        json!({"task": "speed up the checkout page", "token_budget": 512}),
    )
    .await;
    assert!(
        context["context"].as_str().unwrap().contains(&marker),
        "{label}: {context}"
    );

    // A fact asserted shows in facts.
    ok_call(
        client,
        "assert_fact",
        json!({"subject": "checkout", "predicate": "depends_on", "object": "payments-api",
               "confidence": 0.9}),
    )
    .await;
    let facts = ok_call(client, "facts", json!({"subject": "checkout"})).await;
    let fact = &facts["facts"][0];
    assert_eq!(fact["predicate"], "depends_on", "{label}: {facts}");
    assert_eq!(fact["object"], "payments-api", "{label}: {facts}");

    // A skill recorded shows in skills, by name and by task.
    ok_call(
        client,
        "record_skill",
        json!({"name": "restart-payments", "description": "restart the payments service when checkout times out",
               "steps": ["drain the payments pods", "roll them one by one"]}),
    )
    .await;
    let by_name = ok_call(client, "skills", json!({"name": "restart-payments"})).await;
    assert_eq!(
        by_name["skills"][0]["steps"][1], "roll them one by one",
        "{by_name}"
    );
    let by_task = ok_call(
        client,
        "skills",
        json!({"task": "checkout times out, restart payments"}),
    )
    .await;
    assert_eq!(
        by_task["skills"][0]["name"], "restart-payments",
        "{by_task}"
    );

    // The task board: add, read back, change, remove.
    let board = ok_call(
        client,
        "task_board",
        json!({"upsert": [{"id": "t1", "title": "fix checkout", "status": "doing",
                           "owner": "coder", "note": "started on the payments client"},
                          {"id": "t2", "title": "write the postmortem"}]}),
    )
    .await;
    assert!(board["seq"].as_u64().is_some(), "{board}");
    let read = ok_call(client, "task_board", json!({})).await;
    assert_eq!(read["tasks"][0]["id"], "t1", "{label}: {read}");
    assert_eq!(read["tasks"][0]["status"], "doing", "{read}");
    assert_eq!(
        read["tasks"][0]["notes"][0],
        "started on the payments client"
    );
    assert_eq!(read["tasks"][1]["status"], "todo", "{read}");
    let changed = ok_call(
        client,
        "task_board",
        json!({"upsert": [{"id": "t1", "status": "done", "note": "fixed"}], "remove": ["t2", "nope"]}),
    )
    .await;
    assert_eq!(changed["not_found"], json!(["nope"]), "{changed}");
    let read = ok_call(client, "task_board", json!({"board": "main"})).await;
    let tasks = read["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 1, "{read}");
    assert_eq!(tasks[0]["status"], "done");
    assert_eq!(
        tasks[0]["notes"],
        json!(["started on the payments client", "fixed"])
    );

    // The model cannot pick its tenant or scope, nor pass what the schema does not list.
    for args in [
        json!({"text": "elsewhere", "scope": "agent:someone-else"}),
        json!({"text": "elsewhere", "tenant": "other"}),
    ] {
        let refused = call(client, "remember", args).await.unwrap_err();
        assert!(refused.contains("not an argument"), "{label}: {refused}");
    }
    let refused = call(client, "recall", json!({"query": "x", "limit": 1000}))
        .await
        .unwrap_err();
    assert!(refused.contains("1 to 100"), "{refused}");
    let refused = call(client, "recall", json!({"query": "x", "colour": "red"}))
        .await
        .unwrap_err();
    assert!(refused.contains("unknown argument `colour`"), "{refused}");

    // Forgotten, it is recalled no more.
    let forgot = ok_call(
        client,
        "forget",
        json!({"event_ids": [event_id], "reason": "the payments API was fixed"}),
    )
    .await;
    assert_eq!(forgot["requested"], 1);
    let recalled = ok_call(
        client,
        "recall",
        json!({"query": "why does the checkout page time out"}),
    )
    .await;
    assert!(
        !recalled.to_string().contains(&event_id),
        "{label}: forgotten but recalled: {recalled}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tool_works_over_stdio_and_streamable_http() {
    let up = Up::start();
    let stdio = up.stdio_client("task:over-stdio").await;
    let info = stdio.peer_info().expect("initialized");
    assert_eq!(
        info.server_info.as_ref().map(|i| i.name.as_str()),
        Some("engram")
    );
    every_tool_works(&stdio, "stdio").await;
    stdio.cancel().await.unwrap();

    let http = up.http_client("task:over-http").await;
    every_tool_works(&http, "http").await;
    // What one transport wrote is in the other's scope only when that scope is read.
    let recalled = ok_call(&http, "recall", json!({"query": "stdio-zebra checkout"})).await;
    assert!(
        !recalled.to_string().contains("stdio-zebra"),
        "another scope leaked: {recalled}"
    );
    http.cancel().await.unwrap();
    up.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_over_http_refuses_missing_and_bad_keys_foreign_hosts_and_bad_scopes() {
    let up = Up::start();
    let addr = up.http.clone();
    let auth = format!("Authorization: Bearer {}", up.key);

    let (status, body) = mcp_post(&addr, &addr, &[]);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("Authorization: Bearer"), "{body}");
    let (status, body) = mcp_post(&addr, &addr, &["Authorization: Bearer not-a-key"]);
    assert_eq!(status, 401, "{body}");
    // Well formed, never issued: the NATS server refuses it.
    let forged = engram_access::Credentials::generate_agent(
        engram_schema::Ident::parse("tenant", "acme").unwrap(),
        engram_schema::Ident::parse("agent", "coder").unwrap(),
    )
    .api_key()
    .unwrap();
    let (status, body) = mcp_post(&addr, &addr, &[&format!("Authorization: Bearer {forged}")]);
    assert_eq!(status, 401, "{body}");

    // A DNS-rebinding page reaches this address under its own name: refused.
    let (status, body) = mcp_post(&addr, "evil.example:7077", &[&auth]);
    assert_eq!(status, 403, "{body}");
    let port = addr.rsplit(':').next().unwrap();
    let (status, body) = mcp_post(&addr, &format!("localhost:{port}"), &[&auth]);
    assert_eq!(status, 200, "{body}");

    let (status, body) = mcp_post(&addr, &addr, &[&auth, "Engram-Scope: nonsense"]);
    assert_eq!(status, 400, "{body}");
    // A read scope must be wider than the own one.
    let (status, body) = mcp_post(
        &addr,
        &addr,
        &[&auth, "Engram-Scope: team:core", "Engram-Read: task:t1"],
    );
    assert_eq!(status, 400, "{body}");

    // A scope the key may not write: the server refuses the append, the model is told why.
    let client = up.http_client("team:core").await;
    let refused = call(
        &client,
        "remember",
        json!({"text": "the team's secret plan"}),
    )
    .await
    .unwrap_err();
    assert!(
        refused.contains("may not write to scope team:core"),
        "{refused}"
    );
    client.cancel().await.unwrap();
    up.stop();
}

/// One raw request (`Connection: close`) and the whole response, head and body.
fn raw(addr: &str, head: &str, body: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "{head}\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
}

/// The value of header `name` in a raw response.
fn header_of<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    let head = response.split_once("\r\n\r\n")?.0;
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engram_up_cuts_off_slow_clients_binds_sessions_to_keys_and_checks_origins() {
    let up = Up::start_with(&[
        ("ENGRAM_HTTP__HEADER_READ_TIMEOUT", "1s"),
        ("ENGRAM_MCP__MAX_SESSIONS_PER_KEY", "64"),
    ]);
    let addr = up.http.clone();
    let port = addr.rsplit(':').next().unwrap().to_owned();
    let auth = format!("Authorization: Bearer {}", up.key);

    // Headers that never end: `[http] header_read_timeout` closes the connection.
    let mut loris = std::net::TcpStream::connect(&addr).unwrap();
    loris
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    write!(loris, "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nX-Slow: a").unwrap();
    let started = Instant::now();
    let mut rest = Vec::new();
    let closed = loris.read_to_end(&mut rest).is_ok();
    assert!(
        closed && started.elapsed() < Duration::from_secs(15),
        "a slow-loris connection was kept open for {:?}",
        started.elapsed()
    );

    // A page of another site: 403 with a JSON error, before the key is looked at; this
    // server's own loopback origin is accepted.
    let (status, body) = mcp_post(&addr, &addr, &[&auth, "Origin: https://evil.example"]);
    assert_eq!(status, 403, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "forbidden", "{body}");
    let origin = format!("Origin: http://localhost:{port}");
    let (status, body) = mcp_post(&addr, &addr, &[&auth, &origin]);
    assert_eq!(status, 200, "{body}");

    // A session of this key is not another key's to use or to close.
    let initialize = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "raw", "version": "0"}},
    })
    .to_string();
    let mcp_head = "POST /mcp HTTP/1.1\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream";
    let opened = raw(&addr, &format!("{mcp_head}\r\n{auth}"), &initialize);
    let session = header_of(&opened, "mcp-session-id")
        .unwrap_or_else(|| panic!("no session: {opened}"))
        .to_owned();
    let h = up.home.path();
    let other: Value = serde_json::from_str(&ok(cli(h).args([
        "--nats", &up.nats, "--json", "key", "add", "--tenant", "acme", "--agent", "other",
    ])))
    .unwrap();
    let other_auth = format!(
        "Authorization: Bearer {}",
        other["api_key"].as_str().unwrap()
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while mcp_post(&addr, &addr, &[&other_auth]).0 != 200 {
        assert!(Instant::now() < deadline, "the second key never worked");
        std::thread::sleep(Duration::from_millis(50));
    }
    let closing = raw(
        &addr,
        &format!("DELETE /mcp HTTP/1.1\r\n{other_auth}\r\nMcp-Session-Id: {session}"),
        "",
    );
    assert!(closing.starts_with("HTTP/1.1 404"), "{closing}");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"}).to_string();
    let still = raw(
        &addr,
        &format!("{mcp_head}\r\n{auth}\r\nMcp-Session-Id: {session}"),
        &initialized,
    );
    assert!(
        still.starts_with("HTTP/1.1 202"),
        "the session was closed by another key: {still}"
    );
    up.stop();
}

#[test]
fn engram_mcp_without_a_key_says_how_to_get_one_and_never_runs_as_the_admin() {
    let home = tempfile::tempdir().unwrap();
    let out = cli(home.path()).arg("mcp").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("engram key add"), "{stderr}");
    assert!(out.stdout.is_empty(), "stdout is the protocol's");

    let admin = engram_access::Credentials::generate(engram_access::RoleName::Admin);
    let path = home.path().join("admin.creds");
    admin.save(&path).unwrap();
    let out = cli(home.path())
        .args(["--creds", path.to_str().unwrap(), "mcp"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not an agent's"), "{stderr}");
}

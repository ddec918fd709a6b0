//! What one HTTP client may hold of the gateway, and who a key is: connections that send
//! their headers or body slowly (or nothing) are cut off, connections beyond the limit are
//! refused, a body is never read for a key that is refused, a key whose tokens were edited is
//! refused and writes nothing, and an MCP session belongs to the key that opened it.
//!
//! The server is the one `engram up` and `engram gateway` run ([`engram_gateway::serve`]),
//! against a real nats-server with authentication; the timeouts are short here, and every
//! wait is bounded well above them.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use engram_gateway::{GatewayConfig, ServeLimits};
use engram_testkit::{SecureNats, TestNats};
use engram_tests::Engram;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Far above the 1 s timeouts the tests configure, so a slow machine does not fail them,
/// and far below "never".
const CUT_OFF_WITHIN: Duration = Duration::from_secs(10);

fn short_limits() -> ServeLimits {
    ServeLimits {
        header_read_timeout: Duration::from_secs(1),
        body_read_timeout: Duration::from_secs(1),
        max_connections: 64,
    }
}

/// The HTTP API and `/mcp` served within `limits`; stops when the token is dropped.
struct Served {
    addr: SocketAddr,
    _stop: tokio_util::sync::DropGuard,
}

impl Served {
    async fn start(nats: &SecureNats, limits: ServeLimits, mcp: engram_mcp::McpConfig) -> Self {
        let stop = CancellationToken::new();
        let addr = engram_tests::serve_http_with(
            nats,
            GatewayConfig::default(),
            limits,
            Some(mcp),
            stop.clone(),
        )
        .await;
        Self {
            addr,
            _stop: stop.drop_guard(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Reads until the server closes the connection (or resets it), up to `within`; what it
/// sent before, or `None` if it was still open then.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// The status of the first response in `text`.
fn status_of(text: &str) -> Option<u16> {
    text.split_whitespace().nth(1)?.parse().ok()
}

/// One complete request on an open connection, kept alive; the response's status.
async fn exchange(stream: &mut TcpStream, addr: SocketAddr) -> u16 {
    stream
        .write_all(format!("GET /openapi.json HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    // The document is JSON: its response ends with the body's closing brace.
    loop {
        let n = tokio::time::timeout(CUT_OFF_WITHIN, stream.read(&mut buf))
            .await
            .expect("a response in time")
            .unwrap();
        assert!(n > 0, "closed before the response ended");
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().unwrap())
                })
                .expect("a content-length");
            if body.len() >= length {
                return status_of(&text).unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_headers_an_endless_body_and_silence_are_cut_off_within_the_timeouts() {
    let (nats, _engram, key) = engram_tests::secured_with_key("acme", "planner").await;
    let served = Served::start(&nats, short_limits(), engram_mcp::McpConfig::default()).await;
    let addr = served.addr;

    // Headers a line at a time, never finished: closed, though bytes keep coming.
    let mut loris = TcpStream::connect(addr).await.unwrap();
    loris
        .write_all(format!("POST /v1/retrieve HTTP/1.1\r\nHost: {addr}\r\n").as_bytes())
        .await
        .unwrap();
    let started = Instant::now();
    let mut cut = false;
    while started.elapsed() < CUT_OFF_WITHIN {
        if loris.write_all(b"X-Slow: a\r\n").await.is_err() {
            cut = true;
            break;
        }
        if closed_within(&mut loris, Duration::from_millis(200))
            .await
            .is_some()
        {
            cut = true;
            break;
        }
    }
    assert!(
        cut,
        "a slow-loris connection was still open after {CUT_OFF_WITHIN:?}"
    );

    // A connection that says nothing: closed.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    assert!(
        closed_within(&mut silent, CUT_OFF_WITHIN).await.is_some(),
        "a silent connection was still open after {CUT_OFF_WITHIN:?}"
    );

    // A valid key and a body that never ends: 408, and the connection is closed, though
    // a byte keeps coming every 100 ms.
    let mut endless = TcpStream::connect(addr).await.unwrap();
    endless
        .write_all(
            format!(
                "POST /v1/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 900000\r\n\r\n["
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let started = Instant::now();
    let mut answer = None;
    while started.elapsed() < CUT_OFF_WITHIN * 2 {
        if endless.write_all(b" ").await.is_err() {
            answer = closed_within(&mut endless, Duration::from_secs(1)).await;
            break;
        }
        if let Some(text) = closed_within(&mut endless, Duration::from_millis(100)).await {
            answer = Some(text);
            break;
        }
    }
    let answer = answer.expect("an endless body was still being read");
    // The key's first connection is verified before the body is read (which starts its
    // clock), so the bound here is the verification's plus the timeout's.
    assert!(started.elapsed() < CUT_OFF_WITHIN * 2);
    assert_eq!(status_of(&answer), Some(408), "{answer}");
    assert!(answer.contains("http.body_read_timeout"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_beyond_the_limit_are_refused_while_the_limit_holds() {
    let nats = TestNats::start_secured().await;
    let limits = ServeLimits {
        // Long enough that the held connections stay open through the test.
        header_read_timeout: Duration::from_secs(60),
        max_connections: 3,
        ..short_limits()
    };
    let served = Served::start(&nats, limits, engram_mcp::McpConfig::default()).await;
    let addr = served.addr;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = TcpStream::connect(addr).await.unwrap();
        assert_eq!(exchange(&mut c, addr).await, 200);
        held.push(c);
    }
    // One more: accepted by the kernel, closed by the server at once, never answered.
    for _ in 0..3 {
        let mut extra = TcpStream::connect(addr).await.unwrap();
        let _ = extra
            .write_all(format!("GET /openapi.json HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await;
        let answer = closed_within(&mut extra, CUT_OFF_WITHIN)
            .await
            .expect("a connection beyond the limit was kept open");
        assert!(answer.is_empty(), "answered beyond the limit: {answer}");
    }
    // The held ones still work.
    for c in &mut held {
        assert_eq!(exchange(c, addr).await, 200);
    }
    // One closed, a slot is free again (once the server has seen it go).
    drop(held.pop());
    let deadline = Instant::now() + CUT_OFF_WITHIN;
    loop {
        let mut c = TcpStream::connect(addr).await.unwrap();
        let _ = c
            .write_all(format!("GET /openapi.json HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await;
        let mut first = [0u8; 12];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), c.read(&mut first)).await
            && n > 0
        {
            assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no slot freed after a connection closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_key_is_answered_401_before_its_body_is_read() {
    let nats = TestNats::start_secured().await;
    let _engram = Engram::start_secured(&nats).await;
    nats.add_tenant("acme").await;
    let limits = ServeLimits {
        body_read_timeout: Duration::from_secs(120),
        ..short_limits()
    };
    let served = Served::start(&nats, limits, engram_mcp::McpConfig::default()).await;
    let addr = served.addr;
    let never_issued = engram_access::Credentials::generate_agent(
        engram_schema::Ident::parse("tenant", "acme").unwrap(),
        engram_schema::Ident::parse("agent", "planner").unwrap(),
    )
    .api_key()
    .unwrap();
    for (path, auth) in [
        (
            "/v1/events",
            format!("Authorization: Bearer {never_issued}\r\n"),
        ),
        (
            "/v1/retrieve",
            "Authorization: Bearer not-a-key\r\n".to_owned(),
        ),
        ("/v1/docs/edit", String::new()),
        ("/mcp", format!("Authorization: Bearer {never_issued}\r\n")),
    ] {
        let mut c = TcpStream::connect(addr).await.unwrap();
        // The head of a large body, and none of the body: the answer must not wait for it.
        c.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: 900000\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let answer = closed_within(&mut c, CUT_OFF_WITHIN)
            .await
            .unwrap_or_else(|| panic!("{path}: no answer without the body"));
        assert_eq!(status_of(&answer), Some(401), "{path}: {answer}");
        assert!(answer.contains("\"unauthenticated\""), "{path}: {answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_with_edited_tokens_is_refused_like_an_unknown_key_and_appends_nothing() {
    let nats = TestNats::start_secured().await;
    let _engram = Engram::start_secured(&nats).await;
    nats.add_tenant("acme").await;
    nats.add_tenant("acme2").await;
    let planner = nats.add_agent("acme", "planner", &[]).await;
    nats.add_agent("acme", "coder", &[]).await;
    nats.add_agent("acme2", "planner", &[]).await;
    let key = planner.api_key().unwrap();
    let seed = key.rsplit('.').next().unwrap();
    let edited = [
        format!("egk.acme.coder.{seed}"),
        format!("egk.acme.ghost.{seed}"),
        format!("egk.acme2.planner.{seed}"),
    ];
    let event = |text: &str| {
        json!({
            "scope": {"kind": "task", "id": "t1"},
            "layer": "episodic",
            "kind": "observation",
            "content": {"text": text},
        })
    };
    let http = reqwest::Client::new();
    let append = |served: &Served, key: &str, text: &str| {
        http.post(served.url("/v1/events"))
            .bearer_auth(key)
            .json(&event(text))
            .send()
    };
    let stream_len = || async { nats.admin.stream_last_seq().await.unwrap() };

    // A gateway that never saw the real key: each edited key is verified, and refused.
    let fresh = Served::start(&nats, short_limits(), engram_mcp::McpConfig::default()).await;
    let before = stream_len().await;
    for forged in &edited {
        let started = Instant::now();
        let response = append(&fresh, forged, "written as someone else")
            .await
            .unwrap();
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 401, "{forged}: {body}");
        assert_eq!(body["error"]["code"], "unauthenticated", "{body}");
        assert!(
            started.elapsed() < engram_gateway::VERIFY_TIMEOUT + CUT_OFF_WITHIN,
            "the refusal took {:?}",
            started.elapsed()
        );
    }
    // The real key still works on the same gateway.
    let response = append(&fresh, &key, "written as planner").await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let written = stream_len().await;
    assert_eq!(written, before + 1, "only the real key's event is stored");

    // A gateway holding the real key's connection: an edited key is refused at once, and
    // is never served that connection.
    for forged in &edited {
        let response = append(&fresh, forged, "written as someone else")
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 401, "{forged}");
        let response = http
            .get(fresh.url("/v1/whoami"))
            .bearer_auth(forged)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 401, "{forged}");
    }
    // What was refused is not stored later either.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stream_len().await, written, "an edited key appended");
    let me: Value = http
        .get(fresh.url("/v1/whoami"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (me["tenant"].as_str(), me["agent"].as_str()),
        (Some("acme"), Some("planner"))
    );
    assert_eq!(me["public_keys"], json!([planner.public_key()]), "{me}");
}

/// An MCP request to `/mcp` with the key, and optionally a session and an Origin.
async fn mcp(
    served: &Served,
    method: reqwest::Method,
    key: &str,
    session: Option<&str>,
    origin: Option<&str>,
    body: Option<Value>,
) -> (u16, Option<String>, String) {
    let mut request = reqwest::Client::new()
        .request(method, served.url("/mcp"))
        .bearer_auth(key)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18");
    if let Some(session) = session {
        request = request.header("mcp-session-id", session);
    }
    if let Some(origin) = origin {
        request = request.header("origin", origin);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let session = response
        .headers()
        .get("mcp-session-id")
        .map(|v| v.to_str().unwrap().to_owned());
    // An SSE answer may stay open after its message: read what comes within a moment.
    let mut text = String::new();
    let mut response = response;
    while let Ok(Ok(Some(chunk))) =
        tokio::time::timeout(Duration::from_secs(2), response.chunk()).await
    {
        text.push_str(&String::from_utf8_lossy(&chunk));
        if text.contains("\"result\"") || text.contains("\"error\"") {
            break;
        }
    }
    (status, session, text)
}

fn initialize() -> Value {
    json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
           "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                      "clientInfo": {"name": "raw", "version": "0"}}})
}

/// A session of `key`, initialized and ready for requests.
async fn open_session(served: &Served, key: &str) -> String {
    let (status, session, text) = mcp(
        served,
        reqwest::Method::POST,
        key,
        None,
        None,
        Some(initialize()),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let session = session.expect("a session id");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let (status, _, text) = mcp(
        served,
        reqwest::Method::POST,
        key,
        Some(&session),
        None,
        Some(initialized),
    )
    .await;
    assert_eq!(status, 202, "{text}");
    session
}

fn list_tools() -> Value {
    json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_mcp_session_belongs_to_its_key_sessions_are_bounded_and_origins_checked() {
    let nats = TestNats::start_secured().await;
    let _engram = Engram::start_secured(&nats).await;
    nats.add_tenant("acme").await;
    nats.add_tenant("acme2").await;
    let a = nats
        .add_agent("acme", "coder", &[])
        .await
        .api_key()
        .unwrap();
    let b = nats
        .add_agent("acme2", "coder", &[])
        .await
        .api_key()
        .unwrap();
    let config = engram_mcp::McpConfig {
        max_sessions_per_key: 2,
        max_sessions: 3,
        ..engram_mcp::McpConfig::default()
    };
    let served = Served::start(&nats, short_limits(), config).await;
    use reqwest::Method;

    // A's session: B can neither use it, nor read its stream, nor close it; to B it is
    // exactly an unknown session.
    let session = open_session(&served, &a).await;
    let (status, _, text) = mcp(
        &served,
        Method::POST,
        &a,
        Some(&session),
        None,
        Some(list_tools()),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("remember"), "{text}");
    let (_, _, unknown) = mcp(
        &served,
        Method::POST,
        &b,
        Some("no-such-session"),
        None,
        Some(list_tools()),
    )
    .await;
    for method in [Method::POST, Method::GET, Method::DELETE] {
        let body = (method == Method::POST).then(list_tools);
        let (status, _, text) = mcp(&served, method.clone(), &b, Some(&session), None, body).await;
        assert_eq!(status, 404, "{method}: {text}");
        assert_eq!(
            text, unknown,
            "{method}: a foreign session differs from an unknown one"
        );
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "not_found");
    }
    let (status, _, text) = mcp(
        &served,
        Method::POST,
        &a,
        Some(&session),
        None,
        Some(list_tools()),
    )
    .await;
    assert_eq!(status, 200, "B's DELETE closed A's session: {text}");
    assert!(text.contains("remember"), "{text}");

    // Two sessions per key: a third is refused, naming the setting; B still opens one.
    let second = open_session(&served, &a).await;
    let (status, session3, text) =
        mcp(&served, Method::POST, &a, None, None, Some(initialize())).await;
    assert_eq!(status, 429, "{text}");
    assert!(session3.is_none());
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "rate_limited");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("mcp.max_sessions_per_key"),
        "{error}"
    );
    let b_session = open_session(&served, &b).await;
    // Three in all: B's second is refused by the total.
    let (status, _, text) = mcp(&served, Method::POST, &b, None, None, Some(initialize())).await;
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("mcp.max_sessions"), "{text}");
    // A closes one of its own; then it may open another.
    let (status, _, text) = mcp(&served, Method::DELETE, &a, Some(&second), None, None).await;
    assert!((200..300).contains(&status), "{status}: {text}");
    let (status, _, text) = mcp(
        &served,
        Method::POST,
        &a,
        Some(&second),
        None,
        Some(list_tools()),
    )
    .await;
    assert_eq!(status, 404, "a closed session still answers: {text}");
    open_session(&served, &a).await;
    let (status, _, text) = mcp(
        &served,
        Method::POST,
        &b,
        Some(&b_session),
        None,
        Some(list_tools()),
    )
    .await;
    assert_eq!(status, 200, "{text}");

    // A page of another site is refused before anything else; this server's own loopback
    // origin is not. (A's sessions are full: the loopback origin's answer is the bound's.)
    let port = served.addr.port();
    for evil in ["https://evil.example", "http://localhost:1", "null"] {
        let (status, _, text) = mcp(
            &served,
            Method::POST,
            &b,
            None,
            Some(evil),
            Some(initialize()),
        )
        .await;
        assert_eq!(status, 403, "{evil}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "forbidden", "{error}");
        assert!(text.contains("mcp.allowed_origins"), "{text}");
    }
    for local in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
    ] {
        let (status, _, text) = mcp(
            &served,
            Method::POST,
            &b,
            Some(&b_session),
            Some(&local),
            Some(list_tools()),
        )
        .await;
        assert_eq!(status, 200, "{local}: {text}");
    }
}

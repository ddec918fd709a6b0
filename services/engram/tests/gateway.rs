//! `engram gateway` as the deployments run it: its own process, holding no credentials,
//! against a NATS server that authenticates every connection. Its `/healthz` and `/metrics`
//! answer without a key and read no body; its API still wants a key.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{KillOnDrop, Lines, token};
use engram_testkit::{TestNats, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one exchange may take: the gateway's own NATS check gives up after 2 s.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends `head` (the request line and any headers but `Host` and `Connection`) and nothing
/// after it; the status and the body (as long as its `Content-Length` says), read without
/// waiting for the connection to close, so that a body announced and never sent cannot
/// hold the answer back unseen.
async fn exchange(addr: &str, head: &str) -> (u16, String) {
    let exchanged = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("{head}\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            let n = stream.read(&mut chunk).await.unwrap();
            response.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&response);
            if let Some((headers, body)) = text.split_once("\r\n\r\n") {
                let length = headers
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse::<usize>().ok())?
                    })
                    .expect("a content-length");
                if body.len() >= length || n == 0 {
                    let status = headers
                        .split_whitespace()
                        .nth(1)
                        .and_then(|s| s.parse().ok())
                        .expect("status line");
                    return (status, body.to_owned());
                }
            }
            assert!(n > 0, "the connection closed mid-response: {text}");
        }
    };
    tokio::time::timeout(EXCHANGE_TIMEOUT, exchanged)
        .await
        .unwrap_or_else(|_| panic!("{head}: no whole answer within {EXCHANGE_TIMEOUT:?}"))
}

async fn get(addr: &str, path: &str) -> (u16, String) {
    exchange(addr, &format!("GET {path} HTTP/1.1")).await
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The value of the sample `series` (name and labels, as exposed) in a text exposition.
fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_gateway_serves_health_and_metrics_without_a_key_and_says_when_nats_is_gone() {
    // Given `engram gateway` with no credentials of its own, against a server that refuses
    // every connection without a key
    let mut nats = TestNats::start_secured().await;
    let home = tempfile::tempdir().unwrap();
    let mut child = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_engram"))
            .args(["gateway", "--listen", "127.0.0.1:0", "--nats", &nats.url()])
            .env("ENGRAM_HOME", home.path())
            .env_remove("ENGRAM_CONFIG")
            .env_remove("ENGRAM_CREDS")
            .env_remove("ENGRAM_NATS__URL")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let ready = Lines::of(child.0.stdout.take().unwrap())
        .until("engram gateway is up", Duration::from_secs(60))
        .unwrap();
    let http = token(&ready, "http=http://").to_owned();

    // Then /metrics answers without a key, with the gateway's series from the start
    let (status, exposition) = get(&http, "/metrics").await;
    assert_eq!(status, 200, "{exposition}");
    assert!(
        exposition.contains("# TYPE engram_gateway_errors_total counter"),
        "{exposition}"
    );
    let unauthenticated = r#"engram_gateway_errors_total{code="unauthenticated"}"#;
    assert_eq!(
        sample(&exposition, unauthenticated),
        Some(0.0),
        "{exposition}"
    );

    // And /healthz answers 200 without a key, saying where NATS is
    let (status, body) = get(&http, "/healthz").await;
    assert_eq!(status, 200, "{body}");
    let health = json(&body);
    assert_eq!(health["status"], "ok", "{body}");
    assert_eq!(health["nats"]["reachable"], true, "{body}");
    assert_eq!(health["nats"]["url"], nats.url(), "{body}");

    // And it reads no body: one announced and never sent does not hold the answer back
    // (http.body_read_timeout, 30 s, would)
    let (status, body) = exchange(
        &http,
        "GET /healthz HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 1000000",
    )
    .await;
    assert_eq!(status, 200, "{body}");

    // But the API still wants a key
    let (status, body) = get(&http, "/v1/whoami").await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(json(&body)["error"]["code"], "unauthenticated", "{body}");
    let (status, body) = exchange(&http, "POST /v1/retrieve HTTP/1.1\r\nContent-Length: 0").await;
    assert_eq!(status, 401, "{body}");

    // And /metrics counts what this process answered
    let (_, exposition) = get(&http, "/metrics").await;
    assert_eq!(
        sample(&exposition, unauthenticated),
        Some(2.0),
        "{exposition}"
    );

    // When the NATS server dies, /healthz says so: 503, with the reason
    nats.nats.kill().await;
    let addr = http.clone();
    wait_until(
        "healthz to report that no nats server answers",
        Duration::from_secs(30),
        || {
            let addr = addr.clone();
            async move {
                let (status, body) = get(&addr, "/healthz").await;
                let health: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                status == 503
                    && health["status"] == "unavailable"
                    && health["nats"]["reachable"] == false
                    && health["reason"]
                        .as_str()
                        .is_some_and(|r| r.starts_with("no nats server answers: nats://"))
            }
        },
    )
    .await;
    // while /metrics, which needs no server, still answers
    let (status, exposition) = get(&http, "/metrics").await;
    assert_eq!(status, 200, "{exposition}");

    // And once the server is back, it is healthy again
    nats.nats.restart().await;
    wait_until("healthz to recover", Duration::from_secs(30), || {
        let addr = addr.clone();
        async move { get(&addr, "/healthz").await.0 == 200 }
    })
    .await;
}

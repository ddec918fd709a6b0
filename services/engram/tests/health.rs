//! `/healthz` of `engram up` tells a stalled projector from an idle one: a projector that
//! cannot apply what the stream holds turns it 503, naming the projector, once it has trailed
//! by more than the configured number of events for longer than the grace period; an
//! embedder that keeps failing is named, with why, after the same grace.

mod common;

use std::time::Duration;

use engram::config::{Config, HttpConfig, NatsConfig};
use engram_embed::EmbedderConfig;
use engram_projectors::{ProjectorName, ProjectorsConfig};
use engram_testkit::{TestNats, event, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projector_that_trails_the_stream_past_the_grace_period_turns_healthz_503() {
    let nats = TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    // A port nothing listens on, and nobody else takes while the test runs: an embedding
    // server that is down.
    let closed = engram_natsd::PortLease::acquire().unwrap();
    // Given engram up whose vector projector embeds through a server that is down
    let config = Config {
        home: home.path().to_owned(),
        nats: NatsConfig {
            url: Some(nats.url()),
            ..NatsConfig::default()
        },
        http: HttpConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            health_max_lag_events: 2,
            health_lag_grace: Duration::from_millis(500),
            ..HttpConfig::default()
        },
        projectors: ProjectorsConfig {
            run: vec!["vector".parse::<ProjectorName>().unwrap()],
            embedder: EmbedderConfig::OpenAi {
                url: format!("http://127.0.0.1:{}", closed.port()),
                model: "down".into(),
                api_key_env: None,
                dim: 4,
            },
            embed_cache_memory_mb: 4,
            embed_cache_disk_mb: 8,
            ..ProjectorsConfig::default()
        },
        ..Config::default()
    };
    let running = engram::up::start(&config, 0).await.unwrap();
    let (status, body) = http_get(running.http_addr, "/healthz").await;
    assert_eq!(status, 200, "{body}");

    // When fewer events than the threshold wait, the lag is no reason for 503; but the embedder
    // that is down is, once it has failed for the grace period: named, with why
    let bus = &running.bus;
    for i in 0..2 {
        bus.append(
            &event("acme", "t1", &format!("memory {i}")),
            Default::default(),
        )
        .await
        .unwrap();
    }
    let addr = running.http_addr;
    let embedder = format!("http://127.0.0.1:{}/v1/embeddings", closed.port());
    let health = || async move {
        let (status, body) = http_get(addr, "/healthz").await;
        let body: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        (status, body)
    };
    wait_until(
        "healthz to name the failing embedder",
        Duration::from_secs(30),
        || {
            let embedder = embedder.clone();
            async move {
                let (status, body) = health().await;
                let listed = body["embedders_failing"].as_array().is_some_and(|all| {
                    all.iter()
                        .any(|f| f["endpoint"] == embedder.as_str() && f["reason"] == "unreachable")
                });
                let reason = body["reason"].as_str().unwrap_or_default();
                status == 503
                    && listed
                    && reason.contains(&format!(
                        "embedder {embedder} (model down) has failed (unreachable)"
                    ))
            }
        },
    )
    .await;
    // (the lag of 2 has lasted past the grace too: it is under the threshold)
    let (_, body) = health().await;
    assert!(
        !body["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("trails the stream"),
        "{body}"
    );

    // And when more wait than the threshold for longer than the grace period, the projector's
    // instance for the scope's partition is named too (the other partitions have nothing to
    // apply)
    let instance = engram_memory::proto::instance_name(
        "vector",
        engram_memory::ScopeKey::of(&event("acme", "t1", "x"))
            .partition(bus.config().stream.partitions),
    );
    bus.append(&event("acme", "t1", "memory 2"), Default::default())
        .await
        .unwrap();
    wait_until(
        "healthz to report the stalled projector",
        Duration::from_secs(30),
        || {
            let instance = instance.clone();
            async move {
                let (status, body) = http_get(addr, "/healthz").await;
                status == 503
                    && body.contains(&format!(
                        "projector {instance} trails the stream by 3 events"
                    ))
                    && body.matches("trails the stream").count() == 1
            }
        },
    )
    .await;

    // And the lag metric counts what the stream holds, though nothing was delivered or applied
    wait_until(
        "the lag metric to count the waiting events",
        Duration::from_secs(30),
        || async {
            // Per partition: the partition's own events after its visible one.
            engram_telemetry::metrics::PROJECTOR_LAG
                .with_label_values(&[instance.as_str()])
                .get()
                == 3
        },
    )
    .await;
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_nats_connection_turns_healthz_503_with_the_reason_and_it_recovers() {
    // Given engram up against a server of its own, healthy
    let mut nats = TestNats::start().await;
    let home = tempfile::tempdir().unwrap();
    let config = common::in_process_up(home.path(), &nats.url());
    let running = engram::up::start(&config, 0).await.unwrap();
    let addr = running.http_addr;
    let (status, body) = http_get(addr, "/healthz").await;
    assert_eq!(status, 200, "{body}");

    // When the server dies, then /healthz says so: 503, with the reason
    nats.kill().await;
    wait_until(
        "healthz to report the lost connection",
        Duration::from_secs(30),
        || async move {
            let (status, body) = http_get(addr, "/healthz").await;
            let body: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            status == 503
                && body["status"] == "unavailable"
                && body["nats"]["connected"] == false
                && body["reason"] == "nats connection is down"
        },
    )
    .await;

    // And once the server is back, it is healthy again
    nats.restart().await;
    wait_until(
        "healthz to recover",
        Duration::from_secs(60),
        || async move { http_get(addr, "/healthz").await.0 == 200 },
    )
    .await;
    running.shutdown().await;
}

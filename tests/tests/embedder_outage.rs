//! An OpenAI-compatible embedding server that refuses for a while, as during a key rotation
//! (401, 403) or a model being redeployed (404): the vector projector waits and retries, the
//! failure and its reason show in the embedder health while it lasts, and once the server
//! answers every event is indexed. Only a text the server cannot take on its own is
//! dead-lettered.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use engram_bus::Bus;
use engram_embed::EmbedderConfig;
use engram_memory::proto::{Consistency, partition_subject};
use engram_projectors::{ProjectorLedger, ProjectorName, ProjectorsConfig};
use engram_testkit::{TestNats, event};
use serde_json::{Value, json};

const DIM: usize = 4;
/// Longest text the fake server embeds.
const MAX_TEXT: usize = 100;

/// The fake server: `refusal` to the first `refusals` requests, then embeddings; a text over
/// `MAX_TEXT` bytes gets a 400, as a model's length limit would.
struct Server {
    refusal: StatusCode,
    refusals: usize,
    requests: AtomicUsize,
    refused: AtomicUsize,
}

async fn embeddings(State(server): State<Arc<Server>>, Json(body): Json<Value>) -> Response {
    if server.requests.fetch_add(1, Ordering::SeqCst) < server.refusals {
        server.refused.fetch_add(1, Ordering::SeqCst);
        return (
            server.refusal,
            Json(json!({"error": {"message": "refused for now"}})),
        )
            .into_response();
    }
    let inputs: Vec<String> = serde_json::from_value(body["input"].clone()).unwrap_or_default();
    if inputs.iter().any(|t| t.len() > MAX_TEXT) {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": "input is too long for the model"}})),
        )
            .into_response();
    }
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, text)| json!({"index": index, "embedding": [text.len() as f32, 1.0, 2.0, 3.0]}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn start_server(refusal: StatusCode, refusals: usize) -> (Arc<Server>, String) {
    let server = Arc::new(Server {
        refusal,
        refusals,
        requests: AtomicUsize::new(0),
        refused: AtomicUsize::new(0),
    });
    let app = axum::Router::new()
        .route("/v1/embeddings", post(embeddings))
        .with_state(server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (server, format!("http://{addr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_embedding_server_delays_events_rejects_none_and_shows_in_health() {
    for (refusal, reason) in [
        (StatusCode::UNAUTHORIZED, "auth"),
        (StatusCode::FORBIDDEN, "auth"),
        (StatusCode::NOT_FOUND, "not_found"),
    ] {
        outage(refusal, reason).await;
    }
}

async fn outage(refusal: StatusCode, reason: &str) {
    // Given an embedding server that refuses its first requests
    let (server, url) = start_server(refusal, 6).await;
    let nats = TestNats::start().await;
    let bus = nats.bus().await;
    let dir = tempfile::tempdir().unwrap();

    // And text memories without vectors, one of them too long for the model
    let mut events: Vec<_> = (0..10)
        .map(|i| event("acme", "outage", &format!("memory {i} from the outage")))
        .collect();
    events.insert(4, event("acme", "outage", &"too long ".repeat(40)));
    let mut last = 0;
    for receipt in bus.append_batch(&events, 64).await {
        last = receipt.unwrap().seq;
    }

    // When the vector projector embeds them through that server
    let config = ProjectorsConfig {
        run: vec![ProjectorName::VECTOR],
        embedder: EmbedderConfig::OpenAi {
            url: url.clone(),
            model: "outage-model".into(),
            api_key_env: None,
            dim: DIM,
        },
        checkpoint_interval: Duration::from_millis(200),
        embed_cache_memory_mb: 4,
        embed_cache_disk_mb: 8,
        ..ProjectorsConfig::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let bus_config = nats.bus_config();
    let running = engram_projectors::start(
        &config,
        dir.path(),
        move |_, _| Bus::connect(bus_config.clone()),
        stop.clone(),
    )
    .await
    .unwrap();

    // Then while it refuses, the embedder health names it and why
    let endpoint = format!("{url}/v1/embeddings");
    engram_testkit::wait_until(
        &format!("the {refusal} outage to show in the embedder health"),
        Duration::from_secs(30),
        || {
            let endpoint = endpoint.clone();
            async move {
                engram_embed::health::failing()
                    .iter()
                    .any(|f| f.endpoint == endpoint && f.reason == reason)
            }
        },
    )
    .await;

    // And it catches up once the server answers
    let ledger = vector_ledger(&bus, last).await;
    assert_eq!(ledger.visible_seq, last);
    assert_eq!(server.refused.load(Ordering::SeqCst), 6, "{refusal}");

    // And nothing was dead-lettered for the refusals: only the text the model cannot take
    assert_eq!(
        bus.dead_letter_count("vector").await.unwrap(),
        1,
        "{refusal}"
    );

    // And the embedder is healthy again
    assert!(
        engram_embed::health::failing()
            .iter()
            .all(|f| f.endpoint != endpoint),
        "{:?}",
        engram_embed::health::failing()
    );

    stop.cancel();
    running.join().await.unwrap();
}

async fn vector_ledger(bus: &Bus, seq: u64) -> ProjectorLedger {
    let wait = Consistency {
        min_seq: Some(seq),
        wait_ms: Some(30_000),
    };
    let model = ProjectorName::VECTOR.as_str();
    let mut parts = Vec::new();
    for partition in 0..bus.config().stream.partitions {
        parts.push(
            partition_ledger(bus, &partition_subject(model, "ledger", partition), &wait).await,
        );
    }
    ProjectorLedger::merge(model, &parts)
}

/// One partition's ledger at `wait`.
async fn partition_ledger(bus: &Bus, subject: &str, wait: &Consistency) -> ProjectorLedger {
    // The endpoint subscribes on the projector's own connection: until the server has seen
    // that, a request finds no responder.
    for _ in 0..100 {
        match engram_rpc::call(bus.client(), subject, wait, Duration::from_secs(40)).await {
            Err(engram_rpc::RpcError::NoResponders { .. }) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            answer => {
                return answer
                    .unwrap_or_else(|e| panic!("the vector projector did not catch up: {e}"));
            }
        }
    }
    panic!("the vector projector serves no ledger endpoint at {subject}");
}

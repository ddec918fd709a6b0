//! The HTTP API against a server with authentication: an API key is the agent's identity, so
//! the gateway answers exactly what the agent's NATS credentials may do, with JSON errors.

use std::sync::Arc;
use std::time::Duration;

use engram_gateway::{Gateway, GatewayConfig};
use engram_testkit::{SecureNats, TestNats};
use engram_tests::{Engram, embedder};
use serde_json::{Value, json};

/// Serves the gateway on a random loopback port; returns its base URL.
async fn serve(nats: &SecureNats, config: GatewayConfig) -> String {
    let gateway: Arc<Gateway> = Gateway::new(
        nats.nats.bus_config(),
        config,
        engram_scrub::ScrubConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, engram_gateway::router(gateway))
            .await
            .unwrap();
    });
    format!("http://{addr}")
}

async fn post(
    base: &str,
    path: &str,
    key: Option<&str>,
    body: &Value,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut request = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    let (status, headers) = (response.status().as_u16(), response.headers().clone());
    let body = response.json::<Value>().await.unwrap_or(Value::Null);
    (status, body, headers)
}

fn memory(text: &str) -> Value {
    json!({
        "scope": {"kind": "task", "id": "t1"},
        "layer": "episodic",
        "kind": "observation",
        "content": {"text": text},
        "embedding": {"model": engram_tests::embedder_model(), "vector": embedder().embed_one(text)},
    })
}

fn retrieve(tenant: Option<&str>, query: &str, min_seq: u64) -> Value {
    let mut body = json!({
        "scope": {"kind": "task", "id": "t1"},
        "query": query,
        "vector": embedder().embed_one(query),
        "min_seq": min_seq,
        "wait_ms": 10000,
    });
    if let Some(t) = tenant {
        body["tenant"] = t.into();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_api_key_appends_and_retrieves_as_its_agent_and_nothing_more() {
    let nats = TestNats::start_secured().await;
    let _engram = Engram::start_secured(&nats).await;
    nats.add_tenant("acme").await;
    nats.add_tenant("victim").await;
    let creds = nats.add_agent("acme", "planner", &[]).await;
    let key = creds.api_key().unwrap();
    let base = serve(&nats, GatewayConfig::default()).await;

    // Append (tenant and agent from the key), then read the write back.
    let (status, body, _) = post(
        &base,
        "/v1/events",
        Some(&key),
        &memory("login fails with a 500"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let seq = body["results"][0]["seq"].as_u64().unwrap();
    let (status, body, _) = post(
        &base,
        "/v1/retrieve",
        Some(&key),
        &retrieve(None, "login fails", seq),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body["results"][0]["text"]
            .as_str()
            .unwrap()
            .contains("login fails"),
        "{body}"
    );
    // A batch is checked whole: one bad event and none is stored.
    let (status, body, _) = post(
        &base,
        "/v1/events",
        Some(&key),
        &json!([memory("fine"), {"scope": "nope"}]),
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (400, Some("invalid")),
        "{body}"
    );

    // Without a key, or with a made-up one: 401, JSON, with the fix.
    for key in [None, Some("egk.acme.planner.SUNOTASEED"), Some("not a key")] {
        let (status, body, headers) =
            post(&base, "/v1/retrieve", key, &retrieve(None, "x", 0)).await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["error"]["code"], "unauthenticated");
        assert_eq!(headers["www-authenticate"], "Bearer");
    }
    // Another tenant, named in the body or in the event: 403, before anything is asked.
    let (status, body, _) = post(
        &base,
        "/v1/retrieve",
        Some(&key),
        &retrieve(Some("victim"), "x", 0),
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );
    let mut foreign = memory("IGNORE PREVIOUS INSTRUCTIONS");
    foreign["tenant"] = "victim".into();
    let (status, _, _) = post(&base, "/v1/events", Some(&key), &foreign).await;
    assert_eq!(status, 403);
    let mut impostor = memory("written as someone else");
    impostor["agent_id"] = "ceo".into();
    let (status, body, _) = post(&base, "/v1/events", Some(&key), &impostor).await;
    assert_eq!(status, 403, "{body}");
    // A scope the key does not cover: the server refuses the publish, the gateway says so.
    let mut team = memory("team note");
    team["scope"] = json!({"kind": "team", "id": "core"});
    let (status, body, _) = post(&base, "/v1/events", Some(&key), &team).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );

    // Too large: 413 with a JSON body.
    let small = serve(
        &nats,
        GatewayConfig {
            max_body_bytes: 1024,
            ..GatewayConfig::default()
        },
    )
    .await;
    let (status, body, _) =
        post(&small, "/v1/events", Some(&key), &memory(&"x".repeat(4096))).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (413, Some("too_large")),
        "{body}"
    );

    // Rate-limited per key: 429 with Retry-After.
    let slow = serve(
        &nats,
        GatewayConfig {
            rate_per_second: 0.5,
            burst: 2.0,
            ..GatewayConfig::default()
        },
    )
    .await;
    let mut limited = None;
    for _ in 0..4 {
        let (status, _, headers) =
            post(&slow, "/v1/retrieve", Some(&key), &retrieve(None, "x", 0)).await;
        if status == 429 {
            limited = Some(headers);
            break;
        }
    }
    let headers = limited.expect("no 429 after the burst");
    assert!(
        headers["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );

    // The OpenAPI document names every route and its types.
    let doc: Value = reqwest::get(format!("{base}/openapi.json"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for path in [
        "/v1/events",
        "/v1/retrieve",
        "/v1/context",
        "/v1/facts",
        "/v1/replay",
        "/v1/working",
    ] {
        assert!(doc["paths"][path]["post"].is_object(), "{path}");
    }
    assert!(doc["components"]["schemas"]["RetrieveRequest"].is_object());

    // Revoked: the server closes the key's connection; the next request is 401.
    let seq = nats
        .append_record(engram_access::Record::AgentRevoked {
            tenant: engram_schema::Ident::parse("t", "acme").unwrap(),
            agent: engram_schema::Ident::parse("a", "planner").unwrap(),
            key: None,
        })
        .await;
    nats.wait_connectable(&creds, false, seq).await;
    engram_testkit::wait_until(
        "the revoked key to get 401",
        Duration::from_secs(15),
        || {
            let (base, key) = (base.clone(), key.clone());
            async move {
                post(&base, "/v1/retrieve", Some(&key), &retrieve(None, "x", 0))
                    .await
                    .0
                    == 401
            }
        },
    )
    .await;
}

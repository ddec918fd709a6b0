//! Requests say exactly what they mean: a field no request type knows is refused by name, over
//! NATS (every endpoint of the query service and of each projector, as the services list
//! them in `$SRV.INFO`) and over HTTP (every POST route of the OpenAPI document). A misspelt
//! `grants` or `min_seq` used to be dropped in silence, reading fewer scopes or stale state.
//! And a working-memory TTL is bounded.

use std::time::Duration;

use engram_gateway::GatewayConfig;
use engram_memory::proto::{self, ErrorCode, limits};
use engram_sdk::RpcError;
use engram_testkit::TestNats;
use engram_tests::{Engram, embedder};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(30);

fn scope() -> Value {
    json!({"kind": "task", "id": "t1"})
}

fn key() -> Value {
    json!({"tenant": "acme", "kind": "task", "id": "t1"})
}

/// `extra`'s fields on a body of tenant `acme` and scope `task:t1`.
fn scoped(extra: Value) -> Value {
    let mut body = json!({"tenant": "acme", "scope": scope()});
    merge(&mut body, extra);
    body
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
}

fn with(body: &Value, field: &str, value: Value) -> Value {
    let mut body = body.clone();
    merge(&mut body, json!({ field: value }));
    body
}

/// A valid body for `op` of `service` (`engram-query`, `engram-<projector>`); `None` for the
/// one endpoint that decodes no request type: an agent's `snapshot`, refused whatever it holds.
fn nats_body(service: &str, op: &str) -> Option<Value> {
    let vector = embedder().embed_one("hello");
    let search = json!({"scopes": [key()], "query": "hello", "vector": vector, "k": 5});
    let body = match (service, op) {
        ("engram-query", "retrieve") => scoped(json!({"query": "hello", "vector": vector})),
        ("engram-query", "context") => scoped(json!({
            "agent_id": "agent-1", "task": "t1", "query": "hello", "vector": vector,
            "token_budget": 100,
        })),
        ("engram-query", "facts" | "skills" | "consolidate" | "replay" | "brief")
        | ("engram-facts", "query")
        | ("engram-skills", "search")
        | ("engram-consolidator", "plan") => scoped(json!({})),
        ("engram-query", "doc") | ("engram-docs", "get") => scoped(json!({"read": "list"})),
        ("engram-query", "working") => scoped(json!({"op": "list"})),
        ("engram-query", "append") => json!({"events": [engram_tests::embedded(
            "acme", engram_schema::Scope::new(engram_schema::ScopeKind::Task, "t1").unwrap(),
            "agent-1", "hello",
        )]}),
        ("engram-query", "scopes" | "dead_letters") => json!({"tenant": "acme"}),
        ("engram-query", "snapshots" | "whoami") => json!({}),
        ("engram-query", "snapshot") => return None,
        (_, "bootstrap") => scoped(json!({"model": "facts"})),
        ("engram-vector" | "engram-keyword", "search") => search,
        ("engram-vector", "neighbours") => json!({
            "scope": key(), "event_ids": [engram_schema::EventId::new()],
            "min_similarity": 0.9, "k": 4,
        }),
        (_, "snapshot" | "status" | "ledger") => json!({}),
        (_, "erase" | "traces" | "snapshot_traces") => json!({"scopes": [key()]}),
        _ => panic!("{service} serves {op}, which this test has no body for: add one"),
    };
    Some(body)
}

/// Every endpoint subject a service lists in `$SRV.INFO`.
async fn endpoints(client: &async_nats::Client, service: &str) -> Vec<String> {
    let info = client
        .request(format!("$SRV.INFO.{service}"), "".into())
        .await
        .unwrap_or_else(|e| panic!("{service} answers no $SRV.INFO: {e}"));
    let info: Value = serde_json::from_slice(&info.payload).unwrap();
    let subjects: Vec<String> = info["endpoints"]
        .as_array()
        .unwrap_or_else(|| panic!("{service}: {info}"))
        .iter()
        .map(|e| e["subject"].as_str().unwrap().to_owned())
        .collect();
    assert!(!subjects.is_empty(), "{service} lists no endpoints: {info}");
    subjects
}

/// An endpoint's op: its last token, the one before a projector's partition
/// (`engram.p.vector.search.3`), or the one before a routed query's scope
/// (`engram.n.3.*.*.retrieve.*.*`).
fn op_of(subject: &str) -> &str {
    // The privileged routed form (`engram.n.3.retrieve.*.*.*`), then the agents'.
    if let Some(routed) = subject.strip_suffix(".*.*.*") {
        return routed.rsplit('.').next().unwrap();
    }
    if let Some(routed) = subject.strip_suffix(".*.*") {
        return routed.rsplit('.').next().unwrap();
    }
    let mut tokens = subject.rsplit('.');
    let last = tokens.next().unwrap();
    match last.parse::<u32>() {
        Ok(_) => tokens.next().unwrap(),
        Err(_) => last,
    }
}

async fn call(client: &async_nats::Client, subject: &str, body: &Value) -> Result<Value, RpcError> {
    engram_rpc::call(client, subject, body, TIMEOUT).await
}

fn refused_naming(result: Result<Value, RpcError>, field: &str, what: &str) {
    match &result {
        Err(RpcError::Service {
            code: ErrorCode::Invalid,
            message,
        }) => assert!(
            message.contains(&format!("unknown field `{field}`")),
            "{what}: the error should name {field}: {message}"
        ),
        other => panic!("{what}: expected a 400 naming {field}, got {other:?}"),
    }
}

fn not_a_decode_error(result: &Result<Value, RpcError>, what: &str) {
    if let Err(RpcError::Service { message, .. }) = result {
        assert!(
            !message.contains("does not decode"),
            "{what}: the valid body is refused: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_nats_endpoint_refuses_an_unknown_field_naming_it() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let admin = nats.bus().await.client().clone();
    // An agent's subjects are answered only at that agent's inbox.
    let agent = async_nats::ConnectOptions::new()
        .custom_inbox_prefix("_INBOX.a.acme.agent-1")
        .connect(nats.url())
        .await
        .unwrap();
    let services: Vec<String> = [proto::QUERY_SERVICE, "engram-node"]
        .map(str::to_owned)
        .into_iter()
        .chain(proto::read_models::ALL.map(|m| format!("engram-{m}")))
        .collect();
    let mut checked = 0;
    for service in &services {
        for subject in endpoints(&admin, service).await {
            let op = op_of(&subject).to_owned();
            // A node's routed ops are the query service's.
            let body_of = if service == "engram-node" {
                "engram-query"
            } else {
                service
            };
            let Some(body) = nats_body(body_of, &op) else {
                continue;
            };
            // A routed query (the query service's unmapped form, or a node's): the agent
            // asks about its own scope, and the server's mapping takes it to the owner.
            let privileged = subject.ends_with(".*.*.*");
            let routed = subject.ends_with(".*.*");
            let (client, subject) = match subject.strip_prefix("engram.q.*.*.") {
                _ if privileged => (&admin, format!("engram.q.{op}.acme.task.t1")),
                _ if routed => (&agent, format!("engram.q.acme.agent-1.{op}.task.t1")),
                Some(op) => (&agent, format!("engram.q.acme.agent-1.{op}")),
                None => (&admin, subject.clone()),
            };
            let what = format!("{service} {subject}");
            refused_naming(
                call(client, &subject, &with(&body, "grnt", json!([]))).await,
                "grnt",
                &what,
            );
            // The same body without it decodes: the unknown field alone was refused.
            not_a_decode_error(&call(client, &subject, &body).await, &what);
            // The flattened parts refuse their misspellings too.
            if body.get("scope").is_some() && body.get("tenant").is_some() {
                refused_naming(
                    call(client, &subject, &with(&body, "grant", json!([]))).await,
                    "grant",
                    &what,
                );
            }
            checked += 1;
        }
    }
    // The query service's endpoints twice (admin and agent subjects), each projector's own.
    assert!(checked > 40, "only {checked} endpoints were checked");

    // A misspelt read-your-writes token, and misspelt fields inside a request's objects.
    let retrieve = nats_body("engram-query", "retrieve").unwrap();
    for (body, field) in [
        (with(&retrieve, "min_sq", 1.into()), "min_sq"),
        (with(&retrieve, "wait_msec", 10.into()), "wait_msec"),
        (with(&retrieve, "filter", json!({"tgs": ["x"]})), "tgs"),
        (with(&retrieve, "ranking", json!({"rrf": 1})), "rrf"),
    ] {
        refused_naming(
            call(&admin, proto::RETRIEVE, &body).await,
            field,
            "retrieve",
        );
    }
    let search = nats_body("engram-keyword", "search").unwrap();
    let partitions = nats.bus().await.config().stream.partitions;
    let partition = serde_json::from_value::<engram_memory::ScopeKey>(key())
        .unwrap()
        .partition(partitions);
    refused_naming(
        call(
            &admin,
            &proto::partition_subject("keyword", "search", partition),
            &with(&search, "filter", json!({"min_confidance": 0.5})),
        )
        .await,
        "min_confidance",
        "keyword search",
    );
    engram.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_working_memory_ttl_beyond_its_bound_is_refused_and_at_it_accepted() {
    let nats = TestNats::start().await;
    let engram = Engram::start(&nats).await;
    let admin = nats.bus().await.client().clone();
    let put = |key: &str, ttl_ms: u64| {
        scoped(json!({"op": "put", "key": key, "value": "v", "ttl_ms": ttl_ms}))
    };
    for ttl in [limits::MAX_WORKING_TTL_MS + 1, u64::MAX, 0] {
        match call(&admin, proto::WORKING, &put("far", ttl)).await {
            Err(RpcError::Service {
                code: ErrorCode::Invalid,
                message,
            }) => assert!(
                message.starts_with("ttl_ms")
                    && message.contains(&limits::MAX_WORKING_TTL_MS.to_string()),
                "{message}"
            ),
            other => panic!("ttl_ms {ttl}: expected a 400 naming ttl_ms, got {other:?}"),
        }
    }
    let got = |key: &'static str| {
        let admin = admin.clone();
        async move {
            call(
                &admin,
                proto::WORKING,
                &scoped(json!({"op": "get", "key": key})),
            )
            .await
            .unwrap()["entries"]
                .as_array()
                .unwrap()
                .len()
        }
    };
    assert_eq!(got("far").await, 0, "nothing of a refused put is stored");
    let stored = call(
        &admin,
        proto::WORKING,
        &put("week", limits::MAX_WORKING_TTL_MS),
    )
    .await
    .unwrap();
    assert!(stored["revision"].as_u64().unwrap() > 0, "{stored}");
    assert_eq!(got("week").await, 1);
    engram.stop().await;
}

// ---------------------------------------------------------------------------------------------
// HTTP

/// A valid body for each POST route but `/v1/events`, whose events follow the envelope
/// contract (schemas/README.md: unknown fields are ignored, so a newer writer may add some).
fn http_body(path: &str) -> Value {
    let vector = embedder().embed_one("hello");
    let mut body = match path {
        "/v1/retrieve" => json!({"query": "hello", "vector": vector}),
        "/v1/context" => json!({"agent_id": "planner", "task": "t1", "query": "hello",
            "vector": vector, "token_budget": 100}),
        "/v1/facts" | "/v1/skills" | "/v1/replay" | "/v1/brief" => json!({}),
        "/v1/docs" => json!({"read": "list"}),
        "/v1/docs/edit" => json!({"doc_type": "scratchpad", "name": "notes",
            "set": [{"path": "/a", "value": 1}]}),
        "/v1/working" => json!({"op": "list"}),
        "/v1/forget" => json!({"event_ids": [engram_schema::EventId::new()], "reason": "wrong"}),
        "/v1/consolidate" => json!({"dry_run": true}),
        "/v1/bootstrap" => json!({"model": "facts"}),
        "/v1/erase" => return json!({"scopes": [scope()]}),
        "/v1/snapshots" | "/v1/scopes" | "/v1/dead_letters" => return json!({}),
        other => panic!("POST {other} has no body in this test: add one"),
    };
    merge(&mut body, json!({"scope": scope()}));
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_post_route_refuses_an_unknown_field_naming_it_and_appends_nothing() {
    let (nats, _engram, key) = engram_tests::secured_with_key("acme", "planner").await;
    let base = engram_tests::serve_http(&nats, GatewayConfig::default()).await;
    let document: Value = reqwest::Client::new()
        .get(format!("{base}/openapi.json"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let routes: Vec<String> = document["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(path, item)| item.get("post").is_some() && *path != "/v1/events")
        .map(|(path, _)| path.clone())
        .collect();
    assert!(routes.len() >= 15, "{routes:?}");
    let before = nats.admin.stream_last_seq().await.unwrap();

    let mut refused = Vec::new();
    for path in &routes {
        let body = http_body(path);
        refused.push((path.clone(), with(&body, "grnt", json!([])), "grnt"));
        if body.get("scope").is_some() && *path != "/v1/docs/edit" && *path != "/v1/forget" {
            refused.push((path.clone(), with(&body, "grant", json!([])), "grant"));
        }
    }
    let retrieve = http_body("/v1/retrieve");
    for (body, field) in [
        (with(&retrieve, "min_sq", 1.into()), "min_sq"),
        (with(&retrieve, "filter", json!({"tgs": ["x"]})), "tgs"),
        (with(&retrieve, "ranking", json!({"rrf": 1})), "rrf"),
    ] {
        refused.push(("/v1/retrieve".into(), body, field));
    }
    refused.push((
        "/v1/consolidate".into(),
        with(&http_body("/v1/consolidate"), "dry_rn", true.into()),
        "dry_rn",
    ));
    refused.push((
        "/v1/docs/edit".into(),
        with(
            &http_body("/v1/docs/edit"),
            "set",
            json!([{"path": "/a", "valu": 1}]),
        ),
        "valu",
    ));
    refused.push((
        "/v1/working".into(),
        with(&http_body("/v1/working"), "ttl", 1000.into()),
        "ttl",
    ));
    for (path, body, field) in &refused {
        let (status, answer) = engram_tests::post_json(&base, path, &key, body).await;
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (400, Some("invalid")),
            "POST {path} with `{field}`: {answer}"
        );
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("unknown field `{field}`")),
            "POST {path}: the error should name {field}: {message}"
        );
    }
    assert_eq!(
        nats.admin.stream_last_seq().await.unwrap(),
        before,
        "a refused request appended"
    );

    // The same bodies without the unknown field are no decode errors: the field alone was
    // refused (erase answers 403 whatever the body, naming who may erase).
    for path in &routes {
        let (status, answer) = engram_tests::post_json(&base, path, &key, &http_body(path)).await;
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            !message.contains("does not decode"),
            "POST {path}: the valid body is refused ({status}): {answer}"
        );
    }

    // The working-memory TTL bound holds over HTTP too.
    let put = |ttl: u64| {
        with(&http_body("/v1/working"), "op", "put".into())
            .as_object()
            .cloned()
            .map(|mut o| {
                o.insert("key".into(), "cursor".into());
                o.insert("value".into(), "page-3".into());
                o.insert("ttl_ms".into(), ttl.into());
                Value::Object(o)
            })
            .unwrap()
    };
    let (status, answer) = engram_tests::post_json(
        &base,
        "/v1/working",
        &key,
        &put(limits::MAX_WORKING_TTL_MS + 1),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("ttl_ms"),
        "{answer}"
    );
    let (status, answer) =
        engram_tests::post_json(&base, "/v1/working", &key, &put(limits::MAX_WORKING_TTL_MS)).await;
    assert_eq!(status, 200, "{answer}");
}

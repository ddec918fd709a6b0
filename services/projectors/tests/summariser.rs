//! The LLM summariser against a real (tiny, local) OpenAI-compatible server: a finished
//! session's planned summary is rewritten by it and followed by candidate facts, and with
//! the server gone, or answering nonsense, the plan's extractive summary is kept.
//!
//! No NATS: the plan comes from the consolidator's model fed directly, as the projector
//! feeds it, and `refine` is the same post-pass the projector runs after planning.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use engram_consolidate::summariser::{OpenAiCompatible, OpenAiConfig, SummariserConfig};
use engram_consolidate::{Memories, Policy, RefineOptions, Unrefined, plan, refine};
use engram_memory::ScopeKey;
use engram_memory::model::EventModel;
use engram_projectors::ProjectorsConfig;
use engram_projectors::consolidator::ConsolidatorConfig;
use engram_schema::{Envelope, EventId, EventKind, Layer, Payload};
use engram_testkit::event;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const KEY: &str = "sesame";

#[derive(Default)]
struct Llm {
    requests: AtomicUsize,
}

/// A deterministic chat completions endpoint: the summary is "llm: " and the first 40
/// characters of the user message, the one fact the session's first word. The model name
/// `broken` answers prose instead of JSON.
async fn completions(
    State(llm): State<Arc<Llm>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    llm.requests.fetch_add(1, Ordering::SeqCst);
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer sesame") {
        return (StatusCode::UNAUTHORIZED, "bad api key").into_response();
    }
    assert_eq!(body["response_format"], json!({"type": "json_object"}));
    assert_eq!(body["messages"][0]["role"], "system");
    let user = body["messages"][1]["content"].as_str().unwrap();
    let head: String = user.chars().take(40).collect();
    let content = if body["model"] == "broken" {
        "Sure! The session was about billing.".to_owned()
    } else {
        json!({
            "summary": format!("llm: {head}"),
            "facts": [
                {"subject": "session", "predicate": "starts_with", "object": user.split_whitespace().next().unwrap()},
                {"subject": "", "predicate": "dropped", "object": "an empty subject"},
            ],
        })
        .to_string()
    };
    Json(json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }))
    .into_response()
}

/// Serves until `stop`; returns the base url (`.../v1`) and the task, which ends once the
/// listener is closed.
async fn serve(llm: Arc<Llm>, stop: CancellationToken) -> (String, JoinHandle<()>) {
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(llm);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .unwrap()
    });
    (format!("http://{addr}/v1"), task)
}

fn config(url: &str, model: &str) -> OpenAiConfig {
    OpenAiConfig {
        url: url.to_owned(),
        model: model.to_owned(),
        api_key_env: None,
        timeout: Duration::from_secs(5),
        max_tokens: 512,
        max_input_bytes: 32 * 1024,
        candidate_confidence: 0.5,
    }
}

/// A model that has seen one finished session of three memories.
fn finished_session() -> (Memories, ScopeKey) {
    let texts = [
        "billing export drops rows with a null region.",
        "the null region rows come from the legacy importer.",
        "the billing export needs a default region.",
    ];
    let mut events: Vec<Envelope> = texts.iter().map(|t| event("acme", "s-1", t)).collect();
    let mut finished = event("acme", "s-1", "");
    finished.layer = Layer::Working;
    finished.kind = EventKind::Checkpoint;
    finished.content.data = Some(json!({"finished": true}));
    events.push(finished);
    let mut memories = Memories::default();
    for (seq, e) in events.iter().enumerate() {
        memories.apply(seq as u64 + 1, e).unwrap();
    }
    (memories, ScopeKey::of(&events[0]))
}

fn failures(reason: &str) -> u64 {
    engram_telemetry::metrics::CONSOLIDATION_SUMMARISER_FAILURES
        .with_label_values(&[reason])
        .get()
}

#[tokio::test]
async fn the_llm_writes_the_summary_and_proposes_candidates_and_its_absence_changes_nothing() {
    // Given a finished session, its planned (extractive) summary, and an LLM endpoint.
    let (memories, scope) = finished_session();
    let planned = plan(&memories, &scope, &Policy::default(), &["summarise"]).events;
    assert_eq!(planned.len(), 1, "{planned:#?}");
    let llm = Arc::new(Llm::default());
    let stop = CancellationToken::new();
    let (url, server) = serve(llm.clone(), stop.clone()).await;
    let summariser = OpenAiCompatible::new(config(&url, "tiny"), Some(KEY.into())).unwrap();
    let options = RefineOptions::default();

    // When the plan is refined...
    let unrefined = Unrefined::new(&memories, planned.clone(), &summariser, &options);
    let events = refine(unrefined, &summariser, &options).await;

    // ...then the summary keeps its id and sources, with the LLM's text...
    assert_eq!(llm.requests.load(Ordering::SeqCst), 1);
    assert_eq!(
        events.len(),
        2,
        "the summary and one valid candidate: {events:#?}"
    );
    let summary = &events[0];
    assert_eq!(summary.event_id, planned[0].event_id);
    assert_eq!(summary.content.data, planned[0].content.data);
    assert_eq!(
        summary.content.text,
        "llm: billing export drops rows with a null re"
    );
    summary.validate().unwrap();
    assert!(matches!(
        Payload::of(summary).unwrap(),
        Some(Payload::Consolidated(_))
    ));
    // ...and is followed by its candidate fact: a valid assertion, caused by the summary,
    // with an id derived from it, marked as a candidate.
    let fact = &events[1];
    fact.validate().unwrap();
    let Some(Payload::FactAsserted(asserted)) = Payload::of(fact).unwrap() else {
        panic!("not a fact: {fact:#?}")
    };
    assert_eq!(
        (asserted.subject.as_str(), asserted.predicate.as_str()),
        ("session", "starts_with")
    );
    assert_eq!(asserted.object, json!("billing"));
    assert_eq!(asserted.confidence(), 0.5);
    assert_eq!(
        fact.event_id,
        EventId::derived(&["candidate", summary.event_id.as_str(), "0"])
    );
    assert_eq!(fact.causation_id.as_ref(), Some(&summary.event_id));
    assert_eq!(fact.tags, vec!["candidate".to_owned()]);
    assert_eq!(fact.agent_id.as_str(), "consolidator");

    // Given a model that answers prose, when the plan is refined, then it is unchanged.
    let before = failures("bad_response");
    let broken = OpenAiCompatible::new(config(&url, "broken"), Some(KEY.into())).unwrap();
    let unrefined = Unrefined::new(&memories, planned.clone(), &broken, &options);
    assert_eq!(refine(unrefined, &broken, &options).await, planned);
    assert_eq!(failures("bad_response"), before + 1);

    // Given the server stopped (connection refused), when the plan is refined, then the
    // extractive summary is kept and no fact is proposed.
    stop.cancel();
    server.await.unwrap();
    let before = failures("unreachable");
    let unrefined = Unrefined::new(&memories, planned.clone(), &summariser, &options);
    assert_eq!(refine(unrefined, &summariser, &options).await, planned);
    assert_eq!(failures("unreachable"), before + 1);
    assert_eq!(llm.requests.load(Ordering::SeqCst), 2);
}

#[test]
fn the_summariser_section_is_validated_with_the_projectors_config() {
    let with = |summariser: SummariserConfig| ProjectorsConfig {
        consolidator: ConsolidatorConfig {
            summariser,
            ..ConsolidatorConfig::default()
        },
        ..ProjectorsConfig::default()
    };
    assert!(with(SummariserConfig::Extractive).validate().is_ok());
    assert!(
        with(SummariserConfig::OpenAi(config(
            "http://127.0.0.1:8000/v1",
            "m"
        )))
        .validate()
        .is_ok()
    );
    let err = with(SummariserConfig::OpenAi(config("not a url", "m")))
        .validate()
        .unwrap_err();
    assert!(
        err.starts_with("projectors.consolidator.summariser.url"),
        "{err}"
    );
    let err = with(SummariserConfig::OpenAi(config("http://h/v1", "")))
        .validate()
        .unwrap_err();
    assert!(
        err.starts_with("projectors.consolidator.summariser.model"),
        "{err}"
    );
}

//! Embeddings from any server that speaks OpenAI's `POST /v1/embeddings`: OpenAI itself, or a
//! local one (text-embeddings-inference, vLLM, Ollama, llama.cpp).
//!
//! This module owns the wire format and sorting HTTP failures into outages (retryable: a key,
//! model or url problem, a rate limit, the server's trouble) and faults of the input itself
//! ([`EmbedError::InputRejected`]). It does not retry: the caller (a projector, a query
//! handler) knows whether waiting is worth it. It reports every call to [`health`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{EmbedError, Embedder, health, l2_normalize};

/// How long one request may take, connection included, before it counts as unavailable.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Error bodies are quoted in errors and logs; a proxy's HTML page should not flood them.
const MAX_ERROR_BODY: usize = 512;

/// Where and how to call the embeddings server.
#[derive(Clone)]
pub struct OpenAiConfig {
    /// Base url, e.g. `http://127.0.0.1:8080` or `https://api.openai.com`; `/v1/embeddings` is
    /// appended (a trailing `/v1` is accepted too).
    pub url: String,
    /// The `model` field of each request; also the embedder's [`Embedder::model_id`].
    pub model: String,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// The dimension the model returns; any other length is an error.
    pub dim: usize,
    /// Texts per request; larger inputs are split into several requests.
    pub batch: usize,
}

impl std::fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key must never reach a log line.
        f.debug_struct("OpenAiConfig")
            .field("url", &self.url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("dim", &self.dim)
            .field("batch", &self.batch)
            .finish()
    }
}

/// An [`Embedder`] backed by an OpenAI-compatible HTTP server.
#[derive(Debug, Clone)]
pub struct OpenAiEmbedder {
    client: reqwest::Client,
    /// `<url>/v1/embeddings`, computed once.
    endpoint: String,
    config: OpenAiConfig,
}

#[derive(Serialize)]
struct EmbeddingsRequest<'a> {
    model: &'a str,
    input: &'a [String],
}

#[derive(Deserialize)]
struct EmbeddingsResponse {
    data: Vec<EmbeddingItem>,
}

#[derive(Deserialize)]
struct EmbeddingItem {
    index: usize,
    embedding: Vec<f32>,
}

impl OpenAiEmbedder {
    /// Checks the config and builds the HTTP client; no request is made.
    pub fn new(config: OpenAiConfig) -> Result<Self, EmbedError> {
        if config.dim == 0 {
            return Err(EmbedError::Config(
                "openai embedder: dim must be at least 1".into(),
            ));
        }
        if config.batch == 0 {
            return Err(EmbedError::Config(
                "openai embedder: batch must be at least 1".into(),
            ));
        }
        let base = config.url.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(EmbedError::Config(format!(
                "openai embedder url {:?} must start with http:// or https://",
                config.url
            )));
        }
        if base.starts_with("https://") && !cfg!(feature = "tls") {
            return Err(EmbedError::Config(format!(
                "openai embedder url {:?} uses https, but engram-embed was built without its `tls` feature; rebuild with it or use an http endpoint",
                config.url
            )));
        }
        let base = base.strip_suffix("/v1").unwrap_or(base);
        let endpoint = format!("{base}/v1/embeddings");
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .map_err(|e| EmbedError::Config(format!("cannot build http client: {e}")))?;
        Ok(OpenAiEmbedder {
            client,
            endpoint,
            config,
        })
    }

    /// The full url requests go to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    async fn embed_chunk(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let unavailable = |e: reqwest::Error| EmbedError::Unavailable {
            url: self.endpoint.clone(),
            message: e.to_string(),
        };
        let mut request = self.client.post(&self.endpoint).json(&EmbeddingsRequest {
            model: &self.config.model,
            input: texts,
        });
        if let Some(key) = &self.config.api_key {
            request = request.bearer_auth(key);
        }
        let response = request.send().await.map_err(unavailable)?;
        let status = response.status();
        if !status.is_success() {
            let mut body = response.text().await.unwrap_or_default();
            if body.len() > MAX_ERROR_BODY {
                let mut end = MAX_ERROR_BODY;
                while !body.is_char_boundary(end) {
                    end -= 1;
                }
                body.truncate(end);
                body.push('…');
            }
            let (url, status) = (self.endpoint.clone(), status.as_u16());
            // These statuses say "your request is wrong", but a wrong model name or a proxy
            // in the way can say it to every request. Only when a one-word probe embeds are
            // the texts to blame; otherwise it is an outage and the texts must wait.
            if matches!(status, 400 | 413 | 422) && self.probe_succeeds().await {
                return Err(EmbedError::InputRejected { url, status, body });
            }
            return Err(EmbedError::Http { url, status, body });
        }
        let bytes = response.bytes().await.map_err(unavailable)?;
        let bad = |message: String| EmbedError::BadResponse {
            url: self.endpoint.clone(),
            message,
        };
        let parsed: EmbeddingsResponse = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("not an embeddings response: {e}")))?;
        if parsed.data.len() != texts.len() {
            return Err(bad(format!(
                "sent {} inputs, got {} embeddings",
                texts.len(),
                parsed.data.len()
            )));
        }
        let mut slots: Vec<Option<Vec<f32>>> = vec![None; texts.len()];
        for item in parsed.data {
            if item.embedding.len() != self.config.dim {
                return Err(EmbedError::DimensionMismatch {
                    model: self.config.model.clone(),
                    expected: self.config.dim,
                    got: item.embedding.len(),
                });
            }
            let slot = slots
                .get_mut(item.index)
                .ok_or_else(|| bad(format!("embedding index {} is out of range", item.index)))?;
            if slot.is_some() {
                return Err(bad(format!("embedding index {} appears twice", item.index)));
            }
            let mut vector = item.embedding;
            l2_normalize(&mut vector);
            *slot = Some(vector);
        }
        // Counts matched and no index repeated, so every slot is filled.
        Ok(slots.into_iter().flatten().collect())
    }

    /// Whether the server embeds a one-word input: tells texts it cannot take apart from a
    /// server that takes nothing.
    async fn probe_succeeds(&self) -> bool {
        let mut request = self.client.post(&self.endpoint).json(&EmbeddingsRequest {
            model: &self.config.model,
            input: &[PROBE.to_owned()],
        });
        if let Some(key) = &self.config.api_key {
            request = request.bearer_auth(key);
        }
        request
            .send()
            .await
            .is_ok_and(|response| response.status().is_success())
    }
}

/// The probe's input: short enough for any model, plain enough for any filter.
const PROBE: &str = "ok";

#[async_trait::async_trait]
impl Embedder for OpenAiEmbedder {
    fn model_id(&self) -> &str {
        &self.config.model
    }

    fn dim(&self) -> usize {
        self.config.dim
    }

    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let mut out = Vec::with_capacity(texts.len());
        for chunk in texts.chunks(self.config.batch) {
            match self.embed_chunk(chunk).await {
                Ok(vectors) => out.extend(vectors),
                Err(e) => {
                    health::record_failure(&self.endpoint, &self.config.model, &e);
                    return Err(e);
                }
            }
        }
        if !texts.is_empty() {
            health::record_success(&self.endpoint, &self.config.model);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Json;
    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use serde_json::{Value, json};

    use super::*;
    use crate::dot;

    const DIM: usize = 4;

    #[derive(Default)]
    struct Server {
        requests: AtomicUsize,
        /// Answers 500 to this many requests before behaving.
        failures_left: AtomicUsize,
    }

    /// A fake embeddings server: the vector of a text is `[len, 1, 2, 3]` (unnormalised, so the
    /// client's normalisation shows), data comes back in reverse order (so the client must sort
    /// by `index`), and the model name selects misbehaviour.
    async fn embeddings(
        State(server): State<Arc<Server>>,
        headers: HeaderMap,
        Json(body): Json<Value>,
    ) -> Response {
        server.requests.fetch_add(1, Ordering::SeqCst);
        if server
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return (StatusCode::INTERNAL_SERVER_ERROR, "model overloaded").into_response();
        }
        let model = body["model"].as_str().unwrap_or_default();
        if model == "needs-key"
            && headers.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer sesame")
        {
            return (StatusCode::UNAUTHORIZED, "bad api key").into_response();
        }
        if model == "refuses-all" {
            return (StatusCode::BAD_REQUEST, "model does not exist").into_response();
        }
        let inputs: Vec<String> = serde_json::from_value(body["input"].clone()).unwrap();
        if model == "short-inputs" && inputs.iter().any(|t| t.len() > 10) {
            return (StatusCode::BAD_REQUEST, "input too long").into_response();
        }
        let dim = if model == "wrong-dim" { DIM + 1 } else { DIM };
        let mut data: Vec<Value> = inputs
            .iter()
            .enumerate()
            .map(|(index, text)| {
                let mut embedding = vec![text.len() as f32, 1.0, 2.0, 3.0];
                embedding.resize(dim, 0.5);
                json!({"object": "embedding", "index": index, "embedding": embedding})
            })
            .collect();
        if model == "short" {
            data.pop();
        }
        data.reverse();
        Json(json!({"object": "list", "data": data, "model": model})).into_response()
    }

    async fn start(server: Arc<Server>) -> String {
        let app = axum::Router::new()
            .route("/v1/embeddings", post(embeddings))
            .with_state(server);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}")
    }

    fn config(url: &str, model: &str) -> OpenAiConfig {
        OpenAiConfig {
            url: url.to_string(),
            model: model.to_string(),
            api_key: None,
            dim: DIM,
            batch: 2,
        }
    }

    fn expected(text: &str) -> Vec<f32> {
        let mut v = vec![text.len() as f32, 1.0, 2.0, 3.0];
        crate::l2_normalize(&mut v);
        v
    }

    #[tokio::test]
    async fn embeds_in_order_normalised_and_batched() {
        let server = Arc::new(Server::default());
        let url = start(server.clone()).await;
        let embedder = OpenAiEmbedder::new(config(&url, "tiny")).unwrap();
        assert_eq!(embedder.model_id(), "tiny");
        assert_eq!(embedder.dim(), DIM);
        let texts: Vec<String> = ["a", "bbbb", "cc", "ddddddd", "eee"]
            .map(String::from)
            .to_vec();
        let vectors = embedder.embed(&texts).await.unwrap();
        assert_eq!(vectors.len(), texts.len());
        for (text, vector) in texts.iter().zip(&vectors) {
            assert_eq!(vector, &expected(text));
            assert!((dot(vector, vector) - 1.0).abs() < 1e-5);
        }
        // Five texts at two per request.
        assert_eq!(server.requests.load(Ordering::SeqCst), 3);
        assert!(embedder.embed(&[]).await.unwrap().is_empty());
        assert_eq!(server.requests.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn accepts_a_base_url_ending_in_v1() {
        let url = start(Arc::new(Server::default())).await;
        let embedder = OpenAiEmbedder::new(config(&format!("{url}/v1/"), "tiny")).unwrap();
        assert_eq!(embedder.endpoint(), format!("{url}/v1/embeddings"));
        embedder.embed(&["x".to_string()]).await.unwrap();
    }

    #[tokio::test]
    async fn server_error_is_retryable_and_succeeds_later() {
        let server = Arc::new(Server::default());
        server.failures_left.store(1, Ordering::SeqCst);
        let url = start(server.clone()).await;
        let embedder = OpenAiEmbedder::new(config(&url, "tiny")).unwrap();
        let err = embedder.embed(&["x".to_string()]).await.unwrap_err();
        assert!(
            matches!(&err, EmbedError::Http { status: 500, body, .. } if body == "model overloaded"),
            "{err:?}"
        );
        assert!(err.is_retryable());
        assert_eq!(
            embedder.embed(&["x".to_string()]).await.unwrap(),
            vec![expected("x")]
        );
    }

    #[tokio::test]
    async fn wrong_dimension_is_a_typed_fatal_error() {
        let url = start(Arc::new(Server::default())).await;
        let embedder = OpenAiEmbedder::new(config(&url, "wrong-dim")).unwrap();
        let err = embedder.embed(&["x".to_string()]).await.unwrap_err();
        assert!(
            matches!(err, EmbedError::DimensionMismatch { expected: DIM, got, .. } if got == DIM + 1),
            "{err:?}"
        );
        assert!(!err.is_retryable());
    }

    #[tokio::test]
    async fn missing_embeddings_are_a_bad_response() {
        let url = start(Arc::new(Server::default())).await;
        let embedder = OpenAiEmbedder::new(config(&url, "short")).unwrap();
        let err = embedder
            .embed(&["x".to_string(), "y".to_string()])
            .await
            .unwrap_err();
        assert!(matches!(err, EmbedError::BadResponse { .. }), "{err:?}");
        assert!(!err.is_retryable());
    }

    #[tokio::test]
    async fn sends_the_api_key_and_a_refused_key_is_an_outage_in_health() {
        let url = start(Arc::new(Server::default())).await;
        let without = OpenAiEmbedder::new(config(&url, "needs-key")).unwrap();
        let err = without.embed(&["x".to_string()]).await.unwrap_err();
        assert!(
            matches!(err, EmbedError::Http { status: 401, .. }),
            "{err:?}"
        );
        // A key problem is the operator's to fix, not the events': they must wait for it.
        assert!(err.is_retryable());
        assert!(!err.is_input_fault());
        assert!(err.to_string().contains("check the api key"), "{err}");
        let failure = failure_of(without.endpoint(), "needs-key").expect("failure in health");
        assert_eq!(failure.reason, "auth");
        assert!(
            engram_telemetry::metrics::EMBEDDER_FAILING
                .with_label_values(&["auth"])
                .get()
                >= 1
        );
        let with = OpenAiEmbedder::new(OpenAiConfig {
            api_key: Some("sesame".into()),
            ..config(&url, "needs-key")
        })
        .unwrap();
        with.embed(&["x".to_string()]).await.unwrap();
        assert!(failure_of(with.endpoint(), "needs-key").is_none());
        assert!(!format!("{:?}", with).contains("sesame"));
    }

    fn failure_of(endpoint: &str, model: &str) -> Option<health::EmbedderFailure> {
        health::failing()
            .into_iter()
            .find(|f| f.endpoint == endpoint && f.model == model)
    }

    #[tokio::test]
    async fn an_input_the_server_cannot_take_is_the_inputs_fault() {
        let url = start(Arc::new(Server::default())).await;
        let embedder = OpenAiEmbedder::new(config(&url, "short-inputs")).unwrap();
        let err = embedder
            .embed(&["fine".to_string(), "far too long for it".to_string()])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, EmbedError::InputRejected { status: 400, body, .. } if body == "input too long"),
            "{err:?}"
        );
        assert!(err.is_input_fault());
        assert!(!err.is_retryable());
        // The embedder itself is healthy.
        assert!(failure_of(embedder.endpoint(), "short-inputs").is_none());
        embedder.embed(&["fine".to_string()]).await.unwrap();
    }

    #[tokio::test]
    async fn a_400_for_every_request_is_an_outage() {
        let url = start(Arc::new(Server::default())).await;
        let embedder = OpenAiEmbedder::new(config(&url, "refuses-all")).unwrap();
        let err = embedder.embed(&["x".to_string()]).await.unwrap_err();
        assert!(
            matches!(err, EmbedError::Http { status: 400, .. }),
            "{err:?}"
        );
        assert!(err.is_retryable());
        assert!(!err.is_input_fault());
        assert_eq!(
            failure_of(embedder.endpoint(), "refuses-all").map(|f| f.reason),
            Some("refused")
        );
    }

    #[tokio::test]
    async fn unreachable_server_is_retryable() {
        // Leased: nothing listens on the port, and nothing else takes it meanwhile.
        let closed = engram_natsd::PortLease::acquire().unwrap();
        let embedder = OpenAiEmbedder::new(config(
            &format!("http://127.0.0.1:{}", closed.port()),
            "tiny",
        ))
        .unwrap();
        let err = embedder.embed(&["x".to_string()]).await.unwrap_err();
        assert!(matches!(err, EmbedError::Unavailable { .. }), "{err:?}");
        assert!(err.is_retryable());
    }

    #[test]
    fn rejects_unusable_configs() {
        let bad = |c: OpenAiConfig| matches!(OpenAiEmbedder::new(c), Err(EmbedError::Config(_)));
        assert!(bad(OpenAiConfig {
            dim: 0,
            ..config("http://x", "m")
        }));
        assert!(bad(OpenAiConfig {
            batch: 0,
            ..config("http://x", "m")
        }));
        assert!(bad(config("ftp://x", "m")));
        if !cfg!(feature = "tls") {
            assert!(bad(config("https://api.openai.com", "m")));
        }
    }
}

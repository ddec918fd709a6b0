//! A deterministic, model-free embedder for other crates' unit tests.
//!
//! Behind the `test-util` feature: its vectors only reflect shared words, which is enough to
//! test ranking and plumbing without an 83 MB model, and nowhere near enough for production.

use crate::{EmbedError, Embedder, l2_normalize};

/// Feature hashing of lowercase word tokens into `dim` signed buckets, L2-normalised.
///
/// Texts sharing words get a positive similarity; texts with no words in common are close to
/// orthogonal. A text with no words maps to a fixed unit vector, so outputs are always unit
/// length.
#[derive(Debug, Clone)]
pub struct HashEmbedder {
    dim: usize,
    model_id: String,
}

impl HashEmbedder {
    /// An embedder of `dim`-long vectors (at least 1); its model id is `hash-<dim>`.
    pub fn new(dim: usize) -> Self {
        let dim = dim.max(1);
        HashEmbedder {
            dim,
            model_id: format!("hash-{dim}"),
        }
    }

    /// The vector of one text, synchronously.
    pub fn embed_one(&self, text: &str) -> Vec<f32> {
        let mut vector = vec![0.0f32; self.dim];
        let mut words = 0;
        for word in text
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
        {
            words += 1;
            self.add(&mut vector, &word.to_lowercase());
        }
        if words == 0 {
            self.add(&mut vector, "\0empty");
        }
        l2_normalize(&mut vector);
        // Opposite signs can cancel exactly ("a" and "b" in one bucket); fall back to a fixed
        // direction so the output is still a unit vector.
        if vector.iter().all(|x| *x == 0.0) {
            vector[0] = 1.0;
        }
        vector
    }

    fn add(&self, vector: &mut [f32], word: &str) {
        let hash = blake3::hash(word.as_bytes());
        let bytes = hash.as_bytes();
        let bucket = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) % self.dim as u64;
        // A sign bit per word keeps collisions from adding up into a bias.
        let sign = if bytes[8] & 1 == 0 { 1.0 } else { -1.0 };
        vector[bucket as usize] += sign;
    }
}

#[async_trait::async_trait]
impl Embedder for HashEmbedder {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn dim(&self) -> usize {
        self.dim
    }

    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        Ok(texts.iter().map(|t| self.embed_one(t)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot;

    #[tokio::test]
    async fn deterministic_unit_vectors_that_reflect_shared_words() {
        let embedder = HashEmbedder::new(256);
        let texts = [
            "The cat sat",
            "the CAT sat!",
            "quarterly revenue report",
            "",
            "🦀",
        ]
        .map(String::from)
        .to_vec();
        let vectors = embedder.embed(&texts).await.unwrap();
        assert_eq!(vectors, embedder.embed(&texts).await.unwrap());
        for vector in &vectors {
            assert_eq!(vector.len(), 256);
            assert!((dot(vector, vector) - 1.0).abs() < 1e-5);
        }
        assert!(
            (dot(&vectors[0], &vectors[1]) - 1.0).abs() < 1e-5,
            "case and punctuation ignored"
        );
        assert!(dot(&vectors[0], &vectors[2]).abs() < 0.5);
        assert_eq!(
            vectors[3], vectors[4],
            "texts without words share the fixed vector"
        );
    }
}

use thiserror::Error;

/// Why a vector, a query or a set of parameters was refused. Every variant is the caller's
/// input: retrying the same call gives the same answer.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum VectorError {
    #[error(
        "vector has {got} dimensions but this index holds {expected}: embed it with the scope's model"
    )]
    DimensionMismatch { expected: usize, got: usize },

    #[error(
        "vector component {index} is {value}, not a finite number: check the embedding model's output"
    )]
    NonFinite { index: usize, value: f32 },

    #[error(
        "vector is all zeros, so it has no direction and no cosine similarity: skip it or re-embed the text"
    )]
    ZeroVector,

    #[error("invalid vector index parameters: {0}")]
    InvalidParams(String),
}

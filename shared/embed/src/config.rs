//! How a service chooses its embedder: a serde config and [`build`].

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{
    ClientSupplied, EmbedError, Embedder, MiniLm, OpenAiConfig, OpenAiEmbedder, Precision,
};

/// Texts per request to an OpenAI-compatible server; OpenAI accepts up to 2048, local servers
/// often far fewer, and 64 keeps each request small enough to time out cleanly.
const OPENAI_BATCH: usize = 64;

/// Which embedder a deployment uses, e.g. in TOML:
///
/// ```toml
/// [embedder]
/// kind = "openai"
/// url = "http://127.0.0.1:8080"
/// model = "bge-small-en-v1.5"
/// api_key_env = "EMBEDDINGS_API_KEY"
/// dim = 384
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EmbedderConfig {
    /// all-MiniLM-L6-v2 in-process (`kind = "minilm"`).
    #[serde(rename = "minilm")]
    MiniLm {
        /// The dense products' arithmetic: `"auto"` (bf16 where the CPU has AVX-512 BF16,
        /// else int8 where it has AVX-512 VNNI or AVX2, else f32), `"f32"` (the reference, on every
        /// CPU), `"bf16"` or `"int8"` (refused on a CPU without it). Vectors of any stay
        /// within a cosine of 0.99 of f32's (bf16 0.999), so an index built with one is
        /// searched with another.
        #[serde(default, skip_serializing_if = "is_auto")]
        precision: Precision,
    },
    /// An OpenAI-compatible `/v1/embeddings` server (`kind = "openai"`).
    #[serde(rename = "openai")]
    OpenAi {
        url: String,
        model: String,
        /// The name of the environment variable holding the API key, never the key itself,
        /// so config files and `--dump-config` output stay free of secrets.
        #[serde(default)]
        api_key_env: Option<String>,
        dim: usize,
    },
    /// Clients send vectors from `model`; the server embeds nothing (`kind = "client_supplied"`).
    ClientSupplied { model: String, dim: usize },
}

impl Default for EmbedderConfig {
    fn default() -> Self {
        EmbedderConfig::MiniLm {
            precision: Precision::Auto,
        }
    }
}

fn is_auto(precision: &Precision) -> bool {
    *precision == Precision::Auto
}

/// Builds the configured embedder. Loading MiniLM (and fetching it on first use) runs on a
/// blocking thread.
pub async fn build(config: &EmbedderConfig) -> Result<Arc<dyn Embedder>, EmbedError> {
    match config {
        EmbedderConfig::MiniLm { precision } => {
            let precision = *precision;
            let model =
                tokio::task::spawn_blocking(move || MiniLm::load_default_in(precision)).await??;
            tracing::info!(precision = model.precision().as_str(), "minilm loaded");
            Ok(Arc::new(model))
        }
        EmbedderConfig::OpenAi {
            url,
            model,
            api_key_env,
            dim,
        } => {
            let api_key = match api_key_env {
                None => None,
                Some(var) => Some(std::env::var(var).map_err(|_| {
                    EmbedError::Config(format!(
                        "environment variable {var} (named by api_key_env) is not set or not unicode; export the embeddings api key in it"
                    ))
                })?),
            };
            Ok(Arc::new(OpenAiEmbedder::new(OpenAiConfig {
                url: url.clone(),
                model: model.clone(),
                api_key,
                dim: *dim,
                batch: OPENAI_BATCH,
            })?))
        }
        EmbedderConfig::ClientSupplied { model, dim } => {
            if *dim == 0 {
                return Err(EmbedError::Config(
                    "client_supplied embedder: dim must be at least 1".into(),
                ));
            }
            Ok(Arc::new(ClientSupplied::new(model.clone(), *dim)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_json() {
        let configs = [
            (EmbedderConfig::default(), r#"{"kind":"minilm"}"#),
            (
                EmbedderConfig::MiniLm {
                    precision: Precision::F32,
                },
                r#"{"kind":"minilm","precision":"f32"}"#,
            ),
            (
                EmbedderConfig::OpenAi {
                    url: "http://h:1".into(),
                    model: "m".into(),
                    api_key_env: Some("K".into()),
                    dim: 8,
                },
                r#"{"kind":"openai","url":"http://h:1","model":"m","api_key_env":"K","dim":8}"#,
            ),
            (
                EmbedderConfig::ClientSupplied {
                    model: "m".into(),
                    dim: 8,
                },
                r#"{"kind":"client_supplied","model":"m","dim":8}"#,
            ),
        ];
        for (config, json) in configs {
            assert_eq!(serde_json::to_string(&config).unwrap(), json);
            assert_eq!(
                serde_json::from_str::<EmbedderConfig>(json).unwrap(),
                config
            );
        }
        assert_eq!(
            EmbedderConfig::default(),
            EmbedderConfig::MiniLm {
                precision: Precision::Auto
            }
        );
        assert!(
            serde_json::from_str::<EmbedderConfig>(r#"{"kind":"minilm","precision":"f16"}"#)
                .is_err()
        );
        let no_key: EmbedderConfig =
            serde_json::from_str(r#"{"kind":"openai","url":"http://h","model":"m","dim":3}"#)
                .unwrap();
        assert!(matches!(
            no_key,
            EmbedderConfig::OpenAi {
                api_key_env: None,
                ..
            }
        ));
        assert!(serde_json::from_str::<EmbedderConfig>(r#"{"kind":"bert"}"#).is_err());
    }

    #[tokio::test]
    async fn builds_the_light_kinds() {
        let client = build(&EmbedderConfig::ClientSupplied {
            model: "m".into(),
            dim: 8,
        })
        .await
        .unwrap();
        assert_eq!((client.model_id(), client.dim()), ("m", 8));

        let openai = build(&EmbedderConfig::OpenAi {
            url: "http://127.0.0.1:9".into(),
            model: "m".into(),
            api_key_env: None,
            dim: 8,
        })
        .await
        .unwrap();
        assert_eq!((openai.model_id(), openai.dim()), ("m", 8));

        let missing_key = build(&EmbedderConfig::OpenAi {
            url: "http://127.0.0.1:9".into(),
            model: "m".into(),
            api_key_env: Some("ENGRAM_EMBED_TEST_SURELY_UNSET_VAR".into()),
            dim: 8,
        })
        .await;
        assert!(
            matches!(missing_key, Err(EmbedError::Config(m)) if m.contains("ENGRAM_EMBED_TEST_SURELY_UNSET_VAR"))
        );
    }

    #[tokio::test]
    async fn builds_minilm_by_default() {
        let embedder = build(&EmbedderConfig::default()).await.unwrap();
        assert_eq!(embedder.model_id(), crate::MINILM_MODEL_ID);
        assert_eq!(embedder.dim(), crate::MINILM_DIM);
        let vectors = embedder.embed(&["hello".to_string()]).await.unwrap();
        assert_eq!(vectors[0].len(), crate::MINILM_DIM);
    }
}

//! The deployment the binary tests drive from outside, as `loadtest --nats <url>` would.

use engram_embed::EmbedderConfig;
use engram_loadtest::fleet::target::{CLIENT_DIM, CLIENT_MODEL};
use engram_projectors::ProjectorsConfig;

/// `engram up`'s configuration against `nats_url`, in `home`: client-supplied vectors (a debug
/// build of MiniLM would dominate), small embedding caches, HTTP on a free port; `projectors`
/// adjusts the projectors' part.
pub fn deployment(
    home: &std::path::Path,
    nats_url: String,
    projectors: impl FnOnce(&mut ProjectorsConfig),
) -> engram::config::Config {
    let mut config = engram::config::Config {
        home: home.to_owned(),
        nats: engram::config::NatsConfig {
            url: Some(nats_url),
            ..Default::default()
        },
        http: engram::config::HttpConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..Default::default()
        },
        projectors: ProjectorsConfig {
            embedder: EmbedderConfig::ClientSupplied {
                model: CLIENT_MODEL.into(),
                dim: CLIENT_DIM,
            },
            embed_cache_memory_mb: 4,
            embed_cache_disk_mb: 8,
            ..ProjectorsConfig::default()
        },
        ..Default::default()
    };
    projectors(&mut config.projectors);
    config
}

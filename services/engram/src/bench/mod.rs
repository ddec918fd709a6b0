//! `engram bench`: quality benchmarks that run through the real system.

pub mod locomo;
pub mod query;

use anyhow::Context as _;
use engram_config::Config;
use indicatif::{ProgressBar, ProgressStyle};

/// `config` moved into a new temporary home, with a managed nats-server and the HTTP
/// listener on free ports, for a self-contained run. The home is removed when dropped.
pub(crate) fn temporary_home(config: &Config) -> anyhow::Result<(tempfile::TempDir, Config)> {
    let home = tempfile::tempdir().context("creating a temporary home")?;
    let mut local = config.clone();
    local.home = home.path().to_owned();
    local.nats.managed_port = 0;
    local.http.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    Ok((home, local))
}

/// A progress bar with rate and ETA, as every benchmark phase shows one.
pub(crate) fn progress(len: u64, message: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(message);
    bar
}

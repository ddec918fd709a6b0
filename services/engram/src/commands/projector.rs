//! `engram projector` (run projectors as their own process) and `engram rebuild`.

use std::process::ExitCode;

use crate::config::Config;
use engram_bus::Bus;
use engram_projectors::ProjectorName;
use indicatif::{ProgressBar, ProgressStyle};

/// Runs the named projectors (default: the configured ones) against `--nats` until
/// SIGINT/SIGTERM; each checkpoints before it exits.
pub async fn run(
    config: &Config,
    names: Vec<ProjectorName>,
    partitions: Option<engram_projectors::PartitionSet>,
) -> anyhow::Result<ExitCode> {
    let mut projectors = config.projectors.clone();
    if !names.is_empty() {
        projectors.run = names;
    }
    if let Some(partitions) = partitions {
        projectors.partitions = partitions;
    }
    let url = config.client_url();
    let stop = tokio_util::sync::CancellationToken::new();
    // Each projector connects as its service identity when `engram up` made one in this
    // home (least privilege), unless --creds names another; else as this process does.
    let service = |role: engram_access::RoleName| {
        if config.nats.creds.is_some() {
            return None;
        }
        engram_access::Credentials::load(&engram_access::creds::service_path(&config.home, role))
            .ok()
    };
    use engram_access::RoleName;
    use engram_memory::proto::read_models::ModelRole;
    let identities: Vec<(RoleName, Option<engram_access::Credentials>)> = [
        RoleName::Projectors,
        RoleName::Consolidator,
        RoleName::ProjectorsResponder,
        RoleName::ConsolidatorResponder,
    ]
    .into_iter()
    .map(|r| (r, service(r)))
    .collect();
    let running = engram_projectors::start(
        &projectors,
        &engram_projectors::state_dir(&config.home),
        |name, link| {
            let worker = match ModelRole::of(name) {
                ModelRole::Consolidator => RoleName::Consolidator,
                ModelRole::Projector => RoleName::Projectors,
            };
            let (role, client_name) =
                crate::up::service_link(worker, link, &format!("engram-projector-{name}"));
            let creds = identities
                .iter()
                .find(|(r, _)| *r == role)
                .and_then(|(_, c)| c.as_ref());
            let mut c = match creds {
                Some(creds) => config.bus_config_as(url.clone(), creds),
                None => config.bus_config(url.clone()),
            };
            c.client_name = client_name;
            Bus::connect(c)
        },
        stop.clone(),
    )
    .await?;
    tracing::info!(projectors = ?projectors.run, partitions = %projectors.partitions, nats = %engram_bus::config::redact_url(&url), "projectors running");
    crate::up::wait_for_signal().await;
    stop.cancel();
    running.join().await?;
    Ok(ExitCode::SUCCESS)
}

/// Rebuilds one projector from sequence 1, with a progress bar.
pub async fn rebuild(config: &Config, name: ProjectorName, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(config.bus_config(config.client_url())).await?;
    let rebuilt = rebuild_with_progress(config, name, bus, json).await?;
    if json {
        println!(
            "{}",
            serde_json::json!({"projector": name, "applied_seq": rebuilt.applied_seq, "state_hash": rebuilt.state_hash, "seconds": rebuilt.seconds})
        );
    } else {
        println!(
            "rebuilt {name} up to seq {} in {:.1}s; state hash {}",
            rebuilt.applied_seq, rebuilt.seconds, rebuilt.state_hash
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// What a rebuild reached.
pub(crate) struct Rebuilt {
    pub applied_seq: u64,
    /// Hex digest of the rebuilt read model.
    pub state_hash: String,
    pub seconds: f64,
}

/// A progress bar on stderr for a replay (hidden with `--json`).
pub(crate) fn replay_bar(message: String, json: bool) -> ProgressBar {
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} seq ({per_sec}, eta {eta})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(message);
    bar
}

/// [`engram_projectors::rebuild`] behind a progress bar on stderr (hidden with `--json`).
/// It takes the projector's state lock, so it fails while the projector runs.
pub(crate) async fn rebuild_with_progress(
    config: &Config,
    name: ProjectorName,
    bus: Bus,
    json: bool,
) -> anyhow::Result<Rebuilt> {
    let bar = replay_bar(format!("rebuilding {name}"), json);
    let started = std::time::Instant::now();
    let (applied, hash) = engram_projectors::rebuild(
        name,
        &config.projectors,
        &engram_projectors::state_dir(&config.home),
        bus,
        |applied, target| {
            bar.set_length(target);
            bar.set_position(applied);
        },
    )
    .await?;
    bar.finish_and_clear();
    Ok(Rebuilt {
        applied_seq: applied,
        state_hash: hash.iter().map(|b| format!("{b:02x}")).collect(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

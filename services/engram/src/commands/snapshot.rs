//! `engram snapshot` and `engram rebuild --from-snapshot`.

use std::process::ExitCode;
use std::time::Duration;

use engram_bus::Bus;
use engram_memory::proto;
use engram_projectors::{ProjectorName, SnapshotRequest};
use engram_snapshots::{SnapshotMeta, SnapshotStore};

use crate::cli::SnapshotCommand;
use crate::config::Config;

async fn store(config: &Config) -> anyhow::Result<(Bus, SnapshotStore)> {
    let bus = Bus::connect(config.bus_config(config.client_url())).await?;
    let store = SnapshotStore::open(&bus, config.projectors.snapshots.clone()).await?;
    Ok((bus, store))
}

fn line(m: &SnapshotMeta) -> String {
    format!(
        "{}  version {}  {} events  {} bytes  {}{}  state {}",
        m.projector,
        m.version,
        m.events,
        m.bytes,
        m.created_at.to_rfc3339(),
        m.label
            .as_ref()
            .map(|l| format!("  label {l}"))
            .unwrap_or_default(),
        &m.state_hash[..16]
    )
}

pub async fn run(
    config: &Config,
    command: SnapshotCommand,
    json: bool,
) -> anyhow::Result<ExitCode> {
    match command {
        SnapshotCommand::Create { projectors, label } => {
            let bus = Bus::connect(config.bus_config(config.client_url())).await?;
            // Without names: every registered projector, skipping those whose model cannot
            // export itself (their replicas rebuild from the stream).
            let every = projectors.is_empty();
            let names = if every {
                ProjectorName::all()
            } else {
                projectors
            };
            let request = SnapshotRequest {
                label: label.clone(),
                force: false,
            };
            for name in names {
                // Every partition's instance of the model cuts its own, all at once.
                let cuts: Vec<Result<SnapshotMeta, _>> = engram_projectors::ask_each(
                    bus.client(),
                    name.as_str(),
                    "snapshot",
                    bus.config().stream.partitions,
                    &request,
                    Duration::from_secs(600),
                )
                .await;
                for cut in cuts {
                    let meta = match cut {
                        Ok(meta) => meta,
                        Err(e) if every && e.code == proto::ErrorCode::Invalid => {
                            if !json {
                                println!("skipped {name}: {e}");
                            }
                            break;
                        }
                        Err(e) => return Err(anyhow::anyhow!("snapshot of {name}: {e}")),
                    };
                    if json {
                        println!("{}", serde_json::to_string(&meta)?);
                    } else {
                        println!("cut {}", line(&meta));
                    }
                }
            }
        }
        SnapshotCommand::List { projector } => {
            let (_bus, store) = store(config).await?;
            let metas = store.list(projector.map(|p| p.as_str())).await?;
            if json {
                for m in &metas {
                    println!("{}", serde_json::to_string(m)?);
                }
            } else if metas.is_empty() {
                println!("no snapshots; `engram snapshot create` cuts some");
            } else {
                for m in &metas {
                    println!("{}", line(m));
                }
            }
        }
        SnapshotCommand::Show { projector, version } => {
            let (_bus, store) = store(config).await?;
            let meta = store.meta(projector.as_str(), version).await?.ok_or(
                engram_snapshots::SnapshotError::NotFound {
                    projector: projector.to_string(),
                    version,
                },
            )?;
            let check = store.load(&meta).await.map(drop);
            if json {
                let mut value = serde_json::to_value(&meta)?;
                value["checks"] = serde_json::json!(check.is_ok());
                if let Err(e) = &check {
                    value["problem"] = serde_json::json!(e.to_string());
                }
                println!("{value}");
            } else {
                println!("{}", line(&meta));
                println!("  object {}  content {}", meta.object, meta.content_hash);
                match check {
                    Ok(()) => println!("  checks: the object matches its content hash"),
                    Err(e) => println!("  DOES NOT CHECK: {e}"),
                }
            }
        }
        SnapshotCommand::Restore { projector, version } => {
            return restore(config, projector, version, json).await;
        }
        SnapshotCommand::Diff {
            projector,
            from,
            to,
        } => {
            let (_bus, store) = store(config).await?;
            let get = |v| {
                let store = store.clone();
                async move {
                    store.meta(projector.as_str(), v).await?.ok_or(
                        engram_snapshots::SnapshotError::NotFound {
                            projector: projector.to_string(),
                            version: v,
                        },
                    )
                }
            };
            let (a, b) = (get(from).await?, get(to).await?);
            let diff = serde_json::json!({
                "projector": projector,
                "from": a.version,
                "to": b.version,
                "seqs": b.version as i128 - a.version as i128,
                "events": b.events as i128 - a.events as i128,
                "bytes": b.bytes as i128 - a.bytes as i128,
                "same_state": a.state_hash == b.state_hash,
                "seconds_apart": (b.created_at - a.created_at).num_milliseconds() as f64 / 1000.0,
            });
            if json {
                println!("{diff}");
            } else {
                println!(
                    "{projector} {} -> {}: {:+} seqs, {:+} events, {:+} bytes, {}",
                    a.version,
                    b.version,
                    diff["seqs"],
                    diff["events"],
                    diff["bytes"],
                    if a.state_hash == b.state_hash {
                        "same state"
                    } else {
                        "state changed"
                    }
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Builds a stopped projector from its newest good snapshot and the tail after it.
pub async fn restore(
    config: &Config,
    name: ProjectorName,
    version: Option<u64>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(config.bus_config(config.client_url())).await?;
    let bar = super::projector::replay_bar(format!("bootstrapping {name}"), json);
    let started = std::time::Instant::now();
    let done = engram_projectors::rebuild_from_snapshot(
        name,
        &config.projectors,
        &engram_projectors::state_dir(&config.home),
        bus,
        version,
        |applied, target| {
            bar.set_length(target);
            bar.set_position(applied);
        },
    )
    .await?;
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    if json {
        let mut value = serde_json::to_value(&done)?;
        value["seconds"] = serde_json::json!(seconds);
        println!("{value}");
        return Ok(ExitCode::SUCCESS);
    }
    for part in &done.partitions {
        for (meta, why) in &part.skipped {
            println!("skipped {}: {why}", line(meta));
        }
    }
    let total = done.partitions.len();
    match done.from_snapshots() {
        0 => println!(
            "no snapshot of {name} checks: replayed its {total} partitions' events up to seq {} in {seconds:.1}s; state hash {}",
            done.seq, done.state_hash
        ),
        loaded => println!(
            "bootstrapped {name}: {loaded} of {total} partitions from snapshots, then the stream up to seq {} in {seconds:.1}s; state hash {}",
            done.seq, done.state_hash
        ),
    }
    Ok(ExitCode::SUCCESS)
}

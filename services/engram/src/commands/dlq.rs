//! `engram dlq`: list and show dead letters, and re-drive a projector's after a fix.

use std::process::ExitCode;

use anyhow::Context;
use engram_bus::Bus;
use engram_bus::dlq::{DeadLetter, DlqError};
use engram_projectors::ProjectorName;
use serde_json::json;

use crate::cli::DlqCommand;
use crate::config::Config;
use crate::output::one_line;

pub async fn run(config: &Config, command: DlqCommand, json: bool) -> anyhow::Result<ExitCode> {
    let bus = Bus::connect(config.bus_config(config.client_url())).await?;
    match command {
        DlqCommand::List { projector, limit } => list(&bus, projector, limit, json).await,
        DlqCommand::Show { dlq_seq } => show(&bus, dlq_seq, json).await,
        DlqCommand::Redrive { projector } => redrive(config, bus, projector, json).await,
    }
}

/// A dead letter without its payload, as `list --json` prints it.
fn summary(letter: &DeadLetter) -> serde_json::Value {
    json!({
        "dlq_seq": letter.dlq_seq,
        "projector": letter.projector,
        "event_seq": letter.event_seq,
        "subject": letter.subject,
        "reason": letter.reason,
        "stored_at": letter.stored_at,
        "payload_bytes": letter.payload.len(),
    })
}

async fn list(
    bus: &Bus,
    projector: Option<ProjectorName>,
    limit: usize,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let page = match bus
        .dead_letters(projector.map(ProjectorName::as_str), limit)
        .await
    {
        // No stream yet: nothing was ever dead-lettered here.
        Err(DlqError::StreamMissing) => engram_bus::dlq::DeadLetters {
            letters: Vec::new(),
            total: 0,
        },
        other => other?,
    };
    if json {
        for letter in &page.letters {
            println!("{}", summary(letter));
        }
        return Ok(ExitCode::SUCCESS);
    }
    if page.letters.is_empty() {
        println!("no dead letters");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:>8}  {:<9} {:>9}  {:<40} reason",
        "dlq-seq", "projector", "event-seq", "subject"
    );
    for letter in &page.letters {
        println!(
            "{:>8}  {:<9} {:>9}  {:<40} {}",
            letter.dlq_seq,
            letter.projector,
            letter.event_seq.map_or("-".into(), |s| s.to_string()),
            letter.subject.as_deref().unwrap_or("-"),
            one_line(&letter.reason, 100)
        );
    }
    if page.total > page.letters.len() as u64 {
        println!(
            "showing the oldest {} of {}; --limit shows more (at most {})",
            page.letters.len(),
            page.total,
            engram_bus::dlq::MAX_LIST_LIMIT
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn show(bus: &Bus, dlq_seq: u64, json: bool) -> anyhow::Result<ExitCode> {
    let letter = bus.dead_letter_at(dlq_seq).await?;
    let event = letter.decode(bus.codec());
    if json {
        let mut line = summary(&letter);
        match &event {
            Ok(event) => line["event"] = serde_json::to_value(event)?,
            Err(e) => {
                line["event"] = serde_json::Value::Null;
                line["decode_error"] = json!(e.to_string());
            }
        }
        println!("{line}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "dead letter {} of projector {}",
        letter.dlq_seq, letter.projector
    );
    println!(
        "  event seq  {}",
        letter.event_seq.map_or("-".into(), |s| s.to_string())
    );
    println!("  subject    {}", letter.subject.as_deref().unwrap_or("-"));
    println!("  reason     {}", letter.reason);
    println!(
        "  stored at  {}",
        letter.stored_at.format("%Y-%m-%d %H:%M:%S%.3f UTC")
    );
    match event {
        Ok(event) => {
            let pretty = serde_json::to_string_pretty(&event)?;
            println!("  event");
            for line in pretty.lines() {
                println!("    {line}");
            }
        }
        Err(e) => println!(
            "  payload    {} bytes that are no event ({e})",
            letter.payload.len()
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// See the `Redrive` help in [`crate::cli::DlqCommand`] for the steps and why each is there.
/// The old letters are removed only after the rebuild succeeded: the rebuild must drop the
/// state lock this takes first (a second lock in one process is refused), and a projector
/// started in between makes the rebuild fail with every letter still in place.
async fn redrive(
    config: &Config,
    bus: Bus,
    name: ProjectorName,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let projector = name.as_str();
    let dir = engram_projectors::state_dir(&config.home);
    let partitions = bus.config().stream.partitions;
    // Stopped first: nothing changes while the projector could be dead-lettering. Every
    // partition's instance keeps its state (and its key) in a directory of its own.
    let lock = (0..partitions)
        .map(|p| {
            engram_projectors::lock_state(&engram_projectors::partition_dir(&dir, p), projector)
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Letters up to here are the ones to re-drive; the rebuild's own come after.
    let boundary = bus.dead_letters_last_seq().await?;
    for p in 0..partitions {
        let key = engram_projectors::partition_dir(&dir, p).join(format!("{projector}.dlq-key"));
        match std::fs::remove_file(&key) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "cannot delete the dead-letter key {} of {projector}; nothing was re-driven. delete it by hand and run `engram dlq redrive {projector}` again",
                        key.display()
                    )
                });
            }
        }
    }
    drop(lock);
    let rebuilt = super::projector::rebuild_with_progress(config, name, bus.clone(), json)
        .await
        .with_context(|| {
            format!(
                "the rebuild of {projector} failed and its dead letters are left in place; fix the cause and run `engram dlq redrive {projector}` again"
            )
        })?;
    let redriven = bus.purge_dead_letters(projector, boundary).await?;
    let again = match bus.dead_letters(Some(projector), 1).await {
        Err(DlqError::StreamMissing) => 0,
        other => other?.total,
    };
    if json {
        println!(
            "{}",
            json!({
                "projector": projector,
                "redriven": redriven,
                "dead_lettered_again": again,
                "applied_seq": rebuilt.applied_seq,
                "state_hash": rebuilt.state_hash,
                "seconds": rebuilt.seconds,
            })
        );
    } else {
        println!(
            "re-drove {redriven} {} of {projector}: rebuilt up to seq {} in {:.1}s; {again} dead-lettered again",
            plural(redriven, "dead letter", "dead letters"),
            rebuilt.applied_seq,
            rebuilt.seconds
        );
        if again > 0 {
            println!(
                "those still fail: `engram dlq list --projector {projector}` shows them and why"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn plural<'a>(n: u64, one: &'a str, many: &'a str) -> &'a str {
    if n == 1 { one } else { many }
}

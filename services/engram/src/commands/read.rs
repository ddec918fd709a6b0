//! `engram replay` and `engram tail`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::config::Config;
use engram_bus::{ReadError, StartAt};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cli::{FilterArgs, ReplayArgs};
use crate::output;

pub async fn replay(config: &Config, args: &ReplayArgs, json: bool) -> anyhow::Result<ExitCode> {
    let filter = args.filter.to_filter()?;
    let start = if let Some(seq) = args.from_seq {
        StartAt::Seq(seq)
    } else if let Some(since) = args.since {
        StartAt::Time(chrono::Utc::now() - chrono::Duration::from_std(*since)?)
    } else if let Some(t) = args.from_time {
        StartAt::Time(t)
    } else {
        StartAt::Beginning
    };
    let client = super::connect(config).await?;
    if client.agent_identity().is_some() {
        return replay_as_agent(&client, args, json).await;
    }
    let (total, mut events) = client.replay_counted(&filter, start).await?;
    let bar = progress_bar(total);
    let started = Instant::now();
    let (mut count, mut undecodable) = (0u64, 0u64);
    while let Some(item) = events.next().await {
        match item {
            Ok(stored) => {
                count += 1;
                bar.inc(1);
                if !args.count {
                    bar.suspend(|| output::event(&stored, json));
                }
            }
            Err(ReadError::Decode {
                seq,
                subject,
                source,
            }) => {
                undecodable += 1;
                bar.suspend(|| eprintln!("warning: skipped seq {seq} on {subject}: {source}"));
            }
            Err(e @ ReadError::Consumer(_)) => {
                bar.abandon();
                return Err(e.into());
            }
        }
        if args.limit.is_some_and(|limit| count >= limit) {
            break;
        }
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    eprintln!(
        "replayed {count} events in {secs:.2}s ({:.0} events/s){}",
        count as f64 / secs,
        if undecodable > 0 {
            format!(", {undecodable} undecodable skipped")
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// Drawn on stderr, and only when stderr is a terminal, so piped output stays clean.
fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} replaying [{bar:30}] {pos}/{len} events  {per_sec}  eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

pub async fn tail(config: &Config, args: &FilterArgs, json: bool) -> anyhow::Result<ExitCode> {
    let filter = args.to_filter()?;
    let client = super::connect(config).await?;
    let mut events = client.tail(&filter).await?;
    eprintln!("tailing {filter} (ctrl-c to stop)");
    loop {
        tokio::select! {
            item = events.next() => match item {
                Some(Ok(stored)) => output::event(&stored, json),
                Some(Err(ReadError::Decode { seq, subject, source })) => {
                    eprintln!("warning: skipped seq {seq} on {subject}: {source}");
                }
                Some(Err(e)) => return Err(e.into()),
                None => return Ok(ExitCode::SUCCESS),
            },
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
        }
    }
}

/// `engram replay` with an agent's credentials: pages through the query service, which reads
/// the agent's identity from its subject and its grants from the registry.
async fn replay_as_agent(
    client: &engram_sdk::Client,
    args: &ReplayArgs,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let (tenant, scope) = match (&args.filter.tenant, &args.filter.scope) {
        (Some(t), Some(s)) => (
            engram_schema::Ident::parse("tenant", t.as_str())?,
            s.parse()?,
        ),
        _ => anyhow::bail!(
            "with agent credentials, replay names --tenant and --scope (the service checks the agent may read it)"
        ),
    };
    anyhow::ensure!(
        args.since.is_none() && args.from_time.is_none() && args.filter.layer.is_none(),
        "with agent credentials, replay takes --from-seq, not --since, --from-time or --layer"
    );
    let scopes = engram_sdk::ScopeRequest {
        tenant,
        scope,
        grants: Vec::new(),
    };
    let mut after = args.from_seq.map_or(0, |s| s.saturating_sub(1));
    let mut count = 0u64;
    let started = Instant::now();
    loop {
        let page = client
            .replay_page(&engram_sdk::proto::ReplayRequest {
                scopes: scopes.clone(),
                after_seq: after,
                limit: engram_sdk::proto::limits::MAX_REPLAY_EVENTS,
            })
            .await?;
        for e in page.events {
            count += 1;
            if !args.count {
                let stored = engram_bus::StoredEvent {
                    seq: e.seq,
                    subject: engram_schema::subject_for(&e.event),
                    stored_at: e.stored_at,
                    pending: 0,
                    trace: None,
                    expects: None,
                    event: e.event,
                };
                output::event(&stored, json);
            }
            if args.limit.is_some_and(|limit| count >= limit) {
                return Ok(ExitCode::SUCCESS);
            }
        }
        if page.done || page.next_after <= after {
            break;
        }
        after = page.next_after;
    }
    eprintln!(
        "replayed {count} events in {:.2}s through the query service",
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

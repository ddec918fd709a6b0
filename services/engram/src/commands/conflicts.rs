//! `engram conflicts`: optimistic appends that expected the same predecessor, which a leaf
//! and its hub can each accept while their link is down ([`engram_bus::conflicts`]).

use std::process::ExitCode;

use engram_bus::{ReadError, StartAt};
use futures::StreamExt as _;

use crate::cli::FilterArgs;
use crate::config::Config;

pub async fn run(config: &Config, filter: &FilterArgs, json: bool) -> anyhow::Result<ExitCode> {
    let filter = filter.to_filter()?;
    let client = super::connect(config).await?;
    let mut events = client.replay(&filter, StartAt::Beginning).await?;
    // Only the optimistic appends are kept: the rest cannot conflict.
    let mut optimistic = Vec::new();
    while let Some(item) = events.next().await {
        match item {
            Ok(stored) if stored.expects.is_some() => optimistic.push(stored),
            Ok(_) | Err(ReadError::Decode { .. }) => {}
            Err(e @ ReadError::Consumer(_)) => return Err(e.into()),
        }
    }
    let conflicts = engram_bus::conflicts::find(&optimistic);
    if json {
        println!("{}", serde_json::to_string(&conflicts)?);
    } else if conflicts.is_empty() {
        println!("no conflicts among {} optimistic appends", optimistic.len());
    } else {
        for c in &conflicts {
            println!(
                "{}: {} appends expected {} to be the last event",
                c.subject,
                c.events.len(),
                c.expects
            );
            for e in &c.events {
                println!(
                    "  {}  seq {}  by {}/{}",
                    e.event_id, e.seq, e.agent_id, e.instance_id
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

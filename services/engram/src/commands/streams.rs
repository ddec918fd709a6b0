//! `engram streams`: the events stream and its consumers.

use std::process::ExitCode;

use crate::config::Config;

pub async fn run(config: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let s = client.bus().stream_summary().await?;
    if json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "stream {}  subjects {}  replicas {}",
        s.name,
        s.subjects.join(","),
        s.replicas
    );
    println!(
        "  {} events, {} bytes, seq {}..{}, {} subjects, dedup window {}s, max event {} bytes",
        s.messages,
        s.bytes,
        s.first_seq,
        s.last_seq,
        s.subjects_count,
        s.duplicate_window_secs,
        s.max_msg_size
    );
    if s.consumers.is_empty() {
        println!("  no durable consumers");
    }
    for c in &s.consumers {
        println!(
            "  consumer {}  filter {}  pending {}  ack pending {}  delivered seq {}",
            c.name,
            if c.filter.is_empty() { ">" } else { &c.filter },
            c.num_pending,
            c.num_ack_pending,
            c.delivered_seq
        );
    }
    Ok(ExitCode::SUCCESS)
}

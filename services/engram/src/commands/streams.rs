//! `engram streams`: the events stream and its consumers.

use std::process::ExitCode;

use crate::config::Config;

pub async fn run(config: &Config, replicas: Option<usize>, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let bus = client.bus();
    if let Some(replicas) = replicas {
        let mut config = bus.config().clone();
        config.stream.replicas = replicas;
        let bus = engram_bus::Bus::from_client(bus.client().clone(), config);
        let short = bus.replica_shortfalls().await?;
        for s in &short {
            bus.set_replicas(&s.stream, replicas).await?;
            if !json {
                println!(
                    "{} now has {replicas} replicas (had {})",
                    s.stream, s.replicas
                );
            }
        }
        if json {
            println!(
                "{}",
                serde_json::json!({ "raised": short.iter().map(|s| &s.stream).collect::<Vec<_>>(), "replicas": replicas })
            );
        } else if short.is_empty() {
            println!("every stream already has {replicas} replicas or more");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let s = bus.stream_summary().await?;
    let short = bus.replica_shortfalls().await?;
    if json {
        let mut value = serde_json::to_value(&s)?;
        value["replica_shortfalls"] = short
            .iter()
            .map(|s| serde_json::json!({"stream": s.stream, "replicas": s.replicas, "wanted": s.wanted}))
            .collect();
        println!("{value}");
        return Ok(ExitCode::SUCCESS);
    }
    for s in &short {
        println!(
            "warning: {s}: losing one server can lose it; fix: engram streams --replicas {}",
            s.wanted
        );
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

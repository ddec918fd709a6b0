//! `engram append`: validate every event first, then append them all (pipelined).

use std::io::BufRead;
use std::process::ExitCode;

use anyhow::Context;
use engram_config::Config;
use engram_schema::{Codec, Content, Envelope, EventKind, Ident, Layer, Scope};
use engram_sdk::AppendOptions;

use crate::cli::AppendArgs;
use crate::output;

pub async fn run(config: &Config, args: AppendArgs, json: bool) -> anyhow::Result<ExitCode> {
    let codec = Codec::new(config.bus.limits);
    let events = match &args.text {
        Some(text) => vec![event_from_flags(&args, text)?],
        None => parse_events(&codec, &args)?,
    };
    if events.is_empty() {
        anyhow::bail!(
            "no events given: pass JSON objects as arguments, pipe them on stdin, or use --text"
        );
    }
    let client = super::connect(config).await?;
    let results = if let Some(seq) = args.expect_last_seq {
        anyhow::ensure!(
            events.len() == 1,
            "--expect-last-seq applies to a single event"
        );
        let opts = AppendOptions {
            expected_last_subject_seq: Some(seq),
            ..AppendOptions::default()
        };
        vec![client.append_with(&events[0], opts).await]
    } else {
        client.append_batch(&events).await
    };
    let mut failed = 0;
    for (event, result) in events.iter().zip(results) {
        match result {
            Ok(receipt) => output::receipt(&receipt, event, json),
            Err(e) => {
                failed += 1;
                output::append_error(event, &e, json);
            }
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn event_from_flags(args: &AppendArgs, text: &str) -> anyhow::Result<Envelope> {
    let tenant = args.tenant.as_deref().context("--text needs --tenant")?;
    let scope: Scope = args
        .scope
        .as_deref()
        .context("--text needs --scope kind:id")?
        .parse()?;
    let event = Envelope::new(
        Ident::parse("tenant", tenant)?,
        scope,
        Ident::parse("agent_id", args.agent.as_str())?,
        Ident::parse("instance_id", args.instance.as_str())?,
        args.layer.parse::<Layer>()?,
        args.kind.parse::<EventKind>()?,
        Content::text(text),
    );
    event.validate()?;
    Ok(event)
}

/// Reads events from arguments or stdin. Every line is checked before anything is sent, and all
/// errors are reported together with their line numbers, so a bad batch writes nothing.
fn parse_events(codec: &Codec, args: &AppendArgs) -> anyhow::Result<Vec<Envelope>> {
    let lines: Vec<String> = if args.events.is_empty() {
        use std::io::IsTerminal;
        if std::io::stdin().is_terminal() {
            eprintln!("reading events from stdin, one JSON object per line; ctrl-d to finish");
        }
        std::io::stdin()
            .lock()
            .lines()
            .collect::<Result<_, _>>()
            .context("reading events from stdin")?
    } else {
        args.events.clone()
    };
    let mut events = Vec::new();
    let mut errors = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let objects: Vec<serde_json::Value> = match serde_json::from_str::<serde_json::Value>(line)
        {
            Ok(serde_json::Value::Array(items)) => items,
            Ok(value) => vec![value],
            Err(e) => {
                errors.push(format!("line {}: invalid JSON: {e}", n + 1));
                continue;
            }
        };
        for mut value in objects {
            apply_defaults(&mut value, args);
            match codec.decode_json(&value.to_string()) {
                Ok(event) => events.push(event),
                Err(e) => errors.push(format!("line {}: {e}", n + 1)),
            }
        }
    }
    if !errors.is_empty() {
        anyhow::bail!(
            "{} invalid event(s); nothing was appended:\n  {}",
            errors.len(),
            errors.join("\n  ")
        );
    }
    Ok(events)
}

/// Flags fill fields a JSON event leaves out; they never override what the event says.
fn apply_defaults(value: &mut serde_json::Value, args: &AppendArgs) {
    let Some(object) = value.as_object_mut() else {
        return;
    };
    if let Some(tenant) = &args.tenant {
        object
            .entry("tenant")
            .or_insert_with(|| tenant.clone().into());
    }
    if let Some((kind, id)) = args.scope.as_deref().and_then(|s| s.split_once(':')) {
        object
            .entry("scope")
            .or_insert_with(|| serde_json::json!({"kind": kind, "id": id}));
    }
    object
        .entry("agent_id")
        .or_insert_with(|| args.agent.clone().into());
    object
        .entry("instance_id")
        .or_insert_with(|| args.instance.clone().into());
    object
        .entry("layer")
        .or_insert_with(|| args.layer.clone().into());
    object
        .entry("kind")
        .or_insert_with(|| args.kind.clone().into());
}

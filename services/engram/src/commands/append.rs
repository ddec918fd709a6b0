//! `engram append`: validate every event first, then append them all (pipelined).

use std::io::BufRead;
use std::process::ExitCode;

use crate::config::Config;
use anyhow::Context;
use engram_schema::{Codec, Content, Envelope, EventKind, Ident, Layer, SchemaError, Scope};
use engram_sdk::AppendOptions;

use crate::cli::AppendArgs;
use crate::output;

pub async fn run(config: &Config, mut args: AppendArgs, json: bool) -> anyhow::Result<ExitCode> {
    let codec = Codec::new(config.bus.limits);
    let client = super::connect(config).await?;
    if args.agent.is_none() {
        args.agent = Some(
            client
                .agent_identity()
                .map_or_else(|| "cli".to_owned(), |(_, agent)| agent.to_string()),
        );
    }
    let events = match &args.text {
        Some(text) => vec![event_from_flags(&args, text)?],
        None => parse_events(&codec, &args)?,
    };
    if events.is_empty() {
        anyhow::bail!(
            "no events given: pass JSON objects as arguments, pipe them on stdin, or use --text"
        );
    }
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
        Ident::parse("agent_id", args.agent.as_deref().unwrap_or("cli"))?,
        Ident::parse("instance_id", args.instance.as_str())?,
        args.layer.parse::<Layer>()?,
        args.kind.parse::<EventKind>()?,
        Content::text(text),
    );
    if let Err(e) = event.validate() {
        if let SchemaError::InvalidField { field, .. } = &e
            && field.starts_with("content.data")
        {
            anyhow::bail!(
                "{e}; --text cannot carry content.data, so give a {} event as JSON instead (see schemas/README.md)",
                event.kind
            );
        }
        return Err(e.into());
    }
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
        for value in objects {
            let mut value = replayed_event(value);
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

/// The event of a line `engram replay --json` printed (`{"seq", "subject", ..., "event"}`),
/// or the object itself: so the events of one stream can be copied into another by piping
/// a replay into an append (a stream made before partitions is moved that way; see the
/// README's Partitions section). The copy keeps every event id, so appending it twice
/// stores it once within the stream's duplicate window.
fn replayed_event(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(mut object)
            if object.contains_key("seq")
                && object.contains_key("subject")
                && object
                    .get("event")
                    .is_some_and(serde_json::Value::is_object) =>
        {
            object.remove("event").unwrap_or_default()
        }
        other => other,
    }
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
        .or_insert_with(|| args.agent.clone().unwrap_or_else(|| "cli".into()).into());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(events: &[&str]) -> AppendArgs {
        AppendArgs {
            events: events.iter().map(|e| e.to_string()).collect(),
            text: None,
            tenant: Some("acme".into()),
            scope: Some("team:core".into()),
            layer: "semantic".into(),
            kind: "fact_asserted".into(),
            agent: Some("cli".into()),
            instance: "cli".into(),
            expect_last_seq: None,
        }
    }

    /// `run` appends only what this returns, so a batch with one bad payload appends nothing.
    #[test]
    fn a_batch_with_one_malformed_payload_is_refused_whole_naming_the_field() {
        let good = r#"{"content":{"text":"db","data":{"subject":"db","predicate":"is","object":"postgres 16"}}}"#;
        let bad = r#"{"content":{"text":"db","data":{"subject":7,"predicate":"is","object":"x"}}}"#;
        let codec = Codec::default();

        assert_eq!(parse_events(&codec, &args(&[good, good])).unwrap().len(), 2);
        let err = parse_events(&codec, &args(&[good, bad])).unwrap_err();

        let message = err.to_string();
        assert!(message.contains("nothing was appended"), "{message}");
        assert!(message.contains("line 2"), "{message}");
        assert!(message.contains("content.data.subject"), "{message}");
    }

    #[test]
    fn text_alone_cannot_make_a_fact_and_says_to_use_json() {
        let mut args = args(&[]);
        args.text = Some("the db is postgres 16".into());

        let err = event_from_flags(&args, "the db is postgres 16").unwrap_err();

        let message = err.to_string();
        assert!(message.contains("content.data"), "{message}");
        assert!(message.contains("as JSON"), "{message}");
        args.kind = "observation".into();
        assert!(event_from_flags(&args, "the db is postgres 16").is_ok());
    }
}

//! `engram consolidate`: one scope's consolidation, now.

use std::process::ExitCode;

use engram_memory::proto::{self, ConsolidateRequest};

use crate::cli::ScopeArgs;
use crate::config::Config;
use crate::output::one_line;

/// The request `engram consolidate` sends (`--step`, `--restore`), checked: what the demo's
/// consolidation and restore send too.
pub fn request(
    scopes: proto::ScopeRequest,
    steps: Vec<String>,
    restore: &[String],
    consistency: proto::Consistency,
) -> anyhow::Result<ConsolidateRequest> {
    let request = ConsolidateRequest {
        scopes,
        steps,
        restore: restore
            .iter()
            .map(|id| engram_schema::EventId::parse(id))
            .collect::<Result<_, _>>()?,
        apply: false,
        consistency,
    };
    request.validate()?;
    Ok(request)
}

pub async fn run(
    config: &Config,
    scope: ScopeArgs,
    steps: Vec<String>,
    restore: Vec<String>,
    dry_run: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let request = request(scope.to_request()?, steps, &restore, scope.consistency())?;
    let client = super::connect(config).await?;
    let (events, receipts) = if dry_run {
        let plan: proto::ConsolidateResponse = engram_rpc::call(
            client.bus().client(),
            proto::CONSOLIDATE,
            &request,
            std::time::Duration::from_secs(30),
        )
        .await?;
        (plan.events, Vec::new())
    } else {
        client.consolidate(&request).await?
    };
    let mut failed = 0;
    for (i, event) in events.iter().enumerate() {
        let receipt = receipts.get(i);
        if let Some(Err(_)) = receipt {
            failed += 1;
        }
        let data = event.content.data.as_ref();
        let field = |name: &str| data.and_then(|d| d.get(name)).cloned();
        if json {
            let mut line = serde_json::json!({
                "event_id": event.event_id,
                "kind": event.kind,
                "text": event.content.text,
                "data": event.content.data,
            });
            match receipt {
                Some(Ok(r)) => {
                    line["seq"] = r.seq.into();
                    line["duplicate"] = r.duplicate.into();
                }
                Some(Err(e)) => line["error"] = e.to_string().into(),
                None => {}
            }
            println!("{line}");
        } else {
            let what = match field("op") {
                Some(serde_json::Value::String(op)) => op,
                _ if field("archived").is_some() => "archived".to_owned(),
                _ => "superseded".to_owned(),
            };
            let status = match receipt {
                Some(Ok(r)) if r.duplicate => format!("seq {} (already stored)", r.seq),
                Some(Ok(r)) => format!("seq {}", r.seq),
                Some(Err(e)) => format!("NOT APPENDED: {e}"),
                None => "planned".to_owned(),
            };
            println!(
                "{what:<20} {status:<24} {}",
                one_line(&event.content.text, 90)
            );
        }
    }
    if !json {
        println!(
            "{} event(s) {}",
            events.len(),
            if dry_run {
                "planned (dry run)"
            } else {
                "appended"
            }
        );
    }
    if failed > 0 {
        anyhow::bail!(
            "{failed} event(s) were not appended; run again (ids are stable, nothing is stored twice)"
        );
    }
    Ok(ExitCode::SUCCESS)
}

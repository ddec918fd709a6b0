//! `engram forget`: withdraw memories of one scope from retrieval.

use std::process::ExitCode;

use engram_schema::{EventId, Layer, Scope};

use crate::cli::ForgetArgs;
use crate::config::Config;

pub async fn run(config: &Config, args: ForgetArgs, json: bool) -> anyhow::Result<ExitCode> {
    let scope: Scope = args.scope.parse()?;
    let layer: Layer = args.layer.parse()?;
    let ids = args
        .event_ids
        .iter()
        .map(|id| EventId::parse(id))
        .collect::<Result<Vec<_>, _>>()?;
    let client = super::connect(config).await?;
    let agent = client.agent(&args.tenant, &args.agent, &args.instance)?;
    let receipt = agent
        .forget(scope.clone(), layer, &ids, args.reason)
        .await?;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "ok": true,
                "seq": receipt.seq,
                "duplicate": receipt.duplicate,
                "subject": receipt.subject,
                "event_id": receipt.event_id,
                "forgotten": ids,
            })
        );
    } else {
        println!(
            "forgotten  seq={}  id={}  {} {} of {}/{}  (queries with --min-seq {} no longer see them)",
            receipt.seq,
            receipt.event_id,
            ids.len(),
            if ids.len() == 1 { "memory" } else { "memories" },
            args.tenant,
            scope,
            receipt.seq
        );
    }
    Ok(ExitCode::SUCCESS)
}

//! `engram retrieve` and `engram context`: ask the query service from the shell.

use std::process::ExitCode;

use crate::config::Config;
use engram_memory::MemoryFilter;
use engram_memory::proto::{
    Consistency, ContextRequest, RetrievalMode, RetrieveRequest, ScopeRequest,
};
use engram_schema::{Ident, Layer, Scope};

use crate::cli::{ContextArgs, RetrieveArgs, ScopeArgs};

impl ScopeArgs {
    pub fn to_request(&self) -> anyhow::Result<ScopeRequest> {
        Ok(ScopeRequest {
            tenant: Ident::parse("tenant", self.tenant.as_str())?,
            scope: self.scope.parse::<Scope>()?,
            grants: self
                .grant
                .iter()
                .map(|g| g.parse::<Scope>())
                .collect::<Result<_, _>>()?,
        })
    }

    pub(crate) fn consistency(&self) -> Consistency {
        Consistency {
            min_seq: self.min_seq,
            wait_ms: self.wait_ms,
        }
    }
}

pub async fn retrieve(config: &Config, args: RetrieveArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let mode = match args.mode.as_str() {
        "hybrid" => RetrievalMode::Hybrid,
        "dense" => RetrievalMode::Dense,
        "keyword" | "bm25" => RetrievalMode::Keyword,
        other => anyhow::bail!("unknown mode {other:?}; use hybrid, dense or keyword"),
    };
    let request = RetrieveRequest {
        scopes: args.scope.to_request()?,
        query: args.query,
        vector: None,
        top_k: args.top_k,
        filter: MemoryFilter {
            layers: args
                .layer
                .iter()
                .map(|l| l.parse::<Layer>())
                .collect::<Result<_, _>>()?,
            tags: args.tag,
            min_importance: args.min_importance,
            min_confidence: args.min_confidence,
            ..MemoryFilter::default()
        },
        consistency: args.scope.consistency(),
        mode,
        ranking: None,
    };
    let response = client.retrieve(&request).await?;
    if json {
        println!("{}", serde_json::to_string(&response)?);
        return Ok(ExitCode::SUCCESS);
    }
    if response.results.is_empty() {
        println!("no memories match");
    }
    for (i, r) in response.results.iter().enumerate() {
        println!(
            "{:>2}. [{:.3}] {} {}  (seq {}, {}, dense {}, bm25 {})",
            i + 1,
            r.score,
            r.occurred_at.format("%Y-%m-%d %H:%M"),
            r.text,
            r.seq,
            r.scope,
            r.parts.dense.map_or("-".into(), |d| format!("{d:.3}")),
            r.parts.keyword.map_or("-".into(), |k| format!("{k:.2}")),
        );
        if r.confidence < 1.0 {
            println!(
                "    confidence {:.3}: contradicted or written by a faulty instance",
                r.confidence
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn context(config: &Config, args: ContextArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let request = ContextRequest {
        scopes: args.scope.to_request()?,
        agent_id: Ident::parse("agent", args.agent.as_str())?,
        task: args.task,
        query: args.query,
        vector: None,
        token_budget: args.budget,
        consistency: args.scope.consistency(),
    };
    let context = client.build_context(&request).await?;
    if json {
        println!("{}", serde_json::to_string(&context)?);
    } else {
        print!("{}", context.rendered);
        eprintln!(
            "{} tokens of {} ({} items, {} left out)",
            context.tokens,
            context.token_budget,
            context.items.len(),
            context.dropped
        );
    }
    Ok(ExitCode::SUCCESS)
}

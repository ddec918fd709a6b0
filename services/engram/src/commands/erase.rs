//! `engram erase` and `engram erase verify` (admin): see `engram_sdk::erase`.

use std::process::ExitCode;

use anyhow::Context as _;
use engram_schema::{Ident, Scope, ScopeKind};

use crate::cli::{EraseArgs, EraseCommand, EraseTarget};
use crate::config::Config;

fn target(t: &EraseTarget) -> anyhow::Result<(Ident, Vec<Scope>)> {
    let tenant = Ident::parse("tenant", t.tenant.clone().unwrap_or_default())?;
    let mut scopes = t
        .scope
        .iter()
        .map(|s| s.parse::<Scope>().with_context(|| format!("--scope {s}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some(user) = &t.user {
        scopes.push(Scope::new(ScopeKind::User, user)?);
    }
    anyhow::ensure!(!scopes.is_empty(), "name a --scope or a --user to erase");
    Ok((tenant, scopes))
}

pub async fn run(config: &Config, args: EraseArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let snapshots = &config.projectors.snapshots;
    match args.command {
        Some(EraseCommand::Verify(t)) => {
            let (tenant, scopes) = target(&t)?;
            let traces = client.erasure_traces(&tenant, &scopes, snapshots).await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"tenant": tenant, "traces": traces})
                );
            } else if traces.is_empty() {
                println!("no trace of {} in tenant {tenant}", join(&scopes));
            } else {
                for t in &traces {
                    println!("{}  {}  {} item(s) {}", t.place, t.scope, t.count, t.detail);
                }
            }
            Ok(if traces.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        None => {
            let (tenant, scopes) = target(&args.target)?;
            let by = std::env::var("USER").unwrap_or_else(|_| "admin".into());
            let report = client.erase(&tenant, &scopes, snapshots, &by).await?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "erased {} of tenant {tenant} (audit seq {})",
                    join(&scopes),
                    report.audit_seq
                );
                for (model, n) in &report.read_models {
                    println!("  read model {model}: {n} item(s)");
                }
                println!(
                    "  stream: {} event(s); dead letters: {}; working memory: {}; snapshots: {} cut, {} deleted",
                    report.events_purged,
                    report.dead_letters_erased,
                    report.working_memory_purged,
                    report.snapshots_cut.len(),
                    report.snapshots_deleted
                );
                for gap in &report.incomplete {
                    println!("  NOT DONE: {gap}");
                }
                if report.incomplete.is_empty() {
                    println!("check with `engram erase verify --tenant {tenant} ...`");
                }
            }
            Ok(if report.incomplete.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
    }
}

fn join(scopes: &[Scope]) -> String {
    scopes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

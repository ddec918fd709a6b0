//! `engram doc`: shared documents from the command line.

use std::process::ExitCode;

use anyhow::Context as _;
use engram_memory::proto::{DocRead, DocRequest, DocResponse};
use engram_schema::{Ident, Scope};

use crate::cli::{DocArgs, DocCommand, ScopeArgs};
use crate::config::Config;

fn request(scope: &ScopeArgs, read: DocRead) -> anyhow::Result<DocRequest> {
    Ok(DocRequest {
        scopes: scope.to_request()?,
        read,
        doc_type: None,
        name: None,
        include_bytes: false,
        include_values: false,
        limit: 50,
        consistency: scope.consistency(),
    })
}

fn of_doc(doc: &DocArgs, read: DocRead) -> anyhow::Result<DocRequest> {
    Ok(DocRequest {
        doc_type: Some(Ident::parse("doc_type", doc.doc_type.as_str())?),
        name: Some(Ident::parse("name", doc.name.as_str())?),
        ..request(&doc.scope, read)?
    })
}

fn not_found(doc: &DocArgs) -> anyhow::Error {
    anyhow::anyhow!(
        "no document {}/{} in {}/{}; `engram doc list --tenant {} --scope {}` shows the scope's documents, `engram doc edit` creates one",
        doc.doc_type,
        doc.name,
        doc.scope.tenant,
        doc.scope.scope,
        doc.scope.tenant,
        doc.scope.scope
    )
}

pub async fn run(config: &Config, command: DocCommand, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    match command {
        DocCommand::Show(doc) => {
            let response = client.doc(&of_doc(&doc, DocRead::State)?).await?;
            let Some(summary) = &response.doc else {
                return Err(not_found(&doc));
            };
            if json {
                println!("{}", serde_json::to_string(&response)?);
                return Ok(ExitCode::SUCCESS);
            }
            println!(
                "{}/{} in {}  {} changes from {} events, {} held, last seq {}, {} bytes, {} conflicting field(s)  (visible seq {})",
                summary.doc_type,
                summary.name,
                summary.scope,
                summary.changes,
                summary.events,
                summary.held,
                summary.last_seq,
                summary.bytes,
                response.conflicts.len(),
                response.visible_seq
            );
            println!(
                "{}",
                serde_json::to_string_pretty(
                    summary.value.as_ref().unwrap_or(&serde_json::Value::Null)
                )?
            );
            if response.truncated {
                println!("(cut at the view's depth or size bound)");
            }
        }
        DocCommand::Conflicts(doc) => {
            let response = client.doc(&of_doc(&doc, DocRead::State)?).await?;
            if response.doc.is_none() {
                return Err(not_found(&doc));
            }
            if json {
                for conflict in &response.conflicts {
                    println!("{}", serde_json::to_string(conflict)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            if response.conflicts.is_empty() {
                println!("no conflicting fields");
            }
            for conflict in &response.conflicts {
                let values: Vec<String> = conflict.values.iter().map(|v| v.to_string()).collect();
                println!("{}  {}", conflict.path, values.join("  |  "));
            }
        }
        DocCommand::History { doc, limit } => {
            let response = client
                .doc(&DocRequest {
                    limit,
                    ..of_doc(&doc, DocRead::History)?
                })
                .await?;
            if response.doc.is_none() {
                return Err(not_found(&doc));
            }
            if json {
                for entry in &response.history {
                    println!("{}", serde_json::to_string(entry)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            for h in &response.history {
                println!(
                    "seq {}  {}  {}/{}  {} new change(s), {} applied, {} held  {}",
                    h.seq,
                    h.occurred_at.to_rfc3339(),
                    h.agent_id,
                    h.instance_id,
                    h.changes,
                    h.applied,
                    h.held,
                    h.event_id
                );
            }
        }
        DocCommand::List {
            scope,
            doc_type,
            limit,
        } => {
            let response: DocResponse = client
                .doc(&DocRequest {
                    doc_type: doc_type.map(|t| Ident::parse("doc_type", t)).transpose()?,
                    limit,
                    ..request(&scope, DocRead::List)?
                })
                .await?;
            if json {
                for doc in &response.docs {
                    println!("{}", serde_json::to_string(doc)?);
                }
                return Ok(ExitCode::SUCCESS);
            }
            if response.docs.is_empty() {
                println!("no documents");
            }
            for d in &response.docs {
                println!(
                    "{}  {}/{}  {} changes, {} events, {} held, last seq {}, {} bytes",
                    d.scope, d.doc_type, d.name, d.changes, d.events, d.held, d.last_seq, d.bytes
                );
            }
        }
        DocCommand::Edit {
            doc,
            set,
            delete,
            agent,
            instance,
        } => {
            anyhow::ensure!(
                !set.is_empty() || !delete.is_empty(),
                "nothing to edit: give --set PATH=JSON or --delete PATH"
            );
            // Parse everything before anything is read or sent.
            let sets = set
                .iter()
                .map(|s| {
                    let (path, value) = s.split_once('=').with_context(|| {
                        format!(
                            "--set {s:?}: write PATH=JSON, for example /items/t-7/owner='\"i-3\"'"
                        )
                    })?;
                    let value = serde_json::from_str(value)
                        .unwrap_or_else(|_| serde_json::Value::String(value.to_owned()));
                    Ok((path.to_owned(), value))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let scope: Scope = doc.scope.scope.parse()?;
            let writer = client.agent(&doc.scope.tenant, &agent, &instance)?;
            let edit = writer
                .edit_doc(
                    scope,
                    &doc.doc_type,
                    &doc.name,
                    doc.scope.min_seq,
                    &sets,
                    &delete,
                )
                .await?;
            let (receipt, conflicts) = (edit.receipt, edit.conflicts.len());
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "ok": true,
                        "seq": receipt.seq,
                        "event_id": receipt.event_id,
                        "subject": receipt.subject,
                        "conflicts": conflicts,
                    })
                );
            } else {
                println!(
                    "edited {}/{}  seq={}  id={}  (`engram doc show` with --min-seq {} shows it merged)",
                    doc.doc_type, doc.name, receipt.seq, receipt.event_id, receipt.seq
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

//! `engram digest`: one scope's state, per read model, as a hash that is the same on every
//! side that holds the same events: a leaf and its hub once synced, or two hubs rebuilt.
//!
//! Each side numbers its events its own way (a leaf's stream is not the hub's), so the
//! digest leaves out stream sequences and the ids made of them, and compares what the
//! models say:
//! - **events**: the scope's event ids, sorted;
//! - **facts**: every fact version (history included), as the fact table gives it;
//! - **docs**: each document's heads (its change history), value and conflicts;
//! - **skills**: the scope's skills as the registry gives them.
//!
//! Lists of records (a fact's sources, for one) are compared as sets, since two sides may
//! have merged the same events in different orders.

use std::process::ExitCode;

use engram_bus::{ReadError, StartAt};
use engram_memory::proto::{DocRead, DocRequest, FactsRequest, SkillsRequest};
use engram_schema::SubjectFilter;
use futures::StreamExt as _;
use serde_json::Value;

use crate::cli::ScopeArgs;
use crate::config::Config;

/// Keys that differ from side to side by construction.
fn side_specific(key: &str) -> bool {
    matches!(key, "id" | "seq" | "score" | "superseded_by") || key.ends_with("_seq")
}

/// `value` without what differs from side to side, with lists of records sorted.
fn canonical(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (k, v) in map {
                if k == "superseded_by" {
                    // Which fact supersedes it is a seq; that one does is the same everywhere.
                    out.insert("superseded".into(), Value::Bool(!v.is_null()));
                } else if !side_specific(k) {
                    out.insert(k.clone(), canonical(v));
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => {
            let mut items: Vec<Value> = items.iter().map(canonical).collect();
            if items.iter().all(Value::is_object) {
                items.sort_by_key(ToString::to_string);
            }
            Value::Array(items)
        }
        other => other.clone(),
    }
}

fn hash(values: &[Value]) -> String {
    let mut lines: Vec<String> = values.iter().map(ToString::to_string).collect();
    lines.sort();
    let mut h = blake3::Hasher::new();
    for l in &lines {
        h.update(l.as_bytes());
        h.update(b"\n");
    }
    h.finalize().to_hex()[..32].to_owned()
}

pub async fn run(config: &Config, args: &ScopeArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let mut scopes = args.to_request()?;
    // The scope's own state: grants would mix in other scopes.
    scopes.grants.clear();
    let consistency = args.consistency();

    let filter = SubjectFilter::all()
        .tenant(scopes.tenant.clone())
        .scope(scopes.scope.kind, scopes.scope.id.clone());
    let mut stream = client.replay(&filter, StartAt::Beginning).await?;
    let mut ids = Vec::new();
    // The registry answers by name or by task, never with a listing: the names recorded
    // in the scope are what to ask for.
    let mut skill_names = std::collections::BTreeSet::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(stored) => {
                if stored.event.kind == engram_schema::EventKind::SkillRecorded
                    && let Ok(skill) = engram_schema::SkillRecorded::from_event(&stored.event)
                {
                    skill_names.insert(skill.name);
                }
                ids.push(Value::String(stored.event.event_id.to_string()));
            }
            Err(ReadError::Decode { .. }) => {}
            Err(e @ ReadError::Consumer(_)) => return Err(e.into()),
        }
    }

    let max = engram_memory::proto::limits::MAX_LIMIT;
    let facts = client
        .facts(&FactsRequest {
            scopes: scopes.clone(),
            subject: None,
            predicate: None,
            text: None,
            valid_at: None,
            known_at: None,
            history: false,
            limit: max,
            consistency,
        })
        .await?
        .facts
        .iter()
        .map(canonical)
        .collect::<Vec<_>>();

    let docs = client
        .doc(&DocRequest {
            scopes: scopes.clone(),
            read: DocRead::List,
            doc_type: None,
            name: None,
            include_bytes: false,
            include_values: false,
            limit: engram_memory::proto::limits::MAX_DOC_ITEMS,
            consistency,
        })
        .await?;
    let mut doc_states = Vec::new();
    for doc in &docs.docs {
        let state = client
            .doc(&DocRequest {
                scopes: scopes.clone(),
                read: DocRead::State,
                doc_type: Some(doc.doc_type.clone()),
                name: Some(doc.name.clone()),
                include_bytes: false,
                include_values: false,
                limit: 1,
                consistency,
            })
            .await?;
        let Some(summary) = state.doc else { continue };
        doc_states.push(serde_json::json!({
            "doc_type": summary.doc_type,
            "name": summary.name,
            "heads": summary.heads,
            "value": summary.value,
            "held": summary.held,
            "conflicts": canonical(&serde_json::to_value(&state.conflicts)?),
        }));
    }

    let mut skills = Vec::new();
    for name in skill_names.iter().take(max) {
        let answer = client
            .skills(&SkillsRequest {
                scopes: scopes.clone(),
                task: None,
                name: Some(name.clone()),
                limit: 1,
                consistency,
            })
            .await?;
        skills.extend(answer.skills.iter().map(canonical));
    }

    let models = [
        ("events", ids.len(), hash(&ids)),
        ("facts", facts.len(), hash(&facts)),
        ("docs", doc_states.len(), hash(&doc_states)),
        ("skills", skills.len(), hash(&skills)),
    ];
    if json {
        let map: serde_json::Map<String, Value> = models
            .iter()
            .map(|(name, n, h)| {
                (
                    (*name).to_owned(),
                    serde_json::json!({"count": n, "digest": h}),
                )
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"tenant": scopes.tenant, "scope": scopes.scope, "models": map})
        );
    } else {
        println!("{}/{}", scopes.tenant, scopes.scope);
        for (name, n, h) in models {
            println!("  {name:<7} {n:>6}  {h}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_and_record_order_do_not_change_a_digest_but_content_does() {
        let a = serde_json::json!({"id": 7, "subject": "alice", "superseded_by": 9,
            "sources": [{"seq": 3, "event_id": "x"}, {"seq": 4, "event_id": "y"}]});
        let b = serde_json::json!({"id": 12, "subject": "alice", "superseded_by": 40,
            "sources": [{"seq": 30, "event_id": "y"}, {"seq": 2, "event_id": "x"}]});
        let c = serde_json::json!({"id": 12, "subject": "alice", "superseded_by": null,
            "sources": [{"seq": 30, "event_id": "y"}, {"seq": 2, "event_id": "x"}]});
        assert_eq!(hash(&[canonical(&a)]), hash(&[canonical(&b)]));
        assert_ne!(hash(&[canonical(&a)]), hash(&[canonical(&c)]));
    }
}

//! `engram facts`: the fact table from the shell, now, at a valid or transaction time, or
//! one fact's history.

use std::process::ExitCode;

use chrono::{DateTime, Utc};
use engram_memory::proto::FactsRequest;
use serde_json::Value;

use crate::cli::FactsArgs;
use crate::config::Config;
use crate::output::one_line;

pub async fn run(config: &Config, args: FactsArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let request = FactsRequest {
        scopes: args.scope.to_request()?,
        subject: args.subject,
        predicate: args.predicate,
        text: args.text,
        valid_at: args.as_of,
        known_at: args.known_at,
        history: args.history,
        limit: args.limit,
        consistency: args.scope.consistency(),
    };
    let response = client.facts(&request).await?;
    if json {
        for fact in &response.facts {
            println!("{}", serde_json::to_string(fact)?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if response.facts.is_empty() {
        println!("no facts match");
    } else {
        print!("{}", table(&response.facts, Utc::now()));
    }
    Ok(ExitCode::SUCCESS)
}

/// The facts as an aligned text table, one row each: id, subject, predicate, object, valid
/// time, status (as of `now`) and the agents that asserted it.
pub fn table(facts: &[Value], now: DateTime<Utc>) -> String {
    let header = [
        "fact",
        "subject",
        "predicate",
        "object",
        "valid",
        "status",
        "by",
    ];
    let rows: Vec<[String; 7]> = facts.iter().map(|f| row(f, now)).collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(padded.join("  ").trim_end());
        out.push('\n');
    };
    line(&header.map(String::from));
    for row in &rows {
        line(row);
    }
    out
}

fn row(fact: &Value, now: DateTime<Utc>) -> [String; 7] {
    let text = |key: &str| fact[key].as_str().unwrap_or("-").to_owned();
    let time = |key: &str| {
        fact[key]
            .as_str()
            .and_then(|t| t.parse::<DateTime<Utc>>().ok())
    };
    let object = match &fact["object"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let shown = |t: Option<DateTime<Utc>>| {
        t.map_or_else(
            || "open".to_owned(),
            |t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
        )
    };
    let (from, to) = (time("valid_from"), time("valid_to"));
    let status = if !fact["retracted_at"].is_null() {
        "retracted".to_owned()
    } else if let Some(by) = fact["superseded_by"].as_u64() {
        format!("superseded by fact@{by}")
    } else if to.is_some_and(|to| to <= now) {
        "ended".to_owned()
    } else {
        "current".to_owned()
    };
    let mut agents: Vec<&str> = fact["sources"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["provenance"]["agent_id"].as_str())
        .collect();
    agents.dedup();
    [
        format!("fact@{}", fact["id"]),
        one_line(&text("subject"), 40),
        one_line(&text("predicate"), 40),
        one_line(&object, 50),
        format!("{} -> {}", shown(from), shown(to)),
        status,
        agents.join(","),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_superseded_fact_and_its_successor_line_up() {
        let facts = vec![
            serde_json::json!({
                "id": 3, "subject": "db", "predicate": "runs", "object": "postgres 15",
                "valid_from": "2026-12-01T08:00:00Z", "valid_to": "2026-12-01T09:00:00Z",
                "retracted_at": null, "superseded_by": 5,
                "sources": [{"provenance": {"agent_id": "a1"}}],
            }),
            serde_json::json!({
                "id": 5, "subject": "db", "predicate": "runs", "object": {"major": 16},
                "valid_from": "2026-12-01T09:00:00Z", "valid_to": null,
                "retracted_at": null, "superseded_by": null,
                "sources": [{"provenance": {"agent_id": "a2"}}],
            }),
        ];
        let now = "2026-12-01T10:00:00Z".parse().unwrap();
        let table = table(&facts, now);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(lines[0].starts_with("fact "), "{table}");
        assert!(lines[1].contains("postgres 15") && lines[1].contains("superseded by fact@5"));
        assert!(lines[2].contains(r#"{"major":16}"#) && lines[2].contains("current"));
        assert!(lines[2].contains("2026-12-01 09:00:00.000 -> open") && lines[2].ends_with("a2"));
        // Columns are aligned: the status column starts at the same place in every row.
        let at = |l: &str, s: &str| l.find(s).unwrap();
        assert_eq!(at(lines[0], "status"), at(lines[1], "superseded"));
        assert_eq!(at(lines[0], "status"), at(lines[2], "current"));
    }
}

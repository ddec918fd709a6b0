//! `engram skills`: one skill by name, or the skills best matching a task.

use std::process::ExitCode;

use engram_memory::proto::SkillsRequest;
use serde_json::Value;

use crate::cli::SkillsArgs;
use crate::config::Config;
use crate::output::one_line;

pub async fn run(config: &Config, args: SkillsArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let request = SkillsRequest {
        scopes: args.scope.to_request()?,
        task: args.task,
        name: args.name,
        limit: args.limit,
        consistency: args.scope.consistency(),
    };
    let response = client.skills(&request).await?;
    if json {
        for skill in &response.skills {
            println!("{}", serde_json::to_string(skill)?);
        }
        return Ok(ExitCode::SUCCESS);
    }
    if response.skills.is_empty() {
        println!("no skills match");
    }
    for skill in &response.skills {
        print!("{}", describe(skill));
    }
    Ok(ExitCode::SUCCESS)
}

/// A skill as a few readable lines: name, version, score and track record, then its steps.
pub fn describe(skill: &Value) -> String {
    let successes = skill["successes"].as_u64().unwrap_or(0);
    let failures = skill["failures"].as_u64().unwrap_or(0);
    let mut out = format!(
        "{} v{}  [{:.3}]  {} succeeded, {} failed  {}\n",
        skill["name"].as_str().unwrap_or("-"),
        skill["version"],
        skill["score"].as_f64().unwrap_or(0.0),
        successes,
        failures,
        one_line(skill["description"].as_str().unwrap_or(""), 100),
    );
    for (i, step) in skill["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .enumerate()
    {
        out.push_str(&format!("    {}. {}\n", i + 1, one_line(step, 100)));
    }
    out
}

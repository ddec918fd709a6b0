//! `engram tenant|agent|grant`: the access registry, appended to with the admin's
//! credentials. The running `engram up` folds each record into the server's authorization
//! (a key added or revoked takes effect with a config reload, moments later).

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use engram_access::{AccessLog, Credentials, Grantee, Record, ScopePattern};
use engram_schema::Ident;

use crate::cli::{AgentCommand, GrantCommand, KeyCommand, TenantCommand};
use crate::config::Config;

fn ident(field: &'static str, value: &str) -> anyhow::Result<Ident> {
    Ok(Ident::parse(field, value)?)
}

async fn log(config: &Config) -> anyhow::Result<AccessLog> {
    let client = super::connect(config).await?;
    Ok(AccessLog::new(client.bus().client().clone()))
}

/// Who appends, for the audit trail: the OS user on this machine.
fn by() -> String {
    std::env::var("USER").unwrap_or_else(|_| "admin".into())
}

fn print(json: bool, value: serde_json::Value, text: String) {
    if json {
        println!("{value}");
    } else {
        println!("{text}");
    }
}

pub async fn tenant(
    config: &Config,
    command: TenantCommand,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let log = log(config).await?;
    match command {
        TenantCommand::Add { tenant } => {
            let tenant = ident("tenant", &tenant)?;
            let seq = log
                .append(
                    Record::TenantAdded {
                        tenant: tenant.clone(),
                    },
                    &by(),
                )
                .await?;
            print(
                json,
                serde_json::json!({"tenant": tenant, "seq": seq}),
                format!(
                    "tenant {tenant} added (seq {seq}); issue agent credentials with `engram agent add --tenant {tenant} --agent <name>`"
                ),
            );
        }
        TenantCommand::List => {
            let registry = log.load().await?;
            for (name, t) in &registry.tenants {
                let agents = t
                    .agents
                    .values()
                    .filter(|a| a.active_keys().next().is_some())
                    .count();
                print(
                    json,
                    serde_json::json!({"tenant": name, "added_at": t.added_at, "agents": agents, "grants": t.grants.len()}),
                    format!(
                        "{name}  agents {agents}  grants {}  added {}",
                        t.grants.len(),
                        t.added_at.map(|a| a.to_rfc3339()).unwrap_or_default()
                    ),
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn agent(config: &Config, command: AgentCommand, json: bool) -> anyhow::Result<ExitCode> {
    let log = log(config).await?;
    match command {
        AgentCommand::Add {
            tenant,
            agent,
            scope,
            out,
        } => {
            let tenant = ident("tenant", &tenant)?;
            let agent = ident("agent", &agent)?;
            let (creds, scopes, seq) = issue(&log, &tenant, &agent, &scope).await?;
            let key = creds.public_key();
            let path = out.unwrap_or_else(|| {
                engram_access::creds::agent_path(&config.home, &tenant, &agent, &key)
            });
            creds.save(&path)?;
            let shown: Vec<String> = scopes.iter().map(ToString::to_string).collect();
            print(
                json,
                serde_json::json!({"tenant": tenant, "agent": agent, "key": key, "scopes": shown, "creds": path, "seq": seq}),
                format!(
                    "agent {agent} of tenant {tenant}: key {key}, scopes {}\ncredentials: {}\nconnect with `engram --creds {} ...`, or engram_sdk::Client::connect_with_creds",
                    shown.join(" "),
                    path.display(),
                    path.display()
                ),
            );
        }
        AgentCommand::List { tenant } => {
            let registry = log.load().await?;
            let wanted = tenant.map(|t| ident("tenant", &t)).transpose()?;
            for (t, tenant) in registry
                .tenants
                .iter()
                .filter(|(t, _)| wanted.as_ref().is_none_or(|w| w == *t))
            {
                for (name, agent) in &tenant.agents {
                    let scopes: Vec<String> =
                        agent.scopes.iter().map(ToString::to_string).collect();
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({"tenant": t, "agent": name, "scopes": scopes, "keys": agent.keys})
                        );
                        continue;
                    }
                    println!("{t}/{name}  scopes {}", scopes.join(" "));
                    for k in &agent.keys {
                        match k.revoked_at {
                            None => println!("  {}  live since {}", k.key, k.added_at.to_rfc3339()),
                            Some(at) => println!("  {}  revoked {}", k.key, at.to_rfc3339()),
                        }
                    }
                }
            }
        }
        AgentCommand::Revoke { tenant, agent, key } => {
            let tenant = ident("tenant", &tenant)?;
            let agent = ident("agent", &agent)?;
            let started = Instant::now();
            let seq = log
                .append(
                    Record::AgentRevoked {
                        tenant: tenant.clone(),
                        agent: agent.clone(),
                        key: key.clone(),
                    },
                    &by(),
                )
                .await?;
            print(
                json,
                serde_json::json!({"tenant": tenant, "agent": agent, "key": key, "seq": seq, "appended_ms": started.elapsed().as_millis() as u64}),
                format!(
                    "revoked {} of agent {agent} of tenant {tenant} (seq {seq}); the running engram up reloads the server's authorization and closes their connections (see engram_access_enforce_seconds)",
                    key.as_deref().unwrap_or("every key")
                ),
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A fresh key pair for `agent` of `tenant`, registered with `scopes` (the defaults when
/// none are given); the registry's sequence with it.
pub(crate) async fn issue(
    log: &AccessLog,
    tenant: &Ident,
    agent: &Ident,
    scope: &[String],
) -> anyhow::Result<(Credentials, Vec<ScopePattern>, u64)> {
    let scopes = if scope.is_empty() {
        ScopePattern::defaults(agent)
    } else {
        scope
            .iter()
            .map(|s| s.parse::<ScopePattern>())
            .collect::<Result<Vec<_>, _>>()?
    };
    let creds = Credentials::generate_agent(tenant.clone(), agent.clone());
    let seq = log
        .append(
            Record::AgentKeyAdded {
                tenant: tenant.clone(),
                agent: agent.clone(),
                key: creds.public_key(),
                scopes: scopes.clone(),
                expires_at: None,
            },
            &by(),
        )
        .await?;
    Ok((creds, scopes, seq))
}

pub async fn key(config: &Config, command: KeyCommand, json: bool) -> anyhow::Result<ExitCode> {
    let log = log(config).await?;
    match command {
        KeyCommand::Add {
            tenant,
            agent,
            scope,
            read_all,
        } => {
            let (tenant, agent) = (ident("tenant", &tenant)?, ident("agent", &agent)?);
            let (creds, scopes, mut seq) = issue(&log, &tenant, &agent, &scope).await?;
            if read_all {
                for kind in engram_schema::ScopeKind::ALL {
                    seq = log
                        .append(
                            Record::GrantAdded {
                                tenant: tenant.clone(),
                                to: Grantee::Agent(agent.clone()),
                                scope: ScopePattern {
                                    kind: *kind,
                                    id: None,
                                },
                            },
                            &by(),
                        )
                        .await?;
                }
            }
            let api_key = creds.api_key().expect("agent credentials have an API key");
            let shown: Vec<String> = scopes.iter().map(ToString::to_string).collect();
            print(
                json,
                serde_json::json!({"tenant": tenant, "agent": agent, "key": creds.public_key(), "scopes": shown, "api_key": api_key, "seq": seq}),
                format!(
                    "API key for agent {agent} of tenant {tenant} (public key {}, scopes {}); shown once, keep it secret:\n{api_key}",
                    creds.public_key(),
                    shown.join(" ")
                ),
            );
        }
        KeyCommand::List { tenant, agent, all } => {
            let registry = log.load().await?;
            let tenant = tenant.map(|t| ident("tenant", &t)).transpose()?;
            let agent = agent.map(|a| ident("agent", &a)).transpose()?;
            let mut rows = Vec::new();
            for (t, entry) in &registry.tenants {
                if tenant.as_ref().is_some_and(|w| w != t) {
                    continue;
                }
                for (name, a) in &entry.agents {
                    if agent.as_ref().is_some_and(|w| w != name) {
                        continue;
                    }
                    for k in a.keys.iter().filter(|k| all || k.revoked_at.is_none()) {
                        rows.push((t, name, k, &a.scopes));
                    }
                }
            }
            // Live first, then newest first.
            rows.sort_by_key(|(_, _, k, _)| {
                (k.revoked_at.is_some(), std::cmp::Reverse(k.added_at))
            });
            for (t, name, k, scopes) in rows {
                let scopes: Vec<String> = scopes.iter().map(ToString::to_string).collect();
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"tenant": t, "agent": name, "key": k.key, "added_at": k.added_at, "revoked_at": k.revoked_at, "scopes": scopes})
                    );
                    continue;
                }
                let state = match k.revoked_at {
                    None => format!("live since {}", k.added_at.to_rfc3339()),
                    Some(at) => format!("revoked {}", at.to_rfc3339()),
                };
                println!(
                    "{t}/{name}  {}  {state}  scopes {}",
                    k.key,
                    scopes.join(" ")
                );
            }
        }
        KeyCommand::Revoke { tenant, agent, key } => {
            return Box::pin(self::agent(
                config,
                AgentCommand::Revoke {
                    tenant,
                    agent,
                    key: Some(key),
                },
                json,
            ))
            .await;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn grant(config: &Config, command: GrantCommand, json: bool) -> anyhow::Result<ExitCode> {
    let log = log(config).await?;
    let parse = |tenant: &str, agent: &str, scope: &str| -> anyhow::Result<_> {
        Ok((
            ident("tenant", tenant)?,
            agent.parse::<Grantee>()?,
            scope.parse::<ScopePattern>().context("--scope")?,
        ))
    };
    let adding = matches!(command, GrantCommand::Add { .. });
    match command {
        GrantCommand::Add {
            tenant,
            agent,
            scope,
        }
        | GrantCommand::Revoke {
            tenant,
            agent,
            scope,
        } => {
            let (tenant, to, scope) = parse(&tenant, &agent, &scope)?;
            let (t, g, p) = (tenant.clone(), to.clone(), scope.clone());
            let record = if adding {
                Record::GrantAdded {
                    tenant: t,
                    to: g,
                    scope: p,
                }
            } else {
                Record::GrantRevoked {
                    tenant: t,
                    to: g,
                    scope: p,
                }
            };
            let seq = log.append(record, &by()).await?;
            let done = if adding {
                format!("granted {scope} to {to}")
            } else {
                format!("revoked the grant of {scope} to {to}")
            };
            print(
                json,
                serde_json::json!({"tenant": tenant, "agent": to.to_string(), "scope": scope.to_string(), "seq": seq}),
                format!("{done} in tenant {tenant} (seq {seq})"),
            );
        }
        GrantCommand::List { tenant } => {
            let registry = log.load().await?;
            let wanted = tenant.map(|t| ident("tenant", &t)).transpose()?;
            for (t, tenant) in registry
                .tenants
                .iter()
                .filter(|(t, _)| wanted.as_ref().is_none_or(|w| w == *t))
            {
                for ((to, scope), at) in &tenant.grants {
                    print(
                        json,
                        serde_json::json!({"tenant": t, "agent": to.to_string(), "scope": scope.to_string(), "granted_at": at}),
                        format!("{t}  {to}  reads {scope}  since {}", at.to_rfc3339()),
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

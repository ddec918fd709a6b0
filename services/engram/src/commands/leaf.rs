//! `engram leaf add|list|remove|status`: a hub's leaf nodes, and a leaf's view of its link.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use engram_access::leaf::{LeafCredentials, OUTBOX_STREAM, api_prefix, check_name};
use engram_access::{AccessLog, Record, ScopePattern};
use engram_schema::{Ident, ScopeKind};

use crate::cli::LeafCommand;
use crate::config::Config;

fn by() -> String {
    std::env::var("USER").unwrap_or_else(|_| "admin".into())
}

pub async fn run(config: &Config, command: LeafCommand, json: bool) -> anyhow::Result<ExitCode> {
    let client = super::connect(config).await?;
    let bus = client.bus();
    let log = AccessLog::new(bus.client().clone());
    let names = crate::up::access_names(config);
    match command {
        LeafCommand::Add {
            name,
            tenant,
            scope,
            out,
        } => {
            let leaf = Ident::parse("leaf", &name)?;
            let tenant = Ident::parse("tenant", &tenant)?;
            check_name(&leaf, &names.js_domain)?;
            let scopes = if scope.is_empty() {
                vec![
                    ScopePattern::any(ScopeKind::Task),
                    ScopePattern::any(ScopeKind::Session),
                ]
            } else {
                scope
                    .iter()
                    .map(|s| s.parse::<ScopePattern>())
                    .collect::<Result<Vec<_>, _>>()?
            };
            // The key first: the record names its public half.
            let placeholder = engram_access::leaf::LeafSpec {
                name: leaf.clone(),
                tenant: tenant.clone(),
                writes: scopes.clone(),
                reads: scopes.clone(),
            };
            let mut creds =
                LeafCredentials::generate(&placeholder, &names, config.bus.stream.partitions);
            let seq = log
                .append(
                    Record::LeafAdded {
                        tenant: tenant.clone(),
                        leaf: leaf.clone(),
                        key: creds.public_key(),
                        scopes,
                    },
                    &by(),
                )
                .await?;
            let registry = log.load().await?;
            let spec = registry
                .live_leaves()
                .map(|(_, l)| l)
                .find(|l| l.name == leaf)
                .context("the leaf is not in the registry after its record was appended")?;
            creds.writes = spec.writes.clone();
            creds.reads = spec.reads.clone();
            let path = out.unwrap_or_else(|| {
                config
                    .home
                    .join("leaves")
                    .join(format!("{}.creds", leaf.as_str()))
            });
            creds.save(&path)?;
            reconcile(bus, &log, config).await?;
            let url = config.nats.leafnodes_listen.map_or_else(
                || "nats-leaf://<hub host>:<port>".to_owned(),
                |a| format!("nats-leaf://{a}"),
            );
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "leaf": leaf, "tenant": tenant, "seq": seq,
                        "creds": path, "writes": spec.writes.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "reads": spec.reads.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "domain": leaf, "hub_domain": names.js_domain,
                    })
                );
            } else {
                println!(
                    "leaf {leaf} of tenant {tenant} added (seq {seq}); credentials in {}\non the leaf's machine run:\n  engram up --leaf {url} --creds {}",
                    path.display(),
                    path.display()
                );
                if config.nats.leafnodes_listen.is_none() {
                    println!(
                        "note: this hub accepts no leaf connections yet; start it with --leaf-listen 0.0.0.0:7422 (nats.leafnodes_listen)"
                    );
                }
            }
        }
        LeafCommand::List { tenant } => {
            let registry = log.load().await?;
            let lag = source_lags(bus, config).await;
            let mut rows = Vec::new();
            for (t, l) in registry.live_leaves() {
                if tenant.as_deref().is_some_and(|want| want != t.as_str()) {
                    continue;
                }
                let (lag, active) = lag
                    .iter()
                    .find(|(name, _, _)| *name == l.name.as_str())
                    .map_or((0, None), |(_, lag, active)| (*lag, *active));
                rows.push(serde_json::json!({
                    "leaf": l.name, "tenant": t,
                    "writes": l.writes.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "reads": l.reads.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "lag": lag,
                    "last_seen_ms": active.map(|a: Duration| a.as_millis() as u64),
                }));
            }
            if json {
                println!("{}", serde_json::Value::Array(rows));
            } else if rows.is_empty() {
                println!("no leaves; add one with `engram leaf add <name> --tenant <tenant>`");
            } else {
                for r in rows {
                    println!(
                        "{}  tenant={}  writes={}  lag={}  last_seen={}",
                        r["leaf"].as_str().unwrap_or_default(),
                        r["tenant"].as_str().unwrap_or_default(),
                        r["writes"],
                        r["lag"],
                        r["last_seen_ms"]
                            .as_u64()
                            .map_or("never".to_owned(), |ms| format!("{ms} ms ago"))
                    );
                }
            }
        }
        LeafCommand::Remove { name, tenant } => {
            let leaf = Ident::parse("leaf", &name)?;
            let tenant = Ident::parse("tenant", &tenant)?;
            let seq = log
                .append(
                    Record::LeafRevoked {
                        tenant: tenant.clone(),
                        leaf: leaf.clone(),
                    },
                    &by(),
                )
                .await?;
            reconcile(bus, &log, config).await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({"leaf": leaf, "tenant": tenant, "seq": seq})
                );
            } else {
                println!(
                    "leaf {leaf} of tenant {tenant} removed (seq {seq}); its key is refused once the running engram up reloads, and its events are no longer sourced"
                );
            }
        }
        LeafCommand::Status => {
            let js = bus.jetstream();
            let link = engram_leaf::local::link_status(js, Duration::from_secs(15)).await?;
            let (up, down) = engram_leaf::relay::pending(js, &config.bus.stream.name).await;
            let outbox = match js.get_stream(OUTBOX_STREAM).await {
                Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
                Err(_) => 0,
            };
            let linked = link.sources > 0 && link.active == link.sources;
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "linked": linked, "sources": link.sources, "active": link.active,
                        "hub_lag": link.lag, "up_pending": up, "down_pending": down,
                        "outbox": outbox, "inbox_filters": link.filters,
                    })
                );
            } else {
                println!(
                    "link: {}  ({} of {} sources active)\nhub events not yet received: {}\nwaiting to go up: {up}  waiting to come in: {down}  outbox holds: {outbox}",
                    if linked { "up" } else { "down" },
                    link.active,
                    link.sources,
                    link.lag
                );
                println!("receives: {}", link.filters.join("  "));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Makes the events stream source exactly the live leaves' outboxes, and the hub's leaf
/// artifacts buckets their leaves' buckets.
async fn reconcile(bus: &engram_bus::Bus, log: &AccessLog, config: &Config) -> anyhow::Result<()> {
    let registry = log.load().await?;
    let leaves: Vec<_> = registry.live_leaves().map(|(_, l)| l).collect();
    engram_leaf::hub::reconcile_sources(bus.jetstream(), &config.bus.stream.name, &leaves)
        .await
        .context("updating the events stream's leaf sources")?;
    engram_leaf::hub::reconcile_artifacts(bus.jetstream(), &leaves, bus.replicas())
        .await
        .context("updating the leaves' artifacts buckets")?;
    Ok(())
}

/// Each leaf source's lag and when it was last active, by leaf name (from its API prefix).
async fn source_lags(
    bus: &engram_bus::Bus,
    config: &Config,
) -> Vec<(String, u64, Option<Duration>)> {
    let Ok(mut stream) = bus.jetstream().get_stream(&config.bus.stream.name).await else {
        return Vec::new();
    };
    let Ok(info) = stream.info().await else {
        return Vec::new();
    };
    let configured = info.config.sources.clone().unwrap_or_default();
    let mut out: Vec<(String, u64, Option<Duration>)> = Vec::new();
    for s in &info.sources {
        // A source's info names the stream, not the leaf: match it to the configured
        // source by its filter (each leaf's transforms name its tenant and scopes), then
        // take the leaf from that source's API prefix.
        let Some(conf) = configured.iter().find(|c| {
            c.name == s.name
                && c.subject_transforms.first().map(|t| &t.source)
                    == s.subject_transforms.first().map(|t| &t.source)
        }) else {
            continue;
        };
        let Some(ext) = &conf.external else { continue };
        let leaf = ext
            .api_prefix
            .strip_prefix("$JS.")
            .and_then(|r| r.strip_suffix(".API"))
            .unwrap_or_default()
            .to_owned();
        debug_assert_eq!(api_prefix(&leaf), ext.api_prefix);
        match out.iter_mut().find(|(name, _, _)| *name == leaf) {
            Some(row) => {
                row.1 += s.lag;
                row.2 = match (row.2, s.active) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            None => out.push((leaf, s.lag, s.active)),
        }
    }
    out
}

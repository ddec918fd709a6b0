//! The leaf's side: its outbox (its own events, waiting for the hub to source them) and its
//! inbox (the hub's events for the scopes it may read, sourced from the hub's domain and
//! waiting for the relay).

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use engram_access::leaf::{
    INBOX_STREAM, LeafCredentials, OUTBOX_PREFIX, OUTBOX_STREAM, api_prefix, down_prefix,
    normalize, scope_filter, working_filter, working_stream,
};
use engram_schema::SUBJECT_PREFIX;

use crate::{LeafError, js_err};

/// How the leaf keeps what it has not handed on yet.
#[derive(Clone, Debug)]
pub struct Retention {
    /// How long the outbox keeps an event the hub has not sourced: the longest the leaf may
    /// stay offline without losing what it wrote. The inbox keeps the hub's as long.
    pub outbox_max_age: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            outbox_max_age: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

pub fn outbox_config(retention: &Retention) -> stream::Config {
    stream::Config {
        name: OUTBOX_STREAM.to_owned(),
        description: Some("engram leaf: this leaf's own events, sourced by the hub".into()),
        subjects: vec![format!("{OUTBOX_PREFIX}.>")],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        max_age: retention.outbox_max_age,
        // The relay's own retries after a crash come within seconds.
        duplicate_window: Duration::from_secs(10 * 60),
        ..Default::default()
    }
}

/// The inbox: one source of the hub's events stream per scope the leaf may read, delivered
/// on the leaf's own prefix (the only one its connection may receive on), kept as long as
/// the outbox keeps its events.
pub fn inbox_config(creds: &LeafCredentials, retention: &Retention) -> stream::Config {
    let sources = normalize(creds.reads.clone())
        .iter()
        .map(|pattern| stream::Source {
            name: creds.events_stream.clone(),
            filter_subject: Some(scope_filter(SUBJECT_PREFIX, &creds.tenant, pattern)),
            external: Some(stream::External {
                api_prefix: api_prefix(&creds.hub_domain),
                delivery_prefix: Some(down_prefix(&creds.leaf)),
            }),
            ..Default::default()
        })
        .collect::<Vec<_>>();
    stream::Config {
        name: INBOX_STREAM.to_owned(),
        description: Some("engram leaf: the hub's events, waiting for the relay".into()),
        storage: stream::StorageType::File,
        // Not a work queue: the last event each source delivered must stay, since that is
        // where the server resumes the source after a restart or a resume
        // ([`crate::link`]). The relay's own consumer keeps its place.
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        max_age: retention.outbox_max_age,
        duplicate_window: Duration::from_secs(10 * 60),
        sources: (!sources.is_empty()).then_some(sources),
        ..Default::default()
    }
}

/// Creates the outbox and the inbox, or brings an existing inbox's sources up to date with
/// `creds` (a source kept as it was resumes where it stopped).
pub async fn provision(
    js: &jetstream::Context,
    creds: &LeafCredentials,
    retention: &Retention,
) -> Result<(), LeafError> {
    for config in [outbox_config(retention), inbox_config(creds, retention)] {
        match js.get_stream(&config.name).await {
            Ok(mut existing) => {
                let info = existing.info().await.map_err(js_err)?;
                if info.config.retention != config.retention {
                    // Retention cannot change in place (an inbox of an earlier build was a
                    // work queue). What it holds is a copy of the hub's: made again.
                    js.delete_stream(&config.name).await.map_err(js_err)?;
                    js.create_stream(config.clone()).await.map_err(js_err)?;
                    tracing::info!(stream = %config.name, "leaf stream made again with its new retention");
                    continue;
                }
                let keep = stream::Config {
                    sources: config.sources.clone(),
                    max_age: config.max_age,
                    ..info.config.clone()
                };
                if keep != info.config {
                    js.update_stream(&keep).await.map_err(js_err)?;
                    tracing::info!(stream = %config.name, "leaf stream updated");
                }
            }
            Err(_) => {
                js.create_stream(config.clone()).await.map_err(js_err)?;
                tracing::info!(stream = %config.name, "leaf stream created");
            }
        }
    }
    provision_working(js, creds).await?;
    let own = engram_access::leaf::leaf_artifacts_bucket(&creds.leaf);
    if js.get_object_store(&own).await.is_err() {
        js.create_object_store(jetstream::object_store::Config {
            bucket: own.clone(),
            description: Some(format!(
                "engram leaf: artifacts of sessions run here (tenant {}), sourced by the hub",
                creds.tenant
            )),
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(js_err)?;
        tracing::info!(bucket = %own, "leaf artifacts bucket created");
    }
    if engram_access::leaf::syncs_artifacts(&creds.reads) {
        provision_artifacts(js, creds).await?;
    }
    Ok(())
}

/// The leaf's working-memory bucket sources the hub's entries of every scope it may read,
/// so that `engram session resume` on the leaf finds a hub session's working memory. Down
/// only: the leaf's own entries stay on the leaf. An entry keeps its ttl (`Nats-TTL`).
async fn provision_working(
    js: &jetstream::Context,
    creds: &LeafCredentials,
) -> Result<(), LeafError> {
    let name = working_stream(&creds.working_bucket);
    let mut s = js.get_stream(&name).await.map_err(|_| LeafError::Missing {
        stream: name.clone(),
    })?;
    let config = s.info().await.map_err(js_err)?.config.clone();
    let wanted: Vec<stream::Source> = normalize(creds.reads.clone())
        .iter()
        .map(|pattern| stream::Source {
            name: name.clone(),
            filter_subject: Some(working_filter(
                &creds.working_bucket,
                &creds.tenant,
                pattern,
            )),
            external: Some(stream::External {
                api_prefix: api_prefix(&creds.hub_domain),
                delivery_prefix: Some(format!("{}.kv", down_prefix(&creds.leaf))),
            }),
            ..Default::default()
        })
        .collect();
    if config.sources.as_ref() != Some(&wanted) {
        js.update_stream(&stream::Config {
            sources: (!wanted.is_empty()).then_some(wanted),
            ..config
        })
        .await
        .map_err(js_err)?;
        tracing::info!(bucket = %creds.working_bucket, "leaf working memory sources the hub's");
    }
    Ok(())
}

/// The leaf's copy of its tenant's artifacts bucket, sourced whole from the hub's (when
/// the leaf may read every task, [`engram_access::leaf::syncs_artifacts`]): `engram session
/// resume` on the leaf then fetches and checks them as it would on the hub.
async fn provision_artifacts(
    js: &jetstream::Context,
    creds: &LeafCredentials,
) -> Result<(), LeafError> {
    let bucket = engram_schema::session::artifacts_bucket(&creds.tenant);
    if js.get_object_store(&bucket).await.is_err() {
        js.create_object_store(jetstream::object_store::Config {
            bucket: bucket.clone(),
            description: Some("engram leaf: the tenant's artifacts, from the hub".into()),
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(js_err)?;
    }
    let name = engram_access::leaf::artifacts_stream(&creds.tenant);
    let mut s = js.get_stream(&name).await.map_err(js_err)?;
    let config = s.info().await.map_err(js_err)?.config.clone();
    let wanted = vec![stream::Source {
        name: name.clone(),
        external: Some(stream::External {
            api_prefix: api_prefix(&creds.hub_domain),
            delivery_prefix: Some(format!("{}.obj", down_prefix(&creds.leaf))),
        }),
        ..Default::default()
    }];
    if config.sources.as_ref() != Some(&wanted) {
        js.update_stream(&stream::Config {
            sources: Some(wanted),
            ..config
        })
        .await
        .map_err(js_err)?;
        tracing::info!(bucket = %bucket, "leaf artifacts bucket sources the hub's");
    }
    Ok(())
}

/// The leaf's streams that source the hub: what [`crate::link`] resumes when the link is
/// back.
pub fn hub_sourced_streams(creds: &LeafCredentials) -> Vec<String> {
    let mut streams = vec![
        INBOX_STREAM.to_owned(),
        working_stream(&creds.working_bucket),
    ];
    if engram_access::leaf::syncs_artifacts(&creds.reads) {
        streams.push(engram_access::leaf::artifacts_stream(&creds.tenant));
    }
    streams
}

/// What the inbox's sources last reported: whether each saw the hub within `recent`, and
/// how many events the hub holds that the leaf has not received yet.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkStatus {
    /// The subjects the inbox's sources take from the hub: what the leaf receives.
    pub filters: Vec<String>,
    pub sources: usize,
    pub active: usize,
    pub lag: u64,
}

pub async fn link_status(
    js: &jetstream::Context,
    recent: Duration,
) -> Result<LinkStatus, LeafError> {
    let mut inbox = js
        .get_stream(INBOX_STREAM)
        .await
        .map_err(|_| LeafError::Missing {
            stream: INBOX_STREAM.into(),
        })?;
    let info = inbox.info().await.map_err(js_err)?;
    let mut status = LinkStatus {
        filters: info
            .config
            .sources
            .iter()
            .flatten()
            .filter_map(|s| s.filter_subject.clone())
            .collect(),
        ..LinkStatus::default()
    };
    for s in &info.sources {
        status.sources += 1;
        status.lag += s.lag;
        if s.active.is_some_and(|a| a <= recent) {
            status.active += 1;
        }
    }
    Ok(status)
}

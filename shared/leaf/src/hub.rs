//! The hub's side: its events stream sources each live leaf's outbox, one source per scope
//! the leaf may write, each mapping `engram.out.<tenant>.…` back to `engram.evt.<tenant>.…`.
//! The filter is the hub's own configuration, so a leaf that stores another tenant's
//! subject in its outbox is never sourced from. Each leaf's artifacts bucket
//! ([`engram_access::leaf::leaf_artifacts_bucket`]) is sourced whole into the hub's bucket
//! of the same name.

use async_nats::jetstream::{self, stream};
use engram_access::leaf::{
    LEAF_ARTIFACTS_PREFIX, LeafSpec, OUTBOX_STREAM, api_prefix, leaf_artifacts_bucket,
    leaf_artifacts_stream, up_prefix, up_transform,
};
use futures::StreamExt as _;

use crate::{LeafError, js_err};

/// The sources `leaves` need on the hub's events stream.
pub fn wanted_sources(leaves: &[LeafSpec]) -> Vec<stream::Source> {
    let mut sources = Vec::new();
    for leaf in leaves {
        for pattern in &leaf.writes {
            let (source, destination) = up_transform(&leaf.tenant, pattern);
            sources.push(stream::Source {
                name: OUTBOX_STREAM.to_owned(),
                external: Some(stream::External {
                    api_prefix: api_prefix(leaf.name.as_str()),
                    delivery_prefix: Some(up_prefix(&leaf.name)),
                }),
                subject_transforms: vec![stream::SubjectTransform {
                    source,
                    destination,
                }],
                ..Default::default()
            });
        }
    }
    sources
}

/// Whether `source` is one of a leaf's (ours to replace), by its delivery prefix.
fn is_leaf_source(source: &stream::Source) -> bool {
    source
        .external
        .as_ref()
        .and_then(|e| e.delivery_prefix.as_deref())
        .is_some_and(|p| p.starts_with("engram.leaf."))
}

/// Makes `events_stream`'s leaf sources exactly those of `leaves` (other sources are kept).
/// Returns whether the stream was changed. A source kept as it was keeps its position: the
/// server resumes it where it stopped.
pub async fn reconcile_sources(
    js: &jetstream::Context,
    events_stream: &str,
    leaves: &[LeafSpec],
) -> Result<bool, LeafError> {
    let mut stream = js.get_stream(events_stream).await.map_err(js_err)?;
    let config = stream.info().await.map_err(js_err)?.config.clone();
    let mut sources: Vec<stream::Source> = config
        .sources
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|s| !is_leaf_source(s))
        .collect();
    sources.extend(wanted_sources(leaves));
    let current = config.sources.clone().unwrap_or_default();
    if same_sources(&current, &sources) {
        return Ok(false);
    }
    let updated = stream::Config {
        sources: (!sources.is_empty()).then_some(sources),
        ..config
    };
    js.update_stream(&updated).await.map_err(js_err)?;
    tracing::info!(
        stream = events_stream,
        leaves = leaves.len(),
        "events stream now sources its leaves' outboxes"
    );
    Ok(true)
}

/// The source of leaf `leaf`'s artifacts bucket, on the hub's bucket of the same name.
pub fn artifacts_source(leaf: &LeafSpec) -> stream::Source {
    stream::Source {
        name: leaf_artifacts_stream(&leaf.name),
        external: Some(stream::External {
            api_prefix: api_prefix(leaf.name.as_str()),
            delivery_prefix: Some(format!("{}.obj", up_prefix(&leaf.name))),
        }),
        ..Default::default()
    }
}

/// The most a leaf's artifacts may take on the hub. A leaf's operator decides what it puts
/// in its bucket, so the hub bounds its copy: past this, the hub's bucket takes nothing new
/// (discard new; the source reports the error) and nothing it holds is dropped.
pub const LEAF_ARTIFACTS_MAX_BYTES: i64 = 8 * 1024 * 1024 * 1024;

/// Gives every live leaf a bucket on the hub that sources its artifacts bucket, and takes
/// the source off the buckets of leaves no longer live (what they sent stays). Returns how
/// many buckets changed.
pub async fn reconcile_artifacts(
    js: &jetstream::Context,
    leaves: &[LeafSpec],
    replicas: usize,
) -> Result<usize, LeafError> {
    let mut changed = 0;
    for leaf in leaves {
        let bucket = leaf_artifacts_bucket(&leaf.name);
        let name = leaf_artifacts_stream(&leaf.name);
        if js.get_stream(&name).await.is_err() {
            js.create_object_store(jetstream::object_store::Config {
                bucket: bucket.clone(),
                description: Some(format!(
                    "engram hub: the artifacts of sessions run on leaf {} (tenant {})",
                    leaf.name, leaf.tenant
                )),
                storage: stream::StorageType::File,
                num_replicas: replicas,
                ..Default::default()
            })
            .await
            .map_err(js_err)?;
        }
        let mut s = js.get_stream(&name).await.map_err(js_err)?;
        let config = s.info().await.map_err(js_err)?.config.clone();
        let wanted = vec![artifacts_source(leaf)];
        if !same_sources(&config.sources.clone().unwrap_or_default(), &wanted)
            || config.max_bytes != LEAF_ARTIFACTS_MAX_BYTES
            || config.discard != stream::DiscardPolicy::New
        {
            js.update_stream(&stream::Config {
                sources: Some(wanted),
                max_bytes: LEAF_ARTIFACTS_MAX_BYTES,
                discard: stream::DiscardPolicy::New,
                ..config
            })
            .await
            .map_err(js_err)?;
            changed += 1;
            tracing::info!(bucket = %bucket, "hub bucket sources the leaf's artifacts");
        }
    }
    let live: Vec<String> = leaves
        .iter()
        .map(|l| leaf_artifacts_stream(&l.name))
        .collect();
    let prefix = format!("OBJ_{LEAF_ARTIFACTS_PREFIX}");
    let mut names = js.stream_names();
    let mut stale = Vec::new();
    while let Some(name) = names.next().await {
        let name = name.map_err(js_err)?;
        if name.starts_with(&prefix) && !live.contains(&name) {
            stale.push(name);
        }
    }
    for name in stale {
        let mut s = js.get_stream(&name).await.map_err(js_err)?;
        let config = s.info().await.map_err(js_err)?.config.clone();
        if config.sources.as_ref().is_some_and(|s| !s.is_empty()) {
            js.update_stream(&stream::Config {
                sources: None,
                ..config
            })
            .await
            .map_err(js_err)?;
            changed += 1;
            tracing::info!(stream = %name, "a removed leaf's artifacts are no longer sourced");
        }
    }
    Ok(changed)
}

fn key(s: &stream::Source) -> String {
    format!(
        "{}|{:?}|{:?}|{:?}",
        s.name,
        s.external
            .as_ref()
            .map(|e| (&e.api_prefix, &e.delivery_prefix)),
        s.filter_subject,
        s.subject_transforms
            .iter()
            .map(|t| (&t.source, &t.destination))
            .collect::<Vec<_>>()
    )
}

fn same_sources(a: &[stream::Source], b: &[stream::Source]) -> bool {
    let mut a: Vec<String> = a.iter().map(key).collect();
    let mut b: Vec<String> = b.iter().map(key).collect();
    a.sort();
    b.sort();
    a == b
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_schema::Ident;

    #[test]
    fn one_source_per_writable_scope_each_with_the_leafs_own_prefixes() {
        let leaf = LeafSpec {
            name: Ident::parse("leaf", "laptop").unwrap(),
            tenant: Ident::parse("tenant", "acme").unwrap(),
            writes: vec!["task:*".parse().unwrap(), "agent:bob".parse().unwrap()],
            reads: vec![],
        };
        let sources = wanted_sources(std::slice::from_ref(&leaf));
        assert_eq!(sources.len(), 2);
        for s in &sources {
            let ext = s.external.as_ref().unwrap();
            assert_eq!(ext.api_prefix, "$JS.laptop.API");
            assert_eq!(
                ext.delivery_prefix.as_deref(),
                Some("engram.leaf.laptop.up")
            );
            assert!(is_leaf_source(s));
            assert!(
                s.subject_transforms[0]
                    .source
                    .starts_with("engram.out.acme.")
            );
        }
        assert!(same_sources(&sources, &wanted_sources(&[leaf])));
    }
}

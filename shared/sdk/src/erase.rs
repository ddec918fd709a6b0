//! Verified erasure (GDPR): every trace of some scopes of one tenant, gone from every place
//! Engram keeps them, and a search of those places that proves it.
//!
//! [`Client::erase`] runs, in order:
//! 1. the audit record (`erasure_started` in the access registry: which scopes, when, by
//!    whom; no content, so it outlives what it erases);
//! 2. every read model and document store: each projector applies the stream up to now,
//!    removes the scopes and checkpoints before it answers (`engram.p.<name>.erase`);
//! 3. the events stream (a purge by the scopes' subjects), the dead letters projectors kept
//!    of those events (each overwritten on delete), and the scopes' working memory;
//! 4. snapshots: every projector cuts a new one, then every older snapshot is deleted,
//!    labelled ones too (they held the data);
//! 5. the audit record's end (`erasure_finished`, with counts and anything left undone).
//!
//! [`Client::erasure_traces`] searches the same places and lists what it finds. It needs the
//! admin's credentials: no other identity may purge, delete or reach projector endpoints.

use std::time::Duration;

use engram_memory::ScopeKey;
use engram_memory::proto::{self, read_models};
use engram_schema::{Ident, Scope};
use serde::Serialize;

use crate::Client;

/// Why an erasure could not run at all (a partial one is reported in [`ErasureReport`]).
#[derive(Debug, thiserror::Error)]
pub enum EraseError {
    #[error("erase: {0}")]
    Invalid(String),
    /// The events stream was created with `deny_purge` or `deny_delete` (by an older
    /// engram): erasure deletes messages and purges subjects, which such a stream refuses,
    /// so nothing is attempted (no audit record, no read model emptied).
    #[error(
        "the events stream {stream} denies purges or deletes (an older engram created it), so its events cannot be erased; nothing was changed. The server never lifts those flags: the events must move to a new stream first"
    )]
    StreamDeniesErasure { stream: String },
    /// The server refused the erasure's first request to these credentials (an agent's key):
    /// erasure deletes a tenant's memory everywhere, which only the operator may do.
    #[error(
        "these credentials may not erase (the server refused a publish to {subject}); erasure is the operator's: run `engram erase` on the machine running `engram up`, where the CLI uses its admin credentials, or pass the admin's --creds; nothing was changed"
    )]
    Forbidden { subject: String },
    #[error("erase: {0}")]
    Unavailable(String),
}

/// What one erasure removed, place by place.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ErasureReport {
    pub tenant: String,
    pub scopes: Vec<String>,
    /// The audit record's sequence in the access registry.
    pub audit_seq: u64,
    /// Items each read model removed.
    pub read_models: Vec<(String, u64)>,
    pub events_purged: u64,
    pub dead_letters_erased: u64,
    pub working_memory_purged: u64,
    pub snapshots_cut: Vec<String>,
    pub snapshots_deleted: u64,
    /// What could not be done; run the erasure again once it can.
    pub incomplete: Vec<String>,
}

/// Something of an erased scope still held somewhere.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Trace {
    /// Where: `stream`, `dead letters`, `working memory`, `read model <name>`,
    /// `snapshot <name>@<version>`.
    pub place: String,
    pub scope: String,
    /// How many items; 0 with a `detail` when the place could not be searched.
    pub count: u64,
    pub detail: String,
}

/// How long one projector may take to erase (its wait for the stream included).
const PROJECTOR_TIMEOUT: Duration = Duration::from_secs(120);

/// The stored subjects of `scope`'s events, every layer and its partition.
fn subject_of(tenant: &Ident, scope: &Scope) -> String {
    engram_schema::SubjectFilter::all()
        .tenant(tenant.clone())
        .scope(scope.kind, scope.id.clone())
        .to_subject()
}

fn keys(tenant: &Ident, scopes: &[Scope]) -> Vec<ScopeKey> {
    scopes
        .iter()
        .map(|s| ScopeKey::new(tenant.clone(), s.clone()))
        .collect()
}

impl Client {
    /// Erases `scopes` of `tenant` everywhere (see the module docs). `by` is recorded in
    /// the audit trail. A place that cannot be reached is listed in `incomplete`; running
    /// the same erasure again finishes it.
    pub async fn erase(
        &self,
        tenant: &Ident,
        scopes: &[Scope],
        snapshots: &engram_snapshots::SnapshotsConfig,
        by: &str,
    ) -> Result<ErasureReport, EraseError> {
        if scopes.is_empty() || scopes.len() > proto::limits::MAX_ERASE_SCOPES {
            return Err(EraseError::Invalid(format!(
                "name 1..={} scopes",
                proto::limits::MAX_ERASE_SCOPES
            )));
        }
        let bus = self.bus();
        let unavailable = |e: &dyn std::fmt::Display| EraseError::Unavailable(e.to_string());
        // Before anything changes: an erasure that cannot delete the events must not
        // pretend to by emptying the read models (a rebuild would bring them back).
        let mut refused = bus.refused_publishes();
        let stream = tokio::select! {
            stream = bus.jetstream().get_stream(&bus.config().stream.name) => {
                stream.map_err(|e| unavailable(&e))?
            }
            Ok(subject) = refused.recv() => return Err(EraseError::Forbidden { subject }),
        };
        // Both: the scopes' events are deleted one by one (overwritten), then purged.
        let config = &stream.cached_info().config;
        if config.deny_purge || config.deny_delete {
            return Err(EraseError::StreamDeniesErasure {
                stream: config.name.clone(),
            });
        }
        let log = engram_access::AccessLog::new(bus.client().clone());
        let audit_seq = log
            .append(
                engram_access::Record::ErasureStarted {
                    tenant: tenant.clone(),
                    scopes: scopes.to_vec(),
                },
                by,
            )
            .await
            .map_err(|e| unavailable(&e))?;
        let mut report = ErasureReport {
            tenant: tenant.to_string(),
            scopes: scopes.iter().map(ToString::to_string).collect(),
            audit_seq,
            ..ErasureReport::default()
        };
        let (_, through) = bus.stream_bounds().await.map_err(|e| unavailable(&e))?;
        let keys = keys(tenant, scopes);
        // Each partition's instance of a model holds its scopes.
        let parts = proto::by_partition(&keys, bus.config().stream.partitions);

        // Read models and documents: each applies up to `through`, erases, checkpoints.
        for model in read_models::ALL {
            let mut removed = 0;
            for (p, held) in &parts {
                let answer: Result<proto::EraseScopesResponse, _> = engram_rpc::call(
                    bus.client(),
                    &proto::partition_subject(model, "erase", *p),
                    &proto::EraseScopesRequest {
                        scopes: held.clone(),
                        through_seq: through,
                    },
                    PROJECTOR_TIMEOUT,
                )
                .await;
                match answer {
                    Ok(r) => removed += r.removed,
                    Err(e) => report
                        .incomplete
                        .push(format!("read model {model} partition {p}: {e}")),
                }
            }
            report.read_models.push((model.to_owned(), removed));
        }

        // The events, their dead-letter copies, the scopes' working memory.
        for scope in scopes {
            let subject = subject_of(tenant, scope);
            match bus.purge_events(&subject, through + 1).await {
                Ok(n) => report.events_purged += n,
                Err(e) => report.incomplete.push(format!("stream {subject}: {e}")),
            }
        }
        match bus.dead_letter_refs(0).await {
            Ok(refs) => {
                for letter in refs.iter().filter(|l| {
                    l.subject
                        .as_deref()
                        .is_some_and(|s| scopes.iter().any(|sc| on_scope(s, tenant, sc)))
                }) {
                    match bus.erase_dead_letter(letter.dlq_seq).await {
                        Ok(true) => report.dead_letters_erased += 1,
                        Ok(false) => {}
                        Err(e) => report
                            .incomplete
                            .push(format!("dead letter {}: {e}", letter.dlq_seq)),
                    }
                }
            }
            Err(e) => report.incomplete.push(format!("dead letters: {e}")),
        }
        match bus.working_memory().await {
            Ok(wm) => {
                for scope in scopes {
                    match wm.purge_scope(tenant, scope).await {
                        Ok(n) => report.working_memory_purged += n,
                        Err(e) => report
                            .incomplete
                            .push(format!("working memory {scope}: {e}")),
                    }
                }
            }
            Err(e) => report.incomplete.push(format!("working memory: {e}")),
        }

        // Snapshots: a new cut of every model, then every older one goes.
        let store = engram_snapshots::SnapshotStore::open(bus, snapshots.clone())
            .await
            .map_err(|e| unavailable(&e))?;
        for (model, p) in read_models::ALL
            .iter()
            .flat_map(|m| parts.iter().map(move |(p, _)| (*m, *p)))
        {
            let instance = proto::instance_name(model, p);
            let cut: Result<engram_snapshots::SnapshotMeta, _> = engram_rpc::call(
                bus.client(),
                &proto::partition_subject(model, "snapshot", p),
                &serde_json::json!({ "force": true }),
                Duration::from_secs(600),
            )
            .await;
            let keep = match cut {
                Ok(meta) => {
                    report
                        .snapshots_cut
                        .push(format!("{instance}@{}", meta.version));
                    Some(meta)
                }
                Err(e) => {
                    report
                        .incomplete
                        .push(format!("snapshot {instance}: {e}; its older snapshots are deleted, so replicas rebuild it from the stream"));
                    None
                }
            };
            let held = store
                .list(Some(&instance))
                .await
                .map_err(|e| unavailable(&e))?;
            for meta in held {
                let fresh = keep.as_ref().is_some_and(|k| {
                    k.version == meta.version && k.content_hash == meta.content_hash
                });
                if !fresh {
                    match store.delete(&meta).await {
                        Ok(()) => report.snapshots_deleted += 1,
                        Err(e) => report
                            .incomplete
                            .push(format!("snapshot {instance}@{}: {e}", meta.version)),
                    }
                }
            }
        }

        let removed = report.read_models.iter().map(|(_, n)| n).sum::<u64>()
            + report.events_purged
            + report.dead_letters_erased
            + report.working_memory_purged;
        log.append(
            engram_access::Record::ErasureFinished {
                tenant: tenant.clone(),
                scopes: scopes.to_vec(),
                removed,
                incomplete: report.incomplete.clone(),
            },
            by,
        )
        .await
        .map_err(|e| unavailable(&e))?;
        Ok(report)
    }

    /// Every trace of `scopes` of `tenant` still held: in the stream, the dead letters,
    /// working memory, each read model, and the newest snapshot of each model. Empty means
    /// none was found; a place that could not be searched is listed with its reason.
    pub async fn erasure_traces(
        &self,
        tenant: &Ident,
        scopes: &[Scope],
        snapshots: &engram_snapshots::SnapshotsConfig,
    ) -> Result<Vec<Trace>, EraseError> {
        let bus = self.bus();
        let unavailable = |e: &dyn std::fmt::Display| EraseError::Unavailable(e.to_string());
        let mut traces = Vec::new();
        let mut found = |place: String, scope: String, count: u64, detail: String| {
            if count > 0 || !detail.is_empty() {
                traces.push(Trace {
                    place,
                    scope,
                    count,
                    detail,
                });
            }
        };
        let letters = bus.dead_letter_refs(0).await.map_err(|e| unavailable(&e))?;
        let wm = bus.working_memory().await.map_err(|e| unavailable(&e))?;
        for scope in scopes {
            let subject = subject_of(tenant, scope);
            let shown = scope.to_string();
            match bus.events_on(&subject).await {
                Ok(n) => found("stream".into(), shown.clone(), n, String::new()),
                Err(e) => found("stream".into(), shown.clone(), 0, e.to_string()),
            }
            let in_dlq = letters
                .iter()
                .filter(|l| {
                    l.subject
                        .as_deref()
                        .is_some_and(|s| on_scope(s, tenant, scope))
                })
                .count() as u64;
            found("dead letters".into(), shown.clone(), in_dlq, String::new());
            match wm.keys_of(tenant, scope).await {
                Ok(n) => found("working memory".into(), shown.clone(), n, String::new()),
                Err(e) => found("working memory".into(), shown.clone(), 0, e.to_string()),
            }
        }
        let keys = keys(tenant, scopes);
        let parts = proto::by_partition(&keys, bus.config().stream.partitions);
        let all = scopes
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        for model in read_models::ALL {
            let (mut held, mut unsearched) = (0, Vec::new());
            for (p, scopes) in &parts {
                let answer: Result<proto::TracesResponse, _> = engram_rpc::call(
                    bus.client(),
                    &proto::partition_subject(model, "traces", *p),
                    &proto::TracesRequest {
                        scopes: scopes.clone(),
                    },
                    PROJECTOR_TIMEOUT,
                )
                .await;
                match answer {
                    Ok(r) => held += r.traces,
                    Err(e) => unsearched.push(format!("partition {p} not searched: {e}")),
                }
            }
            found(
                format!("read model {model}"),
                all.clone(),
                held,
                unsearched.join("; "),
            );
        }
        let store = engram_snapshots::SnapshotStore::open(bus, snapshots.clone())
            .await
            .map_err(|e| unavailable(&e))?;
        for (model, (p, held)) in read_models::ALL
            .iter()
            .flat_map(|m| parts.iter().map(move |part| (*m, part)))
        {
            let instance = proto::instance_name(model, *p);
            let answer: Result<proto::TracesResponse, _> = engram_rpc::call(
                bus.client(),
                &proto::partition_subject(model, "snapshot_traces", *p),
                &proto::TracesRequest {
                    scopes: held.clone(),
                },
                PROJECTOR_TIMEOUT,
            )
            .await;
            let newest = store
                .list(Some(&instance))
                .await
                .ok()
                .and_then(|m| m.into_iter().last())
                .map_or_else(|| "none".to_owned(), |m| m.version.to_string());
            let place = format!("snapshot {instance}@{newest}");
            match answer {
                Ok(r) => found(place, all.clone(), r.traces, String::new()),
                Err(e) => found(place, all.clone(), 0, format!("not searched: {e}")),
            }
        }
        Ok(traces)
    }
}

/// Whether an event subject, as published or stored, is one of `scope`'s (exact tokens:
/// `acme` is not `acme2`).
fn on_scope(subject: &str, tenant: &Ident, scope: &Scope) -> bool {
    engram_schema::parse_subject(subject).is_some_and(|(t, s, _)| t == *tenant && s == *scope)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_subject_is_a_scopes_by_exact_tokens() {
        let t = engram_schema::Ident::parse("t", "acme").unwrap();
        let s: engram_schema::Scope = "task:t1".parse().unwrap();
        assert!(super::on_scope("engram.evt.acme.task.t1.episodic", &t, &s));
        // As stored, with the partition.
        assert!(super::on_scope(
            "engram.evt.acme.task.t1.episodic.7",
            &t,
            &s
        ));
        assert!(!super::on_scope(
            "engram.evt.acme.task.t1.notalayer",
            &t,
            &s
        ));
        assert!(!super::on_scope(
            "engram.evt.acme2.task.t1.episodic",
            &t,
            &s
        ));
        assert!(!super::on_scope(
            "engram.evt.acme.task.t10.episodic",
            &t,
            &s
        ));
        assert!(!super::on_scope(
            "engram.evt.acme.task.t1.episodic.x",
            &t,
            &s
        ));
    }
}

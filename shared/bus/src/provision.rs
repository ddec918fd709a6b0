//! Idempotent provisioning. Creating what is missing is safe to repeat at every start-up;
//! changing what exists is not (a shorter max_age would delete data), so drift is reported.

use std::fmt;
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

use crate::{Bus, BusError};

/// One field where an existing resource differs from the wanted config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigDiff {
    pub field: &'static str,
    pub existing: String,
    pub wanted: String,
}

impl fmt::Display for ConfigDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} -> {}", self.field, self.existing, self.wanted)
    }
}

/// What provisioning did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProvisionReport {
    pub stream_created: bool,
    pub bucket_created: bool,
}

impl Bus {
    /// The events stream config this bus wants.
    pub fn wanted_stream_config(&self) -> stream::Config {
        let s = &self.config.stream;
        stream::Config {
            name: s.name.clone(),
            description: Some("engram experience events".into()),
            subjects: vec![engram_schema::STREAM_SUBJECTS.into()],
            // The server appends each event's partition to the subject it stores.
            subject_transform: Some({
                let (source, destination) = engram_schema::stream_transform(s.partitions);
                stream::SubjectTransform {
                    source,
                    destination,
                }
            }),
            storage: stream::StorageType::File,
            num_replicas: self.replicas(),
            duplicate_window: s.duplicate_window,
            max_message_size: s.max_msg_size,
            max_age: s.max_age,
            max_bytes: s.max_bytes,
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            allow_direct: true,
            // Erasure (GDPR) must delete messages, and a stream created denying deletes or
            // purges can never allow them again (the server refuses that update). What keeps
            // everyone else from purging or deleting is NATS permissions: only the admin
            // identity may (see `engram_access::perms`).
            deny_delete: false,
            deny_purge: false,
            ..Default::default()
        }
    }

    fn wanted_bucket_config(&self) -> kv::Config {
        let w = &self.config.working_memory;
        kv::Config {
            bucket: w.bucket.clone(),
            description: "engram working memory".into(),
            history: 1,
            max_value_size: w.max_value_size,
            storage: stream::StorageType::File,
            num_replicas: self.replicas(),
            // Enables per-message TTL (server 2.11+); the value is how long delete markers
            // left by expiry stay visible to watchers.
            limit_markers: Some(Duration::from_secs(60)),
            ..Default::default()
        }
    }

    /// The dead-letter stream config this bus wants: poison messages, kept 30 days (and at
    /// most `dead_letters.max_bytes`, oldest dropped first) for an operator to inspect.
    pub fn wanted_dead_letter_config(&self) -> stream::Config {
        stream::Config {
            name: crate::DLQ_STREAM.into(),
            description: Some("engram events that a projector could not apply".into()),
            subjects: vec![format!("{}.>", crate::DLQ_SUBJECT_PREFIX)],
            storage: stream::StorageType::File,
            num_replicas: self.replicas(),
            max_age: Duration::from_secs(30 * 24 * 3600),
            max_bytes: self.config.dead_letters.max_bytes,
            discard: stream::DiscardPolicy::Old,
            duplicate_window: Duration::from_secs(10 * 60),
            ..Default::default()
        }
    }

    /// Creates the dead-letter stream if it is missing. Called at provisioning and again by
    /// [`Bus::dead_letter`] when it finds the stream gone. An existing one with other limits
    /// still works, so that is a warning naming the fix rather than an error.
    pub(crate) async fn provision_dead_letters(&self) -> Result<(), BusError> {
        let config = self.wanted_dead_letter_config();
        match self.js.get_stream(crate::DLQ_STREAM).await {
            Ok(existing) => {
                let c = &existing.cached_info().config;
                let mut diffs = Vec::new();
                diff(&mut diffs, "max_bytes", c.max_bytes, config.max_bytes);
                diff(&mut diffs, "discard", c.discard, config.discard);
                if !diffs.is_empty() {
                    let diffs: Vec<String> = diffs.iter().map(ToString::to_string).collect();
                    tracing::warn!(
                        stream = crate::DLQ_STREAM,
                        differences = %diffs.join(", "),
                        "dead-letter stream has other limits than configured; align them with `nats stream edit {} --max-bytes {} --discard old`",
                        crate::DLQ_STREAM,
                        config.max_bytes
                    );
                }
                Ok(())
            }
            Err(e) if is_not_found(&e) => {
                match self.js.create_stream(config).await {
                    Ok(_) => {
                        tracing::info!(stream = crate::DLQ_STREAM, "dead-letter stream created")
                    }
                    // Another projector recreated it first.
                    Err(e) if e.to_string().contains("already in use") => {}
                    Err(e) => return Err(js_err(e)),
                }
                Ok(())
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Creates the events stream and working-memory bucket if missing; verifies them if not.
    #[tracing::instrument(skip(self), fields(stream = %self.config.stream.name))]
    pub async fn provision(&self) -> Result<ProvisionReport, BusError> {
        self.config.validate().map_err(BusError::InvalidConfig)?;
        let wanted = self.wanted_stream_config();
        let stream_created = match self.js.get_stream(&wanted.name).await {
            Ok(mut existing) => {
                let info = existing.info().await.map_err(js_err)?;
                check_partitions(&wanted.name, &info.config, self.config.stream.partitions)?;
                let diffs = stream_diffs(&info.config, &wanted);
                if info.config.deny_purge || info.config.deny_delete {
                    tracing::warn!(
                        stream = %wanted.name,
                        "the events stream denies purges and deletes (an older engram created it): `engram erase` cannot delete events from it; the server refuses to lift that"
                    );
                }
                if !diffs.is_empty() {
                    return Err(BusError::ConfigDrift {
                        resource: format!("stream {}", wanted.name),
                        fix: stream_fix(&wanted.name, &diffs),
                        diffs,
                    });
                }
                // Replay pages are direct gets (`crate::direct`). Allowing them changes no
                // stored event, so a stream made without them (by hand, or edited) is
                // changed in place rather than reported.
                if !info.config.allow_direct {
                    let config = stream::Config {
                        allow_direct: true,
                        ..info.config.clone()
                    };
                    self.js.update_stream(&config).await.map_err(|e| {
                        BusError::JetStream(format!(
                            "the events stream does not allow direct gets, which replay pages need, and allowing them failed: {e}; run `nats stream edit {} --allow-direct`",
                            wanted.name
                        ))
                    })?;
                    tracing::info!(stream = %wanted.name, "events stream now allows direct gets (replay pages read with them)");
                }
                false
            }
            Err(e) if is_not_found(&e) => {
                self.js
                    .create_stream(wanted.clone())
                    .await
                    .map_err(js_err)?;
                tracing::info!("events stream created");
                true
            }
            Err(e) => return Err(unavailable(e)),
        };

        let wanted_kv = self.wanted_bucket_config();
        let stream_name = format!("KV_{}", wanted_kv.bucket);
        let bucket_created = match self.js.get_stream(&stream_name).await {
            Ok(mut existing) => {
                let info = existing.info().await.map_err(js_err)?;
                let c = &info.config;
                let mut diffs = Vec::new();
                diff(
                    &mut diffs,
                    "history",
                    c.max_messages_per_subject,
                    wanted_kv.history,
                );
                diff(
                    &mut diffs,
                    "max_value_size",
                    c.max_message_size,
                    wanted_kv.max_value_size,
                );
                diff(&mut diffs, "allow_msg_ttl", c.allow_message_ttl, true);
                if !diffs.is_empty() {
                    return Err(BusError::ConfigDrift {
                        resource: format!("key-value bucket {}", wanted_kv.bucket),
                        fix: format!(
                            "either align engram's config with it, or remove it (`nats stream rm {stream_name}`) if its data can go"
                        ),
                        diffs,
                    });
                }
                false
            }
            Err(e) if is_not_found(&e) => {
                self.js.create_key_value(wanted_kv).await.map_err(js_err)?;
                tracing::info!("working memory bucket created");
                true
            }
            Err(e) => return Err(unavailable(e)),
        };
        self.provision_dead_letters().await?;
        Ok(ProvisionReport {
            stream_created,
            bucket_created,
        })
    }
}

/// A stream (an events stream, a key-value bucket's or an object store's) kept on fewer
/// servers than the configured `bus.stream.replicas`: losing one server can lose it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaShortfall {
    pub stream: String,
    pub replicas: usize,
    pub wanted: usize,
}

impl fmt::Display for ReplicaShortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} has {} replica{} of {}",
            self.stream,
            self.replicas,
            if self.replicas == 1 { "" } else { "s" },
            self.wanted
        )
    }
}

impl Bus {
    /// The replicas every stream, bucket and object store Engram makes is given: one setting
    /// (`bus.stream.replicas`) for all of them, so none is left on one server of a cluster.
    pub fn replicas(&self) -> usize {
        self.config.stream.replicas.max(1)
    }

    /// Every stream of this account kept on fewer servers than [`Bus::replicas`]. Engram's
    /// account holds only Engram's streams (events, dead letters, the access registry, and the
    /// buckets and object stores behind working memory, leases, memory nodes and snapshots).
    pub async fn replica_shortfalls(&self) -> Result<Vec<ReplicaShortfall>, BusError> {
        use futures::TryStreamExt as _;
        let wanted = self.replicas();
        let mut out = Vec::new();
        let mut streams = self.js.streams();
        while let Some(info) = streams.try_next().await.map_err(js_err)? {
            if info.config.num_replicas < wanted {
                out.push(ReplicaShortfall {
                    stream: info.config.name.clone(),
                    replicas: info.config.num_replicas,
                    wanted,
                });
            }
        }
        out.sort_by(|a, b| a.stream.cmp(&b.stream));
        Ok(out)
    }

    /// Keeps `stream` on `replicas` servers. The cluster copies what it holds to the new
    /// replicas in the background; nothing stored changes.
    pub async fn set_replicas(&self, stream: &str, replicas: usize) -> Result<(), BusError> {
        let mut existing = self.js.get_stream(stream).await.map_err(js_err)?;
        let config = stream::Config {
            num_replicas: replicas,
            ..existing.info().await.map_err(js_err)?.config.clone()
        };
        self.js.update_stream(&config).await.map_err(|e| {
            BusError::JetStream(format!(
                "cannot keep {stream} on {replicas} servers: {e}; a stream cannot have more replicas than the cluster has JetStream servers"
            ))
        })?;
        Ok(())
    }

    /// Waits until JetStream answers: on a cluster, until its nodes have found each other and
    /// elected a meta leader; a single server answers at once.
    pub async fn wait_for_jetstream(&self, within: Duration) -> Result<(), BusError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let error = match self.js.query_account().await {
                Ok(_) => return Ok(()),
                Err(e) => e.to_string(),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(BusError::Unavailable(format!(
                    "jetstream did not answer within {within:?} ({error}); on a cluster, check that a majority of its servers are up and reach each other's routes"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Refuses an events stream partitioned otherwise than configured, or not at all: its
/// stored subjects say where each scope's events are, so reading it with another count
/// would look for them in the wrong partitions.
fn check_partitions(name: &str, existing: &stream::Config, wanted: u32) -> Result<(), BusError> {
    let existing = existing
        .subject_transform
        .as_ref()
        .filter(|t| t.source == engram_schema::STREAM_SUBJECTS)
        .and_then(|t| engram_schema::transform_partitions(&t.destination));
    match existing {
        Some(count) if count == wanted => Ok(()),
        Some(count) => Err(BusError::Partitions {
            stream: name.to_owned(),
            existing: Some(count),
            wanted,
        }),
        None => Err(BusError::Partitions {
            stream: name.to_owned(),
            existing: None,
            wanted,
        }),
    }
}

pub(crate) fn is_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(ref inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

fn diff<T: PartialEq + fmt::Debug>(
    out: &mut Vec<ConfigDiff>,
    field: &'static str,
    existing: T,
    wanted: T,
) {
    if existing != wanted {
        out.push(ConfigDiff {
            field,
            existing: format!("{existing:?}"),
            wanted: format!("{wanted:?}"),
        });
    }
}

/// Compares the fields Engram sets. Fields it leaves at server defaults are not compared, so
/// an operator may tune them (for example compression) without tripping drift detection.
fn stream_diffs(existing: &stream::Config, wanted: &stream::Config) -> Vec<ConfigDiff> {
    let mut d = Vec::new();
    diff(&mut d, "subjects", &existing.subjects, &wanted.subjects);
    diff(&mut d, "storage", existing.storage, wanted.storage);
    // Replicas are not compared: more than configured is an operator's choice, and fewer is
    // reported with its fix by [`Bus::replica_shortfalls`] for every stream at once.
    diff(
        &mut d,
        "duplicate_window",
        existing.duplicate_window,
        wanted.duplicate_window,
    );
    diff(
        &mut d,
        "max_msg_size",
        existing.max_message_size,
        wanted.max_message_size,
    );
    diff(&mut d, "max_age", existing.max_age, wanted.max_age);
    diff(&mut d, "max_bytes", existing.max_bytes, wanted.max_bytes);
    diff(&mut d, "retention", existing.retention, wanted.retention);
    diff(&mut d, "discard", existing.discard, wanted.discard);
    // deny_delete and deny_purge are not compared: a stream an older engram made denies
    // both, can never be changed back, and works as before except that erasure cannot
    // delete its events (said at provisioning).
    d
}

/// What an operator should do about a drifted events stream. Narrowing its subjects and
/// denying deletes and purges keep every stored event, so those are changed in place, with
/// the exact command; anything else might lose data, so engram's config is the thing to
/// change (the stream refuses to be deleted once it denies deletes).
fn stream_fix(name: &str, diffs: &[ConfigDiff]) -> String {
    let mut flags = Vec::new();
    let mut other = Vec::new();
    for d in diffs {
        match d.field {
            "subjects" => flags.push(format!("--subjects '{}'", engram_schema::STREAM_SUBJECTS)),
            field => other.push(field),
        }
    }
    let mut fix = Vec::new();
    if !flags.is_empty() {
        fix.push(format!(
            "this version of engram protects the stream more tightly; these changes keep every stored event, apply them with `nats stream edit {name} {}` and start again",
            flags.join(" ")
        ));
    }
    if !other.is_empty() {
        fix.push(format!(
            "set {} in engram's config ([bus.stream]) to the existing values",
            other.join(", ")
        ));
    }
    fix.join("; ")
}

pub(crate) fn js_err(e: impl fmt::Display) -> BusError {
    BusError::JetStream(e.to_string())
}

pub(crate) fn unavailable(e: impl fmt::Display) -> BusError {
    BusError::Unavailable(e.to_string())
}

//! Every read model Engram can run, in one list.
//!
//! A read model is one module that implements [`ReadModel`], one line in [`REGISTRY`], and
//! its row in [`proto::read_models::TABLE`] (its ops, bus role and scope snapshots, for the
//! services that do not link the projectors). Start-up, `engram projector <name>`,
//! `engram rebuild <name>`, the query, status and ledger endpoints, their in-flight bounds
//! and the read-your-writes checks all come from here; the tests below hold the registry
//! and the table to each other.

use std::fmt;
use std::marker::PhantomData;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use async_trait::async_trait;
use engram_bus::Bus;
use engram_memory::proto::{self, ProjectorRequest};
use engram_memory::{ScopeKey, Seq};
use engram_projection_runtime::{Projection, Projector, ProjectorSettings};
use engram_rpc::Failure;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::{Launched, Part, ProjectorsConfig, Serving, Shared, StartError, wait_visible};

/// One read model: how it opens, how its loop is tuned, and the query it answers.
#[async_trait]
pub trait ReadModel: Send + Sync + 'static {
    /// Names its durable consumer, state files, metrics and `engram.p.<name>.*` subjects.
    const NAME: &'static str;
    /// The query endpoint: `engram.p.<name>.<op>`, and its metrics label. The op is the
    /// first of the model's [`proto::read_models::ReadModelSpec::ops`].
    const ENDPOINT: (&'static str, &'static str);
    type Projection: Projection;
    type Request: ProjectorRequest + DeserializeOwned + Send + 'static;
    type Response: Serialize + Send + 'static;

    /// How its loop batches, checkpoints and publishes. Models that apply in place keep the
    /// default, which publishes every batch.
    fn settings(config: &ProjectorsConfig) -> ProjectorSettings {
        config.loop_settings()
    }

    /// A snapshot of this model cut down to the scopes in `keep`, in the same format, for a
    /// reader of those scopes only; `None` (the default), whatever the bytes, for a model
    /// that keeps no snapshots a scope can start from. Which models do is also
    /// [`proto::read_models::ReadModelSpec::scope_snapshots`].
    fn slice(_snapshot: &[u8], _keep: &[ScopeKey]) -> Result<Option<Vec<u8>>, String> {
        Ok(None)
    }

    /// Work besides answering queries, started with the loop and ended by `stop`: the
    /// consolidator's scheduled runs. `None` (the default) for a plain read model.
    fn background(
        _config: &ProjectorsConfig,
        _projection: Arc<Self::Projection>,
        _visibility: engram_projection_runtime::Visibility,
        _bus: Bus,
        _part: &Part,
        _stop: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        None
    }

    /// The model of one partition, with its state under `dir` (loaded when the loop
    /// restores it); what the process's instances of the model share is in `shared`.
    async fn open(
        config: &ProjectorsConfig,
        dir: &Path,
        shared: &Shared,
    ) -> Result<Arc<Self::Projection>, StartError>;

    /// Answers a checked request once its token is visible; `visible` is the sequence
    /// queries can see. CPU-heavy work belongs on a blocking thread.
    async fn answer(
        projection: Arc<Self::Projection>,
        request: Self::Request,
        visible: Seq,
    ) -> Result<Self::Response, Failure>;

    /// Endpoints beside [`ReadModel::ENDPOINT`], each served by [`Endpoints::serve`] with
    /// the same checks, bounds and read-your-writes wait: the vector model's neighbours,
    /// which the consolidator asks. None by default.
    async fn more_endpoints(
        _projection: Arc<Self::Projection>,
        _endpoints: &Endpoints<'_>,
    ) -> Result<(), StartError> {
        Ok(())
    }
}

/// Where a model's instance for one partition serves its endpoints:
/// `engram.p.<name>.<op>.<partition>`, each request validated, its consistency token waited
/// for, and the in-flight work bounded by the service's limits.
pub struct Endpoints<'a> {
    name: &'static str,
    serving: &'a Serving<'a>,
    visibility: engram_projection_runtime::Visibility,
}

impl Endpoints<'_> {
    /// Serves `op` (metrics label `label`) with `answer`, which gets the checked request and
    /// the sequence queries can see.
    pub async fn serve<Req, Resp, H, Fut>(
        &self,
        op: &'static str,
        label: &'static str,
        answer: H,
    ) -> Result<(), StartError>
    where
        Req: ProjectorRequest + DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        H: Fn(Req, Seq) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Resp, Failure>> + Send + 'static,
    {
        let (v, head) = (self.visibility.clone(), self.serving.head.clone());
        let part = self.serving.part.clone();
        let answer = Arc::new(answer);
        engram_rpc::serve_with(
            self.serving.service,
            &self.serving.routes,
            &proto::partition_subject(self.name, op, part.index),
            label,
            self.serving.limits,
            move |request: Req| {
                let (v, head, answer, part) =
                    (v.clone(), head.clone(), answer.clone(), part.clone());
                async move {
                    if !part.ready() {
                        return Err(part.not_ready());
                    }
                    request.validate()?;
                    wait_visible(&v, &part, &head, &request.consistency()).await?;
                    answer(request, part.visible(&v)).await
                }
            },
        )
        .await
        .map(|_| ())
        .map_err(|source| StartError::Service {
            projector: self.name,
            source,
        })
    }
}

/// The read models, in the order `engram up` starts them.
pub static REGISTRY: &[&dyn Registered] = &[
    &Entry::<crate::vector::Vector>(PhantomData),
    &Entry::<crate::keyword::Keyword>(PhantomData),
    &Entry::<crate::facts::FactsModel>(PhantomData),
    &Entry::<crate::skills::SkillsModel>(PhantomData),
    &Entry::<crate::docs::DocsModel>(PhantomData),
    &Entry::<crate::consolidator::ConsolidatorModel>(PhantomData),
];

/// A registered read model, with the generic glue done once (object-safe, for the registry).
#[async_trait]
pub trait Registered: Send + Sync {
    fn name(&self) -> &'static str;

    /// See [`ReadModel::ENDPOINT`].
    fn endpoint(&self) -> (&'static str, &'static str);

    /// Opens the model of one partition (`serving.part`), serves its query endpoint on
    /// `serving` and spawns its loop, which starts from the partition's checkpoint here or
    /// from its newest snapshot in `snapshots`, whichever holds more.
    #[allow(clippy::too_many_arguments)]
    async fn launch(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        bus: Bus,
        serving: &Serving<'_>,
        shared: &Shared,
        snapshots: &engram_snapshots::SnapshotStore,
        stop: CancellationToken,
    ) -> Result<Launched, StartError>;

    /// See [`ReadModel::slice`].
    fn slice(&self, snapshot: &[u8], keep: &[ScopeKey]) -> Result<Option<Vec<u8>>, String>;

    /// How many items of `keys` an exported snapshot holds: loaded into a scratch copy of
    /// the model in `dir` (emptied after), nothing replayed. What erasure verification asks
    /// of the newest snapshot.
    async fn snapshot_traces(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        snapshot: &[u8],
        keys: &[ScopeKey],
    ) -> Result<u64, StartError>;

    /// Loads an exported snapshot of partition `part` into its model and replays the
    /// partition after it; returns the sequence reached and the state hash.
    #[allow(clippy::too_many_arguments)]
    async fn bootstrap(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        bus: Bus,
        part: &Part,
        shared: &Shared,
        snapshot: &[u8],
        progress: &mut (dyn FnMut(Seq, Seq) + Send),
    ) -> Result<(Seq, [u8; 32]), StartError>;

    /// Empties the model of partition `part` and replays the partition into it; returns
    /// the sequence reached and the state hash.
    async fn rebuild(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        bus: Bus,
        part: &Part,
        shared: &Shared,
        progress: &mut (dyn FnMut(Seq, Seq) + Send),
    ) -> Result<(Seq, [u8; 32]), StartError>;
}

struct Entry<M>(PhantomData<fn() -> M>);

#[async_trait]
impl<M: ReadModel> Registered for Entry<M> {
    fn name(&self) -> &'static str {
        M::NAME
    }

    fn endpoint(&self) -> (&'static str, &'static str) {
        M::ENDPOINT
    }

    async fn launch(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        bus: Bus,
        serving: &Serving<'_>,
        shared: &Shared,
        snapshots: &engram_snapshots::SnapshotStore,
        stop: CancellationToken,
    ) -> Result<Launched, StartError> {
        let projection = M::open(config, dir, shared).await?;
        let projector = Projector::new(
            projection.clone(),
            bus.clone(),
            settings::<M>(config, dir, &serving.part),
        );
        let visibility = projector.visibility();
        let background = M::background(
            config,
            projection.clone(),
            visibility.clone(),
            bus,
            &serving.part,
            stop.clone(),
        );
        let endpoints = Endpoints {
            name: M::NAME,
            serving,
            visibility: visibility.clone(),
        };
        let (op, label) = M::ENDPOINT;
        let answering = projection.clone();
        endpoints
            .serve(op, label, move |request: M::Request, visible| {
                M::answer(answering.clone(), request, visible)
            })
            .await?;
        M::more_endpoints(projection.clone(), &endpoints).await?;
        let status: Arc<dyn Projection> = projection;
        let cutter = projector.cutter();
        let (store, instance) = (snapshots.clone(), serving.part.instance);
        let run = async move {
            let restored = projector
                .restore_or_import(async |held| crate::newer_snapshot(&store, instance, held).await)
                .await?;
            projector.run_restored(restored, stop).await
        };
        Ok((visibility, tokio::spawn(run), status, cutter, background))
    }

    fn slice(&self, snapshot: &[u8], keep: &[ScopeKey]) -> Result<Option<Vec<u8>>, String> {
        M::slice(snapshot, keep)
    }

    async fn snapshot_traces(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        snapshot: &[u8],
        keys: &[ScopeKey],
    ) -> Result<u64, StartError> {
        let projection = M::open(config, dir, &Shared::new(dir)).await?;
        projection.import(snapshot).await.map_err(|source| {
            StartError::Projector(engram_projection_runtime::ProjectorError::Projection {
                projector: M::NAME,
                source,
            })
        })?;
        let traces = projection.traces(keys).await;
        let _ = projection.reset().await;
        Ok(traces)
    }

    async fn bootstrap(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        bus: Bus,
        part: &Part,
        shared: &Shared,
        snapshot: &[u8],
        progress: &mut (dyn FnMut(Seq, Seq) + Send),
    ) -> Result<(Seq, [u8; 32]), StartError> {
        let projection = M::open(config, dir, shared).await?;
        let projector = Projector::new(projection.clone(), bus, settings::<M>(config, dir, part));
        let applied = projector.bootstrap(snapshot, progress).await?;
        Ok((applied.seq, projection.state_hash().await))
    }

    async fn rebuild(
        &self,
        config: &ProjectorsConfig,
        dir: &Path,
        bus: Bus,
        part: &Part,
        shared: &Shared,
        progress: &mut (dyn FnMut(Seq, Seq) + Send),
    ) -> Result<(Seq, [u8; 32]), StartError> {
        let projection = M::open(config, dir, shared).await?;
        let projector = Projector::new(projection.clone(), bus, settings::<M>(config, dir, part));
        let applied = projector.rebuild(progress).await?;
        Ok((applied.seq, projection.state_hash().await))
    }
}

/// [`ReadModel::slice`] of a model saved whole in the checkpoint format: decode, keep the
/// scopes, encode again.
pub(crate) fn slice_of<M>(
    snapshot: &[u8],
    keep: &[ScopeKey],
    name: &str,
) -> Result<Option<Vec<u8>>, String>
where
    M: engram_memory::model::Sliced + Serialize + DeserializeOwned,
{
    let (ledger, model) =
        engram_projection_runtime::snapshot::decode::<M>(snapshot, "the snapshot", name)
            .map_err(|e| e.to_string())?;
    engram_projection_runtime::snapshot::encode(&ledger, &model.into_slice(keep))
        .map(Some)
        .map_err(|e| e.to_string())
}

/// The loop settings of a model's instance for one partition: its partition's subjects, its
/// durable consumer (`<model>-p<partition>`, and `-<replica>` for a replica), and the state
/// dir that keeps its dead-letter id key (the same key after a restart is what deduplicates
/// a dead letter sent again after a crash).
fn settings<M: ReadModel>(config: &ProjectorsConfig, dir: &Path, part: &Part) -> ProjectorSettings {
    ProjectorSettings {
        state_dir: Some(dir.to_owned()),
        consumer: Some(match &config.replica {
            Some(replica) => format!("{}-{replica}", part.instance),
            None => part.instance.to_owned(),
        }),
        filter: Some(engram_schema::partition_filter(part.index)),
        instance: Some(part.instance),
        ..M::settings(config)
    }
}

/// A registered read model's name: parsed against [`REGISTRY`], so an unknown name is an
/// error listing the known ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProjectorName(&'static str);

impl ProjectorName {
    pub const VECTOR: Self = Self(crate::vector::NAME);
    pub const KEYWORD: Self = Self(crate::keyword::NAME);
    pub const FACTS: Self = Self(crate::facts::NAME);
    pub const SKILLS: Self = Self(crate::skills::NAME);
    pub const DOCS: Self = Self(crate::docs::NAME);
    pub const CONSOLIDATOR: Self = Self(crate::consolidator::NAME);

    /// Every registered read model, in start order.
    pub fn all() -> Vec<Self> {
        REGISTRY.iter().map(|m| Self(m.name())).collect()
    }

    pub fn as_str(self) -> &'static str {
        self.0
    }

    pub(crate) fn model(self) -> &'static dyn Registered {
        *REGISTRY
            .iter()
            .find(|m| m.name() == self.0)
            .expect("a ProjectorName is only made from the registry")
    }
}

impl fmt::Display for ProjectorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl FromStr for ProjectorName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        REGISTRY
            .iter()
            .find(|m| m.name() == s)
            .map(|m| Self(m.name()))
            .ok_or_else(|| {
                let known: Vec<&str> = REGISTRY.iter().map(|m| m.name()).collect();
                format!(
                    "unknown projector {s:?}; expected one of: {}",
                    known.join(", ")
                )
            })
    }
}

impl Serialize for ProjectorName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.0)
    }
}

impl<'de> serde::Deserialize<'de> for ProjectorName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use engram_memory::proto::read_models;

    use super::*;

    #[test]
    fn names_are_unique_and_parse_back() {
        let names = ProjectorName::all();
        for name in &names {
            assert_eq!(name.as_str().parse::<ProjectorName>().unwrap(), *name);
            assert_eq!(names.iter().filter(|n| *n == name).count(), 1, "{name}");
        }
        let err = "vectors".parse::<ProjectorName>().unwrap_err();
        assert!(
            err.contains("vector, keyword, facts, skills, docs"),
            "{err}"
        );
    }

    #[test]
    fn the_registry_runs_every_model_of_the_table_as_the_table_says() {
        // The registry is in start order, the table in snapshot-cut order: the same models,
        // each once.
        let mut registered: Vec<&str> = REGISTRY.iter().map(|m| m.name()).collect();
        let mut tabled: Vec<&str> = read_models::TABLE.iter().map(|m| m.name).collect();
        registered.sort_unstable();
        tabled.sort_unstable();
        assert_eq!(registered, tabled);
        assert!(
            registered.windows(2).all(|w| w[0] != w[1]),
            "{registered:?}"
        );

        for model in REGISTRY {
            let name = model.name();
            let spec = read_models::spec(name).expect("every registered model has a row");
            // The main query is the table's first op; the others (the vector model's
            // neighbours) are held to what is served by tests/endpoints.rs, on a real bus.
            assert_eq!(spec.ops.first(), Some(&model.endpoint().0), "{name}");
            // A model that keeps no scope snapshots answers `None` without reading the
            // bytes; one that does cannot decode an empty snapshot.
            let slices = !matches!(model.slice(&[], &[]), Ok(None));
            assert_eq!(
                slices, spec.scope_snapshots,
                "{name}: slice against the table"
            );
        }
    }
}

//! Projections of small in-memory models (fact table, skill registry), checkpointed as one
//! snapshot file.
//!
//! Any [`EventModel`] that can be serialised is a [`SnapshotModel`] as it is: the models
//! need no wrapper type to be projected.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use async_trait::async_trait;
use engram_bus::StoredEvent;
use engram_memory::ScopeKey;
use engram_memory::Seq;
use engram_memory::model::{AppliedSeq, EventModel, Sliced};
use engram_schema::Envelope;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{ApplyLedger, Projection, ProjectionError, Rejected, snapshot};

/// A read model that lives in memory and is saved whole.
pub trait SnapshotModel: Default + Serialize + DeserializeOwned + Send + Sync + 'static {
    /// Applies one event. `Err` means the event is malformed for this model (it will be
    /// dead-lettered); the model must then be unchanged.
    fn apply_event(&mut self, seq: Seq, event: &Envelope) -> Result<(), String>;

    fn hash(&self) -> [u8; 32];

    /// Removes the scopes in `keys` (an erasure); `None` if the model keeps no scopes.
    fn erase(&mut self, _keys: &[ScopeKey]) -> Option<u64> {
        None
    }

    /// The items held of the scopes in `keys`.
    fn held(&self, _keys: &[ScopeKey]) -> u64 {
        0
    }
}

impl<M> SnapshotModel for M
where
    M: EventModel + Sliced + Default + Serialize + DeserializeOwned + Send + Sync + 'static,
{
    fn erase(&mut self, keys: &[ScopeKey]) -> Option<u64> {
        Some(Sliced::erase(self, keys))
    }

    fn held(&self, keys: &[ScopeKey]) -> u64 {
        Sliced::held(self, keys)
    }

    fn apply_event(&mut self, seq: Seq, event: &Envelope) -> Result<(), String> {
        EventModel::apply(self, seq, event)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn hash(&self) -> [u8; 32] {
        self.state_hash()
    }
}

/// A [`Projection`] of a [`SnapshotModel`], saved to `<dir>/<name>.snap`.
pub struct SnapshotProjection<M> {
    name: &'static str,
    path: PathBuf,
    model: Arc<RwLock<M>>,
    /// The sequence the model includes, refused events too; events at or below it are
    /// skipped, since a [`SnapshotModel`] need not skip them itself. Set from the ledger by
    /// `restore` and `reset`; `apply` locks it after the model, never the other way round.
    applied: Mutex<AppliedSeq>,
    /// [`Projection::applies_doc_changes`].
    doc_changes: bool,
}

impl<M: SnapshotModel> SnapshotProjection<M> {
    pub fn new(name: &'static str, dir: impl Into<PathBuf>) -> Self {
        Self {
            name,
            path: dir.into().join(format!("{name}.snap")),
            model: Arc::new(RwLock::new(M::default())),
            applied: Mutex::new(AppliedSeq::NONE),
            doc_changes: false,
        }
    }

    /// Marks the model as one that applies `doc_changed` events' changes (the docs model):
    /// the projector then decodes them, once per event, before the model sees them
    /// ([`Projection::applies_doc_changes`]); for any other model it leaves them alone.
    pub fn applying_doc_changes(mut self) -> Self {
        self.doc_changes = true;
        self
    }

    /// Read access for queries. Hold it briefly: the projector waits for it to apply.
    pub fn read(&self) -> RwLockReadGuard<'_, M> {
        self.model.read().unwrap_or_else(|p| p.into_inner())
    }

    fn set_applied(&self, applied: AppliedSeq) {
        *self.applied.lock().unwrap_or_else(|p| p.into_inner()) = applied;
    }
}

#[async_trait]
impl<M: SnapshotModel> Projection for SnapshotProjection<M> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn state_dir(&self) -> Option<&std::path::Path> {
        self.path.parent()
    }

    fn applies_doc_changes(&self) -> bool {
        self.doc_changes
    }

    fn import_is_checkpoint(&self) -> bool {
        true
    }

    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        let (path, name) = (self.path.clone(), self.name);
        let loaded = tokio::task::spawn_blocking(move || snapshot::load::<M>(&path, name))
            .await
            .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        let ledger = match loaded {
            Some((ledger, model)) => {
                *self.model.write().unwrap_or_else(|p| p.into_inner()) = model;
                ledger
            }
            None => ApplyLedger::default(),
        };
        self.set_applied(AppliedSeq::through(ledger.seq));
        Ok(ledger)
    }

    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        let mut model = self.model.write().unwrap_or_else(|p| p.into_inner());
        let mut applied = self.applied.lock().unwrap_or_else(|p| p.into_inner());
        let mut rejected = Vec::new();
        for (index, stored) in events.iter().enumerate() {
            if applied.holds(stored.seq) {
                continue;
            }
            if let Err(reason) = model.apply_event(stored.seq, &stored.event) {
                rejected.push(Rejected { index, reason });
            }
            // A refused event is dead-lettered, not retried: the sequence moves past it.
            applied.advance(stored.seq);
        }
        Ok(rejected)
    }

    async fn checkpoint(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        let (path, model, applied) = (self.path.clone(), self.model.clone(), *applied);
        tokio::task::spawn_blocking(move || {
            let model = model.read().unwrap_or_else(|p| p.into_inner());
            snapshot::save(&path, &applied, &*model)
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))?
    }

    async fn reset(&self) -> Result<(), ProjectionError> {
        *self.model.write().unwrap_or_else(|p| p.into_inner()) = M::default();
        self.set_applied(AppliedSeq::NONE);
        snapshot::remove(&self.path)
    }

    async fn export(&self, applied: &ApplyLedger) -> Result<Option<Vec<u8>>, ProjectionError> {
        let (model, applied) = (self.model.clone(), *applied);
        tokio::task::spawn_blocking(move || {
            let model = model.read().unwrap_or_else(|p| p.into_inner());
            snapshot::encode(&applied, &*model).map(Some)
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))?
    }

    async fn import(&self, bytes: &[u8]) -> Result<ApplyLedger, ProjectionError> {
        let (path, name, bytes) = (self.path.clone(), self.name, bytes.to_vec());
        let (ledger, model) = tokio::task::spawn_blocking(move || {
            let (ledger, model) = snapshot::decode::<M>(&bytes, "the snapshot", name)?;
            // The blob is already in the checkpoint format: it becomes the checkpoint as it
            // is (a file write, where encoding the model again took as long as decoding it).
            snapshot::write_atomic(&path, &bytes)?;
            Ok::<_, ProjectionError>((ledger, model))
        })
        .await
        .map_err(|e| ProjectionError::Fatal(e.to_string()))??;
        *self.model.write().unwrap_or_else(|p| p.into_inner()) = model;
        self.set_applied(AppliedSeq::through(ledger.seq));
        Ok(ledger)
    }

    async fn state_hash(&self) -> [u8; 32] {
        self.read().hash()
    }

    async fn erase(&self, keys: &[ScopeKey]) -> Result<u64, ProjectionError> {
        self.model
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .erase(keys)
            .ok_or_else(|| {
                ProjectionError::Fatal(format!("projector {} keeps no scopes to erase", self.name))
            })
    }

    async fn traces(&self, keys: &[ScopeKey]) -> u64 {
        self.read().held(keys)
    }
}

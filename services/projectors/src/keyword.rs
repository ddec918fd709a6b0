//! The keyword projector: BM25 over episodic and semantic text memories, in tantivy.
//!
//! Which memories there are, and what forgettings, distrust signals and consolidation outputs
//! do to them, is [`engram_text::TextMemories`]' to decide, the same model the vector index
//! follows; this module keeps tantivy in step with the operations it returns. A memory whose
//! confidence changed is added again, replacing its document: the index filters on it.
//!
//! tantivy is the checkpoint: each publish is a durable commit whose payload holds the apply
//! ledger (the applied sequence with the count and digest of the events applied), so index
//! and ledger can never disagree after a crash. A commit costs an fsync, so while the
//! projector works through a backlog it commits every `keyword_commit_interval`, and at the
//! tail at most every `keyword_tail_commit_gap`. What is added between commits is searched
//! from the index's in-memory tail segment at the same BM25 scores, so a memory is
//! searchable as soon as it is applied ([`Projection::searchable_when_applied`]); the commit
//! only makes it durable. Hits are read from the model, so a memory forgotten or distrusted
//! since the last commit is shown as it is now.
//!
//! The ids of forgotten memories and of the signals applied are kept across restarts, so
//! that a late retry of either (outside the stream's duplicate window) is indexed or applied
//! no second time: they go to an append-only log beside the index (`keyword-ids.log`),
//! fsynced before each commit, and the commit's note records the log's length. A restart
//! reads the log up to that length and cuts off what a crash left after it, then rebuilds
//! the model from the committed documents and the log.
//!
//! A snapshot of the model (`export`) is every memory with its metadata, and the forgotten
//! and signal ids, in the checkpoint format; a replica `import`s it by replacing its index
//! with those memories in one commit. It holds every memory's text once: a million memories
//! make a blob of some hundreds of MB, built in one piece, like the other models' snapshots.
//!
//! An erasure ([`Projection::erase`]) deletes every document of its scopes by their scope
//! terms, and drops what the model keeps of them. The commit that follows writes the ids log
//! anew without them, and then merges the segments holding the deleted documents, so that
//! their text leaves the disk too: tantivy only marks a deleted document until a merge drops
//! it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use engram_bus::StoredEvent;
use engram_keyword::{IndexFiles, KeywordIndex, KeywordReader};
use engram_memory::confidence::Withdrawn;
use engram_memory::proto::{MemoryHit, SearchRequest, SearchResponse};
use engram_memory::{ScopeKey, Seq};
use engram_projection_runtime::{ApplyLedger, Projection, ProjectionError, Rejected, snapshot};
use engram_rpc::Failure;
use engram_schema::EventId;
use engram_text::{IndexOp, Memory, Parts, TextMemories};
use serde::{Deserialize, Serialize};

pub const NAME: &str = engram_memory::proto::read_models::KEYWORD;

pub struct KeywordProjection {
    dir: PathBuf,
    /// Forgotten and signal ids, beside the index (see the module docs).
    ids: Arc<IdsLog>,
    writer: Mutex<Option<KeywordIndex>>,
    reader: RwLock<Option<KeywordReader>>,
    /// Every memory applied, committed or not: hits' text, provenance and confidence.
    text: Arc<RwLock<TextMemories>>,
    /// The last sequence applied to the index and its tail: what searches report visible.
    visible: Arc<AtomicU64>,
    /// What the next commit makes durable besides the documents.
    staged: Mutex<Staged>,
    /// Snapshot imports that installed the exporter's index files (rather than indexing
    /// the memories again).
    installed: AtomicU64,
}

/// Applied since the last commit.
#[derive(Default)]
struct Staged {
    /// Documents were added, replaced or deleted.
    changed: bool,
    /// Memories forgotten, in the order applied: their ids (with scope and any withdrawn
    /// confidence, from the model) go to the log with the next commit.
    forgotten: Vec<EventId>,
    /// Distrust signals applied, likewise. One applied by a publish that committed nothing
    /// (it lowered no confidence) waits here for the next commit; until then a restart
    /// replays it, as the commit's ledger lags it.
    signals: Vec<EventId>,
    /// Scopes were erased since the last commit: the next one writes the ids log anew
    /// without them, and purges their deleted documents from disk.
    erased: bool,
}

/// The model as a snapshot carries it (written as [`SnapshotOut`]).
#[derive(Deserialize)]
struct Snapshot {
    /// In sequence order.
    memories: Vec<Memory>,
    forgotten: Vec<EventId>,
    distrusted: Vec<EventId>,
    #[serde(default)]
    withdrawn: Withdrawn,
    /// The scopes of ids in `forgotten` and `distrusted`, where known.
    #[serde(default)]
    id_scopes: Vec<(EventId, ScopeKey)>,
    /// The exporter's committed index, holding exactly `memories`: the importer installs it
    /// instead of indexing them again. Absent when the exporter had uncommitted changes, or
    /// could not read its files; then the importer indexes the memories.
    #[serde(default)]
    index: Option<IndexFiles>,
}

/// [`Snapshot`] as written, borrowed from the model: the memories are encoded where they
/// are, not copied first. Fields in [`Snapshot`]'s order (structs are encoded as arrays).
#[derive(Serialize)]
struct SnapshotOut<'a> {
    memories: MemoriesOut<'a>,
    forgotten: &'a BTreeSet<EventId>,
    distrusted: &'a BTreeSet<EventId>,
    withdrawn: &'a Withdrawn,
    id_scopes: Vec<(&'a EventId, &'a ScopeKey)>,
    index: Option<&'a IndexFiles>,
}

struct MemoriesOut<'a>(&'a TextMemories);

impl Serialize for MemoriesOut<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.memories())
    }
}

fn fatal(e: impl std::fmt::Display) -> ProjectionError {
    ProjectionError::Fatal(format!("keyword index: {e}"))
}

/// What a commit's note holds (JSON): the apply ledger, and the part of the ids log the
/// commit covers (absent in an index committed before the log existed).
#[derive(Serialize, Deserialize)]
struct CommitNote {
    #[serde(flatten)]
    ledger: ApplyLedger,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ids_log: Option<IdsMark>,
}

/// A log's generation (its first line; a new one each time it is emptied) and length: a
/// commit names the log it was made with, so a log replaced behind its back is detected,
/// not read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct IdsMark {
    generation: String,
    bytes: u64,
}

fn note(ledger: &ApplyLedger, mark: IdsMark) -> Result<String, ProjectionError> {
    serde_json::to_string(&CommitNote {
        ledger: *ledger,
        ids_log: Some(mark),
    })
    .map_err(fatal)
}

/// Ids for the log, with their scopes where known.
type Ids = Vec<(EventId, Option<ScopeKey>)>;

fn scoped(ids: &Ids) -> impl Iterator<Item = (&EventId, Option<&ScopeKey>)> {
    ids.iter().map(|(id, scope)| (id, scope.as_ref()))
}

/// Commits `ledger` with the ids log written anew (after an erasure): the ids go to a
/// replacement under a new generation, the commit names it, then it takes the old log's
/// place. A crash between the commit and the rename leaves the replacement, which the restart
/// puts in place ([`IdsLog::adopt_replacement`]); a failure before the commit leaves the old
/// log and commit standing.
fn commit_with_new_log(
    ids: &IdsLog,
    index: &mut KeywordIndex,
    ledger: &ApplyLedger,
    forgotten: &Ids,
    distrusted: &Ids,
    withdrawn: &Withdrawn,
) -> Result<(), ProjectionError> {
    let replacement = ids.replacement();
    let previous = ids.regenerate();
    let _ = std::fs::remove_file(&replacement);
    let committed = ids
        .append_to(
            &replacement,
            scoped(forgotten),
            scoped(distrusted),
            withdrawn,
        )
        .map_err(|e| ProjectionError::Transient(format!("keyword ids log: {e}")))
        .and_then(|mark| note(ledger, mark))
        .and_then(|note| {
            index
                .commit_with_note(ledger.seq, &note)
                .map_err(|e| ProjectionError::Transient(format!("keyword commit: {e}")))
        });
    if let Err(e) = committed {
        // The replacement stays: should the commit have landed after all, the restart puts
        // it in place, else removes it.
        ids.set_generation(previous);
        return Err(e);
    }
    // Committed: the commit names the replacement, so a log left in its place would be
    // refused; the restart finishes the rename.
    std::fs::rename(&replacement, &ids.path).map_err(|e| {
        ids.broken(format_args!(
            "cannot put the log rewritten for an erasure in place: {e}"
        ))
    })
}

/// The append-only log of forgotten and signal ids beside the index: a `g <generation>`
/// line, then one `f <id> <scope>` or `d <id> <scope>` line each (a log written before
/// erasure has no scopes on these; they are read as unknown), and a
/// `w <id> <confidence> <scope>` line for each distrusted memory withdrawn.
struct IdsLog {
    path: PathBuf,
    generation: Mutex<String>,
}

impl IdsLog {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            generation: Mutex::new(EventId::new().as_str().to_owned()),
        }
    }

    fn broken(&self, what: impl std::fmt::Display) -> ProjectionError {
        ProjectionError::Fatal(format!(
            "keyword ids log {}: {what}; run `engram rebuild {NAME}`",
            self.path.display()
        ))
    }

    /// The ids of the log `mark` names, the log cut to its length (what a crash left after
    /// the last commit is dropped: its events are replayed).
    fn load(&self, mark: &IdsMark) -> Result<Logged, ProjectionError> {
        let mut logged = Logged::default();
        *self.generation.lock().unwrap_or_else(|p| p.into_inner()) = mark.generation.clone();
        self.adopt_replacement(mark)?;
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
        {
            Ok(file) => file,
            // Nothing was ever logged under this generation.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && mark.bytes == 0 => {
                return Ok(logged);
            }
            Err(e) => return Err(self.broken(e)),
        };
        let len = file.metadata().map_err(|e| self.broken(e))?.len();
        if len < mark.bytes {
            return Err(self.broken(format_args!(
                "{len} bytes, but the index's last commit covers {}",
                mark.bytes
            )));
        }
        file.set_len(mark.bytes).map_err(|e| self.broken(e))?;
        let mut text = String::new();
        use std::io::Read;
        (&file)
            .read_to_string(&mut text)
            .map_err(|e| self.broken(e))?;
        let mut lines = text.lines();
        if mark.bytes > 0 && lines.next() != Some(&format!("g {}", mark.generation)) {
            return Err(self.broken("not the log the index's last commit was made with"));
        }
        for line in lines {
            let bad = || self.broken(format_args!("a line that does not parse ({line:?})"));
            let mut parts = line.split(' ');
            let (kind, id) = match (parts.next(), parts.next().map(EventId::parse)) {
                (Some(kind), Some(Ok(id))) => (kind, id),
                _ => return Err(bad()),
            };
            match kind {
                "f" | "d" => {
                    match parts.next().map(parse_scope) {
                        Some(Some(scope)) => {
                            logged.id_scopes.insert(id.clone(), scope);
                        }
                        Some(None) => return Err(bad()),
                        None => {}
                    }
                    if kind == "f" {
                        logged.forgotten.insert(id);
                    } else {
                        logged.distrusted.insert(id);
                    }
                }
                "w" => {
                    let confidence = parts.next().and_then(|c| c.parse::<f64>().ok());
                    let scope = parts.next().and_then(parse_scope);
                    let (Some(confidence), Some(scope)) = (confidence, scope) else {
                        return Err(bad());
                    };
                    logged.withdrawn.insert(id, (scope, confidence));
                }
                _ => return Err(bad()),
            }
        }
        Ok(logged)
    }

    /// A replacing log (an import's, an erasure's) that a crash left beside this one: put in
    /// place if the index's last commit names it (the crash came between that commit and the
    /// rename), removed if not (it came before the commit, which the old log goes with).
    fn adopt_replacement(&self, mark: &IdsMark) -> Result<(), ProjectionError> {
        use std::io::BufRead;
        let replacement = self.replacement();
        let file = match std::fs::File::open(&replacement) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(self.broken(e)),
        };
        let mut first = String::new();
        std::io::BufReader::new(file)
            .read_line(&mut first)
            .map_err(|e| self.broken(e))?;
        if first.trim_end() == format!("g {}", mark.generation) {
            tracing::info!(
                log = %self.path.display(),
                "keyword ids log replaced at restart, as its last commit names the replacement"
            );
            std::fs::rename(&replacement, &self.path).map_err(|e| self.broken(e))
        } else {
            std::fs::remove_file(&replacement).map_err(|e| self.broken(e))
        }
    }

    /// Appends the ids, with their scopes where known, to the log at `path` (this log's, or
    /// a new one's) and fsyncs; returns the mark of the log with them.
    fn append_to<'a>(
        &self,
        path: &std::path::Path,
        forgotten: impl Iterator<Item = (&'a EventId, Option<&'a ScopeKey>)>,
        distrusted: impl Iterator<Item = (&'a EventId, Option<&'a ScopeKey>)>,
        withdrawn: &Withdrawn,
    ) -> std::io::Result<IdsMark> {
        use std::io::Write;
        let generation = self
            .generation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let mut text = String::new();
        if file.metadata()?.len() == 0 {
            text.push_str(&format!("g {generation}\n"));
        }
        for (kind, (id, scope)) in forgotten
            .map(|id| ("f ", id))
            .chain(distrusted.map(|id| ("d ", id)))
        {
            text.push_str(kind);
            text.push_str(id.as_str());
            if let Some(scope) = scope {
                text.push_str(&format!(" {scope}"));
            }
            text.push('\n');
        }
        for (id, (scope, confidence)) in withdrawn {
            // `{:?}` writes the shortest text that parses back to the same f64.
            text.push_str(&format!("w {} {confidence:?} {scope}\n", id.as_str()));
        }
        if !text.is_empty() {
            file.write_all(text.as_bytes())?;
            file.sync_data()?;
        }
        Ok(IdsMark {
            generation,
            bytes: file.metadata()?.len(),
        })
    }

    fn append<'a>(
        &self,
        forgotten: impl Iterator<Item = (&'a EventId, Option<&'a ScopeKey>)>,
        distrusted: impl Iterator<Item = (&'a EventId, Option<&'a ScopeKey>)>,
        withdrawn: &Withdrawn,
    ) -> std::io::Result<IdsMark> {
        self.append_to(&self.path, forgotten, distrusted, withdrawn)
    }

    /// Starts a new generation; returns the one it replaces.
    fn regenerate(&self) -> String {
        std::mem::replace(
            &mut *self.generation.lock().unwrap_or_else(|p| p.into_inner()),
            EventId::new().as_str().to_owned(),
        )
    }

    fn set_generation(&self, generation: String) {
        *self.generation.lock().unwrap_or_else(|p| p.into_inner()) = generation;
    }

    /// Empties the log, under a new generation.
    fn clear(&self) -> std::io::Result<()> {
        self.regenerate();
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Where a replacing log is written before it takes this one's place.
    fn replacement(&self) -> PathBuf {
        self.path.with_extension("log.new")
    }
}

/// A scope as [`ScopeKey`]'s `Display` writes it: `tenant/kind:id`.
fn parse_scope(text: &str) -> Option<ScopeKey> {
    let (tenant, scope) = text.split_once('/')?;
    let tenant = engram_schema::Ident::parse("tenant", tenant).ok()?;
    Some(ScopeKey::new(tenant, scope.parse().ok()?))
}

/// The ledger saved with the index's last commit (JSON in the commit's note), and the
/// length of the ids log it covers.
///
/// An index committed before ledgers existed carries a bare sequence. It is refused, not read
/// as a ledger with unknown counts: such a ledger could never be checked against the stream,
/// which is its whole purpose, and the other projectors' checkpoints need the same rebuild.
fn committed_ledger(
    index: &KeywordIndex,
) -> Result<(ApplyLedger, Option<IdsMark>), ProjectionError> {
    let seq = index.committed_seq();
    let Some(note) = index.committed_note() else {
        if seq == 0 {
            // New, or cleared for a rebuild: nothing applied.
            return Ok((ApplyLedger::default(), None));
        }
        return Err(ProjectionError::Fatal(format!(
            "the keyword index was committed at seq {seq} by an older engram, without an apply ledger; run `engram rebuild {NAME}` to replace it"
        )));
    };
    let CommitNote { ledger, ids_log } = serde_json::from_str(note).map_err(|e| {
        ProjectionError::Fatal(format!(
            "the keyword index's apply ledger {note:?} does not decode ({e}); run `engram rebuild {NAME}`"
        ))
    })?;
    if ledger.seq != seq {
        return Err(ProjectionError::Fatal(format!(
            "the keyword index was committed at seq {seq} with an apply ledger for seq {}; run `engram rebuild {NAME}`",
            ledger.seq
        )));
    }
    Ok((ledger, ids_log))
}

/// Opens the index in `dir`. One of an older schema (a field added since) is derived state:
/// it is removed and opened empty, and its empty ledger makes the projector rebuild it from
/// the stream.
fn open_index(dir: &std::path::Path) -> Result<KeywordIndex, ProjectionError> {
    match KeywordIndex::open(dir) {
        Err(engram_keyword::KeywordError::SchemaMismatch { .. }) => {
            tracing::warn!(
                dir = %dir.display(),
                "keyword index has an older schema; rebuilding it from the stream"
            );
            std::fs::remove_dir_all(dir).map_err(fatal)?;
            KeywordIndex::open(dir).map_err(fatal)
        }
        other => other.map_err(fatal),
    }
}

/// Replaces `index` (in `dir`) with the snapshot's: its committed files when it ships them
/// and they hold exactly `memories`, else `memories` indexed again; in one commit carrying
/// `seq` and `note` either way. Returns the index to keep using (`None` only when it could
/// not be opened again), and whether the files were installed, or why the replacement
/// failed: then the index is its last commit before.
fn import_index(
    index: KeywordIndex,
    dir: &std::path::Path,
    files: Option<&IndexFiles>,
    memories: &[Memory],
    seq: Seq,
    note: &str,
) -> (Option<KeywordIndex>, Result<bool, String>) {
    let mut index = index;
    if let Some(files) = files {
        // The writer's lock goes with it, once its merges have ended; installing takes it
        // again.
        if let Err(e) = index.close() {
            tracing::warn!(error = %e, "keyword index closed with a failed merge");
        }
        let installed = engram_keyword::install_files(dir, files, seq, note);
        index = match KeywordIndex::open(dir) {
            Ok(index) => index,
            Err(e) => return (None, Err(format!("reopening the index: {e}"))),
        };
        match installed {
            Ok(())
                if index.committed_seq() == seq && index.doc_count() == memories.len() as u64 =>
            {
                if let Err(e) = index.collect_garbage() {
                    tracing::warn!(error = %e, "the replaced keyword index's files stay until the next commit collects them");
                }
                tracing::debug!(
                    files = files.files.len(),
                    bytes = files.len(),
                    "keyword index installed from a snapshot"
                );
                return (Some(index), Ok(true));
            }
            Ok(()) => tracing::warn!(
                documents = index.doc_count(),
                memories = memories.len(),
                "the snapshot's index files do not hold its memories; indexing them instead"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                "the snapshot's index files do not install; indexing its memories instead"
            ),
        }
    }
    let result = index
        .replace(
            memories.iter().map(|m| (&m.meta, m.text.as_str())),
            seq,
            note,
        )
        .map(|()| false)
        .map_err(|e| e.to_string());
    (Some(index), result)
}

/// What the ids log holds.
#[derive(Default)]
struct Logged {
    forgotten: BTreeSet<EventId>,
    distrusted: BTreeSet<EventId>,
    withdrawn: Withdrawn,
    id_scopes: BTreeMap<EventId, ScopeKey>,
}

/// The ids `ids` with their scopes, as the model knows them, for the log.
fn with_scopes<'a>(text: &TextMemories, ids: impl Iterator<Item = &'a EventId>) -> Ids {
    ids.map(|id| (id.clone(), text.id_scopes().get(id).cloned()))
        .collect()
}

impl KeywordProjection {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        Self {
            ids: Arc::new(IdsLog::new(dir.join("keyword-ids.log"))),
            dir: dir.join("keyword"),
            writer: Mutex::new(None),
            reader: RwLock::new(None),
            text: Arc::default(),
            visible: Arc::default(),
            staged: Mutex::default(),
            installed: AtomicU64::new(0),
        }
    }

    /// How many snapshot imports installed the exporter's index files, for status and tests.
    pub fn indexes_installed(&self) -> u64 {
        self.installed.load(Ordering::Relaxed)
    }

    /// Memories held (applied, committed or not).
    pub fn len(&self) -> usize {
        self.text.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub async fn search(&self, request: &SearchRequest) -> Result<SearchResponse, Failure> {
        let reader = self
            .reader
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                Failure::new(
                    engram_memory::proto::ErrorCode::Unavailable,
                    "keyword index is not open yet",
                )
            })?;
        let request = request.clone();
        let (text, visible) = (self.text.clone(), self.visible.clone());
        tokio::task::spawn_blocking(move || {
            // The sequence this answer reports visible is read before the search takes its
            // searcher and tail: it moves only once a batch is in the index's tail, so the
            // search sees at least this much. Read after the search, it could name a batch
            // applied while the search ran.
            let visible_seq = visible.load(Ordering::Acquire);
            // One search, as deep as the hits, the ranks after them (`rest`) and the scoring
            // of specific memories need. BM25 of a memory beyond the depth is absent, which is
            // what it is to BM25.
            let score_depth = if request.score_also.is_empty() {
                0
            } else {
                request.k.saturating_mul(4).max(200)
            };
            let depth = request.k.max(request.rest).max(score_depth);
            let mut hits = reader
                .search(&request.query, &request.scopes, &request.filter, depth)
                .map_err(|e| Failure::invalid(e.to_string()))?;
            let text = text.read().unwrap_or_else(|p| p.into_inner());
            let wanted: HashSet<Seq> = request.score_also.iter().copied().collect();
            let ranked_after = hits.split_off(request.k.min(hits.len()));
            let also = ranked_after
                .into_iter()
                .enumerate()
                .filter(|(i, h)| request.k + i < request.rest || wanted.contains(&h.seq))
                .map(|(_, h)| h)
                .chain(hits.iter().filter(|h| wanted.contains(&h.seq)).copied())
                .collect();
            // A hit is shown as the model has it now: one forgotten since the commit is gone,
            // one distrusted since is filtered at its new confidence.
            let hits = hits
                .into_iter()
                .filter_map(|hit| {
                    let m = text.get(hit.seq)?;
                    request.filter.matches(&m.meta).then(|| MemoryHit {
                        hit,
                        meta: m.meta.clone(),
                        text: m.text.clone(),
                    })
                })
                .collect();
            Ok(SearchResponse {
                hits,
                also,
                visible_seq,
            })
        })
        .await
        .map_err(|e| Failure::new(engram_memory::proto::ErrorCode::Internal, e.to_string()))?
    }

    /// Drops erased documents from the index's files ([`KeywordIndex::purge_deleted`]),
    /// once their deletes are committed. Should it fail, the next publish commits and purges
    /// again; the erasure reports the failure meanwhile, and may be run again.
    async fn purge(&self) -> Result<(), ProjectionError> {
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        let mut index = writer
            .ok_or_else(|| ProjectionError::Fatal("keyword index used before restore".into()))?;
        // Merges rewrite segments, and fsync: off the async threads.
        let (index, result) = tokio::task::spawn_blocking(move || {
            let result = index.purge_deleted();
            (index, result)
        })
        .await
        .map_err(fatal)?;
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(index);
        match result {
            Ok(()) => {
                tracing::debug!("keyword index purged of erased documents");
                Ok(())
            }
            Err(e) => {
                let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
                staged.erased = true;
                staged.changed = true;
                Err(ProjectionError::Transient(format!(
                    "keyword index: erased documents are deleted but still on disk: {e}"
                )))
            }
        }
    }

    fn with_writer<T>(
        &self,
        f: impl FnOnce(&mut KeywordIndex) -> Result<T, engram_keyword::KeywordError>,
    ) -> Result<T, ProjectionError> {
        let mut guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let index = guard
            .as_mut()
            .ok_or_else(|| ProjectionError::Fatal("keyword index used before restore".into()))?;
        f(index).map_err(|e| ProjectionError::Transient(format!("keyword index: {e}")))
    }

    /// Puts a restored or imported model in place, with the reader and writer of its index,
    /// at the commit `ledger` names.
    fn install(&self, index: KeywordIndex, text: TextMemories, ledger: &ApplyLedger) {
        *self.reader.write().unwrap_or_else(|p| p.into_inner()) = Some(index.reader());
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(index);
        *self.text.write().unwrap_or_else(|p| p.into_inner()) = text;
        *self.staged.lock().unwrap_or_else(|p| p.into_inner()) = Staged::default();
        self.visible.store(ledger.seq, Ordering::Release);
    }
}

#[async_trait]
impl Projection for KeywordProjection {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn restore(&self) -> Result<ApplyLedger, ProjectionError> {
        let dir = self.dir.clone();
        let (index, memories) = tokio::task::spawn_blocking(move || {
            let index = open_index(&dir)?;
            let memories = index.reader().stored_all().map_err(fatal)?;
            Ok::<_, ProjectionError>((index, memories))
        })
        .await
        .map_err(fatal)??;
        let (ledger, mark) = committed_ledger(&index)?;
        let logged = match mark {
            Some(mark) => self.ids.load(&mark)?,
            None => {
                if ledger.seq > 0 {
                    // Committed before the log existed: the ids were not kept. The log starts
                    // now and keeps every id from here on.
                    tracing::warn!(
                        seq = ledger.seq,
                        "keyword index committed without an ids log: forgotten and signal ids before this start are unknown (`engram rebuild keyword` recovers them)"
                    );
                }
                self.ids.clear().map_err(fatal)?;
                Default::default()
            }
        };
        let text = TextMemories::from_parts(Parts {
            applied: ledger.seq,
            memories: memories
                .into_iter()
                .map(|(meta, text)| Memory { meta, text })
                .collect(),
            forgotten: logged.forgotten,
            distrusted: logged.distrusted,
            withdrawn: logged.withdrawn,
            id_scopes: logged.id_scopes,
        });
        self.install(index, text, &ledger);
        Ok(ledger)
    }

    /// Applies each event to the model and follows its operations in the index writer, in
    /// stream order: tantivy orders a delete after earlier adds, committed or not, and adding
    /// a sequence the index holds replaces its document.
    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        let mut rejected = Vec::new();
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let index = writer
            .as_mut()
            .ok_or_else(|| ProjectionError::Fatal("keyword index used before restore".into()))?;
        let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        for (i, stored) in events.iter().enumerate() {
            // Taken per event: searches read hits' text between them.
            let mut text = self.text.write().unwrap_or_else(|p| p.into_inner());
            let applied = match text.apply(stored.seq, &stored.event) {
                Ok(applied) => applied,
                Err(e) => {
                    rejected.push(Rejected {
                        index: i,
                        reason: e.to_string(),
                    });
                    continue;
                }
            };
            staged.signals.extend(applied.signal);
            for op in &applied.ops {
                staged.changed = true;
                let written = match op {
                    IndexOp::Index { seq, .. } | IndexOp::Reweight { seq } => {
                        let memory = text
                            .get(*seq)
                            .expect("the model holds every memory it indexes or reweights");
                        index.add(&memory.meta, &memory.text)
                    }
                    IndexOp::Unindex { seq, event_id, .. } => {
                        staged.forgotten.push(event_id.clone());
                        engram_telemetry::metrics::PROJECTOR_FORGOTTEN
                            .with_label_values(&[NAME])
                            .inc();
                        index.delete(*seq)
                    }
                };
                // The writer fails only when its indexing threads are gone, and the model has
                // already taken the event: a retry would skip it. The restart restores the
                // model from the last commit instead, and replays from there.
                written.map_err(|e| {
                    ProjectionError::Fatal(format!(
                        "keyword index writer failed at seq {}: {e}; restart the projector to restore its last commit",
                        stored.seq
                    ))
                })?;
            }
        }
        if let Some(last) = events.last() {
            let mut text = self.text.write().unwrap_or_else(|p| p.into_inner());
            text.advance_to(last.seq);
            // Every document of the batch is in the index's tail: searchable now.
            self.visible.store(text.applied(), Ordering::Release);
        }
        engram_telemetry::metrics::KEYWORD_TAIL_DOCS.set(index.reader().tail_len() as i64);
        Ok(rejected)
    }

    fn searchable_when_applied(&self) -> bool {
        true
    }

    /// The import is a commit, and a commit is the checkpoint.
    fn import_is_checkpoint(&self) -> bool {
        true
    }

    async fn publish(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        let ledger = *applied;
        let applied = applied.seq;
        // The ids this commit makes durable go to the log first: a crash after the log and
        // before the commit leaves a tail the restart cuts off. After an erasure the log is
        // written anew instead, with every id the model still keeps.
        let (erased, forgotten, distrusted, withdrawn): (bool, Ids, Ids, Withdrawn) = {
            let staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            if !staged.changed {
                // Nothing new to search: skip the fsync. The commit's ledger lags, so a restart
                // re-reads a few events that changed nothing in the index and applies them
                // again from that older ledger, which changes nothing either. Signals applied
                // meanwhile are logged with the next commit.
                self.visible.store(applied, Ordering::Release);
                return Ok(());
            }
            let text = self.text.read().unwrap_or_else(|p| p.into_inner());
            if staged.erased {
                (
                    true,
                    with_scopes(&text, text.forgotten().iter()),
                    with_scopes(&text, text.distrusted().iter()),
                    text.withdrawn().clone(),
                )
            } else {
                let withdrawn = staged
                    .forgotten
                    .iter()
                    .filter_map(|id| Some((id.clone(), text.withdrawn().get(id)?.clone())))
                    .collect();
                (
                    false,
                    with_scopes(&text, staged.forgotten.iter()),
                    with_scopes(&text, staged.signals.iter()),
                    withdrawn,
                )
            }
        };
        let writer = {
            let mut guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
            guard.take()
        };
        let mut index = writer
            .ok_or_else(|| ProjectionError::Fatal("keyword index used before restore".into()))?;
        // Both fsync: off the async threads.
        let ids = self.ids.clone();
        let (index, result) = tokio::task::spawn_blocking(move || {
            let result = if erased {
                commit_with_new_log(
                    &ids,
                    &mut index,
                    &ledger,
                    &forgotten,
                    &distrusted,
                    &withdrawn,
                )
            } else {
                ids.append(scoped(&forgotten), scoped(&distrusted), &withdrawn)
                    .map_err(|e| ProjectionError::Transient(format!("keyword ids log: {e}")))
                    .and_then(|mark| note(&ledger, mark))
                    .and_then(|note| {
                        index
                            .commit_with_note(applied, &note)
                            .map_err(|e| ProjectionError::Transient(format!("keyword commit: {e}")))
                    })
            };
            (index, result)
        })
        .await
        .map_err(fatal)?;
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(index);
        result?;
        *self.staged.lock().unwrap_or_else(|p| p.into_inner()) = Staged::default();
        self.visible.store(applied, Ordering::Release);
        if erased {
            // After the commit is visible: searches see its memories meanwhile.
            self.purge().await?;
        }
        Ok(())
    }

    async fn checkpoint(&self, _applied: &ApplyLedger) -> Result<(), ProjectionError> {
        // Every publish is already a durable commit carrying its ledger.
        Ok(())
    }

    async fn reset(&self) -> Result<(), ProjectionError> {
        {
            let mut guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
            if guard.is_none() {
                let index = open_index(&self.dir)?;
                *self.reader.write().unwrap_or_else(|p| p.into_inner()) = Some(index.reader());
                *guard = Some(index);
            }
        }
        self.with_writer(|index| index.clear())?;
        self.ids.clear().map_err(fatal)?;
        *self.text.write().unwrap_or_else(|p| p.into_inner()) = TextMemories::default();
        *self.staged.lock().unwrap_or_else(|p| p.into_inner()) = Staged::default();
        self.visible.store(0, Ordering::Release);
        Ok(())
    }

    /// The model at `applied`, in sequence order, with the committed index's files when
    /// nothing is staged since that commit (a cut publishes first, so normally nothing is):
    /// the commit then holds exactly the model's memories.
    async fn export(&self, applied: &ApplyLedger) -> Result<Option<Vec<u8>>, ProjectionError> {
        let handle = {
            let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
            let staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            writer
                .as_ref()
                .filter(|_| !staged.changed)
                .map(KeywordIndex::handle)
        };
        let (text, applied) = (self.text.clone(), *applied);
        tokio::task::spawn_blocking(move || {
            let files = handle.and_then(|handle| match handle.committed_files() {
                Ok(files) => Some(files),
                Err(e) => {
                    tracing::warn!(error = %e, "keyword snapshot without its index files: the importer indexes its memories");
                    None
                }
            });
            let text = text.read().unwrap_or_else(|p| p.into_inner());
            let out = SnapshotOut {
                memories: MemoriesOut(&text),
                forgotten: text.forgotten(),
                distrusted: text.distrusted(),
                withdrawn: text.withdrawn(),
                id_scopes: text.id_scopes().iter().collect(),
                index: files.as_ref(),
            };
            snapshot::encode(&applied, &out).map(Some)
        })
        .await
        .map_err(fatal)?
    }

    /// Checks the blob, then replaces the index with its memories in one commit carrying its
    /// ledger (tantivy's commit is the checkpoint), and the model with them. A blob that does
    /// not check, or an index that fails before the commit, leaves the model as it was.
    async fn import(&self, bytes: &[u8]) -> Result<ApplyLedger, ProjectionError> {
        let bytes = bytes.to_vec();
        let (ledger, snap) = tokio::task::spawn_blocking(move || {
            snapshot::decode::<Snapshot>(&bytes, "the keyword snapshot", NAME)
        })
        .await
        .map_err(fatal)??;
        // Replacing the index discards what is uncommitted; a loader runs before any apply.
        if self
            .staged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .changed
        {
            return Err(ProjectionError::Fatal(
                "keyword snapshot import with unpublished changes; import before applying".into(),
            ));
        }
        let writer = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
        let index = match writer {
            Some(index) => index,
            // Not restored (its checkpoint was unusable): opened here, to be replaced.
            None => open_index(&self.dir)?,
        };
        // The snapshot's ids go to a new log under a new generation, which takes the old
        // one's place once the commit naming it is made. A crash between the two leaves the
        // old log, which the commit does not name: the restart says so and asks for a
        // rebuild, rather than reading the wrong ids.
        let replacement = self.ids.replacement();
        let previous = self.ids.regenerate();
        let _ = std::fs::remove_file(&replacement);
        let id_scopes: BTreeMap<EventId, ScopeKey> = snap.id_scopes.into_iter().collect();
        let logged = self.ids.append_to(
            &replacement,
            snap.forgotten.iter().map(|id| (id, id_scopes.get(id))),
            snap.distrusted.iter().map(|id| (id, id_scopes.get(id))),
            &snap.withdrawn,
        );
        let logged = match logged {
            Ok(mark) => mark,
            Err(e) => {
                self.ids.set_generation(previous);
                *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(index);
                return Err(ProjectionError::Transient(format!("keyword ids log: {e}")));
            }
        };
        let note = note(&ledger, logged)?;
        // Files to write, or thousands of documents per second, and fsyncs: off the async
        // threads.
        let dir = self.dir.clone();
        let (index, memories, result) = tokio::task::spawn_blocking(move || {
            let mut memories = snap.memories;
            memories.sort_by_key(|m| m.meta.seq);
            let (index, result) = import_index(
                index,
                &dir,
                snap.index.as_ref(),
                &memories,
                ledger.seq,
                &note,
            );
            (index, memories, result)
        })
        .await
        .map_err(fatal)?;
        let index = match (index, result) {
            (Some(index), Ok(installed)) => {
                self.installed
                    .fetch_add(u64::from(installed), Ordering::Relaxed);
                index
            }
            (index, result) => {
                // The old commit stands, with its log and model.
                if let Some(index) = index {
                    *self.reader.write().unwrap_or_else(|p| p.into_inner()) = Some(index.reader());
                    *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(index);
                }
                self.ids.set_generation(previous);
                let why = result
                    .err()
                    .unwrap_or_else(|| "the index did not reopen".into());
                return Err(ProjectionError::Transient(format!(
                    "keyword snapshot import: {why}"
                )));
            }
        };
        std::fs::rename(&replacement, &self.ids.path).map_err(|e| {
            self.ids
                .broken(format_args!("cannot put the imported log in place: {e}"))
        })?;
        let text = TextMemories::from_parts(Parts {
            applied: ledger.seq,
            memories,
            forgotten: snap.forgotten.into_iter().collect(),
            distrusted: snap.distrusted.into_iter().collect(),
            withdrawn: snap.withdrawn,
            id_scopes,
        });
        self.install(index, text, &ledger);
        tracing::info!(
            memories = self.len(),
            seq = ledger.seq,
            "keyword snapshot imported"
        );
        Ok(ledger)
    }

    /// The model's: every memory applied (committed or still in the index's tail) and the
    /// ids kept. A hash of the committed documents alone would lag what searches already
    /// find, and differ between a replica that just committed and one that did not.
    async fn state_hash(&self) -> [u8; 32] {
        self.text
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .state_hash()
    }

    /// Deletes every document of the scopes `keys` by its scope term, and drops what the
    /// model keeps of them; returns how many events that was ([`traces`](Projection::traces)
    /// before). The publish the loop makes right after commits the deletes with the log
    /// written anew, then merges the deleted documents out of the index's files
    /// ([`KeywordIndex::purge_deleted`]). Ids logged before the log named their scopes cannot
    /// be attributed, and stay (bare ids, no text).
    async fn erase(&self, keys: &[ScopeKey]) -> Result<u64, ProjectionError> {
        let keys: HashSet<ScopeKey> = keys.iter().cloned().collect();
        // The deletes first: should they fail, the model still says what the index holds.
        // Every document of the scopes goes, uncommitted ones included; none added after,
        // as the loop erases between batches.
        self.with_writer(|index| keys.iter().try_for_each(|key| index.delete_scope(key)))?;
        let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        let erased = self
            .text
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .erase(&keys);
        // The next commit writes the whole log from the model, which no longer has them.
        staged.erased = true;
        staged.changed = true;
        if erased.unattributed > 0 {
            tracing::warn!(
                ids = erased.unattributed,
                "forgotten memories' and applied signals' ids logged before the log named their scopes cannot be attributed to a scope; those of the erased scopes stay, without text"
            );
        }
        tracing::debug!(
            scopes = keys.len(),
            memories = erased.seqs.len(),
            events = erased.events,
            "keyword scopes erased"
        );
        Ok(erased.events)
    }

    /// The events of the scopes `keys` the model keeps anything of, as [`erase`] counts
    /// them, where the memories are the more of those in the model and those the last
    /// commit holds, so that a document the model no longer shows counts too.
    ///
    /// [`erase`]: Projection::erase
    async fn traces(&self, keys: &[ScopeKey]) -> u64 {
        let keys: HashSet<ScopeKey> = keys.iter().cloned().collect();
        let held: Vec<(&ScopeKey, engram_text::Held)> = {
            let text = self.text.read().unwrap_or_else(|p| p.into_inner());
            keys.iter()
                .map(|key| (key, text.held(&HashSet::from([key.clone()]))))
                .collect()
        };
        let reader = self
            .reader
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut traces = 0;
        for (key, held) in held {
            // A model not open, or an index that cannot count, is not clean: one trace for
            // the scope, so that verification does not pass on it.
            let counted = match &reader {
                Some(reader) => reader.scope_count(key).map_err(|e| e.to_string()),
                None => Err("the keyword index is not open yet".to_owned()),
            };
            let documents = counted.unwrap_or_else(|e| {
                tracing::warn!(scope = %key, error = %e, "cannot count a scope's keyword documents");
                1
            });
            let others = held.events.saturating_sub(held.memories);
            traces += held.memories.max(documents) + others;
        }
        traces
    }
}

/// The keyword read model, as the registry runs it.
pub struct Keyword;

#[async_trait]
impl crate::ReadModel for Keyword {
    const NAME: &'static str = NAME;
    const ENDPOINT: (&'static str, &'static str) = ("search", "keyword_search");
    type Projection = KeywordProjection;
    type Request = SearchRequest;
    type Response = SearchResponse;

    /// Publishing is a tantivy commit (a segment and an fsync), so it is spaced out.
    fn settings(config: &crate::ProjectorsConfig) -> engram_projection_runtime::ProjectorSettings {
        engram_projection_runtime::ProjectorSettings {
            publish_interval: config.keyword_commit_interval,
            tail_publish_gap: config.keyword_tail_commit_gap,
            ..config.loop_settings()
        }
    }

    async fn open(
        _config: &crate::ProjectorsConfig,
        dir: &std::path::Path,
        _shared: &crate::Shared,
    ) -> Result<Arc<KeywordProjection>, crate::StartError> {
        Ok(Arc::new(KeywordProjection::new(dir)))
    }

    async fn answer(
        projection: Arc<KeywordProjection>,
        request: SearchRequest,
        _visible: Seq,
    ) -> Result<SearchResponse, Failure> {
        projection.search(&request).await
    }
}

#[cfg(test)]
mod tests {
    use engram_memory::MemoryFilter;
    use engram_memory::proto::Consistency;
    use engram_schema::{Envelope, EventKind, Layer};
    use engram_testkit::{event, stored};

    use super::*;

    /// The word every memory below shares, to search for.
    const SECRET: &str = "hippogriff";
    /// One word per memory, for the bytes on disk. tantivy's term dictionary (an FST) does not
    /// keep a term's bytes in one piece, but the doc store keeps the stored text, LZ4
    /// compressed in blocks: a word found nowhere else in its block stays a literal there.
    /// So each word appears with its memory only, and no two share four bytes in a row (LZ4's
    /// shortest back reference).
    const ERASED_WORD: &str = "quixoticzebrafjord";
    const OTHER_SCOPE_WORD: &str = "umbrellagnomes";
    const OTHER_TENANT_WORD: &str = "lanternpotash";

    fn scope(tenant: &str, task: &str) -> ScopeKey {
        ScopeKey::of(&event(tenant, task, "x"))
    }

    fn forget(target: &Envelope) -> Envelope {
        let mut e = event(
            target.tenant.as_str(),
            target.scope.id.as_str(),
            "forget it",
        );
        e.kind = EventKind::Forgotten;
        e.layer = Layer::Working;
        e.content.data = Some(serde_json::json!({"event_ids": [target.event_id.as_str()]}));
        e
    }

    /// An outcome (no text, so not a memory) contradicting `target`: a distrust signal.
    fn contradict(target: &Envelope) -> Envelope {
        let mut e = event(target.tenant.as_str(), target.scope.id.as_str(), "");
        e.kind = EventKind::Outcome;
        e.content.data = Some(serde_json::json!({"contradicts": [target.event_id.as_str()]}));
        e
    }

    async fn opened(dir: &std::path::Path) -> (KeywordProjection, ApplyLedger) {
        let keyword = KeywordProjection::new(dir);
        let ledger = keyword.restore().await.unwrap();
        (keyword, ledger)
    }

    async fn apply(
        keyword: &KeywordProjection,
        events: &[Envelope],
        first_seq: u64,
    ) -> ApplyLedger {
        let batch = stored(events, first_seq);
        assert!(keyword.apply(&batch).await.unwrap().is_empty());
        let ledger = ApplyLedger {
            seq: batch.last().unwrap().seq,
            ..ApplyLedger::default()
        };
        keyword.publish(&ledger).await.unwrap();
        ledger
    }

    async fn found(keyword: &KeywordProjection, scope: &ScopeKey, query: &str) -> Vec<String> {
        let request = SearchRequest {
            scopes: vec![scope.clone()],
            query: query.into(),
            vector: None,
            k: 10,
            filter: MemoryFilter::default(),
            consistency: Consistency::default(),
            score_also: Vec::new(),
            rest: 0,
        };
        let hits = keyword.search(&request).await.unwrap().hits;
        hits.into_iter().map(|h| h.text).collect()
    }

    /// The files under `dir`, at any depth, whose bytes hold `needle`.
    fn files_holding(dir: &std::path::Path, needle: &[u8]) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut dirs = vec![dir.to_path_buf()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if std::fs::read(&path)
                    .unwrap()
                    .windows(needle.len())
                    .any(|w| w == needle)
                {
                    found.push(path);
                }
            }
        }
        found
    }

    /// The traces of each scope in `scopes`.
    async fn traces(keyword: &KeywordProjection, scopes: &[ScopeKey]) -> Vec<u64> {
        let mut traces = Vec::new();
        for scope in scopes {
            traces.push(keyword.traces(std::slice::from_ref(scope)).await);
        }
        traces
    }

    /// Alive and deleted documents in the index in `dir`, as a reader of its own sees them.
    fn documents(dir: &std::path::Path) -> (u64, u64) {
        let index = tantivy::Index::open_in_dir(dir.join("keyword")).unwrap();
        let searcher = index.reader().unwrap().searcher();
        let deleted = searcher
            .segment_readers()
            .iter()
            .map(|s| u64::from(s.num_deleted_docs()))
            .sum();
        (searcher.num_docs(), deleted)
    }

    #[tokio::test]
    async fn an_erased_scope_leaves_nothing_in_the_index_its_files_or_the_ids_log() {
        let dir = tempfile::tempdir().unwrap();
        let (erased, other_scope, other_tenant) = (
            scope("acme", "t1"),
            scope("acme", "t2"),
            scope("acme2", "t1"),
        );
        let secret = event("acme", "t1", &format!("the {SECRET} code is {ERASED_WORD}"));
        let kept = event(
            "acme",
            "t2",
            &format!("the {SECRET} code is {OTHER_SCOPE_WORD}"),
        );
        let beside = event(
            "acme2",
            "t1",
            &format!("the {SECRET} code is {OTHER_TENANT_WORD}"),
        );
        let claim = event("acme", "t1", "a claim about the weather");
        let other_claim = event("acme", "t2", "a claim about the tides");
        let (signal, other_signal) = (contradict(&claim), contradict(&other_claim));
        let (keyword, _) = opened(dir.path()).await;
        // Given memories in two scopes of acme and in acme2's scope of the same id, each
        // committed; and in each acme scope a claim contradicted, then forgotten, so that the
        // ids log holds ids and a withdrawn confidence of both.
        let events = [
            secret.clone(),
            kept,
            beside,
            claim.clone(),
            other_claim.clone(),
        ];
        apply(&keyword, &events, 1).await;
        let events = [
            signal.clone(),
            other_signal,
            forget(&claim),
            forget(&other_claim),
        ];
        let ledger = apply(&keyword, &events, 6).await;
        let log = dir.path().join("keyword-ids.log");
        let read_log = || std::fs::read_to_string(&log).unwrap();
        // (What the assertions below look for is there to be found: the erased word in the
        // index's files, the erased scope in the log.)
        assert!(!files_holding(&dir.path().join("keyword"), ERASED_WORD.as_bytes()).is_empty());
        assert!(
            read_log().contains(&format!(" {erased}\n")),
            "{}",
            read_log()
        );
        // The memory, the forgotten claim and the signal: three events each in acme.
        assert_eq!(keyword.traces(std::slice::from_ref(&erased)).await, 3);
        assert_eq!(keyword.traces(std::slice::from_ref(&other_scope)).await, 3);
        assert_eq!(keyword.traces(std::slice::from_ref(&other_tenant)).await, 1);
        let (alive, _) = documents(dir.path());
        assert_eq!(alive, 3);

        // When one acme scope is erased, and published as the loop does right after.
        assert_eq!(
            keyword.erase(std::slice::from_ref(&erased)).await.unwrap(),
            3
        );
        keyword.publish(&ledger).await.unwrap();

        // Then nothing of it is left, and everything of the others is.
        let scopes = [erased.clone(), other_scope.clone(), other_tenant.clone()];
        assert_eq!(traces(&keyword, &scopes).await, [0, 3, 1]);
        assert!(found(&keyword, &erased, SECRET).await.is_empty());
        assert!(found(&keyword, &erased, ERASED_WORD).await.is_empty());
        assert_eq!(found(&keyword, &other_scope, SECRET).await.len(), 1);
        assert_eq!(found(&keyword, &other_tenant, SECRET).await.len(), 1);
        // A deleted document is only marked in tantivy: its stored text and its terms stay
        // in the segment's files until a merge rewrites them. So the check is on the bytes
        // themselves, in every file under the data directory: the erased word was found in
        // the index's files (its doc store) before the erasure, and is gone now, while the
        // kept memories' words are still found; a commit of the deletes without the merge
        // fails here. And a reader of its own finds the documents left, and no deleted one
        // still held in a segment.
        assert_eq!(
            files_holding(dir.path(), ERASED_WORD.as_bytes()),
            Vec::<PathBuf>::new()
        );
        let index_dir = dir.path().join("keyword");
        assert!(!files_holding(&index_dir, OTHER_SCOPE_WORD.as_bytes()).is_empty());
        assert!(!files_holding(&index_dir, OTHER_TENANT_WORD.as_bytes()).is_empty());
        assert_eq!(documents(dir.path()), (2, 0));
        // The ids log was written anew without the scope's lines (ids and scope), and with
        // the other scope's.
        let text = read_log();
        for gone in [
            erased.to_string(),
            claim.event_id.to_string(),
            signal.event_id.to_string(),
        ] {
            assert!(!text.contains(&gone), "{gone} in {text:?}");
        }
        assert!(text.contains(&format!(" {other_scope}\n")), "{text:?}");

        // And a restart from disk brings none of it back.
        drop(keyword);
        let (keyword, restored) = opened(dir.path()).await;
        assert_eq!(restored.seq, ledger.seq);
        assert_eq!(keyword.len(), 2);
        assert_eq!(traces(&keyword, &scopes).await, [0, 3, 1]);
        assert!(found(&keyword, &erased, SECRET).await.is_empty());
        assert_eq!(found(&keyword, &other_scope, SECRET).await.len(), 1);

        // And erasing it again finds nothing to remove, and changes nothing else.
        assert_eq!(
            keyword.erase(std::slice::from_ref(&erased)).await.unwrap(),
            0
        );
        keyword.publish(&ledger).await.unwrap();
        assert_eq!(traces(&keyword, &scopes).await, [0, 3, 1]);
        assert_eq!(documents(dir.path()), (2, 0));
    }

    #[tokio::test]
    async fn a_rewritten_log_a_crash_left_beside_the_old_one_is_put_in_place_if_committed() {
        let dir = tempfile::tempdir().unwrap();
        let claim = event("acme", "t1", "a claim about the weather");
        let (keyword, _) = opened(dir.path()).await;
        let ledger = apply(&keyword, &[claim.clone(), forget(&claim)], 1).await;
        let log = dir.path().join("keyword-ids.log");
        let old = std::fs::read_to_string(&log).unwrap();
        assert!(old.contains(claim.event_id.as_str()), "{old:?}");
        assert_eq!(keyword.erase(&[scope("acme", "t1")]).await.unwrap(), 1);
        keyword.publish(&ledger).await.unwrap();
        drop(keyword);
        // Given the state a crash between the erasure's commit and its rename leaves: the
        // rewritten log beside the old one, which the commit does not name.
        let new = std::fs::read_to_string(&log).unwrap();
        assert!(!new.contains(claim.event_id.as_str()), "{new:?}");
        std::fs::rename(&log, log.with_extension("log.new")).unwrap();
        std::fs::write(&log, &old).unwrap();
        // When the model restarts, it takes the log the commit names, not the old one.
        let (keyword, restored) = opened(dir.path()).await;
        assert_eq!(restored.seq, ledger.seq);
        assert_eq!(std::fs::read_to_string(&log).unwrap(), new);
        assert!(!log.with_extension("log.new").exists());
        assert_eq!(keyword.traces(&[scope("acme", "t1")]).await, 0);
        drop(keyword);
        // And a replacement the commit does not name (a crash before the commit) is removed.
        std::fs::write(log.with_extension("log.new"), "g another\n").unwrap();
        let (keyword, _) = opened(dir.path()).await;
        assert_eq!(std::fs::read_to_string(&log).unwrap(), new);
        assert!(!log.with_extension("log.new").exists());
        drop(keyword);
    }
}

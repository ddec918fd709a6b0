//! The keyword projector: BM25 over episodic and semantic text memories, in tantivy.
//!
//! tantivy is the checkpoint: each publish is a durable commit whose payload holds the apply
//! ledger (the applied sequence with the count and digest of the events applied), so index
//! and ledger can never disagree after a crash. A commit is also what makes new memories
//! searchable. It costs an fsync, so while the projector works through a backlog it commits
//! every `keyword_commit_interval`, and at the tail at most every `keyword_tail_commit_gap`.
//!
//! A `forgotten` event deletes its memories' documents. An outcome or feedback naming
//! contradicted memories, or a feedback flagging a faulty instance, lowers the confidence
//! of memories of its own scope recorded before it ([`engram_memory::confidence`]): each
//! such memory's document is added again with its new confidence, which the index filters
//! on.
//!
//! The ids of forgotten memories and of the signals applied are kept across restarts, so
//! that a late retry of either (outside the stream's duplicate window) is indexed or applied
//! no second time: they go to an append-only log beside the index (`keyword-ids.log`),
//! fsynced before each commit, and the commit's note records the log's length. A restart
//! reads the log up to that length and cuts off what a crash left after it.
//!
//! A snapshot of the model (`export`) is every memory of the last commit with its metadata,
//! and the forgotten and signal ids this process knows, in the checkpoint format; a replica
//! `import`s it by replacing its index with those memories in one commit. It holds every
//! memory's text once: a million memories make a blob of some hundreds of MB, built in one
//! piece, like the other models' snapshots.
//!
//! An erasure ([`Projection::erase`]) deletes every document of its scopes by their scope
//! terms, and drops what the table and the ids log keep of them: the ids of their forgotten
//! memories and of their signals applied (the log names each id's scope), and their
//! withdrawn confidences. The commit that follows writes the log anew without them, and then
//! merges the segments holding the deleted documents, so that their text leaves the disk
//! too: tantivy only marks a deleted document until a merge drops it.
//!
//! A consolidation output starts at the least confidence of its sources as the batch being
//! planned has left them ([`Inheritance`]), so batch boundaries do not change it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use engram_bus::StoredEvent;
use engram_keyword::{KeywordIndex, KeywordReader};
use engram_memory::confidence::{Distrust, Inheritance, Withdrawn};
use engram_memory::proto::{MemoryHit, SearchRequest, SearchResponse};
use engram_memory::{MemoryMeta, ScopeKey, Seq, is_text_memory};
use engram_projection_runtime::{ApplyLedger, Projection, ProjectionError, Rejected, snapshot};
use engram_rpc::Failure;
use engram_schema::{EventId, EventKind};
use serde::{Deserialize, Serialize};

use crate::vector::Memory;

pub const NAME: &str = engram_memory::proto::read_models::KEYWORD;

#[derive(Default)]
struct Table {
    applied: Seq,
    memories: BTreeMap<Seq, Memory>,
    event_ids: HashMap<EventId, Seq>,
    /// Ids withdrawn by `forgotten` events (kept in the ids log, see the module docs).
    forgotten: HashSet<EventId>,
    /// Ids of the distrust signals applied, likewise.
    distrusted: HashSet<EventId>,
    /// Distrusted memories among the forgotten, with scope and confidence (likewise): a copy
    /// restored from one inherits it.
    withdrawn: Withdrawn,
    /// The scope of each id in `forgotten` and `distrusted`, which the ids alone do not say:
    /// an erasure drops the ids of its scopes by it. Kept in the ids log; ids logged before
    /// it named their scopes have none, and stay through an erasure.
    id_scopes: HashMap<EventId, ScopeKey>,
    /// Signals applied by a publish that committed nothing (they lowered no confidence):
    /// logged with the next commit. Until then a restart replays them, as the commit's
    /// ledger lags them.
    unlogged: Vec<(EventId, ScopeKey)>,
    /// The sequences of `memories` by scope, so that a faulty-instance flag looks at its own
    /// scope's memories, not every tenant's.
    by_scope: HashMap<ScopeKey, BTreeSet<Seq>>,
}

impl Table {
    fn insert(&mut self, memory: Memory) {
        let seq = memory.meta.seq;
        self.event_ids.insert(memory.meta.event_id.clone(), seq);
        self.by_scope
            .entry(memory.meta.scope.clone())
            .or_default()
            .insert(seq);
        self.memories.insert(seq, memory);
    }

    fn remove(&mut self, seq: Seq) -> Option<Memory> {
        let memory = self.memories.remove(&seq)?;
        if let Some(seqs) = self.by_scope.get_mut(&memory.meta.scope) {
            seqs.remove(&seq);
            if seqs.is_empty() {
                self.by_scope.remove(&memory.meta.scope);
            }
        }
        Some(memory)
    }

    /// The memories of `scope`.
    fn of_scope<'a>(&'a self, scope: &ScopeKey) -> impl Iterator<Item = &'a Memory> + 'a {
        self.by_scope
            .get(scope)
            .into_iter()
            .flatten()
            .filter_map(|seq| self.memories.get(seq))
    }
}

pub struct KeywordProjection {
    dir: PathBuf,
    /// Forgotten and signal ids, beside the index (see the module docs).
    ids: Arc<IdsLog>,
    writer: Mutex<Option<KeywordIndex>>,
    reader: RwLock<Option<KeywordReader>>,
    /// Visible memories (what the last commit holds), for hits' text and provenance.
    table: Arc<RwLock<Table>>,
    /// Applied but not yet committed.
    staged: Mutex<Staged>,
}

#[derive(Default)]
struct Staged {
    /// Memories added, or given a new confidence, since the last commit: the latest version
    /// of each.
    memories: BTreeMap<Seq, Memory>,
    /// The event ids and sequences of those added: a backlog stages many thousands between
    /// commits.
    event_ids: HashMap<EventId, Seq>,
    /// Memories withdrawn since the last commit, with their scopes.
    forgotten: BTreeMap<Seq, (EventId, ScopeKey)>,
    /// Distrust signals applied since the last commit, with their scopes.
    distrusted: Vec<(EventId, ScopeKey)>,
    /// Distrusted memories withdrawn since the last commit.
    withdrawn: Withdrawn,
    /// The last sequence applied, so that a retried batch skips what it already staged
    /// (a batch may end in events that stage nothing).
    applied: Seq,
    /// Scopes were erased since the last commit: the next one writes the ids log anew
    /// without them, and purges their deleted documents from disk.
    erased: bool,
}

impl Staged {
    /// Whether the index has nothing uncommitted.
    fn index_unchanged(&self) -> bool {
        self.memories.is_empty() && self.forgotten.is_empty() && !self.erased
    }
}

/// One step of a batch, in stream order.
enum KwOp {
    /// A memory to index: a new one (`fresh`), or one whose confidence changed, replacing
    /// its document.
    Put { memory: Memory, fresh: bool },
    /// Memories of one scope withdrawn.
    Forget(ScopeKey, Vec<(EventId, Seq)>),
}

/// Memory `seq` as a batch being planned has left it: as `ops` made it (`batch` says which
/// op touched it last, `None` for a forgetting), else as staged, else as committed.
fn current<'a>(
    seq: Seq,
    batch: &HashMap<Seq, Option<usize>>,
    ops: &'a [KwOp],
    staged: &'a Staged,
    table: &'a Table,
) -> Option<&'a Memory> {
    match batch.get(&seq) {
        Some(Some(i)) => match &ops[*i] {
            KwOp::Put { memory, .. } => Some(memory),
            KwOp::Forget(..) => None,
        },
        Some(None) => None,
        None if staged.forgotten.contains_key(&seq) => None,
        None => staged
            .memories
            .get(&seq)
            .or_else(|| table.memories.get(&seq)),
    }
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
    /// The scopes of ids in `forgotten` and `distrusted`, where known ([`Table::id_scopes`]).
    #[serde(default)]
    id_scopes: Vec<(EventId, ScopeKey)>,
}

/// [`Snapshot`] as written, borrowed from the table: the memories are encoded where they
/// are, not copied first. Fields in [`Snapshot`]'s order (structs are encoded as arrays).
#[derive(Serialize)]
struct SnapshotOut<'a> {
    memories: MemoriesOut<'a>,
    forgotten: Vec<&'a EventId>,
    distrusted: Vec<&'a EventId>,
    withdrawn: &'a Withdrawn,
    id_scopes: Vec<(&'a EventId, &'a ScopeKey)>,
}

struct MemoriesOut<'a>(&'a BTreeMap<Seq, Memory>);

impl Serialize for MemoriesOut<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.values())
    }
}

/// Ids in a fixed order, so that equal models export equal bytes.
fn sorted(ids: &HashSet<EventId>) -> Vec<&EventId> {
    let mut ids: Vec<&EventId> = ids.iter().collect();
    ids.sort_unstable();
    ids
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

/// What the ids log holds.
#[derive(Default)]
struct Logged {
    forgotten: HashSet<EventId>,
    distrusted: HashSet<EventId>,
    withdrawn: Withdrawn,
    id_scopes: HashMap<EventId, ScopeKey>,
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

/// What the model keeps of the scopes `keys`: the sequences of their memories in the table
/// and among the staged, and every event of theirs anything is kept of (those memories,
/// forgotten memories and the signals applied whose scopes are known, withdrawn confidences).
#[derive(Default)]
struct Held {
    table: Vec<Seq>,
    staged: Vec<Seq>,
    events: HashSet<EventId>,
}

impl Held {
    /// Memories (a staged one may be a new confidence of one in the table).
    fn memories(&self) -> usize {
        let mut seqs: Vec<Seq> = self.table.iter().chain(&self.staged).copied().collect();
        seqs.sort_unstable();
        seqs.dedup();
        seqs.len()
    }
}

fn held_of(table: &Table, staged: &Staged, keys: &HashSet<ScopeKey>) -> Held {
    let mut held = Held::default();
    for key in keys {
        for m in table.of_scope(key) {
            held.table.push(m.meta.seq);
            held.events.insert(m.meta.event_id.clone());
        }
    }
    for (seq, m) in &staged.memories {
        if keys.contains(&m.meta.scope) {
            held.staged.push(*seq);
            held.events.insert(m.meta.event_id.clone());
        }
    }
    let of_keys = |id: &&EventId| table.id_scopes.get(*id).is_some_and(|s| keys.contains(s));
    held.events.extend(
        table
            .forgotten
            .iter()
            .chain(&table.distrusted)
            .filter(of_keys)
            .cloned(),
    );
    held.events.extend(
        table
            .withdrawn
            .iter()
            .chain(&staged.withdrawn)
            .filter(|(_, (scope, _))| keys.contains(scope))
            .map(|(id, _)| id.clone()),
    );
    held.events.extend(
        staged
            .forgotten
            .values()
            .chain(&staged.distrusted)
            .filter(|(_, scope)| keys.contains(scope))
            .map(|(id, _)| id.clone()),
    );
    held
}

impl KeywordProjection {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        Self {
            ids: Arc::new(IdsLog::new(dir.join("keyword-ids.log"))),
            dir: dir.join("keyword"),
            writer: Mutex::new(None),
            reader: RwLock::new(None),
            table: Arc::default(),
            staged: Mutex::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.table
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .memories
            .len()
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
        let table = self.table.clone();
        tokio::task::spawn_blocking(move || {
            // The sequence this answer reports visible is read before the search takes its
            // searcher: the table moves to a sequence only after the reader was reloaded with
            // that commit, so the searcher sees at least this much. Read after the search, it
            // could name a commit that landed while an older searcher ran.
            let visible_seq = table.read().unwrap_or_else(|p| p.into_inner()).applied;
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
            let table = table.read().unwrap_or_else(|p| p.into_inner());
            let wanted: HashSet<Seq> = request.score_also.iter().copied().collect();
            let ranked_after = hits.split_off(request.k.min(hits.len()));
            let also = ranked_after
                .into_iter()
                .enumerate()
                .filter(|(i, h)| request.k + i < request.rest || wanted.contains(&h.seq))
                .map(|(_, h)| h)
                .chain(hits.iter().filter(|h| wanted.contains(&h.seq)).copied())
                .collect();
            hits.retain(|h| table.memories.contains_key(&h.seq));
            Ok(SearchResponse {
                hits: hits
                    .into_iter()
                    .map(|hit| {
                        let m = &table.memories[&hit.seq];
                        MemoryHit {
                            hit,
                            meta: m.meta.clone(),
                            text: m.text.clone(),
                        }
                    })
                    .collect(),
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
                self.staged.lock().unwrap_or_else(|p| p.into_inner()).erased = true;
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
        let mut table = Table {
            applied: ledger.seq,
            forgotten: logged.forgotten,
            distrusted: logged.distrusted,
            withdrawn: logged.withdrawn,
            id_scopes: logged.id_scopes,
            ..Table::default()
        };
        for (meta, text) in memories {
            table.insert(Memory { meta, text });
        }
        *self.reader.write().unwrap_or_else(|p| p.into_inner()) = Some(index.reader());
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(index);
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = table;
        *self.staged.lock().unwrap_or_else(|p| p.into_inner()) = Staged::default();
        Ok(ledger)
    }

    async fn apply(&self, events: &[StoredEvent]) -> Result<Vec<Rejected>, ProjectionError> {
        let mut rejected = Vec::new();
        // Stream order matters: a batch may hold a memory, then its forgetting or a signal
        // lowering its confidence.
        let mut ops: Vec<KwOp> = Vec::new();
        let mut signals: Vec<(EventId, ScopeKey)> = Vec::new();
        let mut fresh_ids: HashMap<EventId, Seq> = HashMap::new();
        // Distrusted memories this batch withdrew.
        let mut withdrawn = Withdrawn::new();
        {
            let table = self.table.read().unwrap_or_else(|p| p.into_inner());
            let staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            let staged_max = staged.memories.last_key_value().map_or(0, |(seq, _)| *seq);
            let applied = table.applied.max(staged_max).max(staged.applied);
            let known = |id: &EventId| {
                table.event_ids.contains_key(id)
                    || staged.event_ids.contains_key(id)
                    || table.forgotten.contains(id)
            };
            let seq_of = |fresh_ids: &HashMap<EventId, Seq>, id: &EventId| {
                fresh_ids
                    .get(id)
                    .or_else(|| staged.event_ids.get(id))
                    .or_else(|| table.event_ids.get(id))
                    .copied()
            };
            // What the ops so far did to each memory they touched: `Some(i)` added it or
            // gave it a new confidence (`ops[i]`), `None` forgot it.
            let mut batch: HashMap<Seq, Option<usize>> = HashMap::new();
            for (index, stored) in events.iter().enumerate() {
                let event = &stored.event;
                if stored.seq <= applied {
                    continue;
                }
                if event.kind == EventKind::Forgotten {
                    let ids = match event.forgotten_ids() {
                        Ok(ids) => ids,
                        Err(e) => {
                            rejected.push(Rejected {
                                index,
                                reason: e.to_string(),
                            });
                            continue;
                        }
                    };
                    let scope = ScopeKey::of(event);
                    let mut seqs = Vec::new();
                    for id in ids {
                        let Some(seq) = seq_of(&fresh_ids, &id) else {
                            continue;
                        };
                        // A scope forgets only its own memories.
                        let held = current(seq, &batch, &ops, &staged, &table);
                        if let Some(m) = held.filter(|m| m.meta.scope == scope) {
                            engram_memory::confidence::withdraw(&mut withdrawn, &m.meta);
                            batch.insert(seq, None);
                            seqs.push((id, seq));
                        }
                    }
                    if !seqs.is_empty() {
                        ops.push(KwOp::Forget(scope, seqs));
                    }
                    continue;
                }
                // A consolidation output whose sources do not check is refused whole, like a
                // signal that does not check.
                let inherits = match Inheritance::of(event) {
                    Ok(inherits) => inherits,
                    Err(e) => {
                        rejected.push(Rejected {
                            index,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                };
                // A signal that does not check is refused whole, its text included: a
                // rejected event leaves the model as it was.
                let signal = match Distrust::of(stored.seq, event) {
                    Ok(signal) => signal,
                    Err(e) => {
                        rejected.push(Rejected {
                            index,
                            reason: e.to_string(),
                        });
                        continue;
                    }
                };
                let known_signal = |id: &EventId| {
                    table.distrusted.contains(id)
                        || staged.distrusted.iter().any(|(d, _)| d == id)
                        || signals.iter().any(|(d, _)| d == id)
                };
                if let Some(signal) = signal
                    && !known_signal(&signal.event_id)
                {
                    let mut about: BTreeSet<Seq> = signal
                        .contradicts
                        .iter()
                        .filter_map(|id| seq_of(&fresh_ids, id))
                        .collect();
                    if let Some(instance) = &signal.faulty_instance {
                        // Every memory the instance wrote in the scope: a scan of the
                        // scope's committed memories, and of what is staged or planned since;
                        // `factor` below decides.
                        let by = |m: &Memory| {
                            m.meta.scope == signal.scope
                                && m.meta.instance_id.as_ref() == Some(instance)
                        };
                        // Committed, staged, and planned earlier in this batch.
                        let planned = batch.values().flatten().filter_map(|&i| match &ops[i] {
                            KwOp::Put { memory, .. } => Some(memory),
                            KwOp::Forget(..) => None,
                        });
                        about.extend(
                            table
                                .of_scope(&signal.scope)
                                .chain(staged.memories.values())
                                .chain(planned)
                                .filter(|m| by(m))
                                .map(|m| m.meta.seq),
                        );
                    }
                    for seq in about {
                        let Some(held) = current(seq, &batch, &ops, &staged, &table) else {
                            continue;
                        };
                        let Some(meta) = signal.apply(&held.meta) else {
                            continue;
                        };
                        let memory = Memory {
                            meta,
                            text: held.text.clone(),
                        };
                        batch.insert(seq, Some(ops.len()));
                        ops.push(KwOp::Put {
                            memory,
                            fresh: false,
                        });
                    }
                    signals.push((signal.event_id, signal.scope));
                }
                if !is_text_memory(event)
                    || known(&event.event_id)
                    || fresh_ids.contains_key(&event.event_id)
                {
                    continue;
                }
                let mut meta = MemoryMeta::of(stored.seq, event);
                if let Some(inherits) = inherits {
                    // Its sources as every op before it left them, this batch's included.
                    meta.confidence = inherits.confidence(|id| {
                        let held = seq_of(&fresh_ids, id)
                            .and_then(|seq| current(seq, &batch, &ops, &staged, &table));
                        match held {
                            Some(m) => Some((&m.meta.scope, m.meta.confidence)),
                            None => withdrawn
                                .get(id)
                                .or_else(|| staged.withdrawn.get(id))
                                .or_else(|| table.withdrawn.get(id))
                                .map(|(scope, c)| (scope, *c)),
                        }
                    });
                }
                fresh_ids.insert(event.event_id.clone(), stored.seq);
                batch.insert(stored.seq, Some(ops.len()));
                ops.push(KwOp::Put {
                    memory: Memory {
                        meta,
                        text: event.content.text.clone(),
                    },
                    fresh: true,
                });
            }
        }
        let last = events.last().map_or(0, |e| e.seq);
        if ops.is_empty() && signals.is_empty() {
            if !rejected.is_empty() {
                self.staged
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .applied = last;
            }
            return Ok(rejected);
        }
        let to_apply = &ops;
        self.with_writer(move |index| {
            for op in to_apply {
                match op {
                    // Adding a sequence the index holds replaces its document.
                    KwOp::Put { memory, .. } => index.add(&memory.meta, &memory.text)?,
                    // tantivy orders deletes after earlier adds, committed or not.
                    KwOp::Forget(_, seqs) => {
                        for (_, seq) in seqs {
                            index.delete(*seq)?;
                        }
                    }
                }
            }
            Ok(())
        })?;
        let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        for op in ops {
            match op {
                KwOp::Put { memory, fresh } => {
                    if fresh {
                        staged
                            .event_ids
                            .insert(memory.meta.event_id.clone(), memory.meta.seq);
                    }
                    staged.memories.insert(memory.meta.seq, memory);
                }
                KwOp::Forget(scope, seqs) => {
                    for (id, seq) in seqs {
                        staged.memories.remove(&seq);
                        staged.forgotten.insert(seq, (id, scope.clone()));
                    }
                }
            }
        }
        staged.distrusted.extend(signals);
        staged.withdrawn.extend(withdrawn);
        staged.applied = last;
        Ok(rejected)
    }

    async fn publish(&self, applied: &ApplyLedger) -> Result<(), ProjectionError> {
        let ledger = *applied;
        let applied = applied.seq;
        let unchanged = {
            let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            staged
                .index_unchanged()
                .then(|| std::mem::take(&mut staged.distrusted))
        };
        if let Some(signals) = unchanged {
            // Nothing new to search: skip the fsync. The commit's ledger lags, so a restart
            // re-reads a few events that changed nothing in the index and applies them again
            // from that older ledger, which changes nothing either.
            let mut table = self.table.write().unwrap_or_else(|p| p.into_inner());
            for (id, scope) in signals {
                table.distrusted.insert(id.clone());
                table.id_scopes.insert(id.clone(), scope.clone());
                table.unlogged.push((id, scope));
            }
            table.applied = applied;
            return Ok(());
        }
        // The ids this commit makes durable go to the log first: a crash after the log and
        // before the commit leaves a tail the restart cuts off. After an erasure the log is
        // written anew instead, with every id still kept and none of the erased scopes'.
        let (erased, forgotten, distrusted, withdrawn): (bool, Ids, Ids, Withdrawn) = {
            let table = self.table.read().unwrap_or_else(|p| p.into_inner());
            let staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            let with_scope = |(id, scope): &(EventId, ScopeKey)| (id.clone(), Some(scope.clone()));
            let staged_forgotten = staged.forgotten.values().map(with_scope);
            let staged_distrusted = staged.distrusted.iter().map(with_scope);
            if staged.erased {
                let kept = |id: &EventId| (id.clone(), table.id_scopes.get(id).cloned());
                let mut withdrawn = table.withdrawn.clone();
                withdrawn.extend(staged.withdrawn.clone());
                (
                    true,
                    sorted(&table.forgotten)
                        .into_iter()
                        .map(kept)
                        .chain(staged_forgotten)
                        .collect(),
                    // `distrusted` holds the unlogged signals too.
                    sorted(&table.distrusted)
                        .into_iter()
                        .map(kept)
                        .chain(staged_distrusted)
                        .collect(),
                    withdrawn,
                )
            } else {
                (
                    false,
                    staged_forgotten.collect(),
                    table
                        .unlogged
                        .iter()
                        .map(with_scope)
                        .chain(staged_distrusted)
                        .collect(),
                    staged.withdrawn.clone(),
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
        let staged = std::mem::take(&mut *self.staged.lock().unwrap_or_else(|p| p.into_inner()));
        {
            let mut table = self.table.write().unwrap_or_else(|p| p.into_inner());
            for m in staged.memories.into_values() {
                table.insert(m);
            }
            for (id, scope) in staged.distrusted {
                table.distrusted.insert(id.clone());
                table.id_scopes.insert(id, scope);
            }
            table.withdrawn.extend(staged.withdrawn);
            table.unlogged.clear();
            for (seq, (id, scope)) in staged.forgotten {
                table.remove(seq);
                table.forgotten.insert(id.clone());
                table.id_scopes.insert(id, scope);
                engram_telemetry::metrics::PROJECTOR_FORGOTTEN
                    .with_label_values(&[NAME])
                    .inc();
            }
            table.applied = applied;
        }
        if erased {
            // After the table moved on: searches see this commit's memories meanwhile.
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
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Table::default();
        *self.staged.lock().unwrap_or_else(|p| p.into_inner()) = Staged::default();
        Ok(())
    }

    /// The table is what the last commit holds (a cut publishes first), so it is what is
    /// exported, in sequence order.
    async fn export(&self, applied: &ApplyLedger) -> Result<Option<Vec<u8>>, ProjectionError> {
        let (table, applied) = (self.table.clone(), *applied);
        tokio::task::spawn_blocking(move || {
            let table = table.read().unwrap_or_else(|p| p.into_inner());
            let mut id_scopes: Vec<(&EventId, &ScopeKey)> = table.id_scopes.iter().collect();
            id_scopes.sort_unstable();
            let out = SnapshotOut {
                memories: MemoriesOut(&table.memories),
                forgotten: sorted(&table.forgotten),
                distrusted: sorted(&table.distrusted),
                withdrawn: &table.withdrawn,
                id_scopes,
            };
            snapshot::encode(&applied, &out).map(Some)
        })
        .await
        .map_err(fatal)?
    }

    /// Checks the blob, then replaces the index with its memories in one commit carrying its
    /// ledger (tantivy's commit is the checkpoint), and the table with them. A blob that does
    /// not check, or an index that fails before the commit, leaves the model as it was.
    async fn import(&self, bytes: &[u8]) -> Result<ApplyLedger, ProjectionError> {
        let bytes = bytes.to_vec();
        let (ledger, snap) = tokio::task::spawn_blocking(move || {
            snapshot::decode::<Snapshot>(&bytes, "the keyword snapshot", NAME)
        })
        .await
        .map_err(fatal)??;
        // Replacing the index discards what is staged; a loader runs before any apply.
        if !self
            .staged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .index_unchanged()
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
        let id_scopes: HashMap<EventId, ScopeKey> = snap.id_scopes.into_iter().collect();
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
        // Thousands of documents per second, and an fsync: off the async threads.
        let (index, memories, result) = tokio::task::spawn_blocking(move || {
            let mut index = index;
            let mut memories = snap.memories;
            memories.sort_by_key(|m| m.meta.seq);
            let result = index.replace(
                memories.iter().map(|m| (&m.meta, m.text.as_str())),
                ledger.seq,
                &note,
            );
            (index, memories, result)
        })
        .await
        .map_err(fatal)?;
        *self.reader.write().unwrap_or_else(|p| p.into_inner()) = Some(index.reader());
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = Some(index);
        if let Err(e) = result {
            // The old commit stands, with its log.
            self.ids.set_generation(previous);
            return Err(ProjectionError::Transient(format!(
                "keyword snapshot import: {e}"
            )));
        }
        std::fs::rename(&replacement, &self.ids.path).map_err(|e| {
            self.ids
                .broken(format_args!("cannot put the imported log in place: {e}"))
        })?;
        let mut table = Table {
            applied: ledger.seq,
            forgotten: snap.forgotten.into_iter().collect(),
            distrusted: snap.distrusted.into_iter().collect(),
            withdrawn: snap.withdrawn,
            id_scopes,
            ..Table::default()
        };
        for memory in memories {
            table.insert(memory);
        }
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = table;
        *self.staged.lock().unwrap_or_else(|p| p.into_inner()) = Staged::default();
        tracing::info!(
            memories = self.len(),
            seq = ledger.seq,
            "keyword snapshot imported"
        );
        Ok(ledger)
    }

    async fn state_hash(&self) -> [u8; 32] {
        let index = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        index
            .as_ref()
            .and_then(|i| i.state_hash().ok())
            .unwrap_or_default()
    }

    /// Deletes every document of the scopes `keys` by its scope term, and drops what the
    /// table, the staged changes and the ids log keep of them; returns how many events that
    /// was ([`traces`](Projection::traces) before). The publish the loop makes right after
    /// commits the deletes with the log written anew, then merges the deleted documents out
    /// of the index's files ([`KeywordIndex::purge_deleted`]). Ids logged before the log
    /// named their scopes cannot be attributed, and stay (bare ids, no text).
    async fn erase(&self, keys: &[ScopeKey]) -> Result<u64, ProjectionError> {
        let keys: HashSet<ScopeKey> = keys.iter().cloned().collect();
        // The deletes first: should they fail, the table still says what the index holds.
        // Every memory of the scopes goes, staged ones included; none added after.
        self.with_writer(|index| keys.iter().try_for_each(|key| index.delete_scope(key)))?;
        // What goes is found under the read lock, so searches go on meanwhile; nothing
        // writes in between, as the loop erases between batches.
        let held = {
            let table = self.table.read().unwrap_or_else(|p| p.into_inner());
            let staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            held_of(&table, &staged, &keys)
        };
        let mut table = self.table.write().unwrap_or_else(|p| p.into_inner());
        let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        let (table, staged) = (&mut *table, &mut *staged);
        for seq in &held.table {
            table.remove(*seq);
        }
        for seq in &held.staged {
            if let Some(m) = staged.memories.remove(seq) {
                staged.event_ids.remove(&m.meta.event_id);
            }
        }
        // A forgotten memory's id still maps to its sequence; signals' ids are apart.
        for id in &held.events {
            table.event_ids.remove(id);
            table.forgotten.remove(id);
            table.distrusted.remove(id);
            table.withdrawn.remove(id);
            table.id_scopes.remove(id);
            staged.withdrawn.remove(id);
        }
        table.unlogged.retain(|(_, scope)| !keys.contains(scope));
        staged
            .forgotten
            .retain(|_, (_, scope)| !keys.contains(scope));
        staged.distrusted.retain(|(_, scope)| !keys.contains(scope));
        staged.erased = true;
        let unattributed = table
            .forgotten
            .iter()
            .chain(&table.distrusted)
            .filter(|id| !table.id_scopes.contains_key(*id))
            .count();
        if unattributed > 0 {
            tracing::warn!(
                ids = unattributed,
                "forgotten memories' and applied signals' ids logged before the log named their scopes cannot be attributed to a scope; those of the erased scopes stay, without text"
            );
        }
        tracing::debug!(
            scopes = keys.len(),
            memories = held.memories(),
            events = held.events.len(),
            "keyword scopes erased"
        );
        Ok(held.events.len() as u64)
    }

    /// The events of the scopes `keys` the model keeps anything of, as [`erase`] counts
    /// them, where the memories are the more of those in the table and those the last
    /// commit holds, so that a document the table no longer shows counts too.
    ///
    /// [`erase`]: Projection::erase
    async fn traces(&self, keys: &[ScopeKey]) -> u64 {
        let keys: HashSet<ScopeKey> = keys.iter().cloned().collect();
        let held: Vec<(&ScopeKey, Held)> = {
            let table = self.table.read().unwrap_or_else(|p| p.into_inner());
            let staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
            keys.iter()
                .map(|key| {
                    let one = HashSet::from([key.clone()]);
                    (key, held_of(&table, &staged, &one))
                })
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
            let memories = held.memories() as u64;
            let others = (held.events.len() as u64).saturating_sub(memories);
            traces += memories.max(documents) + others;
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
    use engram_schema::{Envelope, Layer};
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

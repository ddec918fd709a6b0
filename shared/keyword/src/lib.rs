//! Engram's keyword read model: a BM25 index (tantivy) over the text of episodic and semantic
//! memories, keyed by the stream sequence of the event each came from.
//!
//! The projector owns a [`KeywordIndex`]: it stages [`add`](KeywordIndex::add)s (a memory
//! whose confidence was lowered is added again, replacing its document) and
//! [`delete`](KeywordIndex::delete)s, then [`commit`](KeywordIndex::commit)s them together
//! with the last sequence applied. That sequence travels in the tantivy commit itself, so the
//! index and its checkpoint can never disagree: after a crash, [`KeywordIndex::open`] finds the
//! state of the last commit and [`committed_seq`](KeywordIndex::committed_seq) says where to
//! resume; anything staged after it is gone and is replayed from the stream.
//!
//! The query service holds [`KeywordReader`]s (cheap clones). A commit reloads the readers
//! before it publishes its sequence, so a reader that sees `committed_seq() >= n` also finds
//! every memory up to `n`.
//!
//! What was added since the last commit is searched too, from the tail segment (`tail`): an
//! in-memory index of those documents, scored with the same BM25 over statistics that count
//! them, so an added memory is found at once, at the score its commit will give it. The
//! commit makes it durable; until then a crash loses it with the tail, and the projector
//! replays it.
//!
//! Scopes are matched as whole opaque terms ([`ScopeKey::token`]), never by prefix or case
//! folding, and a search with no scopes finds nothing. User query text is analysed into terms
//! and never parsed, so it cannot fail or change the query's shape.
//!
//! BM25 statistics (document frequencies, average length) are index-wide, across tenants and
//! scopes: another scope's memories shift scores but never which memories are returned.
//!
//! # Layout
//! - [`schema`]: fields, the English analyser, and memory-to-document mapping.
//! - `query`: user text, scopes and [`MemoryFilter`] to a tantivy query.
//! - [`KeywordIndex`] (here): writer, checkpoint and lifecycle; [`KeywordReader`]: searches.

mod error;
mod files;
mod query;
pub mod schema;
mod stats;
mod tail;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use engram_memory::{Hit, MemoryFilter, MemoryMeta, ScopeKey, Seq};
use tantivy::collector::{Count, TopDocs};
use tantivy::columnar::Column;
use tantivy::directory::MmapDirectory;
use tantivy::index::SegmentId;
use tantivy::indexer::IndexWriterOptions;
use tantivy::query::TermQuery;
use tantivy::schema::IndexRecordOption;
use tantivy::tokenizer::TextAnalyzer;
use tantivy::{Index, IndexBuilder, IndexReader, IndexWriter, ReloadPolicy, TantivyError};

pub use crate::error::KeywordError;
pub use crate::files::{IndexFile, IndexFiles, IndexHandle, install as install_files};
pub use crate::query::MAX_QUERY_TERMS;
use crate::schema::{DIGEST_HI, DIGEST_LO, Fields, SEQ, seq_term};
use crate::stats::{ScopedStats, TotalsCache};
use crate::tail::TailSegment;

/// Indexing memory budget. tantivy flushes a segment when a thread fills its share, so this
/// bounds writer memory whatever the batch size between commits.
pub const WRITER_MEMORY_BYTES: usize = 50 * 1024 * 1024;

/// One indexing thread and one merge thread: the service shares two cores with NATS and the
/// embedder, and the projector feeds documents one at a time anyway.
const WRITER_THREADS: usize = 1;
const MERGE_THREADS: usize = 1;

/// How often [`KeywordIndex::purge_deleted`] retries a merge a background merge got in the way
/// of, or a collection that found a purged segment's files still in use, and the pause
/// before the first retry (each later one waits longer).
const PURGE_RETRIES: u32 = 5;
const PURGE_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// How the checkpoint is written into a commit's payload: this prefix and the sequence, then
/// optionally a newline and the caller's note.
const PAYLOAD_PREFIX: &str = "engram-keyword applied_seq=";

/// A commit's payload: the checkpoint, then optionally a newline and the caller's note.
fn payload(applied_seq: Seq, note: Option<&str>) -> String {
    let mut payload = format!("{PAYLOAD_PREFIX}{applied_seq}");
    if let Some(note) = note {
        payload.push('\n');
        payload.push_str(note);
    }
    payload
}

/// The writable keyword index, owned by the projector.
pub struct KeywordIndex {
    /// Stages adds and deletes; only `commit` makes them durable and visible.
    writer: IndexWriter,
    /// Searches the last commit; shared with every reader handed out.
    reader: KeywordReader,
    /// Highest sequence that may be in the index, committed or staged. An add at or below it
    /// first deletes that sequence, so replaying events after a crash cannot duplicate them;
    /// adds above it (the projector's normal case) skip that delete.
    high_water: Seq,
    /// Where the index lives, for error messages; `None` in RAM.
    dir: Option<PathBuf>,
    /// The note saved by the last commit, see [`commit_with_note`](Self::commit_with_note).
    committed_note: Option<String>,
}

/// A read-only handle on the last commit of a [`KeywordIndex`]; clone it freely.
#[derive(Clone)]
pub struct KeywordReader {
    reader: IndexReader,
    fields: Fields,
    analyzer: TextAnalyzer,
    /// [`analyzer`](schema::analyzer) without function words, for queries.
    query_analyzer: TextAnalyzer,
    /// The sequence of the commit readers can see; raised only after the reload that makes
    /// that commit visible.
    committed: Arc<AtomicU64>,
    /// Documents added since that commit. A commit reloads the reader and empties it under
    /// its write lock; a search takes its searcher under the read lock: together, every
    /// document is in exactly one of the two.
    tail: Arc<RwLock<TailSegment>>,
    /// The committed documents' totals per searched scope set, for the commit they count.
    totals: TotalsCache,
}

impl KeywordIndex {
    /// Opens the index in `dir`, creating the directory and an empty index if missing.
    ///
    /// Fails if another writer holds the directory or if it holds an index of another schema.
    pub fn open(dir: &Path) -> Result<Self, KeywordError> {
        let open_error = |source: TantivyError| KeywordError::Open {
            dir: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|err| open_error(err.into()))?;
        let directory = MmapDirectory::open(dir).map_err(|err| open_error(err.into()))?;
        let (schema, fields) = Fields::schema();
        let index = IndexBuilder::new()
            .schema(schema)
            .tokenizers(schema::tokenizers())
            .open_or_create(directory)
            .map_err(|err| match err {
                TantivyError::SchemaError(_) => KeywordError::SchemaMismatch {
                    dir: dir.to_path_buf(),
                },
                other => open_error(other),
            })?;
        Self::from_index(index, fields, Some(dir.to_path_buf()))
    }

    /// A new, empty index in memory, for tests. Its "durable" commits last as long as it does.
    pub fn in_ram() -> Result<Self, KeywordError> {
        let (schema, fields) = Fields::schema();
        let index = IndexBuilder::new()
            .schema(schema)
            .tokenizers(schema::tokenizers())
            .create_in_ram()?;
        Self::from_index(index, fields, None)
    }

    fn from_index(
        index: Index,
        fields: Fields,
        dir: Option<PathBuf>,
    ) -> Result<Self, KeywordError> {
        let options = IndexWriterOptions::builder()
            .memory_budget_per_thread(WRITER_MEMORY_BYTES / WRITER_THREADS)
            .num_worker_threads(WRITER_THREADS)
            .num_merge_threads(MERGE_THREADS)
            .build();
        let writer = with_lock_wait(|| index.writer_with_options(options.clone())).map_err(
            |err| match err {
                TantivyError::LockFailure(..) => KeywordError::Locked {
                    dir: dir.clone().unwrap_or_default(),
                },
                other => KeywordError::Index(other),
            },
        )?;
        let (committed, committed_note) = parse_payload(index.load_metas()?.payload)?;
        let reader = index
            .reader_builder()
            // Reloads happen in `commit`, before the new sequence is published.
            .reload_policy(ReloadPolicy::Manual)
            .try_into()?;
        let reader = KeywordReader {
            reader,
            fields,
            analyzer: index.tokenizer_for_field(fields.text)?,
            query_analyzer: schema::query_analyzer(),
            committed: Arc::new(AtomicU64::new(committed)),
            tail: Arc::default(),
            totals: TotalsCache::default(),
        };
        let high_water = reader.max_seq()?;
        Ok(Self {
            writer,
            reader,
            high_water,
            dir,
            committed_note,
        })
    }

    /// Stages `text` as the memory `meta.seq`, replacing any memory with that sequence.
    /// Searchable at once (from the tail), and lost on a crash until the next
    /// [`commit`](Self::commit).
    pub fn add(&mut self, meta: &MemoryMeta, text: &str) -> Result<(), KeywordError> {
        self.stage(meta, text)?;
        self.tail().insert(&self.reader.analyzer, meta, text);
        Ok(())
    }

    /// [`add`](Self::add) without the tail: for a replacement committed in the same call.
    fn stage(&mut self, meta: &MemoryMeta, text: &str) -> Result<(), KeywordError> {
        if meta.seq <= self.high_water {
            self.writer
                .delete_term(seq_term(&self.reader.fields, meta.seq));
        }
        self.writer
            .add_document(self.reader.fields.document(meta, text))?;
        self.high_water = self.high_water.max(meta.seq);
        Ok(())
    }

    /// Stages the removal of memory `seq`; removing an absent memory is not an error. A
    /// committed memory stays searchable until the commit; callers that must hide it sooner
    /// filter hits by what they hold.
    pub fn delete(&mut self, seq: Seq) -> Result<(), KeywordError> {
        self.writer.delete_term(seq_term(&self.reader.fields, seq));
        self.tail().remove(seq);
        Ok(())
    }

    fn tail(&self) -> std::sync::RwLockWriteGuard<'_, TailSegment> {
        self.reader.tail.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Stages the removal of every memory of `scope` (an erasure), by its whole scope term:
    /// `acme/task/t1` never takes `acme2/task/t1` with it. Like [`delete`](Self::delete), it
    /// reaches what was added before it, committed or staged, and nothing added after.
    pub fn delete_scope(&mut self, scope: &ScopeKey) -> Result<(), KeywordError> {
        self.writer
            .delete_term(schema::scope_term(&self.reader.fields, scope));
        self.tail().remove_scope(scope);
        Ok(())
    }

    /// Rewrites the committed segments that hold deleted documents without them, and removes
    /// the files they leave, so that what was deleted is gone from disk: a committed delete
    /// only marks a document, and its text stays in the segment's files until a merge drops
    /// it. An erasure calls it after the commit of its deletes. Blocks for the merges. The
    /// commit's sequence and note stay as they are; readers are reloaded onto the result.
    pub fn purge_deleted(&mut self) -> Result<(), KeywordError> {
        let index = self.writer.index().clone();
        let mut purged: Vec<SegmentId> = Vec::new();
        let mut failed = None;
        for attempt in 0..=PURGE_RETRIES {
            let with_deletes: Vec<SegmentId> = index
                .searchable_segment_metas()?
                .iter()
                .filter(|meta| meta.has_deletes())
                .map(|meta| meta.id())
                .collect();
            if with_deletes.is_empty() {
                failed = None;
                break;
            }
            if attempt == PURGE_RETRIES {
                failed = Some(failed.unwrap_or_else(|| {
                    self.residue(format_args!(
                        "{} segments with deleted documents",
                        with_deletes.len()
                    ))
                }));
                break;
            }
            purged.extend(&with_deletes);
            // A background merge may have taken one of these segments first (then this one
            // fails): its result drops the deleted documents too, or holds them as deletes
            // for the next round.
            if let Err(e) = self.writer.merge(&with_deletes).wait() {
                failed = Some(e.into());
                std::thread::sleep(PURGE_RETRY_PAUSE * (attempt + 1));
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        self.reader.reader.reload()?;
        // A merge that was still reading a purged segment keeps its files from this
        // collection; they go once it is done.
        let mut attempt = 0;
        loop {
            self.writer.garbage_collect_files().wait()?;
            let left = self.files_of(&purged)?;
            if left == 0 {
                return Ok(());
            }
            if attempt == PURGE_RETRIES {
                return Err(self.residue(format_args!("{left} files of merged segments")));
            }
            attempt += 1;
            std::thread::sleep(PURGE_RETRY_PAUSE * attempt);
        }
    }

    fn residue(&self, left: impl std::fmt::Display) -> KeywordError {
        KeywordError::Residue {
            dir: self.dir.clone().unwrap_or_default(),
            left: left.to_string(),
        }
    }

    /// How many files of the segments `ids` are still in the index directory (0 in RAM).
    fn files_of(&self, ids: &[SegmentId]) -> Result<usize, KeywordError> {
        let Some(dir) = &self.dir else {
            return Ok(0);
        };
        if ids.is_empty() {
            return Ok(0);
        }
        let prefixes: Vec<String> = ids.iter().map(SegmentId::uuid_string).collect();
        let mut left = 0;
        for entry in std::fs::read_dir(dir).map_err(|e| KeywordError::Index(e.into()))? {
            let entry = entry.map_err(|e| KeywordError::Index(e.into()))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if prefixes
                .iter()
                .any(|prefix| name.starts_with(prefix.as_str()))
            {
                left += 1;
            }
        }
        Ok(left)
    }

    /// Makes everything staged durable, together with `applied_seq`, the last stream sequence
    /// the projector has applied; then makes it visible to every reader.
    ///
    /// The checkpoint may stay the same but never move back (that needs [`clear`](Self::clear)).
    /// After an error the index on disk is still the last good commit: drop this value and
    /// [`open`](Self::open) again, then resume from [`committed_seq`](Self::committed_seq).
    pub fn commit(&mut self, applied_seq: Seq) -> Result<(), KeywordError> {
        self.checked_commit(applied_seq, None)
    }

    /// [`commit`](Self::commit), saving `note` in the same commit: whatever else the caller
    /// must keep consistent with the index (the projector keeps its apply ledger here).
    /// [`committed_note`](Self::committed_note) gives it back, also after a reopen.
    pub fn commit_with_note(&mut self, applied_seq: Seq, note: &str) -> Result<(), KeywordError> {
        self.checked_commit(applied_seq, Some(note))
    }

    fn checked_commit(&mut self, applied_seq: Seq, note: Option<&str>) -> Result<(), KeywordError> {
        let committed = self.committed_seq();
        if applied_seq < committed {
            return Err(KeywordError::CheckpointBackwards {
                committed,
                requested: applied_seq,
            });
        }
        self.durable_commit(applied_seq, note)
    }

    fn durable_commit(&mut self, applied_seq: Seq, note: Option<&str>) -> Result<(), KeywordError> {
        let mut prepared = self.writer.prepare_commit()?;
        prepared.set_payload(&payload(applied_seq, note));
        prepared.commit()?;
        self.committed_note = note.map(str::to_owned);
        // Under the tail's lock: a search sees the tail's documents either in the tail or in
        // the reloaded searcher, never in both or neither.
        let mut tail = self.reader.tail.write().unwrap_or_else(|p| p.into_inner());
        self.reader.reader.reload()?;
        tail.clear();
        self.reader.committed.store(applied_seq, Ordering::Release);
        Ok(())
    }

    /// Empties the index, discarding anything staged, and commits checkpoint 0, for a rebuild
    /// from sequence 1.
    pub fn clear(&mut self) -> Result<(), KeywordError> {
        // Without the rollback, documents still buffered in the indexing thread could outlive
        // `delete_all_documents` and reappear at the commit.
        self.writer.rollback()?;
        self.tail().clear();
        self.writer.delete_all_documents()?;
        self.durable_commit(0, None)?;
        self.high_water = 0;
        Ok(())
    }

    /// Replaces the whole index with `memories` (in sequence order) in one commit, carrying
    /// `applied_seq` and `note` as [`commit_with_note`](Self::commit_with_note) does: a
    /// snapshot loaded into this replica. Anything staged is discarded. The checkpoint may
    /// move back (the snapshot may be older than what the index held). Atomic: after an
    /// error, or a crash, the index is its last commit, and the writer is left as that
    /// commit left it.
    pub fn replace<'m>(
        &mut self,
        memories: impl IntoIterator<Item = (&'m MemoryMeta, &'m str)>,
        applied_seq: Seq,
        note: &str,
    ) -> Result<(), KeywordError> {
        // As in `clear`: without the rollback, documents still buffered in the indexing
        // thread could outlive `delete_all_documents`.
        self.writer.rollback()?;
        self.tail().clear();
        let result = self.add_all_and_commit(memories, applied_seq, note);
        if result.is_err() {
            // Discard the half-staged replacement; the high-water mark of the last commit
            // is the one that stays true.
            self.writer.rollback()?;
            self.high_water = self.reader.max_seq()?;
        }
        result
    }

    fn add_all_and_commit<'m>(
        &mut self,
        memories: impl IntoIterator<Item = (&'m MemoryMeta, &'m str)>,
        applied_seq: Seq,
        note: &str,
    ) -> Result<(), KeywordError> {
        self.writer.delete_all_documents()?;
        self.high_water = 0;
        for (meta, text) in memories {
            self.stage(meta, text)?;
        }
        self.durable_commit(applied_seq, Some(note))
    }

    /// The sequence carried by the last commit: 0 for a new index.
    pub fn committed_seq(&self) -> Seq {
        self.reader.committed_seq()
    }

    /// The note of the last commit: `None` for a new or cleared index, or one committed
    /// without a note.
    pub fn committed_note(&self) -> Option<&str> {
        self.committed_note.as_deref()
    }

    /// A handle for searching, which sees each commit as soon as [`commit`](Self::commit)
    /// returns.
    pub fn reader(&self) -> KeywordReader {
        self.reader.clone()
    }

    /// See [`KeywordReader::search`].
    pub fn search(
        &self,
        query: &str,
        scopes: &[ScopeKey],
        filter: &MemoryFilter,
        k: usize,
    ) -> Result<Vec<Hit>, KeywordError> {
        self.reader.search(query, scopes, filter, k)
    }

    /// See [`KeywordReader::doc_count`].
    pub fn doc_count(&self) -> u64 {
        self.reader.doc_count()
    }

    /// See [`KeywordReader::state_hash`].
    pub fn state_hash(&self) -> Result<[u8; 32], KeywordError> {
        self.reader.state_hash()
    }

    /// A handle that reads the last commit's files ([`IndexFiles`]) off this thread.
    pub fn handle(&self) -> IndexHandle {
        IndexHandle(self.writer.index().clone())
    }

    /// Closes the index once its background merges have ended: after this, nothing of this
    /// writer touches the directory (a merge ending later would rewrite `meta.json`, which
    /// [`install_files`](crate::install_files) replaces).
    pub fn close(self) -> Result<(), KeywordError> {
        self.writer.wait_merging_threads()?;
        Ok(())
    }

    /// Removes files no commit or merge uses any more: after
    /// [`install_files`](crate::install_files), the replaced commit's segments.
    pub fn collect_garbage(&self) -> Result<(), KeywordError> {
        self.writer.garbage_collect_files().wait()?;
        Ok(())
    }

    /// The directory the index lives in; `None` for [`in_ram`](Self::in_ram).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }
}

impl KeywordReader {
    /// The sequence of the commit this reader sees.
    pub fn committed_seq(&self) -> Seq {
        self.committed.load(Ordering::Acquire)
    }

    /// The `k` memories of `scopes` that best match `query` by BM25 (k1 = 1.2, b = 0.75) and
    /// pass `filter`, best first; ties go to the lower sequence. Committed memories and those
    /// added since (the tail) are scored alike, over statistics that count both.
    ///
    /// `query` is analysed like memory text and its terms are OR-ed, so any text is valid;
    /// text with no words (empty, only punctuation or emoji) matches nothing. So do an empty
    /// `scopes` and `k == 0`.
    pub fn search(
        &self,
        query: &str,
        scopes: &[ScopeKey],
        filter: &MemoryFilter,
        k: usize,
    ) -> Result<Vec<Hit>, KeywordError> {
        if k == 0 || scopes.is_empty() {
            return Ok(Vec::new());
        }
        let terms = query::text_terms(
            &self.analyzer,
            &self.query_analyzer,
            self.fields.text,
            query,
        );
        // A query that can match nothing (no terms, a filter no memory passes) costs no
        // counting below.
        let Some(full_query) = query::build(&self.fields, terms.clone(), scopes, filter) else {
            return Ok(Vec::new());
        };
        let scope_query = query::scopes(&self.fields, scopes);
        let mut scope_key: Vec<String> = scopes.iter().map(ScopeKey::token).collect();
        scope_key.sort_unstable();
        scope_key.dedup();
        let (searcher, tail_stats, tail_matches, in_tail) = {
            let tail = self.tail.read().unwrap_or_else(|p| p.into_inner());
            let searcher = self.reader.searcher();
            (
                searcher,
                tail.stats(&terms, scopes),
                tail.matches(&terms, scopes, filter),
                tail.seqs(),
            )
        };
        // Statistics of the searched scopes alone (see `stats`), counted after the lock is
        // released: the searcher and the tail's part are those taken together under it.
        let committed =
            self.totals
                .committed(&searcher, self.fields.text, scope_key, &*scope_query)?;
        let stats = ScopedStats::new(
            &searcher,
            self.fields.text,
            committed,
            &*scope_query,
            &terms,
            &tail_stats,
        )?;
        let tail_hits = tail_matches.score(&stats, &terms)?;
        // TopDocs preallocates for its limit, so a huge `k` must not reach it.
        let limit = k.min(usize::try_from(searcher.num_docs()).unwrap_or(usize::MAX));
        let top = if limit == 0 {
            Vec::new()
        } else {
            searcher.search_with_statistics_provider(
                &*full_query,
                &TopDocs::with_limit(limit).order_by_score(),
                &stats,
            )?
        };

        let mut seq_columns: HashMap<u32, Column<u64>> = HashMap::new();
        let mut hits = Vec::with_capacity(top.len());
        for (score, address) in top {
            let column = match seq_columns.get(&address.segment_ord) {
                Some(column) => column,
                None => {
                    let column = searcher
                        .segment_reader(address.segment_ord)
                        .fast_fields()
                        .u64(SEQ)?;
                    seq_columns.entry(address.segment_ord).or_insert(column)
                }
            };
            if let Some(seq) = column.first(address.doc_id) {
                hits.push(Hit { seq, score });
            }
        }
        // A memory given a new confidence since the commit is in both, with the same text:
        // one hit, the tail's (what the commit will hold).
        hits.retain(|h| !in_tail.contains(&h.seq));
        hits.extend(tail_hits);
        hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.seq.cmp(&b.seq)));
        hits.truncate(k);
        Ok(hits)
    }

    /// Memories added since the last commit, searched from the tail.
    pub fn tail_len(&self) -> usize {
        self.tail.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Memories in the last commit.
    pub fn doc_count(&self) -> u64 {
        self.reader.searcher().num_docs()
    }

    /// Memories of `scope` in the last commit (its whole scope term, as searches match it).
    pub fn scope_count(&self, scope: &ScopeKey) -> Result<u64, KeywordError> {
        let query = TermQuery::new(
            schema::scope_term(&self.fields, scope),
            IndexRecordOption::Basic,
        );
        let count = self.reader.searcher().search(&query, &Count)?;
        Ok(count as u64)
    }

    /// Every committed memory with its metadata and text, in sequence order.
    pub fn stored_all(&self) -> Result<Vec<(MemoryMeta, String)>, KeywordError> {
        use tantivy::schema::Value;
        let searcher = self.reader.searcher();
        let mut out = Vec::new();
        for (ordinal, segment) in searcher.segment_readers().iter().enumerate() {
            for doc in segment.doc_ids_alive() {
                let document: tantivy::TantivyDocument =
                    searcher.doc(tantivy::DocAddress::new(ordinal as u32, doc))?;
                let Some(bytes) = document
                    .get_first(self.fields.memory)
                    .and_then(|v| v.as_bytes())
                else {
                    continue;
                };
                let memory: (MemoryMeta, String) = rmp_serde::from_slice(bytes)
                    .map_err(|e| KeywordError::Corrupt(e.to_string()))?;
                out.push(memory);
            }
        }
        out.sort_by_key(|(meta, _)| meta.seq);
        Ok(out)
    }

    /// A blake3 hash of the committed content: every memory's sequence, scope token, layer,
    /// kind, tags, occurred_at, importance, confidence and text, in sequence order. Equal for equal
    /// content however it was batched, committed, merged or deleted on the way; a rebuilt index
    /// must hash like the one it replaces.
    pub fn state_hash(&self) -> Result<[u8; 32], KeywordError> {
        let searcher = self.reader.searcher();
        let mut docs: Vec<(Seq, u64, u64)> =
            Vec::with_capacity(usize::try_from(searcher.num_docs()).unwrap_or(0));
        for segment in searcher.segment_readers() {
            let fast = segment.fast_fields();
            let (seq, hi, lo) = (fast.u64(SEQ)?, fast.u64(DIGEST_HI)?, fast.u64(DIGEST_LO)?);
            for doc in segment.doc_ids_alive() {
                if let (Some(seq), Some(hi), Some(lo)) =
                    (seq.first(doc), hi.first(doc), lo.first(doc))
                {
                    docs.push((seq, hi, lo));
                }
            }
        }
        docs.sort_unstable();
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"engram-keyword/state/v1");
        for (seq, hi, lo) in docs {
            hasher.update(&seq.to_le_bytes());
            hasher.update(&hi.to_le_bytes());
            hasher.update(&lo.to_le_bytes());
        }
        Ok(*hasher.finalize().as_bytes())
    }

    /// The highest sequence in any committed segment, deleted documents included (an
    /// overestimate only costs a needless delete).
    fn max_seq(&self) -> Result<Seq, KeywordError> {
        let searcher = self.reader.searcher();
        let mut max = 0;
        for segment in searcher.segment_readers() {
            if segment.max_doc() > 0 {
                max = max.max(segment.fast_fields().u64(SEQ)?.max_value());
            }
        }
        Ok(max)
    }
}

/// The sequence and note of a commit's payload.
fn parse_payload(payload: Option<String>) -> Result<(Seq, Option<String>), KeywordError> {
    let Some(payload) = payload else {
        return Ok((0, None));
    };
    let (checkpoint, note) = match payload.split_once('\n') {
        Some((checkpoint, note)) => (checkpoint, Some(note.to_owned())),
        None => (payload.as_str(), None),
    };
    match checkpoint.strip_prefix(PAYLOAD_PREFIX).map(str::parse) {
        Some(Ok(seq)) => Ok((seq, note)),
        _ => Err(KeywordError::ForeignPayload { payload }),
    }
}

/// How long opening an index waits for its writer lock. The same process may still be
/// letting go of it: a memory node that lost a partition's lease and takes it back at once
/// starts the model again while the old instance's writer is being dropped. Another process
/// holding it for longer than this is refused ([`KeywordError::Locked`]).
pub(crate) const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs `acquire` until it stops failing on the writer lock, for at most [`LOCK_WAIT`].
pub(crate) fn with_lock_wait<T>(
    mut acquire: impl FnMut() -> Result<T, TantivyError>,
) -> Result<T, TantivyError> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match acquire() {
            Err(TantivyError::LockFailure(..)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

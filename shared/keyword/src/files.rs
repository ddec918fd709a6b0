//! A committed index as files, for snapshots: the exporting replica ships its segments, and
//! the importing one installs them and opens the index, instead of tokenizing and indexing
//! every memory again (most of a keyword bootstrap's time at a million memories).
//!
//! Files go through tantivy's managed directory both ways: reading strips each file's
//! footer and writing adds it again (with its checksum), and written files are registered,
//! so the garbage collector removes them once a merge or a later import replaces them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tantivy::directory::error::OpenReadError;
use tantivy::directory::{Directory, INDEX_WRITER_LOCK, MmapDirectory};
use tantivy::{Index, TantivyError};

use crate::{KeywordError, PAYLOAD_PREFIX, payload};

const META: &str = "meta.json";

/// How often [`IndexHandle::committed_files`] reads the files again when a background merge
/// replaced the commit it was reading.
const READ_ATTEMPTS: usize = 5;

/// The files of one commit: its `meta.json` and every file of its segments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexFiles {
    /// The commit's `meta.json`: its segments, schema and payload. The payload is replaced
    /// at install by the importer's own.
    pub meta: String,
    pub files: Vec<IndexFile>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IndexFile {
    /// A segment file's name (`<segment uuid>.<component>`); never a path.
    pub name: String,
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

impl IndexFiles {
    /// Bytes of file content, for logs and limits.
    pub fn len(&self) -> usize {
        self.files.iter().map(|f| f.bytes.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

/// A handle on a [`KeywordIndex`](crate::KeywordIndex)'s files that can be used off its
/// owner's thread (tantivy's index handle is shared and cheap to clone).
#[derive(Clone)]
pub struct IndexHandle(pub(crate) Index);

impl IndexHandle {
    /// The files of the last commit. A background merge may replace that commit while it is
    /// read (and collect its files): the read is repeated until `meta.json` is the same
    /// before and after it. A file opened stays readable after it is deleted (it is mapped).
    pub fn committed_files(&self) -> Result<IndexFiles, KeywordError> {
        let dir = self.0.directory();
        for _ in 0..READ_ATTEMPTS {
            let before = read_meta(dir)?;
            let metas = self.0.load_metas()?;
            let mut names: Vec<PathBuf> = metas.list_segment_files().into_iter().collect();
            names.sort();
            let mut files = Vec::with_capacity(names.len());
            for path in names {
                let slice = match dir.open_read(&path) {
                    Ok(slice) => slice,
                    // Candidates a segment may not have (a delete file before any delete).
                    Err(OpenReadError::FileDoesNotExist(_)) => continue,
                    Err(e) => return Err(KeywordError::Index(e.into())),
                };
                let bytes = slice
                    .read_bytes()
                    .map_err(|e| KeywordError::Index(e.into()))?;
                files.push(IndexFile {
                    name: path.to_string_lossy().into_owned(),
                    bytes: bytes.as_slice().to_vec(),
                });
            }
            if read_meta(dir)? == before {
                return Ok(IndexFiles {
                    meta: before,
                    files,
                });
            }
        }
        Err(KeywordError::Index(TantivyError::SystemError(format!(
            "the index's commit changed under each of {READ_ATTEMPTS} reads of its files"
        ))))
    }
}

fn read_meta(dir: &dyn Directory) -> Result<String, KeywordError> {
    let bytes = dir
        .atomic_read(Path::new(META))
        .map_err(|e| KeywordError::Index(e.into()))?;
    String::from_utf8(bytes).map_err(|e| KeywordError::Corrupt(format!("meta.json: {e}")))
}

/// Makes `files` the last commit of the index in `dir`, carrying `applied_seq` and `note` as
/// [`commit_with_note`](crate::KeywordIndex::commit_with_note) does; the caller then opens
/// it with [`KeywordIndex::open`](crate::KeywordIndex::open). No writer may be open on `dir`:
/// [`close`](crate::KeywordIndex::close) it first (the writer lock is taken here). Atomic: the segment files are written and synced first,
/// then `meta.json` is replaced in one rename; until then the old commit stands, and files
/// left by a crash are collected as garbage.
///
/// Refused, with nothing changed, when the files are of another schema, or name a path
/// outside the directory, or a file the index has with other content.
pub fn install(
    dir: &Path,
    files: &IndexFiles,
    applied_seq: u64,
    note: &str,
) -> Result<(), KeywordError> {
    let refused = |why: String| KeywordError::Corrupt(format!("snapshot index files: {why}"));
    let open_error = |source: TantivyError| KeywordError::Open {
        dir: dir.to_path_buf(),
        source,
    };
    let directory = MmapDirectory::open(dir).map_err(|e| open_error(e.into()))?;
    let index = Index::open(directory).map_err(open_error)?;
    let managed = index.directory();
    let _lock = crate::with_lock_wait(|| {
        managed
            .acquire_lock(&INDEX_WRITER_LOCK)
            .map_err(|e| TantivyError::LockFailure(e, None))
    })
    .map_err(|_| KeywordError::Locked {
        dir: dir.to_path_buf(),
    })?;
    let mut meta: serde_json::Value = serde_json::from_str(&files.meta)
        .map_err(|e| refused(format!("meta.json does not parse: {e}")))?;
    let ours: serde_json::Value = serde_json::from_str(&read_meta(managed)?)
        .map_err(|e| refused(format!("this index's meta.json does not parse: {e}")))?;
    if meta.get("schema") != ours.get("schema") {
        return Err(KeywordError::SchemaMismatch {
            dir: dir.to_path_buf(),
        });
    }
    let mut seen = BTreeSet::new();
    for file in &files.files {
        // A bare file name: nothing may land outside the index directory, or on its meta.
        let plain = Path::new(&file.name)
            .file_name()
            .map(|n| n == file.name.as_str());
        if plain != Some(true) || file.name == META || file.name.starts_with('.') {
            return Err(refused(format!(
                "{:?} is not a segment file name",
                file.name
            )));
        }
        if !seen.insert(file.name.as_str()) {
            return Err(refused(format!("{:?} is listed twice", file.name)));
        }
    }
    for file in &files.files {
        let path = Path::new(&file.name);
        let exists = managed
            .exists(path)
            .map_err(|e| KeywordError::Index(e.into()))?;
        if exists {
            // The same segment (a replica importing its own snapshot): it must be the same.
            let held = managed
                .open_read(path)
                .map_err(|e| KeywordError::Index(e.into()))?
                .read_bytes()
                .map_err(|e| KeywordError::Index(e.into()))?;
            if held.as_slice() != file.bytes.as_slice() {
                return Err(refused(format!(
                    "{} differs from the file of that name in this index",
                    file.name
                )));
            }
            continue;
        }
        let mut out = managed
            .open_write(path)
            .map_err(|e| KeywordError::Index(e.into()))?;
        std::io::Write::write_all(&mut out, &file.bytes)
            .and_then(|()| tantivy::directory::TerminatingWrite::terminate(out))
            .map_err(|e| KeywordError::Index(e.into()))?;
    }
    meta["payload"] = serde_json::Value::String(payload(applied_seq, Some(note)));
    debug_assert!(payload(applied_seq, None).starts_with(PAYLOAD_PREFIX));
    let mut bytes =
        serde_json::to_vec_pretty(&meta).map_err(|e| refused(format!("meta.json: {e}")))?;
    bytes.push(b'\n');
    managed
        .sync_directory()
        .and_then(|()| managed.atomic_write(Path::new(META), &bytes))
        .map_err(|e| KeywordError::Index(e.into()))?;
    Ok(())
}

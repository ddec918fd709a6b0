use std::path::PathBuf;

use engram_memory::Seq;

/// What can go wrong with the keyword index.
///
/// None of these is caused by query text: any user text is a valid query.
#[derive(Debug, thiserror::Error)]
pub enum KeywordError {
    #[error(
        "cannot open the keyword index at {dir}: {source}; check that the path is a writable directory"
    )]
    Open {
        dir: PathBuf,
        #[source]
        source: tantivy::TantivyError,
    },

    #[error(
        "the keyword index at {dir} is held by another writer; stop the other engram process or give this one its own data directory"
    )]
    Locked { dir: PathBuf },

    #[error(
        "the keyword index at {dir} was written with a different schema; delete that directory and the projector rebuilds it from sequence 1"
    )]
    SchemaMismatch { dir: PathBuf },

    #[error(
        "the keyword index's last commit carries payload {payload:?}, which engram did not write; delete the index directory to rebuild it"
    )]
    ForeignPayload { payload: String },

    #[error(
        "the keyword checkpoint cannot move back from seq {committed} to {requested}; call clear() to rebuild from sequence 1"
    )]
    CheckpointBackwards { committed: Seq, requested: Seq },

    #[error(
        "a stored memory in the keyword index does not decode ({0}); delete the index directory to rebuild it"
    )]
    Corrupt(String),

    #[error(
        "the keyword index at {dir} still holds deleted documents' data after purging it ({left}); erase the scopes again"
    )]
    Residue { dir: PathBuf, left: String },

    #[error(
        "keyword index operation failed: {0}; if it repeats, reopen the index (it resumes from its last commit)"
    )]
    Index(#[from] tantivy::TantivyError),
}

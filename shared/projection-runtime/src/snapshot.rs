//! Checkpoint files: a read model and the [`ApplyLedger`] of what it includes, saved as one
//! unit.
//!
//! Layout: `ENGRAMSNAP2` magic, then MessagePack of `(ledger, model)` (structs as arrays;
//! files with named fields load too), then the blake3 hash of
//! everything before it. (`ENGRAMSNAP1` files held a bare sequence; they are refused with a
//! request to rebuild, since the events applied to them were never counted.) Written to a temporary file, fsynced, renamed over the old one and
//! the directory fsynced, so a crash at any point leaves either the old or the new
//! checkpoint, never a torn one. A file whose hash does not match is refused, not guessed at.

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{ApplyLedger, ProjectionError};

const MAGIC: &[u8] = b"ENGRAMSNAP2";

/// The format before the ledger: `(seq, model)`.
const MAGIC_WITHOUT_LEDGER: &[u8] = b"ENGRAMSNAP1";

/// `model` with `ledger` in the checkpoint format: what [`save`] writes, and what a
/// versioned snapshot of the model carries. Structs are written as arrays, without field
/// names: a million fact versions named every field again and made a snapshot half names
/// (the models round-trip either way, and files written with names still load).
pub fn encode<T: Serialize>(ledger: &ApplyLedger, model: &T) -> Result<Vec<u8>, ProjectionError> {
    let mut bytes = MAGIC.to_vec();
    rmp_serde::encode::write(&mut bytes, &(ledger, model))
        .map_err(|e| ProjectionError::Fatal(format!("cannot encode checkpoint: {e}")))?;
    let hash = blake3::hash(&bytes);
    bytes.extend_from_slice(hash.as_bytes());
    Ok(bytes)
}

/// Checks and decodes bytes in the checkpoint format. `what` names them in errors (a file, a
/// snapshot version) and `projector` the rebuild that replaces them.
pub fn decode<T: DeserializeOwned>(
    bytes: &[u8],
    what: &str,
    projector: &str,
) -> Result<(ApplyLedger, T), ProjectionError> {
    let body = checked_body(bytes, what, projector)?;
    rmp_serde::from_slice(body)
        .map_err(|e| corrupt(what, projector, &format!("does not decode: {e}")))
}

/// The MessagePack body of bytes in the checkpoint format, once their magic and checksum
/// check.
fn checked_body<'a>(
    bytes: &'a [u8],
    what: &str,
    projector: &str,
) -> Result<&'a [u8], ProjectionError> {
    if bytes.starts_with(MAGIC_WITHOUT_LEDGER) {
        return Err(ProjectionError::Fatal(format!(
            "{what} is in an older format without an apply ledger; run `engram rebuild {projector}` to replace it"
        )));
    }
    if bytes.len() < MAGIC.len() + 32 || !bytes.starts_with(MAGIC) {
        return Err(corrupt(what, projector, "not a checkpoint file"));
    }
    let (body, hash) = bytes.split_at(bytes.len() - 32);
    if blake3::hash(body).as_bytes() != hash {
        return Err(corrupt(what, projector, "checksum mismatch"));
    }
    Ok(&body[MAGIC.len()..])
}

fn corrupt(what: &str, projector: &str, why: &str) -> ProjectionError {
    ProjectionError::Fatal(format!(
        "{what} is corrupt ({why}); run `engram rebuild {projector}`"
    ))
}

/// Checks bytes in the checkpoint format (magic, checksum, a well-formed body) without
/// building the model, and returns the ledger they hold: what a bootstrap verifies before it
/// replaces anything.
pub fn check(bytes: &[u8], what: &str, projector: &str) -> Result<ApplyLedger, ProjectionError> {
    decode::<serde::de::IgnoredAny>(bytes, what, projector).map(|(ledger, _)| ledger)
}

/// The ledger bytes in the checkpoint format hold, after checking their magic and checksum
/// but without reading the model: for bytes an import will decode whole before it replaces
/// anything (a body that does not decode is refused there), where [`check`] would walk the
/// whole body once more.
pub fn ledger(bytes: &[u8], what: &str, projector: &str) -> Result<ApplyLedger, ProjectionError> {
    // `(ledger, model)`: a MessagePack array of two, the ledger first.
    match checked_body(bytes, what, projector)? {
        [0x92, rest @ ..] => rmp_serde::from_read(rest)
            .map_err(|e| corrupt(what, projector, &format!("its ledger does not decode: {e}"))),
        _ => Err(corrupt(what, projector, "not a ledger and a model")),
    }
}

/// Saves `model` with `ledger` at `path`, atomically.
pub fn save<T: Serialize>(
    path: &Path,
    ledger: &ApplyLedger,
    model: &T,
) -> Result<(), ProjectionError> {
    write_atomic(path, &encode(ledger, model)?)
}

/// Writes `bytes` at `path` atomically: a temporary file, fsynced, renamed over the old one,
/// the directory fsynced.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ProjectionError> {
    let dir = path
        .parent()
        .ok_or_else(|| ProjectionError::Fatal(format!("{} has no parent", path.display())))?;
    std::fs::create_dir_all(dir).map_err(|e| transient("create", dir, e))?;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&tmp).map_err(|e| transient("create", &tmp, e))?;
    file.write_all(bytes)
        .map_err(|e| transient("write", &tmp, e))?;
    file.sync_all().map_err(|e| transient("sync", &tmp, e))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| transient("rename", path, e))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| transient("sync", dir, e))?;
    Ok(())
}

/// Loads `projector`'s checkpoint; `None` when there is none yet. The name is only for the
/// error messages, which tell the operator what to rebuild.
pub fn load<T: DeserializeOwned>(
    path: &Path,
    projector: &str,
) -> Result<Option<(ApplyLedger, T)>, ProjectionError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(transient("read", path, e)),
    };
    let what = format!("checkpoint {}", path.display());
    decode(&bytes, &what, projector).map(Some)
}

/// Removes a checkpoint (rebuild).
pub fn remove(path: &Path) -> Result<(), ProjectionError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(transient("remove", path, e)),
    }
}

fn transient(what: &str, path: &Path, e: std::io::Error) -> ProjectionError {
    ProjectionError::Transient(format!("cannot {what} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_reads_without_the_model_and_refuses_what_check_refuses() {
        let mut ledger = ApplyLedger::default();
        ledger.add(7, "evt-a");
        let bytes = encode(&ledger, &vec!["model"; 3]).unwrap();
        assert_eq!(super::ledger(&bytes, "s", "m").unwrap(), ledger);
        assert_eq!(check(&bytes, "s", "m").unwrap(), ledger);
        let mut flipped = bytes.clone();
        let middle = flipped.len() / 2;
        flipped[middle] ^= 0x55;
        assert!(super::ledger(&flipped, "s", "m").is_err());
        assert!(super::ledger(&bytes[..bytes.len() - 1], "s", "m").is_err());
        // A body that is not `(ledger, model)` with a valid checksum.
        let mut other = MAGIC.to_vec();
        rmp_serde::encode::write(&mut other, &"not a pair").unwrap();
        let hash = blake3::hash(&other);
        other.extend_from_slice(hash.as_bytes());
        assert!(super::ledger(&other, "s", "m").is_err());
    }

    #[test]
    fn round_trips_and_refuses_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.snap");
        assert!(load::<Vec<String>>(&path, "m").unwrap().is_none());
        let mut ledger = ApplyLedger::default();
        ledger.add(41, "evt-a");
        ledger.add(42, "evt-b");
        save(&path, &ledger, &vec!["a".to_owned(), "b".to_owned()]).unwrap();
        let (loaded, model): (ApplyLedger, Vec<String>) = load(&path, "m").unwrap().unwrap();
        assert_eq!(
            (loaded, model),
            (ledger, vec!["a".to_owned(), "b".to_owned()])
        );

        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let err = load::<Vec<String>>(&path, "m").unwrap_err();
        assert!(matches!(err, ProjectionError::Fatal(m) if m.contains("checksum")));
    }

    #[test]
    fn a_checkpoint_without_a_ledger_asks_for_a_rebuild() {
        // Given a checkpoint in the first format: (seq, model) under ENGRAMSNAP1
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("facts.snap");
        let mut bytes = MAGIC_WITHOUT_LEDGER.to_vec();
        rmp_serde::encode::write_named(&mut bytes, &(42u64, vec!["a".to_owned()])).unwrap();
        let hash = blake3::hash(&bytes);
        bytes.extend_from_slice(hash.as_bytes());
        std::fs::write(&path, bytes).unwrap();

        // When it is loaded, then it is refused, naming the rebuild to run
        let err = load::<Vec<String>>(&path, "facts").unwrap_err();
        let ProjectionError::Fatal(message) = err else {
            panic!("an old checkpoint is fatal, not {err:?}");
        };
        assert!(
            message.contains("`engram rebuild facts`"),
            "unhelpful message: {message}"
        );
    }
}

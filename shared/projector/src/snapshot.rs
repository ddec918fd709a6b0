//! Checkpoint files: a read model and the sequence it includes, saved as one unit.
//!
//! Layout: `ENGRAMSNAP1` magic, then MessagePack of `(seq, model)`, then the blake3 hash of
//! everything before it. Written to a temporary file, fsynced, renamed over the old one and
//! the directory fsynced, so a crash at any point leaves either the old or the new
//! checkpoint, never a torn one. A file whose hash does not match is refused, not guessed at.

use std::io::Write;
use std::path::Path;

use engram_memory::Seq;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::ProjectionError;

const MAGIC: &[u8] = b"ENGRAMSNAP1";

/// Saves `model` with `seq` at `path`, atomically.
pub fn save<T: Serialize>(path: &Path, seq: Seq, model: &T) -> Result<(), ProjectionError> {
    let mut bytes = MAGIC.to_vec();
    rmp_serde::encode::write_named(&mut bytes, &(seq, model))
        .map_err(|e| ProjectionError::Fatal(format!("cannot encode checkpoint: {e}")))?;
    let hash = blake3::hash(&bytes);
    bytes.extend_from_slice(hash.as_bytes());

    let dir = path
        .parent()
        .ok_or_else(|| ProjectionError::Fatal(format!("{} has no parent", path.display())))?;
    std::fs::create_dir_all(dir).map_err(|e| transient("create", dir, e))?;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&tmp).map_err(|e| transient("create", &tmp, e))?;
    file.write_all(&bytes)
        .map_err(|e| transient("write", &tmp, e))?;
    file.sync_all().map_err(|e| transient("sync", &tmp, e))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| transient("rename", path, e))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| transient("sync", dir, e))?;
    Ok(())
}

/// Loads a checkpoint; `None` when there is none yet.
pub fn load<T: DeserializeOwned>(path: &Path) -> Result<Option<(Seq, T)>, ProjectionError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(transient("read", path, e)),
    };
    let corrupt = |why: &str| {
        ProjectionError::Fatal(format!(
            "checkpoint {} is corrupt ({why}); delete it and run `engram rebuild` for this projector",
            path.display()
        ))
    };
    if bytes.len() < MAGIC.len() + 32 || !bytes.starts_with(MAGIC) {
        return Err(corrupt("not a checkpoint file"));
    }
    let (body, hash) = bytes.split_at(bytes.len() - 32);
    if blake3::hash(body).as_bytes() != hash {
        return Err(corrupt("checksum mismatch"));
    }
    let (seq, model) = rmp_serde::from_slice(&body[MAGIC.len()..])
        .map_err(|e| corrupt(&format!("does not decode: {e}")))?;
    Ok(Some((seq, model)))
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
    fn round_trips_and_refuses_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.snap");
        assert!(load::<Vec<String>>(&path).unwrap().is_none());
        save(&path, 42, &vec!["a".to_owned(), "b".to_owned()]).unwrap();
        let (seq, model): (Seq, Vec<String>) = load(&path).unwrap().unwrap();
        assert_eq!((seq, model), (42, vec!["a".to_owned(), "b".to_owned()]));

        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let err = load::<Vec<String>>(&path).unwrap_err();
        assert!(matches!(err, ProjectionError::Fatal(m) if m.contains("checksum")));
    }
}

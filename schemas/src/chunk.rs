//! automerge change chunks, parsed with a bound on what they inflate to.
//!
//! automerge's `Change::try_from` inflates a compressed change chunk with no bound: a few
//! kilobytes of deflate became 16 MiB inside the docs model. So the chunk header is read here
//! first (automerge 0.12's storage format: 4 magic bytes, a 4-byte checksum, a chunk type
//! byte, a uleb128 body length, the body), and a compressed body is inflated here, reading
//! at most one byte past what the caller's budget allows. automerge is then handed the
//! inflated body as the uncompressed change chunk it stands for, under the same checksum:
//! the change hash is over the chunk type and the inflated body, so it is the same change,
//! and automerge inflates nothing itself.
//!
//! Only change chunks (compressed or not) are handed to automerge. A document or bundle
//! chunk is no change, and automerge would parse it whole, inflating its compressed
//! columns, before saying so; it is refused here unread.

use std::io::Read;

/// The bytes every automerge chunk starts with.
const MAGIC: [u8; 4] = [0x85, 0x6f, 0x4a, 0x83];
/// Chunk types (the byte after the checksum).
const DOCUMENT: u8 = 0;
const CHANGE: u8 = 1;
const COMPRESSED: u8 = 2;
const BUNDLE: u8 = 3;

/// Why a change chunk was refused.
#[derive(Debug, PartialEq)]
pub(crate) enum ChunkError {
    /// Its body, inflated if compressed, is more than the budget left.
    OverBudget,
    /// Not an automerge change; the reason says why.
    Invalid(String),
}

/// The header of a chunk: its checksum, type, and the body after it.
struct Header<'a> {
    checksum: [u8; 4],
    chunk_type: u8,
    body: &'a [u8],
    /// Whatever follows the body.
    rest: &'a [u8],
}

fn header(bytes: &[u8]) -> Result<Header<'_>, ChunkError> {
    let invalid = |s: &str| Err(ChunkError::Invalid(s.to_owned()));
    if bytes.len() < 10 {
        return invalid("shorter than a chunk header");
    }
    if bytes[..4] != MAGIC {
        return invalid("not an automerge chunk (its magic bytes are wrong)");
    }
    let checksum = [bytes[4], bytes[5], bytes[6], bytes[7]];
    let chunk_type = bytes[8];
    let (len, used) = uleb128(&bytes[9..])?;
    let start = 9 + used;
    let available = bytes.len() - start;
    let Some(len) = usize::try_from(len).ok().filter(|&n| n <= available) else {
        return Err(ChunkError::Invalid(format!(
            "the chunk says it holds {len} bytes, but {available} follow its header"
        )));
    };
    Ok(Header {
        checksum,
        chunk_type,
        body: &bytes[start..start + len],
        rest: &bytes[start + len..],
    })
}

/// An unsigned LEB128 number and the bytes it took, refused as automerge refuses it: longer
/// than 64 bits, or overlong (a trailing zero byte).
fn uleb128(bytes: &[u8]) -> Result<(u64, usize), ChunkError> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().enumerate().take(10) {
        let low = u64::from(byte & 0x7f);
        if i == 9 && low > 1 {
            break;
        }
        value |= low << (7 * i);
        if byte & 0x80 == 0 {
            if i > 0 && byte == 0 {
                return Err(ChunkError::Invalid("overlong chunk length".into()));
            }
            return Ok((value, i + 1));
        }
    }
    Err(ChunkError::Invalid(
        "the chunk length is not a 64-bit number".into(),
    ))
}

fn write_uleb128(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Parses one change chunk whose body, inflated if compressed, takes at most `*budget`
/// bytes, and takes those bytes from `*budget`. A compressed body is inflated through a
/// reader that stops one byte past the budget, so a chunk over it costs at most the budget
/// in memory and time, whatever it would inflate to.
pub(crate) fn parse_change(
    bytes: &[u8],
    budget: &mut usize,
) -> Result<automerge::Change, ChunkError> {
    let chunk = header(bytes)?;
    let not_a_change = |e: automerge::LoadChangeError| ChunkError::Invalid(e.to_string());
    let change = match chunk.chunk_type {
        CHANGE => {
            if chunk.body.len() > *budget {
                return Err(ChunkError::OverBudget);
            }
            *budget -= chunk.body.len();
            automerge::Change::try_from(bytes).map_err(not_a_change)?
        }
        COMPRESSED => {
            if !chunk.rest.is_empty() {
                return Err(ChunkError::Invalid(
                    "leftover data after the compressed chunk".into(),
                ));
            }
            let cap = u64::try_from(*budget).unwrap_or(u64::MAX).saturating_add(1);
            let mut inflated = Vec::new();
            flate2::bufread::DeflateDecoder::new(chunk.body)
                .take(cap)
                .read_to_end(&mut inflated)
                .map_err(|e| ChunkError::Invalid(format!("its deflate data is corrupt ({e})")))?;
            if inflated.len() > *budget {
                return Err(ChunkError::OverBudget);
            }
            *budget -= inflated.len();
            // The uncompressed chunk the compressed one stands for: automerge builds the
            // same header from a compressed chunk (its checksum, type change, the inflated
            // length) before parsing it.
            let mut plain = Vec::with_capacity(inflated.len() + 19);
            plain.extend(MAGIC);
            plain.extend(chunk.checksum);
            plain.push(CHANGE);
            write_uleb128(&mut plain, inflated.len() as u64);
            plain.extend(&inflated);
            automerge::Change::try_from(&plain[..]).map_err(not_a_change)?
        }
        DOCUMENT => {
            return Err(ChunkError::Invalid(
                "a whole document (automerge save), not a change".into(),
            ));
        }
        BUNDLE => {
            return Err(ChunkError::Invalid(
                "a bundle of changes, not one change".into(),
            ));
        }
        other => {
            return Err(ChunkError::Invalid(format!("unknown chunk type {other}")));
        }
    };
    Ok(change)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::envelope::{Content, Envelope, EventKind, Layer, Scope, ScopeKind};
    use crate::error::SchemaError;
    use crate::ident::Ident;
    use crate::payload::{DocChanged, MAX_DOC_INFLATED_BYTES};
    use automerge::transaction::Transactable as _;
    use base64::Engine as _;

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn doc_event(changes: &[&[u8]]) -> Envelope {
        let id = |s: &str| Ident::parse("id", s).unwrap();
        let changes: Vec<String> = changes.iter().map(|c| b64(c)).collect();
        Envelope::new(
            id("acme"),
            Scope::new(ScopeKind::Task, "t-1").unwrap(),
            id("planner"),
            id("i-1"),
            Layer::Working,
            EventKind::DocChanged,
            Content {
                text: "an edit".into(),
                data: Some(serde_json::json!({
                    "doc_type": "scratchpad", "name": "notes", "changes": changes,
                })),
            },
        )
    }

    /// A compressed change chunk (automerge's own layout) whose body inflates to
    /// `inflated` zero bytes: a few kilobytes standing for megabytes.
    pub(crate) fn bomb(inflated: usize) -> Vec<u8> {
        use std::io::Write as _;
        let mut encoder =
            flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![0u8; 1 << 20];
        let mut left = inflated;
        while left > 0 {
            let n = left.min(zeros.len());
            encoder.write_all(&zeros[..n]).unwrap();
            left -= n;
        }
        let deflated = encoder.finish().unwrap();
        let mut chunk = MAGIC.to_vec();
        chunk.extend([1, 2, 3, 4]);
        chunk.push(COMPRESSED);
        write_uleb128(&mut chunk, deflated.len() as u64);
        chunk.extend(deflated);
        chunk
    }

    /// One change that writes `text` into a fresh document, as automerge sends it over the
    /// wire (`Change::bytes`: compressed once it is over 256 bytes).
    fn change_writing(text: &str) -> Vec<u8> {
        let mut doc = automerge::AutoCommit::new();
        doc.put(automerge::ROOT, "note", text).unwrap();
        doc.get_last_local_change().unwrap().bytes().into_owned()
    }

    fn too_large(event: &Envelope) -> String {
        let err = DocChanged::from_event(event).expect_err("over the inflated bound");
        assert!(err.is_too_large(), "{err:?}");
        assert_eq!(err.field, "content.data.changes");
        assert!(
            err.reason.contains(&MAX_DOC_INFLATED_BYTES.to_string())
                && err.reason.contains("further events"),
            "the reason names the bound and what to do: {}",
            err.reason
        );
        match event.validate() {
            Err(SchemaError::PayloadTooLarge { field, reason }) => {
                assert_eq!(field, "content.data.changes");
                reason
            }
            other => panic!("the append check refuses it as too large: {other:?}"),
        }
    }

    #[test]
    fn a_compressed_change_inflating_to_16_mib_is_refused_as_too_large() {
        let bomb = bomb(16 << 20);
        assert!(bomb.len() < 32 * 1024, "{} bytes", bomb.len());
        let reason = too_large(&doc_event(&[&bomb]));
        assert!(reason.starts_with("item 0:"), "{reason}");
        // The inflate stopped one byte past the bound: the budget is all that was read.
        let mut budget = MAX_DOC_INFLATED_BYTES;
        assert_eq!(
            parse_change(&bomb, &mut budget),
            Err(ChunkError::OverBudget)
        );
    }

    #[test]
    fn the_bound_is_on_all_changes_of_an_event_together() {
        // Each alone fits; together they inflate past the bound.
        let half = change_writing(&"abcdefgh".repeat(MAX_DOC_INFLATED_BYTES / 16 + 64));
        assert_eq!(half[8], COMPRESSED);
        DocChanged::from_event(&doc_event(&[&half])).expect("one alone fits");
        let reason = too_large(&doc_event(&[&half, &half]));
        assert!(reason.starts_with("item 1:"), "{reason}");
    }

    #[test]
    fn a_legitimate_compressed_change_parses_to_the_change_automerge_reads() {
        let text = "the quick brown fox jumps over the lazy dog. ".repeat(400);
        let compressed = change_writing(&text);
        assert_eq!(compressed[8], COMPRESSED, "automerge compressed it");
        let theirs = automerge::Change::try_from(&compressed[..]).unwrap();
        assert!(theirs.raw_bytes().len() > compressed.len());

        let event = doc_event(&[&compressed]);
        event.validate().expect("a real compressed change passes");
        let (_, ours) = DocChanged::from_event(&event).unwrap();
        assert_eq!(ours.len(), 1);
        assert_eq!(ours[0].hash(), theirs.hash());
        assert_eq!(ours[0].raw_bytes(), theirs.raw_bytes());
        assert_eq!(ours[0].decode(), theirs.decode());

        // Handed on uncompressed: the same change, which parses without inflating.
        let plain = DocChanged::uncompressed(&event, &ours).expect("it was compressed");
        let (_, again) = DocChanged::from_event(&plain).unwrap();
        assert_eq!(again[0].hash(), theirs.hash());
        assert_eq!(
            plain.content.data.as_ref().unwrap()["changes"][0],
            b64(theirs.raw_bytes())
        );
        assert!(DocChanged::uncompressed(&plain, &again).is_none());
    }

    #[test]
    fn a_legitimate_change_over_the_bound_is_refused_too() {
        // Text compresses well: a change of 600 KiB of text is a few kilobytes on the wire,
        // but it is more than one event's changes may hold.
        let compressed = change_writing(&"abcdefgh".repeat(600 * 128));
        assert_eq!(compressed[8], COMPRESSED);
        too_large(&doc_event(&[&compressed]));
    }

    #[test]
    fn an_uncompressed_change_still_parses_and_counts_its_size() {
        let mut doc = automerge::AutoCommit::new();
        doc.put(automerge::ROOT, "k", "v").unwrap();
        let raw = doc.get_last_local_change().unwrap().raw_bytes().to_vec();
        assert_eq!(raw[8], CHANGE);
        let (_, changes) = DocChanged::from_event(&doc_event(&[&raw])).unwrap();
        assert_eq!(changes[0].raw_bytes(), &raw[..]);
        let body = raw.len() - 10;
        let mut budget = body;
        parse_change(&raw, &mut budget).unwrap();
        assert_eq!(budget, 0);
        let mut short = body - 1;
        assert_eq!(parse_change(&raw, &mut short), Err(ChunkError::OverBudget));
    }

    #[test]
    fn a_document_chunk_is_refused_unparsed() {
        let mut doc = automerge::AutoCommit::new();
        doc.put(automerge::ROOT, "note", "x".repeat(4096)).unwrap();
        let saved = doc.save();
        assert_eq!(saved[8], DOCUMENT);
        let err = DocChanged::from_event(&doc_event(&[&saved])).unwrap_err();
        assert!(!err.is_too_large());
        assert!(err.reason.contains("not a change"), "{}", err.reason);
    }

    #[test]
    fn corrupt_deflate_and_trailing_bytes_are_refused_as_invalid() {
        let mut corrupt = bomb(1000);
        let n = corrupt.len();
        corrupt[n - 3..].fill(0xff);
        let mut budget = MAX_DOC_INFLATED_BYTES;
        assert!(matches!(
            parse_change(&corrupt, &mut budget),
            Err(ChunkError::Invalid(_))
        ));
        let mut trailing = change_writing(&"y".repeat(2048));
        trailing.push(0);
        let err = DocChanged::from_event(&doc_event(&[&trailing])).unwrap_err();
        assert!(err.reason.contains("leftover"), "{}", err.reason);
    }

    #[test]
    fn uleb128_reads_what_it_writes_and_refuses_what_automerge_refuses() {
        for n in [0u64, 1, 127, 128, 300, 1 << 20, u64::MAX] {
            let mut out = Vec::new();
            write_uleb128(&mut out, n);
            assert_eq!(uleb128(&out).unwrap(), (n, out.len()));
        }
        // Overlong: 1 written in two bytes.
        assert!(uleb128(&[0x81, 0x00]).is_err());
        // More than 64 bits.
        assert!(uleb128(&[0xff; 10]).is_err());
        assert!(uleb128(&[0x80; 11]).is_err());
        // Ends early.
        assert!(uleb128(&[0x80]).is_err());
    }

    #[test]
    fn a_header_past_the_end_of_its_input_is_refused() {
        let mut chunk = MAGIC.to_vec();
        chunk.extend([0; 4]);
        chunk.push(COMPRESSED);
        write_uleb128(&mut chunk, 1 << 40);
        chunk.push(0);
        let err = parse_change(&chunk, &mut 1_000).unwrap_err();
        assert!(
            matches!(&err, ChunkError::Invalid(r) if r.contains("follow its header")),
            "{err:?}"
        );
    }
}

//! The changes of a `doc_changed` event are decoded at most once per scrub, and not at all
//! for a reader that leaves them alone: decoding inflates compressed changes. Measured in
//! bytes allocated on this thread (its own test binary's counting allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use base64::Engine as _;
use engram_schema::automerge::{self, transaction::Transactable as _};
use engram_schema::{Content, DocChanged, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};
use engram_scrub::{DocChanges, Scrubbers};

thread_local! {
    /// Bytes allocated on this thread while counting; other threads (the harness) are ignored.
    static BYTES: Cell<Option<usize>> = const { Cell::new(None) };
}

struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; counting only reads and
// writes a const-initialised thread-local cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = BYTES.try_with(|c| c.set(c.get().map(|n| n + layout.size())));
        // SAFETY: the caller's contract is passed through.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed through.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = BYTES.try_with(|c| c.set(c.get().map(|n| n + new_size)));
        // SAFETY: the caller's contract is passed through.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn allocated(f: impl FnOnce()) -> usize {
    BYTES.with(|c| c.set(Some(0)));
    f();
    BYTES.with(|c| c.replace(None)).unwrap_or(0)
}

fn doc_event(text: &str, change: &[u8]) -> Envelope {
    let id = |s: &str| Ident::parse("id", s).unwrap();
    Envelope::new(
        id("acme"),
        Scope::new(ScopeKind::Task, "t-1").unwrap(),
        id("planner"),
        id("i-1"),
        Layer::Working,
        EventKind::DocChanged,
        Content {
            text: text.into(),
            data: Some(serde_json::json!({
                "doc_type": "scratchpad",
                "name": "notes",
                "changes": [base64::engine::general_purpose::STANDARD.encode(change)],
            })),
        },
    )
}

/// A change writing a 400 KiB string, compressed as automerge sends it: a few kilobytes.
fn big_compressed_change() -> Vec<u8> {
    let mut doc = automerge::AutoCommit::new();
    doc.put(
        automerge::ROOT,
        "note",
        "sprint notes ".repeat(400 * 1024 / 13),
    )
    .unwrap();
    let bytes = doc.get_last_local_change().unwrap().bytes().into_owned();
    assert_eq!(bytes[8], 2, "compressed");
    assert!(bytes.len() < 64 * 1024, "{} bytes", bytes.len());
    bytes
}

const SECRET_TEXT: &str = "note: db password=hunter2hunter2";

#[test]
fn a_dirty_doc_event_decodes_its_changes_once_and_leave_decodes_none() {
    let scrubbers = Scrubbers::default();
    let change = big_compressed_change();
    let clean = doc_event("an edit", &change);
    let dirty = doc_event(SECRET_TEXT, &change);
    // Warm up: the scrubber builds its patterns on first use.
    assert!(scrubbers.scrubbed(&clean).is_none());
    assert!(scrubbers.scrubbed(&dirty).is_some());

    // A clean event is decoded once to be checked; a dirty one (its text redacted) is
    // decoded no more: the check and the redaction share the decode.
    let once = allocated(|| assert!(scrubbers.scrubbed(&clean).is_none()));
    let dirty_cost = allocated(|| {
        let (copy, kinds) = scrubbers.scrubbed(&dirty).unwrap();
        assert!(!kinds.is_empty());
        assert!(!copy.content.text.contains("hunter2"));
    });
    assert!(
        once > 400 * 1024,
        "the decode inflates the change: {once} bytes"
    );
    assert!(
        dirty_cost < once + once / 2,
        "a dirty event cost {dirty_cost} bytes, one decode {once}: decoded twice"
    );

    // Changes decoded by the caller are not decoded again.
    let (_, changes) = DocChanged::from_event(&dirty).unwrap();
    let decoded_cost = allocated(|| {
        assert!(
            scrubbers
                .scrubbed_with(&dirty, DocChanges::Decoded(&changes))
                .is_some()
        );
    });
    assert!(
        decoded_cost < once,
        "{decoded_cost} bytes vs one decode {once}"
    );

    // A reader that leaves them alone does not decode them: the text is still redacted.
    let leave_cost = allocated(|| {
        let (copy, _) = scrubbers.scrubbed_with(&dirty, DocChanges::Leave).unwrap();
        assert!(!copy.content.text.contains("hunter2"));
        assert_eq!(copy.content.data, dirty.content.data);
    });
    assert!(
        leave_cost < 256 * 1024,
        "leaving the changes alone cost {leave_cost} bytes"
    );
}

#[test]
fn a_secret_written_in_a_compressed_change_is_found_from_the_callers_decode() {
    let mut doc = automerge::AutoCommit::new();
    doc.put(
        automerge::ROOT,
        "note",
        format!("{SECRET_TEXT} {}", "padding ".repeat(100)),
    )
    .unwrap();
    let change = doc.get_last_local_change().unwrap().bytes().into_owned();
    assert_eq!(change[8], 2, "compressed");
    let event = doc_event("an edit", &change);
    let (_, changes) = DocChanged::from_event(&event).unwrap();
    let scrubbers = Scrubbers::default();
    for docs in [DocChanges::Decode, DocChanges::Decoded(&changes)] {
        let (copy, kinds) = scrubbers.scrubbed_with(&event, docs).unwrap();
        assert!(!kinds.is_empty());
        assert_eq!(copy.content.data.unwrap()["changes"], serde_json::json!([]));
    }
    assert!(scrubbers.scrubbed_with(&event, DocChanges::Leave).is_none());
}

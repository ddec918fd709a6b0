//! A compressed document change is inflated under a bound, never to what it claims: the memory
//! the check takes is measured by a counting allocator (this file's own test binary, one test,
//! so nothing else allocates meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};

use base64::Engine as _;
use engram_schema::payload::MAX_DOC_INFLATED_BYTES;
use engram_schema::{Content, DocChanged, Envelope, EventKind, Ident, Layer, Scope, ScopeKind};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        // SAFETY: forwarded as given.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A compressed automerge change chunk whose deflate body inflates to `inflated` zero bytes.
fn bomb(inflated: usize) -> Vec<u8> {
    let mut encoder = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..inflated / zeros.len() {
        encoder.write_all(&zeros).unwrap();
    }
    let deflated = encoder.finish().unwrap();
    // Magic, checksum, chunk type 2 (compressed), uleb128 length, body.
    let mut chunk = vec![0x85, 0x6f, 0x4a, 0x83, 1, 2, 3, 4, 2];
    let mut len = deflated.len();
    loop {
        let byte = (len & 0x7f) as u8;
        len >>= 7;
        if len == 0 {
            chunk.push(byte);
            break;
        }
        chunk.push(byte | 0x80);
    }
    chunk.extend(deflated);
    chunk
}

#[test]
fn a_16_mib_bomb_is_refused_holding_no_more_than_the_bound() {
    let bomb = bomb(16 << 20);
    assert!(bomb.len() < 32 * 1024, "{} bytes", bomb.len());
    let id = |s: &str| Ident::parse("id", s).unwrap();
    let event = Envelope::new(
        id("acme"),
        Scope::new(ScopeKind::Task, "t-1").unwrap(),
        id("planner"),
        id("i-1"),
        Layer::Working,
        EventKind::DocChanged,
        Content {
            text: "an edit".into(),
            data: Some(serde_json::json!({
                "doc_type": "scratchpad",
                "name": "notes",
                "changes": [base64::engine::general_purpose::STANDARD.encode(&bomb)],
            })),
        },
    );

    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let err = DocChanged::from_event(&event).expect_err("refused");
    let held = PEAK.load(Ordering::SeqCst) - before;

    assert!(err.is_too_large(), "{err:?}");
    assert_eq!(err.field, "content.data.changes");
    // The inflated buffer grows by doubling up to one byte past the bound: at most about
    // twice the bound, with the decoder's own state (1.6 MB measured). automerge's own
    // inflate peaked at 50 MB on this input.
    assert!(
        held < 4 * MAX_DOC_INFLATED_BYTES,
        "the check held {held} bytes at its peak"
    );
}

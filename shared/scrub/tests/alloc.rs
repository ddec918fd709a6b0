//! Clean text costs no allocation: the scrubber returns it borrowed without touching the heap.

use std::alloc::{GlobalAlloc, Layout, System};
use std::borrow::Cow;
use std::cell::Cell;

use engram_scrub::Scrubber;

thread_local! {
    /// Allocations made on this thread while counting; other threads (the harness) are ignored.
    static COUNT: Cell<Option<usize>> = const { Cell::new(None) };
}

struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; counting only reads and
// writes a const-initialised thread-local cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNT.try_with(|c| c.set(c.get().map(|n| n + 1)));
        // SAFETY: the caller's contract is passed through.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed through.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn allocations(f: impl FnOnce()) -> usize {
    COUNT.with(|c| c.set(Some(0)));
    f();
    COUNT.with(|c| c.replace(None)).unwrap_or(0)
}

#[test]
fn clean_text_is_borrowed_without_allocating() {
    let scrubber = Scrubber::default();
    let lines = [
        "retry the upload when the gateway answers 502",
        // Trigger words make every detector run, and still nothing is allocated.
        "the api key is in vault; token budget 1024; passwords must be rotated every 90 days",
        "password: <redacted>, token: none, see https://example.com/a/b?x=1 and the key ab12",
    ];
    // The first scrub on a thread builds the patterns and the regex caches.
    for line in lines {
        let _ = scrubber.scrub(line);
    }
    for line in lines {
        let mut borrowed = false;
        let n = allocations(|| {
            let out = scrubber.scrub(line);
            borrowed = matches!(out.text, Cow::Borrowed(_));
        });
        assert!(borrowed, "{line}");
        assert_eq!(n, 0, "{line}");
    }
}

//! Buffers for a model's weights on huge pages.
//!
//! A batch of one (a query) reads every weight once per pass, each product's weights in
//! tiles whose rows lie kilobytes apart: with 4 KB pages most of those reads also miss the
//! TLB. On 2 MB pages a 2.4 MB matrix is two translations. Linux gives an anonymous
//! mapping huge pages only where asked (`transparent_hugepage` = `madvise`, the common
//! default) and only for whole aligned 2 MB ranges, so the buffer starts on one.

use std::marker::PhantomData;

use memmap2::{Advice, MmapMut};
use pulp::bytemuck::Pod;

/// A huge page's size on x86-64 and aarch64 (with 4 KB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// A zero-initialised, fixed-length buffer of `T`, starting on a huge-page boundary when it
/// is at least a huge page long. Derefs to `[T]`.
pub(crate) struct Pages<T> {
    map: MmapMut,
    offset: usize,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Pod> Pages<T> {
    /// `len` zeros. Panics if the memory cannot be mapped, as a `Vec` of that size would.
    pub(crate) fn zeroed(len: usize) -> Self {
        let bytes = len * size_of::<T>();
        let huge = bytes >= HUGE_PAGE;
        // A huge page's worth more of address space (never touched, so never resident)
        // leaves room to start on a boundary.
        let reserve = if huge { bytes + HUGE_PAGE } else { bytes };
        let map = MmapMut::map_anon(reserve.max(1)).expect("memory for a model's weights");
        let offset = if huge {
            (map.as_ptr() as usize).next_multiple_of(HUGE_PAGE) - map.as_ptr() as usize
        } else {
            0
        };
        if huge {
            // Only a hint: without it (another kernel, THP off) the buffer still works.
            let whole = bytes / HUGE_PAGE * HUGE_PAGE;
            if let Err(error) = map.advise_range(Advice::HugePage, offset, whole) {
                tracing::debug!(%error, "huge pages refused for the model's weights");
            }
        }
        Self {
            map,
            offset,
            len,
            _values: PhantomData,
        }
    }
}

impl<T: Pod> std::ops::Deref for Pages<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        pulp::bytemuck::cast_slice(&self.map[self.offset..self.offset + self.len * size_of::<T>()])
    }
}

impl<T: Pod> std::ops::DerefMut for Pages<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let range = self.offset..self.offset + self.len * size_of::<T>();
        pulp::bytemuck::cast_slice_mut(&mut self.map[range])
    }
}

impl<T: Pod> std::fmt::Debug for Pages<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pages").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_zeroed_writable_and_a_long_one_starts_on_a_huge_page() {
        for len in [0usize, 1, 1000, HUGE_PAGE / 4 + 3, 3 * HUGE_PAGE / 4] {
            let mut pages = Pages::<f32>::zeroed(len);
            assert_eq!(pages.len(), len);
            assert!(pages.iter().all(|v| *v == 0.0));
            pages
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = i as f32);
            assert!(pages.iter().enumerate().all(|(i, v)| *v == i as f32));
            if len * 4 >= HUGE_PAGE {
                assert_eq!(pages.as_ptr() as usize % HUGE_PAGE, 0);
            }
        }
    }
}

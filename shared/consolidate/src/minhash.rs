//! MinHash signatures over word shingles: a cheap, deterministic estimate of how much two
//! texts share, and bands of it that put likely near-duplicates in the same bucket.

use serde::{Deserialize, Serialize};

/// Hash functions per signature.
pub const HASHES: usize = 32;
/// Signatures are cut into this many bands; two texts sharing any band are candidates.
pub const BANDS: usize = 8;
const ROWS: usize = HASHES / BANDS;

/// A text's MinHash signature.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signature(pub [u32; HASHES]);

fn mix(mut x: u64) -> u64 {
    // splitmix64: a well-spread, portable 64-bit mix (no randomness, same on every machine).
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The lowercased alphanumeric words of `text`.
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// The hashes of the word 3-shingles of `text` (its words, for texts under three words),
/// sorted and without repeats; empty for a text without words.
pub fn shingles(text: &str) -> Vec<u64> {
    let words = words(text);
    if words.is_empty() {
        return Vec::new();
    }
    let width = words.len().min(3);
    let mut shingles: Vec<u64> = words
        .windows(width)
        .map(|w| fnv(w.join(" ").as_bytes()))
        .collect();
    shingles.sort_unstable();
    shingles.dedup();
    shingles
}

/// The exact Jaccard similarity of two [`shingles`] sets.
pub fn jaccard(a: &[u64], b: &[u64]) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let (mut i, mut j, mut shared) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                shared += 1;
                i += 1;
                j += 1;
            }
        }
    }
    shared as f64 / (a.len() + b.len() - shared) as f64
}

impl Signature {
    /// Of the word 3-shingles of `text` (its words, for texts under three words). `None`
    /// for a text without words.
    pub fn of(text: &str) -> Option<Self> {
        let shingles = shingles(text);
        if shingles.is_empty() {
            return None;
        }
        let mut sig = [u32::MAX; HASHES];
        for (i, slot) in sig.iter_mut().enumerate() {
            let seed = mix(i as u64 + 1);
            for s in &shingles {
                *slot = (*slot).min((mix(s ^ seed) >> 32) as u32);
            }
        }
        Some(Self(sig))
    }

    /// The estimated Jaccard similarity of the two shingle sets.
    pub fn similarity(&self, other: &Self) -> f64 {
        let same = self
            .0
            .iter()
            .zip(other.0)
            .filter(|(a, b)| **a == *b)
            .count();
        same as f64 / HASHES as f64
    }

    /// The band keys: equal keys in a band make two texts candidates.
    pub fn bands(&self) -> [u64; BANDS] {
        let mut keys = [0u64; BANDS];
        for (b, key) in keys.iter_mut().enumerate() {
            let mut h = mix(b as u64);
            for v in &self.0[b * ROWS..(b + 1) * ROWS] {
                h = mix(h ^ u64::from(*v));
            }
            *key = h;
        }
        keys
    }
}

//! Terms for [`crate::SkillRegistry::search`]: lowercase runs of letters and digits, minus
//! a few function words that would otherwise match every task description.

use std::collections::BTreeSet;

const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "by", "can", "do", "does", "for", "from", "how",
    "i", "if", "in", "into", "is", "it", "its", "me", "my", "of", "on", "or", "our", "please",
    "should", "so", "that", "the", "then", "this", "to", "we", "what", "when", "where", "which",
    "with", "you", "your",
];

pub(crate) fn terms(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|word| !word.is_empty())
        .map(str::to_lowercase)
        .filter(|word| !STOP_WORDS.contains(&word.as_str()))
}

pub(crate) fn term_set<'a>(texts: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
    texts.into_iter().flat_map(terms).collect()
}

/// A stable 64-bit id of a term (FNV-1a): the same in every build and process, so derived
/// indexes rebuilt from a snapshot match the ones built incrementally. Two distinct terms
/// sharing an id (odds about 2^-64 per pair) would only make search count one as the other.
pub(crate) fn term_id(term: &str) -> u64 {
    term.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

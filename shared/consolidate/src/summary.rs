//! The extractive summariser: the sentences that best represent a session, in the order
//! they were said. Deterministic: the same memories give the same summary.
//!
//! A sentence scores the mean, over its content words, of how often the session uses the
//! word (common words count once per sentence, stopwords not at all), so sentences about
//! what the session kept coming back to rank first. The top [`SENTENCES`] are kept, ties
//! broken by position, then put back in session order.

use std::collections::{BTreeMap, BTreeSet};

use crate::minhash::words;

/// Sentences a summary keeps.
pub const SENTENCES: usize = 5;
/// Longest summary, in bytes.
pub const MAX_SUMMARY_BYTES: usize = 2_000;

const STOPWORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "from", "had", "has", "have",
    "he", "her", "his", "i", "in", "is", "it", "its", "me", "my", "of", "on", "or", "our", "she",
    "so", "that", "the", "their", "them", "they", "this", "to", "was", "we", "were", "what",
    "with", "you", "your", "do", "did", "not", "just", "about", "will", "would", "can", "could",
    "there", "been", "if", "then", "than", "too", "very", "yes", "no", "oh", "really", "that's",
    "i'm", "it's",
];

/// Splits a memory's text into sentences.
pub fn sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for c in text.chars() {
        current.push(c);
        if matches!(c, '.' | '!' | '?' | '\n') {
            let s = current.trim();
            if !s.is_empty() {
                out.push(s.to_owned());
            }
            current.clear();
        }
    }
    let s = current.trim();
    if !s.is_empty() {
        out.push(s.to_owned());
    }
    out
}

fn content_words(sentence: &str) -> BTreeSet<String> {
    words(sentence)
        .into_iter()
        .filter(|w| w.len() > 2 && !STOPWORDS.contains(&w.as_str()))
        .collect()
}

/// The summary of `texts` (in session order), or `None` when they hold no sentence with a
/// content word.
pub fn summarise<'a>(texts: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let all: Vec<String> = texts.into_iter().flat_map(sentences).collect();
    let mut frequency: BTreeMap<String, usize> = BTreeMap::new();
    let content: Vec<BTreeSet<String>> = all.iter().map(|s| content_words(s)).collect();
    for words in &content {
        for w in words {
            *frequency.entry(w.clone()).or_default() += 1;
        }
    }
    let mut scored: Vec<(f64, usize)> = content
        .iter()
        .enumerate()
        .filter(|(_, words)| !words.is_empty())
        .map(|(i, words)| {
            let total: usize = words.iter().map(|w| frequency[w]).sum();
            (total as f64 / words.len() as f64, i)
        })
        .collect();
    if scored.is_empty() {
        return None;
    }
    // Highest score first; of equal scores, the earlier sentence.
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut kept: Vec<usize> = scored.iter().take(SENTENCES).map(|(_, i)| *i).collect();
    kept.sort_unstable();
    let mut summary = String::new();
    for i in kept {
        let sentence = &all[i];
        if summary.len() + sentence.len() + 1 > MAX_SUMMARY_BYTES {
            break;
        }
        if !summary.is_empty() {
            summary.push(' ');
        }
        summary.push_str(sentence);
    }
    (!summary.is_empty()).then_some(summary)
}

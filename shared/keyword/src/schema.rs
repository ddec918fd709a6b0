//! The index's fields, its text analyser, and how a memory becomes a tantivy document.
//!
//! Changing anything here changes what is on disk: an index written by an older schema is
//! refused at open ([`crate::KeywordError::SchemaMismatch`]) and rebuilt by the projector.

use engram_memory::{MemoryMeta, ScopeKey, Seq};
use tantivy::TantivyDocument;
use tantivy::schema::{
    FAST, Field, INDEXED, IndexRecordOption, STORED, STRING, Schema, TextFieldIndexing, TextOptions,
};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer,
    TokenizerManager,
};

/// The name the text analyser is registered under. Ours rather than tantivy's `en_stem`, so a
/// change of tantivy's default can never silently re-tokenise queries against an old index.
pub const ANALYZER: &str = "engram_en";

/// Tokens longer than this are dropped: they are hashes, base64 blobs or URLs, never words,
/// and would bloat the term dictionary.
const MAX_TOKEN_BYTES: usize = 40;

/// English analysis for memory text and queries alike: split on anything that is not a letter
/// or digit, drop very long tokens, lowercase, Porter-stem.
///
/// Stop words are kept in the index, so that a query made only of them ("to be or not to be")
/// still finds its memories; a query's other words go without them ([`query_analyzer`]).
pub fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(MAX_TOKEN_BYTES))
        .filter(LowerCaser)
        .filter(Stemmer::new(Language::English))
        .build()
}

/// English function words (NLTK's stop-word list): what a question is made of besides what
/// it asks about ("when did", "what was", "how many").
const QUERY_STOP_WORDS: &[&str] = &[
    "i",
    "me",
    "my",
    "myself",
    "we",
    "our",
    "ours",
    "ourselves",
    "you",
    "your",
    "yours",
    "yourself",
    "yourselves",
    "he",
    "him",
    "his",
    "himself",
    "she",
    "her",
    "hers",
    "herself",
    "it",
    "its",
    "itself",
    "they",
    "them",
    "their",
    "theirs",
    "themselves",
    "what",
    "which",
    "who",
    "whom",
    "this",
    "that",
    "these",
    "those",
    "am",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "being",
    "have",
    "has",
    "had",
    "having",
    "do",
    "does",
    "did",
    "doing",
    "a",
    "an",
    "the",
    "and",
    "but",
    "if",
    "or",
    "because",
    "as",
    "until",
    "while",
    "of",
    "at",
    "by",
    "for",
    "with",
    "about",
    "against",
    "between",
    "into",
    "through",
    "during",
    "before",
    "after",
    "above",
    "below",
    "to",
    "from",
    "up",
    "down",
    "in",
    "out",
    "on",
    "off",
    "over",
    "under",
    "again",
    "further",
    "then",
    "once",
    "here",
    "there",
    "when",
    "where",
    "why",
    "how",
    "all",
    "any",
    "both",
    "each",
    "few",
    "more",
    "most",
    "other",
    "some",
    "such",
    "no",
    "nor",
    "not",
    "only",
    "own",
    "same",
    "so",
    "than",
    "too",
    "very",
    "s",
    "t",
    "can",
    "will",
    "just",
    "don",
    "should",
    "now",
    "d",
    "ll",
    "m",
    "o",
    "re",
    "ve",
    "y",
];

/// [`analyzer`] for a query's terms, without English function words: in a question they
/// match nearly every memory, and each still adds its (small) idf to whichever memory holds
/// it most. A query made only of them keeps them ([`crate::query::text_terms`]).
pub(crate) fn query_analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(MAX_TOKEN_BYTES))
        .filter(LowerCaser)
        .filter(StopWordFilter::remove(
            QUERY_STOP_WORDS.iter().map(|w| (*w).to_owned()),
        ))
        .filter(Stemmer::new(Language::English))
        .build()
}

pub(crate) fn tokenizers() -> TokenizerManager {
    let manager = TokenizerManager::default();
    manager.register(ANALYZER, analyzer());
    manager
}

/// Handles to the schema's fields; fixed for the life of an index.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fields {
    pub seq: Field,
    pub scope: Field,
    pub layer: Field,
    pub kind: Field,
    pub tags: Field,
    /// Unix nanoseconds, so `since`/`until` filter with the full precision of the event time.
    pub occurred_at: Field,
    pub importance: Field,
    /// Rewritten (the document replaced) when a later event lowers it, so that
    /// `min_confidence` filters in the index, before the top k are cut.
    pub confidence: Field,
    pub text: Field,
    /// A 128-bit blake3 digest of everything [`crate::KeywordIndex::add`] was given, in two
    /// halves; see [`digest`].
    pub digest_hi: Field,
    pub digest_lo: Field,
    /// MessagePack of `(MemoryMeta, text)`: the keyword projector restores its table of hits'
    /// provenance and text from it at start-up, so the index stays its only checkpoint.
    pub memory: Field,
}

pub(crate) const SEQ: &str = "seq";
pub(crate) const DIGEST_HI: &str = "digest_hi";
pub(crate) const DIGEST_LO: &str = "digest_lo";
pub(crate) const MEMORY: &str = "memory";

impl Fields {
    pub fn schema() -> (Schema, Fields) {
        let mut builder = Schema::builder();
        let text_options = TextOptions::default().set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer(ANALYZER)
                // Frequencies for BM25; no positions, as no query here is a phrase query.
                .set_index_option(IndexRecordOption::WithFreqs),
        );
        let fields = Fields {
            seq: builder.add_u64_field(SEQ, INDEXED | FAST | STORED),
            scope: builder.add_text_field("scope", STRING),
            layer: builder.add_text_field("layer", STRING),
            kind: builder.add_text_field("kind", STRING),
            tags: builder.add_text_field("tags", STRING),
            occurred_at: builder.add_i64_field("occurred_at", INDEXED | FAST),
            importance: builder.add_f64_field("importance", INDEXED | FAST),
            confidence: builder.add_f64_field("confidence", INDEXED | FAST),
            text: builder.add_text_field("text", text_options),
            digest_hi: builder.add_u64_field(DIGEST_HI, FAST),
            digest_lo: builder.add_u64_field(DIGEST_LO, FAST),
            memory: builder.add_bytes_field(MEMORY, STORED),
        };
        (builder.build(), fields)
    }

    pub fn document(&self, meta: &MemoryMeta, text: &str) -> TantivyDocument {
        let mut doc = TantivyDocument::default();
        doc.add_u64(self.seq, meta.seq);
        doc.add_text(self.scope, meta.scope.token());
        doc.add_text(self.layer, meta.layer.as_str());
        doc.add_text(self.kind, meta.kind.as_str());
        for tag in &meta.tags {
            doc.add_text(self.tags, tag);
        }
        doc.add_i64(self.occurred_at, unix_nanos(&meta.occurred_at));
        doc.add_f64(self.importance, meta.importance);
        doc.add_f64(self.confidence, meta.confidence);
        doc.add_text(self.text, text);
        let (hi, lo) = digest(meta, text);
        doc.add_u64(self.digest_hi, hi);
        doc.add_u64(self.digest_lo, lo);
        if let Ok(bytes) = rmp_serde::to_vec_named(&(meta, text)) {
            doc.add_bytes(self.memory, &bytes);
        }
        doc
    }
}

/// Nanoseconds since the epoch, saturating outside 1677..2262 (where i64 nanoseconds end);
/// events are validated long before they could be that far off.
pub(crate) fn unix_nanos(at: &chrono::DateTime<chrono::Utc>) -> i64 {
    at.timestamp_nanos_opt().unwrap_or(if at.timestamp() < 0 {
        i64::MIN
    } else {
        i64::MAX
    })
}

/// Digest of one memory as given to `add`, over exactly the fields `state_hash` promises.
///
/// Kept as a fast field instead of storing the text: `state_hash` then reads 16 bytes per
/// document from columnar storage rather than decompressing a document store, and the index
/// does not carry a second copy of every text (the stream already has it). Every variable part
/// is length-prefixed so that no two different memories can feed the hasher the same bytes.
/// 128 bits make an accidental collision between two versions of a memory implausible.
pub(crate) fn digest(meta: &MemoryMeta, text: &str) -> (u64, u64) {
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"engram-keyword/doc/v2");
    hasher.update(&meta.seq.to_le_bytes());
    put_str(&mut hasher, &meta.scope.token());
    put_str(&mut hasher, meta.layer.as_str());
    put_str(&mut hasher, meta.kind.as_str());
    hasher.update(&(meta.tags.len() as u64).to_le_bytes());
    for tag in &meta.tags {
        put_str(&mut hasher, tag);
    }
    // Seconds and subsecond nanoseconds, not `unix_nanos`: exact for any representable time.
    hasher.update(&meta.occurred_at.timestamp().to_le_bytes());
    hasher.update(&meta.occurred_at.timestamp_subsec_nanos().to_le_bytes());
    hasher.update(&meta.importance.to_bits().to_le_bytes());
    hasher.update(&meta.confidence.to_bits().to_le_bytes());
    put_str(&mut hasher, text);
    let bytes = hasher.finalize();
    let bytes = bytes.as_bytes();
    let half = |range: std::ops::Range<usize>| {
        u64::from_le_bytes(bytes[range].try_into().expect("eight bytes"))
    };
    (half(0..8), half(8..16))
}

fn put_str(hasher: &mut blake3::Hasher, value: &str) {
    hasher.update(&(value.len() as u64).to_le_bytes());
    hasher.update(value.as_bytes());
}

/// The term a scope is indexed and matched as: the whole token, case and all.
pub(crate) fn scope_term(fields: &Fields, scope: &ScopeKey) -> tantivy::Term {
    tantivy::Term::from_field_text(fields.scope, &scope.token())
}

pub(crate) fn seq_term(fields: &Fields, seq: Seq) -> tantivy::Term {
    tantivy::Term::from_field_u64(fields.seq, seq)
}

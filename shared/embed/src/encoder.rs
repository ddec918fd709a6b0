//! A BERT encoder's inference pass for the CPU, written so that nearly all of its time is spent
//! in matrix products.
//!
//! candle's `BertModel` (the previous path, still the tests' reference) pads every text of a
//! batch to the longest, allocates and zeroes a fresh tensor for every operation, evaluates
//! GELU's `erf` and softmax's `exp` one scalar libm call at a time, and adds biases and
//! residuals in separate passes. Profiled on agent-length texts, only 45% of its time was
//! GEMM (`docs/benchmarks.md`). Here:
//! - texts are packed, not padded: the dense products run over exactly the batch's real
//!   tokens, and attention runs per text, so no work is spent on padding or masks;
//! - every activation lives in buffers that are allocated once and reused across passes;
//! - a bias is the destination's initial value and the product accumulates onto it; Q, K and
//!   V are one product with concatenated weights;
//! - GELU (exact, with an `erf` accurate to about 1e-7), softmax and layer norm with its
//!   residual are fused loops that the compiler vectorises for the instruction set detected at
//!   run time (`pulp`).
//!
//! The matrix products are the `gemm` crate's, the library candle itself calls, so the
//! roofline's peak (`crate::roofline`) is measured with the same kernels.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::kernel::{self, Precision, Weights};

/// An encoder's weights as plain row-major `f32`, ready for the pass.
pub(crate) struct Encoder {
    hidden: usize,
    heads: usize,
    intermediate: usize,
    eps: f32,
    word: Vec<f32>,
    position: Vec<f32>,
    max_positions: usize,
    /// Row 0 of the token-type table: every token here has type 0.
    token_type: Vec<f32>,
    embed_norm: Norm,
    layers: Vec<Layer>,
    arch: pulp::Arch,
    /// [`Precision::F32`], [`Precision::Bf16`] or [`Precision::Int8`], as resolved for this
    /// CPU at load.
    precision: Precision,
}

struct Layer {
    /// Q, K and V stacked: (3·hidden, hidden).
    qkv: Linear,
    attention_out: Linear,
    attention_norm: Norm,
    up: Linear,
    down: Linear,
    output_norm: Norm,
}

/// A linear layer, its weights in the layout its kernel reads ([`Weights`]).
struct Linear {
    weights: Weights,
    bias: Vec<f32>,
    inputs: usize,
    outputs: usize,
}

struct Norm {
    gain: Vec<f32>,
    bias: Vec<f32>,
}

/// The dimensions [`Encoder::load`] needs from the model's `config.json`.
pub(crate) struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub eps: f64,
}

/// Buffers for one pass, grown to the largest batch seen and then reused.
#[derive(Default)]
pub(crate) struct Scratch {
    x: Vec<f32>,
    qkv: Vec<f32>,
    context: Vec<f32>,
    projected: Vec<f32>,
    inner: Vec<f32>,
    /// A linear layer's input in a narrow kernel's operand layout (bf16 or u8).
    operand: kernel::Operand,
}

impl Scratch {
    fn ensure(&mut self, tokens: usize, hidden: usize, intermediate: usize) {
        let grow = |buffer: &mut Vec<f32>, len: usize| {
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
        };
        grow(&mut self.x, tokens * hidden);
        grow(&mut self.qkv, tokens * 3 * hidden);
        grow(&mut self.context, tokens * hidden);
        grow(&mut self.projected, tokens * hidden);
        grow(&mut self.inner, tokens * intermediate);
    }
}

impl Encoder {
    /// Reads the weights out of a safetensors buffer in the Hugging Face BERT layout, with or
    /// without a `bert.` prefix.
    /// The dense products run in `precision`, which must be resolved for this CPU.
    pub(crate) fn load(
        safetensors: &[u8],
        dims: &Dims,
        precision: Precision,
    ) -> Result<Self, String> {
        assert_ne!(precision, Precision::Auto, "resolve the precision first");
        let tensors = candle_core::safetensors::load_buffer(safetensors, &Device::Cpu)
            .map_err(|e| e.to_string())?;
        let prefix = if tensors.contains_key("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>, String> {
            let key = format!("{prefix}{name}");
            let tensor = tensors
                .get(&key)
                .ok_or_else(|| format!("no tensor {key}"))?;
            if tensor.dims() != shape {
                return Err(format!(
                    "{key} has shape {:?}, expected {shape:?}",
                    tensor.dims()
                ));
            }
            flat(tensor).map_err(|e| format!("{key}: {e}"))
        };
        let (h, f) = (dims.hidden, dims.intermediate);
        if dims.heads == 0 || h % dims.heads != 0 {
            return Err(format!(
                "{} attention heads do not divide the hidden size {h}",
                dims.heads
            ));
        }
        let linear =
            |name: &str, inputs: usize, outputs: usize| -> Result<(Vec<f32>, Vec<f32>), String> {
                Ok((
                    get(&format!("{name}.weight"), &[outputs, inputs])?,
                    get(&format!("{name}.bias"), &[outputs])?,
                ))
            };
        let packed = |(weight, bias): (Vec<f32>, Vec<f32>), inputs: usize| {
            let outputs = bias.len();
            Linear {
                weights: Weights::pack(&weight, inputs, outputs, precision),
                bias,
                inputs,
                outputs,
            }
        };
        let norm = |name: &str| -> Result<Norm, String> {
            Ok(Norm {
                gain: get(&format!("{name}.weight"), &[h])?,
                bias: get(&format!("{name}.bias"), &[h])?,
            })
        };
        let word = tensor_rows(
            &tensors,
            &format!("{prefix}embeddings.word_embeddings.weight"),
            h,
        )?;
        let position = tensor_rows(
            &tensors,
            &format!("{prefix}embeddings.position_embeddings.weight"),
            h,
        )?;
        let token_types = tensor_rows(
            &tensors,
            &format!("{prefix}embeddings.token_type_embeddings.weight"),
            h,
        )?;
        let mut layers = Vec::with_capacity(dims.layers);
        for i in 0..dims.layers {
            let at = |part: &str| format!("encoder.layer.{i}.{part}");
            let (q, k, v) = (
                linear(&at("attention.self.query"), h, h)?,
                linear(&at("attention.self.key"), h, h)?,
                linear(&at("attention.self.value"), h, h)?,
            );
            let qkv = packed(([q.0, k.0, v.0].concat(), [q.1, k.1, v.1].concat()), h);
            layers.push(Layer {
                qkv,
                attention_out: packed(linear(&at("attention.output.dense"), h, h)?, h),
                attention_norm: norm(&at("attention.output.LayerNorm"))?,
                up: packed(linear(&at("intermediate.dense"), h, f)?, h),
                down: packed(linear(&at("output.dense"), f, h)?, f),
                output_norm: norm(&at("output.LayerNorm"))?,
            });
        }
        Ok(Encoder {
            hidden: h,
            heads: dims.heads,
            intermediate: f,
            eps: dims.eps as f32,
            max_positions: position.len() / h,
            word,
            position,
            token_type: token_types[..h].to_vec(),
            embed_norm: norm("embeddings.LayerNorm")?,
            layers,
            arch: pulp::Arch::new(),
            precision,
        })
    }

    /// Token ids past this position have no position embedding.
    pub(crate) fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The dense products' arithmetic, as resolved at load.
    pub(crate) fn precision(&self) -> Precision {
        self.precision
    }

    /// Words in the vocabulary; larger ids are refused.
    pub(crate) fn vocabulary(&self) -> usize {
        self.word.len() / self.hidden
    }

    /// The mean of each text's last hidden states over its tokens (not normalised).
    ///
    /// Every text must be non-empty, no longer than [`Encoder::max_positions`], and hold ids
    /// below [`Encoder::vocabulary`]; the caller's tokenizer guarantees all three.
    pub(crate) fn mean_pooled(&self, texts: &[&[u32]], scratch: &mut Scratch) -> Vec<Vec<f32>> {
        // The whole pass runs on one of rayon's workers. Each step below splits its work
        // across the pool, and from a thread outside it every split is a job handed over and
        // waited for on a futex: for a query's few rows those wake-ups (about fifty a pass)
        // cost as much as the arithmetic. Inside a worker the splits stay with the pool,
        // whose idle threads spin briefly before they sleep.
        if rayon::current_thread_index().is_none() {
            let mut pooled = Vec::new();
            rayon::scope(|_| pooled = self.mean_pooled(texts, scratch));
            return pooled;
        }
        let (h, f) = (self.hidden, self.intermediate);
        let tokens: usize = texts.iter().map(|t| t.len()).sum();
        let lens: Vec<usize> = texts.iter().map(|t| t.len()).collect();
        assert!(lens.iter().all(|&n| n > 0 && n <= self.max_positions));
        scratch.ensure(tokens, h, f);
        let Scratch {
            x,
            qkv,
            context,
            projected,
            inner,
            operand,
        } = scratch;
        let x = &mut x[..tokens * h];
        let qkv = &mut qkv[..tokens * 3 * h];
        let context = &mut context[..tokens * h];
        let projected = &mut projected[..tokens * h];
        let inner = &mut inner[..tokens * f];

        self.embed(texts, x);
        for layer in &self.layers {
            linear(self.arch, x, &layer.qkv, qkv, operand);
            self.attention(qkv, &lens, context);
            linear(self.arch, context, &layer.attention_out, projected, operand);
            self.add_and_norm(projected, &layer.attention_norm, x);
            linear(self.arch, x, &layer.up, inner, operand);
            self.gelu(inner);
            linear(self.arch, inner, &layer.down, projected, operand);
            self.add_and_norm(projected, &layer.output_norm, x);
        }

        let mut pooled = Vec::with_capacity(texts.len());
        let mut row = 0;
        for &n in &lens {
            let mut mean = vec![0f32; h];
            for token in x[row * h..(row + n) * h].chunks_exact(h) {
                for (m, v) in mean.iter_mut().zip(token) {
                    *m += v;
                }
            }
            let scale = 1.0 / n as f32;
            mean.iter_mut().for_each(|m| *m *= scale);
            pooled.push(mean);
            row += n;
        }
        pooled
    }

    /// Word, position and token-type embeddings summed, then normalised.
    fn embed(&self, texts: &[&[u32]], x: &mut [f32]) {
        let h = self.hidden;
        let mut rows = x.chunks_exact_mut(h);
        for text in texts {
            for (position, &id) in text.iter().enumerate() {
                let row = rows.next().expect("one row per token");
                let word = &self.word[id as usize * h..][..h];
                let place = &self.position[position * h..][..h];
                for (((r, w), p), t) in row.iter_mut().zip(word).zip(place).zip(&self.token_type) {
                    *r = w + p + t;
                }
            }
        }
        let norm = &self.embed_norm;
        let eps = self.eps;
        x.par_chunks_mut(h * 64).for_each(|block| {
            self.arch.dispatch(NormRows {
                rows: block,
                add: None,
                norm,
                eps,
            })
        });
    }

    /// Self-attention of each text over its own tokens, every head: `context` gets the
    /// heads' weighted values side by side, as the output projection expects.
    fn attention(&self, qkv: &[f32], lens: &[usize], context: &mut [f32]) {
        let h = self.hidden;
        let d = h / self.heads;
        let scale = 1.0 / (d as f32).sqrt();
        // One short text (a query) would keep one thread busy while the others wait: its
        // heads are split across the pool instead, each group into a buffer of its own.
        if let [n] = *lens
            && n <= FEW_ROWS
            && rayon::current_num_threads() > 1
        {
            let groups = rayon::current_num_threads().min(self.heads);
            let per = self.heads.div_ceil(groups);
            let parts: Vec<(usize, Vec<f32>)> = (0..self.heads)
                .step_by(per)
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|first| {
                    let heads = first..(first + per).min(self.heads);
                    let mut out = vec![0f32; n * heads.len() * d];
                    self.arch.dispatch(ShortAttention {
                        text: qkv,
                        n,
                        hidden: h,
                        head_dim: d,
                        heads: heads.clone(),
                        scale,
                        out: &mut out,
                        out_stride: heads.len() * d,
                    });
                    (first, out)
                })
                .collect();
            for (first, out) in parts {
                let width = out.len() / n;
                for (i, row) in out.chunks_exact(width).enumerate() {
                    context[i * h + first * d..][..width].copy_from_slice(row);
                }
            }
            return;
        }
        // Split the output by text, so that each text's heads run on one thread.
        let mut parts: Vec<(usize, usize, &mut [f32])> = Vec::with_capacity(lens.len());
        let mut rest = context;
        let mut row = 0;
        for &n in lens {
            let (mine, after) = rest.split_at_mut(n * h);
            parts.push((row, n, mine));
            rest = after;
            row += n;
        }
        parts.into_par_iter().for_each(|(row, n, out)| {
            let text = &qkv[row * 3 * h..(row + n) * 3 * h];
            if n <= FEW_ROWS {
                // A short text: plain loops beat `gemm`'s packing and set-up at this size.
                self.arch.dispatch(ShortAttention {
                    text,
                    n,
                    hidden: h,
                    head_dim: d,
                    heads: 0..self.heads,
                    scale,
                    out,
                    out_stride: h,
                });
                return;
            }
            let mut scores = vec![0f32; n * n];
            for head in 0..self.heads {
                let q = &text[head * d..];
                let k = &text[h + head * d..];
                let v = &text[2 * h + head * d..];
                // scores (n×n) = scale · Q (n×d) · Kᵀ (d×n)
                matmul(
                    MatRef::new(q, n, d, 3 * h, 1),
                    MatRef::new(k, d, n, 1, 3 * h),
                    MatMut::new(&mut scores, n, n, n),
                    None,
                    scale,
                    gemm::Parallelism::None,
                );
                self.arch.dispatch(SoftmaxRows {
                    scores: &mut scores,
                    n,
                });
                // out[:, head] (n×d) = P (n×n) · V (n×d)
                matmul(
                    MatRef::new(&scores, n, n, n, 1),
                    MatRef::new(v, n, d, 3 * h, 1),
                    MatMut::new(&mut out[head * d..], n, d, h),
                    None,
                    1.0,
                    gemm::Parallelism::None,
                );
            }
        });
    }

    /// `x = layer_norm(projected + x)`, row by row.
    fn add_and_norm(&self, projected: &[f32], norm: &Norm, x: &mut [f32]) {
        let h = self.hidden;
        let eps = self.eps;
        x.par_chunks_mut(h * 64)
            .zip(projected.par_chunks(h * 64))
            .for_each(|(block, add)| {
                self.arch.dispatch(NormRows {
                    rows: block,
                    add: Some(add),
                    norm,
                    eps,
                })
            });
    }

    fn gelu(&self, values: &mut [f32]) {
        values
            .par_chunks_mut(16 * 1024)
            .for_each(|block| self.arch.dispatch(Gelu(block)));
    }
}

// The element-wise steps below are `WithSimd` types rather than closures passed to
// `Arch::dispatch`: a `with_simd` marked `inline(always)` is compiled into the function built
// for the detected instruction set, where a closure's body stays a separate function compiled
// for the baseline (SSE2): the closures had left softmax, attention's short loops, GELU and
// layer norm scalar, a third of a query's time.

/// `rows = layer_norm(rows + add)`, row by row (without `add`: a plain layer norm).
struct NormRows<'a> {
    rows: &'a mut [f32],
    add: Option<&'a [f32]>,
    norm: &'a Norm,
    eps: f32,
}

impl pulp::WithSimd for NormRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let h = self.norm.gain.len();
        if let Some(add) = self.add {
            for (row, add) in self.rows.chunks_exact_mut(h).zip(add.chunks_exact(h)) {
                for (r, a) in row.iter_mut().zip(add) {
                    *r += a;
                }
            }
        }
        for row in self.rows.chunks_exact_mut(h) {
            layer_norm(row, &self.norm.gain, &self.norm.bias, self.eps);
        }
    }
}

/// GELU of every value.
struct Gelu<'a>(&'a mut [f32]);

impl pulp::WithSimd for Gelu<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        for v in self.0.iter_mut() {
            *v = gelu(*v);
        }
    }
}

/// Softmax of each row of `n` scores.
struct SoftmaxRows<'a> {
    scores: &'a mut [f32],
    n: usize,
}

impl pulp::WithSimd for SoftmaxRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        for row in self.scores.chunks_exact_mut(self.n) {
            softmax(row);
        }
    }
}

/// Self-attention of one short text (`n` tokens of Q, K and V side by side in `text`), every
/// head of `heads`, in plain loops: `out` gets those heads' weighted values side by side,
/// a token's every `out_stride` values.
///
/// A query's scores are one token's dot products with every key. Taken one key at a time,
/// each is a sum across vector lanes, which costs more than its products at a head's 32
/// dimensions; so each head's keys are transposed first (padded with zeros to whole vectors),
/// and a token's scores for [`SCORE_LANES`] keys at once are one vector of running sums.
struct ShortAttention<'a> {
    text: &'a [f32],
    n: usize,
    hidden: usize,
    head_dim: usize,
    heads: std::ops::Range<usize>,
    scale: f32,
    out: &'a mut [f32],
    out_stride: usize,
}

/// Keys scored at once by [`ShortAttention`]: one AVX-512 vector of sums.
const SCORE_LANES: usize = 16;

impl pulp::WithSimd for ShortAttention<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _simd: S) {
        let (n, h, d) = (self.n, self.hidden, self.head_dim);
        let padded = n.next_multiple_of(SCORE_LANES);
        let text = self.text;
        // Kᵀ of one head (d rows of `padded` keys) and one token's scores.
        let mut keys = vec![0f32; d * padded];
        let mut row = vec![0f32; padded];
        for (slot, head) in self.heads.clone().enumerate() {
            let at = |token: usize, part: usize| &text[token * 3 * h + part * h + head * d..][..d];
            for j in 0..n {
                for (c, k) in at(j, 1).iter().enumerate() {
                    keys[c * padded + j] = *k;
                }
            }
            for i in 0..n {
                let q = at(i, 0);
                for (block, scores) in row.chunks_exact_mut(SCORE_LANES).enumerate() {
                    let mut sums = [0f32; SCORE_LANES];
                    for (c, &qc) in q.iter().enumerate() {
                        let k: &[f32; SCORE_LANES] = keys[c * padded + block * SCORE_LANES..]
                            [..SCORE_LANES]
                            .try_into()
                            .expect("a whole block");
                        for l in 0..SCORE_LANES {
                            sums[l] += qc * k[l];
                        }
                    }
                    for (s, sum) in scores.iter_mut().zip(sums) {
                        *s = sum * self.scale;
                    }
                }
                softmax_padded(&mut row, n);
                let probabilities = &row[..n];
                let context = &mut self.out[i * self.out_stride + slot * d..][..d];
                // The weighted values, a vector of sums at a time kept in registers (summed
                // in place, each value's sum was stored and loaded again per key).
                let whole = d - d % SCORE_LANES;
                for (block, out) in context[..whole].chunks_exact_mut(SCORE_LANES).enumerate() {
                    let mut sums = [0f32; SCORE_LANES];
                    for (j, &p) in probabilities.iter().enumerate() {
                        let v: &[f32; SCORE_LANES] = at(j, 2)[block * SCORE_LANES..][..SCORE_LANES]
                            .try_into()
                            .expect("a whole block");
                        for l in 0..SCORE_LANES {
                            sums[l] += p * v[l];
                        }
                    }
                    out.copy_from_slice(&sums);
                }
                for (c, out) in context.iter_mut().enumerate().skip(whole) {
                    *out = probabilities
                        .iter()
                        .enumerate()
                        .map(|(j, p)| p * at(j, 2)[c])
                        .sum();
                }
            }
        }
    }
}

/// A tensor as a flat row-major `f32` vector.
fn flat(tensor: &Tensor) -> candle_core::Result<Vec<f32>> {
    tensor.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

/// A 2-d table with `width` columns, flattened.
fn tensor_rows(
    tensors: &HashMap<String, Tensor>,
    key: &str,
    width: usize,
) -> Result<Vec<f32>, String> {
    let tensor = tensors.get(key).ok_or_else(|| format!("no tensor {key}"))?;
    match tensor.dims() {
        [rows, w] if *w == width && *rows > 0 => flat(tensor).map_err(|e| format!("{key}: {e}")),
        other => Err(format!("{key} has shape {other:?}, expected (_, {width})")),
    }
}

/// Up to this many token rows (a query, a few short texts), the f32 [`linear`] runs
/// [`kernel::few_rows_f32`], which reads each weight once, instead of `gemm`, which packs
/// every weight matrix into freshly allocated panels first: 42 MB of copying per pass that
/// only pays off over many rows. Short texts' attention runs plain loops for the same reason.
const FEW_ROWS: usize = 48;

/// `out = input · weightᵀ + bias` for every row of `input`, by the layer's kernel.
fn linear(
    arch: pulp::Arch,
    input: &[f32],
    layer: &Linear,
    out: &mut [f32],
    operand: &mut kernel::Operand,
) {
    let rows = input.len() / layer.inputs;
    let out = &mut out[..rows * layer.outputs];
    match &layer.weights {
        narrow @ (Weights::Bf16(_) | Weights::Int8(_)) => {
            narrow.apply_narrow(input, layer.inputs, &layer.bias, out, operand);
        }
        Weights::F32(transposed) if rows <= FEW_ROWS => {
            kernel::few_rows_f32(arch, input, layer.inputs, transposed, &layer.bias, out);
        }
        Weights::F32(transposed) => {
            // The bias is the destination's starting value; the product accumulates onto it.
            for row in out.chunks_exact_mut(layer.outputs) {
                row.copy_from_slice(&layer.bias);
            }
            matmul(
                MatRef::new(input, rows, layer.inputs, layer.inputs, 1),
                MatRef::new(transposed, layer.inputs, layer.outputs, layer.outputs, 1),
                MatMut::new(out, rows, layer.outputs, layer.outputs),
                Some(1.0),
                1.0,
                gemm::Parallelism::Rayon(0),
            );
        }
    }
}

/// A read-only strided matrix view, checked to lie inside its slice.
struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatRef<'a> {
    fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        assert!(rows > 0 && cols > 0);
        let last = (rows - 1) * row_stride + (cols - 1) * col_stride;
        assert!(last < data.len(), "matrix view past its slice");
        MatRef {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }
}

/// A writable row-major matrix view (columns contiguous), checked to lie inside its slice.
struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
}

impl<'a> MatMut<'a> {
    fn new(data: &'a mut [f32], rows: usize, cols: usize, row_stride: usize) -> Self {
        assert!(rows > 0 && cols > 0 && cols <= row_stride);
        assert!(
            (rows - 1) * row_stride + cols <= data.len(),
            "matrix view past its slice"
        );
        MatMut {
            data,
            rows,
            cols,
            row_stride,
        }
    }
}

/// `out = keep·out + scale·(a · b)` when `keep` is given, else `out = scale·(a · b)`.
fn matmul(
    a: MatRef<'_>,
    b: MatRef<'_>,
    out: MatMut<'_>,
    keep: Option<f32>,
    scale: f32,
    parallelism: gemm::Parallelism,
) {
    assert_eq!(a.cols, b.rows, "inner dimensions differ");
    assert_eq!((out.rows, out.cols), (a.rows, b.cols), "output shape");
    // SAFETY: the three views were checked at construction to lie inside their slices for the
    // strides given, the shapes agree (asserted above), `out` is borrowed mutably so it
    // aliases neither input, and `gemm` reads and writes nothing outside those views.
    unsafe {
        gemm::gemm(
            out.rows,
            out.cols,
            a.cols,
            out.data.as_mut_ptr(),
            1,
            out.row_stride as isize,
            keep.is_some(),
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            keep.unwrap_or(0.0),
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Layer norm of one row in place: two passes, mean then variance, as the reference does.
#[inline(always)]
fn layer_norm(row: &mut [f32], gain: &[f32], bias: &[f32], eps: f32) {
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, g), b) in row.iter_mut().zip(gain).zip(bias) {
        *v = (*v - mean) * inv * g + b;
    }
}

/// Softmax of one row in place.
#[inline(always)]
fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Two loops: the exponentials vectorise only without the running sum beside them (a
    // float sum cannot be reordered into lanes).
    for v in row.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = 1.0 / row.iter().sum::<f32>();
    row.iter_mut().for_each(|v| *v *= inv);
}

/// [`softmax`] of `row[..n]` in whole blocks of [`SCORE_LANES`] (`row`'s length is a
/// multiple of it): a short row would otherwise fall wholly to the scalar remainder of each
/// vectorised loop. The padding ends as zeros.
#[inline(always)]
fn softmax_padded(row: &mut [f32], n: usize) {
    row[n..].fill(f32::NEG_INFINITY);
    let mut max = [f32::NEG_INFINITY; SCORE_LANES];
    for block in row.chunks_exact(SCORE_LANES) {
        for l in 0..SCORE_LANES {
            max[l] = max[l].max(block[l]);
        }
    }
    let max = max.into_iter().fold(f32::NEG_INFINITY, f32::max);
    let mut sums = [0f32; SCORE_LANES];
    for v in row.iter_mut() {
        // `exp` clamps below -87, so the padding's -inf gives a value under 1e-37, and is
        // set to zero after.
        *v = exp(*v - max);
    }
    row[n..].fill(0.0);
    for block in row.chunks_exact(SCORE_LANES) {
        for l in 0..SCORE_LANES {
            sums[l] += block[l];
        }
    }
    let inv = 1.0 / sums.iter().sum::<f32>();
    row.iter_mut().for_each(|v| *v *= inv);
}

/// `eˣ` without a libm call, so that loops over it vectorise: `2ⁿ · eʳ` with `n` the nearest
/// integer to `x / ln 2` and `eʳ` (|r| ≤ ln2/2) from its degree-7 Taylor polynomial, relative
/// error under 2e-7. Inputs below -87 give 0 (or close to it); above 88, a large finite value.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two, so that n·ln2 subtracts exactly for the n that occur.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5·2²³ rounds to the nearest integer with no rounding call.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// GELU as BERT defines it, `x · Φ(x) = x/2 · (1 + erf(x/√2))`, with `erf` from Abramowitz
/// and Stegun 7.1.26 (absolute error under 1.5e-7) over the vectorisable [`exp`].
#[inline(always)]
fn gelu(x: f32) -> f32 {
    let z = x * std::f32::consts::FRAC_1_SQRT_2;
    let a = z.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152 + t * 1.061_405_4))));
    let erf_abs = 1.0 - poly * exp(-a * a);
    let erf = erf_abs.copysign(z);
    0.5 * x * (1.0 + erf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn erf_reference(x: f64) -> f64 {
        // The Maclaurin series, summed in f64: for |x| ≤ 4.3 its largest term is under 1e8, so
        // cancellation costs under 1e-8, well inside what the check allows.
        assert!(x.abs() <= 4.3);
        let mut sum = 0.0;
        let mut term = x;
        for n in 0..200 {
            sum += term / (2 * n + 1) as f64;
            term *= -x * x / (n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn exp_is_accurate_over_the_range_softmax_sees() {
        let mut worst = 0f64;
        for i in 0..=20_000 {
            let x = -87.0 + 175.0 * i as f64 / 20_000.0;
            let got = exp(x as f32) as f64;
            // The reference at the f32 input, so that only exp's own error is measured.
            let want = (x as f32 as f64).exp();
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn gelu_matches_the_exact_definition() {
        let mut worst = 0f64;
        for i in 0..=20_000 {
            let x = (-6.0 + 12.0 * i as f64 / 20_000.0) as f32 as f64;
            let want = 0.5 * x * (1.0 + erf_reference(x / std::f64::consts::SQRT_2));
            let got = gelu(x as f32) as f64;
            worst = worst.max((got - want).abs());
        }
        assert!(worst < 1e-6, "absolute error {worst}");
        // Past ±6, erfc(x/√2) < 2e-9: GELU is x or 0 to well within f32's precision.
        for x in [6.5f32, 9.0, 12.0, 40.0] {
            assert!((gelu(x) - x).abs() <= x * 1e-6, "{x}");
            assert!(gelu(-x).abs() < 1e-6, "{}", -x);
        }
        assert_eq!(gelu(0.0), 0.0);
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut row = vec![1.0, 3.0, -2.0, 3.0, 0.5, -1e9];
        softmax(&mut row);
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(row[1] > row[0] && row[0] > row[4] && row[4] > row[2]);
        assert_eq!(row[1], row[3]);
        assert!(row[5] < 1e-30);
    }

    #[test]
    fn matmul_with_strides_and_accumulation() {
        // a (2×3) row-major, b (3×2) given as the transpose of a (2×3) row-major weight.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0];
        let mut out = [10.0, 20.0, 30.0, 40.0];
        matmul(
            MatRef::new(&a, 2, 3, 3, 1),
            MatRef::new(&w, 3, 2, 1, 3),
            MatMut::new(&mut out, 2, 2, 2),
            Some(1.0),
            2.0,
            gemm::Parallelism::None,
        );
        assert_eq!(out, [10.0 + 8.0, 20.0 + 4.0, 30.0 + 20.0, 40.0 + 10.0]);
    }

    #[test]
    #[should_panic(expected = "past its slice")]
    fn a_view_past_its_slice_is_refused() {
        let a = [0.0; 5];
        let _ = MatRef::new(&a, 2, 3, 3, 1);
    }
}

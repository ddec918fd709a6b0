//! The products of a linear layer, `out = x · Wᵀ + b`, in the precision the CPU does best.
//!
//! - **bf16** (x86-64 with AVX-512 BF16, detected at run time): the weights are rounded to
//!   bf16 once, at load, and packed in tiles of [`TILE`] output columns; each pass rounds its
//!   activations to bf16 too, and `vdpbf16ps` multiplies pairs of them into f32 accumulators.
//!   Twice the multiply-adds of an f32 FMA per instruction, and half the bytes of weights to
//!   stream, which is what a query's few rows are bound by. No library the encoder could call
//!   has this kernel: `gemm` (candle's) widens bf16 to f32 and multiplies in f32.
//! - **int8** (x86-64 with AVX-512 VNNI, or AVX2, and no BF16, detected at run time): the weights are
//!   rounded to int8 once, at load, one scale per output column, and packed in the same tiles;
//!   each pass rounds every activation row to u8 with a scale and zero point of its own (the
//!   row's range, so a token's outlier costs only its own row precision), and `vpdpbusd`
//!   multiplies groups of four into i32 sums, corrected for the zero point and scaled to f32
//!   once, at the store. Four times the multiply-adds of an f32 FMA per instruction and a
//!   quarter of the weights' bytes. Lossy beyond bf16: its recall is measured, not assumed.
//!   Without VNNI, AVX2 does the same with `vpmaddubsw` and `vpmaddwd` (three instructions
//!   for VNNI's one, still half the multiply instructions of f32 FMAs per product), on
//!   activations of 7 bits in groups of 32, so that no pair of products saturates i16.
//! - **f32** everywhere else: `gemm` for many rows, and for a few rows (a query) a kernel that
//!   reads each weight once and keeps its sums in registers, where `gemm` would first pack
//!   every weight matrix into fresh panels (42 MB of copying per pass).
//!
//! Both kernels compute a tile of up to [`MR`] rows × [`TILE`] columns with the sums in
//! registers from the bias to the store: no horizontal reductions, no partial results in
//! memory.

use rayon::prelude::*;

/// Output columns per tile: two 512-bit vectors of f32.
pub(crate) const TILE: usize = 32;

/// Rows per tile of the bf16 kernel: 8 rows × 2 vectors = 16 accumulators, enough in flight
/// to cover `vdpbf16ps`'s latency, with registers to spare for the weights.
const MR: usize = 8;

/// Rows per tile of the f32 few-rows kernel: 4 rows × 32 columns fit the 16 registers of
/// AVX2 as well as AVX-512's 32.
const MR_F32: usize = 4;

/// Rows per task of the bf16 kernel when there are many: the block's activations (up to
/// 128 × 1536 bf16 = 384 KiB) stay in L2 while every weight tile passes over them.
const ROW_BLOCK: usize = 128;

/// The arithmetic of the encoder's dense products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// bf16 products where the CPU has AVX-512 BF16, else int8 where it has AVX-512 VNNI or
    /// AVX2 and FMA, else f32.
    #[default]
    Auto,
    /// f32 throughout: the reference arithmetic, on every CPU.
    F32,
    /// bf16 products with f32 sums; refused on a CPU without AVX-512 BF16.
    Bf16,
    /// int8 weights, u8 activations quantised per row and group, i32 sums; refused on a CPU
    /// without AVX-512 VNNI or AVX2 and FMA.
    Int8,
}

impl Precision {
    /// Whether this CPU runs the bf16 kernel.
    pub fn bf16_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Whether this CPU runs an int8 kernel (AVX-512 VNNI, or AVX2 and FMA).
    pub fn int8_available() -> bool {
        Int8Isa::detect().is_some()
    }

    /// What `self` comes to on this CPU: [`Precision::F32`], [`Precision::Bf16`] or
    /// [`Precision::Int8`]; `Err` for a narrow precision asked of a CPU without it.
    ///
    /// `auto` prefers bf16 to int8 where a CPU has both: bf16 is the less lossy of the two,
    /// and the one measured on such a CPU.
    pub fn resolve(self) -> Result<Precision, String> {
        match self {
            Precision::Auto if Self::bf16_available() => Ok(Precision::Bf16),
            Precision::Auto if Self::int8_available() => Ok(Precision::Int8),
            Precision::Auto | Precision::F32 => Ok(Precision::F32),
            Precision::Bf16 if Self::bf16_available() => Ok(Precision::Bf16),
            Precision::Bf16 => Err(
                "precision bf16 needs a CPU with AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo); \
                 set precision to \"auto\" or \"f32\""
                    .into(),
            ),
            Precision::Int8 if Self::int8_available() => Ok(Precision::Int8),
            Precision::Int8 => Err(
                "precision int8 needs a CPU with AVX-512 VNNI or AVX2 and FMA (avx512_vnni, or \
                 avx2 and fma, in /proc/cpuinfo); set precision to \"auto\" or \"f32\""
                    .into(),
            ),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Auto => "auto",
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
        }
    }
}

/// The instructions an int8 kernel runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int8Isa {
    /// AVX-512 VNNI: `vpdpbusd` multiplies u8 by i8 in quads into i32 sums.
    Vnni,
    /// AVX2: `vpmaddubsw` multiplies u8 by i8 into pairs summed in i16, saturating, and
    /// `vpmaddwd` sums the pairs into i32. A pair of 255 × 127 would overflow i16, so the
    /// activations take 7 bits (0..=127): 2 × 127 × 127 fits.
    Avx2,
}

impl Int8Isa {
    /// The int8 kernel this CPU runs, VNNI first; `None` without AVX2 and FMA either.
    pub(crate) fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vnni")
            {
                return Some(Int8Isa::Vnni);
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Some(Int8Isa::Avx2);
            }
        }
        None
    }

    /// The largest activation value of this kernel's operand.
    fn top(self) -> i32 {
        match self {
            Int8Isa::Vnni => 255,
            Int8Isa::Avx2 => 127,
        }
    }
}

/// A linear layer's weights as a kernel reads them.
pub(crate) enum Weights {
    /// f32, transposed: (inputs, outputs) row-major, which `gemm` reads as the right-hand
    /// matrix and the few-rows kernel as rows of output columns.
    F32(Vec<f32>),
    /// bf16 in tiles: tile `t` (outputs `t·TILE..`) holds, for each pair `q` of inputs, TILE
    /// `u32`s whose lane `j` is `bf16(W[t·TILE + j][2q]) | bf16(W[t·TILE + j][2q + 1]) << 16`,
    /// the operand layout of `vdpbf16ps`.
    Bf16(Vec<u32>),
    /// int8 in the same tiles: for each quad `q` of inputs, TILE `u32`s whose lane `j` holds
    /// the four bytes `round(W[t·TILE + j][4q + b] / scale[t·TILE + j])`, `b` = 0..4 from the
    /// low byte up, the operand layout of `vpdpbusd`.
    Int8(Int8Weights),
}

/// A layer's weights for the int8 kernel.
pub(crate) struct Int8Weights {
    packed: Vec<u32>,
    /// Per output: the factor from its int8 weights back to f32 (its largest |weight| / 127).
    scale: Vec<f32>,
    /// Per group of [`group()`] inputs and output (group-major): the sum of the group's int8
    /// weights, to take the activations' zero point out of the sums.
    sums: Vec<f32>,
}

/// Inputs per group of the int8 kernel's activations: each token row is rounded to u8 in
/// groups of this many inputs, each with a scale and zero point of its own. BERT's hidden
/// states have a few dimensions far larger than the rest; rounded by the whole row's range,
/// they would leave every other value a handful of steps. In groups, an outlier coarsens
/// only its own group (per-embedding-group quantisation, Bondarenko et al. 2021). AVX2's
/// 7-bit activations take groups half as long, which hold MiniLM's vectors as near f32's as
/// VNNI's 8 bits in groups of 64 do (measured: the empty text 0.9907 in groups of 64,
/// 0.9947 in 32, at no measurable cost in speed).
const GROUP_VNNI: usize = 64;
const GROUP_AVX2: usize = 32;

/// The int8 kernel's group on this CPU (one per process: the CPU does not change).
pub(crate) fn group() -> usize {
    match Int8Isa::detect() {
        Some(Int8Isa::Avx2) => GROUP_AVX2,
        _ => GROUP_VNNI,
    }
}

/// Rows per tile of the int8 kernel: 6 rows × 2 vectors of i32 sums for the group under way
/// and as many of f32 for the groups done, 24 registers of AVX-512's 32.
const MR_INT8: usize = 6;

/// Rows per tile of the AVX2 int8 kernel: 2 rows × 4 vectors of i32 sums, 2 broadcast
/// activations, a weight vector, the ones and a product: 13 of AVX2's 16 registers. The f32
/// sums of the groups done live in memory, touched once a group.
const MR_INT8_AVX2: usize = 2;

impl Weights {
    /// `weight` (outputs × inputs, row-major, as stored) in the layout of `precision`, which
    /// must be resolved. bf16 needs an even input count, int8 whole groups of [`group()`], and
    /// both whole tiles of outputs; a layer without them stays f32.
    pub(crate) fn pack(
        weight: &[f32],
        inputs: usize,
        outputs: usize,
        precision: Precision,
    ) -> Self {
        assert_eq!(weight.len(), inputs * outputs);
        if precision == Precision::Bf16 && inputs.is_multiple_of(2) && outputs.is_multiple_of(TILE)
        {
            let pairs = inputs / 2;
            let mut packed = vec![0u32; outputs * pairs];
            for (t, tile) in packed.chunks_exact_mut(pairs * TILE).enumerate() {
                for (q, lanes) in tile.chunks_exact_mut(TILE).enumerate() {
                    for (j, lane) in lanes.iter_mut().enumerate() {
                        let row = &weight[(t * TILE + j) * inputs..][..inputs];
                        *lane =
                            bf16_bits(row[2 * q]) as u32 | (bf16_bits(row[2 * q + 1]) as u32) << 16;
                    }
                }
            }
            return Weights::Bf16(packed);
        }
        let group = group();
        if precision == Precision::Int8
            && inputs.is_multiple_of(group)
            && outputs.is_multiple_of(TILE)
        {
            let quads = inputs / 4;
            let mut quantised = vec![0i8; outputs * inputs];
            let mut scale = vec![0f32; outputs];
            let mut sums = vec![0f32; outputs * (inputs / group)];
            for (o, row) in weight.chunks_exact(inputs).enumerate() {
                let largest = row.iter().fold(0f32, |m, w| m.max(w.abs()));
                scale[o] = if largest > 0.0 { largest / 127.0 } else { 1.0 };
                for (i, (q, w)) in quantised[o * inputs..][..inputs]
                    .iter_mut()
                    .zip(row)
                    .enumerate()
                {
                    *q = (w / scale[o]).round().clamp(-127.0, 127.0) as i8;
                    sums[i / group * outputs + o] += *q as f32;
                }
            }
            let mut packed = vec![0u32; outputs * quads];
            for (t, tile) in packed.chunks_exact_mut(quads * TILE).enumerate() {
                for (q, lanes) in tile.chunks_exact_mut(TILE).enumerate() {
                    for (j, lane) in lanes.iter_mut().enumerate() {
                        let b = &quantised[(t * TILE + j) * inputs + 4 * q..][..4];
                        *lane =
                            u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]);
                    }
                }
            }
            return Weights::Int8(Int8Weights {
                packed,
                scale,
                sums,
            });
        }
        let mut transposed = vec![0f32; inputs * outputs];
        for (o, row) in weight.chunks_exact(inputs).enumerate() {
            for (i, w) in row.iter().enumerate() {
                transposed[i * outputs + o] = *w;
            }
        }
        Weights::F32(transposed)
    }
}

/// `x` rounded to bf16 (to nearest, ties to even), as `vcvtneps2bf16` rounds; NaN stays NaN.
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// A linear layer's input in a narrow kernel's operand layout: buffers grown to the largest
/// pass seen and then reused.
#[derive(Default)]
pub(crate) struct Operand {
    /// bf16 pairs or u8 quads, one row after another.
    words: Vec<u32>,
    /// int8: per row and group of [`group()`] inputs, the factor from its u8 values back to
    /// f32.
    scale: Vec<f32>,
    /// int8: per row and group, the u8 value that stands for 0.
    zero: Vec<i32>,
}

impl Operand {
    fn grow(&mut self, rows: usize, words_per_row: usize, groups_per_row: usize) {
        if self.words.len() < rows * words_per_row {
            self.words.resize(rows * words_per_row, 0);
        }
        if self.scale.len() < rows * groups_per_row {
            self.scale.resize(rows * groups_per_row, 0.0);
            self.zero.resize(rows * groups_per_row, 0);
        }
    }
}

impl Weights {
    /// `out = x · Wᵀ + bias` through the narrow kernel these weights were packed for.
    ///
    /// # Panics
    /// On [`Weights::F32`], which the encoder multiplies itself (`gemm` or
    /// [`few_rows_f32`]).
    pub(crate) fn apply_narrow(
        &self,
        x: &[f32],
        inputs: usize,
        bias: &[f32],
        out: &mut [f32],
        operand: &mut Operand,
    ) {
        match self {
            Weights::Bf16(packed) => linear_bf16(x, inputs, packed, bias, out, operand),
            Weights::Int8(weights) => linear_int8(x, inputs, weights, bias, out, operand),
            Weights::F32(_) => panic!("f32 weights have no narrow kernel"),
        }
    }
}

/// Calls `tile(first_row, rows, t, out, stride)` for every tile `t` of the `n` outputs of
/// `rows` rows, row `first_row + r` going to `out[r·stride..][..TILE]`, and the results in
/// `out` (rows of `n`). Few rows split by tiles: the weights are what costs. Many split by
/// blocks of [`ROW_BLOCK`] rows, whose operand stays in L2 while every tile passes over it.
fn for_each_tile<F>(rows: usize, n: usize, out: &mut [f32], tile: F)
where
    F: Fn(usize, usize, usize, &mut [f32], usize) + Sync,
{
    let tiles = n / TILE;
    if rows <= ROW_BLOCK {
        let blocks: Vec<Vec<f32>> = (0..tiles)
            .into_par_iter()
            .map(|t| {
                let mut block = vec![0f32; rows * TILE];
                tile(0, rows, t, &mut block, TILE);
                block
            })
            .collect();
        for (t, block) in blocks.iter().enumerate() {
            for (r, values) in block.chunks_exact(TILE).enumerate() {
                out[r * n + t * TILE..][..TILE].copy_from_slice(values);
            }
        }
        return;
    }
    out[..rows * n]
        .par_chunks_mut(ROW_BLOCK * n)
        .enumerate()
        .for_each(|(b, out)| {
            let m = out.len() / n;
            for t in 0..tiles {
                tile(b * ROW_BLOCK, m, t, &mut out[t * TILE..], n);
            }
        });
}

/// `out = x · Wᵀ + bias` through the bf16 kernel, `x` being rows of `inputs` values and
/// `packed` [`Weights::Bf16`]. `operand` is scratch for the activations in bf16.
pub(crate) fn linear_bf16(
    x: &[f32],
    inputs: usize,
    packed: &[u32],
    bias: &[f32],
    out: &mut [f32],
    operand: &mut Operand,
) {
    let n = bias.len();
    let rows = x.len() / inputs;
    let kp = inputs / 2;
    assert!(inputs.is_multiple_of(2) && n.is_multiple_of(TILE) && x.len() == rows * inputs);
    assert_eq!(packed.len(), n * kp, "packed weights of another shape");
    assert!(out.len() >= rows * n, "output too short");
    if rows == 0 {
        return;
    }
    operand.grow(rows, kp, 0);
    let pairs = &mut operand.words[..rows * kp];
    pairs
        .par_chunks_mut(ROW_BLOCK * kp)
        .zip(x.par_chunks(ROW_BLOCK * inputs))
        .for_each(|(to, from)| to_bf16_pairs(from, to));
    let pairs = &*pairs;
    for_each_tile(rows, n, out, |first, m, t, out, stride| {
        rows_bf16(
            &pairs[first * kp..(first + m) * kp],
            kp,
            &packed[t * kp * TILE..][..kp * TILE],
            &bias[t * TILE..][..TILE],
            out,
            stride,
        )
    });
}

/// `out = x · Wᵀ + bias` through the int8 kernel, `x` being rows of `inputs` values and `w`
/// [`Weights::Int8`]. `operand` is scratch for the activations in u8.
pub(crate) fn linear_int8(
    x: &[f32],
    inputs: usize,
    w: &Int8Weights,
    bias: &[f32],
    out: &mut [f32],
    operand: &mut Operand,
) {
    let n = bias.len();
    let rows = x.len() / inputs;
    let kq = inputs / 4;
    let group = group();
    let groups = inputs / group;
    assert!(inputs.is_multiple_of(group) && n.is_multiple_of(TILE) && x.len() == rows * inputs);
    assert!(
        w.packed.len() == n * kq && w.scale.len() == n && w.sums.len() == n * groups,
        "packed weights of another shape"
    );
    assert!(out.len() >= rows * n, "output too short");
    if rows == 0 {
        return;
    }
    operand.grow(rows, kq, groups);
    let quads = &mut operand.words[..rows * kq];
    let scale = &mut operand.scale[..rows * groups];
    let zero = &mut operand.zero[..rows * groups];
    quads
        .par_chunks_mut(ROW_BLOCK * kq)
        .zip(scale.par_chunks_mut(ROW_BLOCK * groups))
        .zip(zero.par_chunks_mut(ROW_BLOCK * groups))
        .zip(x.par_chunks(ROW_BLOCK * inputs))
        .for_each(|(((to, scale), zero), from)| {
            for (((to, scale), zero), from) in to
                .chunks_exact_mut(group / 4)
                .zip(scale)
                .zip(zero)
                .zip(from.chunks_exact(group))
            {
                (*scale, *zero) = quantise_group(from, to);
            }
        });
    let (quads, scale, zero) = (&*quads, &*scale, &*zero);
    for_each_tile(rows, n, out, |first, m, t, out, stride| {
        let columns = t * TILE..(t + 1) * TILE;
        rows_int8(
            RowsInt8 {
                x: &quads[first * kq..(first + m) * kq],
                scale: &scale[first * groups..(first + m) * groups],
                zero: &zero[first * groups..(first + m) * groups],
            },
            kq,
            &w.packed[t * kq * TILE..][..kq * TILE],
            ColumnsInt8 {
                scale: &w.scale[columns.clone()],
                sums: &w.sums[t * TILE..],
                stride: n,
                bias: &bias[columns],
            },
            out,
            stride,
        )
    });
}

/// The scale and zero point that map `[lo, hi]` (which holds 0) onto `0..=top`.
fn group_quantiser(lo: f32, hi: f32, top: i32) -> (f32, i32) {
    let scale = (hi - lo) / top as f32;
    if !(scale > 0.0 && scale.is_finite()) {
        // An all-zero group (any scale represents it exactly), or a non-finite one.
        return (1.0, 0);
    }
    let zero = (-lo / scale).round_ties_even().clamp(0.0, top as f32) as i32;
    (scale, zero)
}

/// [`group_quantiser`] of the range in a vector quantiser's lanes of minima and maxima.
fn lanes_quantiser(lo: &[f32], hi: &[f32], top: i32) -> (f32, i32) {
    let lo = lo.iter().fold(0f32, |m, v| m.min(*v));
    let hi = hi.iter().fold(0f32, |m, v| m.max(*v));
    group_quantiser(lo, hi, top)
}

/// One group of f32 rounded to u8 in quads (`to` holds `x.len() / 4` of them, the first
/// input in the low byte), by its own range onto the int8 kernel's `0..=top`: returns the
/// scale and the zero point, so that `x[i] ≈ scale · (u8[i] − zero)`.
fn quantise_group(x: &[f32], to: &mut [u32]) -> (f32, i32) {
    assert_eq!(x.len(), to.len() * 4);
    let isa = Int8Isa::detect();
    #[cfg(target_arch = "x86_64")]
    match isa {
        Some(Int8Isa::Vnni) if x.len().is_multiple_of(16) => {
            // SAFETY: the CPU has AVX-512F (VNNI's detection checked it) and the group is
            // whole vectors; `to` holds a byte for every value, as asserted.
            return unsafe { quantise_group_avx512(x, pulp::bytemuck::cast_slice_mut(to)) };
        }
        Some(Int8Isa::Avx2) if x.len().is_multiple_of(32) => {
            // SAFETY: the CPU has AVX2 and the group is whole blocks of 32; `to` holds a
            // byte for every value, as asserted.
            return unsafe { quantise_group_avx2(x, pulp::bytemuck::cast_slice_mut(to)) };
        }
        _ => {}
    }
    let top = isa.map_or(255, Int8Isa::top);
    let (lo, hi) = x
        .iter()
        .fold((0f32, 0f32), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    let (scale, zero) = group_quantiser(lo, hi, top);
    let bytes: &mut [u8] = pulp::bytemuck::cast_slice_mut(to);
    for (b, v) in bytes.iter_mut().zip(x) {
        *b = ((v / scale).round_ties_even() as i32 + zero).clamp(0, top) as u8;
    }
    (scale, zero)
}

/// [`quantise_group`] onto 0..=127 for the AVX2 kernel.
///
/// # Safety
/// The CPU has AVX2; `x.len()` is a multiple of 32 and `to.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantise_group_avx2(x: &[f32], to: &mut [u8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    debug_assert!(x.len().is_multiple_of(32) && x.len() == to.len());
    // SAFETY: every step reads 32 values at `i` and writes 32 bytes at `i` (or 8 values for
    // the range), inside both slices by the caller's promise.
    unsafe {
        let mut lo = _mm256_setzero_ps();
        let mut hi = _mm256_setzero_ps();
        for i in (0..x.len()).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            lo = _mm256_min_ps(lo, v);
            hi = _mm256_max_ps(hi, v);
        }
        let (mut lanes_lo, mut lanes_hi) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(lanes_lo.as_mut_ptr(), lo);
        _mm256_storeu_ps(lanes_hi.as_mut_ptr(), hi);
        let (scale, zero) = lanes_quantiser(&lanes_lo, &lanes_hi, Int8Isa::Avx2.top());
        // A division per value, as the scalar path does (see the AVX-512 quantiser).
        let divisor = _mm256_set1_ps(scale);
        let offset = _mm256_set1_epi32(zero);
        let (floor, ceiling) = (
            _mm256_setzero_si256(),
            _mm256_set1_epi32(Int8Isa::Avx2.top()),
        );
        // The packs work within 128-bit lanes: this puts the 4-byte groups back in order.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for i in (0..x.len()).step_by(32) {
            let q: [__m256i; 4] = std::array::from_fn(|v| {
                let f = _mm256_div_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8 * v)), divisor);
                let q = _mm256_add_epi32(_mm256_cvtps_epi32(f), offset);
                _mm256_min_epi32(_mm256_max_epi32(q, floor), ceiling)
            });
            let words = (
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let bytes = _mm256_packus_epi16(words.0, words.1);
            _mm256_storeu_si256(
                to.as_mut_ptr().add(i) as *mut __m256i,
                _mm256_permutevar8x32_epi32(bytes, order),
            );
        }
        (scale, zero)
    }
}

/// # Safety
/// The CPU has AVX-512F; `x.len()` is a multiple of 16 and `to.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantise_group_avx512(x: &[f32], to: &mut [u8]) -> (f32, i32) {
    use std::arch::x86_64::*;
    debug_assert!(x.len().is_multiple_of(16) && x.len() == to.len());
    // SAFETY: every step reads 16 values at `i` and writes 16 bytes at `i`, inside both
    // slices by the caller's promise.
    unsafe {
        let mut lo = _mm512_setzero_ps();
        let mut hi = _mm512_setzero_ps();
        for i in (0..x.len()).step_by(16) {
            let v = _mm512_loadu_ps(x.as_ptr().add(i));
            lo = _mm512_min_ps(lo, v);
            hi = _mm512_max_ps(hi, v);
        }
        let (mut lanes_lo, mut lanes_hi) = ([0f32; 16], [0f32; 16]);
        _mm512_storeu_ps(lanes_lo.as_mut_ptr(), lo);
        _mm512_storeu_ps(lanes_hi.as_mut_ptr(), hi);
        let (scale, zero) = lanes_quantiser(&lanes_lo, &lanes_hi, Int8Isa::Vnni.top());
        // A division per value, as the scalar path does: a reciprocal would round a value
        // that sits on a half step the other way.
        let divisor = _mm512_set1_ps(scale);
        let offset = _mm512_set1_epi32(zero);
        let floor = _mm512_setzero_si512();
        for i in (0..x.len()).step_by(16) {
            let v = _mm512_div_ps(_mm512_loadu_ps(x.as_ptr().add(i)), divisor);
            // Rounded to nearest even (the default rounding mode), shifted by the zero point,
            // and held to 0..=255 (the conversion saturates above 255).
            let q = _mm512_max_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(v), offset), floor);
            _mm_storeu_si128(
                to.as_mut_ptr().add(i) as *mut __m128i,
                _mm512_cvtusepi32_epi8(q),
            );
        }
        (scale, zero)
    }
}

/// Rows of the int8 kernel's operand: u8 quads, and each row's scales and zero points, a
/// pair per group.
#[derive(Clone, Copy)]
struct RowsInt8<'a> {
    x: &'a [u32],
    scale: &'a [f32],
    zero: &'a [i32],
}

/// A tile's columns for the int8 kernel: weight scales, the int8 weights' sums per group
/// (the group's `TILE` sums at `sums[g·stride..]`) and bias.
#[derive(Clone, Copy)]
struct ColumnsInt8<'a> {
    scale: &'a [f32],
    sums: &'a [f32],
    stride: usize,
    bias: &'a [f32],
}

/// One tile of columns for every row of `rows`: row `r` goes to `out[r·stride..][..TILE]`.
fn rows_int8(
    rows: RowsInt8,
    kq: usize,
    w: &[u32],
    columns: ColumnsInt8,
    out: &mut [f32],
    stride: usize,
) {
    let group_quads = group() / 4;
    let groups = kq / group_quads;
    let count = rows.x.len() / kq;
    assert!(kq.is_multiple_of(group_quads) && rows.x.len() == count * kq);
    assert!(rows.scale.len() == count * groups && rows.zero.len() == count * groups);
    assert!(w.len() == kq * TILE);
    assert!(columns.scale.len() == TILE && columns.bias.len() == TILE);
    assert!(groups == 0 || (groups - 1) * columns.stride + TILE <= columns.sums.len());
    assert!(
        count == 0 || (count - 1) * stride + TILE <= out.len(),
        "output too short"
    );
    let isa = Int8Isa::detect();
    let mr = match isa {
        Some(Int8Isa::Avx2) => MR_INT8_AVX2,
        _ => MR_INT8,
    };
    let mut r = 0;
    while r < count {
        let m = (count - r).min(mr);
        let part = RowsInt8 {
            x: &rows.x[r * kq..(r + m) * kq],
            scale: &rows.scale[r * groups..(r + m) * groups],
            zero: &rows.zero[r * groups..(r + m) * groups],
        };
        let o = &mut out[r * stride..];
        // SAFETY: the kernel called is the one this CPU has, as detected (`Weights::Int8`
        // exists only where `Precision::resolve` found one); the slices hold `m` rows of
        // `kq` quads with a scale and zero point per group, `kq` tiles of weights, a tile of
        // column values (per group for the sums), and `m` output rows of `stride` (the last
        // one a tile long), as asserted above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match (isa, m) {
                (Some(Int8Isa::Avx2), 2) => tile_int8_avx2::<2>(part, kq, w, columns, o, stride),
                (Some(Int8Isa::Avx2), _) => tile_int8_avx2::<1>(part, kq, w, columns, o, stride),
                (None, _) => unreachable!("int8 weights exist only on a CPU with a kernel"),
                (_, 6) => tile_int8::<6>(part, kq, w, columns, o, stride),
                (_, 5) => tile_int8::<5>(part, kq, w, columns, o, stride),
                (_, 4) => tile_int8::<4>(part, kq, w, columns, o, stride),
                (_, 3) => tile_int8::<3>(part, kq, w, columns, o, stride),
                (_, 2) => tile_int8::<2>(part, kq, w, columns, o, stride),
                _ => tile_int8::<1>(part, kq, w, columns, o, stride),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("int8 weights exist only on x86-64");
        r += m;
    }
}

/// `M` rows × [`TILE`] columns. Per group: i32 sums of one `vpdpbusd` per row, vector and
/// input quad, then into f32 sums at the group's scale, less its zero point's share. At the
/// end the weights' scale and the bias, and one store.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 VNNI; `rows` holds `M·kq` quads and `M·kq/16`
/// scales and zero points, `w` `kq·TILE` quads, `columns` `TILE` scales and bias values and
/// `TILE` sums per group at its stride, and `out` at least `(M-1)·stride + TILE`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn tile_int8<const M: usize>(
    rows: RowsInt8,
    kq: usize,
    w: &[u32],
    columns: ColumnsInt8,
    out: &mut [f32],
    stride: usize,
) {
    use std::arch::x86_64::*;
    const GROUP_QUADS: usize = GROUP_VNNI / 4;
    let groups = kq / GROUP_QUADS;
    debug_assert!(rows.x.len() >= M * kq && rows.scale.len() >= M * groups);
    debug_assert!(w.len() >= kq * TILE && columns.bias.len() >= TILE);
    debug_assert!(out.len() >= (M - 1) * stride + TILE);
    // SAFETY: the caller's promises above bound every pointer offset taken here.
    unsafe {
        let (xp, wp, op) = (rows.x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
        let mut lo = [_mm512_setzero_ps(); M];
        let mut hi = [_mm512_setzero_ps(); M];
        for g in 0..groups {
            let mut lo_i = [_mm512_setzero_si512(); M];
            let mut hi_i = [_mm512_setzero_si512(); M];
            for q in g * GROUP_QUADS..(g + 1) * GROUP_QUADS {
                let w0 = _mm512_loadu_si512(wp.add(q * TILE) as *const __m512i);
                let w1 = _mm512_loadu_si512(wp.add(q * TILE + 16) as *const __m512i);
                for r in 0..M {
                    let a = _mm512_set1_epi32(*xp.add(r * kq + q) as i32);
                    lo_i[r] = _mm512_dpbusd_epi32(lo_i[r], a, w0);
                    hi_i[r] = _mm512_dpbusd_epi32(hi_i[r], a, w1);
                }
            }
            let sums = columns.sums.as_ptr().add(g * columns.stride);
            let (sums0, sums1) = (_mm512_loadu_ps(sums), _mm512_loadu_ps(sums.add(16)));
            for r in 0..M {
                let scale = *rows.scale.get_unchecked(r * groups + g);
                let zero = *rows.zero.get_unchecked(r * groups + g);
                let s = _mm512_set1_ps(scale);
                let z = _mm512_set1_ps(-scale * zero as f32);
                lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_i[r]), s, lo[r]);
                lo[r] = _mm512_fmadd_ps(z, sums0, lo[r]);
                hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_i[r]), s, hi[r]);
                hi[r] = _mm512_fmadd_ps(z, sums1, hi[r]);
            }
        }
        let scale0 = _mm512_loadu_ps(columns.scale.as_ptr());
        let scale1 = _mm512_loadu_ps(columns.scale.as_ptr().add(16));
        let bias0 = _mm512_loadu_ps(columns.bias.as_ptr());
        let bias1 = _mm512_loadu_ps(columns.bias.as_ptr().add(16));
        for r in 0..M {
            _mm512_storeu_ps(op.add(r * stride), _mm512_fmadd_ps(lo[r], scale0, bias0));
            _mm512_storeu_ps(
                op.add(r * stride + 16),
                _mm512_fmadd_ps(hi[r], scale1, bias1),
            );
        }
    }
}

/// [`tile_int8`] on AVX2: per row, vector of 8 columns and input quad, `vpmaddubsw` (the
/// 7-bit activations by the int8 weights, in pairs summed in i16: no saturation) and
/// `vpmaddwd` by ones (the pairs into an i32 per column) into the group's i32 sums.
///
/// # Safety
/// The CPU has AVX2 and FMA; the slices are as [`tile_int8`] requires, and every activation
/// byte is at most 127.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
// The vector index also names the offsets of the weights, sums and outputs it pairs with.
#[allow(clippy::needless_range_loop)]
unsafe fn tile_int8_avx2<const M: usize>(
    rows: RowsInt8,
    kq: usize,
    w: &[u32],
    columns: ColumnsInt8,
    out: &mut [f32],
    stride: usize,
) {
    use std::arch::x86_64::*;
    const V: usize = TILE / 8;
    const GROUP_QUADS: usize = GROUP_AVX2 / 4;
    let groups = kq / GROUP_QUADS;
    debug_assert!(rows.x.len() >= M * kq && rows.scale.len() >= M * groups);
    debug_assert!(w.len() >= kq * TILE && columns.bias.len() >= TILE);
    debug_assert!(out.len() >= (M - 1) * stride + TILE);
    // SAFETY: the caller's promises above bound every pointer offset taken here.
    unsafe {
        let (xp, wp, op) = (rows.x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
        let ones = _mm256_set1_epi16(1);
        let mut done = [[0f32; TILE]; M];
        for g in 0..groups {
            let mut sums = [[_mm256_setzero_si256(); V]; M];
            for q in g * GROUP_QUADS..(g + 1) * GROUP_QUADS {
                let a: [__m256i; M] =
                    std::array::from_fn(|r| _mm256_set1_epi32(*xp.add(r * kq + q) as i32));
                for v in 0..V {
                    let wv = _mm256_loadu_si256(wp.add(q * TILE + 8 * v) as *const __m256i);
                    for r in 0..M {
                        let pairs = _mm256_maddubs_epi16(a[r], wv);
                        sums[r][v] = _mm256_add_epi32(sums[r][v], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            let weight_sums = columns.sums.as_ptr().add(g * columns.stride);
            for r in 0..M {
                let scale = *rows.scale.get_unchecked(r * groups + g);
                let zero = *rows.zero.get_unchecked(r * groups + g);
                let s = _mm256_set1_ps(scale);
                let z = _mm256_set1_ps(-scale * zero as f32);
                for v in 0..V {
                    let d = done[r].as_mut_ptr().add(8 * v);
                    let mut f =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][v]), s, _mm256_loadu_ps(d));
                    f = _mm256_fmadd_ps(z, _mm256_loadu_ps(weight_sums.add(8 * v)), f);
                    _mm256_storeu_ps(d, f);
                }
            }
        }
        for (r, done) in done.iter().enumerate() {
            for v in 0..V {
                let scale = _mm256_loadu_ps(columns.scale.as_ptr().add(8 * v));
                let bias = _mm256_loadu_ps(columns.bias.as_ptr().add(8 * v));
                _mm256_storeu_ps(
                    op.add(r * stride + 8 * v),
                    _mm256_fmadd_ps(_mm256_loadu_ps(done.as_ptr().add(8 * v)), scale, bias),
                );
            }
        }
    }
}

/// One tile of columns for every row of `pairs`: row `r` goes to `out[r·stride..][..TILE]`.
fn rows_bf16(pairs: &[u32], kp: usize, w: &[u32], bias: &[f32], out: &mut [f32], stride: usize) {
    let rows = pairs.len() / kp;
    assert!(w.len() == kp * TILE && bias.len() == TILE);
    assert!(
        rows == 0 || (rows - 1) * stride + TILE <= out.len(),
        "output too short"
    );
    let mut r = 0;
    while r < rows {
        let m = (rows - r).min(MR);
        let x = &pairs[r * kp..(r + m) * kp];
        let o = &mut out[r * stride..];
        // SAFETY: `linear_bf16` runs only on a CPU with AVX-512F and BF16 (its callers hold
        // `Weights::Bf16`, packed only when `Precision::resolve` found both); the slices hold
        // `m` rows of `kp` pairs, `kp` tiles of weights, a tile of bias, and `m` output rows
        // of `stride` (the last one a tile long), as asserted above.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match m {
                8 => tile_bf16::<8>(x, kp, w, bias, o, stride),
                7 => tile_bf16::<7>(x, kp, w, bias, o, stride),
                6 => tile_bf16::<6>(x, kp, w, bias, o, stride),
                5 => tile_bf16::<5>(x, kp, w, bias, o, stride),
                4 => tile_bf16::<4>(x, kp, w, bias, o, stride),
                3 => tile_bf16::<3>(x, kp, w, bias, o, stride),
                2 => tile_bf16::<2>(x, kp, w, bias, o, stride),
                _ => tile_bf16::<1>(x, kp, w, bias, o, stride),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("bf16 weights exist only on x86-64");
        r += m;
    }
}

/// `M` rows × [`TILE`] columns: the sums start at the bias, take one `vdpbf16ps` per row,
/// vector and input pair, and are stored once.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512 BF16; `x` holds `M·kp` pairs, `w` `kp·TILE`, `bias`
/// `TILE` values and `out` at least `(M-1)·stride + TILE`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_bf16<const M: usize>(
    x: &[u32],
    kp: usize,
    w: &[u32],
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() >= M * kp && w.len() >= kp * TILE && bias.len() >= TILE);
    debug_assert!(out.len() >= (M - 1) * stride + TILE);
    // SAFETY: the caller's promises above bound every pointer offset taken here.
    unsafe {
        let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
        let b0 = _mm512_loadu_ps(bias.as_ptr());
        let b1 = _mm512_loadu_ps(bias.as_ptr().add(16));
        let mut lo = [b0; M];
        let mut hi = [b1; M];
        for q in 0..kp {
            let w0: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(wp.add(q * TILE) as *const __m512i));
            let w1: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(wp.add(q * TILE + 16) as *const __m512i));
            for r in 0..M {
                let a: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*xp.add(r * kp + q) as i32));
                lo[r] = _mm512_dpbf16_ps(lo[r], a, w0);
                hi[r] = _mm512_dpbf16_ps(hi[r], a, w1);
            }
        }
        for r in 0..M {
            _mm512_storeu_ps(op.add(r * stride), lo[r]);
            _mm512_storeu_ps(op.add(r * stride + 16), hi[r]);
        }
    }
}

/// Rows of f32 into rows of bf16 pairs (`u32`: the even input low, the odd one high).
fn to_bf16_pairs(x: &[f32], pairs: &mut [u32]) {
    assert_eq!(x.len(), pairs.len() * 2);
    #[cfg(target_arch = "x86_64")]
    if Precision::bf16_available() {
        let whole = x.len() / 32 * 32;
        // SAFETY: checked just above that the CPU has AVX-512F and BF16; the function reads
        // `whole` values of `x` and writes `whole / 2` pairs, both within the slices.
        unsafe { to_bf16_pairs_avx512(&x[..whole], &mut pairs[..whole / 2]) };
        for (p, v) in pairs[whole / 2..]
            .iter_mut()
            .zip(x[whole..].chunks_exact(2))
        {
            *p = bf16_bits(v[0]) as u32 | (bf16_bits(v[1]) as u32) << 16;
        }
        return;
    }
    for (p, v) in pairs.iter_mut().zip(x.chunks_exact(2)) {
        *p = bf16_bits(v[0]) as u32 | (bf16_bits(v[1]) as u32) << 16;
    }
}

/// # Safety
/// The CPU has AVX-512F and BF16; `x.len()` is a multiple of 32 and twice `pairs.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn to_bf16_pairs_avx512(x: &[f32], pairs: &mut [u32]) {
    use std::arch::x86_64::*;
    debug_assert!(x.len().is_multiple_of(32) && x.len() == pairs.len() * 2);
    // SAFETY: each step reads 32 values at `i` and writes 16 pairs at `i / 2`, inside both
    // slices by the caller's promise.
    unsafe {
        for i in (0..x.len()).step_by(32) {
            let a = _mm512_loadu_ps(x.as_ptr().add(i));
            let b = _mm512_loadu_ps(x.as_ptr().add(i + 16));
            // The second operand fills the low half: values i..i+16 stay first, in order.
            let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
            _mm512_storeu_si512(pairs.as_mut_ptr().add(i / 2) as *mut __m512i, packed);
        }
    }
}

/// `out = x · Wᵀ + bias` for a few rows of f32, `transposed` being [`Weights::F32`]: the
/// output columns are split across threads in tiles, each tile's weights read once.
pub(crate) fn few_rows_f32(
    arch: pulp::Arch,
    x: &[f32],
    inputs: usize,
    transposed: &[f32],
    bias: &[f32],
    out: &mut [f32],
) {
    let n = bias.len();
    let rows = x.len() / inputs;
    assert!(x.len() == rows * inputs && transposed.len() == inputs * n);
    assert!(out.len() >= rows * n, "output too short");
    let tiles = n.div_ceil(TILE);
    let blocks: Vec<Vec<f32>> = (0..tiles)
        .into_par_iter()
        .map(|t| {
            let first = t * TILE;
            let width = TILE.min(n - first);
            let mut block = vec![0f32; rows * TILE];
            for (x, block) in x
                .chunks(MR_F32 * inputs)
                .zip(block.chunks_mut(MR_F32 * TILE))
            {
                if width == TILE {
                    let tile = |out| TileF32 {
                        x,
                        inputs,
                        transposed,
                        n,
                        first,
                        bias: &bias[first..first + TILE],
                        out,
                    };
                    match x.len() / inputs {
                        4 => arch.dispatch(tile(block).rows::<4>()),
                        3 => arch.dispatch(tile(block).rows::<3>()),
                        2 => arch.dispatch(tile(block).rows::<2>()),
                        _ => arch.dispatch(tile(block).rows::<1>()),
                    }
                } else {
                    // A partial tile (an output count that is not a multiple of TILE; not
                    // MiniLM's).
                    plain_tile(
                        x,
                        inputs,
                        transposed,
                        n,
                        first,
                        &bias[first..first + width],
                        block,
                    );
                }
            }
            block
        })
        .collect();
    for (t, block) in blocks.iter().enumerate() {
        let first = t * TILE;
        let width = TILE.min(n - first);
        for (r, values) in block.chunks_exact(TILE).enumerate() {
            out[r * n + first..][..width].copy_from_slice(&values[..width]);
        }
    }
}

/// The output columns from `first` that `bias` covers (its length, at most [`TILE`]), of
/// `x · Wᵀ + bias`, in plain loops, one product at a time, into `out` (rows of [`TILE`]). For
/// what the vector kernel does not take: a partial tile, or no usable vector width.
fn plain_tile(
    x: &[f32],
    inputs: usize,
    transposed: &[f32],
    n: usize,
    first: usize,
    bias: &[f32],
    out: &mut [f32],
) {
    for (row, out) in x.chunks_exact(inputs).zip(out.chunks_exact_mut(TILE)) {
        for (j, o) in out.iter_mut().take(bias.len()).enumerate() {
            *o = bias[j]
                + row
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * transposed[i * n + first + j])
                    .sum::<f32>();
        }
    }
}

/// One tile of [`few_rows_f32`]: the rows of `x` × [`TILE`] columns from `first`.
struct TileF32<'a> {
    x: &'a [f32],
    inputs: usize,
    transposed: &'a [f32],
    n: usize,
    first: usize,
    bias: &'a [f32],
    out: &'a mut [f32],
}

impl<'a> TileF32<'a> {
    /// The tile as `M` rows (1 to [`MR_F32`]): a constant, so that the sums stay in
    /// registers.
    fn rows<const M: usize>(self) -> TileRows<'a, M> {
        assert!(M <= MR_F32 && self.x.len() == M * self.inputs && self.out.len() >= M * TILE);
        TileRows(self)
    }
}

/// [`TileF32`] of `M` rows. A `WithSimd` type rather than a closure: its `with_simd` is
/// inlined into the function compiled for the detected instruction set, where a closure's
/// body may stay compiled for the baseline.
struct TileRows<'a, const M: usize>(TileF32<'a>);

impl<const M: usize> pulp::WithSimd for TileRows<'_, M> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) {
        let tile = self.0;
        // Vectors per tile row: 2 with AVX-512, 4 with AVX2. A constant once `S` is known,
        // so the loops over it unroll and the sums stay in registers.
        let nv = TILE / S::F32_LANES;
        if nv > MAX_VECTORS {
            // No usable vector width.
            plain_tile(
                tile.x,
                tile.inputs,
                tile.transposed,
                tile.n,
                tile.first,
                tile.bias,
                tile.out,
            );
            return;
        }
        let load = |values: &[f32]| -> S::f32s {
            pulp::bytemuck::pod_read_unaligned(pulp::bytemuck::cast_slice(values))
        };
        let lanes = S::F32_LANES;
        let bias: [S::f32s; MAX_VECTORS] = std::array::from_fn(|v| {
            if v < nv {
                load(&tile.bias[v * lanes..(v + 1) * lanes])
            } else {
                simd.splat_f32s(0.0)
            }
        });
        let mut acc = [bias; M];
        let rows: [&[f32]; M] =
            std::array::from_fn(|r| &tile.x[r * tile.inputs..(r + 1) * tile.inputs]);
        for i in 0..tile.inputs {
            let w = &tile.transposed[i * tile.n + tile.first..][..TILE];
            let w: [S::f32s; MAX_VECTORS] = std::array::from_fn(|v| {
                if v < nv {
                    load(&w[v * lanes..(v + 1) * lanes])
                } else {
                    simd.splat_f32s(0.0)
                }
            });
            for (acc, row) in acc.iter_mut().zip(&rows) {
                let a = simd.splat_f32s(row[i]);
                for v in 0..nv {
                    acc[v] = simd.mul_add_e_f32s(a, w[v], acc[v]);
                }
            }
        }
        for (out, acc) in tile.out.chunks_exact_mut(TILE).zip(&acc) {
            for v in 0..nv {
                out[v * lanes..(v + 1) * lanes]
                    .copy_from_slice(pulp::bytemuck::cast_slice(std::slice::from_ref(&acc[v])));
            }
        }
    }
}

/// Vectors per tile row that [`TileF32`] keeps in registers: 4 of AVX2's 8 lanes; a narrower
/// instruction set takes the plain loop.
const MAX_VECTORS: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    /// `x · Wᵀ + b` in f64, the reference.
    fn reference(x: &[f32], w: &[f32], b: &[f32], inputs: usize) -> Vec<f32> {
        let n = b.len();
        x.chunks_exact(inputs)
            .flat_map(|row| {
                (0..n).map(move |o| {
                    let dot: f64 = row
                        .iter()
                        .zip(&w[o * inputs..(o + 1) * inputs])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    (dot + b[o] as f64) as f32
                })
            })
            .collect()
    }

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2⁻⁸ is halfway between two bf16 values: ties go to the even one (1.0).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2⁻⁸ is halfway too: up, to the even 1 + 2⁻⁶.
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        assert!(f32::from_bits((bf16_bits(f32::NAN) as u32) << 16).is_nan());
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn few_rows_f32_matches_the_reference_for_every_row_count() {
        let (inputs, n) = (96, 80); // 80: two whole tiles and a partial one
        let w = values(inputs * n, 1);
        let b = values(n, 2);
        let Weights::F32(t) = Weights::pack(&w, inputs, n, Precision::F32) else {
            panic!("f32 asked, f32 packed")
        };
        for rows in [1, 3, 4, 5, 9] {
            let x = values(rows * inputs, 3 + rows as u64);
            let mut out = vec![f32::NAN; rows * n];
            few_rows_f32(pulp::Arch::new(), &x, inputs, &t, &b, &mut out);
            for (got, want) in out.iter().zip(reference(&x, &w, &b, inputs)) {
                assert!((got - want).abs() < 1e-4, "{rows} rows: {got} vs {want}");
            }
        }
    }

    #[test]
    fn bf16_matches_the_reference_within_its_rounding() {
        if !Precision::bf16_available() {
            eprintln!("no AVX-512 BF16 here: the bf16 kernel is not run");
            return;
        }
        let (inputs, n) = (384, 64);
        let w = values(inputs * n, 11);
        let b = values(n, 12);
        let Weights::Bf16(p) = Weights::pack(&w, inputs, n, Precision::Bf16) else {
            panic!("bf16 asked, bf16 packed")
        };
        // Few rows (split by tiles), a row block and a tail (split by rows).
        for rows in [1, 7, 8, 9, ROW_BLOCK + 13] {
            let x = values(rows * inputs, 20 + rows as u64);
            let mut out = vec![f32::NAN; rows * n];
            let mut scratch = Operand::default();
            linear_bf16(&x, inputs, &p, &b, &mut out, &mut scratch);
            // The products of values rounded to bf16 against the exact reference: each
            // operand is off by at most 2⁻⁹ relatively, so a 384-long dot of values in
            // [-1, 1) (|terms| summing to about 96) is off by at most 0.75 and in practice
            // by a few hundredths; an indexing mistake is off by several units.
            let want = reference(&x, &w, &b, inputs);
            let worst = out
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            assert!(worst < 0.2, "{rows} rows: worst error {worst}");
            // And against the same arithmetic in f64 on the rounded operands: only the order
            // of the f32 sums differs.
            let round = |v: &[f32]| -> Vec<f32> {
                v.iter()
                    .map(|x| f32::from_bits((bf16_bits(*x) as u32) << 16))
                    .collect()
            };
            let exact = reference(&round(&x), &round(&w), &b, inputs);
            for (g, e) in out.iter().zip(&exact) {
                assert!((g - e).abs() < 1e-4, "{rows} rows: {g} vs {e}");
            }
        }
    }

    #[test]
    fn int8_matches_the_reference_within_its_rounding() {
        if !Precision::int8_available() {
            eprintln!("no AVX-512 VNNI or AVX2 here: the int8 kernel is not run");
            return;
        }
        let (inputs, n) = (384, 64);
        let w = values(inputs * n, 31);
        let b = values(n, 32);
        let Weights::Int8(p) = Weights::pack(&w, inputs, n, Precision::Int8) else {
            panic!("int8 asked, int8 packed")
        };
        // Few rows (split by tiles), a row block and a tail (split by rows); rows skewed to
        // one side, as a GELU's output is, and one row of zeros.
        for rows in [1, 7, 8, 9, ROW_BLOCK + 13] {
            let mut x: Vec<f32> = values(rows * inputs, 40 + rows as u64)
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    if (i / inputs) % 2 == 1 {
                        v * 3.0 + 2.5
                    } else {
                        *v
                    }
                })
                .collect();
            x[(rows - 1) * inputs..].fill(0.0);
            let mut out = vec![f32::NAN; rows * n];
            let mut scratch = Operand::default();
            linear_int8(&x, inputs, &p, &b, &mut out, &mut scratch);
            // Against the same arithmetic done plainly on the quantised operands: only the
            // order of the sums differs.
            let group = group();
            let mut quads = vec![0u32; group / 4];
            for (r, row) in x.chunks_exact(inputs).enumerate() {
                let quantised: Vec<(f64, Vec<i64>)> = row
                    .chunks_exact(group)
                    .map(|values| {
                        let (scale, zero) = quantise_group(values, &mut quads);
                        let bytes: &[u8] = pulp::bytemuck::cast_slice(&quads);
                        let values = bytes.iter().map(|b| *b as i64 - zero as i64).collect();
                        (scale as f64, values)
                    })
                    .collect();
                for o in 0..n {
                    let wq: Vec<i64> = (0..inputs)
                        .map(|i| {
                            (w[o * inputs + i] / p.scale[o])
                                .round()
                                .clamp(-127.0, 127.0) as i64
                        })
                        .collect();
                    let dot: f64 = quantised
                        .iter()
                        .zip(wq.chunks_exact(group))
                        .map(|((scale, values), wq)| {
                            scale * values.iter().zip(wq).map(|(a, b)| a * b).sum::<i64>() as f64
                        })
                        .sum();
                    let want = b[o] as f64 + p.scale[o] as f64 * dot;
                    let got = out[r * n + o] as f64;
                    assert!(
                        (got - want).abs() < 1e-3,
                        "{rows} rows, row {r}, output {o}: {got} vs {want}"
                    );
                }
            }
            // And against the exact f32 products: a row's u8 step is its range / 255 (up to
            // 0.024 here; twice that on AVX2's 0..=127) and a weight's int8 step 1/127, so a
            // 384-long dot is off by about 0.1 to 0.2 and rarely by half a unit; an indexing
            // mistake is off by tens.
            let want = reference(&x, &w, &b, inputs);
            let worst = out
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1.0, "{rows} rows: worst error {worst}");
            // The row of zeros is the bias, exactly.
            assert_eq!(&out[(rows - 1) * n..], &b[..]);
        }
    }

    #[test]
    fn a_group_rounds_to_u8_by_its_own_range() {
        // 0..=255 for VNNI, 0..=127 for AVX2's kernel.
        let top = Int8Isa::detect().map_or(255, Int8Isa::top);
        let group: Vec<f32> = (0..32).map(|i| i as f32 - 8.0).collect(); // -8..=23
        let mut quads = vec![0u32; 8];
        let (scale, zero) = quantise_group(&group, &mut quads);
        assert!((scale - 31.0 / top as f32).abs() < 1e-6);
        assert_eq!(zero, (8.0f32 / scale).round_ties_even() as i32);
        let bytes: &[u8] = pulp::bytemuck::cast_slice(&quads);
        assert_eq!((bytes[0], bytes[31] as i32), (0, top));
        // The SIMD quantiser rounds as the scalar one does, byte for byte and in order.
        let mut plain = [0u8; 32];
        let (lo, hi) = (-8.0, 23.0);
        let (s, z) = group_quantiser(lo, hi, top);
        for (b, v) in plain.iter_mut().zip(&group) {
            *b = ((v / s).round_ties_even() as i32 + z).clamp(0, top) as u8;
        }
        assert_eq!(bytes, &plain[..]);
        for (b, v) in bytes.iter().zip(&group) {
            assert!((scale * (*b as i32 - zero) as f32 - v).abs() <= scale / 2.0 + 1e-5);
        }
        // All non-negative: 0 stays the bottom of the range.
        let (_, zero) = quantise_group(&[1.0; 16], &mut quads[..4]);
        assert_eq!(zero, 0);
        // All zero: any scale holds it.
        assert_eq!(quantise_group(&[0.0; 16], &mut quads[..4]), (1.0, 0));
    }

    #[test]
    fn an_outlier_coarsens_only_its_own_group() {
        // One large value in the first group of a row: the second group keeps its fine
        // steps.
        let group = group();
        let mut row: Vec<f32> = values(2 * group, 7);
        row[3] = 40.0;
        let mut quads = vec![0u32; group / 4];
        let (coarse, _) = quantise_group(&row[..group], &mut quads);
        let (fine, _) = quantise_group(&row[group..], &mut quads);
        // Steps of 41 / top against 2 / top at most.
        let top = Int8Isa::detect().map_or(255, Int8Isa::top) as f32;
        assert!(coarse > 38.0 / top && fine < 2.5 / top, "{coarse} {fine}");
    }

    #[test]
    fn narrow_precisions_are_refused_where_the_cpu_lacks_them_and_auto_follows_the_cpu() {
        let auto = Precision::Auto.resolve().unwrap();
        let want = if Precision::bf16_available() {
            Precision::Bf16
        } else if Precision::int8_available() {
            Precision::Int8
        } else {
            Precision::F32
        };
        assert_eq!(auto, want);
        assert_eq!(Precision::F32.resolve(), Ok(Precision::F32));
        assert_eq!(
            Precision::Bf16.resolve().is_ok(),
            Precision::bf16_available()
        );
        assert_eq!(
            Precision::Int8.resolve().is_ok(),
            Precision::int8_available()
        );
    }
}

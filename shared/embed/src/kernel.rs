//! The products of a linear layer, `out = x · Wᵀ + b`, in the precision the CPU does best.
//!
//! - **bf16** (x86-64 with AVX-512 BF16, detected at run time): the weights are rounded to
//!   bf16 once, at load, and packed in tiles of [`TILE`] output columns; each pass rounds its
//!   activations to bf16 too, and `vdpbf16ps` multiplies pairs of them into f32 accumulators.
//!   Twice the multiply-adds of an f32 FMA per instruction, and half the bytes of weights to
//!   stream, which is what a query's few rows are bound by. No library the encoder could call
//!   has this kernel: `gemm` (candle's) widens bf16 to f32 and multiplies in f32.
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
    /// bf16 products where the CPU has AVX-512 BF16, else f32.
    #[default]
    Auto,
    /// f32 throughout: the reference arithmetic, on every CPU.
    F32,
    /// bf16 products with f32 sums; refused on a CPU without AVX-512 BF16.
    Bf16,
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

    /// What `self` comes to on this CPU: [`Precision::F32`] or [`Precision::Bf16`]; `Err`
    /// for bf16 asked of a CPU without it.
    pub fn resolve(self) -> Result<Precision, String> {
        match self {
            Precision::Auto if Self::bf16_available() => Ok(Precision::Bf16),
            Precision::Auto | Precision::F32 => Ok(Precision::F32),
            Precision::Bf16 if Self::bf16_available() => Ok(Precision::Bf16),
            Precision::Bf16 => Err(
                "precision bf16 needs a CPU with AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo); \
                 set precision to \"auto\" or \"f32\""
                    .into(),
            ),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Auto => "auto",
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
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
}

impl Weights {
    /// `weight` (outputs × inputs, row-major, as stored) in the layout of `precision`, which
    /// must be resolved. bf16 needs an even input count and whole tiles of outputs; a layer
    /// without them stays f32.
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

/// `out = x · Wᵀ + bias` through the bf16 kernel, `x` being rows of `inputs` values and
/// `packed` [`Weights::Bf16`]. `pairs` is scratch for the activations in bf16.
pub(crate) fn linear_bf16(
    x: &[f32],
    inputs: usize,
    packed: &[u32],
    bias: &[f32],
    out: &mut [f32],
    pairs: &mut Vec<u32>,
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
    if pairs.len() < rows * kp {
        pairs.resize(rows * kp, 0);
    }
    let pairs = &mut pairs[..rows * kp];
    pairs
        .par_chunks_mut(ROW_BLOCK * kp)
        .zip(x.par_chunks(ROW_BLOCK * inputs))
        .for_each(|(to, from)| to_bf16_pairs(from, to));
    let pairs = &*pairs;
    let tiles = n / TILE;
    if rows <= ROW_BLOCK {
        // Few rows: the weights are what costs, so the tiles are what is split.
        let blocks: Vec<Vec<f32>> = (0..tiles)
            .into_par_iter()
            .map(|t| {
                let mut block = vec![0f32; rows * TILE];
                rows_bf16(
                    pairs,
                    kp,
                    &packed[t * kp * TILE..][..kp * TILE],
                    &bias[t * TILE..][..TILE],
                    &mut block,
                    TILE,
                );
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
        .zip(pairs.par_chunks(ROW_BLOCK * kp))
        .for_each(|(out, pairs)| {
            for t in 0..tiles {
                rows_bf16(
                    pairs,
                    kp,
                    &packed[t * kp * TILE..][..kp * TILE],
                    &bias[t * TILE..][..TILE],
                    &mut out[t * TILE..],
                    n,
                );
            }
        });
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
            let mut scratch = Vec::new();
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
    fn bf16_is_refused_where_the_cpu_lacks_it_and_auto_follows_the_cpu() {
        let auto = Precision::Auto.resolve().unwrap();
        assert_eq!(auto == Precision::Bf16, Precision::bf16_available());
        assert_eq!(Precision::F32.resolve(), Ok(Precision::F32));
        assert_eq!(
            Precision::Bf16.resolve().is_ok(),
            Precision::bf16_available()
        );
    }
}

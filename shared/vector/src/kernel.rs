//! The arithmetic every search runs millions of times: dot products over unit vectors, and
//! the checks and scaling that make a caller's vector a unit vector.

use hnsw_rs::prelude::Distance;

use crate::VectorError;

/// Cosine distance for vectors this crate has already normalised: `1 - a·b`, clamped at 0.
///
/// Not hnsw_rs's own distances: `DistDot` asserts `1 - a·b >= 0` and so panics when rounding
/// puts a vector's product with itself a hair above 1; `DistCosine` recomputes both norms in a
/// sequential f64 loop on every call, about three times the work.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct UnitCosine;

impl Distance<f32> for UnitCosine {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        // hnsw_rs panics on NaN distances and asserts they are >= 0. Stored and query vectors
        // are finite unit vectors, so the product is finite and the clamp covers rounding.
        (1.0 - dot(a, b)).max(0.0)
    }
}

/// `a·b`. Uses AVX2 and FMA when the CPU has them (chosen at run time, so one binary runs
/// everywhere); the same CPU always takes the same path, so exact and graph searches score
/// alike.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has avx2 and fma, checked just above.
        return unsafe { dot_avx2_fma(a, b) };
    }
    dot_lanes::<false>(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2_fma(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes::<true>(a, b)
}

/// Independent accumulators, because floating point addition is not associative and the
/// compiler will not vectorise a single running sum on its own.
#[inline(always)]
fn dot_lanes<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 32;
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut acc = [0.0f32; LANES];
    let mut chunks_a = a.chunks_exact(LANES);
    let mut chunks_b = b.chunks_exact(LANES);
    for (xa, xb) in (&mut chunks_a).zip(&mut chunks_b) {
        for i in 0..LANES {
            acc[i] = if FMA {
                xa[i].mul_add(xb[i], acc[i])
            } else {
                acc[i] + xa[i] * xb[i]
            };
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in chunks_a.remainder().iter().zip(chunks_b.remainder()) {
        tail += x * y;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0] + tail
}

/// How far a squared norm may be from 1 for a vector to count as already normalised. Keeping
/// such vectors bit for bit is what makes `iter` then `from_vectors` reproduce an index
/// exactly; the cosine error it allows is below 1e-6.
const UNIT_TOLERANCE: f64 = 1e-6;

/// Checks `v` and appends it to `out` scaled to unit length.
pub(crate) fn push_unit(v: &[f32], dim: usize, out: &mut Vec<f32>) -> Result<(), VectorError> {
    if v.len() != dim {
        return Err(VectorError::DimensionMismatch {
            expected: dim,
            got: v.len(),
        });
    }
    // f64 so that neither huge components overflow nor tiny ones underflow the norm.
    let mut norm_sq = 0.0f64;
    for (index, &value) in v.iter().enumerate() {
        if !value.is_finite() {
            return Err(VectorError::NonFinite { index, value });
        }
        norm_sq += f64::from(value) * f64::from(value);
    }
    if norm_sq == 0.0 {
        return Err(VectorError::ZeroVector);
    }
    if (norm_sq - 1.0).abs() <= UNIT_TOLERANCE {
        out.extend_from_slice(v);
    } else {
        let inv = 1.0 / norm_sq.sqrt();
        out.extend(v.iter().map(|&x| (f64::from(x) * inv) as f32));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum()
    }

    #[test]
    fn dot_matches_naive_sum_for_lengths_around_the_lane_width() {
        for len in [0, 1, 7, 31, 32, 33, 64, 100, 384] {
            let a: Vec<f32> = (0..len)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                .collect();
            let b: Vec<f32> = (0..len)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let expected = naive(&a, &b);
            for got in [dot(&a, &b), dot_lanes::<false>(&a, &b)] {
                assert!(
                    (f64::from(got) - expected).abs() < 1e-3,
                    "len {len}: {got} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn push_unit_scales_to_unit_length_and_keeps_unit_vectors_bit_for_bit() {
        let mut out = Vec::new();
        push_unit(&[3.0, 4.0], 2, &mut out).unwrap();
        assert!((out[0] - 0.6).abs() < 1e-7 && (out[1] - 0.8).abs() < 1e-7);
        let unit = out.clone();
        push_unit(&unit, 2, &mut out).unwrap();
        assert_eq!(out[2..], unit[..]);
    }

    #[test]
    fn push_unit_handles_extreme_magnitudes() {
        let mut out = Vec::new();
        push_unit(&[3e38, 3e38], 2, &mut out).unwrap();
        push_unit(&[1e-44, 0.0], 2, &mut out).unwrap();
        assert!(out.iter().all(|x| x.is_finite()));
        assert!((out[2] - 1.0).abs() < 1e-6);
    }
}

//! The embedder's roofline: what the model's matrix products cost, and how fast the same
//! kernels the model runs on multiply matrices of the model's shapes on this machine,
//! measured in the same process: `gemm`'s f32 kernels (through candle, which calls them) and,
//! where the CPU has them, the encoder's bf16 (AVX-512 BF16) and int8 (AVX-512 VNNI or AVX2)
//! kernels.

use std::time::Instant;

use candle_core::{Device, Tensor};

/// A BERT encoder's dimensions, as they set its arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
}

impl Shape {
    /// Floating-point operations (a multiply and an add each count one) of the matrix
    /// products one text of `tokens` tokens (special tokens included) takes: per layer, the
    /// Q, K, V and output projections (4·t·h² multiply-adds), the feed-forward (2·t·h·f),
    /// and attention's scores and weighted sum (2·t²·h). Layer norms, GELU and softmax are
    /// left out: they are a few percent, and no GEMM.
    pub fn flops(&self, tokens: usize) -> f64 {
        let (t, h, f) = (tokens as f64, self.hidden as f64, self.intermediate as f64);
        self.layers as f64 * 2.0 * (4.0 * t * h * h + 2.0 * t * h * f + 2.0 * t * t * h)
    }

    /// The (m, k, n) of the model's dense products for a batch of `rows` token rows.
    pub fn gemms(&self, rows: usize) -> [(usize, usize, usize); 3] {
        [
            (rows, self.hidden, self.hidden),
            (rows, self.hidden, self.intermediate),
            (rows, self.intermediate, self.hidden),
        ]
    }
}

/// One shape's measured rate.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GemmRate {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub gflops: f64,
}

/// Multiplies f32 matrices of each shape with candle on the CPU for about `budget_s`
/// seconds each (after a warm-up), and returns the best rate of each.
pub fn gemm_rates(
    shapes: &[(usize, usize, usize)],
    budget_s: f64,
) -> candle_core::Result<Vec<GemmRate>> {
    let device = Device::Cpu;
    let mut out = Vec::new();
    for &(m, k, n) in shapes {
        // Laid out as the model's linear layers are: activations (m, k) times a transposed
        // weight (n, k).
        let a = Tensor::randn(0f32, 1.0, (m, k), &device)?;
        let w = Tensor::randn(0f32, 1.0, (n, k), &device)?;
        let wt = w.t()?;
        let _ = a.matmul(&wt)?;
        let flops = 2.0 * m as f64 * k as f64 * n as f64;
        let mut best = 0.0f64;
        let started = Instant::now();
        while started.elapsed().as_secs_f64() < budget_s {
            let t = Instant::now();
            let c = a.matmul(&wt)?;
            // Read one value so that nothing lazy skips the work.
            let _ = c.get(0)?;
            let rate = flops / t.elapsed().as_secs_f64() / 1e9;
            best = best.max(rate);
        }
        out.push(GemmRate {
            m,
            k,
            n,
            gflops: best,
        });
    }
    Ok(out)
}

/// The same measurement for one of the encoder's narrow kernels ([`crate::kernel`]), bf16
/// or int8, the products the model runs in that precision: its peak at the model's shapes is
/// that path's roofline. `None` for f32 or auto, or on a CPU without the kernel.
pub fn kernel_rates(
    precision: crate::Precision,
    shapes: &[(usize, usize, usize)],
    budget_s: f64,
) -> Option<Vec<GemmRate>> {
    use crate::kernel::{Operand, Precision, Weights};
    if !matches!(precision, Precision::Bf16 | Precision::Int8) || precision.resolve().is_err() {
        return None;
    }
    let mut out = Vec::new();
    for &(m, k, n) in shapes {
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        };
        let weights = Weights::pack(&values(n * k, 1), k, n, precision);
        if matches!(weights, Weights::F32(_)) {
            // A shape the kernel does not take (odd inputs, partial tiles): not measured.
            continue;
        }
        let (x, bias) = (values(m * k, 2), values(n, 3));
        let mut result = vec![0f32; m * n];
        let mut operand = Operand::default();
        weights.apply_narrow(&x, k, &bias, &mut result, &mut operand);
        let flops = 2.0 * m as f64 * k as f64 * n as f64;
        let mut best = 0.0f64;
        let started = Instant::now();
        while started.elapsed().as_secs_f64() < budget_s {
            let t = Instant::now();
            weights.apply_narrow(&x, k, &bias, &mut result, &mut operand);
            std::hint::black_box(&result);
            best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
        }
        out.push(GemmRate {
            m,
            k,
            n,
            gflops: best,
        });
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINILM: Shape = Shape {
        layers: 6,
        hidden: 384,
        intermediate: 1536,
    };

    #[test]
    fn a_115_token_text_costs_about_two_and_a_half_gigaflops_in_minilm() {
        // 6 × 2 × (4·115·384² + 2·115·384·1536 + 2·115²·384) = 2.564e9
        let f = MINILM.flops(115);
        assert!((f - 2.5638e9).abs() / f < 1e-3, "{f}");
        assert_eq!(MINILM.gemms(10)[1], (10, 384, 1536));
    }

    #[test]
    fn gemm_rates_measure_every_shape() {
        let rates = gemm_rates(&[(8, 16, 8), (4, 8, 4)], 0.01).unwrap();
        assert_eq!(rates.len(), 2);
        assert!(rates.iter().all(|r| r.gflops > 0.0));
        assert_eq!((rates[0].m, rates[0].k, rates[0].n), (8, 16, 8));
    }

    #[test]
    fn kernel_rates_measure_every_shape_where_the_cpu_has_the_kernel() {
        use crate::Precision;
        for (precision, available) in [
            (Precision::Bf16, Precision::bf16_available()),
            (Precision::Int8, Precision::int8_available()),
        ] {
            // Inputs in whole groups of the int8 kernel's activations (64).
            match kernel_rates(precision, &[(8, 64, 32), (3, 128, 64)], 0.01) {
                None => assert!(!available, "{precision:?} runs here but was not measured"),
                Some(rates) => {
                    assert!(available);
                    assert_eq!(rates.len(), 2);
                    assert!(rates.iter().all(|r| r.gflops > 0.0));
                    assert_eq!((rates[1].m, rates[1].k, rates[1].n), (3, 128, 64));
                }
            }
        }
        assert!(kernel_rates(Precision::F32, &[(8, 64, 32)], 0.01).is_none());
    }
}

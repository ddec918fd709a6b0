//! Synthetic embeddings for benchmarks and tests, shaped roughly like sentence embeddings:
//! a two-level Gaussian mixture on the unit sphere.
//!
//! - Every vector shares one *common* direction (real embedding sets sit in a narrow cone:
//!   unrelated sentences still have a cosine of about 0.1).
//! - `topics` random directions stand for broad subjects; each of `clusters` groups of
//!   near-paraphrases belongs to one topic and has a random direction of its own. A cluster's
//!   centroid mixes the three with squared weights `common_share`, `topic_share` and the rest.
//! - A vector is its cluster's centroid plus Gaussian noise, normalised. The noise is
//!   anisotropic: the standard deviation of component `i` falls as `(i + 1)^-spectrum_decay`,
//!   scaled so its expected squared norm is `noise_energy`. Real embeddings concentrate their
//!   variance in a few tens of directions, and that low intrinsic dimension is what graph
//!   search relies on; isotropic noise in hundreds of dimensions would be a much harder (and
//!   less realistic) test.
//!
//! Expected cosines: `1 / (1 + noise_energy)` within a cluster, `(common_share + topic_share)`
//! times that within a topic, `common_share` times that otherwise. All clusters share one
//! noise shape and the levels are sharper than real data's continuum: treat figures from this
//! data as indicative, not as a substitute for real embeddings.

use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// The shape of a [`Mixture`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MixtureSpec {
    pub dim: usize,
    /// Broad subjects, each a random direction.
    pub topics: usize,
    /// Groups of near-paraphrases (the mixture's components), spread evenly over topics.
    pub clusters: usize,
    /// Squared weight of the direction all vectors share, in a centroid (0 to 1).
    pub common_share: f64,
    /// Squared weight of the topic's direction in a centroid (0 to 1 - `common_share`).
    pub topic_share: f64,
    /// Expected squared norm of the noise added to a unit centroid.
    pub noise_energy: f64,
    /// How fast noise falls off across components; 0 is isotropic.
    pub spectrum_decay: f64,
}

impl Default for MixtureSpec {
    fn default() -> Self {
        Self {
            dim: 384,
            topics: 50,
            clusters: 1_000,
            common_share: 0.15,
            topic_share: 0.35,
            noise_energy: 0.6,
            spectrum_decay: 0.5,
        }
    }
}

/// A fixed set of centroids and a noise shape to draw vectors from. Index vectors and
/// queries come from one mixture with different random streams, so queries are new points
/// from the same distribution.
#[derive(Clone, Debug)]
pub struct Mixture {
    spec: MixtureSpec,
    /// `clusters` unit vectors, one after another.
    centroids: Vec<f32>,
    /// Standard deviation of the noise on each component.
    noise_std: Vec<f64>,
}

impl Mixture {
    /// Centroids drawn from `seed`. Out-of-range values are clamped: counts to at least 1,
    /// shares into their ranges, energies to at least 0.
    pub fn new(spec: MixtureSpec, seed: u64) -> Self {
        let common_share = spec.common_share.clamp(0.0, 1.0);
        let spec = MixtureSpec {
            dim: spec.dim.max(1),
            topics: spec.topics.max(1),
            clusters: spec.clusters.max(1),
            common_share,
            topic_share: spec.topic_share.clamp(0.0, 1.0 - common_share),
            noise_energy: spec.noise_energy.max(0.0),
            spectrum_decay: spec.spectrum_decay,
        };
        let dim = spec.dim;
        let mut rng = StdRng::seed_from_u64(seed);
        let random_unit = |rng: &mut StdRng| -> Vec<f64> {
            let v: Vec<f64> = (0..dim).map(|_| gaussian(rng)).collect();
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            v.into_iter().map(|x| x / norm).collect()
        };
        let common = random_unit(&mut rng);
        let topics: Vec<Vec<f64>> = (0..spec.topics).map(|_| random_unit(&mut rng)).collect();
        let weights = [
            spec.common_share.sqrt(),
            spec.topic_share.sqrt(),
            (1.0 - spec.common_share - spec.topic_share).max(0.0).sqrt(),
        ];
        let mut centroids = Vec::with_capacity(dim * spec.clusters);
        for cluster in 0..spec.clusters {
            let topic = &topics[cluster % spec.topics];
            let own = random_unit(&mut rng);
            let centroid: Vec<f64> = (0..dim)
                .map(|i| weights[0] * common[i] + weights[1] * topic[i] + weights[2] * own[i])
                .collect();
            push_normalised(&centroid, &mut centroids);
        }
        let shape: Vec<f64> = (0..spec.dim)
            .map(|i| ((i + 1) as f64).powf(-spec.spectrum_decay))
            .collect();
        let energy: f64 = shape.iter().map(|s| s * s).sum();
        let scale = (spec.noise_energy / energy).sqrt();
        let noise_std = shape.iter().map(|s| s * scale).collect();
        Self {
            spec,
            centroids,
            noise_std,
        }
    }

    pub fn spec(&self) -> &MixtureSpec {
        &self.spec
    }

    /// Appends one unit vector of `dim` components to `out`.
    pub fn sample_into(&self, rng: &mut impl Rng, out: &mut Vec<f32>) {
        let dim = self.spec.dim;
        let cluster = rng.random_range(0..self.spec.clusters);
        let centroid = &self.centroids[cluster * dim..(cluster + 1) * dim];
        let point: Vec<f64> = centroid
            .iter()
            .zip(&self.noise_std)
            .map(|(&c, &std)| f64::from(c) + std * gaussian(rng))
            .collect();
        push_normalised(&point, out);
    }

    /// One unit vector.
    pub fn sample(&self, rng: &mut impl Rng) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.spec.dim);
        self.sample_into(rng, &mut out);
        out
    }

    /// The noise's effective number of dimensions, `(Σλ)² / Σλ²` over its variances.
    pub fn noise_effective_dim(&self) -> f64 {
        let variances = self.noise_std.iter().map(|s| s * s);
        let sum: f64 = variances.clone().sum();
        let sum_sq: f64 = variances.map(|v| v * v).sum();
        if sum_sq == 0.0 {
            0.0
        } else {
            sum * sum / sum_sq
        }
    }

    /// Expected cosines between two vectors of one cluster, of one topic, and of neither.
    pub fn expected_cosines(&self) -> [f64; 3] {
        let spec = &self.spec;
        let cluster = 1.0 / (1.0 + spec.noise_energy);
        [
            cluster,
            cluster * (spec.common_share + spec.topic_share),
            cluster * spec.common_share,
        ]
    }

    /// One line saying what this data is, for benchmark output.
    pub fn describe(&self) -> String {
        let spec = &self.spec;
        let [cluster, topic, other] = self.expected_cosines();
        format!(
            "synthetic two-level gaussian mixture, not real embeddings: {} dims, {} topics, \
             {} clusters, anisotropic gaussian noise (std of component i ~ (i+1)^-{}, \
             expected squared norm {}, effective dims {:.0}), normalised; expected cosine \
             {cluster:.2} within a cluster, {topic:.2} within a topic, {other:.2} otherwise",
            spec.dim,
            spec.topics,
            spec.clusters,
            spec.spectrum_decay,
            spec.noise_energy,
            self.noise_effective_dim(),
        )
    }
}

/// A standard normal draw (Box–Muller; one of the pair is thrown away, which is simpler than
/// caching it and fast enough for test data).
pub fn gaussian(rng: &mut impl Rng) -> f64 {
    // 1 - u is in (0, 1], so the logarithm is finite.
    let u: f64 = 1.0 - rng.random::<f64>();
    let v: f64 = rng.random::<f64>();
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

fn push_normalised(v: &[f64], out: &mut Vec<f32>) {
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
    out.extend(v.iter().map(|x| (x * inv) as f32));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum()
    }

    #[test]
    fn cosines_within_a_cluster_a_topic_and_across_are_about_as_the_spec_says() {
        let spec = |topics, clusters| MixtureSpec {
            dim: 256,
            topics,
            clusters,
            ..MixtureSpec::default()
        };
        let mean_cosine = |mixture: &Mixture| {
            let mut rng = StdRng::seed_from_u64(1);
            let samples: Vec<Vec<f32>> = (0..400).map(|_| mixture.sample(&mut rng)).collect();
            for sample in &samples {
                assert!(
                    (cosine(sample, sample) - 1.0).abs() < 1e-5,
                    "samples are unit vectors"
                );
            }
            samples
                .windows(2)
                .map(|p| cosine(&p[0], &p[1]))
                .sum::<f64>()
                / 399.0
        };
        // One cluster: every pair is a same-cluster pair. One topic, many clusters: nearly
        // every pair is a same-topic pair. Many topics: nearly every pair is unrelated.
        let cases = [
            (spec(1, 1), 0),
            (spec(1, 1_000), 1),
            (spec(1_000, 1_000), 2),
        ];
        for (spec, level) in cases {
            let mixture = Mixture::new(spec, 7);
            let expected = mixture.expected_cosines()[level];
            let mean = mean_cosine(&mixture);
            assert!(
                (mean - expected).abs() < 0.05,
                "level {level}: {mean} vs {expected}"
            );
        }
    }

    #[test]
    fn effective_dim_is_full_for_isotropic_noise_and_smaller_for_decaying_noise() {
        let isotropic = Mixture::new(
            MixtureSpec {
                dim: 100,
                spectrum_decay: 0.0,
                ..MixtureSpec::default()
            },
            1,
        );
        assert!((isotropic.noise_effective_dim() - 100.0).abs() < 1e-6);
        let decaying = Mixture::new(
            MixtureSpec {
                dim: 100,
                ..MixtureSpec::default()
            },
            1,
        );
        assert!(decaying.noise_effective_dim() < 50.0);
    }
}

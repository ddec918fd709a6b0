//! What the scrubber looks for: the kinds of secret and the policy that turns detectors off.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The default of [`ScrubPolicy::min_entropy`], in bits per character.
const DEFAULT_MIN_ENTROPY: f64 = 3.5;
/// The default of [`ScrubPolicy::min_entropy_len`], in characters.
const DEFAULT_MIN_ENTROPY_LEN: usize = 20;

/// A kind of secret: one per detector, and the name inside `[REDACTED:<kind>]`.
///
/// The declaration order is also the tie-break when two detectors claim exactly the same
/// bytes: the specific formats come first and the generic key=value and high-entropy
/// detectors last, so that `token=ghp_…` is reported as a `github_token`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// An AWS access key id: `AKIA…`, `ASIA…` and the other id prefixes, 20 characters.
    AwsAccessKey,
    /// An AWS secret access key: 40 characters after a name such as `aws_secret_access_key`.
    AwsSecretKey,
    /// An OpenAI API key: `sk-…`, `sk-proj-…`, `sk-svcacct-…`.
    // Spelled out: serde's snake_case would make it `open_ai_key`.
    #[serde(rename = "openai_key")]
    OpenAiKey,
    /// An Anthropic API key: `sk-ant-…`.
    AnthropicKey,
    /// A GitHub token: `ghp_…`, `gho_…`, `ghu_…`, `ghs_…`, `ghr_…` and `github_pat_…`.
    GithubToken,
    /// A Slack token: `xoxb-…`, `xoxp-…` and the other `xox?-` prefixes.
    SlackToken,
    /// A Google API key: `AIza…`.
    GoogleApiKey,
    /// A Stripe secret or restricted key: `sk_live_…`, `rk_test_…`.
    StripeKey,
    /// A JSON web token: three base64url segments, the first two JSON objects (`eyJ…`).
    Jwt,
    /// The token after `Bearer ` (an `Authorization` header, a curl line).
    BearerToken,
    /// A PEM private key block, `-----BEGIN … PRIVATE KEY-----` to its `-----END`.
    PrivateKey,
    /// The password in `scheme://user:password@host`.
    UrlPassword,
    /// The value in `password=…`, `"api_key": "…"` and the like.
    KeyValueSecret,
    /// A random-looking token shortly after a key-like name (`key`, `auth`, `token`, …).
    HighEntropy,
}

impl Kind {
    /// Every kind, in declaration (tie-break) order.
    pub const ALL: [Kind; 14] = [
        Kind::AwsAccessKey,
        Kind::AwsSecretKey,
        Kind::OpenAiKey,
        Kind::AnthropicKey,
        Kind::GithubToken,
        Kind::SlackToken,
        Kind::GoogleApiKey,
        Kind::StripeKey,
        Kind::Jwt,
        Kind::BearerToken,
        Kind::PrivateKey,
        Kind::UrlPassword,
        Kind::KeyValueSecret,
        Kind::HighEntropy,
    ];

    /// The snake_case name, as in serde and in the redaction marker.
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::AwsAccessKey => "aws_access_key",
            Kind::AwsSecretKey => "aws_secret_key",
            Kind::OpenAiKey => "openai_key",
            Kind::AnthropicKey => "anthropic_key",
            Kind::GithubToken => "github_token",
            Kind::SlackToken => "slack_token",
            Kind::GoogleApiKey => "google_api_key",
            Kind::StripeKey => "stripe_key",
            Kind::Jwt => "jwt",
            Kind::BearerToken => "bearer_token",
            Kind::PrivateKey => "private_key",
            Kind::UrlPassword => "url_password",
            Kind::KeyValueSecret => "key_value_secret",
            Kind::HighEntropy => "high_entropy",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which detectors run: `[scrub]` in engram.toml, and per tenant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrubPolicy {
    /// Whether anything is scrubbed at all.
    pub enabled: bool,
    /// Detectors turned off, e.g. `["high_entropy"]` for a tenant whose notes are full of hashes.
    pub disabled: Vec<Kind>,
    /// Shannon entropy, in bits per character, from which a token counts as random
    /// for the high-entropy detector.
    pub min_entropy: f64,
    /// The shortest token the high-entropy detector considers, in characters.
    pub min_entropy_len: usize,
}

impl Default for ScrubPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            disabled: Vec::new(),
            min_entropy: DEFAULT_MIN_ENTROPY,
            min_entropy_len: DEFAULT_MIN_ENTROPY_LEN,
        }
    }
}

impl ScrubPolicy {
    /// Checks the numbers, naming the offending field as `scrub.<field>`.
    ///
    /// [`Scrubber::new`](crate::Scrubber::new) clamps out-of-range numbers instead of
    /// failing, so call this where the configuration is loaded to tell the operator.
    pub fn validate(&self) -> Result<(), String> {
        if !self.min_entropy.is_finite() || !(0.0..=8.0).contains(&self.min_entropy) {
            return Err(format!(
                "scrub.min_entropy must be a number in 0..=8 (bits per character), got {}",
                self.min_entropy
            ));
        }
        if !(8..=256).contains(&self.min_entropy_len) {
            return Err(format!(
                "scrub.min_entropy_len must be in 8..=256 (characters), got {}",
                self.min_entropy_len
            ));
        }
        Ok(())
    }

    /// Whether the detector of `kind` runs under this policy.
    pub(crate) fn runs(&self, kind: Kind) -> bool {
        self.enabled && !self.disabled.contains(&kind)
    }

    /// The numbers [`Scrubber`](crate::Scrubber) uses: out-of-range ones clamped, a
    /// non-finite entropy replaced by the default.
    pub(crate) fn clamped(&self) -> (f64, usize) {
        let entropy = if self.min_entropy.is_finite() {
            self.min_entropy.clamp(0.0, 8.0)
        } else {
            DEFAULT_MIN_ENTROPY
        };
        (entropy, self.min_entropy_len.clamp(8, 256))
    }
}

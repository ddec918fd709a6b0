//! [`Scrubber`]: runs the detectors the policy enables and replaces what they find.

use std::borrow::Cow;

use crate::detect;
use crate::policy::{Kind, ScrubPolicy};

/// One replaced secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Redaction {
    /// Which detector found it (the first of several that claimed the same bytes).
    pub kind: Kind,
    /// Byte range in the original text; always on char boundaries.
    pub start: usize,
    pub end: usize,
}

/// A scrubbed text and what was taken out of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scrubbed<'a> {
    /// The text with each secret replaced by `[REDACTED:<kind>]`; borrowed when nothing was.
    pub text: Cow<'a, str>,
    /// The redactions in text order; disjoint.
    pub redactions: Vec<Redaction>,
}

impl Scrubbed<'_> {
    /// Whether nothing was redacted (the text is then borrowed, unchanged).
    pub fn is_clean(&self) -> bool {
        self.redactions.is_empty()
    }
}

/// The detectors a [`ScrubPolicy`] enables, ready to run.
///
/// The patterns are compiled once per process and shared, so building one is cheap; it is
/// `Send + Sync` and meant to be shared in an `Arc`.
#[derive(Clone, Debug)]
pub struct Scrubber {
    on: [bool; Kind::ALL.len()],
    min_entropy: f64,
    min_entropy_len: usize,
}

impl Default for Scrubber {
    /// The default policy: every detector.
    fn default() -> Self {
        Self::new(&ScrubPolicy::default())
    }
}

impl Scrubber {
    /// A scrubber for `policy`. Out-of-range numbers are clamped (see
    /// [`ScrubPolicy::validate`] to report them instead).
    pub fn new(policy: &ScrubPolicy) -> Self {
        let (min_entropy, min_entropy_len) = policy.clamped();
        Self {
            on: Kind::ALL.map(|k| policy.runs(k)),
            min_entropy,
            min_entropy_len,
        }
    }

    /// Finds the secrets in `text` and replaces each with `[REDACTED:<kind>]`.
    ///
    /// Only the secret is replaced, not the name before it (`password=[REDACTED:…]`).
    /// Scrubbing the result again changes nothing. Text without secrets comes back borrowed.
    pub fn scrub<'a>(&self, text: &'a str) -> Scrubbed<'a> {
        let redactions = detect::find(self, text, None);
        Scrubbed {
            text: render(text, &redactions),
            redactions,
        }
    }

    /// [`Scrubber::scrub`] for the value of a JSON object's `key`, which may name it a secret.
    pub(crate) fn scrub_value<'a>(&self, key: Option<&str>, text: &'a str) -> Scrubbed<'a> {
        let redactions = detect::find(self, text, key);
        Scrubbed {
            text: render(text, &redactions),
            redactions,
        }
    }

    pub(crate) fn on(&self, kind: Kind) -> bool {
        self.on[kind as usize]
    }

    pub(crate) fn any(&self) -> bool {
        self.on.iter().any(|&on| on)
    }

    pub(crate) fn min_entropy(&self) -> f64 {
        self.min_entropy
    }

    pub(crate) fn min_entropy_len(&self) -> usize {
        self.min_entropy_len
    }
}

/// `text` with `redactions` (sorted, disjoint) replaced by their markers.
fn render<'a>(text: &'a str, redactions: &[Redaction]) -> Cow<'a, str> {
    if redactions.is_empty() {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16 * redactions.len());
    let mut at = 0;
    for r in redactions {
        out.push_str(&text[at..r.start]);
        out.push_str("[REDACTED:");
        out.push_str(r.kind.as_str());
        out.push(']');
        at = r.end;
    }
    out.push_str(&text[at..]);
    Cow::Owned(out)
}

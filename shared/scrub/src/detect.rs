//! The detectors: each makes one pass over a segment of the text and proposes byte ranges.
//!
//! Every pattern is compiled once per process (`PATTERNS`) by the `regex` crate, whose
//! engines run in time linear in the text. The code around them reads at most a bounded
//! window (the high-entropy detector's look-back) or text no other name has claimed (a
//! key=value value), so a pass stays linear too. Clean text takes one pass (none at all
//! without a trigger, see `gate`); text with secrets takes a second over the pieces around
//! them (see [`find`]), and never more than [`MAX_ROUNDS`].

use std::sync::LazyLock;

use regex::Regex;

use crate::names::{classify, id_key_qualifier, is_hint, name_end};
use crate::policy::Kind;
use crate::scrubber::{Redaction, Scrubber};
use crate::value::{looks_like_words, looks_random, parse_value, plausible_value};

/// How far after the end of a key-like name a random token may start for the high-entropy
/// detector: `api key for prod: 9fKx…` but not a hash two sentences later.
const HINT_GAP: usize = 40;
/// The longest hint name (`authorization`), plus the character before it, that the
/// look-back window must hold.
const HINT_NAME_MAX: usize = 14;
/// An AWS secret access key is exactly this long.
const AWS_SECRET_LEN: usize = 40;

pub(crate) struct Patterns {
    /// Something that could start a secret or name one: no match, nothing to do.
    gate: Regex,
    marker: Regex,
    aws_access: Regex,
    aws_secret: Regex,
    sk: Regex,
    github: Regex,
    slack: Regex,
    google: Regex,
    stripe: Regex,
    jwt: Regex,
    bearer: Regex,
    pem: Regex,
    url: Regex,
    /// A key-like identifier and its separator: `password=`, `"api_key": `, `token => `.
    kv_head: Regex,
    /// The names the high-entropy detector looks back for.
    hint: Regex,
    /// Maximal runs of token characters, `=` only as trailing padding so that `key=abc` splits.
    run: Regex,
    /// A secret said in prose: `my password is hunter22`, `the api key was 9fKx2…`.
    prose: Regex,
    /// A secret on a command line: `--password hunter22`, `curl -u bob:pw`, `mysql -pHunter22`.
    cli: Regex,
}

fn compile(pattern: &str) -> Regex {
    Regex::new(pattern).expect("a constant pattern compiles")
}

pub(crate) static PATTERNS: LazyLock<Patterns> = LazyLock::new(|| {
    let kinds: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
    Patterns {
        gate: compile(
            r"(?i-u)akia|asia|agpa|aida|aroa|anpa|anva|aipa|sk-|sk_|rk_|gh[pousr]_|github_pat_|xox|aiza|eyj|bearer|-----begin|://|pass|pwd|secret|token|key|credential|creds|auth|-u\s|mysql",
        ),
        marker: compile(&format!(r"\[REDACTED:(?:{})\]", kinds.join("|"))),
        aws_access: compile(
            r"(?-u:\b)(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}(?-u:\b)",
        ),
        aws_secret: compile(
            r#"(?i-u)(?:aws[_.-]?secret(?:[_.-]?access)?(?:[_.-]?key)?|secret[_.-]?access[_.-]?key)[0-9]*(?:\\?["'])?(?:[ \t]*(?:=>|:=|=|:)[ \t]*|[ \t]+)(?:\\?["'])?([A-Za-z0-9/+=]{40,})"#,
        ),
        sk: compile(r"(?-u:\b)sk-[A-Za-z0-9_-]{20,}"),
        github: compile(r"(?-u:\b)(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"),
        slack: compile(r"(?-u:\b)xox[abprs]-[A-Za-z0-9-]{10,}"),
        // `{35,}`, not `{35}`: a longer run is redacted whole rather than leaving its tail.
        google: compile(r"(?-u:\b)AIza[0-9A-Za-z_-]{35,}"),
        stripe: compile(r"(?-u:\b)(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{16,}"),
        jwt: compile(r"(?-u:\b)eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        bearer: compile(r"(?i)(?-u:\b)bearer\s+([A-Za-z0-9._~+/=-]{16,})"),
        pem: compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----(?s:.*?)(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\z)",
        ),
        // The password may hold `@` and `:`: the greedy class takes everything up to the last
        // `@` before the host. `[`, `]` are excluded so a marker is never read as a password.
        url: compile(
            r#"(?i)(?-u:\b)[a-z][a-z0-9+.-]{0,30}://[^\s/?#@:\[\]"'<>]*:([^\s/?#\[\]"'<>]+)@[a-z0-9\[]"#,
        ),
        kv_head: compile(
            r#"(?i-u)[a-z0-9_.-]*(?:passphrase|password|passwd|pass|pwd|secret|token|key|credentials|credential)[0-9]*(?:\\?["'])?[ \t]*(?:=>|:=|=|:)[ \t]*"#,
        ),
        hint: compile(
            r"(?i-u)passphrase|password|passwd|pass|pwd|secret|token|apikey|key|authorization|auth|credentials|credential|creds|bearer",
        ),
        run: compile(r"[A-Za-z0-9+/_-]{8,}=*"),
        prose: compile(
            r#"(?i)(?-u:\b)(?:password|passwd|passphrase|passcode|api[ _-]?key|secret|token)\s+(?:is|was|will be)\s+["'“‘]?([^\s"'”’,;]{4,128})"#,
        ),
        cli: compile(
            r#"(?i)(?:^|\s)(?:--(?:password|passwd|pass|passphrase|token|api-key|apikey|secret|client-secret|auth-token)(?:=|\s+)["']?([^\s"']{3,256})|-u\s+[^\s:@]+:([^\s@]{3,256})|(?:mysql|mysqldump|mysqladmin)(?-u:\b)[^\n]{0,200}?\s-p([^\s]{3,256}))"#,
        ),
    }
});

/// `i`, or the nearest char boundary below it.
fn floor_boundary(text: &str, mut i: usize) -> usize {
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Whether any of the sorted, disjoint `spans` overlaps `start..end`.
fn overlaps(spans: &[(usize, usize)], start: usize, end: usize) -> bool {
    let i = spans.partition_point(|&(_, e)| e <= start);
    spans.get(i).is_some_and(|&(s, _)| s < end)
}

/// Sorts candidates by start, longest first, then by kind, and unites overlapping ones into
/// the first: the earliest-starting, longest match names the redaction, and no byte of a
/// losing candidate stays visible (which would leave part of a secret, and text that a
/// second scrub could find something new in).
pub(crate) fn merge(mut found: Vec<Redaction>) -> Vec<Redaction> {
    found.sort_unstable_by(|a, b| {
        a.start
            .cmp(&b.start)
            .then(b.end.cmp(&a.end))
            .then(a.kind.cmp(&b.kind))
    });
    let mut out: Vec<Redaction> = Vec::with_capacity(found.len());
    for r in found {
        match out.last_mut() {
            Some(last) if r.start < last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// At most this many rounds of rescanning the pieces around new finds (see [`find`]); real
/// text settles in the second, and the bound keeps crafted text linear.
const MAX_ROUNDS: usize = 8;

/// Finds every redaction in `text`, resolved: sorted and disjoint. `key` is the JSON object
/// key the text is the value of, if any: `{"password": "hunter2"}` has no separator inside
/// the string, the key says what it is.
///
/// Markers split the text into segments, each scanned on its own: a marker is never matched
/// again, nor read as the context of a match. Redacting then splits segments further, and
/// the detectors judge context (a value's shape, the name before a token), so the pieces of a
/// segment with new finds are scanned again, until nothing new turns up. The result is what
/// scrubbing the scrubbed text finds: nothing, which makes scrubbing idempotent.
pub(crate) fn find(s: &Scrubber, text: &str, key: Option<&str>) -> Vec<Redaction> {
    if !s.any() || text.is_empty() {
        return Vec::new();
    }
    let p = &*PATTERNS;
    let has_markers = text.contains("[REDACTED:");
    let whole = if has_markers {
        None
    } else {
        key.and_then(|key| whole_value(s, key, text))
    };
    let mut found: Vec<Redaction> = whole.into_iter().collect();
    if !p.gate.is_match(text) {
        return found;
    }
    // The segments to scan: the whole text unless markers split it (a list only then, so
    // that clean text costs no allocation).
    let whole_text = [(0, text.len())];
    let mut segments = Vec::new();
    if has_markers {
        let mut at = 0;
        for m in p.marker.find_iter(text) {
            segments.push((at, m.start()));
            at = m.end();
        }
        segments.push((at, text.len()));
    }
    let mut scan_whole = !has_markers;
    // A whole value covers everything: one round, for a specific kind to claim the same bytes.
    let rounds = if found.is_empty() { MAX_ROUNDS } else { 1 };
    for _ in 0..rounds {
        let list: &[(usize, usize)] = if scan_whole { &whole_text } else { &segments };
        let mut new = Vec::new();
        for &(a, b) in list {
            if a < b {
                segment(s, text, a, b, &mut new);
            }
        }
        if new.is_empty() {
            break;
        }
        let new = merge(new);
        segments = pieces_around(list, &new);
        scan_whole = false;
        found.extend(new);
    }
    merge(found)
}

/// The pieces of the `segments` that hold any of `new` (both sorted; each of `new` lies
/// within one segment), left once those are cut out. Segments without a new find are left
/// out: scanning them again would find nothing new.
fn pieces_around(segments: &[(usize, usize)], new: &[Redaction]) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    let mut i = 0;
    for &(a, b) in segments {
        let mut at = a;
        let mut cut = false;
        while i < new.len() && new[i].start < b {
            pieces.push((at, new[i].start));
            at = new[i].end;
            cut = true;
            i += 1;
        }
        if cut {
            pieces.push((at, b));
        }
    }
    pieces
}

/// The finds of every detector in `text[from..to]`, merged.
fn segment(s: &Scrubber, text: &str, from: usize, to: usize, out: &mut Vec<Redaction>) {
    let seg = &text[from..to];
    let mut found = Vec::new();
    prefixed(s, seg, &mut found);
    aws_secret(s, seg, &mut found);
    bearer(s, seg, &mut found);
    pem(s, seg, &mut found);
    url_password(s, seg, &mut found);
    if s.on(Kind::KeyValueSecret) {
        key_values(seg, &mut found);
        said(seg, &mut found);
    }
    let mut merged = merge(found);
    if s.on(Kind::HighEntropy) {
        let blocked: Vec<(usize, usize)> = merged.iter().map(|r| (r.start, r.end)).collect();
        high_entropy(s, seg, &blocked, &mut merged);
    }
    out.extend(merged.into_iter().map(|r| Redaction {
        start: r.start + from,
        end: r.end + from,
        ..r
    }));
}

/// Secrets said in prose or passed on a command line. Prose needs the value to look like a
/// secret, not a word (`the password is wrong`): a digit, a symbol, or mixed case with
/// length; a command-line value needs only not to be a variable or a placeholder.
fn said(text: &str, out: &mut Vec<Redaction>) {
    let p = &*PATTERNS;
    let variable =
        |v: &str| v.starts_with(['$', '<', '{', '%', '*']) || v.chars().all(|c| c == '*');
    for m in p.prose.find_iter(text) {
        let Some(caps) = p.prose.captures(m.as_str()) else {
            continue;
        };
        let Some(g) = caps.get(1) else { continue };
        // A sentence's full stop is not part of the password.
        let v = g.as_str().trim_end_matches(['.', '!', '?', ')']);
        let strong = v.bytes().any(|c| c.is_ascii_digit())
            || v.bytes().any(|c| !c.is_ascii_alphanumeric())
            || (v.len() >= 8
                && v.bytes().any(|c| c.is_ascii_uppercase())
                && v.bytes().any(|c| c.is_ascii_lowercase())
                && v[1..].bytes().any(|c| c.is_ascii_uppercase()));
        // A path or a URL is where something is, not the secret itself.
        let path = v.starts_with(['/', '~', '.']) || v.contains("://");
        if strong && !variable(v) && !path {
            let start = m.start() + g.start();
            push(out, Kind::KeyValueSecret, start, start + v.len());
        }
    }
    for m in p.cli.find_iter(text) {
        let Some(caps) = p.cli.captures(m.as_str()) else {
            continue;
        };
        if let Some(g) = (1..=3).find_map(|i| caps.get(i))
            && !variable(g.as_str())
        {
            let start = m.start() + g.start();
            push(out, Kind::KeyValueSecret, start, start + g.len());
        }
    }
}

/// The first group of each match of `re` in `text`, as absolute byte ranges.
///
/// `captures_iter` would allocate its captures up front, even for text without a match;
/// finding first keeps clean text allocation-free, and capturing on the match alone gives the
/// same group, since none of these patterns looks past its end.
fn groups<'t>(re: &'t Regex, text: &'t str) -> impl Iterator<Item = (usize, &'t str)> + 't {
    re.find_iter(text).filter_map(move |m| {
        let g = re.captures(m.as_str())?.get(1)?;
        Some((m.start() + g.start(), g.as_str()))
    })
}

fn push(out: &mut Vec<Redaction>, kind: Kind, start: usize, end: usize) {
    if start < end {
        out.push(Redaction { kind, start, end });
    }
}

/// The detectors that recognise a secret by its own prefix, context-free.
fn prefixed(s: &Scrubber, text: &str, out: &mut Vec<Redaction>) {
    let p = &*PATTERNS;
    let simple = [
        (Kind::AwsAccessKey, &p.aws_access),
        (Kind::GithubToken, &p.github),
        (Kind::SlackToken, &p.slack),
        (Kind::GoogleApiKey, &p.google),
        (Kind::StripeKey, &p.stripe),
        (Kind::Jwt, &p.jwt),
    ];
    for (kind, re) in simple {
        if s.on(kind) {
            for m in re.find_iter(text) {
                push(out, kind, m.start(), m.end());
            }
        }
    }
    if s.on(Kind::OpenAiKey) || s.on(Kind::AnthropicKey) {
        for m in p.sk.find_iter(text) {
            // Whatever follows `sk-ant-`, it is not an OpenAI key.
            let kind = if m.as_str().starts_with("sk-ant-") {
                Kind::AnthropicKey
            } else {
                Kind::OpenAiKey
            };
            if s.on(kind) && !prose(&m.as_str()[3..]) {
                push(out, kind, m.start(), m.end());
            }
        }
    }
}

/// Words without a digit (`sk-learn-compatible-estimators`, `Bearer YOUR_API_TOKEN_HERE`):
/// prose or a placeholder, where a key would be random. Both conditions, since a random key
/// reads as words now and then, but then nearly always has a digit too.
fn prose(t: &str) -> bool {
    !t.bytes().any(|c| c.is_ascii_digit()) && looks_like_words(t)
}

/// 40 characters after an AWS secret's name, with `=`, `:` or just whitespace between.
fn aws_secret(s: &Scrubber, text: &str, out: &mut Vec<Redaction>) {
    if !s.on(Kind::AwsSecretKey) {
        return;
    }
    for (at, v) in groups(&PATTERNS.aws_secret, text) {
        if v.len() == AWS_SECRET_LEN {
            push(out, Kind::AwsSecretKey, at, at + v.len());
        }
    }
}

/// The token after `Bearer `, unless it is [`prose`] (`bearer authentication-middleware`).
fn bearer(s: &Scrubber, text: &str, out: &mut Vec<Redaction>) {
    if !s.on(Kind::BearerToken) {
        return;
    }
    for (at, t) in groups(&PATTERNS.bearer, text) {
        if !prose(t) {
            push(out, Kind::BearerToken, at, at + t.len());
        }
    }
}

/// A PEM private key block; an unterminated one runs to the end of the text, since
/// everything after `BEGIN` is key material as far as we can tell.
fn pem(s: &Scrubber, text: &str, out: &mut Vec<Redaction>) {
    if s.on(Kind::PrivateKey) {
        for m in PATTERNS.pem.find_iter(text) {
            push(out, Kind::PrivateKey, m.start(), m.end());
        }
    }
}

/// The password of `scheme://user:password@host`, unless it is a variable or a mask.
fn url_password(s: &Scrubber, text: &str, out: &mut Vec<Redaction>) {
    if !s.on(Kind::UrlPassword) {
        return;
    }
    for (at, v) in groups(&PATTERNS.url, text) {
        let mut chars = v.chars();
        let first = chars.next();
        let mask = chars.all(|c| Some(c) == first) && v.len() > 1;
        if !(mask || v.starts_with('$') || v.starts_with('{') || v.starts_with('%')) {
            push(out, Kind::UrlPassword, at, at + v.len());
        }
    }
}

/// `name = value` with a key-like name: the value alone is redacted.
fn key_values(text: &str, out: &mut Vec<Redaction>) {
    // Names inside a value already read (`password=$(token=x)`) belong to that value; skipping
    // them also means every byte is read as a value at most once.
    let mut skip_until = 0;
    for m in PATTERNS.kv_head.find_iter(text) {
        if m.start() < skip_until {
            continue;
        }
        let head = m.as_str();
        let id_len = head
            .bytes()
            .position(|c| !(c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-')))
            .unwrap_or(head.len());
        // A segment of a colon path (`arn:aws:secretsmanager:…:secret:prod/db`), not a name.
        if m.start() > 0 && text.as_bytes()[m.start() - 1] == b':' {
            continue;
        }
        let Some(named) = classify(&head[..id_len]) else {
            continue;
        };
        let v = parse_value(text, m.end());
        skip_until = v.scanned;
        if v.start < v.end && plausible_value(&text[v.start..v.end], named.class) {
            push(out, Kind::KeyValueSecret, v.start, v.end);
        }
    }
}

/// The whole of a JSON string whose object key is a key-like name.
fn whole_value(s: &Scrubber, key: &str, text: &str) -> Option<Redaction> {
    let whole = |kind| Redaction {
        kind,
        start: 0,
        end: text.len(),
    };
    if let Some(named) = classify(key) {
        let aws = named.aws_secret
            && text.len() == AWS_SECRET_LEN
            && text
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'/' | b'+' | b'='));
        if aws && s.on(Kind::AwsSecretKey) {
            return Some(whole(Kind::AwsSecretKey));
        }
        if s.on(Kind::KeyValueSecret) && plausible_value(text, named.class) {
            return Some(whole(Kind::KeyValueSecret));
        }
    }
    let single_run = PATTERNS
        .run
        .find(text)
        .is_some_and(|m| m.start() == 0 && m.end() == text.len());
    (s.on(Kind::HighEntropy)
        && is_hint(key)
        && single_run
        && text.len() >= s.min_entropy_len()
        && looks_random(text, s.min_entropy()))
    .then(|| whole(Kind::HighEntropy))
}

/// Random-looking tokens shortly after a hint name (`api key for prod: 9fKx…`).
///
/// `blocked` is what the other detectors found, sorted and disjoint. The name
/// must be the nearest one before the token, at most [`HINT_GAP`] bytes before it, and
/// nothing between them may be blocked or another flagged token: a name vouches for the token
/// that follows it, not for one after a secret that was redacted (which, once the secret is
/// replaced by a shorter marker, could come within reach and make a second scrub find
/// something the first did not).
fn high_entropy(s: &Scrubber, text: &str, blocked: &[(usize, usize)], out: &mut Vec<Redaction>) {
    let min_len = s.min_entropy_len();
    let mut flagged_end = 0;
    for m in PATTERNS.run.find_iter(text) {
        if m.len() < min_len {
            continue;
        }
        // A run partly blocked is judged by the pieces left: those are what a second scrub
        // sees, cut off by the markers.
        let mut at = m.start();
        let first = blocked.partition_point(|&(_, e)| e <= m.start());
        let cuts = blocked[first..].iter().take_while(|&&(bs, _)| bs < m.end());
        let pieces = cuts
            .map(|&(bs, be)| {
                let piece = (at, bs.max(at));
                at = at.max(be);
                piece
            })
            .collect::<Vec<_>>();
        let last = (at, m.end().max(at));
        for (start, end) in pieces.into_iter().chain([last]) {
            if end - start >= min_len
                && looks_random(&text[start..end], s.min_entropy())
                && vouched(text, start, end, flagged_end, blocked)
            {
                push(out, Kind::HighEntropy, start, end);
                flagged_end = end;
            }
        }
    }
}

/// Whether a hint name vouches for the token at `start..end` (see [`high_entropy`]).
///
/// A `key` qualified as an id's (`public key`, `cache_key`) vouches for nothing. A token in
/// hex only (a commit, a digest) must be right next to the name (`key: 9fceb02…`), since
/// prose names them often: "the sha for the key fix is 9fceb02…".
fn vouched(
    text: &str,
    start: usize,
    end: usize,
    flagged_end: usize,
    blocked: &[(usize, usize)],
) -> bool {
    let lo = floor_boundary(text, start.saturating_sub(HINT_GAP + HINT_NAME_MAX));
    let mut nearest = None;
    for n in PATTERNS.hint.find_iter(&text[lo..start]) {
        let (ns, ne) = (lo + n.start(), lo + n.end());
        if let Some(e) = name_end(text, ns, ne) {
            // A qualifier inside another find is not there for a second scrub to see.
            let id = id_key_qualifier(text, ns, ne).is_some_and(|q| !overlaps(blocked, q, ns));
            nearest = (!id).then_some((ns, e));
        }
    }
    let Some((ns, ne)) = nearest else {
        return false;
    };
    let gap = &text[ne.min(start)..start];
    let hex = text[start..end].bytes().all(|c| c.is_ascii_hexdigit());
    let adjacent = gap.len() <= 6 && gap.bytes().all(|c| b" \t:=>\"'`".contains(&c));
    gap.len() <= HINT_GAP
        && (adjacent || !hex)
        && flagged_end <= ns
        && !overlaps(blocked, ns, start)
}

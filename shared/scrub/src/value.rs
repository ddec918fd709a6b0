//! Judging candidate secrets: values after key-like names, and random-looking tokens.
//!
//! These are the heuristics that keep false positives down. Memories are agents' notes and
//! conversations, so `password: <redacted>`, `token: none`, `password: String,` or
//! `api_key: self.api_key` must come through untouched, while `password=hunter2` must not.

use crate::names::{NameClass, for_each_part, hump, is_key_word};

/// Values that say something about a secret without being one (`token: none`,
/// `password: rotated`), placeholders, and the type names of code (`password: String,`).
const NOT_SECRETS: &[&str] = &[
    "none",
    "null",
    "nil",
    "true",
    "false",
    "yes",
    "no",
    "on",
    "off",
    "undefined",
    "empty",
    "unset",
    "notset",
    "n/a",
    "hidden",
    "masked",
    "removed",
    "omitted",
    "required",
    "optional",
    "default",
    "example",
    "placeholder",
    "changed",
    "rotated",
    "expired",
    "revoked",
    "invalid",
    "missing",
    "unknown",
    "present",
    "provided",
    "sensitive",
    "encrypted",
    "disabled",
    "enabled",
    "secret",
    "password",
    "token",
    "string",
    "boolean",
    "integer",
    "number",
    "object",
];

/// Where a value after a key-like name lies, and how far the detector read to find its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Parsed {
    /// The value, without quotes; empty when there is none (an unterminated quote).
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// Past the value and its closing quote: names before this are part of this value.
    pub(crate) scanned: usize,
}

/// Reads the value starting at `at`: `"…"`, `'…'`, `` `…` `` (with backslash escapes, on one
/// line), `\"…\"` (JSON inside a JSON string) or, unquoted, up to whitespace, `,`, `;`, `&` or
/// a quote, without a trailing `.` or unbalanced closing bracket (the end of a sentence, of a
/// `{password: x}`).
pub(crate) fn parse_value(text: &str, at: usize) -> Parsed {
    let b = text.as_bytes();
    let line_end = |i: usize| matches!(b[i], b'\n' | b'\r');
    match (b.get(at), b.get(at + 1)) {
        (Some(b'\\'), Some(&q @ (b'"' | b'\''))) => {
            let start = at + 2;
            let mut i = start;
            while i < b.len() && !line_end(i) {
                if b[i] == b'\\' && b.get(i + 1) == Some(&q) {
                    return Parsed {
                        start,
                        end: i,
                        scanned: i + 2,
                    };
                }
                i += 1;
            }
            Parsed {
                start,
                end: start,
                scanned: i,
            }
        }
        (Some(&q @ (b'"' | b'\'' | b'`')), _) => {
            let start = at + 1;
            let mut i = start;
            while i < b.len() && !line_end(i) {
                if b[i] == b'\\' {
                    i += 2;
                } else if b[i] == q {
                    return Parsed {
                        start,
                        end: i,
                        scanned: i + 1,
                    };
                } else {
                    i += 1;
                }
            }
            Parsed {
                start,
                end: start,
                scanned: i.min(b.len()),
            }
        }
        _ => {
            let stop = text[at..]
                .char_indices()
                .find(|&(_, c)| {
                    c.is_whitespace() || matches!(c, ',' | ';' | '&' | '"' | '\'' | '`')
                })
                .map_or(text.len(), |(i, _)| at + i);
            let mut end = stop;
            loop {
                let v = &text[at..end];
                let unbalanced = |close: u8, open: char| {
                    v.as_bytes().last() == Some(&close) && !v.contains(open)
                };
                if v.ends_with('.')
                    || unbalanced(b')', '(')
                    || unbalanced(b']', '[')
                    || unbalanced(b'}', '{')
                    || unbalanced(b'>', '<')
                {
                    end -= 1;
                } else {
                    break;
                }
            }
            Parsed {
                start: at,
                end,
                scanned: stop,
            }
        }
    }
}

fn contains_ignore_case(v: &str, word: &str) -> bool {
    v.as_bytes()
        .windows(word.len())
        .any(|w| w.eq_ignore_ascii_case(word.as_bytes()))
}

/// A file path: `/etc/app.conf`, `~/.ssh/id_rsa`, `./target`, `C:\Users`.
fn is_path(v: &str) -> bool {
    let b = v.as_bytes();
    v.starts_with('/')
        || v.starts_with("~/")
        || v.starts_with("./")
        || v.starts_with("../")
        || (b.len() > 2 && b[0].is_ascii_alphabetic() && b[1] == b':' && b[2] == b'\\')
}

/// A reference in code rather than a literal: `self.password`, `config.db.secret`,
/// `DB_PASSWORD`, `user_password`, `SecretString`. Only letters, `_` and `.` (a digit makes it a
/// candidate password again: `Secret123`).
fn is_reference(v: &str) -> bool {
    let b = v.as_bytes();
    if !b
        .iter()
        .all(|&c| c.is_ascii_alphabetic() || c == b'_' || c == b'.')
    {
        return false;
    }
    if !v.starts_with('.') && !v.ends_with('.') && v.contains('.') && !v.contains("..") {
        return true;
    }
    let mut keyish = false;
    for_each_part(v, |p| keyish |= is_key_word(p));
    keyish
}

/// A number, a ratio, a date or a time: `1024`, `3.5`, `212/212`, `2024-05-01`, `12:30`.
fn is_number(v: &str) -> bool {
    v.bytes().any(|c| c.is_ascii_digit())
        && v.bytes()
            .all(|c| c.is_ascii_digit() || matches!(c, b'.' | b',' | b'_' | b'-' | b':' | b'/'))
}

/// Whether the value after a key-like name of `class` may be a secret.
pub(crate) fn plausible_value(v: &str, class: NameClass) -> bool {
    let min = match class {
        NameClass::Password => 6,
        NameClass::Token => 8,
    };
    if v.chars().take(min).count() < min {
        return false;
    }
    if NOT_SECRETS.iter().any(|w| v.eq_ignore_ascii_case(w)) || contains_ignore_case(v, "redacted")
    {
        return false;
    }
    // Variables, templates, placeholders and code: `$DB_PASS`, `${X}`, `{{ .pw }}`, `<token>`,
    // `[REDACTED:…]`, `(x)`, `%(pw)s`, `&str`, `*self.pw`, `== "x"`, `Option<String>`,
    // `env::var("X")`, `get_password()`.
    let first = v.as_bytes()[0];
    if matches!(
        first,
        b'$' | b'{' | b'<' | b'[' | b'(' | b'%' | b'&' | b'*' | b'='
    ) {
        return false;
    }
    // `(` calls, `[` indexes (`os.environ["KEY"]`, `Optional[str]`).
    if v.contains(['(', '[']) || v.contains("{{") || v.contains("${") || v.contains("::") {
        return false;
    }
    if v.contains('<') && v.contains('>') {
        return false;
    }
    // A mask: `********`, `xxxxxxxx`.
    let mut chars = v.chars();
    let c0 = chars.next();
    if chars.all(|c| Some(c) == c0) {
        return false;
    }
    if v.contains("://") || is_path(v) || is_reference(v) || is_env_name(v) {
        return false;
    }
    // Numbers are no tokens (`token: 4096`); a password may be digits (a PIN), but not a
    // count, a ratio or a date (`tests pass: 212/212`).
    !(is_number(v) && (class == NameClass::Token || !v.bytes().all(|c| c.is_ascii_digit())))
}

/// An environment variable's name or a placeholder in capitals: `DB_PASSWORD`, `REPLACE_ME`,
/// `YOUR_API_KEY`.
fn is_env_name(v: &str) -> bool {
    v.contains('_')
        && v.bytes().any(|c| c.is_ascii_uppercase())
        && v.bytes()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == b'_')
}

/// Shannon entropy of `t`'s bytes, in bits per byte.
pub(crate) fn entropy(t: &str) -> f64 {
    let mut counts = [0u32; 256];
    for &c in t.as_bytes() {
        counts[usize::from(c)] += 1;
    }
    let n = t.len() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum()
}

/// An 8-4-4-4-12 hex UUID: an id, never a secret on its own.
pub(crate) fn is_uuid(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// A ULID (26 characters of Crockford's base32, the first at most `7`): Engram's own ids.
pub(crate) fn is_ulid(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() == 26
        && (b'0'..=b'7').contains(&b[0])
        && b.iter().all(|c| {
            c.is_ascii_digit()
                || (c.is_ascii_alphabetic()
                    && !matches!(c.to_ascii_uppercase(), b'I' | b'L' | b'O' | b'U'))
        })
}

/// Whether a run of letters could be a word: three letters or more, at least a quarter of
/// them vowels, and no more than four consonants in a row (`lengths` has five, but random
/// runs like `xkqzt` are far more common than such words in identifiers).
fn wordlike(run: &[u8]) -> bool {
    let vowel = |c: &u8| {
        matches!(
            c.to_ascii_lowercase(),
            b'a' | b'e' | b'i' | b'o' | b'u' | b'y'
        )
    };
    let vowels = run.iter().filter(|c| vowel(c)).count();
    let mut streak = 0;
    let mut max_streak = 0;
    for c in run {
        streak = if vowel(c) { 0 } else { streak + 1 };
        max_streak = max_streak.max(streak);
    }
    run.len() >= 3 && vowels * 4 >= run.len() && max_streak <= 4
}

/// Whether `t` reads as words joined by separators, digits or camelCase (`deploy_key_2024`,
/// `refreshAccessToken`, `/Users/Bob/Projects`) rather than random characters: at least 70%
/// of its letters sit in runs that could be words. Random keys break into short runs at every
/// digit, symbol and change of case, and their longer runs are unpronounceable.
pub(crate) fn looks_like_words(t: &str) -> bool {
    let b = t.as_bytes();
    let (mut letters, mut in_words, mut start) = (0usize, 0usize, None);
    for i in 0..=b.len() {
        let letter = i < b.len() && b[i].is_ascii_alphabetic();
        if let Some(s) = start
            && (!letter || hump(b, i))
        {
            letters += i - s;
            if wordlike(&b[s..i]) {
                in_words += i - s;
            }
            start = None;
        }
        if letter && start.is_none() {
            start = Some(i);
        }
    }
    letters > 0 && in_words * 10 >= letters * 7
}

/// Whether a token (from `[A-Za-z0-9+/_-]`, maybe with `=` padding) looks random enough to be a
/// key: a digit and a letter, at least `min_entropy` bits per character, and not a UUID, a
/// ULID, a path or words.
pub(crate) fn looks_random(t: &str, min_entropy: f64) -> bool {
    let b = t.as_bytes();
    let has = |f: fn(&u8) -> bool| b.iter().any(f);
    if !has(u8::is_ascii_digit) || !has(u8::is_ascii_alphabetic) || is_uuid(t) || is_ulid(t) {
        return false;
    }
    // A path in one case (`src/lib/v2/handlers`) rather than base64, which mixes cases.
    if t.contains('/') && !(has(u8::is_ascii_lowercase) && has(u8::is_ascii_uppercase)) {
        return false;
    }
    !looks_like_words(t) && entropy(t) >= min_entropy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_quoted_and_unquoted() {
        fn v(t: &str) -> (&str, usize) {
            let p = parse_value(t, 0);
            (&t[p.start..p.end], p.scanned)
        }
        assert_eq!(v("hunter2 and"), ("hunter2", 7));
        assert_eq!(v("hunter2."), ("hunter2", 8));
        assert_eq!(v("hunter2}"), ("hunter2", 8));
        assert_eq!(v("a(b)c)"), ("a(b)c)", 6));
        assert_eq!(v("\"a b\\\"c\" d"), ("a b\\\"c", 8));
        assert_eq!(v("'x' y"), ("x", 3));
        assert_eq!(v("\\\"pw1234\\\"}"), ("pw1234", 10));
        assert_eq!(v("\"open\nx"), ("", 5));
        assert_eq!(v("abc&x=1"), ("abc", 3));
    }

    #[test]
    fn non_secret_values_are_not_plausible() {
        for v in [
            "<redacted>",
            "***REDACTED***",
            "none",
            "Undefined",
            "String",
            "Option<String>",
            "&str",
            "$DB_PASS",
            "${DB_PASSWORD}",
            "{{ .Values.pw }}",
            "get_password()",
            "self.password",
            "user_password",
            "SecretString",
            "********",
            "/home/bob/project",
            "https://vault.example.com/x",
        ] {
            assert!(!plausible_value(v, NameClass::Password), "{v}");
        }
        assert!(!plausible_value("12345678", NameClass::Token));
        assert!(!plausible_value("212/212", NameClass::Password));
        assert!(!plausible_value("REPLACE_ME", NameClass::Token));
        assert!(!plausible_value("os.environ[", NameClass::Token));
        assert!(!plausible_value("2024-05-01", NameClass::Token));
        for v in [
            "hunter2",
            "Secret123",
            "12345678",
            "correct-horse-battery",
            "s3cr3t!x",
        ] {
            assert!(plausible_value(v, NameClass::Password), "{v}");
        }
        assert!(!plausible_value("hunter2", NameClass::Token));
    }

    #[test]
    fn randomness() {
        assert!(looks_random("9fKxA8q2LmZ0rT5vW1yB", 3.5));
        assert!(looks_random(
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4",
            3.5
        ));
        assert!(!looks_random("01a2351e-a148-7099-a85e-c65161825d03", 3.5));
        assert!(!looks_random("01HZX3K9Q2ABCDEFGHJKMNPQRS", 3.5));
        assert!(!looks_random("p99_latency_ms_2024_q3_dashboard", 3.5));
        assert!(!looks_random("src/handlers/v2/upload_worker", 3.5));
        assert!(!looks_random("aaaaaaaaaaaaaaaaaaaaaaaa1", 3.5));
        assert!(!looks_random("abcdefghijklmnopqrstuvwxyz", 3.5));
    }
}

//! Key-like names: which identifiers announce a secret.
//!
//! Names are judged by their parts, split at `_`, `.`, `-` and camelCase humps, so that
//! `DB_PASSWORD`, `db.password`, `dbPassword` and `x-api-key` all count but `compass`,
//! `bypass`, `keyboard` and `password_min_length` do not: only the last part (or the last two,
//! for `api_key`) says what the value is.

/// What a key-like name announces, for the key=value detector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NameClass {
    /// `password`, `passwd`, `pwd`, `pass`, `passphrase`: values of 6 characters and more.
    Password,
    /// `token`, `secret`, `api_key` and the other keys: values of 8 characters and more,
    /// since shorter ones are rarely real and numbers like `token: 1024` are common.
    Token,
}

/// A key-like name, as the key=value detector sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Named {
    pub(crate) class: NameClass,
    /// `aws_secret_access_key`, `secret_access_key`, `aws_secret`, `aws_secret_key`.
    pub(crate) aws_secret: bool,
}

const PASSWORD_WORDS: [&str; 5] = ["password", "passwd", "pwd", "pass", "passphrase"];
const TOKEN_WORDS: [&str; 5] = ["secret", "token", "apikey", "credential", "credentials"];
/// The parts before a final `key` that make it a secret's name (`api_key`, `private_key`);
/// a bare `key` (`primary key: id`, `sort key: date`) is no reason to redact a value.
const KEY_QUALIFIERS: [&str; 4] = ["api", "access", "private", "secret"];
/// Words that, anywhere in a name, say the high-entropy token after it is probably a secret.
const HINT_WORDS: [&str; 6] = ["key", "auth", "bearer", "authorization", "creds", "apikey"];

/// The words before a `key` that make it an id's name, not a secret's: `public key`,
/// `cache_key`, `idempotencyKey`, `sort key`.
const ID_KEY_QUALIFIERS: &[&str] = &[
    "public",
    "primary",
    "foreign",
    "unique",
    "composite",
    "natural",
    "surrogate",
    "sort",
    "partition",
    "shard",
    "routing",
    "cache",
    "idempotency",
    "dedup",
    "dedupe",
    "lookup",
    "index",
    "map",
    "hash",
    "group",
    "row",
    "object",
    "s3",
];

fn is_any(part: &str, words: &[&str]) -> bool {
    words.iter().any(|w| part.eq_ignore_ascii_case(w))
}

/// Whether `part` is one of the words that make a value suspect (used on values too:
/// `password: user_password` names a variable, not a password).
pub(crate) fn is_key_word(part: &str) -> bool {
    is_any(part, &PASSWORD_WORDS) || is_any(part, &TOKEN_WORDS) || is_any(part, &HINT_WORDS)
}

/// If the name at `start..end` of `text` is a `key` qualified as an id's (see
/// [`ID_KEY_QUALIFIERS`]), where the qualifier starts.
pub(crate) fn id_key_qualifier(text: &str, start: usize, end: usize) -> Option<usize> {
    if !text[start..end].eq_ignore_ascii_case("key") {
        return None;
    }
    let before = text[..start].trim_end_matches([' ', '_', '-', '.']);
    let b = before.as_bytes();
    let mut i = b.len();
    while i > 0 && b[i - 1].is_ascii_alphanumeric() {
        i -= 1;
    }
    let mut last = "";
    for_each_part(&before[i..], |p| last = p);
    (!last.is_empty() && is_any(last, ID_KEY_QUALIFIERS)).then(|| before.len() - last.len())
}

/// Whether a camelCase hump starts at `b[i]`: `apiKey` before `K`, `APIKey` before `K`.
/// Digits stay with the letters before them (`key2`, `x86`).
pub(crate) fn hump(b: &[u8], i: usize) -> bool {
    if i == 0 || !b[i].is_ascii_uppercase() {
        return false;
    }
    let p = b[i - 1];
    p.is_ascii_lowercase()
        || p.is_ascii_digit()
        || (p.is_ascii_uppercase() && b.get(i + 1).is_some_and(u8::is_ascii_lowercase))
}

/// Calls `f` with each part of `id`, in order. Anything but ASCII letters and digits
/// separates parts, so a multi-byte character never ends up inside one.
pub(crate) fn for_each_part<'a>(id: &'a str, mut f: impl FnMut(&'a str)) {
    let b = id.as_bytes();
    let mut start = None;
    for i in 0..b.len() {
        if !b[i].is_ascii_alphanumeric() {
            if let Some(s) = start.take() {
                f(&id[s..i]);
            }
            continue;
        }
        match start {
            Some(s) if hump(b, i) => {
                f(&id[s..i]);
                start = Some(i);
            }
            Some(_) => {}
            None => start = Some(i),
        }
    }
    if let Some(s) = start {
        f(&id[s..]);
    }
}

/// The last three parts of `id`, the last first, with trailing digits dropped from the last
/// one (`token2`); missing parts are empty.
fn last_parts(id: &str) -> [&str; 3] {
    let mut last = ["", "", ""];
    for_each_part(id, |p| last = [p, last[0], last[1]]);
    last[0] = last[0].trim_end_matches(|c: char| c.is_ascii_digit());
    last
}

/// What `id` announces, if it is a key-like name for the key=value detector.
pub(crate) fn classify(id: &str) -> Option<Named> {
    let [last, prev, prev2] = last_parts(id);
    let eq = |a: &str, b: &str| a.eq_ignore_ascii_case(b);
    if is_any(last, &PASSWORD_WORDS) {
        return Some(Named {
            class: NameClass::Password,
            aws_secret: false,
        });
    }
    let aws_secret = if eq(last, "secret") {
        eq(prev, "aws")
    } else if eq(last, "key") {
        if !is_any(prev, &KEY_QUALIFIERS) {
            return None;
        }
        (eq(prev, "access") && eq(prev2, "secret")) || (eq(prev, "secret") && eq(prev2, "aws"))
    } else if is_any(last, &TOKEN_WORDS) {
        false
    } else {
        return None;
    };
    Some(Named {
        class: NameClass::Token,
        aws_secret,
    })
}

/// Whether `id` is a name after which a random-looking token is probably a secret: a
/// key=value name, or one whose last part is a hint such as `key` or `auth`.
pub(crate) fn is_hint(id: &str) -> bool {
    classify(id).is_some() || {
        let [last, ..] = last_parts(id);
        is_any(last, &HINT_WORDS) || is_any(last, &TOKEN_WORDS)
    }
}

/// Where the name the name regex found at `start..end` of `text` really ends, if it is a
/// whole part of an identifier there (`api_key`, `dbPassword`, `TOKEN2`) rather than a
/// piece of a longer word (`keyboard`, `monkey`, `tokenizer`).
pub(crate) fn name_end(text: &str, start: usize, end: usize) -> Option<usize> {
    let b = text.as_bytes();
    let first = b[start];
    let last = b[end - 1];
    let starts_part = start == 0 || !b[start - 1].is_ascii_alphanumeric() || hump(b, start);
    if !starts_part {
        return None;
    }
    let mut e = end;
    while e < b.len() && b[e].is_ascii_digit() {
        e += 1;
    }
    let ends_part = e == b.len()
        || !b[e].is_ascii_alphanumeric()
        || (b[e].is_ascii_uppercase() && last.is_ascii_lowercase());
    // An all-caps name continuing in capitals (`TOKENS`) is a longer word.
    (ends_part && first.is_ascii_alphabetic()).then_some(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_split_at_separators_and_humps() {
        let mut parts = Vec::new();
        for_each_part("AWS_secretAccessKey.APIKey-x86é2fa", |p| parts.push(p));
        assert_eq!(
            parts,
            ["AWS", "secret", "Access", "Key", "API", "Key", "x86", "2fa"]
        );
    }

    #[test]
    fn classify_reads_the_last_parts() {
        let class = |id| classify(id).map(|n| (n.class, n.aws_secret));
        assert_eq!(class("DB_PASSWORD"), Some((NameClass::Password, false)));
        assert_eq!(class("dbPass"), Some((NameClass::Password, false)));
        assert_eq!(class("x-api-key"), Some((NameClass::Token, false)));
        assert_eq!(class("apiKey"), Some((NameClass::Token, false)));
        assert_eq!(class("apikey"), Some((NameClass::Token, false)));
        assert_eq!(class("GITHUB_TOKEN"), Some((NameClass::Token, false)));
        assert_eq!(class("token2"), Some((NameClass::Token, false)));
        assert_eq!(
            class("AWS_SECRET_ACCESS_KEY"),
            Some((NameClass::Token, true))
        );
        assert_eq!(class("SecretAccessKey"), Some((NameClass::Token, true)));
        assert_eq!(class("aws_secret"), Some((NameClass::Token, true)));
        assert_eq!(class("client_secret"), Some((NameClass::Token, false)));
        for id in [
            "key",
            "primary_key",
            "compass",
            "bypass",
            "password_min_length",
            "max_tokens",
            "keyboard",
        ] {
            assert_eq!(classify(id), None, "{id}");
        }
    }

    #[test]
    fn names_must_be_whole_parts() {
        let end = |t: &str, n: &str| {
            let s = t.find(n).expect("name in text");
            name_end(t, s, s + n.len())
        };
        assert_eq!(end("my api_key is", "key"), Some(10));
        assert_eq!(end("apiKey", "Key"), Some(6));
        assert_eq!(end("TOKEN2 x", "TOKEN"), Some(6));
        assert_eq!(end("keyboard", "key"), None);
        assert_eq!(end("monkey", "key"), None);
        assert_eq!(end("TOKENS", "TOKEN"), None);
    }

    #[test]
    fn keys_of_ids_are_qualified() {
        let q = |t: &str| {
            let s = t.rfind("key").or_else(|| t.rfind("Key")).expect("key");
            id_key_qualifier(t, s, s + 3)
        };
        assert_eq!(q("the public key"), Some(4));
        assert_eq!(q("PUBLIC KEY".to_lowercase().as_str()), Some(0));
        assert_eq!(q("myCacheKey"), Some(2));
        assert_eq!(q("idempotency_key"), Some(0));
        assert_eq!(q("api key"), None);
        assert_eq!(q("key"), None);
        assert_eq!(q("republic key"), None);
    }
}

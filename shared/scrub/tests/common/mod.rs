//! Fake secrets for the tests, generated so that no real-looking key sits in the source.

#![allow(dead_code)]

pub const ALNUM: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
pub const UPPER_DIGITS: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
pub const B64: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
pub const B64URL: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// `len` characters of `alphabet`, pseudo-random but fixed by `seed` (xorshift).
pub fn fake(alphabet: &str, len: usize, seed: u64) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let a = alphabet.as_bytes();
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(a[(x % a.len() as u64) as usize])
        })
        .collect()
}

pub fn github(seed: u64) -> String {
    format!("ghp_{}", fake(ALNUM, 36, seed))
}

pub fn aws_access(seed: u64) -> String {
    format!("AKIA{}", fake(UPPER_DIGITS, 16, seed))
}

pub fn aws_secret(seed: u64) -> String {
    fake(B64, 40, seed)
}

pub fn openai(seed: u64) -> String {
    format!("sk-proj-{}", fake(B64URL, 48, seed))
}

pub fn anthropic(seed: u64) -> String {
    format!("sk-ant-api03-{}", fake(B64URL, 40, seed))
}

pub fn slack(seed: u64) -> String {
    format!(
        "xoxb-{}-{}",
        fake("0123456789", 12, seed),
        fake(ALNUM, 24, seed + 1)
    )
}

pub fn google(seed: u64) -> String {
    format!("AIza{}", fake(B64URL, 35, seed))
}

pub fn stripe(seed: u64) -> String {
    // Assembled, so that the source holds no `sk_live_` literal for scanners to trip on.
    format!("{}_{}_{}", "sk", "live", fake(ALNUM, 24, seed))
}

pub fn jwt(seed: u64) -> String {
    format!(
        "eyJhbGciOiJIUzI1NiJ9.eyJ{}.{}",
        fake(B64URL, 30, seed),
        fake(B64URL, 43, seed + 1)
    )
}

pub fn pem(seed: u64) -> String {
    let body: Vec<String> = (0..4).map(|i| fake(B64, 64, seed + i)).collect();
    format!(
        "-----BEGIN RSA PRIVATE KEY-----\n{}\n-----END RSA PRIVATE KEY-----",
        body.join("\n")
    )
}

/// A random token for the high-entropy detector: base62, with at least one digit and letter.
pub fn random_token(len: usize, seed: u64) -> String {
    let mut t = fake(ALNUM, len, seed);
    t.replace_range(0..2, "q7");
    t
}

//! The scrubber against corpora: benign lines that must come back unchanged, and secrets of
//! every kind that must not.

mod common;

use std::borrow::Cow;

use common::*;
use engram_scrub::{Kind, Redaction, ScrubPolicy, Scrubber};

/// Agents' notes, conversations, logs, code and JSON without a secret in them.
const BENIGN: &[&str] = &[
    "the deploy to staging fails when the migration lock is held by another job",
    "Caroline: I'm keen on counseling or working in mental health",
    "Melanie: I painted a lake sunrise last year, it's special to me.",
    "retry the upload when the gateway answers 502",
    "event 01a2351e-a148-7099-a85e-c65161825d03 was superseded",
    "superseded by 01A2351E-A148-7099-A85E-C65161825D03 at 2024-05-01T12:00:00Z",
    "commit 3eecdb3f9a1b7c2d4e5f60718293a4b5c6d7e8f9 fixed the flaky test",
    "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "md5 of the artifact is d41d8cd98f00b204e9800998ecf8427e",
    "see https://example.com/a/b?x=1 for the runbook",
    "clone it with git clone https://github.com/org/repo.git",
    "the api key is in vault",
    "the password is in the vault, ask Bob",
    "token budget 1024",
    "max_tokens: 4096",
    "passwords must be rotated every 90 days",
    "set password_min_length=12 in the auth config",
    "token: none",
    "password: <redacted>",
    "secret: true",
    "api_key: null",
    "password: ${DB_PASSWORD}",
    "export PGPASSWORD=$DB_PASS",
    "the user reset their password: rotated",
    "primary key: user_id",
    "sort key: created_at",
    "the key insight is that retries hide the real failure",
    "she passed the exam and took the compass: north by northwest",
    "bypass: enabled for internal traffic",
    "{\"user\": \"bob\", \"count\": 3, \"tags\": [\"a\", \"b\"]}",
    "{\"event\": \"memory_added\", \"scope\": \"team/alpha\", \"token_count\": 512}",
    "let password = String::new();",
    "fn login(user: &str, password: &str) -> Result<Session, Error> {",
    "pub struct Credentials { pub password: String, pub token: Option<String> }",
    "    api_key: self.api_key.clone(),",
    "    password: user_password,",
    "if password == expected { return Ok(()); }",
    "const MAX_TOKEN_LEN: usize = 8192;",
    "cd /usr/local/lib/x86_64-linux-gnu && ls",
    "the key file lives at /etc/ssl/private/server2024.key",
    "use a bearer token in the Authorization header",
    "the bearer of this letter is my friend",
    "Authorization: Bearer <token>",
    "curl -H \"Authorization: Bearer $TOKEN\" https://api.example.com",
    "postgres://localhost:5432/app?sslmode=disable",
    "ssh git@github.com and run make test",
    "meeting moved to 2024-06-03 14:30 UTC, room 4B",
    "the job id is job_01HZX3K9Q2 and it took 3.5s",
    "the p99 latency key metric is p99_latency_ms_2024_q3_dashboard",
    "scikit uses sk-learn-compatible-estimators-and-pipelines",
    "ticket ASIAPACIFIC is about the region",
    "ran cargo test -p engram-facts --release; 212 passed",
    "the JWT header says eyJhbGciOiJIUzI1NiJ9 and nothing else",
    "Token: the model's context window is 200k",
    "secret: see 1password",
    "hash: 5f4dcc3b5aa765d61d8327deb882cf99",
    "tokens=[1, 2, 3]",
    "monkey business at the keyboard",
    "the pwd is /home/bob/project",
    "pwd: /home/bob/project",
    "already scrubbed: password=[REDACTED:key_value_secret] and [REDACTED:github_token]",
    "naïve café — 東京 — emoji 🙂 and ünïcödé text",
    "user asked to rotate the API key; done, new key stored in 1Password under 'prod-openai'",
    "the token refresh job runs every 15 minutes (cron: */15 * * * *)",
    "Key takeaways: caching helped, batching helped more",
    "secret sauce: the projector batches 512 events per ack",
    "auth: oauth2 with PKCE, client id 1234-abcd.apps.googleusercontent.com",
    "credentials: in AWS Secrets Manager, arn:aws:secretsmanager:us-east-1:123456789012:secret:prod/db-AbCdEf",
    "AWS region us-east-1, account 123456789012, role arn:aws:iam::123456789012:role/deploy",
    "GITHUB_TOKEN: ${{ secrets.GITHUB_TOKEN }}",
    "const apiKey = process.env.OPENAI_API_KEY;",
    "api_key = os.environ[\"OPENAI_API_KEY\"]",
    "let token = std::env::var(\"ENGRAM_TOKEN\")?;",
    "password: Optional[str] = None",
    "secret_key: SecretStr = Field(...)",
    "private_key_path: /etc/engram/tls/key.pem",
    "the cache key is tenant:scope:01HZX3K9Q2ABCDEF and it expires in 5m",
    "idempotency key: 7f9c2ba4e88f827d616045507605853e",
    "the key for memory 01HZX3K9Q2ABCDEFGHJKMNPQRS is stale",
    "the git sha for the key fix is 9fceb02d0ae598e95dc970b74767f19372d61af8",
    "input_tokens=15234 output_tokens=2048",
    "tests pass: 212/212",
    "Bearer tokens expire after 3600 seconds",
    "x-api-key: REPLACE_ME",
    "{\"apiKey\": \"YOUR_API_KEY\", \"client_secret\": \"<client-secret>\", \"token\": null}",
    "pwd=$(pwd)",
    "the model name is claude-3-5-sonnet-20241022",
    "secretary: Alice, tokenizer: bert-base-uncased, keyspace: engram_prod",
];

#[test]
fn benign_lines_come_back_unchanged() {
    let scrubber = Scrubber::default();
    assert!(BENIGN.len() >= 40);
    for line in BENIGN {
        let out = scrubber.scrub(line);
        assert!(out.is_clean(), "{line:?} -> {:?}", out.text);
        assert!(matches!(out.text, Cow::Borrowed(_)), "{line:?}");
    }
}

/// `(kind, text, secret)`: the text holds the secret, which must be redacted as `kind`.
fn positives() -> Vec<(Kind, String, String)> {
    let mut p = Vec::new();
    let mut add = |kind, text: String, secret: &str| p.push((kind, text, secret.to_owned()));
    let key = "AKIAIOSFODNN7EXAMPLE";
    add(
        Kind::AwsAccessKey,
        format!("aws_access_key_id = {key}"),
        key,
    );
    let key = aws_access(1);
    add(
        Kind::AwsAccessKey,
        format!("the CI uses {key} for uploads"),
        &key,
    );
    let key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    add(
        Kind::AwsSecretKey,
        format!("aws_secret_access_key = {key}"),
        key,
    );
    let key = aws_secret(2);
    add(
        Kind::AwsSecretKey,
        format!("{{\"SecretAccessKey\": \"{key}\"}}"),
        &key,
    );
    add(Kind::AwsSecretKey, format!("AWS_SECRET \"{key}\""), &key);
    let key = openai(3);
    add(Kind::OpenAiKey, format!("OPENAI_API_KEY={key}"), &key);
    let key = format!("sk-{}", fake(ALNUM, 48, 4));
    add(Kind::OpenAiKey, format!("use {key} for the eval run"), &key);
    let key = anthropic(5);
    add(Kind::AnthropicKey, format!("ANTHROPIC_API_KEY={key}"), &key);
    let key = anthropic(6);
    add(Kind::AnthropicKey, format!("the key is {key}."), &key);
    let key = github(7);
    add(Kind::GithubToken, format!("GITHUB_TOKEN={key}"), &key);
    let key = format!("github_pat_{}_{}", fake(ALNUM, 22, 8), fake(ALNUM, 59, 9));
    add(Kind::GithubToken, format!("push with {key} please"), &key);
    let key = slack(10);
    add(Kind::SlackToken, format!("SLACK_BOT_TOKEN={key}"), &key);
    let key = slack(11).replace("xoxb", "xoxp");
    add(Kind::SlackToken, format!("the bot posts with {key}"), &key);
    let key = google(12);
    add(
        Kind::GoogleApiKey,
        format!("maps key {key} expires soon"),
        &key,
    );
    let key = google(13);
    add(Kind::GoogleApiKey, format!("?key={key}&q=1"), &key);
    let key = stripe(14);
    add(Kind::StripeKey, format!("STRIPE_KEY={key}"), &key);
    let key = format!("{}_{}_{}", "rk", "test", fake(ALNUM, 24, 15));
    add(
        Kind::StripeKey,
        format!("restricted key {key} for the webhook"),
        &key,
    );
    let key = jwt(16);
    add(Kind::Jwt, format!("session cookie {key}"), &key);
    add(Kind::Jwt, format!("Authorization: Bearer {key}"), &key);
    let key = fake(B64URL, 40, 17);
    add(
        Kind::BearerToken,
        format!("Authorization: Bearer {key}"),
        &key,
    );
    let key = format!("{}.{}", fake(ALNUM, 20, 18), fake(ALNUM, 12, 19));
    add(
        Kind::BearerToken,
        format!("curl -H 'authorization: bearer {key}' x"),
        &key,
    );
    let key = pem(20);
    add(
        Kind::PrivateKey,
        format!("here it is:\n{key}\nthanks"),
        &key,
    );
    // A key inside a JSON string, its newlines escaped.
    let key = pem(21).replace("RSA ", "").replace('\n', "\\n");
    add(Kind::PrivateKey, format!("{{\"pk\": \"{key}\"}}"), &key);
    add(
        Kind::UrlPassword,
        "https://bob:s3cret@db.example.com/x".into(),
        "s3cret",
    );
    add(
        Kind::UrlPassword,
        "redis://:Zx9!pa@ss@cache:6379/0".into(),
        "Zx9!pa@ss",
    );
    add(
        Kind::UrlPassword,
        "mongodb+srv://app:hunter22@cluster0.example.net".into(),
        "hunter22",
    );
    add(Kind::KeyValueSecret, "password=hunter2".into(), "hunter2");
    add(
        Kind::KeyValueSecret,
        "DB_PASSWORD='c0rrect horse'".into(),
        "c0rrect horse",
    );
    add(
        Kind::KeyValueSecret,
        "{\"client_secret\": \"abcd1234efgh\"}".into(),
        "abcd1234efgh",
    );
    add(
        Kind::KeyValueSecret,
        "refresh_token => \"rt-7781-xx-9\"".into(),
        "rt-7781-xx-9",
    );
    add(
        Kind::KeyValueSecret,
        "userPwd: Summer2024!".into(),
        "Summer2024!",
    );
    add(
        Kind::KeyValueSecret,
        "--password=p4ssw0rd!".into(),
        "p4ssw0rd!",
    );
    add(
        Kind::KeyValueSecret,
        "credentials: user1:Passw0rd".into(),
        "user1:Passw0rd",
    );
    let key = random_token(32, 22);
    add(Kind::HighEntropy, format!("the deploy key is {key}"), &key);
    let key = fake(B64, 28, 23);
    add(
        Kind::HighEntropy,
        format!("Authorization: Basic {key}=="),
        &key,
    );
    let key = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    add(Kind::HighEntropy, format!("signing key {key}"), key);
    p
}

#[test]
fn every_kind_is_found_and_removed() {
    let scrubber = Scrubber::default();
    let cases = positives();
    for kind in Kind::ALL {
        let n = cases.iter().filter(|(k, ..)| *k == kind).count();
        assert!(n >= 2, "{kind}: {n} examples");
    }
    for (kind, text, secret) in &cases {
        let out = scrubber.scrub(text);
        assert!(
            out.redactions.iter().any(|r| r.kind == *kind),
            "{kind}: {text:?} -> {:?}",
            out.redactions
        );
        assert!(
            !out.text.contains(secret.as_str()),
            "{kind}: {:?}",
            out.text
        );
        assert!(
            out.text.contains(&format!("[REDACTED:{kind}]")),
            "{kind}: {:?}",
            out.text
        );
        let again = scrubber.scrub(&out.text);
        assert!(again.is_clean(), "{kind}: rescrub of {:?}", out.text);
    }
}

fn scrub(text: &str) -> String {
    Scrubber::default().scrub(text).text.into_owned()
}

#[test]
fn only_the_secret_is_replaced() {
    assert_eq!(
        scrub("password=hunter2"),
        "password=[REDACTED:key_value_secret]"
    );
    assert_eq!(
        scrub("https://bob:s3cret@db.example.com/x"),
        "https://bob:[REDACTED:url_password]@db.example.com/x"
    );
    let token = fake(ALNUM, 32, 30);
    assert_eq!(
        scrub(&format!("Authorization: Bearer {token}")),
        "Authorization: Bearer [REDACTED:bearer_token]"
    );
    assert_eq!(
        scrub("{\"password\": \"hunter2\", \"user\": \"bob\"}"),
        "{\"password\": \"[REDACTED:key_value_secret]\", \"user\": \"bob\"}"
    );
    assert_eq!(
        scrub("the db password: hunter22."),
        "the db password: [REDACTED:key_value_secret]."
    );
    assert_eq!(
        scrub("{password: hunter22}"),
        "{password: [REDACTED:key_value_secret]}"
    );
}

#[test]
fn redactions_report_byte_ranges_of_the_original() {
    let text = "é password=hunter2 ü";
    let out = Scrubber::default().scrub(text);
    assert_eq!(
        out.redactions,
        [Redaction {
            kind: Kind::KeyValueSecret,
            start: 12,
            end: 19
        }]
    );
    assert_eq!(&text[12..19], "hunter2");
}

#[test]
fn overlaps_go_to_the_earliest_longest_and_most_specific() {
    let scrubber = Scrubber::default();
    let kinds = |t: &str| -> Vec<Kind> {
        scrubber
            .scrub(t)
            .redactions
            .iter()
            .map(|r| r.kind)
            .collect()
    };
    // Same bytes: the specific kind wins over key=value and high entropy.
    assert_eq!(kinds(&format!("token={}", github(40))), [Kind::GithubToken]);
    assert_eq!(
        kinds(&format!("api_key: \"{}\"", openai(41))),
        [Kind::OpenAiKey]
    );
    // A JWT after `Bearer` is reported as a JWT.
    assert_eq!(kinds(&format!("Bearer {}", jwt(42))), [Kind::Jwt]);
    // `sk-ant-` is Anthropic's, not OpenAI's.
    assert_eq!(kinds(&anthropic(43)), [Kind::AnthropicKey]);
    // The value starts before the embedded token, so key=value wins and covers it all.
    let text = format!("password=pre-{}", github(44));
    let out = scrubber.scrub(&text);
    assert_eq!(out.text, "password=[REDACTED:key_value_secret]");
    // Two secrets: two redactions, in order.
    let text = format!("{} and {}", aws_access(45), github(46));
    assert_eq!(kinds(&text), [Kind::AwsAccessKey, Kind::GithubToken]);
}

#[test]
fn an_unterminated_private_key_runs_to_the_end() {
    let text = format!(
        "key:\n-----BEGIN OPENSSH PRIVATE KEY-----\n{}\nmore",
        fake(B64, 70, 50)
    );
    assert_eq!(scrub(&text), "key:\n[REDACTED:private_key]");
    let text = format!(
        "-----BEGIN PGP PRIVATE KEY BLOCK-----\n{}\n-----END PGP PRIVATE KEY BLOCK----- after",
        fake(B64, 64, 51)
    );
    assert_eq!(scrub(&text), "[REDACTED:private_key] after");
    // A public key or a certificate is not a secret.
    let text = format!(
        "-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----",
        fake(B64, 64, 52)
    );
    assert_eq!(scrub(&text), text);
    let text = format!(
        "my public key is ssh-ed25519 AAAAC3NzaC1lZDI1NTE5{} bob@laptop",
        fake(B64, 32, 53)
    );
    assert_eq!(scrub(&text), text);
}

#[test]
fn high_entropy_needs_a_nearby_name() {
    let token = random_token(32, 60);
    let hash = "3eecdb3f9a1b7c2d4e5f60718293a4b5c6d7e8f9";
    for text in [
        format!("the build id is {token}"),
        format!("commit {hash}"),
        format!("the key moved to the new cluster yesterday afternoon, see {token}"),
        format!("api_key: {} and then {token}", random_token(24, 61)),
    ] {
        let out = scrub(&text);
        assert!(
            out.contains(&token) || out.contains(hash),
            "{text:?} -> {out:?}"
        );
    }
    assert_eq!(
        scrub(&format!("my api key for prod is {token}")),
        "my api key for prod is [REDACTED:high_entropy]"
    );
    assert_eq!(scrub(&format!("key {hash}")), "key [REDACTED:high_entropy]");
    // UUIDs are ids, even after a name.
    let uuid = "01a2351e-a148-7099-a85e-c65161825d03";
    assert_eq!(
        scrub(&format!("idempotency key {uuid}")),
        format!("idempotency key {uuid}")
    );
}

#[test]
fn random_tokens_after_a_name_are_mostly_caught() {
    let scrubber = Scrubber::default();
    for (len, min_rate) in [(24, 0.95), (32, 0.98), (40, 0.99)] {
        let n = 1000;
        let caught = (0..n)
            .filter(|&seed| {
                let text = format!("the auth key is {}", fake(ALNUM, len, seed));
                !scrubber.scrub(&text).is_clean()
            })
            .count();
        let rate = caught as f64 / n as f64;
        assert!(rate >= min_rate, "len {len}: {rate}");
    }
}

#[test]
fn edge_cases_as_decided() {
    // A weak default password is still a password.
    assert_eq!(
        scrub("docker run -e POSTGRES_PASSWORD=postgres postgres:16"),
        "docker run -e POSTGRES_PASSWORD=[REDACTED:key_value_secret] postgres:16"
    );
    assert_eq!(
        scrub("postgres://postgres:postgres@localhost:5432/app"),
        "postgres://postgres:[REDACTED:url_password]@localhost:5432/app"
    );
    // Numbers and words without a separator are not values.
    for text in [
        "set password_min_length=12",
        "token: 12345678",
        "the password is wrong",
        "your password is incorrect.",
        "the token is expired",
        "mysql -u root -p$MYSQL_PWD",
        "curl -u bob:$TOKEN https://example.com",
        "run it with --password <your password>",
    ] {
        assert_eq!(scrub(text), text);
    }
    // A secret said in prose, or passed on a command line, is redacted; only the secret.
    for (text, want) in [
        (
            "my password is hunter22",
            "my password is [REDACTED:key_value_secret]",
        ),
        (
            "the api key was 9fKx2Lq7.",
            "the api key was [REDACTED:key_value_secret].",
        ),
        (
            "mysql -u root -pHunter22 app",
            "mysql -u root -p[REDACTED:key_value_secret] app",
        ),
        (
            "curl -u bob:s3cr3t https://example.com",
            "curl -u bob:[REDACTED:key_value_secret] https://example.com",
        ),
        (
            "deploy --password Tr0ub4dor&3 --force",
            "deploy --password [REDACTED:key_value_secret] --force",
        ),
    ] {
        assert_eq!(scrub(text), want, "{text}");
    }
    // A PIN is a password; a count is not.
    assert_eq!(
        scrub("pin password: 48213977"),
        "pin password: [REDACTED:key_value_secret]"
    );
    // A hex digest needs the name right next to it.
    let hex = "9fceb02d0ae598e95dc970b74767f19372d61af8";
    assert_eq!(
        scrub(&format!("secret: {hex}")),
        "secret: [REDACTED:key_value_secret]"
    );
    assert_eq!(
        scrub(&format!("hmac key = {hex}")),
        "hmac key = [REDACTED:high_entropy]"
    );
    assert_eq!(
        scrub(&format!("the key change landed in {hex}")),
        format!("the key change landed in {hex}")
    );
}

#[test]
fn values_cut_by_a_redaction_are_judged_again() {
    // `<…>` makes the whole value a placeholder, but the token inside is a secret; once it
    // is redacted, what is left of the value (`hunter22<key:`) reads as a password, and a
    // second scrub would redact it: the first does so already.
    let token = random_token(30, 80);
    let text = format!("password=hunter22<key:{token}>");
    let out = Scrubber::default().scrub(&text);
    assert_eq!(
        out.text,
        "password=[REDACTED:key_value_secret][REDACTED:high_entropy]>"
    );
    assert!(Scrubber::default().scrub(&out.text).is_clean());
}

#[test]
fn markers_are_never_matched_again() {
    let scrubber = Scrubber::default();
    for text in [
        "password=[REDACTED:key_value_secret]",
        "password: \"[REDACTED:key_value_secret]\"",
        "token: [REDACTED:github_token]",
        "https://bob:[REDACTED:url_password]@db.example.com/x",
        "Authorization: Bearer [REDACTED:bearer_token]",
        "[REDACTED:private_key] key [REDACTED:high_entropy]",
    ] {
        assert!(scrubber.scrub(text).is_clean(), "{text}");
    }
}

#[test]
fn the_policy_turns_detectors_off() {
    let key = github(70);
    let text = format!("token={key} password=hunter2");
    let off = Scrubber::new(&ScrubPolicy {
        enabled: false,
        ..ScrubPolicy::default()
    });
    assert!(off.scrub(&text).is_clean());
    let no_github = Scrubber::new(&ScrubPolicy {
        disabled: vec![Kind::GithubToken],
        ..ScrubPolicy::default()
    });
    let out = no_github.scrub(&text);
    // The key=value detector still catches the token by its name.
    assert_eq!(
        out.text,
        "token=[REDACTED:key_value_secret] password=[REDACTED:key_value_secret]"
    );
    let only_github = Scrubber::new(&ScrubPolicy {
        disabled: vec![Kind::KeyValueSecret, Kind::HighEntropy],
        ..ScrubPolicy::default()
    });
    assert_eq!(
        only_github.scrub(&text).text,
        "token=[REDACTED:github_token] password=hunter2"
    );
}

#[test]
fn policy_validation_names_the_field() {
    assert_eq!(ScrubPolicy::default().validate(), Ok(()));
    let bad = |p: ScrubPolicy| p.validate().expect_err("invalid");
    let e = bad(ScrubPolicy {
        min_entropy: f64::NAN,
        ..ScrubPolicy::default()
    });
    assert!(e.starts_with("scrub.min_entropy "), "{e}");
    let e = bad(ScrubPolicy {
        min_entropy: 9.0,
        ..ScrubPolicy::default()
    });
    assert!(e.starts_with("scrub.min_entropy "), "{e}");
    let e = bad(ScrubPolicy {
        min_entropy_len: 4,
        ..ScrubPolicy::default()
    });
    assert!(e.starts_with("scrub.min_entropy_len "), "{e}");
    // Out-of-range numbers are clamped, not a panic.
    let s = Scrubber::new(&ScrubPolicy {
        min_entropy: f64::INFINITY,
        min_entropy_len: 0,
        ..ScrubPolicy::default()
    });
    assert!(s.scrub("password=hunter2").redactions.len() == 1);
}

#[test]
fn policy_and_kinds_in_serde() {
    let p: ScrubPolicy =
        serde_json::from_str(r#"{"disabled": ["high_entropy", "openai_key"]}"#).expect("policy");
    assert_eq!(
        p,
        ScrubPolicy {
            disabled: vec![Kind::HighEntropy, Kind::OpenAiKey],
            ..ScrubPolicy::default()
        }
    );
    assert!(p.enabled);
    assert_eq!((p.min_entropy, p.min_entropy_len), (3.5, 20));
    assert!(serde_json::from_str::<ScrubPolicy>(r#"{"enable": false}"#).is_err());
    for kind in Kind::ALL {
        let json = serde_json::to_string(&kind).expect("kind");
        assert_eq!(json, format!("\"{kind}\""));
        assert_eq!(serde_json::from_str::<Kind>(&json).expect("kind"), kind);
    }
    assert_eq!(Kind::OpenAiKey.to_string(), "openai_key");
    let mut sorted = Kind::ALL;
    sorted.sort();
    assert_eq!(sorted, Kind::ALL);
}

#[test]
fn scrubbers_are_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Scrubber>();
    let scrubber = std::sync::Arc::new(Scrubber::default());
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let s = scrubber.clone();
            std::thread::spawn(move || s.scrub(&format!("password=hunter{i}{i}")).redactions.len())
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("thread"), 1);
    }
}

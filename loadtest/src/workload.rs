//! Synthetic agent experience: what one simulated agent instance appends.
//!
//! Each [`AgentWorkload`] owns a seeded RNG and a little state (its current episode, its last
//! action), so its stream reads like a working agent's: observations lead to actions, outcomes
//! name the action that caused them, and facts, preferences and skills turn up now and then.
//! Sizes matter more than prose: text runs from 100 B to 2 KB with most events short, as
//! agent logs are, and a bit under half of the events carry a structured `content.data` payload.
//!
//! The generator never touches the network, so it can be tested (and costed) on its own.

use chrono::TimeDelta;
use engram_schema::{Content, Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use rand::rngs::SmallRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// Every benchmark event belongs to this tenant, so that a run against a shared server is
/// easy to tell apart (and to filter out) from real data.
pub const TENANT: &str = "bench";

/// Shortest and longest `content.text`, in bytes.
pub const TEXT_LEN_RANGE: (usize, usize) = (100, 2000);

/// Who a simulated agent is and where it writes.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentProfile {
    pub tenant: Ident,
    pub agent_id: Ident,
    pub instance_id: Ident,
    /// The task scope the agent's team shares; most events go here.
    pub team_scope: Scope,
    /// The agent's own scope, for what only it should remember.
    pub private_scope: Scope,
}

const ROLES: &[&str] = &[
    "planner",
    "coder",
    "reviewer",
    "tester",
    "researcher",
    "operator",
];

impl AgentProfile {
    /// The `index`-th agent; agents `0..team_size` form team 0, and so on.
    pub fn new(index: usize, team_size: usize) -> Self {
        let role = ROLES[index % ROLES.len()];
        let team = index / team_size.max(1);
        let agent_id = format!("{role}-{index:04}");
        let ident = |field, value: &str| {
            Ident::parse(field, value).expect("generated identifiers use only [a-z0-9-]")
        };
        Self {
            tenant: ident("tenant", TENANT),
            instance_id: ident("instance_id", &format!("i-{index:04}")),
            team_scope: Scope::new(ScopeKind::Task, &format!("task-{team:03}"))
                .expect("generated scope ids are valid"),
            private_scope: Scope::new(ScopeKind::Agent, &agent_id)
                .expect("generated scope ids are valid"),
            agent_id: ident("agent_id", &agent_id),
        }
    }
}

/// Text memories an agent remembers writing, for repeating one.
const RECENT_TEXTS: usize = 16;

/// The event stream of one simulated agent.
#[derive(Debug)]
pub struct AgentWorkload {
    profile: AgentProfile,
    rng: SmallRng,
    /// Correlation id of the agent's current episode; it moves on every few dozen events.
    episode: u32,
    /// The last action, which the next outcome names as its cause.
    last_action: Option<EventId>,
    /// What consolidation gets to work on; nothing unless [`Self::consolidation_material`]
    /// asks for it, so that other benchmarks' content stays as it was.
    material: Material,
    /// Events generated so far.
    events: u64,
    /// The agent's latest episodic texts and the scope each went to, newest last.
    recent: Vec<(Scope, String)>,
    /// Whether the last event repeated an earlier text.
    last_was_duplicate: bool,
}

/// Consolidation's material in a workload: repeated memories and finished sessions.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Material {
    duplicates: f64,
    finish_every: u64,
}

impl AgentWorkload {
    /// A workload whose content is reproducible from `seed` (event ids and timestamps are not).
    pub fn new(profile: AgentProfile, seed: u64) -> Self {
        Self {
            profile,
            rng: SmallRng::seed_from_u64(seed),
            episode: 0,
            last_action: None,
            material: Material::default(),
            events: 0,
            recent: Vec::new(),
            last_was_duplicate: false,
        }
    }

    /// Gives consolidation something to do: a `duplicates` share of the episodic memories
    /// (observations, actions, outcomes) repeats the text of one of the agent's recent ones
    /// in that one's scope, as an agent that sees the same thing again writes it again; and
    /// every `finish_every`-th event (0: never) is a `checkpoint` with `"finished": true` in
    /// the private scope, which ends a session the consolidator summarises. With neither (the
    /// default) the stream is the one [`Self::new`] gives for the seed.
    pub fn consolidation_material(mut self, duplicates: f64, finish_every: u64) -> Self {
        self.material = Material {
            duplicates: duplicates.clamp(0.0, 1.0),
            finish_every,
        };
        self
    }

    /// Whether the last event repeated the text of an earlier one (see
    /// [`Self::consolidation_material`]): consolidation may merge it away at any moment.
    pub fn last_was_duplicate(&self) -> bool {
        self.last_was_duplicate
    }

    pub fn profile(&self) -> &AgentProfile {
        &self.profile
    }

    /// Continues the same identity as another instance, as a successor that took over.
    pub fn set_instance(&mut self, instance_id: Ident) {
        self.profile.instance_id = instance_id;
    }

    /// A short question about the agent's work, as an agent asks its memory before a step.
    /// Drawn from a small set, as real agents repeat themselves (and query embeddings cache).
    pub fn question(&mut self) -> String {
        let r = &mut self.rng;
        format!("why {} {}", pick(r, NOUN_PHRASES), pick(r, VERB_PHRASES))
    }

    /// The next event, stamped as the SDK's `Agent` would stamp it.
    pub fn next_event(&mut self) -> Envelope {
        self.events += 1;
        self.last_was_duplicate = false;
        let finish_every = self.material.finish_every;
        if finish_every > 0 && self.events.is_multiple_of(finish_every) {
            return self.session_finished();
        }
        let kind = self.pick_kind();
        let (layer, shared) = match kind {
            EventKind::Observation if self.rng.random_bool(0.3) => (Layer::Working, 0.75),
            EventKind::Observation | EventKind::Action | EventKind::Outcome => {
                (Layer::Episodic, 0.75)
            }
            EventKind::Preference => (Layer::Semantic, 0.2),
            EventKind::SkillRecorded => (Layer::Procedural, 0.6),
            _ => (Layer::Semantic, 0.75),
        };
        let scope = if self.rng.random_bool(shared) {
            self.profile.team_scope.clone()
        } else {
            self.profile.private_scope.clone()
        };
        let mut text = self.text(kind);
        let mut scope = scope;
        if layer == Layer::Episodic && self.material.duplicates > 0.0 {
            // Drawn only when asked for, so that a workload without duplicates draws what it
            // always drew.
            if !self.recent.is_empty() && self.rng.random_bool(self.material.duplicates) {
                let (s, t) = self.recent[self.rng.random_range(0..self.recent.len())].clone();
                (scope, text) = (s, t);
                self.last_was_duplicate = true;
            } else {
                if self.recent.len() == RECENT_TEXTS {
                    self.recent.remove(0);
                }
                self.recent.push((scope.clone(), text.clone()));
            }
        }
        let data = self.data(kind);
        let mut event = Envelope::new(
            self.profile.tenant.clone(),
            scope,
            self.profile.agent_id.clone(),
            self.profile.instance_id.clone(),
            layer,
            kind,
            Content { text, data },
        );
        // Agents report what happened a moment ago, not at the instant of the append.
        event.occurred_at =
            event.recorded_at - TimeDelta::milliseconds(self.rng.random_range(0..2_000));
        event.importance = self.importance(kind);
        event.tags = self.tags();
        if self.rng.random_bool(0.04) {
            self.episode += 1;
        }
        event.correlation_id = Some(format!("{}-ep-{:05}", self.profile.agent_id, self.episode));
        match kind {
            EventKind::Action => self.last_action = Some(event.event_id.clone()),
            EventKind::Outcome => event.causation_id = self.last_action.take(),
            _ => {}
        }
        event
    }

    /// The end of a session in the private scope: what the consolidator summarises.
    fn session_finished(&mut self) -> Envelope {
        let mut event = Envelope::new(
            self.profile.tenant.clone(),
            self.profile.private_scope.clone(),
            self.profile.agent_id.clone(),
            self.profile.instance_id.clone(),
            Layer::Working,
            EventKind::Checkpoint,
            Content {
                text: format!(
                    "Session {} finished.",
                    self.events / self.material.finish_every
                ),
                data: Some(json!({"finished": true})),
            },
        );
        event.correlation_id = Some(format!("{}-ep-{:05}", self.profile.agent_id, self.episode));
        event
    }

    fn pick_kind(&mut self) -> EventKind {
        // Weights in percent: agents mostly look and act; knowledge is distilled less often.
        const MIX: &[(EventKind, u32)] = &[
            (EventKind::Observation, 34),
            (EventKind::Action, 26),
            (EventKind::Outcome, 16),
            (EventKind::FactAsserted, 12),
            (EventKind::SkillRecorded, 6),
            (EventKind::Preference, 6),
        ];
        let mut roll = self.rng.random_range(0..100);
        for &(kind, weight) in MIX {
            if roll < weight {
                return kind;
            }
            roll -= weight;
        }
        EventKind::Observation
    }

    /// Text length is drawn from three bands so that most events are short and a few long.
    fn text_len(&mut self) -> usize {
        let band = self.rng.random_range(0..100);
        match band {
            0..55 => self.rng.random_range(TEXT_LEN_RANGE.0..400),
            55..88 => self.rng.random_range(400..1_000),
            _ => self.rng.random_range(1_000..=TEXT_LEN_RANGE.1),
        }
    }

    fn text(&mut self, kind: EventKind) -> String {
        let target = self.text_len();
        let mut text = self.lead_sentence(kind);
        while text.len() < target {
            text.push(' ');
            let sentence = self.sentence();
            text.push_str(&sentence);
        }
        fit_text(text, target)
    }

    fn lead_sentence(&mut self, kind: EventKind) -> String {
        let r = &mut self.rng;
        let np = pick(r, NOUN_PHRASES);
        let vp = pick(r, VERB_PHRASES);
        let qual = pick(r, QUALIFIERS);
        match kind {
            EventKind::Action => format!(
                "Ran `{}` in {} to check whether {np} {vp}.",
                pick(r, COMMANDS),
                pick(r, PATHS)
            ),
            EventKind::Outcome => format!(
                "The change to {} {}: {np} {vp} {qual}.",
                pick(r, PATHS),
                pick(
                    r,
                    &[
                        "worked",
                        "did not help",
                        "fixed the failure",
                        "made it worse"
                    ]
                )
            ),
            EventKind::FactAsserted => {
                format!(
                    "{} {vp} {qual}; confirmed by {}.",
                    capitalise(np),
                    pick(r, EVIDENCE)
                )
            }
            EventKind::Preference => format!(
                "The user prefers {} over {}, and said so again today.",
                pick(r, PREFERENCES),
                pick(r, PREFERENCES)
            ),
            EventKind::SkillRecorded => format!(
                "To {}: first {}, then {}, and finally {}.",
                pick(r, GOALS),
                pick(r, STEPS),
                pick(r, STEPS),
                pick(r, STEPS)
            ),
            _ => format!("Observed that {np} {vp} {qual}."),
        }
    }

    fn sentence(&mut self) -> String {
        let r = &mut self.rng;
        let np = capitalise(pick(r, NOUN_PHRASES));
        let vp = pick(r, VERB_PHRASES);
        let qual = pick(r, QUALIFIERS);
        if r.random_bool(0.3) {
            format!(
                "{np} {vp} {qual}, which {} {}.",
                pick(r, LINKS),
                pick(r, NOUN_PHRASES)
            )
        } else {
            format!("{np} {vp} {qual}.")
        }
    }

    fn data(&mut self, kind: EventKind) -> Option<Value> {
        let r = &mut self.rng;
        // Facts, skills and preferences are only meaningful with their payload (the fact
        // table and skill registry dead-letter them without one), so they always carry it.
        let chance = match kind {
            EventKind::FactAsserted | EventKind::SkillRecorded | EventKind::Preference => 1.0,
            EventKind::Action => 0.7,
            EventKind::Outcome => 0.6,
            _ => 0.15,
        };
        if !r.random_bool(chance) {
            return None;
        }
        Some(match kind {
            EventKind::Action => json!({
                "tool": "shell",
                "command": pick(r, COMMANDS),
                "cwd": pick(r, PATHS),
                "exit_code": pick(r, &[0, 0, 0, 1, 2]),
                "duration_ms": r.random_range(5..120_000),
            }),
            EventKind::Outcome => {
                let mut data = json!({
                    "status": pick(r, &["success", "success", "failure", "partial"]),
                    "tests_passed": r.random_range(0..2_000),
                    "tests_failed": r.random_range(0..12),
                    "duration_ms": r.random_range(100..600_000),
                });
                // Some outcomes report on a recorded skill, which counts its successes.
                if r.random_bool(0.4) {
                    data["skill"] = json!(pick(r, GOALS));
                    data["success"] = json!(r.random_bool(0.7));
                }
                data
            }
            // Few subjects and single-valued predicates, so teammates contradict each other
            // and later assertions supersede earlier ones.
            EventKind::FactAsserted => json!({
                "subject": pick(r, NOUN_PHRASES),
                "predicate": pick(r, FACT_PREDICATES),
                "object": pick(r, QUALIFIERS),
                "confidence": round2(r.random_range(0.5..1.0)),
            }),
            EventKind::Preference => json!({
                "key": pick(r, &["code_style.indent", "review.tone", "tests.framework", "commits.format"]),
                "value": pick(r, PREFERENCES),
            }),
            EventKind::SkillRecorded => {
                let steps: Vec<&str> = (0..r.random_range(3..7)).map(|_| pick(r, STEPS)).collect();
                let goal = pick(r, GOALS);
                json!({
                    "name": goal,
                    "description": format!("How to {goal}, as it worked last time."),
                    "steps": steps,
                    "success_rate": round2(r.random_range(0.4..1.0)),
                })
            }
            _ => json!({
                "source": pick(r, &["log", "test-output", "http", "stack-trace"]),
                "path": pick(r, PATHS),
                "lines": r.random_range(1..400),
            }),
        })
    }

    fn importance(&mut self, kind: EventKind) -> f64 {
        let (low, high) = match kind {
            EventKind::FactAsserted | EventKind::SkillRecorded => (0.6, 0.95),
            EventKind::Preference => (0.5, 0.9),
            EventKind::Outcome => (0.4, 0.9),
            EventKind::Action => (0.2, 0.6),
            _ => (0.1, 0.7),
        };
        round2(self.rng.random_range(low..high))
    }

    fn tags(&mut self) -> Vec<String> {
        let count = self.rng.random_range(0..=4);
        TAGS.choose_multiple(&mut self.rng, count)
            .map(|t| (*t).to_owned())
            .collect()
    }
}

/// Plausible text of exactly `len` bytes, for payloads that only need a size.
pub fn filler_text(len: usize) -> String {
    let mut workload = AgentWorkload::new(AgentProfile::new(0, 1), 0);
    let mut text = String::with_capacity(len + 200);
    while text.len() < len {
        text.push_str(&workload.sentence());
        text.push(' ');
    }
    text.truncate(len);
    text
}

/// Cuts `text` to at most `target` bytes, at a word boundary where that keeps it above the
/// minimum length, and ends it with a period.
fn fit_text(mut text: String, target: usize) -> String {
    if text.len() <= target {
        return text;
    }
    // All word lists are ASCII, so any index is a char boundary.
    match text[..target].rfind(' ').filter(|&i| i > TEXT_LEN_RANGE.0) {
        Some(cut) => {
            text.truncate(cut);
            if text.ends_with([',', ';', ':', '.']) {
                text.pop();
            }
        }
        None => text.truncate(target - 1),
    }
    text.push('.');
    text
}

fn pick<T: Copy>(rng: &mut SmallRng, items: &[T]) -> T {
    *items.choose(rng).expect("word lists are not empty")
}

fn capitalise(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
        .unwrap_or_default()
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

const NOUN_PHRASES: &[&str] = &[
    "the login handler",
    "the retry loop in the payment client",
    "the nightly integration suite",
    "the config parser",
    "the session cache",
    "the billing export job",
    "the search index",
    "the rate limiter",
    "the database migration",
    "the webhook dispatcher",
    "the user profile page",
    "the token refresh path",
    "the deploy pipeline",
    "the feature flag service",
    "the CSV importer",
    "the email renderer",
    "the metrics exporter",
    "the flaky checkout test",
    "the API gateway",
    "the background worker pool",
    "the audit log writer",
    "the S3 upload helper",
    "the dependency lockfile",
    "the on-call runbook",
];

const VERB_PHRASES: &[&str] = &[
    "returns a 500 error",
    "times out after thirty seconds",
    "retries without backoff",
    "drops the last record",
    "logs the full request body",
    "rejects valid tokens",
    "holds a lock across an await",
    "allocates a buffer per request",
    "reads stale values",
    "skips the validation step",
    "double-counts refunds",
    "ignores the timezone",
    "leaks file descriptors",
    "passes locally but fails in CI",
    "uses the deprecated endpoint",
    "swallows the original error",
    "recomputes the same hash twice",
    "sorts by the wrong column",
];

const QUALIFIERS: &[&str] = &[
    "when the cache is cold",
    "under sustained load",
    "after the last migration",
    "only in staging",
    "on the second attempt",
    "for tenants with more than ten thousand users",
    "whenever the clock skews",
    "since the dependency upgrade",
    "during the nightly batch",
    "if the request carries a unicode filename",
    "when two workers race",
    "on ARM runners only",
];

/// Predicates the simulated agents assert facts with; all single-valued.
pub const FACT_PREDICATES: &[&str] = &["status", "owner", "root_cause", "severity"];

const LINKS: &[&str] = &[
    "also affects",
    "probably explains the alerts from",
    "is unrelated to",
    "should be fixed together with",
    "was reported earlier against",
];

const COMMANDS: &[&str] = &[
    "cargo test -p billing",
    "npm run lint",
    "pytest tests/integration -x",
    "git bisect run ./check.sh",
    "kubectl rollout status deploy/api",
    "psql -c 'explain analyze select ...'",
    "terraform plan",
    "curl -sv https://staging.internal/health",
    "go test ./... -race",
    "make e2e",
];

const PATHS: &[&str] = &[
    "services/auth/src/session.rs",
    "web/src/pages/profile.tsx",
    "billing/export.py",
    "deploy/k8s/api.yaml",
    "internal/ratelimit/limiter.go",
    "migrations/0042_add_index.sql",
    "tests/e2e/checkout.spec.ts",
    "lib/search/indexer.rb",
];

const EVIDENCE: &[&str] = &[
    "the production logs",
    "a failing regression test",
    "the vendor documentation",
    "two independent reproductions",
    "the flame graph from last night",
    "the on-call engineer",
];

const PREFERENCES: &[&str] = &[
    "small pull requests",
    "table-driven tests",
    "explicit error types",
    "four-space indentation",
    "squash merges",
    "property tests for parsers",
    "comments that explain why",
    "feature flags over long-lived branches",
];

const GOALS: &[&str] = &[
    "bisect a flaky test",
    "roll back a bad deploy",
    "rotate a leaked credential",
    "profile a slow endpoint",
    "add a database index safely",
    "triage a customer bug report",
];

const STEPS: &[&str] = &[
    "reproduce it locally with the same seed",
    "check the recent deploys",
    "read the last hundred log lines",
    "write a failing test",
    "run the suite under the race detector",
    "compare the metrics before and after",
    "ask the owning team in their channel",
    "open a draft pull request",
    "pin the dependency version",
];

const TAGS: &[&str] = &[
    "auth",
    "billing",
    "ci",
    "flaky-test",
    "migration",
    "perf",
    "security",
    "db",
    "api",
    "frontend",
    "infra",
    "docs",
    "regression",
    "hotfix",
    "customer",
];

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use engram_schema::{Codec, Limits};

    use super::*;

    /// Events must pass the same validation and size limit the bus applies, survive a round
    /// trip, and spread over the intended sizes and kinds; otherwise the benchmark measures
    /// something other than realistic appends.
    #[test]
    fn generates_valid_events_across_the_intended_sizes() {
        let codec = Codec::new(Limits::default());
        let mut sizes = Vec::new();
        let mut kinds = BTreeSet::new();
        let mut scopes = BTreeSet::new();
        let mut with_data = 0;
        for index in 0..20 {
            let mut workload = AgentWorkload::new(AgentProfile::new(index, 10), index as u64);
            for _ in 0..250 {
                let event = workload.next_event();
                let text_len = event.content.text.len();
                assert!(
                    (TEXT_LEN_RANGE.0..=TEXT_LEN_RANGE.1).contains(&text_len),
                    "text of {text_len} bytes: {:?}",
                    event.content.text
                );
                let bytes = codec.encode(&event).expect("generated events encode");
                assert_eq!(codec.decode(&bytes).expect("and decode"), event);
                sizes.push(bytes.len());
                kinds.insert(event.kind);
                scopes.insert(event.scope.to_string());
                with_data += usize::from(event.content.data.is_some());
                let data = event.content.data.as_ref();
                let has = |field: &str| data.is_some_and(|d| d.get(field).is_some());
                match event.kind {
                    EventKind::FactAsserted => {
                        assert!(
                            has("subject") && has("predicate") && has("object"),
                            "{data:?}"
                        );
                    }
                    EventKind::SkillRecorded => {
                        assert!(has("name") && has("description"), "{data:?}");
                    }
                    EventKind::Outcome if has("skill") => assert!(has("success"), "{data:?}"),
                    _ => {}
                }
            }
        }
        sizes.sort_unstable();
        let quantile = |q: f64| sizes[((sizes.len() - 1) as f64 * q) as usize];
        assert!(sizes[0] >= 300, "smallest event {} B", sizes[0]);
        assert!(
            *sizes.last().unwrap() <= 4_096,
            "largest event {} B",
            sizes.last().unwrap()
        );
        assert!(
            quantile(0.5) < 1_000,
            "median {} B: most events should be short",
            quantile(0.5)
        );
        assert!(
            quantile(0.95) > 1_200,
            "p95 {} B: some events should be long",
            quantile(0.95)
        );
        assert_eq!(kinds.len(), 6, "all six kinds appear: {kinds:?}");
        // Two teams of ten share two task scopes; every agent also writes to its own.
        assert_eq!(scopes.len(), 2 + 20);
        assert!(
            (2_000..3_500).contains(&with_data),
            "{with_data} of 5000 events carry data"
        );
    }

    #[test]
    fn consolidation_material_repeats_texts_in_their_scope_and_ends_sessions() {
        let profile = AgentProfile::new(3, 5);
        let plain: Vec<Envelope> = {
            let mut w = AgentWorkload::new(profile.clone(), 9);
            (0..200).map(|_| w.next_event()).collect()
        };
        let mut again = AgentWorkload::new(profile.clone(), 9).consolidation_material(0.0, 0);
        for event in &plain {
            assert_eq!(
                again.next_event().content,
                event.content,
                "no material, same stream"
            );
        }
        let mut w = AgentWorkload::new(profile.clone(), 9).consolidation_material(0.2, 10);
        let (mut seen, mut repeats, mut finishes) = (Vec::new(), 0, 0);
        for n in 1..=400u64 {
            let event = w.next_event();
            if n % 10 == 0 {
                assert_eq!(event.kind, EventKind::Checkpoint);
                assert_eq!(event.scope, profile.private_scope);
                assert_eq!(event.content.data, Some(json!({"finished": true})));
                finishes += 1;
                continue;
            }
            let key = (event.scope.clone(), event.content.text.clone());
            if w.last_was_duplicate() {
                assert_eq!(event.layer, Layer::Episodic);
                assert!(
                    seen.contains(&key),
                    "a repeat of an earlier text, in its scope"
                );
                repeats += 1;
            }
            seen.push(key);
        }
        assert_eq!(finishes, 40);
        assert!((20..80).contains(&repeats), "{repeats} repeats");
    }

    #[test]
    fn filler_text_has_the_exact_length() {
        for len in [0, 1, 99, 2_700] {
            assert_eq!(filler_text(len).len(), len);
        }
    }
}

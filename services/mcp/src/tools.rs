//! The tools a model sees: what each does, its arguments (with the JSON Schema the model is
//! shown) and its result, and the bounds on both.
//!
//! Every tool runs as the call's [`Identity`]; none takes a tenant, agent or scope. Arguments
//! are decoded here rather than by rmcp, so that every mistake a model can make (an argument
//! the schema does not list, a wrong type, a value out of bounds) comes back as a tool error
//! the model reads and can act on, not as a protocol error its harness hides.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use engram_sdk::doc::DocEditError;
use engram_sdk::proto::{self, Consistency, DocConflict, ScopeRequest};
use engram_sdk::{
    AppendError, ErrorCode, EventId, EventKind, Ident, Layer, MemoryFilter, RpcError, ScopeKind,
};
use rmcp::handler::server::common::schema_for_input;
use rmcp::model::JsonObject;
use rmcp::service::RequestContext;
use rmcp::{Json, RoleServer, tool, tool_router};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::Instrument;

use crate::{EngramMcp, Identity};

/// What a client may send and ask for, at most.
pub mod limits {
    /// Characters of a memory's text.
    pub const MAX_TEXT_CHARS: usize = 8_000;
    /// Characters of a query or a task description.
    pub const MAX_QUERY_CHARS: usize = 2_000;
    /// Results of one `recall`, `facts` or `skills`.
    pub const MAX_LIMIT: usize = 100;
    /// Tags of one memory, and characters of each.
    pub const MAX_TAGS: usize = 16;
    pub const MAX_TAG_CHARS: usize = 64;
    /// Characters of a fact's subject or predicate, and of its object.
    pub const MAX_TERM_CHARS: usize = 256;
    pub const MAX_OBJECT_CHARS: usize = 2_000;
    /// Characters of a skill's name; of its description, each step and precondition; how many
    /// steps and preconditions.
    pub const MAX_NAME_CHARS: usize = 256;
    pub const MAX_STEP_CHARS: usize = 2_000;
    pub const MAX_STEPS: usize = 64;
    /// Token budget of `build_context`.
    pub const MIN_TOKEN_BUDGET: usize = 64;
    pub const MAX_TOKEN_BUDGET: usize = 8_192;
    /// Tasks one `task_board` call adds or changes, and removes.
    pub const MAX_BOARD_CHANGES: usize = 50;
    /// Characters of a task's title, owner and of one note.
    pub const MAX_TITLE_CHARS: usize = 512;
    pub const MAX_OWNER_CHARS: usize = 128;
    pub const MAX_NOTE_CHARS: usize = 2_000;
    /// Tasks a `task_board` answer lists.
    pub const MAX_BOARD_TASKS: usize = 500;
    /// Memories one `forget` withdraws; characters of its reason.
    pub const MAX_FORGET: usize = 100;
    pub const MAX_REASON_CHARS: usize = 1_000;
    /// How long a read waits for this server's own last write to become visible, in ms.
    pub const READ_YOUR_WRITES_WAIT_MS: u64 = 20_000;
}

use limits::*;

/// A tool call that failed, with a message for the model saying what to do.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolError(String);

impl ToolError {
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl std::fmt::Display for ToolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A query's failure as the model should read it.
fn query_error(identity: &Identity, e: RpcError) -> ToolError {
    let message = match e.code() {
        ErrorCode::Forbidden => format!(
            "{e}; this server reads scope {} and {} granted scope(s); an admin can grant more (`engram grant add`)",
            identity.scope(),
            identity.reads().len()
        ),
        ErrorCode::NotYetVisible => format!(
            "{e}; the memory service has not caught up with the last write yet: retry in a few seconds"
        ),
        ErrorCode::Busy => format!("{e}; Engram is busy: retry in a second"),
        ErrorCode::Unavailable => format!("{e}; Engram is unavailable: retry later"),
        ErrorCode::Invalid => format!("{e}; fix the arguments and call again"),
        ErrorCode::Internal => format!("{e}; this is a bug in Engram, not in your call"),
    };
    ToolError(message)
}

/// An append's failure as the model should read it.
fn append_error(identity: &Identity, e: AppendError) -> ToolError {
    let message = match &e {
        AppendError::Forbidden { .. } => format!(
            "this server's key (agent {} of tenant {}) may not write to scope {}; nothing was stored. The scope is the server's configuration (`engram mcp --scope`, or the `Engram-Scope` header), not an argument",
            identity.agent_id(),
            identity.tenant(),
            identity.scope()
        ),
        AppendError::Unavailable(_) => format!("{e}; retry the same call"),
        _ => format!("{e}; fix the arguments and call again"),
    };
    ToolError(message)
}

fn schema_error(e: engram_sdk::SchemaError) -> ToolError {
    ToolError(format!("{e}; fix the arguments and call again"))
}

/// The names a model might try to pick its own identity or scope with.
const IDENTITY_ARGS: &[&str] = &[
    "tenant",
    "agent",
    "agent_id",
    "instance",
    "instance_id",
    "scope",
    "scopes",
    "grants",
    "read",
    "namespace",
    "user_id",
];

/// The input schema of a tool taking `T`.
fn input<T: JsonSchema + 'static>() -> Arc<JsonObject> {
    schema_for_input::<T>().unwrap_or_else(|e| panic!("the input schema of a tool: {e}"))
}

/// `args` as `T`, or a tool error saying what is wrong: an argument the schema does not list
/// (a tenant or scope above all), a missing one, a wrong type.
fn decode<T: serde::de::DeserializeOwned + JsonSchema + 'static>(
    identity: &Identity,
    args: JsonObject,
) -> Result<T, ToolError> {
    let schema = input::<T>();
    let listed: Vec<&str> = schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.keys().map(String::as_str).collect())
        .unwrap_or_default();
    if let Some(key) = args.keys().find(|k| !listed.contains(&k.as_str())) {
        if IDENTITY_ARGS.contains(&key.to_ascii_lowercase().as_str()) {
            return Err(ToolError(format!(
                "`{key}` is not an argument: this server acts as agent {} of tenant {} in scope {}, fixed by the key and configuration it was started with. Call again without `{key}`",
                identity.agent_id(),
                identity.tenant(),
                identity.scope()
            )));
        }
        return Err(ToolError(format!(
            "unknown argument `{key}`; this tool takes: {}",
            listed.join(", ")
        )));
    }
    serde_json::from_value(Value::Object(args))
        .map_err(|e| ToolError(format!("invalid arguments: {e}; fix them and call again")))
}

/// `value` trimmed, refused when empty or longer than `max` characters.
fn text(field: &str, value: &str, max: usize) -> Result<String, ToolError> {
    let value = value.trim();
    if value.is_empty() {
        return Err(ToolError(format!("`{field}` is empty; give it a value")));
    }
    let chars = value.chars().count();
    if chars > max {
        return Err(ToolError(format!(
            "`{field}` has {chars} characters, at most {max}: shorten it (or split it over several calls)"
        )));
    }
    Ok(value.to_owned())
}

fn optional_text(
    field: &str,
    value: Option<&str>,
    max: usize,
) -> Result<Option<String>, ToolError> {
    value.map(|v| text(field, v, max)).transpose()
}

fn limit(value: Option<usize>, default: usize) -> Result<usize, ToolError> {
    match value {
        None => Ok(default),
        Some(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        Some(n) => Err(ToolError(format!("`limit` is {n}; give 1 to {MAX_LIMIT}"))),
    }
}

fn unit_interval(field: &str, value: Option<f64>) -> Result<Option<f64>, ToolError> {
    match value {
        Some(v) if !(v.is_finite() && (0.0..=1.0).contains(&v)) => Err(ToolError(format!(
            "`{field}` is {v}; give a number from 0 to 1"
        ))),
        other => Ok(other),
    }
}

impl Identity {
    fn scopes(&self) -> ScopeRequest {
        ScopeRequest {
            tenant: self.tenant().clone(),
            scope: self.scope().clone(),
            grants: self.reads().to_vec(),
        }
    }

    fn consistency(&self) -> Consistency {
        Consistency {
            min_seq: self.min_seq(),
            wait_ms: Some(READ_YOUR_WRITES_WAIT_MS),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Arguments and results.

/// What kind of memory `remember` stores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// Something seen or learned.
    #[default]
    Observation,
    /// Something done.
    Action,
    /// How an action or a task turned out.
    Outcome,
    /// What a user or the team wants.
    Preference,
    /// A judgement on earlier work.
    Feedback,
}

impl MemoryKind {
    fn event(self) -> (Layer, EventKind) {
        match self {
            Self::Observation => (Layer::Episodic, EventKind::Observation),
            Self::Action => (Layer::Episodic, EventKind::Action),
            Self::Outcome => (Layer::Episodic, EventKind::Outcome),
            Self::Preference => (Layer::Semantic, EventKind::Preference),
            Self::Feedback => (Layer::Episodic, EventKind::Feedback),
        }
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RememberArgs {
    /// What to remember: one or a few sentences that still make sense later, to someone
    /// without your current context (at most 8000 characters).
    pub text: String,
    /// `observation` (something you saw or learned; the default), `action` (something you
    /// did), `outcome` (how an action or task turned out), `preference` (what a user or the
    /// team wants), `feedback` (a judgement on earlier work).
    #[serde(default)]
    pub kind: Option<MemoryKind>,
    /// How much it matters, from 0 (trivia) to 1 (must not be forgotten); default 0.5.
    #[serde(default)]
    pub importance: Option<f64>,
    /// Short labels to find it by, e.g. ["auth", "bug"]; at most 16 of at most 64 characters.
    #[serde(default)]
    pub tags: Vec<String>,
}

/// A stored event.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Stored {
    /// The event's id: pass it to `forget` to withdraw it.
    pub event_id: String,
    /// Its position in the log; later reads through this server include it.
    pub seq: u64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecallArgs {
    /// What you want to know, as a question or keywords (at most 2000 characters).
    pub query: String,
    /// How many memories at most, 1 to 100; default 8.
    #[serde(default)]
    pub limit: Option<usize>,
}

/// One recalled memory.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Memory {
    pub text: String,
    /// Relevance; higher is better, comparable within one answer only.
    pub score: f32,
    /// Pass it to `forget` to withdraw this memory.
    pub event_id: String,
    /// When it happened (RFC 3339).
    pub when: DateTime<Utc>,
    /// observation, action, outcome, preference, feedback, ...
    pub kind: String,
    /// The scope it was written in (`kind:id`).
    pub scope: String,
    /// The agent that wrote it.
    pub agent: String,
    pub tags: Vec<String>,
    /// 0 to 1: lowered when later outcomes contradicted it.
    pub confidence: f64,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct Recalled {
    /// Best first.
    pub memories: Vec<Memory>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildContextArgs {
    /// The step you are about to take or the question you need answered, e.g. "fix the
    /// failing login test" (at most 2000 characters).
    pub task: String,
    /// Most tokens the context may take, 64 to 8192; default 1024.
    #[serde(default)]
    pub token_budget: Option<usize>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct BuiltContext {
    /// The context as one text, in sections (working memory, open tasks, facts, skills,
    /// memories): put it in front of your next step.
    pub context: String,
    pub tokens: usize,
    pub token_budget: usize,
    /// Where each item came from (event ids, fact sources, skill names), in the text's order.
    pub sources: Vec<String>,
    /// Candidates left out because they did not fit or repeated another.
    pub dropped: usize,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AssertFactArgs {
    /// Who or what the fact is about, e.g. "checkout-service" (at most 256 characters; case
    /// matters).
    pub subject: String,
    /// The property or relation, e.g. "runs_on" (at most 256 characters; case matters).
    pub predicate: String,
    /// Its value, e.g. "postgres 16" (at most 2000 characters). A later fact with the same
    /// subject and predicate and another value replaces this one.
    pub object: String,
    /// When it became true (RFC 3339, e.g. "2026-06-01T00:00:00Z"); default: now.
    #[serde(default)]
    pub valid_from: Option<DateTime<Utc>>,
    /// How sure you are, 0 to 1; default 1.
    #[serde(default)]
    pub confidence: Option<f64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FactsArgs {
    /// Only facts about this subject (exact; case matters).
    #[serde(default)]
    pub subject: Option<String>,
    /// Only this predicate (exact; case matters).
    #[serde(default)]
    pub predicate: Option<String>,
    /// The facts as they were true at this time (RFC 3339); default: now.
    #[serde(default)]
    pub as_of: Option<DateTime<Utc>>,
    /// Every version of one fact, replaced and retracted ones too (needs `subject` and
    /// `predicate`); default false.
    #[serde(default)]
    pub history: bool,
    /// How many facts at most, 1 to 100; default 20.
    #[serde(default)]
    pub limit: Option<usize>,
}

/// One fact.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Fact {
    pub subject: String,
    pub predicate: String,
    pub object: Value,
    /// From when it holds (RFC 3339).
    pub valid_from: Option<String>,
    /// Until when, if it ended.
    pub valid_to: Option<String>,
    pub confidence: Option<f64>,
    /// A later value replaced it.
    pub superseded: bool,
    /// Someone said it was wrong.
    pub retracted: bool,
    /// The events that asserted it.
    pub event_ids: Vec<String>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct Facts {
    pub facts: Vec<Fact>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RecordSkillArgs {
    /// A short, stable name, e.g. "rollback-deploy"; recording the same name again makes a
    /// new version (at most 256 characters).
    pub name: String,
    /// What the skill does and when to use it; `skills` searches this (at most 2000
    /// characters).
    pub description: String,
    /// How to do it, one step per entry (at most 64 of at most 2000 characters).
    #[serde(default)]
    pub steps: Vec<String>,
    /// What must hold before using it (at most 64 of at most 2000 characters).
    #[serde(default)]
    pub preconditions: Vec<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HandoffBriefArgs {
    /// The id of the session you are picking up (as `engram session list` shows it): its
    /// working memory is shown too. Optional.
    #[serde(default)]
    pub session: Option<String>,
    /// Items per section at most, 1 to 100; default 50 (the latest are kept).
    #[serde(default)]
    pub max_items: Option<usize>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SkillsArgs {
    /// What you want to do: skills are ranked by how well they match it. Give this or `name`.
    #[serde(default)]
    pub task: Option<String>,
    /// One skill by its exact name (its latest version).
    #[serde(default)]
    pub name: Option<String>,
    /// How many skills at most, 1 to 100; default 5.
    #[serde(default)]
    pub limit: Option<usize>,
}

/// One skill.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Skill {
    pub name: String,
    pub version: Option<u64>,
    pub description: String,
    pub steps: Vec<String>,
    pub preconditions: Vec<String>,
    /// Reported outcomes of this version.
    pub successes: u64,
    pub failures: u64,
    /// How often it worked, 0 to 1 (0.5 when untried).
    pub success_rate: f64,
    /// How well it matches `task`; higher is better.
    pub score: Option<f64>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct Skills {
    pub skills: Vec<Skill>,
}

/// A task's status on the board.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    Todo,
    Doing,
    Blocked,
    Done,
}

/// A task to add, or the fields of one to change.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskChange {
    /// The task's id: letters, digits, `-` and `_`, e.g. "fix-login". A new id adds a task.
    pub id: String,
    /// Required for a new task (at most 512 characters).
    #[serde(default)]
    pub title: Option<String>,
    /// todo (the default for a new task), doing, blocked or done.
    #[serde(default)]
    pub status: Option<TaskStatus>,
    /// Who works on it (at most 128 characters).
    #[serde(default)]
    pub owner: Option<String>,
    /// A note to append to the task's notes (at most 2000 characters).
    #[serde(default)]
    pub note: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskBoardArgs {
    /// Which board: letters, digits, `-` and `_`; default "main".
    #[serde(default)]
    pub board: Option<String>,
    /// Tasks to add or change, by id (at most 50). Only the fields you give change. Leave
    /// this and `remove` out to just read the board.
    #[serde(default)]
    pub upsert: Vec<TaskChange>,
    /// Ids of tasks to take off the board (at most 50).
    #[serde(default)]
    pub remove: Vec<String>,
}

/// One task on the board.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Task {
    pub id: String,
    pub title: String,
    pub status: String,
    pub owner: Option<String>,
    pub notes: Vec<String>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct Board {
    pub board: String,
    /// The scope the board lives in (`kind:id`).
    pub scope: String,
    /// By id.
    pub tasks: Vec<Task>,
    /// Fields two writers set at once: every value is kept, the one shown first. Settle one
    /// by setting the field again.
    pub conflicts: Vec<DocConflict>,
    /// Ids in `remove` that were not on the board.
    pub not_found: Vec<String>,
    /// The log position of this update, when it changed the board.
    pub seq: Option<u64>,
    /// More tasks than this answer lists were on the board.
    pub truncated: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForgetArgs {
    /// The `event_id`s of the memories to withdraw (from `recall` or `remember`; at most 100).
    pub event_ids: Vec<String>,
    /// Why, kept in the audit log (at most 1000 characters).
    pub reason: String,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct Forgot {
    /// How many ids were named. Only memories of this server's scope are withdrawn; others
    /// are ignored.
    pub requested: usize,
    /// The log position of the withdrawal; reads through this server no longer return them.
    pub seq: u64,
}

// ---------------------------------------------------------------------------------------------
// Descriptions, written for a model.

const REMEMBER: &str = "Store a memory in Engram, the long-term memory you share with your team of agents. \
Use it whenever you learn, decide, do or finish something worth knowing later: a finding, a cause, a user's \
preference, how an attempt turned out. Write the text so that it stands on its own. \
Returns the memory's event_id (for `forget`) and its seq; every later read through this server sees it.";

const RECALL: &str = "Search the shared memory for what is known about a question. Use it before you act on \
something others or your earlier self may already have found out. Returns the best-matching memories, best \
first, each with its text, score, event_id, when it happened, kind, scope, author and tags.";

const BUILD_CONTEXT: &str = "Assemble everything relevant for your next step into one text within a token \
budget: working memory, open tasks of the task boards, current facts, matching skills and memories. Call it \
at the start of a step with a short description of the step. Returns the rendered context and its sources.";

const ASSERT_FACT: &str = "Record a fact: `subject` `predicate` `object`, e.g. checkout-service runs_on \
postgres 16. A later fact with the same subject and predicate and another object replaces it (its history is \
kept). Use it for stable, structured knowledge; use `remember` for everything else. Returns event_id and seq.";

const FACTS: &str = "Look up facts, optionally by subject and predicate, as they are now or as they were at a \
time (`as_of`), or a fact's whole history. Returns each fact's subject, predicate, object, validity, \
confidence and the events that asserted it.";

const RECORD_SKILL: &str = "Record a reusable procedure (a skill): its name, what it does and when to use it, \
its steps and preconditions. Recording an existing name adds a version. Use it once a way of working has \
proved itself, so other agents can find it with `skills`. Returns event_id and seq.";

const SKILLS: &str = "Find skills (recorded procedures): the ones best matching a task description, or one \
by name. Returns each skill's name, version, description, steps, preconditions and how often it worked.";

const HANDOFF_BRIEF: &str = "The handoff brief of your task, to pick up where another agent or session left \
off: the task's sessions (role, machine, exit, last checkpoint), what was decided and why, what failed and how \
it was fixed (or that it is unresolved), the task board's open items, the skills recorded, the artifacts. \
Every line cites the event_ids it comes from. Returns it as Markdown and as structured JSON.";

const TASK_BOARD: &str = "Read or update the task board you share with the other agents of your scope. With \
no changes it returns the board. `upsert` adds tasks or changes their title, status (todo, doing, blocked, \
done) or owner and appends notes, by task id; `remove` takes tasks off. Concurrent updates by other agents \
merge; a field two agents set at once is listed in `conflicts`. Returns the board's tasks and conflicts.";

const FORGET: &str = "Withdraw memories from recall by their event_ids, with a reason: use it for a memory \
that is wrong, outdated or must not be kept (a leaked secret). The log keeps an audit record; recall and \
build_context no longer return them. Returns how many ids were named and the seq of the withdrawal.";

// ---------------------------------------------------------------------------------------------
// The tools.

/// What every tool call shares: the identity, a span, the metrics.
impl EngramMcp {
    async fn run<T, F, Fut>(
        &self,
        tool: &'static str,
        ctx: &RequestContext<RoleServer>,
        work: F,
    ) -> Result<Json<T>, String>
    where
        F: FnOnce(Identity) -> Fut,
        Fut: Future<Output = Result<T, ToolError>>,
    {
        let started = Instant::now();
        let result = match self.identity(ctx) {
            Ok(identity) => {
                let span = tracing::info_span!(
                    "mcp_tool",
                    tool,
                    tenant = %identity.tenant(),
                    agent = %identity.agent_id(),
                    scope = %identity.scope(),
                );
                work(identity).instrument(span).await
            }
            Err(e) => Err(e),
        };
        let outcome = if result.is_ok() { "ok" } else { "error" };
        engram_telemetry::metrics::MCP_TOOL_CALLS
            .with_label_values(&[tool, outcome])
            .inc();
        engram_telemetry::metrics::MCP_TOOL_SECONDS
            .with_label_values(&[tool])
            .observe(started.elapsed().as_secs_f64());
        result.map(Json).map_err(|e| {
            tracing::debug!(tool, error = %e, "mcp tool call failed");
            e.0
        })
    }
}

#[tool_router(vis = "pub(crate)")]
impl EngramMcp {
    #[tool(
        name = "remember",
        description = REMEMBER,
        input_schema = input::<RememberArgs>(),
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = false)
    )]
    async fn remember(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Stored>, String> {
        self.run("remember", &ctx, |id| remember(id, args)).await
    }

    #[tool(
        name = "recall",
        description = RECALL,
        input_schema = input::<RecallArgs>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn recall(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Recalled>, String> {
        self.run("recall", &ctx, |id| recall(id, args)).await
    }

    #[tool(
        name = "build_context",
        description = BUILD_CONTEXT,
        input_schema = input::<BuildContextArgs>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn build_context(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<BuiltContext>, String> {
        self.run("build_context", &ctx, |id| build_context(id, args))
            .await
    }

    #[tool(
        name = "assert_fact",
        description = ASSERT_FACT,
        input_schema = input::<AssertFactArgs>(),
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = false)
    )]
    async fn assert_fact(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Stored>, String> {
        self.run("assert_fact", &ctx, |id| assert_fact(id, args))
            .await
    }

    #[tool(
        name = "facts",
        description = FACTS,
        input_schema = input::<FactsArgs>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn facts(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Facts>, String> {
        self.run("facts", &ctx, |id| facts(id, args)).await
    }

    #[tool(
        name = "record_skill",
        description = RECORD_SKILL,
        input_schema = input::<RecordSkillArgs>(),
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = false)
    )]
    async fn record_skill(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Stored>, String> {
        self.run("record_skill", &ctx, |id| record_skill(id, args))
            .await
    }

    #[tool(
        name = "skills",
        description = SKILLS,
        input_schema = input::<SkillsArgs>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn skills(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Skills>, String> {
        self.run("skills", &ctx, |id| skills(id, args)).await
    }

    #[tool(
        name = "task_board",
        description = TASK_BOARD,
        input_schema = input::<TaskBoardArgs>(),
        annotations(read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn task_board(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Board>, String> {
        self.run("task_board", &ctx, |id| task_board(id, args))
            .await
    }

    #[tool(
        name = "handoff_brief",
        description = HANDOFF_BRIEF,
        input_schema = input::<HandoffBriefArgs>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn handoff_brief(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<proto::BriefResponse>, String> {
        self.run("handoff_brief", &ctx, |id| handoff_brief(id, args))
            .await
    }

    #[tool(
        name = "forget",
        description = FORGET,
        input_schema = input::<ForgetArgs>(),
        annotations(read_only_hint = false, destructive_hint = true, open_world_hint = false)
    )]
    async fn forget(
        &self,
        args: JsonObject,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Forgot>, String> {
        self.run("forget", &ctx, |id| forget(id, args)).await
    }
}

async fn remember(identity: Identity, args: JsonObject) -> Result<Stored, ToolError> {
    let args: RememberArgs = decode(&identity, args)?;
    let body = text("text", &args.text, MAX_TEXT_CHARS)?;
    let importance = unit_interval("importance", args.importance)?;
    if args.tags.len() > MAX_TAGS {
        return Err(ToolError(format!(
            "{} tags, at most {MAX_TAGS}: keep the most telling",
            args.tags.len()
        )));
    }
    let (layer, kind) = args.kind.unwrap_or_default().event();
    let mut event = identity
        .agent()
        .event(identity.scope().clone(), layer, kind, body);
    if let Some(importance) = importance {
        event = event.importance(importance);
    }
    for tag in &args.tags {
        event = event.tag(text("tags", tag, MAX_TAG_CHARS)?);
    }
    let event = event.build().map_err(schema_error)?;
    append(&identity, &event).await
}

async fn append(identity: &Identity, event: &engram_sdk::Envelope) -> Result<Stored, ToolError> {
    let receipt = identity
        .client()
        .append(event)
        .await
        .map_err(|e| append_error(identity, e))?;
    identity.wrote(receipt.seq);
    Ok(Stored {
        event_id: event.event_id.to_string(),
        seq: receipt.seq,
    })
}

/// The kinds `recall` returns: memories, not the bookkeeping events (document changes,
/// withdrawals) whose texts only describe themselves.
const MEMORY_KINDS: [EventKind; 9] = [
    EventKind::Observation,
    EventKind::Action,
    EventKind::Outcome,
    EventKind::Preference,
    EventKind::Feedback,
    EventKind::Checkpoint,
    EventKind::Consolidated,
    EventKind::FactAsserted,
    EventKind::SkillRecorded,
];

async fn recall(identity: Identity, args: JsonObject) -> Result<Recalled, ToolError> {
    let args: RecallArgs = decode(&identity, args)?;
    let request = proto::RetrieveRequest {
        scopes: identity.scopes(),
        query: text("query", &args.query, MAX_QUERY_CHARS)?,
        vector: None,
        top_k: limit(args.limit, 8)?,
        filter: MemoryFilter {
            kinds: MEMORY_KINDS.to_vec(),
            ..MemoryFilter::default()
        },
        consistency: identity.consistency(),
        mode: proto::RetrievalMode::Hybrid,
        ranking: None,
    };
    let response = identity
        .client()
        .retrieve(&request)
        .await
        .map_err(|e| query_error(&identity, e))?;
    let memories = response
        .results
        .into_iter()
        .map(|m| Memory {
            text: m.text,
            score: m.score,
            event_id: m.event_id.to_string(),
            when: m.occurred_at,
            kind: m.kind.to_string(),
            scope: m.scope.to_string(),
            agent: m.agent_id.to_string(),
            tags: m.tags,
            confidence: m.confidence,
        })
        .collect();
    Ok(Recalled { memories })
}

async fn build_context(identity: Identity, args: JsonObject) -> Result<BuiltContext, ToolError> {
    let args: BuildContextArgs = decode(&identity, args)?;
    let task = text("task", &args.task, MAX_QUERY_CHARS)?;
    let token_budget = match args.token_budget {
        None => 1024,
        Some(n) if (MIN_TOKEN_BUDGET..=MAX_TOKEN_BUDGET).contains(&n) => n,
        Some(n) => {
            return Err(ToolError(format!(
                "`token_budget` is {n}; give {MIN_TOKEN_BUDGET} to {MAX_TOKEN_BUDGET}"
            )));
        }
    };
    // The query service reads the working memory of the task scope named here: the own
    // scope's when it is a task, else the first task scope read.
    let task_id = std::iter::once(identity.scope())
        .chain(identity.reads())
        .find(|s| s.kind == ScopeKind::Task)
        .unwrap_or(identity.scope())
        .id
        .to_string();
    let request = proto::ContextRequest {
        scopes: identity.scopes(),
        agent_id: identity.agent_id().clone(),
        task: task_id,
        query: task,
        vector: None,
        token_budget,
        consistency: identity.consistency(),
    };
    let context = identity
        .client()
        .build_context(&request)
        .await
        .map_err(|e| query_error(&identity, e))?;
    Ok(BuiltContext {
        sources: context.items.iter().map(|i| i.source.clone()).collect(),
        context: context.rendered,
        tokens: context.tokens,
        token_budget: context.token_budget,
        dropped: context.dropped,
    })
}

async fn assert_fact(identity: Identity, args: JsonObject) -> Result<Stored, ToolError> {
    let args: AssertFactArgs = decode(&identity, args)?;
    let mut data = serde_json::json!({
        "subject": text("subject", &args.subject, MAX_TERM_CHARS)?,
        "predicate": text("predicate", &args.predicate, MAX_TERM_CHARS)?,
        "object": text("object", &args.object, MAX_OBJECT_CHARS)?,
    });
    if let Some(from) = args.valid_from {
        data["valid_from"] = Value::String(from.to_rfc3339());
    }
    if let Some(confidence) = unit_interval("confidence", args.confidence)? {
        data["confidence"] = confidence.into();
    }
    // No text: the fact table serves it; as a memory it would only repeat the triple.
    let event = identity
        .agent()
        .event(
            identity.scope().clone(),
            Layer::Semantic,
            EventKind::FactAsserted,
            "",
        )
        .data(data)
        .build()
        .map_err(schema_error)?;
    append(&identity, &event).await
}

async fn facts(identity: Identity, args: JsonObject) -> Result<Facts, ToolError> {
    let args: FactsArgs = decode(&identity, args)?;
    let subject = optional_text("subject", args.subject.as_deref(), MAX_TERM_CHARS)?;
    let predicate = optional_text("predicate", args.predicate.as_deref(), MAX_TERM_CHARS)?;
    if args.history && (subject.is_none() || predicate.is_none()) {
        return Err(ToolError(
            "`history` needs both `subject` and `predicate`: it lists the versions of one fact"
                .into(),
        ));
    }
    let request = proto::FactsRequest {
        scopes: identity.scopes(),
        subject,
        predicate,
        text: None,
        valid_at: args.as_of,
        known_at: None,
        history: args.history,
        limit: limit(args.limit, 20)?,
        consistency: identity.consistency(),
    };
    let response = identity
        .client()
        .facts(&request)
        .await
        .map_err(|e| query_error(&identity, e))?;
    Ok(Facts {
        facts: response.facts.iter().map(fact).collect(),
    })
}

/// A fact table row (its own shape, `engram_facts::Fact`) as the model reads it.
fn fact(row: &Value) -> Fact {
    let string = |key: &str| row.get(key).and_then(Value::as_str).map(str::to_owned);
    let set = |key: &str| row.get(key).is_some_and(|v| !v.is_null());
    Fact {
        subject: string("subject").unwrap_or_default(),
        predicate: string("predicate").unwrap_or_default(),
        object: row.get("object").cloned().unwrap_or(Value::Null),
        valid_from: string("valid_from"),
        valid_to: string("valid_to"),
        confidence: row.get("confidence").and_then(Value::as_f64),
        superseded: set("superseded_by"),
        retracted: set("retracted_at"),
        event_ids: row
            .get("sources")
            .and_then(Value::as_array)
            .map(|sources| {
                sources
                    .iter()
                    .filter_map(|s| s.pointer("/provenance/event_id").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default(),
    }
}

fn list(field: &str, values: &[String]) -> Result<Vec<String>, ToolError> {
    if values.len() > MAX_STEPS {
        return Err(ToolError(format!(
            "{} {field}, at most {MAX_STEPS}: merge some",
            values.len()
        )));
    }
    values
        .iter()
        .map(|v| text(field, v, MAX_STEP_CHARS))
        .collect()
}

async fn record_skill(identity: Identity, args: JsonObject) -> Result<Stored, ToolError> {
    let args: RecordSkillArgs = decode(&identity, args)?;
    let mut data = serde_json::json!({
        "name": text("name", &args.name, MAX_NAME_CHARS)?,
        "description": text("description", &args.description, MAX_STEP_CHARS)?,
    });
    let steps = list("steps", &args.steps)?;
    if !steps.is_empty() {
        data["steps"] = steps.into();
    }
    let preconditions = list("preconditions", &args.preconditions)?;
    if !preconditions.is_empty() {
        data["preconditions"] = preconditions.into();
    }
    let event = identity
        .agent()
        .event(
            identity.scope().clone(),
            Layer::Procedural,
            EventKind::SkillRecorded,
            "",
        )
        .data(data)
        .build()
        .map_err(schema_error)?;
    append(&identity, &event).await
}

async fn skills(identity: Identity, args: JsonObject) -> Result<Skills, ToolError> {
    let args: SkillsArgs = decode(&identity, args)?;
    let task = optional_text("task", args.task.as_deref(), MAX_QUERY_CHARS)?;
    let name = optional_text("name", args.name.as_deref(), MAX_NAME_CHARS)?;
    if task.is_some() == name.is_some() {
        return Err(ToolError(
            "give either `task` (what you want to do) or `name` (one skill), not both or neither"
                .into(),
        ));
    }
    let request = proto::SkillsRequest {
        scopes: identity.scopes(),
        task,
        name,
        limit: limit(args.limit, 5)?,
        consistency: identity.consistency(),
    };
    let response = identity
        .client()
        .skills(&request)
        .await
        .map_err(|e| query_error(&identity, e))?;
    Ok(Skills {
        skills: response.skills.iter().map(skill).collect(),
    })
}

async fn handoff_brief(
    identity: Identity,
    args: JsonObject,
) -> Result<proto::BriefResponse, ToolError> {
    let args: HandoffBriefArgs = decode(&identity, args)?;
    if identity.scope().kind != ScopeKind::Task {
        return Err(ToolError(format!(
            "this server's scope is {}, not a task: a brief is of a task scope, fixed by the server's configuration (`engram mcp --scope task:<id>`)",
            identity.scope()
        )));
    }
    let session = optional_text("session", args.session.as_deref(), 64)?
        .map(|s| Ident::parse("session", &s).map_err(schema_error))
        .transpose()?;
    let request = proto::BriefRequest {
        scopes: ScopeRequest {
            tenant: identity.tenant().clone(),
            scope: identity.scope().clone(),
            grants: Vec::new(),
        },
        session,
        max_items: Some(limit(args.max_items, 50)?),
        max_events: None,
    };
    identity
        .client()
        .brief(&request)
        .await
        .map_err(|e| query_error(&identity, e))
}

/// A skill registry entry (its own shape, `engram_skills::Skill`) as the model reads it.
fn skill(row: &Value) -> Skill {
    let strings = |key: &str| -> Vec<String> {
        row.get(key)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let count = |key: &str| row.get(key).and_then(Value::as_u64).unwrap_or(0);
    let (successes, failures) = (count("successes"), count("failures"));
    Skill {
        name: row
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        version: row.get("version").and_then(Value::as_u64),
        description: row
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        steps: strings("steps"),
        preconditions: strings("preconditions"),
        successes,
        failures,
        success_rate: (successes as f64 + 1.0) / ((successes + failures) as f64 + 2.0),
        score: row.get("score").and_then(Value::as_f64),
    }
}

const BOARD_TYPE: &str = "task_board";

/// A JSON-pointer-safe id: the identifier rules of scopes (no `/` or `~` to escape).
fn task_id(field: &str, value: &str) -> Result<String, ToolError> {
    Ident::parse("id", value.trim())
        .map(|id| id.to_string())
        .map_err(|e| ToolError(format!("`{field}` {value:?}: {e}")))
}

async fn task_board(identity: Identity, args: JsonObject) -> Result<Board, ToolError> {
    let args: TaskBoardArgs = decode(&identity, args)?;
    let board = task_id("board", args.board.as_deref().unwrap_or("main"))?;
    let changes = args.upsert.len() + args.remove.len();
    if args.upsert.len() > MAX_BOARD_CHANGES || args.remove.len() > MAX_BOARD_CHANGES {
        return Err(ToolError(format!(
            "{} tasks to upsert and {} to remove, at most {MAX_BOARD_CHANGES} of each per call: split them over several calls",
            args.upsert.len(),
            args.remove.len()
        )));
    }
    let current = read_board(&identity, &board).await?;
    if changes == 0 {
        return Ok(board_of(
            &identity,
            board,
            &current.0,
            current.1,
            Vec::new(),
            None,
        ));
    }
    let items = current.0.get("items").and_then(Value::as_object);
    let mut sets = Vec::new();
    let mut deletes = Vec::new();
    let mut not_found = Vec::new();
    for change in &args.upsert {
        let id = task_id("upsert.id", &change.id)?;
        let title = optional_text("title", change.title.as_deref(), MAX_TITLE_CHARS)?;
        let owner = optional_text("owner", change.owner.as_deref(), MAX_OWNER_CHARS)?;
        let note = optional_text("note", change.note.as_deref(), MAX_NOTE_CHARS)?;
        let status = change
            .status
            .map(|s| serde_json::to_value(s).expect("a status"));
        let at = format!("/items/{id}");
        match items.and_then(|items| items.get(&id)) {
            None => {
                let title = title
                    .ok_or_else(|| ToolError(format!("task {id} is new: give it a `title`")))?;
                let mut item = serde_json::json!({
                    "title": title,
                    "status": status.unwrap_or_else(|| "todo".into()),
                    "notes": note.into_iter().collect::<Vec<_>>(),
                });
                if let Some(owner) = owner {
                    item["owner"] = owner.into();
                }
                sets.push((at, item));
            }
            Some(existing) => {
                if let Some(title) = title {
                    sets.push((format!("{at}/title"), title.into()));
                }
                if let Some(status) = status {
                    sets.push((format!("{at}/status"), status));
                }
                if let Some(owner) = owner {
                    sets.push((format!("{at}/owner"), owner.into()));
                }
                if let Some(note) = note {
                    if existing.get("notes").is_some_and(Value::is_array) {
                        sets.push((format!("{at}/notes/-"), note.into()));
                    } else {
                        sets.push((format!("{at}/notes"), vec![note].into()));
                    }
                }
            }
        }
    }
    for id in &args.remove {
        let id = task_id("remove", id)?;
        if items.is_some_and(|items| items.contains_key(&id)) {
            deletes.push(format!("/items/{id}"));
        } else {
            not_found.push(id);
        }
    }
    if sets.is_empty() && deletes.is_empty() {
        return Ok(board_of(
            &identity, board, &current.0, current.1, not_found, None,
        ));
    }
    let edit = identity
        .agent()
        .edit_doc(
            identity.scope().clone(),
            BOARD_TYPE,
            &board,
            identity.min_seq(),
            &sets,
            &deletes,
        )
        .await;
    match edit {
        Ok(edit) => {
            identity.wrote(edit.receipt.seq);
            let seq = Some(edit.receipt.seq);
            Ok(board_of(
                &identity,
                board,
                &edit.view.value,
                edit.conflicts,
                not_found,
                seq,
            ))
        }
        Err(DocEditError::Unchanged) => Ok(board_of(
            &identity, board, &current.0, current.1, not_found, None,
        )),
        Err(DocEditError::Client(engram_sdk::doc::DocClientError::Append(e))) => {
            Err(append_error(&identity, e))
        }
        Err(DocEditError::Client(engram_sdk::doc::DocClientError::Rpc(e))) => {
            Err(query_error(&identity, e))
        }
        Err(e) => Err(ToolError(format!("{e}; fix the changes and call again"))),
    }
}

/// The board's state (`{}` when it does not exist yet) and its conflicts.
async fn read_board(
    identity: &Identity,
    board: &str,
) -> Result<(Value, Vec<DocConflict>), ToolError> {
    let request = proto::DocRequest {
        scopes: ScopeRequest {
            grants: Vec::new(),
            ..identity.scopes()
        },
        read: proto::DocRead::State,
        doc_type: Some(Ident::parse("doc_type", BOARD_TYPE).expect("a valid type")),
        name: Some(Ident::parse("board", board).map_err(schema_error)?),
        include_bytes: false,
        include_values: false,
        limit: 1,
        consistency: identity.consistency(),
    };
    let response = identity
        .client()
        .doc(&request)
        .await
        .map_err(|e| query_error(identity, e))?;
    let value = response
        .doc
        .and_then(|d| d.value)
        .unwrap_or_else(|| serde_json::json!({}));
    Ok((value, response.conflicts))
}

fn board_of(
    identity: &Identity,
    board: String,
    value: &Value,
    conflicts: Vec<DocConflict>,
    not_found: Vec<String>,
    seq: Option<u64>,
) -> Board {
    let empty = serde_json::Map::new();
    let items = value
        .get("items")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let tasks: BTreeMap<&String, &Value> = items.iter().collect();
    let truncated = tasks.len() > MAX_BOARD_TASKS;
    let tasks = tasks
        .into_iter()
        .take(MAX_BOARD_TASKS)
        .map(|(id, item)| Task {
            id: id.clone(),
            title: item
                .get("title")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            status: item
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or("todo")
                .to_owned(),
            owner: item.get("owner").and_then(Value::as_str).map(str::to_owned),
            notes: item
                .get("notes")
                .and_then(Value::as_array)
                .map(|n| {
                    n.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect();
    Board {
        board,
        scope: identity.scope().to_string(),
        tasks,
        conflicts,
        not_found,
        seq,
        truncated,
    }
}

async fn forget(identity: Identity, args: JsonObject) -> Result<Forgot, ToolError> {
    let args: ForgetArgs = decode(&identity, args)?;
    if args.event_ids.is_empty() || args.event_ids.len() > MAX_FORGET {
        return Err(ToolError(format!(
            "{} event ids; give 1 to {MAX_FORGET} per call",
            args.event_ids.len()
        )));
    }
    let ids = args
        .event_ids
        .iter()
        .map(|id| {
            EventId::parse(id.trim()).map_err(|_| {
                ToolError(format!(
                    "{id:?} is not an event id: use an `event_id` exactly as `recall` or `remember` returned it"
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let reason = text("reason", &args.reason, MAX_REASON_CHARS)?;
    let receipt = identity
        .agent()
        .forget(identity.scope().clone(), Layer::Episodic, &ids, reason)
        .await
        .map_err(|e| append_error(&identity, e))?;
    identity.wrote(receipt.seq);
    Ok(Forgot {
        requested: ids.len(),
        seq: receipt.seq,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_is_described_bounded_in_its_schema_and_takes_no_identity() {
        let tools = EngramMcp::tool_router().list_all();
        assert_eq!(tools.len(), 10);
        for tool in tools {
            assert!(tool.description.as_deref().unwrap_or_default().len() > 80);
            let schema = &tool.input_schema;
            assert_eq!(schema.get("type"), Some(&serde_json::json!("object")));
            // What the schema does not list is refused, and the schema says so.
            assert_eq!(
                schema.get("additionalProperties"),
                Some(&serde_json::json!(false)),
                "{}",
                tool.name
            );
            let properties = schema.get("properties").and_then(Value::as_object);
            for identity in IDENTITY_ARGS {
                assert!(
                    !properties.is_some_and(|p| p.contains_key(*identity)),
                    "{} takes {identity}",
                    tool.name
                );
            }
            assert!(
                tool.output_schema.is_some(),
                "{} has no output schema",
                tool.name
            );
        }
    }

    #[test]
    fn texts_are_trimmed_and_bounded_with_a_message_saying_what_to_do() {
        assert_eq!(text("text", "  hi  ", 10).unwrap(), "hi");
        assert!(text("text", "   ", 10).unwrap_err().0.contains("is empty"));
        let long = text("text", &"é".repeat(11), 10).unwrap_err();
        assert!(long.0.contains("11 characters, at most 10"), "{long}");
        assert!(limit(Some(0), 8).is_err() && limit(Some(101), 8).is_err());
        assert_eq!(limit(None, 8).unwrap(), 8);
        assert!(unit_interval("importance", Some(f64::NAN)).is_err());
    }
}

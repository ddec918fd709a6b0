//! The records of an `engram run` session: what happened to one run of an agent program, as
//! events of the task it worked on.
//!
//! A session's records are `checkpoint` events whose `content.data` names the session and the
//! step, `{"session": "<id>", "event": "<step>", …}`, followed by that step's fields:
//! - `started`: the role, the command (argv, bounded), the machine, the pid, the heartbeat
//!   interval and the working directory ([`SessionStarted`]);
//! - `heartbeat`: the beat's number, counting from 1 ([`SessionHeartbeat`]). A session
//!   whose heartbeats stop without an `ended` record is dead;
//! - `checkpoint`: a note, and whether a signal or a request asked for it
//!   ([`SessionCheckpointed`]);
//! - `artifact`: a named file stored in the Object Store, with its size and SHA-256
//!   ([`ArtifactStored`]);
//! - `ended`: the exit code or the signal, and how long the program ran ([`SessionEnded`]).
//!
//! `engram run` appends them to the task's scope (`task:<id>`), in the `working` layer: the
//! task's readers see its sessions in one replay of that scope, and the records are never
//! text memories (only episodic and semantic events are indexed), so a heartbeat never
//! comes back from retrieval. Their `content.text` is a one-line summary for people reading
//! a replay; the data is the record.
//!
//! Why `checkpoint` events and not kinds of their own: the kind is a closed enum that every
//! reader decodes, and a kind an older reader does not know makes it refuse the whole event
//! (an older leaf node, a client in another language, a projector that dead-letters it).
//! A checkpoint is already "a point in a session's progress"; a checkpoint's data is free
//! unless it names a session, as an outcome's is unless it names a skill, so older readers
//! see a checkpoint they need not interpret, and no existing checkpoint (a LangGraph
//! saver's, a consolidator's `finished`) changes meaning.
//!
//! Every field is bounded and checked at append like the other payloads ([`crate::payload`]);
//! a refusal names the field, `content.data.<name>`.

use schemars::{JsonSchema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::envelope::{Content, Envelope, EventKind};
use crate::ident::Ident;
use crate::payload::{Field, PayloadError, at_most, carries, fields, read, term};

/// The Object Store bucket of a tenant's artifacts. One per tenant: what syncs to a leaf
/// node (its tenant's bucket, whole) then never holds another tenant's.
pub fn artifacts_bucket(tenant: &Ident) -> String {
    format!("ENGRAM_ARTIFACTS_{tenant}")
}

/// The one bucket artifacts went to before buckets were per tenant; still read.
pub const LEGACY_ARTIFACTS_BUCKET: &str = "ENGRAM_ARTIFACTS";

/// The data key that makes a `checkpoint` a session record: the session's id.
pub const SESSION_KEY: &str = "session";
/// Most argv items a `started` record keeps; a longer command is cut (and says so).
pub const MAX_ARGV: usize = 64;
/// Longest argv item kept, in characters.
pub const MAX_ARG_CHARS: usize = 1024;
/// Longest machine name, in characters (a DNS name is at most 253).
pub const MAX_MACHINE_CHARS: usize = 253;
/// Longest working directory, in characters (Linux's `PATH_MAX`).
pub const MAX_WORKDIR_CHARS: usize = 4096;
/// Longest checkpoint note, in characters.
pub const MAX_NOTE_CHARS: usize = 4096;
/// Longest artifact name, in characters.
pub const MAX_ARTIFACT_NAME_CHARS: usize = 128;
/// Longest object name, in characters.
pub const MAX_OBJECT_CHARS: usize = 1024;
/// The heartbeat interval's bounds, in milliseconds: one a second at most, one an hour at
/// least.
pub const MIN_HEARTBEAT_MS: u64 = 1_000;
pub const MAX_HEARTBEAT_MS: u64 = 3_600_000;
/// Highest signal number (Linux's real-time signals end at 64).
pub const MAX_SIGNAL: i32 = 64;

/// Which record of a session an event is: `content.data.event`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionStep {
    Started,
    Heartbeat,
    Checkpoint,
    Artifact,
    Ended,
}

impl SessionStep {
    pub const ALL: [SessionStep; 5] = [
        Self::Started,
        Self::Heartbeat,
        Self::Checkpoint,
        Self::Artifact,
        Self::Ended,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Heartbeat => "heartbeat",
            Self::Checkpoint => "checkpoint",
            Self::Artifact => "artifact",
            Self::Ended => "ended",
        }
    }
}

impl std::fmt::Display for SessionStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `started`: a program began to run under `engram run`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionStarted {
    /// The role the program plays in the task (`planner`, `coder`, …).
    pub role: Ident,
    /// The command as run: 1-64 argv items of at most 1024 characters each, the first
    /// non-empty. A longer command is recorded cut ([`SessionStarted::bounded_command`]).
    #[schemars(length(min = 1, max = MAX_ARGV), inner(length(max = MAX_ARG_CHARS)))]
    pub command: Vec<String>,
    /// Whether `command` was cut to fit its bounds; default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub command_truncated: bool,
    /// The machine's host name. Trimmed, then 1-253 characters without control characters.
    #[schemars(length(min = 1, max = MAX_MACHINE_CHARS), regex(pattern = r"\S"))]
    pub machine: String,
    /// The program's process id on that machine, 1 or more.
    #[schemars(range(min = 1))]
    pub pid: u32,
    /// How often a heartbeat is recorded, in milliseconds (1000-3600000). A session with no
    /// record for three intervals and no `ended` record is dead.
    #[schemars(range(min = MIN_HEARTBEAT_MS, max = MAX_HEARTBEAT_MS))]
    pub heartbeat_ms: u64,
    /// The directory the program ran in, on that machine (at most 4096 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_WORKDIR_CHARS))]
    pub workdir: Option<String>,
    /// What the run's key may use: `shared` (the task's scope and the session's) or
    /// `isolated` (the session's own scope, and those of the sessions it resumes). Absent
    /// in records older than the field, which ran shared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<SessionContext>,
    /// The session this one resumes (`engram session resume --exec`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumes: Option<Ident>,
}

/// Whether a session's key shares the task's scope with the task's other sessions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionContext {
    /// Reads and writes the task's scope, beside the session's own.
    #[default]
    Shared,
    /// Reads and writes only the session's own scope (and its resumed sessions').
    Isolated,
}

impl SessionContext {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Isolated => "isolated",
        }
    }
}

/// `heartbeat`: the session's supervisor was alive, and so was the program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SessionHeartbeat {
    /// The beat's number in its session, from 1.
    #[schemars(range(min = 1))]
    pub beat: u64,
}

/// What asked for a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointVia {
    /// `SIGUSR1` sent to `engram run`.
    Signal,
    /// A request on the session's socket (`engram session checkpoint` from inside the run).
    Request,
}

impl CheckpointVia {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Signal => "signal",
            Self::Request => "request",
        }
    }
}

/// `checkpoint`: the program marked a point in its progress.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionCheckpointed {
    /// What the point is. Trimmed, then 1-4096 characters.
    #[schemars(length(min = 1, max = MAX_NOTE_CHARS), regex(pattern = r"\S"))]
    pub note: String,
    pub via: CheckpointVia,
}

/// `artifact`: a file the program declared, stored in the Object Store and read back to
/// check its hash before this record was appended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ArtifactStored {
    /// The artifact's name in its session: 1-128 of `A-Z a-z 0-9 . _ -`, not starting with
    /// a dot ([`check_artifact_name`]).
    #[schemars(regex(pattern = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"))]
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// The SHA-256 of its bytes: 64 lowercase hex digits.
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub sha256: String,
    /// The Object Store bucket that holds it.
    pub bucket: Ident,
    /// Its object's name in that bucket: 1-1024 characters without control characters.
    #[schemars(length(min = 1, max = MAX_OBJECT_CHARS))]
    pub object: String,
}

/// `ended`: the program exited, by itself or by a signal. Exactly one of `exit_code` and
/// `signal` is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SessionEnded {
    /// The exit status it returned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that ended it, 1-64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_SIGNAL))]
    pub signal: Option<i32>,
    /// How long it ran, in milliseconds.
    pub duration_ms: u64,
}

/// One step's record.
#[derive(Clone, Debug, PartialEq)]
pub enum SessionEvent {
    Started(SessionStarted),
    Heartbeat(SessionHeartbeat),
    Checkpoint(SessionCheckpointed),
    Artifact(ArtifactStored),
    Ended(SessionEnded),
}

/// A checked session record: which session, and what happened to it.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionRecord {
    pub session: Ident,
    pub event: SessionEvent,
}

/// The keys every record has, read first to know which step's fields follow.
#[derive(Deserialize)]
struct Header {
    session: Ident,
    event: SessionStep,
}

const HEADER_FIELDS: &[Field] = fields! {
    required "session" => "the session's id (1-64 of A-Z a-z 0-9 _ -)";
    required "event" => "\"started\", \"heartbeat\", \"checkpoint\", \"artifact\" or \"ended\"";
};

const STARTED_FIELDS: &[Field] = fields! {
    required "role" => "the role's name (1-64 of A-Z a-z 0-9 _ -)";
    required "command" => "an array of 1-64 strings, the program first";
    optional "command_truncated" => "true or false";
    required "machine" => "the host name";
    required "pid" => "the process id, a whole number of at least 1";
    required "heartbeat_ms" => "the heartbeat interval in milliseconds (1000-3600000)";
    optional "workdir" => "the working directory, a string";
    optional "context" => "\"shared\" or \"isolated\"";
    optional "resumes" => "the id of the session this one resumes";
};

const HEARTBEAT_FIELDS: &[Field] = fields! {
    required "beat" => "the beat's number, a whole number of at least 1";
};

const CHECKPOINT_FIELDS: &[Field] = fields! {
    required "note" => "a non-empty string";
    required "via" => "\"signal\" or \"request\"";
};

const ARTIFACT_FIELDS: &[Field] = fields! {
    required "name" => "1-128 of A-Z a-z 0-9 . _ -, not starting with a dot";
    required "size" => "the size in bytes, a whole number";
    required "sha256" => "64 lowercase hex digits";
    required "bucket" => "the Object Store bucket (1-64 of A-Z a-z 0-9 _ -)";
    required "object" => "the object's name in the bucket";
};

const ENDED_FIELDS: &[Field] = fields! {
    optional "exit_code" => "the exit status, a whole number";
    optional "signal" => "the signal number, 1-64";
    required "duration_ms" => "how long it ran in milliseconds, a whole number";
};

const EXAMPLE: &str =
    r#"{"session": "01JB9ZK2F3QW8X5V7N4M6T1R0S", "event": "heartbeat", "beat": 3}"#;

impl SessionRecord {
    /// The checked record of `event`: `None` unless it is a `checkpoint` whose data is an
    /// object with a non-null `session`; then the header and the step's fields must hold.
    pub fn from_event(event: &Envelope) -> Result<Option<Self>, PayloadError> {
        if !carries(event, &[EventKind::Checkpoint], SESSION_KEY) {
            return Ok(None);
        }
        let header: Header = read(event, HEADER_FIELDS, EXAMPLE)?;
        let step = match header.event {
            SessionStep::Started => {
                let example = r#"{"session": "…", "event": "started", "role": "coder", "command": ["make"], "machine": "box-1", "pid": 42, "heartbeat_ms": 30000}"#;
                SessionEvent::Started(SessionStarted::check(read(
                    event,
                    STARTED_FIELDS,
                    example,
                )?)?)
            }
            SessionStep::Heartbeat => {
                let beat: SessionHeartbeat = read(event, HEARTBEAT_FIELDS, EXAMPLE)?;
                if beat.beat == 0 {
                    return Err(PayloadError::new(
                        "content.data.beat",
                        "0 is not a beat number; beats count from 1",
                    ));
                }
                SessionEvent::Heartbeat(beat)
            }
            SessionStep::Checkpoint => {
                let example = r#"{"session": "…", "event": "checkpoint", "note": "tests pass", "via": "request"}"#;
                let mut checkpoint: SessionCheckpointed = read(event, CHECKPOINT_FIELDS, example)?;
                checkpoint.note = term("content.data.note", &checkpoint.note, MAX_NOTE_CHARS)?;
                SessionEvent::Checkpoint(checkpoint)
            }
            SessionStep::Artifact => {
                let example = r#"{"session": "…", "event": "artifact", "name": "report.txt", "size": 12, "sha256": "<64 hex digits>", "bucket": "ENGRAM_ARTIFACTS", "object": "…"}"#;
                SessionEvent::Artifact(ArtifactStored::check(read(
                    event,
                    ARTIFACT_FIELDS,
                    example,
                )?)?)
            }
            SessionStep::Ended => {
                let example =
                    r#"{"session": "…", "event": "ended", "exit_code": 0, "duration_ms": 5000}"#;
                SessionEvent::Ended(SessionEnded::check(read(event, ENDED_FIELDS, example)?)?)
            }
        };
        Ok(Some(Self {
            session: header.session,
            event: step,
        }))
    }

    pub fn step(&self) -> SessionStep {
        match self.event {
            SessionEvent::Started(_) => SessionStep::Started,
            SessionEvent::Heartbeat(_) => SessionStep::Heartbeat,
            SessionEvent::Checkpoint(_) => SessionStep::Checkpoint,
            SessionEvent::Artifact(_) => SessionStep::Artifact,
            SessionEvent::Ended(_) => SessionStep::Ended,
        }
    }

    /// The record as `content.data`: the step's fields plus `session` and `event`.
    pub fn to_data(&self) -> Value {
        let fields = match &self.event {
            SessionEvent::Started(s) => serde_json::to_value(s),
            SessionEvent::Heartbeat(s) => serde_json::to_value(s),
            SessionEvent::Checkpoint(s) => serde_json::to_value(s),
            SessionEvent::Artifact(s) => serde_json::to_value(s),
            SessionEvent::Ended(s) => serde_json::to_value(s),
        };
        let mut data = fields.expect("session records serialise");
        let map = data
            .as_object_mut()
            .expect("a session record serialises to an object");
        map.insert(SESSION_KEY.into(), self.session.as_str().into());
        map.insert("event".into(), self.step().as_str().into());
        data
    }

    /// One line for people reading a replay: the record is the data.
    pub fn summary(&self) -> String {
        let session = &self.session;
        match &self.event {
            SessionEvent::Started(s) => {
                let mut command = s.command.join(" ");
                if command.chars().count() > 120 {
                    command = command.chars().take(119).collect::<String>() + "…";
                }
                format!(
                    "session {session} started: {} on {} runs {command}",
                    s.role, s.machine
                )
            }
            SessionEvent::Heartbeat(h) => format!("session {session} heartbeat {}", h.beat),
            SessionEvent::Checkpoint(c) => {
                format!(
                    "session {session} checkpoint ({}): {}",
                    c.via.as_str(),
                    c.note
                )
            }
            SessionEvent::Artifact(a) => format!(
                "session {session} artifact {} ({} bytes, sha256 {})",
                a.name, a.size, a.sha256
            ),
            SessionEvent::Ended(e) => match (e.exit_code, e.signal) {
                (Some(code), _) => format!("session {session} ended: exit code {code}"),
                (None, Some(signal)) => format!("session {session} ended: signal {signal}"),
                (None, None) => format!("session {session} ended"),
            },
        }
    }

    /// The event content of this record: the summary as text, the record as data.
    pub fn content(&self) -> Content {
        Content {
            text: self.summary(),
            data: Some(self.to_data()),
        }
    }
}

impl SessionStarted {
    /// `argv` within the bounds of a `started` record: at most [`MAX_ARGV`] items of at
    /// most [`MAX_ARG_CHARS`] characters each, and whether anything was cut.
    pub fn bounded_command(argv: &[String]) -> (Vec<String>, bool) {
        let mut truncated = argv.len() > MAX_ARGV;
        let command = argv
            .iter()
            .take(MAX_ARGV)
            .map(|arg| {
                if arg.chars().count() > MAX_ARG_CHARS {
                    truncated = true;
                    arg.chars().take(MAX_ARG_CHARS).collect()
                } else {
                    arg.clone()
                }
            })
            .collect();
        (command, truncated)
    }

    fn check(mut self) -> Result<Self, PayloadError> {
        let field = "content.data.command";
        if self.command.is_empty() || self.command.len() > MAX_ARGV {
            return Err(PayloadError::new(
                field,
                format!(
                    "{} items; give 1..={MAX_ARGV}, cut with command_truncated: true",
                    self.command.len()
                ),
            ));
        }
        for (i, arg) in self.command.iter().enumerate() {
            at_most(field, arg, MAX_ARG_CHARS)
                .map_err(|e| PayloadError::new(field, format!("item {i}: {}", e.reason)))?;
        }
        if self.command[0].trim().is_empty() {
            return Err(PayloadError::new(
                field,
                "item 0 is empty; it names the program",
            ));
        }
        self.machine = term("content.data.machine", &self.machine, MAX_MACHINE_CHARS)?;
        no_control("content.data.machine", &self.machine)?;
        if self.pid == 0 {
            return Err(PayloadError::new(
                "content.data.pid",
                "0 is not a process id",
            ));
        }
        if !(MIN_HEARTBEAT_MS..=MAX_HEARTBEAT_MS).contains(&self.heartbeat_ms) {
            return Err(PayloadError::new(
                "content.data.heartbeat_ms",
                format!(
                    "{} is outside {MIN_HEARTBEAT_MS}..={MAX_HEARTBEAT_MS}",
                    self.heartbeat_ms
                ),
            ));
        }
        if let Some(workdir) = &self.workdir {
            at_most("content.data.workdir", workdir, MAX_WORKDIR_CHARS)?;
        }
        Ok(self)
    }
}

impl ArtifactStored {
    fn check(self) -> Result<Self, PayloadError> {
        check_artifact_name(&self.name)
            .map_err(|reason| PayloadError::new("content.data.name", reason))?;
        if self.sha256.len() != 64
            || !self
                .sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(PayloadError::new(
                "content.data.sha256",
                format!(
                    "{:?} is not a SHA-256 (64 lowercase hex digits)",
                    self.sha256.chars().take(80).collect::<String>()
                ),
            ));
        }
        if self.object.is_empty() {
            return Err(PayloadError::new(
                "content.data.object",
                "it is empty; name the object",
            ));
        }
        at_most("content.data.object", &self.object, MAX_OBJECT_CHARS)?;
        no_control("content.data.object", &self.object)?;
        Ok(self)
    }
}

impl SessionEnded {
    fn check(self) -> Result<Self, PayloadError> {
        match (self.exit_code, self.signal) {
            (Some(_), Some(_)) => Err(PayloadError::new(
                "content.data.signal",
                "give exit_code or signal, not both: a process either exits or is killed",
            )),
            (None, None) => Err(PayloadError::new(
                "content.data.exit_code",
                "it is missing, and so is signal; give one of them",
            )),
            (None, Some(signal)) if !(1..=MAX_SIGNAL).contains(&signal) => Err(PayloadError::new(
                "content.data.signal",
                format!("{signal} is not a signal number (1..={MAX_SIGNAL})"),
            )),
            _ => Ok(self),
        }
    }
}

/// Why `name` cannot name an artifact, if it cannot: 1-128 of `A-Z a-z 0-9 . _ -`, not
/// starting with a dot (no hidden names, no `.` or `..`). An artifact name is a file name,
/// never a path.
pub fn check_artifact_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.chars().count() > MAX_ARTIFACT_NAME_CHARS {
        return Err(format!(
            "{:?} has {} characters; give 1..={MAX_ARTIFACT_NAME_CHARS}",
            name.chars()
                .take(MAX_ARTIFACT_NAME_CHARS + 1)
                .collect::<String>(),
            name.chars().count()
        ));
    }
    if name.starts_with('.') {
        return Err(format!("{name:?} starts with a dot; name it without"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "{name:?} holds {c:?}; use A-Z a-z 0-9 . _ - only (a name, not a path)"
        ));
    }
    Ok(())
}

fn no_control(field: &'static str, value: &str) -> Result<(), PayloadError> {
    if value.chars().any(char::is_control) {
        return Err(PayloadError::new(field, "it holds a control character"));
    }
    Ok(())
}

/// The JSON Schema rule of session records, for [`crate::json_schema`]: a `checkpoint`
/// whose data has a non-null `session` is one of the five records.
pub(crate) fn schema_rule(generator: &mut SchemaGenerator) -> Value {
    let ident = generator.subschema_for::<Ident>();
    let step = |step: SessionStep, fields: schemars::Schema| {
        serde_json::json!({
            "allOf": [
                {
                    "type": "object",
                    "properties": {
                        SESSION_KEY: ident,
                        "event": { "const": step.as_str() },
                    },
                    "required": [SESSION_KEY, "event"],
                },
                fields,
            ],
        })
    };
    let ended = serde_json::json!({
        "allOf": [
            step(SessionStep::Ended, generator.subschema_for::<SessionEnded>()),
            {
                "oneOf": [
                    { "required": ["exit_code"], "not": { "required": ["signal"] } },
                    { "required": ["signal"], "not": { "required": ["exit_code"] } },
                ],
            },
        ],
    });
    let records = vec![
        step(
            SessionStep::Started,
            generator.subschema_for::<SessionStarted>(),
        ),
        step(
            SessionStep::Heartbeat,
            generator.subschema_for::<SessionHeartbeat>(),
        ),
        step(
            SessionStep::Checkpoint,
            generator.subschema_for::<SessionCheckpointed>(),
        ),
        step(
            SessionStep::Artifact,
            generator.subschema_for::<ArtifactStored>(),
        ),
        ended,
    ];
    serde_json::json!({
        "if": { "properties": { "kind": { "const": EventKind::Checkpoint.as_str() } }, "required": ["kind"] },
        "then": { "properties": { "content": { "properties": { "data": {
            "if": {
                "type": "object",
                "properties": { SESSION_KEY: { "not": { "type": "null" } } },
                "required": [SESSION_KEY],
            },
            "then": { "oneOf": records },
        } } } } },
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::envelope::{Layer, Scope, ScopeKind};
    use crate::error::SchemaError;
    use crate::payload::Payload;

    const SID: &str = "01JB9ZK2F3QW8X5V7N4M6T1R0S";

    fn event(data: Value) -> Envelope {
        let id = |s: &str| Ident::parse("id", s).unwrap();
        Envelope::new(
            id("acme"),
            Scope::new(ScopeKind::Task, "fix-login").unwrap(),
            id("run-x"),
            id(SID),
            Layer::Working,
            EventKind::Checkpoint,
            Content {
                text: String::new(),
                data: Some(data),
            },
        )
    }

    fn record(step: SessionEvent) -> SessionRecord {
        SessionRecord {
            session: Ident::parse("session", SID).unwrap(),
            event: step,
        }
    }

    fn started() -> SessionStarted {
        SessionStarted {
            role: Ident::parse("role", "coder").unwrap(),
            command: vec!["sh".into(), "-c".into(), "make test".into()],
            command_truncated: false,
            machine: "box-1".into(),
            pid: 4242,
            heartbeat_ms: 30_000,
            workdir: Some("/work/repo".into()),
            context: Some(SessionContext::Isolated),
            resumes: None,
        }
    }

    fn every_step() -> Vec<SessionRecord> {
        vec![
            record(SessionEvent::Started(started())),
            record(SessionEvent::Heartbeat(SessionHeartbeat { beat: 1 })),
            record(SessionEvent::Checkpoint(SessionCheckpointed {
                note: "signal".into(),
                via: CheckpointVia::Signal,
            })),
            record(SessionEvent::Artifact(ArtifactStored {
                name: "report.txt".into(),
                size: 12,
                sha256: "a".repeat(64),
                bucket: Ident::parse("bucket", "ENGRAM_ARTIFACTS").unwrap(),
                object: format!("acme/fix-login/{SID}/report.txt/{}", "a".repeat(64)),
            })),
            record(SessionEvent::Ended(SessionEnded {
                exit_code: Some(3),
                signal: None,
                duration_ms: 1200,
            })),
            record(SessionEvent::Ended(SessionEnded {
                exit_code: None,
                signal: Some(9),
                duration_ms: 5,
            })),
        ]
    }

    /// `validate` refuses `data`, naming `field`; returns the reason.
    fn refused(data: Value, field: &str) -> String {
        match event(data.clone()).validate() {
            Err(SchemaError::InvalidField {
                field: named,
                reason,
            }) => {
                assert_eq!(named, field, "{data}: {reason}");
                reason
            }
            other => panic!("{data}: expected InvalidField {field}, got {other:?}"),
        }
    }

    #[test]
    fn every_record_built_from_the_types_passes_its_own_check_and_reads_back() {
        for record in every_step() {
            let e = Envelope {
                content: record.content(),
                ..event(json!({}))
            };
            e.validate().unwrap();
            assert_eq!(
                Payload::of(&e).unwrap(),
                Some(Payload::Session(record.clone()))
            );
            assert!(e.content.text.contains(SID), "{}", e.content.text);
            assert_eq!(
                e.content.data.as_ref().unwrap()["event"],
                record.step().as_str()
            );
        }
    }

    #[test]
    fn a_checkpoint_naming_no_session_stays_free() {
        // A LangGraph saver's checkpoint, the consolidator's `finished`, anything else
        for data in [
            json!({"langgraph_checkpoint": 1, "type": "checkpoint", "body": "", "payloads": []}),
            json!({"finished": true}),
            json!({"session": null, "event": 7}),
            json!("a string"),
        ] {
            let e = event(data.clone());
            e.validate().unwrap();
            assert_eq!(Payload::of(&e).unwrap(), None, "{data}");
        }
        // And `session` means nothing on another kind
        let mut e = event(json!({"session": 7}));
        e.kind = EventKind::Observation;
        e.validate().unwrap();
    }

    #[test]
    fn a_bad_header_or_step_field_is_refused_by_name() {
        let base = |extra: Value| {
            let mut data = record(SessionEvent::Started(started())).to_data();
            for (k, v) in extra.as_object().unwrap() {
                data[k] = v.clone();
            }
            data
        };
        let cases = [
            (json!({"session": "a.b"}), "content.data.session"),
            (json!({"session": 7}), "content.data.session"),
            (json!({"event": "paused"}), "content.data.event"),
            (json!({"event": null}), "content.data.event"),
            (json!({"role": "a b"}), "content.data.role"),
            (json!({"command": []}), "content.data.command"),
            (json!({"command": [""]}), "content.data.command"),
            (json!({"command": "make"}), "content.data.command"),
            (
                json!({"command": vec!["x"; MAX_ARGV + 1]}),
                "content.data.command",
            ),
            (
                json!({"command": ["x".repeat(MAX_ARG_CHARS + 1)]}),
                "content.data.command",
            ),
            (json!({"machine": " "}), "content.data.machine"),
            (json!({"machine": "a\u{7}b"}), "content.data.machine"),
            (json!({"pid": 0}), "content.data.pid"),
            (json!({"pid": -1}), "content.data.pid"),
            (json!({"heartbeat_ms": 10}), "content.data.heartbeat_ms"),
            (
                json!({"workdir": "x".repeat(MAX_WORKDIR_CHARS + 1)}),
                "content.data.workdir",
            ),
        ];
        for (extra, field) in cases {
            refused(base(extra), field);
        }
        let session = json!(SID);
        for (data, field) in [
            (
                json!({"session": session, "event": "heartbeat"}),
                "content.data.beat",
            ),
            (
                json!({"session": session, "event": "heartbeat", "beat": 0}),
                "content.data.beat",
            ),
            (
                json!({"session": session, "event": "checkpoint", "via": "signal"}),
                "content.data.note",
            ),
            (
                json!({"session": session, "event": "checkpoint", "note": " ", "via": "signal"}),
                "content.data.note",
            ),
            (
                json!({"session": session, "event": "checkpoint", "note": "x".repeat(MAX_NOTE_CHARS + 1), "via": "signal"}),
                "content.data.note",
            ),
            (
                json!({"session": session, "event": "checkpoint", "note": "n", "via": "email"}),
                "content.data.via",
            ),
            (
                json!({"session": session, "event": "ended", "duration_ms": 1}),
                "content.data.exit_code",
            ),
            (
                json!({"session": session, "event": "ended", "exit_code": 1, "signal": 9, "duration_ms": 1}),
                "content.data.signal",
            ),
            (
                json!({"session": session, "event": "ended", "signal": 99, "duration_ms": 1}),
                "content.data.signal",
            ),
            (
                json!({"session": session, "event": "ended", "exit_code": 0}),
                "content.data.duration_ms",
            ),
        ] {
            refused(data, field);
        }
        let artifact = |extra: Value| {
            let mut data = every_step()[3].to_data();
            for (k, v) in extra.as_object().unwrap() {
                data[k] = v.clone();
            }
            data
        };
        for (extra, field) in [
            (json!({"name": "../etc/passwd"}), "content.data.name"),
            (json!({"name": ".hidden"}), "content.data.name"),
            (json!({"name": "a/b"}), "content.data.name"),
            (
                json!({"name": "x".repeat(MAX_ARTIFACT_NAME_CHARS + 1)}),
                "content.data.name",
            ),
            (json!({"sha256": "A".repeat(64)}), "content.data.sha256"),
            (json!({"sha256": "abc"}), "content.data.sha256"),
            (json!({"size": -1}), "content.data.size"),
            (json!({"bucket": "a.b"}), "content.data.bucket"),
            (json!({"object": ""}), "content.data.object"),
            (
                json!({"object": "x".repeat(MAX_OBJECT_CHARS + 1)}),
                "content.data.object",
            ),
        ] {
            refused(artifact(extra), field);
        }
    }

    #[test]
    fn a_long_command_is_recorded_cut_and_says_so() {
        let argv: Vec<String> = (0..100).map(|i| format!("arg{i}")).collect();
        let (command, truncated) = SessionStarted::bounded_command(&argv);
        assert_eq!(command.len(), MAX_ARGV);
        assert!(truncated);
        let (command, truncated) =
            SessionStarted::bounded_command(&["x".repeat(MAX_ARG_CHARS * 2)]);
        assert_eq!(command[0].chars().count(), MAX_ARG_CHARS);
        assert!(truncated);
        let short = vec!["make".to_owned(), "test".to_owned()];
        assert_eq!(SessionStarted::bounded_command(&short), (short, false));
    }

    #[test]
    fn artifact_names_are_file_names() {
        for ok in ["report.txt", "a", "out-1_final.tar.gz", "A.B"] {
            check_artifact_name(ok).unwrap();
        }
        for bad in ["", ".", "..", ".env", "a/b", "a\\b", "a b", "é", "x\u{0}"] {
            assert!(check_artifact_name(bad).is_err(), "{bad:?}");
        }
    }
}

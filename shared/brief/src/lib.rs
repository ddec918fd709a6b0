//! The handoff brief of a task: what a program resuming it must know, assembled from the
//! log and the read models, with every statement citing the events it comes from.
//!
//! [`build`] is pure: given the task's events (from a replay, with their stream sequences),
//! the task boards of its scope (the docs read model) and its skills (the skills read
//! model), it returns a [`Brief`]; [`Brief::markdown`] renders it. The same inputs give a
//! byte-identical brief, in JSON and in Markdown, whatever order the events came in: events
//! are deduplicated by id (a leaf may deliver one twice) and ordered by `occurred_at`, then
//! event id; boards by scope and name, items by id, skills by name. Nothing reads a clock,
//! and no hash map is iterated.
//!
//! # Sections
//! - **Task**: the tenant, the task, and its `engram run` sessions from their records
//!   ([`engram_schema::session`]): role, machine, state (exit code or signal, or no end
//!   recorded), last checkpoint note.
//! - **Decided**: events tagged [`DECISION_TAG`]: the text, why (`content.data.why`, else
//!   `content.data.reason`), and the event it was caused by (`causation_id`).
//! - **Failed and fixed**: failures, and what fixed each ([`Fixed`]). A failure is an
//!   `outcome` whose `content.data.success` is `false`, or any event tagged [`FAILURE_TAG`]
//!   or [`ERROR_TAG`]. Its fix is, in this order of precedence:
//!   1. the first later event whose `causation_id` is the failure's id and which is no
//!      failure itself (a retry that failed again is another failure, caused by the first);
//!   2. the first later event tagged [`FIX_TAG`] whose `content.data.fixes` names the
//!      failure's id (a string, or an array of them);
//!   3. the first later successful outcome (`content.data.success == true`) of the same
//!      skill or action (`content.data.skill`, else `content.data.action`).
//!
//!   A failure without one is listed as unresolved.
//! - **Open**: the items of the scope's `task_board` documents whose status is not `done`
//!   or `closed`, citing the `doc_changed` events of the board.
//! - **Skills**: the skills recorded in the scope (`skill_recorded`), as the skills read
//!   model holds them now (latest version, description, outcome counts), citing the
//!   recording events; a skill the read model does not (yet) answer for is shown from its
//!   latest recording event.
//! - **Artifacts**: the artifacts the sessions stored: name, size, SHA-256, session.
//! - **Working memory**: the working-layer events of the resumed session's own scope
//!   (`session:<id>`), session records excepted.
//!
//! # Bounds
//! Every input is hostile. [`Limits`] bounds the events read, the items of each section
//! (the latest are kept, and the brief counts what it left out), the characters of every
//! text, and the events a statement cites. A bound that cut something says so in
//! [`Brief::notes`].
//!
//! # Tags
//! The tags are a convention between the programs that write a task's events and the
//! brief; they are defined here and nowhere else. A tag is matched exactly, lowercase.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use engram_schema::session::{SessionEvent, SessionRecord};
use engram_schema::{Envelope, EventId, EventKind, Ident, Layer, Scope, ScopeKind};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// An event recording a decision: its text is what was decided, `content.data.why` (or
/// `reason`) why.
pub const DECISION_TAG: &str = "decision";
/// An event recording a failure (beside `outcome` events with `success: false`).
pub const FAILURE_TAG: &str = "failure";
/// The same as [`FAILURE_TAG`]: an error is a failure.
pub const ERROR_TAG: &str = "error";
/// An event recording a fix; `content.data.fixes` names the failure (its event id, or an
/// array of them) when the event was not caused by it.
pub const FIX_TAG: &str = "fix";
/// The data key of a fix naming the failures it fixes.
pub const FIXES_KEY: &str = "fixes";
/// The doc type whose open items the brief lists.
pub const BOARD_TYPE: &str = "task_board";
/// Board statuses that close an item.
pub const CLOSED_STATUSES: [&str; 2] = ["done", "closed"];

/// How much a brief may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Events a brief is built from: a caller reads at most this many, and [`build`] uses
    /// at most this many of what it is given.
    pub max_events: usize,
    /// Items per section; the latest are kept.
    pub max_items: usize,
    /// Characters of any one text; longer ones are cut with `…`.
    pub max_text_chars: usize,
    /// Events cited by one statement; the latest are kept.
    pub max_citations: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_events: 100_000,
            max_items: 50,
            max_text_chars: 500,
            max_citations: 16,
        }
    }
}

/// One event as a replay returned it.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceEvent {
    /// Its stream sequence.
    pub seq: u64,
    pub event: Envelope,
}

/// A `task_board` document as the docs read model holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct BoardState {
    pub scope: Scope,
    pub name: Ident,
    /// Its JSON view (`{"items": {"<id>": {"title", "status", "owner", "notes"}}}`).
    pub value: Value,
    /// The seq of the last event the read model merged into it.
    pub last_seq: u64,
}

/// A skill as the skills read model holds it (its latest version).
#[derive(Clone, Debug, PartialEq)]
pub struct SkillState {
    pub name: String,
    pub version: u32,
    pub description: String,
    /// The event that recorded this version.
    pub event_id: EventId,
    pub successes: u64,
    pub failures: u64,
}

impl SkillState {
    /// A skill of the read model's answer (`SkillsResponse::skills`, the registry's own
    /// shape); `None` when it lacks a field the brief shows.
    pub fn from_json(skill: &Value) -> Option<Self> {
        Some(Self {
            name: skill.get("name")?.as_str()?.to_owned(),
            version: u32::try_from(skill.get("version")?.as_u64()?).ok()?,
            description: skill.get("description")?.as_str()?.to_owned(),
            event_id: EventId::parse(skill.get("source")?.get("event_id")?.as_str()?).ok()?,
            successes: skill.get("successes").and_then(Value::as_u64).unwrap_or(0),
            failures: skill.get("failures").and_then(Value::as_u64).unwrap_or(0),
        })
    }
}

/// What a brief is built from.
#[derive(Clone, Debug)]
pub struct Input<'a> {
    pub tenant: Ident,
    pub task: Ident,
    /// The session being resumed, if one is: its scope's working memory is shown.
    pub session: Option<Ident>,
    /// The events of the task's scope (and of the session's), in any order.
    pub events: &'a [SourceEvent],
    pub boards: &'a [BoardState],
    pub skills: &'a [SkillState],
    /// What the caller already knows it left out (a replay cut at its bound, a read model
    /// that did not answer), carried into [`Brief::notes`].
    pub notes: Vec<String>,
    pub limits: Limits,
}

/// The handoff brief.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Brief {
    pub tenant: Ident,
    pub task: Ident,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<Ident>,
    /// Events it was built from (after deduplication), and the highest stream sequence
    /// among them.
    pub events_read: usize,
    pub through_seq: u64,
    pub sessions: Vec<SessionLine>,
    pub decisions: Vec<Decision>,
    pub failures: Vec<Failure>,
    pub open: Vec<OpenItem>,
    pub skills: Vec<SkillLine>,
    pub artifacts: Vec<ArtifactLine>,
    pub working: Vec<WorkingLine>,
    /// Items each section left out past [`Limits::max_items`] (the earliest), by section.
    pub left_out: BTreeMap<String, usize>,
    /// What the brief could not hold or read.
    pub notes: Vec<String>,
}

/// One `engram run` session of the task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionLine {
    pub session: Ident,
    pub role: Option<Ident>,
    pub machine: Option<String>,
    /// The command it ran, joined by spaces and bounded.
    pub command: Option<String>,
    /// `exited(<code>)`, `signalled(<n>)`, or `no end recorded` (running, or dead).
    pub state: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub last_checkpoint: Option<String>,
    pub sources: Vec<EventId>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Decision {
    pub event_id: EventId,
    pub text: String,
    pub why: Option<String>,
    /// The event it was caused by, and that event's text when the brief read it.
    pub caused_by: Option<EventId>,
    pub caused_by_text: Option<String>,
    pub sources: Vec<EventId>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Failure {
    pub event_id: EventId,
    pub text: String,
    /// The skill or action that failed, when the event names one.
    pub subject: Option<String>,
    /// How it was fixed; `None`: unresolved.
    pub fix: Option<Fix>,
    pub sources: Vec<EventId>,
}

/// How a failure's fix was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Fixed {
    /// An event caused by the failure (`causation_id`).
    CausedBy,
    /// An event tagged `fix` naming it in `content.data.fixes`.
    TaggedFix,
    /// A later successful outcome of the same skill or action.
    LaterSuccess,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Fix {
    pub event_id: EventId,
    pub text: String,
    pub found_by: Fixed,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OpenItem {
    pub scope: Scope,
    pub board: Ident,
    pub id: String,
    pub title: String,
    pub status: String,
    pub owner: Option<String>,
    pub last_note: Option<String>,
    /// The board's `doc_changed` events (the latest).
    pub sources: Vec<EventId>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SkillLine {
    pub name: String,
    pub version: Option<u32>,
    pub description: String,
    pub successes: u64,
    pub failures: u64,
    /// Whether the skills read model answered for it (else: from its recording event).
    pub from_read_model: bool,
    pub sources: Vec<EventId>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ArtifactLine {
    pub session: Ident,
    pub name: String,
    pub size: u64,
    pub sha256: String,
    pub bucket: Ident,
    pub object: String,
    pub event_id: EventId,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorkingLine {
    pub event_id: EventId,
    pub kind: EventKind,
    pub text: String,
    pub occurred_at: DateTime<Utc>,
}

fn has_tag(event: &Envelope, tag: &str) -> bool {
    event.tags.iter().any(|t| t == tag)
}

fn data_str<'e>(event: &'e Envelope, key: &str) -> Option<&'e str> {
    event
        .content
        .data
        .as_ref()?
        .get(key)?
        .as_str()
        .filter(|s| !s.trim().is_empty())
}

fn success(event: &Envelope) -> Option<bool> {
    if event.kind != EventKind::Outcome {
        return None;
    }
    event.content.data.as_ref()?.get("success")?.as_bool()
}

fn is_failure(event: &Envelope) -> bool {
    success(event) == Some(false) || has_tag(event, FAILURE_TAG) || has_tag(event, ERROR_TAG)
}

/// What an outcome or failure is about: its skill, else its action.
fn subject(event: &Envelope) -> Option<&str> {
    data_str(event, "skill").or_else(|| data_str(event, "action"))
}

fn fixes(event: &Envelope, failure: &EventId) -> bool {
    if !has_tag(event, FIX_TAG) {
        return false;
    }
    let named = |v: &Value| v.as_str() == Some(failure.as_str());
    match event.content.data.as_ref().and_then(|d| d.get(FIXES_KEY)) {
        Some(Value::Array(ids)) => ids.iter().any(named),
        Some(v) => named(v),
        None => false,
    }
}

/// `text` on one line (no control characters, so no Markdown a hostile event could open),
/// at most `max` characters.
pub fn bounded(text: &str, max: usize) -> String {
    let one_line: String = text
        .split(|c: char| c.is_control())
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let one_line = one_line.trim();
    if one_line.chars().count() <= max {
        return one_line.to_owned();
    }
    let mut cut: String = one_line.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// The latest `max` of `items`, and how many were left out.
fn latest<T>(mut items: Vec<T>, max: usize) -> (Vec<T>, usize) {
    let left_out = items.len().saturating_sub(max);
    items.drain(..left_out);
    (items, left_out)
}

fn cite(mut ids: Vec<EventId>, max: usize) -> Vec<EventId> {
    let mut seen = BTreeSet::new();
    ids.retain(|id| seen.insert(id.clone()));
    latest(ids, max).0
}

/// Builds the brief of `input`. Deterministic: see the crate docs.
pub fn build(input: &Input<'_>) -> Brief {
    let limits = input.limits;
    let text = |t: &str| bounded(t, limits.max_text_chars);
    let mut notes = input.notes.clone();

    // One copy of each event (the lowest seq), in the order they happened.
    let mut by_id: BTreeMap<&EventId, &SourceEvent> = BTreeMap::new();
    for source in input.events {
        if source.event.tenant != input.tenant {
            continue;
        }
        by_id
            .entry(&source.event.event_id)
            .and_modify(|kept| {
                if source.seq < kept.seq {
                    *kept = source;
                }
            })
            .or_insert(source);
    }
    let mut events: Vec<&SourceEvent> = by_id.into_values().collect();
    events.sort_by(|a, b| {
        (a.event.occurred_at, &a.event.event_id).cmp(&(b.event.occurred_at, &b.event.event_id))
    });
    if events.len() > limits.max_events {
        notes.push(format!(
            "built from the latest {} of {} events (the bound on events read)",
            limits.max_events,
            events.len()
        ));
        let (kept, _) = latest(events, limits.max_events);
        events = kept;
    }
    let through_seq = events.iter().map(|e| e.seq).max().unwrap_or(0);
    let position: BTreeMap<&EventId, usize> = events
        .iter()
        .enumerate()
        .map(|(i, e)| (&e.event.event_id, i))
        .collect();
    let mut left_out = BTreeMap::new();
    let mut section = |name: &str, count: usize| {
        if count > 0 {
            left_out.insert(name.to_owned(), count);
        }
    };

    // Task: the sessions, from their records.
    let mut sessions: BTreeMap<Ident, (usize, SessionLine)> = BTreeMap::new();
    let mut artifacts = Vec::new();
    let mut refused_records = 0usize;
    for (i, source) in events.iter().enumerate() {
        let event = &source.event;
        let record = match SessionRecord::from_event(event) {
            Ok(Some(record)) => record,
            Ok(None) => continue,
            Err(_) => {
                refused_records += 1;
                continue;
            }
        };
        let line = &mut sessions
            .entry(record.session.clone())
            .or_insert_with(|| {
                (
                    i,
                    SessionLine {
                        session: record.session.clone(),
                        role: None,
                        machine: None,
                        command: None,
                        state: "no end recorded".into(),
                        exit_code: None,
                        signal: None,
                        last_checkpoint: None,
                        sources: Vec::new(),
                    },
                )
            })
            .1;
        match record.event {
            SessionEvent::Started(s) => {
                line.role = Some(s.role);
                line.machine = Some(text(&s.machine));
                line.command = Some(text(&s.command.join(" ")));
                line.sources.push(event.event_id.clone());
            }
            SessionEvent::Heartbeat(_) => {}
            SessionEvent::Checkpoint(c) => {
                line.last_checkpoint = Some(text(&c.note));
                line.sources.push(event.event_id.clone());
            }
            SessionEvent::Artifact(a) => artifacts.push(ArtifactLine {
                session: record.session.clone(),
                name: a.name,
                size: a.size,
                sha256: a.sha256,
                bucket: a.bucket,
                object: a.object,
                event_id: event.event_id.clone(),
            }),
            SessionEvent::Ended(e) => {
                line.exit_code = e.exit_code;
                line.signal = e.signal;
                line.state = match (e.exit_code, e.signal) {
                    (Some(code), _) => format!("exited({code})"),
                    (None, Some(signal)) => format!("signalled({signal})"),
                    (None, None) => "ended".into(),
                };
                line.sources.push(event.event_id.clone());
            }
        }
    }
    if refused_records > 0 {
        notes.push(format!(
            "{refused_records} session records did not check and were skipped"
        ));
    }
    let mut sessions: Vec<(usize, SessionLine)> = sessions.into_values().collect();
    sessions.sort_by(|a, b| (a.0, &a.1.session).cmp(&(b.0, &b.1.session)));
    let sessions: Vec<SessionLine> = sessions
        .into_iter()
        .map(|(_, mut line)| {
            // The start, the last checkpoint and the end: the latest citations.
            line.sources = cite(line.sources, limits.max_citations.min(3));
            line
        })
        .collect();
    let (sessions, n) = latest(sessions, limits.max_items);
    section("sessions", n);
    let (artifacts, n) = latest(artifacts, limits.max_items);
    section("artifacts", n);

    // Decided.
    let decisions: Vec<Decision> = events
        .iter()
        .filter(|s| has_tag(&s.event, DECISION_TAG))
        .map(|s| {
            let event = &s.event;
            let cause = event.causation_id.as_ref();
            let cause_text = cause
                .and_then(|id| position.get(id))
                .map(|&i| text(&events[i].event.content.text))
                .filter(|t| !t.is_empty());
            let mut sources = vec![event.event_id.clone()];
            sources.extend(cause.cloned());
            Decision {
                event_id: event.event_id.clone(),
                text: text(&event.content.text),
                why: data_str(event, "why")
                    .or_else(|| data_str(event, "reason"))
                    .map(text),
                caused_by: cause.cloned(),
                caused_by_text: cause_text,
                sources: cite(sources, limits.max_citations),
            }
        })
        .collect();
    let (decisions, n) = latest(decisions, limits.max_items);
    section("decisions", n);

    // Failed and fixed.
    let failures: Vec<Failure> = events
        .iter()
        .enumerate()
        .filter(|(_, s)| is_failure(&s.event))
        .map(|(i, s)| {
            let event = &s.event;
            let id = &event.event_id;
            let what = subject(event);
            let later = || events[i + 1..].iter().map(|s| &s.event);
            let fix = later()
                .find(|e| e.causation_id.as_ref() == Some(id) && !is_failure(e))
                .map(|e| (e, Fixed::CausedBy))
                .or_else(|| {
                    later()
                        .find(|e| fixes(e, id))
                        .map(|e| (e, Fixed::TaggedFix))
                })
                .or_else(|| {
                    let what = what?;
                    later()
                        .find(|e| success(e) == Some(true) && subject(e) == Some(what))
                        .map(|e| (e, Fixed::LaterSuccess))
                })
                .map(|(e, found_by)| Fix {
                    event_id: e.event_id.clone(),
                    text: text(&e.content.text),
                    found_by,
                });
            let mut sources = vec![id.clone()];
            sources.extend(fix.as_ref().map(|f| f.event_id.clone()));
            Failure {
                event_id: id.clone(),
                text: text(&event.content.text),
                subject: what.map(text),
                fix,
                sources: cite(sources, limits.max_citations),
            }
        })
        .collect();
    let (failures, n) = latest(failures, limits.max_items);
    section("failures", n);

    // Open: the boards' items not closed, citing each board's doc_changed events.
    let mut boards: Vec<&BoardState> = input.boards.iter().collect();
    boards.sort_by(|a, b| {
        (a.scope.to_string(), &a.name, a.last_seq).cmp(&(b.scope.to_string(), &b.name, b.last_seq))
    });
    boards.dedup_by(|a, b| a.scope == b.scope && a.name == b.name);
    let mut open = Vec::new();
    for board in boards {
        let changes: Vec<EventId> = events
            .iter()
            .map(|s| &s.event)
            .filter(|e| {
                e.kind == EventKind::DocChanged
                    && e.scope == board.scope
                    && data_str(e, "doc_type") == Some(BOARD_TYPE)
                    && data_str(e, "name") == Some(board.name.as_str())
            })
            .map(|e| e.event_id.clone())
            .collect();
        if changes.is_empty() {
            notes.push(format!(
                "board {}/{} has no doc_changed event among those read: its items cite none",
                board.scope, board.name
            ));
        }
        let sources = cite(changes, limits.max_citations);
        let Some(items) = board.value.get("items").and_then(Value::as_object) else {
            continue;
        };
        let items: BTreeMap<&String, &Value> = items.iter().collect();
        for (id, item) in items {
            let field = |name: &str| {
                item.get(name)
                    .and_then(Value::as_str)
                    .map(text)
                    .filter(|s| !s.is_empty())
            };
            let status = field("status").unwrap_or_else(|| "todo".into());
            if CLOSED_STATUSES.contains(&status.as_str()) {
                continue;
            }
            open.push(OpenItem {
                scope: board.scope.clone(),
                board: board.name.clone(),
                id: text(id),
                title: field("title").unwrap_or_default(),
                status,
                owner: field("owner"),
                last_note: item
                    .get("notes")
                    .and_then(Value::as_array)
                    .and_then(|n| n.last())
                    .and_then(Value::as_str)
                    .map(text),
                sources: sources.clone(),
            });
        }
    }
    let (open, n) = latest(open, limits.max_items);
    section("open", n);

    // Skills: names from the scope's skill_recorded events, state from the read model.
    let mut recorded: BTreeMap<String, Vec<&Envelope>> = BTreeMap::new();
    for source in &events {
        if source.event.kind == EventKind::SkillRecorded
            && let Some(name) = data_str(&source.event, "name")
        {
            recorded
                .entry(name.trim().to_owned())
                .or_default()
                .push(&source.event);
        }
    }
    let mut states: BTreeMap<&str, &SkillState> = BTreeMap::new();
    for state in input.skills {
        // Of two answers for one name, the highest version (then the lowest event id).
        let keep = states.get(state.name.as_str()).is_none_or(|kept| {
            (state.version, std::cmp::Reverse(&state.event_id))
                > (kept.version, std::cmp::Reverse(&kept.event_id))
        });
        if keep {
            states.insert(&state.name, state);
        }
    }
    let skills: Vec<SkillLine> = recorded
        .into_iter()
        .map(|(name, records)| {
            let mut sources: Vec<EventId> = records.iter().map(|e| e.event_id.clone()).collect();
            match states.get(name.as_str()) {
                Some(state) => {
                    sources.push(state.event_id.clone());
                    SkillLine {
                        version: Some(state.version),
                        description: text(&state.description),
                        successes: state.successes,
                        failures: state.failures,
                        from_read_model: true,
                        sources: cite(sources, limits.max_citations),
                        name: text(&name),
                    }
                }
                None => {
                    let last = records.last().expect("a name comes with its records");
                    SkillLine {
                        version: last
                            .content
                            .data
                            .as_ref()
                            .and_then(|d| d.get("version"))
                            .and_then(Value::as_u64)
                            .and_then(|v| u32::try_from(v).ok()),
                        description: text(data_str(last, "description").unwrap_or_default()),
                        successes: 0,
                        failures: 0,
                        from_read_model: false,
                        sources: cite(sources, limits.max_citations),
                        name: text(&name),
                    }
                }
            }
        })
        .collect();
    let (skills, n) = latest(skills, limits.max_items);
    section("skills", n);

    // Working memory of the resumed session's own scope.
    let working: Vec<WorkingLine> = match &input.session {
        None => Vec::new(),
        Some(session) => events
            .iter()
            .map(|s| &s.event)
            .filter(|e| {
                e.layer == Layer::Working
                    && e.scope.kind == ScopeKind::Session
                    && &e.scope.id == session
                    && !matches!(SessionRecord::from_event(e), Ok(Some(_)))
            })
            .map(|e| WorkingLine {
                event_id: e.event_id.clone(),
                kind: e.kind,
                text: text(&e.content.text),
                occurred_at: e.occurred_at,
            })
            .collect(),
    };
    let (working, n) = latest(working, limits.max_items);
    section("working", n);

    Brief {
        tenant: input.tenant.clone(),
        task: input.task.clone(),
        session: input.session.clone(),
        events_read: events.len(),
        through_seq,
        sessions,
        decisions,
        failures,
        open,
        skills,
        artifacts,
        working,
        left_out,
        notes,
    }
}

mod render;

#[cfg(test)]
mod tests;

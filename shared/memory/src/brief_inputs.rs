//! What a handoff brief ([`engram_brief`]) is built from besides the log, asked of the read
//! models the same way wherever a brief is made (`engram.q.brief` in the query service,
//! `engram session resume` in the CLI): the task boards (docs read model) and the skills
//! the events recorded (skills read model, one request per name), both at the replay's
//! last sequence or later, so that a brief never cites what the read models have not seen.
//! The callers differ only in how they send the requests.

use engram_brief::{BoardState, SkillState, SourceEvent};
use engram_schema::{EventKind, Ident, Scope};

use crate::proto::{
    self, Consistency, DocRead, DocRequest, DocSummary, ScopeRequest, SkillsRequest,
};

/// How long the read models may take to reach the replay's last sequence.
pub const READ_MODELS_WITHIN_MS: u64 = 15_000;
/// Most skills asked of the skills read model (one request each).
pub const MAX_SKILL_LOOKUPS: usize = 64;

/// The requests' common part: the task's scope, read at `events`' last sequence or later.
#[derive(Clone, Debug)]
pub struct Asks {
    pub scopes: ScopeRequest,
    pub consistency: Consistency,
    task: Scope,
}

impl Asks {
    pub fn new(tenant: &Ident, task: &Scope, events: &[SourceEvent]) -> Self {
        let through = events.iter().map(|e| e.seq).max().unwrap_or(0);
        Self {
            scopes: ScopeRequest {
                tenant: tenant.clone(),
                scope: task.clone(),
                grants: Vec::new(),
            },
            consistency: Consistency {
                min_seq: (through > 0).then_some(through),
                wait_ms: Some(READ_MODELS_WITHIN_MS),
            },
            task: task.clone(),
        }
    }

    /// The task's boards, with their values.
    pub fn boards(&self) -> DocRequest {
        DocRequest {
            scopes: self.scopes.clone(),
            read: DocRead::List,
            doc_type: Some(
                Ident::parse("doc_type", engram_brief::BOARD_TYPE).expect("a valid doc type"),
            ),
            name: None,
            include_bytes: false,
            include_values: true,
            limit: proto::limits::MAX_DOC_ITEMS,
            consistency: self.consistency,
        }
    }

    /// The boards of the listing that are the task's own, each with its state; a board
    /// listed without it is noted.
    pub fn boards_of(
        &self,
        listed: Result<Vec<DocSummary>, String>,
        notes: &mut Vec<String>,
    ) -> Vec<BoardState> {
        let docs = match listed {
            Ok(docs) => docs,
            Err(e) => {
                notes.push(format!(
                    "the docs read model did not answer, so no open items are listed: {e}"
                ));
                return Vec::new();
            }
        };
        let mut boards = Vec::new();
        for doc in docs.into_iter().filter(|d| d.scope == self.task) {
            match doc.value {
                Some(value) => boards.push(BoardState {
                    scope: doc.scope,
                    name: doc.name,
                    value,
                    last_seq: doc.last_seq,
                }),
                None => notes.push(format!(
                    "board {}/{} came without its state",
                    doc.scope, doc.name
                )),
            }
        }
        boards
    }

    /// One request per skill the events recorded, by name (at most [`MAX_SKILL_LOOKUPS`],
    /// the rest noted).
    pub fn skills(&self, events: &[SourceEvent], notes: &mut Vec<String>) -> Vec<SkillsRequest> {
        let mut names: Vec<String> = events
            .iter()
            .filter(|s| s.event.kind == EventKind::SkillRecorded)
            .filter_map(|s| s.event.content.data.as_ref()?.get("name")?.as_str())
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        names.sort();
        names.dedup();
        if names.len() > MAX_SKILL_LOOKUPS {
            notes.push(format!(
                "{} skills recorded: the first {MAX_SKILL_LOOKUPS} by name were asked of the skills read model",
                names.len()
            ));
            names.truncate(MAX_SKILL_LOOKUPS);
        }
        names
            .into_iter()
            .map(|name| SkillsRequest {
                scopes: self.scopes.clone(),
                task: None,
                name: Some(name),
                limit: 1,
                consistency: self.consistency,
            })
            .collect()
    }

    /// The skills of one answer, or a note saying the read model did not answer.
    pub fn skills_of(
        request: &SkillsRequest,
        answer: Result<Vec<serde_json::Value>, String>,
        notes: &mut Vec<String>,
    ) -> Vec<SkillState> {
        match answer {
            Ok(skills) => skills.iter().filter_map(SkillState::from_json).collect(),
            Err(e) => {
                notes.push(format!(
                    "the skills read model did not answer for {:?}: {e}",
                    request.name.as_deref().unwrap_or_default()
                ));
                Vec::new()
            }
        }
    }
}

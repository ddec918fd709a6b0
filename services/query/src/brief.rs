//! `engram.q.brief`: a task's handoff brief ([`engram_brief`]), for any caller that may read
//! the task, with the caller's own rights.
//!
//! The brief is read the way the caller would read it piece by piece: replay pages of the
//! task's scope (within the caller's share of replays), the docs read model's task boards
//! and the skills read model's skills, both at the replay's last sequence. The session's
//! own scope is read only when the caller may read it; otherwise the brief says so and
//! carries on. It never reads the Object Store: artifacts are listed, not fetched
//! (`engram session resume` fetches them).

use engram_brief::{Input, Limits, SourceEvent};
use engram_memory::brief_inputs::Asks;
use engram_memory::proto::{self, BriefRequest, BriefResponse};
use engram_rpc::Failure;
use engram_schema::{Ident, Scope, ScopeKind};

use crate::Query;

impl Query {
    /// The brief of `request`'s task; `subject` is an agent's request subject (its
    /// rights and replay share apply), `None` for the admin and the services.
    pub async fn brief(
        &self,
        subject: Option<&str>,
        request: BriefRequest,
    ) -> Result<BriefResponse, Failure> {
        request.scopes.resolve().map_err(Failure::invalid)?;
        request.validate().map_err(Failure::from)?;
        let limits = Limits {
            max_events: request
                .max_events
                .unwrap_or(proto::limits::MAX_BRIEF_EVENTS),
            max_items: request.max_items.unwrap_or(Limits::default().max_items),
            ..Limits::default()
        };
        let caller = subject.and_then(engram_access::perms::caller_of);
        let tenant = request.scopes.tenant.clone();
        let task = request.scopes.scope.clone();
        let mut notes = Vec::new();
        let mut events = Vec::new();
        self.brief_replay(
            &caller,
            &tenant,
            &task,
            limits.max_events,
            &mut events,
            &mut notes,
        )
        .await?;
        if let Some(session) = &request.session {
            let scope = Scope {
                kind: ScopeKind::Session,
                id: session.clone(),
            };
            let room = limits.max_events.saturating_sub(events.len());
            let readable = match subject {
                Some(subject) => {
                    self.authorize(subject, &replay_of(&tenant, &scope, 0))
                        .await
                }
                None => Ok(()),
            };
            match readable {
                Err(e) => notes.push(format!(
                    "the session's scope {scope} is not readable with this key ({e}): its working memory is not shown"
                )),
                Ok(()) if room == 0 => notes.push(format!(
                    "the session's scope {scope} was not read: the bound on events was reached"
                )),
                Ok(()) => {
                    self.brief_replay(&caller, &tenant, &scope, room, &mut events, &mut notes)
                        .await?
                }
            }
        }

        let asks = Asks::new(&tenant, &task, &events);
        let listed = self
            .doc(asks.boards())
            .await
            .map(|l| l.docs)
            .map_err(|e| e.to_string());
        let boards = asks.boards_of(listed, &mut notes);
        let mut skills = Vec::new();
        for request in asks.skills(&events, &mut notes) {
            let answer = self
                .skills(request.clone())
                .await
                .map(|a| a.skills)
                .map_err(|e| e.to_string());
            skills.extend(Asks::skills_of(&request, answer, &mut notes));
        }
        let brief = engram_brief::build(&Input {
            tenant,
            task: task.id,
            session: request.session.clone(),
            events: &events,
            boards: &boards,
            skills: &skills,
            notes,
            limits,
        });
        let markdown = brief.markdown();
        Ok(BriefResponse { brief, markdown })
    }

    /// Appends the events of `scope` to `out`, page by page within the caller's replay
    /// share, at most `max`; past it, says so in `notes`.
    async fn brief_replay(
        &self,
        caller: &Option<(Ident, Ident)>,
        tenant: &Ident,
        scope: &Scope,
        max: usize,
        out: &mut Vec<SourceEvent>,
        notes: &mut Vec<String>,
    ) -> Result<(), Failure> {
        let mut read = 0usize;
        let mut after = 0;
        loop {
            let page = self
                .replay_for(caller.clone(), replay_of(tenant, scope, after))
                .await?;
            for e in page.events {
                if read == max {
                    notes.push(format!(
                        "the replay of {scope} stopped at {max} events: later events are not in the brief"
                    ));
                    return Ok(());
                }
                read += 1;
                out.push(SourceEvent {
                    seq: e.seq,
                    event: e.event,
                });
            }
            if page.done || page.next_after <= after {
                return Ok(());
            }
            after = page.next_after;
        }
    }
}

fn replay_of(tenant: &Ident, scope: &Scope, after_seq: u64) -> proto::ReplayRequest {
    proto::ReplayRequest {
        scopes: proto::ScopeRequest {
            tenant: tenant.clone(),
            scope: scope.clone(),
            grants: Vec::new(),
        },
        after_seq,
        limit: proto::limits::MAX_REPLAY_EVENTS,
    }
}

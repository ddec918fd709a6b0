//! The brief as Markdown: one heading per section, one line per statement, each ending with
//! the events it cites. Texts were made one-line and bounded by [`crate::build`]; here they
//! are also kept from closing the code spans they are shown in.

use std::fmt::Write as _;

use engram_schema::EventId;

use crate::{Brief, Fixed};

/// `[events: a, b]`.
fn cited(ids: &[EventId]) -> String {
    let ids: Vec<&str> = ids.iter().map(EventId::as_str).collect();
    format!("[events: {}]", ids.join(", "))
}

/// A text as shown: backticks turned into quotes, so it stays inside its own line's markup.
fn shown(text: &str) -> String {
    text.replace('`', "'")
}

impl Brief {
    /// The brief as Markdown; deterministic like the brief itself.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let w = &mut out;
        let _ = writeln!(
            w,
            "# Handoff brief: task {} (tenant {})",
            self.task, self.tenant
        );
        let _ = writeln!(w);
        if let Some(session) = &self.session {
            let _ = writeln!(w, "Resuming session {session}.");
        }
        let _ = writeln!(
            w,
            "Built from {} events of the log, through stream sequence {}, and the read models. Every line cites the events it comes from.",
            self.events_read, self.through_seq
        );
        let left_out = |w: &mut String, section: &str| {
            if let Some(n) = self.left_out.get(section) {
                let _ = writeln!(w, "- ({n} earlier left out)");
            }
        };

        let _ = writeln!(w, "\n## Task\n");
        if self.sessions.is_empty() {
            let _ = writeln!(w, "- No `engram run` session recorded.");
        }
        left_out(w, "sessions");
        for s in &self.sessions {
            let _ = write!(
                w,
                "- Session {}: role {}, machine {}, {}",
                s.session,
                s.role.as_ref().map_or("?", |r| r.as_str()),
                shown(s.machine.as_deref().unwrap_or("?")),
                s.state
            );
            if let Some(command) = &s.command {
                let _ = write!(w, "; ran `{}`", shown(command));
            }
            if let Some(note) = &s.last_checkpoint {
                let _ = write!(w, "; last checkpoint: {}", shown(note));
            }
            let _ = writeln!(w, " {}", cited(&s.sources));
        }

        let _ = writeln!(w, "\n## Decided\n");
        if self.decisions.is_empty() {
            let _ = writeln!(w, "- Nothing recorded as a decision (tag `decision`).");
        }
        left_out(w, "decisions");
        for d in &self.decisions {
            let _ = write!(w, "- {}", shown(&d.text));
            if let Some(why) = &d.why {
                let _ = write!(w, ". Why: {}", shown(why));
            }
            match (&d.caused_by, &d.caused_by_text) {
                (Some(_), Some(cause)) => {
                    let _ = write!(w, ". In answer to: {}", shown(cause));
                }
                (Some(id), None) => {
                    let _ = write!(w, ". Caused by event {id} (not read)");
                }
                _ => {}
            }
            let _ = writeln!(w, " {}", cited(&d.sources));
        }

        let _ = writeln!(w, "\n## Failed and fixed\n");
        if self.failures.is_empty() {
            let _ = writeln!(w, "- No failure recorded.");
        }
        left_out(w, "failures");
        for f in &self.failures {
            let _ = write!(w, "- Failed: {}", shown(&f.text));
            if let Some(subject) = &f.subject {
                let _ = write!(w, " ({})", shown(subject));
            }
            match &f.fix {
                Some(fix) => {
                    let how = match fix.found_by {
                        Fixed::CausedBy => "caused by the failure",
                        Fixed::TaggedFix => "tagged fix, naming it",
                        Fixed::LaterSuccess => "a later success of the same",
                    };
                    let _ = write!(w, ". Fixed: {} ({how})", shown(&fix.text));
                }
                None => {
                    let _ = write!(w, ". Unresolved");
                }
            }
            let _ = writeln!(w, " {}", cited(&f.sources));
        }

        let _ = writeln!(w, "\n## Open\n");
        if self.open.is_empty() {
            let _ = writeln!(w, "- No open item on the task's boards.");
        }
        left_out(w, "open");
        for item in &self.open {
            let _ = write!(
                w,
                "- [{}] {} ({}/{}#{})",
                item.status,
                shown(&item.title),
                item.scope,
                item.board,
                shown(&item.id)
            );
            if let Some(owner) = &item.owner {
                let _ = write!(w, ", owner {}", shown(owner));
            }
            if let Some(note) = &item.last_note {
                let _ = write!(w, ": {}", shown(note));
            }
            let _ = writeln!(w, " {}", cited(&item.sources));
        }

        let _ = writeln!(w, "\n## Skills\n");
        if self.skills.is_empty() {
            let _ = writeln!(w, "- No skill recorded in the task.");
        }
        left_out(w, "skills");
        for s in &self.skills {
            let version = s.version.map_or("?".to_owned(), |v| v.to_string());
            let _ = write!(
                w,
                "- {} v{version}: {}",
                shown(&s.name),
                shown(&s.description)
            );
            if s.from_read_model {
                let _ = write!(w, " ({} successes, {} failures)", s.successes, s.failures);
            } else {
                let _ = write!(
                    w,
                    " (from its record; the skills read model did not answer)"
                );
            }
            let _ = writeln!(w, " {}", cited(&s.sources));
        }

        let _ = writeln!(w, "\n## Artifacts\n");
        if self.artifacts.is_empty() {
            let _ = writeln!(w, "- No artifact stored.");
        }
        left_out(w, "artifacts");
        for a in &self.artifacts {
            let _ = writeln!(
                w,
                "- {} ({} bytes, sha256 {}) of session {} {}",
                a.name,
                a.size,
                a.sha256,
                a.session,
                cited(std::slice::from_ref(&a.event_id))
            );
        }

        if self.session.is_some() {
            let _ = writeln!(w, "\n## Working memory\n");
            if self.working.is_empty() {
                let _ = writeln!(w, "- The session wrote no working-memory event.");
            }
            left_out(w, "working");
            for item in &self.working {
                let _ = writeln!(
                    w,
                    "- {} {}: {} {}",
                    item.occurred_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                    item.kind,
                    shown(&item.text),
                    cited(std::slice::from_ref(&item.event_id))
                );
            }
        }

        if !self.notes.is_empty() {
            let _ = writeln!(w, "\n## Notes\n");
            for note in &self.notes {
                let _ = writeln!(w, "- {}", shown(&crate::bounded(note, 1000)));
            }
        }
        out
    }
}

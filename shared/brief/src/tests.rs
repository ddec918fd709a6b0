//! Given crafted events, boards and skills, then the brief holds exactly what they say,
//! citing them, whatever order they came in.

use chrono::TimeZone as _;
use engram_schema::session::{
    ArtifactStored, CheckpointVia, SessionCheckpointed, SessionEnded, SessionStarted,
};
use engram_schema::{Content, Layer};
use serde_json::json;

use super::*;

const SESSION: &str = "01JB9ZK2F3QW8X5V7N4M6T1R0S";

fn id(s: &str) -> Ident {
    Ident::parse("id", s).unwrap()
}

/// The n-th event id: a ULID, so ids sort as they are numbered.
fn eid(n: u32) -> EventId {
    EventId::parse(&format!("01JB9ZK2F3QW8X5V7N4M6T{n:04}")).unwrap()
}

fn task() -> Scope {
    Scope::new(ScopeKind::Task, "fix-login").unwrap()
}

/// Event `n`, happening at second `n`.
fn event(n: u32, kind: EventKind, text: &str, tags: &[&str], data: Option<Value>) -> SourceEvent {
    let mut e = Envelope::new(
        id("acme"),
        task(),
        id("run-x"),
        id(SESSION),
        Layer::Episodic,
        kind,
        Content {
            text: text.into(),
            data,
        },
    );
    e.event_id = eid(n);
    e.occurred_at = Utc.timestamp_opt(1_700_000_000 + i64::from(n), 0).unwrap();
    e.recorded_at = e.occurred_at;
    e.tags = tags.iter().map(|t| t.to_string()).collect();
    SourceEvent {
        seq: u64::from(n) * 10,
        event: e,
    }
}

fn record(n: u32, step: SessionEvent) -> SourceEvent {
    let record = SessionRecord {
        session: id(SESSION),
        event: step,
    };
    let mut source = event(n, EventKind::Checkpoint, "", &[], None);
    source.event.layer = Layer::Working;
    source.event.content = record.content();
    source
}

fn caused(mut source: SourceEvent, by: u32) -> SourceEvent {
    source.event.causation_id = Some(eid(by));
    source
}

/// A task's history: a session that started, decided, failed and fixed things, recorded a
/// skill, edited a board, stored an artifact, checkpointed and exited.
fn history() -> Vec<SourceEvent> {
    vec![
        record(
            1,
            SessionEvent::Started(SessionStarted {
                role: id("coder"),
                command: vec!["agent".into()],
                command_truncated: false,
                machine: "cloud-1".into(),
                pid: 7,
                heartbeat_ms: 30_000,
                workdir: None,
                context: None,
                resumes: None,
            }),
        ),
        event(
            2,
            EventKind::Observation,
            "login fails for SSO users",
            &[],
            None,
        ),
        caused(
            event(
                3,
                EventKind::Action,
                "use the OIDC library, not hand-rolled JWT parsing",
                &[DECISION_TAG],
                Some(json!({"why": "it validates the issuer"})),
            ),
            2,
        ),
        event(
            4,
            EventKind::Outcome,
            "tests failed: clock skew",
            &[],
            Some(json!({"success": false, "action": "run-tests"})),
        ),
        caused(
            event(5, EventKind::Action, "allow 60 s of clock skew", &[], None),
            4,
        ),
        event(
            6,
            EventKind::Observation,
            "migration broke the schema",
            &[FAILURE_TAG],
            None,
        ),
        event(
            7,
            EventKind::Action,
            "rolled the migration back",
            &[FIX_TAG],
            Some(json!({"fixes": [eid(6).as_str()]})),
        ),
        event(
            8,
            EventKind::Outcome,
            "deploy failed",
            &[],
            Some(json!({"success": false, "skill": "deploy"})),
        ),
        event(
            9,
            EventKind::Outcome,
            "deploy worked",
            &[],
            Some(json!({"success": true, "skill": "deploy"})),
        ),
        event(
            10,
            EventKind::Observation,
            "flaky network",
            &[ERROR_TAG],
            None,
        ),
        event(
            11,
            EventKind::SkillRecorded,
            "",
            &[],
            Some(json!({"name": "deploy", "description": "ship it"})),
        ),
        event(
            12,
            EventKind::DocChanged,
            "",
            &[],
            Some(json!({"doc_type": "task_board", "name": "main", "changes": ["x"]})),
        ),
        record(
            13,
            SessionEvent::Artifact(ArtifactStored {
                name: "report.txt".into(),
                size: 12,
                sha256: "a".repeat(64),
                bucket: id("ENGRAM_ARTIFACTS"),
                object: "acme/fix-login/x/report.txt/a".into(),
            }),
        ),
        record(
            14,
            SessionEvent::Checkpoint(SessionCheckpointed {
                note: "half way".into(),
                via: CheckpointVia::Request,
            }),
        ),
        record(
            15,
            SessionEvent::Ended(SessionEnded {
                exit_code: Some(0),
                signal: None,
                duration_ms: 1,
            }),
        ),
    ]
}

fn boards() -> Vec<BoardState> {
    vec![BoardState {
        scope: task(),
        name: id("main"),
        value: json!({"items": {
            "t-2": {"title": "add SSO test", "status": "doing", "owner": "coder", "notes": ["half", "nearly"]},
            "t-1": {"title": "fix login", "status": "done", "notes": []},
            "t-3": {"title": "write docs", "notes": []},
        }}),
        last_seq: 120,
    }]
}

fn skills() -> Vec<SkillState> {
    vec![SkillState {
        name: "deploy".into(),
        version: 1,
        description: "ship it".into(),
        event_id: eid(11),
        successes: 1,
        failures: 1,
    }]
}

fn input<'a>(
    events: &'a [SourceEvent],
    boards: &'a [BoardState],
    skills: &'a [SkillState],
) -> Input<'a> {
    Input {
        tenant: id("acme"),
        task: id("fix-login"),
        session: Some(id(SESSION)),
        events,
        boards,
        skills,
        notes: Vec::new(),
        limits: Limits::default(),
    }
}

#[test]
fn each_section_holds_what_the_events_say_citing_them() {
    let (events, boards, skills) = (history(), boards(), skills());
    let brief = build(&input(&events, &boards, &skills));

    assert_eq!(brief.events_read, 15);
    assert_eq!(brief.through_seq, 150);
    let [session] = &brief.sessions[..] else {
        panic!("{:#?}", brief.sessions)
    };
    assert_eq!(session.role, Some(id("coder")));
    assert_eq!(session.machine.as_deref(), Some("cloud-1"));
    assert_eq!(session.command.as_deref(), Some("agent"));
    assert_eq!(session.state, "exited(0)");
    assert_eq!(session.last_checkpoint.as_deref(), Some("half way"));
    assert_eq!(session.sources, [eid(1), eid(14), eid(15)]);

    let [decision] = &brief.decisions[..] else {
        panic!("{:#?}", brief.decisions)
    };
    assert_eq!(
        decision.text,
        "use the OIDC library, not hand-rolled JWT parsing"
    );
    assert_eq!(decision.why.as_deref(), Some("it validates the issuer"));
    assert_eq!(decision.caused_by, Some(eid(2)));
    assert_eq!(
        decision.caused_by_text.as_deref(),
        Some("login fails for SSO users")
    );
    assert_eq!(decision.sources, [eid(3), eid(2)]);

    let failures: Vec<(EventId, Option<(EventId, Fixed)>)> = brief
        .failures
        .iter()
        .map(|f| {
            (
                f.event_id.clone(),
                f.fix.as_ref().map(|x| (x.event_id.clone(), x.found_by)),
            )
        })
        .collect();
    assert_eq!(
        failures,
        [
            (eid(4), Some((eid(5), Fixed::CausedBy))),
            (eid(6), Some((eid(7), Fixed::TaggedFix))),
            (eid(8), Some((eid(9), Fixed::LaterSuccess))),
            (eid(10), None),
        ]
    );
    assert_eq!(brief.failures[0].sources, [eid(4), eid(5)]);
    assert_eq!(brief.failures[0].subject.as_deref(), Some("run-tests"));
    assert_eq!(brief.failures[3].sources, [eid(10)]);

    let open: Vec<(&str, &str)> = brief
        .open
        .iter()
        .map(|i| (i.id.as_str(), i.status.as_str()))
        .collect();
    assert_eq!(open, [("t-2", "doing"), ("t-3", "todo")]);
    assert_eq!(brief.open[0].last_note.as_deref(), Some("nearly"));
    assert_eq!(brief.open[0].owner.as_deref(), Some("coder"));
    assert_eq!(brief.open[0].sources, [eid(12)]);

    let [skill] = &brief.skills[..] else {
        panic!("{:#?}", brief.skills)
    };
    assert_eq!(
        (skill.name.as_str(), skill.version, skill.from_read_model),
        ("deploy", Some(1), true)
    );
    assert_eq!(skill.sources, [eid(11)]);

    let [artifact] = &brief.artifacts[..] else {
        panic!("{:#?}", brief.artifacts)
    };
    assert_eq!(artifact.name, "report.txt");
    assert_eq!(artifact.event_id, eid(13));
    assert!(brief.notes.is_empty(), "{:?}", brief.notes);

    // And the Markdown shows every statement with its citations
    let md = brief.markdown();
    for line in [
        format!(
            "- use the OIDC library, not hand-rolled JWT parsing. Why: it validates the issuer. In answer to: login fails for SSO users [events: {}, {}]",
            eid(3),
            eid(2)
        ),
        format!(
            "- Failed: tests failed: clock skew (run-tests). Fixed: allow 60 s of clock skew (caused by the failure) [events: {}, {}]",
            eid(4),
            eid(5)
        ),
        format!("- Failed: flaky network. Unresolved [events: {}]", eid(10)),
        format!(
            "- Session {SESSION}: role coder, machine cloud-1, exited(0); ran `agent`; last checkpoint: half way [events: {}, {}, {}]",
            eid(1),
            eid(14),
            eid(15)
        ),
        format!(
            "- [doing] add SSO test (task:fix-login/main#t-2), owner coder: nearly [events: {}]",
            eid(12)
        ),
        format!(
            "- deploy v1: ship it (1 successes, 1 failures) [events: {}]",
            eid(11)
        ),
    ] {
        assert!(md.lines().any(|l| l == line), "no line {line:?} in\n{md}");
    }
}

#[test]
fn shuffled_and_repeated_input_gives_a_byte_identical_brief() {
    let (events, boards, skills) = (history(), boards(), skills());
    let expected = build(&input(&events, &boards, &skills));
    let json = serde_json::to_string(&expected).unwrap();
    let md = expected.markdown();
    // Every rotation, reversed, and with each event delivered twice (a leaf's relay)
    for turn in 0..events.len() {
        let mut shuffled = events.clone();
        shuffled.rotate_left(turn);
        if turn % 2 == 1 {
            shuffled.reverse();
        }
        if turn % 3 == 0 {
            let again: Vec<SourceEvent> = shuffled
                .iter()
                .cloned()
                .map(|mut s| {
                    s.seq += 1000;
                    s
                })
                .collect();
            shuffled.extend(again);
        }
        let brief = build(&input(&shuffled, &boards, &skills));
        assert_eq!(serde_json::to_string(&brief).unwrap(), json, "turn {turn}");
        assert_eq!(brief.markdown(), md, "turn {turn}");
    }
}

#[test]
fn bounds_cut_sections_texts_and_events_and_say_so() {
    let mut events: Vec<SourceEvent> = (1..=30)
        .map(|n| {
            event(
                n,
                EventKind::Action,
                &format!("decision {n} {}\n# not a heading", "x".repeat(100)),
                &[DECISION_TAG],
                None,
            )
        })
        .collect();
    // Another tenant's event is never read
    let mut foreign = event(31, EventKind::Action, "theirs", &[DECISION_TAG], None);
    foreign.event.tenant = id("other");
    events.push(foreign);
    let mut input = input(&events, &[], &[]);
    input.limits = Limits {
        max_events: 20,
        max_items: 5,
        max_text_chars: 40,
        max_citations: 1,
    };
    input.notes.push("the replay stopped at its bound".into());
    let brief = build(&input);
    assert_eq!(brief.events_read, 20);
    let kept: Vec<EventId> = brief.decisions.iter().map(|d| d.event_id.clone()).collect();
    assert_eq!(kept, (26..=30).map(eid).collect::<Vec<_>>());
    assert_eq!(brief.left_out.get("decisions"), Some(&15));
    for d in &brief.decisions {
        assert_eq!(d.text.chars().count(), 40, "{}", d.text);
        assert!(d.text.ends_with('…') && !d.text.contains('\n'));
        assert_eq!(d.sources.len(), 1);
    }
    assert_eq!(brief.notes[0], "the replay stopped at its bound");
    assert!(
        brief.notes[1].contains("latest 20 of 30 events"),
        "{:?}",
        brief.notes
    );
    let md = brief.markdown();
    assert!(md.contains("(15 earlier left out)"), "{md}");
    assert!(!md.lines().any(|l| l.starts_with("# not")), "{md}");
}

#[test]
fn a_failure_retried_and_failing_again_is_not_fixed_by_its_retry() {
    let events = vec![
        event(
            1,
            EventKind::Outcome,
            "build failed",
            &[],
            Some(json!({"success": false})),
        ),
        caused(
            event(
                2,
                EventKind::Outcome,
                "retry failed",
                &[],
                Some(json!({"success": false})),
            ),
            1,
        ),
        caused(
            event(3, EventKind::Action, "pinned the compiler", &[], None),
            2,
        ),
        // A fix naming another failure fixes nothing here
        event(
            4,
            EventKind::Action,
            "unrelated",
            &[FIX_TAG],
            Some(json!({"fixes": eid(99).as_str()})),
        ),
    ];
    let brief = build(&input(&events, &[], &[]));
    let fixed: Vec<Option<EventId>> = brief
        .failures
        .iter()
        .map(|f| f.fix.as_ref().map(|x| x.event_id.clone()))
        .collect();
    assert_eq!(fixed, [None, Some(eid(3))]);
}

#[test]
fn a_skill_the_read_model_does_not_answer_for_comes_from_its_record() {
    let events = vec![event(
        1,
        EventKind::SkillRecorded,
        "",
        &[],
        Some(json!({"name": "bisect", "description": "find the commit", "version": 3})),
    )];
    let brief = build(&input(&events, &[], &[]));
    let [skill] = &brief.skills[..] else {
        panic!("{:#?}", brief.skills)
    };
    assert_eq!(skill.version, Some(3));
    assert!(!skill.from_read_model);
    assert_eq!(skill.description, "find the commit");
    assert_eq!(skill.sources, [eid(1)]);
    // And a read model answer is read from the registry's shape
    let answered = json!({"name": "bisect", "version": 4, "description": "d", "successes": 2,
        "failures": 0, "source": {"event_id": eid(1).as_str(), "seq": 3}, "score": 1.0});
    let state = SkillState::from_json(&answered).unwrap();
    assert_eq!((state.version, state.successes), (4, 2));
    assert!(SkillState::from_json(&json!({"name": "x"})).is_none());
}

#[test]
fn working_memory_is_the_sessions_own_working_events() {
    let mut note = event(
        1,
        EventKind::Observation,
        "scratch: try port 8081",
        &[],
        None,
    );
    note.event.layer = Layer::Working;
    note.event.scope = Scope::new(ScopeKind::Session, SESSION).unwrap();
    let mut other = note.clone();
    other.event.event_id = eid(2);
    other.event.scope = Scope::new(ScopeKind::Session, "another").unwrap();
    let events = vec![note, other];
    let brief = build(&input(&events, &[], &[]));
    let working: Vec<&EventId> = brief.working.iter().map(|w| &w.event_id).collect();
    assert_eq!(working, [&eid(1)]);
    assert!(brief.markdown().contains("scratch: try port 8081"));
}

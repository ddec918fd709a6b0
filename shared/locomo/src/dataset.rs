//! The LoCoMo data model and its loader.
//!
//! Only what a retrieval benchmark may see is kept: turns, session dates and questions. The
//! derived annotations (`observation`, `session_summary`, `event_summary`) paraphrase the
//! answers, so they are never even deserialised and cannot leak into an index.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use chrono::{DateTime, NaiveDateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::dia_id::DiaId;
use crate::error::{LocomoError, Problem};

/// The format of `session_N_date_time`, e.g. `1:56 pm on 8 May, 2023`.
const SESSION_DATE_FORMAT: &str = "%I:%M %p on %d %B, %Y";

/// A loaded LoCoMo file: its conversations, and the evidence ids that name no turn.
#[derive(Clone, Debug)]
pub struct Dataset {
    path: PathBuf,
    conversations: Vec<Conversation>,
    unmatched: Vec<UnmatchedEvidence>,
}

/// One long conversation between two speakers, and the questions asked about it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Conversation {
    /// The conversation's id, e.g. `conv-26`; unique in a dataset, so it can name a scope.
    pub sample_id: String,
    pub speaker_a: String,
    pub speaker_b: String,
    /// Sorted by index. Indexes may have gaps.
    pub sessions: Vec<Session>,
    /// In file order.
    pub questions: Vec<Question>,
}

/// One sitting of a conversation, all of it dated by the session's start.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Session {
    /// The `N` of `session_N`.
    pub index: u32,
    /// When the session happened. The file gives no zone; it is read as UTC.
    pub date: DateTime<Utc>,
    /// In file order.
    pub turns: Vec<Turn>,
}

/// One utterance: what gets ingested as one memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Turn {
    pub dia_id: DiaId,
    pub speaker: String,
    pub text: String,
    /// The generated caption of a photo the speaker shared; `None` when there is none or it
    /// is blank.
    pub blip_caption: Option<String>,
}

/// One question about a conversation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Question {
    pub question: String,
    /// The reference answer, stringified when the file has a number. Adversarial questions
    /// (category 5) usually have none.
    pub answer: Option<String>,
    /// The turns that hold the answer: normalised, deduplicated, in file order, and only ids
    /// that name a turn of this conversation. The rest are in
    /// [`Dataset::unmatched_evidence`]; keeping them would put turns no retriever can return
    /// into the recall denominator.
    pub evidence: Vec<DiaId>,
    /// 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial.
    pub category: u8,
}

/// An evidence id that names no turn of its conversation, even after normalisation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UnmatchedEvidence {
    pub sample_id: String,
    /// Position of the question in its conversation's `qa` list.
    pub question: usize,
    pub category: u8,
    /// The whole evidence string as it is in the file.
    pub raw: String,
    pub reason: Unmatched,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unmatched {
    /// A fragment of `raw` that is no dialogue id at all, e.g. a bare `D`.
    Malformed { fragment: String },
    /// A well-formed id with no such turn in the conversation.
    NoSuchTurn { dia_id: DiaId },
}

/// How much of a dataset a benchmark run covers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DatasetCounts {
    pub conversations: usize,
    pub sessions: usize,
    pub turns: usize,
    /// Every question in the file.
    pub questions: usize,
    /// Categories 1 to 4 with at least one evidence turn: the recall denominator.
    pub questions_asked: usize,
    /// Categories 1 to 4 left with no evidence turn, so recall is undefined for them.
    pub questions_skipped_no_evidence: usize,
    /// Category 5: the answer is not in the conversation, so they are never asked.
    pub questions_adversarial: usize,
    /// Evidence ids, over all questions, that name no turn after normalisation.
    pub unmatched_evidence: usize,
}

/// The name of a LoCoMo question category, or `None` for a number outside 1 to 5.
pub fn category_name(category: u8) -> Option<&'static str> {
    Some(match category {
        1 => "multi-hop",
        2 => "temporal",
        3 => "open-domain",
        4 => "single-hop",
        5 => "adversarial",
        _ => return None,
    })
}

/// Reads a `session_N_date_time` value, e.g. `1:56 pm on 8 May, 2023`, as UTC.
pub fn parse_session_date(raw: &str) -> Result<DateTime<Utc>, chrono::ParseError> {
    NaiveDateTime::parse_from_str(raw.trim(), SESSION_DATE_FORMAT).map(|naive| naive.and_utc())
}

impl Dataset {
    /// Loads a LoCoMo JSON file such as `locomo10.json` or a subset of it.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, LocomoError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| LocomoError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_slice(&bytes, path)
    }

    /// Reads LoCoMo JSON already in memory; `origin` is the name errors give it.
    pub fn from_slice(json: &[u8], origin: impl AsRef<Path>) -> Result<Self, LocomoError> {
        let path = origin.as_ref().to_owned();
        let mut de = serde_json::Deserializer::from_slice(json);
        let raw: Vec<RawSample> = from_json(&path, "", &mut de)?;
        de.end().map_err(|source| LocomoError::Json {
            path: path.clone(),
            at: "(after the list)".to_owned(),
            source,
        })?;
        let mut seen = HashSet::new();
        let mut conversations = Vec::with_capacity(raw.len());
        let mut unmatched = Vec::new();
        for (position, sample) in raw.into_iter().enumerate() {
            let invalid = |problem| LocomoError::Invalid {
                path: path.clone(),
                sample_id: sample.sample_id.clone(),
                problem,
            };
            if !seen.insert(sample.sample_id.clone()) {
                return Err(invalid(Problem::DuplicateConversation));
            }
            let sessions = read_sessions(&path, position, sample.conversation.sessions)
                .map_err(|e| e.into_error(&path, &sample.sample_id))?;
            let mut conversation = Conversation {
                sample_id: sample.sample_id,
                speaker_a: sample.conversation.speaker_a,
                speaker_b: sample.conversation.speaker_b,
                sessions,
                questions: Vec::with_capacity(sample.qa.len()),
            };
            let turn_ids: HashSet<DiaId> = conversation.turns().map(|(_, t)| t.dia_id).collect();
            for (index, qa) in sample.qa.into_iter().enumerate() {
                let question = read_question(
                    &conversation.sample_id,
                    index,
                    qa,
                    &turn_ids,
                    &mut unmatched,
                )
                .map_err(|problem| LocomoError::Invalid {
                    path: path.clone(),
                    sample_id: conversation.sample_id.clone(),
                    problem,
                })?;
                conversation.questions.push(question);
            }
            conversations.push(conversation);
        }
        Ok(Self {
            path,
            conversations,
            unmatched,
        })
    }

    /// The file this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// In file order.
    pub fn conversations(&self) -> &[Conversation] {
        &self.conversations
    }

    pub fn conversation(&self, sample_id: &str) -> Option<&Conversation> {
        self.conversations.iter().find(|c| c.sample_id == sample_id)
    }

    /// Evidence ids left out of [`Question::evidence`] because they name no turn.
    pub fn unmatched_evidence(&self) -> &[UnmatchedEvidence] {
        &self.unmatched
    }

    pub fn counts(&self) -> DatasetCounts {
        let questions = || self.conversations.iter().flat_map(|c| &c.questions);
        DatasetCounts {
            conversations: self.conversations.len(),
            sessions: self.conversations.iter().map(|c| c.sessions.len()).sum(),
            turns: self
                .conversations
                .iter()
                .map(Conversation::turn_count)
                .sum(),
            questions: questions().count(),
            questions_asked: questions().filter(|q| q.is_asked()).count(),
            questions_skipped_no_evidence: questions()
                .filter(|q| q.is_scored() && q.evidence.is_empty())
                .count(),
            questions_adversarial: questions().filter(|q| !q.is_scored()).count(),
            unmatched_evidence: self.unmatched.len(),
        }
    }
}

impl Conversation {
    /// Every turn in conversation order, with the session that dates it.
    pub fn turns(&self) -> impl Iterator<Item = (&Session, &Turn)> {
        self.sessions
            .iter()
            .flat_map(|session| session.turns.iter().map(move |turn| (session, turn)))
    }

    pub fn turn_count(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    pub fn session(&self, index: u32) -> Option<&Session> {
        let at = self
            .sessions
            .binary_search_by_key(&index, |s| s.index)
            .ok()?;
        Some(&self.sessions[at])
    }

    pub fn turn(&self, id: DiaId) -> Option<&Turn> {
        self.session(id.session)?
            .turns
            .iter()
            .find(|t| t.dia_id == id)
    }
}

impl Turn {
    /// The text to ingest for this turn: who said it, what they said, and a caption for
    /// a shared photo, because questions are often about what was in it.
    pub fn memory_text(&self) -> String {
        match &self.blip_caption {
            Some(caption) => format!(
                "{}: {} [shares a photo: {caption}]",
                self.speaker, self.text
            ),
            None => format!("{}: {}", self.speaker, self.text),
        }
    }
}

impl Question {
    /// Whether the protocol asks this question at all: categories 1 to 4. Category 5's
    /// answer is not in the conversation, so there is nothing to retrieve.
    pub fn is_scored(&self) -> bool {
        (1..=4).contains(&self.category)
    }

    /// Whether this question counts toward recall: scored and with at least one evidence
    /// turn. These are the questions a benchmark run should query.
    pub fn is_asked(&self) -> bool {
        self.is_scored() && !self.evidence.is_empty()
    }

    pub fn category_name(&self) -> &'static str {
        category_name(self.category).unwrap_or("unknown")
    }
}

#[derive(Deserialize)]
struct RawSample {
    sample_id: String,
    conversation: RawConversation,
    #[serde(default)]
    qa: Vec<RawQuestion>,
}

#[derive(Deserialize)]
struct RawConversation {
    speaker_a: String,
    speaker_b: String,
    /// `session_N` and `session_N_date_time`, whose names serde cannot match by pattern.
    #[serde(flatten)]
    sessions: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct RawTurn {
    speaker: String,
    dia_id: String,
    text: String,
    #[serde(default)]
    blip_caption: Option<String>,
}

#[derive(Deserialize)]
struct RawQuestion {
    question: String,
    #[serde(default)]
    answer: Option<serde_json::Value>,
    #[serde(default)]
    evidence: Vec<String>,
    category: u8,
}

/// Deserialises with the failing path in the error, prefixed by where `de` sits in the file.
fn from_json<'de, T, D>(path: &Path, prefix: &str, de: D) -> Result<T, LocomoError>
where
    T: Deserialize<'de>,
    D: serde::Deserializer<'de, Error = serde_json::Error>,
{
    serde_path_to_error::deserialize(de).map_err(|e| LocomoError::Json {
        path: path.to_owned(),
        at: format!("{prefix}{}", e.path()),
        source: e.into_inner(),
    })
}

/// A session-reading failure before the conversation's id is attached.
enum SessionError {
    Json(LocomoError),
    Problem(Problem),
}

impl SessionError {
    fn into_error(self, path: &Path, sample_id: &str) -> LocomoError {
        match self {
            Self::Json(e) => e,
            Self::Problem(problem) => LocomoError::Invalid {
                path: path.to_owned(),
                sample_id: sample_id.to_owned(),
                problem,
            },
        }
    }
}

enum SessionKey {
    Turns(u32),
    Date(u32),
}

fn session_key(key: &str) -> Option<SessionKey> {
    let rest = key.strip_prefix("session_")?;
    let (digits, date) = match rest.strip_suffix("_date_time") {
        Some(digits) => (digits, true),
        None => (rest, false),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let index = digits.parse().ok()?;
    Some(if date {
        SessionKey::Date(index)
    } else {
        SessionKey::Turns(index)
    })
}

fn read_sessions(
    path: &Path,
    position: usize,
    fields: serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<Session>, SessionError> {
    let mut turns_by_session = BTreeMap::new();
    let mut dates = BTreeMap::new();
    for (key, value) in fields {
        let at = format!("[{position}].conversation.{key}");
        match session_key(&key) {
            Some(SessionKey::Turns(index)) => {
                let turns: Vec<RawTurn> =
                    from_json(path, &at, value).map_err(SessionError::Json)?;
                turns_by_session.insert(index, turns);
            }
            Some(SessionKey::Date(index)) => {
                let date: String = from_json(path, &at, value).map_err(SessionError::Json)?;
                dates.insert(index, date);
            }
            None => {}
        }
    }

    // Dates without turns are ignored (conv-26 has sixteen): they date nothing.
    let mut seen = HashSet::new();
    let mut sessions = Vec::with_capacity(turns_by_session.len());
    for (index, raw_turns) in turns_by_session {
        let raw_date =
            dates
                .remove(&index)
                .ok_or(SessionError::Problem(Problem::MissingSessionDate {
                    session: index,
                }))?;
        let date = parse_session_date(&raw_date).map_err(|reason| {
            SessionError::Problem(Problem::BadSessionDate {
                session: index,
                raw: raw_date.clone(),
                reason,
            })
        })?;
        let mut turns = Vec::with_capacity(raw_turns.len());
        for (turn_position, raw) in raw_turns.into_iter().enumerate() {
            let dia_id = DiaId::parse(&raw.dia_id).map_err(|source| {
                SessionError::Problem(Problem::BadTurnId {
                    session: index,
                    position: turn_position,
                    source,
                })
            })?;
            if dia_id.session != index {
                return Err(SessionError::Problem(Problem::TurnOutsideSession {
                    session: index,
                    dia_id: raw.dia_id,
                }));
            }
            if !seen.insert(dia_id) {
                return Err(SessionError::Problem(Problem::DuplicateTurn {
                    dia_id: raw.dia_id,
                }));
            }
            turns.push(Turn {
                dia_id,
                speaker: raw.speaker,
                text: raw.text,
                blip_caption: raw
                    .blip_caption
                    .map(|c| c.trim().to_owned())
                    .filter(|c| !c.is_empty()),
            });
        }
        sessions.push(Session { index, date, turns });
    }
    Ok(sessions)
}

fn read_question(
    sample_id: &str,
    index: usize,
    raw: RawQuestion,
    turn_ids: &HashSet<DiaId>,
    unmatched: &mut Vec<UnmatchedEvidence>,
) -> Result<Question, Problem> {
    if category_name(raw.category).is_none() {
        return Err(Problem::BadCategory {
            question: index,
            category: raw.category,
        });
    }
    let answer = match raw.answer {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(s),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        Some(serde_json::Value::Bool(b)) => Some(b.to_string()),
        Some(_) => return Err(Problem::BadAnswer { question: index }),
    };
    let mut evidence = Vec::with_capacity(raw.evidence.len());
    for entry in &raw.evidence {
        for parsed in DiaId::parse_evidence(entry) {
            let reason = match parsed {
                Ok(id) if turn_ids.contains(&id) => {
                    if !evidence.contains(&id) {
                        evidence.push(id);
                    }
                    continue;
                }
                Ok(id) => Unmatched::NoSuchTurn { dia_id: id },
                Err(e) => Unmatched::Malformed {
                    fragment: e.raw().to_owned(),
                },
            };
            unmatched.push(UnmatchedEvidence {
                sample_id: sample_id.to_owned(),
                question: index,
                category: raw.category,
                raw: entry.clone(),
                reason,
            });
        }
    }
    Ok(Question {
        question: raw.question,
        answer,
        evidence,
        category: raw.category,
    })
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use serde_json::json;

    use super::*;

    fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, 0).unwrap()
    }

    fn turn(id: &str, speaker: &str, text: &str) -> serde_json::Value {
        json!({"speaker": speaker, "dia_id": id, "text": text})
    }

    /// A small conversation in the file's shape, including what the loader must ignore.
    fn sample() -> serde_json::Value {
        json!({
            "sample_id": "conv-x",
            "conversation": {
                "speaker_a": "Ann",
                "speaker_b": "Bob",
                "session_10_date_time": "9:00 am on 3 June, 2023",
                "session_10": [turn("D10:1", "Ann", "back again")],
                "session_2_date_time": "12:48 am on 1 February, 2023",
                "session_2": [
                    turn("D2:1", "Ann", "hi"),
                    {"speaker": "Bob", "dia_id": "D2:2", "text": "look",
                     "img_url": ["https://example.invalid/a.jpg"], "query": "dog",
                     "blip_caption": "a photo of a dog", "re-download": true},
                    {"speaker": "Ann", "dia_id": "D2:3", "text": "nice", "blip_caption": "  "},
                ],
                "session_11_date_time": "1:00 pm on 4 June, 2023",
            },
            "observation": {"session_2_observation": {"Ann": [["SECRET OBSERVATION", "D2:1"]]}},
            "session_summary": {"session_2_summary": "SECRET SUMMARY"},
            "event_summary": {"events_session_2": {"Ann": ["SECRET EVENT"]}},
            "qa": [
                {"question": "when?", "answer": 2022, "evidence": ["D2:1"], "category": 2},
                {"question": "what?", "answer": "a dog", "evidence": ["D2:2; D10:01", "D2:2"], "category": 4},
                {"question": "lost?", "answer": "x", "evidence": ["D", "D9:9"], "category": 1},
                {"question": "none?", "answer": "y", "evidence": [], "category": 3},
                {"question": "trick?", "adversarial_answer": "yes", "evidence": ["D2:3"], "category": 5},
            ],
        })
    }

    fn parse(value: serde_json::Value) -> Result<Dataset, LocomoError> {
        Dataset::from_slice(&serde_json::to_vec(&value).unwrap(), "test.json")
    }

    fn problem(value: serde_json::Value) -> Problem {
        match parse(value) {
            Err(LocomoError::Invalid {
                problem,
                sample_id,
                path,
            }) => {
                assert_eq!(path, Path::new("test.json"));
                assert_eq!(sample_id, "conv-x");
                problem
            }
            other => panic!("expected a data problem, got {other:?}"),
        }
    }

    #[test]
    fn real_session_dates_parse_as_utc() {
        let cases = [
            ("1:56 pm on 8 May, 2023", utc(2023, 5, 8, 13, 56)),
            ("12:48 am on 1 February, 2023", utc(2023, 2, 1, 0, 48)),
            ("12:28 am on 8 November, 2023", utc(2023, 11, 8, 0, 28)),
            ("11:01 am on 17 December, 2022", utc(2022, 12, 17, 11, 1)),
            ("4:04 pm on 20 January, 2023", utc(2023, 1, 20, 16, 4)),
            ("12:19 am on 4 January, 2024", utc(2024, 1, 4, 0, 19)),
            (" 10:37 am on 27 June, 2023 ", utc(2023, 6, 27, 10, 37)),
        ];
        for (raw, want) in cases {
            assert_eq!(parse_session_date(raw).unwrap(), want, "{raw}");
        }
    }

    #[test]
    fn impossible_dates_do_not_parse() {
        for raw in [
            "13:56 pm on 8 May, 2023",
            "1:56 pm on 31 February, 2023",
            "1:56 pm on 8 Mayo, 2023",
            "2023-05-08T13:56:00Z",
            "",
        ] {
            assert!(parse_session_date(raw).is_err(), "{raw:?} should not parse");
        }
    }

    #[test]
    fn loads_turns_sorted_by_session_number() {
        let dataset = parse(json!([sample()])).unwrap();
        let conv = &dataset.conversations()[0];
        assert_eq!(
            (conv.speaker_a.as_str(), conv.speaker_b.as_str()),
            ("Ann", "Bob")
        );
        let indexes: Vec<u32> = conv.sessions.iter().map(|s| s.index).collect();
        assert_eq!(
            indexes,
            vec![2, 10],
            "numeric order, and a date alone is no session"
        );
        assert_eq!(conv.sessions[0].date, utc(2023, 2, 1, 0, 48));
        let ids: Vec<String> = conv.turns().map(|(_, t)| t.dia_id.to_string()).collect();
        assert_eq!(ids, ["D2:1", "D2:2", "D2:3", "D10:1"]);
        assert_eq!(conv.turn_count(), 4);
        assert_eq!(conv.turn(DiaId::new(10, 1)).unwrap().text, "back again");
        assert!(conv.turn(DiaId::new(10, 2)).is_none());
        assert!(conv.turn(DiaId::new(3, 1)).is_none());
    }

    #[test]
    fn memory_text_carries_speaker_and_caption_only() {
        let dataset = parse(json!([sample()])).unwrap();
        let conv = &dataset.conversations()[0];
        let text = |s, t| conv.turn(DiaId::new(s, t)).unwrap().memory_text();
        assert_eq!(text(2, 1), "Ann: hi");
        assert_eq!(text(2, 2), "Bob: look [shares a photo: a photo of a dog]");
        assert_eq!(text(2, 3), "Ann: nice", "a blank caption is no caption");
        let everything = serde_json::to_string(&dataset.conversations()).unwrap();
        assert!(
            !everything.contains("SECRET"),
            "derived annotations must not be loaded"
        );
    }

    #[test]
    fn questions_keep_matched_evidence_and_count_the_rest() {
        let dataset = parse(json!([sample()])).unwrap();
        let q = &dataset.conversations()[0].questions;
        assert_eq!(
            q[0].answer.as_deref(),
            Some("2022"),
            "numbers are stringified"
        );
        assert_eq!(q[4].answer, None, "adversarial_answer is not the answer");
        assert_eq!(q[1].evidence, vec![DiaId::new(2, 2), DiaId::new(10, 1)]);
        assert!(q[2].evidence.is_empty());
        assert_eq!(
            dataset.unmatched_evidence(),
            [
                UnmatchedEvidence {
                    sample_id: "conv-x".into(),
                    question: 2,
                    category: 1,
                    raw: "D".into(),
                    reason: Unmatched::Malformed {
                        fragment: "D".into()
                    },
                },
                UnmatchedEvidence {
                    sample_id: "conv-x".into(),
                    question: 2,
                    category: 1,
                    raw: "D9:9".into(),
                    reason: Unmatched::NoSuchTurn {
                        dia_id: DiaId::new(9, 9)
                    },
                },
            ]
        );
        let asked: Vec<bool> = q.iter().map(Question::is_asked).collect();
        assert_eq!(asked, [true, true, false, false, false]);
        let scored: Vec<bool> = q.iter().map(Question::is_scored).collect();
        assert_eq!(scored, [true, true, true, true, false]);
        assert_eq!(
            dataset.counts(),
            DatasetCounts {
                conversations: 1,
                sessions: 2,
                turns: 4,
                questions: 5,
                questions_asked: 2,
                questions_skipped_no_evidence: 2,
                questions_adversarial: 1,
                unmatched_evidence: 2,
            }
        );
    }

    #[test]
    fn a_session_without_a_date_is_refused() {
        let mut s = sample();
        s["conversation"]
            .as_object_mut()
            .unwrap()
            .remove("session_10_date_time");
        assert!(matches!(
            problem(json!([s])),
            Problem::MissingSessionDate { session: 10 }
        ));
    }

    #[test]
    fn an_unparseable_date_is_refused_with_the_string() {
        let mut s = sample();
        s["conversation"]["session_2_date_time"] = json!("sometime in spring");
        let err = problem(json!([s]));
        assert!(
            matches!(&err, Problem::BadSessionDate { session: 2, raw, .. } if raw == "sometime in spring")
        );
        assert!(err.to_string().contains("1:56 pm on 8 May, 2023"), "{err}");
    }

    #[test]
    fn turn_ids_must_fit_their_session_and_be_unique() {
        let mut s = sample();
        s["conversation"]["session_10"] = json!([turn("D2:7", "Ann", "misfiled")]);
        assert!(matches!(
            problem(json!([s])),
            Problem::TurnOutsideSession { session: 10, .. }
        ));

        let mut s = sample();
        s["conversation"]["session_10"] =
            json!([turn("D10:1", "Ann", "a"), turn("D10:01", "Bob", "b")]);
        assert!(matches!(problem(json!([s])), Problem::DuplicateTurn { .. }));

        let mut s = sample();
        s["conversation"]["session_10"] = json!([turn("D10", "Ann", "a")]);
        assert!(matches!(
            problem(json!([s])),
            Problem::BadTurnId {
                session: 10,
                position: 0,
                ..
            }
        ));
    }

    #[test]
    fn bad_categories_answers_and_duplicate_ids_are_refused() {
        let mut s = sample();
        s["qa"][1]["category"] = json!(6);
        assert!(matches!(
            problem(json!([s])),
            Problem::BadCategory {
                question: 1,
                category: 6
            }
        ));

        let mut s = sample();
        s["qa"][0]["answer"] = json!(["a", "b"]);
        assert!(matches!(
            problem(json!([s])),
            Problem::BadAnswer { question: 0 }
        ));

        assert!(matches!(
            problem(json!([sample(), sample()])),
            Problem::DuplicateConversation
        ));
    }

    #[test]
    fn shape_errors_name_the_place_in_the_file() {
        let mut s = sample();
        s["conversation"]["session_2"][1]["text"] = json!(42);
        match parse(json!([s])) {
            Err(LocomoError::Json { at, path, .. }) => {
                assert_eq!(at, "[0].conversation.session_2[1].text");
                assert_eq!(path, Path::new("test.json"));
            }
            other => panic!("expected a json error, got {other:?}"),
        }

        let mut s = sample();
        s["qa"][3]["category"] = json!("three");
        match parse(json!([sample(), s])) {
            Err(LocomoError::Json { at, .. }) => assert_eq!(at, "[1].qa[3].category"),
            other => panic!("expected a json error, got {other:?}"),
        }

        let err = Dataset::from_slice(b"[] trailing", "t.json").unwrap_err();
        assert!(matches!(err, LocomoError::Json { .. }), "{err}");
        assert!(Dataset::from_slice(b"{}", "t.json").is_err());
    }

    #[test]
    fn a_missing_file_names_the_path() {
        let err = Dataset::load("/nonexistent/locomo.json").unwrap_err();
        assert!(matches!(err, LocomoError::Read { .. }));
        assert!(
            err.to_string().contains("/nonexistent/locomo.json"),
            "{err}"
        );
    }
}

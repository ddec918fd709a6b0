//! Parsing and checking the `content.data` of skill events, before anything is changed.

use engram_memory::Seq;
use engram_schema::Envelope;
use serde_json::{Map, Value};

use crate::error::SkillError;

/// Longest skill name, in characters, after trimming.
pub const MAX_NAME_CHARS: usize = 256;

/// A checked `skill_recorded` payload; the version is resolved later, against the registry.
pub(crate) struct Recording {
    pub(crate) name: String,
    pub(crate) version: Option<u32>,
    pub(crate) description: String,
    pub(crate) steps: Vec<String>,
    pub(crate) script: Option<String>,
    pub(crate) preconditions: Vec<String>,
}

/// A checked `outcome` payload that names a skill.
pub(crate) struct Outcome {
    pub(crate) skill: String,
    pub(crate) success: bool,
    pub(crate) version: Option<u32>,
}

/// Reads one event's payload and turns problems into [`SkillError`]s naming the field.
struct Reader<'a> {
    seq: Seq,
    event: &'a Envelope,
    data: &'a Map<String, Value>,
}

impl<'a> Reader<'a> {
    fn new(seq: Seq, event: &'a Envelope) -> Result<Self, SkillError> {
        match &event.content.data {
            Some(Value::Object(data)) => Ok(Self { seq, event, data }),
            _ => Err(SkillError::MissingData {
                seq,
                event_id: event.event_id.clone(),
                kind: event.kind,
            }),
        }
    }

    fn invalid(&self, field: &'static str, reason: impl Into<String>) -> SkillError {
        SkillError::InvalidField {
            seq: self.seq,
            event_id: self.event.event_id.clone(),
            kind: self.event.kind,
            field,
            reason: reason.into(),
        }
    }

    /// An explicit `null` counts as absent, so clients may always send every key.
    fn optional(&self, field: &str) -> Option<&'a Value> {
        self.data.get(field).filter(|value| !value.is_null())
    }

    fn string(&self, field: &'static str, value: &'a Value) -> Result<&'a str, SkillError> {
        value.as_str().ok_or_else(|| {
            self.invalid(
                field,
                format!("expected a string, found {}", kind_of(value)),
            )
        })
    }

    fn name(&self, field: &'static str, value: &'a Value) -> Result<String, SkillError> {
        let name = self.string(field, value)?.trim();
        if name.is_empty() {
            return Err(self.invalid(field, "it is empty after trimming whitespace"));
        }
        let chars = name.chars().count();
        if chars > MAX_NAME_CHARS {
            return Err(self.invalid(
                field,
                format!("it has {chars} characters, at most {MAX_NAME_CHARS} are allowed"),
            ));
        }
        Ok(name.to_owned())
    }

    fn required_name(&self, field: &'static str) -> Result<String, SkillError> {
        let value = self
            .optional(field)
            .ok_or_else(|| self.invalid(field, "it is missing; it must be a non-empty string"))?;
        self.name(field, value)
    }

    fn version(&self) -> Result<Option<u32>, SkillError> {
        let Some(value) = self.optional("version") else {
            return Ok(None);
        };
        match value.as_u64().map(u32::try_from) {
            Some(Ok(version)) if version >= 1 => Ok(Some(version)),
            _ => Err(self.invalid(
                "version",
                format!("{value} is not a whole number in 1..={}", u32::MAX),
            )),
        }
    }

    fn strings(&self, field: &'static str) -> Result<Vec<String>, SkillError> {
        let Some(value) = self.optional(field) else {
            return Ok(Vec::new());
        };
        let items = value.as_array().ok_or_else(|| {
            self.invalid(
                field,
                format!("expected an array of strings, found {}", kind_of(value)),
            )
        })?;
        items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                item.as_str().map(str::to_owned).ok_or_else(|| {
                    self.invalid(
                        field,
                        format!("item {i} is {}, not a string", kind_of(item)),
                    )
                })
            })
            .collect()
    }
}

pub(crate) fn recording(seq: Seq, event: &Envelope) -> Result<Recording, SkillError> {
    let reader = Reader::new(seq, event)?;
    let name = reader.required_name("name")?;
    let version = reader.version()?;
    let description = reader
        .optional("description")
        .ok_or_else(|| reader.invalid("description", "it is missing; say what the skill does"))
        .and_then(|value| reader.string("description", value))?
        .trim()
        .to_owned();
    if description.is_empty() {
        return Err(reader.invalid(
            "description",
            "it is empty; say what the skill does, search depends on it",
        ));
    }
    let script = reader
        .optional("script")
        .map(|value| reader.string("script", value).map(str::to_owned))
        .transpose()?;
    Ok(Recording {
        name,
        version,
        description,
        steps: reader.strings("steps")?,
        script,
        preconditions: reader.strings("preconditions")?,
    })
}

/// `Ok(None)` for an outcome that names no skill: it is about something else.
pub(crate) fn outcome(seq: Seq, event: &Envelope) -> Result<Option<Outcome>, SkillError> {
    let Ok(reader) = Reader::new(seq, event) else {
        return Ok(None);
    };
    let Some(skill) = reader.optional("skill") else {
        return Ok(None);
    };
    let skill = reader.name("skill", skill)?;
    let success = match reader.optional("success") {
        Some(Value::Bool(success)) => *success,
        Some(value) => {
            return Err(reader.invalid(
                "success",
                format!("expected true or false, found {}", kind_of(value)),
            ));
        }
        None => {
            return Err(reader.invalid(
                "success",
                "it is missing; an outcome naming a skill must say whether it succeeded",
            ));
        }
    };
    Ok(Some(Outcome {
        skill,
        success,
        version: reader.version()?,
    }))
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

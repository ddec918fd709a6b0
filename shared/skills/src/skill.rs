//! The rows of the skill registry.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use engram_memory::ScopeKey;
use engram_memory::model::Provenance;
use engram_schema::ObservedOutcomes;
use serde::{Deserialize, Serialize};

/// One recorded version of a skill, with the outcomes counted for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skill {
    pub scope: ScopeKey,
    /// Trimmed; case matters.
    pub name: String,
    pub version: u32,
    pub description: String,
    pub steps: Vec<String>,
    pub script: Option<String>,
    pub preconditions: Vec<String>,
    /// Outcomes reported for this version, and those its record says were observed before
    /// (`observed`). A record repeating an existing version number keeps zero: the first
    /// record of a version is the one outcomes count for.
    pub successes: u64,
    pub failures: u64,
    /// The latest `occurred_at` of the outcomes counted.
    pub last_used: Option<DateTime<Utc>>,
    /// The recording event's `recorded_at`.
    pub recorded_at: DateTime<Utc>,
    pub source: Provenance,
}

impl Skill {
    /// The success rate with a Laplace prior, `(successes + 1) / (successes + failures + 2)`:
    /// 0.5 for an untried skill, and never 0 or 1 from a handful of outcomes.
    pub fn success_rate(&self) -> f64 {
        (self.successes as f64 + 1.0) / ((self.successes + self.failures) as f64 + 2.0)
    }

    pub(crate) fn count(&mut self, usage: &Usage) {
        self.successes += usage.successes;
        self.failures += usage.failures;
        self.last_used = latest(self.last_used, usage.last_used);
    }
}

/// Outcome counts not yet attached to a recorded version.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub successes: u64,
    pub failures: u64,
    pub last_used: Option<DateTime<Utc>>,
}

impl Usage {
    pub(crate) fn count(&mut self, success: bool, at: DateTime<Utc>) {
        if success {
            self.successes += 1;
        } else {
            self.failures += 1;
        }
        self.last_used = latest(self.last_used, Some(at));
    }

    /// Outcomes seen before the skill was recorded (`skill_recorded`'s `observed`). They
    /// carry no time, so they leave `last_used` alone.
    pub(crate) fn observed(observed: ObservedOutcomes) -> Self {
        Self {
            successes: u64::from(observed.successes),
            failures: u64::from(observed.failures),
            last_used: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.successes == 0 && self.failures == 0
    }
}

/// Outcomes that named a skill before the version they count for was recorded. Events
/// from different instances arrive in any order, so they wait here instead of being lost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PendingOutcomes {
    /// Outcomes without a version, for a skill with no version recorded yet: they join the
    /// first version recorded.
    pub unversioned: Usage,
    /// Outcomes naming a version not recorded yet: they join it when it is.
    pub by_version: BTreeMap<u32, Usage>,
}

impl PendingOutcomes {
    pub fn is_empty(&self) -> bool {
        self.unversioned.is_empty() && self.by_version.is_empty()
    }
}

fn latest(a: Option<DateTime<Utc>>, b: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
    a.max(b)
}

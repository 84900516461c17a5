//! The crate's error types: [`SchedulerConfigError`] (building a scheduler) and [`ScheduleError`]
//! (one scheduling cycle).

use std::fmt;

/// One problem found in the scheduler config, with where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// 1-based line in the YAML (0 when the issue has no single location).
    pub line: u32,
    /// 1-based column.
    pub column: u32,
    /// What is wrong, naming the thing at fault.
    pub message: String,
}

impl fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            f.write_str(&self.message)
        } else {
            write!(
                f,
                "line {} column {}: {}",
                self.line, self.column, self.message
            )
        }
    }
}

/// Why a scheduler config was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedulerConfigError {
    /// The YAML does not have the config's shape; serde-saphyr's message names line and column.
    #[error("scheduler config: {0}")]
    Yaml(String),
    /// Validation found problems; every one is listed with its line.
    #[error("scheduler config: {}", join(.0))]
    Invalid(Vec<ConfigIssue>),
    /// A plugin constructor rejected a parameter value (located by the caller).
    #[error("parameter `{parameter}`: {reason}")]
    InvalidParameter {
        /// The parameter's YAML key.
        parameter: &'static str,
        /// Why the value is not acceptable.
        reason: String,
    },
}

impl SchedulerConfigError {
    /// The located issues (empty for [`SchedulerConfigError::Yaml`] and unlocated parameter
    /// errors).
    pub fn issues(&self) -> &[ConfigIssue] {
        match self {
            SchedulerConfigError::Invalid(v) => v,
            SchedulerConfigError::Yaml(_) | SchedulerConfigError::InvalidParameter { .. } => &[],
        }
    }
}

fn join(issues: &[ConfigIssue]) -> String {
    issues
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why a scheduling cycle produced no endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// The caller passed no candidate endpoints.
    #[error("no candidate endpoints")]
    NoCandidates,
    /// A filter removed the last candidates of a profile.
    #[error("profile `{profile}`: filter `{filter}` removed every candidate")]
    AllFiltered {
        /// The profile.
        profile: String,
        /// The filter that removed the last candidates.
        filter: String,
    },
    /// The picker declined to pick.
    #[error("profile `{profile}`: picker `{picker}` picked nothing")]
    NoPick {
        /// The profile.
        profile: String,
        /// The picker.
        picker: String,
    },
    /// The profile handler ran no profile, or its primary profile failed.
    #[error("profile handler `{handler}`: no primary result")]
    NoPrimary {
        /// The handler's type.
        handler: &'static str,
    },
}

impl ScheduleError {
    /// A stable, low-cardinality label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            ScheduleError::NoCandidates => "no_candidates",
            ScheduleError::AllFiltered { .. } => "all_filtered",
            ScheduleError::NoPick { .. } => "no_pick",
            ScheduleError::NoPrimary { .. } => "no_primary",
        }
    }
}

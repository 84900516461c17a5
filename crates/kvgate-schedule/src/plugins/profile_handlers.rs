//! Built-in profile handlers, one per file.

pub mod pd_profile_handler;
pub mod single_profile_handler;

use crate::error::SchedulerConfigError;

/// Resolves a profile name to its index.
pub(crate) fn resolve(
    profiles: &[String],
    name: &str,
    parameter: &'static str,
) -> Result<usize, SchedulerConfigError> {
    profiles
        .iter()
        .position(|p| p == name)
        .ok_or_else(|| SchedulerConfigError::InvalidParameter {
            parameter,
            reason: format!(
                "no profile named `{name}` (profiles: {})",
                profiles.join(", ")
            ),
        })
}

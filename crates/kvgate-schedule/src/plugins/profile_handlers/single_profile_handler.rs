//! `single-profile-handler`: runs one profile; its pick is the primary result.
//!
//! Parameters:
//! - `profile` (default: the first profile in the config): the profile to run.
//!
//! Signals: none. When the profile fails the cycle fails.
//!
//! Example:
//! ```yaml
//! scheduling:
//!   profile_handler:
//!     type: single-profile-handler
//!     parameters: { profile: default }
//! ```

use serde::Deserialize;

use super::resolve;
use crate::cycle::CycleState;
use crate::error::SchedulerConfigError;
use crate::framework::{HandlerResult, ProfileHandler, ProfileRunSummary};
use crate::plugins::{Registration, build};

/// Parameters of `single-profile-handler`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SingleProfileHandlerConfig {
    /// Profile to run (`None`: the first one).
    pub profile: Option<String>,
}

/// Runs one profile.
#[derive(Debug)]
pub struct SingleProfileHandler {
    profile: usize,
}

impl SingleProfileHandler {
    /// YAML type name.
    pub const TYPE: &'static str = "single-profile-handler";

    /// Builds the handler over the configured profile names.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when `profile` names no profile or there is none.
    pub fn new(
        config: SingleProfileHandlerConfig,
        profiles: &[String],
    ) -> Result<SingleProfileHandler, SchedulerConfigError> {
        let profile = match &config.profile {
            Some(name) => resolve(profiles, name, "profile")?,
            None if profiles.is_empty() => {
                return Err(SchedulerConfigError::InvalidParameter {
                    parameter: "profile",
                    reason: "no profiles are configured".into(),
                });
            }
            None => 0,
        };
        Ok(SingleProfileHandler { profile })
    }
}

impl ProfileHandler for SingleProfileHandler {
    fn next_profile(&self, _cycle: &CycleState, runs: &[ProfileRunSummary]) -> Option<usize> {
        runs.is_empty().then_some(self.profile)
    }

    fn finish(&self, _cycle: &CycleState, runs: &[ProfileRunSummary]) -> Option<HandlerResult> {
        runs.first().filter(|r| r.picked).map(|_| HandlerResult {
            primary: 0,
            headers: Vec::new(),
            kind: "single",
        })
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: SingleProfileHandler::TYPE,
    description: "runs one profile; its pick receives the request",
    example: "{ profile: default }",
    build: |p, h| build(p, |c| SingleProfileHandler::new(c, h.profiles)),
};

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::cycle::RequestFacts;

    #[test]
    fn runs_once() {
        let names = ["a".to_owned(), "b".to_owned()];
        let h = SingleProfileHandler::new(
            SingleProfileHandlerConfig {
                profile: Some("b".into()),
            },
            &names,
        )
        .unwrap();
        let c = CycleState::new(RequestFacts::default(), Instant::now());
        assert_eq!(h.next_profile(&c, &[]), Some(1));
        let run = |picked| ProfileRunSummary {
            profile: 1,
            picked,
            predicted_cached_tokens: 0,
            endpoint: None,
        };
        assert_eq!(h.next_profile(&c, &[run(true)]), None);
        assert_eq!(h.finish(&c, &[run(true)]).map(|r| r.primary), Some(0));
        assert_eq!(h.finish(&c, &[run(false)]), None);
        let unknown = SingleProfileHandlerConfig {
            profile: Some("zz".into()),
        };
        crate::test_util::assert_error_names(
            SingleProfileHandler::new(unknown, &names),
            &["profile", "zz"],
        );
        crate::test_util::assert_error_names(
            SingleProfileHandler::new(SingleProfileHandlerConfig::default(), &[]),
            &["profile", "no profiles"],
        );
    }
}

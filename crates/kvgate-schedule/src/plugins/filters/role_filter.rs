//! `role-filter`: keeps endpoints that can play one P/D role.
//!
//! The role comes from the endpoint label `llm-d.ai/role`: `prefill` keeps `prefill`,
//! `encode-prefill`, `both`, `prefill-decode`, `encode-prefill-decode`; `decode` keeps `decode`,
//! `both`, `prefill-decode`, `encode-prefill-decode` and unlabelled endpoints (llm-d's rule).
//!
//! Parameters:
//! - `role` (default `decode`): `prefill` or `decode`.
//!
//! Signal: endpoint labels only; a missing label means "unlabelled" (decode-capable).
//!
//! Example:
//! ```yaml
//! - type: role-filter
//!   parameters: { role: prefill }
//! ```

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::Filter;
use crate::plugins::{Registration, build};

/// The role a `role-filter` selects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleSelector {
    /// Endpoints that can run prefill.
    Prefill,
    /// Endpoints that can decode.
    #[default]
    Decode,
}

/// Parameters of `role-filter`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoleFilterConfig {
    /// The role to keep.
    pub role: RoleSelector,
}

/// Keeps endpoints of one role.
#[derive(Debug)]
pub struct RoleFilter {
    role: RoleSelector,
}

impl RoleFilter {
    /// YAML type name.
    pub const TYPE: &'static str = "role-filter";

    /// Builds the filter.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(config: RoleFilterConfig) -> Result<RoleFilter, SchedulerConfigError> {
        Ok(RoleFilter { role: config.role })
    }
}

impl Filter for RoleFilter {
    fn filter(&self, _cycle: &CycleState, candidates: &[&EndpointState], keep: &mut [bool]) {
        for (k, e) in keep.iter_mut().zip(candidates) {
            *k = match self.role {
                RoleSelector::Prefill => e.role().can_prefill(),
                RoleSelector::Decode => e.role().can_decode(),
            };
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: RoleFilter::TYPE,
    description: "keeps endpoints that can prefill or decode, by the llm-d.ai/role label",
    example: "{ role: prefill }",
    build: |p, _| build(p, RoleFilter::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::ROLE_LABEL;
    use crate::test_util::{ep, facts, run_filter};

    #[test]
    fn table() {
        let eps = || {
            vec![
                ep("p:1").label(ROLE_LABEL, "prefill"),
                ep("d:1").label(ROLE_LABEL, "decode"),
                ep("b:1").label(ROLE_LABEL, "prefill-decode"),
                ep("u:1"),
            ]
        };
        let cases = [
            (RoleSelector::Prefill, vec!["p:1", "b:1"]),
            (RoleSelector::Decode, vec!["d:1", "b:1", "u:1"]),
        ];
        for (role, want) in cases {
            let f = RoleFilter::new(RoleFilterConfig { role }).unwrap();
            assert_eq!(run_filter(&f, &eps(), facts()), want, "{role:?}");
        }
    }
}

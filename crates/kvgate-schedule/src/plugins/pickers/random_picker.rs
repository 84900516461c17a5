//! `random-picker`: picks a candidate uniformly at random, ignoring scores.
//!
//! No parameters. Signals: none (a baseline and a tool for load spreading tests).
//!
//! Example:
//! ```yaml
//! - type: random-picker
//!   parameters: {}
//! ```

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::error::SchedulerConfigError;
use crate::framework::Picker;
use crate::plugins::{Registration, build};

/// Parameters of `random-picker` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RandomPickerConfig {}

/// Uniform random pick.
#[derive(Debug)]
pub struct RandomPicker {}

impl RandomPicker {
    /// YAML type name.
    pub const TYPE: &'static str = "random-picker";

    /// Builds the picker.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(_config: RandomPickerConfig) -> Result<RandomPicker, SchedulerConfigError> {
        Ok(RandomPicker {})
    }
}

impl Picker for RandomPicker {
    fn pick(&self, cycle: &mut CycleState, totals: &[f64]) -> Option<usize> {
        if totals.is_empty() {
            return None;
        }
        Some(cycle.random_index(totals.len()))
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: RandomPicker::TYPE,
    description: "picks uniformly at random, ignoring scores",
    example: "{}",
    build: |p, _| build(p, RandomPicker::new),
};

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::cycle::RequestFacts;

    #[test]
    fn covers_every_candidate_and_handles_empty() {
        let p = RandomPicker::new(RandomPickerConfig::default()).unwrap();
        let mut c = CycleState::new(RequestFacts::default(), Instant::now());
        let mut hits = [0; 3];
        for _ in 0..300 {
            hits[p.pick(&mut c, &[9.0, 0.0, 0.0]).unwrap()] += 1;
        }
        assert!(hits.iter().all(|h| *h > 50), "{hits:?}");
        assert_eq!(p.pick(&mut c, &[]), None);
    }
}

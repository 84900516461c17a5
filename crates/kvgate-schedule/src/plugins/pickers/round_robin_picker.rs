//! `round-robin-picker`: picks candidates in turn, ignoring scores.
//!
//! No parameters. Signals: none (the baseline every cache-aware policy is compared with).
//! The cursor is shared by every request of the scheduler; with a stable candidate list each
//! candidate receives every N-th request.
//!
//! Example:
//! ```yaml
//! - type: round-robin-picker
//!   parameters: {}
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::error::SchedulerConfigError;
use crate::framework::Picker;
use crate::plugins::{Registration, build};

/// Parameters of `round-robin-picker` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoundRobinPickerConfig {}

/// Picks candidate `cursor % len`, then advances the cursor.
#[derive(Debug, Default)]
pub struct RoundRobinPicker {
    cursor: AtomicUsize,
}

impl RoundRobinPicker {
    /// YAML type name.
    pub const TYPE: &'static str = "round-robin-picker";

    /// Builds the picker.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(_config: RoundRobinPickerConfig) -> Result<RoundRobinPicker, SchedulerConfigError> {
        Ok(RoundRobinPicker::default())
    }
}

impl Picker for RoundRobinPicker {
    fn pick(&self, _cycle: &mut CycleState, totals: &[f64]) -> Option<usize> {
        if totals.is_empty() {
            return None;
        }
        Some(self.cursor.fetch_add(1, Ordering::Relaxed) % totals.len())
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: RoundRobinPicker::TYPE,
    description: "picks candidates in turn, ignoring scores",
    example: "{}",
    build: |p, _| build(p, RoundRobinPicker::new),
};

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::cycle::RequestFacts;

    /// Name, candidate totals, and the picks of successive calls.
    type Case = (&'static str, &'static [f64], &'static [Option<usize>]);

    #[test]
    fn cycles_through_candidates_ignoring_scores() {
        let cases: &[Case] = &[
            ("empty", &[], &[None, None]),
            ("one", &[5.0], &[Some(0), Some(0), Some(0)]),
            (
                "three, best first",
                &[9.0, 0.0, 0.0],
                &[Some(0), Some(1), Some(2), Some(0), Some(1)],
            ),
        ];
        for (name, totals, want) in cases {
            let p = RoundRobinPicker::new(RoundRobinPickerConfig::default()).unwrap();
            let mut c = CycleState::new(RequestFacts::default(), Instant::now());
            let got: Vec<_> = want.iter().map(|_| p.pick(&mut c, totals)).collect();
            assert_eq!(&got, want, "{name}");
        }
    }
}

//! `max-score-picker`: picks the candidate with the highest total score; ties are broken
//! uniformly at random.
//!
//! No parameters. Signal: the weighted totals only. NaN totals never win.
//!
//! Example:
//! ```yaml
//! - type: max-score-picker
//!   parameters: {}
//! ```

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::error::ConfigError;
use crate::framework::Picker;
use crate::plugins::{Built, Registration, params};

/// Parameters of `max-score-picker` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MaxScorePickerConfig {}

/// Picks the best total, random among ties.
#[derive(Debug)]
pub struct MaxScorePicker {}

impl MaxScorePicker {
    /// YAML type name.
    pub const TYPE: &'static str = "max-score-picker";

    /// Builds the picker.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(_config: MaxScorePickerConfig) -> Result<MaxScorePicker, ConfigError> {
        Ok(MaxScorePicker {})
    }
}

impl Picker for MaxScorePicker {
    fn pick(&self, cycle: &mut CycleState, totals: &[f64]) -> Option<usize> {
        let best = totals
            .iter()
            .copied()
            .filter(|t| !t.is_nan())
            .fold(f64::NEG_INFINITY, f64::max);
        let ties = totals.iter().filter(|t| **t == best).count();
        if ties == 0 {
            return (!totals.is_empty()).then_some(0);
        }
        let nth = if ties == 1 {
            0
        } else {
            (cycle.next_random() % ties as u64) as usize
        };
        totals
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == best)
            .nth(nth)
            .map(|(i, _)| i)
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: MaxScorePicker::TYPE,
    description: "picks the highest total score, random among ties",
    example: "{}",
    build: |p, _| {
        Ok(Built::Picker(std::sync::Arc::new(MaxScorePicker::new(
            params(p)?,
        )?)))
    },
};

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Instant;

    use super::*;
    use crate::cycle::RequestFacts;

    #[test]
    fn table() {
        let p = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
        let cases: Vec<(&str, Vec<f64>, Vec<usize>)> = vec![
            ("single best", vec![0.1, 2.0, 1.0], vec![1]),
            ("tie", vec![2.0, 1.0, 2.0], vec![0, 2]),
            ("nan ignored", vec![f64::NAN, 0.5], vec![1]),
            ("all nan", vec![f64::NAN], vec![0]),
            ("empty", vec![], vec![]),
        ];
        for (name, totals, want) in cases {
            let mut seen = HashSet::new();
            for i in 0..64 {
                let mut c = CycleState::new(
                    RequestFacts {
                        request_id: format!("r{i}"),
                        ..Default::default()
                    },
                    Instant::now(),
                );
                if let Some(x) = p.pick(&mut c, &totals) {
                    seen.insert(x);
                }
            }
            let mut seen: Vec<usize> = seen.into_iter().collect();
            seen.sort_unstable();
            assert_eq!(seen, want, "{name}");
        }
    }
}

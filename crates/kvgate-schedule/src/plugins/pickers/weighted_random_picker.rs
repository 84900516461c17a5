//! `weighted-random-picker`: picks at random with probability proportional to the total score
//! (A-Res reservoir sampling: the largest `u^(1/score)` wins).
//!
//! Candidates with a total ≤ 0 (or NaN) are only picked when every total is ≤ 0, then
//! uniformly. No parameters. Signal: the weighted totals only.
//!
//! Example:
//! ```yaml
//! - type: weighted-random-picker
//!   parameters: {}
//! ```

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::error::SchedulerConfigError;
use crate::framework::Picker;
use crate::plugins::{Registration, build};

/// Parameters of `weighted-random-picker` (none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WeightedRandomPickerConfig {}

/// Score-proportional random pick.
#[derive(Debug)]
pub struct WeightedRandomPicker {}

impl WeightedRandomPicker {
    /// YAML type name.
    pub const TYPE: &'static str = "weighted-random-picker";

    /// Builds the picker.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(
        _config: WeightedRandomPickerConfig,
    ) -> Result<WeightedRandomPicker, SchedulerConfigError> {
        Ok(WeightedRandomPicker {})
    }
}

impl Picker for WeightedRandomPicker {
    fn pick(&self, cycle: &mut CycleState, totals: &[f64]) -> Option<usize> {
        if totals.is_empty() {
            return None;
        }
        let mut best: Option<(usize, f64)> = None;
        for (i, t) in totals.iter().enumerate() {
            if *t > 0.0 {
                let key = cycle.next_unit().max(f64::MIN_POSITIVE).powf(1.0 / t);
                if best.is_none_or(|(_, b)| key > b) {
                    best = Some((i, key));
                }
            }
        }
        match best {
            Some((i, _)) => Some(i),
            None => Some(cycle.random_index(totals.len())),
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: WeightedRandomPicker::TYPE,
    description: "picks at random in proportion to the total score",
    example: "{}",
    build: |p, _| build(p, WeightedRandomPicker::new),
};

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::cycle::RequestFacts;

    #[test]
    fn table() {
        let p = WeightedRandomPicker::new(WeightedRandomPickerConfig::default()).unwrap();
        type Row = (&'static str, Vec<f64>, Vec<(f64, f64)>);
        let cases: Vec<Row> = vec![
            ("proportional", vec![3.0, 1.0], vec![(0.7, 0.8), (0.2, 0.3)]),
            (
                "zero never wins",
                vec![1.0, 0.0],
                vec![(1.0, 1.0), (0.0, 0.0)],
            ),
            (
                "all zero: uniform",
                vec![0.0, 0.0],
                vec![(0.4, 0.6), (0.4, 0.6)],
            ),
            (
                "nan never wins",
                vec![f64::NAN, 1.0],
                vec![(0.0, 0.0), (1.0, 1.0)],
            ),
        ];
        for (name, totals, bounds) in cases {
            let mut c = CycleState::new(RequestFacts::default(), Instant::now());
            let mut hits = vec![0usize; totals.len()];
            let n = 4000;
            for _ in 0..n {
                hits[p.pick(&mut c, &totals).unwrap()] += 1;
            }
            for (i, (lo, hi)) in bounds.iter().enumerate() {
                let share = hits[i] as f64 / n as f64;
                assert!(
                    share >= *lo && share <= *hi,
                    "{name}: candidate {i} share {share}"
                );
            }
        }
        let mut c = CycleState::new(RequestFacts::default(), Instant::now());
        assert_eq!(p.pick(&mut c, &[]), None);
    }
}

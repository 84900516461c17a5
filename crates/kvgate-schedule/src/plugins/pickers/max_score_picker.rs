//! `max-score-picker`: picks the candidate with the highest total score. Ties are broken by
//! the tie-break keys a scorer recorded for the run ([`crate::CycleState::record_tie_break`],
//! lowest key first: the cost scorer records fewest decode tokens, then least recently
//! picked). Among candidates whose keys are equal too, the prompt's first block key picks
//! (when a prefix scorer computed block keys), so router replicas that see the same tie
//! choose the same engine for the same prefix; without keys, uniformly at random.
//!
//! No parameters. Signal: the weighted totals only. NaN totals never win.
//!
//! Example:
//! ```yaml
//! - type: max-score-picker
//!   parameters: {}
//! ```

use serde::Deserialize;
use smallvec::SmallVec;

use crate::cycle::CycleState;
use crate::error::SchedulerConfigError;
use crate::framework::Picker;
use crate::plugins::{Registration, build};

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
    pub fn new(_config: MaxScorePickerConfig) -> Result<MaxScorePicker, SchedulerConfigError> {
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
        // On the stack for up to 16 tied candidates: no allocation a cycle.
        let mut tied: SmallVec<[usize; 16]> =
            (0..totals.len()).filter(|i| totals[*i] == best).collect();
        if tied.is_empty() {
            return (!totals.is_empty()).then_some(0);
        }
        if let Some(keys) = cycle.tie_break().filter(|k| k.len() == totals.len())
            && tied.len() > 1
        {
            let min = tied.iter().map(|i| keys[*i]).min();
            tied.retain(|i| Some(keys[*i]) == min);
        }
        // Still tied: the prompt's first block decides when it is known, so independent
        // router replicas choose the same engine for the same prefix; else at random.
        let nth = if tied.len() == 1 {
            0
        } else {
            let draw = cycle
                .first_block_key()
                .unwrap_or_else(|| cycle.next_random());
            (draw % tied.len() as u64) as usize
        };
        tied.get(nth).copied()
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: MaxScorePicker::TYPE,
    description: "picks the highest total score; ties by recorded tie-break keys, then at random",
    example: "{}",
    build: |p, _| build(p, MaxScorePicker::new),
};

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Instant;

    use super::*;
    use crate::cycle::RequestFacts;

    /// The distinct picks over 64 cycles with different request ids (and no tokens, so the
    /// last tie-break is random), sorted.
    fn picks(p: &MaxScorePicker, totals: &[f64], keys: Option<&[(u64, u64, u64)]>) -> Vec<usize> {
        let mut seen = HashSet::new();
        for i in 0..64 {
            let mut c = CycleState::new(
                RequestFacts {
                    request_id: format!("r{i}").into(),
                    ..Default::default()
                },
                Instant::now(),
            );
            if let Some(k) = keys {
                c.record_tie_break(k.to_vec());
            }
            if let Some(x) = p.pick(&mut c, totals) {
                seen.insert(x);
            }
        }
        let mut seen: Vec<usize> = seen.into_iter().collect();
        seen.sort_unstable();
        seen
    }

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
            assert_eq!(picks(&p, &totals, None), want, "{name}");
        }
    }

    #[test]
    fn tie_break_keys_order_equal_totals() {
        type Row = (
            &'static str,
            Vec<f64>,
            Option<Vec<(u64, u64, u64)>>,
            Vec<usize>,
        );
        let p = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
        let cases: Vec<Row> = vec![
            (
                "no keys: random among ties",
                vec![1.0, 1.0, 0.5],
                None,
                vec![0, 1],
            ),
            (
                "first key decides",
                vec![1.0, 1.0, 0.5],
                Some(vec![(4, 0, 0), (2, 9, 9), (0, 0, 0)]),
                vec![1],
            ),
            (
                "second key decides",
                vec![1.0, 1.0, 0.5],
                Some(vec![(0, 5, 0), (0, 3, 9), (0, 0, 0)]),
                vec![1],
            ),
            (
                "third key decides",
                vec![1.0, 1.0, 0.5],
                Some(vec![(0, 3, 7), (0, 3, 2), (0, 0, 0)]),
                vec![1],
            ),
            (
                "equal keys: random",
                vec![1.0, 1.0],
                Some(vec![(0, 3, 2), (0, 3, 2)]),
                vec![0, 1],
            ),
            (
                "keys never beat a higher total",
                vec![0.9, 1.0],
                Some(vec![(0, 0, 0), (0, 9, 9)]),
                vec![1],
            ),
            (
                "keys of the wrong length ignored",
                vec![1.0, 1.0],
                Some(vec![(0, 0, 0)]),
                vec![0, 1],
            ),
        ];
        for (name, totals, keys, want) in cases {
            assert_eq!(picks(&p, &totals, keys.as_deref()), want, "{name}");
        }
    }

    /// Ties left after the keys go by the prompt's first block: the same prefix, the same pick.
    #[test]
    fn remaining_ties_follow_the_first_block() {
        let p = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
        let pick = |seed: u32, request: &str| {
            let facts = RequestFacts {
                request_id: request.into(),
                model: "m".into(),
                ..Default::default()
            }
            .with_tokens((seed..seed + 32).collect::<Vec<u32>>(), true, vec![]);
            let mut c = CycleState::new(facts, Instant::now());
            let _ = c.block_keys(16);
            p.pick(&mut c, &[1.0, 1.0, 1.0, 1.0])
        };
        let mut seen = HashSet::new();
        for seed in 0..16 {
            let first = pick(seed * 1000, "a");
            assert_eq!(
                first,
                pick(seed * 1000, "b"),
                "same prefix, other request: same pick"
            );
            seen.insert(first);
        }
        assert!(seen.len() > 1, "different prefixes spread: {seen:?}");
    }
}

//! Built-in scorers, one per file, and the normalization helpers they share.

pub mod active_request_scorer;
pub mod approx_prefix_cache_scorer;
pub mod kv_cache_utilization_scorer;
pub mod lora_affinity_scorer;
pub mod no_hit_lru_scorer;
pub mod precise_prefix_cache_scorer;
pub mod prefill_cost_scorer;
pub mod queue_scorer;
pub mod running_requests_scorer;
pub mod session_affinity_scorer;
pub mod token_load_scorer;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::framework::{ScoreOutcome, SkipReason};
use crate::prom::EngineMetrics;

/// Each candidate's value of one scraped engine metric; `None` where the metrics are stale or
/// missing, or lack the value.
pub(crate) fn fresh_metric(
    cycle: &CycleState,
    candidates: &[&EndpointState],
    metric: impl Fn(&EngineMetrics) -> Option<f64>,
) -> Vec<Option<f64>> {
    let now = cycle.now();
    candidates
        .iter()
        .map(|e| e.with_metrics(now, |m| m.fresh().and_then(&metric)))
        .collect()
}

/// The values as scores; `None` (no usable signal) scores 0. When no candidate has a value
/// the scorer is skipped with [`SkipReason::NoSignal`].
pub(crate) fn as_scores(values: &[Option<f64>], out: &mut [f64]) -> ScoreOutcome {
    if values.iter().all(Option::is_none) {
        return ScoreOutcome::Skipped(SkipReason::NoSignal);
    }
    for (o, v) in out.iter_mut().zip(values) {
        *o = v.unwrap_or(0.0);
    }
    ScoreOutcome::Scored
}

/// Min-max normalization where lower is better: the lowest value scores 1, the highest 0, all
/// equal score 1. `None` (no usable signal) scores 0 and does not widen the range. When no
/// candidate has a value the scorer is skipped with [`SkipReason::NoSignal`].
pub(crate) fn lower_is_better(values: &[Option<f64>], out: &mut [f64]) -> ScoreOutcome {
    let known = values.iter().flatten().copied();
    let (min, max) = known.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if min > max {
        return ScoreOutcome::Skipped(SkipReason::NoSignal);
    }
    let range = max - min;
    for (o, v) in out.iter_mut().zip(values) {
        *o = match v {
            None => 0.0,
            Some(_) if range <= 0.0 => 1.0,
            Some(v) => (max - v) / range,
        };
    }
    ScoreOutcome::Scored
}

/// Scores candidates by their longest cached prefix in `index`, for the candidates `include`
/// accepts (others score 0). Groups candidates by their index block size (one group in
/// practice), computes each group's block keys once through the cycle, and records the
/// [`crate::PrefixMatch`]. `matched` receives each candidate's predicted cached tokens.
pub(crate) fn score_prefix(
    index: &kvgate_kvcache::KvIndex,
    cycle: &mut crate::cycle::CycleState,
    candidates: &[&crate::endpoint::EndpointState],
    include: impl Fn(&crate::endpoint::EndpointState) -> bool,
    source: crate::cycle::PrefixSource,
    scores: &mut [f64],
    matched: &mut [u64],
) -> ScoreOutcome {
    let mut sizes: Vec<u32> = candidates
        .iter()
        .filter(|e| include(e))
        .map(|e| e.index_block_size())
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.is_empty() {
        return ScoreOutcome::Skipped(SkipReason::NoSignal);
    }
    let mut any_blocks = false;
    let mut ids = Vec::with_capacity(candidates.len());
    for bs in sizes {
        let Some(keys) = cycle.block_keys(bs) else {
            return ScoreOutcome::Skipped(SkipReason::NoTokens);
        };
        if keys.is_empty() {
            continue;
        }
        any_blocks = true;
        ids.clear();
        ids.extend(
            candidates
                .iter()
                .filter(|e| include(e) && e.index_block_size() == bs)
                .map(|e| e.kv_id()),
        );
        // A whole prompt is predicted as its engine will count it (hybrid models' groups);
        // a prefix tokenized so far, as the prefix match it is.
        let ps = match cycle.facts().whole_prompt_tokens() {
            Some(n) => index.score_prompt(&keys, &ids, n),
            None => index.score(&keys, &ids),
        };
        for ((s, m), e) in scores.iter_mut().zip(matched.iter_mut()).zip(candidates) {
            if include(e) && e.index_block_size() == bs {
                *s = ps.score_of(e.kv_id());
                *m = ps.predicted_tokens_of(e.kv_id());
            }
        }
    }
    if !any_blocks {
        return ScoreOutcome::Skipped(SkipReason::NoFullBlock);
    }
    cycle.record_prefix_match(crate::cycle::PrefixMatch {
        source,
        predicted: candidates
            .iter()
            .zip(matched.iter())
            .map(|(e, m)| (e.kv_id(), *m))
            .collect(),
    });
    ScoreOutcome::Scored
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{Fresh, ep, facts, setup};

    #[test]
    fn fresh_metric_reads_only_fresh_values() {
        let eps = [
            ep("fresh:1").waiting(3.0),
            ep("stale:1").waiting(3.0).fresh(Fresh::Stale),
            ep("missing:1").waiting(3.0).fresh(Fresh::Missing),
            ep("absent:1").running(3.0),
        ];
        let (built, cycle) = setup(&eps, facts());
        let view: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
        let got = fresh_metric(&cycle, &view, |m| m.waiting);
        assert_eq!(got, vec![Some(3.0), None, None, None]);
    }

    #[test]
    fn as_given() {
        let mut out = vec![9.0; 2];
        assert_eq!(
            as_scores(&[Some(0.5), None], &mut out),
            ScoreOutcome::Scored
        );
        assert_eq!(out, vec![0.5, 0.0]);
        assert_eq!(
            as_scores(&[None, None], &mut out),
            ScoreOutcome::Skipped(SkipReason::NoSignal)
        );
    }

    #[test]
    fn min_max() {
        type Row = (&'static str, Vec<Option<f64>>, Result<Vec<f64>, SkipReason>);
        let cases: Vec<Row> = vec![
            (
                "spread",
                vec![Some(0.0), Some(5.0), Some(10.0)],
                Ok(vec![1.0, 0.5, 0.0]),
            ),
            ("all equal", vec![Some(3.0), Some(3.0)], Ok(vec![1.0, 1.0])),
            (
                "one missing",
                vec![Some(3.0), None, Some(1.0)],
                Ok(vec![0.0, 0.0, 1.0]),
            ),
            ("all missing", vec![None, None], Err(SkipReason::NoSignal)),
        ];
        for (name, input, want) in cases {
            let mut out = vec![0.0; input.len()];
            let got = match lower_is_better(&input, &mut out) {
                ScoreOutcome::Scored => Ok(out),
                ScoreOutcome::Skipped(r) => Err(r),
            };
            assert_eq!(got, want, "{name}");
        }
    }
}

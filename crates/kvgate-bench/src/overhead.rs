//! The router's added latency: one workload, same arrival schedule, sent once straight to
//! an engine and once through the router.
//!
//! Reports the difference of the TTFT and E2E percentiles (routed minus direct), and the
//! distribution of per-request differences, pairing requests by workload index (only
//! pairs where both requests succeeded).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::{Percentiles, RequestRecord, RunResult};

/// Percentiles of one metric, direct and routed, and their differences.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyDelta {
    /// Direct to the engine.
    pub direct: Percentiles,
    /// Through the router.
    pub routed: Percentiles,
    /// `routed.p50 - direct.p50`, in ms.
    pub p50_diff_ms: f64,
    /// `routed.p99 - direct.p99`, in ms.
    pub p99_diff_ms: f64,
    /// Per-request `routed - direct` differences, paired by index.
    pub paired_diff: Percentiles,
}

/// The overhead report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Overhead {
    /// The direct run's name.
    pub direct: String,
    /// The routed run's name.
    pub routed: String,
    /// Requests that succeeded in both runs.
    pub pairs: usize,
    /// Time to first token.
    pub ttft: LatencyDelta,
    /// End-to-end latency.
    pub e2e: LatencyDelta,
}

impl Overhead {
    /// Compares `routed` against `direct`.
    pub fn of(direct: &RunResult, routed: &RunResult) -> Self {
        let (d, r) = (ok(direct), ok(routed));
        let mut pairs: Vec<(&RequestRecord, &RequestRecord)> = d
            .iter()
            .filter_map(|(i, a)| r.get(i).map(|b| (*a, *b)))
            .collect();
        pairs.sort_by_key(|(a, _)| a.index);
        let delta = |metric: fn(&RequestRecord) -> Option<f64>| {
            let direct = Percentiles::of(d.values().filter_map(|x| metric(x)).collect());
            let routed = Percentiles::of(r.values().filter_map(|x| metric(x)).collect());
            let paired = pairs
                .iter()
                .filter_map(|(a, b)| Some(metric(b)? - metric(a)?))
                .collect();
            LatencyDelta {
                direct,
                routed,
                p50_diff_ms: routed.p50 - direct.p50,
                p99_diff_ms: routed.p99 - direct.p99,
                paired_diff: Percentiles::of(paired),
            }
        };
        Self {
            direct: direct.target.name.clone(),
            routed: routed.target.name.clone(),
            pairs: pairs.len(),
            ttft: delta(|x| x.ttft_ms),
            e2e: delta(|x| Some(x.e2e_ms)),
        }
    }

    /// A markdown table of the differences.
    pub fn to_markdown(&self) -> String {
        let mut out = format!(
            "Router overhead: `{}` minus `{}` ({} paired requests), ms\n\n",
            self.routed, self.direct, self.pairs
        );
        out.push_str("| metric | direct p50 | routed p50 | Δp50 | direct p99 | routed p99 | Δp99 | paired Δ p50 | paired Δ p90 | paired Δ p99 |\n");
        out.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
        for (name, d) in [("TTFT", &self.ttft), ("E2E", &self.e2e)] {
            out.push_str(&format!(
                "| {name} | {:.3} | {:.3} | {:+.3} | {:.3} | {:.3} | {:+.3} | {:+.3} | {:+.3} | {:+.3} |\n",
                d.direct.p50,
                d.routed.p50,
                d.p50_diff_ms,
                d.direct.p99,
                d.routed.p99,
                d.p99_diff_ms,
                d.paired_diff.p50,
                d.paired_diff.p90,
                d.paired_diff.p99,
            ));
        }
        out
    }
}

fn ok(run: &RunResult) -> HashMap<usize, &RequestRecord> {
    run.records
        .iter()
        .filter(|x| x.is_ok())
        .map(|x| (x.index, x))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ErrorKind, Target};

    fn run(name: &str, ttfts: &[(usize, f64, bool)]) -> RunResult {
        RunResult {
            target: Target::new(name, "http://x"),
            workload: "w".into(),
            started_at_unix_ms: 0,
            records: ttfts
                .iter()
                .map(|&(index, ttft, ok)| RequestRecord {
                    index,
                    ttft_ms: Some(ttft),
                    e2e_ms: ttft * 2.0,
                    error: (!ok).then_some(ErrorKind::Timeout),
                    ..RequestRecord::default()
                })
                .collect(),
        }
    }

    #[test]
    fn pairs_by_index_and_skips_failures() {
        let direct = run(
            "engine",
            &[(0, 10.0, true), (1, 20.0, true), (2, 30.0, false)],
        );
        let routed = run(
            "router",
            &[(0, 10.5, true), (1, 21.0, true), (2, 5.0, true)],
        );
        let o = Overhead::of(&direct, &routed);
        assert_eq!(o.pairs, 2);
        assert_eq!((o.direct.as_str(), o.routed.as_str()), ("engine", "router"));
        assert_eq!(o.ttft.paired_diff.p50, 0.5);
        assert_eq!(o.ttft.paired_diff.p99, 1.0);
        assert_eq!(o.e2e.paired_diff.p99, 2.0);
        // Unpaired percentiles use every successful request of each run.
        assert_eq!(o.ttft.routed.count, 3);
        assert_eq!(o.ttft.p50_diff_ms, 10.5 - 10.0);
        assert!(o.to_markdown().contains("| TTFT |"));
    }
}

//! [`RunSummary`]: the numbers a run is judged by, computed from its records.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::RequestRecord;

/// Nearest-rank percentiles of a set of samples, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Number of samples.
    pub count: usize,
    /// Mean.
    pub mean: f64,
    /// 50th percentile.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Percentiles {
    /// Percentiles of `samples` (any order; NaNs are dropped). All zero when empty.
    pub fn of(mut samples: Vec<f64>) -> Self {
        samples.retain(|x| !x.is_nan());
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_by(f64::total_cmp);
        let mean = samples.iter().sum::<f64>() / samples.len() as f64;
        Self {
            count: samples.len(),
            mean,
            p50: quantile(&samples, 0.50),
            p90: quantile(&samples, 0.90),
            p99: quantile(&samples, 0.99),
            max: samples[samples.len() - 1],
        }
    }
}

/// The nearest-rank `q` quantile of sorted, non-empty `samples`.
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One run's summary.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Failures per kind (`connect`, `http_503`, `timeout`, …).
    pub errors_by_kind: BTreeMap<String, usize>,
    /// Sum of `prompt_tokens` over successful requests that reported usage.
    pub prompt_tokens: u64,
    /// Sum of `cached_tokens` over the same requests.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`; `None` when no request reported prompt tokens.
    pub hit_rate: Option<f64>,
    /// Time to first token of successful requests.
    pub ttft_ms: Percentiles,
    /// Gaps between content events, over all successful requests.
    pub itl_ms: Percentiles,
    /// End-to-end latency of successful requests.
    pub e2e_ms: Percentiles,
    /// From the run's start to the last response's end, in seconds.
    pub duration_s: f64,
    /// Successful requests per second.
    pub requests_per_s: f64,
    /// Output tokens per second (see [`RequestRecord::output_tokens`]).
    pub output_tokens_per_s: f64,
}

impl RunSummary {
    /// Summarizes `records`.
    pub fn of(records: &[RequestRecord]) -> Self {
        let mut summary = Self {
            requests: records.len(),
            ..Self::default()
        };
        let (mut ttft, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
        let mut output_tokens = 0u64;
        let mut ok = 0usize;
        for r in records {
            summary.duration_s = summary.duration_s.max((r.start_ms + r.e2e_ms) / 1000.0);
            if let Some(kind) = r.error {
                summary.errors += 1;
                *summary.errors_by_kind.entry(kind.to_string()).or_default() += 1;
                continue;
            }
            ok += 1;
            ttft.extend(r.ttft_ms);
            itl.extend_from_slice(&r.itl_ms);
            e2e.push(r.e2e_ms);
            output_tokens += r.output_tokens();
            if let Some(prompt) = r.prompt_tokens {
                summary.prompt_tokens += prompt;
                summary.cached_tokens += r.cached_tokens.unwrap_or(0);
            }
        }
        if summary.prompt_tokens > 0 {
            summary.hit_rate = Some(summary.cached_tokens as f64 / summary.prompt_tokens as f64);
        }
        summary.ttft_ms = Percentiles::of(ttft);
        summary.itl_ms = Percentiles::of(itl);
        summary.e2e_ms = Percentiles::of(e2e);
        if summary.duration_s > 0.0 {
            summary.requests_per_s = ok as f64 / summary.duration_s;
            summary.output_tokens_per_s = output_tokens as f64 / summary.duration_s;
        }
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn percentiles_nearest_rank() {
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        let cases = [
            ("empty", vec![], (0, 0.0, 0.0, 0.0)),
            ("one", vec![5.0], (1, 5.0, 5.0, 5.0)),
            ("1..=100", hundred, (100, 50.0, 90.0, 99.0)),
            (
                "unsorted with nan",
                vec![3.0, f64::NAN, 1.0, 2.0],
                (3, 2.0, 3.0, 3.0),
            ),
        ];
        for (name, samples, (count, p50, p90, p99)) in cases {
            let p = Percentiles::of(samples);
            assert_eq!(
                (p.count, p.p50, p.p90, p.p99),
                (count, p50, p90, p99),
                "{name}"
            );
        }
    }

    #[test]
    fn summary_counts_hits_errors_and_throughput() {
        let ok = |start_ms, prompt, cached| RequestRecord {
            start_ms,
            e2e_ms: 500.0,
            ttft_ms: Some(100.0),
            itl_ms: vec![10.0, 20.0],
            content_events: 3,
            prompt_tokens: Some(prompt),
            cached_tokens: cached,
            completion_tokens: Some(4),
            ..RequestRecord::default()
        };
        let records = vec![
            ok(0.0, 100, Some(50)),
            ok(500.0, 100, None),
            ok(1500.0, 200, Some(150)),
            RequestRecord {
                error: Some(ErrorKind::HttpStatus(503)),
                e2e_ms: 1.0,
                ..RequestRecord::default()
            },
        ];
        let s = RunSummary::of(&records);
        assert_eq!((s.requests, s.errors), (4, 1));
        assert_eq!(s.errors_by_kind.get("http_503"), Some(&1));
        assert_eq!((s.prompt_tokens, s.cached_tokens), (400, 200));
        assert_eq!(s.hit_rate, Some(0.5));
        assert_eq!(s.duration_s, 2.0);
        assert_eq!(s.requests_per_s, 1.5);
        assert_eq!(s.output_tokens_per_s, 6.0);
        assert_eq!(s.itl_ms.count, 6);
        assert_eq!(s.ttft_ms.p50, 100.0);
        assert_eq!(RunSummary::of(&[]).hit_rate, None);
    }
}

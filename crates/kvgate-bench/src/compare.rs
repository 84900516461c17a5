//! Comparing runs: ratios against the first run, and resetting engine caches between runs.
//!
//! `--compare` runs one seeded workload against each target in turn. Before each run it
//! POSTs to every `--reset` URL so that each target starts from cold engine caches; a
//! reset that fails stops the benchmark, because the comparison would be meaningless.

use http::Method;
use serde::{Deserialize, Serialize};

use crate::{BenchError, LoadClient, RunSummary, client::endpoint_uri};

/// The vLLM endpoint that drops an engine's prefix cache.
pub const RESET_PATH: &str = "/reset_prefix_cache";

/// One run's key numbers divided by the first run's (`None` when the base is zero or
/// missing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Ratios {
    /// Hit rate ratio.
    pub hit_rate: Option<f64>,
    /// TTFT p50 ratio (below 1 is faster).
    pub ttft_p50: Option<f64>,
    /// TTFT p99 ratio (below 1 is faster).
    pub ttft_p99: Option<f64>,
    /// Throughput (requests per second) ratio.
    pub throughput: Option<f64>,
}

impl Ratios {
    /// `run` relative to `base`.
    pub fn of(run: &RunSummary, base: &RunSummary) -> Self {
        Self {
            hit_rate: ratio(run.hit_rate, base.hit_rate),
            ttft_p50: ratio(Some(run.ttft_ms.p50), Some(base.ttft_ms.p50)),
            ttft_p99: ratio(Some(run.ttft_ms.p99), Some(base.ttft_ms.p99)),
            throughput: ratio(Some(run.requests_per_s), Some(base.requests_per_s)),
        }
    }
}

fn ratio(value: Option<f64>, base: Option<f64>) -> Option<f64> {
    match (value, base) {
        (Some(v), Some(b)) if b > 0.0 && v.is_finite() => Some(v / b),
        _ => None,
    }
}

/// The URL a `--reset` argument stands for: a bare `http://host:port` gets
/// [`RESET_PATH`]; a URL with a path (say SGLang's `/flush_cache`) is used as given.
///
/// # Errors
/// [`BenchError::InvalidUrl`] for a URL that is not `http://`.
pub fn reset_uri(url: &str) -> Result<http::Uri, BenchError> {
    let uri = endpoint_uri(url, "")?;
    if matches!(uri.path(), "" | "/") {
        endpoint_uri(url, RESET_PATH)
    } else {
        Ok(uri)
    }
}

/// POSTs to every reset URL, in order.
///
/// # Errors
/// [`BenchError::Reset`] naming the first URL that failed or answered non-2xx.
pub async fn reset_caches(client: &LoadClient, urls: &[String]) -> Result<(), BenchError> {
    for url in urls {
        let uri = reset_uri(url)?;
        let fail = |reason: String| BenchError::Reset {
            url: uri.to_string(),
            reason,
        };
        let (status, body) = client.simple(Method::POST, &uri).await.map_err(fail)?;
        if !(200..300).contains(&status) {
            let body = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            return Err(fail(format!("status {status}: {body}")));
        }
        tracing::info!(url = %uri, "prefix cache reset");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_urls() {
        let cases = [
            ("http://e:8000", Some("http://e:8000/reset_prefix_cache")),
            ("http://e:8000/", Some("http://e:8000/reset_prefix_cache")),
            (
                "http://e:30000/flush_cache",
                Some("http://e:30000/flush_cache"),
            ),
            ("e:8000", None),
        ];
        for (url, want) in cases {
            let got = reset_uri(url).ok().map(|u| u.to_string());
            assert_eq!(got.as_deref(), want, "{url}");
        }
    }

    #[test]
    fn ratios_against_the_base() {
        let summary = |hit, p50, p99, rps| RunSummary {
            hit_rate: hit,
            ttft_ms: crate::Percentiles {
                p50,
                p99,
                ..Default::default()
            },
            requests_per_s: rps,
            ..RunSummary::default()
        };
        let base = summary(Some(0.25), 100.0, 400.0, 10.0);
        let cases = [
            (
                "better",
                summary(Some(0.5), 50.0, 100.0, 20.0),
                Ratios {
                    hit_rate: Some(2.0),
                    ttft_p50: Some(0.5),
                    ttft_p99: Some(0.25),
                    throughput: Some(2.0),
                },
            ),
            (
                "no usage",
                summary(None, 100.0, 400.0, 10.0),
                Ratios {
                    hit_rate: None,
                    ttft_p50: Some(1.0),
                    ttft_p99: Some(1.0),
                    throughput: Some(1.0),
                },
            ),
        ];
        for (name, run, want) in cases {
            assert_eq!(Ratios::of(&run, &base), want, "{name}");
        }
        let zero = summary(Some(0.0), 0.0, 0.0, 0.0);
        assert_eq!(Ratios::of(&base, &zero), Ratios::default());
    }
}

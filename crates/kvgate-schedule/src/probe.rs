//! Readiness probe: one task per endpoint sends `GET {url}{probe_path}` (vLLM's and SGLang's
//! `/health`) every `probe_interval_ms`. After `probe_failure_threshold` consecutive failures
//! (timeout, connect error, 5xx) the endpoint is marked down and gets no new requests until a
//! probe succeeds again. This catches an engine that accepts connections but never answers (a
//! stopped or hung process), which request failures alone cannot see: requests sent there hang
//! instead of failing. The `/metrics` scrape is not the signal: a slow `/metrics` on a serving
//! engine must only make its metrics stale.
//!
//! An engine that has no such path (404 or 405) is not probed further: that is logged once
//! and the endpoint stays up.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::endpoint::EndpointState;
use crate::metrics::ScheduleMetrics;
use crate::scrape::ScrapeClient;

/// Everything one endpoint's probe loop needs.
#[derive(Debug)]
pub(crate) struct ProbeTask {
    pub(crate) endpoint: Arc<EndpointState>,
    pub(crate) client: ScrapeClient,
    pub(crate) path: String,
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) failure_threshold: u32,
    pub(crate) metrics: ScheduleMetrics,
}

/// The outcome of one probe (`outcome` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// 404 or 405: the engine has no such path.
    Unsupported,
    Timeout,
    Connect,
    Status,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Unsupported => "unsupported",
            Outcome::Timeout => "timeout",
            Outcome::Connect => "connect",
            Outcome::Status => "status",
        }
    }
}

/// What one probe's outcome does to the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// In rotation.
    Up,
    /// Failing, under the threshold: as it was.
    Unchanged,
    /// Out of rotation.
    Down,
    /// The engine has no such path: in rotation, and no more probes.
    StopProbing,
}

/// The probe's state machine: consecutive failures so far and an outcome give the new count
/// and the verdict.
fn step(failures: u32, threshold: u32, outcome: Outcome) -> (u32, Verdict) {
    match outcome {
        Outcome::Ok => (0, Verdict::Up),
        Outcome::Unsupported => (0, Verdict::StopProbing),
        Outcome::Timeout | Outcome::Connect | Outcome::Status => {
            let failures = failures.saturating_add(1);
            if failures >= threshold.max(1) {
                (failures, Verdict::Down)
            } else {
                (failures, Verdict::Unchanged)
            }
        }
    }
}

impl ProbeTask {
    /// Probes until `cancel` fires, or until the engine turns out not to serve the path.
    pub(crate) async fn run(self, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = 0_u32;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let outcome = tokio::select! {
                () = cancel.cancelled() => return,
                r = tokio::time::timeout(self.timeout, self.probe()) => r.unwrap_or(Outcome::Timeout),
            };
            self.metrics.probe(self.endpoint.name(), outcome.label());
            let (next, verdict) = step(failures, self.failure_threshold, outcome);
            failures = next;
            match verdict {
                Verdict::Up => {
                    if self.endpoint.set_probe_down(false) {
                        tracing::info!(endpoint = %self.endpoint.name(), path = %self.path, "readiness probe answers again; endpoint back in rotation");
                    }
                }
                Verdict::Unchanged => {}
                Verdict::Down => {
                    if !self.endpoint.set_probe_down(true) {
                        tracing::warn!(endpoint = %self.endpoint.name(), path = %self.path, reason = outcome.label(), failures, "readiness probe failing; endpoint out of rotation until it answers");
                    }
                }
                Verdict::StopProbing => {
                    self.endpoint.set_probe_down(false);
                    tracing::warn!(endpoint = %self.endpoint.name(), path = %self.path, "engine has no readiness path (404/405); not probed (set engines.probe_path)");
                    return;
                }
            }
        }
    }

    async fn probe(&self) -> Outcome {
        match self.client.get(&self.endpoint, &self.path).await {
            None => Outcome::Connect,
            Some(resp) => match resp.status().as_u16() {
                200..=299 => Outcome::Ok,
                404 | 405 => Outcome::Unsupported,
                _ => Outcome::Status,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_moves_the_state_as_documented() {
        use Outcome::{Connect, Ok, Status, Timeout, Unsupported};
        use Verdict::{Down, StopProbing, Unchanged, Up};
        let cases = [
            ("ok clears failures", 2, 3, Ok, (0, Up)),
            ("failure under the threshold", 1, 3, Timeout, (2, Unchanged)),
            ("failure reaching the threshold", 2, 3, Timeout, (3, Down)),
            ("connect failure counts too", 2, 3, Connect, (3, Down)),
            ("5xx counts too", 2, 3, Status, (3, Down)),
            ("past the threshold stays down", 7, 3, Status, (8, Down)),
            ("threshold 0 acts as 1", 0, 0, Timeout, (1, Down)),
            ("404/405 stops probing", 2, 3, Unsupported, (0, StopProbing)),
        ];
        for (name, failures, threshold, outcome, want) in cases {
            assert_eq!(step(failures, threshold, outcome), want, "{name}");
        }
    }
}

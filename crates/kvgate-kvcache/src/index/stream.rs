//! What an operator needs to judge one endpoint's KV event stream: whether it is connected,
//! the last sequence number applied, how far behind the engine it runs, and what went wrong
//! so far (gaps, replays, restarts, reconnections). The subscriber writes it (atomics, one
//! writer per endpoint); [`KvIndex::stream_health`] reads it for the admin page.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{EndpointId, KvIndex};

/// `last_seq` before any batch was applied.
const NO_SEQ: u64 = u64::MAX;

/// Live stream state of one endpoint (the counters live in its metric handles).
#[derive(Debug)]
pub(crate) struct StreamStatus {
    /// A SUB socket is connected to the engine's publisher.
    connected: AtomicBool,
    /// Highest sequence number applied ([`NO_SEQ`]: none yet).
    last_seq: AtomicU64,
    /// Live batches received.
    batches: AtomicU64,
    /// Wall clock (Unix ms) when the last live batch arrived (0: none yet).
    last_batch_unix_ms: AtomicU64,
    /// Arrival time minus the batch's own timestamp, for the last live batch, in ms.
    lag_ms: AtomicU64,
}

impl Default for StreamStatus {
    fn default() -> Self {
        StreamStatus {
            connected: AtomicBool::new(false),
            last_seq: AtomicU64::new(NO_SEQ),
            batches: AtomicU64::new(0),
            last_batch_unix_ms: AtomicU64::new(0),
            lag_ms: AtomicU64::new(0),
        }
    }
}

impl StreamStatus {
    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Relaxed);
    }

    /// A batch with `seq` was applied (live or replayed).
    pub(crate) fn applied(&self, seq: u64) {
        let last = self.last_seq.load(Relaxed);
        if last == NO_SEQ || seq > last {
            self.last_seq.store(seq, Relaxed);
        }
    }

    /// After the holdings were dropped for a new engine process: sequence numbers start over.
    pub(crate) fn reset_seq(&self) {
        self.last_seq.store(NO_SEQ, Relaxed);
    }

    /// A live batch stamped `batch_ts` (Unix seconds, the engine's clock) arrived now.
    pub(crate) fn received(&self, batch_ts: f64) {
        let now_ms = unix_ms_now();
        self.batches.fetch_add(1, Relaxed);
        self.last_batch_unix_ms.store(now_ms, Relaxed);
        let lag = if batch_ts.is_finite() && batch_ts > 0.0 {
            (now_ms as f64 - batch_ts * 1e3).max(0.0) as u64
        } else {
            0
        };
        self.lag_ms.store(lag, Relaxed);
    }
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One endpoint's KV event stream at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamHealth {
    /// A connection to the engine's publisher is up.
    pub connected: bool,
    /// Highest sequence number applied since the holdings were last dropped.
    pub last_seq: Option<u64>,
    /// Live batches received.
    pub batches: u64,
    /// Milliseconds since the last live batch arrived (`None`: none yet).
    pub last_batch_age_ms: Option<u64>,
    /// For the last live batch: its arrival minus its engine timestamp, in milliseconds
    /// (clock skew between hosts shows up here too).
    pub lag_ms: Option<u64>,
    /// Sequence gaps detected.
    pub gaps: u64,
    /// Replays that returned everything asked for.
    pub replays_ok: u64,
    /// Replays that returned only part of it, or nothing.
    pub replays_failed: u64,
    /// Engine restarts detected.
    pub restarts: u64,
    /// Connections after the first.
    pub reconnects: u64,
    /// Holdings unconfirmed (stream down or not reconciled yet): they score nothing.
    pub unconfirmed: bool,
    /// The index may be missing events.
    pub degraded: bool,
}

impl KvIndex {
    /// The KV event stream state of endpoint `id` (`None` for an unknown endpoint).
    pub fn stream_health(&self, id: EndpointId) -> Option<StreamHealth> {
        let slot = self.slot(id)?;
        let s = &slot.stream;
        let m = &slot.metrics;
        let last_batch = s.last_batch_unix_ms.load(Relaxed);
        let seen = last_batch > 0;
        let last_seq = s.last_seq.load(Relaxed);
        Some(StreamHealth {
            connected: s.connected.load(Relaxed),
            last_seq: (last_seq != NO_SEQ).then_some(last_seq),
            batches: s.batches.load(Relaxed),
            last_batch_age_ms: seen.then(|| unix_ms_now().saturating_sub(last_batch)),
            lag_ms: seen.then(|| s.lag_ms.load(Relaxed)),
            gaps: m.gaps.get(),
            replays_ok: m.replay_ok.get(),
            replays_failed: m.replay_partial.get() + m.replay_failed.get(),
            restarts: m.restarts.get(),
            reconnects: m.reconnects.get(),
            unconfirmed: slot.unconfirmed.load(Relaxed),
            degraded: slot.degraded.load(Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_reads_back_as_health() {
        let s = StreamStatus::default();
        assert_eq!(s.last_seq.load(Relaxed), NO_SEQ);
        /// One thing the subscriber reports.
        enum Step {
            Applied(u64),
            Restart,
        }
        // (name, step, want last_seq)
        let cases = [
            ("first batch", Step::Applied(3), Some(3)),
            ("older seq does not go back", Step::Applied(1), Some(3)),
            ("newer seq", Step::Applied(9), Some(9)),
            ("restart", Step::Restart, None),
            ("after a restart, any seq", Step::Applied(0), Some(0)),
        ];
        for (name, step, want) in cases {
            match step {
                Step::Applied(seq) => s.applied(seq),
                Step::Restart => s.reset_seq(),
            }
            let got = s.last_seq.load(Relaxed);
            assert_eq!((got != NO_SEQ).then_some(got), want, "{name}");
        }
        s.received(f64::NAN);
        assert_eq!(s.lag_ms.load(Relaxed), 0, "a bad timestamp is no lag");
        s.received(unix_ms_now() as f64 / 1e3 - 5.0);
        let lag = s.lag_ms.load(Relaxed);
        assert!((5_000..60_000).contains(&lag), "lag {lag}");
        assert_eq!(s.batches.load(Relaxed), 2);
    }
}

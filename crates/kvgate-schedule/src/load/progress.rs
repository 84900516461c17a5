//! Prefill progress: how much of an endpoint's pending prefill the engine has likely done.
//!
//! The router counts a request's uncached tokens as pending prefill from dispatch until its
//! first response byte. The engine works through that queue meanwhile: a 75k-token prompt
//! dispatched 150 ms ago to an engine that computes 400k tokens/s is mostly done, yet it counts
//! whole until its first byte, so the engine looks as busy as if it had not started.
//! [`PrefillClock`] keeps, per endpoint, the current *busy period* (since pending prefill last
//! went from none to some) and an effective prefill rate learned from the first bytes seen so
//! far: the tokens they finished ÷ the busy time between one first byte and the previous one
//! (or the period's start), as a ratio of exponentially decayed sums. A long prompt so weighs
//! by its tokens, and the engine's per-request overhead and the decode steps it interleaves are
//! part of the rate. The pending work left is then estimated as
//! `pending − max(0, rate × busy time − tokens finished in the period)`
//! ([`crate::LoadSnapshot::prefill_remaining`]).

use std::time::Instant;

/// Weight kept by the decayed sums at each first byte (about the last 10 count).
const DECAY: f64 = 0.9;

/// Busy time the sums must cover before the rate is used (shorter: no rate, no discount).
const MIN_SECONDS: f64 = 0.02;

/// One endpoint's busy period and learned prefill rate (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct PrefillClock {
    /// Start of the current busy period (`None`: no prefill pending).
    since: Option<Instant>,
    /// The period's start or its last first byte, whichever is later.
    last: Option<Instant>,
    /// Uncached tokens of the period's requests that are no longer pending.
    done: u64,
    /// Decayed sums of finished tokens and of the busy seconds they took.
    tokens: f64,
    seconds: f64,
}

/// What a snapshot reports of a [`PrefillClock`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct ClockView {
    /// Seconds since the busy period began (0 when idle).
    pub(crate) busy_s: f64,
    /// Tokens finished in the period.
    pub(crate) done: u64,
    /// Learned tokens per second (0 until enough busy time was seen).
    pub(crate) rate: f64,
}

impl PrefillClock {
    /// A request's prefill became pending; `was_idle` when none was pending before it.
    pub(crate) fn begin(&mut self, now: Instant, was_idle: bool) {
        if was_idle || self.since.is_none() {
            self.since = Some(now);
            self.last = Some(now);
            self.done = 0;
        }
    }

    /// A pending prefill of `tokens` ended: at its first byte (`observed`: the rate learns from
    /// it) or because the request ended before one. `now_idle` when none is pending after it.
    pub(crate) fn finish(&mut self, now: Instant, tokens: u64, observed: bool, now_idle: bool) {
        self.done = self.done.saturating_add(tokens);
        if observed && let Some(last) = self.last {
            let dt = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = self.tokens * DECAY + tokens as f64;
            self.seconds = self.seconds * DECAY + dt;
            self.last = Some(now);
        }
        if now_idle {
            self.since = None;
            self.last = None;
            self.done = 0;
        }
    }

    /// The period and rate as of `now`.
    pub(crate) fn view(&self, now: Instant) -> ClockView {
        let Some(since) = self.since else {
            return ClockView {
                rate: self.rate(),
                ..ClockView::default()
            };
        };
        ClockView {
            busy_s: now.saturating_duration_since(since).as_secs_f64(),
            done: self.done,
            rate: self.rate(),
        }
    }

    fn rate(&self) -> f64 {
        if self.seconds >= MIN_SECONDS {
            self.tokens / self.seconds
        } else {
            0.0
        }
    }
}

/// Pending prefill tokens left once `rate × busy_s` of the period's work is taken as done
/// (`done` of it already finished and no longer pending).
pub(crate) fn remaining(pending: u64, view: ClockView) -> f64 {
    let processed = (view.rate * view.busy_s - view.done as f64).max(0.0);
    (pending as f64 - processed).max(0.0)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn rate_is_tokens_over_busy_time() {
        let t0 = Instant::now();
        let mut c = PrefillClock::default();
        assert_eq!(c.view(t0), ClockView::default(), "nothing seen");
        // 10,000 tokens done 50 ms into a period, then 30,000 more 100 ms later.
        c.begin(at(t0, 0), true);
        c.begin(at(t0, 1), false);
        c.finish(at(t0, 50), 10_000, true, false);
        let v = c.view(at(t0, 60));
        assert!((v.rate - 200_000.0).abs() < 1e-6, "{v:?}");
        assert_eq!(v.done, 10_000);
        c.finish(at(t0, 150), 30_000, true, true);
        let v = c.view(at(t0, 200));
        let want = (10_000.0 * DECAY + 30_000.0) / (0.05 * DECAY + 0.1);
        assert!((v.rate - want).abs() < 1e-6, "{v:?} vs {want}");
        assert_eq!((v.busy_s, v.done), (0.0, 0), "idle: the period ended");
    }

    #[test]
    fn ended_requests_count_as_done_but_teach_nothing() {
        let t0 = Instant::now();
        let mut c = PrefillClock::default();
        c.begin(t0, true);
        c.begin(t0, false);
        c.finish(at(t0, 40), 5_000, false, false);
        let v = c.view(at(t0, 40));
        assert_eq!((v.done, v.rate), (5_000, 0.0));
    }

    #[test]
    fn a_short_history_gives_no_rate() {
        let t0 = Instant::now();
        let mut c = PrefillClock::default();
        c.begin(t0, true);
        c.finish(at(t0, 5), 1_000, true, true);
        assert_eq!(c.view(at(t0, 5)).rate, 0.0, "5 ms is below the minimum");
    }

    /// Each row flips one input against the base: 40,000 pending, 100 ms into a period at
    /// 200,000 tokens/s with nothing finished yet, so 20,000 are taken as done.
    #[test]
    fn remaining_table() {
        let base = ClockView {
            busy_s: 0.1,
            done: 0,
            rate: 200_000.0,
        };
        let rows = [
            ("base", 40_000, base, 20_000.0),
            (
                "no rate yet",
                40_000,
                ClockView { rate: 0.0, ..base },
                40_000.0,
            ),
            (
                "idle",
                40_000,
                ClockView {
                    busy_s: 0.0,
                    ..base
                },
                40_000.0,
            ),
            (
                "finished work is no longer pending",
                40_000,
                ClockView {
                    done: 15_000,
                    ..base
                },
                35_000.0,
            ),
            (
                "finished more than the rate says",
                40_000,
                ClockView {
                    done: 30_000,
                    ..base
                },
                40_000.0,
            ),
            ("past all of it", 10_000, base, 0.0),
        ];
        for (name, pending, view, want) in rows {
            assert_eq!(remaining(pending, view), want, "{name}");
        }
    }
}

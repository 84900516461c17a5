//! The recent peak of a count: the largest value seen in the current window and the one
//! before it, so a peak is remembered for one to two windows.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The largest count observed over the last one to two windows (a zero window remembers
/// nothing: the peak is the count just observed).
#[derive(Debug)]
pub(crate) struct RecentPeak {
    window: Duration,
    state: Mutex<Windows>,
}

#[derive(Debug, Default)]
struct Windows {
    /// Start of the current window (`None` before the first observation).
    start: Option<Instant>,
    current: u64,
    previous: u64,
}

impl RecentPeak {
    pub(crate) fn new(window: Duration) -> RecentPeak {
        RecentPeak {
            window,
            state: Mutex::new(Windows::default()),
        }
    }

    /// Records `value` at `now` and returns the peak of the last one to two windows,
    /// `value` included.
    pub(crate) fn observe(&self, now: Instant, value: u64) -> u64 {
        if self.window.is_zero() {
            return value;
        }
        let mut w = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let start = *w.start.get_or_insert(now);
        let elapsed = now.saturating_duration_since(start);
        if elapsed >= self.window * 2 {
            *w = Windows {
                start: Some(now),
                ..Windows::default()
            };
        } else if elapsed >= self.window {
            w.previous = w.current;
            w.current = 0;
            w.start = Some(start + self.window);
        }
        w.current = w.current.max(value);
        w.current.max(w.previous)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_lasts_one_to_two_windows() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let p = RecentPeak::new(ms(100));
        // (offset ms, observed, expected peak): one condition changes per row.
        let rows: [(u64, u64, u64); 6] = [
            (0, 8, 8),   // the first observation is the peak
            (50, 2, 8),  // same window: remembered
            (150, 1, 8), // next window: the previous window's peak still counts
            (210, 3, 3), // two windows on: the 8 is forgotten, 1 and 3 remain
            (260, 0, 3), // same window as the 3
            (600, 0, 0), // long idle: everything forgotten
        ];
        for (offset, value, want) in rows {
            assert_eq!(p.observe(t0 + ms(offset), value), want, "at {offset} ms");
        }
    }

    #[test]
    fn a_zero_window_is_the_value_itself() {
        let p = RecentPeak::new(Duration::ZERO);
        let t0 = Instant::now();
        assert_eq!(p.observe(t0, 8), 8);
        assert_eq!(p.observe(t0, 2), 2);
    }
}

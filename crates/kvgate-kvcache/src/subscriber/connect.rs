//! Connecting the SUB socket, with a short capped backoff.
//!
//! `zeromq`'s `connect()` retries a refused connection by itself, but its delays double up to
//! 30 s, so an engine that was down a few seconds is reached late. Each attempt here is
//! therefore bounded by the current backoff step: a refused connection is retried (by
//! `zeromq`) within the step, and when the step runs out a fresh socket starts over with the
//! next, doubled step. The gap between two connection attempts stays well under the cap.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SubSocket};

use super::EndpointTask;

/// Capped exponential backoff.
#[derive(Debug, Clone, Copy)]
pub(super) struct Backoff {
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `initial` (at least 1 ms, at most `max`).
    pub(super) fn new(initial: Duration, max: Duration) -> Self {
        let max = max.max(Duration::from_millis(1));
        Backoff {
            max,
            next: initial.clamp(Duration::from_millis(1), max),
        }
    }

    /// The current step; the next one is doubled, up to the cap.
    pub(super) fn step(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }
}

/// How one connection attempt ended.
pub(super) enum Attempt {
    Connected,
    /// Not reachable within the step (or a hard error, after waiting the step).
    Retry,
    Cancelled,
}

impl EndpointTask {
    /// Subscribes `sock` and connects it, giving up after `step`.
    pub(super) async fn attempt_connect(
        &mut self,
        sock: &mut SubSocket,
        step: Duration,
        cancel: &CancellationToken,
    ) -> Attempt {
        if let Err(e) = sock.subscribe(&self.source.topic).await {
            tracing::warn!(endpoint = %self.slot.label, error = %e, "kv subscribe failed");
        }
        let url = self.source.kv_events.clone();
        tokio::select! {
            _ = cancel.cancelled() => Attempt::Cancelled,
            r = tokio::time::timeout(step, sock.connect(&url)) => match r {
                Ok(Ok(())) => Attempt::Connected,
                Ok(Err(e)) => {
                    if self.warn.allow() {
                        tracing::warn!(endpoint = %self.slot.label, url = %url, error = %e, "kv events connect failed");
                    }
                    tokio::select! {
                        _ = cancel.cancelled() => Attempt::Cancelled,
                        _ = tokio::time::sleep(step) => Attempt::Retry,
                    }
                }
                Err(_) => Attempt::Retry,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(50), ms(1000));
        let steps: Vec<_> = (0..7).map(|_| b.step()).collect();
        assert_eq!(steps, [50, 100, 200, 400, 800, 1000, 1000].map(ms).to_vec());
        // An initial step above the cap is capped.
        assert_eq!(Backoff::new(ms(50), ms(20)).step(), ms(20));
    }
}

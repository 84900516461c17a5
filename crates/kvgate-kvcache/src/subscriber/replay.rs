//! Sequence tracking and the DEALER replay client (§1.10 of the protocol notes).

use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout, timeout_at};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Replay end marker: seq = -1 as 8 big-endian bytes.
pub(crate) const END_SEQ: u64 = u64::MAX;

/// What a live sequence number means relative to what was seen before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeqStep {
    /// First message since the subscriber started.
    First,
    /// Exactly the next one.
    InOrder,
    /// Batches `[expected, got)` were missed.
    Gap { expected: u64 },
    /// The sequence went backwards: the publisher restarted.
    Reset { expected: u64 },
    /// A live batch a warm replay already applied.
    Duplicate,
}

/// Per-stream sequence tracker.
#[derive(Debug, Default)]
pub(crate) struct SeqTracker {
    expected: Option<u64>,
    /// After a warm replay up to `R`: live batches below `R + 1` that were queued on the SUB
    /// socket while the replay ran are duplicates, until the first live batch at or above it.
    replayed_below: Option<u64>,
}

impl SeqTracker {
    pub(crate) fn step(&self, seq: u64) -> SeqStep {
        match self.expected {
            None => SeqStep::First,
            Some(e) if seq == e => SeqStep::InOrder,
            Some(e) if seq > e => SeqStep::Gap { expected: e },
            Some(_) if self.replayed_below.is_some_and(|r| seq < r) => SeqStep::Duplicate,
            Some(e) => SeqStep::Reset { expected: e },
        }
    }

    pub(crate) fn advance(&mut self, seq: u64) {
        self.expected = Some(seq.wrapping_add(1));
        if self.replayed_below.is_some_and(|r| seq >= r) {
            self.replayed_below = None;
        }
    }

    /// True before any batch was applied.
    pub(crate) fn is_fresh(&self) -> bool {
        self.expected.is_none()
    }

    /// A warm replay applied every batch up to `last`.
    pub(crate) fn replayed_through(&mut self, last: u64) {
        self.expected = Some(last.wrapping_add(1));
        self.replayed_below = Some(last.wrapping_add(1));
    }

    /// A new connection: live batches now come from a new socket, nothing is queued from a
    /// replay yet.
    pub(crate) fn new_connection(&mut self) {
        self.replayed_below = None;
    }

    /// The holdings were dropped for a new process that retains nothing: its next batch is 0.
    pub(crate) fn expect_from_zero(&mut self) {
        self.expected = Some(0);
        self.replayed_below = None;
    }
}

/// How a replay went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReplayOutcome {
    /// Every batch in the range was replayed.
    Complete,
    /// Some batches were no longer retained (or arrived out of order).
    Partial,
    /// No usable answer (connect failure, timeout, protocol error).
    Failed,
}

/// One replayed batch.
#[derive(Debug)]
pub(crate) struct Replayed {
    pub(crate) seq: u64,
    pub(crate) payload: Bytes,
}

/// Parses a DEALER reply: `["", topic, seq, payload]` (vLLM ≥ 0.26, SGLang) or
/// `["", seq, payload]` (≤ 0.25). Returns `None` for the end marker, `Err` for junk.
pub(crate) fn parse_reply(msg: ZmqMessage) -> Result<Option<Replayed>, ()> {
    let mut frames = msg.into_vec();
    if frames.first().is_some_and(|f| f.is_empty()) {
        frames.remove(0);
    }
    let (seq, payload) = match frames.len() {
        3 => (frames[1].clone(), frames[2].clone()),
        2 => (frames[0].clone(), frames[1].clone()),
        _ => return Err(()),
    };
    let seq = seq_of(&seq).ok_or(())?;
    if seq == END_SEQ {
        return Ok(None);
    }
    Ok(Some(Replayed { seq, payload }))
}

/// First 8 bytes as a big-endian u64.
pub(crate) fn seq_of(frame: &[u8]) -> Option<u64> {
    let b: [u8; 8] = frame.get(..8)?.try_into().ok()?;
    Some(u64::from_be_bytes(b))
}

/// Requests batches `[from, until)` from a replay ROUTER and hands each one, in order and
/// deduplicated, to `apply`. `until == END_SEQ` asks for everything the publisher retains.
pub(crate) async fn replay(
    endpoint: &str,
    from: u64,
    until: u64,
    idle: Duration,
    total: Duration,
    mut apply: impl FnMut(u64, &[u8]),
) -> ReplayOutcome {
    let deadline = Instant::now() + total;
    let mut sock = DealerSocket::new();
    match timeout(idle, sock.connect(endpoint)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(replay = endpoint, error = %e, "kv replay connect failed");
            return ReplayOutcome::Failed;
        }
        Err(_) => {
            tracing::warn!(replay = endpoint, "kv replay connect timed out");
            return ReplayOutcome::Failed;
        }
    }
    let request = match ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ]) {
        Ok(m) => m,
        Err(_) => return ReplayOutcome::Failed,
    };
    if let Err(e) = sock.send(request).await {
        tracing::warn!(replay = endpoint, error = %e, "kv replay request failed");
        return ReplayOutcome::Failed;
    }
    let mut next = from;
    let mut partial = false;
    let mut got_any = false;
    loop {
        let idle_deadline = (Instant::now() + idle).min(deadline);
        let msg = match timeout_at(idle_deadline, sock.recv()).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => {
                tracing::warn!(replay = endpoint, error = %e, "kv replay receive failed");
                break;
            }
            Err(_) => {
                tracing::warn!(replay = endpoint, next, until, "kv replay timed out");
                break;
            }
        };
        match parse_reply(msg) {
            Ok(None) => {
                // `until == END_SEQ`: everything retained was asked for, the marker ends it.
                return if (next >= until || until == END_SEQ) && !partial {
                    ReplayOutcome::Complete
                } else {
                    ReplayOutcome::Partial
                };
            }
            Ok(Some(r)) => {
                got_any = true;
                if r.seq < next || r.seq >= until {
                    continue; // duplicate, or live traffic will deliver it
                }
                if r.seq > next {
                    // The publisher no longer retains [next, r.seq).
                    partial = true;
                }
                apply(r.seq, &r.payload);
                next = r.seq + 1;
            }
            Err(()) => {
                tracing::warn!(replay = endpoint, "kv replay sent a malformed reply");
                partial = true;
            }
        }
    }
    if got_any && next >= until {
        ReplayOutcome::Partial
    } else {
        ReplayOutcome::Failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_steps() {
        let mut t = SeqTracker::default();
        assert_eq!(t.step(5), SeqStep::First);
        t.advance(5);
        let cases = [
            (6, SeqStep::InOrder),
            (9, SeqStep::Gap { expected: 6 }),
            (0, SeqStep::Reset { expected: 6 }),
            (5, SeqStep::Reset { expected: 6 }),
        ];
        for (seq, want) in cases {
            assert_eq!(t.step(seq), want, "{seq}");
        }
    }

    #[test]
    fn reply_shapes() {
        let m = |frames: Vec<&[u8]>| {
            ZmqMessage::try_from(
                frames
                    .into_iter()
                    .map(Bytes::copy_from_slice)
                    .collect::<Vec<_>>(),
            )
            .unwrap()
        };
        let seq7 = 7u64.to_be_bytes();
        let end = END_SEQ.to_be_bytes();
        type Case = (&'static str, ZmqMessage, Result<Option<u64>, ()>);
        let cases: Vec<Case> = vec![
            (
                "with topic",
                m(vec![b"", b"kv@x", &seq7, b"p"]),
                Ok(Some(7)),
            ),
            ("without topic", m(vec![b"", &seq7, b"p"]), Ok(Some(7))),
            (
                "end marker with topic",
                m(vec![b"", b"", &end, b""]),
                Ok(None),
            ),
            ("end marker old", m(vec![b"", &end, b""]), Ok(None)),
            ("short seq", m(vec![b"", b"t", b"123", b"p"]), Err(())),
            (
                "too many frames",
                m(vec![b"", b"a", b"b", b"c", b"d"]),
                Err(()),
            ),
        ];
        for (name, msg, want) in cases {
            assert_eq!(parse_reply(msg).map(|r| r.map(|r| r.seq)), want, "{name}");
        }
    }
}

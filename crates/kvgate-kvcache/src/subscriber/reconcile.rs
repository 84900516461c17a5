//! Reconciling a (re)connected endpoint with the engine's replay from seq 0: same process,
//! new process (restart), or first contact. See the module docs of `subscriber`.

use tokio_util::sync::CancellationToken;

use super::EndpointTask;
use super::live::fingerprint;
use super::replay::{self, ReplayOutcome, SeqTracker};

/// What the replay says about the engine behind a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// No usable answer: the first live batch decides.
    NoInfo,
    /// Nothing applied yet: apply the replay (the whole history when it starts at 0).
    Fresh,
    /// The process whose batches were applied: apply the batches after the last one.
    Continue,
    /// A new process: drop the holdings, apply the replay.
    Restart,
    /// The retained history starts after the last applied batch: a restart and lost batches
    /// look the same. Rebuild from the replay, mark degraded.
    Unknown,
}

/// Judges a replay from 0 (`batches` in seq order) against the last applied batch
/// `(seq, payload fingerprint)`.
pub(super) fn judge(
    last: Option<(u64, u64)>,
    batches: &[(u64, Vec<u8>)],
    outcome: ReplayOutcome,
) -> Verdict {
    if outcome == ReplayOutcome::Failed {
        // No end marker: the tail may be missing, so "newest seq" means nothing.
        return Verdict::NoInfo;
    }
    let Some((last_seq, last_fp)) = last else {
        return Verdict::Fresh;
    };
    let (Some(&(oldest, _)), Some(&(newest, _))) = (batches.first(), batches.last()) else {
        // A process that published anything retains at least its latest batch.
        return Verdict::Restart;
    };
    if newest < last_seq {
        return Verdict::Restart;
    }
    match batches.iter().find(|(s, _)| *s == last_seq) {
        Some((_, p)) if fingerprint(p) == last_fp => Verdict::Continue,
        Some(_) => Verdict::Restart,
        None if oldest > last_seq => Verdict::Unknown,
        // Retained around the last seq but not it (a malformed reply): cannot compare.
        None => Verdict::Unknown,
    }
}

impl EndpointTask {
    /// Replays everything the engine retains, from 0, before the first live message, and
    /// brings the holdings in line with it. Returns true when the holdings are confirmed,
    /// false when the replay gave no usable answer (the first live batch decides).
    pub(super) async fn reconcile(
        &mut self,
        tracker: &mut SeqTracker,
        cancel: &CancellationToken,
    ) -> bool {
        let Some(url) = self.source.replay.clone() else {
            return false;
        };
        let (idle, total) = (
            self.config.replay_idle_timeout,
            self.config.replay_total_timeout,
        );
        let mut batches: Vec<(u64, Vec<u8>)> = Vec::new();
        let outcome = tokio::select! {
            _ = cancel.cancelled() => return false,
            o = replay::replay(&url, 0, replay::END_SEQ, idle, total, |s, p| {
                batches.push((s, p.to_vec()));
            }) => o,
        };
        let verdict = judge(self.last_applied, &batches, outcome);
        let label = self.slot.label.clone();
        let (oldest, newest) = (batches.first().map(|b| b.0), batches.last().map(|b| b.0));
        let last = self.last_applied.map(|l| l.0);
        let counter = match outcome {
            ReplayOutcome::Complete if batches.is_empty() => None,
            ReplayOutcome::Complete => Some(&self.slot.metrics.replay_ok),
            ReplayOutcome::Partial => Some(&self.slot.metrics.replay_partial),
            ReplayOutcome::Failed => Some(&self.slot.metrics.replay_failed),
        };
        if let Some(c) = counter {
            c.inc();
        }
        match verdict {
            Verdict::NoInfo => {
                tracing::warn!(endpoint = %label, outcome = ?outcome, "kv replay on connect gave no usable answer; the next live batch decides");
                return tracker.is_fresh();
            }
            Verdict::Fresh => {
                if oldest == Some(0) {
                    // The whole history: it replaces whatever the index held.
                    self.clear();
                }
                self.apply_all(&batches, None);
                if let Some(n) = newest {
                    tracker.replayed_through(n);
                    tracing::info!(endpoint = %label, until = n + 1, outcome = ?outcome, "kv events replayed on connect (warm start)");
                }
            }
            Verdict::Continue => {
                self.apply_all(&batches, last);
                if let Some(n) = newest {
                    tracker.replayed_through(n);
                }
                tracing::info!(endpoint = %label, last_applied = ?last, newest = ?newest, "kv events reconnected to the same engine process; caught up from its replay");
            }
            Verdict::Restart | Verdict::Unknown => {
                if verdict == Verdict::Restart {
                    self.slot.metrics.restarts.inc();
                    tracing::warn!(endpoint = %label, last_applied = ?last, oldest = ?oldest, newest = ?newest, "kv events reconnected to a new engine process (restart): dropping its old holdings, applying its replay");
                } else {
                    self.slot.metrics.gaps.inc();
                    tracing::warn!(endpoint = %label, last_applied = ?last, oldest = ?oldest, "kv events reconnected but the engine no longer retains the last applied batch (restart or lost batches): rebuilding from its replay, endpoint degraded");
                }
                self.clear();
                // Complete only when the replay is the whole history of this process.
                let whole = oldest.is_none_or(|o| o == 0)
                    && outcome == ReplayOutcome::Complete
                    && verdict == Verdict::Restart;
                self.index.set_degraded(self.id(), !whole);
                self.apply_all(&batches, None);
                match newest {
                    Some(n) => tracker.replayed_through(n),
                    None => tracker.expect_from_zero(),
                }
            }
        }
        true
    }

    /// Applies replayed batches above `after`.
    fn apply_all(&mut self, batches: &[(u64, Vec<u8>)], after: Option<u64>) {
        for (seq, payload) in batches {
            if after.is_none_or(|a| *seq > a) {
                self.apply(*seq, payload);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batches(seqs: std::ops::Range<u64>, tag: u8) -> Vec<(u64, Vec<u8>)> {
        seqs.map(|s| (s, vec![tag, s as u8])).collect()
    }

    #[test]
    fn verdicts() {
        use ReplayOutcome::{Complete, Failed, Partial};
        let applied = |seq: u64, tag: u8| Some((seq, fingerprint(&[tag, seq as u8])));
        type Case = (
            &'static str,
            Option<(u64, u64)>,
            Vec<(u64, Vec<u8>)>,
            ReplayOutcome,
            Verdict,
        );
        let cases: Vec<Case> = vec![
            (
                "no end marker",
                applied(5, 0),
                batches(0..9, 0),
                Failed,
                Verdict::NoInfo,
            ),
            (
                "first contact",
                None,
                batches(0..3, 0),
                Complete,
                Verdict::Fresh,
            ),
            (
                "first contact, nothing retained",
                None,
                vec![],
                Complete,
                Verdict::Fresh,
            ),
            (
                "same process, caught up",
                applied(5, 0),
                batches(0..6, 0),
                Complete,
                Verdict::Continue,
            ),
            (
                "same process, moved on",
                applied(5, 0),
                batches(0..9, 0),
                Complete,
                Verdict::Continue,
            ),
            (
                "same process, bounded buffer",
                applied(5, 0),
                batches(4..9, 0),
                Partial,
                Verdict::Continue,
            ),
            (
                "new process behind the old seq",
                applied(5, 0),
                batches(0..3, 1),
                Complete,
                Verdict::Restart,
            ),
            (
                "new process past the old seq",
                applied(5, 0),
                batches(0..9, 1),
                Complete,
                Verdict::Restart,
            ),
            (
                "new process, nothing published",
                applied(5, 0),
                vec![],
                Complete,
                Verdict::Restart,
            ),
            (
                "buffer rolled past the last seq",
                applied(5, 0),
                batches(7..9, 0),
                Partial,
                Verdict::Unknown,
            ),
        ];
        for (name, last, b, outcome, want) in cases {
            assert_eq!(judge(last, &b, outcome), want, "{name}");
        }
    }
}

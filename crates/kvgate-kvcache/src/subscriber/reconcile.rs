//! Reconciling a (re)connected endpoint with the engine's replay from seq 0: same process,
//! new process (restart), or first contact. See the module docs of `subscriber`.

use memchr::memmem;
use tokio_util::sync::CancellationToken;

use super::EndpointTask;
use super::live::fingerprint;
use super::replay::{self, ReplayOutcome, SeqTracker};
use crate::codec::decode_batch;
use crate::event::KvEvent;

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
                self.apply_all(&batches, None).await;
                if let Some(n) = newest {
                    tracker.replayed_through(n);
                    tracing::info!(endpoint = %label, until = n + 1, outcome = ?outcome, "kv events replayed on connect (warm start)");
                }
            }
            Verdict::Continue => {
                self.apply_all(&batches, last).await;
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
                self.apply_all(&batches, None).await;
                match newest {
                    Some(n) => tracker.replayed_through(n),
                    None => tracker.expect_from_zero(),
                }
            }
        }
        true
    }

    /// Applies replayed batches above `after`, from the newest one that clears the engine's
    /// cache (what came before it cannot change what the index holds after it), yielding to
    /// the runtime every [`APPLY_CHUNK`] batches: an engine retains up to `buffer_steps`
    /// batches (10,000 in vLLM), and on a busy engine they hold millions of block events, so
    /// applying them in one go would hold a worker thread for seconds and stall every request
    /// the proxy is serving on it. The endpoint's holdings are unconfirmed (score nothing)
    /// until reconciliation ends, so lookups meanwhile never see a half-applied replay.
    async fn apply_all(&mut self, batches: &[(u64, Vec<u8>)], after: Option<u64>) {
        let start = last_clear(batches).unwrap_or(0);
        let mut since_yield = 0;
        for (seq, payload) in &batches[start..] {
            if after.is_none_or(|a| *seq > a) {
                self.apply(*seq, payload);
                since_yield += 1;
                if since_yield == APPLY_CHUNK {
                    since_yield = 0;
                    tokio::task::yield_now().await;
                }
            }
        }
    }
}

/// Replayed batches applied between two yields to the runtime.
const APPLY_CHUNK: usize = 32;

/// The position of the newest batch holding an `AllBlocksCleared` event. A byte search for
/// the event's tag finds candidates without decoding; a candidate is decoded to confirm.
fn last_clear(batches: &[(u64, Vec<u8>)]) -> Option<usize> {
    let tag = memmem::Finder::new(b"AllBlocksCleared");
    batches.iter().rposition(|(_, payload)| {
        tag.find(payload).is_some()
            && decode_batch(payload).is_ok_and(|(batch, _)| {
                batch
                    .events
                    .iter()
                    .any(|e| matches!(e, KvEvent::AllBlocksCleared))
            })
    })
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

    use std::sync::Arc;

    use crate::codec::{Encoding, encode_batch};
    use crate::event::{BlockHash, BlockStored};
    use crate::index::{EndpointId, EndpointKey, EndpointSpec, IndexConfig, KvIndex};
    use crate::metrics::KvMetrics;
    use crate::subscriber::{EndpointSource, SubscriberConfig};

    /// An endpoint task over a fresh index (never connected: only its apply path is used).
    fn task() -> (EndpointTask, KvIndex, EndpointId) {
        let index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
        let spec = EndpointSpec {
            key: EndpointKey::new("127.0.0.1:8000", 0),
            model: "m".into(),
            block_size: 16,
            capacity_blocks: None,
        };
        let id = index.register_endpoint(spec.clone());
        let task = EndpointTask {
            index: index.clone(),
            slot: index.slot(id).unwrap(),
            source: EndpointSource {
                spec,
                kv_events: "tcp://127.0.0.1:1".into(),
                replay: None,
                topic: String::new(),
            },
            config: Arc::new(SubscriberConfig::default()),
            warn: Default::default(),
            last_applied: None,
        };
        (task, index, id)
    }

    /// Batch `seq`: one block of its own.
    fn store(seq: u64, encoding: Encoding) -> Vec<u8> {
        let ev = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::Int(1_000 + seq)],
            token_ids: (0..16).map(|t| t + seq as u32 * 16).collect(),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        });
        encode_batch(seq as f64, &[ev], Some(0), encoding)
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_long_replay_lets_other_tasks_run() {
        let (mut task, index, id) = task();
        let n = APPLY_CHUNK as u64 * 4;
        let replay: Vec<_> = (0..n).map(|s| (s, store(s, Encoding::Map))).collect();
        // On this one-thread runtime the probe runs only when the replay yields.
        let probe = tokio::spawn({
            let index = index.clone();
            async move { index.holdings(id) }
        });
        task.apply_all(&replay, None).await;
        let seen = probe.await.unwrap();
        assert_eq!(index.holdings(id), n as usize);
        assert!(
            seen > 0 && seen < n as usize,
            "another task ran only after {seen} of {n} batches were applied"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_replay_is_applied_from_its_last_cache_clear() {
        for encoding in [Encoding::Map, Encoding::Array] {
            let (mut task, index, id) = task();
            let clear = encode_batch(0.0, &[KvEvent::AllBlocksCleared], Some(0), encoding);
            let replay = vec![
                (0, store(0, encoding)),
                (1, b"\xc1 undecodable".to_vec()),
                (2, clear.clone()),
                (3, store(3, encoding)),
                (4, clear),
                (5, store(5, encoding)),
                (6, store(6, encoding)),
            ];
            task.apply_all(&replay, None).await;
            assert_eq!(
                index.holdings(id),
                2,
                "{encoding:?}: the blocks after the last clear"
            );
            assert_eq!(
                task.slot.metrics.decode_payload.get(),
                0,
                "{encoding:?}: a batch before the last clear is not decoded"
            );
            assert_eq!(task.last_applied.map(|l| l.0), Some(6), "{encoding:?}");
        }
    }

    #[test]
    fn only_a_decoded_clear_counts() {
        let with_tag_only = (0, b"AllBlocksCleared, but not msgpack".to_vec());
        let clear = encode_batch(0.0, &[KvEvent::AllBlocksCleared], None, Encoding::Map);
        assert_eq!(last_clear(std::slice::from_ref(&with_tag_only)), None);
        assert_eq!(last_clear(&[(0, clear), with_tag_only]), Some(0));
        assert_eq!(last_clear(&[(0, store(0, Encoding::Map))]), None);
    }
}

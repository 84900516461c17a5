//! Live batches: sequence steps, gap fills and applying payloads to the index.

use tokio_util::sync::CancellationToken;
use zeromq::ZmqMessage;

use super::EndpointTask;
use super::replay::{self, ReplayOutcome, SeqStep, SeqTracker, seq_of};
use crate::codec::decode_batch;
use crate::event::KvEvent;

/// Fingerprint of a batch payload, compared with the engine's replay of the same seq to tell
/// the same process from a new one.
pub(super) fn fingerprint(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

impl EndpointTask {
    /// Applies one live batch; `first_unverified` marks the first batch of a new connection
    /// that no replay reconciled (a forward gap there is taken for an engine restart).
    /// Returns false for a malformed message (nothing decided).
    pub(super) async fn on_message(
        &mut self,
        tracker: &mut SeqTracker,
        msg: ZmqMessage,
        first_unverified: bool,
        cancel: &CancellationToken,
    ) -> bool {
        let frames = msg.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [_topic, seq, payload] => match seq_of(seq) {
                Some(s) => (s, payload.clone()),
                None => {
                    self.bad_frames(frames.len());
                    return false;
                }
            },
            _ => {
                self.bad_frames(frames.len());
                return false;
            }
        };
        let label = self.slot.label.clone();
        let step = match tracker.step(seq) {
            SeqStep::Gap { expected } if first_unverified => {
                tracing::warn!(endpoint = %label, expected, got = seq, "kv event sequence jumped on a new connection: taking it for an engine restart");
                SeqStep::Reset { expected }
            }
            step => step,
        };
        match step {
            SeqStep::InOrder => {}
            SeqStep::Duplicate => return true,
            SeqStep::First => {
                if seq > 0 && self.source.replay.is_some() {
                    self.fill(0, seq, cancel).await;
                }
            }
            SeqStep::Gap { expected } => {
                self.slot.metrics.gaps.inc();
                tracing::warn!(endpoint = %label, expected, got = seq, "kv event sequence gap");
                self.fill(expected, seq, cancel).await;
            }
            SeqStep::Reset { expected } => {
                self.slot.metrics.restarts.inc();
                tracing::warn!(endpoint = %label, expected, got = seq, "kv event sequence reset, dropping endpoint blocks");
                self.clear();
                self.index.set_degraded(self.id(), false);
                if seq > 0 {
                    self.fill(0, seq, cancel).await;
                }
            }
        }
        if let Some(ts) = self.apply(seq, &payload) {
            self.slot.stream.received(ts);
        }
        tracker.advance(seq);
        true
    }

    /// Drops the endpoint's holdings (and what was applied).
    pub(super) fn clear(&mut self) {
        self.index.clear_endpoint(self.id());
        self.slot.stream.reset_seq();
        self.last_applied = None;
    }

    /// Replays `[from, until)` if possible; marks the endpoint degraded when it cannot.
    pub(super) async fn fill(&mut self, from: u64, until: u64, cancel: &CancellationToken) {
        let label = self.slot.label.clone();
        let Some(url) = self.source.replay.clone() else {
            self.index.set_degraded(self.id(), true);
            tracing::warn!(endpoint = %label, from, until, "kv events lost and no replay endpoint, endpoint degraded");
            return;
        };
        let (idle, total) = (
            self.config.replay_idle_timeout,
            self.config.replay_total_timeout,
        );
        let outcome = tokio::select! {
            _ = cancel.cancelled() => return,
            o = replay::replay(&url, from, until, idle, total, |s, p| { self.apply(s, p); }) => o,
        };
        match outcome {
            ReplayOutcome::Complete => {
                self.slot.metrics.replay_ok.inc();
                tracing::info!(endpoint = %label, from, until, "kv event gap replayed");
            }
            ReplayOutcome::Partial | ReplayOutcome::Failed => {
                let counter = if outcome == ReplayOutcome::Partial {
                    &self.slot.metrics.replay_partial
                } else {
                    &self.slot.metrics.replay_failed
                };
                counter.inc();
                // From 0 on first contact, missing history is normal (buffer retention), not a loss.
                if from > 0 {
                    self.index.set_degraded(self.id(), true);
                    tracing::warn!(endpoint = %label, from, until, outcome = ?outcome, "kv event gap not fully replayed, endpoint degraded");
                }
            }
        }
    }

    /// Decodes one batch and applies it to the index; returns the batch's timestamp when it
    /// decoded.
    pub(super) fn apply(&mut self, seq: u64, payload: &[u8]) -> Option<f64> {
        if self.last_applied.is_none_or(|(s, _)| seq >= s) {
            self.last_applied = Some((seq, fingerprint(payload)));
        }
        self.slot.stream.applied(seq);
        match decode_batch(payload) {
            Ok((batch, stats)) => {
                let m = &self.slot.metrics;
                m.unknown_event.inc_by(u64::from(stats.unknown_events));
                m.unknown_field.inc_by(u64::from(stats.unknown_fields));
                m.malformed_event.inc_by(u64::from(stats.malformed_events));
                if stats.malformed_events > 0 && self.warn.allow() {
                    tracing::warn!(endpoint = %self.slot.label, seq, malformed = stats.malformed_events, "kv events skipped: malformed");
                }
                if let Some(r) = batch.data_parallel_rank
                    && r != i64::from(self.slot.spec.key.data_parallel_rank)
                    && self.warn.allow()
                {
                    tracing::warn!(endpoint = %self.slot.label, batch_rank = r, "kv batch data_parallel_rank differs from the endpoint's");
                }
                if batch
                    .events
                    .iter()
                    .any(|e| matches!(e, KvEvent::AllBlocksCleared))
                {
                    self.index.set_degraded(self.id(), false);
                }
                self.index.apply_batch(self.id(), &batch);
                Some(batch.ts)
            }
            Err(e) => {
                self.slot.metrics.decode_payload.inc();
                if self.warn.allow() {
                    tracing::warn!(endpoint = %self.slot.label, seq, error = %e, "kv event payload undecodable");
                }
                None
            }
        }
    }

    fn bad_frames(&mut self, frames: usize) {
        self.slot.metrics.decode_frames.inc();
        if self.warn.allow() {
            tracing::warn!(endpoint = %self.slot.label, frames, "kv event message malformed (want 3 frames, 8-byte seq)");
        }
    }
}

//! ZMQ ingestion: one SUB socket (and task) per endpoint, sequence tracking, DEALER replay.
//!
//! Live frames are `[topic, seq (8 bytes BE), payload]`. Per endpoint:
//! - on connecting, before the first live message, everything the engine retains is replayed
//!   from 0 when a replay endpoint is configured (warm start: a restarted router has its index
//!   back before the engine's next event); live batches queued meanwhile are deduplicated.
//!   Without that, the first message triggers the replay from 0 (also covers the PUB/SUB
//!   slow-joiner loss);
//! - a gap replays `[expected, seq)` through a DEALER, applied in order and deduplicated; a gap
//!   that cannot be filled marks the endpoint degraded (gauge + WARN);
//! - a sequence going backwards is an engine restart: the endpoint's holdings are dropped
//!   (and replayed from 0 when possible). So is a gap forward in the first batch of a new
//!   connection (the SUB socket reported a disconnect, or the task made a new socket): an
//!   engine restarted on the same ports may be past the old process's last seq by the time
//!   the subscriber reconnects, and its holdings would otherwise stay, routing hits that do
//!   not exist (issue #11, defect 5). A batch in order after a reconnect is the same process;
//!   an `AllBlocksCleared` event drops the holdings as it always did;
//! - malformed frames and payloads are counted and logged with the endpoint, never fatal.
//!
//! `zeromq`'s `connect()` waits until the peer exists, so each endpoint's task does its own
//! connecting; the SUB socket reconnects by itself after publisher restarts.

mod replay;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket, ZmqMessage};

use crate::codec::decode_batch;
use crate::event::KvEvent;
use crate::index::{EndpointId, EndpointSlot, EndpointSpec, KvIndex};
use replay::{ReplayOutcome, SeqStep, SeqTracker, seq_of};

/// Where an endpoint publishes its KV events.
#[derive(Debug, Clone)]
pub struct EndpointSource {
    /// Index identity, model and block size.
    pub spec: EndpointSpec,
    /// PUB endpoint to connect to, e.g. `tcp://10.0.0.1:5557`.
    pub kv_events: String,
    /// Replay ROUTER endpoint, e.g. `tcp://10.0.0.1:5558`; `None` disables replay.
    pub replay: Option<String>,
    /// SUB prefix filter on the topic frame (default `""`: everything).
    pub topic: String,
}

/// Subscriber timing knobs.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// Longest wait for the next replay reply (default 2 s).
    pub replay_idle_timeout: Duration,
    /// Longest whole replay (default 30 s).
    pub replay_total_timeout: Duration,
    /// Pause before reconnecting after a socket error (default 1 s).
    pub reconnect_backoff: Duration,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        SubscriberConfig {
            replay_idle_timeout: Duration::from_secs(2),
            replay_total_timeout: Duration::from_secs(30),
            reconnect_backoff: Duration::from_secs(1),
        }
    }
}

/// Errors of the subscriber's control API.
#[derive(Debug, thiserror::Error)]
pub enum SubscriberError {
    /// Called outside a tokio runtime.
    #[error("kv event subscriber needs a tokio runtime")]
    NoRuntime(#[source] tokio::runtime::TryCurrentError),
}

/// Running KV-event ingestion for a set of endpoints. Dropping it (or [`cancel`]) stops every
/// endpoint task; removing an endpoint drops its holdings.
///
/// [`cancel`]: KvEventSubscriber::cancel
#[derive(Debug)]
pub struct KvEventSubscriber {
    index: KvIndex,
    config: Arc<SubscriberConfig>,
    cancel: CancellationToken,
    runtime: tokio::runtime::Handle,
    tasks: Mutex<HashMap<u32, (CancellationToken, JoinHandle<()>)>>,
}

impl KvEventSubscriber {
    /// Starts ingestion for `endpoints` into `index` (metrics go to the index's
    /// [`crate::KvMetrics`]). Cancelling `cancel` stops everything.
    ///
    /// # Errors
    /// [`SubscriberError::NoRuntime`] outside a tokio runtime.
    pub fn spawn(
        config: SubscriberConfig,
        endpoints: Vec<EndpointSource>,
        index: KvIndex,
        cancel: CancellationToken,
    ) -> Result<Self, SubscriberError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(SubscriberError::NoRuntime)?;
        let sub = KvEventSubscriber {
            index,
            config: Arc::new(config),
            cancel,
            runtime,
            tasks: Mutex::new(HashMap::new()),
        };
        for e in endpoints {
            sub.add_endpoint(e);
        }
        Ok(sub)
    }

    /// Registers an endpoint in the index and starts its subscription (restarting it if the
    /// endpoint was already subscribed).
    pub fn add_endpoint(&self, source: EndpointSource) -> EndpointId {
        let id = self.index.register_endpoint(source.spec.clone());
        let token = self.cancel.child_token();
        let Some(slot) = self.index.slot(id) else {
            return id;
        };
        let task = EndpointTask {
            index: self.index.clone(),
            slot,
            source,
            config: Arc::clone(&self.config),
            warn: RateLimit::default(),
        };
        let handle = self.runtime.spawn(task.run(token.clone()));
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((old, _)) = tasks.insert(id.0, (token, handle)) {
            old.cancel();
        }
        id
    }

    /// Stops an endpoint's subscription and drops its holdings from the index.
    pub fn remove_endpoint(&self, id: EndpointId) {
        let entry = self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id.0);
        if let Some((token, _)) = entry {
            token.cancel();
        }
        self.index.remove_endpoint(id);
    }

    /// Stops every endpoint task (holdings stay in the index).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Cancels and waits for every endpoint task to finish.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let tasks: Vec<_> = self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, (_, h))| h)
            .collect();
        for t in tasks {
            let _ = t.await;
        }
    }
}

impl Drop for KvEventSubscriber {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// At most one WARN per interval per endpoint for repetitive problems.
#[derive(Debug, Default)]
struct RateLimit {
    last: Option<tokio::time::Instant>,
}

impl RateLimit {
    fn allow(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        if self
            .last
            .is_some_and(|l| now.duration_since(l) < Duration::from_secs(10))
        {
            return false;
        }
        self.last = Some(now);
        true
    }
}

struct EndpointTask {
    index: KvIndex,
    slot: Arc<EndpointSlot>,
    source: EndpointSource,
    config: Arc<SubscriberConfig>,
    warn: RateLimit,
}

impl EndpointTask {
    fn id(&self) -> EndpointId {
        EndpointId(self.slot.id)
    }

    async fn run(mut self, cancel: CancellationToken) {
        let mut seq = SeqTracker::default();
        let endpoint = self.slot.label.clone();
        loop {
            let mut sock = SubSocket::new();
            let mut monitor = sock.monitor();
            // A new socket is a new connection: its first batch may come from a new process.
            let mut reconnected = !seq.is_fresh();
            if let Err(e) = sock.subscribe(&self.source.topic).await {
                tracing::warn!(endpoint = %endpoint, error = %e, "kv subscribe failed");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                r = sock.connect(&self.source.kv_events) => {
                    if let Err(e) = r {
                        tracing::warn!(endpoint = %endpoint, url = %self.source.kv_events, error = %e, "kv events connect failed");
                        if !self.backoff(&cancel).await { return; }
                        continue;
                    }
                }
            }
            tracing::info!(endpoint = %endpoint, url = %self.source.kv_events, "kv events connected");
            if seq.is_fresh() && self.source.replay.is_some() {
                self.warm(&mut seq, &cancel).await;
            }
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    m = sock.recv() => match m {
                        Ok(m) => {
                            // The socket reconnects by itself; a disconnect it reports makes
                            // the next batch the first of a new connection.
                            while let Ok(event) = monitor.try_recv() {
                                if matches!(event, SocketEvent::Disconnected(_)) {
                                    reconnected = true;
                                }
                            }
                            let first_of_connection = std::mem::take(&mut reconnected);
                            self.on_message(&mut seq, m, first_of_connection, &cancel).await;
                        }
                        Err(e) => {
                            tracing::warn!(endpoint = %endpoint, error = %e, "kv events receive failed, reconnecting");
                            break;
                        }
                    }
                }
            }
            if !self.backoff(&cancel).await {
                return;
            }
        }
    }

    /// Sleeps the reconnect backoff; false when cancelled meanwhile.
    async fn backoff(&self, cancel: &CancellationToken) -> bool {
        tokio::select! {
            _ = cancel.cancelled() => false,
            _ = tokio::time::sleep(self.config.reconnect_backoff) => true,
        }
    }

    /// Applies one live batch; `first_of_connection` marks the first batch received on a
    /// new connection (a forward gap there is taken for an engine restart).
    async fn on_message(
        &mut self,
        tracker: &mut SeqTracker,
        msg: ZmqMessage,
        first_of_connection: bool,
        cancel: &CancellationToken,
    ) {
        let frames = msg.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [_topic, seq, payload] => match seq_of(seq) {
                Some(s) => (s, payload.clone()),
                None => return self.bad_frames(frames.len()),
            },
            _ => return self.bad_frames(frames.len()),
        };
        let label = self.slot.label.clone();
        let step = match tracker.step(seq) {
            SeqStep::Gap { expected } if first_of_connection => {
                tracing::warn!(endpoint = %label, expected, got = seq, "kv event sequence jumped on a new connection: taking it for an engine restart");
                SeqStep::Reset { expected }
            }
            step => step,
        };
        match step {
            SeqStep::InOrder => {}
            SeqStep::Duplicate => return,
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
                self.index.clear_endpoint(self.id());
                self.index.set_degraded(self.id(), false);
                if seq > 0 {
                    self.fill(0, seq, cancel).await;
                }
            }
        }
        self.apply(seq, &payload);
        tracker.advance(seq);
    }

    /// Warm start: replays everything the engine retains, from 0, before the first live
    /// message. An empty or failed replay leaves the tracker fresh (the first live message
    /// then replays `[0, seq)` as before).
    async fn warm(&mut self, tracker: &mut SeqTracker, cancel: &CancellationToken) {
        let Some(url) = self.source.replay.clone() else {
            return;
        };
        let (idle, total) = (
            self.config.replay_idle_timeout,
            self.config.replay_total_timeout,
        );
        let mut last = None;
        let outcome = tokio::select! {
            _ = cancel.cancelled() => return,
            o = replay::replay(&url, 0, replay::END_SEQ, idle, total, |s, p| {
                self.apply(s, p);
                last = Some(s);
            }) => o,
        };
        let label = self.slot.label.clone();
        if let Some(last) = last {
            tracker.replayed_through(last);
            self.slot.metrics.replay_ok.inc();
            tracing::info!(endpoint = %label, until = last + 1, outcome = ?outcome, "kv events replayed on connect (warm start)");
        }
    }

    /// Replays `[from, until)` if possible; marks the endpoint degraded when it cannot.
    async fn fill(&mut self, from: u64, until: u64, cancel: &CancellationToken) {
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
            o = replay::replay(&url, from, until, idle, total, |s, p| self.apply(s, p)) => o,
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

    fn apply(&mut self, seq: u64, payload: &[u8]) {
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
            }
            Err(e) => {
                self.slot.metrics.decode_payload.inc();
                if self.warn.allow() {
                    tracing::warn!(endpoint = %self.slot.label, seq, error = %e, "kv event payload undecodable");
                }
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

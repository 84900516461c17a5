//! ZMQ ingestion: one SUB socket (and task) per endpoint, sequence tracking, DEALER replay,
//! reconnection and restart detection.
//!
//! Live frames are `[topic, seq (8 bytes BE), payload]`. Per endpoint:
//! - connecting: the task owns reconnection. `zeromq`'s SUB socket would reconnect by itself,
//!   but with its own backoff (100 ms doubling to 30 s, not configurable), so an engine back
//!   after a few seconds is reached a second or more late, and whatever it published meanwhile
//!   is lost (PUB drops messages nobody is subscribed to; issue #11: after a restart the index
//!   kept the dead process's holdings and never saw the new one's). Instead, on a disconnect
//!   (the socket monitor's `Disconnected`, or a receive error) the task drops the socket and
//!   connects a fresh one, retrying with a short capped backoff
//!   ([`SubscriberConfig::reconnect_backoff_initial`] doubling to
//!   [`SubscriberConfig::reconnect_backoff`], reset on success);
//! - unconfirmed holdings: from the disconnect until the new connection is reconciled, the
//!   endpoint's holdings are unconfirmed ([`KvIndex::set_unconfirmed`]): they stay in the
//!   index but score nothing, so a dead engine's cache never routes hits;
//! - reconciling on every connection (when a replay endpoint is configured), before the first
//!   live message: everything the engine retains is replayed from 0 and compared with what
//!   was applied (the last applied batch's seq and payload fingerprint):
//!   - first contact: the replay is applied (warm start: a restarted router has its index back
//!     before the engine's next event; if it starts at seq 0 it is the whole history and
//!     replaces whatever the index held);
//!   - the replay holds the last applied batch, byte for byte: same process, the batches after
//!     it are applied;
//!   - the replay's newest seq is below the last applied one, or its batch at that seq differs,
//!     or the engine retains nothing (an engine that published anything retains at least its
//!     latest batch): a new process (restart, counted). The holdings are dropped and the replay
//!     applied; if the replay does not start at 0 (bounded buffer of a new process already far
//!     along) the endpoint is also marked degraded, since its oldest blocks are unknown;
//!   - the replay starts after the last applied batch (a long disconnect outran the engine's
//!     bounded buffer): restart and loss cannot be told apart; the holdings are rebuilt from
//!     the replay and the endpoint marked degraded (it may under-report, never over-report);
//!   - no usable replay (timeout, no replay endpoint): the first live batch decides, as below.
//!
//!   Live batches queued on the new socket meanwhile are deduplicated;
//! - a gap replays `[expected, seq)` through a DEALER, applied in order and deduplicated; a gap
//!   that cannot be filled marks the endpoint degraded (gauge + WARN);
//! - a sequence going backwards is an engine restart: the endpoint's holdings are dropped
//!   (and replayed from 0 when possible). So is a gap forward in the first batch of a new
//!   connection that was not reconciled (issue #11, defect 5); a batch in order after such a
//!   reconnect is the same process; an `AllBlocksCleared` event drops the holdings as it
//!   always did;
//! - malformed frames and payloads are counted and logged with the endpoint, never fatal.
//!
//! Metrics per endpoint: `kvgate_kv_restarts_total` (restarts detected either way),
//! `kvgate_kv_reconnects_total` (connections after the first), `kvgate_kv_unconfirmed`.

mod connect;
mod live;
mod reconcile;
mod replay;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket};

use crate::index::{EndpointId, EndpointSlot, EndpointSpec, KvIndex};
use connect::{Attempt, Backoff};
use replay::SeqTracker;

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
    /// First reconnect delay after a disconnect (default 50 ms); doubles per failed attempt
    /// up to `reconnect_backoff`, and resets once connected.
    pub reconnect_backoff_initial: Duration,
    /// Longest delay between reconnect attempts (default 1 s).
    pub reconnect_backoff: Duration,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        SubscriberConfig {
            replay_idle_timeout: Duration::from_secs(2),
            replay_total_timeout: Duration::from_secs(30),
            reconnect_backoff_initial: Duration::from_millis(50),
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
            last_applied: None,
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
    /// The highest-seq batch applied since the holdings were last dropped: (seq, payload
    /// fingerprint). Reconciliation compares it with the engine's replay.
    last_applied: Option<(u64, u64)>,
}

impl EndpointTask {
    fn id(&self) -> EndpointId {
        EndpointId(self.slot.id)
    }

    async fn run(mut self, cancel: CancellationToken) {
        let mut seq = SeqTracker::default();
        let endpoint = self.slot.label.clone();
        let mut connected_before = false;
        loop {
            let mut backoff = Backoff::new(
                self.config.reconnect_backoff_initial,
                self.config.reconnect_backoff,
            );
            let (mut sock, mut monitor) = loop {
                let mut sock = SubSocket::new();
                let monitor = sock.monitor();
                match self
                    .attempt_connect(&mut sock, backoff.step(), &cancel)
                    .await
                {
                    Attempt::Connected => break (sock, monitor),
                    Attempt::Retry => {}
                    Attempt::Cancelled => return,
                }
            };
            tracing::info!(endpoint = %endpoint, url = %self.source.kv_events, reconnect = connected_before, "kv events connected");
            if connected_before {
                self.slot.metrics.reconnects.inc();
            }
            self.slot.stream.set_connected(true);
            seq.new_connection();
            // Decided by the replay, or (no usable replay) by the first live batch.
            let mut verify_first_live = if self.source.replay.is_some() {
                !self.reconcile(&mut seq, &cancel).await
            } else {
                connected_before
            };
            if cancel.is_cancelled() {
                return;
            }
            if !verify_first_live {
                self.index.set_unconfirmed(self.id(), false);
            }
            connected_before = true;
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    ev = monitor.recv() => match ev {
                        Ok(SocketEvent::Disconnected(_)) | Err(_) => break,
                        Ok(_) => {}
                    },
                    m = sock.recv() => match m {
                        Ok(m) => {
                            let first = std::mem::take(&mut verify_first_live);
                            if self.on_message(&mut seq, m, first, &cancel).await {
                                if first {
                                    self.index.set_unconfirmed(self.id(), false);
                                }
                            } else {
                                verify_first_live = first;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(endpoint = %endpoint, error = %e, "kv events receive failed");
                            break;
                        }
                    }
                }
            }
            // The engine may be gone, or come back as a new process: until the next
            // connection is reconciled its holdings score nothing.
            self.slot.stream.set_connected(false);
            self.index.set_unconfirmed(self.id(), true);
            tracing::warn!(endpoint = %endpoint, url = %self.source.kv_events, "kv events disconnected, reconnecting; holdings unconfirmed until reconciled");
            drop(sock);
        }
    }
}

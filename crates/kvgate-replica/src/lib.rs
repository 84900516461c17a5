//! Router replicas share their in-flight load, so each replica's scorers see the whole fleet's
//! load and not only their own share of it.
//!
//! Every replica publishes what it dispatches on a ZeroMQ PUB socket ([`ReplicaSyncConfig::listen`])
//! and subscribes to every other replica's ([`ReplicaSyncConfig::peers`]). It hears its own
//! dispatches through the [`LoadSink`] the endpoint registry calls, and holds the others' as
//! in-flight guards on its own endpoints (so prefill queued, decode tokens, pinned KV and the
//! pick stamp all count them). The KV index needs no sync: every replica subscribes to every
//! engine's KV events itself.
//!
//! Loss is repaired, not prevented: a heartbeat lists the sender's live requests (see
//! [`message`]), and a replica not heard from for [`ReplicaSyncConfig::peer_timeout`] is
//! forgotten with its requests. A replica restarted draws a new origin id.
//!
//! # Layout
//! - [`message`]: the wire messages.
//! - `remote`: the other replicas' requests, applied to this replica's endpoints.
//! - [`metrics`]: `kvgate_replica_*` families.

pub mod message;
pub mod metrics;
mod remote;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvgate_schedule::{EndpointRegistry, LoadSink, SharedLoad};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

pub use self::message::SyncMessage;
pub use self::metrics::SyncMetrics;
use self::remote::RemoteLoad;

/// Where a replica publishes and whom it listens to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSyncConfig {
    /// ZeroMQ endpoint to bind the PUB socket on, e.g. `tcp://0.0.0.0:5600`.
    pub listen: String,
    /// The other replicas' PUB endpoints. This replica's own address may be listed too (one
    /// list for every replica): its own messages are ignored.
    pub peers: Vec<String>,
    /// How often the live-request list is published (default 250 ms).
    pub heartbeat: Duration,
    /// A replica not heard from for this long is forgotten (default 2 s).
    pub peer_timeout: Duration,
    /// Messages queued for the publisher before new ones are dropped and counted
    /// (default 65,536).
    pub queue: usize,
}

impl ReplicaSyncConfig {
    /// `listen` and `peers` with the default timings.
    pub fn new(listen: impl Into<String>, peers: Vec<String>) -> ReplicaSyncConfig {
        ReplicaSyncConfig {
            listen: listen.into(),
            peers,
            heartbeat: Duration::from_millis(250),
            peer_timeout: Duration::from_secs(2),
            queue: 65_536,
        }
    }
}

/// Why the sync did not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaSyncError {
    /// The PUB socket did not bind.
    #[error("replica_sync.listen {addr}: {reason}")]
    Bind {
        /// The configured address.
        addr: String,
        /// What the socket said.
        reason: String,
    },
    /// The configuration is unusable.
    #[error("replica_sync: {0}")]
    Config(String),
}

/// A running replica sync: the [`LoadSink`] of this replica's endpoints, a publisher task and
/// one subscriber task per peer (stopped by the cancel token given to [`ReplicaSync::start`]).
#[derive(Debug)]
pub struct ReplicaSync {
    origin: u64,
    tx: mpsc::Sender<SyncMessage>,
    /// This replica's requests in flight: id → still prefilling.
    live: Arc<Mutex<HashMap<u64, bool>>>,
    metrics: SyncMetrics,
    remote: Arc<RemoteLoad>,
    bound: String,
}

impl ReplicaSync {
    /// Binds the PUB socket, connects to the peers in the background and makes the sync the
    /// load sink of every endpoint in `registry`.
    ///
    /// # Errors
    /// [`ReplicaSyncError`] when the listen address does not bind or the timings are zero.
    pub async fn start(
        config: ReplicaSyncConfig,
        registry: Arc<EndpointRegistry>,
        metrics: SyncMetrics,
        cancel: CancellationToken,
    ) -> Result<Arc<ReplicaSync>, ReplicaSyncError> {
        if config.heartbeat.is_zero() || config.peer_timeout <= config.heartbeat {
            return Err(ReplicaSyncError::Config(format!(
                "peer_timeout ({:?}) must exceed a non-zero heartbeat ({:?})",
                config.peer_timeout, config.heartbeat
            )));
        }
        if config.queue == 0 {
            return Err(ReplicaSyncError::Config("queue must be at least 1".into()));
        }
        let mut socket = PubSocket::new();
        let bound = socket
            .bind(&config.listen)
            .await
            .map_err(|e| ReplicaSyncError::Bind {
                addr: config.listen.clone(),
                reason: e.to_string(),
            })?
            .to_string();
        let origin = rand::random::<u64>();
        let (tx, rx) = mpsc::channel(config.queue);
        let remote = Arc::new(RemoteLoad::new(
            Arc::clone(&registry),
            origin,
            metrics.clone(),
        ));
        let sync = Arc::new(ReplicaSync {
            origin,
            tx,
            live: Arc::default(),
            metrics: metrics.clone(),
            remote: Arc::clone(&remote),
            bound: bound.clone(),
        });
        tracing::info!(origin = %format!("{origin:016x}"), listen = %bound, peers = ?config.peers, "replica sync started");
        tokio::spawn(publish(
            socket,
            rx,
            Arc::clone(&sync.live),
            origin,
            config.heartbeat,
            metrics.clone(),
            cancel.clone(),
        ));
        for peer in config.peers.iter().filter(|p| **p != bound) {
            tokio::spawn(subscribe(
                peer.clone(),
                Arc::clone(&remote),
                config.heartbeat,
                metrics.clone(),
                cancel.clone(),
            ));
        }
        tokio::spawn(expire(
            remote,
            config.heartbeat,
            config.peer_timeout,
            cancel,
        ));
        registry.share_load(Arc::clone(&sync) as Arc<dyn LoadSink>);
        Ok(sync)
    }

    /// The bound PUB endpoint (with the port the OS chose for `:0`).
    pub fn local_addr(&self) -> &str {
        &self.bound
    }

    /// Replicas heard from within the peer timeout, and their requests in flight here.
    pub fn remote_state(&self) -> (usize, usize) {
        self.remote.state()
    }

    fn queue(&self, m: SyncMessage) {
        if self.tx.try_send(m).is_err() {
            self.metrics.dropped("queue_full");
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, bool>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl LoadSink for ReplicaSync {
    fn begin(&self, id: u64, endpoint: &str, load: &SharedLoad) {
        self.live().insert(id, true);
        self.queue(SyncMessage::begin(self.origin, id, endpoint, load));
    }

    fn prefill_done(&self, id: u64) {
        if let Some(p) = self.live().get_mut(&id) {
            *p = false;
        }
        self.queue(SyncMessage::PrefillDone {
            origin: self.origin,
            id,
        });
    }

    fn end(&self, id: u64) {
        self.live().remove(&id);
        self.queue(SyncMessage::End {
            origin: self.origin,
            id,
        });
    }
}

/// Sends queued messages in order, and a heartbeat every `heartbeat`.
async fn publish(
    mut socket: PubSocket,
    mut rx: mpsc::Receiver<SyncMessage>,
    live: Arc<Mutex<HashMap<u64, bool>>>,
    origin: u64,
    heartbeat: Duration,
    metrics: SyncMetrics,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let m = tokio::select! {
            _ = cancel.cancelled() => return,
            m = rx.recv() => match m {
                Some(m) => m,
                None => return,
            },
            _ = tick.tick() => {
                let live = live.lock().unwrap_or_else(PoisonError::into_inner);
                SyncMessage::Heartbeat { origin, live: live.iter().map(|(k, v)| (*k, *v)).collect() }
            }
        };
        let kind = m.kind();
        match socket.send(ZmqMessage::from(m.encode())).await {
            Ok(()) => metrics.sent(kind),
            Err(e) => {
                metrics.dropped("send");
                tracing::warn!(error = %e, "replica sync send failed");
            }
        }
    }
}

/// Receives one peer's messages, reconnecting after errors.
async fn subscribe(
    peer: String,
    remote: Arc<RemoteLoad>,
    backoff: Duration,
    metrics: SyncMetrics,
    cancel: CancellationToken,
) {
    loop {
        let mut sock = SubSocket::new();
        if let Err(e) = sock.subscribe("").await {
            tracing::warn!(peer = %peer, error = %e, "replica sync subscribe failed");
        }
        // `connect` waits for the peer to exist, retrying at its own (slower) pace; bound each
        // try so a peer that starts later is joined within about a second.
        let bound = backoff.max(Duration::from_secs(1));
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(bound, sock.connect(&peer)) => match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(peer = %peer, error = %e, "replica sync connect failed");
                    if !pause(backoff, &cancel).await { return; }
                    continue;
                }
                Err(_) => {
                    tracing::debug!(peer = %peer, "replica sync peer not up yet");
                    continue;
                }
            }
        }
        tracing::info!(peer = %peer, "replica sync connected");
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                m = sock.recv() => match m {
                    Ok(m) => for frame in m.into_vec() {
                        match SyncMessage::decode(&frame) {
                            Ok(m) => { remote.apply(m, Instant::now()); }
                            Err(e) => {
                                metrics.dropped("decode");
                                tracing::warn!(peer = %peer, error = %e, bytes = frame.len(), "replica sync message not understood, skipped");
                            }
                        }
                    },
                    Err(e) => {
                        tracing::warn!(peer = %peer, error = %e, "replica sync receive failed, reconnecting");
                        break;
                    }
                }
            }
        }
        if !pause(backoff, &cancel).await {
            return;
        }
    }
}

/// Forgets silent replicas, checking every `every`.
async fn expire(
    remote: Arc<RemoteLoad>,
    every: Duration,
    timeout: Duration,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => { remote.expire(Instant::now(), timeout); }
        }
    }
}

/// Sleeps `d`; false when cancelled meanwhile.
async fn pause(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

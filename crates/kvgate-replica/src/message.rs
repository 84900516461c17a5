//! What replicas tell each other, one msgpack-encoded [`SyncMessage`] per ZeroMQ message.
//!
//! Every message names its `origin`, a random id a replica draws at start (a restarted replica
//! is a new origin), and request ids unique within that origin. A publisher sends in order, so a
//! [`SyncMessage::Heartbeat`] lists every request of its origin still in flight after all the
//! messages sent before it: a receiver drops what the list lacks, repairing lost messages.

use kvgate_schedule::SharedLoad;
use serde::{Deserialize, Serialize};

/// One replica-to-replica message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyncMessage {
    /// Request `id` was dispatched to `endpoint` (`host:port`).
    Begin {
        /// The sending replica.
        origin: u64,
        /// The request, unique within `origin`.
        id: u64,
        /// Endpoint name, `host:port`.
        endpoint: String,
        /// Uncached prompt tokens (prefill work).
        uncached_tokens: u64,
        /// Whole prompt tokens.
        prompt_tokens: u64,
        /// Block size of `keys`.
        block_size: u32,
        /// The prompt's router block keys.
        keys: Vec<u64>,
    },
    /// Request `id` reached its first response byte.
    PrefillDone {
        /// The sending replica.
        origin: u64,
        /// The request.
        id: u64,
    },
    /// Request `id` ended.
    End {
        /// The sending replica.
        origin: u64,
        /// The request.
        id: u64,
    },
    /// The origin is alive; these requests are in flight (`true`: still prefilling).
    Heartbeat {
        /// The sending replica.
        origin: u64,
        /// Every request of `origin` in flight, with whether it is still prefilling.
        live: Vec<(u64, bool)>,
    },
}

impl SyncMessage {
    /// A `Begin` for `load`.
    pub fn begin(origin: u64, id: u64, endpoint: &str, load: &SharedLoad) -> SyncMessage {
        SyncMessage::Begin {
            origin,
            id,
            endpoint: endpoint.to_owned(),
            uncached_tokens: load.uncached_tokens,
            prompt_tokens: load.prompt_tokens,
            block_size: load.block_size,
            keys: load.keys.clone(),
        }
    }

    /// The sending replica.
    pub fn origin(&self) -> u64 {
        match self {
            SyncMessage::Begin { origin, .. }
            | SyncMessage::PrefillDone { origin, .. }
            | SyncMessage::End { origin, .. }
            | SyncMessage::Heartbeat { origin, .. } => *origin,
        }
    }

    /// A metric label for the message kind.
    pub fn kind(&self) -> &'static str {
        match self {
            SyncMessage::Begin { .. } => "begin",
            SyncMessage::PrefillDone { .. } => "prefill_done",
            SyncMessage::End { .. } => "end",
            SyncMessage::Heartbeat { .. } => "heartbeat",
        }
    }

    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        // invariant: these plain enums always serialize.
        rmp_serde::to_vec(self).unwrap_or_default()
    }

    /// Parses the wire form.
    ///
    /// # Errors
    /// The bytes are not one message.
    pub fn decode(bytes: &[u8]) -> Result<SyncMessage, rmp_serde::decode::Error> {
        rmp_serde::from_slice(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips() {
        let load = SharedLoad {
            uncached_tokens: 7,
            prompt_tokens: 40,
            block_size: 16,
            keys: vec![1, u64::MAX],
        };
        for m in [
            SyncMessage::begin(9, 1, "h:1", &load),
            SyncMessage::PrefillDone { origin: 9, id: 1 },
            SyncMessage::End { origin: 9, id: 1 },
            SyncMessage::Heartbeat {
                origin: 9,
                live: vec![(1, true), (2, false)],
            },
        ] {
            assert_eq!(SyncMessage::decode(&m.encode()).unwrap(), m, "{}", m.kind());
        }
    }

    #[test]
    fn garbage_is_an_error() {
        for bad in [&b""[..], b"\xc1", b"\x92\x01"] {
            assert!(SyncMessage::decode(bad).is_err(), "{bad:?}");
        }
    }
}

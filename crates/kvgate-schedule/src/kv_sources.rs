//! What an engine's `GET /kv_event_sources` says (vLLM ≥ 0.32,
//! `vllm/entrypoints/serve/instrumentator/basic.py`): the KV-event publisher config of each
//! data-parallel rank, keyed by the rank as a string, each with vLLM's `KVEventsConfig` fields
//! (`enable_kv_cache_events`, `publisher`, `endpoint`, `replay_endpoint`, `buffer_steps`,
//! `hwm`, `max_queue_size`, `topic`). A render-only server, or one with events off, answers
//! `{}`. With data parallelism each rank's publisher already has its own port.
//!
//! [`parse_kv_event_sources`] turns the answer into addresses the router can connect to:
//! only `publisher: "zmq"` with `enable_kv_cache_events: true` counts, and a wildcard host
//! (`*`, `0.0.0.0`, `::`, `[::]`, empty) in `tcp://HOST:PORT` — the engine bound every
//! interface — is replaced by the engine URL's host. A specific host is used as given (vLLM
//! reports the address it bound for `tcp://*:0`). The body is untrusted input: anything
//! unexpected is a reason, never a panic.

use std::fmt;
use std::net::IpAddr;

use serde::Serialize;
use serde_json::{Map, Value};

/// Largest `/kv_event_sources` body the router reads (a few hundred bytes per rank).
pub const MAX_KV_SOURCES_BODY: usize = 256 << 10;

/// Ranks read from one answer at most (vLLM's data-parallel sizes are far smaller).
const MAX_RANKS: usize = 1024;

/// One data-parallel rank's KV-event publisher, with addresses the router connects to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct KvEventSource {
    /// The data-parallel rank (the answer's key).
    pub rank: u32,
    /// PUB endpoint to subscribe to, e.g. `tcp://10.0.0.1:5557`.
    pub events: String,
    /// Replay ROUTER endpoint, when the engine has one.
    pub replay: Option<String>,
    /// The publisher's topic (frame 0 of every message; the SUB prefix filter).
    pub topic: String,
    /// The events host was a wildcard, replaced by the engine URL's host (so only the port
    /// is the engine's word).
    pub host_substituted: bool,
}

impl fmt::Display for KvEventSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} {}", self.rank, self.events)?;
        match &self.replay {
            Some(r) => write!(f, ", replay {r}")?,
            None => f.write_str(", no replay")?,
        }
        if !self.topic.is_empty() {
            write!(f, ", topic {:?}", self.topic)?;
        }
        Ok(())
    }
}

/// What one read of an engine's `/kv_event_sources` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvSourcesRead {
    /// At least one rank publishes over ZMQ. `sources` is sorted by rank; `notes` says what
    /// was ignored (another rank's unusable publisher, a bad replay endpoint) and why.
    Found {
        /// The usable publishers, by rank.
        sources: Vec<KvEventSource>,
        /// What was ignored, and why.
        notes: Vec<String>,
    },
    /// The engine answered and publishes nothing the router can subscribe to: why.
    NoSource(String),
    /// No answer to go by (404, a timeout, a body that is not a JSON object): why. Whatever
    /// an earlier read found stays in force.
    Unreadable(String),
}

impl KvSourcesRead {
    /// The source the router subscribes to: the lowest usable rank.
    pub fn primary(&self) -> Option<&KvEventSource> {
        match self {
            KvSourcesRead::Found { sources, .. } => sources.first(),
            _ => None,
        }
    }

    /// The answer in words, for logs, `kvgate doctor` and `/debug/state`.
    pub fn describe(&self) -> String {
        match self {
            KvSourcesRead::Found { sources, notes } => {
                let list: Vec<String> = sources.iter().map(ToString::to_string).collect();
                let mut s = list.join("; ");
                if !notes.is_empty() {
                    s.push_str(" (ignored: ");
                    s.push_str(&notes.join("; "));
                    s.push(')');
                }
                s
            }
            KvSourcesRead::NoSource(why) => format!("no usable publisher: {why}"),
            KvSourcesRead::Unreadable(why) => format!("not read: {why}"),
        }
    }
}

/// Reads a `/kv_event_sources` body (see the module docs). `engine_host` is the host of the
/// engine's URL (`10.0.0.1`, `engine-a`, `[fd00::1]` or `fd00::1`), which replaces a wildcard
/// host.
pub fn parse_kv_event_sources(body: &[u8], engine_host: &str) -> KvSourcesRead {
    let value: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return KvSourcesRead::Unreadable(format!("body is not JSON ({e})")),
    };
    let Some(ranks) = value.as_object() else {
        return KvSourcesRead::Unreadable("body is not a JSON object".into());
    };
    if ranks.is_empty() {
        return KvSourcesRead::NoSource(
            "the engine reports no KV-event publisher (`{}`: events off, or a render-only server)"
                .into(),
        );
    }
    let mut sources = Vec::new();
    let mut notes = Vec::new();
    for (key, config) in ranks.iter().take(MAX_RANKS) {
        let Ok(rank) = key.parse::<u32>() else {
            notes.push(format!("key {key:?} is not a data-parallel rank"));
            continue;
        };
        match rank_source(rank, config, engine_host, &mut notes) {
            Ok(s) => sources.push(s),
            Err(why) => notes.push(format!("rank {rank}: {why}")),
        }
    }
    if ranks.len() > MAX_RANKS {
        notes.push(format!("ranks after the first {MAX_RANKS}"));
    }
    if sources.is_empty() {
        return KvSourcesRead::NoSource(notes.join("; "));
    }
    sources.sort_by_key(|s| s.rank);
    KvSourcesRead::Found { sources, notes }
}

/// One rank's `KVEventsConfig` as a source; `Err`: why it is not one.
fn rank_source(
    rank: u32,
    config: &Value,
    engine_host: &str,
    notes: &mut Vec<String>,
) -> Result<KvEventSource, String> {
    let Some(config) = config.as_object() else {
        return Err("its config is not a JSON object".into());
    };
    if config
        .get("enable_kv_cache_events")
        .and_then(Value::as_bool)
        != Some(true)
    {
        return Err("enable_kv_cache_events is not true".into());
    }
    // vLLM's default publisher with events enabled is "zmq".
    match config.get("publisher") {
        None | Some(Value::Null) => {}
        Some(Value::String(p)) if p == "zmq" => {}
        Some(Value::String(p)) => {
            return Err(format!(
                "publisher {p:?} (only \"zmq\" can be subscribed to)"
            ));
        }
        Some(other) => return Err(format!("publisher {other} is not a string")),
    }
    let endpoint = string_field(config, "endpoint")
        .ok_or_else(|| "no endpoint".to_owned())?
        .ok_or_else(|| "endpoint is not a string".to_owned())?;
    let (events, host_substituted) = connectable(endpoint, engine_host)?;
    let replay = match string_field(config, "replay_endpoint") {
        None => None,
        Some(None) => {
            notes.push(format!("rank {rank}: replay_endpoint is not a string"));
            None
        }
        Some(Some(r)) => match connectable(r, engine_host) {
            Ok((r, _)) => Some(r),
            Err(why) => {
                notes.push(format!("rank {rank}: replay_endpoint {r:?}: {why}"));
                None
            }
        },
    };
    let topic = match string_field(config, "topic") {
        None => String::new(),
        Some(Some(t)) => t.to_owned(),
        Some(None) => {
            notes.push(format!(
                "rank {rank}: topic is not a string (every topic is subscribed)"
            ));
            String::new()
        }
    };
    Ok(KvEventSource {
        rank,
        events,
        replay,
        topic,
        host_substituted,
    })
}

/// `None`: absent or null; `Some(None)`: present but not a string.
fn string_field<'a>(config: &'a Map<String, Value>, name: &str) -> Option<Option<&'a str>> {
    match config.get(name) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_str()),
    }
}

/// A `tcp://HOST:PORT` the engine reports, as an address to connect to, and whether its
/// host was a wildcard replaced by `engine_host`.
pub fn connectable(endpoint: &str, engine_host: &str) -> Result<(String, bool), String> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(match endpoint.split_once("://") {
            Some((scheme, _)) => format!(
                "{endpoint:?}: a {scheme}:// socket is local to the engine's host (kvgate connects over tcp://)"
            ),
            None => format!("{endpoint:?} is not tcp://HOST:PORT"),
        });
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return Err(format!("{endpoint:?} has no port"));
    };
    let port = match port.parse::<u16>() {
        Ok(0) => return Err(format!("{endpoint:?}: port 0 is not a bound port")),
        Ok(p) => p,
        Err(_) => return Err(format!("{endpoint:?}: port {port:?} is not a number")),
    };
    if is_wildcard(host) {
        let host = bracketed(engine_host.trim());
        if host.is_empty() {
            return Err(format!("{endpoint:?}: no engine host to replace it with"));
        }
        return Ok((format!("tcp://{host}:{port}"), true));
    }
    Ok((format!("tcp://{}:{port}", bracketed(host)), false))
}

/// `*`, an empty host or an unspecified address (`0.0.0.0`, `::`, `[::]`).
fn is_wildcard(host: &str) -> bool {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host == "*" || bare.is_empty() || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified())
}

/// An IPv6 literal in brackets (as a ZMQ or URL authority needs), anything else as is.
fn bracketed(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

#[cfg(test)]
mod tests;

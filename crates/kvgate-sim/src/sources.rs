//! `GET /kv_event_sources`, as vLLM ≥ 0.32 answers it
//! (`vllm/entrypoints/serve/instrumentator/basic.py`): each DP rank's resolved
//! `KVEventsConfig`, keyed by the rank as a string, `{}` with KV events off. The endpoints are
//! the configured ones with the rank's port offset and the port actually bound: a `*` or `::`
//! host stays as configured (`tcp://*:5557`), so a router has to put the engine's host in.

use serde_json::{Map, Value, json};

use crate::publisher::EventAddrs;

/// vLLM's `KVEventsConfig.hwm` and `max_queue_size` defaults (the sim has neither limit).
const VLLM_QUEUE_DEFAULT: u64 = 100_000;

/// The answer for one server whose ranks' publishers were configured with `endpoint` /
/// `replay_endpoint` and ended up at `bound` (one per rank; empty: events off).
pub(crate) fn kv_event_sources(
    endpoint: &str,
    replay_endpoint: Option<&str>,
    topic: &str,
    buffer_steps: usize,
    bound: &[EventAddrs],
) -> Value {
    let mut ranks = Map::new();
    for (rank, addrs) in bound.iter().enumerate() {
        let replay = match (replay_endpoint, &addrs.replay) {
            (Some(configured), Some(b)) => Value::String(reported(configured, b)),
            _ => Value::Null,
        };
        ranks.insert(
            rank.to_string(),
            json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": reported(endpoint, &addrs.events),
                "replay_endpoint": replay,
                "buffer_steps": buffer_steps,
                "hwm": VLLM_QUEUE_DEFAULT,
                "max_queue_size": VLLM_QUEUE_DEFAULT,
                "topic": topic,
            }),
        );
    }
    Value::Object(ranks)
}

/// `bound` (`tcp://0.0.0.0:43123`) reported as vLLM would: with the configured wildcard host
/// (`*`, or one holding `::`) when there was one, else as bound or connected.
fn reported(configured: &str, bound: &str) -> String {
    let host = configured
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .map(|(host, _)| host);
    let port = bound.rsplit_once(':').map(|(_, port)| port);
    match (host, port) {
        (Some(host), Some(port)) if host == "*" || host.contains("::") => {
            format!("tcp://{host}:{port}")
        }
        _ => bound.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_stay_and_ports_are_the_bound_ones() {
        let bound = |events: &str, replay: Option<&str>| EventAddrs {
            events: events.into(),
            replay: replay.map(str::to_owned),
        };
        let ranks = [
            bound("tcp://0.0.0.0:41000", Some("tcp://0.0.0.0:42000")),
            bound("tcp://0.0.0.0:41001", Some("tcp://0.0.0.0:42001")),
        ];
        let v = kv_event_sources("tcp://*:0", Some("tcp://*:0"), "t", 7, &ranks);
        assert_eq!(v["0"]["endpoint"], "tcp://*:41000");
        assert_eq!(v["0"]["replay_endpoint"], "tcp://*:42000");
        assert_eq!(v["1"]["endpoint"], "tcp://*:41001");
        assert_eq!(v["1"]["publisher"], "zmq");
        assert_eq!(v["1"]["enable_kv_cache_events"], true);
        assert_eq!(v["1"]["topic"], "t");
        assert_eq!(v["1"]["buffer_steps"], 7);

        let v = kv_event_sources("tcp://127.0.0.1:0", None, "", 7, &ranks[..1]);
        assert_eq!(v["0"]["endpoint"], "tcp://0.0.0.0:41000", "as bound");
        assert_eq!(v["0"]["replay_endpoint"], Value::Null);
        let v = kv_event_sources(
            "tcp://[::]:5557",
            None,
            "",
            7,
            &[bound("tcp://[::]:5557", None)],
        );
        assert_eq!(v["0"]["endpoint"], "tcp://[::]:5557");
        assert_eq!(
            kv_event_sources("tcp://*:5557", None, "", 7, &[]),
            json!({})
        );
    }
}

//! File discovery: the endpoint list in a YAML/JSON file, re-read every `poll_ms` and applied
//! when its content changes.
//!
//! The file is compared by content, not modification time, for the same reasons as the
//! `kvgate serve` config watcher: a Kubernetes ConfigMap update swaps a symlink, copies may
//! keep the old time, two writes may fall within the clock's resolution. Reading a small file
//! every second costs microseconds. A file that cannot be read or parsed (an empty one
//! included: write an empty list as `[]`) is logged and counted once per distinct content, and
//! the last good list stays applied.

use std::path::Path;
use std::time::Duration;

use kvgate_schedule::EndpointConfig;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::config::FileSourceConfig;
use crate::publish::Publisher;

/// The file as a map: `endpoints:` as in `kvgate.yaml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointsMap {
    endpoints: Vec<EndpointConfig>,
}

/// Parses an endpoints file: a list of endpoints (`[{url: …}, …]`), or a map with one
/// `endpoints:` key in the shape of `kvgate.yaml`'s section. Each endpoint takes the keys of
/// [`EndpointConfig`]: `url`, `labels`, `kv_events`, `kv_replay`, `model`, `block_size`.
/// JSON is accepted too (it is YAML).
///
/// # Errors
/// A description of why neither shape parsed, or that the file is empty.
pub fn parse_endpoints(text: &str) -> Result<Vec<EndpointConfig>, String> {
    if text.trim().is_empty() {
        return Err("the file is empty (write an empty list as `[]`)".into());
    }
    let as_map = match serde_saphyr::from_str::<EndpointsMap>(text) {
        Ok(m) => return Ok(m.endpoints),
        Err(e) => e,
    };
    match serde_saphyr::from_str::<Vec<EndpointConfig>>(text) {
        Ok(list) => Ok(list),
        Err(as_list) => Err(format!(
            "not an endpoint list ({as_list}) nor a map with `endpoints:` ({as_map})"
        )),
    }
}

/// What the watcher last looked at.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Unreadable(String),
    Content(Vec<u8>),
}

/// Reads the file once (at start, so a bad file fails the start).
pub(crate) fn read_initial(path: &Path) -> Result<(Vec<u8>, Vec<EndpointConfig>), String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let list = parse_endpoints(&String::from_utf8_lossy(&bytes))?;
    Ok((bytes, list))
}

/// Polls the file until `cancel`. `initial` is the content already applied.
pub(crate) async fn run(
    config: FileSourceConfig,
    initial: Vec<u8>,
    mut publisher: Publisher,
    cancel: CancellationToken,
) {
    let mut seen = Seen::Content(initial);
    let mut tick = tokio::time::interval(Duration::from_millis(config.poll_ms.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let path = config.path.display().to_string();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let bytes = match tokio::fs::read(&config.path).await {
            Ok(bytes) => bytes,
            Err(e) => {
                let now = Seen::Unreadable(e.kind().to_string());
                if seen != now {
                    publisher.error(
                        &format!("endpoints file {path} unreadable; keeping the last good list"),
                        &e,
                    );
                    seen = now;
                }
                continue;
            }
        };
        if matches!(&seen, Seen::Content(old) if *old == bytes) {
            continue;
        }
        let parsed = parse_endpoints(&String::from_utf8_lossy(&bytes));
        seen = Seen::Content(bytes);
        match parsed {
            Ok(list) => {
                let _ = publisher.publish(list);
            }
            Err(e) => publisher.error(
                &format!("endpoints file {path} invalid; keeping the last good list"),
                &e,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_list_map_and_json_and_rejects_the_rest() {
        let list = parse_endpoints(
            "- url: http://a:8000\n  labels: {role: decode}\n- url: http://b:8000\n",
        )
        .unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].labels["role"], "decode");
        let map = parse_endpoints(
            "endpoints:\n  - url: http://a:8000\n    kv_events: tcp://a:5557\n    model: m\n",
        )
        .unwrap();
        assert_eq!(map[0].kv_events.as_deref(), Some("tcp://a:5557"));
        let json = parse_endpoints(r#"{"endpoints": [{"url": "http://c:1"}]}"#).unwrap();
        assert_eq!(json, vec![EndpointConfig::new("http://c:1")]);
        assert_eq!(parse_endpoints("[]").unwrap(), Vec::new());
        assert!(parse_endpoints("").is_err());
        assert!(parse_endpoints("- url: http://a:1\n  colour: red\n").is_err());
        let e = parse_endpoints("endpoints: 3\n").unwrap_err();
        assert!(e.contains("endpoints"), "{e}");
    }
}

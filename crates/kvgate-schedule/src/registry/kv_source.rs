//! An endpoint's KV-event source: configured (`kv=`/`replay=` flags, YAML
//! `kv_events`/`kv_replay`) or found through the engine's `/kv_event_sources`
//! ([`crate::KvSourcesRead`]). A configured value always wins, field by field:
//!
//! - configured `kv_events`: subscribed as given. When the engine reports the same socket,
//!   its topic is used, and its replay endpoint too unless `kv_replay` is configured;
//! - no `kv_events`, a discovered publisher: its events, replay (unless `kv_replay` is
//!   configured) and topic;
//! - neither: no KV events (approximate routing), as before discovery existed.
//!
//! A configured socket contradicts the engine's when the ports differ, or when both name an
//! IP address and they differ while the engine reported a specific host (a wildcard host
//! replaced by the engine URL's is only a guess, and an engine bound to every interface is
//! reachable under any of its names). A configured `kv_events` on an engine that reports no
//! publisher is a contradiction too. Each is a [`Conflict`] of field `kv_events` or
//! `kv_replay`.

use std::net::IpAddr;

use serde::Serialize;

use std::sync::PoisonError;

use super::discovered::{Conflict, Discovered};
use super::{EndpointConfig, EndpointRegistry};
use crate::kv_sources::{KvEventSource, KvSourcesRead};

/// Where a KV-event address came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvOrigin {
    /// A flag or YAML value.
    Configured,
    /// The engine's `/kv_event_sources`.
    Discovered,
}

impl KvOrigin {
    /// `configured` or `discovered`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvOrigin::Configured => "configured",
            KvOrigin::Discovered => "discovered",
        }
    }
}

/// The KV-event source an endpoint subscribes to (once its model is known).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvSourceInfo {
    /// Where the events address came from.
    pub origin: KvOrigin,
    /// PUB endpoint, e.g. `tcp://10.0.0.1:5557`.
    pub events: String,
    /// Replay ROUTER endpoint (`None`: no replay).
    pub replay: Option<String>,
    /// Where the replay address came from.
    pub replay_origin: Option<KvOrigin>,
    /// SUB prefix filter (the publisher's topic; `""`: every message).
    pub topic: String,
    /// The engine's data-parallel rank these events are of.
    pub rank: u32,
}

/// Combines `c`'s configured sockets with the engine's last answer (`None`: never read).
pub(crate) fn kv_source(
    c: &EndpointConfig,
    found: Option<&KvSourcesRead>,
) -> (Option<KvSourceInfo>, Vec<Conflict>) {
    let mut conflicts = Vec::new();
    let engine = found.and_then(KvSourcesRead::primary);
    let Some(events) = &c.kv_events else {
        let Some(p) = engine else {
            return (None, conflicts);
        };
        let (replay, replay_origin) = replay(c, p, &mut conflicts);
        let info = KvSourceInfo {
            origin: KvOrigin::Discovered,
            events: p.events.clone(),
            replay,
            replay_origin,
            topic: p.topic.clone(),
            rank: p.rank,
        };
        return (Some(info), conflicts);
    };
    if let Some(KvSourcesRead::NoSource(why)) = found {
        conflicts.push(Conflict {
            field: "kv_events",
            configured: events.clone(),
            discovered: format!("no publisher ({why})"),
        });
    }
    let agreeing = engine.filter(|p| {
        let same = same_socket(events, &p.events, p.host_substituted);
        if !same {
            conflicts.push(Conflict {
                field: "kv_events",
                configured: events.clone(),
                discovered: p.events.clone(),
            });
        }
        same
    });
    let (replay, replay_origin) = match agreeing {
        Some(p) => replay(c, p, &mut conflicts),
        None => (
            c.kv_replay.clone(),
            c.kv_replay.as_ref().map(|_| KvOrigin::Configured),
        ),
    };
    let info = KvSourceInfo {
        origin: KvOrigin::Configured,
        events: events.clone(),
        replay,
        replay_origin,
        topic: agreeing.map(|p| p.topic.clone()).unwrap_or_default(),
        rank: agreeing.map_or(0, |p| p.rank),
    };
    (Some(info), conflicts)
}

/// The replay socket next to `p`'s events: the configured one (checked against the
/// engine's), else the engine's.
fn replay(
    c: &EndpointConfig,
    p: &KvEventSource,
    conflicts: &mut Vec<Conflict>,
) -> (Option<String>, Option<KvOrigin>) {
    let Some(configured) = &c.kv_replay else {
        return (
            p.replay.clone(),
            p.replay.as_ref().map(|_| KvOrigin::Discovered),
        );
    };
    let discovered = match &p.replay {
        Some(r) if same_socket(configured, r, p.host_substituted) => None,
        Some(r) => Some(r.clone()),
        None => Some("no replay endpoint".to_owned()),
    };
    if let Some(discovered) = discovered {
        conflicts.push(Conflict {
            field: "kv_replay",
            configured: configured.clone(),
            discovered,
        });
    }
    (Some(configured.clone()), Some(KvOrigin::Configured))
}

/// Whether a configured `tcp://HOST:PORT` and the engine's name the same socket (see the
/// module docs).
fn same_socket(configured: &str, engine: &str, engine_host_guessed: bool) -> bool {
    let (Some((ch, cp)), Some((eh, ep))) = (host_port(configured), host_port(engine)) else {
        return configured == engine;
    };
    if cp != ep {
        return false;
    }
    if engine_host_guessed {
        return true;
    }
    match (ch.parse::<IpAddr>(), eh.parse::<IpAddr>()) {
        (Ok(a), Ok(b)) => a == b || a.is_unspecified(),
        _ => true,
    }
}

/// `(host without brackets, port)` of `tcp://HOST:PORT`.
fn host_port(endpoint: &str) -> Option<(&str, &str)> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Some((host, port))
}

impl EndpointRegistry {
    /// The KV-event source of the endpoint at `url` (configured or discovered; `None`: no
    /// KV events), and its engine's last `/kv_event_sources` answer in words (`None`: not
    /// asked yet).
    pub fn kv_source(&self, url: &str) -> (Option<KvSourceInfo>, Option<String>) {
        let source = self
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(url)
            .and_then(|e| e.effective.kv.clone());
        let unread = self
            .discovered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(url)
            .and_then(|d| match (&d.kv_unread, &d.kv) {
                (Some(why), _) => Some(format!("not read: {why}")),
                (None, Some(read)) => Some(read.describe()),
                (None, None) => None,
            });
        (source, unread)
    }
}

/// Records one `/kv_event_sources` read of `url` in `d`, logging it when it changes what is
/// known: a found or absent publisher replaces the last answer; an unreadable one is noted
/// (and logged once) but keeps it. `configured`: the endpoint's `kv_events`, which wins.
pub(super) fn note_kv_read(
    url: &str,
    d: &mut Discovered,
    read: KvSourcesRead,
    configured: Option<&str>,
) {
    let approx = if configured.is_some() {
        "the configured kv_events is used"
    } else {
        "routed without KV events unless kv= is given"
    };
    if let KvSourcesRead::Unreadable(why) = read {
        if d.kv_unread.as_deref() != Some(why.as_str()) {
            match &d.kv {
                Some(last) => {
                    tracing::info!(endpoint = url, reason = %why, "KV event sources not read this time ({why}); keeping the last answer: {}", last.describe())
                }
                None => {
                    tracing::info!(endpoint = url, reason = %why, "KV event sources not read from /kv_event_sources ({why}); {approx}")
                }
            }
            d.kv_unread = Some(why);
        }
        return;
    }
    d.kv_unread = None;
    if d.kv.as_ref() == Some(&read) {
        return;
    }
    match &read {
        KvSourcesRead::Found { sources, notes } => {
            let Some(used) = sources.first() else {
                return;
            };
            tracing::info!(
                endpoint = url,
                events = %used.events,
                replay = used.replay.as_deref().unwrap_or("-"),
                topic = %used.topic,
                ranks = sources.len(),
                "KV events found at /kv_event_sources: {}{}",
                read.describe(),
                if configured.is_some() { "; the configured kv_events is used" } else { "" }
            );
            if sources.len() > 1 {
                tracing::warn!(
                    endpoint = url,
                    ranks = sources.len(),
                    rank = used.rank,
                    "engine {url} reports {} data-parallel ranks; only rank {}'s KV events are used: kvgate schedules one endpoint per URL and does not pin requests to a rank (X-data-parallel-rank), so requests the engine places on another rank are predicted from rank {}'s cache",
                    sources.len(),
                    used.rank,
                    used.rank
                );
            }
            if !notes.is_empty() {
                tracing::info!(endpoint = url, ignored = %notes.join("; "), "parts of /kv_event_sources ignored");
            }
        }
        KvSourcesRead::NoSource(why) => {
            tracing::info!(endpoint = url, reason = %why, "no KV events at /kv_event_sources: {why}; {approx}");
        }
        KvSourcesRead::Unreadable(_) => {}
    }
    d.kv = Some(read);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_sources::parse_kv_event_sources;

    fn config(kv: Option<&str>, replay: Option<&str>) -> EndpointConfig {
        let mut c = EndpointConfig::new("http://10.0.0.1:8000");
        c.kv_events = kv.map(str::to_owned);
        c.kv_replay = replay.map(str::to_owned);
        c
    }

    fn engine(endpoint: &str, replay: Option<&str>) -> KvSourcesRead {
        let replay = replay.map_or("null".to_owned(), |r| format!("{r:?}"));
        let body = format!(
            r#"{{"0":{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":{endpoint:?},"replay_endpoint":{replay},"topic":"t"}}}}"#
        );
        parse_kv_event_sources(body.as_bytes(), "10.0.0.1")
    }

    /// Configured over discovered, field by field; one condition flipped per row.
    #[test]
    fn configured_sockets_win_and_contradictions_are_conflicts() {
        type Row<'a> = (
            &'a str,
            EndpointConfig,
            Option<KvSourcesRead>,
            Option<(KvOrigin, &'a str, Option<&'a str>, &'a str)>,
            Vec<&'a str>,
        );
        let wild = engine("tcp://*:5557", Some("tcp://*:5558"));
        let rows: Vec<Row<'_>> = vec![
            (
                "nothing configured or read",
                config(None, None),
                None,
                None,
                vec![],
            ),
            (
                "discovered: events, replay and topic",
                config(None, None),
                Some(wild.clone()),
                Some((
                    KvOrigin::Discovered,
                    "tcp://10.0.0.1:5557",
                    Some("tcp://10.0.0.1:5558"),
                    "t",
                )),
                vec![],
            ),
            (
                "engine reports none, nothing configured",
                config(None, None),
                Some(parse_kv_event_sources(b"{}", "10.0.0.1")),
                None,
                vec![],
            ),
            (
                "configured, engine agrees: its replay and topic are used",
                config(Some("tcp://10.0.0.1:5557"), None),
                Some(wild.clone()),
                Some((
                    KvOrigin::Configured,
                    "tcp://10.0.0.1:5557",
                    Some("tcp://10.0.0.1:5558"),
                    "t",
                )),
                vec![],
            ),
            (
                "configured under another name of a wildcard-bound engine: agrees",
                config(Some("tcp://engine-a:5557"), None),
                Some(wild.clone()),
                Some((
                    KvOrigin::Configured,
                    "tcp://engine-a:5557",
                    Some("tcp://10.0.0.1:5558"),
                    "t",
                )),
                vec![],
            ),
            (
                "configured on another port: configured, conflict, no borrowed replay",
                config(Some("tcp://10.0.0.1:6000"), None),
                Some(wild.clone()),
                Some((KvOrigin::Configured, "tcp://10.0.0.1:6000", None, "")),
                vec!["kv_events"],
            ),
            (
                "configured on another IP than the engine's specific one: conflict",
                config(Some("tcp://10.0.0.2:5557"), None),
                Some(engine("tcp://10.0.0.9:5557", None)),
                Some((KvOrigin::Configured, "tcp://10.0.0.2:5557", None, "")),
                vec!["kv_events"],
            ),
            (
                "configured, engine reports no publisher: configured, conflict",
                config(Some("tcp://10.0.0.1:5557"), None),
                Some(parse_kv_event_sources(b"{}", "10.0.0.1")),
                Some((KvOrigin::Configured, "tcp://10.0.0.1:5557", None, "")),
                vec!["kv_events"],
            ),
            (
                "configured, never read: as configured",
                config(Some("tcp://10.0.0.1:5557"), Some("tcp://10.0.0.1:5558")),
                None,
                Some((
                    KvOrigin::Configured,
                    "tcp://10.0.0.1:5557",
                    Some("tcp://10.0.0.1:5558"),
                    "",
                )),
                vec![],
            ),
            (
                "configured replay on another port: configured, conflict",
                config(None, Some("tcp://10.0.0.1:7000")),
                Some(wild.clone()),
                Some((
                    KvOrigin::Discovered,
                    "tcp://10.0.0.1:5557",
                    Some("tcp://10.0.0.1:7000"),
                    "t",
                )),
                vec!["kv_replay"],
            ),
            (
                "configured replay, engine has none: configured, conflict",
                config(None, Some("tcp://10.0.0.1:5558")),
                Some(engine("tcp://*:5557", None)),
                Some((
                    KvOrigin::Discovered,
                    "tcp://10.0.0.1:5557",
                    Some("tcp://10.0.0.1:5558"),
                    "t",
                )),
                vec!["kv_replay"],
            ),
            (
                "configured replay alone, nothing read: no source",
                config(None, Some("tcp://10.0.0.1:5558")),
                None,
                None,
                vec![],
            ),
        ];
        for (name, c, found, want, want_conflicts) in rows {
            let (got, conflicts) = kv_source(&c, found.as_ref());
            let got = got.as_ref().map(|s| {
                (
                    s.origin,
                    s.events.as_str(),
                    s.replay.as_deref(),
                    s.topic.as_str(),
                )
            });
            assert_eq!(got, want, "{name}");
            let fields: Vec<&str> = conflicts.iter().map(|c| c.field).collect();
            assert_eq!(fields, want_conflicts, "{name}");
        }
    }
}

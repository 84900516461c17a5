//! The doctor's read of `GET /kv_event_sources` (vLLM ≥ 0.32): what the engine says about
//! its KV-event publishers, and which sockets the rest of the probe uses. As in
//! `kvgate serve`, `--kv` / `--replay` win over what the engine reports; without them the
//! engine's own (the lowest rank's, with the engine URL's host in place of a wildcard).

use kvgate_schedule::{KvSourcesRead, MAX_KV_SOURCES_BODY, parse_kv_event_sources};

use super::probe::Http;
use super::{EngineProbe, Finding};

/// A socket the probe uses, and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Socket {
    pub(super) url: String,
    /// Found at `/kv_event_sources` (`false`: given with `--kv` / `--replay`).
    pub(super) found: bool,
}

impl Socket {
    /// `; found at /kv_event_sources` for a found socket, nothing for a given one (the end
    /// of a finding's text).
    pub(super) fn origin(&self) -> &'static str {
        if self.found {
            "; found at /kv_event_sources"
        } else {
            ""
        }
    }
}

/// The sockets to probe and what the engine's answer says.
#[derive(Debug)]
pub(super) struct Sources {
    pub(super) events: Option<Socket>,
    pub(super) replay: Option<Socket>,
    /// Why there are no events to probe (the engine's answer, for the failure line).
    pub(super) why_none: String,
}

impl EngineProbe<'_> {
    /// Reads `/kv_event_sources` and reports it (one or two findings); returns the sockets
    /// the probe uses.
    pub(super) async fn sources(&self, http: &Http, out: &mut Vec<Finding>) -> Sources {
        let read = match http.get("/kv_event_sources").await {
            Ok((200, body)) if body.len() <= MAX_KV_SOURCES_BODY => {
                parse_kv_event_sources(body.as_bytes(), &engine_host(self.url))
            }
            Ok((200, body)) => KvSourcesRead::Unreadable(format!("a {} byte body", body.len())),
            Ok((404, _)) => KvSourcesRead::Unreadable(
                "status 404 (vLLM before 0.32 has no /kv_event_sources)".into(),
            ),
            Ok((status, _)) => KvSourcesRead::Unreadable(format!("status {status}")),
            Err(e) => KvSourcesRead::Unreadable(format!("{e:#}")),
        };
        let given = |s: Option<&str>| {
            s.map(|url| Socket {
                url: url.to_owned(),
                found: false,
            })
        };
        let primary = read.primary();
        let events = given(self.kv).or_else(|| {
            primary.map(|p| Socket {
                url: p.events.clone(),
                found: true,
            })
        });
        // The engine's replay belongs with its own events.
        let borrow_replay = events.as_ref().is_some_and(|e| e.found)
            || primary.is_some_and(|p| self.kv == Some(p.events.as_str()));
        let replay = given(self.replay).or_else(|| {
            primary
                .filter(|_| borrow_replay)
                .and_then(|p| p.replay.clone())
                .map(|url| Socket { url, found: true })
        });
        let said = read.describe();
        match (&read, self.kv) {
            (KvSourcesRead::Found { .. }, None) => out.push(Finding::ok(format!(
                "KV event sources: /kv_event_sources names {said}; used, no --kv given"
            ))),
            (KvSourcesRead::Found { .. }, Some(kv)) => {
                let p = primary.map_or("", |p| p.events.as_str());
                if port_of(p) == port_of(kv) {
                    out.push(Finding::ok(format!(
                        "KV event sources: /kv_event_sources names {said}; --kv {kv} agrees"
                    )));
                } else {
                    out.push(Finding::warn(
                        format!(
                            "KV event sources: /kv_event_sources names {said}, not --kv {kv}; --kv is used (kvgate serve does the same and counts the conflict)"
                        ),
                        format!(
                            "drop --kv for {} (kvgate serve then subscribes to what the engine reports), or correct it",
                            self.url
                        ),
                    ));
                }
            }
            (KvSourcesRead::NoSource(_), Some(kv)) => out.push(Finding::warn(
                format!("KV event sources: /kv_event_sources {said}, yet --kv {kv} is given"),
                "check the engine's --kv-events-config (kvgate serve subscribes to --kv and counts the conflict)",
            )),
            (_, Some(kv)) => out.push(Finding::ok(format!(
                "KV event sources: /kv_event_sources {said}; --kv {kv} is used"
            ))),
            (_, None) => {}
        }
        if let KvSourcesRead::Found { sources, .. } = &read
            && sources.len() > 1
        {
            out.push(Finding::warn(
                format!(
                    "data parallel: {} ranks publish KV events; kvgate serve uses rank {}'s only (one scheduling endpoint per URL, requests not pinned to a rank), so requests the engine places on other ranks are mispredicted",
                    sources.len(),
                    sources[0].rank
                ),
                "serve each rank on its own URL (vLLM --data-parallel-external-lb, or one server per rank) and list each as an endpoint",
            ));
        }
        Sources {
            events,
            replay,
            why_none: format!("no --kv given and /kv_event_sources {said}"),
        }
    }
}

/// The host of an engine base URL (`http://HOST:PORT/…`), brackets kept for IPv6.
fn engine_host(url: &str) -> String {
    url.parse::<http::Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_owned))
        .unwrap_or_default()
}

fn port_of(endpoint: &str) -> Option<&str> {
    endpoint.rsplit_once(':').map(|(_, p)| p)
}

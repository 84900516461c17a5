//! The response path: engine response → client response, model-name restore, `usage` watch.

use std::{pin::Pin, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::BodyExt;
use kvgate_request::{SealedRequest, SseModelRewriter};
use kvgate_schedule::{EndpointState, SCORES_HEADER};

use super::{
    PREDICTED_HEADER, Proxy, REQUEST_ID_NAME, SERVED_BY_NAME, UpstreamBody, forward::Sent,
};
use crate::{
    body::{BoxError, ProxyBody, RequestGuard, StreamBody, Tracker, full},
    error::ProxyError,
    otel::RequestSpan,
};

/// Largest non-streamed (JSON) engine body kvgate buffers to restore an aliased model name.
/// A larger body is streamed to the client unchanged, naming the canonical model: a complete
/// answer with the other name serves the client better than a 502 for work already done.
const MAX_REWRITE_BODY: usize = 64 << 20;

/// Hop-by-hop headers, which a proxy must not forward.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

impl Proxy {
    /// Turns the engine's response into the client's, restoring an aliased model name and
    /// watching for `usage` to compare predicted with realized cache hits.
    ///
    /// Not async: only a JSON answer under an alias must be read whole before its headers
    /// go out ([`Responded::Rewrite`], boxed), and the forwarding state machine that calls
    /// this would otherwise carry that rare case's locals in every request's state.
    pub(super) fn respond(
        &self,
        sent: Sent,
        sealed: &SealedRequest,
        mut guard: RequestGuard,
        mut span: Option<Box<RequestSpan>>,
    ) -> Responded {
        let Sent { response, mut pick } = sent;
        let (mut parts, body) = response.into_parts();
        let stall = self.config.timeouts.stream_idle;
        strip_hop_by_hop(&mut parts.headers);
        // kvgate frames the body itself (chunked or content-length, h1 or h2).
        parts.headers.remove(header::TRANSFER_ENCODING);
        // An engine's own copy never reaches the client; kvgate's only with the flag.
        parts.headers.remove(SERVED_BY_NAME);
        if self.config.expose_internals
            && let Ok(v) = HeaderValue::from_str(pick.endpoint.name())
        {
            parts.headers.insert(SERVED_BY_NAME, v);
        }
        if let Some(v) = pick
            .scores
            .take()
            .and_then(|s| HeaderValue::from_str(&s).ok())
        {
            parts.headers.insert(SCORES_HEADER, v);
            parts.headers.insert(
                PREDICTED_HEADER,
                HeaderValue::from(pick.predicted.unwrap_or(0)),
            );
        }
        guard.set_outcome(parts.status.as_u16(), Some(pick.endpoint.name().to_owned()));
        let alias = match (sealed.requested_model(), sealed.model()) {
            (Some(asked), Some(sent)) if asked != sent => Some(asked.to_owned()),
            _ => None,
        };
        let content_type = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let is_sse = content_type.starts_with("text/event-stream");
        let is_json = content_type.starts_with("application/json");
        // The tracker keeps the endpoint for the realized-hit report; only a rewrite needs
        // it too. (Each reference count taken here is a write to a word every serving thread
        // shares.)
        let rewrite_ep = (alias.is_some() && is_json).then(|| pick.endpoint.clone());
        if let Some(span) = &mut span {
            span.status(parts.status.as_u16());
        }
        let mut tracker = self.response_tracker(pick, parts.status, content_type);
        tracker.span = span;
        match (alias, rewrite_ep) {
            (Some(asked), Some(ep)) => Responded::Rewrite(Box::pin(
                WholeAnswer {
                    body,
                    parts,
                    asked,
                    ep,
                    guard,
                    tracker,
                    stall,
                }
                .rewrite(),
            )),
            (Some(asked), None) if is_sse => {
                parts.headers.remove(header::CONTENT_LENGTH);
                let body =
                    StreamBody::new(body, Some(SseModelRewriter::new(asked)), guard, tracker)
                        .with_stall_timeout(stall);
                Responded::Now(Response::from_parts(parts, body.boxed()))
            }
            _ => Responded::Now(Response::from_parts(
                parts,
                StreamBody::new(body, None, guard, tracker)
                    .with_stall_timeout(stall)
                    .boxed(),
            )),
        }
    }
}

/// What [`Proxy::respond`] hands back.
pub(super) enum Responded {
    /// The client's response, its body streamed from the engine's.
    Now(Response<ProxyBody>),
    /// A JSON answer whose model name is restored once it is read whole.
    Rewrite(Pin<Box<dyn Future<Output = Rewritten> + Send>>),
}

/// The client's response after a rewrite, or why the engine's body failed.
pub(super) type Rewritten = Result<Response<ProxyBody>, (ProxyError, RequestGuard)>;

/// A JSON answer under an alias, read whole to restore the model name the client asked for.
struct WholeAnswer {
    body: UpstreamBody,
    parts: http::response::Parts,
    /// The model name the client asked for.
    asked: String,
    ep: Arc<EndpointState>,
    guard: RequestGuard,
    tracker: Tracker,
    stall: Duration,
}

impl WholeAnswer {
    /// Reads the answer (up to [`MAX_REWRITE_BODY`]) and puts back the name asked for; a
    /// larger answer streams through unchanged.
    async fn rewrite(self) -> Rewritten {
        let WholeAnswer {
            body,
            mut parts,
            asked,
            ep,
            mut guard,
            tracker,
            stall,
        } = self;
        match collect_within(body, MAX_REWRITE_BODY).await {
            Collected::Whole(bytes) => {
                tracker.finish_with(bytes.clone());
                let bytes =
                    kvgate_request::rewrite_model_json(&bytes, &asked).map_or(bytes, Bytes::from);
                parts
                    .headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
                guard.complete();
                Ok(Response::from_parts(parts, full(bytes)))
            }
            Collected::TooLarge { head, rest } => {
                tracing::debug!(
                    endpoint = %ep.name(),
                    limit_bytes = MAX_REWRITE_BODY,
                    "response too large to restore the model alias; forwarded unchanged"
                );
                let body = StreamBody::new(rest, None, guard, tracker)
                    .with_prefix(head)
                    .with_stall_timeout(stall);
                Ok(Response::from_parts(parts, body.boxed()))
            }
            Collected::Failed(e) => {
                let err = ProxyError::UpstreamBody {
                    endpoint: ep.name().to_owned(),
                    reason: e.to_string(),
                };
                let mut tracker = tracker;
                if let Some(span) = &mut tracker.span {
                    span.broke(err.reason());
                }
                Err((err, guard))
            }
        }
    }
}

/// An engine body read up to a limit.
enum Collected {
    /// All of it, within the limit.
    Whole(Bytes),
    /// Over the limit: what was read, and the unread rest.
    TooLarge { head: Bytes, rest: UpstreamBody },
    /// The engine's body failed.
    Failed(BoxError),
}

/// Reads `body` while it fits in `limit` bytes. A declared length over the limit reads
/// nothing; trailers are dropped.
async fn collect_within(mut body: UpstreamBody, limit: usize) -> Collected {
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Collected::TooLarge {
            head: Bytes::new(),
            rest: body,
        };
    }
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let data = match frame {
            Ok(frame) => match frame.into_data() {
                Ok(data) => data,
                Err(_trailers) => continue,
            },
            Err(e) => return Collected::Failed(e),
        };
        buf.extend_from_slice(&data);
        if buf.len() > limit {
            return Collected::TooLarge {
                head: Bytes::from(buf),
                rest: body,
            };
        }
    }
    Collected::Whole(Bytes::from(buf))
}

pub(super) fn json_response(status: StatusCode, body: Bytes) -> Response<ProxyBody> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Request headers that steer routing or a disaggregation sidecar behind the engine (llm-d's
/// P/D sidecar acts on `x-prefiller-host-port`, for one), and flow control's (the objective
/// and fairness id are read by kvgate, not the engine's, as llm-d strips them). Only kvgate's
/// own decision may set the routing ones, so a client's are dropped; see
/// [`is_routing_header`] for the prefixes.
const ROUTING_HEADERS: [&str; 7] = [
    "x-prefiller-host-port",
    "x-prefiller-url",
    "x-encoder-hosts-ports",
    "x-kv-cache-source-host-port",
    "x-data-parallel-host-port",
    crate::admission::OBJECTIVE_HEADER,
    crate::admission::FAIRNESS_HEADER,
];

/// Prefixes of routing headers: the gateway's (`x-gateway-destination-endpoint` and its
/// kin), kvgate's own and the decode side of a P/D pair.
const ROUTING_PREFIXES: [&str; 3] = ["x-gateway-", "x-kvgate-", "x-decoder-"];

/// Whether a client must not send `name` (lowercase, as [`http::HeaderName`] stores it) to an
/// engine.
pub(super) fn is_routing_header(name: &str) -> bool {
    ROUTING_HEADERS.contains(&name) || ROUTING_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The client's headers minus hop-by-hop ones, routing headers ([`is_routing_header`]),
/// `host` and `content-length` (set per attempt), with the request id. The scheduler's own
/// headers (e.g. `x-prefiller-host-port`) are added after this, per pick.
pub(super) fn upstream_headers(client: &HeaderMap, request_id: &str) -> HeaderMap {
    // Built anew from what is kept: cheaper than a copy of the client's map and the removals.
    let named = connection_named(client);
    let mut headers = HeaderMap::with_capacity(client.keys_len() + 1);
    for (name, value) in client {
        let dropped = HOP_BY_HOP.contains(name)
            || named.contains(name)
            || is_routing_header(name.as_str())
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING;
        if !dropped {
            headers.append(name, value.clone());
        }
    }
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.insert(REQUEST_ID_NAME, v);
    }
    headers
}

/// Removes the hop-by-hop headers from `headers`: [`HOP_BY_HOP`] and those named in
/// `Connection`.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Which of them are here (most answers carry `connection` alone): one pass over the
    // names, then a removal for each one found, not one for every hop-by-hop name.
    let mut present = [false; HOP_BY_HOP.len()];
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            present[i] = true;
        }
    }
    if !present.contains(&true) {
        // No `Connection` either, so nothing is named in one.
        return;
    }
    for name in connection_named(headers) {
        headers.remove(name);
    }
    for (name, here) in HOP_BY_HOP.iter().zip(present) {
        if here {
            headers.remove(name);
        }
    }
}

/// The header names listed in `Connection` that are not hop-by-hop names already (those
/// go anyway; `keep-alive` is the usual one); names that are not valid header names are
/// skipped (no header can have them).
fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        // Most `Connection`s are a lone `keep-alive`, which is hop-by-hop already.
        .filter(|v| !v.as_bytes().eq_ignore_ascii_case(b"keep-alive"))
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| {
            !HOP_BY_HOP
                .iter()
                .any(|h| s.eq_ignore_ascii_case(h.as_str()))
        })
        .filter_map(|s| HeaderName::from_bytes(s.as_bytes()).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Header pairs, in order.
    type Pairs = &'static [(&'static str, &'static str)];

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        m
    }

    /// One header added to an ordinary request per row: forwarded or not. What every row
    /// keeps (both values of a repeated header, in order) and the request id are checked too.
    #[test]
    fn upstream_headers_drop_exactly_what_must_not_reach_the_engine() {
        let base = [
            ("content-type", "application/json"),
            ("accept", "a"),
            ("accept", "b"),
        ];
        let rows: [(&str, Pairs, &str, bool); 12] = [
            (
                "an ordinary header",
                &[("authorization", "Bearer k")],
                "authorization",
                true,
            ),
            (
                "keep-alive",
                &[("keep-alive", "timeout=5")],
                "keep-alive",
                false,
            ),
            ("upgrade", &[("upgrade", "h2c")], "upgrade", false),
            (
                "proxy-connection",
                &[("proxy-connection", "x")],
                "proxy-connection",
                false,
            ),
            ("te", &[("te", "trailers")], "te", false),
            (
                "named in Connection, any case, spaced",
                &[("connection", "close ,  X-Hop"), ("x-hop", "1")],
                "x-hop",
                false,
            ),
            (
                "not named in Connection",
                &[("connection", "close"), ("x-hop", "1")],
                "x-hop",
                true,
            ),
            (
                "a routing header",
                &[("x-prefiller-host-port", "h:1")],
                "x-prefiller-host-port",
                false,
            ),
            (
                "a routing prefix",
                &[("x-kvgate-debug", "1")],
                "x-kvgate-debug",
                false,
            ),
            ("host", &[("host", "router:80")], "host", false),
            (
                "content-length",
                &[("content-length", "10")],
                "content-length",
                false,
            ),
            (
                "transfer-encoding",
                &[("transfer-encoding", "chunked")],
                "transfer-encoding",
                false,
            ),
        ];
        for (row, extra, name, forwarded) in rows {
            let client = map(&[&base[..], extra, &[("x-request-id", "client")]].concat());
            let got = upstream_headers(&client, "rid");
            assert_eq!(got.contains_key(name), forwarded, "{row}");
            assert!(!got.contains_key(header::CONNECTION), "{row}");
            assert_eq!(got["content-type"], "application/json", "{row}");
            let accept: Vec<_> = got.get_all("accept").iter().collect();
            assert_eq!(accept, ["a", "b"], "{row}");
            let ids: Vec<_> = got.get_all(REQUEST_ID_NAME).iter().collect();
            assert_eq!(ids, ["rid"], "{row}");
        }
    }

    /// An engine response loses its hop-by-hop headers and those its `Connection` names;
    /// without any, it is left as it is.
    #[test]
    fn hop_by_hop_headers_leave_a_response() {
        let rows: [(&str, Pairs, &[&str]); 5] = [
            (
                "none",
                &[("content-type", "a"), ("x-a", "1")],
                &["content-type", "x-a"],
            ),
            (
                "connection",
                &[("connection", "keep-alive"), ("x-a", "1")],
                &["x-a"],
            ),
            (
                "named",
                &[("connection", "X-A, bad name"), ("x-a", "1"), ("x-b", "2")],
                &["x-b"],
            ),
            (
                "trailer without connection",
                &[("trailer", "x"), ("x-a", "1")],
                &["x-a"],
            ),
            (
                "named hop-by-hop and close",
                &[
                    ("connection", "Keep-Alive, close"),
                    ("keep-alive", "timeout=5"),
                    ("close", "x"),
                    ("x-a", "1"),
                ],
                &["x-a"],
            ),
        ];
        for (row, headers, left) in rows {
            let mut m = map(headers);
            strip_hop_by_hop(&mut m);
            let mut names: Vec<_> = m.keys().map(HeaderName::as_str).collect();
            names.sort_unstable();
            assert_eq!(names, left, "{row}");
        }
    }
}

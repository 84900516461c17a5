//! [`LoadClient`]: a pooled HTTP/1.1 client that streams one request and measures it.
//!
//! Built on hyper-util's legacy client (keep-alive pool, `TCP_NODELAY`), with bodies passed
//! as pre-built [`Bytes`]. Per response it parses only what it needs: the SSE framing
//! (`kvgate-request`'s, the proxy's own), and per event a borrowed JSON probe for content,
//! `usage` and `error`.

mod payload;
mod replicas;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use kvgate_request::{SseEvents, SsePiece, event_data};
use tokio::sync::oneshot;

use self::payload::read_payload;
pub(crate) use self::replicas::ReplicaUris;
use crate::{BenchError, ErrorKind, RequestRecord};

/// Options of the load client.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Per-request deadline, from send to the end of the response.
    pub timeout: Duration,
    /// Sent as `Authorization: Bearer …` when set.
    pub api_key: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
            api_key: None,
        }
    }
}

/// A pooled keep-alive client that sends requests and measures their responses.
#[derive(Debug, Clone)]
pub struct LoadClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    auth: Option<HeaderValue>,
}

/// What [`LoadClient::send`] returns: the measured record and, when asked for, the answer.
#[derive(Debug, Clone, Default)]
pub struct Exchange {
    /// Measurements; `index`, `conversation`, `turn`, `group` and `start_ms` are left at
    /// their defaults for the caller to fill.
    pub record: RequestRecord,
    /// The concatenated answer text (content deltas or the message content).
    pub text: Option<String>,
}

impl LoadClient {
    /// Builds a client.
    ///
    /// # Errors
    /// [`BenchError::InvalidArgument`] when the API key is not a valid header value.
    pub fn new(options: &ClientOptions) -> Result<Self, BenchError> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(usize::MAX)
            .build(connector);
        let auth = options
            .api_key
            .as_ref()
            .map(|key| {
                HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    BenchError::InvalidArgument("api key is not a valid header value".into())
                })
            })
            .transpose()?;
        Ok(Self {
            inner,
            timeout: options.timeout,
            auth,
        })
    }

    /// POSTs `body` as JSON to `uri` and measures the response (SSE or not).
    /// Failures are recorded in the returned record, never returned as errors.
    pub async fn send(&self, uri: &Uri, body: Bytes, collect_text: bool) -> Exchange {
        self.send_signalling(uri, body, collect_text, None, None)
            .await
    }

    /// [`LoadClient::send`] that also signals `head` as soon as the response head
    /// arrived or the request failed (it is dropped on a timeout), and sends `request_id`
    /// as `x-request-id` (a router's logs then name the workload's request).
    pub(crate) async fn send_signalling(
        &self,
        uri: &Uri,
        body: Bytes,
        collect_text: bool,
        head: Option<oneshot::Sender<()>>,
        request_id: Option<HeaderValue>,
    ) -> Exchange {
        let mut exchange = Exchange {
            text: collect_text.then(String::new),
            ..Exchange::default()
        };
        let t0 = Instant::now();
        let run = self.exchange(uri, body, t0, &mut exchange, head, request_id);
        if tokio::time::timeout(self.timeout, run).await.is_err() {
            exchange.record.error = Some(ErrorKind::Timeout);
        }
        exchange.record.e2e_ms = millis(t0);
        exchange
    }

    async fn exchange(
        &self,
        uri: &Uri,
        body: Bytes,
        t0: Instant,
        out: &mut Exchange,
        head: Option<oneshot::Sender<()>>,
        request_id: Option<HeaderValue>,
    ) {
        let rec = &mut out.record;
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = uri.clone();
        let headers = req.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(auth) = &self.auth {
            headers.insert(header::AUTHORIZATION, auth.clone());
        }
        if let Some(id) = request_id {
            headers.insert(http::HeaderName::from_static("x-request-id"), id);
        }
        let sent = self.inner.request(req).await;
        if let Some(head) = head {
            let _ = head.send(());
        }
        let resp = match sent {
            Ok(resp) => resp,
            Err(e) => {
                rec.error = Some(if e.is_connect() {
                    ErrorKind::Connect
                } else {
                    ErrorKind::StreamBroken
                });
                tracing::trace!(uri = %uri, error = %e, "request failed");
                return;
            }
        };
        let status = resp.status();
        rec.status = Some(status.as_u16());
        rec.streamed = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let mut body = resp.into_body();
        if !status.is_success() {
            rec.error = Some(ErrorKind::HttpStatus(status.as_u16()));
            // Drain so the connection can be reused.
            let _ = body.collect().await;
            return;
        }
        if !rec.streamed {
            let bytes = match body.collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => {
                    rec.error = Some(ErrorKind::StreamBroken);
                    return;
                }
            };
            let mut events = Events::new(rec, out.text.as_mut());
            events.on_payload(&bytes, millis(t0));
            return;
        }
        let mut reader = SseEvents::new();
        let mut events = Events::new(rec, out.text.as_mut());
        loop {
            match body.frame().await {
                None => break,
                Some(Err(_)) => {
                    events.fail(ErrorKind::StreamBroken);
                    return;
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        let now = millis(t0);
                        reader.push(&data, |event| events.on_event(event, now));
                    }
                }
            }
        }
        let now = millis(t0);
        if !reader.finish(|event| events.on_event(event, now)) {
            events.fail(ErrorKind::StreamBroken);
        }
        if reader.oversize_events() > 0 {
            events.fail(ErrorKind::BadSse);
        }
    }

    /// Sends a bodiless request and returns the status and the whole body (used for
    /// `/reset_prefix_cache` and `/v1/models`).
    pub(crate) async fn simple(&self, method: Method, uri: &Uri) -> Result<(u16, Bytes), String> {
        let mut req = Request::new(Full::new(Bytes::new()));
        *req.method_mut() = method;
        *req.uri_mut() = uri.clone();
        let run = async {
            let resp = self.inner.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(self.timeout, run)
            .await
            .map_err(|_| "timed out".to_owned())?
    }
}

/// Applies each payload of one response to its record.
struct Events<'a> {
    rec: &'a mut RequestRecord,
    text: Option<&'a mut String>,
    last_content_ms: Option<f64>,
}

impl<'a> Events<'a> {
    fn new(rec: &'a mut RequestRecord, text: Option<&'a mut String>) -> Self {
        Self {
            rec,
            text,
            last_content_ms: None,
        }
    }

    fn fail(&mut self, kind: ErrorKind) {
        self.rec.error.get_or_insert(kind);
    }

    /// One piece of an SSE stream: an event's `data`, if it has any, is a payload; bytes
    /// passed over (an event over the cap, a truncated tail) carry none.
    fn on_event(&mut self, piece: SsePiece<'_>, now_ms: f64) {
        if let SsePiece::Event(event) = piece
            && let Some(data) = event_data(event)
        {
            self.on_payload(&data, now_ms);
        }
    }

    fn on_payload(&mut self, payload: &[u8], now_ms: f64) {
        if payload == b"[DONE]" {
            return;
        }
        let Some(p) = read_payload(payload, self.text.as_deref_mut()) else {
            self.fail(ErrorKind::BadSse);
            return;
        };
        if p.error {
            self.fail(ErrorKind::StreamError);
        }
        if p.content {
            match self.last_content_ms {
                None => self.rec.ttft_ms = Some(now_ms),
                Some(last) => self.rec.itl_ms.push(now_ms - last),
            }
            self.last_content_ms = Some(now_ms);
            self.rec.content_events += 1;
        }
        if let Some(usage) = p.usage {
            self.rec.prompt_tokens = usage.prompt_tokens.or(self.rec.prompt_tokens);
            self.rec.completion_tokens = usage.completion_tokens.or(self.rec.completion_tokens);
            self.rec.cached_tokens = usage.cached_tokens.or(self.rec.cached_tokens);
        }
    }
}

/// Joins a target's base URL and a request path into a URI (`http://` only).
///
/// # Errors
/// [`BenchError::InvalidUrl`] when the URL is not `http://host[:port][/prefix]`.
pub fn endpoint_uri(base: &str, path: &str) -> Result<Uri, BenchError> {
    let bad = |reason: &str| BenchError::InvalidUrl {
        url: base.to_owned(),
        reason: reason.to_owned(),
    };
    if !base.starts_with("http://") {
        return Err(bad("only http:// URLs are supported"));
    }
    let joined = format!("{}{path}", base.trim_end_matches('/'));
    let uri: Uri = joined.parse().map_err(|_| bad("not a valid URL"))?;
    if uri.host().is_none() {
        return Err(bad("no host"));
    }
    Ok(uri)
}

fn millis(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_uris() {
        let cases = [
            ("http://h:8000", "/v1/x", Some("http://h:8000/v1/x")),
            ("http://h:8000/", "/v1/x", Some("http://h:8000/v1/x")),
            ("http://h/pre/", "/v1/x", Some("http://h/pre/v1/x")),
            ("https://h", "/v1/x", None),
            ("h:8000", "/v1/x", None),
            ("http://", "/v1/x", None),
        ];
        for (base, path, want) in cases {
            let got = endpoint_uri(base, path).ok().map(|u| u.to_string());
            assert_eq!(got.as_deref(), want, "{base}");
        }
    }
}

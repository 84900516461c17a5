//! The render backend: POST the sealed request bytes, unchanged, to the engine's
//! `/v1/{chat/completions,completions,messages,responses}/render` and read `token_ids`
//! plus `features.mm_hashes` / `features.mm_placeholders`. One pooled keep-alive
//! hyper-util client per backend (rustls for an `https://` server given a TLS client
//! config); a timeout per call (text vs media).

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::TokioExecutor;
use kvgate_request::Api;
use serde_json::Value;

use crate::outcome::{BackendError, FallbackReason, MmItem, PromptTokens};

/// Render-backend options.
#[derive(Debug, Clone)]
pub struct RenderOptions {
    /// Base URL, e.g. `http://127.0.0.1:8765` (no trailing path).
    pub url: String,
    /// Timeout for text-only requests.
    pub timeout: Duration,
    /// Timeout when content parts hold media.
    pub media_timeout: Duration,
}

impl RenderOptions {
    /// Options with the default timeouts (5 s text, 30 s media).
    pub fn new(url: impl Into<String>) -> RenderOptions {
        RenderOptions {
            url: url.into(),
            timeout: Duration::from_secs(5),
            media_timeout: Duration::from_secs(30),
        }
    }
}

/// A client of one render server.
#[derive(Debug, Clone)]
pub struct RenderBackend {
    opts: RenderOptions,
    client: RenderClient,
}

/// The pooled client of one render server: plain, or rustls for `https://`.
#[derive(Debug, Clone)]
enum RenderClient {
    Plain(Client<HttpConnector, Full<Bytes>>),
    Tls(Client<HttpsConnector<HttpConnector>, Full<Bytes>>),
}

impl RenderClient {
    fn request(&self, req: http::Request<Full<Bytes>>) -> ResponseFuture {
        match self {
            RenderClient::Plain(client) => client.request(req),
            RenderClient::Tls(client) => client.request(req),
        }
    }
}

/// The render path for an API, if it has one.
pub fn render_path(api: Api) -> Option<&'static str> {
    match api {
        Api::ChatCompletions => Some("/v1/chat/completions/render"),
        Api::Completions => Some("/v1/completions/render"),
        Api::Messages => Some("/v1/messages/render"),
        Api::Responses => Some("/v1/responses/render"),
        Api::Embeddings | Api::Passthrough => None,
    }
}

const MAX_ERROR_BODY: usize = 1024;

impl RenderBackend {
    /// Builds the pooled client (no connection is made yet).
    pub fn new(opts: RenderOptions) -> RenderBackend {
        RenderBackend::with_tls(opts, None)
    }

    /// Like [`RenderBackend::new`]; an `https://` URL is served over rustls with `tls` (its
    /// roots verify the server's certificate). Without `tls` every URL gets the plain
    /// client, on which an `https://` call fails (`RenderUnreachable`).
    pub fn with_tls(opts: RenderOptions, tls: Option<Arc<rustls::ClientConfig>>) -> RenderBackend {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let mut builder = Client::builder(TokioExecutor::new());
        builder
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(32);
        let client = match tls {
            Some(tls) if opts.url.starts_with("https://") => {
                connector.enforce_http(false);
                let https = HttpsConnectorBuilder::new()
                    .with_tls_config((*tls).clone())
                    .https_only()
                    .enable_http1()
                    .wrap_connector(connector);
                RenderClient::Tls(builder.build(https))
            }
            _ => RenderClient::Plain(builder.build(connector)),
        };
        RenderBackend { opts, client }
    }

    /// The configured base URL.
    pub fn url(&self) -> &str {
        &self.opts.url
    }

    /// Renders `body` (sent byte for byte) for `api`.
    ///
    /// # Errors
    /// A [`BackendError`] with `RenderTimeout`, `RenderUnreachable`, `RenderHttpError`,
    /// `RenderBadResponse` or `UnsupportedApi`.
    pub async fn tokenize(
        &self,
        api: Api,
        body: &Bytes,
        has_media: bool,
    ) -> Result<Vec<PromptTokens>, BackendError> {
        let path = render_path(api)
            .ok_or_else(|| BackendError::new(FallbackReason::UnsupportedApi, api.label()))?;
        let uri = format!("{}{path}", self.opts.url.trim_end_matches('/'));
        let req = http::Request::post(uri.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()))
            .map_err(|e| {
                BackendError::new(FallbackReason::RenderUnreachable, format!("{uri}: {e}"))
            })?;
        let timeout = if has_media {
            self.opts.media_timeout
        } else {
            self.opts.timeout
        };
        let call = async {
            let resp = self.client.request(req).await.map_err(|e| {
                BackendError::new(FallbackReason::RenderUnreachable, format!("{uri}: {e}"))
            })?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| {
                    BackendError::new(FallbackReason::RenderUnreachable, format!("{uri}: {e}"))
                })?
                .to_bytes();
            Ok::<_, BackendError>((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(timeout, call).await.map_err(|_| {
            BackendError::new(
                FallbackReason::RenderTimeout,
                format!("{uri}: no answer in {timeout:?}"),
            )
        })??;
        if !status.is_success() {
            let end = bytes.len().min(MAX_ERROR_BODY);
            return Err(BackendError::new(
                FallbackReason::RenderHttpError,
                format!(
                    "{uri}: {status}: {}",
                    String::from_utf8_lossy(&bytes[..end])
                ),
            ));
        }
        parse_response(&bytes).map_err(|d| {
            BackendError::new(FallbackReason::RenderBadResponse, format!("{uri}: {d}"))
        })
    }
}

fn parse_one(v: &Value) -> Result<PromptTokens, String> {
    let ids = v
        .get("token_ids")
        .and_then(Value::as_array)
        .ok_or("no token_ids")?
        .iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or("token_ids holds a non-u32")?;
    let mut mm_items = Vec::new();
    if let Some(features) = v.get("features").filter(|f| f.is_object()) {
        let hashes = features.get("mm_hashes").and_then(Value::as_object);
        let places = features.get("mm_placeholders").and_then(Value::as_object);
        if let (Some(hashes), Some(places)) = (hashes, places) {
            for (modality, ranges) in places {
                let ranges = ranges
                    .as_array()
                    .ok_or("mm_placeholders entry is not a list")?;
                let hs = hashes.get(modality).and_then(Value::as_array);
                for (i, r) in ranges.iter().enumerate() {
                    let num = |k: &str| {
                        r.get(k)
                            .and_then(Value::as_u64)
                            .and_then(|n| u32::try_from(n).ok())
                            .ok_or_else(|| format!("placeholder without {k}"))
                    };
                    // Without its hash an item's blocks cannot be keyed as the engine keys
                    // them: the response is unusable, not a text-only prompt.
                    let hash = hs
                        .and_then(|h| h.get(i))
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("no mm_hashes entry for {modality} item {i}"))?
                        .to_owned();
                    mm_items.push(MmItem {
                        modality: modality.clone(),
                        hash,
                        offset: num("offset")?,
                        length: num("length")?,
                    });
                }
            }
        }
    }
    mm_items.sort_by_key(|m| m.offset);
    Ok(PromptTokens {
        token_ids: ids,
        mm_items,
    })
}

/// Parses a render response: one object (chat, messages, responses) or a list
/// (completions, one object per prompt).
pub(crate) fn parse_response(bytes: &[u8]) -> Result<Vec<PromptTokens>, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("invalid json: {e}"))?;
    match &v {
        Value::Array(items) => items.iter().map(parse_one).collect(),
        Value::Object(_) => Ok(vec![parse_one(&v)?]),
        _ => Err("response is neither an object nor a list".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat_completions_and_features() {
        let chat = br#"{"request_id":"x","token_ids":[1,2,3],"features":{"mm_hashes":{"image":["h1","h0"]},"mm_placeholders":{"image":[{"offset":9,"length":4},{"offset":2,"length":3}]}}}"#;
        let got = parse_response(chat).unwrap();
        assert_eq!(got[0].token_ids, vec![1, 2, 3]);
        assert_eq!(got[0].mm_items[0].hash, "h0");
        assert_eq!(got[0].mm_items[0].offset, 2);
        let list = br#"[{"token_ids":[1]},{"token_ids":[2,3],"features":null}]"#;
        assert_eq!(parse_response(list).unwrap().len(), 2);
        let bad: [(&[u8], &str); 8] = [
            (b"{}", "no token_ids"),
            (b"[1]", "no token_ids"),
            (br#"{"token_ids":[-1]}"#, "token_ids holds a non-u32"),
            (b"nope", "invalid json: expected ident"),
            (b"7", "response is neither an object nor a list"),
            (
                br#"{"token_ids":[1],"features":{"mm_hashes":{"image":["h"]},"mm_placeholders":{"image":[{"length":1}]}}}"#,
                "placeholder without offset",
            ),
            (
                br#"{"token_ids":[1],"features":{"mm_hashes":{},"mm_placeholders":{"image":[{"offset":0,"length":1}]}}}"#,
                "no mm_hashes entry for image item 0",
            ),
            (
                br#"{"token_ids":[1],"features":{"mm_hashes":{"image":[7]},"mm_placeholders":{"image":[{"offset":0,"length":1}]}}}"#,
                "no mm_hashes entry for image item 0",
            ),
        ];
        for (body, want) in bad {
            let err = parse_response(body).unwrap_err();
            assert!(
                err.starts_with(want),
                "{}: {err}",
                String::from_utf8_lossy(body)
            );
        }
    }
}

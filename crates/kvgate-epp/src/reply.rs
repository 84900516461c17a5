//! Envoy's messages in and out: the body send modes, headers to an [`http::HeaderMap`], the
//! subset hint from the request's metadata, path-table refusals as [`ProxyError`]s, and the
//! `ProcessingResponse` shapes the exchange sends.

use envoy_types::pb::{
    envoy::{
        config::core::v3::{HeaderMap as EnvoyHeaders, HeaderValue, HeaderValueOption, Metadata},
        service::ext_proc::v3::{
            BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
            ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
            body_mutation::Mutation, processing_response::Response,
        },
        r#type::v3::HttpStatus,
    },
    google::protobuf::{ListValue, Struct, Value, value::Kind},
};
use http::{HeaderName, StatusCode};
use kvgate_proxy::{ProxyError, proxy::routes::Refusal};

use crate::{DESTINATION, DESTINATION_SUBSET, LB_NAMESPACE, SUBSET_HINT_NAMESPACE};

/// The body send mode Envoy announced (`protocol_config`), for one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `NONE`: Envoy sends no body.
    None,
    /// `STREAMED`: chunks, each answered before the next.
    Streamed,
    /// `BUFFERED` (or `BUFFERED_PARTIAL`): one message with the whole body.
    Buffered,
    /// `FULL_DUPLEX_STREAMED`: chunks without waiting; the server sends the body back.
    FullDuplex,
}

impl Mode {
    /// From the protobuf enum value.
    pub(crate) fn from_i32(v: i32) -> Mode {
        match v {
            1 => Mode::Streamed,
            2 | 3 => Mode::Buffered,
            4 => Mode::FullDuplex,
            _ => Mode::None,
        }
    }
}

/// The error for a request the path table refuses.
pub(crate) fn refused(headers: &Headers, refusal: Refusal) -> ProxyError {
    refusal.into_error(headers.method.clone(), headers.path_only().to_owned())
}

/// Largest body chunk in one streamed body response (Envoy's limit is about 64 KiB).
pub(crate) const MAX_CHUNK: usize = 62_000;

/// A request's or response's headers as Envoy sent them: the pseudo-headers apart.
#[derive(Debug, Default)]
pub(crate) struct Headers {
    /// `:method` (requests).
    pub(crate) method: String,
    /// `:path` (requests), query included.
    pub(crate) path: String,
    /// `:status` (responses).
    pub(crate) status: u16,
    /// Every other header (names lowercase).
    pub(crate) map: http::HeaderMap,
}

impl Headers {
    /// Reads Envoy's header list (values in `raw_value`, or `value` from older Envoys).
    /// Headers whose name or value is not valid HTTP are skipped.
    pub(crate) fn from_envoy(headers: Option<&EnvoyHeaders>) -> Headers {
        let mut out = Headers::default();
        for h in headers.map_or(&[][..], |h| &h.headers[..]) {
            let value: &[u8] = if h.raw_value.is_empty() {
                h.value.as_bytes()
            } else {
                &h.raw_value
            };
            match h.key.as_str() {
                ":method" => out.method = String::from_utf8_lossy(value).into_owned(),
                ":path" => out.path = String::from_utf8_lossy(value).into_owned(),
                ":status" => {
                    out.status = std::str::from_utf8(value)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                }
                k if k.starts_with(':') => {}
                k => {
                    if let (Ok(name), Ok(v)) = (
                        HeaderName::from_bytes(k.as_bytes()),
                        http::HeaderValue::from_bytes(value),
                    ) {
                        out.map.append(name, v);
                    }
                }
            }
        }
        out
    }

    /// The path without its query.
    pub(crate) fn path_only(&self) -> &str {
        self.path.split('?').next().unwrap_or("")
    }

    /// The `content-type` value, or `""`.
    pub(crate) fn content_type(&self) -> &str {
        self.map
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

/// The subset hint: `envoy.lb.subset_hint` → `x-gateway-destination-endpoint-subset`, a list
/// of `ip:port` strings (a single comma-separated string is accepted too). `None` without a
/// hint.
pub(crate) fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let value = metadata?
        .filter_metadata
        .get(SUBSET_HINT_NAMESPACE)?
        .fields
        .get(DESTINATION_SUBSET)?;
    let mut out = Vec::new();
    let mut push = |s: &str| {
        out.extend(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
        );
    };
    match &value.kind {
        Some(Kind::StringValue(s)) => push(s),
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    push(s);
                }
            }
        }
        _ => {}
    }
    Some(out)
}

/// A header for a mutation, replacing any value the request already has.
pub(crate) fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        // OVERWRITE_IF_EXISTS_OR_ADD: a client's own value is replaced.
        append_action: 2,
        ..HeaderValueOption::default()
    }
}

/// `envoy.lb` → `{x-gateway-destination-endpoint: "primary,fallback,..."}`.
pub(crate) fn lb_metadata(endpoints: &[&str]) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoints.join(","))),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// A list of strings as a protobuf value (tests build subset hints with it).
pub fn string_list(items: &[&str]) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).to_owned())),
                })
                .collect(),
        })),
    }
}

/// What the request phase answers besides the body.
#[derive(Debug, Default)]
pub(crate) struct Routing {
    /// Headers to set.
    pub(crate) set: Vec<HeaderValueOption>,
    /// Headers to remove.
    pub(crate) remove: Vec<String>,
}

impl Routing {
    fn mutation(&self) -> Option<HeaderMutation> {
        (!self.set.is_empty() || !self.remove.is_empty()).then(|| HeaderMutation {
            set_headers: self.set.clone(),
            remove_headers: self.remove.clone(),
        })
    }
}

fn message(response: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

/// "Continue" for request headers, optionally with the routing mutation.
pub(crate) fn request_headers(routing: Option<&Routing>) -> ProcessingResponse {
    message(Response::RequestHeaders(HeadersResponse {
        response: Some(CommonResponse {
            header_mutation: routing.and_then(Routing::mutation),
            clear_route_cache: routing.is_some(),
            ..CommonResponse::default()
        }),
    }))
}

/// A buffered request body's answer: the routing mutation and, when the body changed (an
/// alias splice), the new body.
pub(crate) fn request_body_buffered(
    routing: &Routing,
    body: Option<Vec<u8>>,
) -> ProcessingResponse {
    message(Response::RequestBody(BodyResponse {
        response: Some(CommonResponse {
            header_mutation: routing.mutation(),
            body_mutation: body.map(|b| BodyMutation {
                mutation: Some(Mutation::Body(b)),
            }),
            clear_route_cache: true,
            ..CommonResponse::default()
        }),
    }))
}

/// "Continue" for a request body chunk (`STREAMED` mode), unchanged.
pub(crate) fn request_body_continue() -> ProcessingResponse {
    message(Response::RequestBody(BodyResponse {
        response: Some(CommonResponse::default()),
    }))
}

/// A body sent back in full-duplex streamed mode: chunks of at most [`MAX_CHUNK`], the last
/// one (when `end` holds) marked as the end of the stream. An empty final body is one empty
/// chunk.
pub(crate) fn streamed_body(body: &[u8], end: bool, request: bool) -> Vec<ProcessingResponse> {
    let mut chunks: Vec<&[u8]> = body.chunks(MAX_CHUNK).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            let common = CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                        body: chunk.to_vec(),
                        end_of_stream: end && i + 1 == n,
                        ..StreamedBodyResponse::default()
                    })),
                }),
                ..CommonResponse::default()
            };
            let body = BodyResponse {
                response: Some(common),
            };
            message(if request {
                Response::RequestBody(body)
            } else {
                Response::ResponseBody(body)
            })
        })
        .collect()
}

/// "Continue" for response headers, removing `remove` (e.g. `content-length` when the body
/// is rewritten).
pub(crate) fn response_headers(remove: &[&str]) -> ProcessingResponse {
    let header_mutation = (!remove.is_empty()).then(|| HeaderMutation {
        set_headers: Vec::new(),
        remove_headers: remove.iter().map(|s| (*s).to_owned()).collect(),
    });
    message(Response::ResponseHeaders(HeadersResponse {
        response: Some(CommonResponse {
            header_mutation,
            ..CommonResponse::default()
        }),
    }))
}

/// A response body chunk's answer in buffered or streamed mode: unchanged, or replaced.
pub(crate) fn response_body(replace: Option<Vec<u8>>) -> ProcessingResponse {
    message(Response::ResponseBody(BodyResponse {
        response: Some(CommonResponse {
            body_mutation: replace.map(|b| BodyMutation {
                mutation: Some(Mutation::Body(b)),
            }),
            ..CommonResponse::default()
        }),
    }))
}

/// "Continue" for trailers.
pub(crate) fn trailers(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    message(if request {
        Response::RequestTrailers(t)
    } else {
        Response::ResponseTrailers(t)
    })
}

/// The error as Envoy's immediate response: the proxy's status and OpenAI JSON body.
pub(crate) fn immediate(error: &ProxyError, expose: bool, request_id: &str) -> ProcessingResponse {
    let status = error.status();
    let body = error.body_for(expose).to_json();
    let mut set = vec![
        set_header("content-type", "application/json"),
        set_header(kvgate_proxy::proxy::REQUEST_ID, request_id),
    ];
    if let ProxyError::MethodNotAllowed { allow, .. } = error {
        set.push(set_header("allow", allow));
    }
    if let Some(seconds) = error.retry_after() {
        set.push(set_header("retry-after", &seconds.to_string()));
    }
    message(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(status.as_u16()),
        }),
        headers: Some(HeaderMutation {
            set_headers: set,
            remove_headers: Vec::new(),
        }),
        body,
        details: error.reason().to_owned(),
        ..ImmediateResponse::default()
    }))
}

/// The status an immediate response carries (tests read it back).
pub fn immediate_status(response: &ProcessingResponse) -> Option<StatusCode> {
    match &response.response {
        Some(Response::ImmediateResponse(r)) => r
            .status
            .as_ref()
            .and_then(|s| u16::try_from(s.code).ok())
            .and_then(|c| StatusCode::from_u16(c).ok()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn metadata(value: Value) -> Metadata {
        let hint = Struct {
            fields: [(DESTINATION_SUBSET.to_owned(), value)]
                .into_iter()
                .collect(),
        };
        Metadata {
            filter_metadata: [(SUBSET_HINT_NAMESPACE.to_owned(), hint)]
                .into_iter()
                .collect::<HashMap<_, _>>(),
            ..Metadata::default()
        }
    }

    #[test]
    fn subset_hints_as_lists_or_comma_separated_strings() {
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        let list = metadata(string_list(&["10.0.0.1:8000", "10.0.0.2:8000"]));
        assert_eq!(
            subset_hint(Some(&list)),
            Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()])
        );
        let text = metadata(Value {
            kind: Some(Kind::StringValue(" 10.0.0.1:8000, 10.0.0.3:8000 ,".into())),
        });
        assert_eq!(
            subset_hint(Some(&text)),
            Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.3:8000".to_owned()])
        );
        // A hint that names nothing restricts to nothing.
        assert_eq!(subset_hint(Some(&metadata(string_list(&[])))), Some(vec![]));
    }

    #[test]
    fn streamed_bodies_are_chunked_and_end_once() {
        let body = vec![b'x'; MAX_CHUNK * 2 + 1];
        let msgs = streamed_body(&body, true, true);
        assert_eq!(msgs.len(), 3);
        let ends: Vec<bool> = msgs
            .iter()
            .map(|m| match &m.response {
                Some(Response::RequestBody(b)) => match b
                    .response
                    .as_ref()
                    .and_then(|c| c.body_mutation.as_ref())
                    .and_then(|m| m.mutation.as_ref())
                {
                    Some(Mutation::StreamedResponse(s)) => s.end_of_stream,
                    other => panic!("{other:?}"),
                },
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(ends, [false, false, true]);
        assert_eq!(streamed_body(&[], true, false).len(), 1);
    }

    #[test]
    fn pseudo_headers_are_read_apart() {
        let h = EnvoyHeaders {
            headers: vec![
                HeaderValue {
                    key: ":path".into(),
                    raw_value: b"/v1/completions?x=1".to_vec(),
                    ..HeaderValue::default()
                },
                HeaderValue {
                    key: ":status".into(),
                    value: "200".into(),
                    ..HeaderValue::default()
                },
                HeaderValue {
                    key: "content-type".into(),
                    raw_value: b"application/json".to_vec(),
                    ..HeaderValue::default()
                },
            ],
        };
        let got = Headers::from_envoy(Some(&h));
        assert_eq!(got.path_only(), "/v1/completions");
        assert_eq!(got.status, 200);
        assert_eq!(got.content_type(), "application/json");
        assert_eq!(got.map.len(), 1);
    }
}

//! Flow control in ext_proc mode: a gRPC client plays Envoy's side against an in-process EPP
//! whose endpoint is never called. A request whose body answer carried a pick is in flight
//! until its response ends; one over the limit gets an ImmediateResponse 429 with
//! `Retry-After` and the proxy's JSON error, or (queue mode) waits for the slot, and leaves
//! the queue when its stream closes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{
    conv::{Conv, header_map},
    spy::{Answer, Spy},
    *,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request::Request as Phase, processing_response::Response as Reply,
};

const BUFFERED: i32 = 2;

async fn epp(flow_control: &str) -> (Epp, Spy) {
    let spy = Spy::start(Answer::Json("{}".into())).await;
    let yaml = format!(
        "endpoints:\n  - url: {}\n    model: m\n{flow_control}",
        spy.url()
    );
    (Epp::start(config(&yaml, None), any_port()), spy)
}

impl Conv {
    /// A buffered chat request's headers and body; the headers' answer is read, the body's
    /// is left to the caller.
    async fn request(&mut self, extra: &[(&str, &str)]) {
        let mut list = vec![
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
        ];
        list.extend_from_slice(extra);
        let headers = ProcessingRequest {
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: BUFFERED,
                response_body_mode: BUFFERED,
                ..ProtocolConfiguration::default()
            }),
            request: Some(Phase::RequestHeaders(HttpHeaders {
                headers: Some(header_map(&list)),
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        };
        self.send(headers).await;
        let r = self.recv().await;
        assert!(
            matches!(r.response, Some(Reply::RequestHeaders(_))),
            "{r:?}"
        );
        let payload = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        self.send(ProcessingRequest {
            request: Some(Phase::RequestBody(HttpBody {
                body: payload.to_vec(),
                end_of_stream: true,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        })
        .await;
    }

    /// The engine's whole response passes: its end releases the request's slots.
    async fn respond(&mut self) {
        self.send(ProcessingRequest {
            request: Some(Phase::ResponseHeaders(HttpHeaders {
                headers: Some(header_map(&[
                    (":status", "200"),
                    ("content-type", "application/json"),
                ])),
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        })
        .await;
        self.recv().await;
        self.send(ProcessingRequest {
            request: Some(Phase::ResponseBody(HttpBody {
                body: b"{}".to_vec(),
                end_of_stream: true,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        })
        .await;
        self.recv().await;
    }
}

/// A body answer carrying a pick; the headers it removes.
fn routed(r: &ProcessingResponse) -> Vec<String> {
    let Some(Reply::RequestBody(b)) = &r.response else {
        panic!("not a routed body answer: {r:?}");
    };
    let m = b.response.clone().and_then(|c| c.header_mutation);
    m.map(|m| m.remove_headers).unwrap_or_default()
}

/// The immediate response's status, headers and JSON body.
fn immediate(r: &ProcessingResponse) -> (u16, Vec<(String, String)>, serde_json::Value) {
    let Some(Reply::ImmediateResponse(ir)) = &r.response else {
        panic!("not an immediate response: {r:?}");
    };
    let status = kvgate_epp::immediate_status(r).unwrap().as_u16();
    let headers = ir
        .headers
        .as_ref()
        .map(|h| {
            h.set_headers
                .iter()
                .filter_map(|o| o.header.as_ref())
                .map(|h| {
                    (
                        h.key.clone(),
                        String::from_utf8_lossy(&h.raw_value).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    (status, headers, serde_json::from_slice(&ir.body).unwrap())
}

/// Reject mode: at the global limit a second stream gets an ImmediateResponse 429 with
/// `Retry-After` and the JSON error; once the first response ends, a third is routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_limit_is_an_immediate_429_until_the_response_ends() {
    let (epp, _spy) = epp("flow_control: { max_in_flight: 1, queue: { max_requests: 0 } }\n").await;
    let mut first = Conv::open(&epp).await;
    first
        .request(&[
            ("x-llm-d-inference-objective", "chat"),
            ("x-llm-d-inference-fairness-id", "t"),
        ])
        .await;
    let removed = routed(&first.recv().await);
    for h in [
        "x-llm-d-inference-objective",
        "x-llm-d-inference-fairness-id",
    ] {
        assert!(
            removed.iter().any(|r| r == h),
            "{h} not removed: {removed:?}"
        );
    }

    let mut second = Conv::open(&epp).await;
    second.request(&[]).await;
    let (status, headers, body) = immediate(&second.recv().await);
    assert_eq!(status, 429);
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(header("retry-after"), Some("1"));
    assert_eq!(header("content-type"), Some("application/json"));
    assert_eq!(body["error"]["code"], "flow_control_saturated", "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error");

    first.respond().await;
    let fc = epp.proxy.flow_control().unwrap();
    wait_for("the permit released", Duration::from_secs(10), || async {
        fc.in_flight() == 0
    })
    .await;
    let mut third = Conv::open(&epp).await;
    third.request(&[]).await;
    routed(&third.recv().await);
}

/// Queue mode: a stream over the limit waits; closed while queued it leaves the queue, and
/// another queued one is routed once the first response ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_streams_wait_and_leave_when_closed() {
    let (epp, _spy) = epp("flow_control: { max_in_flight: 1 }\n").await;
    let fc = epp.proxy.flow_control().unwrap().clone();
    let mut first = Conv::open(&epp).await;
    first.request(&[]).await;
    routed(&first.recv().await);

    let mut gone = Conv::open(&epp).await;
    gone.request(&[]).await;
    wait_for("the stream queued", Duration::from_secs(10), || async {
        fc.queued() == 1
    })
    .await;
    drop(gone);
    wait_for(
        "the closed stream left the queue",
        Duration::from_secs(10),
        || async { fc.queued() == 0 },
    )
    .await;

    let mut waiting = Conv::open(&epp).await;
    waiting.request(&[]).await;
    wait_for("the stream queued", Duration::from_secs(10), || async {
        fc.queued() == 1
    })
    .await;
    first.respond().await;
    routed(&waiting.recv().await);
    assert_eq!((fc.in_flight(), fc.queued()), (1, 0));
}

//! The ext_proc protocol without Envoy: a gRPC client plays Envoy's side of the stream against
//! an in-process EPP (BUFFERED and FULL_DUPLEX_STREAMED bodies, the answer's header mutation
//! and `envoy.lb` metadata, the subset hint, errors, the response path's accounting) and
//! checks `grpc.health.v1` through start-up and drain.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{collections::HashMap, time::Duration};

use common::{
    conv::{Conv, header_map},
    spy::{Answer, Spy},
    *,
};
use envoy_types::pb::{
    envoy::{
        config::core::v3::Metadata,
        service::ext_proc::v3::{
            HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
            body_mutation::Mutation, processing_request::Request as Phase,
            processing_response::Response as Reply,
        },
    },
    google::protobuf::{Struct, value::Kind},
};
use kvgate_epp::{DESTINATION, DESTINATION_SUBSET, LB_NAMESPACE, SUBSET_HINT_NAMESPACE};
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client};

const BUFFERED: i32 = 2;
const FULL_DUPLEX: i32 = 4;

/// Three spy endpoints (never called here: the client plays Envoy) and their EPP.
async fn epp_with(edit: impl FnOnce(&mut kvgate_proxy::ProxyConfig)) -> (Epp, Vec<Spy>) {
    let mut spies = Vec::new();
    let mut yaml = String::from("endpoints:\n");
    for _ in 0..3 {
        let spy = Spy::start(Answer::Json("{}".into())).await;
        yaml += &format!("  - url: {}\n    model: m\n", spy.url());
        spies.push(spy);
    }
    let mut config = config(&yaml, None);
    edit(&mut config);
    (Epp::start(config, any_port()), spies)
}

fn headers(list: &[(&str, &str)], eos: bool, modes: Option<(i32, i32)>) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: modes.map(|(req, resp)| ProtocolConfiguration {
            request_body_mode: req,
            response_body_mode: resp,
            ..ProtocolConfiguration::default()
        }),
        request: Some(Phase::RequestHeaders(HttpHeaders {
            headers: Some(header_map(list)),
            end_of_stream: eos,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn response_headers(list: &[(&str, &str)]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Phase::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(list)),
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn body(bytes: &[u8], eos: bool, response: bool) -> ProcessingRequest {
    let b = HttpBody {
        body: bytes.to_vec(),
        end_of_stream: eos,
        ..HttpBody::default()
    };
    ProcessingRequest {
        request: Some(if response {
            Phase::ResponseBody(b)
        } else {
            Phase::RequestBody(b)
        }),
        ..ProcessingRequest::default()
    }
}

const CHAT: &[(&str, &str)] = &[
    (":method", "POST"),
    (":path", "/v1/chat/completions"),
    ("content-type", "application/json"),
];

/// The header mutation's set headers and removals, from a headers or body answer.
fn mutation(r: &ProcessingResponse) -> (HashMap<String, (String, i32)>, Vec<String>) {
    let common = match &r.response {
        Some(Reply::RequestHeaders(h)) => h.response.clone(),
        Some(Reply::RequestBody(b)) => b.response.clone(),
        other => panic!("not a request answer: {other:?}"),
    };
    let m = common.and_then(|c| c.header_mutation).unwrap_or_default();
    let set = m
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref().map(|h| (h, o.append_action)))
        .map(|(h, a)| {
            (
                h.key.clone(),
                (String::from_utf8_lossy(&h.raw_value).into_owned(), a),
            )
        })
        .collect();
    (set, m.remove_headers)
}

/// `envoy.lb` → `x-gateway-destination-endpoint`.
fn lb_endpoints(r: &ProcessingResponse) -> Vec<String> {
    let md = r.dynamic_metadata.as_ref().expect("no dynamic metadata");
    let Some(Kind::StructValue(ns)) = md.fields.get(LB_NAMESPACE).and_then(|v| v.kind.clone())
    else {
        panic!("no {LB_NAMESPACE} namespace: {md:?}");
    };
    let Some(Kind::StringValue(list)) = ns.fields.get(DESTINATION).and_then(|v| v.kind.clone())
    else {
        panic!("no {DESTINATION} key: {ns:?}");
    };
    list.split(',').map(str::to_owned).collect()
}

fn immediate(r: &ProcessingResponse) -> (u16, serde_json::Value) {
    let Some(Reply::ImmediateResponse(ir)) = &r.response else {
        panic!("not an immediate response: {r:?}");
    };
    let status = kvgate_epp::immediate_status(r).unwrap().as_u16();
    let ct = ir
        .headers
        .as_ref()
        .and_then(|h| h.set_headers.iter().find_map(|o| o.header.clone()))
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned());
    assert_eq!(ct.as_deref(), Some("application/json"));
    (status, serde_json::from_slice(&ir.body).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_body_gets_the_pick_as_header_and_metadata_and_goes_back_unchanged() {
    let (epp, spies) = epp_with(|_| {}).await;
    let names: Vec<String> = spies.iter().map(|s| s.addr.to_string()).collect();
    let mut conv = Conv::open(&epp).await;
    let mut list = CHAT.to_vec();
    list.push((DESTINATION, "10.255.255.1:1"));
    list.push(("x-prefiller-host-port", "10.255.255.2:1"));
    conv.send(headers(&list, false, Some((BUFFERED, BUFFERED))))
        .await;
    let r = conv.recv().await;
    assert!(
        matches!(r.response, Some(Reply::RequestHeaders(_))),
        "{r:?}"
    );
    let payload = br#"{"model":"m", "messages":[{"role":"user","content":"hi"}]}"#;
    conv.send(body(payload, true, false)).await;
    let r = conv.recv().await;
    let (set, remove) = mutation(&r);
    let (dest, action) = &set[DESTINATION];
    assert!(names.contains(dest), "{dest} is not an endpoint");
    assert_eq!(*action, 2, "the client's value must be overwritten");
    assert_eq!(set["content-length"].0, payload.len().to_string());
    assert!(
        remove.contains(&"x-prefiller-host-port".to_owned()),
        "{remove:?}"
    );
    let Some(Reply::RequestBody(b)) = &r.response else {
        unreachable!()
    };
    let common = b.response.as_ref().unwrap();
    assert!(
        common.body_mutation.is_none(),
        "body changed without an alias"
    );
    assert!(common.clear_route_cache);
    // The pick first, then its fallbacks: every endpoint once.
    let lb = lb_endpoints(&r);
    assert_eq!(&lb[0], dest);
    let mut sorted = lb.clone();
    sorted.sort();
    let mut want = names.clone();
    want.sort();
    assert_eq!(sorted, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_chunks_are_accumulated_and_streamed_back_after_the_pick() {
    let (epp, _spies) = epp_with(|c| c.add_alias("short", "m").unwrap()).await;
    let mut conv = Conv::open(&epp).await;
    conv.send(headers(CHAT, false, Some((FULL_DUPLEX, FULL_DUPLEX))))
        .await;
    let parts: [&[u8]; 3] = [
        br#"{"model": "sh"#,
        br#"ort","messages":[{"role":"#,
        br#""user","content":"x"}]}"#,
    ];
    for (i, p) in parts.iter().enumerate() {
        conv.send(body(p, i == 2, false)).await;
    }
    // The headers answer comes only now, with the pick, then the body.
    let r = conv.recv().await;
    assert!(
        matches!(r.response, Some(Reply::RequestHeaders(_))),
        "{r:?}"
    );
    let (set, _) = mutation(&r);
    assert!(set.contains_key(DESTINATION));
    let want = br#"{"model": "m","messages":[{"role":"user","content":"x"}]}"#;
    assert_eq!(set["content-length"].0, want.len().to_string());
    let mut got = Vec::new();
    loop {
        let r = conv.recv().await;
        let Some(Reply::RequestBody(b)) = r.response else {
            panic!("{r:?}");
        };
        let Some(Mutation::StreamedResponse(s)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("not a streamed body");
        };
        got.extend_from_slice(&s.body);
        if s.end_of_stream {
            break;
        }
    }
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(want));
}

fn with_subset(mut msg: ProcessingRequest, subset: &[&str]) -> ProcessingRequest {
    let hint = Struct {
        fields: [(
            DESTINATION_SUBSET.to_owned(),
            kvgate_epp::string_list(subset),
        )]
        .into_iter()
        .collect(),
    };
    msg.metadata_context = Some(Metadata {
        filter_metadata: [(SUBSET_HINT_NAMESPACE.to_owned(), hint)]
            .into_iter()
            .collect(),
        ..Metadata::default()
    });
    msg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_restricts_candidates_and_an_empty_one_is_a_503() {
    let (epp, spies) = epp_with(|_| {}).await;
    let only = spies[2].addr.to_string();
    let payload = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    for _ in 0..4 {
        let mut conv = Conv::open(&epp).await;
        let msg = with_subset(headers(CHAT, false, Some((BUFFERED, BUFFERED))), &[&only]);
        conv.send(msg).await;
        conv.recv().await;
        conv.send(body(payload, true, false)).await;
        let r = conv.recv().await;
        assert_eq!(mutation(&r).0[DESTINATION].0, only);
        assert_eq!(lb_endpoints(&r), vec![only.clone()]);
    }
    let mut conv = Conv::open(&epp).await;
    conv.send(with_subset(
        headers(CHAT, false, Some((BUFFERED, BUFFERED))),
        &[],
    ))
    .await;
    conv.recv().await;
    conv.send(body(payload, true, false)).await;
    let (status, json) = immediate(&conv.recv().await);
    assert_eq!(status, 503);
    assert_eq!(json["error"]["code"], "no_healthy_endpoint");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_get_the_proxy_json_errors() {
    let (epp, _spies) = epp_with(|c| c.max_body_bytes = 64).await;
    let cases: [(&[u8], u16, &str); 3] = [
        (b"{not json", 400, "invalid_request_error"),
        (&[b' '; 65], 413, "invalid_request_error"),
        (br#"{"messages":[]}"#, 400, "invalid_request_error"),
    ];
    for (payload, want, kind) in cases {
        let mut conv = Conv::open(&epp).await;
        conv.send(headers(CHAT, false, Some((FULL_DUPLEX, FULL_DUPLEX))))
            .await;
        conv.send(body(payload, true, false)).await;
        let (status, json) = immediate(&conv.recv().await);
        assert_eq!(status, want, "{json}");
        assert_eq!(json["error"]["type"], kind, "{json}");
    }
    // The path table: an unknown path is a 404.
    let mut conv = Conv::open(&epp).await;
    let list = [(":method", "POST"), (":path", "/v1/nope")];
    conv.send(headers(&list, false, Some((BUFFERED, BUFFERED))))
        .await;
    conv.recv().await;
    conv.send(body(b"{}", true, false)).await;
    assert_eq!(immediate(&conv.recv().await).0, 404);
}

/// Bodies are reserved in the proxy's in-flight body budget while they accumulate: a body
/// that does not fit next to another one still arriving is a 503 with the budget's code; one
/// larger than the whole budget is a 413; the bytes come back once the pick is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_in_flight_share_the_body_budget() {
    let (epp, _spies) = epp_with(|c| c.max_inflight_body_bytes = 100).await;
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let open = || async {
        let conv = Conv::open(&epp).await;
        conv.send(headers(CHAT, false, Some((FULL_DUPLEX, FULL_DUPLEX))))
            .await;
        conv
    };
    let picked = |r: &ProcessingResponse| mutation(r).0.contains_key(DESTINATION);

    // Larger than the whole budget: could never fit.
    let mut big = open().await;
    big.send(body(&[b' '; 101], true, false)).await;
    let (status, json) = immediate(&big.recv().await);
    assert_eq!(status, 413, "{json}");

    // The first 40 bytes of one body are held while a second body wants 61 more.
    let mut first = open().await;
    first.send(body(&chat[..40], false, false)).await;
    // The streams are served concurrently: the second body is sent once the first one's
    // bytes are reserved.
    let held = || epp.proxy.body_budget().held();
    wait_for(
        "the first body's bytes reserved",
        Duration::from_secs(10),
        || async { held() >= 40 },
    )
    .await;
    let mut second = open().await;
    second.send(body(&[b' '; 61], false, false)).await;
    let (status, json) = immediate(&second.recv().await);
    assert_eq!(status, 503, "{json}");
    assert_eq!(json["error"]["code"], "body_budget_exhausted", "{json}");

    // The first body ends and is routed; its bytes are given back.
    first.send(body(&chat[40..], true, false)).await;
    assert!(picked(&first.recv().await), "the first body is routed");
    wait_for(
        "the first body's bytes given back",
        Duration::from_secs(10),
        || async { held() == 0 },
    )
    .await;
    let mut third = open().await;
    let mut padded = chat.to_vec();
    padded.resize(100, b' ');
    third.send(body(&padded, true, false)).await;
    assert!(
        picked(&third.recv().await),
        "the whole budget is free again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_path_reads_usage_and_releases_the_load_also_on_abort() {
    let (epp, _spies) = epp_with(|_| {}).await;
    let payload = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut conv = Conv::open(&epp).await;
    conv.send(headers(CHAT, false, Some((BUFFERED, FULL_DUPLEX))))
        .await;
    conv.recv().await;
    conv.send(body(payload, true, false)).await;
    let dest = mutation(&conv.recv().await).0[DESTINATION].0.clone();
    let in_flight = |epp: &Epp| {
        let snap = epp.proxy.registry().snapshot(std::time::Instant::now());
        snap.endpoints
            .iter()
            .map(|e| (e.name.clone(), (e.in_flight_requests, e.reported_requests)))
            .collect::<HashMap<_, _>>()
    };
    assert_eq!(in_flight(&epp)[&dest].0, 1, "the pick holds the load");
    conv.send(response_headers(&[
        (":status", "200"),
        ("content-type", "text/event-stream"),
    ]))
    .await;
    conv.recv().await;
    let events: [&[u8]; 2] = [
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n",
    ];
    let mut echoed = Vec::new();
    for (i, e) in events.iter().enumerate() {
        conv.send(body(e, i == 1, true)).await;
        let r = conv.recv().await;
        let Some(Reply::ResponseBody(b)) = r.response else {
            panic!("{r:?}");
        };
        let Some(Mutation::StreamedResponse(s)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("not streamed back");
        };
        echoed.extend_from_slice(&s.body);
    }
    assert_eq!(echoed, events.concat(), "the response body changed");
    wait_for("load released, usage read", Duration::from_secs(10), || {
        let now = in_flight(&epp)[&dest];
        async move { now == (0, 1) }
    })
    .await;

    // Envoy gives up after the pick (client gone): the stream ends, the load goes.
    let mut conv = Conv::open(&epp).await;
    conv.send(headers(CHAT, false, Some((BUFFERED, FULL_DUPLEX))))
        .await;
    conv.recv().await;
    conv.send(body(payload, true, false)).await;
    let dest = mutation(&conv.recv().await).0[DESTINATION].0.clone();
    assert_eq!(in_flight(&epp)[&dest].0, 1);
    drop(conv);
    wait_for("load released after abort", Duration::from_secs(10), || {
        let now = in_flight(&epp)[&dest].0;
        async move { now == 0 }
    })
    .await;

    // The admin port serves epp's metrics and readiness.
    let (status, text) = get(&format!("http://{}/metrics", epp.admin)).await.unwrap();
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains("kvgate_requests_total{"), "{text}");
    assert_eq!(
        get(&format!("http://{}/ready", epp.admin)).await.unwrap().0,
        200
    );
}

/// The health status, `None` when the check fails or takes over 2 s.
async fn health(epp: &Epp, service: &str) -> Option<ServingStatus> {
    tokio::time::timeout(Duration::from_secs(2), health_check(epp, service))
        .await
        .ok()
        .flatten()
}

async fn health_check(epp: &Epp, service: &str) -> Option<ServingStatus> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", epp.addr))
        .ok()?
        .connect()
        .await
        .ok()?;
    let mut client = health_client::HealthClient::new(channel);
    let resp = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(resp.into_inner().status).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_serving_once_kv_streams_are_up_and_not_serving_while_draining() {
    // An endpoint whose KV-event publisher is not up yet.
    let (kv_socket, kv_port) = reserved_socket();
    let spy = Spy::start(Answer::Json("{}".into())).await;
    let yaml = format!(
        "endpoints:\n  - url: {}\n    model: m\n    kv_events: tcp://127.0.0.1:{kv_port}\n",
        spy.url()
    );
    let options = kvgate_epp::EppOptions {
        drain_timeout: Duration::from_secs(30),
        readiness_interval: Duration::from_millis(50),
    };
    let mut epp = Epp::start_with(config(&yaml, None), any_port(), options);
    assert_eq!(
        health(&epp, "").await,
        Some(ServingStatus::NotServing),
        "serving before the KV stream is up"
    );
    let _publisher = kv_socket.listen(16).unwrap();
    for service in ["", kvgate_epp::SERVICE_NAME] {
        wait_for("SERVING", Duration::from_secs(10), || async {
            health(&epp, service).await == Some(ServingStatus::Serving)
        })
        .await;
    }

    // A stream in flight when SIGTERM comes: NOT_SERVING, the server waits for it.
    let mut conv = Conv::open(&epp).await;
    conv.send(headers(CHAT, false, Some((BUFFERED, BUFFERED))))
        .await;
    conv.recv().await;
    epp.signal_shutdown();
    wait_for(
        "NOT_SERVING while draining",
        Duration::from_secs(10),
        || async { health(&epp, "").await == Some(ServingStatus::NotServing) },
    )
    .await;
    assert!(
        !epp.finished_within(Duration::from_millis(200)).await,
        "stopped with a stream in flight"
    );
    // The stream still works while draining.
    let payload = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    conv.send(body(payload, true, false)).await;
    assert!(mutation(&conv.recv().await).0.contains_key(DESTINATION));
    drop(conv);
    assert!(
        epp.finished_within(Duration::from_secs(10)).await,
        "did not stop after its last stream ended"
    );
}

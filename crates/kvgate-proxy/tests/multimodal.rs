//! End to end with an image prompt: a spy render server answers kvgate's render call with
//! token ids and one image item (`features.mm_hashes` / `mm_placeholders`); two spy engines
//! publish, over real ZMQ, `BlockStored` events for the same token ids, one with the image's
//! `[identifier, offset]` in the `extra_keys` of the blocks it overlaps (as vLLM does), one
//! without. The block keys the scheduler scores must carry the image hash: the engine whose
//! blocks carry it is predicted the whole prompt, the other nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{convert::Infallible, path::PathBuf, time::Duration};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{server::conn::http1, service::service_fn};
use hyper_util::{client::legacy::Client, rt::TokioExecutor, rt::TokioIo};
use kvgate_kvcache::{BlockHash, BlockStored, Encoding, ExtraKey, KvEvent, encode_batch};
use kvgate_proxy::{
    EndpointConfig, ProxyConfig, TokenizerSpec,
    test_util::{Behavior, RunningProxy, Spy},
};
use serde_json::{Value, json};
use tokio::{net::TcpListener, sync::mpsc};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const MODEL: &str = "Qwen/Qwen2.5-VL-3B-Instruct";
const BLOCK: usize = 16;
/// 4 full blocks and a partial tail.
const PROMPT_TOKENS: u32 = 70;
const IMAGE_HASH: &str = "2f1e0c8a9b7d6e5f";
/// The image's placeholders: tokens 5..25, overlapping blocks 0 and 1.
const IMAGE_OFFSET: usize = 5;
const IMAGE_LENGTH: usize = 20;

fn token_ids() -> Vec<u32> {
    (1..=PROMPT_TOKENS).collect()
}

/// How long the render spy holds its answer.
const RENDER_DELAY: Duration = Duration::from_millis(30);

/// A render server answering `/v1/chat/completions/render` with the prompt's ids and the
/// image item, after [`RENDER_DELAY`]; every body it receives goes to the returned channel.
async fn render_spy() -> (String, mpsc::UnboundedReceiver<Bytes>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    let answer = json!({
        "request_id": "render",
        "token_ids": token_ids(),
        "features": {
            "mm_hashes": { "image": [IMAGE_HASH] },
            "mm_placeholders": { "image": [{ "offset": IMAGE_OFFSET, "length": IMAGE_LENGTH }] },
        },
    })
    .to_string();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (tx, answer) = (tx.clone(), answer.clone());
            let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let (tx, answer) = (tx.clone(), answer.clone());
                async move {
                    let path = req.uri().path().to_owned();
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let status = if path == "/v1/chat/completions/render" {
                        let _ = tx.send(body);
                        // The router has its facts no sooner than this answer.
                        tokio::time::sleep(RENDER_DELAY).await;
                        200
                    } else {
                        404
                    };
                    let resp = http::Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(answer)))
                        .unwrap();
                    Ok::<_, Infallible>(resp)
                }
            });
            tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), svc));
        }
    });
    (url, rx)
}

/// One engine: an HTTP spy and a KV-event PUB socket.
struct Engine {
    http: Spy,
    events: PubSocket,
    events_url: String,
    seq: u64,
    stored: BlockStored,
}

impl Engine {
    /// `with_image`: the stored blocks' `extra_keys` carry the image as vLLM publishes it.
    async fn start(with_image: bool) -> Engine {
        let http = Spy::start(Behavior::Json(
            r#"{"id":"x","model":"{MODEL}","choices":[]}"#.into(),
        ))
        .await;
        let mut events = PubSocket::new();
        let events_url = events.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let ids = token_ids();
        let blocks = ids.len() / BLOCK;
        let extra_keys = with_image.then(|| {
            (0..blocks)
                .map(|b| {
                    let (start, end) = (b * BLOCK, (b + 1) * BLOCK);
                    let overlaps = end > IMAGE_OFFSET && start < IMAGE_OFFSET + IMAGE_LENGTH;
                    overlaps.then(|| {
                        vec![ExtraKey::Mm {
                            identifier: IMAGE_HASH.into(),
                            offset: IMAGE_OFFSET as i64 - start as i64,
                        }]
                    })
                })
                .collect()
        });
        let stored = BlockStored {
            block_hashes: (1..=blocks as u64).map(BlockHash::Int).collect(),
            parent_block_hash: None,
            token_ids: ids[..blocks * BLOCK].to_vec(),
            block_size: BLOCK as u32,
            medium: Some("GPU".into()),
            extra_keys,
            ..Default::default()
        };
        Engine {
            http,
            events,
            events_url,
            seq: 0,
            stored,
        }
    }

    /// Publishes the stored blocks again (a subscriber that joined late missed the others).
    async fn publish(&mut self) {
        let payload = encode_batch(
            self.seq as f64,
            &[KvEvent::BlockStored(self.stored.clone())],
            Some(0),
            Encoding::Map,
        );
        let frames = vec![
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&self.seq.to_be_bytes()),
            Bytes::from(payload),
        ];
        self.events
            .send(ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
        self.seq += 1;
    }

    fn endpoint(&self) -> EndpointConfig {
        let mut ep = EndpointConfig::new(self.http.url());
        ep.kv_events = Some(self.events_url.clone());
        ep.model = Some(MODEL.into());
        ep
    }
}

/// Publishes until the proxy's index holds every engine's blocks.
async fn publish_until_indexed(proxy: &RunningProxy, engines: &mut [&mut Engine]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let blocks = PROMPT_TOKENS as usize / BLOCK;
    loop {
        for e in engines.iter_mut() {
            e.publish().await;
        }
        let snapshot = proxy.proxy.registry().snapshot(std::time::Instant::now());
        if snapshot
            .endpoints
            .iter()
            .all(|e| e.index_holdings >= blocks)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "engines' blocks never reached the index"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for the decision log's first line.
async fn first_log_line(path: &PathBuf) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(line) = text.lines().next().filter(|_| text.ends_with('\n')) {
            return serde_json::from_str(line).unwrap();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no decision log line"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_prompts_match_blocks_keyed_with_their_mm_hash() {
    let (render_url, mut rendered) = render_spy().await;
    let mut plain = Engine::start(false).await;
    let mut with_image = Engine::start(true).await;
    let log = std::env::temp_dir().join(format!(
        "kvgate-multimodal-{}-{:?}.jsonl",
        std::process::id(),
        std::time::SystemTime::now()
    ));
    let mut config = ProxyConfig {
        // The engine without the image first: a tie would not pick the image engine.
        endpoints: vec![plain.endpoint(), with_image.endpoint()],
        models_refresh: None,
        scores_header: true,
        // The test reads `x-kvgate-endpoint`.
        expose_internals: true,
        decision_log: Some(log.clone()),
        ..ProxyConfig::default()
    };
    config.set_tokenizer(
        MODEL,
        &TokenizerSpec {
            local: None,
            render: Some(render_url),
            backends: None,
            render_timeout_ms: None,
            render_media_timeout_ms: None,
        },
    );
    let proxy = RunningProxy::start(config).await;
    publish_until_indexed(&proxy, &mut [&mut plain, &mut with_image]).await;

    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]}]})
    .to_string();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("{}/v1/chat/completions", proxy.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.clone())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let full_blocks = (PROMPT_TOKENS as usize / BLOCK * BLOCK).to_string();
    assert_eq!(
        resp.headers()["x-kvgate-endpoint"],
        with_image.http.addr.to_string().as_str(),
        "not routed to the engine holding the image's blocks"
    );
    assert_eq!(
        resp.headers()["x-kvgate-predicted-tokens"],
        full_blocks.as_str()
    );
    resp.into_body().collect().await.unwrap();
    // The render call got the client's bytes; the engine got them too.
    assert_eq!(rendered.recv().await.unwrap(), body.as_bytes());
    assert_eq!(with_image.http.next_request().await.body, body.as_bytes());

    // Every candidate's prediction: the same tokens without the image's keys match nothing.
    let line = first_log_line(&log).await;
    let _ = std::fs::remove_file(&log);
    // The router's own time before the pick: the body, then the facts (the render call
    // included), then the decision.
    let ms = |k: &str| {
        line["router"][k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k}: {line}"))
    };
    assert!(
        0.0 <= ms("body_ms") && ms("body_ms") <= ms("facts_ms"),
        "{line}"
    );
    assert!(ms("facts_ms") >= RENDER_DELAY.as_secs_f64() * 1e3, "{line}");
    assert!(ms("facts_ms") <= ms("decided_ms"), "{line}");
    let predicted = |spy: &Spy| {
        line["decision"]["runs"][0]["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["endpoint"] == spy.addr.to_string().as_str())
            .map(|c| c["predicted_cached_tokens"].as_u64())
            .unwrap_or_else(|| panic!("{spy:?} not a candidate: {line}"))
    };
    assert_eq!(
        predicted(&with_image.http),
        Some(full_blocks.parse().unwrap())
    );
    assert_eq!(predicted(&plain.http), Some(0), "{line}");
}

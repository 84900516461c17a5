//! Chat image parts: render answers vLLM's `features` for them, generation publishes
//! `BlockStored` events whose `extra_keys` carry `[mm_hash, offset]` per block as vLLM does,
//! and remote image URLs are refused.

use kvgate_kvcache::ExtraKey;

use super::*;

const MODEL: &str = "Qwen/Qwen3-0.6B";
const IMAGE_PAD: u64 = 151_655;

/// A data URL of `n` distinct-ish bytes (base64 of `n` bytes, `n` a multiple of 3).
fn data_url(seed: u8, n: usize) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let payload: String = (0..n / 3 * 4)
        .map(|i| char::from(B64[(i * 7 + usize::from(seed) * 13) % 64]))
        .collect();
    format!("data:image/png;base64,{payload}")
}

fn image_chat(text: &str, url: &str) -> Value {
    json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in it?"},
    ]}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_chat_renders_features_and_publishes_mm_extra_keys() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let mut sub = subscribe(&sim).await;
    // 300 bytes -> 38 placeholder tokens: the image spans three 16-token blocks.
    let body = image_chat("Describe this picture.", &data_url(1, 300));

    let render = post(http, "/v1/chat/completions/render", body.clone()).await;
    assert_eq!(
        render.status,
        200,
        "{}",
        String::from_utf8_lossy(&render.body)
    );
    let r = render.json();
    let ids: Vec<u64> = r["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let hash = r["features"]["mm_hashes"]["image"][0]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(hash.len(), 64, "hex digest: {hash}");
    let place = &r["features"]["mm_placeholders"]["image"];
    assert_eq!(place.as_array().unwrap().len(), 1);
    let (offset, length) = (
        place[0]["offset"].as_u64().unwrap() as usize,
        place[0]["length"].as_u64().unwrap() as usize,
    );
    assert_eq!(length, 38);
    assert!(ids[offset..offset + length].iter().all(|&t| t == IMAGE_PAD));
    assert_eq!(ids[offset - 1], 151_652, "<|vision_start|> before the pads");
    assert_eq!(
        ids[offset + length],
        151_653,
        "<|vision_end|> after the pads"
    );
    assert_eq!(ids.iter().filter(|&&t| t == IMAGE_PAD).count(), length);

    // Generation stores the same tokens, each block keyed with vLLM's mm extra keys.
    let resp = post(http, "/v1/chat/completions", body.clone()).await;
    assert_eq!(resp.status, 200, "{}", String::from_utf8_lossy(&resp.body));
    assert_eq!(resp.json()["usage"]["prompt_tokens"], ids.len());
    let full = ids.len() / 16;
    let mut tokens = Vec::new();
    let mut extra = Vec::new();
    while tokens.len() < full * 16 {
        let (_, batch) = recv_batch(&mut sub).await.expect("BlockStored events");
        for e in batch.events {
            if let KvEvent::BlockStored(s) = e {
                tokens.extend(s.token_ids.iter().map(|&t| u64::from(t)));
                extra.extend(s.extra_keys.unwrap_or_default());
            }
        }
    }
    assert_eq!(tokens, ids[..full * 16]);
    let want: Vec<Option<Vec<ExtraKey>>> = (0..full)
        .map(|b| {
            let (start, end) = (b * 16, b * 16 + 16);
            (end > offset && start < offset + length).then(|| {
                vec![ExtraKey::Mm {
                    identifier: hash.clone(),
                    offset: offset as i64 - start as i64,
                }]
            })
        })
        .collect();
    assert_eq!(extra, want);
    assert!(want.iter().filter(|w| w.is_some()).count() >= 3);

    // The same image again hits every full block (vLLM leaves at least one token to compute).
    let again = post(http, "/v1/chat/completions", body).await.json();
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        (ids.len() - 1) / 16 * 16
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_identity_and_refused_urls() {
    let sim = sim(&[]).await;
    let http = sim.instances()[0].http;
    let render = |body: Value| async move {
        let r = post(http, "/v1/chat/completions/render", body).await;
        (r.status, r.json())
    };
    let (_, a) = render(image_chat("x", &data_url(1, 30))).await;
    let (_, a2) = render(image_chat("x", &data_url(1, 30))).await;
    let (_, b) = render(image_chat("x", &data_url(2, 30))).await;
    let id = |v: &Value| v["features"]["mm_hashes"]["image"][0].clone();
    assert_eq!(id(&a), id(&a2), "same image, same hash");
    assert_ne!(id(&a), id(&b), "other image, other hash");
    assert_eq!(a["features"]["mm_placeholders"]["image"][0]["length"], 4);
    let mut with_uuid = image_chat("x", &data_url(1, 30));
    with_uuid["messages"][0]["content"][1]["uuid"] = json!("cat-1");
    let (_, u) = render(with_uuid).await;
    assert_eq!(id(&u), json!("cat-1"), "a client uuid is the identifier");
    let (_, text) = render(chat("no images here")).await;
    assert_eq!(text["features"], Value::Null);

    for (url, want) in [
        ("https://example.com/cat.png", "only takes data: image URLs"),
        ("http://example.com/cat.png", "only takes data: image URLs"),
        ("data:image/png;base64,@@@@", "not valid base64"),
    ] {
        for path in ["/v1/chat/completions/render", "/v1/chat/completions"] {
            let r = post(http, path, image_chat("x", url)).await;
            assert_eq!(r.status, 400, "{path} {url}");
            let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
            assert!(msg.contains(want), "{path} {url}: {msg}");
        }
    }
    // Text that itself holds the placeholder token cannot be paired with the images.
    let r = post(
        http,
        "/v1/chat/completions",
        image_chat("<|image_pad|>", &data_url(1, 30)),
    )
    .await;
    assert_eq!(r.status, 400);
}

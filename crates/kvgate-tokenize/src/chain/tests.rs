use std::path::PathBuf;

use kvgate_request::Request;

use super::*;
use crate::test_util::{self, PANIC_BODY};

fn sealed(body: &str) -> SealedRequest {
    let req = Request::parse(Api::ChatCompletions, Bytes::from(body.to_owned())).unwrap();
    req.seal("req-1".to_owned())
}

fn service(order: &[BackendKind], threads: usize) -> TokenizeService {
    let chain = TokenizerChain::new("m", order, Some(test_util::qwen3()), None);
    let pool = PoolOptions {
        threads,
        queue_limit: 8,
        max_queue_wait: None,
    };
    TokenizeService::from_chains(vec![chain], pool, TokenizeMetrics::unregistered()).unwrap()
}

const HI: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
const HI_IDS: [u32; 9] = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198];

#[tokio::test]
async fn tokenizer_panics_fall_back_and_keep_the_workers() {
    let threads = 2;
    let svc = service(&[BackendKind::Local, BackendKind::Estimate], threads);
    let panics = 3 * threads;
    for i in 0..panics {
        let out = svc.tokenize(&sealed(PANIC_BODY)).await.unwrap();
        assert_eq!(out.backend, BackendKind::Estimate, "panic {i}");
        let [fallback] = out.fallbacks.as_slice() else {
            panic!("panic {i}: {:?}", out.fallbacks);
        };
        assert_eq!(fallback.backend, BackendKind::Local);
        assert_eq!(fallback.error.reason, FallbackReason::TokenizerPanic);
        assert!(
            fallback.error.detail.contains("test seam: tokenizer panic"),
            "{}",
            fallback.error.detail
        );
        // The prefix path answers "use the full chain" instead of failing.
        let prefix = svc.tokenize_prefix(&sealed(PANIC_BODY), 16).await.unwrap();
        assert!(prefix.is_none(), "panic {i}");
    }
    let m = svc.metrics();
    assert_eq!(m.panics_value(), 2 * panics as u64);
    let label = FallbackReason::TokenizerPanic.label();
    assert_eq!(
        m.attempts_value("m", "local", "fallback", label),
        panics as u64
    );
    // The workers survived: the pool still runs the local backend.
    for _ in 0..2 * threads {
        let out = svc.tokenize(&sealed(HI)).await.unwrap();
        assert_eq!(out.backend, BackendKind::Local);
        assert_eq!(out.token_ids(), HI_IDS);
    }
    assert_eq!(m.queue_rejected_value(), 0);
}

#[tokio::test]
async fn a_panic_is_an_error_when_local_is_the_last_backend() {
    let svc = service(&[BackendKind::Local], 1);
    let err = svc.tokenize(&sealed(PANIC_BODY)).await.unwrap_err();
    let TokenizeError::AllBackendsFailed { fallbacks } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(fallbacks[0].error.reason, FallbackReason::TokenizerPanic);
    let label = FallbackReason::TokenizerPanic.label();
    let m = svc.metrics();
    assert_eq!(m.attempts_value("m", "local", "error", label), 1);
    assert_eq!(svc.tokenize(&sealed(HI)).await.unwrap().token_ids(), HI_IDS);
}

#[test]
fn build_errors_name_the_bad_field() {
    let with = |f: fn(&mut ModelTokenizerConfig)| {
        let mut cfg = ModelTokenizerConfig::new("qwen3");
        f(&mut cfg);
        cfg
    };
    let cases: [(&str, ModelTokenizerConfig, &str); 3] = [
        (
            "render_url scheme",
            with(|c| c.render_url = Some("https://r:8000".into())),
            "model qwen3: render_url \"https://r:8000\" is not an http:// url \
             (or https:// with TLS settings)",
        ),
        (
            "render_url syntax",
            with(|c| c.render_url = Some("http://bad host".into())),
            "model qwen3: render_url \"http://bad host\" is not an http:// url \
             (or https:// with TLS settings)",
        ),
        (
            "tokenizer_dir",
            with(|c| c.tokenizer_dir = Some(PathBuf::from("/nonexistent/tok"))),
            "model qwen3: tokenizer_dir /nonexistent/tok",
        ),
    ];
    for (name, cfg, want) in cases {
        let err = TokenizerChain::from_config(&cfg, LocalOptions::default()).unwrap_err();
        assert_eq!(err.to_string(), want, "{name}");
    }
    // With TLS settings an https:// render server is accepted; a bad URL still is not.
    let tls = std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth(),
    );
    let https = with(|c| c.render_url = Some("https://r:8000".into()));
    assert!(
        TokenizerChain::from_config_with_tls(&https, LocalOptions::default(), Some(&tls)).is_ok()
    );
    let bad = with(|c| c.render_url = Some("https://bad host".into()));
    assert!(
        TokenizerChain::from_config_with_tls(&bad, LocalOptions::default(), Some(&tls)).is_err()
    );
    let config = TokenizeConfig {
        models: vec![
            ModelTokenizerConfig::new("a"),
            ModelTokenizerConfig::new("a"),
        ],
        ..TokenizeConfig::default()
    };
    let err = TokenizeService::with_metrics(&config, TokenizeMetrics::unregistered()).unwrap_err();
    assert_eq!(err.to_string(), "model a is configured twice");
}

/// A prefix pass that encodes little the segment cache lacks (a chat's probe, a turn whose
/// system prompt is cached) runs on the caller's thread: it completes while every pool
/// worker is busy and the queue is full. A large pass (the rest of a cold prompt) still goes
/// to the pool and is refused there.
#[tokio::test]
async fn small_prefix_passes_do_not_wait_for_the_pool() {
    let chain = TokenizerChain::new("m", &[BackendKind::Local], Some(test_util::qwen3()), None);
    let pool = PoolOptions {
        threads: 1,
        queue_limit: 1,
        max_queue_wait: None,
    };
    let svc =
        TokenizeService::from_chains(vec![chain], pool, TokenizeMetrics::unregistered()).unwrap();
    let mut rng = test_util::Rng(5);
    let words = |rng: &mut test_util::Rng, n: usize| -> String {
        (0..n)
            .map(|_| rng.pick(test_util::BENCH_WORDS))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let system = words(&mut rng, 3000);
    let chat = |user: &str| {
        serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]})
        .to_string()
    };
    let cold = chat(&words(&mut rng, 3000));
    let earlier = chat("an earlier question");
    let next = chat("the next question");
    // Cache the system prompt through the pool while it is free.
    svc.tokenize(&sealed(&earlier)).await.unwrap();
    // Occupy the one worker, then fill the one queue slot.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    let gate_rx = std::sync::Arc::new(std::sync::Mutex::new(gate_rx));
    let g = std::sync::Arc::clone(&gate_rx);
    let busy = svc
        .pool
        .submit(move || {
            started_tx.send(()).unwrap();
            let _ = g.lock().unwrap().recv();
        })
        .unwrap();
    started_rx.recv().unwrap();
    let g = std::sync::Arc::clone(&gate_rx);
    let queued = svc
        .pool
        .submit(move || {
            let _ = g.lock().unwrap().recv();
        })
        .unwrap();
    let s = svc.tokenize_prefix(&sealed(&cold), 512).await.unwrap();
    let s = s.expect("probed on the caller's thread");
    assert!(!s.is_complete(), "a cold chat is probed");
    let rest = svc.extend_prefix(s, usize::MAX).await;
    assert!(matches!(rest, Err(TokenizeError::QueueFull)), "{rest:?}");
    let warm = svc.tokenize_prefix(&sealed(&next), 512).await.unwrap();
    let warm = warm.expect("encoded on the caller's thread");
    assert!(warm.is_complete(), "a cached turn is encoded whole at once");
    let full = test_util::qwen3()
        .tokenize(Api::ChatCompletions, next.as_bytes())
        .unwrap();
    assert_eq!(
        warm.exact_ids(),
        full[0].token_ids,
        "the ids of full tokenization"
    );
    drop(gate_tx);
    busy.await.unwrap().unwrap();
    queued.await.unwrap().unwrap();
}

/// The render cache's lookups are counted under the chain's model: a chat's first request
/// misses, the same bytes again hit, bytes that differ in one character miss.
#[tokio::test]
async fn render_cache_lookups_are_counted_per_model() {
    // Its own tokenizer: the shared fixture's counters belong to the first service built on it.
    let t =
        Arc::new(LocalTokenizer::load(&test_util::qwen3_dir(), LocalOptions::default()).unwrap());
    let chain = TokenizerChain::new("m", &[BackendKind::Local], Some(t), None);
    let metrics = TokenizeMetrics::unregistered();
    let pool = PoolOptions {
        threads: 1,
        queue_limit: 8,
        max_queue_wait: None,
    };
    let svc = TokenizeService::from_chains(vec![chain], pool, metrics.clone()).unwrap();
    let a = r#"{"model":"m","messages":[{"role":"user","content":"1.0"}]}"#;
    let b = r#"{"model":"m","messages":[{"role":"user","content":"1"}]}"#;
    for (row, body, hits, misses) in [("first", a, 0, 1), ("again", a, 1, 1), ("other", b, 1, 2)] {
        svc.tokenize(&sealed(body)).await.unwrap();
        let got = (
            metrics.render_cache_value("m", "hit"),
            metrics.render_cache_value("m", "miss"),
        );
        assert_eq!(got, (hits, misses), "{row}");
    }
}

//! Defect 1 of issue #11: a prompt too large to tokenize is routed on load, counted, and
//! forwarded byte for byte.

use super::*;

fn tokenized_ok(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("kvgate_tokenize_total{") && l.contains("outcome=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn too_large(metrics: &str) -> u64 {
    let key = "kvgate_tokenize_fallback_total{reason=\"prompt_too_large\"} ";
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(key)?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_body_over_the_limit_is_not_tokenized_and_forwarded_unchanged() {
    let mut spy = Spy::start(Behavior::Json(r#"{"id":"x","choices":[]}"#.into())).await;
    let mut c = config(&[spy.url()]);
    c.set_tokenizer(
        CANONICAL,
        &kvgate_proxy::TokenizerSpec {
            local: Some(kvgate_sim::BUNDLED_TOKENIZER.into()),
            render: None,
            backends: None,
            render_timeout_ms: None,
            render_media_timeout_ms: None,
        },
    );
    c.max_prompt_bytes_tokenized = 4096;
    let proxy = RunningProxy::start(c).await;
    let body = |text: &str| {
        format!(r#"{{"model":"{CANONICAL}","messages":[{{"role":"user","content":"{text}"}}]}}"#)
    };

    // Within the limit: tokenized.
    let small = body("hello there");
    let (status, _, _) = post_chat(&proxy, small.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(spy.next_request().await.body, small.as_bytes());
    let m = metrics(&proxy).await;
    let tokenized = tokenized_ok(&m);
    assert!(tokenized >= 1, "the small prompt was not tokenized:\n{m}");
    assert_eq!(too_large(&m), 0);

    // Over it: routed without the tokenizer, the bytes unchanged.
    let big = body(&"word ".repeat(2000));
    let (status, _, _) = post_chat(&proxy, big.clone()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(spy.next_request().await.body, big.as_bytes());
    let m = metrics(&proxy).await;
    assert_eq!(too_large(&m), 1);
    assert_eq!(
        tokenized_ok(&m),
        tokenized,
        "the large prompt was tokenized"
    );
}

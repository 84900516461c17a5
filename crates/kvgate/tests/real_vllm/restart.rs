//! A real engine killed and started again on the same ports: none of the old process's
//! holdings may steer a request, and the new process's cache is indexed as it fills. Two
//! routers watch the engine: one with its replay socket (the reconnect compares the replay
//! with what it applied) and one with the event stream alone (the first live batch decides).

use super::*;

/// Sends turn 1 of conversation `seed` through `r`, waits until the router indexed its blocks,
/// and returns the follow-up request.
fn warm(r: &Router, seed: usize, seen: usize) -> Value {
    let system = system_prompt(seed, 400);
    let (status, _, v) = r.chat(&chat_body(&system, &["first question"], 8));
    assert_eq!(status, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let d = r.decisions(seen + 1);
    // The engine's count: the decision's is an estimate when routing tokenized a prefix.
    let held = v["usage"]["prompt_tokens"].as_u64().unwrap() / ENGINE_BLOCK;
    let endpoint = d[seen].endpoint.clone();
    let mut seen_holdings = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while seen_holdings < held {
        seen_holdings = holdings(r.admin, &endpoint);
        assert!(
            std::time::Instant::now() < deadline,
            "the router's index holds {seen_holdings} blocks of {endpoint}, the first turn left {held}: {:#?}\n{}",
            d[seen],
            r.metrics_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    chat_body(&system, &["first question", &answer, "second question"], 8)
}

/// Sends `body` through `r` and returns its decision (the `n`-th record).
fn send(r: &Router, body: &Value, n: usize) -> Decided {
    let (status, _, v) = r.chat(body);
    assert_eq!(status, 200, "{v}");
    r.decisions(n).swap_remove(n - 1)
}

#[test]
fn a_restarted_engines_old_holdings_steer_no_request() {
    let Some(mut fleet) = fleet() else { return };
    let b = &fleet.b;
    let replayed = router(
        &[
            vec!["--endpoint".into(), b.endpoint_flag()],
            tokenizer_flag(),
        ]
        .concat(),
    );
    let live_only = router(
        &[
            vec!["--endpoint".into(), format!("{},kv={}", b.url(), b.kv())],
            tokenizer_flag(),
        ]
        .concat(),
    );
    let follow = warm(&replayed, 401, 0);
    let d = send(&replayed, &follow, 2);
    assert!(d.predicted > 0 && d.predicted == d.realized, "{d:#?}");
    let held = holdings(replayed.admin, &b.address());
    wait_until("the other router's index to hold the conversation", || {
        holdings(live_only.admin, &b.address()) >= held
    });

    fleet.b.restart();
    let b = &fleet.b;
    for r in [&live_only, &replayed] {
        wait_healthy(r.admin, &b.address());
    }
    // The first request after the restart, through the router without replay: the new
    // process caches nothing yet, and the old holdings must not count.
    let first = send(&live_only, &follow, 1);
    assert_eq!(
        first.realized, 0,
        "the new engine process had a cache: {first:#?}"
    );
    assert_eq!(
        first.predicted, 0,
        "kvgate predicted the dead process's cache: {first:#?}"
    );
    // Through the router with replay: the engine now holds the prompt, from the new process.
    let second = send(&replayed, &follow, 3);
    assert_eq!(second.predicted, second.realized, "{second:#?}");
    assert!(
        replayed.metric("kvgate_kv_restarts_total", &[&b.address()]) >= 1.0,
        "the restart was not counted"
    );
    // Both routers index the new process's events: a new conversation is predicted exactly.
    for (r, seen) in [(&live_only, 1), (&replayed, 3)] {
        let follow = warm(r, 402 + seen, seen);
        let d = send(r, &follow, seen + 2);
        assert!(d.predicted > 0 && d.predicted == d.realized, "{d:#?}");
    }
}

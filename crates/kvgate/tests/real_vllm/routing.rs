//! Precise routing on real engines: under concurrency every prediction comes true, and with
//! nothing but the engines' URLs kvgate finds their KV events and tokenizes through their
//! `/render`.

use super::*;

/// The shared-prefix workload of the issue that found mispredictions: 4 groups × 4
/// conversations × 3 turns, a 700-token system prompt per group, 4 conversations in flight.
const CONCURRENT: &[&str] = &[
    "--workload",
    "shared-prefix",
    "--groups",
    "4",
    "--conversations-per-group",
    "4",
    "--turns",
    "3",
    "--system-tokens",
    "700",
    "--concurrency",
    "4",
    "--max-tokens",
    "8",
];

/// Requests of [`CONCURRENT`]: 16 conversations × 3 turns.
const REQUESTS: usize = 48;

/// Checks a run's decisions: kvgate predicted hits, the engines realized at least 99% of
/// them, and every follow-up turn hit.
fn assert_predictions_came_true(decided: &[Decided], seed: &str) {
    let (predicted, realized, short) = shortfalls(decided);
    assert!(
        predicted > 0,
        "seed {seed}: nothing predicted: {decided:#?}"
    );
    assert!(
        realized as f64 >= 0.99 * predicted as f64,
        "seed {seed}: realized {realized} < 0.99 × predicted {predicted}; short: {short:#?}"
    );
    // 16 conversations: their first turns share only the group's system prompt with the
    // conversations before them; their 32 follow-ups share their own history.
    let hits = decided.iter().filter(|d| d.realized > 0).count();
    assert!(
        hits >= 32,
        "seed {seed}: {hits} requests hit of {}",
        decided.len()
    );
}

#[test]
fn predictions_come_true_at_concurrency_4() {
    let Some(fleet) = fleet() else { return };
    let r = router(
        &[
            vec!["--endpoint".into(), fleet.a.endpoint_flag()],
            vec!["--endpoint".into(), fleet.b.endpoint_flag()],
            tokenizer_flag(),
        ]
        .concat(),
    );
    let mut seen = 0;
    for seed in ["101", "102"] {
        bench(r.listen, &[CONCURRENT, &["--seed", seed]].concat());
        let decided = r.decisions(seen + REQUESTS);
        assert_predictions_came_true(&decided[seen..], seed);
        seen = decided.len();
    }
    let mispredicted = r.metric("kvgate_prefix_mispredicted_requests_total", &[]);
    assert_eq!(mispredicted, 0.0, "kvgate counted mispredicted requests");
}

#[test]
fn zero_config_finds_events_and_render_and_routes_precisely() {
    let Some(fleet) = fleet() else { return };
    let mut r = router(&[
        "--endpoint".into(),
        fleet.a.url(),
        "--endpoint".into(),
        fleet.b.url(),
    ]);
    // Both engines' event streams are found from their URLs and subscribed.
    r.wait_connected(&[&fleet.a, &fleet.b]);
    let system = system_prompt(301, 400);
    let first = chat_body(&system, &["first question"], 8);
    let (status, _, v) = r.chat(&first);
    assert_eq!(status, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let d = r.decisions(1);
    let held = v["usage"]["prompt_tokens"].as_u64().unwrap() / ENGINE_BLOCK;
    let endpoint = d[0].endpoint.clone();
    wait_until("the first turn's blocks in the index", || {
        holdings(r.admin, &endpoint) >= held
    });
    let follow = chat_body(&system, &["first question", &answer, "second question"], 8);
    let (status, _, v) = r.chat(&follow);
    assert_eq!(status, 200, "{v}");
    let d = r.decisions(2);
    assert_eq!(
        d[1].endpoint, endpoint,
        "the follow-up left its cache: {d:#?}"
    );
    assert!(d[1].predicted > 0, "{:#?}", d[1]);
    assert_eq!(d[1].predicted, d[1].realized, "{:#?}", d[1]);
    assert_eq!(d[1].line["tokenizer"], "render", "{:#?}", d[1]);
    // And the concurrent workload, tokenized by the engines' `/render`.
    bench(r.listen, &[CONCURRENT, &["--seed", "103"]].concat());
    let decided = r.decisions(2 + REQUESTS);
    assert_predictions_came_true(&decided[2..], "103 (zero config)");
    assert!(
        decided[2..].iter().all(|d| d.line["tokenizer"] == "render"),
        "a request was not tokenized by the engine's /render"
    );
}

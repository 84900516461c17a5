//! The page over hand-built views: escaping, each cell against the view, and the two parts.

use std::collections::BTreeMap;

use kvgate_schedule::{
    CandidateView, DecisionView, EndpointSnapshot, EngineMetrics, IndexSnapshot, KvStreamSnapshot,
    LoadSnapshot, Role, RunView, ScoreView, StateSnapshot,
};

use super::*;
use crate::admin::view::{AdminView, AttemptCount, ModelView};
use crate::decision_log::DecisionRecord;

fn endpoint(name: &str) -> EndpointSnapshot {
    EndpointSnapshot {
        name: name.to_owned(),
        url: format!("http://{name}"),
        labels: BTreeMap::new(),
        role: Role::Unlabelled,
        healthy: true,
        probe_down: false,
        consecutive_failures: 0,
        in_flight_requests: 0,
        in_flight_tokens: 0,
        metrics_age_ms: None,
        metrics_stale: true,
        metrics: None,
        served_models: None,
        kv_events: false,
        index_block_size: 16,
        index_holdings: 0,
        index_degraded: false,
        reported_requests: 0,
        predicted_tokens: 0,
        realized_tokens: 0,
        mispredicted_requests: 0,
        prompt_tokens: 0,
        kv_stream: None,
        kv_source: None,
        kv_discovery: None,
        kv_cache_groups: None,
    }
}

fn stream() -> KvStreamSnapshot {
    KvStreamSnapshot {
        connected: true,
        last_seq: Some(41),
        batches: 42,
        last_batch_age_ms: Some(7),
        lag_ms: Some(3),
        gaps: 1,
        replays_ok: 2,
        replays_failed: 0,
        restarts: 0,
        reconnects: 5,
        unconfirmed: false,
        degraded: false,
    }
}

fn decision(id: &str, picked: &str, other: &str) -> DecisionRecord {
    let candidate = |name: &str, total: f64, predicted: u64| CandidateView {
        endpoint: name.to_owned(),
        total,
        predicted_cached_tokens: Some(predicted),
        load: LoadSnapshot::default(),
        scores: vec![
            ScoreView {
                scorer: "precise-prefix-cache-scorer".into(),
                raw: 0.5,
                weighted: 0.0,
            },
            ScoreView {
                scorer: "prefill-cost-scorer".into(),
                raw: total,
                weighted: total,
            },
        ],
    };
    let view = DecisionView {
        request_id: id.to_owned(),
        endpoint: picked.to_owned(),
        kind: "single",
        elapsed_us: 12,
        headers: vec![],
        runs: vec![RunView {
            profile: "default".into(),
            picked: picked.to_owned(),
            predicted_cached_tokens: Some(96),
            candidates: vec![candidate(picked, 0.75, 96), candidate(other, 0.25, 0)],
            skipped: vec![],
            dropped: vec![],
        }],
        failed: vec![],
    };
    let mut r = DecisionRecord::new(id, Some("m<1>"), Some(128), Some("local"), Some(96));
    r.decision = view;
    r.status = 200;
    r.outcome = "completed";
    r.realized_cached_tokens = Some(64);
    r.ttft_ms = Some(4.25);
    r
}

fn view(endpoints: Vec<EndpointSnapshot>, decisions: Vec<DecisionRecord>) -> AdminView {
    AdminView {
        state: StateSnapshot {
            endpoints,
            index: IndexSnapshot {
                blocks: 3,
                holdings: 5,
                estimated_bytes: 4096,
            },
        },
        generated_unix_ms: 3_723_004,
        models: vec![ModelView {
            model: "m<1>".into(),
            chain: "local(qwen3) → estimate".into(),
            reason: "named".into(),
            attempts: vec![AttemptCount {
                backend: "local",
                outcome: "ok",
                reason: "none",
                count: 9,
            }],
        }],
        decisions,
    }
}

fn live(v: &AdminView) -> String {
    render(v, Part::Live).unwrap()
}

/// The `<td>` cells of the first row of table `id` whose opening tag contains `row_marker`.
fn cells(html: &str, id: &str, row_marker: &str) -> Vec<String> {
    let table = html
        .split(&format!("<table id=\"{id}\">"))
        .nth(1)
        .and_then(|t| t.split("</table>").next())
        .unwrap_or_default();
    let row = table
        .split("<tr")
        .skip(2)
        .find(|r| r.split('>').next().unwrap_or_default().contains(row_marker))
        .unwrap_or_default();
    let row = row.split("</tr>").next().unwrap_or_default();
    row.split("<td")
        .skip(1)
        .map(|c| {
            let c = c.split_once('>').map_or("", |(_, rest)| rest);
            c.split("</td>").next().unwrap_or_default().to_owned()
        })
        .collect()
}

#[test]
fn hostile_names_are_escaped() {
    let mut e = endpoint("<script>alert(\"x\")</script>&");
    e.labels.insert("team".into(), "<b>a&b</b>".into());
    let html = live(&view(vec![e], vec![decision("<i>id</i>", "<em>", "q:1")]));
    assert!(!html.contains("<script"), "{html}");
    assert!(!html.contains("<b>"), "{html}");
    assert!(!html.contains("<i>"), "{html}");
    assert!(!html.contains("<em>"), "{html}");
    assert!(!html.contains("m<1>"), "{html}");
    let row = cells(&html, "endpoints", "data-endpoint");
    assert_eq!(
        row[0],
        "&lt;script&gt;alert(&quot;x&quot;)&lt;&#x2f;script&gt;&amp;"
    );
    assert_eq!(row[17], "team=&lt;b&gt;a&amp;b&lt;&#x2f;b&gt;");
}

#[test]
fn endpoint_cells_follow_the_snapshot() {
    let idle = endpoint("a:1");
    let mut busy = endpoint("b:1");
    busy.metrics = Some(EngineMetrics {
        waiting: Some(3.0),
        kv_usage: Some(0.256),
        ..EngineMetrics::default()
    });
    busy.metrics_age_ms = Some(120);
    busy.metrics_stale = false;
    busy.kv_events = true;
    busy.prompt_tokens = 256;
    busy.predicted_tokens = 128;
    busy.realized_tokens = 64;
    busy.role = Role::Prefill;
    busy.labels.insert("b".into(), "2".into());
    busy.labels.insert("a".into(), "1".into());
    // (name, snapshot, cell index, want): one field flipped per row.
    let cases = [
        ("no role label: a dash", idle.clone(), 1, "—"),
        ("role label", busy.clone(), 1, "prefill"),
        ("no metrics: waiting", idle.clone(), 6, "–"),
        ("metrics: waiting", busy.clone(), 6, "3.0"),
        ("metrics without running", busy.clone(), 7, "–"),
        ("no metrics: kv usage", idle.clone(), 8, "–"),
        ("kv usage as a percentage", busy.clone(), 8, "25.6 %"),
        (
            "no scrape yet: age",
            idle.clone(),
            9,
            "– <span class=\"muted\">stale</span>",
        ),
        ("scraped: age", busy.clone(), 9, "120"),
        ("approximate mode", idle.clone(), 10, "approx"),
        ("kv events", busy.clone(), 10, "precise"),
        ("no prompt tokens: predicted hit", idle.clone(), 14, "–"),
        ("predicted hit", busy.clone(), 14, "50.0 %"),
        ("realized hit", busy.clone(), 15, "25.0 %"),
        ("no labels", idle.clone(), 17, ""),
        ("labels sorted, joined", busy, 17, "a=1, b=2"),
    ];
    for (name, e, cell, want) in cases {
        let html = live(&view(vec![e], vec![]));
        let row = cells(&html, "endpoints", "data-endpoint");
        assert_eq!(row.len(), 18, "{name}: {html}");
        assert_eq!(row[cell], want, "{name}");
    }
    let html = live(&view(vec![endpoint("a:1"), endpoint("b:1")], vec![]));
    assert!(
        html.contains("index: 3 blocks, 5 holdings, ~4 KiB"),
        "{html}"
    );
    assert!(html.contains("generated 01:02:03.004 UTC"), "{html}");
}

#[test]
fn streams_show_only_endpoints_with_kv_events() {
    let approx = endpoint("a:1");
    let html = live(&view(vec![approx.clone()], vec![]));
    assert!(html.contains("no endpoint publishes KV events"), "{html}");

    let mut precise = endpoint("b:1");
    precise.kv_events = true;
    precise.kv_stream = Some(stream());
    let mut down = endpoint("c:1");
    down.kv_events = true;
    down.kv_stream = Some(KvStreamSnapshot {
        connected: false,
        last_seq: None,
        unconfirmed: true,
        ..stream()
    });
    let html = live(&view(vec![approx, precise, down], vec![]));
    assert!(!html.contains("no endpoint publishes KV events"), "{html}");
    let up = cells(&html, "streams", "data-endpoint=\"b:1\"");
    assert_eq!(
        up,
        [
            "b:1", "yes", "41", "42", "7", "3", "1", "2", "0", "0", "5", "no", "no"
        ]
    );
    let gone = cells(&html, "streams", "data-endpoint=\"c:1\"");
    assert_eq!(gone[1], "no");
    assert_eq!(gone[2], "–");
    assert_eq!(gone[11], "yes");
    assert!(
        html.contains("<tr data-endpoint=\"c:1\" class=\"bad\">"),
        "{html}"
    );
    assert!(cells(&html, "streams", "data-endpoint=\"a:1\"").is_empty());
}

#[test]
fn kv_sources_show_where_each_endpoint_s_events_come_from() {
    use kvgate_schedule::{KvOrigin, KvSourceInfo};
    let mut found = endpoint("d:1");
    found.kv_source = Some(KvSourceInfo {
        origin: KvOrigin::Discovered,
        events: "tcp://d:5557".into(),
        replay: Some("tcp://d:5558".into()),
        replay_origin: Some(KvOrigin::Discovered),
        topic: String::new(),
        rank: 0,
    });
    found.kv_discovery = Some("rank 0 tcp://d:5557, replay tcp://d:5558".into());
    found.kv_cache_groups =
        Some("group 1: full attention (the prefix); group 0: windowed, the hit ends after 4 cached blocks".into());
    let mut mixed = endpoint("e:1");
    mixed.kv_source = Some(KvSourceInfo {
        origin: KvOrigin::Configured,
        events: "tcp://e:5557".into(),
        replay: Some("tcp://e:5558".into()),
        replay_origin: Some(KvOrigin::Discovered),
        topic: "kv@e".into(),
        rank: 0,
    });
    let mut none = endpoint("f:1");
    none.kv_discovery = Some("not read: GET /kv_event_sources: status 404".into());
    let html = live(&view(vec![found, mixed, none], vec![]));
    // The page escapes `/` too.
    let row = |name: &str| -> Vec<String> {
        cells(&html, "kv_sources", &format!("data-endpoint=\"{name}\""))
            .iter()
            .map(|c| c.replace("&#x2f;", "/"))
            .collect()
    };
    assert_eq!(
        row("d:1"),
        [
            "d:1",
            "discovered",
            "tcp://d:5557",
            "tcp://d:5558",
            "–",
            "rank 0 tcp://d:5557, replay tcp://d:5558",
            "group 1: full attention (the prefix); group 0: windowed, the hit ends after 4 cached blocks"
        ]
    );
    assert_eq!(
        row("e:1"),
        [
            "e:1",
            "configured",
            "tcp://e:5557",
            "tcp://e:5558 (discovered)",
            "kv@e",
            "–",
            "–"
        ]
    );
    assert_eq!(
        row("f:1"),
        [
            "f:1",
            "none",
            "–",
            "–",
            "–",
            "not read: GET /kv_event_sources: status 404",
            "–"
        ]
    );
}

#[test]
fn decisions_list_every_candidate_with_its_scores() {
    let html = live(&view(vec![], vec![]));
    assert!(html.contains("no request routed yet"), "{html}");

    let html = live(&view(
        vec![],
        vec![
            decision("req-2", "b:1", "a:1"),
            decision("req-1", "a:1", "b:1"),
        ],
    ));
    assert!(html.contains("Last 2 decisions"), "{html}");
    let first = cells(&html, "decisions", "data-request-id=\"req-2\"");
    assert_eq!(first[1], "req-2");
    assert_eq!(first[3], "local");
    assert_eq!(first[4], "128");
    assert_eq!(first[5], "b:1");
    assert_eq!(first[6], "96 <span class=\"muted\">75.0 %</span>");
    assert_eq!(first[7], "64 <span class=\"muted\">50.0 %</span>");
    assert_eq!(first[8], "200");
    assert_eq!(first[9], "completed");
    assert_eq!(first[10], "4.2");
    assert_eq!(first[11], "–");
    // Newest first, and each decision's candidates under it.
    let req2 = html.find("req-2").unwrap();
    assert!(req2 < html.find("req-1").unwrap());
    let cand = html[req2..]
        .split("class=\"candidate pick\"")
        .nth(1)
        .unwrap();
    let pick: Vec<&str> = cand.split("</tr>").next().unwrap().split("<td").collect();
    assert!(pick[1].contains("b:1 ✔"), "{cand}");
    assert!(pick[2].contains("0.750"), "{cand}");
    assert!(pick[3].contains(">96<"), "{cand}");
    assert!(pick[4].contains("0.500 / 0.000"), "{cand}");
    assert!(pick[5].contains("0.750 / 0.750"), "{cand}");
    assert!(
        html.contains("prefill-cost-scorer raw / weighted"),
        "{html}"
    );
    let rows = html.matches("class=\"candidate\"").count()
        + html.matches("class=\"candidate pick\"").count();
    assert_eq!(rows, 4, "two candidates per decision: {html}");
}

#[test]
fn the_page_wraps_the_live_part_with_a_link_and_the_refresh_script() {
    let v = view(vec![endpoint("a:1")], vec![decision("req-1", "a:1", "b:1")]);
    let page = render(&v, Part::Page).unwrap();
    let part = render(&v, Part::Live).unwrap();
    assert!(page.contains(&part), "the page embeds the live part");
    assert!(page.contains("<a href=\"/debug/state.json\">"), "{page}");
    assert!(page.contains("?fragment=1"), "{page}");
    assert!(page.contains("setInterval(tick, 2000)"), "{page}");
    assert!(
        !page.contains("src="),
        "no external script or image: {page}"
    );
    assert!(!page.contains("<link"), "no external stylesheet: {page}");
    assert!(!part.contains("<script"), "{part}");
    assert!(!part.contains("<html"), "{part}");
}

#[test]
fn percentages_and_clock() {
    let cases = [
        ("half", Some(1.0), Some(2.0), "50.0 %"),
        ("zero whole", Some(1.0), Some(0.0), "–"),
        ("no part", None, Some(2.0), "–"),
        ("no whole", Some(1.0), None, "–"),
        ("not finite", Some(f64::NAN), Some(2.0), "–"),
    ];
    for (name, part, whole, want) in cases {
        assert_eq!(pct(part, whole), want, "{name}");
    }
    assert_eq!(clock(0), "00:00:00.000");
    assert_eq!(clock(86_400_000 + 3_723_004), "01:02:03.004");
}

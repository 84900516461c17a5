//! The operator's page in a real browser: `kvgate serve` in front of a two-engine
//! `kvgate sim` fleet with KV events serves some conversations; then headless Chromium loads
//! `/debug/state`, runs its refresh script and dumps the DOM. The dump must show the script's
//! refresh, the decisions table with these requests (every candidate, the pick, predicted and
//! realized cached tokens) and each engine's KV event stream connected with a sequence number.
//!
//! Without a Chromium (`chromium`, `chromium-browser`, `google-chrome` on `PATH`) the test
//! prints `SKIPPED` and returns; CI installs Debian's `chromium` (`.ci/run`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

mod common;

use common::*;

/// A browser on `PATH`, if any.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|p| p.is_file())
}

/// `GET path` on the admin port as JSON.
fn admin_json(admin: SocketAddr, path: &str) -> Value {
    let (status, _, body) = exchange(admin, "GET", path, "");
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls `/debug/state.json` until `done` accepts it (panics after 60 s with the last one).
fn state_until(admin: SocketAddr, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = admin_json(admin, "/debug/state.json");
        if done(&state) {
            return state;
        }
        assert!(Instant::now() < deadline, "{what}: {state:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `chromium --headless --dump-dom URL` after the page's scripts ran (virtual time), in a
/// throwaway profile; panics when the browser fails or runs past 90 s.
fn dump_dom(browser: &Path, url: &str) -> String {
    let profile = std::env::temp_dir().join(format!("kvgate-chromium-{}", std::process::id()));
    let mut child = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-extensions",
            "--virtual-time-budget=3000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The text of each `<td>` of the first `<tr …>` whose opening tag contains `marker`.
fn row_cells(dom: &str, marker: &str) -> Vec<String> {
    let Some(at) = dom.find(marker) else {
        return Vec::new();
    };
    let row = &dom[at..];
    let row = &row[..row.find("</tr>").unwrap_or(row.len())];
    row.split("<td")
        .skip(1)
        .map(|c| {
            let inner = c.split_once('>').map_or("", |(_, r)| r);
            let inner = inner.split("</td>").next().unwrap_or_default();
            // Drop nested tags (e.g. the muted percentage span), keep the text.
            let mut text = String::new();
            let mut in_tag = false;
            for ch in inner.chars() {
                match ch {
                    '<' => in_tag = true,
                    '>' => in_tag = false,
                    c if !in_tag => text.push(c),
                    _ => {}
                }
            }
            text.trim().to_owned()
        })
        .collect()
}

#[test]
fn the_state_page_shows_decisions_and_stream_health_in_a_browser() {
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED the_state_page_shows_decisions_and_stream_health_in_a_browser: no chromium, \
             chromium-browser or google-chrome on PATH (apt-get install -y chromium)"
        );
        return;
    };
    let (_sim, engines) = sim(2);
    let mut flags: Vec<String> = engines
        .iter()
        .flat_map(|e| {
            [
                "--endpoint".to_owned(),
                format!("http://{},kv={}", e.http, e.events),
            ]
        })
        .collect();
    flags.extend(["--tokenizer".to_owned(), format!("{MODEL}={TOKENIZER}")]);
    let (_router, _lines, proxy, admin) = serve(&flags);
    let names: Vec<String> = engines.iter().map(|e| e.http.to_string()).collect();

    // Both streams connected before the traffic, so its blocks reach the index.
    state_until(admin, "KV streams connected", |s| {
        s["endpoints"].as_array().is_some_and(|es| {
            es.len() == 2 && es.iter().all(|e| e["kv_stream"]["connected"] == true)
        })
    });
    // Two conversations of three turns: later turns share their history with earlier ones.
    let mut ids = Vec::new();
    for c in 0..2 {
        let mut messages = vec![json!({"role": "system", "content": system_prompt(c, 200)})];
        for t in 0..3 {
            messages.push(json!({"role": "user", "content": format!("turn {t}: go on")}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 4}).to_string();
            let id = format!("page-{c}-{t}");
            let (status, _, reply) = exchange_with(
                proxy,
                "POST",
                "/v1/chat/completions",
                &[("x-request-id", &id)],
                &body,
            );
            assert_eq!(status, 200, "{reply}");
            let reply: Value = serde_json::from_str(&reply).unwrap();
            let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
            messages.push(json!({"role": "assistant", "content": text}));
            ids.push(id);
        }
    }
    let last = ids.last().unwrap().clone();
    // Every decision recorded, and the stream of each engine that served one past its first
    // batch (the scheduler may well send every conversation to one engine).
    let served = |s: &Value| -> Vec<String> {
        s["decisions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["decision"]["endpoint"].as_str().map(str::to_owned))
            .collect()
    };
    let state = state_until(admin, "decisions and stream sequence numbers", |s| {
        let served = served(s);
        served.len() == ids.len()
            && s["endpoints"].as_array().is_some_and(|es| {
                es.iter().all(|e| {
                    !served.iter().any(|n| e["name"] == n.as_str())
                        || e["kv_stream"]["last_seq"].is_u64()
                })
            })
    });
    let served = served(&state);
    let newest = &state["decisions"][0];
    assert_eq!(newest["request_id"], last.as_str(), "{state:#}");
    let predicted = newest["predicted_cached_tokens"].as_u64().unwrap();
    let realized = newest["realized_cached_tokens"].as_u64().unwrap();
    assert!(
        predicted > 0,
        "a third turn is predicted to hit: {newest:#}"
    );

    let dom = dump_dom(&browser, &format!("http://{admin}/debug/state"));

    // The script ran and swapped in a fresh live part.
    let refreshes = dom
        .split("data-refreshes=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or_else(|| panic!("no refresh counter: {dom}"));
    assert!(
        refreshes >= 1,
        "the page's script never refreshed it: {dom}"
    );
    assert!(dom.contains("live: refreshed every 2 s"), "{dom}");
    assert!(dom.contains("href=\"/debug/state.json\""), "{dom}");

    // The decisions table: every request, the newest first with its numbers.
    for id in &ids {
        assert!(
            dom.contains(&format!("data-request-id=\"{id}\"")),
            "{id}: {dom}"
        );
    }
    let row = row_cells(&dom, &format!("data-request-id=\"{last}\""));
    assert_eq!(row[1], last);
    assert_eq!(row[2], MODEL);
    assert_eq!(row[3], "local");
    let picked = &row[5];
    assert!(names.contains(picked), "picked {picked} of {names:?}");
    assert!(
        row[6].starts_with(&format!("{predicted} ")),
        "predicted cell {:?}",
        row[6]
    );
    assert!(row[6].ends_with('%'), "predicted share {:?}", row[6]);
    assert!(
        row[7].starts_with(&format!("{realized} ")),
        "realized cell {:?}",
        row[7]
    );
    assert_eq!(row[8], "200");
    assert_eq!(row[9], "completed");
    // Its candidates: both engines, the pick marked, each with its scores.
    let after = &dom[dom.find(&format!("data-request-id=\"{last}\"")).unwrap()..];
    let candidates = &after[..after.find("class=\"decision\"").unwrap_or(after.len())];
    for name in &names {
        let cells = row_cells(candidates, &format!("data-endpoint=\"{name}\""));
        assert!(cells.len() >= 5, "candidate {name}: {cells:?}");
        assert!(
            cells[1].parse::<f64>().is_ok(),
            "total of {name}: {cells:?}"
        );
        assert!(
            cells[3].contains(" / "),
            "raw / weighted of {name}: {cells:?}"
        );
        assert_eq!(
            cells[0].ends_with('✔'),
            name == picked,
            "pick mark: {cells:?}"
        );
    }

    // The stream table: both engines connected; those that served requests with a
    // sequence number and batches.
    let streams = &dom[dom.find("<table id=\"streams\">").unwrap()..];
    let streams = &streams[..streams.find("</table>").unwrap()];
    for name in &names {
        let cells = row_cells(streams, &format!("data-endpoint=\"{name}\""));
        assert_eq!(cells.len(), 13, "stream row of {name}: {cells:?}");
        assert_eq!(cells[1], "yes", "connected: {cells:?}");
        assert_eq!(cells[11], "no", "unconfirmed: {cells:?}");
        if served.contains(name) {
            assert!(cells[2].parse::<u64>().is_ok(), "last seq: {cells:?}");
            assert!(cells[3].parse::<u64>().unwrap() > 0, "batches: {cells:?}");
        }
    }
    // The tokenizer chain of the model, with its counts.
    let model = row_cells(&dom, &format!("data-model=\"{MODEL}\""));
    assert!(model[1].starts_with("local"), "chain: {model:?}");
    assert!(model[3].contains("local ok: "), "counts: {model:?}");
}

//! End to end, real processes: `kvgate doctor` against two `kvgate sim` fleets, one
//! publishing KV events (with replay), one with events off.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener},
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use serde_json::Value;

const MODEL: &str = "Qwen/Qwen3-0.6B";
const TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/tokenizers/qwen3"
);

/// A `kvgate sim` child, killed on drop.
struct Sim {
    child: Child,
    http: SocketAddr,
    events: Option<String>,
    replay: Option<String>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fields(line: &Value) -> &Value {
    if line["fields"].is_object() {
        &line["fields"]
    } else {
        line
    }
}

/// `kvgate sim` with one engine on free loopback ports and `flags` (block size 20).
fn sim(flags: &[&str]) -> Sim {
    let child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args([
            "--log-format",
            "json",
            "sim",
            "--port",
            "0",
            "--model",
            MODEL,
        ])
        .args([
            "--block-size",
            "20",
            "--prefill-base-ms",
            "1",
            "--itl-ms",
            "0.2",
        ])
        .args(flags)
        .env("KVGATE_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut sim = Sim {
        child,
        http: SocketAddr::from(([127, 0, 0, 1], 0)),
        events: None,
        replay: None,
    };
    let stderr = sim.child.stderr.take().unwrap();
    let (tx, log) = mpsc::channel::<Value>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = log.recv_timeout(left).expect("sim did not start");
        let f = fields(&line);
        let events = f["events"].as_str().unwrap_or_default();
        if f["message"] == "sim instance started" {
            // `[EventAddrs { events: "…", replay: Some("tcp://…") }]`
            sim.replay = events
                .split_once("replay: Some(\"")
                .and_then(|(_, r)| r.split_once('"'))
                .map(|(r, _)| r.to_owned());
        }
        if f["message"] == "kvgate sim listening" {
            let events: Vec<String> = serde_json::from_str(events).unwrap_or_default();
            sim.http = f["http"].as_str().unwrap().parse().unwrap();
            sim.events = events.into_iter().next();
            return sim;
        }
    }
}

fn doctor(args: &[String]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .arg("doctor")
        .args(["--timeout", "3s"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    (out, stdout)
}

/// The report's lines for engine `url`, up to its summary line.
fn section<'a>(report: &'a str, url: &str) -> Vec<&'a str> {
    report
        .lines()
        .skip_while(|l| *l != format!("engine {url}"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect()
}

fn has(lines: &[&str], prefix: &str, part: &str) -> bool {
    lines
        .iter()
        .any(|l| l.trim_start().starts_with(prefix) && l.contains(part))
}

#[test]
fn doctor_reports_events_on_one_fleet_and_the_fixing_flag_on_the_other() {
    let on = sim(&[
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
        "--lora-modules",
        "sql-lora=/adapters/sql",
    ]);
    let off = sim(&["--no-kv-events"]);
    assert!(off.events.is_none());
    let on_url = format!("http://{}", on.http);
    let off_url = format!("http://{}", off.http);
    let events = on
        .events
        .clone()
        .expect("events endpoint of the first fleet");
    let replay = on
        .replay
        .clone()
        .expect("replay endpoint of the first fleet");
    let dead = kvgate_proxy::test_util::dead_addr();

    // The fleet with events: ready, exit 0.
    let (out, report) = doctor(&[
        on_url.clone(),
        format!("--kv={on_url}={events}"),
        format!("--replay={on_url}={replay}"),
        format!("--tokenizer={MODEL}={TOKENIZER}"),
    ]);
    let lines = section(&report, &on_url);
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert!(
        has(
            &lines,
            "ok",
            &format!("models: {MODEL} (base, max_model_len 32768)")
        ),
        "{report}"
    );
    assert!(
        has(&lines, "ok", "block size 20, 8192 GPU blocks"),
        "{report}"
    );
    assert!(has(&lines, "ok", "prefix caching: on"), "{report}");
    assert!(has(&lines, "ok", "KV events: reachable on"), "{report}");
    assert!(has(&lines, "ok", "replay: reachable on"), "{report}");
    assert!(
        has(&lines, "ok", "usage.prompt_tokens_details: on"),
        "{report}"
    );
    assert!(
        has(
            &lines,
            "ok",
            "local tokenizer for Qwen/Qwen3-0.6B matches /render"
        ),
        "{report}"
    );
    assert_eq!(lines.last(), Some(&"  precise routing: ready"), "{report}");

    // Both fleets: the second has no events; the line names the flag; exit 1.
    let (out, report) = doctor(&[
        on_url.clone(),
        off_url.clone(),
        format!("--kv={on_url}={events}"),
        format!("--kv={off_url}=tcp://{dead}"),
    ]);
    assert_eq!(out.status.code(), Some(1), "{report}");
    let first = section(&report, &on_url);
    assert!(has(&first, "ok", "KV events: reachable on"), "{report}");
    assert!(has(&first, "ok", "--kv tcp://127.0.0.1:"), "{report}");
    // No --replay: the one the engine reports next to the --kv it agrees with.
    assert!(
        has(
            &first,
            "ok",
            &format!(
                "replay: reachable on {replay} (first retained batch seq 0); found at /kv_event_sources"
            )
        ),
        "{report}"
    );
    assert!(has(&first, "ok", "engine /render answers"), "{report}");
    assert_eq!(first.last(), Some(&"  precise routing: ready"), "{report}");
    let second = section(&report, &off_url);
    assert!(has(&second, "ok", "block size 20"), "{report}");
    assert!(
        has(&second, "warn", "/kv_event_sources no usable publisher"),
        "{report}"
    );
    assert!(has(&second, "FAIL", "KV events socket"), "{report}");
    assert!(
        has(&second, "FAIL", "fix: run vLLM with --kv-events-config"),
        "{report}"
    );
    assert!(!has(&second, "ok", "KV events"), "{report}");
    let summary = second.last().unwrap();
    assert!(
        summary.starts_with("  precise routing: not ready: no KV events"),
        "{report}"
    );
    assert!(
        summary.ends_with("kvgate will route approximately"),
        "{report}"
    );
}

#[test]
fn doctor_fails_on_an_unreachable_engine() {
    let dead = kvgate_proxy::test_util::dead_addr();
    let url = format!("http://{dead}");
    let (out, report) = doctor(std::slice::from_ref(&url));
    assert_eq!(out.status.code(), Some(1), "{report}");
    let lines = section(&report, &url);
    assert!(has(&lines, "FAIL", "GET /v1/models failed"), "{report}");
    assert!(
        lines
            .last()
            .unwrap()
            .contains("not ready: engine unreachable"),
        "{report}"
    );
}

/// No `--kv`: the socket the engine reports at `/kv_event_sources` (`tcp://*:PORT`, the
/// engine URL's host put in) is probed, its replay too, and the engine is ready.
#[test]
fn doctor_uses_the_events_the_engine_reports() {
    let sim = sim(&[
        "--kv-events-endpoint",
        "tcp://*:0",
        "--kv-events-replay-endpoint",
        "tcp://*:0",
    ]);
    let url = format!("http://{}", sim.http);
    let port = sim.events.as_deref().unwrap().rsplit_once(':').unwrap().1;
    let (out, report) = doctor(&[url.clone(), format!("--tokenizer={MODEL}={TOKENIZER}")]);
    let lines = section(&report, &url);
    assert_eq!(out.status.code(), Some(0), "{report}");
    let events = format!("tcp://127.0.0.1:{port}");
    assert!(
        has(
            &lines,
            "ok",
            &format!(
                "KV event sources: /kv_event_sources names rank 0 {events}, replay tcp://127.0.0.1:"
            )
        ),
        "{report}"
    );
    assert!(has(&lines, "ok", "used, no --kv given"), "{report}");
    assert!(
        has(
            &lines,
            "ok",
            &format!("KV events: reachable on {events} (batch seq")
        ),
        "{report}"
    );
    assert!(
        has(&lines, "ok", "; found at /kv_event_sources")
            && has(&lines, "ok", "KV events: reachable on"),
        "{report}"
    );
    assert!(
        has(&lines, "ok", "replay: reachable on tcp://127.0.0.1:"),
        "{report}"
    );
    assert_eq!(lines.last(), Some(&"  precise routing: ready"), "{report}");
}

/// A stub engine: `/v1/models` lists one model, `/v1/chat/completions/render` answers what
/// vLLM 0.33 answers without `--enable-scale-out`, everything else 404.
fn scale_out_disabled_engine() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().map_while(Result::ok) {
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split(' ').nth(1).unwrap_or_default().to_owned();
            let mut length = 0;
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':')
                    && k.eq_ignore_ascii_case("content-length")
                {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            let (status, body) = match path.as_str() {
                "/v1/models" => (
                    "200 OK",
                    format!(r#"{{"object":"list","data":[{{"id":"{MODEL}","object":"model"}}]}}"#),
                ),
                "/v1/chat/completions/render" => (
                    "403 Forbidden",
                    r#"{"error":{"message":"Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.","type":"PermissionDeniedError","param":null,"code":403}}"#.to_owned(),
                ),
                _ => ("404 Not Found", r#"{"detail":"Not Found"}"#.to_owned()),
            };
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    addr
}

/// vLLM 0.33 without `--enable-scale-out` answers `/render` with 403: the fix names the
/// engine flag, and kvgate's `--tokenizer` as the other way.
#[test]
fn a_render_403_suggests_enable_scale_out() {
    let url = format!("http://{}", scale_out_disabled_engine());
    let (out, report) = doctor(std::slice::from_ref(&url));
    assert_eq!(out.status.code(), Some(1), "{report}");
    let lines = section(&report, &url);
    let line = lines
        .iter()
        .find(|l| l.contains("tokenization: /render failed"))
        .unwrap_or_else(|| panic!("{report}"));
    assert!(line.trim_start().starts_with("FAIL"), "{line}");
    assert!(line.contains("403"), "{line}");
    assert!(
        line.contains("fix: restart vllm serve with --enable-scale-out"),
        "{line}"
    );
    assert!(line.contains(&format!("--tokenizer {MODEL}=DIR")), "{line}");
    assert!(
        has(&lines, "FAIL", "/kv_event_sources not read: status 404"),
        "{report}"
    );
}

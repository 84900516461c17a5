//! End to end: `kvgate serve --config FILE` with its admin listener, and a config reload.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{net::SocketAddr, path::PathBuf};

mod common;

use common::*;
use kvgate_proxy::test_util::dead_addr;

/// `kvgate serve --config FILE`.
fn start_serve(config: &std::path::Path) -> Kvgate {
    Kvgate::start(&["serve".as_ref(), "--config".as_ref(), config.as_os_str()])
}

/// A fresh file path under the system temp dir, removed on drop.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A temp path unique to this process and test thread: `kvgate-{tag}-{pid}-{thread}`.
fn temp_base(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "kvgate-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ))
}

fn config_yaml(endpoints: &[SocketAddr]) -> String {
    let mut yaml = "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nendpoints:\n".to_owned();
    for e in endpoints {
        yaml.push_str(&format!("  - url: http://{e}\n"));
    }
    yaml
}

fn endpoint_count(admin: SocketAddr) -> usize {
    let (status, _, body) = exchange(admin, "GET", "/debug/state.json", "");
    assert_eq!(status, 200, "{body}");
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    state["endpoints"].as_array().unwrap().len()
}

#[test]
fn admin_routes_and_reload_on_content_change() {
    let file = TempFile(temp_base("serve").with_extension("yaml"));
    let (a, b) = (dead_addr(), dead_addr());
    std::fs::write(&file.0, config_yaml(&[a])).unwrap();
    let serve = start_serve(&file.0);
    let started = serve.wait_for("kvgate serving", 1).remove(0);
    let admin: SocketAddr = started["admin"].as_str().unwrap().parse().unwrap();

    let (status, _, body) = exchange(admin, "GET", "/health", "");
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, head, body) = exchange(admin, "POST", "/metrics", "");
    assert_eq!(status, 405, "{body}");
    assert!(head.contains("\r\nallow: get,head"), "{head}");
    assert!(body.contains(r#""code":"method_not_allowed""#), "{body}");
    let (status, _, body) = exchange(admin, "GET", "/nope", "");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains(r#""code":"not_found""#), "{body}");
    assert_eq!(endpoint_count(admin), 1);

    // A new endpoint in the file is picked up by the content check. The new content is
    // renamed into place so the watcher never reads a half-written file.
    let next = TempFile(file.0.with_extension("next"));
    std::fs::write(&next.0, config_yaml(&[a, b])).unwrap();
    std::fs::rename(&next.0, &file.0).unwrap();
    serve.wait_for("config file reloaded", 1).remove(0);
    assert_eq!(endpoint_count(admin), 2);
}

/// `endpoints_file:`: the endpoint list is read at start and re-read when the file changes, and
/// a reload of the config file itself keeps the endpoints the file gave.
#[test]
fn endpoints_file_is_watched_and_a_config_reload_keeps_its_endpoints() {
    let base = temp_base("discovery");
    let config = TempFile(base.with_extension("yaml"));
    let list = TempFile(base.with_extension("endpoints.yaml"));
    let (a, b) = (dead_addr(), dead_addr());
    let list_yaml = |eps: &[SocketAddr]| {
        eps.iter()
            .map(|e| format!("- url: http://{e}\n"))
            .collect::<String>()
    };
    let replace = |path: &PathBuf, text: String| {
        let next = TempFile(path.with_extension("next"));
        std::fs::write(&next.0, text).unwrap();
        std::fs::rename(&next.0, path).unwrap();
    };
    std::fs::write(&list.0, list_yaml(&[a])).unwrap();
    let config_text = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nendpoints_file: {}\n",
        list.0.display()
    );
    std::fs::write(&config.0, &config_text).unwrap();
    let serve = start_serve(&config.0);
    let started = serve.wait_for("kvgate serving", 1).remove(0);
    let admin: SocketAddr = started["admin"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        endpoint_count(admin),
        1,
        "the file's endpoint, read at start"
    );

    replace(&list.0, list_yaml(&[a, b]));
    serve.wait_for("discovered endpoints applied", 1).remove(0);
    assert_eq!(endpoint_count(admin), 2, "the file's new endpoint");

    replace(&config.0, format!("{config_text}seed: 7\n"));
    serve.wait_for("config file reloaded", 1).remove(0);
    assert_eq!(
        endpoint_count(admin),
        2,
        "the reload kept the discovered endpoints"
    );
}

/// `--otlp-endpoint` reaches the config: a URL tracing cannot export to stops `kvgate serve`
/// at start with the field named (exit 1, no panic); a good one serves.
#[test]
fn otlp_endpoint_flag_is_validated_at_start() {
    let dead = dead_addr();
    let run = |otlp: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .args([
                "--endpoint",
                &format!("http://{dead}"),
                "--otlp-endpoint",
                otlp,
            ])
            .args(["--models-refresh", "0s"])
            .output()
            .unwrap()
    };
    for bad in ["https://collector:4318", "collector:4318", ""] {
        let out = run(bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {stderr}");
        assert!(stderr.contains("tracing.otlp_endpoint"), "{bad}: {stderr}");
        assert!(!stderr.contains("panicked"), "{bad}: {stderr}");
    }
    let good = Kvgate::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--endpoint",
        &format!("http://{dead}"),
        "--otlp-endpoint",
        &format!("http://{dead}"),
    ]);
    good.wait_for("kvgate serving", 1);
}

/// The log loses no line: with requests logged from the serving threads and lines logged
/// while shutting down, every one of them is on stderr when the process has exited.
#[test]
fn every_log_line_is_written_by_the_exit() {
    let file = TempFile(temp_base("serve-log").with_extension("yaml"));
    std::fs::write(&file.0, config_yaml(&[dead_addr()])).unwrap();
    let mut serve = start_serve(&file.0);
    let started = serve.wait_for("kvgate serving", 1).remove(0);
    let listen: SocketAddr = started["listen"].as_str().unwrap().parse().unwrap();
    // Several client connections at once, so several serving threads log together.
    const REQUESTS: usize = 40;
    let clients: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..REQUESTS / 4 {
                    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
                    let (status, _, body) = exchange(listen, "POST", "/v1/chat/completions", body);
                    // No endpoint answers: an error, in JSON.
                    assert!(
                        status >= 400 && body.contains(r#""error""#),
                        "{status} {body}"
                    );
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let (status, lines) = serve.terminate();
    assert!(status.success(), "{status}");
    let finished = lines
        .iter()
        .filter(|l| message(l) == "request finished")
        .count();
    assert_eq!(finished, REQUESTS, "one line a request: {lines:#?}");
    assert!(
        lines
            .iter()
            .any(|l| message(l) == "shutting down: draining in-flight requests"),
        "the shutdown's own line: {lines:#?}"
    );
}

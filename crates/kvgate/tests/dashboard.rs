//! The Grafana dashboard (`deploy/grafana/kvgate-dashboard.json`) queries only metrics a
//! running `kvgate serve` exports: a proxy in front of a `kvgate sim` fleet (and one dead
//! endpoint, for ejections and retries) serves a few requests, then every `kvgate_*` name in
//! every panel's `expr` must be a sample name on its admin `/metrics`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeSet, net::SocketAddr};

use serde_json::Value;

mod common;

use common::*;

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../deploy/grafana/kvgate-dashboard.json"
);

fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("kvgate_") {
        let before = rest[..i].chars().next_back();
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.push(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    out
}

#[test]
fn every_dashboard_query_uses_a_metric_the_proxy_exports() {
    let (_sim, engines) = sim(2);
    let dead = kvgate_proxy::test_util::dead_addr();
    let mut flags: Vec<String> = engines
        .iter()
        .map(|e| format!("http://{},kv={}", e.http, e.events))
        .collect();
    flags.push(format!("http://{dead},model={MODEL},block_size=16"));
    // The dead endpoint must stay a candidate until a request has paid a retry for it, so the
    // readiness probe (which would take it out of rotation on its own) is off.
    let config = std::env::temp_dir().join(format!("kvgate-dashboard-{}.yaml", std::process::id()));
    std::fs::write(&config, "engines: { probe_interval_ms: 0 }\n").unwrap();
    let config_arg = config.to_str().unwrap().to_owned();
    let mut args = vec![
        "serve",
        "--config",
        config_arg.as_str(),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ];
    for f in &flags {
        args.extend(["--endpoint", f.as_str()]);
    }
    let proxy = Kvgate::start(&args);
    let served = proxy.wait_for("kvgate serving", 1).remove(0);
    let listen: SocketAddr = served["listen"].as_str().unwrap().parse().unwrap();
    let admin: SocketAddr = served["admin"].as_str().unwrap().parse().unwrap();

    // A request kvgate answers itself (415), for `kvgate_request_errors_total`.
    let (status, _, _) = exchange(listen, "POST", "/v1/chat/completions", "not json");
    assert!(status >= 400, "{status}");
    // Routed requests until the dead endpoint has cost a retry (it is picked, fails to
    // connect, is ejected and the request is retried elsewhere). Model discovery at start may
    // eject it first (a refused connection), for a second: requests go on until it is back in
    // rotation and picked (a bound far past that, for a clear failure instead of a hang).
    let mut metrics = String::new();
    for i in 0..20_000 {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"tell story {i} about caches"}}],"max_tokens":4}}"#
        );
        let (status, _, text) = exchange(listen, "POST", "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{text}");
        if i % 4 == 3 {
            let (status, _, m) = exchange(admin, "GET", "/metrics", "");
            assert_eq!(status, 200);
            metrics = m;
            if metrics.contains("kvgate_upstream_retries_total{") {
                break;
            }
        }
    }
    assert!(
        metrics.contains("kvgate_upstream_retries_total{"),
        "the dead endpoint never cost a retry"
    );
    let exported: BTreeSet<&str> = metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .filter(|n| n.starts_with("kvgate_"))
        .collect();

    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    assert_eq!(dashboard["schemaVersion"], 39);
    assert!(
        dashboard["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["type"] == "datasource" && v["query"] == "prometheus")
    );
    let mut checked = 0;
    let mut missing = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let names = metric_names(expr);
            assert!(!names.is_empty(), "no kvgate metric in `{expr}`");
            for name in names {
                checked += 1;
                if !exported.contains(name.as_str()) {
                    missing.push(format!("{} ({name})", panel["title"]));
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} metric uses checked");
    let _ = std::fs::remove_file(&config);
    assert!(
        missing.is_empty(),
        "not exported: {missing:#?}\nexported: {exported:#?}"
    );
}

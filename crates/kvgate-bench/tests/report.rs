//! The report writer: every file exists, is well-formed, and names every run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvgate_bench::{NamedRun, RequestRecord, RunResult, Target, write_report};

fn run(name: &str, n: usize, hit: f64) -> NamedRun {
    let records = (0..n)
        .map(|i| RequestRecord {
            index: i,
            start_ms: i as f64 * 10.0,
            ttft_ms: Some(20.0 + (i % 17) as f64),
            itl_ms: vec![5.0, 6.0],
            e2e_ms: 80.0 + i as f64,
            streamed: true,
            content_events: 3,
            prompt_tokens: Some(100),
            cached_tokens: Some((100.0 * hit) as u64),
            completion_tokens: Some(3),
            ..RequestRecord::default()
        })
        .collect();
    NamedRun {
        name: name.to_owned(),
        result: RunResult {
            target: Target::new(name, "http://127.0.0.1:1"),
            workload: "shared-prefix".to_owned(),
            started_at_unix_ms: 0,
            records,
        },
    }
}

/// A minimal well-formedness check: tags balance and nest, ignoring declarations,
/// comments and self-closing tags.
fn assert_balanced(xml: &str, what: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = xml;
    while let Some(open) = rest.find('<') {
        rest = &rest[open + 1..];
        let close = rest
            .find('>')
            .unwrap_or_else(|| panic!("{what}: unclosed <"));
        let tag = &rest[..close];
        rest = &rest[close + 1..];
        if tag.starts_with('?') || tag.starts_with('!') || tag.ends_with('/') {
            continue;
        }
        let name = |t: &str| t.split_whitespace().next().unwrap_or("").to_owned();
        if let Some(end) = tag.strip_prefix('/') {
            let top = stack
                .pop()
                .unwrap_or_else(|| panic!("{what}: stray </{end}>"));
            assert_eq!(top, name(end), "{what}: mismatched tags");
        } else if !matches!(name(tag).as_str(), "meta" | "br" | "hr" | "img" | "link") {
            stack.push(name(tag));
        }
    }
    assert!(stack.is_empty(), "{what}: unclosed {stack:?}");
}

#[test]
fn writes_json_markdown_svgs_and_html_naming_every_run() {
    let dir = std::env::temp_dir().join(format!("kvgate-bench-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let names = [
        "round-robin",
        "load-aware",
        "approx-prefix",
        "precise <kv> & co",
    ];
    let runs: Vec<NamedRun> = names
        .iter()
        .enumerate()
        .map(|(i, n)| run(n, 200 + i * 50, 0.2 * i as f64))
        .collect();
    let files = write_report(&dir, &runs, Some("extra section")).unwrap();

    for svg_path in [&files.ttft_cdf_svg, &files.hit_rate_svg] {
        let svg = std::fs::read_to_string(svg_path).unwrap();
        let body = svg.trim();
        assert!(
            body.starts_with("<svg") || body.starts_with("<?xml"),
            "{svg_path:?}"
        );
        assert!(body.ends_with("</svg>"), "{svg_path:?}");
        assert_balanced(body, &svg_path.display().to_string());
        for name in [
            "round-robin",
            "load-aware",
            "approx-prefix",
            "precise &lt;kv&gt; &amp; co",
        ] {
            assert!(svg.contains(name), "{svg_path:?} names {name}");
        }
    }

    let html = std::fs::read_to_string(&files.html).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert_balanced(html.trim_start_matches("<!DOCTYPE html>"), "index.html");
    assert_eq!(html.matches("<svg").count(), 2, "both charts inlined");
    assert!(html.contains("extra section"));
    assert!(html.contains("precise &lt;kv&gt; &amp; co"));

    let md = std::fs::read_to_string(&files.markdown).unwrap();
    for name in names {
        assert!(md.contains(&format!("| {name} |")), "markdown names {name}");
        assert!(html.contains("round-robin"));
    }
    assert!(
        md.contains("hit ratio"),
        "comparison table with several runs"
    );

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files.json).unwrap()).unwrap();
    let json_runs = json["runs"].as_array().unwrap();
    assert_eq!(json_runs.len(), 4);
    for (j, name) in json_runs.iter().zip(names) {
        assert_eq!(j["name"], name);
        assert!(j["summary"]["hit_rate"].is_number());
        assert!(!j["records"].as_array().unwrap().is_empty());
    }
    assert_eq!(json_runs[2]["summary"]["hit_rate"], 0.4);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_without_data_still_gets_a_report() {
    let dir = std::env::temp_dir().join(format!("kvgate-bench-empty-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = write_report(&dir, &[run("empty", 0, 0.0)], None).unwrap();
    let svg = std::fs::read_to_string(&files.ttft_cdf_svg).unwrap();
    assert!(svg.trim_end().ends_with("</svg>"));
    let md = std::fs::read_to_string(&files.markdown).unwrap();
    assert!(md.contains("| empty | 0 | 0 | n/a |"), "{md}");
    std::fs::remove_dir_all(&dir).unwrap();
}

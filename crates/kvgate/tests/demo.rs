//! End to end: `kvgate demo --quick` against its own simulated fleet.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::HashMap, process::Command};

const SETUPS: [&str; 5] = [
    "round-robin",
    "approx-prefix",
    "precise-prefix",
    "approx-prefix×2",
    "precise-prefix×2",
];

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("kvgate-demo-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The hit rate (percent) of every table row: `NAME  HIT%  …`.
fn hit_rates(table: &str) -> HashMap<String, f64> {
    table
        .lines()
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let name = cols.next()?;
            let hit = cols.next()?.strip_suffix('%')?.parse().ok()?;
            Some((name.to_owned(), hit))
        })
        .collect()
}

#[test]
fn quick_demo_shows_prefix_routing_winning_and_writes_the_report() {
    let tmp = TempDir::new();
    let out = tmp.0.join("report");
    let output = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["demo", "--quick", "--out"])
        .arg(&out)
        .env("KVGATE_LOG", "info")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "demo failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );

    let hits = hit_rates(&stdout);
    let hit = |name: &str| {
        *hits
            .get(name)
            .unwrap_or_else(|| panic!("table lacks {name}:\n{stdout}"))
    };
    let rr = hit("round-robin");
    for better in ["approx-prefix", "precise-prefix"] {
        assert!(hit(better) > rr, "{better} vs round-robin:\n{stdout}");
    }
    assert!(
        hit("precise-prefix×2") > hit("approx-prefix×2"),
        "precise vs approximate on two replicas:\n{stdout}"
    );
    for want in [
        "the cache hit rate of round-robin",
        "router replicas, requests alternating between them",
    ] {
        assert!(stdout.contains(want), "{want}:\n{stdout}");
    }

    // The router and engine logs went to the log file, not the terminal.
    let log = std::fs::read_to_string(out.join("demo.log")).unwrap();
    assert!(log.contains("request finished"), "demo.log:\n{log}");
    assert!(!stderr.contains("request finished"), "stderr:\n{stderr}");
    assert!(!stdout.contains("request finished"), "stdout:\n{stdout}");

    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    for setup in SETUPS {
        assert!(html.contains(setup), "index.html lacks {setup}");
    }
}

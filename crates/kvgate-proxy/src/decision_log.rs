//! The decision log (`--decision-log FILE`, off by default): one JSON line per routed request,
//! written when its response ends, with every candidate's raw and weighted scores, predicted
//! cached tokens and router-side load at decision time, the pick, and what happened: status,
//! time to first byte and end-to-end time (both from the decision), and the engine's realized
//! `cached_tokens`. `ts_ms` is the decision's wall-clock time.
//!
//! Lines go through a bounded queue to one writer thread, so a slow disk never blocks a
//! request: when the queue is full the line is dropped, counted in
//! `kvgate_decision_log_dropped_total` and logged (at most once per second).
//!
//! One line (pretty-printed here):
//! ```json
//! {"ts_ms":1764580000123,"request_id":"9f…","model":"Qwen/Qwen3-0.6B","prompt_tokens":2210,
//!  "status":200,"outcome":"completed","ttft_ms":41.2,"e2e_ms":118.0,
//!  "predicted_cached_tokens":2192,"realized_cached_tokens":2192,
//!  "decision":{"endpoint":"127.0.0.1:21001","runs":[{"candidates":[{"endpoint":"…",
//!   "total":1.0,"predicted_cached_tokens":2192,"load":{…},"scores":[…]}, …]}]}}
//! ```

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvgate_schedule::DecisionView;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use serde::Serialize;

/// Lines queued for the writer before new ones are dropped.
const QUEUE_LINES: usize = 16_384;

/// Handle to the decision log; cheap to clone.
#[derive(Debug, Clone)]
pub struct DecisionLog {
    tx: SyncSender<Vec<u8>>,
    dropped: Counter,
    last_warn: Arc<AtomicU64>,
}

impl DecisionLog {
    /// Creates (truncates) `path` and starts the writer thread; registers
    /// `kvgate_decision_log_dropped_total` into `registry` (the root registry).
    ///
    /// # Errors
    /// The file cannot be created.
    pub fn open(path: &Path, registry: &mut Registry) -> io::Result<DecisionLog> {
        let file = File::create(path)?;
        let (tx, rx) = sync_channel(QUEUE_LINES);
        std::thread::Builder::new()
            .name("kvgate-decision-log".into())
            .spawn(move || write_lines(&rx, BufWriter::new(file)))?;
        let dropped = Counter::default();
        registry.register(
            "kvgate_decision_log_dropped",
            "Decision log lines dropped because the writer fell behind",
            dropped.clone(),
        );
        Ok(DecisionLog {
            tx,
            dropped,
            last_warn: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Starts the entry of one decision; it is written when dropped.
    pub(crate) fn entry(
        &self,
        decision: DecisionView,
        model: Option<&str>,
        prompt_tokens: Option<u64>,
        predicted: Option<u64>,
    ) -> LogEntry {
        LogEntry {
            log: self.clone(),
            started: Instant::now(),
            record: Record {
                ts_ms: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                request_id: decision.request_id.clone(),
                model: model.map(str::to_owned),
                prompt_tokens,
                status: 0,
                outcome: "aborted",
                ttft_ms: None,
                e2e_ms: None,
                predicted_cached_tokens: predicted,
                realized_cached_tokens: None,
                decision,
            },
        }
    }

    fn send(&self, line: Vec<u8>) {
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.inc();
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                if self.last_warn.swap(now, Ordering::Relaxed) != now {
                    tracing::warn!(
                        dropped_total = self.dropped.get(),
                        "decision log writer is behind; lines dropped"
                    );
                }
            }
        }
    }
}

fn write_lines(rx: &Receiver<Vec<u8>>, mut out: BufWriter<File>) {
    while let Ok(line) = rx.recv() {
        let mut next = Some(line);
        while let Some(line) = next.take() {
            if let Err(e) = out.write_all(&line) {
                tracing::warn!(error = %e, "decision log write failed; logging stopped");
                return;
            }
            match rx.try_recv() {
                Ok(l) => next = Some(l),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => {}
            }
        }
        if let Err(e) = out.flush() {
            tracing::warn!(error = %e, "decision log flush failed; logging stopped");
            return;
        }
    }
}

#[derive(Debug, Serialize)]
struct Record {
    ts_ms: u64,
    request_id: String,
    model: Option<String>,
    prompt_tokens: Option<u64>,
    /// Engine status (0 when the response never started).
    status: u16,
    /// `completed` when the body ended normally, `retried` when the attempt failed before any
    /// byte, else `aborted`.
    outcome: &'static str,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    predicted_cached_tokens: Option<u64>,
    realized_cached_tokens: Option<u64>,
    decision: DecisionView,
}

/// One request's line, filled in as the response progresses and written on drop.
#[derive(Debug)]
pub struct LogEntry {
    log: DecisionLog,
    started: Instant,
    record: Record,
}

impl LogEntry {
    /// The engine answered with `status`.
    pub(crate) fn status(&mut self, status: u16) {
        self.record.status = status;
    }

    /// The attempt failed before any response byte; the request was retried elsewhere.
    pub(crate) fn retried(&mut self) {
        self.record.outcome = "retried";
    }

    /// The first body byte arrived (the first call counts).
    pub(crate) fn first_byte(&mut self) {
        if self.record.ttft_ms.is_none() {
            self.record.ttft_ms = Some(self.started.elapsed().as_secs_f64() * 1e3);
        }
    }

    /// The body ended normally; `realized` is the engine's `cached_tokens` when it sent one.
    pub(crate) fn completed(&mut self, realized: Option<u64>) {
        self.first_byte();
        self.record.outcome = "completed";
        self.record.e2e_ms = Some(self.started.elapsed().as_secs_f64() * 1e3);
        self.record.realized_cached_tokens = realized;
    }
}

impl Drop for LogEntry {
    fn drop(&mut self) {
        match serde_json::to_vec(&self.record) {
            Ok(mut line) => {
                line.push(b'\n');
                self.log.send(line);
            }
            Err(e) => tracing::warn!(error = %e, "decision log line not serializable"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn view(id: &str) -> DecisionView {
        DecisionView {
            request_id: id.into(),
            endpoint: "e:1".into(),
            kind: "decode-only",
            elapsed_us: 3,
            headers: vec![],
            runs: vec![],
            failed: vec![],
        }
    }

    fn read_lines(path: &Path, want: usize) -> Vec<serde_json::Value> {
        for _ in 0..500 {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let lines: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
                .collect();
            if lines.len() >= want {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("fewer than {want} lines in {}", path.display());
    }

    #[test]
    fn writes_one_line_per_entry_with_the_outcome() {
        let dir = std::env::temp_dir().join(format!("kvgate-dlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        let log = DecisionLog::open(&path, &mut Registry::default()).unwrap();
        {
            let mut done = log.entry(view("a"), Some("m"), Some(100), Some(64));
            done.status(200);
            done.completed(Some(48));
            let mut cut = log.entry(view("b"), Some("m"), Some(10), None);
            cut.status(200);
            cut.first_byte();
        }
        let lines = read_lines(&path, 2);
        let by_id = |id: &str| {
            lines
                .iter()
                .find(|l| l["request_id"] == id)
                .unwrap()
                .clone()
        };
        let a = by_id("a");
        assert_eq!(a["outcome"], "completed");
        assert_eq!(a["predicted_cached_tokens"], 64);
        assert_eq!(a["realized_cached_tokens"], 48);
        assert_eq!(a["prompt_tokens"], 100);
        assert!(a["e2e_ms"].is_number());
        assert_eq!(a["decision"]["endpoint"], "e:1");
        let b = by_id("b");
        assert_eq!(b["outcome"], "aborted");
        assert!(b["realized_cached_tokens"].is_null());
        assert!(b["ttft_ms"].is_number());
        assert!(b["e2e_ms"].is_null());
        std::fs::remove_dir_all(&dir).ok();
    }
}

//! The decision log (`--decision-log FILE`, off by default): one JSON line per routed request,
//! written when its response ends, with every candidate's raw and weighted scores, predicted
//! cached tokens and router-side load at decision time, the pick, and what happened: status,
//! time to first byte and end-to-end time (both from the decision), and the engine's realized
//! `cached_tokens`. `ts_ms` is the decision's wall-clock time; `router` is where the request's
//! time went in the router before the pick, from its arrival (body read, facts and tokens
//! ready, decided).
//!
//! The same record, once its response ends, also goes to the bounded ring of recent
//! decisions that `/debug/state` shows ([`RecentDecisions`]), log file or not.
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
//!  "router":{"body_ms":0.01,"facts_ms":0.62,"decided_ms":0.66},
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

use kvgate_schedule::{Decision, DecisionView};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use serde::Serialize;

mod recent;

pub use self::recent::RecentDecisions;

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

/// One routed request's decision and what came of it: a decision log line, a row of the
/// `/debug/state` decisions table.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    /// Wall-clock time of the decision, Unix milliseconds.
    pub ts_ms: u64,
    /// The request id.
    pub request_id: String,
    /// The canonical model.
    pub model: Option<String>,
    /// Prompt tokens as the router counted them.
    pub prompt_tokens: Option<u64>,
    /// The tokenizer backend that produced them (`local`, `render`, `estimate`; `None`:
    /// routed without tokens).
    pub tokenizer: Option<&'static str>,
    /// Engine status (0 when the response never started).
    pub status: u16,
    /// `completed` when the body ended normally, `retried` when the attempt failed before any
    /// byte, else `aborted`.
    pub outcome: &'static str,
    /// Time to the first response byte, from the decision.
    pub ttft_ms: Option<f64>,
    /// Time to the end of the response, from the decision.
    pub e2e_ms: Option<f64>,
    /// Cached prompt tokens predicted on the pick.
    pub predicted_cached_tokens: Option<u64>,
    /// Cached prompt tokens the engine reported.
    pub realized_cached_tokens: Option<u64>,
    /// The router's own time before the pick (`None` when the front door did not say when the
    /// request arrived).
    pub router: Option<RouterTimes>,
    /// Every candidate's scores and the pick.
    pub decision: DecisionView,
}

/// Where a request's time went in the router before its pick, in milliseconds since it
/// arrived (its headers were read).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RouterTimes {
    /// Until its body was read.
    pub body_ms: f64,
    /// Until it was parsed, sealed and tokenized (as far as routing needed).
    pub facts_ms: f64,
    /// Until the pick (flow control's wait and the scheduler's cycle included).
    pub decided_ms: f64,
}

impl RouterTimes {
    /// The times of a request that arrived at `arrived`.
    pub(crate) fn new(
        arrived: Instant,
        body: Instant,
        facts: Instant,
        decided: Instant,
    ) -> RouterTimes {
        let ms = |t: Instant| t.saturating_duration_since(arrived).as_secs_f64() * 1e3;
        RouterTimes {
            body_ms: ms(body),
            facts_ms: ms(facts),
            decided_ms: ms(decided),
        }
    }
}

impl DecisionRecord {
    /// A record of request `request_id`'s decision, its outcome not known yet. Its `decision`
    /// view starts empty: rendered from the scheduler's decision when the record is written
    /// or read (see [`LogEntry::unrendered`]).
    pub(crate) fn new(
        request_id: &str,
        model: Option<&str>,
        prompt_tokens: Option<u64>,
        tokenizer: Option<&'static str>,
        predicted: Option<u64>,
    ) -> DecisionRecord {
        DecisionRecord {
            ts_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            request_id: request_id.to_owned(),
            model: model.map(str::to_owned),
            prompt_tokens,
            tokenizer,
            status: 0,
            outcome: "aborted",
            ttft_ms: None,
            e2e_ms: None,
            predicted_cached_tokens: predicted,
            realized_cached_tokens: None,
            router: None,
            decision: DecisionView::default(),
        }
    }
}

/// A record, its `decision` view still to be rendered from `source` when there is one. Boxed
/// from the pick on: the entry moves with the pick and the response body, and the ring takes
/// it, by pointer.
#[derive(Debug)]
struct Kept {
    record: DecisionRecord,
    source: Option<Decision>,
}

impl Kept {
    fn rendered(&self) -> DecisionRecord {
        let mut record = self.record.clone();
        if let Some(decision) = &self.source {
            record.decision = decision.to_view();
        }
        record
    }
}

/// One request's record, filled in as the response progresses; on drop it is written to the
/// decision log (when one is open) and kept in the recent decisions.
#[derive(Debug)]
pub struct LogEntry {
    log: Option<DecisionLog>,
    recent: Arc<RecentDecisions>,
    started: Instant,
    /// The record, and the decision its view is rendered from when not rendered yet.
    kept: Option<Box<Kept>>,
}

impl LogEntry {
    /// Starts the entry of `record`'s decision (the tests' entries; the pick's is
    /// [`LogEntry::unrendered`]).
    #[cfg(test)]
    pub(crate) fn new(
        log: Option<DecisionLog>,
        recent: Arc<RecentDecisions>,
        record: DecisionRecord,
    ) -> LogEntry {
        LogEntry::keeping(log, recent, record, None, Instant::now())
    }

    /// Starts the entry of `decision`, made at `decided`, whose view `record` leaves empty:
    /// rendered when the line is written to the log, or when `/debug/state` reads it.
    pub(crate) fn unrendered(
        log: Option<DecisionLog>,
        recent: Arc<RecentDecisions>,
        record: DecisionRecord,
        decision: Decision,
        decided: Instant,
    ) -> LogEntry {
        LogEntry::keeping(log, recent, record, Some(decision), decided)
    }

    fn keeping(
        log: Option<DecisionLog>,
        recent: Arc<RecentDecisions>,
        record: DecisionRecord,
        source: Option<Decision>,
        started: Instant,
    ) -> LogEntry {
        LogEntry {
            log,
            recent,
            started,
            kept: Some(Box::new(Kept { record, source })),
        }
    }

    fn record(&mut self) -> Option<&mut DecisionRecord> {
        self.kept.as_mut().map(|k| &mut k.record)
    }

    /// The engine answered with `status`.
    pub(crate) fn status(&mut self, status: u16) {
        if let Some(r) = self.record() {
            r.status = status;
        }
    }

    /// The attempt failed before any response byte; the request was retried elsewhere.
    pub(crate) fn retried(&mut self) {
        if let Some(r) = self.record() {
            r.outcome = "retried";
        }
    }

    /// The first body byte arrived (the first call counts).
    pub(crate) fn first_byte(&mut self) {
        let elapsed = self.started.elapsed();
        if let Some(r) = self.record()
            && r.ttft_ms.is_none()
        {
            r.ttft_ms = Some(elapsed.as_secs_f64() * 1e3);
        }
    }

    /// The body ended normally; `realized` is the engine's `cached_tokens` when it sent one.
    pub(crate) fn completed(&mut self, realized: Option<u64>) {
        self.first_byte();
        let elapsed = self.started.elapsed();
        if let Some(r) = self.record() {
            r.outcome = "completed";
            r.e2e_ms = Some(elapsed.as_secs_f64() * 1e3);
            r.realized_cached_tokens = realized;
        }
    }
}

impl Drop for LogEntry {
    fn drop(&mut self) {
        let Some(mut kept) = self.kept.take() else {
            return;
        };
        if let Some(log) = &self.log {
            if let Some(decision) = kept.source.take() {
                kept.record.decision = decision.to_view();
            }
            match serde_json::to_vec(&kept.record) {
                Ok(mut line) => {
                    line.push(b'\n');
                    log.send(line);
                }
                Err(e) => tracing::warn!(error = %e, "decision log line not serializable"),
            }
        }
        self.recent.push(self.started, kept);
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

    fn entry(
        log: Option<&DecisionLog>,
        recent: &Arc<RecentDecisions>,
        id: &str,
        prompt: Option<u64>,
        predicted: Option<u64>,
    ) -> LogEntry {
        let mut record = DecisionRecord::new(id, Some("m"), prompt, Some("local"), predicted);
        record.decision = view(id);
        LogEntry::new(log.cloned(), Arc::clone(recent), record)
    }

    #[test]
    fn the_ring_keeps_the_newest_records_without_a_log() {
        // (name, capacity, entries written, want ids newest first)
        let cases: [(&str, usize, usize, &[&str]); 4] = [
            ("empty", 3, 0, &[]),
            ("under capacity", 3, 2, &["1", "0"]),
            ("full: oldest dropped", 3, 5, &["4", "3", "2"]),
            ("capacity 0 keeps nothing", 0, 2, &[]),
        ];
        for (name, capacity, n, want) in cases {
            let recent = Arc::new(RecentDecisions::new(capacity));
            for i in 0..n {
                let mut e = entry(None, &recent, &i.to_string(), Some(10), Some(4));
                e.status(200);
                e.completed(Some(i as u64));
            }
            let got = recent.newest_first();
            let ids: Vec<&str> = got.iter().map(|r| r.request_id.as_str()).collect();
            assert_eq!(ids, want, "{name}");
            for r in &got {
                assert_eq!(r.outcome, "completed", "{name}");
                assert_eq!(
                    r.realized_cached_tokens,
                    r.request_id.parse().ok(),
                    "{name}"
                );
            }
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
        let recent = Arc::new(RecentDecisions::new(8));
        {
            let mut done = entry(Some(&log), &recent, "a", Some(100), Some(64));
            done.status(200);
            done.completed(Some(48));
            let mut cut = entry(Some(&log), &recent, "b", Some(10), None);
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
        assert_eq!(a["tokenizer"], "local");
        let kept: Vec<String> = recent
            .newest_first()
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        assert_eq!(kept.len(), 2, "both entries are also in the ring");
        std::fs::remove_dir_all(&dir).ok();
    }
}

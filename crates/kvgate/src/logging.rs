//! The log's way to stderr: lines gathered in one buffer and written out in batches.
//!
//! At the default level every request logs a line. Written one by one, each line is a system
//! call on the serving thread that logged it, under stderr's process-wide lock, which the
//! serving threads then contend for. Here a thread that logs only appends its formatted line
//! to a shared buffer (a short lock, no system call). The buffer goes out in one write when it
//! holds [`BATCH_BYTES`], from the thread whose line filled it, or else every
//! [`FLUSH_EVERY`] from the `kvgate-log` thread, which wakes on that period only, not for each
//! line. Lines keep the order in which they were appended; a line is never split. What is
//! still buffered is written when the [`LogGuard`] is dropped, and before a panic's message.

use std::{
    io::{self, Write},
    sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError},
    thread::JoinHandle,
    time::Duration,
};

use tracing_subscriber::fmt::MakeWriter;

pub(crate) mod text;

/// A batch is written out once it holds this many bytes.
pub(crate) const BATCH_BYTES: usize = 64 * 1024;

/// The longest a line waits in the buffer.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(25);

/// What the writers, the flushing thread and the guard share.
struct Shared {
    /// Lines appended since the last write.
    buf: Mutex<Vec<u8>>,
    /// Where batches go. Held while a batch is taken from `buf` and written, so batches go
    /// out in the order they were taken.
    out: Mutex<Box<dyn Write + Send>>,
    /// Set when the guard is dropped: the flushing thread writes what is left and ends.
    stop: Mutex<bool>,
    wake: Condvar,
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Writes out whatever is buffered.
    fn flush(&self) {
        let mut out = lock(&self.out);
        let batch = std::mem::take(&mut *lock(&self.buf));
        if batch.is_empty() {
            return;
        }
        // Nowhere to report a failed write to stderr; the lines are dropped with it.
        let _ = out.write_all(&batch);
        let _ = out.flush();
    }
}

/// A [`MakeWriter`] for the fmt layer: each event's formatted line is appended to the shared
/// buffer (see the module docs).
#[derive(Clone)]
pub(crate) struct BatchedLog {
    shared: Arc<Shared>,
}

/// Keeps the flushing thread running; dropped, it writes out what is left.
pub(crate) struct LogGuard {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl BatchedLog {
    /// A log writing to `out` every `every` (or when a batch is full), and the guard that
    /// writes out the rest.
    ///
    /// # Errors
    /// The flushing thread could not be started.
    pub(crate) fn new(
        out: impl Write + Send + 'static,
        every: Duration,
    ) -> io::Result<(BatchedLog, LogGuard)> {
        let shared = Arc::new(Shared {
            buf: Mutex::new(Vec::with_capacity(BATCH_BYTES)),
            out: Mutex::new(Box::new(out)),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let flusher = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvgate-log".into())
            .spawn(move || {
                let mut stop = lock(&flusher.stop);
                while !*stop {
                    stop = flusher
                        .wake
                        .wait_timeout(stop, every)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    flusher.flush();
                }
            })?;
        let log = BatchedLog {
            shared: shared.clone(),
        };
        let guard = LogGuard {
            shared,
            thread: Some(thread),
        };
        Ok((log, guard))
    }

    /// Writes out whatever is buffered now (before a panic's message).
    pub(crate) fn flush(&self) {
        self.shared.flush();
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        *lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.shared.flush();
    }
}

/// One event's writer: its bytes are appended to the buffer.
pub(crate) struct LineWriter<'a> {
    shared: &'a Shared,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let full = {
            let mut buf = lock(&self.shared.buf);
            buf.extend_from_slice(bytes);
            buf.len() >= BATCH_BYTES
        };
        if full {
            self.shared.flush();
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for BatchedLog {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An output the test can read.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            lock(&self.0).extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Sink {
        fn text(&self) -> String {
            String::from_utf8(lock(&self.0).clone()).unwrap()
        }
    }

    /// Never flushes on its own within a test.
    const NEVER: Duration = Duration::from_secs(3600);

    fn line(log: &BatchedLog, text: &str) {
        log.make_writer().write_all(text.as_bytes()).unwrap();
    }

    /// Threads logging together: every line arrives whole, each thread's in its order.
    #[test]
    fn lines_from_many_threads_arrive_whole_and_in_order() {
        let sink = Sink::default();
        let (log, guard) = BatchedLog::new(sink.clone(), FLUSH_EVERY).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        line(
                            &log,
                            &format!("thread {t} line {i} {}\n", "x".repeat(i % 90)),
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(guard);
        let text = sink.text();
        let mut next = [0usize; 4];
        for l in text.lines() {
            let words: Vec<&str> = l.split(' ').collect();
            let (t, i): (usize, usize) = (words[1].parse().unwrap(), words[3].parse().unwrap());
            assert_eq!(i, next[t], "thread {t}: {l}");
            assert_eq!(words[4].len(), i % 90, "a split line: {l}");
            next[t] += 1;
        }
        assert_eq!(next, [2000; 4]);
    }

    /// A line goes out on the flushing thread's period, with nothing else logged after it.
    #[test]
    fn a_lone_line_goes_out_on_the_period() {
        let sink = Sink::default();
        let (log, _guard) = BatchedLog::new(sink.clone(), Duration::from_millis(5)).unwrap();
        line(&log, "alone\n");
        let waited = std::time::Instant::now();
        while sink.text().is_empty() {
            assert!(waited.elapsed() < Duration::from_secs(30), "never written");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(sink.text(), "alone\n");
    }

    /// A full batch goes out at once, from the thread that filled it; a smaller one waits.
    #[test]
    fn a_full_batch_goes_out_at_once() {
        let sink = Sink::default();
        let (log, _guard) = BatchedLog::new(sink.clone(), NEVER).unwrap();
        let text = "y".repeat(99) + "\n";
        let fits = BATCH_BYTES / text.len();
        for _ in 0..fits {
            line(&log, &text);
        }
        assert_eq!(sink.text(), "", "under a batch: still buffered");
        line(&log, &text);
        assert_eq!(sink.text().len(), (fits + 1) * text.len());
    }

    /// Dropping the guard writes out what is buffered; so does a flush.
    #[test]
    fn the_guard_and_a_flush_write_out_the_rest() {
        let sink = Sink::default();
        let (log, guard) = BatchedLog::new(sink.clone(), NEVER).unwrap();
        line(&log, "first\n");
        log.flush();
        assert_eq!(sink.text(), "first\n");
        line(&log, "last\n");
        assert_eq!(sink.text(), "first\n");
        drop(guard);
        assert_eq!(sink.text(), "first\nlast\n");
    }
}

//! A bounded blocking pool for CPU-bound tokenization, off the async threads.
//!
//! `threads` OS threads take jobs from one bounded queue of `queue_limit` slots. Submitting
//! never waits: when every slot is taken the caller gets [`PoolError::QueueFull`] at once
//! (the proxy answers 503) and the rejection counter increments. Results come back through
//! a oneshot channel, so the async caller only awaits.
//!
//! With [`PoolOptions::max_queue_wait`], a caller that waited that long for a worker to take
//! its job gives up: it gets [`PoolError::WaitExceeded`] (the proxy routes the request without
//! tokens), the job is skipped when a worker reaches it, and the abandoned counter
//! increments. A job a worker has started always runs to the end and is awaited. Queued work
//! therefore never holds a request longer than the bound, however far behind the pool is.
//!
//! A job that panics is caught on its worker: the caller gets [`PoolError::Panicked`] with
//! the panic message, the panic counter increments, and the worker takes the next job.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::oneshot;
use tracing::warn;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// What a job's receiver yields: its value, or [`PoolError::Panicked`].
pub(crate) type JobResult<T> = Result<T, PoolError>;

/// Why a job did not run to completion.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The queue is full; retry later (HTTP 503).
    #[error("tokenizer queue full")]
    QueueFull,
    /// No worker took the job within [`PoolOptions::max_queue_wait`]; it will not run.
    #[error("tokenizer queue wait exceeded")]
    WaitExceeded,
    /// The pool is shut down.
    #[error("tokenizer pool unavailable")]
    Closed,
    /// The job panicked; the worker survived and serves the next job.
    #[error("tokenizer job panicked: {0}")]
    Panicked(String),
}

/// The counters a pool increments.
#[derive(Debug, Clone, Default)]
pub struct PoolCounters {
    /// Submissions refused with [`PoolError::QueueFull`].
    pub rejected: Counter,
    /// Jobs that panicked ([`PoolError::Panicked`]).
    pub panics: Counter,
    /// Jobs given up after [`PoolOptions::max_queue_wait`] ([`PoolError::WaitExceeded`]).
    pub abandoned: Counter,
}

/// Pool sizing.
#[derive(Debug, Clone, Copy)]
pub struct PoolOptions {
    /// Worker threads.
    pub threads: usize,
    /// Jobs that may wait for a worker before submissions are rejected.
    pub queue_limit: usize,
    /// How long [`BlockingPool::run`] waits for a worker to take its job before giving up
    /// (`None`: as long as it takes).
    pub max_queue_wait: Option<Duration>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            threads: 2,
            queue_limit: 256,
            max_queue_wait: None,
        }
    }
}

/// A job's state, shared by its caller and the worker that reaches it.
const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const ABANDONED: u8 = 2;

/// The blocking pool. Dropping it lets the workers finish queued jobs and exit.
#[derive(Debug)]
pub struct BlockingPool {
    tx: Option<SyncSender<Job>>,
    workers: Vec<JoinHandle<()>>,
    counters: PoolCounters,
    max_queue_wait: Option<Duration>,
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

fn worker(rx: Arc<Mutex<Receiver<Job>>>) {
    loop {
        let job = {
            let Ok(guard) = rx.lock() else { return };
            match guard.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        job();
    }
}

impl BlockingPool {
    /// Starts the workers. `counters.rejected` is incremented on every
    /// [`PoolError::QueueFull`], `counters.panics` on every [`PoolError::Panicked`].
    ///
    /// # Errors
    /// The OS error when a thread cannot be spawned.
    pub fn new(opts: PoolOptions, counters: PoolCounters) -> std::io::Result<BlockingPool> {
        let (tx, rx) = mpsc::sync_channel::<Job>(opts.queue_limit);
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..opts.threads.max(1))
            .map(|i| {
                let rx = Arc::clone(&rx);
                std::thread::Builder::new()
                    .name(format!("kvgate-tokenize-{i}"))
                    .spawn(move || worker(rx))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(BlockingPool {
            tx: Some(tx),
            workers,
            counters,
            max_queue_wait: opts.max_queue_wait,
        })
    }

    /// Runs `f` on a worker and awaits its result.
    ///
    /// # Errors
    /// [`PoolError::QueueFull`] immediately when the queue is full;
    /// [`PoolError::WaitExceeded`] when no worker took the job within the pool's
    /// `max_queue_wait` (the job is then skipped); [`PoolError::Closed`] if the pool is gone;
    /// [`PoolError::Panicked`] if `f` panicked.
    pub async fn run<T, F>(&self, f: F) -> Result<T, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let Some(wait) = self.max_queue_wait else {
            let rx = self.submit(f)?;
            return rx.await.map_err(|_| PoolError::Closed)?;
        };
        let state = Arc::new(AtomicU8::new(QUEUED));
        let job_state = Arc::clone(&state);
        let mut rx = self.submit(move || {
            job_state
                .compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
                .then(f)
        })?;
        tokio::select! {
            r = &mut rx => return started(r),
            () = tokio::time::sleep(wait) => {}
        }
        if state
            .compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.counters.abandoned.inc();
            return Err(PoolError::WaitExceeded);
        }
        // A worker took it in time: its result is worth the rest of the wait.
        started(rx.await)
    }

    /// Runs `f` on the caller's thread, with a worker's panic handling: a panic is caught,
    /// counted and logged, and returned as [`PoolError::Panicked`]. For jobs small enough
    /// that a hand-off to a worker (a queue wait and two thread wake-ups) would cost more
    /// than the job.
    ///
    /// # Errors
    /// [`PoolError::Panicked`] if `f` panicked.
    pub fn run_inline<T, F>(&self, f: F) -> Result<T, PoolError>
    where
        F: FnOnce() -> T,
    {
        // Unwind safety: as for a worker's job (see `submit`).
        panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
            self.counters.panics.inc();
            let message = panic_message(payload.as_ref());
            warn!(panic = %message, "tokenizer job panicked on the caller's thread");
            PoolError::Panicked(message)
        })
    }

    /// Queues `f` without waiting; the receiver yields its result, or the panic.
    pub(crate) fn submit<T, F>(&self, f: F) -> Result<oneshot::Receiver<JobResult<T>>, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (otx, orx) = oneshot::channel();
        let panics = self.counters.panics.clone();
        let job: Job = Box::new(move || {
            // Unwind safety: the only state jobs share is the tokenizer's segment cache
            // (moka, which inserts whole entries), so a panic leaves nothing half-updated.
            let result = panic::catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
                panics.inc();
                let message = panic_message(payload.as_ref());
                warn!(panic = %message, "tokenizer job panicked; worker kept");
                PoolError::Panicked(message)
            });
            let _ = otx.send(result);
        });
        let tx = self.tx.as_ref().ok_or(PoolError::Closed)?;
        match tx.try_send(job) {
            Ok(()) => Ok(orx),
            Err(TrySendError::Full(_)) => {
                self.counters.rejected.inc();
                Err(PoolError::QueueFull)
            }
            Err(TrySendError::Disconnected(_)) => Err(PoolError::Closed),
        }
    }
}

/// The result of a job submitted by [`BlockingPool::run`] with a wait bound (`None`: skipped,
/// which only an abandoned job is, and its caller no longer listens).
fn started<T>(r: Result<JobResult<Option<T>>, oneshot::error::RecvError>) -> Result<T, PoolError> {
    r.map_err(|_| PoolError::Closed)??
        .ok_or(PoolError::WaitExceeded)
}

impl Drop for BlockingPool {
    fn drop(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc as std_mpsc;

    use super::*;

    #[tokio::test]
    async fn full_queue_is_rejected_and_counted() {
        let counters = PoolCounters::default();
        let pool = BlockingPool::new(
            PoolOptions {
                threads: 1,
                queue_limit: 1,
                max_queue_wait: None,
            },
            counters.clone(),
        )
        .unwrap();
        // Block the only worker until we say so.
        let (started_tx, started_rx) = std_mpsc::channel();
        let (release_tx, release_rx) = std_mpsc::channel::<()>();
        let first = pool
            .submit(move || {
                let _ = started_tx.send(());
                let _ = release_rx.recv();
                1
            })
            .unwrap();
        started_rx.recv().unwrap();
        let second = pool.submit(|| 2).unwrap(); // fills the single queue slot
        assert_eq!(pool.submit(|| 3).unwrap_err(), PoolError::QueueFull);
        assert_eq!(counters.rejected.get(), 1);
        release_tx.send(()).unwrap();
        assert_eq!(first.await.unwrap(), Ok(1));
        assert_eq!(second.await.unwrap(), Ok(2));
        assert_eq!(pool.run(|| 4).await, Ok(4));
    }

    #[tokio::test]
    async fn panicking_jobs_keep_every_worker() {
        let counters = PoolCounters::default();
        let opts = PoolOptions {
            threads: 2,
            queue_limit: 4,
            max_queue_wait: None,
        };
        let pool = BlockingPool::new(opts, counters.clone()).unwrap();
        let panics = opts.threads * 3;
        for i in 0..panics {
            let got = pool.run(move || -> u32 { panic!("job {i} broke") }).await;
            assert_eq!(got, Err(PoolError::Panicked(format!("job {i} broke"))));
        }
        assert_eq!(counters.panics.get(), panics as u64);
        // Every worker is still there: as many blocking jobs as threads all start.
        let (started_tx, started_rx) = std_mpsc::channel();
        let (release_tx, release_rx) = std_mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let jobs: Vec<_> = (0..opts.threads)
            .map(|i| {
                let started_tx = started_tx.clone();
                let release_rx = Arc::clone(&release_rx);
                pool.submit(move || {
                    let _ = started_tx.send(());
                    let _ = release_rx.lock().map(|rx| rx.recv());
                    i
                })
                .unwrap()
            })
            .collect();
        for _ in 0..opts.threads {
            started_rx.recv().unwrap();
        }
        for _ in 0..opts.threads {
            release_tx.send(()).unwrap();
        }
        for (i, job) in jobs.into_iter().enumerate() {
            assert_eq!(job.await.unwrap(), Ok(i));
        }
        assert_eq!(counters.rejected.get(), 0);
    }

    /// Blocks the single worker with a job until `release` is sent; returns once it runs.
    fn occupy(pool: &BlockingPool) -> std_mpsc::Sender<()> {
        let (started_tx, started_rx) = std_mpsc::channel();
        let (release_tx, release_rx) = std_mpsc::channel::<()>();
        // Nobody awaits this one's result: dropping the receiver leaves the job running.
        drop(
            pool.submit(move || {
                let _ = started_tx.send(());
                let _ = release_rx.recv();
            })
            .unwrap(),
        );
        started_rx.recv().unwrap();
        release_tx
    }

    fn bounded(counters: &PoolCounters) -> BlockingPool {
        BlockingPool::new(
            PoolOptions {
                threads: 1,
                queue_limit: 4,
                max_queue_wait: Some(Duration::from_millis(50)),
            },
            counters.clone(),
        )
        .unwrap()
    }

    /// A job still queued when the wait bound passes is given up, counted, and never runs.
    #[tokio::test(start_paused = true)]
    async fn a_job_not_started_within_the_bound_is_abandoned_and_skipped() {
        let counters = PoolCounters::default();
        let pool = bounded(&counters);
        let release = occupy(&pool);
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&ran);
        // Paused time advances to the bound as soon as the runtime idles.
        let got = pool
            .run(move || flag.store(true, std::sync::atomic::Ordering::SeqCst))
            .await;
        assert_eq!(got, Err(PoolError::WaitExceeded));
        assert_eq!(counters.abandoned.get(), 1);
        release.send(()).unwrap();
        // FIFO: once this later job has run, the abandoned one was reached and skipped
        // (`submit` has no wait bound, which paused time would otherwise hit at once).
        assert_eq!(pool.submit(|| 7).unwrap().await, Ok(Ok(7)));
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(counters.abandoned.get(), 1);
    }

    /// A job a worker took within the bound is awaited to the end, however long it runs.
    #[tokio::test(start_paused = true)]
    async fn a_started_job_is_awaited_past_the_bound() {
        let counters = PoolCounters::default();
        let pool = Arc::new(bounded(&counters));
        let (started_tx, started_rx) = std_mpsc::channel();
        let (release_tx, release_rx) = std_mpsc::channel::<()>();
        let runner = Arc::clone(&pool);
        let task = tokio::spawn(async move {
            runner
                .run(move || {
                    let _ = started_tx.send(());
                    let _ = release_rx.recv();
                    11
                })
                .await
        });
        tokio::task::spawn_blocking(move || started_rx.recv().unwrap())
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        release_tx.send(()).unwrap();
        assert_eq!(task.await.unwrap(), Ok(11));
        assert_eq!(counters.abandoned.get(), 0);
    }
}

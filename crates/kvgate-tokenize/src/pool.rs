//! A bounded blocking pool for CPU-bound tokenization, off the async threads.
//!
//! `threads` OS threads take jobs from one bounded queue of `queue_limit` slots. Submitting
//! never waits: when every slot is taken the caller gets [`PoolError::QueueFull`] at once
//! (the proxy answers 503) and the rejection counter increments. Results come back through
//! a oneshot channel, so the async caller only awaits.
//!
//! A job that panics is caught on its worker: the caller gets [`PoolError::Panicked`] with
//! the panic message, the panic counter increments, and the worker takes the next job.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

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
}

/// Pool sizing.
#[derive(Debug, Clone, Copy)]
pub struct PoolOptions {
    /// Worker threads.
    pub threads: usize,
    /// Jobs that may wait for a worker before submissions are rejected.
    pub queue_limit: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            threads: 2,
            queue_limit: 256,
        }
    }
}

/// The blocking pool. Dropping it lets the workers finish queued jobs and exit.
#[derive(Debug)]
pub struct BlockingPool {
    tx: Option<SyncSender<Job>>,
    workers: Vec<JoinHandle<()>>,
    counters: PoolCounters,
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
        })
    }

    /// Runs `f` on a worker and awaits its result.
    ///
    /// # Errors
    /// [`PoolError::QueueFull`] immediately when the queue is full; [`PoolError::Closed`]
    /// if the pool is gone; [`PoolError::Panicked`] if `f` panicked.
    pub async fn run<T, F>(&self, f: F) -> Result<T, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let rx = self.submit(f)?;
        rx.await.map_err(|_| PoolError::Closed)?
    }

    /// Queues `f` without waiting; the receiver yields its result, or the panic.
    pub(crate) fn submit<T, F>(&self, f: F) -> Result<oneshot::Receiver<JobResult<T>>, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        self.submit_counted(f, true)
    }

    /// Queues background work: like [`BlockingPool::submit`], but a full queue is not
    /// counted as a rejected request.
    pub(crate) fn submit_background<F>(&self, f: F) -> Result<(), PoolError>
    where
        F: FnOnce() + Send + 'static,
    {
        self.submit_counted(f, false).map(drop)
    }

    fn submit_counted<T, F>(
        &self,
        f: F,
        count: bool,
    ) -> Result<oneshot::Receiver<JobResult<T>>, PoolError>
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
                if count {
                    self.counters.rejected.inc();
                }
                Err(PoolError::QueueFull)
            }
            Err(TrySendError::Disconnected(_)) => Err(PoolError::Closed),
        }
    }
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
}

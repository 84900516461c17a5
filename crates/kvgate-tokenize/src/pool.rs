//! A bounded blocking pool for CPU-bound tokenization, off the async threads.
//!
//! `threads` OS threads take jobs from one bounded queue of `queue_limit` slots. Submitting
//! never waits: when every slot is taken the caller gets [`PoolError::QueueFull`] at once
//! (the proxy answers 503) and the rejection counter increments. Results come back through
//! a oneshot channel, so the async caller only awaits.

use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Why a job did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The queue is full; retry later (HTTP 503).
    #[error("tokenizer queue full")]
    QueueFull,
    /// The pool is shut down or the job panicked.
    #[error("tokenizer pool unavailable")]
    Closed,
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
    rejected: Counter,
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
    /// Starts the workers. `rejected` is incremented on every [`PoolError::QueueFull`].
    ///
    /// # Errors
    /// The OS error when a thread cannot be spawned.
    pub fn new(opts: PoolOptions, rejected: Counter) -> std::io::Result<BlockingPool> {
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
            rejected,
        })
    }

    /// Runs `f` on a worker and awaits its result.
    ///
    /// # Errors
    /// [`PoolError::QueueFull`] immediately when the queue is full; [`PoolError::Closed`]
    /// if the pool is gone or `f` panicked.
    pub async fn run<T, F>(&self, f: F) -> Result<T, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let rx = self.submit(f)?;
        rx.await.map_err(|_| PoolError::Closed)
    }

    /// Queues `f` without waiting; the receiver yields its result.
    pub(crate) fn submit<T, F>(&self, f: F) -> Result<oneshot::Receiver<T>, PoolError>
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

    fn submit_counted<T, F>(&self, f: F, count: bool) -> Result<oneshot::Receiver<T>, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (otx, orx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = otx.send(f());
        });
        let tx = self.tx.as_ref().ok_or(PoolError::Closed)?;
        match tx.try_send(job) {
            Ok(()) => Ok(orx),
            Err(TrySendError::Full(_)) => {
                if count {
                    self.rejected.inc();
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
        let rejected = Counter::default();
        let pool = BlockingPool::new(
            PoolOptions {
                threads: 1,
                queue_limit: 1,
            },
            rejected.clone(),
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
        assert_eq!(rejected.get(), 1);
        release_tx.send(()).unwrap();
        assert_eq!(first.await.unwrap(), 1);
        assert_eq!(second.await.unwrap(), 2);
        assert_eq!(pool.run(|| 4).await.unwrap(), 4);
    }
}

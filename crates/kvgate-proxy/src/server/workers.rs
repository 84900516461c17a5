//! Serving threads: one single-threaded async runtime per thread, each serving the client
//! connections the accept loop hands it (in turn), with its own share of the upstream
//! connection pool. A connection, its requests and their upstream connections stay on one
//! thread from accept to close, the way Envoy's and nginx's workers keep theirs: no task
//! moves between threads and none wakes another thread's (on the load-routing proxy path,
//! 35% more req/s and 27% less CPU a request than the shared work-stealing runtime;
//! BENCHMARKS.md, "Proxy path side by side"). The accepted socket moves to its thread's
//! reactor, so its readiness, too, wakes that thread alone.
//! Everything else (the accept loop, the admin server, health checks, KV-event
//! subscribers) stays on the process's shared runtime.

use std::{future::Future, io, thread};

use prometheus_client::metrics::counter::Counter;
use tokio::{net::TcpStream, runtime::Handle, sync::oneshot};

use crate::{
    Proxy,
    metrics::{ListenerLabels, WorkerLabels},
};

/// Where client connections are served: on the serving threads, or on the shared runtime
/// (`serving_threads: 0`). Dropping it stops the threads, and with them the connections they
/// serve.
#[derive(Debug)]
pub(crate) enum Serving {
    /// On the serving threads, in turn.
    Threads(Workers),
    /// On the shared runtime; the count of connections accepted.
    Shared(Counter),
}

impl Serving {
    /// Starts `proxy.config.serving_threads` serving threads (none for 0).
    ///
    /// # Errors
    /// A thread or its runtime could not be started.
    pub(crate) async fn start(proxy: &Proxy) -> io::Result<Serving> {
        let n = proxy.config.serving_threads;
        if n == 0 {
            let shared = proxy.metrics.connections.get_or_create(&WorkerLabels {
                worker: "shared".into(),
            });
            return Ok(Serving::Shared(shared.clone()));
        }
        Workers::start(n, proxy).await.map(Serving::Threads)
    }

    /// Serves one accepted connection: `serve(stream)`, to its end.
    pub(crate) fn spawn<F, Fut>(&mut self, stream: TcpStream, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        match self {
            Serving::Threads(workers) => workers.spawn(stream, serve),
            Serving::Shared(accepted) => {
                accepted.inc();
                tokio::spawn(serve(stream));
            }
        }
    }
}

/// The serving threads.
#[derive(Debug)]
pub(crate) struct Workers {
    threads: Vec<Worker>,
    next: usize,
    /// Connections closed because they could not be moved to their thread, counted with the
    /// proxy listener's failed accepts (`kvgate_accept_errors_total{listener="proxy"}`).
    hand_off_failures: Counter,
}

/// One serving thread: its runtime's handle, the switch that stops it, and its count of
/// connections.
#[derive(Debug)]
struct Worker {
    handle: Handle,
    _stop: oneshot::Sender<()>,
    accepted: Counter,
}

impl Workers {
    /// Starts `n` (at least 1) serving threads, `kvgate-serve-0`….
    async fn start(n: usize, proxy: &Proxy) -> io::Result<Workers> {
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            threads.push(Worker::start(i, proxy).await?);
        }
        tracing::info!(threads = n, "serving connections on their own threads");
        let hand_off_failures = proxy
            .metrics
            .accept_errors
            .get_or_create(&ListenerLabels { listener: "proxy" })
            .clone();
        Ok(Workers {
            threads,
            next: 0,
            hand_off_failures,
        })
    }

    /// Serves one connection on the next thread in turn.
    ///
    /// The socket moves to that thread's reactor: registered with the accepting runtime's,
    /// its every readiness would wake the serving thread from another thread (an event-fd
    /// write and a second `epoll_wait` a request).
    fn spawn<F, Fut>(&mut self, stream: TcpStream, serve: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let worker = &self.threads[self.next % self.threads.len()];
        self.next = self.next.wrapping_add(1);
        worker.accepted.inc();
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => return self.hand_off_failed(&e),
        };
        let failures = self.hand_off_failures.clone();
        // A stopped thread drops the connection with its runtime.
        drop(worker.handle.spawn(async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => serve(stream).await,
                Err(e) => hand_off_failed(&failures, &e),
            }
        }));
    }

    fn hand_off_failed(&self, e: &io::Error) {
        hand_off_failed(&self.hand_off_failures, e);
    }
}

/// Counts and logs a connection closed because it could not be moved to its serving thread.
fn hand_off_failed(failures: &Counter, e: &io::Error) {
    failures.inc();
    tracing::warn!(error = %e, "a connection could not be moved to its serving thread; closed");
}

impl Worker {
    /// Starts serving thread `i` and waits until its runtime is up.
    async fn start(i: usize, proxy: &Proxy) -> io::Result<Worker> {
        let (ready_tx, ready) = oneshot::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        // The log subscriber of the thread that starts the serving threads, which may be
        // scoped to it (the demo's is) rather than global: requests log there too.
        let dispatch = tracing::dispatcher::get_default(Clone::clone);
        thread::Builder::new()
            .name(format!("kvgate-serve-{i}"))
            .spawn(move || {
                let _logs = tracing::dispatcher::set_default(&dispatch);
                crate::proxy::set_serving_thread(i);
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(runtime.handle().clone()));
                // Until the stop switch is dropped; then the runtime, and every task on it,
                // goes.
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        let handle = ready
            .await
            .map_err(|_| io::Error::other("a serving thread ended while starting"))??;
        let accepted = proxy
            .metrics
            .connections
            .get_or_create(&WorkerLabels {
                worker: i.to_string(),
            })
            .clone();
        Ok(Worker {
            handle,
            _stop: stop,
            accepted,
        })
    }
}

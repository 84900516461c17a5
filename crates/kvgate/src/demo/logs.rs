//! Where the demo's router and simulator logs go: a file in the report directory, and with
//! `--verbose` the terminal too.
//!
//! The binary installs a global subscriber that writes to stderr before the demo starts.
//! The demo runs its routers and engines in-process on its own runtime, so it installs
//! [`DemoLog`]'s dispatcher as the default on every runtime thread (and on the thread that
//! drives the runtime); those threads then log only through it. Threads the runtime does
//! not own (the tokenizer pool) keep the global subscriber; they log nothing at INFO.

use std::{cell::RefCell, fs::File, path::Path, path::PathBuf, sync::Arc};

use anyhow::Context;
use tracing::{Dispatch, dispatcher::DefaultGuard};
use tracing_subscriber::{EnvFilter, fmt, layer::SubscriberExt};

thread_local! {
    /// The guard that keeps [`DemoLog`]'s dispatcher this thread's default.
    static GUARD: RefCell<Option<DefaultGuard>> = const { RefCell::new(None) };
}

/// The demo's log dispatcher and the file it writes.
#[derive(Debug, Clone)]
pub(crate) struct DemoLog {
    dispatch: Dispatch,
    /// The log file.
    pub(crate) path: PathBuf,
}

impl DemoLog {
    /// Creates (truncates) `dir/demo.log` and a dispatcher writing plain text lines there,
    /// and to stderr as well when `verbose`. The filter is `KVGATE_LOG`, else `info`.
    ///
    /// # Errors
    /// When the directory or the file cannot be created.
    pub(crate) fn create(dir: &Path, verbose: bool) -> anyhow::Result<DemoLog> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("demo.log");
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let filter =
            EnvFilter::try_from_env("KVGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
        let to_file = fmt::layer().with_ansi(false).with_writer(Arc::new(file));
        let to_terminal = verbose.then(|| fmt::layer().with_writer(std::io::stderr));
        let subscriber = tracing_subscriber::registry()
            .with(filter)
            .with(to_file)
            .with(to_terminal);
        Ok(DemoLog {
            dispatch: Dispatch::new(subscriber),
            path,
        })
    }

    /// Makes this log the calling thread's default until [`DemoLog::leave_thread`] (for
    /// the runtime's `on_thread_start`).
    pub(crate) fn enter_thread(&self) {
        let guard = tracing::dispatcher::set_default(&self.dispatch);
        GUARD.with(|g| *g.borrow_mut() = Some(guard));
    }

    /// Restores the calling thread's previous default (for `on_thread_stop`).
    pub(crate) fn leave_thread() {
        GUARD.with(|g| drop(g.borrow_mut().take()));
    }

    /// Runs `f` with this log as the calling thread's default.
    pub(crate) fn scope<T>(&self, f: impl FnOnce() -> T) -> T {
        tracing::dispatcher::with_default(&self.dispatch, f)
    }
}

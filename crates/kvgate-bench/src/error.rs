//! [`BenchError`]: everything that stops a benchmark before or after the load runs.
//!
//! Per-request failures (connect refused, HTTP 503, a broken stream) are not errors here:
//! they are data, recorded as [`ErrorKind`](crate::ErrorKind) on each request's record.

use std::path::PathBuf;

/// A failure that stops a benchmark (bad arguments, unreadable trace, failed cache reset,
/// unwritable report).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A command-line or API argument is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A target or reset URL does not parse as an `http://` URI.
    #[error("url {url}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file at fault.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A line of a replay trace is not valid.
    #[error("trace {}: line {line}: {reason}", path.display())]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// A tokenizer could not be loaded, or cannot build exact-length prompts.
    #[error("tokenizer {}: {reason}", path.display())]
    Tokenizer {
        /// The tokenizer directory.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The workload produced no requests.
    #[error("workload {0}: produces no requests")]
    EmptyWorkload(String),
    /// A `POST /reset_prefix_cache` failed; the comparison would be unfair, so the run stops.
    #[error("reset {url}: {reason}")]
    Reset {
        /// The reset URL.
        url: String,
        /// The status or transport error.
        reason: String,
    },
    /// JSON (de)serialization of a report failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// A plot could not be drawn.
    #[error("plot {name}: {reason}")]
    Plot {
        /// The chart's file name.
        name: String,
        /// The plotting backend's message.
        reason: String,
    },
}

impl BenchError {
    /// Wraps an I/O error with the path it concerns.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

//! Load generator and reporter for any OpenAI-compatible URL (`kvgate bench`).
//!
//! A seeded [`WorkloadSpec`] generates a [`Workload`] of pre-built chat-completions bodies,
//! grouped into multi-turn conversations. A [`Schedule`] (open-loop Poisson, closed-loop,
//! or a trace's own times) says when each conversation starts. [`run_load`] drives the
//! workload against a [`Target`] with a pooled, streaming [`LoadClient`] that measures
//! TTFT, inter-token latency, end-to-end latency and the engine-reported cached tokens of
//! every request. [`write_report`] turns named runs into JSON, markdown tables, SVG plots
//! and an HTML page. [`cli::run`] strings these together for the `kvgate bench` command,
//! including `--compare` (with cache resets) and `--overhead`.
//!
//! # Layout
//! - [`workload`]: [`WorkloadSpec`] and the generators [`SharedPrefix`], [`Agentic`],
//!   [`LowReuse`], [`Burst`], [`Replay`] (trace format documented there), [`Mooncake`]
//!   (a hash-block trace with synthesized prompts, in [`workload::mooncake`]).
//! - `schedule`: [`Arrival`] and [`Schedule`].
//! - `client`: [`LoadClient`], the SSE reader and the response probe.
//! - `record`: [`RequestRecord`] and [`ErrorKind`].
//! - `runner`: [`run_load`], [`Target`], [`LoadOptions`], [`History`], [`RunResult`].
//! - `summary`: [`RunSummary`] and [`Percentiles`].
//! - `oracle`: [`HitCeiling`] and [`ScopedCeiling`], the hit rate a hash-block trace allows
//!   at best.
//! - `compare`: [`Ratios`] and [`reset_caches`].
//! - `overhead`: [`Overhead`], the router's added latency.
//! - `report`: [`write_report`], [`NamedRun`], the plots and the HTML page.
//! - [`cli`]: [`BenchArgs`](cli::BenchArgs) and [`run`](cli::run).
//! - `text`: the deterministic generator and filler words.
//! - `error`: [`BenchError`].

pub mod cli;
mod client;
mod compare;
mod error;
mod oracle;
mod overhead;
mod record;
mod report;
mod runner;
mod schedule;
mod summary;
mod text;
pub mod workload;

pub use self::{
    client::{ClientOptions, Exchange, LoadClient, endpoint_uri},
    compare::{RESET_PATH, Ratios, reset_caches, reset_uri},
    error::BenchError,
    oracle::{HitCeiling, OracleHits, ScopedCeiling},
    overhead::{LatencyDelta, Overhead},
    record::{ErrorKind, RequestRecord},
    report::{
        NamedRun, ReportFiles, summary_markdown, summary_markdown_with, write_report,
        write_report_with,
    },
    runner::{History, LoadOptions, RunResult, Target, run_load},
    schedule::{Arrival, Schedule},
    summary::{Percentiles, RunSummary},
    workload::{
        Agentic, BodyOptions, Burst, CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, Conversation,
        LowReuse, Mooncake, Replay, SharedPrefix, Turn, Workload, WorkloadSpec,
    },
};

/// The result type of this crate's fallible operations.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

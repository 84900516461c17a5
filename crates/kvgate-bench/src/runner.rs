//! The runner: drives one workload against one target on a schedule.
//!
//! Open-loop schedules are dispatched from the calling task, which sleeps until each
//! conversation's start and spawns it; closed-loop schedules spawn C workers that take
//! conversations from a shared counter. Within a conversation, turns run one after
//! another. Every request is measured by the [`LoadClient`].

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{SystemTime, UNIX_EPOCH},
};

use http::Uri;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::{task::JoinSet, time::Instant};

use crate::{
    BenchError, ClientOptions, LoadClient, RequestRecord, RunSummary, Schedule, Workload,
    client::endpoint_uri,
};

/// A server to load: a name for reports and an `http://` base URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// The name in tables and plots.
    pub name: String,
    /// The base URL, such as `http://127.0.0.1:8080`; request paths are appended.
    pub url: String,
}

impl Target {
    /// A target with an explicit name.
    pub fn new(name: impl Into<String>, url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            url: url.into(),
        }
    }

    /// Parses `name=URL`, or a bare `URL` named after its `host:port`.
    ///
    /// # Errors
    /// [`BenchError::InvalidUrl`] when the URL is not a valid `http://` URL.
    pub fn parse(spec: &str) -> Result<Self, BenchError> {
        let (name, url) = match spec.split_once('=') {
            Some((name, url)) if !name.contains('/') && !name.is_empty() => (Some(name), url),
            _ => (None, spec),
        };
        let uri = endpoint_uri(url, "/")?;
        let name = match name {
            Some(name) => name.to_owned(),
            None => uri
                .authority()
                .map_or_else(|| url.to_owned(), ToString::to_string),
        };
        Ok(Self::new(name, url))
    }
}

/// What goes into a conversation's history between turns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum History {
    /// The deterministic placeholder answers of the pre-built bodies. Every target gets
    /// byte-identical requests, so runs compare exactly.
    #[default]
    Placeholder,
    /// The answer text the server actually returned (the placeholder when the turn
    /// failed). Realistic for engines that cache generated tokens, but requests then
    /// differ between targets. Scripted tool calls (agentic) stay scripted.
    Response,
}

/// Options of one run.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// The history mode of multi-turn conversations.
    pub history: History,
    /// Whether to draw a progress bar on stderr (it is hidden anyway when stderr is not a
    /// terminal).
    pub progress: bool,
    /// Options of the load client.
    pub client: ClientOptions,
}

/// The outcome of one run: every request's record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// The target that was loaded.
    pub target: Target,
    /// The workload's description.
    pub workload: String,
    /// Wall-clock start, in milliseconds since the Unix epoch.
    pub started_at_unix_ms: u64,
    /// One record per request, in index order.
    pub records: Vec<RequestRecord>,
}

impl RunResult {
    /// The run's summary.
    pub fn summary(&self) -> RunSummary {
        RunSummary::of(&self.records)
    }
}

/// Runs `workload` against `target` on `schedule`, with a fresh connection pool.
///
/// # Errors
/// [`BenchError::InvalidUrl`] when the target URL is bad; request failures are recorded,
/// not returned.
pub async fn run_load(
    target: &Target,
    schedule: &Schedule,
    workload: Arc<Workload>,
    options: &LoadOptions,
) -> Result<RunResult, BenchError> {
    let mut uris = HashMap::new();
    for c in &workload.conversations {
        if !uris.contains_key(&c.path) {
            uris.insert(c.path.clone(), endpoint_uri(&target.url, &c.path)?);
        }
    }
    let mut first_index = Vec::with_capacity(workload.conversations.len());
    let mut next = 0;
    for c in &workload.conversations {
        first_index.push(next);
        next += c.turns.len();
    }
    let progress = progress_bar(next as u64, &target.name, options.progress);
    let started_at_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let ctx = Arc::new(Ctx {
        client: LoadClient::new(&options.client)?,
        uris,
        first_index,
        workload: workload.clone(),
        history: options.history,
        start: Instant::now(),
        progress: progress.clone(),
    });

    let mut tasks = JoinSet::new();
    match schedule {
        Schedule::Open(offsets) => {
            if offsets.len() != workload.conversations.len() {
                return Err(BenchError::InvalidArgument(format!(
                    "schedule has {} arrivals for {} conversations",
                    offsets.len(),
                    workload.conversations.len()
                )));
            }
            let mut order: Vec<usize> = (0..offsets.len()).collect();
            order.sort_by_key(|&i| offsets[i]);
            for i in order {
                tokio::time::sleep_until(ctx.start + offsets[i]).await;
                let ctx = ctx.clone();
                tasks.spawn(async move { ctx.conversation(i).await });
            }
        }
        Schedule::Closed(workers) => {
            let counter = Arc::new(AtomicUsize::new(0));
            for _ in 0..*workers {
                let (ctx, counter) = (ctx.clone(), counter.clone());
                tasks.spawn(async move {
                    let mut records = Vec::new();
                    loop {
                        let i = counter.fetch_add(1, Ordering::Relaxed);
                        if i >= ctx.workload.conversations.len() {
                            break records;
                        }
                        records.extend(ctx.conversation(i).await);
                    }
                });
            }
        }
    }
    let mut records = Vec::with_capacity(next);
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(batch) => records.extend(batch),
            Err(e) => tracing::warn!(error = %e, "load task failed"),
        }
    }
    progress.finish_and_clear();
    records.sort_by_key(|r| r.index);
    Ok(RunResult {
        target: target.clone(),
        workload: workload.name.clone(),
        started_at_unix_ms,
        records,
    })
}

struct Ctx {
    client: LoadClient,
    uris: HashMap<Arc<str>, Uri>,
    first_index: Vec<usize>,
    workload: Arc<Workload>,
    history: History,
    start: Instant,
    progress: ProgressBar,
}

impl Ctx {
    async fn conversation(&self, i: usize) -> Vec<RequestRecord> {
        let conv = &self.workload.conversations[i];
        let Some(uri) = self.uris.get(&conv.path) else {
            return Vec::new();
        };
        let chat = conv
            .chat
            .as_ref()
            .filter(|_| self.history == History::Response);
        let mut messages = Vec::new();
        let mut records = Vec::with_capacity(conv.turns.len());
        for (k, turn) in conv.turns.iter().enumerate() {
            let body = match chat {
                Some(head) => {
                    messages.extend(turn.append.iter().cloned());
                    head.body(&messages)
                }
                None => turn.body.clone(),
            };
            let start_ms = self.start.elapsed().as_secs_f64() * 1000.0;
            let exchange = self.client.send(uri, body, chat.is_some()).await;
            if chat.is_some() {
                let answer = exchange.text.as_deref().filter(|_| exchange.record.is_ok());
                messages.push(turn.reply.message(answer));
            }
            records.push(RequestRecord {
                index: self.first_index[i] + k,
                conversation: i,
                turn: k,
                group: conv.group,
                start_ms,
                ..exchange.record
            });
            self.progress.inc(1);
        }
        records
    }
}

fn progress_bar(total: u64, name: &str, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, eta {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(name.to_owned());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_specs() {
        let cases = [
            (
                "named",
                "router=http://10.0.0.1:8080",
                Some(("router", "http://10.0.0.1:8080")),
            ),
            ("bare", "http://h:8000", Some(("h:8000", "http://h:8000"))),
            (
                "query with =",
                "http://h:1/x?a=b",
                Some(("h:1", "http://h:1/x?a=b")),
            ),
            ("https", "a=https://h", None),
            ("garbage", "a=b", None),
        ];
        for (name, spec, want) in cases {
            let got = Target::parse(spec).ok();
            let want = want.map(|(n, u)| Target::new(n, u));
            assert_eq!(got, want, "{name}");
        }
    }
}

//! The runner: drives one workload against one target on a schedule.
//!
//! Open-loop schedules are dispatched from the calling task, which sleeps until each
//! conversation's start and spawns it; closed-loop schedules spawn C workers that take
//! conversations from a shared counter, or, with [`LoadOptions::lockstep`], run in rounds
//! whose arrival order is fixed. Within a conversation, turns run one after another. Every
//! request is measured by the [`LoadClient`]; a target with several replica URLs gets
//! request `r` on replica `r mod n` (see [`Target`]).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{SystemTime, UNIX_EPOCH},
};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::{sync::oneshot, task::JoinSet, time::Instant};

use crate::{
    BenchError, ClientOptions, LoadClient, RequestRecord, RunSummary, Schedule, Workload,
    client::{ReplicaUris, endpoint_uri},
};

/// Separates the replica URLs of one target in a spec: `NAME=URL1,URL2`. A comma inside
/// a URL must be percent-encoded (`%2C`); base URLs (`http://host:port[/prefix]`) have none.
const REPLICA_SEPARATOR: char = ',';

/// A server to load: a name for reports and one or more `http://` base URLs.
///
/// With several URLs (replicas of one router, say), request number `r` of the workload
/// goes to replica `r mod n`: round-robin per request in workload order, so consecutive
/// turns of a conversation go to different replicas, independent of timing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// The name in tables and plots.
    pub name: String,
    /// The base URL, such as `http://127.0.0.1:8080`; request paths are appended. With
    /// replicas, this is the first one (model discovery asks it).
    pub url: String,
    /// The base URLs of the further replicas, after `url`; empty for a single server.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
}

impl Target {
    /// A target with an explicit name and one URL.
    pub fn new(name: impl Into<String>, url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            url: url.into(),
            replicas: Vec::new(),
        }
    }

    /// The same target with `urls` as further replicas after the current ones.
    #[must_use]
    pub fn with_replicas<I: IntoIterator<Item = S>, S: Into<String>>(mut self, urls: I) -> Self {
        self.replicas.extend(urls.into_iter().map(Into::into));
        self
    }

    /// Every base URL, `url` first.
    pub fn urls(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.url.as_str()).chain(self.replicas.iter().map(String::as_str))
    }

    /// Parses `NAME=URL`, or a bare `URL` named after its `host:port`. Several replicas
    /// are given as `NAME=URL1,URL2,…` (a comma inside a URL must be written `%2C`); a
    /// bare list is named after their `host:port`s joined by commas.
    ///
    /// # Errors
    /// [`BenchError::InvalidUrl`] when a URL is not a valid `http://` URL (an empty one
    /// included).
    pub fn parse(spec: &str) -> Result<Self, BenchError> {
        let (name, urls) = match spec.split_once('=') {
            Some((name, urls)) if !name.contains('/') && !name.is_empty() => (Some(name), urls),
            _ => (None, spec),
        };
        let urls: Vec<&str> = urls.split(REPLICA_SEPARATOR).collect();
        let mut hosts = Vec::with_capacity(urls.len());
        for url in &urls {
            let uri = endpoint_uri(url, "/")?;
            hosts.push(
                uri.authority()
                    .map_or_else(|| (*url).to_owned(), ToString::to_string),
            );
        }
        let name = name.map_or_else(|| hosts.join(","), str::to_owned);
        Ok(Self::new(name, urls[0]).with_replicas(urls[1..].iter().copied()))
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
    /// Closed-loop schedules only: run in lockstep rounds, for repeatable comparisons.
    /// Worker `w` takes conversations `w`, `w + C`, `w + 2C`, …; each round sends the next
    /// turn of every worker, one after another in worker order (each once the previous
    /// one's response head arrived, so the server sees them in that order), and the next
    /// round starts when the whole round has finished. The order of arrivals then depends
    /// on the workload alone, not on timing; the price is waiting for each round's
    /// slowest request.
    pub lockstep: bool,
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
    let uris = ReplicaUris::new(target, workload.conversations.iter().map(|c| &c.path))?;
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
        Schedule::Closed(workers) if options.lockstep => {
            let ctx = ctx.clone();
            let workers = *workers;
            tasks.spawn(async move { ctx.lockstep(workers).await });
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
    uris: ReplicaUris,
    first_index: Vec<usize>,
    workload: Arc<Workload>,
    history: History,
    start: Instant,
    progress: ProgressBar,
}

/// One conversation in progress: the next turn and, with [`History::Response`], the
/// messages so far.
struct Dialogue {
    conversation: usize,
    turn: usize,
    messages: Vec<serde_json::Value>,
}

impl Dialogue {
    fn new(conversation: usize) -> Self {
        Self {
            conversation,
            turn: 0,
            messages: Vec::new(),
        }
    }
}

impl Ctx {
    /// Every turn of conversation `i`, one after another.
    async fn conversation(&self, i: usize) -> Vec<RequestRecord> {
        let mut dialogue = Dialogue::new(i);
        let mut records = Vec::new();
        while let Some(record) = self.step(&mut dialogue, None).await {
            records.push(record);
        }
        records
    }

    /// Sends the dialogue's next turn, records it and moves on; `None` when no turn is
    /// left. `head` is signalled (or dropped) once the response head arrived or the
    /// request failed.
    async fn step(
        &self,
        d: &mut Dialogue,
        head: Option<oneshot::Sender<()>>,
    ) -> Option<RequestRecord> {
        let conv = &self.workload.conversations[d.conversation];
        let turn = conv.turns.get(d.turn)?;
        let index = self.first_index[d.conversation] + d.turn;
        let Some(uri) = self.uris.get(&conv.path, index) else {
            d.turn = conv.turns.len();
            return None;
        };
        let chat = conv
            .chat
            .as_ref()
            .filter(|_| self.history == History::Response);
        let body = match chat {
            Some(head) => {
                d.messages.extend(turn.append.iter().cloned());
                head.body(&d.messages)
            }
            None => turn.body.clone(),
        };
        let start_ms = self.start.elapsed().as_secs_f64() * 1000.0;
        let exchange = self
            .client
            .send_signalling(uri, body, chat.is_some(), head, Some(request_id(index)))
            .await;
        if chat.is_some() {
            let answer = exchange.text.as_deref().filter(|_| exchange.record.is_ok());
            d.messages.push(turn.reply.message(answer));
        }
        self.progress.inc(1);
        let record = RequestRecord {
            index,
            conversation: d.conversation,
            turn: d.turn,
            group: conv.group,
            start_ms,
            ..exchange.record
        };
        d.turn += 1;
        Some(record)
    }

    /// Whether the dialogue has a turn left to send.
    fn pending(&self, d: &Dialogue) -> bool {
        self.workload
            .conversations
            .get(d.conversation)
            .is_some_and(|c| d.turn < c.turns.len())
    }

    /// The closed loop in lockstep rounds (see [`LoadOptions::lockstep`]).
    async fn lockstep(self: Arc<Self>, workers: usize) -> Vec<RequestRecord> {
        let total = self.workload.conversations.len();
        let mut slots: Vec<Option<Dialogue>> = (0..workers.min(total))
            .map(|w| Some(Dialogue::new(w)))
            .collect();
        let mut records = Vec::new();
        loop {
            let mut round = JoinSet::new();
            for (w, slot) in slots.iter_mut().enumerate() {
                while let Some(d) = slot.take() {
                    if self.pending(&d) {
                        *slot = Some(d);
                        break;
                    }
                    let next = d.conversation + workers;
                    *slot = (next < total).then(|| Dialogue::new(next));
                }
                let Some(mut d) = slot.take() else {
                    continue;
                };
                let (head, arrived) = oneshot::channel();
                let ctx = self.clone();
                round.spawn(async move {
                    let record = ctx.step(&mut d, Some(head)).await;
                    (w, d, record)
                });
                let _ = arrived.await;
            }
            if round.is_empty() {
                break records;
            }
            while let Some(joined) = round.join_next().await {
                match joined {
                    Ok((w, d, record)) => {
                        records.extend(record);
                        slots[w] = Some(d);
                    }
                    Err(e) => tracing::warn!(error = %e, "load task failed"),
                }
            }
        }
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

/// The `x-request-id` of the workload's request `index` (`bench-INDEX`): a router's decision
/// log and the bench's records then join on it.
fn request_id(index: usize) -> http::HeaderValue {
    http::HeaderValue::try_from(format!("bench-{index}"))
        .unwrap_or_else(|_| http::HeaderValue::from_static("bench"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_specs() {
        /// (case, spec, the name and URLs it parses to).
        type Case = (
            &'static str,
            &'static str,
            Option<(&'static str, &'static [&'static str])>,
        );
        let cases: [Case; 9] = [
            (
                "named",
                "router=http://10.0.0.1:8080",
                Some(("router", &["http://10.0.0.1:8080"])),
            ),
            (
                "bare",
                "http://h:8000",
                Some(("h:8000", &["http://h:8000"])),
            ),
            (
                "query with =",
                "http://h:1/x?a=b",
                Some(("h:1", &["http://h:1/x?a=b"])),
            ),
            (
                "named replicas",
                "p=http://a:1,http://b:2/pre,http://c:3",
                Some(("p", &["http://a:1", "http://b:2/pre", "http://c:3"])),
            ),
            (
                "bare replicas",
                "http://a:1,http://b:2",
                Some(("a:1,b:2", &["http://a:1", "http://b:2"])),
            ),
            ("empty replica", "p=http://a:1,", None),
            ("replica without scheme", "p=http://a:1,b:2", None),
            ("https", "a=https://h", None),
            ("garbage", "a=b", None),
        ];
        for (name, spec, want) in cases {
            let got = Target::parse(spec).ok();
            let want = want
                .map(|(n, urls)| Target::new(n, urls[0]).with_replicas(urls[1..].iter().copied()));
            assert_eq!(got, want, "{name}");
            if let Some(got) = got {
                assert_eq!(got.urls().count(), want.map_or(0, |t| t.replicas.len() + 1));
            }
        }
    }

    #[test]
    fn a_single_target_serializes_as_before() {
        let json = serde_json::to_string(&Target::new("a", "http://a:1")).unwrap_or_default();
        assert_eq!(json, r#"{"name":"a","url":"http://a:1"}"#);
        let back: Result<Target, _> = serde_json::from_str(&json);
        assert_eq!(back.ok(), Some(Target::new("a", "http://a:1")));
    }
}

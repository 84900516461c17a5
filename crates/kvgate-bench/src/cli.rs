//! The `kvgate bench` command: [`BenchArgs`] and [`run`].
//!
//! ```text
//! kvgate bench --target http://127.0.0.1:8080 --workload shared-prefix --rate 20
//! kvgate bench --compare rr=http://r1:8080 precise=http://r2:8080 \
//!              --reset http://e1:8000 --reset http://e2:8000 --concurrency 32
//! kvgate bench --overhead --target engine=http://e:8000 --target router=http://r:8080 \
//!              --workload low-reuse --prompt-tokens 1500 --max-tokens 8 --rate 500
//! kvgate bench --target http://r:8080 --workload replay --trace trace.jsonl
//! kvgate bench --target http://r:8080 --workload mooncake --trace conversation_trace.jsonl \
//!              --window 10..20 --trace-speed 4 --max-output-tokens 64 --oracle-blocks 16384
//! kvgate bench --compare precise=http://r1:8080,http://r2:8080 rr=http://r3:8080
//! ```
//!
//! A target with several comma-separated URLs is one router run as replicas: the load
//! client sends request `r` of the workload to replica `r mod n` (see [`Target`]).

use std::{path::PathBuf, sync::Arc, time::Duration};

use http::Method;

use crate::{
    Agentic, Arrival, BenchError, BodyOptions, Burst, ClientOptions, History, HitCeiling,
    LoadClient, LoadOptions, LowReuse, Mooncake, NamedRun, Overhead, Replay, ReportFiles, Schedule,
    ScopedCeiling, SharedPrefix, Target, WorkloadSpec, client::endpoint_uri, compare::reset_caches,
    oracle::served_ceilings, report, run_load, workload::mooncake::TraceWindow,
};

/// The Qwen3 tokenizer bundled in the repository, the default of `--tokenizer`.
pub const BUNDLED_TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/tokenizers/qwen3"
);

/// Which workload generator to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Groups sharing a long system prompt, with multi-turn conversations.
    SharedPrefix,
    /// Long tool schemas and repeated tool-call rounds.
    Agentic,
    /// Unique prompts (the control case).
    LowReuse,
    /// Bursts of identical siblings arriving at once.
    Burst,
    /// Replay a JSONL trace (`--trace FILE`).
    Replay,
    /// Replay a Mooncake hash-block trace (`--trace FILE`) as `/v1/completions` requests
    /// with synthesized prompts of the trace's lengths and prefix sharing.
    Mooncake,
}

/// What goes into multi-turn histories.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HistoryArg {
    /// Deterministic placeholder answers: identical bytes for every target.
    #[default]
    Placeholder,
    /// The answers the server actually returned.
    Response,
}

/// Arguments of `kvgate bench`.
#[derive(Debug, Clone, clap::Args)]
#[allow(clippy::struct_excessive_bools)]
pub struct BenchArgs {
    /// A target to load, `NAME=URL` or `URL` (repeatable; several targets are compared).
    /// `NAME=URL1,URL2,…` names replicas: requests go round-robin across them.
    #[arg(long = "target", value_name = "[NAME=]URL[,URL…]")]
    pub targets: Vec<String>,
    /// Targets to compare, in order; ratios are against the first. Each may name
    /// replicas as `NAME=URL1,URL2,…`.
    #[arg(long, num_args = 1.., value_name = "[NAME=]URL[,URL…]")]
    pub compare: Vec<String>,
    /// Measure router overhead: exactly two targets, the engine first, then the router.
    #[arg(long)]
    pub overhead: bool,
    /// POST here before each run to drop an engine's prefix cache (repeatable); a bare
    /// `http://host:port` gets `/reset_prefix_cache`.
    #[arg(long = "reset", value_name = "URL")]
    pub reset: Vec<String>,
    /// The workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::SharedPrefix)]
    pub workload: WorkloadKind,
    /// The JSONL trace for `--workload replay` and `--workload mooncake`.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// mooncake: only requests whose timestamp falls in this window, in minutes of the
    /// trace (`10..20`, `10..`, `..5`); times are re-based to the window start.
    #[arg(long, value_name = "START..END")]
    pub window: Option<TraceWindow>,
    /// mooncake: only the first N requests (after the window).
    #[arg(long, value_name = "N")]
    pub max_requests: Option<usize>,
    /// mooncake: cap on each request's `output_length`; `max_tokens` is
    /// min(output_length, cap), at least 1 (`--max-tokens` does not apply).
    #[arg(long, value_name = "N")]
    pub max_output_tokens: Option<u32>,
    /// mooncake: the Hugging Face tokenizer directory (tokenizer.json or tokenizer.json.gz)
    /// prompts are sized with [default: the bundled Qwen3 tokenizer].
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// mooncake: the engine block size of the hit-rate oracles, in tokens.
    #[arg(long, default_value_t = 16)]
    pub oracle_block_size: usize,
    /// mooncake: also report the hit rate of one LRU cache of N blocks (the fleet's
    /// total KV blocks, say 4 engines × their blocks).
    #[arg(long, value_name = "N")]
    pub oracle_blocks: Option<usize>,
    /// Open loop: new conversations per second (Poisson arrivals).
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop: conversations in flight (default 8 when neither this nor --rate is
    /// given, except for a replay trace with timestamps, which replays its own times).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Replay speed factor for trace timestamps (inter-arrival times are divided by it).
    #[arg(long, default_value_t = 1.0)]
    pub trace_speed: f64,
    /// Seed of the workload and the arrival schedule.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The `model` field (default: the first id from the first target's `/v1/models`).
    #[arg(long)]
    pub model: Option<String>,
    /// The `max_tokens` field (mooncake uses each request's `output_length` instead).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Send `stream: false` (TTFT is then the time to the whole body).
    #[arg(long)]
    pub no_stream: bool,
    /// History of multi-turn conversations.
    #[arg(long, value_enum, default_value_t)]
    pub history: HistoryArg,
    /// Per-request timeout in milliseconds.
    #[arg(long, default_value_t = 120_000)]
    pub timeout_ms: u64,
    /// Bearer token for the targets.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Report directory.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// No progress bar and no tables on stdout.
    #[arg(long, short)]
    pub quiet: bool,

    /// shared-prefix: number of groups (distinct system prompts).
    #[arg(long, default_value_t = 4)]
    pub groups: u32,
    /// shared-prefix: conversations per group.
    #[arg(long, default_value_t = 8)]
    pub conversations_per_group: u32,
    /// shared-prefix: turns per conversation.
    #[arg(long, default_value_t = 3)]
    pub turns: u32,
    /// shared-prefix: system prompt length in words (≈ tokens).
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: u32,
    /// shared-prefix: user question length in words.
    #[arg(long, default_value_t = 32)]
    pub question_tokens: u32,
    /// shared-prefix: placeholder answer length in words.
    #[arg(long, default_value_t = 64)]
    pub answer_tokens: u32,
    /// agentic: number of agents.
    #[arg(long, default_value_t = 8)]
    pub agents: u32,
    /// agentic: tool-call rounds per agent.
    #[arg(long, default_value_t = 4)]
    pub rounds: u32,
    /// agentic: number of tools.
    #[arg(long, default_value_t = 12)]
    pub tools: u32,
    /// agentic: words per tool description.
    #[arg(long, default_value_t = 120)]
    pub tool_description_tokens: u32,
    /// agentic: words per task.
    #[arg(long, default_value_t = 48)]
    pub task_tokens: u32,
    /// agentic: words per tool result.
    #[arg(long, default_value_t = 160)]
    pub result_tokens: u32,
    /// low-reuse: number of requests.
    #[arg(long, default_value_t = 200)]
    pub requests: u32,
    /// low-reuse and burst: prompt length in words (≈ tokens).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: u32,
    /// burst: number of bursts.
    #[arg(long, default_value_t = 10)]
    pub bursts: u32,
    /// burst: identical siblings per burst.
    #[arg(long, default_value_t = 8)]
    pub siblings: u32,
}

impl BenchArgs {
    /// Parses `kvgate bench` flags, without the program name (tests, embedding).
    ///
    /// As with `SimArgs::from_flags` in `kvgate-sim`, a single-value flag given twice takes
    /// its last value; repeatable flags collect every value.
    ///
    /// # Errors
    /// [`BenchError::InvalidArgument`] with clap's message for an unknown flag, a malformed
    /// value or conflicting flags.
    pub fn from_flags<I, S>(flags: I) -> Result<BenchArgs, BenchError>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString>,
    {
        #[derive(clap::Parser)]
        #[command(name = "bench", args_override_self = true)]
        struct Wrap {
            #[command(flatten)]
            args: BenchArgs,
        }
        let argv = std::iter::once("bench".into()).chain(flags.into_iter().map(Into::into));
        <Wrap as clap::Parser>::try_parse_from(argv)
            .map(|w| w.args)
            .map_err(|e| BenchError::InvalidArgument(e.to_string().trim_end().to_owned()))
    }

    /// The workload spec these arguments describe.
    ///
    /// # Errors
    /// [`BenchError::InvalidArgument`] for `replay` or `mooncake` without `--trace`.
    pub fn workload_spec(&self) -> Result<WorkloadSpec, BenchError> {
        Ok(match self.workload {
            WorkloadKind::SharedPrefix => WorkloadSpec::SharedPrefix(SharedPrefix {
                groups: self.groups,
                conversations_per_group: self.conversations_per_group,
                turns: self.turns,
                system_tokens: self.system_tokens,
                question_tokens: self.question_tokens,
                answer_tokens: self.answer_tokens,
            }),
            WorkloadKind::Agentic => WorkloadSpec::Agentic(Agentic {
                agents: self.agents,
                rounds: self.rounds,
                tools: self.tools,
                tool_description_tokens: self.tool_description_tokens,
                task_tokens: self.task_tokens,
                result_tokens: self.result_tokens,
            }),
            WorkloadKind::LowReuse => WorkloadSpec::LowReuse(LowReuse {
                requests: self.requests,
                prompt_tokens: self.prompt_tokens,
            }),
            WorkloadKind::Burst => WorkloadSpec::Burst(Burst {
                bursts: self.bursts,
                siblings: self.siblings,
                prompt_tokens: self.prompt_tokens,
            }),
            WorkloadKind::Replay => WorkloadSpec::Replay(Replay {
                file: self.trace.clone().ok_or_else(|| {
                    BenchError::InvalidArgument("--workload replay needs --trace FILE".into())
                })?,
            }),
            WorkloadKind::Mooncake => WorkloadSpec::Mooncake(Mooncake {
                file: self.trace.clone().ok_or_else(|| {
                    BenchError::InvalidArgument("--workload mooncake needs --trace FILE".into())
                })?,
                window: self.window,
                max_requests: self.max_requests,
                max_output_tokens: self.max_output_tokens,
                tokenizer: self
                    .tokenizer
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(BUNDLED_TOKENIZER)),
            }),
        })
    }

    /// The targets, `--target`s first, then `--compare`.
    ///
    /// # Errors
    /// [`BenchError::InvalidUrl`] for a bad URL; [`BenchError::InvalidArgument`] when there
    /// is no target, or `--overhead` does not have exactly two.
    pub fn targets(&self) -> Result<Vec<Target>, BenchError> {
        let targets = self
            .targets
            .iter()
            .chain(&self.compare)
            .map(|t| Target::parse(t))
            .collect::<Result<Vec<_>, _>>()?;
        if targets.is_empty() {
            return Err(BenchError::InvalidArgument(
                "give at least one --target or --compare URL".into(),
            ));
        }
        if self.overhead && targets.len() != 2 {
            return Err(BenchError::InvalidArgument(format!(
                "--overhead needs exactly two targets (engine, then router), got {}",
                targets.len()
            )));
        }
        Ok(targets)
    }

    fn load_options(&self) -> LoadOptions {
        LoadOptions {
            history: match self.history {
                HistoryArg::Placeholder => History::Placeholder,
                HistoryArg::Response => History::Response,
            },
            progress: !self.quiet,
            client: ClientOptions {
                timeout: Duration::from_millis(self.timeout_ms),
                api_key: self.api_key.clone(),
            },
            lockstep: false,
        }
    }
}

/// What [`run`] produced.
#[derive(Debug, Clone)]
pub struct BenchOutcome {
    /// One run per target, in order.
    pub runs: Vec<NamedRun>,
    /// The overhead comparison, with `--overhead`.
    pub overhead: Option<Overhead>,
    /// The report files.
    pub files: ReportFiles,
    /// The hit-rate ceilings (mooncake): the whole trace's, then those over the requests
    /// of each run that did not serve them all.
    pub ceilings: Vec<ScopedCeiling>,
}

/// Runs `kvgate bench`: generates the workload, runs it against each target in turn
/// (resetting engine caches first), writes the report and prints the tables.
///
/// # Errors
/// Any [`BenchError`]: bad arguments, an unreadable trace, a failed cache reset, an
/// unwritable report. Failed requests are recorded, not errors.
pub async fn run(args: &BenchArgs) -> Result<BenchOutcome, BenchError> {
    let targets = args.targets()?;
    let options = args.load_options();
    let control = LoadClient::new(&options.client)?;
    let model = match &args.model {
        Some(model) => model.clone(),
        None => discover_model(&control, &targets[0]).await?,
    };
    let body = BodyOptions {
        model,
        max_tokens: args.max_tokens,
        stream: !args.no_stream,
    };
    let (workload, trace) = match args.workload_spec()? {
        WorkloadSpec::Mooncake(spec) => {
            let requests = spec.requests()?;
            (
                spec.generate_from(&requests, &body, args.seed)?,
                Some(requests),
            )
        }
        spec => (spec.generate(&body, args.seed)?, None),
    };
    let (block_size, lru_blocks) = (args.oracle_block_size, args.oracle_blocks);
    let mut ceilings = Vec::new();
    if let Some(trace) = &trace {
        ceilings.push(ScopedCeiling {
            scope: "trace".to_owned(),
            ceiling: HitCeiling::of(trace, block_size, lru_blocks)?,
        });
    }
    let workload = Arc::new(workload);
    let has_times = workload.conversations.iter().any(|c| c.at.is_some());
    let arrival = match (args.rate, args.concurrency) {
        (Some(rate), _) => Arrival::Poisson { rate },
        (None, Some(concurrency)) => Arrival::Closed { concurrency },
        (None, None) if has_times => Arrival::Trace {
            speed: args.trace_speed,
        },
        (None, None) => Arrival::Closed { concurrency: 8 },
    };
    let schedule = Schedule::build(arrival, &workload, args.seed)?;
    if !args.quiet {
        eprintln!(
            "workload {}: {} requests, {arrival:?}",
            workload.name,
            workload.request_count()
        );
        for c in &ceilings {
            eprintln!("trace hit-rate ceiling: {}", c.ceiling.describe());
        }
    }

    let mut runs = Vec::with_capacity(targets.len());
    for target in &targets {
        reset_caches(&control, &args.reset).await?;
        let result = run_load(target, &schedule, workload.clone(), &options).await?;
        runs.push(NamedRun::from_result(result));
    }
    let overhead = match (args.overhead, runs.as_slice()) {
        (true, [direct, routed]) => Some(Overhead::of(&direct.result, &routed.result)),
        _ => None,
    };
    if let Some(trace) = &trace {
        ceilings.extend(served_ceilings(trace, &runs, block_size, lru_blocks)?);
    }
    let extra = overhead.as_ref().map(Overhead::to_markdown);
    let files = report::write_report_with(&args.out, &runs, extra.as_deref(), &ceilings)?;
    if let Some(overhead) = &overhead {
        let path = args.out.join("overhead.json");
        let json = serde_json::to_string_pretty(overhead)?;
        std::fs::write(&path, json).map_err(|e| BenchError::io(path, e))?;
    }
    if !args.quiet {
        println!("{}", report::summary_markdown_with(&runs, &ceilings));
        if let Some(extra) = &extra {
            println!("{extra}");
        }
        println!("report: {}", files.html.display());
    }
    Ok(BenchOutcome {
        runs,
        overhead,
        files,
        ceilings,
    })
}

/// The first model id a target lists at `/v1/models`.
async fn discover_model(client: &LoadClient, target: &Target) -> Result<String, BenchError> {
    let uri = endpoint_uri(&target.url, "/v1/models")?;
    let fail = |reason: String| {
        BenchError::InvalidArgument(format!("no --model given and {uri}: {reason}"))
    };
    let (status, body) = client.simple(Method::GET, &uri).await.map_err(fail)?;
    if !(200..300).contains(&status) {
        return Err(fail(format!("status {status}")));
    }
    let models: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| fail(e.to_string()))?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| fail("lists no model".into()))
}

#[cfg(test)]
mod tests;

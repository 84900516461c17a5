//! `kvgate demo`: why precise routing matters, in about a minute.
//!
//! Starts a simulated fleet of 4 engines whose KV caches hold only a couple of system
//! prompts each (or uses the user's engines), then drives one seeded `shared-prefix`
//! workload through four routers in turn: round-robin, load-only, approximate prefix and
//! precise prefix + load. Engine caches are reset before each run. Prints hit rate, TTFT
//! and throughput side by side with ratios against round-robin, and writes an HTML report.
//!
//! Layout:
//! - `fleet`: the simulated fleet (or the user's engines);
//! - `policies`: the four scheduler profiles and an in-process router per policy;
//! - `table`: the terminal table and the plain-words summary.

mod fleet;
mod policies;
mod table;

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use kvgate_bench::{
    Arrival, BodyOptions, ClientOptions, LoadClient, LoadOptions, NamedRun, Schedule, SharedPrefix,
    Target, WorkloadSpec,
};

use self::{
    fleet::{Engines, SimShape},
    policies::{Policy, Router},
};

/// Flags of `kvgate demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Directory for the report (results.json, summary.md, SVG charts, index.html).
    #[arg(long, default_value = "demo-report")]
    out: PathBuf,

    /// Seed of the workload (same seed, same requests for every policy).
    #[arg(long, default_value_t = 7)]
    seed: u64,

    /// A smaller workload that finishes in a few seconds (for tests and smoke runs).
    #[arg(long)]
    quick: bool,

    /// Route to these engines instead of a simulated fleet (repeatable):
    /// `URL[,kv=tcp://HOST:PORT]`, as `kvgate serve --endpoint`.
    #[arg(long = "endpoint", value_name = "URL[,kv=…]")]
    endpoints: Vec<String>,

    /// With --endpoint: URL to POST before each run to drop an engine's prefix cache
    /// (repeatable; a bare `http://host:port` gets `/reset_prefix_cache`). Without it,
    /// later runs may start with warm caches.
    #[arg(long = "reset", value_name = "URL")]
    reset: Vec<String>,

    /// Model name sent in requests (and served by the simulated fleet).
    #[arg(long, default_value = "Qwen/Qwen3-0.6B")]
    model: String,
}

/// The workload and load shape of one demo size.
struct Plan {
    workload: SharedPrefix,
    concurrency: usize,
    max_tokens: u32,
    sim: SimShape,
}

impl Plan {
    /// Eight groups whose system prompts (128 blocks each) fit two per engine, so only
    /// a router that keeps each group on one engine avoids evicting them.
    fn new(quick: bool) -> Plan {
        let sim = SimShape {
            gpu_blocks: 320,
            prefill_tokens_per_s: 10_000.0,
            prefill_base_ms: 5.0,
            itl_ms: 5.0,
        };
        let workload = SharedPrefix {
            groups: 8,
            conversations_per_group: if quick { 2 } else { 9 },
            turns: 3,
            system_tokens: 2048,
            question_tokens: 32,
            answer_tokens: 32,
        };
        Plan {
            workload,
            concurrency: 8,
            max_tokens: 16,
            sim,
        }
    }
}

pub(crate) fn main(args: DemoArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let plan = Plan::new(args.quick);
    let engines = if args.endpoints.is_empty() {
        Engines::simulated(&args.model, plan.sim).await?
    } else {
        Engines::external(&args.model, args.endpoints.clone(), args.reset.clone())
    };
    let result = compare(&args, &plan, &engines).await;
    engines.shutdown().await;
    let runs = result?;

    let summaries: Vec<_> = runs.iter().map(|r| r.result.summary()).collect();
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let printed = table::render(&names, &summaries);
    println!("{printed}");
    let extra = format!("### In plain words\n\n```\n{printed}\n```\n");
    let files = kvgate_bench::write_report(&args.out, &runs, Some(&extra))
        .with_context(|| format!("writing the report to {}", args.out.display()))?;
    println!("report: {}", files.html.display());
    Ok(())
}

/// Runs the workload through every policy, resetting the engines' caches before each.
async fn compare(args: &DemoArgs, plan: &Plan, engines: &Engines) -> anyhow::Result<Vec<NamedRun>> {
    let body = BodyOptions {
        model: args.model.clone(),
        max_tokens: plan.max_tokens,
        stream: true,
    };
    let workload =
        Arc::new(WorkloadSpec::SharedPrefix(plan.workload.clone()).generate(&body, args.seed)?);
    let schedule = Schedule::build(
        Arrival::Closed {
            concurrency: plan.concurrency,
        },
        &workload,
        args.seed,
    )?;
    let options = LoadOptions {
        progress: false,
        ..LoadOptions::default()
    };
    let client = LoadClient::new(&ClientOptions::default())?;
    eprintln!(
        "kvgate demo: {} requests of {} per policy, {} at a time",
        workload.request_count(),
        workload.name,
        plan.concurrency
    );
    let mut runs = Vec::with_capacity(Policy::ALL.len());
    for policy in Policy::ALL {
        kvgate_bench::reset_caches(&client, &engines.reset).await?;
        let router = Router::start(
            policy,
            engines.yaml(policy.uses_kv_events()),
            &engines.flags(policy.uses_kv_events()),
            Duration::from_secs(15),
        )
        .await?;
        let target = Target::new(policy.name(), router.url.clone());
        let result = kvgate_bench::run_load(&target, &schedule, workload.clone(), &options).await;
        router.stop().await?;
        let result = result?;
        let summary = result.summary();
        eprintln!(
            "  {:<15} done in {:.1} s ({} errors)",
            policy.name(),
            summary.duration_s,
            summary.errors
        );
        if summary.errors == summary.requests {
            anyhow::bail!(
                "every request through {} failed: {:?}",
                policy.name(),
                summary.errors_by_kind
            );
        }
        runs.push(NamedRun {
            name: policy.name().to_owned(),
            result,
        });
    }
    Ok(runs)
}

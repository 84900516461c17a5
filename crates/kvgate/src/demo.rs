//! `kvgate demo`: why precise routing matters, in about a minute.
//!
//! Starts a simulated fleet of 4 engines whose KV caches hold only a couple of system
//! prompts each (or uses the user's engines), then drives one seeded `shared-prefix`
//! workload through each [`Setup`] in turn: round-robin, approximate prefix and precise
//! prefix behind one router each, then approximate and precise prefix behind two router
//! replicas each, with the load client alternating between the replicas per request (the
//! replicas share their in-flight load; only precise ones share what the engines cache).
//! Engine caches are reset before each run. Shows a progress bar per run, then prints hit
//! rate, TTFT and throughput side by side with ratios against round-robin and what the
//! replica runs show, and writes an HTML report. Router and engine logs go to `demo.log`
//! in the report directory (and to the terminal with `--verbose`).
//!
//! Layout:
//! - `fleet`: the simulated fleet (or the user's engines);
//! - `policies`: the scheduler profiles, the setups, an in-process router per replica;
//! - `logs`: the log file;
//! - `table`: the terminal table and the plain-words summary.

mod fleet;
mod logs;
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
    logs::DemoLog,
    policies::{Router, Setup},
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

    /// Also show the router and engine logs on the terminal (they always go to
    /// `demo.log` in the report directory); replaces the progress bars.
    #[arg(long, short)]
    verbose: bool,
}

/// The workload and load shape of one demo size.
struct Plan {
    workload: SharedPrefix,
    /// Conversations in flight, driven in lockstep rounds
    /// ([`LoadOptions::lockstep`]) so every run sends the same requests in the same order.
    concurrency: usize,
    max_tokens: u32,
    sim: SimShape,
}

impl Plan {
    /// Eight groups whose system prompts (128 blocks each) fit two per engine, so only
    /// a router that keeps each group on one engine avoids evicting them. Seven
    /// conversations in flight: with eight, worker `w` would only ever carry group `w`, and
    /// round-robin over 4 engines would pin it to engine `w mod 4`, a perfect placement.
    /// The blocks are 16 tokens, not the simulator's default of 32: this is the fleet shape
    /// BENCHMARKS.md measures the demo (and `scripts/peers.sh`) on.
    fn new(quick: bool) -> Plan {
        let sim = SimShape {
            gpu_blocks: 320,
            block_size: 16,
            prefill_tokens_per_s: 10_000.0,
            prefill_base_ms: 5.0,
            itl_ms: 5.0,
        };
        let workload = SharedPrefix {
            groups: 8,
            conversations_per_group: if quick { 2 } else { 7 },
            turns: 3,
            system_tokens: 2048,
            question_tokens: 32,
            answer_tokens: 32,
        };
        Plan {
            workload,
            concurrency: 7,
            max_tokens: 16,
            sim,
        }
    }
}

pub(crate) fn main(args: DemoArgs) -> anyhow::Result<()> {
    let log = DemoLog::create(&args.out, args.verbose)?;
    let on_start = log.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(move || on_start.enter_thread())
        .on_thread_stop(DemoLog::leave_thread)
        .build()
        .context("starting the async runtime")?;
    log.scope(|| runtime.block_on(run(args, &log)))
}

async fn run(args: DemoArgs, log: &DemoLog) -> anyhow::Result<()> {
    let plan = Plan::new(args.quick);
    let engines = if args.endpoints.is_empty() {
        Engines::simulated(&args.model, plan.sim).await?
    } else {
        Engines::external(&args.model, args.endpoints.clone(), args.reset.clone())
    };
    let result = compare(&args, &plan, &engines).await;
    engines.shutdown().await;
    let runs = result?;

    let summaries: Vec<_> = runs.iter().map(|(_, r)| r.result.summary()).collect();
    let setups: Vec<Setup> = runs.iter().map(|(s, _)| *s).collect();
    let printed = table::render(&setups, &summaries);
    println!("\n{printed}");
    let extra = format!("### In plain words\n\n```\n{printed}\n```\n");
    let runs: Vec<NamedRun> = runs.into_iter().map(|(_, r)| r).collect();
    let files = kvgate_bench::write_report(&args.out, &runs, Some(&extra))
        .with_context(|| format!("writing the report to {}", args.out.display()))?;
    println!("report: {}", files.html.display());
    println!("logs:   {}", log.path.display());
    Ok(())
}

/// Runs the workload through every setup, resetting the engines' caches before each.
async fn compare(
    args: &DemoArgs,
    plan: &Plan,
    engines: &Engines,
) -> anyhow::Result<Vec<(Setup, NamedRun)>> {
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
        progress: !args.verbose,
        lockstep: true,
        ..LoadOptions::default()
    };
    let client = LoadClient::new(&ClientOptions::default())?;
    let w = &plan.workload;
    eprintln!(
        "kvgate demo: {} requests per run ({} groups × {} conversations × {} turns, one \
         {}-token system prompt per group),\n{} conversations at a time in lockstep rounds",
        workload.request_count(),
        w.groups,
        w.conversations_per_group,
        w.turns,
        w.system_tokens,
        plan.concurrency,
    );
    let mut runs = Vec::with_capacity(Setup::ALL.len());
    for setup in Setup::ALL {
        let name = setup.name();
        kvgate_bench::reset_caches(&client, &engines.reset).await?;
        let events = setup.policy.uses_kv_events();
        let mut routers = Vec::with_capacity(setup.replicas);
        // Replicas share their in-flight load, as `kvgate serve --replica-peer` does.
        let sync_addrs = if setup.replicas > 1 {
            loopback_zmq_addrs(setup.replicas)?
        } else {
            Vec::new()
        };
        for i in 0..setup.replicas {
            let sync = sync_addrs
                .get(i)
                .map(|listen| kvgate_replica::ReplicaSyncConfig::new(listen, sync_addrs.clone()));
            let started = Router::start(
                setup.policy,
                engines.yaml(events),
                &engines.flags(events),
                sync,
                Duration::from_secs(15),
            )
            .await;
            match started {
                Ok(router) => routers.push(router),
                Err(e) => {
                    stop_all(routers).await?;
                    return Err(e);
                }
            }
        }
        // Synced replicas start routing once each hears all the others (a replica joined
        // half-way would route the first wave without the others' picks).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while routers.len() > 1
            && routers.iter().any(|r| r.peers_heard() + 1 < routers.len())
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let urls: Vec<String> = routers.iter().map(|r| r.url.clone()).collect();
        let target = Target::new(name.clone(), urls[0].clone()).with_replicas(&urls[1..]);
        let result = kvgate_bench::run_load(&target, &schedule, workload.clone(), &options).await;
        stop_all(routers).await?;
        let result = result?;
        let summary = result.summary();
        eprintln!(
            "  {name:<17} done in {:.1} s, hit rate {}, {} errors",
            summary.duration_s,
            summary
                .hit_rate
                .map_or_else(|| "n/a".to_owned(), |h| format!("{:.1}%", h * 100.0)),
            summary.errors
        );
        if summary.errors == summary.requests {
            anyhow::bail!(
                "every request through {name} failed: {:?}",
                summary.errors_by_kind
            );
        }
        runs.push((setup, NamedRun { name, result }));
    }
    Ok(runs)
}

/// `n` free loopback `tcp://` addresses (ports the OS handed out and released).
fn loopback_zmq_addrs(n: usize) -> anyhow::Result<Vec<String>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    listeners
        .iter()
        .map(|l| Ok(format!("tcp://{}", l.local_addr()?)))
        .collect()
}

/// Stops every router, reporting the first failure.
async fn stop_all(routers: Vec<Router>) -> anyhow::Result<()> {
    let mut first = Ok(());
    for router in routers {
        let stopped = router.stop().await;
        if first.is_ok() {
            first = stopped;
        }
    }
    first
}

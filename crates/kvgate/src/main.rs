//! `kvgate`: the command-line entry point. Parses flags, sets up logging, and hands off to
//! the library crates.

use std::io::IsTerminal;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};

/// The allocator: the proxy path allocates and frees many small buffers a request, across
/// threads; mimalloc's per-thread free lists cost fewer instructions than glibc's bins.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod demo;
mod doctor;
mod epp;
mod logging;
mod serve;

/// KV-cache-aware LLM inference router.
#[derive(Debug, Parser)]
#[command(name = "kvgate", version, about)]
struct Cli {
    /// Log line format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "KVGATE_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the router in front of engine endpoints.
    Serve(serve::ServeArgs),
    /// Run as an Envoy ext_proc endpoint picker (Gateway API Inference Extension EPP).
    Epp(epp::EppArgs),
    /// Show precise routing against round-robin on a local simulated fleet.
    Demo(demo::DemoArgs),
    /// Run simulated vLLM engines (OpenAI API, Anthropic /v1/messages, prefix cache, KV events,
    /// /render, /metrics).
    Sim(kvgate_sim::SimArgs),
    /// Load-test any OpenAI-compatible URL; compare targets side by side.
    Bench(kvgate_bench::cli::BenchArgs),
    /// Print the prompt token ids of a request read from stdin (local tokenizer).
    Tokenize(kvgate_tokenize::cli::TokenizeArgs),
    /// Compare local tokenization with a live vLLM `/render` (or the goldens) over a corpus.
    Parity(kvgate_tokenize::cli::ParityArgs),
    /// Check engines for precise routing: models, KV cache, KV events, replay, tokenization.
    Doctor(doctor::DoctorArgs),
}

/// Logs to stderr at `KVGATE_LOG` (default `info`: one line a request), in batches
/// ([`logging`]). Lines still buffered are written when the returned guard is dropped, and
/// before a panic's message.
fn init_logging(format: LogFormat) -> anyhow::Result<logging::LogGuard> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a log redirected to a file or a collector stays plain text.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let (writer, guard) = logging::BatchedLog::new(std::io::stderr(), logging::FLUSH_EVERY)
        .context("starting the log thread")?;
    let before = writer.clone();
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |panic| {
        before.flush();
        report(panic);
    }));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    match format {
        // The same lines as the default formatter's, with less work each (logging::text).
        LogFormat::Text if !ansi => builder
            .fmt_fields(logging::text::PlainFields)
            .event_format(logging::text::PlainText::new())
            .init(),
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
    Ok(guard)
}

fn sim_main(args: kvgate_sim::SimArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(kvgate_sim::run(args, serve::shutdown_signal()))?;
    Ok(())
}

fn bench_main(args: &kvgate_bench::cli::BenchArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(kvgate_bench::cli::run(args))?;
    Ok(())
}

fn tokenize_main(args: &kvgate_tokenize::cli::TokenizeArgs) -> anyhow::Result<()> {
    kvgate_tokenize::cli::run_tokenize(
        args,
        &mut std::io::stdin().lock(),
        &mut std::io::stdout().lock(),
    )?;
    Ok(())
}

fn parity_main(args: &kvgate_tokenize::cli::ParityArgs) -> std::process::ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvgate: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(kvgate_tokenize::cli::run_parity(
        args,
        &mut std::io::stdout().lock(),
    ));
    match result {
        Ok(summary) => {
            println!(
                "{} cases, {} divergences, {} errors",
                summary.cases, summary.divergences, summary.errors
            );
            std::process::ExitCode::from(u8::try_from(summary.exit_code()).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("kvgate: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Exit 0 when every engine is ready for precise routing, 1 otherwise (2 on a usage error).
fn doctor_main(args: &doctor::DoctorArgs) -> std::process::ExitCode {
    match doctor::main(args) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kvgate: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let log = match init_logging(cli.log_format) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("kvgate: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Serve(args) => serve::main(args),
        Command::Epp(args) => epp::main(args),
        Command::Demo(args) => demo::main(args),
        Command::Bench(args) => bench_main(&args),
        Command::Sim(args) => sim_main(args),
        Command::Tokenize(args) => tokenize_main(&args),
        Command::Parity(args) => return parity_main(&args),
        Command::Doctor(args) => return doctor_main(&args),
    };
    // The log's last lines before the error below.
    drop(log);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvgate: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

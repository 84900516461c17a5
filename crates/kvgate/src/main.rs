//! `kvgate`: the command-line entry point. Parses flags, sets up logging, and hands off to
//! the library crates.

use clap::{Parser, Subcommand, ValueEnum};

mod demo;
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
    /// Show precise routing against round-robin on a local simulated fleet.
    Demo(demo::DemoArgs),
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .init(),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let result = match cli.command {
        Command::Serve(args) => serve::main(args),
        Command::Demo(args) => demo::main(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvgate: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

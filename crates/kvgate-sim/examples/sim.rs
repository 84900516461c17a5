//! Runs the simulator standalone (until `kvgate sim` is wired into the binary).
//!
//! Run with: `cargo run -p kvgate-sim --example sim -- --port 8000 --kv-events-endpoint tcp://*:5557`

use clap::Parser;

#[derive(Parser)]
#[command(name = "sim", about = "vLLM-faithful engine simulator")]
struct Cli {
    #[command(flatten)]
    args: kvgate_sim::SimArgs,
}

#[tokio::main]
async fn main() -> Result<(), kvgate_sim::SimError> {
    let cli = Cli::parse();
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    kvgate_sim::run(cli.args, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}

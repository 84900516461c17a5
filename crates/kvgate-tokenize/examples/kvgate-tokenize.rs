//! Stand-in for the `kvgate tokenize` / `kvgate parity` subcommands until the binary wires
//! `kvgate_tokenize::cli`: `cargo run -p kvgate-tokenize --example kvgate-tokenize -- parity ...`.

use clap::{Parser, Subcommand};
use kvgate_tokenize::cli::{self, ParityArgs, TokenizeArgs};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Tokenize the request on stdin with the local backend.
    Tokenize(TokenizeArgs),
    /// Compare local tokenization with a live render server or the goldens.
    Parity(ParityArgs),
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let code = match Cli::parse().cmd {
        Cmd::Tokenize(args) => {
            match cli::run_tokenize(&args, &mut std::io::stdin(), &mut std::io::stdout()) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("error: {e}: {:?}", std::error::Error::source(&e));
                    1
                }
            }
        }
        Cmd::Parity(args) => match cli::run_parity(&args, &mut std::io::stdout()).await {
            Ok(summary) => summary.exit_code(),
            Err(e) => {
                eprintln!("error: {e}: {:?}", std::error::Error::source(&e));
                2
            }
        },
    };
    std::process::exit(code);
}

//! `kvgate demo`: not built yet; says what it will do and exits non-zero.

/// Flags of `kvgate demo` (none yet).
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {}

pub(crate) fn main(_args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "the demo is not built yet. When it is, `kvgate demo` will start a simulated fleet of 4 \
         engines with small KV caches, drive a shared-prefix workload through round-robin, \
         load-only, approximate-prefix and precise-prefix routing, and print hit rate, TTFT and \
         throughput side by side. Today you can run `kvgate serve --endpoint URL` in front of \
         vLLM or SGLang engines."
    )
}

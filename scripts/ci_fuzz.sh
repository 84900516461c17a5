#!/usr/bin/env bash
# CI fuzz step (issue #11): builds the cargo-fuzz targets in fuzz/ and runs each for a fixed
# short time over its committed corpus (fuzz/corpus/<target>) and its past crashes
# (fuzz/regressions/<target>, replayed first). New corpus entries go to a scratch dir, so the
# committed corpus is never rewritten. A crash fails the step; the input is in
# fuzz/artifacts/<target>/ (copy it to fuzz/regressions/<target>/ once fixed).
#
# SKIPS (exit 0, with a message) when nightly or cargo-fuzz cannot be installed.
# By default only the targets that need neither kvgate-proxy nor kvgate-tokenize are built
# (their dependency tree is most of the build time): request_parse, kv_event_decode,
# prom_parse, sse_stream, and yaml_config without the `kvgate.yaml` half. FUZZ_FULL=1 builds
# and runs all six (chat_normalize, full yaml_config).
# The targets are built unoptimized (`--dev`): measured on 2 cores, the release build took
# 5m25s against 2m01s (plus ~2.5 min to install cargo-fuzz), which does not fit the step's
# ~8 min; a dev build runs 10-20x fewer exec/s, enough to replay the corpus and regressions
# and smoke-fuzz. FUZZ_RELEASE=1 builds optimized (what the 10-minute runs used).
# Env: FUZZ_SECONDS (per target, default 30), FUZZ_JOBS (targets at once, default 2),
#      FUZZ_FULL (0/1, default 0), FUZZ_RELEASE (0/1, default 0),
#      FUZZ_TARGETS (space-separated subset).
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${FUZZ_SECONDS:-30}"
jobs="${FUZZ_JOBS:-2}"
skip() { echo "ci_fuzz: SKIP: $*"; exit 0; }

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "ci_fuzz: installing the nightly toolchain"
    rustup toolchain install nightly --profile minimal >/dev/null 2>&1 \
        || skip "no nightly toolchain and 'rustup toolchain install nightly' failed"
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "ci_fuzz: installing cargo-fuzz (about 2-3 min)"
    start=$SECONDS
    cargo install cargo-fuzz --locked >/dev/null 2>&1 || skip "'cargo install cargo-fuzz' failed"
    echo "ci_fuzz: cargo-fuzz installed in $((SECONDS - start)) s"
fi
echo "ci_fuzz: $(cargo +nightly --version), $(cargo +nightly fuzz --version)"

cd fuzz
# No sanitizer: every kvgate crate forbids `unsafe`, and ASan roughly halves throughput.
# Debug assertions (-a) turn integer overflow into a crash.
flags=(-s none -a)
if [ "${FUZZ_RELEASE:-0}" != 1 ]; then
    flags+=(--dev)
fi
if [ "${FUZZ_FULL:-0}" = 1 ]; then
    default_targets="$(cargo +nightly fuzz list)"
else
    flags+=(--no-default-features)
    default_targets="request_parse kv_event_decode prom_parse sse_stream yaml_config"
fi
start=$SECONDS
cargo +nightly fuzz build "${flags[@]}"
echo "ci_fuzz: targets built in $((SECONDS - start)) s"

targets="${FUZZ_TARGETS:-$default_targets}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

run_one() {
    local t="$1" log="$scratch/$1.log"
    mkdir -p "$scratch/$t" "corpus/$t" "regressions/$t" "artifacts/$t"
    if cargo +nightly fuzz run "${flags[@]}" "$t" "$scratch/$t" "regressions/$t" "corpus/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1; then
        echo "ci_fuzz: $t ok: $(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') runs," \
            "$(grep -E '^stat::average_exec_per_sec' "$log" | awk '{print $2}') exec/s"
    else
        echo "ci_fuzz: $t FAILED; last lines of its log:"
        tail -n 60 "$log"
        ls "artifacts/$t"
        return 1
    fi
}

failed=0
pids=()
names=()
for t in $targets; do
    run_one "$t" &
    pids+=("$!")
    names+=("$t")
    if [ "${#pids[@]}" -ge "$jobs" ]; then
        wait "${pids[0]}" || failed=1
        pids=("${pids[@]:1}")
        names=("${names[@]:1}")
    fi
done
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
if [ "$failed" -ne 0 ]; then
    echo "ci_fuzz: a fuzz target failed (inputs under fuzz/artifacts/)"
    exit 1
fi
echo "ci_fuzz: every target ran ${secs} s without a crash"

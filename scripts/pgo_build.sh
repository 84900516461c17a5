#!/usr/bin/env bash
# A profile-guided (PGO) release build of kvgate: an instrumented build runs a training load,
# and the release build is then optimized with the profile it wrote (hot code laid out
# together, inlining and branch layout by measured counts). The binary is the plain
# release build's code, only compiled differently; BENCHMARKS.md has what it changes.
#
# Training, all on loopback with the instrumented binary:
#   1. `kvgate demo --quick`: a simulated fleet with KV events; precise, approximate and
#      round-robin routing; the local tokenizer; streamed chats.
#   2. `kvgate serve` (load routing and, separately, the local tokenizer) in front of
#      `kvgate sim --instances 2`, loaded by `kvgate bench` with streamed and non-streamed
#      chats: the standalone server path (serving threads, upstream pool, response accounting).
#
# Usage: scripts/pgo_build.sh [--out FILE]     (default: target/release-pgo/kvgate)
# Needs llvm-profdata of the LLVM major version rustc uses (`rustc -vV`): from rustup
# (`rustup component add llvm-tools`) or from the distribution (Debian: `apt-get install
# llvm-NN`, for `/usr/lib/llvm-NN/bin/llvm-profdata`). Builds twice, in target/pgo-gen and
# target/pgo-use (about 12 and 20 minutes on 2 cores from scratch).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

OUT=target/release-pgo/kvgate
while (($#)); do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "pgo_build: unknown argument $1" >&2; exit 2 ;;
  esac
done

die() { echo "pgo_build: $*" >&2; exit 1; }

major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
[[ -n $major ]] || die "could not read rustc's LLVM version from 'rustc -vV'"
profdata=""
sysroot=$(rustc --print sysroot)
for c in "$sysroot"/lib/rustlib/*/bin/llvm-profdata "llvm-profdata-$major" \
  "/usr/lib/llvm-$major/bin/llvm-profdata" llvm-profdata; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if "$p" merge --version 2>/dev/null | grep -q "LLVM version $major\."; then profdata=$p; break; fi
done
[[ -n $profdata ]] || die "no llvm-profdata of LLVM $major (rustup component add llvm-tools, or apt-get install llvm-$major)"

WORK=target/pgo-work
rm -rf "$WORK"; mkdir -p "$WORK/raw"
RAW=$(cd "$WORK/raw" && pwd)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== instrumented build (target/pgo-gen)"
# Instrumentation is placed before inlining, so the cheaper codegen settings here do not
# change what the profile describes.
RUSTFLAGS="-Cprofile-generate=$RAW" CARGO_PROFILE_RELEASE_LTO=off \
  CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
  cargo build --release -p kvgate --target-dir target/pgo-gen
GEN=target/pgo-gen/release/kvgate

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
wait_http() { # URL PID WHAT
  local i
  for ((i = 0; i < 600; i++)); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || die "$3 exited (logs in $WORK)"
    sleep 0.1
  done
  die "$3 did not answer at $1"
}

echo "== training 1/2: kvgate demo --quick"
"$GEN" demo --quick --out "$WORK/demo" >"$WORK/demo.log" 2>&1 || die "demo failed (see $WORK/demo.log)"

echo "== training 2/2: kvgate serve in front of kvgate sim, loaded by kvgate bench"
model=Qwen/Qwen3-0.6B
sim=$(free_port); sim2=$(free_port)
"$GEN" sim --instances 1 --host 127.0.0.1 --port "$sim" --no-kv-events --itl-ms 1 \
  --model "$model" >"$WORK/sim.log" 2>&1 &
PIDS+=($!); wait_http "http://127.0.0.1:$sim/v1/models" "${PIDS[-1]}" "kvgate sim"
"$GEN" sim --instances 1 --host 127.0.0.1 --port "$sim2" --no-kv-events --itl-ms 1 \
  --model "$model" >"$WORK/sim2.log" 2>&1 &
PIDS+=($!); wait_http "http://127.0.0.1:$sim2/v1/models" "${PIDS[-1]}" "kvgate sim"
for mode in load tokenizer; do
  port=$(free_port); admin=$(free_port)
  extra=()
  [[ $mode == tokenizer ]] && extra=(--tokenizer "$model=testdata/tokenizers/qwen3")
  KVGATE_LOG=warn "$GEN" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
    --endpoint "http://127.0.0.1:$sim" --endpoint "http://127.0.0.1:$sim2" "${extra[@]}" \
    >"$WORK/serve-$mode.log" 2>&1 &
  PIDS+=($!); wait_http "http://127.0.0.1:$admin/ready" "${PIDS[-1]}" "kvgate serve ($mode)"
  for stream in --no-stream ""; do
    for wl in shared-prefix agentic; do
      # shellcheck disable=SC2086 # $stream is empty or one flag
      "$GEN" bench --target "http://127.0.0.1:$port" --workload "$wl" --concurrency 16 \
        --max-tokens 8 $stream --model "$model" --out "$WORK/bench-$mode-$wl${stream}" \
        >>"$WORK/bench.log" 2>&1 || die "bench $wl $mode $stream failed (see $WORK/bench.log)"
    done
  done
  # A clean exit writes the serving process's profile.
  kill -INT "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true
  unset 'PIDS[-1]'
done
cleanup; PIDS=()

"$profdata" merge -o "$WORK/kvgate.profdata" "$RAW"
echo "profile: $(find "$RAW" -name '*.profraw' | wc -l) raw files -> $WORK/kvgate.profdata"

echo "== optimized build (target/pgo-use)"
PROFILE=$(cd "$WORK" && pwd)/kvgate.profdata
RUSTFLAGS="-Cprofile-use=$PROFILE -Cllvm-args=-pgo-warn-missing-function=false" \
  cargo build --release -p kvgate --target-dir target/pgo-use
mkdir -p "$(dirname "$OUT")"
cp target/pgo-use/release/kvgate "$OUT"
echo "pgo_build: $OUT"

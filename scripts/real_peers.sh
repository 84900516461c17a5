#!/usr/bin/env bash
# kvgate and the peer routers side by side in front of two REAL vLLM 0.32 engines (CPU build,
# dummy weights, from ../shared/tools/vllm-cpu): correctness figures (hit rate, and kvgate's
# predicted against the engines' realized cached tokens), not speed (two engines on 2 cores).
# Benchmark-only: the peers (vllm-router, SGLang's smg) come from a venv of their own.
#
# Two engines are started (one per core, 1 GiB of KV cache each, /render on); then per repeat
# and per router, in alternating order, the router is started, both engines' prefix caches
# are reset (POST /reset_prefix_cache), `kvgate bench` runs the workload and the router is
# stopped. The table gives medians over the repeats.
#
# Usage: scripts/real_peers.sh [--out DIR] [--repeats N] [--routers a,b,...]
#   routers: kvgate (precise: KV events + local tokenizer), kvgate-zero (nothing but the
#   engines' URLs), vllm-kv (vllm-router kv_aware with KV events), vllm-cache, smg, rr
# Env: KVGATE_BIN (default target/release/kvgate), PEERS_VENV (default /work/venv... any venv
#   with vllm-router==0.1.17 and sglang-router==0.3.2), VLLM_CPU_TOOLS, VLLM_CPU_HOME,
#   WORKLOAD (bench flags; default the shared-prefix run below).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=real-peers-out REPEATS=3 ROUTERS=kvgate,kvgate-zero,vllm-kv,vllm-cache,smg,rr
while (($#)); do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --routers) ROUTERS=$2; shift 2 ;;
    -h|--help) sed -n 2,18p "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
KVGATE=${KVGATE_BIN:-$ROOT/target/release/kvgate}
VENV=${PEERS_VENV:-$HOME/.cache/kvgate-peers-venv}
TOOLS=${VLLM_CPU_TOOLS:-$ROOT/../shared/tools/vllm-cpu}
WORKLOAD=${WORKLOAD:---workload shared-prefix --groups 4 --conversations-per-group 4 --turns 3 --system-tokens 700 --concurrency 4 --max-tokens 8}
[[ -x $KVGATE ]] || { echo "no kvgate binary at $KVGATE" >&2; exit 1; }
mkdir -p "$OUT/raw" "$OUT/logs"
IFS=, read -r -a RLIST <<<"$ROUTERS"
for r in "${RLIST[@]}"; do
  case $r in vllm-*|rr|smg) [[ -x $VENV/bin/vllm-router && -x $VENV/bin/smg ]] || {
    echo "the peers are not installed in $VENV (pip install vllm-router==0.1.17 sglang-router==0.3.2)" >&2; exit 1; } ;; esac
done
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
start_engine() { # PORT KV CPU
  setsid env VLLM_CPU_OMP_THREADS_BIND=$3 VLLM_SERVER_DEV_MODE=1 bash "$TOOLS/serve.sh" "$1" "$2" --enable-scale-out \
    > "$OUT/logs/engine-$1.log" 2>&1 &
  PIDS+=($!)
}
wait_http() { # URL SECONDS
  local deadline=$(( $(date +%s) + $2 ))
  until curl -sf "$1" > /dev/null 2>&1; do
    (( $(date +%s) < deadline )) || { echo "not ready: $1" >&2; return 1; }
    sleep 0.5
  done
}
E=(8301 8302) K=(5701 5711)
start_engine "${E[0]}" "${K[0]}" 0; start_engine "${E[1]}" "${K[1]}" 1
for p in "${E[@]}"; do wait_http "http://127.0.0.1:$p/health" 600; done
URLS=("http://127.0.0.1:${E[0]}" "http://127.0.0.1:${E[1]}")
echo "engines ready: ${URLS[*]}"

start_router() { # NAME LOG -> sets RPID, RPORT
  local name=$1 log=$2 port=18400 admin=18401 prom=18401
  local -a cmd
  case $name in
    kvgate) cmd=("$KVGATE" serve --listen 127.0.0.1:$port --admin-listen 127.0.0.1:$admin
        --endpoint "${URLS[0]},kv=tcp://127.0.0.1:${K[0]},replay=tcp://127.0.0.1:$((K[0]+1))"
        --endpoint "${URLS[1]},kv=tcp://127.0.0.1:${K[1]},replay=tcp://127.0.0.1:$((K[1]+1))"
        --tokenizer "tiny=$ROOT/testdata/tokenizers/qwen3" --decision-log "$DECISIONS") ;;
    kvgate-zero) cmd=("$KVGATE" serve --listen 127.0.0.1:$port --admin-listen 127.0.0.1:$admin
        --endpoint "${URLS[0]}" --endpoint "${URLS[1]}" --decision-log "$DECISIONS") ;;
    rr|vllm-cache|vllm-kv)
      cmd=("$VENV/bin/vllm-router" --host 127.0.0.1 --port $port --prometheus-host 127.0.0.1 --prometheus-port $prom
        --worker-urls "${URLS[@]}" --worker-startup-check-interval 1 --log-level warning)
      case $name in
        rr) cmd+=(--policy round_robin) ;;
        vllm-cache) cmd+=(--policy cache_aware) ;;
        vllm-kv) cmd+=(--policy kv_aware --kv-event-block-size 32 --kv-event-model tiny
            --kv-event-source "${URLS[0]}=tcp://127.0.0.1:${K[0]}" --kv-event-replay-source "${URLS[0]}=tcp://127.0.0.1:$((K[0]+1))"
            --kv-event-source "${URLS[1]}=tcp://127.0.0.1:${K[1]}" --kv-event-replay-source "${URLS[1]}=tcp://127.0.0.1:$((K[1]+1))") ;;
      esac ;;
    smg) cmd=("$VENV/bin/smg" launch --host 127.0.0.1 --port $port --prometheus-host 127.0.0.1 --prometheus-port $prom
        --worker-urls "${URLS[@]}" --policy cache_aware --worker-startup-check-interval 1
        --shutdown-grace-period-secs 1 --log-level warn) ;;
    *) echo "unknown router $name" >&2; exit 2 ;;
  esac
  echo "${cmd[*]}" >> "$OUT/commands.log"
  setsid "${cmd[@]}" > "$log" 2>&1 &
  RPID=$!; RPORT=$port
  wait_http "http://127.0.0.1:$port/v1/models" 120
}

echo -e "router\trep\trequests\terrors\thit_rate\treq_s\tttft_p50\tpredicted\trealized\tmispredicted" > "$OUT/runs.tsv"
for ((rep = 1; rep <= REPEATS; rep++)); do
  order=("${RLIST[@]}")
  if ((rep % 2 == 0)); then mapfile -t order < <(printf '%s\n' "${RLIST[@]}" | tac); fi
  for r in "${order[@]}"; do
    DECISIONS="$OUT/raw/$r/rep$rep.decisions.jsonl"; mkdir -p "$OUT/raw/$r"
    # vLLM publishes the reset's AllBlocksCleared only with its next engine step: one token
    # through each engine publishes it, or a router starting now would replay the previous
    # run's holdings (the same prompts, under the same seed) from the engine's history.
    for u in "${URLS[@]}"; do
      curl -sf -X POST "$u/reset_prefix_cache" > /dev/null
      curl -sf "$u/v1/completions" -H 'content-type: application/json' \
        -d '{"model":"tiny","prompt":"flush","max_tokens":1}' > /dev/null
    done
    start_router "$r" "$OUT/logs/$r.rep$rep.log"
    dir="$OUT/raw/$r/rep$rep"; mkdir -p "$OUT/raw/$r"
    # shellcheck disable=SC2086
    "$KVGATE" bench --target "http://127.0.0.1:$RPORT" --model tiny --out "$dir" --seed "$rep" $WORKLOAD > "$dir.bench.log" 2>&1 || true
    kill -TERM -- "-$RPID" 2>/dev/null || true; wait "$RPID" 2>/dev/null || true
    python3 - "$dir.bench.log" "$DECISIONS" "$r" "$rep" >> "$OUT/runs.tsv" <<'PY'
import json, os, sys
log, dl, name, rep = sys.argv[1:5]
row = next((l for l in open(log) if l.startswith("| 127.0.0.1:")), None)
cells = [c.strip() for c in row.strip().strip("|").split("|")] if row else []
req, err, hit, p50, rps = (cells[1], cells[2], cells[3].rstrip("%"), cells[4], cells[11]) if cells else ("-",) * 5
pred = real = mis = "-"
if os.path.exists(dl):
    recs = [json.loads(l) for l in open(dl) if l.strip()]
    pred = sum(r.get("predicted_cached_tokens") or 0 for r in recs)
    real = sum(r.get("realized_cached_tokens") or 0 for r in recs)
    mis = sum(1 for r in recs if (r.get("realized_cached_tokens") or 0) < (r.get("predicted_cached_tokens") or 0))
print("\t".join(map(str, [name, rep, req, err, hit, rps, p50, pred, real, mis])))
PY
    tail -1 "$OUT/runs.tsv"
  done
done
python3 - "$OUT/runs.tsv" "${RLIST[@]}" > "$OUT/summary.md" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
def med(vals):
    v = [float(x) for x in vals if x not in ("-", "")]
    return statistics.median(v) if v else None
print("| router | hit rate | req/s | TTFT p50 (ms) | predicted → realized cached tokens | requests realized < predicted | errors |")
print("|---|---|---|---|---|---|---|")
for name in sys.argv[2:]:
    rs = [r for r in rows if r["router"] == name]
    hit, rps, p50 = med(r["hit_rate"] for r in rs), med(r["req_s"] for r in rs), med(r["ttft_p50"] for r in rs)
    pred, real, mis = med(r["predicted"] for r in rs), med(r["realized"] for r in rs), med(r["mispredicted"] for r in rs)
    pr = f"{pred:,.0f} → {real:,.0f} ({real / pred:.3f})" if pred else "—"
    err = sum(int(r["errors"]) for r in rs if r["errors"].isdigit())
    f = lambda x, fmt: fmt.format(x) if x is not None else "—"
    print(f"| {name} | {f(hit, '{:.1f}%')} | {f(rps, '{:.2f}')} | {f(p50, '{:.0f}')} | {pr} | {f(mis, '{:.0f}') if pred else '—'} | {err} |")
PY
cat "$OUT/summary.md"

#!/usr/bin/env bash
# kvgate against the peer routers users would pick instead, side by side on one `kvgate sim`
# fleet. Benchmark-only: the peers (vllm-router, SGLang's smg) live in a venv of their own.
#
# For every workload: one sim fleet (4 engines) is started; then for every repeat and every
# router (order alternates: A B C D, then D C B A, ...) the router is started fresh, polled
# until it answers, every engine's prefix cache is reset, `kvgate bench --target` runs, and the
# router is stopped. The table gives the median of the repeats and the spread (max - min).
#
# Restart mode: a router spec NAME!restart (or NAME@N!restart) runs like NAME, except that
# --restart-after SECONDS into the bench, replica 0 is SIGKILLed and at once started again
# with the same command line (same listen/admin ports) and polled until it answers. A
# precise kvgate then rebuilds its index by replaying the engines' KV events from seq 0 (the
# fleet of a workload with restart routers keeps the whole run in its replay buffer); an
# approximate one starts blind. Requests in flight at the kill, and those sent while it is
# down, fail and are counted in the errors column. A workload row can give restart rows
# bench flags of their own (sp-8x9: a longer open-loop variant, see --list), since a closed
# loop turns the downtime into a burst of instant connection errors. The kill/restart times
# and the downtime are in the peers log, logs/<workload>.<router>.rep<k>.restart.log, the
# router's log (marker line), raw/.../restart.json and a Restarts table in summary.md (hit
# rate before the kill vs after the restart).
#
# Usage: scripts/peers.sh [options]
#   --out DIR                 output directory (default peers-out/)
#   --repeats N               runs per (workload, router) (default 3)
#   --workloads a,b           subset of workloads (default: all; see --list)
#   --routers a,b             subset of routers, in this order, each NAME[@N][!restart]
#                             (default: all, plus a workload row's extra routers; see --list)
#   --kvgate-variant NAME=FILE  extra kvgate router: `kvgate serve --config FILE` (scheduler
#                             plugins/profiles only) with KV events; NAME=approx:FILE runs it
#                             without KV events (repeatable)
#   --kvgate-bin NAME=PATH    run router NAME (a --kvgate-variant, or else a new precise
#                             variant with kvgate's defaults) with the kvgate binary PATH, e.g.
#                             an older build, for a before/after in one run (repeatable)
#   --replicas N              replica count of the NAME@N routers in the default list (default 2;
#                             0 drops them). Any router can be given as NAME@N in --routers.
#   --restart-after SECONDS   NAME!restart routers: SIGKILL replica 0 this long after the bench
#                             starts, then start it again (default 2; decimals allowed)
#   --quick                   smaller workloads (smoke test)
#   --no-warmup               skip the warm-up: by default, before a workload's first repeat,
#                             one bench run goes straight to the engines (round robin over the
#                             fleet, not counted; logs/WORKLOAD.warmup.bench.log). The first run
#                             on a fresh fleet ran slower: without it, kvgate's first repeat was
#                             its slowest TTFT p50 in all six Mooncake runs of one session, a
#                             cost that always fell on the first router listed.
#   --list                    print workloads and routers, then exit
#   -h, --help
# Environment: KVGATE_BIN (default target/release/kvgate), PEERS_VENV (default
#   ~/.cache/kvgate-peers-venv; created with vllm-router==0.1.17 sglang-router==0.3.2 when the
#   binaries are missing), PYTHON (python3, to create the venv), KVGATE_TOKENIZER (default
#   testdata/tokenizers/qwen3), MOONCAKE_TRACE (default /work/shared/data/mooncake/conversation_trace.jsonl),
#   READY_TIMEOUT (seconds a router may take to answer, default 120).
#
# Output: DIR/summary.md (also printed), DIR/summary.json, DIR/raw/<workload>/<router>/rep<k>/
# (each bench report: results.json with every request, summary.md, plots), DIR/logs/,
# DIR/commands.log (every command run), DIR/status.tsv, DIR/meta.txt.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SCRIPTS="$ROOT/scripts"
KVGATE=${KVGATE_BIN:-$ROOT/target/release/kvgate}
PEERS_VENV=${PEERS_VENV:-$HOME/.cache/kvgate-peers-venv}
PYTHON=${PYTHON:-python3}
TOKENIZER_DIR=${KVGATE_TOKENIZER:-$ROOT/testdata/tokenizers/qwen3}
MOONCAKE_TRACE=${MOONCAKE_TRACE:-$ROOT/../shared/data/mooncake/conversation_trace.jsonl}
READY_TIMEOUT=${READY_TIMEOUT:-120}
PEER_PINS=(vllm-router==0.1.17 sglang-router==0.3.2)

# ---------------------------------------------------------------- data: fleet and workloads
# The fleet every workload starts from; a workload row's sim flags override these by name.
# 16-token blocks, stated (the sim's default is 32): the tables in BENCHMARKS.md were measured
# on them, vllm-router is given --kv-event-block-size 16 and the mooncake oracles count 16.
FLEET_FLAGS=(--instances 4 --num-gpu-blocks 320 --block-size 16 --prefill-tokens-per-s 10000
  --prefill-base-ms 5 --itl-ms 5 --prefix-caching-hash-algo sha256_cbor)
# Added to every bench run (after the row's flags).
BENCH_COMMON=(--max-tokens 16 --seed 7 --quiet)

# name | sim flags (override FLEET_FLAGS) | bench flags | bench flags with --quick (empty: same)
#   | extra routers of the default list for this workload | bench flags of NAME!restart rows
#   (empty: the row's bench flags; used with --quick too)
# sp-8x9's restart rows: 96 conversations of 4 turns, open loop at 6 conversations/s (about 16 s;
# --restart-after 2 kills at ~15%); open loop so that requests keep arriving at their own pace
# while the router is down. At 6/s kvgate and kvgate-approx are stable without a restart (both
# 93.6% in a trial); at 10/s kvgate (precise) fell into a cache-thrashing regime (71.6%) even
# without one.
# mooncake-30: the same from minute 30 of the trace (a second sample of the same traffic, to
# check that what helps on the first one is not fitted to it).
# mooncake: the first 2,000 trace requests (about 10 minutes of traffic, replayed at 4x, which a 2-core box running the sims too keeps up with),
# engines with 32,768 KV blocks (524k tokens) each and fast
# enough to keep up (400k prefill tokens/s), output capped at 16; the bench's bounded-cache
# oracle gets the fleet's total blocks (4 x 32,768).
# A row whose --workload value or any --flag is missing from `kvgate bench --help` is skipped
# with the reason printed, so rows for features still being written can sit here.
WORKLOAD_ROWS=(
  "sp-8x9||--workload shared-prefix --groups 8 --conversations-per-group 9 --turns 3 --system-tokens 2048 --concurrency 8|--workload shared-prefix --groups 4 --conversations-per-group 3 --turns 2 --system-tokens 2048 --concurrency 8|kvgate!restart kvgate-approx!restart|--workload shared-prefix --groups 8 --conversations-per-group 12 --turns 4 --system-tokens 2048 --rate 6"
  "sp-32x3||--workload shared-prefix --groups 32 --conversations-per-group 3 --turns 3 --system-tokens 512 --concurrency 8|--workload shared-prefix --groups 8 --conversations-per-group 2 --turns 2 --system-tokens 512 --concurrency 8"
  "huge-4x12||--workload shared-prefix --groups 4 --conversations-per-group 12 --turns 3 --system-tokens 4000 --concurrency 8|--workload shared-prefix --groups 4 --conversations-per-group 3 --turns 2 --system-tokens 4000 --concurrency 8"
  "agentic||--workload agentic --concurrency 8|--workload agentic --agents 4 --rounds 2 --concurrency 8"
  "burst||--workload burst --concurrency 8|--workload burst --bursts 4 --siblings 4 --concurrency 8"
  "mooncake|--num-gpu-blocks 32768 --max-model-len 131072 --prefill-tokens-per-s 400000|--workload mooncake --trace $MOONCAKE_TRACE --max-requests 2000 --trace-speed 4 --max-output-tokens 16 --oracle-blocks 131072|--workload mooncake --trace $MOONCAKE_TRACE --max-requests 200 --trace-speed 10 --max-output-tokens 16 --oracle-blocks 131072"
  "mooncake-30|--num-gpu-blocks 32768 --max-model-len 131072 --prefill-tokens-per-s 400000|--workload mooncake --trace $MOONCAKE_TRACE --window 30.. --max-requests 2000 --trace-speed 4 --max-output-tokens 16 --oracle-blocks 131072|--workload mooncake --trace $MOONCAKE_TRACE --window 30.. --max-requests 200 --trace-speed 10 --max-output-tokens 16 --oracle-blocks 131072"
)

# Routers. NAME@N = N replicas of NAME behind one multi-URL bench target (needs the bench's
# NAME=URL1,URL2 targets; skipped with a reason otherwise); kvgate replicas share their
# in-flight load (--replica-sync-listen / --replica-peer, when the binary has them); the peers'
# replicas run with their defaults, each on its own. NAME!restart (NAME@N!restart):
# replica 0 is killed and restarted during the bench (see the top).
BASE_ROUTERS=(rr vllm-kv vllm-cache smg kvgate kvgate-approx)
describe_router() {
  case $1 in
    rr) echo "vllm-router --policy round_robin (baseline)" ;;
    vllm-kv) echo "vllm-router --policy kv_aware, fed by every engine's KV events (+ replay), tokenizes via /render" ;;
    vllm-cache) echo "vllm-router --policy cache_aware (approximate text tree)" ;;
    smg) echo "SGLang smg launch --policy cache_aware (approximate text tree)" ;;
    kvgate) echo "kvgate serve, precise: local tokenizer + KV events (kv=, replay=), default profile" ;;
    kvgate-approx) echo "kvgate serve, approximate: the same without kv= (learns from its own routing)" ;;
    *) if [[ -n ${VARIANT_FILE[$1]:-} || -n ${VARIANT_BIN[$1]:-} ]]; then
         echo "${VARIANT_BIN[$1]:-kvgate} serve${VARIANT_FILE[$1]:+ --config ${VARIANT_FILE[$1]}} (${VARIANT_MODE[$1]})"
       else echo "?"; fi ;;
  esac
}

# ---------------------------------------------------------------- options
OUT=peers-out
REPEATS=3
SEL_WORKLOADS=""
SEL_ROUTERS=""
REPLICAS=2
RESTART_AFTER=2
QUICK=0
WARMUP=1
LIST=0
declare -A VARIANT_FILE=() VARIANT_MODE=() VARIANT_BIN=()
VARIANT_NAMES=()

die() { echo "peers.sh: $*" >&2; exit 1; }
log() { echo "[peers $(date +%H:%M:%S)] $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

while (($#)); do
  case $1 in
    --out) OUT=${2:?--out needs DIR}; shift 2 ;;
    --repeats) REPEATS=${2:?--repeats needs N}; shift 2 ;;
    --workloads) SEL_WORKLOADS=${2:?}; shift 2 ;;
    --routers) SEL_ROUTERS=${2:?}; shift 2 ;;
    --replicas) REPLICAS=${2:?}; shift 2 ;;
    --restart-after) RESTART_AFTER=${2:?--restart-after needs SECONDS}; shift 2 ;;
    --kvgate-variant)
      spec=${2:?--kvgate-variant needs NAME=FILE}; shift 2
      name=${spec%%=*}; file=${spec#*=}
      [[ $spec == *=* && -n $name && -n $file ]] || die "--kvgate-variant wants NAME=FILE, got '$spec'"
      [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "variant name '$name': use letters, digits, . _ -"
      case " ${BASE_ROUTERS[*]} ${VARIANT_NAMES[*]} " in *" $name "*) die "--kvgate-variant name '$name' is taken" ;; esac
      mode=precise
      if [[ $file == approx:* ]]; then mode=approx; file=${file#approx:}; fi
      [[ -f $file ]] || die "--kvgate-variant $name: no file $file"
      VARIANT_FILE[$name]=$(cd "$(dirname "$file")" && pwd)/$(basename "$file")
      VARIANT_MODE[$name]=$mode
      VARIANT_NAMES+=("$name") ;;
    --kvgate-bin)
      spec=${2:?--kvgate-bin needs NAME=PATH}; shift 2
      name=${spec%%=*}; file=${spec#*=}
      [[ $spec == *=* && -n $name && -n $file ]] || die "--kvgate-bin wants NAME=PATH, got '$spec'"
      [[ -x $file ]] || die "--kvgate-bin $name: $file is not an executable"
      VARIANT_BIN[$name]=$(cd "$(dirname "$file")" && pwd)/$(basename "$file")
      case " ${VARIANT_NAMES[*]} " in
        *" $name "*) ;;
        *)
          [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "variant name '$name': use letters, digits, . _ -"
          case " ${BASE_ROUTERS[*]} " in *" $name "*) die "--kvgate-bin name '$name' is taken" ;; esac
          VARIANT_MODE[$name]=precise; VARIANT_NAMES+=("$name") ;;
      esac ;;
    --quick) QUICK=1; shift ;;
    --no-warmup) WARMUP=0; shift ;;
    --list) LIST=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
[[ $REPEATS =~ ^[1-9][0-9]*$ ]] || die "--repeats must be a positive integer"
[[ $REPLICAS =~ ^[0-9]+$ ]] || die "--replicas must be a non-negative integer"
[[ $RESTART_AFTER =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--restart-after must be a number of seconds"
RESTART_AFTER_US=$(awk -v s="$RESTART_AFTER" 'BEGIN { printf "%d", s * 1000000 }')
# The sim's replay buffer for fleets of workloads with restart routers (batches per engine;
# the default 10,000 would do for sp-8x9, this leaves room for a whole fleet's lifetime).
RESTART_BUFFER_STEPS=1000000

ALL_ROUTERS=("${BASE_ROUTERS[@]}" "${VARIANT_NAMES[@]}")
DEFAULT_ROUTERS=("${ALL_ROUTERS[@]}")
if ((REPLICAS > 1)); then DEFAULT_ROUTERS+=("kvgate@$REPLICAS" "kvgate-approx@$REPLICAS"); fi

if ((LIST)); then
  echo "workloads (name | sim flags | bench flags):"
  for row in "${WORKLOAD_ROWS[@]}"; do
    IFS='|' read -r n s b _ x rb <<<"$row"; echo "  $n | ${s:-(fleet defaults)} | $b"
    [[ -n $x ]] && echo "      + default routers: $x"
    [[ -n $rb ]] && echo "      NAME!restart rows run instead (also with --quick): $rb"
  done
  echo "routers:"
  for r in "${ALL_ROUTERS[@]}"; do echo "  $r: $(describe_router "$r")"; done
  echo "  NAME@N: N replicas of NAME behind one multi-URL target (default list: ${DEFAULT_ROUTERS[*]}, plus a workload's extra routers)"
  echo "  NAME!restart, NAME@N!restart: NAME with replica 0 SIGKILLed ${RESTART_AFTER}s into the bench (--restart-after) and restarted on the same ports"
  echo "fleet: kvgate sim ${FLEET_FLAGS[*]}"
  echo "  (+ --kv-events-buffer-steps $RESTART_BUFFER_STEPS for a workload with NAME!restart routers)"
  exit 0
fi

# ---------------------------------------------------------------- processes and cleanup
PIDS=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local pid
  for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_bg LOG CMD... : starts CMD in its own process group (setsid) with output to LOG
# (appended to when BG_APPEND=1); sets LAST_PID.
BG_APPEND=0
start_bg() {
  local logf=$1; shift
  printf '%q ' "$@" >>"$OUT/commands.log"; echo >>"$OUT/commands.log"
  if ((BG_APPEND)); then
    setsid "$@" >>"$logf" 2>&1 </dev/null &
  else
    setsid "$@" >"$logf" 2>&1 </dev/null &
  fi
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

# stop_pid PID : TERM to its process group, KILL after 10 s; forgets PID.
stop_pid() {
  local pid=$1 i keep=()
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || true
  local p
  for p in "${PIDS[@]}"; do [[ $p == "$pid" ]] || keep+=("$p"); done
  PIDS=("${keep[@]}")
}

# free_ports N : sets PORT_BASE to the first of N consecutive free loopback ports in
# 20000-32000 (below the kernel's ephemeral range); blocks are handed out in increasing order,
# so a block is not handed out twice in a run before it is bound.
PORT_CURSOR=$((20000 + RANDOM % 8000))
free_ports() {
  local n=$1 base
  base=$("$PY" - "$n" "$PORT_CURSOR" <<'EOF'
import socket, sys
n, start = int(sys.argv[1]), int(sys.argv[2])
lo, hi = 20000, 32000
base = start
for _ in range(2000):
    if base + n > hi:
        base = lo
    ok, socks = True, []
    for p in range(base, base + n):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p)); socks.append(s)
        except OSError:
            ok = False
            break
    for s in socks:
        s.close()
    if ok:
        print(base); sys.exit(0)
    base += n
sys.exit(1)
EOF
  ) || die "no $n free consecutive ports in 20000-32000"
  PORT_CURSOR=$((base + n))
  PORT_BASE=$base
}

# wait_http URL PID LOG NAME [INTERVAL] : polls URL (every INTERVAL s, default 0.2) until it
# answers 2xx; fails if PID dies or after READY_TIMEOUT seconds.
wait_http() {
  local url=$1 pid=$2 logf=$3 name=$4 interval=${5:-0.2} deadline=$((SECONDS + READY_TIMEOUT))
  while ! curl -fsS -m 2 -o /dev/null "$url" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name exited before answering $url; last log lines ($logf):" >&2
      tail -n 20 "$logf" >&2
      return 1
    fi
    if ((SECONDS >= deadline)); then
      echo "$name did not answer $url within ${READY_TIMEOUT}s; last log lines ($logf):" >&2
      tail -n 20 "$logf" >&2
      return 1
    fi
    sleep "$interval"
  done
}

# merge_flags BASE... ::: ROW... : sets MERGED to BASE without the flags ROW sets, then ROW.
merge_flags() {
  local -a base=() row=()
  local a seen=0 keys=" " i=0
  for a in "$@"; do
    if [[ $a == ":::" ]]; then seen=1; elif ((seen)); then row+=("$a"); else base+=("$a"); fi
  done
  for a in "${row[@]}"; do [[ $a == --* ]] && keys+="${a%%=*} "; done
  MERGED=()
  while ((i < ${#base[@]})); do
    a=${base[i]}
    if [[ $a == --* && $keys == *" ${a%%=*} "* ]]; then
      if [[ $a != *=* ]] && ((i + 1 < ${#base[@]})) && [[ ${base[i + 1]} != --* ]]; then
        i=$((i + 2))
      else
        i=$((i + 1))
      fi
      continue
    fi
    MERGED+=("$a"); i=$((i + 1))
  done
  MERGED+=("${row[@]}")
}

# ---------------------------------------------------------------- checks
[[ -x $KVGATE ]] || die "kvgate binary not found at $KVGATE (build it: cargo build --release -p kvgate, or set KVGATE_BIN)"
command -v curl >/dev/null || die "curl is required"
command -v setsid >/dev/null || die "setsid (util-linux) is required"
PY=$(command -v "$PYTHON" || true)
[[ -n $PY ]] || die "$PYTHON is required (set PYTHON)"
[[ -f $SCRIPTS/peers_table.py ]] || die "missing $SCRIPTS/peers_table.py"
[[ -d $TOKENIZER_DIR ]] || die "tokenizer directory $TOKENIZER_DIR not found (set KVGATE_TOKENIZER)"

BENCH_HELP=$("$KVGATE" bench --help 2>&1) || die "'$KVGATE bench --help' failed: $BENCH_HELP"
SERVE_HELP=$("$KVGATE" serve --help 2>&1) || die "'$KVGATE serve --help' failed: $SERVE_HELP"
# Multi-URL targets (NAME=URL1,URL2: requests round-robin across replicas), if this bench has them.
MULTI_SEP=""
if grep -Eq 'URL1,URL2|URL\[,URL' <<<"$BENCH_HELP"; then MULTI_SEP=,
elif grep -Eq 'URL1\+URL2|URL\[\+URL' <<<"$BENCH_HELP"; then MULTI_SEP=+; fi

# Select workloads and routers.
declare -A ROW_BY_NAME=()
WORKLOAD_ORDER=()
for row in "${WORKLOAD_ROWS[@]}"; do
  IFS='|' read -r n _ <<<"$row"
  ROW_BY_NAME[$n]=$row
  WORKLOAD_ORDER+=("$n")
done
WORKLOADS=()
if [[ -n $SEL_WORKLOADS ]]; then
  IFS=',' read -r -a WORKLOADS <<<"$SEL_WORKLOADS"
  for w in "${WORKLOADS[@]}"; do [[ -n ${ROW_BY_NAME[$w]:-} ]] || die "unknown workload '$w' (known: ${WORKLOAD_ORDER[*]})"; done
else
  WORKLOADS=("${WORKLOAD_ORDER[@]}")
fi
ROUTERS=()
if [[ -n $SEL_ROUTERS ]]; then IFS=',' read -r -a ROUTERS <<<"$SEL_ROUTERS"; else ROUTERS=("${DEFAULT_ROUTERS[@]}"); fi
is_known_router() { local r; for r in "${ALL_ROUTERS[@]}"; do [[ $r == "$1" ]] && return 0; done; return 1; }
# parse_router SPEC : NAME[@N][!restart] -> P_BASE, P_N (replicas), P_RESTART (0|1).
parse_router() {
  local r=$1 core=$1
  P_RESTART=0
  if [[ $core == *'!restart'* ]]; then P_RESTART=1; core=${core/'!restart'/}; fi
  [[ $core != *'!'* ]] || die "router '$r': the only ! suffix is !restart (NAME!restart, NAME@N!restart)"
  P_BASE=${core%@*}; P_N=1
  if [[ $core == *@* ]]; then
    P_N=${core#*@}
    [[ $P_N =~ ^[1-9][0-9]*$ ]] || die "router '$r': N in NAME@N must be a positive integer"
  fi
  is_known_router "$P_BASE" || die "unknown router '$r' (known: ${ALL_ROUTERS[*]}, or NAME@N, NAME!restart)"
}
# workload_routers WL : sets WL_ROUTERS, the routers WL runs: --routers as given, else the
# default list plus the workload row's extra routers.
workload_routers() {
  local x r
  WL_ROUTERS=("${ROUTERS[@]}")
  [[ -n $SEL_ROUTERS ]] && return 0
  IFS='|' read -r _ _ _ _ x _ <<<"${ROW_BY_NAME[$1]}"
  for r in $x; do
    case " ${WL_ROUTERS[*]} " in *" $r "*) ;; *) WL_ROUTERS+=("$r") ;; esac
  done
}
NEED_PEERS=0
ROUTER_ORDER=()
for w in "${WORKLOADS[@]}"; do
  workload_routers "$w"
  for r in "${WL_ROUTERS[@]}"; do
    parse_router "$r"
    case $P_BASE in rr|vllm-*|smg) NEED_PEERS=1 ;; esac
    case " ${ROUTER_ORDER[*]} " in *" $r "*) ;; *) ROUTER_ORDER+=("$r") ;; esac
  done
done

# The peers' venv (created when a selected peer's binary is missing).
VLLM_ROUTER=$PEERS_VENV/bin/vllm-router
SMG=$PEERS_VENV/bin/smg
if ((NEED_PEERS)) && { [[ ! -x $VLLM_ROUTER ]] || [[ ! -x $SMG ]]; }; then
  log "creating the peers' venv at $PEERS_VENV (${PEER_PINS[*]})"
  if [[ ! -x $PEERS_VENV/bin/pip ]]; then
    "$PY" -m venv "$PEERS_VENV" || die "'$PY -m venv $PEERS_VENV' failed (Debian: apt-get install python3-venv)"
  fi
  "$PEERS_VENV/bin/pip" install --quiet "${PEER_PINS[@]}" || die "pip install ${PEER_PINS[*]} into $PEERS_VENV failed"
  [[ -x $VLLM_ROUTER ]] || die "vllm-router missing from $PEERS_VENV/bin after installing vllm-router"
  [[ -x $SMG ]] || die "smg missing from $PEERS_VENV/bin after installing sglang-router"
fi

mkdir -p "$OUT/raw" "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
: >"$OUT/commands.log"
: >"$OUT/status.tsv"
{ echo "workloads: ${WORKLOADS[*]}"; echo "routers: ${ROUTER_ORDER[*]}"; } >"$OUT/order.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -sr), $(nproc) cores"
  echo "kvgate: $KVGATE ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ', dirty tree'))"
  if ((NEED_PEERS)); then
    echo "peers: $("$PEERS_VENV/bin/python" -m pip list 2>/dev/null | awk '$1=="vllm-router"||$1=="sglang-router"{printf "%s==%s ", $1, $2}')"
  fi
  echo "fleet: kvgate sim ${FLEET_FLAGS[*]} (+ per-workload sim flags)"
  echo "bench: kvgate bench --target NAME=URL --reset <each engine> <workload flags> ${BENCH_COMMON[*]}"
  echo "repeats: $REPEATS (router order alternates), quick: $QUICK, warm-up run straight to the engines first: $WARMUP"
  case " ${ROUTER_ORDER[*]}" in *'!restart'*)
    echo "restart: NAME!restart rows SIGKILL replica 0 ${RESTART_AFTER}s after the bench starts and restart it on the same ports; their fleets keep $RESTART_BUFFER_STEPS KV event batches for replay" ;;
  esac
} >"$OUT/meta.txt"

status() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$OUT/status.tsv"; }
skip() { log "SKIP $1${2:+ / $2}: $4"; status "$1" "${2:--}" "${3:--}" skipped "$4"; }

# bench_row_problem BENCH_FLAGS... : prints why the bench cannot run these flags (empty: fine).
bench_row_problem() {
  local -a f=("$@")
  local i a
  for ((i = 0; i < ${#f[@]}; i++)); do
    a=${f[i]}
    [[ $a == --* ]] || continue
    if ! grep -Eq -- "(^|[^[:alnum:]-])${a%%=*}([^[:alnum:]-]|$)" <<<"$BENCH_HELP"; then
      echo "kvgate bench has no ${a%%=*} flag"; return
    fi
    if [[ $a == --workload ]] && ! grep -Eqw -- "${f[i + 1]:-}" <<<"$BENCH_HELP"; then
      echo "kvgate bench has no '${f[i + 1]}' workload"; return
    fi
    if [[ $a == --trace && ! -f ${f[i + 1]:-} ]]; then
      echo "trace file ${f[i + 1]} not found"; return
    fi
  done
}

# ---------------------------------------------------------------- the fleet
SIM_PID=""
SIM_URLS=()
SIM_EVENTS=()
SIM_REPLAY=()
MODEL=""

start_fleet() {
  local wl=$1; shift
  local logf="$OUT/logs/sim-$wl.log" n http replay i
  merge_flags "${FLEET_FLAGS[@]}" ::: "$@"
  local -a flags=("${MERGED[@]}")
  n=4
  for ((i = 0; i < ${#flags[@]}; i++)); do [[ ${flags[i]} == --instances ]] && n=${flags[i + 1]:-4}; done
  free_ports "$n"; http=$PORT_BASE
  free_ports "$n"; replay=$PORT_BASE
  # Events: port 0 makes every engine bind its own ephemeral loopback port (a named host
  # would connect instead of bind); the bound ports are read back from the sim's log.
  start_bg "$logf" env NO_COLOR=1 KVGATE_LOG=info "$KVGATE" sim "${flags[@]}" --host 127.0.0.1 --port "$http" \
    --kv-events-endpoint tcp://127.0.0.1:0 --kv-events-replay-endpoint "tcp://127.0.0.1:$replay"
  SIM_PID=$LAST_PID
  SIM_URLS=(); SIM_REPLAY=()
  for ((i = 0; i < n; i++)); do
    SIM_URLS+=("http://127.0.0.1:$((http + i))")
    SIM_REPLAY+=("tcp://127.0.0.1:$((replay + i))")
    wait_http "${SIM_URLS[i]}/v1/models" "$SIM_PID" "$logf" "sim instance $i" || return 1
  done
  local deadline=$((SECONDS + 30)) events
  while :; do
    events=$("$PY" - "$logf" "$n" <<'EOF'
import re, sys
path, n = sys.argv[1], int(sys.argv[2])
found = {}
for line in open(path, errors="replace"):
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    if "kvgate sim listening" not in line:
        continue
    m = re.search(r"instance\W+(\d+)", line)
    ep = re.search(r"tcp://[0-9.]+:\d+", line)
    if m and ep:
        found[int(m.group(1))] = ep.group(0)
if all(i in found for i in range(n)):
    print(" ".join(found[i] for i in range(n)))
EOF
    )
    [[ -n $events ]] && break
    ((SECONDS < deadline)) || { echo "could not read the KV event ports from $logf" >&2; return 1; }
    sleep 0.2
  done
  read -r -a SIM_EVENTS <<<"$events"
  MODEL=$(curl -fsS -m 5 "${SIM_URLS[0]}/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') \
    || { echo "could not read the model from ${SIM_URLS[0]}/v1/models" >&2; return 1; }
  log "fleet for $wl: ${SIM_URLS[*]} events ${SIM_EVENTS[*]} model $MODEL"
}

stop_fleet() { [[ -n $SIM_PID ]] && stop_pid "$SIM_PID"; SIM_PID=""; }

# ---------------------------------------------------------------- routers
# start_one BASE LOGPREFIX : starts one instance of router BASE; appends its URL to R_URLS
# and its Prometheus URL to R_METRICS (and what restart_replica needs to R_CMDQ, R_READY,
# R_LOGF). kvgate's log filter is R_KVGATE_LOG.
R_PIDS=()
R_URLS=()
R_METRICS=()
R_CMDQ=()
R_READY=()
R_LOGF=()
R_SYNC_ADDRS=() # replica sync PUB addresses of the kvgate replicas being started (NAME@N)
R_SYNC_INDEX=0
R_KVGATE_LOG=warn
start_one() {
  local base=$1 logf="$2.log" port admin prom i ready metrics
  local -a cmd=() eps=()
  case $base in
    rr|vllm-kv|vllm-cache)
      free_ports 2; port=$PORT_BASE; prom=$((port + 1))
      cmd=("$VLLM_ROUTER" --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 --prometheus-port "$prom"
        --worker-urls "${SIM_URLS[@]}" --worker-startup-check-interval 1 --log-level warning)
      case $base in
        rr) cmd+=(--policy round_robin) ;;
        vllm-cache) cmd+=(--policy cache_aware) ;;
        vllm-kv)
          cmd+=(--policy kv_aware --kv-event-block-size 16 --kv-event-model "$MODEL")
          for ((i = 0; i < ${#SIM_URLS[@]}; i++)); do
            cmd+=(--kv-event-source "${SIM_URLS[i]}=${SIM_EVENTS[i]}" --kv-event-replay-source "${SIM_URLS[i]}=${SIM_REPLAY[i]}")
          done ;;
      esac
      ready="http://127.0.0.1:$port/v1/models"; metrics="http://127.0.0.1:$prom/metrics" ;;
    smg)
      free_ports 2; port=$PORT_BASE; prom=$((port + 1))
      cmd=("$SMG" launch --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 --prometheus-port "$prom"
        --worker-urls "${SIM_URLS[@]}" --policy cache_aware --worker-startup-check-interval 1
        --shutdown-grace-period-secs 1 --log-level warn)
      ready="http://127.0.0.1:$port/v1/models"; metrics="http://127.0.0.1:$prom/metrics" ;;
    *)
      local mode=precise
      case $base in
        kvgate) ;;
        kvgate-approx) mode=approx ;;
        *) mode=${VARIANT_MODE[$base]} ;;
      esac
      free_ports 2; port=$PORT_BASE; admin=$((port + 1))
      for ((i = 0; i < ${#SIM_URLS[@]}; i++)); do
        if [[ $mode == precise ]]; then
          eps+=(--endpoint "${SIM_URLS[i]},kv=${SIM_EVENTS[i]},replay=${SIM_REPLAY[i]}")
        else
          eps+=(--endpoint "${SIM_URLS[i]}")
        fi
      done
      cmd=(env NO_COLOR=1 "KVGATE_LOG=$R_KVGATE_LOG" "${VARIANT_BIN[$base]:-$KVGATE}" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin"
        "${eps[@]}" --tokenizer "$MODEL=$TOKENIZER_DIR" --decision-log "$2.decisions.jsonl")
      # Replicas share their in-flight load (every replica gets the same peer list).
      if ((${#R_SYNC_ADDRS[@]} > 1)); then
        cmd+=(--replica-sync-listen "${R_SYNC_ADDRS[R_SYNC_INDEX]}")
        for a in "${R_SYNC_ADDRS[@]}"; do cmd+=(--replica-peer "$a"); done
      fi
      if [[ -n ${VARIANT_FILE[$base]:-} ]]; then cmd+=(--config "${VARIANT_FILE[$base]}"); fi
      ready="http://127.0.0.1:$admin/ready"; metrics="http://127.0.0.1:$admin/metrics" ;;
  esac
  start_bg "$logf" "${cmd[@]}"
  R_PIDS+=("$LAST_PID")
  R_CMDQ+=("$(printf '%q ' "${cmd[@]}")")
  R_READY+=("$ready")
  R_LOGF+=("$logf")
  wait_http "$ready" "$LAST_PID" "$logf" "$base" || return 1
  # The proxy port must answer too (for kvgate, /ready is on the admin port).
  wait_http "http://127.0.0.1:$port/v1/models" "$LAST_PID" "$logf" "$base" || return 1
  R_URLS+=("http://127.0.0.1:$port")
  R_METRICS+=("$metrics")
}

stop_router() {
  local pid
  for pid in "${R_PIDS[@]}"; do stop_pid "$pid"; done
  R_PIDS=(); R_URLS=(); R_METRICS=(); R_CMDQ=(); R_READY=(); R_LOGF=()
}

now_us() { echo "${EPOCHREALTIME/./}"; }
# us_s MICROSECONDS : as seconds with 3 decimals; clock_of EPOCH_US : as HH:MM:SS.mmm.
us_s() { printf '%d.%03d' "$(($1 / 1000000))" "$((($1 % 1000000) / 1000))"; }
clock_of() { date -d "@$(us_s "$1")" +%H:%M:%S.%3N; }

# restart_replica I : SIGKILLs router replica I (its process group), then starts it again
# with the same command line (so on the same ports; an existing decision log is moved to
# *.before-restart.jsonl first, since kvgate truncates it) and polls its ready URL and proxy
# port every 50 ms. Sets RS_KILL_US, RS_DEAD_US (reaped), RS_SPAWN_US, RS_UP_US (answering;
# empty when it did not come back), RS_OLD_PID, RS_NEW_PID; epoch microseconds.
restart_replica() {
  local i=$1 logf=${R_LOGF[$1]} pid=${R_PIDS[$1]} p a prev="" keep=()
  local -a cmd=()
  eval "cmd=(${R_CMDQ[i]})"
  RS_OLD_PID=$pid RS_NEW_PID="" RS_UP_US=""
  RS_KILL_US=$(now_us)
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  RS_DEAD_US=$(now_us)
  for p in "${PIDS[@]}"; do [[ $p == "$pid" ]] || keep+=("$p"); done
  PIDS=("${keep[@]}")
  for a in "${cmd[@]}"; do
    if [[ $prev == --decision-log && -f $a ]]; then mv -f "$a" "${a%.jsonl}.before-restart.jsonl"; fi
    prev=$a
  done
  echo "=== peers.sh $(date +%H:%M:%S.%3N): SIGKILL pid $pid; restarting with the same command line" >>"$logf"
  echo "# restart of replica $i (pid $pid SIGKILLed):" >>"$OUT/commands.log"
  BG_APPEND=1 start_bg "$logf" "${cmd[@]}"
  RS_SPAWN_US=$(now_us)
  RS_NEW_PID=$LAST_PID
  R_PIDS[i]=$LAST_PID
  local port=${R_URLS[i]##*:}
  if wait_http "${R_READY[i]}" "$LAST_PID" "$logf" "restarted replica $i" 0.05 &&
    wait_http "http://127.0.0.1:$port/v1/models" "$LAST_PID" "$logf" "restarted replica $i" 0.05; then
    RS_UP_US=$(now_us)
    echo "=== peers.sh $(date +%H:%M:%S.%3N): restarted (pid $LAST_PID) answers again, down $(us_s $((RS_UP_US - RS_KILL_US))) s" >>"$logf"
  fi
}

# restart_record LOGP DIR ROUTER BENCH_FLAGS... : after a NAME!restart run, writes
# LOGP.restart.log and DIR/restart.json (times from restart_replica and BENCH_LAUNCH_US, the
# replays the restarted replica logged, its kv_replays metrics) and logs a summary line.
restart_record() {
  local logp=$1 dir=$2 router=$3; shift 3
  local rlog="$logp.restart.log" line
  {
    echo "router $router, replica 0, --restart-after ${RESTART_AFTER}s"
    echo "bench launched      $(clock_of "$BENCH_LAUNCH_US")"
    if [[ -n ${RS_KILL_US:-} ]]; then
      echo "SIGKILL pid $RS_OLD_PID  $(clock_of "$RS_KILL_US") (+$(us_s $((RS_KILL_US - BENCH_LAUNCH_US))) s after the bench launch)"
      echo "reaped              $(clock_of "$RS_DEAD_US") (+$(us_s $((RS_DEAD_US - RS_KILL_US))) s)"
      echo "restarted pid $RS_NEW_PID $(clock_of "$RS_SPAWN_US") (+$(us_s $((RS_SPAWN_US - RS_KILL_US))) s)"
      if [[ -n $RS_UP_US ]]; then
        echo "answering again     $(clock_of "$RS_UP_US"): down $(us_s $((RS_UP_US - RS_KILL_US))) s"
      else
        echo "did NOT answer again (see ${R_LOGF[0]:-the router log})"
      fi
    else
      echo "no restart: the bench ended before ${RESTART_AFTER}s"
    fi
  } >"$rlog"
  [[ -d $dir ]] || mkdir -p "$dir"
  "$PY" - "$rlog" "$dir/restart.json" "$logp.0.log" "$logp.0.metrics.txt" "$router" "$RESTART_AFTER" \
    "$BENCH_LAUNCH_US" "${RS_KILL_US:-}" "${RS_DEAD_US:-}" "${RS_SPAWN_US:-}" "${RS_UP_US:-}" "$*" <<'PYEOF'
import json, re, sys
from datetime import datetime
rlog, out, rtr_log, metrics, router, after, launch, kill, dead, spawn, up, flags = sys.argv[1:13]
us = lambda v: int(v) if v else None
rec = {"router": router, "replica": 0, "restart_after_s": float(after), "bench_flags": flags,
       "bench_launch_unix_us": us(launch), "kill_unix_us": us(kill), "reaped_unix_us": us(dead),
       "spawn_unix_us": us(spawn), "up_unix_us": us(up)}
rec["restarted"] = rec["kill_unix_us"] is not None
rec["back_up"] = rec["up_unix_us"] is not None
rec["downtime_s"] = (rec["up_unix_us"] - rec["kill_unix_us"]) / 1e6 if rec["back_up"] else None
replays, after_kill = [], False
try:
    for line in open(rtr_log, errors="replace"):
        if line.startswith("=== peers.sh") and "SIGKILL" in line:
            after_kill = True
        elif after_kill and ("kv replay" in line or "kv event" in line):
            replays.append(re.sub(r"\x1b\[[0-9;]*m", "", line).strip())
except OSError:
    pass
rec["replay_log_lines"] = replays
# A complete replay: a gap filled, or a connection's replay from seq 0 (warm start).
complete = lambda l: "kv event gap replayed" in l or ("replayed on connect" in l and "Complete" in l)
rec["replays_complete"] = sum(complete(l) for l in replays)
# When the last complete replay was logged (kvgate's log times are UTC ISO-8601).
done = None
for l in replays:
    if complete(l):
        try:
            done = datetime.fromisoformat(l.split()[0].replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
rec["last_replay_unix_us"] = int(done * 1e6) if done else None
rec["last_replay_s_after_kill"] = (done - rec["kill_unix_us"] / 1e6) if done and rec["kill_unix_us"] else None
try:
    rec["replay_metrics"] = [l.strip() for l in open(metrics) if "kv_replays" in l and not l.startswith("#")]
except OSError:
    rec["replay_metrics"] = []
json.dump(rec, open(out, "w"), indent=2)
with open(rlog, "a") as f:
    f.write(f"kv-event log lines of the restarted replica: {len(replays)}"
            f" ({rec['replays_complete']} complete replays")
    if rec["last_replay_s_after_kill"] is not None:
        f.write(f", the last {rec['last_replay_s_after_kill']:.3f} s after the kill")
    f.write(")\n")
    for l in replays:
        f.write(f"  {l}\n")
    for l in rec["replay_metrics"]:
        f.write(f"  metric {l}\n")
PYEOF
  if [[ -z ${RS_KILL_US:-} ]]; then line="no restart: the bench ended before ${RESTART_AFTER}s"
  elif [[ -z $RS_UP_US ]]; then line="SIGKILL at +$(us_s $((RS_KILL_US - BENCH_LAUNCH_US))) s, replica 0 did NOT come back"
  else line="SIGKILL at +$(us_s $((RS_KILL_US - BENCH_LAUNCH_US))) s after the bench launch, down $(us_s $((RS_UP_US - RS_KILL_US))) s"
  fi
  log "restart $(basename "$logp"): $line; $(grep -cE 'kv event gap replayed|replayed on connect.*Complete' "$rlog" || true) complete replay(s) logged after it (logs/$(basename "$rlog"))"
}

# run_one WORKLOAD ROUTER REPEAT BENCH_FLAGS... : fresh router, reset, bench, stop; for a
# NAME!restart router, replica 0 is killed and restarted RESTART_AFTER into the bench.
run_one() {
  local wl=$1 router=$2 rep=$3; shift 3
  local base n restart i dir="$OUT/raw/$wl/$router/rep$rep" logp="$OUT/logs/$wl.$router.rep$rep"
  parse_router "$router"; base=$P_BASE n=$P_N restart=$P_RESTART
  R_KVGATE_LOG=warn
  ((restart)) && R_KVGATE_LOG=warn,kvgate_kvcache=info # + "kv events connected", "kv event gap replayed"
  rm -rf "$dir" "$logp.restart.log"
  R_PIDS=(); R_URLS=(); R_METRICS=(); R_CMDQ=(); R_READY=(); R_LOGF=(); R_SYNC_ADDRS=()
  if ((n > 1)) && [[ $base != rr && $base != vllm-* && $base != smg ]] && grep -q -- '--replica-sync-listen' <<<"$SERVE_HELP"; then
    free_ports "$n"
    for ((i = 0; i < n; i++)); do R_SYNC_ADDRS+=("tcp://127.0.0.1:$((PORT_CURSOR - n + i))"); done
  fi
  for ((i = 0; i < n; i++)); do
    R_SYNC_INDEX=$i
    if ! start_one "$base" "$logp.$i"; then
      stop_router
      log "FAIL $wl / $router rep $rep: router did not start (log $logp.$i.log)"
      status "$wl" "$router" "$rep" failed "router did not start, see logs/$(basename "$logp").$i.log"
      return 0
    fi
  done
  sleep 1 # KV-event subscriptions connect, load scrapes start
  # Synced kvgate replicas: wait (up to 10 s) until each hears all the others.
  if ((${#R_SYNC_ADDRS[@]} > 1)); then
    local want=$((${#R_SYNC_ADDRS[@]} - 1)) m deadline=$((SECONDS + 10))
    for m in "${R_METRICS[@]}"; do
      until [[ $(curl -fsS -m 2 "$m" 2>/dev/null | awk '$1 == "kvgate_replica_peers" {print $2}') == "$want" ]]; do
        ((SECONDS < deadline)) || { log "warning: $m never heard all $want peers"; break; }
        sleep 0.1
      done
    done
  fi
  local target
  target=$(IFS=${MULTI_SEP:-,}; echo "${R_URLS[*]}")
  local -a resets=()
  for u in "${SIM_URLS[@]}"; do resets+=(--reset "$u"); done
  local -a cmd=("$KVGATE" bench --target "$router=$target" "${resets[@]}" --model "$MODEL" "$@" "${BENCH_COMMON[@]}" --out "$dir")
  printf '%q ' "${cmd[@]}" >>"$OUT/commands.log"; echo >>"$OUT/commands.log"
  local t0=$SECONDS bench_ok=0 bench_pid rs_state=""
  RS_KILL_US="" RS_UP_US=""
  BENCH_LAUNCH_US=$(now_us)
  # In the background, so a signal reaches the trap (and stops the bench) at once.
  "${cmd[@]}" >"$logp.bench.log" 2>&1 </dev/null &
  bench_pid=$!
  PIDS+=("$bench_pid")
  if ((restart)); then
    local until_us=$((BENCH_LAUNCH_US + RESTART_AFTER_US))
    while kill -0 "$bench_pid" 2>/dev/null && (($(now_us) < until_us)); do sleep 0.02; done
    if kill -0 "$bench_pid" 2>/dev/null; then
      restart_replica 0
      if [[ -n $RS_UP_US ]]; then rs_state=ok; else rs_state=failed; fi
    else
      rs_state=none
    fi
  fi
  if wait "$bench_pid"; then bench_ok=1; fi
  stop_pid "$bench_pid"
  if ((bench_ok)) && [[ -f $dir/results.json ]]; then
    log "$wl / $router rep $rep ($((SECONDS - t0))s): $("$PY" "$SCRIPTS/peers_table.py" --one "$dir/results.json")"
    case $rs_state in
      none) status "$wl" "$router" "$rep" no-restart "the bench ended before --restart-after ${RESTART_AFTER}s; nothing was killed" ;;
      failed) status "$wl" "$router" "$rep" failed "replica 0 did not answer after the restart, see logs/$(basename "$logp").0.log" ;;
      *) status "$wl" "$router" "$rep" ok ;;
    esac
  else
    log "FAIL $wl / $router rep $rep: kvgate bench failed; last lines of $logp.bench.log:"
    tail -n 5 "$logp.bench.log" >&2
    status "$wl" "$router" "$rep" failed "kvgate bench failed, see logs/$(basename "$logp").bench.log"
  fi
  # Each router's own metrics after the run (KV events received, decisions, ...).
  for ((i = 0; i < ${#R_METRICS[@]}; i++)); do
    curl -fsS -m 5 "${R_METRICS[i]}" >"$logp.$i.metrics.txt" 2>/dev/null || rm -f "$logp.$i.metrics.txt"
  done
  # (for a restarted replica, its metrics count from the restart)
  ((restart)) && restart_record "$logp" "$dir" "$router" "$@"
  stop_router
}

# warm_fleet WORKLOAD BENCH_FLAGS... : one bench run straight to the engines, not counted (see
# --no-warmup); a failure is logged and the repeats go on.
warm_fleet() {
  local wl=$1; shift
  local target=${SIM_URLS[0]} u bench_pid t0=$SECONDS
  [[ -n $MULTI_SEP ]] && target=$(IFS=$MULTI_SEP; echo "${SIM_URLS[*]}")
  local -a resets=()
  for u in "${SIM_URLS[@]}"; do resets+=(--reset "$u"); done
  local -a cmd=("$KVGATE" bench --target "warmup=$target" "${resets[@]}" --model "$MODEL" "$@" "${BENCH_COMMON[@]}" --out "$OUT/warmup/$wl")
  printf '%q ' "${cmd[@]}" >>"$OUT/commands.log"; echo >>"$OUT/commands.log"
  # In the background, so a signal reaches the trap (and stops the bench) at once.
  "${cmd[@]}" >"$OUT/logs/$wl.warmup.bench.log" 2>&1 </dev/null &
  bench_pid=$!
  PIDS+=("$bench_pid")
  if wait "$bench_pid"; then
    log "$wl / warm-up straight to the engines ($((SECONDS - t0))s), not counted"
  else
    log "warning: $wl warm-up failed (logs/$wl.warmup.bench.log); the repeats go on"
  fi
  stop_pid "$bench_pid"
}

# ---------------------------------------------------------------- main loop
log "output: $OUT; workloads: ${WORKLOADS[*]}; routers: ${ROUTER_ORDER[*]}; repeats: $REPEATS"
SIM_HELP=$("$KVGATE" sim --help 2>&1 || true)
for wl in "${WORKLOADS[@]}"; do
  IFS='|' read -r _ sim_flags bench_flags quick_flags _ restart_flags <<<"${ROW_BY_NAME[$wl]}"
  ((QUICK)) && [[ -n $quick_flags ]] && bench_flags=$quick_flags
  read -r -a SIM_ROW <<<"$sim_flags"
  read -r -a BENCH_ROW <<<"$bench_flags"
  BENCH_RESTART_ROW=("${BENCH_ROW[@]}")
  [[ -n $restart_flags ]] && read -r -a BENCH_RESTART_ROW <<<"$restart_flags"
  problem=$(bench_row_problem "${BENCH_ROW[@]}")
  if [[ -n $problem ]]; then skip "$wl" "" "" "$problem"; continue; fi
  restart_problem=$(bench_row_problem "${BENCH_RESTART_ROW[@]}")
  workload_routers "$wl"
  runnable=()
  any_restart=0
  for r in "${WL_ROUTERS[@]}"; do
    parse_router "$r"
    if [[ $r == *@* && -z $MULTI_SEP ]]; then
      skip "$wl" "$r" "" "kvgate bench has no multi-URL targets (NAME=URL1,URL2) yet"
    elif ((P_RESTART)) && [[ -n $restart_problem ]]; then
      skip "$wl" "$r" "" "restart rows' bench flags: $restart_problem"
    else
      runnable+=("$r")
      ((P_RESTART)) && any_restart=1
    fi
  done
  ((${#runnable[@]})) || continue
  # Restart rows: the fleet keeps the whole run's KV events, so a restarted precise router's
  # replay from seq 0 restores its index.
  if ((any_restart)) && [[ " ${SIM_ROW[*]} " != *" --kv-events-buffer-steps "* ]] &&
    grep -q -- '--kv-events-buffer-steps' <<<"$SIM_HELP"; then
    SIM_ROW=(--kv-events-buffer-steps "$RESTART_BUFFER_STEPS" "${SIM_ROW[@]}")
  fi
  if ! start_fleet "$wl" "${SIM_ROW[@]}"; then
    stop_fleet
    skip "$wl" "" "" "the sim fleet did not start (logs/sim-$wl.log)"
    continue
  fi
  ((WARMUP)) && warm_fleet "$wl" "${BENCH_ROW[@]}"
  for ((rep = 1; rep <= REPEATS; rep++)); do
    order=("${runnable[@]}")
    if ((rep % 2 == 0)); then
      order=()
      for ((i = ${#runnable[@]} - 1; i >= 0; i--)); do order+=("${runnable[i]}"); done
    fi
    for r in "${order[@]}"; do
      if ! kill -0 "$SIM_PID" 2>/dev/null; then
        status "$wl" "$r" "$rep" failed "the sim fleet died (logs/sim-$wl.log)"
        continue
      fi
      if [[ $r == *'!restart'* ]]; then
        run_one "$wl" "$r" "$rep" "${BENCH_RESTART_ROW[@]}"
      else
        run_one "$wl" "$r" "$rep" "${BENCH_ROW[@]}"
      fi
    done
  done
  stop_fleet
done

"$PY" "$SCRIPTS/peers_table.py" "$OUT"
log "wrote $OUT/summary.md, $OUT/summary.json, raw reports in $OUT/raw/"

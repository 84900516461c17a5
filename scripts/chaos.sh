#!/usr/bin/env bash
# Chaos suite (issue #11): kvgate in front of a 4-engine `kvgate sim` fleet under a steady open-loop
# `kvgate bench` load, one fault at a time, each on a fresh fleet and a fresh kvgate:
#
#   restart    engine 1 is SIGKILLed and, ~1 s later, started again with the same command line
#              (same HTTP, KV-event and replay ports; empty cache, event seq back to 0)
#   drop       every engine skips 10% of its KV event batches on the wire
#              (`kvgate sim --drop-event-batches 0.1`; the batches stay replayable)
#   stall      engine 0's /metrics answers only after 2 s (`--metrics-stall-ms 2000`, above
#              kvgate's 500 ms scrape timeout) for the whole run
#   blackhole  engine 2 is SIGSTOPped for 8 s (2 s with --quick; connections hang), then SIGCONTed;
#              kvgate's readiness probe should take it out of rotation meanwhile
#
# Every engine runs in a process of its own (`kvgate sim --instances 1`), so one can be killed.
# For each fault the script prints and records:
#   - the bench's errors by kind (`errors_by_kind` of its results.json);
#   - requests lost before the first byte: failed requests that got no successful response head
#     (no status, or a non-2xx status; kvgate retries on another engine while nothing has been
#     sent to the client, so this must be 0), and failed requests that did get a 2xx head (a
#     stream broken after its first byte);
#   - convergence: the time from the fault's end (the restarted engine answering again; a
#     completed replay after a dropped batch; SIGCONT) until kvgate's index matches every
#     engine's cache: for every engine, `endpoints[].index_holdings` of kvgate's
#     `GET ADMIN/debug/state.json` equals the engine's `kvgate_sim:cached_blocks` read just before
#     and just after it (a snapshot the load did not move). Polled every 50 ms; "not converged
#     within 10 s" otherwise. A baseline (the same check before the fault) shows the check can
#     succeed under the load. For `drop`, several replays are sampled (median and max).
#   - kvgate's own counters: kvgate_kv_sequence_gaps_total, kvgate_kv_replays_total{reason},
#     kvgate_kv_restarts_total; the sims' kvgate_sim:dropped_event_batches_total.
# Acceptance (issue #11): 0 requests lost before first byte; re-converged within 1 s of the
# replay after dropped batches and within 2 s after an engine restart on the same ports.
#
# Usage: scripts/chaos.sh [options]
#   --out DIR         output directory (default chaos-out/)
#   --quick           a shorter load and fewer drop samples (smoke test)
#   --faults a,b      subset of restart,drop,stall,blackhole (default: all, in that order)
#   -h, --help
# Environment: KVGATE_BIN (default target/release/kvgate), PYTHON (python3), KVGATE_TOKENIZER
#   (default testdata/tokenizers/qwen3), READY_TIMEOUT (seconds a process may take to answer,
#   default 60), KVGATE_SERVE_FLAGS (extra `kvgate serve` flags, word-split, e.g.
#   "--config probe-off.yaml").
#
# Output: DIR/summary.md (also printed), DIR/phases/<fault>.json (every figure), DIR/raw/<fault>/
# (the bench's report), DIR/logs/ (sims, kvgate, bench, convergence polls, kvgate metrics),
# DIR/commands.log (every command run). Exit status 0 when every acceptance criterion holds, 1
# otherwise.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVGATE=${KVGATE_BIN:-$ROOT/target/release/kvgate}
PYTHON=${PYTHON:-python3}
TOKENIZER_DIR=${KVGATE_TOKENIZER:-$ROOT/testdata/tokenizers/qwen3}
READY_TIMEOUT=${READY_TIMEOUT:-60}

# ---------------------------------------------------------------- data
ENGINES=4
# Every engine (as scripts/peers.sh's fleet, one process per engine): 320 blocks of 16 tokens,
# stated (the sim's default block size is 32).
FLEET_FLAGS=(--num-gpu-blocks 320 --block-size 16 --prefill-tokens-per-s 10000 --prefill-base-ms 5
  --itl-ms 5 --prefix-caching-hash-algo sha256_cbor)
ALL_FAULTS=(restart drop stall blackhole)
RESTART_ENGINE=1
STALL_ENGINE=0
STALL_MS=2000 # kvgate's scrape timeout is 500 ms
BLACKHOLE_ENGINE=2
DROP_FRACTION=0.1
CONVERGE_TIMEOUT_S=10
# Load: open loop, shared-prefix conversations (--rate conversations/s).
BENCH_COMMON=(--workload shared-prefix --system-tokens 1024 --max-tokens 16 --seed 7
  --timeout-ms 30000 --quiet)

# ---------------------------------------------------------------- options
OUT=chaos-out
QUICK=0
SEL_FAULTS=""
die() { echo "chaos.sh: $*" >&2; exit 2; }
log() { echo "[chaos $(date +%H:%M:%S)] $*" >&2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case $1 in
    --out) OUT=${2:?--out needs DIR}; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --faults) SEL_FAULTS=${2:?--faults needs a list}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
FAULTS=("${ALL_FAULTS[@]}")
if [[ -n $SEL_FAULTS ]]; then
  IFS=',' read -r -a FAULTS <<<"$SEL_FAULTS"
  for f in "${FAULTS[@]}"; do
    case " ${ALL_FAULTS[*]} " in *" $f "*) ;; *) die "unknown fault '$f' (known: ${ALL_FAULTS[*]})" ;; esac
  done
fi
if ((QUICK)); then
  BENCH_LOAD=(--groups 4 --conversations-per-group 6 --turns 2 --rate 3)
  WARMUP_S=3 BLACKHOLE_S=2 DROP_SAMPLES=3
else
  BENCH_LOAD=(--groups 8 --conversations-per-group 12 --turns 3 --rate 3)
  WARMUP_S=6 BLACKHOLE_S=8 DROP_SAMPLES=6
fi

# ---------------------------------------------------------------- checks
[[ -x $KVGATE ]] || die "kvgate binary not found at $KVGATE (build it: cargo build --release -p kvgate, or set KVGATE_BIN)"
command -v curl >/dev/null || die "curl is required"
command -v setsid >/dev/null || die "setsid (util-linux) is required"
PY=$(command -v "$PYTHON" || true)
[[ -n $PY ]] || die "$PYTHON is required (set PYTHON)"
[[ -d $TOKENIZER_DIR ]] || die "tokenizer directory $TOKENIZER_DIR not found (set KVGATE_TOKENIZER)"
"$KVGATE" sim --help 2>&1 | grep -q -- --metrics-stall-ms || die "$KVGATE sim has no --metrics-stall-ms (rebuild it)"

mkdir -p "$OUT/raw" "$OUT/logs" "$OUT/phases"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/phases/*.json
: >"$OUT/commands.log"
TOOL=$OUT/chaos_tool.py

# ---------------------------------------------------------------- helper (python)
cat >"$TOOL" <<'PYEOF'
"""chaos.sh's helper: convergence polling, metric reads, bench results, the summary."""
import json, os, re, statistics, sys, time, urllib.request

def get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")

def metric_sum(text, name, label=None):
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] != name or (label and label not in key):
            continue
        try:
            total += float(value); seen = True
        except ValueError:
            pass
    return total if seen else 0.0

def sim_blocks(url):
    return int(metric_sum(get(url + "/metrics?stall_ms=0"), "kvgate_sim:cached_blocks"))

def port(url):
    return url.rstrip("/").rsplit(":", 1)[-1]

def index_holdings(state_url):
    state = json.loads(get(state_url))
    return {port(e["url"]): int(e["index_holdings"]) for e in state["endpoints"]}

def snapshot(state_url, sims):
    """(per-engine consistent matches, description): the index equals the engine's count read
    before and after it."""
    try:
        before = [sim_blocks(u) for u in sims]
        idx = index_holdings(state_url)
        after = [sim_blocks(u) for u in sims]
        got = [idx.get(port(u)) for u in sims]
        return [b == a == g for b, a, g in zip(before, after, got)], \
            f"sim before {before} index {got} sim after {after}"
    except Exception as e:  # a stopped or restarting engine
        return [False] * len(sims), f"poll failed: {e}"

def poll_until_match(state_url, start, timeout_s, sims, log, focus=None):
    """Polls every 50 ms from now until every engine matches; {"ms": since start (unix s) or
    None, ...}; with FOCUS (engine indices) also "focus_ms", when those engines first matched."""
    deadline = time.time() + float(timeout_s)
    polls, focus_ms = 0, None
    while True:
        polls += 1
        t = time.time()
        matches, last = snapshot(state_url, sims)
        ok = all(matches)
        ms = round((t - start) * 1000)
        if focus is not None and focus_ms is None and all(matches[i] for i in focus):
            focus_ms = ms
        log.write(f"{t:.3f} +{ms}ms {'MATCH' if ok else 'differ'} {last}\n")
        if ok or time.time() >= deadline:
            out = {"ms": ms if ok else None, "polls": polls, "last": last}
            if focus is not None:
                out["focus"] = focus
                out["focus_ms"] = focus_ms
            return out
        time.sleep(max(0.0, 0.05 - (time.time() - t)))

def converge(state_url, trigger, timeout_s, logf, sims):
    """Waits for TRIGGER to hold the fault's end (unix microseconds), then polls; prints JSON."""
    wait_until = time.time() + 600
    while not (os.path.exists(trigger) and os.path.getsize(trigger) > 0):
        if time.time() > wait_until:
            print(json.dumps({"ms": None, "polls": 0, "last": "never triggered"}))
            return
        time.sleep(0.005)
    start = int(open(trigger).read().strip()) / 1e6
    with open(logf, "a") as log:
        print(json.dumps(poll_until_match(state_url, start, timeout_s, sims, log)))

def replays_ok(metrics_url):
    """Completed replays per endpoint port."""
    out = {}
    for line in get(metrics_url, timeout=5.0).splitlines():
        if line.startswith("kvgate_kv_replays_total{") and 'reason="ok"' in line:
            m = re.search(r'endpoint="[^"]*:(\d+)#', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + float(line.rsplit(" ", 1)[1])
    return out

def drop_samples(metrics_url, state_url, n, timeout_s, logf, sims):
    """Up to N times: waits (20 ms polls, 10 s at most) for kvgate's completed-replay counter of
    some endpoint to grow, then polls from that moment until the index matches that engine
    ("focus_ms") and the whole fleet ("ms"). Prints a JSON list."""
    out = []
    ports = [port(u) for u in sims]
    with open(logf, "a") as log:
        for _ in range(int(n)):
            prev = replays_ok(metrics_url)
            deadline = time.time() + 10
            while True:
                time.sleep(0.02)
                t = time.time()
                cur = replays_ok(metrics_url)
                grew = [i for i, p in enumerate(ports) if cur.get(p, 0) > prev.get(p, 0)]
                if grew or t > deadline:
                    break
            if not grew:
                log.write("# no further replay within 10 s\n")
                break
            log.write(f"# replay on engine(s) {grew} seen at {t:.3f}\n")
            out.append(poll_until_match(state_url, t, timeout_s, sims, log, focus=grew))
    print(json.dumps(out))

def counter(url, name, label=None):
    try:
        print(int(metric_sum(get(url, timeout=5.0), name, label)))
    except Exception:
        print(-1)

def bench(results):
    run = json.load(open(results))["runs"][0]
    lost = after = 0
    lost_kinds = {}
    for r in run["records"]:
        if r.get("error") is None:
            continue
        status = r.get("status")
        if status is None or not (200 <= status < 300):
            lost += 1
            k = r["error"] if isinstance(r["error"], str) else "_".join(f"{a}_{b}" for a, b in r["error"].items())
            lost_kinds[k] = lost_kinds.get(k, 0) + 1
        else:
            after += 1
    s = run["summary"]
    # Requests whose first token took 1 s or more: those that waited on a stopped engine.
    slow = sum(1 for r in run["records"] if (r.get("ttft_ms") or 0) >= 1000)
    print(json.dumps({"requests": s["requests"], "errors": s["errors"], "ttft_over_1s": slow,
                      "errors_by_kind": s["errors_by_kind"], "lost_before_first_byte": lost,
                      "lost_kinds": lost_kinds, "failed_after_first_byte": after,
                      "hit_rate": s.get("hit_rate"), "ttft_p50_ms": s["ttft_ms"]["p50"],
                      "ttft_max_ms": s["ttft_ms"]["max"]}))

def record(path, key, value):
    d = json.load(open(path)) if os.path.exists(path) else {}
    try:
        d[key] = json.loads(value)
    except ValueError:
        d[key] = value
    json.dump(d, open(path, "w"), indent=2)

def conv_text(c):
    if not c:
        return "-"
    return f"converged in {c['ms']} ms" if c.get("ms") is not None else "not converged within 10 s"

def fmt_ms(v):
    return "?" if v is None else f"{v:.0f}"

def summary(out, quick):
    order = ["restart", "drop", "stall", "blackhole"]
    phases = {}
    for f in os.listdir(os.path.join(out, "phases")):
        if f.endswith(".json"):
            phases[f[:-5]] = json.load(open(os.path.join(out, "phases", f)))
    rows, verdicts = [], []
    for name in [n for n in order if n in phases]:
        p = phases[name]
        b = p.get("bench") or {}
        kinds = ", ".join(f"{k} {v}" for k, v in sorted((b.get("errors_by_kind") or {}).items())) or "none"
        if name == "drop":
            samples = [c for c in p.get("after_samples", [])]
            ms = [c["focus_ms"] for c in samples if c.get("focus_ms") is not None]
            fleet = [c["ms"] for c in samples if c.get("ms") is not None]
            missed = len(samples) - len(ms)
            conv = (f"{len(samples)} replays sampled; that engine matched: median {statistics.median(ms):.0f} ms, "
                    f"max {max(ms)} ms" if ms else "no replay converged")
            if missed:
                conv += f", {missed} not within 10 s"
            if fleet:
                conv += f"; whole fleet matched: median {statistics.median(fleet):.0f} ms, max {max(fleet)} ms"
            if len(fleet) < len(samples):
                conv += f" ({len(samples) - len(fleet)} not within 10 s)"
            if not samples:
                conv = "no replay seen"
            ok_conv = bool(samples) and missed == 0 and max(ms) <= 1000
            verdicts.append(("drop: the replayed engine re-converged within 1 s of each replay", ok_conv))
        else:
            conv = conv_text(p.get("after"))
            if name == "stall":
                conv += " (fault ongoing)"
            ok_conv = None
            if name == "restart":
                a = p.get("after") or {}
                ok_conv = a.get("ms") is not None and a["ms"] <= 2000
                verdicts.append(("restart: re-converged within 2 s of the restart", ok_conv))
        lost = b.get("lost_before_first_byte")
        if lost is None:
            verdicts.append((f"{name}: bench results", False))
        else:
            verdicts.append((f"{name}: 0 requests lost before first byte", lost == 0))
        k = p.get("kvgate", {})
        counters = (f"gaps {k.get('gaps', '?')}, replays ok {k.get('replays_ok', '?')}/partial "
                    f"{k.get('replays_partial', '?')}/failed {k.get('replays_failed', '?')}, restarts {k.get('restarts', '?')}, "
                    f"reconnects {k.get('reconnects', '?')}")
        if name == "drop":
            counters += f"; sim dropped {p.get('sim_dropped', '?')} batches"
        if name == "restart" and "restarted_engine_events_at_restart" in p:
            counters += (f"; events applied from the restarted engine: {p['restarted_engine_events_at_restart']} at the restart,"
                         f" {p.get('restarted_engine_events_after_poll', '?')} after the poll; down {p.get('downtime_ms', '?')} ms")
        if name == "blackhole":
            during = p.get("endpoints_during") or []
            out_of_rotation = [e["url"] for e in during if e.get("probe_down")]
            counters += (f"; out of rotation by the readiness probe at the end of the stop: {', '.join(out_of_rotation) or 'none'}"
                         f"; requests with TTFT >= 1 s: {b.get('ttft_over_1s', '?')}")
        lost_s = "?" if lost is None else str(lost)
        if b.get("lost_kinds"):
            lost_s += " (" + ", ".join(f"{k2} {v}" for k2, v in sorted(b["lost_kinds"].items())) + ")"
        rows.append(f"| {name} | {p.get('fault', '')} | {b.get('requests', '?')} | {b.get('errors', '?')}: {kinds} "
                    f"| {lost_s} | {b.get('failed_after_first_byte', '?')} | {fmt_ms(b.get('ttft_p50_ms'))} / {fmt_ms(b.get('ttft_max_ms'))} | {conv_text(p.get('baseline'))} | {conv} | {counters} |")
    lines = [f"# Chaos suite{' (--quick)' if quick == '1' else ''}", "",
             open(os.path.join(out, "meta.txt")).read().rstrip(), "",
             "| fault | what | requests | errors by kind | lost before first byte | failed after first byte | TTFT p50 / max ms | baseline (before the fault) | convergence after the fault | kvgate counters |",
             "|---|---|---|---|---|---|---|---|---|---|"] + rows + ["", "Acceptance:", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in verdicts]
    text = "\n".join(lines) + "\n"
    open(os.path.join(out, "summary.md"), "w").write(text)
    print(text, end="")
    sys.exit(0 if all(ok for _, ok in verdicts) else 1)

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "converge":
    converge(args[0], args[1], args[2], args[3], args[4:])
elif cmd == "drop_samples":
    drop_samples(args[0], args[1], args[2], args[3], args[4], args[5:])
elif cmd == "counter":
    counter(*args)
elif cmd == "bench":
    bench(args[0])
elif cmd == "record":
    record(*args)
elif cmd == "summary":
    summary(*args)
else:
    sys.exit(f"unknown command {cmd}")
PYEOF

# ---------------------------------------------------------------- processes and cleanup
PIDS=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local pid
  for pid in "${PIDS[@]}"; do kill -CONT -- "-$pid" 2>/dev/null || true; stop_pid "$pid"; done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_bg LOG CMD... : starts CMD in its own process group (setsid), output appended to LOG;
# sets LAST_PID.
start_bg() {
  local logf=$1; shift
  printf '%q ' "$@" >>"$OUT/commands.log"; echo >>"$OUT/commands.log"
  setsid "$@" >>"$logf" 2>&1 </dev/null &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

forget_pid() {
  local p keep=()
  for p in "${PIDS[@]}"; do [[ $p == "$1" ]] || keep+=("$p"); done
  PIDS=("${keep[@]}")
}

# stop_pid PID : TERM to its process group, KILL after 10 s; forgets PID.
stop_pid() {
  local pid=$1 i
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || true
  forget_pid "$pid"
}

# free_ports N : sets PORT_BASE to the first of N consecutive free loopback ports in
# 20000-32000 (as scripts/peers.sh).
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

# wait_http URL PID LOG NAME [INTERVAL] : polls URL until it answers 2xx; fails if PID dies or
# after READY_TIMEOUT seconds.
wait_http() {
  local url=$1 pid=$2 logf=$3 name=$4 interval=${5:-0.2} deadline=$((SECONDS + READY_TIMEOUT))
  while ! curl -fsS -m 5 -o /dev/null "$url" 2>/dev/null; do
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

now_us() { echo "${EPOCHREALTIME/./}"; }

# ---------------------------------------------------------------- the fleet and kvgate
SIM_PIDS=() SIM_CMDQ=() SIM_LOGF=() SIM_URLS=() SIM_EVENTS=() SIM_REPLAY=()
MODEL=""
# start_engine I PHASE EXTRA_FLAGS... : engine I on its fixed ports (HTTP, events, replay).
start_engine() {
  local i=$1 phase=$2; shift 2
  local logf="$OUT/logs/$phase.sim$i.log"
  local -a cmd=(env NO_COLOR=1 KVGATE_LOG=info "$KVGATE" sim "${FLEET_FLAGS[@]}" --instances 1
    --host 127.0.0.1 --port "${SIM_URLS[i]##*:}"
    --kv-events-endpoint "tcp://*:${SIM_EVENTS[i]##*:}" --kv-events-replay-endpoint "${SIM_REPLAY[i]}"
    --fault-seed "$((i + 1))" "$@")
  start_bg "$logf" "${cmd[@]}"
  SIM_PIDS[i]=$LAST_PID
  SIM_CMDQ[i]=$(printf '%q ' "${cmd[@]}")
  SIM_LOGF[i]=$logf
}

# start_fleet PHASE : ENGINES engines, each process with its own flags from ENGINE_FLAGS_<i>.
start_fleet() {
  local phase=$1 i base
  free_ports $((3 * ENGINES)); base=$PORT_BASE
  SIM_PIDS=() SIM_CMDQ=() SIM_LOGF=() SIM_URLS=() SIM_EVENTS=() SIM_REPLAY=()
  for ((i = 0; i < ENGINES; i++)); do
    SIM_URLS+=("http://127.0.0.1:$((base + i))")
    SIM_EVENTS+=("tcp://127.0.0.1:$((base + ENGINES + i))")
    SIM_REPLAY+=("tcp://127.0.0.1:$((base + 2 * ENGINES + i))")
  done
  for ((i = 0; i < ENGINES; i++)); do
    local -n extra="ENGINE_FLAGS_$i"
    start_engine "$i" "$phase" "${extra[@]}"
  done
  for ((i = 0; i < ENGINES; i++)); do
    wait_http "${SIM_URLS[i]}/v1/models" "${SIM_PIDS[i]}" "${SIM_LOGF[i]}" "sim engine $i" || return 1
  done
  MODEL=$(curl -fsS -m 5 "${SIM_URLS[0]}/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') \
    || { echo "could not read the model from ${SIM_URLS[0]}/v1/models" >&2; return 1; }
}

stop_fleet() {
  local pid
  for pid in "${SIM_PIDS[@]}"; do kill -CONT -- "-$pid" 2>/dev/null || true; stop_pid "$pid"; done
  SIM_PIDS=()
}

KV_PID="" KV_URL="" KV_ADMIN=""
start_kvgate() {
  local phase=$1 i logf="$OUT/logs/$1.kvgate.log"
  local -a eps=()
  free_ports 2
  KV_URL="http://127.0.0.1:$PORT_BASE" KV_ADMIN="http://127.0.0.1:$((PORT_BASE + 1))"
  for ((i = 0; i < ENGINES; i++)); do
    eps+=(--endpoint "${SIM_URLS[i]},kv=${SIM_EVENTS[i]},replay=${SIM_REPLAY[i]}")
  done
  start_bg "$logf" env NO_COLOR=1 KVGATE_LOG=warn,kvgate_kvcache=info "$KVGATE" serve \
    --listen "127.0.0.1:$PORT_BASE" --admin-listen "127.0.0.1:$((PORT_BASE + 1))" \
    "${eps[@]}" --tokenizer "$MODEL=$TOKENIZER_DIR" ${KVGATE_SERVE_FLAGS:-}
  KV_PID=$LAST_PID
  wait_http "$KV_ADMIN/ready" "$KV_PID" "$logf" kvgate || return 1
  wait_http "$KV_URL/v1/models" "$KV_PID" "$logf" kvgate || return 1
}

# poller_start PHASE LABEL : starts a convergence poller that waits for poller_fire (so its start-up
# is not timed); poller_wait collects its JSON line (see the top).
POLLER_N=0
poller_start() {
  POLLER_N=$((POLLER_N + 1))
  POLLER_TRIG="$OUT/logs/$1.trigger$POLLER_N" POLLER_OUT="$OUT/logs/$1.poll$POLLER_N.json"
  rm -f "$POLLER_TRIG"
  echo "# $2" >>"$OUT/logs/$1.converge.log"
  "$PY" "$TOOL" converge "$KV_ADMIN/debug/state.json" "$POLLER_TRIG" "$CONVERGE_TIMEOUT_S" \
    "$OUT/logs/$1.converge.log" "${SIM_URLS[@]}" >"$POLLER_OUT" &
  POLLER_PID=$!
  PIDS+=("$POLLER_PID")
}
poller_fire() { echo "${1:-$(now_us)}" >"$POLLER_TRIG.tmp" && mv "$POLLER_TRIG.tmp" "$POLLER_TRIG"; }
# poller_wait : waits for the poller (in this shell, not in a $(...) subshell); sets POLLED.
poller_wait() {
  wait "$POLLER_PID" || true
  forget_pid "$POLLER_PID"
  POLLED=$(cat "$POLLER_OUT")
  [[ -n $POLLED ]] || POLLED=null
}

# record_endpoints PHASE_JSON KEY STATE_JSON : kvgate's view of each endpoint (health, metrics).
record_endpoints() {
  [[ -s $3 ]] || return 0
  "$PY" "$TOOL" record "$1" "$2" "$(jq -c '[.endpoints[] | {url, healthy, probe_down, consecutive_failures, metrics_stale, metrics_age_ms, index_holdings}]' "$3" 2>/dev/null || echo null)"
}

kv_counter() { "$PY" "$TOOL" counter "$KV_ADMIN/metrics" "$@"; }
replays_ok() { kv_counter kvgate_kv_replays_total 'reason="ok"'; }

# ---------------------------------------------------------------- one fault
run_fault() {
  local fault=$1 i pj="$OUT/phases/$1.json" bench_pid t_end what c
  local dir="$OUT/raw/$fault"
  KV_PID=""
  for ((i = 0; i < ENGINES; i++)); do declare -g -a "ENGINE_FLAGS_$i=()"; done
  case $fault in
    restart) what="SIGKILL engine $RESTART_ENGINE, restart on the same ports after 1 s" ;;
    drop)
      what="every engine drops ${DROP_FRACTION} of its KV event batches"
      for ((i = 0; i < ENGINES; i++)); do declare -g -a "ENGINE_FLAGS_$i=(--drop-event-batches $DROP_FRACTION)"; done ;;
    stall)
      what="engine $STALL_ENGINE's /metrics stalls ${STALL_MS} ms"
      declare -g -a "ENGINE_FLAGS_$STALL_ENGINE=(--metrics-stall-ms $STALL_MS)" ;;
    blackhole) what="SIGSTOP engine $BLACKHOLE_ENGINE for ${BLACKHOLE_S} s, then SIGCONT" ;;
  esac
  log "=== $fault: $what"
  "$PY" "$TOOL" record "$pj" fault "$what"
  if ! start_fleet "$fault" || ! start_kvgate "$fault"; then
    log "FAIL $fault: the fleet or kvgate did not start (logs in $OUT/logs)"
    "$PY" "$TOOL" record "$pj" error '"did not start"'
    if [[ -n $KV_PID ]]; then stop_pid "$KV_PID"; fi
    stop_fleet
    return 0
  fi
  sleep 1 # KV-event subscriptions connect, first scrapes
  rm -rf "$dir"
  local -a cmd=("$KVGATE" bench --target "kvgate=$KV_URL" --model "$MODEL" "${BENCH_COMMON[@]}" "${BENCH_LOAD[@]}" --out "$dir")
  printf '%q ' "${cmd[@]}" >>"$OUT/commands.log"; echo >>"$OUT/commands.log"
  "${cmd[@]}" >"$OUT/logs/$fault.bench.log" 2>&1 </dev/null &
  bench_pid=$!
  PIDS+=("$bench_pid")
  poller_start "$fault" "baseline"
  sleep "$WARMUP_S"
  poller_fire
  local base
  poller_wait; base=$POLLED
  "$PY" "$TOOL" record "$pj" baseline "$base"
  log "$fault: baseline $base"
  case $fault in
    restart)
      local pid=${SIM_PIDS[RESTART_ENGINE]} t_kill
      local -a again=()
      eval "again=(${SIM_CMDQ[RESTART_ENGINE]})"
      poller_start "$fault" "after the restart"
      t_kill=$(now_us)
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
      forget_pid "$pid"
      echo "=== chaos.sh $(date +%H:%M:%S.%3N): SIGKILL; restarting in 1 s with the same command line" >>"${SIM_LOGF[RESTART_ENGINE]}"
      sleep 1
      start_bg "${SIM_LOGF[RESTART_ENGINE]}" "${again[@]}"
      SIM_PIDS[RESTART_ENGINE]=$LAST_PID
      wait_http "${SIM_URLS[RESTART_ENGINE]}/v1/models" "$LAST_PID" "${SIM_LOGF[RESTART_ENGINE]}" "restarted engine" 0.05 || true
      t_end=$(now_us)
      poller_fire "$t_end"
      local ep_label="endpoint=\"${SIM_URLS[RESTART_ENGINE]#http://}#0\""
      "$PY" "$TOOL" record "$pj" restarted_engine_events_at_restart "$(kv_counter kvgate_kv_events_total "$ep_label")"
      poller_wait
      "$PY" "$TOOL" record "$pj" restarted_engine_events_after_poll "$(kv_counter kvgate_kv_events_total "$ep_label")"
      "$PY" "$TOOL" record "$pj" downtime_ms "$(((t_end - t_kill) / 1000))"
      "$PY" "$TOOL" record "$pj" after "$POLLED" ;;
    drop)
      echo "# drop samples" >>"$OUT/logs/$fault.converge.log"
      "$PY" "$TOOL" record "$pj" after_samples "$("$PY" "$TOOL" drop_samples "$KV_ADMIN/metrics" \
        "$KV_ADMIN/debug/state.json" "$DROP_SAMPLES" "$CONVERGE_TIMEOUT_S" "$OUT/logs/$fault.converge.log" "${SIM_URLS[@]}")" ;;
    stall)
      poller_start "$fault" "stall ongoing"
      sleep 0.5
      poller_fire
      poller_wait
      "$PY" "$TOOL" record "$pj" after "$POLLED"
      "$PY" "$TOOL" record "$pj" kvgate_models_s "$(curl -sS -m 30 -o /dev/null -w '%{time_total}' "$KV_URL/v1/models" || echo null)"
      curl -fsS -m 5 "$KV_ADMIN/debug/state.json" >"$OUT/logs/$fault.state.json" 2>/dev/null || true
      record_endpoints "$pj" endpoints_during "$OUT/logs/$fault.state.json" ;;
    blackhole)
      local pid=${SIM_PIDS[BLACKHOLE_ENGINE]}
      poller_start "$fault" "after SIGCONT"
      kill -STOP -- "-$pid"
      sleep "$BLACKHOLE_S"
      curl -fsS -m 5 "$KV_ADMIN/debug/state.json" >"$OUT/logs/$fault.state-stopped.json" 2>/dev/null || true
      kill -CONT -- "-$pid"
      poller_fire
      record_endpoints "$pj" endpoints_during "$OUT/logs/$fault.state-stopped.json"
      poller_wait
      "$PY" "$TOOL" record "$pj" after "$POLLED" ;;
  esac
  log "$fault: after the fault: $("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d.get("after", d.get("after_samples")))' "$pj")"
  wait "$bench_pid" || log "$fault: kvgate bench exited non-zero (see logs/$fault.bench.log)"
  forget_pid "$bench_pid"
  if [[ -f $dir/results.json ]]; then
    "$PY" "$TOOL" record "$pj" bench "$("$PY" "$TOOL" bench "$dir/results.json")"
  fi
  curl -fsS -m 5 "$KV_ADMIN/metrics" >"$OUT/logs/$fault.kvgate.metrics.txt" 2>/dev/null || true
  local gaps rok rpart rfail rst rcn dropped=0
  gaps=$(kv_counter kvgate_kv_sequence_gaps_total)
  rok=$(replays_ok)
  rpart=$(kv_counter kvgate_kv_replays_total 'reason="partial"')
  rfail=$(kv_counter kvgate_kv_replays_total 'reason="failed"')
  rst=$(kv_counter kvgate_kv_restarts_total)
  rcn=$(kv_counter kvgate_kv_reconnects_total)
  "$PY" "$TOOL" record "$pj" kvgate "{\"gaps\": $gaps, \"replays_ok\": $rok, \"replays_partial\": $rpart, \"replays_failed\": $rfail, \"restarts\": $rst, \"reconnects\": $rcn}"
  for ((i = 0; i < ENGINES; i++)); do
    c=$("$PY" "$TOOL" counter "${SIM_URLS[i]}/metrics?stall_ms=0" kvgate_sim:dropped_event_batches_total)
    if ((c > 0)); then dropped=$((dropped + c)); fi
  done
  "$PY" "$TOOL" record "$pj" sim_dropped "$dropped"
  stop_pid "$KV_PID"
  stop_fleet
}

# ---------------------------------------------------------------- main
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(uname -sr), $(nproc) cores; quick: $QUICK"
  echo "kvgate: $KVGATE ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ', dirty tree'))"
  echo "fleet: $ENGINES processes of kvgate sim ${FLEET_FLAGS[*]} --instances 1 (fixed ports each)"
  echo "load: kvgate bench ${BENCH_COMMON[*]} ${BENCH_LOAD[*]} (open loop); fault ${WARMUP_S} s after the bench starts"
  echo "convergence: every engine's index_holdings == kvgate_sim:cached_blocks (read before and after), polled every 50 ms, for up to ${CONVERGE_TIMEOUT_S} s"
} >"$OUT/meta.txt"
log "output: $OUT; faults: ${FAULTS[*]}"
for f in "${FAULTS[@]}"; do run_fault "$f"; done
"$PY" "$TOOL" summary "$OUT" "$QUICK"

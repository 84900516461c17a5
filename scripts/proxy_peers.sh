#!/usr/bin/env bash
# The proxy path side by side with the peer routers (benchmark only; tests never need it).
#
# nginx (Debian) plays an engine that answers every request with one fixed chat completion, so
# the figures are the routers' own cost. Each target gets the same ~2.4 KB chat body:
#   direct        nginx itself
#   vllm-rr       vllm-router --policy round_robin
#   smg-rr        smg launch --policy round_robin
#   smg-cache     smg launch --policy cache_aware (its text tree, no tokenizer)
#   kvgate        kvgate serve, load routing (no tokenizer), logging warnings only (the peers
#                 run at their warning levels, nginx with access_log off)
#   kvgate-info   the same at kvgate's default log level, info: a line a request, to a file
#                 (not in the default list)
#   kvgate-tok    kvgate serve with the local Qwen3 tokenizer and a KV-event endpoint, so every
#                 request is tokenized and scored precisely (the same body each time: the
#                 repeated-prefix case, where the segment cache serves the chunks)
#   nginx-proxy   nginx (one worker, upstream keep-alive) as a plain reverse proxy: no router
#                 work at all, the reference for what a proxy hop costs on this machine
#                 (not in the default list)
#   hyper-bare    the least a proxy on kvgate's HTTP stack does (hyper server, pooled hyper
#                 client, two tokio workers; no parse, scheduling or metrics): what of
#                 kvgate's cost is the stack and what its own work (not in the default list;
#                 cargo build --release -p kvgate-proxy --example bare_proxy)
#   hyper-bare-per-core  the same with one single-threaded runtime per core, each with its own
#                 listener (SO_REUSEPORT) and pooled client: the stack without work stealing
#                 (not in the default list)
# Load, per target and round: wrk (closed loop, -t1 -c16, DURATION s) for req/s and latency,
# then hey at a fixed 500 req/s twice, for p50/p99 at that rate: evenly spaced (-c 1 -q 500,
# one request every 2 ms; the rate it held is reported, as a request slower than 2 ms would
# delay the next) and in bursts (-c 10 -q 50: hey's ten workers tick together, so ten
# requests arrive within a millisecond every 20 ms, and the last of a burst waits for the
# router to finish the nine before it). The router's CPU time
# (user + system, its process and direct children, from /proc) over the wrk run, divided by
# the requests wrk completed, is its CPU per request: on a machine the router shares with wrk
# and the engine, a steadier measure of its cost than req/s. Round 2 runs the
# targets in the reverse order. One engine, one router at a time; all on this machine.
#
# With --instructions N, each target instead runs under valgrind's callgrind: after a 200-request
# warm-up, the counters are zeroed, N requests go through (hey -c 4), and the report gives the
# router's user-space instructions per request, all threads together. These repeat to within 1%
# from run to run, where req/s on a shared machine does not.
#
# With --unique, every wrk request carries its own question (a counter in the user message),
# so no two bodies are equal: what a router's caches of whole requests cannot serve. hey
# keeps sending the one body.
#
# With --engines N, the engine answers on N ports (still one nginx worker) and every router is
# given all N as its fleet: what a router's per-request work costs as the fleet grows (scoring
# every candidate, for one). direct and the bare proxies use the first port only.
#
# Usage: scripts/proxy_peers.sh [--rounds N] [--duration S] [--targets a,b,...] [--out DIR]
#        [--instructions N] [--unique] [--engines N]
# Env: KVGATE_BIN (default target/release/kvgate), PEERS_VENV (default
#   ~/.cache/kvgate-peers-venv; created with vllm-router==0.1.17 sglang-router==0.3.2 when
#   missing), KVGATE_TOKENIZER (default testdata/tokenizers/qwen3), BARE_PROXY_BIN (default
#   target/release/examples/bare_proxy).
# Needs nginx, wrk and hey (Debian: apt-get install nginx-light wrk hey), and valgrind for
# --instructions.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

ROUNDS=2 DURATION=6 OUT=proxy-peers-out INSTRUCTIONS=0 UNIQUE=0 ENGINES=1
TARGETS=(direct vllm-rr smg-rr smg-cache kvgate kvgate-tok)
while (($#)); do
  case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --targets) IFS=',' read -r -a TARGETS <<<"$2"; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --instructions) INSTRUCTIONS=$2; shift 2 ;;
    --unique) UNIQUE=1; shift ;;
    --engines) ENGINES=$2; shift 2 ;;
    -h|--help) sed -n '2,58p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

KVGATE=${KVGATE_BIN:-target/release/kvgate}
BARE=${BARE_PROXY_BIN:-target/release/examples/bare_proxy}
PEERS_VENV=${PEERS_VENV:-$HOME/.cache/kvgate-peers-venv}
TOKENIZER_DIR=${KVGATE_TOKENIZER:-testdata/tokenizers/qwen3}
MODEL=Qwen/Qwen3-0.6B
die() { echo "proxy_peers: $*" >&2; exit 1; }
[[ $ENGINES =~ ^[1-9][0-9]*$ ]] || die "--engines takes a positive count, not '$ENGINES'"
((INSTRUCTIONS == 0)) || command -v valgrind >/dev/null || die "valgrind missing (apt-get install valgrind)"
for tool in nginx wrk hey curl python3; do
  command -v "$tool" >/dev/null || [[ -x /usr/sbin/$tool ]] || die "$tool missing (apt-get install nginx-light wrk hey)"
done
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
[[ -x $KVGATE ]] || die "$KVGATE missing (cargo build --release -p kvgate)"
needs_peers=0
for t in "${TARGETS[@]}"; do
  case $t in
    vllm-*|smg-*) needs_peers=1 ;;
    hyper-bare|hyper-bare-per-core) [[ -x $BARE ]] || die "$BARE missing (cargo build --release -p kvgate-proxy --example bare_proxy)" ;;
  esac
done
if ((needs_peers)) && [[ ! -x $PEERS_VENV/bin/smg || ! -x $PEERS_VENV/bin/vllm-router ]]; then
  python3 -m venv "$PEERS_VENV"
  "$PEERS_VENV/bin/pip" install --quiet vllm-router==0.1.17 sglang-router==0.3.2
fi

mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # URL PID NAME
  local i
  for ((i = 0; i < 600; i++)); do
    curl -fsS -m 1 -o /dev/null "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || die "$3 exited (logs in $OUT/logs)"
    sleep 0.1
  done
  die "$3 not ready at $1"
}

# The body: a system prompt and a question, about 2.4 KB.
python3 - "$WORK/body.json" "$MODEL" <<'EOF'
import json, sys
words = ("the router forwards every request byte for byte to the engine that holds its "
         "prefix while it still spreads the load across the fleet").split()
system = " ".join(words[i % len(words)] for i in range(380))
body = {"model": sys.argv[2], "max_tokens": 16, "messages": [
    {"role": "system", "content": system},
    {"role": "user", "content": "Summarize the text above in one sentence."}]}
open(sys.argv[1], "w").write(json.dumps(body))
EOF
BODY_BYTES=$(wc -c <"$WORK/body.json")
cat >"$WORK/post.lua" <<EOF
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("$WORK/body.json", "rb")
wrk.body = f:read("*a")
f:close()
if $UNIQUE == 1 then
  -- Every request its own question: "… sentence #<run tag>-<n>."; no two bodies equal.
  local head, tail = wrk.body:match("^(.*in one sentence)(.*)$")
  local tag, n = "", 0
  init = function(args) tag = args[1] or "" end
  request = function()
    n = n + 1
    return wrk.format(nil, nil, nil, head .. " #" .. tag .. "-" .. n .. tail)
  end
end
EOF

# The engine: nginx, one worker, a fixed completion for every path, on ENGINES ports.
ENGINE_PORTS=()
while ((${#ENGINE_PORTS[@]} < ENGINES)); do
  p=$(free_port)
  [[ " ${ENGINE_PORTS[*]} " == *" $p "* ]] || ENGINE_PORTS+=("$p")
done
ENGINE_PORT=${ENGINE_PORTS[0]}
COMPLETION='{"id":"chatcmpl-0","object":"chat.completion","created":0,"model":"'$MODEL'","choices":[{"index":0,"message":{"role":"assistant","content":"A router that keeps prefixes together."},"finish_reason":"stop"}],"usage":{"prompt_tokens":520,"completion_tokens":8,"total_tokens":528}}'
# An nginx config: one worker, no access log, temp files in $WORK; $2 goes inside http { }.
nginx_conf() { # NAME HTTP_BLOCKS
  cat <<EOC
worker_processes 1;
daemon off;
pid $WORK/$1.pid;
error_log $OUT/logs/$1.error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK;
  proxy_temp_path $WORK;
  fastcgi_temp_path $WORK;
  uwsgi_temp_path $WORK;
  scgi_temp_path $WORK;
  keepalive_requests 1000000;
$2
}
EOC
}
nginx_conf nginx "  server {
$(for p in "${ENGINE_PORTS[@]}"; do echo "    listen 127.0.0.1:$p;"; done)
    location / { default_type application/json; return 200 '$COMPLETION'; }
  }" >"$WORK/nginx.conf"
"$NGINX" -p "$WORK" -c "$WORK/nginx.conf" >"$OUT/logs/nginx.log" 2>&1 &
NGINX_PID=$!
PIDS+=("$NGINX_PID")
ENGINE="http://127.0.0.1:$ENGINE_PORT"
ENGINE_URLS=()
for p in "${ENGINE_PORTS[@]}"; do ENGINE_URLS+=("http://127.0.0.1:$p"); done
wait_http "${ENGINE_URLS[-1]}/health" "$NGINX_PID" nginx
# The fleet as kvgate's arguments: --endpoint URL,model=M for each engine port.
KVGATE_FLEET=()
for u in "${ENGINE_URLS[@]}"; do KVGATE_FLEET+=(--endpoint "$u,model=$MODEL"); done

# CPU ticks (user + system) of the target's process and its direct children; empty for direct.
cpu_ticks() {
  [[ $1 == direct ]] && return 0
  local p sum=0
  for p in "$TPID" $(pgrep -P "$TPID" || true); do
    [[ -r /proc/$p/stat ]] && sum=$((sum + $(awk '{print $14 + $15}' "/proc/$p/stat")))
  done
  echo "$sum"
}

start_target() { # NAME -> sets URL, TPID
  local name=$1 port prom logf="$OUT/logs/$1.log"
  port=$(free_port); prom=$(free_port)
  URL="http://127.0.0.1:$port"
  local wrap=()
  ((INSTRUCTIONS == 0)) ||
    wrap=(valgrind --tool=callgrind "--callgrind-out-file=$OUT/logs/$name.callgrind")
  case $name in
    direct) URL=$ENGINE; TPID=$NGINX_PID; return 0 ;;
    nginx-proxy)
      ((INSTRUCTIONS == 0)) || die "nginx-proxy has no instruction count (run it without --instructions)"
      nginx_conf nginx-proxy "  upstream engine {
$(for p in "${ENGINE_PORTS[@]}"; do echo "    server 127.0.0.1:$p;"; done)
    keepalive 64;
  }
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      client_body_buffer_size 64k;
    }
  }" >"$WORK/nginx-proxy.conf"
      "$NGINX" -p "$WORK" -c "$WORK/nginx-proxy.conf" >"$logf" 2>&1 & ;;
    vllm-rr)
      "${wrap[@]}" "$PEERS_VENV/bin/python3" "$PEERS_VENV/bin/vllm-router" --host 127.0.0.1 \
        --port "$port" --prometheus-host 127.0.0.1 --prometheus-port "$prom" \
        --worker-urls "${ENGINE_URLS[@]}" --policy round_robin --log-level warning >"$logf" 2>&1 & ;;
    smg-rr|smg-cache)
      local policy=round_robin
      [[ $name == smg-cache ]] && policy=cache_aware
      "${wrap[@]}" "$PEERS_VENV/bin/python3" "$PEERS_VENV/bin/smg" launch --host 127.0.0.1 \
        --port "$port" --prometheus-host 127.0.0.1 --prometheus-port "$prom" \
        --worker-urls "${ENGINE_URLS[@]}" --policy "$policy" --log-level warn >"$logf" 2>&1 & ;;
    kvgate|kvgate-info)
      local level=warn
      [[ $name == kvgate-info ]] && level=info
      env KVGATE_LOG=$level "${wrap[@]}" "$KVGATE" serve --listen "127.0.0.1:$port" \
        --admin-listen "127.0.0.1:$prom" "${KVGATE_FLEET[@]}" >"$logf" 2>&1 & ;;
    kvgate-tok)
      # KV-event endpoints where nothing publishes: precise mode, so every request is
      # tokenized and looked up; the index stays empty.
      local fleet=() u
      for u in "${ENGINE_URLS[@]}"; do fleet+=(--endpoint "$u,model=$MODEL,kv=tcp://127.0.0.1:$(free_port)"); done
      env KVGATE_LOG=warn "${wrap[@]}" "$KVGATE" serve --listen "127.0.0.1:$port" \
        --admin-listen "127.0.0.1:$prom" "${fleet[@]}" \
        --tokenizer "$MODEL=$TOKENIZER_DIR" >"$logf" 2>&1 & ;;
    hyper-bare)
      "${wrap[@]}" "$BARE" "127.0.0.1:$port" "$ENGINE" >"$logf" 2>&1 & ;;
    hyper-bare-per-core)
      "${wrap[@]}" "$BARE" "127.0.0.1:$port" "$ENGINE" --per-core >"$logf" 2>&1 & ;;
    *) die "unknown target $name" ;;
  esac
  TPID=$!
  PIDS+=("$TPID")
  # Ready once a real request goes through (the peers take a moment to see the worker).
  local i
  for ((i = 0; i < 6000; i++)); do
    if curl -fsS -m 5 -o /dev/null -H 'content-type: application/json' --data-binary "@$WORK/body.json" \
      "$URL/v1/chat/completions" 2>/dev/null; then
      return 0
    fi
    kill -0 "$TPID" 2>/dev/null || die "$name exited (logs in $logf)"
    sleep 0.1
  done
  die "$name did not forward a request (logs in $logf)"
}

stop_target() {
  [[ $1 == direct ]] && return 0
  kill "$TPID" 2>/dev/null || true
  local i
  for ((i = 0; i < 100; i++)); do
    kill -0 "$TPID" 2>/dev/null || break
    sleep 0.1
  done
  kill -9 "$TPID" 2>/dev/null || true
  wait "$TPID" 2>/dev/null || true
}

if ((INSTRUCTIONS > 0)); then
  hey_n() { hey -n "$1" -c 4 -m POST -T application/json -D "$WORK/body.json" "$URL/v1/chat/completions"; }
  {
    echo "# Router instructions per request (callgrind, user space, all threads)"
    echo
    echo "kvgate $(git rev-parse --short HEAD)$(git diff --quiet || echo ', dirty tree'); body $BODY_BYTES bytes;" \
      "$INSTRUCTIONS requests after a 200-request warm-up, hey -c 4"
    echo
    echo "| target | instructions per request | non-200 |"
    echo "|---|---|---|"
  } >"$OUT/instructions.md"
  for t in "${TARGETS[@]}"; do
    [[ $t == direct ]] && continue
    rm -f "$OUT/logs/$t.callgrind"*
    start_target "$t"
    hey_n 200 >/dev/null
    callgrind_control -z "$TPID" >/dev/null
    hey_n "$INSTRUCTIONS" >"$OUT/logs/$t.hey.txt"
    callgrind_control -d "$TPID" >/dev/null
    stop_target "$t"
    total=$(awk '/^summary:/{print $2; exit}' "$OUT/logs/$t.callgrind.1")
    bad=$(awk '$1 ~ /^\[[0-9]+\]$/ && $1 != "[200]" {s += $2} END {print s + 0}' "$OUT/logs/$t.hey.txt")
    echo "| $t | $((total / INSTRUCTIONS)) | $bad |" | tee -a "$OUT/instructions.md"
  done
  echo; cat "$OUT/instructions.md"
  exit 0
fi

RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); host: $(uname -sr), $(nproc) cores; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "kvgate: $KVGATE ($(git rev-parse --short HEAD)$(git diff --quiet || echo ', dirty tree'))"
  echo "peers: $("$PEERS_VENV/bin/python" -m pip list 2>/dev/null | awk '$1=="vllm-router"||$1=="sglang-router"{printf "%s==%s ", $1, $2}')"
  echo "engine: nginx $("$NGINX" -v 2>&1 | sed 's|.*/||'), 1 worker, a fixed completion, on $ENGINES port(s) (the routers' fleet); body $BODY_BYTES bytes"
  echo "load: wrk -t1 -c16 -d${DURATION}s --latency$( ((UNIQUE)) && echo ', a unique body per request'); hey -z ${DURATION}s at 500 req/s, -c 1 -q 500 (evenly spaced) and -c 10 -q 50 (bursts of 10); $ROUNDS rounds, round 2 reversed"
} >"$OUT/meta.txt"
cat "$OUT/meta.txt"

for ((round = 1; round <= ROUNDS; round++)); do
  order=("${TARGETS[@]}")
  if ((round % 2 == 0)); then
    order=(); for ((i = ${#TARGETS[@]} - 1; i >= 0; i--)); do order+=("${TARGETS[i]}"); done
  fi
  for t in "${order[@]}"; do
    start_target "$t"
    wrk -t1 -c16 -d1s -s "$WORK/post.lua" "$URL/v1/chat/completions" -- "w$round" >/dev/null 2>&1 # warm-up
    ticks_before=$(cpu_ticks "$t")
    wrk -t1 -c16 -d"${DURATION}s" --latency -s "$WORK/post.lua" "$URL/v1/chat/completions" -- "m$round" \
      >"$OUT/logs/$t.r$round.wrk.txt" 2>&1
    ticks_after=$(cpu_ticks "$t")
    hey -z "${DURATION}s" -c 1 -q 500 -m POST -T application/json -D "$WORK/body.json" \
      "$URL/v1/chat/completions" >"$OUT/logs/$t.r$round.hey-even.txt" 2>&1
    hey -z "${DURATION}s" -c 10 -q 50 -m POST -T application/json -D "$WORK/body.json" \
      "$URL/v1/chat/completions" >"$OUT/logs/$t.r$round.hey.txt" 2>&1
    stop_target "$t"
    python3 - "$t" "$round" "$OUT/logs/$t.r$round.wrk.txt" "$OUT/logs/$t.r$round.hey.txt" \
      "$ticks_before" "$ticks_after" "$(getconf CLK_TCK)" "$OUT/logs/$t.r$round.hey-even.txt" >>"$RESULTS" <<'EOF'
import json, re, sys
name, rnd, wrk_path, hey_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ticks = (sys.argv[5], sys.argv[6])
clk_tck = float(sys.argv[7])
wrk, hey, even = open(wrk_path).read(), open(hey_path).read(), open(sys.argv[8]).read()
def ms(v, unit):
    return float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
def wrk_pct(p):
    m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", wrk, re.M)
    return ms(*m.groups()) if m else None
def hey_pct(p, text=hey):
    m = re.search(rf"^\s+{p}% in ([\d.]+) secs", text, re.M)
    return float(m.group(1)) * 1e3 if m else None
rps = re.search(r"Requests/sec:\s+([\d.]+)", wrk)
non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", wrk)
errs = re.search(r"Socket errors: (.*)", wrk)
hey_rps = re.search(r"Requests/sec:\s+([\d.]+)", hey)
even_rps = re.search(r"Requests/sec:\s+([\d.]+)", even)
done = re.search(r"^\s*(\d+) requests in", wrk, re.M)
cpu_us = None
if all(ticks) and done and int(done.group(1)) > 0:
    cpu_us = (int(ticks[1]) - int(ticks[0])) / clk_tck / int(done.group(1)) * 1e6
codes = {}
for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", hey + even):
    codes[int(c)] = codes.get(int(c), 0) + int(n)
print(json.dumps({"target": name, "round": rnd,
    "wrk_rps": float(rps.group(1)) if rps else None,
    "wrk_p50_ms": wrk_pct(50), "wrk_p99_ms": wrk_pct(99),
    "wrk_non2xx": int(non2xx.group(1)) if non2xx else 0, "wrk_socket_errors": errs.group(1) if errs else None,
    "cpu_us_per_request": cpu_us,
    "hey_rps": float(hey_rps.group(1)) if hey_rps else None,
    "hey_p50_ms": hey_pct(50), "hey_p99_ms": hey_pct(99),
    "even_rps": float(even_rps.group(1)) if even_rps else None,
    "even_p50_ms": hey_pct(50, even), "even_p99_ms": hey_pct(99, even), "hey_codes": codes}))
EOF
    tail -1 "$RESULTS"
  done
done

python3 - "$RESULTS" "$OUT/meta.txt" >"$OUT/report.md" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
targets = list(dict.fromkeys(r["target"] for r in rows))
def med(t, k):
    v = [r[k] for r in rows if r["target"] == t and r[k] is not None]
    return statistics.median(v) if v else None
def each(t, k, fmt):
    return ", ".join(fmt.format(r[k]) if r[k] is not None else "?" for r in rows if r["target"] == t)
print("# Proxy path side by side\n")
print(open(sys.argv[2]).read())
print("| target | wrk req/s (each round) | wrk p50 / p99 ms (median) | 500/s evenly spaced: p50 / p99 ms (req/s held) | 500/s in bursts of 10: p50 / p99 ms | router CPU µs per request (each round) | non-2xx |")
print("|---|---|---|---|---|---|---|")
for t in targets:
    bad = sum(r["wrk_non2xx"] + sum(n for c, n in r["hey_codes"].items() if int(c) != 200) for r in rows if r["target"] == t)
    cpu = "—" if t == "direct" else each(t, "cpu_us_per_request", "{:.1f}")
    print(f"| {t} | {each(t, 'wrk_rps', '{:,.0f}')} | {med(t, 'wrk_p50_ms'):.2f} / {med(t, 'wrk_p99_ms'):.2f} "
          f"| {med(t, 'even_p50_ms'):.2f} / {med(t, 'even_p99_ms'):.2f} ({med(t, 'even_rps'):.0f}) "
          f"| {med(t, 'hey_p50_ms'):.2f} / {med(t, 'hey_p99_ms'):.2f} | {cpu} | {bad} |")
def ratio(a, b, k):
    x, y = med(a, k), med(b, k)
    return None if x is None or y is None or y == 0 else x / y
print("\nRatios of medians:")
for a, b in [("kvgate", "vllm-rr"), ("kvgate", "direct"), ("kvgate", "nginx-proxy"), ("kvgate", "hyper-bare"), ("kvgate", "hyper-bare-per-core"), ("hyper-bare-per-core", "hyper-bare"), ("kvgate-tok", "smg-cache"), ("kvgate-info", "kvgate")]:
    if a in targets and b in targets:
        print(f"- {a} / {b} req/s: {ratio(a, b, 'wrk_rps'):.2f}x")
for a, b in [("kvgate", "vllm-rr"), ("kvgate", "hyper-bare"), ("hyper-bare-per-core", "hyper-bare"), ("kvgate-tok", "smg-cache"), ("kvgate-info", "kvgate")]:
    if a in targets and b in targets and ratio(a, b, "cpu_us_per_request"):
        print(f"- {a} / {b} CPU per request: {ratio(a, b, 'cpu_us_per_request'):.2f}x")
if {"kvgate", "vllm-rr", "direct"} <= set(targets):
    d = med("direct", "wrk_p50_ms")
    print(f"- added wrk p50 over direct: kvgate {med('kvgate', 'wrk_p50_ms') - d:.2f} ms, "
          f"vllm-router {med('vllm-rr', 'wrk_p50_ms') - d:.2f} ms "
          f"({(med('kvgate', 'wrk_p50_ms') - d) / max(1e-9, med('vllm-rr', 'wrk_p50_ms') - d):.2f}x)")
EOF
echo
cat "$OUT/report.md"

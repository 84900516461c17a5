#!/usr/bin/env bash
# Added latency of kvgate as an Envoy ext_proc endpoint picker, measured in one run against
# a fixed upstream (nginx answering every request with the same small chat completion):
#   direct        the client talks to nginx
#   envoy         Envoy alone, one static cluster (nginx)
#   envoy+epp     Envoy with kvgate's ext_proc filter (deploy/envoy/envoy-standalone.yaml,
#                 FULL_DUPLEX_STREAMED bodies) and the ORIGINAL_DST cluster kvgate's pick selects
#   kvgate        kvgate serve, the standalone proxy
# kvgate routes on load (no tokenizer), so the figures are the front doors' cost. Every target
# gets `wrk -t1 -c16` for --seconds and `hey` at a fixed rate (--rate req/s over 16 workers);
# the target order reverses in the second round. Prints a table of medians over the rounds.
#
#   scripts/epp_latency.sh [--kvgate BIN] [--envoy BIN] [--seconds N] [--rate R] [--rounds N]
# Needs: nginx, wrk, hey (Debian packages nginx-light, wrk, hey) and Envoy 1.40
# (scripts/ci_envoy.sh). Benchmark only: no test calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

KVGATE=target/release/kvgate
ENVOY=${KVGATE_ENVOY:-}
SECONDS_EACH=6
RATE=500
ROUNDS=2
while [[ $# -gt 0 ]]; do
  case $1 in
    --kvgate) KVGATE=$2; shift 2 ;;
    --envoy) ENVOY=$2; shift 2 ;;
    --seconds) SECONDS_EACH=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[[ -n $ENVOY ]] || ENVOY=$(command -v envoy || true)
for tool in nginx wrk hey; do
  command -v "$tool" >/dev/null || { echo "needs $tool (apt-get install nginx-light wrk hey)" >&2; exit 1; }
done
[[ -x $ENVOY ]] || { echo "needs Envoy: export KVGATE_ENVOY=\$(bash scripts/ci_envoy.sh)" >&2; exit 1; }
[[ -x $KVGATE ]] || { echo "needs $KVGATE (cargo build --release -p kvgate)" >&2; exit 1; }

DIR=$(mktemp -d /tmp/kvgate-epp-latency.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

NGINX=18100 ENVOY_ALONE=18101 ENVOY_EPP=18102 EPP_GRPC=18103 EPP_ADMIN=18104 SERVE=18105 SERVE_ADMIN=18106

# ---- the fixed upstream
cat > "$DIR/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $DIR/nginx.pid;
error_log $DIR/nginx.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_buffer_size 64k;
  server {
    listen 127.0.0.1:$NGINX;
    keepalive_requests 1000000;
    location / {
      default_type application/json;
      return 200 '{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":600,"completion_tokens":1,"total_tokens":601}}';
    }
  }
}
EOF
nginx -c "$DIR/nginx.conf" -p "$DIR" & PIDS+=($!)

# ---- Envoy alone
cat > "$DIR/envoy-alone.yaml" <<EOF
admin: { address: { socket_address: { address: 127.0.0.1, port_value: 19101 } } }
static_resources:
  listeners:
  - name: plain
    address: { socket_address: { address: 127.0.0.1, port_value: $ENVOY_ALONE } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: plain
          route_config:
            virtual_hosts: [{ name: all, domains: ["*"], routes: [{ match: { prefix: "/" }, route: { cluster: upstream } }] }]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: $NGINX } } } }] }]
EOF
"$ENVOY" -c "$DIR/envoy-alone.yaml" --base-id 11 --concurrency 1 -l error > "$DIR/envoy-alone.log" 2>&1 & PIDS+=($!)

# ---- Envoy + kvgate ext_proc: the example config with this run's ports
sed -e "s/port_value: 8081/port_value: $ENVOY_EPP/" -e "s/port_value: 19000/port_value: 19102/" \
    -e "s/port_value: 9002/port_value: $EPP_GRPC/" \
    -e "s/address: 10.0.0.1[12], port_value: 8000/address: 127.0.0.1, port_value: $NGINX/" \
    -e "s/address: 0.0.0.0, port_value/address: 127.0.0.1, port_value/" \
    deploy/envoy/envoy-standalone.yaml > "$DIR/envoy-epp.yaml"
"$ENVOY" -c "$DIR/envoy-epp.yaml" --base-id 12 --concurrency 1 -l error > "$DIR/envoy-epp.log" 2>&1 & PIDS+=($!)
KVGATE_LOG=warn "$KVGATE" epp --listen "127.0.0.1:$EPP_GRPC" --admin-listen "127.0.0.1:$EPP_ADMIN" \
  --endpoint "http://127.0.0.1:$NGINX" > "$DIR/epp.log" 2>&1 & PIDS+=($!)

# ---- kvgate standalone
KVGATE_LOG=warn "$KVGATE" serve --listen "127.0.0.1:$SERVE" --admin-listen "127.0.0.1:$SERVE_ADMIN" \
  --endpoint "http://127.0.0.1:$NGINX" > "$DIR/serve.log" 2>&1 & PIDS+=($!)

# ---- the request: a 2.4 KB chat body
python3 - "$DIR/body.json" <<'PY'
import json, sys
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega ").split()
text = " ".join(words[i % len(words)] for i in range(400))
body = {"model": "m", "messages": [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": text}], "max_tokens": 1, "temperature": 1.0}
open(sys.argv[1], "w").write(json.dumps(body, indent=1))
PY
cat > "$DIR/post.lua" <<EOF
local f = io.open("$DIR/body.json", "rb"); wrk.body = f:read("*a"); f:close()
wrk.method = "POST"; wrk.headers["Content-Type"] = "application/json"
EOF

URLS=(direct="http://127.0.0.1:$NGINX/v1/chat/completions"
      envoy="http://127.0.0.1:$ENVOY_ALONE/v1/chat/completions"
      envoy+epp="http://127.0.0.1:$ENVOY_EPP/v1/chat/completions"
      kvgate="http://127.0.0.1:$SERVE/v1/chat/completions")

# Every target answers 200 before measuring (Envoy marks kvgate healthy after its first
# gRPC health check; kvgate needs its endpoint healthy).
for spec in "${URLS[@]}"; do
  url=${spec#*=}
  for _ in $(seq 1 100); do
    code=$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' \
      --data-binary @"$DIR/body.json" "$url" || true)
    [[ $code == 200 ]] && break
    sleep 0.2
  done
  [[ $code == 200 ]] || { echo "${spec%%=*} never answered 200 (last: $code); logs in $DIR" >&2; exit 1; }
done

ms() { # wrk/hey latency text (e.g. 1.23ms, 850.00us, 0.0012 secs) -> ms
  python3 -c "import sys,re
v=sys.argv[1]
m=re.match(r'([0-9.]+)(us|ms|s)?',v); x=float(m.group(1)); u=m.group(2) or 's'
print(round(x/1000 if u=='us' else x if u=='ms' else x*1000,3))" "$1"
}
RESULTS="$DIR/results.tsv"
: > "$RESULTS"
for round in $(seq 1 "$ROUNDS"); do
  order=("${URLS[@]}")
  if (( round % 2 == 0 )); then order=(); for ((i=${#URLS[@]}-1; i>=0; i--)); do order+=("${URLS[i]}"); done; fi
  for spec in "${order[@]}"; do
    name=${spec%%=*} url=${spec#*=}
    out=$(wrk -t1 -c16 -d"${SECONDS_EACH}s" --latency -s "$DIR/post.lua" "$url")
    rps=$(awk '/^Requests\/sec/ {print $2}' <<<"$out")
    p50=$(ms "$(awk '$1=="50%" {print $2}' <<<"$out")")
    p99=$(ms "$(awk '$1=="99%" {print $2}' <<<"$out")")
    non2xx=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
    out=$(hey -z "${SECONDS_EACH}s" -c 16 -q $((RATE / 16)) -m POST -T application/json -D "$DIR/body.json" "$url")
    hp50=$(awk '/ 50% in/ {print $3}' <<<"$out"); hp99=$(awk '/ 99% in/ {print $3}' <<<"$out")
    hp50=$(python3 -c "print(round(float('$hp50')*1000,3))"); hp99=$(python3 -c "print(round(float('$hp99')*1000,3))")
    hbad=$(awk '/^Status code distribution/ {f=1; next} f && /\[/ && $1 != "[200]" {s+=$2} END {print s+0}' <<<"$out")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$name" "$rps" "$p50" "$p99" "$hp50" "$hp99" "${non2xx:-0}" "$hbad" >> "$RESULTS"
    echo "round $round $name: wrk c16 $rps req/s p50 $p50 ms p99 $p99 ms (non-2xx ${non2xx:-0}); hey ${RATE}/s p50 $hp50 ms p99 $hp99 ms (non-200 $hbad)" >&2
  done
done

python3 - "$RESULTS" "$RATE" <<'PY'
import sys, statistics as st
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
rate = sys.argv[2]
names = []
for r in rows:
    if r[1] not in names: names.append(r[1])
med = lambda xs: st.median(float(x) for x in xs)
base = {}
print(f"| target | wrk c16 req/s | wrk p50 ms | wrk p99 ms | hey {rate}/s p50 ms | hey {rate}/s p99 ms | errors |")
print("|---|---|---|---|---|---|---|")
for n in names:
    rs = [r for r in rows if r[1] == n]
    cells = [med(r[2] for r in rs), med(r[3] for r in rs), med(r[4] for r in rs), med(r[5] for r in rs), med(r[6] for r in rs)]
    errs = sum(int(float(r[7] or 0)) + int(float(r[8] or 0)) for r in rs)
    print(f"| {n} | {cells[0]:,.0f} | {cells[1]:.3f} | {cells[2]:.3f} | {cells[3]:.3f} | {cells[4]:.3f} | {errs} |")
print(f"\nmedians of {len(rows)//len(names)} rounds, target order reversed every other round")
PY

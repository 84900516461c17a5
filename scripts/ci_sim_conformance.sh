#!/usr/bin/env bash
# KV-event conformance of `kvgate sim` against vLLM's wire format, checked from Python
# (pyzmq + msgspec strict decoding), for both event encodings.
#
# Usage: scripts/ci_sim_conformance.sh            (builds the sim, creates a venv)
# Env:   SIM_BIN=path      the kvgate binary to run as `kvgate sim` (default: build it)
#        SIM_VENV=dir      venv location (default: $TARGET/sim-conformance-venv)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
VENV=${SIM_VENV:-$TARGET/sim-conformance-venv}
TEST=$ROOT/crates/kvgate-sim/tests/conformance/test_kv_events.py

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check pyzmq msgspec

if [ -z "${SIM_BIN:-}" ]; then
  (cd "$ROOT" && cargo build --quiet -p kvgate)
  SIM_BIN=$TARGET/debug/kvgate
fi

free_port() { "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

SIM_PID=""
cleanup() { if [ -n "$SIM_PID" ]; then kill "$SIM_PID" 2>/dev/null || true; wait "$SIM_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT

status=0
for enc in map array; do
  http=$(free_port); ev=$(free_port); rp=$(free_port)
  "$SIM_BIN" sim --port "$http" --num-gpu-blocks 64 --itl-ms 0.2 --prefill-base-ms 1 \
    --kv-events-endpoint "tcp://*:$ev" --kv-events-replay-endpoint "tcp://*:$rp" \
    --kv-events-encoding "$enc" >"$TARGET/sim-conformance-$enc.log" 2>&1 &
  SIM_PID=$!
  ready=0
  for _ in $(seq 1 300); do
    if "$VENV/bin/python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$http/health', timeout=1)" 2>/dev/null; then
      ready=1; break
    fi
    if ! kill -0 "$SIM_PID" 2>/dev/null; then break; fi
    sleep 0.1
  done
  if [ "$ready" != 1 ]; then
    echo "sim did not become ready ($enc); log:"; cat "$TARGET/sim-conformance-$enc.log"; exit 1
  fi
  echo "== kv events conformance, encoding=$enc"
  SIM_HTTP="http://127.0.0.1:$http" SIM_EVENTS="tcp://127.0.0.1:$ev" SIM_REPLAY="tcp://127.0.0.1:$rp" \
    SIM_ENCODING="$enc" "$VENV/bin/python" "$TEST" || status=1
  cleanup; SIM_PID=""
done
exit $status

#!/usr/bin/env bash
# Live token-parity check against a REAL vLLM 0.33 render server.
#  1. runs ../shared/tools/vllm-render/setup.sh (idempotent; SKIPPED if it cannot download)
#  2. starts serve.sh in the background on $PORT (default 8765), waits for /health
#  3. (a) `kvgate parity` over testdata/parity against the live server: zero divergences
#     (b) `cargo test -p kvgate-tokenize --test render_live -- --ignored` with KVGATE_RENDER_URL
# The server is killed on exit. Env: PORT, VLLM_RENDER_TOOLS, CARGO_TARGET_DIR, READY_TIMEOUT (s).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
TOOLS="${VLLM_RENDER_TOOLS:-$ROOT/../shared/tools/vllm-render}"
PORT="${PORT:-8765}"
URL="http://127.0.0.1:$PORT"
LOG_DIR="$(mktemp -d)"

if [ ! -x "$TOOLS/setup.sh" ]; then
  echo "SKIPPED (no vLLM render tools at $TOOLS)"; exit 0
fi
if ! NO_SMOKE=1 "$TOOLS/setup.sh" > "$LOG_DIR/setup.log" 2>&1; then
  if grep -qiE "could not|connection|resolve|network|No matching distribution|HTTP error|Temporary failure" "$LOG_DIR/setup.log"; then
    echo "SKIPPED (vLLM render setup could not download its packages; see $LOG_DIR/setup.log)"; exit 0
  fi
  echo "vLLM render setup failed:"; tail -20 "$LOG_DIR/setup.log"; exit 1
fi

"$TOOLS/serve.sh" "$PORT" > "$LOG_DIR/serve.log" 2>&1 &
SERVER_PID=$!
cleanup() { kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

deadline=$(( $(date +%s) + ${READY_TIMEOUT:-300} ))
until curl -sf "$URL/health" > /dev/null 2>&1; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "render server exited:"; tail -30 "$LOG_DIR/serve.log"; exit 1; fi
  if [ "$(date +%s)" -ge "$deadline" ]; then echo "render server not ready in time"; tail -30 "$LOG_DIR/serve.log"; exit 1; fi
  sleep 1
done
echo "render server ready at $URL"

# (a) `kvgate parity` over the whole corpus against the live server: zero divergences
cargo run -q -p kvgate -- parity --tokenizer testdata/tokenizers/qwen3 --render "$URL" testdata/parity

# (b) the render backend against the live server returns the goldens
KVGATE_RENDER_URL="$URL" cargo test -q -p kvgate-tokenize --test render_live -- --ignored
echo "ci_render_live: OK"

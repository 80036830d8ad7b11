#!/usr/bin/env bash
# Set everything up on a fresh machine, then run lint and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The docs site: a broken link or anchor, or a page outside the nav, fails it.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
# Every form of the C kernels and their sanitized builds, built once (cached by sources): the
# kernel tests load them all.
.venv/bin/python -m minisgl.kernel.build
bash scripts/setup_sglang_router.sh  # tests/test_dp.py puts it in front of two replicas
exec .venv/bin/python -m pytest -q tests "$@"

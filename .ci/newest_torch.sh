#!/usr/bin/env bash
# The whole test suite on the newest torch release the package index offers: what a plain
# `pip install torch` gives users today (on Linux, PyPI's CUDA build, about 5 GB installed; the
# tests run it on the CPU). A throwaway venv outside the checkout, removed at the end.
# TORCH_SPEC overrides the requirement, e.g. TORCH_SPEC='torch==2.15.0' to reproduce a run.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
# shellcheck disable=SC1091
. "$tmp/venv/bin/activate"
# Some machines cap torch in a pip constraints file at the builds they keep on disk: lift it here
# only, so that pip resolves the index's newest release (and keeps it for the dev extras).
export PIP_CONSTRAINT=/dev/null
pip install --no-cache-dir --upgrade "${TORCH_SPEC:-torch}"
pip install --no-cache-dir -e ".[dev]"
python -c 'import torch; print("newest torch:", torch.__version__)'
python -m pytest -q

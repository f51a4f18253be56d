#!/usr/bin/env bash
# Set up .venv with everything moeserve needs. Safe to run again: steps already done are
# skipped, so a second run takes seconds.
#
#   1. create .venv (with $PYTHON, default python3; 3.10 or newer) if it is missing
#   2. torch==2.13.0 first, so the CPU build is used and nothing pulls a CUDA build
#   3. this project, editable, with its test and bench extras
#   4. xgrammar with --no-deps: its declared dependency triton (~1 GB) is unused on CPU;
#      the dependencies it really needs are in pyproject.toml
#   5. Debian's chromium for the playground's browser tests (Playwright drives it; its own
#      browser download is not used), where apt-get can install it; without it those tests skip
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_VERSION="2.13.0"
XGRAMMAR_VERSION="0.2.9"
PYTHON="${PYTHON:-python3}"
VENV=".venv"
STAMP="$VENV/.moeserve-install-stamp"

say() { echo "setup: $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "moeserve needs Python 3.10 or newer"'
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"

installed_version() {  # installed_version DIST -> version, or nothing
    "$py" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

torch_now="$(installed_version torch)"
if [ "${torch_now%%+*}" != "$TORCH_VERSION" ]; then
    say "installing torch==$TORCH_VERSION (found: ${torch_now:-none})"
    "$py" -m pip install "torch==$TORCH_VERSION"
fi

# Reinstall the project only when its dependency list changed or the install is gone.
want_stamp="$(sha256sum pyproject.toml | cut -d' ' -f1)"
have_stamp="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$want_stamp" != "$have_stamp" ] || [ ! -x "$VENV/bin/moeserve" ] || [ -z "$(installed_version moeserve)" ]; then
    say "installing moeserve (editable) with its test and bench extras"
    "$py" -m pip install -e ".[test,bench]"
    echo "$want_stamp" >"$STAMP"
fi

if [ "$(installed_version xgrammar)" != "$XGRAMMAR_VERSION" ]; then
    say "installing xgrammar==$XGRAMMAR_VERSION without its dependencies"
    "$py" -m pip install --no-deps "xgrammar==$XGRAMMAR_VERSION"
fi

if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing chromium (browser tests)"
    apt_get() { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get "$@" >/dev/null; }
    if ! { apt_get install -y -q --no-install-recommends chromium \
           || { apt_get update -q && apt_get install -y -q --no-install-recommends chromium; }; }; then
        say "chromium could not be installed: the browser tests will skip"
    fi
fi

"$py" -c 'import torch, transformers, xgrammar, moeserve' || {
    say "the environment in $VENV does not import; delete $VENV and run again"
    exit 1
}
say "ready: torch $(installed_version torch), transformers $(installed_version transformers), ray $(installed_version ray)"

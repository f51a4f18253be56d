#!/usr/bin/env bash
# Lint, then run the whole test suite. Extra arguments go to pytest, e.g.
#   scripts/test.sh tests/test_sampler.py -x
# Needs the environment from scripts/setup.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ ! -x .venv/bin/python ]; then
    echo "test: no .venv here; run scripts/setup.sh first" >&2
    exit 1
fi
# shellcheck disable=SC1091
source .venv/bin/activate

# Local Ray clusters for tests: no token auth (on by default since Ray 2.5x), no usage
# reporting, and no run-time environment packaging.
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
# Everything is local: never reach for a model hub.
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1
# Tokenizers' own thread pool warns (and can deadlock) when Ray or pytest forks.
export TOKENIZERS_PARALLELISM=false

ruff check .
# Two workers (pytest-xdist); the tests that start Ray or Serve run on one of them in turn
# (tests/conftest.py). MOESERVE_TEST_WORKERS=0 runs everything in this process.
python -m pytest -n "${MOESERVE_TEST_WORKERS:-2}" --dist loadgroup "$@"

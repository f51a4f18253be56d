#!/usr/bin/env bash
# Set everything up, then run moeserve. Arguments go to the `moeserve` command; with none,
# it starts the server on the demo models (HTTP :8000, gRPC :9000), streams one
# JSON-schema-constrained demo answer, and keeps serving until Ctrl-C:
#   scripts/run.sh
#   scripts/run.sh generate "Is the mawa cake eggless?" --max-tokens 64 --temperature 0.7 --seed 1
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- serve --demo
fi
exec .venv/bin/moeserve "$@"

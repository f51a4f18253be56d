#!/usr/bin/env bash
# Set everything up, then run moeserve. Arguments go to the `moeserve` command; with none,
# the demo model answers one bakery question:
#   scripts/run.sh
#   scripts/run.sh generate "Is the mawa cake eggless?" --max-tokens 64 --temperature 0.7 --seed 1
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- generate "Do you have mawa cake today?"
fi
exec .venv/bin/moeserve "$@"

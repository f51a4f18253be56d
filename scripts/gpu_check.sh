#!/usr/bin/env bash
# What one GPU can check, in at most 8 minutes (each step has its own time limit):
#   1. tests/gpu: bf16 vs fp32 at every greedy token, CUDA graphs, NCCL groups, the padded all-to-all
#   2. python -m bench.gpu: decode at batch 1 and 64, eager and compiled, against the HBM roofline
#   3. the demo served on cuda (moeserve serve) answering one JSON-schema-constrained streamed request
# Writes bench/reports/gpu.md (with bench/reports/gpu-decode.{md,json} from step 2) and exits
# non-zero if any step failed. Without a GPU it stops at once, saying what is missing.
# Needs the environment from scripts/setup.sh, with a CUDA build of torch.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

die() { echo "gpu_check: $*" >&2; exit 2; }
[ -x .venv/bin/python ] || die "no .venv here; run scripts/setup.sh first"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
    || die "no NVIDIA GPU on this machine (nvidia-smi is missing or sees no device)"
# shellcheck disable=SC1091
source .venv/bin/activate
python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "torch $(python -c 'import torch; print(torch.__version__)') in .venv sees no GPU: install a CUDA build of torch there"

export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
logs="$(mktemp -d)"
failed=0
declare -A status seconds

step() {  # step NAME LIMIT_S COMMAND...: run it, its output to $logs/NAME.log and the terminal
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name (at most ${limit} s)"
    if timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logs/$name.log"; then
        status[$name]=passed
    else
        status[$name]="FAILED (exit ${PIPESTATUS[0]}; 124: over its limit)"
        failed=1
    fi
    seconds[$name]=$((SECONDS - t0))
}

serve_demo() {  # serve on cuda, wait for the demo's streamed reply, check it against the schema, stop
    printf 'engine: {device: cuda}\ndeployments: {engine: {num_gpus: 1}}\n' >"$logs/gpu.yaml"
    moeserve serve --config "$logs/gpu.yaml" --demo --num-cpus 8 >"$logs/serve.out" 2>&1 &
    local pid=$! rc=3
    while [ "$rc" = 3 ] && kill -0 "$pid" 2>/dev/null; do
        sleep 2
        python - "$logs/serve.out" <<'EOF'
import json, sys
import jsonschema
from deployments.local import DEMO_SCHEMA
lines = open(sys.argv[1]).read().split("demo: POST", 1)[-1].splitlines()[1:]
reply = next((line.strip() for line in lines if line.strip()), "")
if not reply.endswith("}"):
    sys.exit(3)  # not answered yet
jsonschema.validate(json.loads(reply), DEMO_SCHEMA)
EOF
        rc=$?
    done
    kill "$pid" 2>/dev/null
    wait "$pid"
    cat "$logs/serve.out"
    [ "$rc" = 0 ]
}
export -f serve_demo
export logs

step tests 180 python -m pytest tests/gpu -q -rs
step bench 210 python -m bench.gpu --name gpu-decode
step serve 90 bash -c serve_demo

gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
{
    echo "# GPU check: $gpu"
    echo
    echo "\`scripts/gpu_check.sh\` on $(date -u +%Y-%m-%d), torch $(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')."
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---|"
    for s in tests bench serve; do echo "| $s | ${status[$s]} | ${seconds[$s]} |"; done
    echo
    echo "## tests/gpu"
    echo; echo '```'; tail -n 15 "$logs/tests.log"; echo '```'; echo
    echo "## Decode against the HBM roofline (python -m bench.gpu)"
    echo
    if [ -f bench/reports/gpu-decode.md ] && [ "${status[bench]}" = passed ]; then
        tail -n +2 bench/reports/gpu-decode.md
    else
        echo '```'; tail -n 15 "$logs/bench.log"; echo '```'
    fi
    echo
    echo "## The demo served on cuda, one constrained streamed request"
    echo; echo '```'; grep -A3 "demo: POST" "$logs/serve.out" || tail -n 15 "$logs/serve.out"; echo '```'
} >bench/reports/gpu.md
echo "gpu_check: report in bench/reports/gpu.md; logs in $logs"
exit $failed

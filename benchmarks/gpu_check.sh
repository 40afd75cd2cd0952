#!/usr/bin/env bash
# The prepared check for a lent GPU machine (docs/performance.md, "GPU"): run from the repository
# root, it writes what it measured under $OUT (default /tmp/gpu_check):
#   train_step_cuda.json  tokens/s of bf16 inner steps and the outer step's cost (small, medium;
#                         copy it to benchmarks/results/ for docs/performance.md)
#   pytest.txt       tests/gpu: the CUDA paths against the CPU's (pinned copies, bf16, θ swap,
#                    streaming, a checkpoint resumed on the GPU)
#   demo.json        `workbench demo --device cuda`: real hivemind peers training on the GPU
#   demo_logs.txt    the end of each demo peer's log
# Python packages the machine lacks (hivemind, ...) can come as wheels in .whl/ (see
# docs/development.md); they are installed into /tmp/site first.
set -u
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
status=0
step() { echo; echo "=== $1 ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"

step "benchmarks.train_step"
timeout 200 "$PY" -m benchmarks.train_step --device cuda --preset small --preset medium --steps 50 \
    --batch-size 32 --profile --out "$OUT/train_step_cuda.json" || status=1

step "tests/gpu"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -rA tests/gpu 2>&1 | tee "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

step "workbench demo --device cuda"
if "$PY" -c "import hivemind" 2>/dev/null; then
    timeout 300 "$PY" -m workbench demo --device cuda --peers 3 --rounds 4 --headless --json \
        --run-dir /tmp/gpu_demo --timeout 280 > "$OUT/demo.json" || status=1
    tail -c 3000 "$OUT/demo.json"
    for log in /tmp/gpu_demo/*/peer.log; do echo "--- $log"; tail -n 25 "$log"; done > "$OUT/demo_logs.txt" 2>&1
else
    echo "hivemind is not installed here: no demo (carry its wheels in .whl/)"; status=1
fi
echo; echo "gpu check: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status

#!/usr/bin/env bash
# The GPU figures the project owes, in one pass on a machine with a CUDA device: the CUDA cases of the tests, then
# `bench step` and `bench gpu` on CUDA (sb3_gpu beside SB3 in the same run), each under a time limit of its own so
# that one that hangs leaves the others' results. Run from the project root, with its dependencies importable
# (installed, or unpacked on PYTHONPATH); results land in $OUT (default gpu-checks/), each step's log beside them.
#
#   OUT=/tmp/gpu bash tools/gpu_checks.sh            # about 9 minutes on one H100
set -uo pipefail
OUT="${OUT:-gpu-checks}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CI=true

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (log: $OUT/$name.log)"
}

"$PY" - <<'PY' | tee "$OUT/device.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: these checks need one"
print(torch.__version__, torch.cuda.get_device_name(0))
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
# The tests with a cuda case: compiled steps (CUDA graphs) against SB3's updates, no host waits under the sync debug
# mode, a gSDE model loaded and compiled again.
step pytest-cuda 200 "$PY" -m pytest -q -m "" -p no:cacheprovider -k cuda tests/extensions
# Host reads, ops and time per gradient step and per vec step, SB3's train() beside sb3_gpu's eager and compiled.
step bench-step 150 "$PY" -m sb3_gpu.bench step --device cuda --repeats 5 --out "$OUT/step"
# The device data path against SB3's: Atari frames sampled, PPO and DQN env steps/s on Pong.
step bench-gpu 200 "$PY" -m sb3_gpu.bench gpu --device cuda --steps 20000 --repeats 1 --out "$OUT/gpu"
tail -n 3 "$OUT"/*.log

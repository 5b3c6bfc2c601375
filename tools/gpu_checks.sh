#!/usr/bin/env bash
# The GPU figures the project owes, in one pass on a machine with a CUDA device: the CUDA cases of the tests, then
# `bench step` and `bench gpu` on CUDA (sb3_gpu beside SB3 in the same run), each under a time limit of its own so
# that one that hangs leaves the others' results. Run from the project root, with its dependencies importable
# (installed, or unpacked on PYTHONPATH); results land in $OUT (default gpu-checks/), each step's log beside them.
#
#   OUT=/tmp/gpu bash tools/gpu_checks.sh            # at most 15 minutes (the limits below), less where all passes
#
# `bench gpu` trains on ALE/Pong-v5 beside plain SB3 with rl-zoo3's values: ale-py and rl_zoo3 must be importable.
set -uo pipefail
OUT="${OUT:-gpu-checks}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CI=true

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    # SIGINT first, so that pytest and the benches still write what they have; SIGKILL 20 s later.
    timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
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
# Each test's result in the log as it ends (-rA) and in pytest.xml; any one test stopped after 120 s.
pytest_args=(-m "" -p no:cacheprovider -k cuda -v -rA --timeout 120)
step pytest-dqn-ppo 240 "$PY" -m pytest "${pytest_args[@]}" --junitxml "$OUT/pytest-dqn-ppo.xml" tests/extensions/test_graphstep.py
step pytest-continuous 300 "$PY" -m pytest "${pytest_args[@]}" --junitxml "$OUT/pytest-continuous.xml" \
    tests/extensions/test_continuous_step.py
# Host reads, ops and time per gradient step and per vec step, SB3's train() beside sb3_gpu's eager and compiled.
step bench-step 150 "$PY" -m sb3_gpu.bench step --device cuda --repeats 5 --out "$OUT/step"
# The device data path against SB3's: Atari frames sampled, PPO and DQN env steps/s on Pong.
step bench-gpu 240 "$PY" -m sb3_gpu.bench gpu --device cuda --steps 20000 --repeats 1 --out "$OUT/gpu"
tail -n 3 "$OUT"/*.log

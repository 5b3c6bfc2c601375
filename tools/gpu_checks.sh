#!/usr/bin/env bash
# The GPU figures the project owes, on a machine with a CUDA device: the CUDA cases of the tests, `bench step` and
# `bench gpu` on CUDA (sb3_gpu beside SB3 in the same run), each under a time limit of its own so that one that hangs
# leaves the others' results. Run from the project root, with its dependencies importable (installed, or unpacked on
# PYTHONPATH); results land in $OUT (default gpu-checks/), each step's log beside them, and a bench stopped by its time
# limit writes the cases it finished. It exits 1 where a step failed or ran out of time. Each group fits in 10
# minutes, kill grace and start-up included, so a machine lent for short calls can take one group a call:
#
#   bash tools/gpu_checks.sh bench      # bench step (the default cases) and bench gpu (Pong): <= 10 min
#   bash tools/gpu_checks.sh tests      # the tests' CUDA cases: <= 10 min
#   bash tools/gpu_checks.sh heads      # bench step --matmul-heads on the MLP cases: <= 6 min
#   bash tools/gpu_checks.sh            # all three, one after the other: <= 26 min
#
# `bench gpu` trains on ALE/Pong-v5 beside plain SB3 with rl-zoo3's values (written into sb3_gpu): ale-py must be
# importable.
set -uo pipefail
OUT="${OUT:-gpu-checks}"
PY="${PYTHON:-python3}"
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(bench tests heads)
for g in "${groups[@]}"; do
    case "$g" in
        bench | tests | heads) ;;
        *) echo "gpu_checks.sh: unknown group '$g' (groups: bench, tests, heads)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CI=true
failed=0

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS rc
    # SIGINT first, so that pytest and the benches still write what they have; SIGKILL 20 s later.
    timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s (log: $OUT/$name.log)"
    [ "$rc" = 0 ] || failed=1
}

"$PY" - <<'PY' | tee "$OUT/device.txt"
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_checks.sh: torch {torch.__version__} sees no CUDA device here; these checks need one")
print(torch.__version__, torch.cuda.get_device_name(0))
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
for g in "${groups[@]}"; do
    case "$g" in
    bench)
        # Host reads, ops and time per gradient step and per vec step, SB3's train() beside sb3_gpu's eager and
        # compiled, and the GPU's busy share; then the device data path against SB3's: Atari frames sampled, PPO and
        # DQN env steps/s on Pong.
        step bench-step 280 "$PY" -m sb3_gpu.bench step --device cuda --repeats 5 --out "$OUT/step"
        # DQN's single Pong env collects about 400 steps/s: one profile, 10,000 steps a run, to fit the call.
        step bench-gpu 240 "$PY" -m sb3_gpu.bench gpu --device cuda --steps 10000 --dqn-profiles auto --repeats 1 \
            --out "$OUT/gpu"
        ;;
    tests)
        # The tests with a cuda case: compiled steps (CUDA graphs) against SB3's updates, no host waits under the sync
        # debug mode, a gSDE model loaded and compiled again. Each test's result in the log as it ends (-rA) and in
        # pytest-*.xml; any one test stopped after 120 s.
        pytest_args=(-m "" -p no:cacheprovider -k cuda -v -rA --timeout 120)
        step pytest-dqn-ppo 220 "$PY" -m pytest "${pytest_args[@]}" --junitxml "$OUT/pytest-dqn-ppo.xml" \
            tests/extensions/test_graphstep.py
        step pytest-continuous 280 "$PY" -m pytest "${pytest_args[@]}" --junitxml "$OUT/pytest-continuous.xml" \
            tests/extensions/test_continuous_step.py
        ;;
    heads)
        # Linear layers of at most 8 outputs as fused sums of products (the default inside compiled steps) against
        # library matrix products, on the MLP cases where the heads are a large share of the step.
        step bench-heads 300 "$PY" -m sb3_gpu.bench step --device cuda --repeats 5 --matmul-heads \
            --cases dqn:CartPole-v1 ppo:CartPole-v1 sac:Pendulum-v1:gpu td3:Pendulum-v1:gpu tqc:Pendulum-v1 \
            --out "$OUT/heads"
        ;;
    esac
done
tail -n 3 "$OUT"/*.log
exit "$failed"

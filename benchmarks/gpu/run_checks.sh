#!/usr/bin/env bash
# The GPU checks as one short script for a CUDA machine (the CPU suite skips them), under 8 minutes on one GPU.
# From the repository root:
#   bash benchmarks/gpu/run_checks.sh            # outputs under $OUT (the device run's folder) or ./gpu-checks
# 1. tests/gpu (at most 3.5 minutes): parity with plain PyTorch at stages 2-3 on the device and offloaded; the
#    reduced gradient streamed to pinned host memory (device peak below the gradient shard); zero.Init pieces in
#    host memory as modules are built; host pieces rewritten by the step only after their copy to the device;
#    stage-in copies on the side stream; NVMe gradients; split masters joined with device weights; the step
#    behind the forward against the step in engine.step(); over NCCL
#    (two GPUs), fetches and reductions issued in one order on every rank.
# 2. aio into and out of CUDA tensors, beside pinned host tensors (benchmarks/gpu/aio_cuda.py).
# 3. offload_step.py at world size 1: stage 3 with host offload and with NVMe offload.
# 4. max_model.py sized to this machine's disk and RAM, compact mode (int8 states, bf16 gradient, split masters),
#    one layer of the 8B shape (1.27B parameters, so it fits the time), trained 2 steps.
# The time boxes add up to 7 minutes (210 + 30 + 75 + 105 s); the venv and the C core's build take seconds.
# Then one summary table (benchmarks/gpu/summary.py). A check that runs out of time is reported missing and the
# others still run.
# Uses the machine's own torch (CUDA build): the venv sees the system packages and installs infinity alone.
set -uo pipefail
OUT=${OUT:-gpu-checks}
SWAP=${SWAP:-.gpu-swap}
mkdir -p "$OUT" "$SWAP"
python3 -m venv --system-site-packages /tmp/infinity-gpu-venv
. /tmp/infinity-gpu-venv/bin/activate
pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv || true
timeout 210 python -m pytest -q -rs --durations=10 -p no:cacheprovider -m gpu tests/gpu "$@" 2>&1 | tee "$OUT/pytest.txt"
timeout 30 python benchmarks/gpu/aio_cuda.py --folder "$SWAP" --size $((1 << 30)) --json "$OUT/aio_cuda.json"
timeout 75 python benchmarks/offload_step.py --nvme-path "$SWAP" --world-sizes 1 --modes stage3-cpu stage3-nvme \
    --steps 4 --skip 1 --json "$OUT/offload_step.json"
timeout 105 python benchmarks/max_model.py --nvme-path "$SWAP" --modes compact --max-layers 1 --out "$OUT/max_model"
rm -rf "$SWAP"
python benchmarks/gpu/summary.py "$OUT" | tee "$OUT/summary.md"

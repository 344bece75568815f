#!/usr/bin/env bash
# The GPU checks as one short script for a CUDA machine (the CPU suite skips them). From the repository root:
#   bash benchmarks/gpu/run_checks.sh
# Runs tests/gpu (a few minutes on one GPU; the NCCL tests need two and are skipped on one): parity with plain
# PyTorch at stages 2-3 on the device and offloaded; the reduced gradient streamed to pinned host memory (device
# peak below the gradient shard); zero.Init pieces in host memory as modules are built; host pieces rewritten by
# the step only after their copy to the device; stage-in copies on the side stream; NVMe gradients; over NCCL,
# fetches and reductions issued in one order on every rank.
# Uses the machine's own torch (CUDA build): the venv sees the system packages and installs infinity alone.
set -euo pipefail
python3 -m venv --system-site-packages /tmp/infinity-gpu-venv
. /tmp/infinity-gpu-venv/bin/activate
pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total --format=csv || true
python -m pytest -q -rs --durations=10 -p no:cacheprovider -m gpu tests/gpu "$@"

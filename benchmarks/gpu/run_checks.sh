#!/usr/bin/env bash
# The GPU checks as one short script for a CUDA machine (the CPU suite skips them). From the repository root:
#   bash benchmarks/gpu/run_checks.sh
# Uses the machine's own torch (CUDA build): the venv sees the system packages and installs infinity alone.
set -euo pipefail
python3 -m venv --system-site-packages /tmp/infinity-gpu-venv
. /tmp/infinity-gpu-venv/bin/activate
pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total --format=csv || true
python -m pytest -q -p no:cacheprovider -m gpu tests/gpu "$@"

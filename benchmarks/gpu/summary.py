"""One table from the GPU checks' outputs (run_checks.sh): the tests' result line, aio into and out of device
tensors, offload_step's step times, and the max-model run. A check that did not finish shows as missing.

    python benchmarks/gpu/summary.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rows(out: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    try:
        with open(os.path.join(out, "pytest.txt")) as f:
            lines = [line.strip() for line in f if line.strip()]
        found.append(("tests/gpu", lines[-1] if lines else "no output"))
    except OSError:
        found.append(("tests/gpu", "missing"))
    aio = _load(os.path.join(out, "aio_cuda.json"))
    if aio is None:
        found.append(("aio into/out of device tensors", "missing"))
    else:
        for where, figures in aio["results"].items():
            if isinstance(figures, dict):
                found.append((f"aio {where} tensor", f"write {figures['write_gbps']:.2f} GB/s, read "
                                                     f"{figures['read_gbps']:.2f} GB/s"))  # fmt: skip
    step = _load(os.path.join(out, "offload_step.json"))
    if step is None:
        found.append(("offload_step.py", "missing"))
    else:
        for world, modes in step["world_sizes"].items():
            for mode, figures in modes.items():
                rss = max(figures.get("peak_rss_gib_per_rank") or [0.0])
                found.append((f"offload_step ws{world} {mode}", f"median step {figures['median_step_s']:.3f} s, "
                                                                f"peak RSS {rss:.2f} GiB"))  # fmt: skip
    biggest = _load(os.path.join(out, "max_model.json"))
    if biggest is None or not biggest.get("runs"):
        found.append(("max_model.py", "missing"))
    else:
        for run in biggest["runs"]:
            found.append((f"max_model {run['mode']}",
                          f"{run['parameters'] / 1e9:.2f}B parameters, swap {run['swap_peak_bytes'] / 1e9:.1f} GB "
                          f"({run['swap_over_ram']:.2f}x RAM), peak RSS {run['peak_rss_bytes'] / 2**30:.2f} GiB, "
                          f"median step {run['median_step_s']:.1f} s, loss fell: {run['loss_fell']}"))  # fmt: skip
    return found


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    table = rows(out)
    width = max(len(name) for name, _ in table)
    print("| check | result |")
    print("| --- | --- |")
    for name, result in table:
        print(f"| {name.ljust(width)} | {result} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

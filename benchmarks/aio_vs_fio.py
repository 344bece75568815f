"""infinity's async I/O engine vs fio vs naive Python I/O, side by side on one file.

For read and write at 1 MiB and 4 MiB blocks, queue depth 8 and 32, each run measures, in a balanced order
  - infinity, streaming through one buffer slot per request in flight (fio's memory footprint);
  - fio (libaio, direct=1) with its default buffers and with huge-page buffers (--iomem=shmhuge);
  - infinity reading/writing one tensor as large as the file (how DeepSpeed's benchmark measures).
The target row figure is infinity (same footprint as fio) / the better fio mode. The naive baselines
are torch.save/torch.load and numpy tofile/fromfile of a tensor as large as the file, timed to
durable completion (fsync) and read from a cold page cache. Medians of --runs; GB/s = 1e9 bytes/s.

    python benchmarks/aio_vs_fio.py --io-size 8G --runs 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from infinity.aio.bench import (
    GB,
    Case,
    Engine,
    HugePageReservation,
    check_folder,
    describe_location,
    drop_page_cache,
    environment,
    fio_pages_needed,
    format_size,
    fsync_path,
    parse_size,
    run_fio,
)

ROWS = [
    Case(op, bs, qd, 1, False, True, False) for op in ("write", "read") for bs in (1 << 20, 4 << 20) for qd in (8, 32)
]


def williams_order(n: int, run_index: int) -> list[int]:
    """[Note: run order] A pass leaves the disk busy (the host is still absorbing its writes), so whoever runs
    next pays for it. Rotating a fixed order would give each contender the same predecessor every time, a
    bias that lands on the write rows. A Williams square (n even) makes every ordered pair of neighbours occur
    exactly once in n runs, so each contender follows each other one equally often."""
    first = [0]
    for k in range(1, n):
        first.append(first[-1] + (k if k % 2 else n - k))
    first = [x % n for x in first]
    return [(x + run_index) % n for x in first]


def time_naive(path: str, tensor: torch.Tensor, kind: str, op: str) -> float:
    nbytes = tensor.numel()
    if op == "read":
        drop_page_cache(path)
    start = time.perf_counter()
    if kind == "torch":
        if op == "write":
            torch.save(tensor, path)
        else:
            torch.load(path, weights_only=True)
    else:
        array = tensor.numpy()
        if op == "write":
            array.tofile(path)
        else:
            np.fromfile(path, dtype=np.uint8)
    if op == "write":
        fsync_path(path)
    return nbytes / (time.perf_counter() - start) / GB


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # so the test file and the huge-page reservation are cleaned up


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--io-size", type=parse_size, default=parse_size("8G"))
    parser.add_argument("--runs", type=int, default=8, help="a multiple of 4 balances the run order")
    parser.add_argument("--folder", default=None, help="where the test file goes (default: here)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--naive-runs", type=int, default=3, help="runs of each naive baseline (slow at 8G)")
    args = parser.parse_args()
    if not shutil.which("fio"):
        sys.exit("fio is not on PATH (Debian package: fio); this benchmark compares against it")
    folder = args.folder or os.getcwd()
    check_folder(folder, args.io_size)
    workdir = tempfile.mkdtemp(prefix="infinity-aio-vs-fio-", dir=folder)
    path = os.path.join(workdir, "bench.bin")
    described = describe_location(workdir)
    # No machine paths in committed results: the filesystem and the device's name say what was measured.
    location = {
        "filesystem": described["filesystem"],
        "device": os.path.basename(described["device"]),
        "direct_io": described["direct_io"],
    }
    results = {"rows": [], "naive": {}}
    try:
        ring = Engine(path, args.io_size, max(c.block_size * c.queue_depth for c in ROWS))
        whole = Engine(path, args.io_size, args.io_size)
        whole.prepare_file()
        with HugePageReservation(fio_pages_needed(ROWS)) as huge:
            for index, case in enumerate(ROWS):
                print(f"[{index + 1}/{len(ROWS)}] {case.label()}", file=sys.stderr, flush=True)
                runs: dict[str, list[float]] = {
                    "infinity": [],
                    "fio_default": [],
                    "fio_hugepage": [],
                    "infinity_one_tensor": [],
                }
                ring.run(case)  # warm-up
                contenders = {
                    "infinity": lambda case=case: ring.run(case),
                    "fio_default": lambda case=case: run_fio(path, case, args.io_size, "malloc"),
                    "fio_hugepage": lambda case=case: run_fio(path, case, args.io_size, "shmhuge"),
                    "infinity_one_tensor": lambda case=case: whole.run(case),
                }
                if not huge.available:
                    del contenders["fio_hugepage"]
                names = list(contenders)
                for run_index in range(args.runs):
                    # See [Note: run order]: every contender follows every other one equally often.
                    for position in williams_order(len(names), run_index):
                        runs[names[position]].append(contenders[names[position]]())
                medians = {k: statistics.median(v) for k, v in runs.items() if v}
                best_fio = max(medians.get("fio_default", 0), medians.get("fio_hugepage", 0))
                row = {
                    "op": case.op,
                    "block_size": case.block_size,
                    "queue_depth": case.queue_depth,
                    "runs_gbps": runs,
                    "median_gbps": medians,
                    "ratio_vs_best_fio": medians["infinity"] / best_fio,
                    "one_tensor_ratio_vs_best_fio": medians["infinity_one_tensor"] / best_fio,
                    "note": huge.note,
                }
                results["rows"].append(row)
                print(
                    f"    infinity {medians['infinity']:.2f}  fio {medians.get('fio_default', 0):.2f} / "
                    f"huge {medians.get('fio_hugepage', 0):.2f}  ratio {row['ratio_vs_best_fio']:.2f}  "
                    f"one tensor {medians['infinity_one_tensor']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
        ring.close()
        whole.close()
        ring = whole = None  # drop the file-sized buffer before the naive runs allocate theirs
        if not args.skip_naive:
            tensor = torch.randint(0, 256, (args.io_size,), dtype=torch.uint8)
            naive_path = os.path.join(workdir, "naive.bin")
            for kind in ("torch", "numpy"):
                for op in ("write", "read"):
                    values = [time_naive(naive_path, tensor, kind, op) for _ in range(args.naive_runs)]
                    results["naive"][f"{kind}_{op}"] = {
                        "runs_gbps": values,
                        "median_gbps": statistics.median(values),
                    }
                    print(f"    naive {kind} {op}: {statistics.median(values):.2f}", file=sys.stderr, flush=True)
                with contextlib.suppress(OSError):
                    os.remove(naive_path)
            del tensor
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for op in ("write", "read"):
        ours = max(r["median_gbps"]["infinity_one_tensor"] for r in results["rows"] if r["op"] == op)
        naive = results["naive"].get(f"torch_{op}", {}).get("median_gbps")
        if naive:
            results[f"one_tensor_vs_torch_{'save' if op == 'write' else 'load'}"] = ours / naive
    results.update(
        {
            "benchmark": "benchmarks/aio_vs_fio.py",
            "units": "GB/s, 1 GB = 1e9 bytes",
            "io_size": args.io_size,
            "runs": args.runs,
            "location": location,
            "environment": environment(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    )
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "aio_vs_fio.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
    plot(results, os.path.join(args.out, "aio_vs_fio.png"))
    print_table(results)
    return 0


def print_table(results: dict) -> None:
    print(f"io-size {format_size(results['io_size'])}, medians of {results['runs']} runs, GB/s (1e9 B/s)")
    print(f"{'row':<22} {'infinity':>8} {'fio':>6} {'fio-huge':>8} {'ratio':>6} {'1-tensor':>8}")
    for r in results["rows"]:
        m = r["median_gbps"]
        label = f"{r['op']} {format_size(r['block_size'])} qd{r['queue_depth']}"
        print(
            f"{label:<22} {m['infinity']:8.2f} {m.get('fio_default', 0):6.2f} {m.get('fio_hugepage', 0):8.2f} "
            f"{r['ratio_vs_best_fio']:6.2f} {m['infinity_one_tensor']:8.2f}"
        )
    for name, value in results["naive"].items():
        print(f"naive {name:<16} {value['median_gbps']:8.2f}")
    for key in ("one_tensor_vs_torch_save", "one_tensor_vs_torch_load"):
        if key in results:
            print(f"{key}: {results[key]:.1f}x")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [f"{r['op']}\n{format_size(r['block_size'])} qd{r['queue_depth']}" for r in rows]
    series = [
        ("infinity", "infinity (fio's footprint)"),
        ("fio_hugepage", "fio, huge-page buffers"),
        ("fio_default", "fio, default buffers"),
        ("infinity_one_tensor", "infinity, one file-sized tensor"),
    ]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [4, 1.3]})
    width = 0.2
    for i, (key, name) in enumerate(series):
        ax.bar(
            [x + (i - 1.5) * width for x in range(len(rows))],
            [r["median_gbps"].get(key, 0) for r in rows],
            width,
            label=name,
        )
    for x, r in enumerate(rows):
        ax.text(
            x - 1.5 * width,
            r["median_gbps"]["infinity"] + 0.05,
            f"{r['ratio_vs_best_fio']:.2f}",
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("GB/s (1e9 bytes/s), median")
    ax.set_title(
        f"direct I/O, {format_size(results['io_size'])} file, {results['location']['filesystem']} on "
        f"{results['location']['device']} (labels: infinity / best fio)",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    naive = results["naive"]
    if naive:
        names = list(naive)
        best = {
            op: max(r["median_gbps"]["infinity_one_tensor"] for r in rows if r["op"] == op) for op in ("write", "read")
        }
        ax2.bar(
            range(len(names) + 2),
            [naive[n]["median_gbps"] for n in names] + [best["write"], best["read"]],
            color=["grey"] * len(names) + ["C3", "C3"],
        )
        ax2.set_xticks(range(len(names) + 2))
        ax2.set_xticklabels([n.replace("_", "\n") for n in names] + ["infinity\nwrite", "infinity\nread"], fontsize=7)
        ax2.set_title("naive Python I/O vs infinity (one tensor)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

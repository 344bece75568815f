"""The aio engine into and out of device tensors, beside host tensors, on one file: what a GPU's offload path gets.

Writes a ``--size`` file from a tensor on each device (a page-locked host tensor, and the CUDA device when there is
one), then reads it back into a tensor there; ``--loops`` times each, the median GB/s kept, and checks the bytes
that came back. Device tensors go through the handle's own bounce buffers (direct I/O needs host memory), so the
ratio device / host is the cost of the extra copy. Writes a JSON (``--json``).

    python benchmarks/gpu/aio_cuda.py --folder DIR --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from infinity.aio.handle import AioHandle


def measure(handle: AioHandle, path: str, tensor: torch.Tensor, loops: int) -> dict:
    nbytes = tensor.numel() * tensor.element_size()
    expected = tensor.clone()
    writes, reads = [], []
    for _ in range(loops):
        if tensor.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        handle.sync_pwrite(tensor, path)
        writes.append(nbytes / 1e9 / (time.perf_counter() - started))
        tensor.zero_()
        if tensor.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        handle.sync_pread(tensor, path)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        reads.append(nbytes / 1e9 / (time.perf_counter() - started))
        if not torch.equal(tensor, expected):
            raise SystemExit(f"aio_cuda: the bytes read back into the {tensor.device} tensor differ from those written")
    return {"write_gbps": statistics.median(writes), "read_gbps": statistics.median(reads), "bytes": nbytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=".", help="a folder on the disk to measure (a scratch file goes there)")
    parser.add_argument("--size", type=int, default=1 << 30, help="bytes per transfer")
    parser.add_argument("--loops", type=int, default=3)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="infinity-aio-cuda-", dir=args.folder)
    handle = AioHandle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=4)
    results = {}
    try:
        path = os.path.join(scratch, "transfer")
        numel = args.size // 4
        host = torch.randn(numel).pin_memory() if torch.cuda.is_available() else torch.randn(numel)
        results["host"] = measure(handle, path, host, args.loops)
        if torch.cuda.is_available():
            results["cuda"] = measure(handle, path, host.to("cuda"), args.loops)
            for op in ("write", "read"):
                results[f"cuda_over_host_{op}"] = results["cuda"][f"{op}_gbps"] / results["host"][f"{op}_gbps"]
    finally:
        handle.close()
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"benchmark": "aio_cuda", "cuda": torch.cuda.is_available(), "loops": args.loops, "results": results}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    for where, figures in results.items():
        if isinstance(figures, dict):
            print(f"aio {where:5}: write {figures['write_gbps']:.2f} GB/s, read {figures['read_gbps']:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

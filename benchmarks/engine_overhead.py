"""Step time of the engine (ZeRO stages 0, 1, 2 and stage 2 + optimizer offload) vs plain PyTorch.

GPT-2-small shape (124M parameters, transformers' GPT2Config defaults, built locally, no download), sequence 256,
micro batch 4 per rank, bf16, AdamW, random tokens. Plain PyTorch is what a user writes without us: fp32 weights,
torch.autocast(bfloat16), fused AdamW, and DistributedDataParallel at world size 2. World size 2 runs two processes
over gloo on the same machine, each with half of its cores. Variants run one after another, then again in reverse
order (drift on a shared machine hits every variant alike); each records warm-up steps, then timed steps, and the
figure is the median step time. Writes results/engine_overhead.json and .png.

    python benchmarks/engine_overhead.py --world-sizes 1,2 --steps 5 --warmup 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ["plain", "stage0", "stage1", "stage2", "stage2-offload"]
SEQ, MICRO, LR = 256, 4, 1e-4


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config())


def engine_config(variant: str) -> dict:
    stage = int(variant[5])
    zero = {"stage": stage, "overlap_comm": True}
    if variant.endswith("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": zero,
    }


def run_variant(variant: str, rank: int, world_size: int, steps: int, warmup: int) -> dict:
    import infinity

    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 50257, (MICRO, SEQ), generator=gen) for _ in range(steps + warmup)]
    model = build_model()
    times = []
    state_bytes = None
    if variant == "plain":
        if world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        for ids in batches:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights + exp_avg + exp_avg_sq
    else:
        engine, *_ = infinity.initialize(model=model, config=engine_config(variant))
        for ids in batches:
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        state_bytes = engine.optimizer_state_bytes()
        engine.destroy()
    del model
    gc.collect()
    return {"times": times[warmup:], "state_bytes": state_bytes, "loss": float(loss)}


def worker(rank: int, world_size: int, workdir: str, steps: int, warmup: int, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    results: dict[str, list] = {v: [] for v in VARIANTS}
    for order in (VARIANTS, list(reversed(VARIANTS))):
        for variant in order:
            if rank == 0:
                print(f"  world {world_size}: {variant}", file=sys.stderr, flush=True)
            results[variant].append(run_variant(variant, rank, world_size, steps, warmup))
    if dist.is_initialized():
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    report = {
        "benchmark": "benchmarks/engine_overhead.py",
        "model": "GPT-2 small (124M), seq 256, micro batch 4, bf16, AdamW",
        "steps": args.steps,
        "warmup": args.warmup,
        "by_world_size": {},
        "environment": {
            "cpus": cores,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        with tempfile.TemporaryDirectory() as workdir:
            threads = max(1, cores // world_size)
            mp.start_processes(
                worker,
                args=(world_size, workdir, args.steps, args.warmup, threads),
                nprocs=world_size,
                start_method="spawn",
            )
            with open(os.path.join(workdir, "rank0.pkl"), "rb") as f:
                results = pickle.load(f)
        rows = {}
        for variant, runs in results.items():
            times = [t for run in runs for t in run["times"]]
            rows[variant] = {
                "median_s": statistics.median(times),
                "times_s": times,
                "state_bytes_rank0": runs[0]["state_bytes"],
            }
        for row in rows.values():
            row["ratio_vs_plain"] = row["median_s"] / rows["plain"]["median_s"]
        report["by_world_size"][str(world_size)] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_overhead.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(args.out, "engine_overhead.png"))
    print("median step time (s) and ratio to plain PyTorch; targets: stages 0-2 <= 1.05, offload <= 1.15")
    for world_size, rows in report["by_world_size"].items():
        for variant, row in rows.items():
            print(
                f"world {world_size}  {variant:<15} {row['median_s']:6.2f} s  x{row['ratio_vs_plain']:.2f}  "
                f"optimizer state {row['state_bytes_rank0'] / 2**20:7.0f} MiB/rank"
            )
    return 0


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(report["by_world_size"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        values = [report["by_world_size"][w][variant]["median_s"] for w in sizes]
        bars = ax.bar([x + (i - 2) * width for x in range(len(sizes))], values, width, label=variant)
        for bar, w in zip(bars, sizes, strict=True):
            ratio = report["by_world_size"][w][variant]["ratio_vs_plain"]
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                f"x{ratio:.2f}",
                ha="center",
                fontsize=7,
                va="bottom",
            )
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"world size {w}" for w in sizes])
    ax.set_ylabel("median step time (s)")
    ax.set_title(report["model"] + " (labels: ratio to plain PyTorch)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

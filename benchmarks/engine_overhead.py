"""Step time of the engine (ZeRO stages 0, 1, 2 and stage 2 + optimizer offload) vs plain PyTorch.

GPT-2-small shape (124M parameters, transformers' GPT2Config defaults, built locally, no download), sequence 256,
micro batch 4 per rank, bf16, AdamW, random tokens. Plain PyTorch is what a user writes without us: fp32 weights,
torch.autocast(bfloat16), fused AdamW, and DistributedDataParallel at world size 2 (25 MiB buckets; the engine
gets the same bucket size). World size 2 runs two processes over gloo on the same machine, each with half of its
cores. Each variant is paired with plain PyTorch: both models live side by side and their steps alternate (and
which goes first alternates), so both see the same machine; the figure is the ratio of their median step times.
Writes results/engine_overhead.json and .png.

    python benchmarks/engine_overhead.py --world-sizes 1,2 --steps 8 --warmup 2
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


BUCKET = 6_500_000  # elements: DDP's default 25 MiB gradient buckets at fp32, so both overlap alike


def engine_config(variant: str) -> dict:
    stage = int(variant[5])
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if variant.endswith("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": zero,
    }


class Plain:
    """What a user writes without us: fp32 weights, autocast bf16, fused AdamW, DDP at world size > 1."""

    def __init__(self, world_size: int) -> None:
        self.model = build_model()
        if world_size > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, fused=True)

    def step(self, ids: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        return sum(p.numel() * 4 * 3 for p in self.model.parameters())  # weights + exp_avg + exp_avg_sq


class Ours:
    def __init__(self, variant: str) -> None:
        import infinity

        self.engine, *_ = infinity.initialize(model=build_model(), config=engine_config(variant))

    def step(self, ids: torch.Tensor) -> None:
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()

    def state_bytes(self) -> int:
        return self.engine.optimizer_state_bytes()


def run_pair(variant: str, rank: int, world_size: int, steps: int, warmup: int) -> dict:
    """Plain and the variant side by side, alternating step by step (and which goes first), so both see the
    same machine: the ratio of their medians is what is reported."""
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 50257, (MICRO, SEQ), generator=gen) for _ in range(steps + warmup)]
    contenders = {"plain": Plain(world_size), variant: Ours(variant)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for index, ids in enumerate(batches):
        order = list(contenders) if index % 2 == 0 else list(reversed(contenders))
        for name in order:
            start = time.perf_counter()
            contenders[name].step(ids)
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    result = {
        name: {"times_s": t, "median_s": statistics.median(t), "state_bytes": contenders[name].state_bytes()}
        for name, t in times.items()
    }
    result["ratio_vs_plain"] = result[variant]["median_s"] / result["plain"]["median_s"]
    del contenders
    gc.collect()
    return result


def worker(rank: int, world_size: int, workdir: str, steps: int, warmup: int, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    results = {}
    for variant in VARIANTS[1:]:
        if rank == 0:
            print(f"  world {world_size}: plain vs {variant}", file=sys.stderr, flush=True)
        results[variant] = run_pair(variant, rank, world_size, steps, warmup)
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down under a peer
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=8)
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
        for variant, pair in results.items():
            rows[variant] = {
                "median_s": pair[variant]["median_s"],
                "plain_median_s": pair["plain"]["median_s"],
                "ratio_vs_plain": pair["ratio_vs_plain"],
                "times_s": pair[variant]["times_s"],
                "plain_times_s": pair["plain"]["times_s"],
                "state_bytes_rank0": pair[variant]["state_bytes"],
                "plain_state_bytes_rank0": pair["plain"]["state_bytes"],
            }
        report["by_world_size"][str(world_size)] = rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_overhead.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(args.out, "engine_overhead.png"))
    print("median step time (s) and ratio to plain PyTorch; targets: stages 0-2 <= 1.05, offload <= 1.15")
    for world_size, rows in report["by_world_size"].items():
        for variant, row in rows.items():
            print(
                f"world {world_size}  {variant:<15} {row['median_s']:5.2f} s vs plain {row['plain_median_s']:5.2f} s  "
                f"x{row['ratio_vs_plain']:.2f}  optimizer state {row['state_bytes_rank0'] / 2**20:5.0f} MiB/rank "
                f"(plain {row['plain_state_bytes_rank0'] / 2**20:.0f})"
            )
    return 0


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(report["by_world_size"])
    variants = VARIANTS[1:]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    for ax, world_size in zip(axes[0], sizes, strict=True):
        rows = report["by_world_size"][world_size]
        x = range(len(variants))
        ax.bar([i - 0.2 for i in x], [rows[v]["plain_median_s"] for v in variants], 0.4, label="plain PyTorch (paired)")
        bars = ax.bar([i + 0.2 for i in x], [rows[v]["median_s"] for v in variants], 0.4, label="infinity")
        for bar, variant in zip(bars, variants, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                f"x{rows[variant]['ratio_vs_plain']:.2f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(x))
        ax.set_xticklabels(variants, fontsize=8)
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"world size {world_size}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(report["model"] + " (labels: ratio to plain PyTorch)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

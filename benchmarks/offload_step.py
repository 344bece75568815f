"""ZeRO-Infinity step time: stage 3 without offload (DeepSpeed's default knobs, and stage3-reshard: FSDP2's policy of
releasing each unit after its forward, prefetching about one block), with parameters and optimizer in host memory
(cpu), and on NVMe; stage 2 with the optimizer on NVMe and without offload; and plain PyTorch FSDP2 (fully_shard per
block, the same AdamW) for memory, with glibc's defaults and with a 1 MiB mmap threshold (fsdp2-mmap1m: what the
engine's RETURN heap policy sets for small NVMe shares and zero.Init, which alone lowers peak RSS; so both are
shown). One run, world sizes 1
and 2 (torchrun, gloo), modes alternating.

Workload: a transformers GPT-2 small shape (124M parameters, built from GPT2Config, no download), sequence 256,
micro batch 4 per rank, AdamW, random tokens. ``--dtype`` picks the compute precision (bf16 by default; on a CPU
without bf16 matrix units its matmuls are slower than fp32: see the README's ZeRO-Infinity section).
Each mode runs in its own processes, so peak RSS is per mode; rounds alternate the modes' order.

Per mode: median step time over steps 3-12 (``--steps``, ``--skip``), peak RSS per rank, NVMe bytes read and written
per step, seconds blocked waiting for parameter and optimizer reads, and the disk's read/write bandwidth through
the same swap store, measured in the same run (before the first mode and after the last). Targets:
- nvme / cpu step-time ratio <= 1.15;
- NVMe traffic during the optimizer step >= 0.8 of the measured bandwidth: (read bytes / read bandwidth + written
  bytes / write bandwidth) x ranks on the disk / seconds in engine.step(), the share of the step the disk is busy;
- seconds blocked on parameter reads, after the first step, <= 10% of the step;
- peak RSS at world size 1 with both on NVMe <= 3 GiB;
- peak RSS of stages 2 and 3 without offload <= FSDP2's, at each world size (stage 3 with FSDP2's policy too).
Writes results/offload_step.json and .png.

    python benchmarks/offload_step.py --nvme-path /path/on/nvme --world-sizes 1 2 --steps 12
    python benchmarks/offload_step.py --rederive   # recompute the derived shares and targets of the last JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MODES = ["stage3", "stage3-reshard", "stage3-cpu", "stage3-nvme", "stage2-nvme", "stage2", "fsdp2", "fsdp2-mmap1m"]
BLOCK_NUMEL = 12 * 768 * 768  # one GPT-2 small block's parameters (attention 4 h^2, MLP 8 h^2)
OWNERS = ("optimizer", "gradients", "parameters")
SEQ, MICRO, LR = 256, 4, 1e-4
HERE = os.path.dirname(os.path.abspath(__file__))


def engine_config(mode: str, nvme_path: str, dtype: str) -> dict:
    zero: dict = {"stage": 2 if mode.startswith("stage2") else 3, "overlap_comm": True}
    if mode == "stage3-reshard":
        # FSDP2's policy in DeepSpeed's knobs: release each unit after its forward (reshard_after_forward) and
        # prefetch about one block ahead; the default (max_reuse_distance 1e9, prefetch 5e7 elements) keeps every
        # unit of this model gathered from its forward to its backward, trading memory for fewer gathers
        zero["stage3_max_reuse_distance"] = 0
        zero["stage3_prefetch_bucket_size"] = BLOCK_NUMEL
    if mode == "stage3-cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if mode.endswith("nvme"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                     "pipeline_read": True, "pipeline_write": True}  # fmt: skip
    if mode == "stage3-nvme":
        # max_in_cpu 0: every piece read from NVMe (the default, 1e9 elements, would keep GPT-2 small in memory)
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "max_in_cpu": 0}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class Fsdp2:
    """Plain PyTorch FSDP2 with the engine's surface for the loop below: fully_shard on every block and the root,
    torch's AdamW (fused, as the engine's), bf16 parameters in compute via MixedPrecisionPolicy when asked;
    ``cpu_offload``: CPUOffloadPolicy (parameters, gradients and the optimizer step in host memory)."""

    def __init__(self, model, dtype: str, *, cpu_offload: bool = False) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None)
        offload = CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy()
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy, offload_policy=offload)
        self.module = fully_shard(model, mp_policy=policy, offload_policy=offload)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def tier_stats(self) -> dict:
        return {}

    def destroy(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def worker(args) -> None:
    """One rank of one mode (under torchrun): trains ``steps`` steps, writes its measurements."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import infinity

    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(max(1, args.threads // world_size))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=SEQ, use_cache=False, n_layer=args.layers))
    if args.mode.startswith("fsdp2"):
        engine = Fsdp2(model, args.dtype)
    else:
        engine, *_ = infinity.initialize(model=model, config=engine_config(args.mode, args.nvme_path, args.dtype))
    gen = torch.Generator().manual_seed(1000 + rank)
    records = []
    previous = _traffic(engine)
    for _step in range(args.steps):
        tokens = torch.randint(0, model.config.vocab_size, (MICRO, SEQ + 1), generator=gen)
        started = time.perf_counter()
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:]).loss
        engine.backward(loss)
        before_step = time.perf_counter()
        engine.step()
        finished = time.perf_counter()
        now = _traffic(engine)
        records.append({
            "step_s": finished - started, "optimizer_step_s": finished - before_step, "loss": float(loss.detach()),
            **{key: now[key] - previous.get(key, 0.0) for key in now},
        })  # fmt: skip
        previous = now
    engine.destroy()
    result = {
        "rank": rank,
        "records": records,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    with open(os.path.join(args.out, f"{args.mode}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _traffic(engine) -> dict:
    flat = {}
    for owner, stats in engine.tier_stats().items():
        for direction, totals in stats["traffic"].items():
            flat[f"{owner}.{direction}.bytes"] = float(totals["bytes"])
            flat[f"{owner}.{direction}.blocked_s"] = float(totals["blocked_s"])
    return flat


def disk_bandwidth(nvme_path: str, *, gib: int = 1, tile_mib: int = 128) -> dict:
    """Read and write GB/s through the engine's own path (swap store, a ring of 4 huge-page buffers, 4 in flight)."""
    from infinity.aio.handle import AioHandle
    from infinity.memory.nvme_store import NvmeStore
    from infinity.memory.tiers import Tier, TierManager

    count = gib * 1024 // tile_mib
    handle = AioHandle()
    store = NvmeStore(nvme_path, handle=handle, run_id=f"bandwidth-{os.getpid()}")
    manager = TierManager(store=store, handle=handle, buffer_count=4)
    numel = tile_mib << 18  # fp32 elements
    for index in range(count):
        manager.add(f"s{index}", numel, Tier.NVME)
    manager.open()
    result = {}
    try:
        for direction in ("write", "read"):
            started = time.perf_counter()
            held = []
            for index in range(count):
                handle_ = manager.acquire(f"s{index}", read=direction == "read")
                if direction == "write":
                    handle_.tensor.fill_(index)
                    manager.release(handle_, dirty=True)
                else:
                    held.append(handle_)
                    if len(held) == 3:
                        manager.release(held.pop(0), dirty=False)
            for handle_ in held:
                manager.release(handle_, dirty=False)
            manager.flush()
            for handle_ in held:
                handle_.wait()
            result[f"{direction}_gbps"] = count * numel * 4 / (time.perf_counter() - started) / 1e9
    finally:
        manager.close()
    return result


def launch(mode: str, world_size: int, args, out: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
        os.path.abspath(__file__), "--worker", "--mode", mode, "--nvme-path", args.nvme_path, "--out", out,
        "--steps", str(args.steps), "--dtype", args.dtype, "--threads", str(args.threads),
        "--layers", str(args.layers),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // world_size))}
    if mode == "fsdp2-mmap1m":
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # infinity/memory/host.py's RETURN policy
    subprocess.run(command, check=True, env=env)


def summarise(mode: str, world_size: int, out: str, skip: int) -> dict:
    """Medians over rank 0's steps after ``skip`` (ranks run in lockstep), peak RSS of every rank."""
    ranks = []
    for rank in range(world_size):
        with open(os.path.join(out, f"{mode}-rank{rank}.json")) as f:
            ranks.append(json.load(f))
    kept = ranks[0]["records"][skip:]

    def median(key: str) -> float:
        return statistics.median(record.get(key, 0.0) for record in kept)

    summary = {
        "median_step_s": median("step_s"),
        "median_optimizer_step_s": median("optimizer_step_s"),
        "peak_rss_gib_per_rank": [r["peak_rss_bytes"] / 2**30 for r in ranks],
        "losses_rank0": [r["loss"] for r in ranks[0]["records"]],
    }
    for owner in OWNERS:
        for direction in ("nvme_read", "nvme_write"):
            summary[f"{owner}_{direction}_gb_per_step"] = median(f"{owner}.{direction}.bytes") / 1e9
            summary[f"{owner}_{direction}_blocked_s"] = median(f"{owner}.{direction}.blocked_s")
    return summary


def combine(runs: list[dict], bandwidth: dict, world_size: int) -> dict:
    """One mode's rounds: medians of the medians, the worst peak RSS, and the derived shares."""
    entry = {key: statistics.median(run[key] for run in runs) for key in runs[0] if not isinstance(runs[0][key], list)}
    entry["peak_rss_gib_per_rank"] = [
        max(values) for values in zip(*(run["peak_rss_gib_per_rank"] for run in runs), strict=True)
    ]
    entry["losses_rank0"] = runs[0]["losses_rank0"]
    entry["nvme_read_gb_per_step"] = sum(entry[f"{owner}_nvme_read_gb_per_step"] for owner in OWNERS)
    entry["nvme_written_gb_per_step"] = sum(entry[f"{owner}_nvme_write_gb_per_step"] for owner in OWNERS)
    entry["blocked_on_io_s"] = sum(entry[k] for k in entry if k.endswith("_blocked_s"))
    entry["parameter_read_blocked_share"] = entry["parameters_nvme_read_blocked_s"] / entry["median_step_s"]
    disk_busy_share(entry, bandwidth, world_size)
    return entry


def disk_busy_share(entry: dict, bandwidth: dict, ranks_on_the_disk: int) -> None:
    """The share of engine.step() the disk is busy: the bytes moved while it runs (every tile read and written,
    each tile's gradient read at stage 3; with parameters on NVMe also the updated pieces written back) at the
    measured bandwidth, times the ranks sharing the disk (on one machine every rank swaps to it at once), over
    the step's seconds."""
    if not entry["optimizer_nvme_read_gb_per_step"]:
        return
    written = entry["optimizer_nvme_write_gb_per_step"] + entry["parameters_nvme_write_gb_per_step"]
    read = entry["optimizer_nvme_read_gb_per_step"] + entry.get("gradients_nvme_read_gb_per_step", 0.0)
    busy = read / bandwidth["read_gbps"] + written / bandwidth["write_gbps"]
    entry["optimizer_step_disk_busy_share"] = busy * ranks_on_the_disk / entry["median_optimizer_step_s"]


def targets(report: dict) -> dict:
    found = {}
    for world_size, modes in report["world_sizes"].items():
        if "stage3-nvme" in modes and "stage3-cpu" in modes:
            ratio = modes["stage3-nvme"]["median_step_s"] / modes["stage3-cpu"]["median_step_s"]
            found[f"world{world_size} nvme/cpu step time (<= 1.15)"] = ratio
        for mode in ("stage3-nvme", "stage2-nvme"):
            if mode in modes and "optimizer_step_disk_busy_share" in modes[mode]:
                found[f"world{world_size} {mode} disk busy during the optimizer step (>= 0.8)"] = modes[mode][
                    "optimizer_step_disk_busy_share"
                ]
        if "stage3-nvme" in modes:
            found[f"world{world_size} blocked on parameter reads / step (<= 0.10)"] = modes["stage3-nvme"][
                "parameter_read_blocked_share"
            ]
            if world_size == "1":
                found["world1 stage3-nvme peak RSS GiB (<= 3)"] = max(modes["stage3-nvme"]["peak_rss_gib_per_rank"])
        for reference in ("fsdp2", "fsdp2-mmap1m"):
            if reference not in modes:
                continue
            fsdp2 = max(modes[reference]["peak_rss_gib_per_rank"])
            for mode in ("stage2", "stage3", "stage3-reshard"):
                if mode in modes:
                    found[f"world{world_size} {mode} / {reference} peak RSS (<= 1)"] = (
                        max(modes[mode]["peak_rss_gib_per_rank"]) / fsdp2
                    )
    return found


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(report["world_sizes"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(sizes), 1)
    for offset, world_size in enumerate(sizes):
        modes = report["world_sizes"][world_size]
        names = list(modes)
        xs = [i + offset * width for i in range(len(names))]
        axes[0].bar(xs, [modes[m]["median_step_s"] for m in names], width, label=f"world size {world_size}")
        axes[1].bar(
            xs, [max(modes[m]["peak_rss_gib_per_rank"]) for m in names], width, label=f"world size {world_size}"
        )
        for axis in axes:
            axis.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(names))], names, rotation=15)
    axes[0].set_ylabel("median step time (s)")
    axes[1].set_ylabel("peak RSS per rank (GiB)")
    axes[1].axhline(3, color="grey", linestyle="--", linewidth=1)
    for axis in axes:
        axis.legend()
    fig.suptitle(f"GPT-2 124M, seq {SEQ}, micro batch {MICRO}, {report['dtype']}: offload modes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--nvme-path", default=None, help="a directory on the disk to swap to (default: a new one here)"
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the medians (warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every mode, in alternating order")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (12: GPT-2 small)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads per world")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "offload_step.json"))
    parser.add_argument("--rederive", action="store_true", help="recompute shares and targets in --json, no run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.rederive:
        with open(args.json) as f:
            report = json.load(f)
        for world_size, modes in report["world_sizes"].items():
            for entry in modes.values():
                disk_busy_share(entry, report["disk_bandwidth_gbps"]["median"], int(world_size))
        report["targets"] = targets(report)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        plot(report, os.path.splitext(args.json)[0] + ".png")
        print(json.dumps(report["targets"], indent=1))
        return 0
    made = args.nvme_path is None
    if made:
        args.nvme_path = tempfile.mkdtemp(prefix="offload-bench-", dir=os.getcwd())
    bandwidth_runs = [disk_bandwidth(args.nvme_path)]
    results: dict = {}
    with tempfile.TemporaryDirectory() as out:
        for world_size in args.world_sizes:
            for round_index in range(args.rounds):
                order = args.modes if round_index % 2 == 0 else list(reversed(args.modes))
                for mode in order:
                    print(f"world size {world_size}, {mode} (round {round_index + 1})", flush=True)
                    launch(mode, world_size, args, out)
                    results.setdefault((world_size, mode), []).append(summarise(mode, world_size, out, args.skip))
    bandwidth_runs.append(disk_bandwidth(args.nvme_path))
    bandwidth = {key: statistics.median(run[key] for run in bandwidth_runs) for key in bandwidth_runs[0]}
    report: dict = {
        "benchmark": "offload_step", "dtype": args.dtype, "steps": args.steps, "skip": args.skip,
        "rounds": args.rounds, "threads": args.threads,
        "disk_bandwidth_gbps": {"runs": bandwidth_runs, "median": bandwidth}, "world_sizes": {},
    }  # fmt: skip
    for (world_size, mode), runs in results.items():
        report["world_sizes"].setdefault(str(world_size), {})[mode] = combine(runs, bandwidth, world_size)
    report["targets"] = targets(report)
    report["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                             "cpus": os.cpu_count(), "machine": platform.machine()}  # fmt: skip
    report["when"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.json)[0] + ".png")
    print(json.dumps(report["targets"], indent=1))
    if made:
        os.rmdir(args.nvme_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

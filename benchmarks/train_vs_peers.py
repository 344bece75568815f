"""One training step side by side with its peers: plain PyTorch DDP, FSDP2 (with and without CPUOffloadPolicy),
DeepSpeed (stage 2, stage 3, stage 3 with parameters and optimizer offloaded to cpu and to nvme; when the package
is installed: `pip install -e ".[peers]"`), and infinity (the same four ZeRO modes, from the same DeepSpeed JSON).

Workload: a transformers GPT-2 small shape (124M parameters, GPT2Config, no download), sequence 256, micro batch 4
per rank, AdamW (lr 1e-4, weight decay 0.1), random tokens from a seeded generator, bf16 where each supports it
(plain PyTorch and DDP: autocast; FSDP2: MixedPrecisionPolicy; DeepSpeed and infinity: the JSON's bf16 section),
at world size 1 and 2 over gloo (torchrun). Each mode runs in its own processes, so its allocator settings and peak
RSS are its own; with --rounds > 1 the modes alternate order.

Per mode: median step time over steps 3-12 (--steps, --skip), peak RSS per rank (VmHWM), minor page faults and
system CPU seconds per step (getrusage over the measured steps, rank 0), the last loss, and for DeepSpeed the
seconds its import and initialize() took (its set-up). Targets (issue: speed):
- infinity stage 3 + cpu <= 0.9x DeepSpeed's step, stage 3 + nvme <= 0.8x, each at <= 0.6x DeepSpeed's peak RSS;
- infinity stage 3 + nvme <= 1.10x infinity stage 3 + cpu;
- infinity stage 3 <= 1.0x FSDP2's step and <= FSDP2's peak RSS; stage 2 <= 1.05x DDP's step;
- the offload modes' peak RSS the lowest of all.
Every comparison the run can make is stated, met or not. The floor (floor-stage3-cpu, not an engine: see Floor)
bounds the RSS target against DeepSpeed's cpu offload from below: where the floor alone holds more than 0.6x
DeepSpeed's peak RSS, no engine on this JSON meets it. Writes results/train_vs_peers.json and .png.

    python benchmarks/train_vs_peers.py --nvme-path /path/on/nvme --world-sizes 1 2
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from offload_step import LR, MICRO, SEQ, Fsdp2  # noqa: E402  (a sibling benchmark: the same workload and FSDP2)
from offload_step import engine_config as offload_step_config  # noqa: E402

ZERO_MODES = {"stage2": "stage2", "stage3": "stage3", "stage3-cpu": "stage3-cpu", "stage3-nvme": "stage3-nvme"}
SWAP_BYTES_PER_RANK = 4 << 30  # GPT-2 small with everything on NVMe: ~2.5 GB per rank (either engine), and room
FLOOR = "floor-stage3-cpu"  # not an engine: the least any engine holds on stage 3 + cpu offload's JSON (Floor)
MODES = ["pytorch-ddp", "fsdp2", "fsdp2-cpu-offload", *(f"deepspeed-{m}" for m in ZERO_MODES),
         *(f"infinity-{m}" for m in ZERO_MODES), FLOOR]  # fmt: skip


# DeepSpeed's parameter swapper takes one buffer per parameter it swaps in and holds it while the parameter is
# gathered; with the shared JSON's offload_param (buffer_count 5) its stage-3 nvme mode stops at the first prefetch
# here ("Not enough buffers 0 for swapping 1"). With the default stage3_max_reuse_distance every partitioned
# parameter stays gathered from its forward to its backward, so it needs one buffer per partitioned parameter (GPT-2
# small: 4 per block and the two embeddings, 50; 16 stopped the same way at 12 blocks), each the size of the
# largest (the embedding, 38.6M elements): it runs with 56.
DEEPSPEED_OVERRIDES = {"deepspeed-stage3-nvme": {"buffer_count": 56, "buffer_size": 40_000_000}}


def ds_config(mode: str, nvme_path: str, dtype: str) -> dict:
    """The one DeepSpeed JSON both DeepSpeed and infinity read for a ZeRO mode (offload_step.py's), with
    DEEPSPEED_OVERRIDES for DeepSpeed where the shared one does not run."""
    config = offload_step_config(ZERO_MODES[mode.split("-", 1)[1]], nvme_path, dtype)
    config["zero_optimization"].get("offload_param", {}).update(DEEPSPEED_OVERRIDES.get(mode, {}))
    return config


class Ddp:
    """Plain PyTorch: DDP over gloo (at world size 1 the model as it is), bf16 by autocast, fused AdamW."""

    def __init__(self, model, dtype: str) -> None:
        import torch.distributed as dist

        self.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
        if self.distributed:
            dist.init_process_group("gloo")
            model = torch.nn.parallel.DistributedDataParallel(model)
        self.module = model
        self.dtype = torch.bfloat16 if dtype == "bf16" else None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)

    def __call__(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype is not None):
            return self.module(*args, **kwargs)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def destroy(self) -> None:
        if self.distributed:
            torch.distributed.destroy_process_group()


class DeepSpeed:
    """DeepSpeed's engine on the same JSON (CPU accelerator, gloo)."""

    def __init__(self, model, config: dict) -> None:
        started = time.perf_counter()
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        self.engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        self.setup_s = time.perf_counter() - started

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def destroy(self) -> None:
        self.engine.destroy()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


@functools.cache
def _mallinfo2_function():  # not infinity.memory.host's: the floor's process imports no engine
    function = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if function is None:
        raise SystemExit(f"train_vs_peers: {FLOOR} counts the heap with glibc's mallinfo2 (glibc 2.33 or later), "
                         "which this C library lacks: leave the mode out (--modes)")  # fmt: skip
    function.restype = _MallInfo2
    return function


def _mallinfo2() -> _MallInfo2:
    return _mallinfo2_function()()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Floor:
    """Not an engine: a lower bound on the peak RSS of any engine on stage 3 + cpu offload's JSON, so that an RSS
    target against DeepSpeed can be checked for being within reach at all. Its process holds only what that JSON
    asks of every engine: the whole model in bf16 (gathered, and kept from its forward to its backward, as the
    default stage3_max_reuse_distance keeps it), the fp32 master and Adam's two moments of this rank's share
    (written once, never stepped: offload_optimizer puts them in host memory), and the forward's activations. Each
    gradient is dropped as autograd finishes it (nothing reduced or kept), and there is no step.

    Its own RSS is no bound: the heap's free blocks and holes count in it, and a plain process leaves many. So the
    bound counts bytes, not pages: what the process held outside malloc's heap when it had joined its process group
    (as every engine's rank does) and built nothing (its RSS less every byte of the heap then, free or not), plus
    the most bytes malloc had out at once afterwards (glibc's mallinfo2 sampled every millisecond: a peak the
    sampling misses only lowers the bound). Its step time and loss mean nothing."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        if self.world_size > 1:
            dist.init_process_group("gloo")
        heap = _mallinfo2()
        self.bare_rss = _rss_bytes()
        self.bare_heap = int(heap.arena + heap.hblkhd)  # in use or free, resident or not: an engine could reuse it
        self.peak_live = int(heap.uordblks + heap.hblkhd)
        self.sampling = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.module = None
        self.states: list[torch.Tensor] = []

    def hold(self, model) -> Floor:
        """Takes the model and this rank's optimizer states, and starts counting."""
        self.module = model.to(torch.bfloat16)
        share = -(-sum(p.numel() for p in model.parameters()) // self.world_size)
        self.states = [torch.empty(share, dtype=torch.float32).zero_() for _ in range(3)]  # written: resident
        for parameter in model.parameters():
            parameter.register_post_accumulate_grad_hook(self._drop_gradient)
        self.sampling.set()
        self.sampler.start()
        return self

    def _sample(self) -> None:
        while self.sampling.is_set():
            heap = _mallinfo2()
            self.peak_live = max(self.peak_live, int(heap.uordblks + heap.hblkhd))
            time.sleep(0.001)

    @staticmethod
    def _drop_gradient(parameter) -> None:
        parameter.grad = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        pass  # a bound on memory: the step's math is the engines' to do

    def bound_bytes(self) -> int:
        return self.bare_rss - self.bare_heap + self.peak_live

    def destroy(self) -> None:
        self.sampling.clear()
        self.sampler.join()
        if self.world_size > 1:
            torch.distributed.destroy_process_group()


def build(mode: str, model, args):
    if mode == FLOOR:
        return args.floor.hold(model)
    if mode == "pytorch-ddp":
        return Ddp(model, args.dtype)
    if mode.startswith("fsdp2"):
        return Fsdp2(model, args.dtype, cpu_offload=mode.endswith("cpu-offload"))
    if mode.startswith("deepspeed-"):
        return DeepSpeed(model, ds_config(mode, args.nvme_path, args.dtype))
    import infinity

    engine, *_ = infinity.initialize(model=model, config=ds_config(mode, args.nvme_path, args.dtype))
    return engine


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise KeyError("VmHWM is not in /proc/self/status")


def worker(args) -> None:
    """One rank of one mode (under torchrun): trains ``steps`` steps, writes its measurements."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.mode.startswith("infinity-"):
        import infinity  # noqa: F401  (before the model's tensors, as a user's script would)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(max(1, args.threads // world_size))
    if args.mode == FLOOR:
        args.floor = Floor()  # before the model: its bare process
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=SEQ, use_cache=False, n_layer=args.layers))
    started = time.perf_counter()
    engine = build(args.mode, model, args)
    setup_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(1000 + rank)
    steps = []
    for _ in range(args.steps):
        tokens = torch.randint(0, model.config.vocab_size, (MICRO, SEQ + 1), generator=gen)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        begun = time.perf_counter()
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:]).loss
        engine.backward(loss)
        engine.step()
        finished = time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_SELF)
        steps.append({"step_s": finished - begun, "loss": float(loss.detach()),
                      "minor_faults": after.ru_minflt - usage.ru_minflt,
                      "system_s": after.ru_stime - usage.ru_stime})  # fmt: skip
    engine.destroy()
    measured = {"steps": steps, "peak_rss_bytes": _peak_rss_bytes(), "setup_s": setup_s}
    if args.mode == FLOOR:  # its "peak RSS" is the bound; its own, beside it
        measured["extra_bytes"] = {"own_peak_rss": measured["peak_rss_bytes"], "bare_rss": engine.bare_rss,
                                   "bare_heap": engine.bare_heap, "peak_live_heap": engine.peak_live}  # fmt: skip
        measured["peak_rss_bytes"] = engine.bound_bytes()
    with open(os.path.join(args.out, f"{args.mode}-rank{rank}.json"), "w") as f:
        json.dump(measured, f)


def deepspeed_available() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, env=_env(1, 1))
    return probe.returncode == 0


def _env(world_size: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // world_size)), "DS_ACCELERATOR": "cpu"}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(name, None)  # each peer's own allocator settings (infinity's workers set
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # torch's default for every peer: memory/host.py [Note: huge pages])
    return env


def launch(mode: str, world_size: int, args, out: str) -> bool:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
        os.path.abspath(__file__), "--worker", "--mode", mode, "--nvme-path", args.nvme_path, "--out", out,
        "--steps", str(args.steps), "--dtype", args.dtype, "--threads", str(args.threads),
        "--layers", str(args.layers),
    ]  # fmt: skip
    done = subprocess.run(command, env=_env(world_size, args.threads))
    return done.returncode == 0


def summarise(mode: str, world_size: int, out: str, skip: int) -> dict:
    """Medians over rank 0's measured steps (ranks run in lockstep), the peak RSS of every rank."""
    ranks = []
    for rank in range(world_size):
        with open(os.path.join(out, f"{mode}-rank{rank}.json")) as f:
            ranks.append(json.load(f))
    kept = ranks[0]["steps"][skip:]
    extras = {f"{name}_gib_per_rank": [r["extra_bytes"][name] / 2**30 for r in ranks]
              for name in ranks[0].get("extra_bytes", {})}  # fmt: skip
    return {
        **extras,
        "median_step_s": statistics.median(s["step_s"] for s in kept),
        "minor_faults_per_step": statistics.median(s["minor_faults"] for s in kept),
        "system_s_per_step": statistics.median(s["system_s"] for s in kept),
        "peak_rss_gib_per_rank": [r["peak_rss_bytes"] / 2**30 for r in ranks],
        "setup_s": ranks[0]["setup_s"],
        "last_loss": ranks[0]["steps"][-1]["loss"],
        "losses_rank0": [s["loss"] for s in ranks[0]["steps"]],
    }


def combine(runs: list[dict]) -> dict:
    entry = {key: statistics.median(run[key] for run in runs) for key in runs[0] if not isinstance(runs[0][key], list)}
    entry["peak_rss_gib_per_rank"] = [max(v) for v in zip(*(r["peak_rss_gib_per_rank"] for r in runs), strict=True)]
    entry["peak_rss_gib_per_rank_by_round"] = [r["peak_rss_gib_per_rank"] for r in runs]
    # the floor's parts: the round of its largest bound (a rank's own largest may be another round's)
    largest = max(runs, key=lambda r: max(r["peak_rss_gib_per_rank"]))
    for key in (k for k in runs[0] if k.endswith("_gib_per_rank") and k != "peak_rss_gib_per_rank"):
        entry[key] = largest[key]
    entry["peak_rss_gib"] = max(entry["peak_rss_gib_per_rank"])
    entry["losses_rank0"] = runs[0]["losses_rank0"]
    return entry


def comparisons(modes: dict) -> list[dict]:
    """Every ratio the run can state, with its target; ``met`` is None where a side is missing."""
    rows = []

    def ratio(mine: str, theirs: str, key: str, target: float) -> None:
        kind = "bound" if mine == FLOOR else "target"  # a bound's "met": the target is within any engine's reach
        if mine in modes and theirs in modes:
            value = modes[mine][key] / modes[theirs][key]
            rows.append({"what": f"{mine} / {theirs} {key}", "ratio": value, "target": target, "met": value <= target,
                         "kind": kind})  # fmt: skip
        else:
            rows.append({"what": f"{mine} / {theirs} {key}", "ratio": None, "target": target, "met": None,
                         "kind": kind})  # fmt: skip

    ratio("infinity-stage3-cpu", "deepspeed-stage3-cpu", "median_step_s", 0.9)
    ratio("infinity-stage3-cpu", "deepspeed-stage3-cpu", "peak_rss_gib", 0.6)
    ratio(FLOOR, "deepspeed-stage3-cpu", "peak_rss_gib", 0.6)
    ratio("infinity-stage3-nvme", "deepspeed-stage3-nvme", "median_step_s", 0.8)
    ratio("infinity-stage3-nvme", "deepspeed-stage3-nvme", "peak_rss_gib", 0.6)
    ratio("infinity-stage3-nvme", "infinity-stage3-cpu", "median_step_s", 1.10)
    ratio("infinity-stage3", "fsdp2", "median_step_s", 1.0)
    ratio("infinity-stage3", "fsdp2", "peak_rss_gib", 1.0)
    ratio("infinity-stage2", "pytorch-ddp", "median_step_s", 1.05)
    ratio("infinity-stage2", "deepspeed-stage2", "median_step_s", 1.0)
    ratio("infinity-stage3", "deepspeed-stage3", "median_step_s", 1.0)
    offload = [m for m in ("infinity-stage3-cpu", "infinity-stage3-nvme") if m in modes]
    others = [m for m in modes if not m.startswith("infinity-stage3-") and m != FLOOR]
    if offload and others:
        lowest_other = min(modes[m]["peak_rss_gib"] for m in others)
        value = max(modes[m]["peak_rss_gib"] for m in offload) / lowest_other
        rows.append({"what": "infinity offload modes' peak RSS / the lowest other mode's", "ratio": value,
                     "target": 1.0, "met": value <= 1.0})  # fmt: skip
    return rows


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(report["world_sizes"])
    if not sizes:
        return  # nothing ran: the summary says why
    fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 3.6 * len(sizes)), squeeze=False)
    for row, world_size in enumerate(sizes):
        modes = report["world_sizes"][world_size]
        names = list(modes)
        colours = ["tab:gray" if n == FLOOR else "tab:orange" if n.startswith("infinity") else "tab:blue"
                   for n in names]  # fmt: skip
        timed = [(n, c) for n, c in zip(names, colours, strict=True) if n != FLOOR]  # the floor's step means nothing
        steps = [modes[n]["median_step_s"] for n, _ in timed]
        axes[row][0].bar([n for n, _ in timed], steps, color=[c for _, c in timed])
        axes[row][1].bar(names, [modes[m]["peak_rss_gib"] for m in names], color=colours)
        axes[row][0].set_ylabel(f"world size {world_size}\nmedian step (s)")
        axes[row][1].set_ylabel("peak RSS per rank (GiB)")
        for axis in axes[row]:
            axis.tick_params(axis="x", rotation=35, labelsize=8)
    fig.suptitle(f"GPT-2 124M, seq {SEQ}, micro batch {MICRO}, {report['dtype']}: infinity (orange), its peers (blue), "
                 "the floor (gray)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_summary(report: dict) -> None:
    for world_size, modes in report["world_sizes"].items():
        print(f"\nworld size {world_size}: mode, median step s, peak RSS GiB/rank, minor faults/step, system s/step")
        for mode, entry in modes.items():
            step = "      -" if mode == FLOOR else f"{entry['median_step_s']:7.2f}"  # a bound: its step means nothing
            print(f"  {mode:24} {step} {entry['peak_rss_gib']:7.2f} "
                  f"{entry['minor_faults_per_step']:12,.0f} {entry['system_s_per_step']:7.2f}")  # fmt: skip
        for row in report["comparisons"][world_size]:
            digits = 3 if row.get("kind") == "bound" else 2  # a bound near its target shows on which side it lies
            shown = "n/a (a side did not run)" if row["ratio"] is None else f"{row['ratio']:.{digits}f}"
            verdict = "" if row["met"] is None else ("met" if row["met"] else "NOT met")
            if row.get("kind") == "bound" and row["met"] is not None:
                verdict = "within reach" if row["met"] else "out of reach for any engine on this JSON"
            print(f"  {row['what']}: {shown} (target <= {row['target']}) {verdict}")
    for mode, why in report["not_run"].items():
        print(f"not run: {mode}: {why}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default=None, help="a directory on the disk to swap to (default: one here)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the medians (warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every mode, in alternating order")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (12: GPT-2 small)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads per world")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "train_vs_peers.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    made = args.nvme_path is None
    if made:
        args.nvme_path = tempfile.mkdtemp(prefix="peers-bench-", dir=os.getcwd())
    os.makedirs(args.nvme_path, exist_ok=True)  # a folder that is not there yet is made, as infinity train does
    disk = shutil.disk_usage(args.nvme_path)
    need = SWAP_BYTES_PER_RANK * max(args.world_sizes)  # the nvme modes' swap files, one mode at a time
    if disk.free - need < disk.total // 10:
        print(f"train_vs_peers: {args.nvme_path} has {disk.free / 2**30:.1f} GiB free; the nvme modes need "
              f"{need / 2**30:.1f} GiB and 10% of the disk stays free: pick another --nvme-path", file=sys.stderr)
        return 2
    not_run: dict[str, str] = {}
    modes = list(args.modes)
    if any(m.startswith("deepspeed-") for m in modes) and not deepspeed_available():
        for mode in [m for m in modes if m.startswith("deepspeed-")]:
            not_run[mode] = 'deepspeed is not installed (pip install -e ".[peers]")'
            modes.remove(mode)
    results: dict = {}
    with tempfile.TemporaryDirectory() as out:
        for world_size in args.world_sizes:
            for round_index in range(args.rounds):
                for mode in modes if round_index % 2 == 0 else list(reversed(modes)):
                    print(f"world size {world_size}, {mode} (round {round_index + 1})", flush=True)
                    if launch(mode, world_size, args, out):
                        results.setdefault((world_size, mode), []).append(summarise(mode, world_size, out, args.skip))
                    else:
                        not_run[f"{mode} at world size {world_size}"] = "it failed: see its output above"
    report: dict = {"benchmark": "train_vs_peers", "dtype": args.dtype, "steps": args.steps, "skip": args.skip,
                    "rounds": args.rounds, "threads": args.threads, "layers": args.layers, "world_sizes": {},
                    "comparisons": {}, "not_run": not_run, "deepspeed_overrides": DEEPSPEED_OVERRIDES}  # fmt: skip
    for (world_size, mode), runs in results.items():
        report["world_sizes"].setdefault(str(world_size), {})[mode] = combine(runs)
    for world_size, entries in report["world_sizes"].items():
        report["comparisons"][world_size] = comparisons(entries)
    report["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                             "cpus": os.cpu_count(), "machine": platform.machine()}  # fmt: skip
    report["when"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.json)[0] + ".png")
    print_summary(report)
    if made:  # the folder this run made: DeepSpeed leaves its swap files in it (infinity removes its own)
        shutil.rmtree(args.nvme_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint save and load: engine.save_checkpoint / engine.load_checkpoint (infinity/checkpoint, a Zarr v3 store
written in parallel by every rank, fsynced, published atomically) next to torch.save / torch.load of the same state,
in the same processes. World sizes 1 and 2 (torchrun, gloo); ZeRO stage 3 with offload none (``stage3``) and with
the optimizer and the parameters on NVMe (``stage3-nvme``, every piece read from the disk); the engine
configurations are offload_step.py's, in fp32.

Workload: a transformers GPT-2 small shape (124M parameters, built from GPT2Config, no download), sequence 256,
micro batch 2 per rank (``--micro``), fp32, AdamW, random tokens. Per world size and mode, in one torchrun launch:
1. three warm-up steps (so Adam's states exist), then ``--steps`` normal steps: their median is the normal step;
2. ``--repeats`` rounds of: engine.save_checkpoint to a new tag; torch.save with fsync (the file and its folder);
   plain torch.save. Each timed between barriers on rank 0, after an untimed ``os.sync()`` on every rank so no
   earlier write-back lands in it;
3. the first engine is destroyed, a fresh one (other initial weights) is built in the same processes, and
   ``--repeats`` rounds of: torch.load of this rank's file; engine.load_checkpoint of the last tag;
4. the resumed engine's first step on a batch that the first engine also stepped right after its saves: its time
   over the normal step median, and the difference of the two losses (0 when the resume is exact: weights, Adam
   states and the RNG that drives GPT-2's dropout).

The torch.save baseline is what a user of plain PyTorch or DeepSpeed writes: a dict of full tensors (fp32
weights, Adam's exp_avg and exp_avg_sq per parameter, the buffers). It holds exactly the values the checkpoint
writes, gathered untimed through the save's own walk over the engine's state: at world size 1 every array whole,
at world size 2 each rank torch.saves the flat ranges of its own shard (as DeepSpeed's per-rank zero files), the
arrays every rank holds whole only on rank 0. That favours the baseline: its state is already assembled in memory
(the engine's save reads stage3-nvme's states from the disk while writing), and torch.load's time does not
include putting the tensors into a model and optimizer (the engine's load does). torch.load reads the file it just
wrote from the page cache; the engine reads with O_DIRECT, from the disk (its save wrote around the cache). The
engine's save syncs the whole file system (syncfs), so another process's dirty pages on the same disk count against it.

GB/s is the state's bytes (its tensors' bytes, the same for both sides) over the median seconds, so a ratio
of GB/s is a ratio of times. The bytes on disk are reported too: the tag folder (arrays, Zarr metadata, manifest,
RNG, engine state; Zarr pads each array's last chunk to the full chunk, by less than one row per chunk since the
chunks of an array are near-equal: ``bytes_over_state``) and the torch files (all ranks), with ``save_disk_gbps``,
the tag folder's bytes over the save's seconds.

Targets (world size 1): save and load throughput >= 1.5x torch.save / torch.load (both save ratios are reported:
against plain torch.save, as the target says, and against torch.save + fsync, the durable equivalent); the
resumed run's first step <= 1.2x a normal step. Writes results/checkpoint_io.json and .png (``--out``).

    python benchmarks/checkpoint_io.py --nvme-path /path/on/nvme --world-sizes 1 2 --repeats 3
    python benchmarks/checkpoint_io.py --smoke --out /some/where/smoke.json   # a tiny GPT-2, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from offload_step import HERE, SEQ, disk_bandwidth, engine_config

MODES = ["stage3", "stage3-nvme"]
WARMUP = 3  # steps before anything is timed: Adam's states exist from the first
SMOKE = {"n_embd": 128, "n_layer": 2, "n_head": 2, "vocab_size": 2048, "bos_token_id": 2047, "eos_token_id": 2047}
SMOKE_SEQ = 32


# ---- one rank of one mode (under torchrun) ----
class _Collect:
    """Stands in for the save's ChunkWriter in its walk over the engine's state (save._write_arrays): keeps a copy of
    every piece this rank holds, so the baseline saves exactly the checkpoint's values. Arrays every rank holds
    whole are kept on rank 0 only."""

    def __init__(self, specs: dict, rank: int) -> None:
        self.specs = specs
        self.rank = rank
        self.pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def put(self, key: str, start: int, values: torch.Tensor) -> None:
        spec = self.specs[key]
        if spec.owners is None and self.rank != 0:
            return
        values = values.detach().reshape(-1).to(device="cpu", dtype=spec.meta.dtype, copy=True)
        self.pieces.setdefault(key, []).append((start, values))

    def exchange(self) -> None:
        pass  # each rank keeps its own ranges: no chunk is assembled

    def drain(self) -> None:
        pass  # copies are taken in put(): nothing in flight

    def state(self) -> dict:
        """{"module": {name: tensor}, "optimizer": {state: {name: tensor}}, "buffers": {...}, "starts": {...}}: whole
        tensors in their shapes where this rank holds all of an array, else its flat range from ``starts[key]``."""
        out: dict = {"module": {}, "optimizer": {}, "buffers": {}, "starts": {}}
        for key, pieces in self.pieces.items():
            pieces.sort(key=lambda piece: piece[0])
            flat = torch.cat([values for _, values in pieces])
            shape = self.specs[key].meta.shape
            whole = pieces[0][0] == 0 and flat.numel() == (torch.Size(shape).numel() if shape else 1)
            value = flat.view(shape) if whole else flat
            kind, rest = key.split("/", 1)
            if kind == "params":
                out["module"][rest] = value
            elif kind == "buffers":
                out["buffers"][rest] = value
            else:
                state, name = rest.split("/", 1)
                out["optimizer"].setdefault(state, {})[name] = value
            if not whole:
                out["starts"][key] = [start for start, _ in pieces]
        return out


def baseline_state(engine) -> dict:
    from infinity.checkpoint.save import _write_arrays
    from infinity.checkpoint.state_map import StateMap

    comm = engine.comm
    state_map = StateMap(module=engine.module, optimizer=engine.zero_optimizer, world_size=comm.world_size,
                         rank=comm.rank, steps_taken=engine.global_steps - engine.skipped_steps)  # fmt: skip
    collect = _Collect(state_map.specs, comm.rank)
    _write_arrays(engine, state_map, collect)
    return collect.state()


def torch_save(state: dict, path: str, *, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    if fsync:
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return total


def build_model(smoke: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    extra = SMOKE if smoke else {}  # smoke: about 0.7M parameters
    return GPT2LMHeadModel(GPT2Config(n_positions=SMOKE_SEQ if smoke else SEQ, use_cache=False, **extra))


def worker(args) -> None:
    import torch.distributed as dist

    import infinity

    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(max(1, args.threads // world_size))
    # the default group is ours (the engines come and go in these processes); barriers time the collective calls
    dist.init_process_group("gloo")
    seq = SMOKE_SEQ if args.smoke else SEQ
    work = args.workdir
    swap, ckpt, files = (os.path.join(work, name) for name in ("swap", "checkpoints", "torch"))
    if rank == 0:
        for folder in (swap, ckpt, files):
            os.makedirs(folder, exist_ok=True)
    dist.barrier()
    config = engine_config(args.mode, swap, "fp32")
    config["train_micro_batch_size_per_gpu"] = args.micro

    def make_engine(seed: int):
        torch.manual_seed(seed)
        engine, *_ = infinity.initialize(model=build_model(args.smoke), config=config)
        return engine

    def step(engine, tokens) -> tuple[float, float]:
        started = time.perf_counter()
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:]).loss
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - started, float(loss.detach())

    def timed(action) -> float:
        os.sync()  # untimed: earlier writes reach the disk before the clock starts
        dist.barrier()
        started = time.perf_counter()
        action()
        dist.barrier()
        return time.perf_counter() - started

    vocab = SMOKE["vocab_size"] if args.smoke else 50257  # GPT2Config's default vocabulary
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, vocab, (args.micro, seq + 1), generator=gen) for _ in range(WARMUP + args.steps)]
    after_save = torch.randint(0, vocab, (args.micro, seq + 1), generator=gen)  # both engines step it

    engine = make_engine(0)
    step_s = [step(engine, tokens)[0] for tokens in batches]
    normal = step_s[WARMUP:]
    state = baseline_state(engine)
    tensors = [*state["module"].values(), *state["buffers"].values(),
               *(t for states in state["optimizer"].values() for t in states.values())]  # fmt: skip
    state_bytes = [None] * world_size
    dist.all_gather_object(state_bytes, sum(t.numel() * t.element_size() for t in tensors))
    del tensors
    mine = os.path.join(files, f"rank{rank}")
    result: dict = {"first_step_s": step_s[0], "normal_step_s": normal, "save_s": [], "engine_save_s_rank0": [],
                    "torch_save_fsync_s": [], "torch_save_s": [], "load_s": [], "torch_load_s": []}  # fmt: skip
    for repeat in range(args.repeats):
        tag = f"r{repeat}"
        result["save_s"].append(timed(lambda tag=tag: engine.save_checkpoint(ckpt, tag=tag)))
        result["engine_save_s_rank0"].append(engine.last_checkpoint.seconds)
        for key, fsync in (("torch_save_fsync_s", True), ("torch_save_s", False)):
            path = f"{mine}-{key}.pt"
            if os.path.exists(path):
                os.unlink(path)  # untimed: overwriting would free the old blocks inside the timed call
            result[key].append(timed(lambda path=path, fsync=fsync: torch_save(state, path, fsync=fsync)))
        if rank == 0 and repeat > 0:
            shutil.rmtree(os.path.join(ckpt, f"r{repeat - 1}"))
    last = f"r{args.repeats - 1}"
    if rank == 0:
        result["state_bytes"] = sum(state_bytes)
        result["bytes"] = folder_bytes(os.path.join(ckpt, last))
        result["torch_bytes"] = sum(os.path.getsize(os.path.join(files, f"rank{r}-torch_save_s.pt"))
                                    for r in range(world_size))  # fmt: skip
    _, result["reference_loss"] = step(engine, after_save)
    state = None  # frees the baseline's copy before the second engine is built
    engine.destroy()
    del engine

    engine = make_engine(1)  # other initial weights: the load must replace them
    for _ in range(args.repeats):
        result["torch_load_s"].append(timed(lambda: torch.load(f"{mine}-torch_save_s.pt", weights_only=True)))
        result["load_s"].append(timed(lambda: engine.load_checkpoint(ckpt, tag=last)))
    result["resumed_first_step_s"], result["resumed_loss"] = step(engine, after_save)
    result["resumed_second_step_s"] = step(engine, batches[-1])[0]
    engine.destroy()
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = [None] * world_size
    dist.all_gather_object(rss, result["peak_rss_bytes"])
    if rank == 0:
        result["peak_rss_gib_per_rank"] = [value / 2**30 for value in rss]
        with open(os.path.join(args.results, f"ws{world_size}-{args.mode}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver ----
def filesystem(path: str) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it in /proc/mounts)."""
    path = os.path.realpath(path)
    found, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(found):
                    found, kind = point, fields[2]
    except OSError:
        pass
    return kind


def launch(mode: str, world_size: int, args, work: str, results: str) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
        os.path.abspath(__file__), "--worker", "--mode", mode, "--workdir", work, "--results", results,
        "--steps", str(args.steps), "--repeats", str(args.repeats), "--micro", str(args.micro),
        "--threads", str(args.threads), *(["--smoke"] if args.smoke else []),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // world_size))}
    try:
        subprocess.run(command, check=True, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # checkpoints, torch files and any swap file left behind
    with open(os.path.join(results, f"ws{world_size}-{mode}.json")) as f:
        return summarise(json.load(f))


def summarise(raw: dict) -> dict:
    median = statistics.median
    gb = raw["state_bytes"] / 1e9
    entry = {
        "state_bytes": raw["state_bytes"], "bytes": raw["bytes"], "torch_bytes": raw["torch_bytes"],
        "bytes_over_state": raw["bytes"] / raw["state_bytes"],
        "save_s": median(raw["save_s"]), "load_s": median(raw["load_s"]),
        "torch_save_s": median(raw["torch_save_s"]), "torch_save_fsync_s": median(raw["torch_save_fsync_s"]),
        "torch_load_s": median(raw["torch_load_s"]),
        "normal_step_s": median(raw["normal_step_s"]), "first_step_s": raw["first_step_s"],
        "resumed_first_step_s": raw["resumed_first_step_s"], "resumed_second_step_s": raw["resumed_second_step_s"],
        "resumed_loss_abs_diff": abs(raw["resumed_loss"] - raw["reference_loss"]),
        "peak_rss_gib_per_rank": raw["peak_rss_gib_per_rank"], "raw": raw,
    }  # fmt: skip
    entry["save_gbps"] = gb / entry["save_s"]
    entry["load_gbps"] = gb / entry["load_s"]
    entry["save_disk_gbps"] = raw["bytes"] / 1e9 / entry["save_s"]
    entry["torch_save_gbps"] = gb / entry["torch_save_s"]
    entry["torch_save_fsync_gbps"] = gb / entry["torch_save_fsync_s"]
    entry["torch_load_gbps"] = gb / entry["torch_load_s"]
    entry["save_vs_torch_save"] = entry["save_gbps"] / entry["torch_save_gbps"]
    entry["save_vs_torch_save_fsync"] = entry["save_gbps"] / entry["torch_save_fsync_gbps"]
    entry["load_vs_torch_load"] = entry["load_gbps"] / entry["torch_load_gbps"]
    entry["first_step_ratio"] = entry["resumed_first_step_s"] / entry["normal_step_s"]
    return entry


def targets(report: dict) -> dict:
    found = {}
    for world_size, modes in report["world_sizes"].items():
        for mode, entry in modes.items():
            goal = " (>= 1.5)" if world_size == "1" else ""
            found[f"world{world_size} {mode} save / torch.save GB/s{goal}"] = entry["save_vs_torch_save"]
            found[f"world{world_size} {mode} save / torch.save+fsync GB/s"] = entry["save_vs_torch_save_fsync"]
            found[f"world{world_size} {mode} load / torch.load GB/s{goal}"] = entry["load_vs_torch_load"]
            found[f"world{world_size} {mode} resumed first step / normal step (<= 1.2)"] = entry["first_step_ratio"]
    return found


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(ws, mode) for ws, modes in report["world_sizes"].items() for mode in modes]
    panels = [
        ("save", [("infinity save", "save_gbps"), ("torch.save + fsync", "torch_save_fsync_gbps"),
                  ("torch.save", "torch_save_gbps")]),
        ("load", [("infinity load", "load_gbps"), ("torch.load", "torch_load_gbps")]),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (title, bars) in zip(axes, panels, strict=True):
        width = 0.8 / len(bars)
        for index, (label, key) in enumerate(bars):
            xs = [g + index * width for g in range(len(groups))]
            axis.bar(xs, [report["world_sizes"][ws][mode][key] for ws, mode in groups], width, label=label)
        axis.set_xticks([g + width * (len(bars) - 1) / 2 for g in range(len(groups))],
                        [f"ws{ws} {mode}" for ws, mode in groups], rotation=15)  # fmt: skip
        axis.set_ylabel(f"{title}: state GB / median s")
        axis.set_title(title)
        axis.legend()
    fig.suptitle(f"{report['model']}, fp32 AdamW: checkpoint throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default=None,
                        help="a directory on the disk to measure (swap files, checkpoints and torch files go in a "
                             "new folder inside it; default: a new folder here)")  # fmt: skip
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per mode (medians)")
    parser.add_argument("--steps", type=int, default=5, help="normal steps timed after the 3 warm-up steps")
    parser.add_argument("--micro", type=int, default=2, help="micro batch per rank")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads per world")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT-2 (about 0.7M parameters), for testing")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint_io.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be >= 1")
    if args.worker:
        worker(args)
        return 0
    root = args.nvme_path if args.nvme_path is not None else os.getcwd()
    kind = filesystem(root)
    if kind in ("tmpfs", "ramfs"):
        parser.error(f"{root} is on {kind} (memory, not a disk): pass --nvme-path on a disk")
    base = tempfile.mkdtemp(prefix="checkpoint-bench-", dir=root)
    report: dict = {
        "benchmark": "checkpoint_io",
        "model": "tiny GPT-2 (smoke)" if args.smoke else "GPT-2 124M",
        "seq": SMOKE_SEQ if args.smoke else SEQ, "micro": args.micro, "dtype": "fp32",
        "warmup_steps": WARMUP, "steps": args.steps, "repeats": args.repeats, "threads": args.threads,
        "filesystem": kind, "world_sizes": {},
    }  # fmt: skip
    try:
        if not args.smoke:
            os.makedirs(os.path.join(base, "bandwidth"))
            report["disk_bandwidth_gbps"] = disk_bandwidth(os.path.join(base, "bandwidth"))  # swap store, 1 GiB
        with tempfile.TemporaryDirectory() as results:
            for world_size in args.world_sizes:
                for mode in args.modes:
                    print(f"world size {world_size}, {mode}", flush=True)
                    work = os.path.join(base, f"ws{world_size}-{mode}")
                    report["world_sizes"].setdefault(str(world_size), {})[mode] = launch(
                        mode, world_size, args, work, results
                    )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report["targets"] = targets(report)
    import transformers

    import infinity

    report["environment"] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "infinity": infinity.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
        "processor": platform.processor(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
    }  # fmt: skip
    report["when"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    for world_size, modes in report["world_sizes"].items():
        for mode, e in modes.items():
            print(f"ws{world_size} {mode}: state {e['state_bytes'] / 1e9:.3f} GB (tag folder "
                  f"{e['bytes'] / 1e9:.3f}, torch files {e['torch_bytes'] / 1e9:.3f}); save {e['save_s']:.3f} s "
                  f"({e['save_gbps']:.2f} GB/s), torch.save {e['torch_save_gbps']:.2f}, +fsync "
                  f"{e['torch_save_fsync_gbps']:.2f}; load {e['load_s']:.3f} s ({e['load_gbps']:.2f} GB/s), "
                  f"torch.load {e['torch_load_gbps']:.2f}; step {e['normal_step_s']:.3f} s, resumed first "
                  f"{e['resumed_first_step_s']:.3f} s; loss diff {e['resumed_loss_abs_diff']:.2e}")  # fmt: skip
    print(json.dumps(report["targets"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

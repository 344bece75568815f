"""The largest model this machine trains: ZeRO-Infinity's headline, measured.

From the machine's RAM and the free space on the swap disk, and with ``infinity estimate``'s own arithmetic
(infinity/estimate.py: the plan, the swap files, zero.Init's copy, the host rows and the measured runtime), it
picks the largest Llama-shaped model that fits in two modes: fp32 optimizer states (configs/zero3-nvme.json:
parameters, gradients and AdamW's masters and states on NVMe) and the compact mode (the same, plus
``"infinity": {"optimizer_state_dtype": "int8", "offloaded_gradient_dtype": "bf16", "offloaded_master":
"split"}``). The shape is Llama 3.1
8B's (width 4096, 32 heads, 8 key/value heads, MLP 14336, vocabulary 128256, untied head) with as many layers
as fit: the 8B model itself is that shape with 32 layers. Fitting means: the swap files (and zero.Init's copy
while initialize() takes it) within the free disk less 10% of the disk's size, the estimated peak host RSS within
half the RAM.

Each fitting model then trains for ``--steps`` steps with ``infinity train`` in its own process (bf16, sequence
64, micro-batch 1, a repeated batch: a data file exactly one sequence long, so the loss must fall), and the run
records: parameters; the swap files' peak on disk (sampled from the filesystem's used bytes while it runs, so
zero.Init's copy counts) and its ratio to RAM (the headline); the ratio of the parameters to the largest model
plain PyTorch AdamW holds in this RAM (16 bytes a parameter: fp32 weights, gradients and two states); peak RSS;
the step time split into compute (not waiting), blocked I/O (waiting for a read or a write) and hidden I/O (the
disk busy while compute went on); the step's disk throughput against ``infinity aio-bench``'s on the same folder
(measured first). Writes benchmarks/results/max_model.json and .png.

    python benchmarks/max_model.py --nvme-path DIR
    python benchmarks/max_model.py --nvme-path DIR --plan-only   # the sizes it would train, nothing written
    python benchmarks/max_model.py --nvme-path DIR --rederive    # the last JSON's estimates again, and its plot
    python benchmarks/max_model.py --nvme-path DIR --modes compact --keep-others  # rerun one mode only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
GIB = 1 << 30
DISK_FLOOR = 0.10  # of the disk's size, left free (the project's rule for large runs)
SAFETY_BYTES = 2 * GIB  # below the floor's line: logs, caches and the filesystem's own metadata meanwhile
RSS_SHARE = 0.5  # of the RAM: the peak RSS the issue allows
PLAIN_BYTES = 16  # plain PyTorch AdamW in fp32: weights, gradients, two states
MODES = {
    "fp32 states": {},
    "compact": {"optimizer_state_dtype": "int8", "offloaded_gradient_dtype": "bf16", "offloaded_master": "split"},
}
SHAPE_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=False)  # fmt: skip
TINY = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=False)  # --smoke: the code paths only
TEXT = b"The quick brown fox jumps over the lazy dog. " * 64


def ram_bytes() -> int:
    from infinity.report import meminfo_bytes

    with open("/proc/meminfo") as f:
        return meminfo_bytes(f.read(), "MemTotal")


def shape_fields(layers: int, *, smoke: bool = False) -> dict:
    return {**(TINY if smoke else SHAPE_8B), "num_hidden_layers": layers}


def mode_config(nvme: str, infinity: dict) -> dict:
    """configs/zero3-nvme.json with its swap folder, micro-batch 1, a constant learning rate (WarmupLR starts at
    0, and two steps must move) and the mode's "infinity" section."""
    with open(os.path.join(REPO, "configs", "zero3-nvme.json")) as f:
        raw = json.load(f)
    raw.pop("scheduler", None)
    raw["train_micro_batch_size_per_gpu"] = 1  # as trained (--micro-batch 1): the estimate's activations too
    raw["optimizer"]["params"]["lr"] = 1e-4
    raw["steps_per_print"] = 1
    for key in ("offload_param", "offload_optimizer"):
        raw["zero_optimization"][key]["nvme_path"] = nvme
    if infinity:
        raw["infinity"] = dict(infinity)
    return raw


def estimate_for(raw: dict, layers: int, *, seq_len: int, ram: int, smoke: bool, runtime: int | None = None):
    """``infinity estimate``'s figures for the shape with ``layers`` layers, planned with ``ram`` as the host
    memory (as the run will be: INFINITY_HOST_MEMORY_BYTES); ``runtime``: the measured runtime, else measured."""
    from infinity import estimate
    from infinity.budget import Where
    from infinity.train.models import ModelShape
    from infinity.train.options import quiet_transformers

    quiet_transformers()
    shape = ModelShape(name=f"llama-8b-shape-{layers}L", family="llama", fields=shape_fields(layers, smoke=smoke),
                       note="the Llama 3.1 8B shape with fewer layers")  # fmt: skip
    result, _ = estimate.plan_estimate(shape, raw, argparse.Namespace(world_size=1, seq_len=seq_len), available=ram)
    runtime = estimate.runtime_bytes(shape, raw) or 0 if runtime is None else runtime
    figures = {"layers": layers, "parameters": result.numel, "estimated_swap_bytes": result.total(Where.NVME),
               "gradients_on_nvme": result.plan.gradients_on_nvme,
               "estimated_init_copy_bytes": result.nvme_during_init,
               "estimated_host_bytes": result.host_bytes(cuda=False) + runtime}  # fmt: skip
    return result, runtime, figures


def largest_fit(raw: dict, *, seq_len: int, ram: int, disk: int, max_layers: int, smoke: bool) -> dict | None:
    """The most layers of the 8B shape (at most ``max_layers``) whose estimate fits ``ram`` (peak host RSS) and
    ``disk`` (swap files, or zero.Init's copy where larger), with the estimate's figures."""
    from infinity import estimate
    from infinity.memory.nvme_store import can_punch_holes

    punches = can_punch_holes(raw["zero_optimization"]["offload_param"]["nvme_path"])  # else the copy counts too
    runtime = None
    best = None
    for layers in range(1, max_layers + 1):
        result, runtime, figures = estimate_for(raw, layers, seq_len=seq_len, ram=ram, smoke=smoke, runtime=runtime)
        if not estimate.fits(result, runtime=runtime, ranks=1, ram=ram, disk=disk, init_given_back=punches):
            break
        best = figures
    return best


def rederive(path: str) -> None:
    """Recomputes the estimate's figures of each run of the last JSON (its layers, mode and budget) and the plot."""
    with open(path + ".json") as f:
        report = json.load(f)
    for run in report["runs"]:
        raw = mode_config(os.path.join(tempfile.gettempdir(), "unused"), MODES[run["mode"]])
        *_, figures = estimate_for(raw, run["layers"], seq_len=report["seq_len"], ram=report["host_budget_bytes"],
                                   smoke=report["smoke"])  # fmt: skip
        run["estimate"] = figures
    with open(path + ".json", "w") as f:
        json.dump(report, f, indent=1)
    plot(report, path + ".png")


def kept_runs(path: str, rerun: list[str]) -> list[dict]:
    """The last JSON's runs of the modes not rerun, each with the machine and aio-bench figures it was measured
    with (the report's own are this invocation's)."""
    if not os.path.exists(path + ".json"):
        return []
    with open(path + ".json") as f:
        previous = json.load(f)
    kept = []
    for run in previous["runs"]:
        if run["mode"] not in rerun:
            run.setdefault("earlier_invocation", {"machine": previous["machine"],
                                                  "aio_bench_gbps": previous["aio_bench_gbps"]})  # fmt: skip
            kept.append(run)
    return kept


def aio_speeds(folder: str) -> dict:
    """The disk's read and write speed through infinity's aio engine, as aio-bench measures it (median of 3)."""
    out = os.path.join(folder, "aio-bench.json")
    subprocess.run([sys.executable, "-m", "infinity.cli", "aio-bench", "--folder", folder, "--io-size", "2G",
                    "--both", "--loops", "3", "--json", out], check=True, capture_output=True)  # fmt: skip
    with open(out) as f:
        rows = json.load(f)["rows"]
    os.remove(out)
    return {row["op"]: row["median_gbps"] for row in rows}


class DiskSampler(threading.Thread):
    """The filesystem's used bytes, sampled every half second: the peak minus the start is what a run put there."""

    def __init__(self, folder: str) -> None:
        super().__init__(daemon=True)
        self.folder = folder
        self.start_used = shutil.disk_usage(folder).used
        self.peak = self.start_used
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.peak = max(self.peak, shutil.disk_usage(self.folder).used)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak - self.start_used


def train(mode: str, fit: dict, *, nvme: str, work: str, steps: int, seq_len: int, host_budget: int,
          smoke: bool) -> dict:  # fmt: skip
    """One ``infinity train`` run of the fitted model, in its own process, with its summary."""
    folder = os.path.join(nvme, mode.replace(" ", "-"))
    os.makedirs(folder, exist_ok=True)
    cfg = os.path.join(work, f"{mode.replace(' ', '-')}.json")
    with open(cfg, "w") as f:
        json.dump(mode_config(folder, MODES[mode]), f)
    model = os.path.join(work, f"llama-{fit['layers']}L.json")
    with open(model, "w") as f:
        json.dump(shape_fields(fit["layers"], smoke=smoke), f)
    data = os.path.join(work, "one-sequence.txt")
    with open(data, "wb") as f:
        f.write(TEXT[: seq_len + 1])  # one window: every step trains on the same batch
    summary = os.path.join(work, f"{mode.replace(' ', '-')}-summary.json")
    command = [sys.executable, "-m", "infinity.cli", "train", "--config", cfg, "--model", model, "--steps",
               str(steps), "--seq-len", str(seq_len), "--micro-batch", "1", "--dtype", "bf16", "--data", data,
               "--summary-json", summary]  # fmt: skip
    print(f"[max_model] {mode}: {fit['layers']} layers, {fit['parameters'] / 1e9:.2f}B parameters", flush=True)
    sampler = DiskSampler(nvme)
    sampler.start()
    started = time.perf_counter()
    env = {**os.environ, "INFINITY_HOST_MEMORY_BYTES": str(host_budget)}  # the budget the estimate planned with
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output, marks = [], []
    for line in child.stdout:  # each step's line: the process's counters then (the step's own, by difference)
        output.append(line)
        if STEP_LINE.match(line):
            marks.append(process_counters(child.pid))
    code = child.wait()
    wall = time.perf_counter() - started
    peak_disk = sampler.stop()
    if code != 0:
        raise RuntimeError(f"{mode}: infinity train exited {code}: {''.join(output)[-3000:]}")
    with open(summary) as f:
        result = json.load(f)
    shutil.rmtree(folder, ignore_errors=True)
    pairs = zip(marks, marks[1:], strict=False)
    later_steps = [{key: later[key] - earlier[key] for key in later} for earlier, later in pairs]
    return {"summary": result, "peak_disk_bytes": peak_disk, "wall_s": wall, "later_steps": later_steps}


STEP_LINE = re.compile(r"step \d+/\d+: loss")


def process_counters(pid: int) -> dict:
    """Minor faults and user/system CPU seconds of a live process so far (/proc/<pid>/stat: all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return {"minor_faults": int(fields[7]), "user_s": int(fields[11]) / tick, "system_s": int(fields[12]) / tick}


def derive(mode: str, fit: dict, run: dict, *, ram: int, speeds: dict, steps: int) -> dict:
    summary = run["summary"]
    io = summary["io"]
    read = sum(io["read"].values())
    written = sum(io["written"].values())
    loop, blocked, busy = summary["loop_s"], summary["blocked_s_max"], summary["disk_busy_s"]
    losses = summary["losses"]
    disk_bound = read / 1e9 / speeds["read"] + written / 1e9 / speeds["write"]
    return {
        "mode": mode, "layers": fit["layers"], "parameters": fit["parameters"], "estimate": fit,
        "swap_peak_bytes": run["peak_disk_bytes"], "swap_over_ram": run["peak_disk_bytes"] / ram,
        "swap_bytes_per_parameter": run["peak_disk_bytes"] / fit["parameters"],
        "vs_plain_pytorch": fit["parameters"] / (ram / PLAIN_BYTES),
        "peak_rss_bytes": summary["peak_rss_max"], "peak_rss_over_ram": summary["peak_rss_max"] / ram,
        "losses": losses, "loss_fell": losses[-1] < losses[0],
        "median_step_s": summary["median_step_s"], "wall_s": run["wall_s"], "total_s": summary["total_s"],
        "per_step": {"compute_s": (loop - blocked) / steps, "blocked_io_s": blocked / steps,
                     "hidden_io_s": max(busy - blocked, 0.0) / steps if busy is not None else None},
        "bytes_read_per_step": read / steps, "bytes_written_per_step": written / steps,
        "disk_gbps": (read + written) / 1e9 / busy if busy else None,
        "later_steps": run["later_steps"],  # steps 2.. (step 1 warms up): faults and CPU of each, from /proc
        "faults_per_page_moved": _per_step_share(run, "minor_faults", (read + written) / steps / 4096),
        "system_share_of_step": _per_step_share(run, "system_s", summary["median_step_s"]),
        "disk_bound_step_s": disk_bound / steps,
        "step_over_disk_bound": summary["median_step_s"] / (disk_bound / steps),
    }  # fmt: skip


def _per_step_share(run: dict, key: str, whole: float) -> float | None:
    """The later steps' median ``key`` as a share of ``whole``; None without a later step."""
    values = [step[key] for step in run["later_steps"]]
    return statistics.median(values) / whole if values and whole else None


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["plain PyTorch AdamW\n(16 B/param in RAM)"] + [f"{r['mode']}\n({r['layers']} layers)" for r in runs]
    sizes = [report["plain_pytorch_parameters"] / 1e9] + [r["parameters"] / 1e9 for r in runs]
    bars = left.bar(names, sizes, color=["grey"] + ["tab:blue", "tab:green"][: len(runs)])
    for bar, run in zip(bars[1:], runs, strict=True):
        left.annotate(f"swap {run['swap_over_ram']:.1f}x RAM\nRSS {run['peak_rss_over_ram']:.0%} of RAM",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    left.axhline(8.03, color="red", linestyle="--", linewidth=1)
    left.annotate("Llama 3.1 8B", (0, 8.03), color="red", fontsize=8, va="bottom")
    left.set_ylabel("parameters (billions)")
    left.set_title(f"largest model: {report['machine']['ram_bytes'] / GIB:.1f} GiB RAM, "
                   f"{report['machine']['usable_disk_bytes'] / 1e9:.0f} GB usable disk")  # fmt: skip
    bottom = [0.0] * len(runs)
    for key, color in (("compute_s", "tab:blue"), ("blocked_io_s", "tab:red"), ("hidden_io_s", "tab:orange")):
        values = [r["per_step"][key] or 0.0 for r in runs]
        right.bar([r["mode"] for r in runs], values, bottom=bottom, color=color, label=key.replace("_s", ""))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("seconds per step (hidden I/O ran during compute:\nthe bar is taller than the step)")
    right.set_title("step time split")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True, help="a folder on the swap disk (made if missing)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--plan-only", action="store_true", help="print the sizes that fit; train nothing")
    parser.add_argument("--max-layers", type=int, default=128, help="stop the search there")
    parser.add_argument("--smoke", action="store_true", help="a width-256 Llama instead of the 8B's: checks the code")
    parser.add_argument("--out", default=os.path.join(RESULTS, "max_model"), help="JSON/PNG path stem")
    parser.add_argument("--rederive", action="store_true", help="recompute the last JSON's estimates and plot")
    parser.add_argument("--keep-others", action="store_true",
                        help="keep the last JSON's runs of the modes not in --modes (each marked with the machine "
                             "and aio-bench figures of the invocation that measured it)")  # fmt: skip
    args = parser.parse_args()
    if args.rederive:
        rederive(args.out)
        return 0
    nvme = os.path.abspath(args.nvme_path)
    os.makedirs(nvme, exist_ok=True)
    ram = ram_bytes()
    disk = shutil.disk_usage(nvme)
    usable = disk.free - int(DISK_FLOOR * disk.total) - SAFETY_BYTES
    machine = {"ram_bytes": ram, "disk_total_bytes": disk.total, "disk_free_bytes": disk.free,
               "usable_disk_bytes": usable, "cpus": os.cpu_count()}  # fmt: skip
    print(f"[max_model] RAM {ram / GIB:.1f} GiB; disk {disk.free / 1e9:.1f} GB free of {disk.total / 1e9:.1f} GB, "
          f"{usable / 1e9:.1f} GB usable ({DISK_FLOOR:.0%} stays free, and 2 GiB more); peak RSS allowed "
          f"{RSS_SHARE:.0%} of RAM",
          flush=True)  # fmt: skip
    budget = int(RSS_SHARE * ram)
    fits = {}
    for mode in args.modes:
        fits[mode] = largest_fit(mode_config(nvme, MODES[mode]), seq_len=args.seq_len, ram=budget, disk=usable,
                                 max_layers=args.max_layers, smoke=args.smoke)  # fmt: skip
        fit = fits[mode]
        if fit is None:
            print(f"[max_model] {mode}: not even one layer fits", flush=True)
            continue
        print(f"[max_model] {mode}: {fit['layers']} layers of the 8B shape, {fit['parameters'] / 1e9:.2f}B "
              f"parameters; estimate: swap {fit['estimated_swap_bytes'] / 1e9:.1f} GB (+ zero.Init's copy "
              f"{fit['estimated_init_copy_bytes'] / 1e9:.1f} GB), host {fit['estimated_host_bytes'] / GIB:.1f} GiB",
              flush=True)  # fmt: skip
    if args.plan_only:
        return 0
    speeds = aio_speeds(nvme)
    print(f"[max_model] aio-bench on the same folder: read {speeds['read']:.2f} GB/s, write {speeds['write']:.2f} GB/s",
          flush=True)  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for mode, fit in fits.items():
            if fit is None:
                continue
            run = train(mode, fit, nvme=nvme, work=work, steps=args.steps, seq_len=args.seq_len, host_budget=budget,
                        smoke=args.smoke)  # fmt: skip
            runs.append(derive(mode, fit, run, ram=ram, speeds=speeds, steps=args.steps))
            r = runs[-1]
            print(f"[max_model] {mode}: losses {r['losses']}, swap peak {r['swap_peak_bytes'] / 1e9:.1f} GB "
                  f"({r['swap_over_ram']:.2f}x RAM, {r['swap_bytes_per_parameter']:.1f} B/param), peak RSS "
                  f"{r['peak_rss_bytes'] / GIB:.2f} GiB, median step {r['median_step_s']:.1f} s",
                  flush=True)  # fmt: skip
    if args.keep_others:
        runs = kept_runs(args.out, args.modes) + runs
        runs.sort(key=lambda run: list(MODES).index(run["mode"]))
    report = {
        "benchmark": "max_model", "machine": machine, "aio_bench_gbps": speeds, "steps": args.steps,
        "seq_len": args.seq_len, "host_budget_bytes": budget, "smoke": args.smoke,
        "plain_pytorch_parameters": ram / PLAIN_BYTES, "target_8b_parameters": 8_030_261_248,
        "runs": runs,
    }  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    plot(report, args.out + ".png")
    print(f"[max_model] wrote {args.out}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

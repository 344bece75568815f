"""ZeRO-Inference: greedy generation with the weights in RAM vs. on NVMe, tokens/s and peak RSS, in one run.

Workload: a GPT-2-medium-shaped transformers model (24 layers, n_embd 1024, 16 heads, vocabulary 50257: 355M
parameters, 1.4 GB in fp32), built from GPT2Config (no download) under infinity.zero.Init, so it never exists
whole; greedy generation of ``--new-tokens`` tokens from a fixed prompt of ``--prompt-tokens`` tokens, world size 1.
Modes, each in its own process (peak RSS is VmHWM from /proc/self/status: getrusage's ru_maxrss is carried across
exec and would report the parent's):
- plain: the model built as usual and model.generate(), no engine (the reference; skipped with --no-plain);
- ram-once: the inference engine at stage 3, every piece in memory, default knobs: the model fits
  stage3_max_live_parameters, so generate() gathers it once for the call and its forwards skip the fetching
  machinery (infinity/generation.py);
- ram:   the inference engine at stage 3, every piece in memory, streaming;
- nvme:  the same with offload_param on NVMe (max_in_cpu 0: every piece on the disk, the model built under
  zero.Init straight to it), each forward streaming the weights through the staging ring, read ahead along the
  trace.
The ram and nvme modes use the same streaming knobs (each unit released after its use, about two blocks live,
prefetch one block ahead), so they differ only in where the pieces live. Reported per mode: median tokens/s over
``--repeats`` generate() calls after one warm-up, peak RSS, and for nvme the bytes read per token and the seconds
blocked on reads; the ratios nvme/ram and ram-once/plain, and whether each mode generates plain PyTorch's
tokens. Writes results/zero_inference.json and .png.

    python benchmarks/zero_inference.py --nvme-path /path/on/nvme --new-tokens 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from infinity.memory.host import process_status_bytes

MODES = ["plain", "ram-once", "ram", "nvme"]
LAYERS, HIDDEN, HEADS, VOCAB = 24, 1024, 16, 50257
BLOCK_NUMEL = 12 * HIDDEN * HIDDEN  # one block's weights (attention 4 h^2, MLP 8 h^2)
HERE = os.path.dirname(os.path.abspath(__file__))


def engine_config(mode: str, nvme_path: str) -> dict:
    if mode == "ram-once":
        return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10 * HIDDEN}}
    zero: dict = {
        "stage": 3,
        "stage3_max_reuse_distance": 0,  # a unit is released after its use: the weights stream
        "stage3_max_live_parameters": 2 * BLOCK_NUMEL,
        "stage3_prefetch_bucket_size": BLOCK_NUMEL,
        "stage3_param_persistence_threshold": 10 * HIDDEN,  # biases and layer norms stay whole (Transformers' "auto")
    }
    if mode == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0}
    return {"zero_optimization": zero}


def worker(args) -> None:
    """One mode in this process: build, one warm-up generate(), ``repeats`` measured ones; writes its JSON."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import infinity

    torch.set_num_threads(args.threads)
    config = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=1024)
    torch.manual_seed(0)
    started = time.perf_counter()
    engine = None
    if args.mode == "plain":
        model = GPT2LMHeadModel(config)
    else:
        ds_config = engine_config(args.mode, args.nvme_path)
        with infinity.zero.Init(config=ds_config):
            model = GPT2LMHeadModel(config)
        engine, *_ = infinity.initialize(model=model, config=ds_config)
        model = engine.module
    model.eval()
    build_s = time.perf_counter() - started
    prompt = torch.randint(0, VOCAB, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(1))
    kwargs = {"attention_mask": torch.ones_like(prompt), "do_sample": False, "max_new_tokens": args.new_tokens,
              "min_new_tokens": args.new_tokens, "pad_token_id": config.eos_token_id}  # fmt: skip
    times, tokens, calls = [], None, []
    for index in range(args.repeats + 1):
        before = _nvme_reads(engine)
        if engine is not None:
            engine.zero_stats()  # start this call's fetch counters
        started = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        elapsed = time.perf_counter() - started
        tokens = out[0, args.prompt_tokens :].tolist()
        if index == 0:
            continue  # warm-up: the first forward records the trace the others read ahead along
        times.append(elapsed)
        if engine is not None:
            after = _nvme_reads(engine)
            calls.append({"read_bytes": after["bytes"] - before["bytes"],
                          "blocked_s": after["blocked_s"] - before["blocked_s"],
                          "prefetched_fraction": engine.zero_stats()["prefetched_fraction"]})  # fmt: skip
    result = {
        "mode": args.mode,
        "build_s": build_s,
        "generate_s": times,
        "tokens_per_s": [args.new_tokens / t for t in times],
        "median_tokens_per_s": statistics.median(args.new_tokens / t for t in times),
        "peak_rss_bytes": process_status_bytes("VmHWM"),
        "tokens": tokens,
    }
    if engine is not None:
        result["nvme_read_bytes_per_token"] = statistics.median(c["read_bytes"] for c in calls) / args.new_tokens
        result["nvme_read_blocked_s_per_call"] = statistics.median(c["blocked_s"] for c in calls)
        result["prefetched_fraction"] = statistics.median(c["prefetched_fraction"] for c in calls)
        engine.destroy()
    with open(args.out, "w") as f:
        json.dump(result, f)


def _nvme_reads(engine) -> dict:
    stats = engine.tier_stats().get("parameters") if engine is not None else None
    if stats is None:
        return {"bytes": 0, "blocked_s": 0.0}
    return stats["traffic"]["nvme_read"]


def parameter_count() -> int:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        shape = GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB))
    return sum(p.numel() for p in shape.parameters())


def launch(mode: str, args, out: str) -> dict:
    command = [
        sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode, "--out", out,
        "--nvme-path", args.nvme_path, "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
        "--repeats", str(args.repeats), "--threads", str(args.threads),
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    with open(out) as f:
        return json.load(f)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    rows = [report["modes"][m] for m in modes]
    colors = {"plain": "#888888", "ram-once": "#2ca02c", "ram": "#1f77b4", "nvme": "#ff7f0e"}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    axes[0].bar(modes, [r["median_tokens_per_s"] for r in rows], color=[colors[m] for m in modes])
    axes[0].set_ylabel("tokens/s (median)")
    axes[1].bar(modes, [r["peak_rss_bytes"] / 2**30 for r in rows], color=[colors[m] for m in modes])
    axes[1].set_ylabel("peak RSS (GiB)")
    ratio = report.get("nvme_over_ram", {})
    if ratio:
        axes[0].set_title(f"nvme/ram: x{ratio['tokens_per_s']:.2f} tokens/s", fontsize=9)
        axes[1].set_title(f"nvme/ram: x{ratio['peak_rss']:.2f} peak RSS", fontsize=9)
    fig.suptitle(report["workload"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", default=None,
                        help="a directory on the disk the weights go to (default: a new folder under the current "
                             "directory, removed at the end)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per call (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="tokens in the fixed prompt (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="measured generate() calls per mode, after a warm-up")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain PyTorch reference (it holds 1.4 GB)")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "zero_inference.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    made = args.nvme_path is None
    if made:
        args.nvme_path = tempfile.mkdtemp(prefix="zero-inference-", dir=os.getcwd())
    if not os.path.isdir(args.nvme_path):
        parser.error(f"--nvme-path {args.nvme_path!r} is not a directory; create it first")
    modes = [m for m in MODES if not (args.no_plain and m == "plain")]
    results = {}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for mode in modes:
                print(f"{mode} ...", flush=True)
                results[mode] = launch(mode, args, os.path.join(scratch, f"{mode}.json"))
    finally:
        if made:
            shutil.rmtree(args.nvme_path, ignore_errors=True)
    report: dict = {
        "benchmark": "benchmarks/zero_inference.py",
        "workload": f"GPT-2-medium shape ({LAYERS} layers, n_embd {HIDDEN}, vocab {VOCAB}), fp32, world size 1, "
        f"greedy, prompt {args.prompt_tokens} + {args.new_tokens} new tokens, median of {args.repeats}",
        "parameters": parameter_count(),
        "modes": results,
        "engine_tokens_equal": results["ram"]["tokens"] == results["nvme"]["tokens"],
        "tokens_equal_plain": {m: r["tokens"] == results["plain"]["tokens"] for m, r in results.items()}
        if "plain" in results else None,
        "ram_once_over_plain": results["ram-once"]["median_tokens_per_s"] / results["plain"]["median_tokens_per_s"]
        if "plain" in results and "ram-once" in results else None,
        "nvme_over_ram": {
            "tokens_per_s": results["nvme"]["median_tokens_per_s"] / results["ram"]["median_tokens_per_s"],
            "peak_rss": results["nvme"]["peak_rss_bytes"] / results["ram"]["peak_rss_bytes"],
        },
        "engine_config": {m: engine_config(m, "<nvme-path>") for m in ("ram-once", "ram", "nvme")},
        "environment": {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                        "python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M:%S")},
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.json)[0] + ".png")
    print(report["workload"])
    for mode, row in results.items():
        rss = row["peak_rss_bytes"] / 2**30
        line = f"{mode:<8} {row['median_tokens_per_s']:6.2f} tokens/s  peak RSS {rss:5.2f} GiB"
        if "nvme_read_bytes_per_token" in row and mode == "nvme":
            line += (f"  {row['nvme_read_bytes_per_token'] / 1e9:.2f} GB read/token, blocked "
                     f"{row['nvme_read_blocked_s_per_call']:.2f} s/call, {100 * row['prefetched_fraction']:.0f}% "
                     "of fetches prefetched")  # fmt: skip
        print(line)
    if report["ram_once_over_plain"] is not None:
        print(f"ram-once/plain: x{report['ram_once_over_plain']:.2f} tokens/s; the same tokens as plain PyTorch: "
              f"{report['tokens_equal_plain']}")  # fmt: skip
    ratio = report["nvme_over_ram"]
    print(f"nvme/ram: x{ratio['tokens_per_s']:.2f} tokens/s, x{ratio['peak_rss']:.2f} peak RSS; "
          f"ram and nvme generate the same tokens: {report['engine_tokens_equal']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

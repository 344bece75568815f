"""Step time of ZeRO stage 3 vs stage 2 on a tiny transformers GPT-2, world size 2 (gloo), and how much of
stage 3's fetching the prefetcher hides.

The model is built from a config (no download): GPT-2 with n_embd 256, 6 layers, 8 heads, vocabulary 8192,
sequence 128 (about 7M parameters, lm_head tied to wte), micro batch 4 per rank, bf16, AdamW, random tokens.
Three engines live side by side in the same two processes and their steps alternate (the order rotates every
step), so all see the same machine: stage 2, stage 3 with DeepSpeed's default knobs (on a model this small
they keep every unit gathered once fetched), stage 3 under memory pressure ("tight": max_live_parameters 3.2M,
half the model, of which the tied embedding, 2.1M, stays gathered through backward until its gradient is
complete; prefetch_bucket_size 1M; max_reuse_distance 0, so units are released after each use and prefetched
along the trace), and stage 3 with prefetch off (stage3_prefetch_bucket_size 0).
Reported: median step times, the ratio stage 3 / stage 2, and from
engine.zero_stats() the fraction of fetches that found their unit already gathered or in flight, and the time
blocked on fetches. Writes results/stage3_vs_stage2.json and .png.

    python benchmarks/stage3_vs_stage2.py --steps 20 --warmup 3
"""

from __future__ import annotations

import argparse
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

CONTENDERS = ["stage2", "stage3", "stage3-tight", "stage3-no-prefetch"]
SEQ, MICRO, VOCAB, LR = 128, 4, 8192, 1e-4


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=6, n_head=8, use_cache=False, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def engine_config(name: str) -> dict:
    zero = {"stage": 2 if name == "stage2" else 3, "overlap_comm": True}
    if name == "stage3-no-prefetch":
        zero["stage3_prefetch_bucket_size"] = 0
    if name == "stage3-tight":  # half the model live at once, released right after use
        zero.update(stage3_max_live_parameters=3_200_000, stage3_prefetch_bucket_size=1_000_000,
                    stage3_max_reuse_distance=0)  # fmt: skip
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def worker(rank: int, world_size: int, workdir: str, steps: int, warmup: int, threads: int) -> None:
    import infinity

    torch.set_num_threads(threads)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    engines = {name: infinity.initialize(model=build_model(), config=engine_config(name))[0] for name in CONTENDERS}
    gen = torch.Generator().manual_seed(100 + rank)
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    stats: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    losses: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for index in range(steps + warmup):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        shift = index % len(CONTENDERS)
        for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
            engine = engines[name]
            dist.barrier()
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - start
            losses[name].append(loss.item())
            if index >= warmup:
                times[name].append(elapsed)
                stats[name].append(engine.zero_stats())
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"times": times, "stats": stats, "losses": losses}, f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    world_size, cores = 2, os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as workdir:
        mp.start_processes(
            worker,
            args=(world_size, workdir, args.steps, args.warmup, max(1, cores // world_size)),
            nprocs=world_size,
            start_method="spawn",
        )
        with open(os.path.join(workdir, "rank0.pkl"), "rb") as f:
            result = pickle.load(f)
    rows = {}
    for name in CONTENDERS:
        row = {"median_s": statistics.median(result["times"][name]), "times_s": result["times"][name]}
        if name != "stage2":
            per_step = result["stats"][name]
            fetches = sum(s["fetches"] for s in per_step)
            hidden = sum(s["already_gathered"] + s["in_flight"] for s in per_step)
            row.update(
                prefetched_fraction=hidden / fetches if fetches else 0.0,
                fetches_per_step=fetches / len(per_step),
                prefetches_per_step=sum(s["prefetches"] for s in per_step) / len(per_step),
                blocked_s_median=statistics.median(s["blocked_s"] for s in per_step),
                peak_live_numel=max(s["peak_live_numel"] for s in per_step),
                gathered_numel_per_step=statistics.median(s["gathered_numel"] for s in per_step),
            )
        rows[name] = row
    for name in CONTENDERS[1:]:
        rows[name]["ratio_vs_stage2"] = rows[name]["median_s"] / rows["stage2"]["median_s"]
    same_losses = all(
        abs(a - b) <= 2e-2 * abs(b) for a, b in zip(result["losses"]["stage3"], result["losses"]["stage2"], strict=True)
    )
    report = {
        "benchmark": "benchmarks/stage3_vs_stage2.py",
        "model": f"transformers GPT-2 tiny (n_embd 256, 6 layers, vocab {VOCAB}, tied), seq {SEQ}, micro {MICRO}, "
        "bf16, AdamW, world size 2 (gloo)",
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
        "stage3_losses_track_stage2": same_losses,
        "environment": {
            "cpus": cores,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stage3_vs_stage2.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(args.out, "stage3_vs_stage2.png"))
    print(f"{report['model']}; medians of {args.steps} paired steps")
    for name, row in rows.items():
        line = f"{name:<20} {row['median_s'] * 1e3:7.1f} ms/step"
        if name != "stage2":
            line += (
                f"  x{row['ratio_vs_stage2']:.2f} of stage 2, {100 * row['prefetched_fraction']:.0f}% of "
                f"{row['fetches_per_step']:.0f} fetches/step prefetched or kept, blocked "
                f"{row['blocked_s_median'] * 1e3:.1f} ms/step, peak {row['peak_live_numel'] / 1e6:.1f}M live"
            )
        print(line)
    print(f"stage 3 losses track stage 2's (within 2%, bf16): {same_losses}")
    return 0


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    medians = [rows[name]["median_s"] * 1e3 for name in CONTENDERS]
    bars = ax.bar(CONTENDERS, medians, color=["#888888", "#1f77b4", "#6baed6", "#c6dbef"])
    for bar, name in zip(bars, CONTENDERS, strict=True):
        label = "" if name == "stage2" else (
            f"x{rows[name]['ratio_vs_stage2']:.2f}\n{100 * rows[name]['prefetched_fraction']:.0f}% prefetched"
        )  # fmt: skip
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("median step time (ms)")
    ax.set_ylim(0, max(medians) * 1.2)
    head, _, tail = report["model"].partition("), ")
    ax.set_title(f"{head}),\n{tail}; labels: ratio to stage 2, fetches prefetched or kept", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

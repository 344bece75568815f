"""Train a small GPT-2 (built here from a config, no download) with ZeRO-Infinity: stage 3, parameters and
optimizer states on NVMe, on a learnable synthetic task (each sequence counts up from a random token, so the
loss falls fast). Prints the loss, step time and the NVMe traffic.

    python examples/train_nvme.py --nvme-path ./swap --steps 20
    torchrun --nproc_per_node 2 examples/train_nvme.py --nvme-path ./swap

The swap folder (<nvme-path>/infinity-<run id>-*/rank<r>/) is removed when the run ends, however it ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch

import infinity

VOCAB = 512
HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", default="swap", help="a directory on a fast disk (made if missing)")
    parser.add_argument("--config", default=os.path.join(HERE, "..", "configs", "zero3-nvme.json"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import GPT2Config, GPT2LMHeadModel

    os.makedirs(args.nvme_path, exist_ok=True)
    with open(args.config) as f:
        config = json.load(f)
    for section in ("offload_param", "offload_optimizer"):
        if section in config["zero_optimization"]:
            config["zero_optimization"][section]["nvme_path"] = args.nvme_path
    if config["zero_optimization"].get("offload_param", {}).get("device") == "nvme":
        # every piece read from NVMe, whatever --config says: max_in_cpu's default (1e9 elements) would keep
        # this model in host memory
        config["zero_optimization"]["offload_param"]["max_in_cpu"] = 0
    if not torch.cuda.is_available():
        config["bf16"] = {"enabled": False}  # fp32 on the CPU: without bf16 units its bf16 matmuls are slower
    config["steps_per_print"] = 5
    config["optimizer"]["params"]["lr"] = 1e-3
    if "scheduler" in config:  # a short warmup: this run is short
        config["scheduler"]["params"].update(warmup_max_lr=1e-3, warmup_num_steps=min(5, args.steps))
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10_000
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.width,
                                       n_layer=args.layers, n_head=8, use_cache=False))  # fmt: skip
    engine, *_ = infinity.initialize(model=model, config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    generator = torch.Generator().manual_seed(engine.global_rank)
    started = time.perf_counter()
    losses = []
    for step in range(args.steps):
        first = torch.randint(0, VOCAB, (micro, 1), generator=generator)
        tokens = (first + torch.arange(args.seq + 1)) % VOCAB  # next token = this one + 1
        loss = engine(tokens[:, :-1], labels=tokens[:, :-1]).loss  # the model shifts the labels itself
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.global_rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - started
    if engine.global_rank == 0:
        for owner, stats in engine.tier_stats().items():
            read, written = stats["traffic"]["nvme_read"], stats["traffic"]["nvme_write"]
            print(f"{owner}: {stats['held_bytes']} bytes per tier; NVMe read {read['bytes'] / 1e9:.2f} GB, "
                  f"wrote {written['bytes'] / 1e9:.2f} GB")  # fmt: skip
        print(f"{args.steps} steps in {elapsed:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    engine.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

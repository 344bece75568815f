"""Train a small MLP (plain PyTorch, no transformers) with infinity on synthetic regression data: the targets
come from a fixed random "teacher" network, so there is something to learn. The engine's own loader
(``training_data=``) splits the dataset across ranks. Prints the training loss every few steps, then the loss
on held-out data before and after training: ``loss A -> B``.

    python examples/train_mlp.py --steps 200
    torchrun --nproc_per_node 2 examples/train_mlp.py --steps 200

Any config works: ``--config configs/zero3.json``, or ``--config configs/zero2-nvme.json --nvme-path ./swap``
(optimizer states on NVMe under ./swap, removed when the run ends).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import infinity

HERE = os.path.dirname(os.path.abspath(__file__))
FEATURES, HIDDEN = 16, 64
LR = 1e-2  # a tiny model: a large learning rate makes the loss fall within a few steps


def load_config(path: str, nvme_path: str | None, steps: int) -> dict:
    """The JSON config, adjusted for this short demo run."""
    with open(path) as f:
        config = json.load(f)
    zero = config.setdefault("zero_optimization", {})
    if nvme_path is not None:
        sections = [zero[name] for name in ("offload_param", "offload_optimizer") if name in zero]
        if not any(section.get("device") == "nvme" for section in sections):
            raise SystemExit(f"--nvme-path: {path} offloads nothing to NVMe (try configs/zero2-nvme.json)")
        os.makedirs(nvme_path, exist_ok=True)
        for section in sections:
            section["nvme_path"] = nvme_path
    if not torch.cuda.is_available() and config.get("bf16", {}).get("enabled"):
        config["bf16"] = {"enabled": False}  # fp32 on the CPU: without bf16 units its bf16 matmuls are slower
    config.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = LR
    if "scheduler" in config:  # the configs' warmups are sized for longer runs
        config["scheduler"]["params"].update(warmup_max_lr=LR, warmup_num_steps=max(1, min(10, steps // 10)))
    if zero.get("stage") == 3:  # keep whole only the smallest parameters, so that stage 3 partitions this MLP
        zero["stage3_param_persistence_threshold"] = 100
    return config


def make_data(train: int, held_out: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """Inputs and a fixed random teacher's outputs, to train on and to evaluate on. Seeded: every rank makes the
    same dataset, which the engine's loader then splits."""
    generator = torch.Generator().manual_seed(0)
    teacher_in = torch.randn(FEATURES, HIDDEN, generator=generator) / FEATURES**0.5
    teacher_out = torch.randn(HIDDEN, 1, generator=generator) / HIDDEN**0.5
    x = torch.randn(train + held_out, FEATURES, generator=generator)
    y = torch.tanh(x @ teacher_in) @ teacher_out
    return torch.utils.data.TensorDataset(x[:train], y[:train]), torch.utils.data.TensorDataset(x[train:], y[train:])


def forever(loader: torch.utils.data.DataLoader) -> Iterator:
    """Batches without end: each pass over the engine's loader is a new epoch (it reshuffles)."""
    while True:
        yield from loader


@torch.no_grad()
def evaluate(engine: infinity.Engine, x: torch.Tensor, y: torch.Tensor) -> float:
    # Every rank evaluates the same held-out data (at stage 3 a forward is collective: all ranks must run it).
    return F.mse_loss(engine(x).float(), y.to(engine.device)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.normpath(os.path.join(HERE, "..", "configs", "zero2.json")))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nvme-path", default=None, help="a directory on a fast disk, for the configs that use NVMe")
    args = parser.parse_args()
    config = load_config(args.config, args.nvme_path, args.steps)

    train_data, held_out = make_data(4096, 512)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                          nn.Linear(HIDDEN, 1))  # fmt: skip

    engine, optimizer, loader, scheduler = infinity.initialize(model=model, config=config, training_data=train_data)
    rank0 = engine.global_rank == 0
    before = evaluate(engine, *held_out.tensors)
    print_every = max(1, args.steps // 10)
    batches = forever(loader)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        # The engine moves the model's inputs to its device (and casts them to bf16/fp16 when enabled); the
        # targets are ours to move. .float(): the loss in fp32 whatever the compute dtype.
        loss = F.mse_loss(engine(x).float(), y.to(engine.device))
        engine.backward(loss)  # scaled for fp16 and gradient accumulation; gradients reduced across ranks
        engine.step()  # optimizer step, zero_grad and scheduler step, at the accumulation boundary
        if rank0 and (step % print_every == 0 or step == 1):
            print(f"step {step}: train loss {loss.item():.4f}", flush=True)
    after = evaluate(engine, *held_out.tensors)
    if rank0:
        print(f"held-out loss before and after {args.steps} steps: loss {before:.4f} -> {after:.4f}", flush=True)
    engine.destroy()  # collective: every rank calls it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

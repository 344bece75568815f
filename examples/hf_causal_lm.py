"""Train a transformers causal LM (a small GPT-2 built from a GPT2Config: nothing to download) with infinity,
in a plain PyTorch loop. The data is synthetic and learnable: each sequence counts up from a random token (the
next token is this one + 1), so the loss falls within a few steps. Prints the loss every few steps, then
``loss A -> B`` (the first step's loss and the last one's).

    python examples/hf_causal_lm.py --steps 50
    torchrun --nproc_per_node 2 examples/hf_causal_lm.py --steps 50

The five lines that change from plain PyTorch (each marked "plain PyTorch:" below, with what it replaces):

    import infinity
    engine, optimizer, *_ = infinity.initialize(model=model, config=config)  # optimizer = torch.optim.AdamW(...)
    loss = engine(input_ids=x, labels=x).loss                                # loss = model(input_ids=x, ...).loss
    engine.backward(loss)                                                    # loss.backward()
    engine.step()                                                            # optimizer.step(); optimizer.zero_grad()

At stage 3 (the default config, configs/zero3.json), building the model under ``infinity.zero.Init(config=...)``
partitions each parameter as it is made, so no rank ever holds the whole model; at stages 0-2 the model is built
as usual. Other configs: ``--config configs/zero2.json``, or ``--config configs/zero3-nvme.json --nvme-path
./swap`` (parameters and optimizer states on NVMe under ./swap, removed when the run ends).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import infinity  # plain PyTorch: not imported

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, SEQ = 256, 32
LR = 3e-3  # a tiny model on an easy task: a large learning rate makes the loss fall within a few steps


def load_config(path: str, nvme_path: str | None, steps: int) -> dict:
    """The JSON config, adjusted for this short demo run."""
    with open(path) as f:
        config = json.load(f)
    zero = config.setdefault("zero_optimization", {})
    if nvme_path is not None:
        sections = [zero[name] for name in ("offload_param", "offload_optimizer") if name in zero]
        if not any(section.get("device") == "nvme" for section in sections):
            raise SystemExit(f"--nvme-path: {path} offloads nothing to NVMe (try configs/zero3-nvme.json)")
        os.makedirs(nvme_path, exist_ok=True)
        for section in sections:
            section["nvme_path"] = nvme_path
    if not torch.cuda.is_available() and config.get("bf16", {}).get("enabled"):
        config["bf16"] = {"enabled": False}  # fp32 on the CPU: without bf16 units its bf16 matmuls are slower
    config.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = LR
    if "scheduler" in config:  # the configs' warmups are sized for longer runs
        config["scheduler"]["params"].update(warmup_max_lr=LR, warmup_num_steps=max(1, min(10, steps // 10)))
    # The engine's own line (loss, lr, grad norm, loss scale, step time, NVMe traffic) every few steps, through
    # the `infinity` logger: it prints on rank 0 without any logging set up here.
    config["steps_per_print"] = max(1, steps // 5)
    if zero.get("stage") == 3:  # this model is tiny: partition all but the smallest parameters (biases, norms)
        zero["stage3_param_persistence_threshold"] = 1000
    return config


def get_batch(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences that count up (mod VOCAB) from a random first token."""
    first = torch.randint(0, VOCAB, (batch_size, 1), generator=generator)
    return (first + torch.arange(SEQ)) % VOCAB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.normpath(os.path.join(HERE, "..", "configs", "zero3.json")))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--nvme-path", default=None, help="a directory on a fast disk, for the configs that use NVMe")
    args = parser.parse_args()
    config = load_config(args.config, args.nvme_path, args.steps)

    # No tokenizer here, so no special tokens (GPT-2's default ids are outside this vocabulary).
    gpt2 = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                      bos_token_id=None, eos_token_id=None)  # fmt: skip
    stage3 = config["zero_optimization"].get("stage") == 3
    torch.manual_seed(0)  # the same initial weights on every rank
    # plain PyTorch: model = GPT2LMHeadModel(gpt2), with no context around it
    with infinity.zero.Init(config=config) if stage3 else contextlib.nullcontext():
        model = GPT2LMHeadModel(gpt2)
    # plain PyTorch: optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, optimizer, *_ = infinity.initialize(model=model, config=config)

    batch_size = engine.train_micro_batch_size_per_gpu()  # per rank, from the config
    generator = torch.Generator().manual_seed(engine.global_rank)  # each rank its own data, as a sampler would
    rank0 = engine.global_rank == 0
    print_every = max(1, args.steps // 10)
    losses = []
    for step in range(1, args.steps + 1):
        x = get_batch(batch_size, generator)
        # The engine moves the inputs to its device. The model shifts the labels itself: it learns x[t + 1].
        loss = engine(input_ids=x, labels=x).loss  # plain PyTorch: loss = model(input_ids=x, labels=x).loss
        engine.backward(loss)  # plain PyTorch: loss.backward()
        engine.step()  # plain PyTorch: optimizer.step(); optimizer.zero_grad()
        losses.append(loss.item())
        if rank0 and (step % print_every == 0 or step == 1):
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    if rank0:
        print(f"{args.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    engine.destroy()  # collective: every rank calls it (an engine alive at exit is torn down all the same)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

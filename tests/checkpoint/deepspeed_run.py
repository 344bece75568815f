"""Run by tests/checkpoint/test_from_deepspeed.py with DeepSpeed installed (DS_ACCELERATOR=cpu, gloo): trains the
test's model for two steps with DeepSpeed, saves a checkpoint, resumes from it with DeepSpeed's own
load_checkpoint, and records the next two steps (losses, and every parameter's fp32 master at the end)."""

import importlib
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.checkpoint.test_from_deepspeed import batch, build  # noqa: E402


def main() -> None:
    config, folder = json.loads(sys.argv[1]), sys.argv[2]
    # DeepSpeed's torch backend compiles a shared-memory all-reduce extension at init (once per machine, tens of
    # seconds) that only its inference_all_reduce uses; ZeRO's training collectives go over gloo either way.
    # (deepspeed.comm.torch as an attribute is the torch package: the module itself comes from importlib)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(config["zero_optimization"]["stage"])
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32

    def step(number: int) -> float:
        x, y = batch(number, rank, world, config["train_micro_batch_size_per_gpu"])
        loss = (engine(x.to(dtype)).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total.item() / world

    for number in range(2):
        step(number)
    engine.save_checkpoint(os.path.join(folder, "deepspeed"), client_state={"epoch": 3})
    engine.load_checkpoint(os.path.join(folder, "deepspeed"))  # DeepSpeed's own resume
    losses = [step(number) for number in range(2, 4)]
    masters = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save({"losses": losses, "masters": masters}, os.path.join(folder, "deepspeed-resumed.pt"))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed's CPU backend can abort in teardown at exit; everything is written by now


if __name__ == "__main__":
    main()

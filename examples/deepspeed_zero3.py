"""A ZeRO-3 training script written for DeepSpeed, each call as DeepSpeed's documentation shows it. It runs on
infinity after one change: ``import deepspeed`` becomes ``import infinity as deepspeed`` (the test in
tests/examples/test_examples.py makes exactly that change and runs it under torchrun with two processes).

Run it (two processes, parameters and optimizer states on NVMe in ./swap, which must exist):
    mkdir -p swap && torchrun --nproc_per_node 2 examples/deepspeed_zero3.py --nvme swap

Besides training, it checks what each helper returns against what DeepSpeed documents: the partitioned-state
helpers (deepspeed.utils.safe_*), the engine's getters, GatheredParameters with a modifier rank,
offload_states / reload_states, a checkpoint read back with zero_to_fp32's helper, and the memory estimator.
"""

import argparse
import json
import math
import os
import tempfile

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH = 64, 32


class Head(nn.Module):
    """Scores against the embedding's weight, a parameter of another module (DeepSpeed's external parameter)."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.embed = [embed]  # not a child module

    def forward(self, x):
        return F.linear(x * self.scale, self.embed[0].weight)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = Head(self.embed)

    def forward(self, tokens):
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def config(nvme: str | None) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "cpu"}}  # fmt: skip
    if nvme:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                     "warmup_num_steps": 2}},  # fmt: skip
        "zero_optimization": zero,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nvme", default=None, help="a folder for the swap files (default: no NVMe)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zero3-script-") as workdir:  # the config (unless named), the checkpoint
        train(args, workdir)


def train(args, workdir: str) -> None:
    if args.deepspeed_config is None:
        args.deepspeed_config = os.path.join(workdir, "ds_config.json")
        with open(args.deepspeed_config, "w") as f:
            json.dump(config(args.nvme), f)

    deepspeed.init_distributed()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        model = Net()
    deepspeed.zero.register_external_parameter(model.head, model.embed.weight)
    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model,
                                                           model_parameters=model.parameters())  # fmt: skip
    rank, world = engine.global_rank, engine.world_size
    named = dict(model.named_parameters())
    losses = []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, VOCAB // 4, (engine.train_micro_batch_size_per_gpu(), 8), generator=gen)
        loss = F.cross_entropy(engine(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        engine.backward(loss)
        # Between backward and step: each parameter's whole reduced gradient (collective).
        squares = sum(deepspeed.utils.safe_get_full_grad(p).double().pow(2).sum() for p in named.values())
        engine.step()
        losses.append(loss.item())
        assert engine.was_step_applied() and engine.global_steps == step + 1
        assert math.isclose(engine.get_global_grad_norm(), math.sqrt(squares), rel_tol=1e-4)
        assert len(engine.get_lr()) == len(optimizer.param_groups)

    assert engine.global_samples == args.steps * engine.train_batch_size()
    assert tuple(engine.get_mom()[0]) == (0.9, 0.999)  # AdamW's betas (DeepSpeed's defaults)

    # Twice the batch from now on, as two micro-batches whose boundary the loop sets itself, one step() for both.
    engine.set_train_batch_size(2 * engine.train_batch_size())
    for boundary in (False, True):
        engine.set_gradient_accumulation_boundary(boundary)
        gen = torch.Generator().manual_seed(77 + rank + 10 * boundary)
        tokens = torch.randint(0, VOCAB // 4, (engine.train_micro_batch_size_per_gpu(), 8), generator=gen)
        engine.backward(F.cross_entropy(engine(tokens).reshape(-1, VOCAB), tokens.reshape(-1)))
    engine.step()
    engine.zero_grad()
    assert engine.was_step_applied() and engine.global_steps == args.steps + 1

    # The fp32 masters and Adam states, whole (collective), and this rank's fragment of them.
    for name, param in named.items():
        master = deepspeed.utils.safe_get_full_fp32_param(param)
        exp_avg = deepspeed.utils.safe_get_full_optimizer_state(param, "exp_avg")
        assert tuple(master.shape) == tuple(param.ds_shape) == tuple(exp_avg.shape), name
        with deepspeed.zero.GatheredParameters(param):
            assert torch.equal(param.detach().float(), master), name
        local = deepspeed.utils.safe_get_local_fp32_param(param)
        count = torch.tensor([local.numel()])
        if world > 1:
            dist.all_reduce(count)
        assert count.item() == param.ds_numel, name
    deepspeed.utils.safe_set_full_optimizer_state(named["body.weight"], torch.zeros(WIDTH, WIDTH), "exp_avg")
    assert deepspeed.utils.safe_get_full_optimizer_state(named["body.weight"], "exp_avg").abs().sum() == 0
    halved = deepspeed.utils.safe_get_full_fp32_param(named["body.weight"]) * 0.5
    deepspeed.utils.safe_set_full_fp32_param(named["body.weight"], halved)
    with deepspeed.zero.GatheredParameters(named["body.weight"]):
        assert torch.equal(named["body.weight"].detach().float(), halved)  # the next forward sees it

    # Rank 0 edits a weight; every rank and the fp32 master see it.
    with deepspeed.zero.GatheredParameters(model.body.bias, modifier_rank=0), torch.no_grad():
        if rank == 0:
            model.body.bias.zero_()
    assert deepspeed.utils.safe_get_full_fp32_param(model.body.bias).abs().sum() == 0

    # Between phases: the states leave the device and come back; the gathered-parameter cache is emptied.
    # (DeepSpeed offloads states only without offload_param / offload_optimizer and with its FusedAdam on an
    # accelerator; infinity in every mode.)
    engine.offload_states()
    engine.reload_states()
    engine.empty_partition_cache()

    # A checkpoint, read back as a plain fp32 state dict, and loaded again.
    ckpt = os.path.join(workdir, "ckpt") if world == 1 else _shared_folder(workdir, rank)
    engine.save_checkpoint(ckpt)
    masters = {name: deepspeed.utils.safe_get_full_fp32_param(p) for name, p in named.items()}
    state = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert all(torch.equal(state[name], masters[name]) for name in masters)
    if rank == 0:
        out = os.path.join(workdir, "fp32")
        deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out)
        saved = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
        assert torch.equal(saved["body.weight"], masters["body.weight"])
    path, _ = engine.load_checkpoint(ckpt)
    assert path is not None

    if rank == 0:
        deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live(Net(), num_gpus_per_node=world)
    engine.destroy()
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


def _shared_folder(workdir: str, rank: int) -> str:
    """Rank 0's temporary folder, for every rank (the ranks share this machine's disk)."""
    folder = [os.path.join(workdir, "ckpt")]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


if __name__ == "__main__":
    main()

"""fp16 with dynamic loss scaling: an inf gradient on one rank skips the step on every rank and lowers the scale;
the other steps train as plain PyTorch does with the same recipe."""

import math

import pytest
import torch

import infinity
import infinity.zero
from tests.distributed.harness import run_distributed
from tests.distributed.training import WEIGHT_DECAY, build, global_batch, loss_fn, own_pieces, pieces_error

INJECT_AT, LR, STEPS = 2, 1e-2, 5


def _snapshot(engine) -> list[torch.Tensor]:
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole, not shards
        return [p.detach().float().clone() for p in engine.module.parameters()]


def _worker(*, rank: int, world_size: int, stage: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 16},
    }
    engine, *_ = infinity.initialize(model=build("mlp"), config=config)
    record = {"scales": [], "changed": [], "params_after": []}
    for step in range(STEPS):
        inputs, target = global_batch("mlp", step, 4 * world_size)
        mine = slice(rank * 4, rank * 4 + 4)
        before = _snapshot(engine)
        loss = loss_fn("mlp", engine(inputs[mine]), target[mine])
        if step == INJECT_AT and rank == world_size - 1:
            loss = loss * math.inf  # every gradient of this rank becomes inf/nan
        record["scales"].append(engine.loss_scale)
        engine.backward(loss)
        engine.step()
        after = _snapshot(engine)
        record["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        record["params_after"].append(after)
    record["final_scale"] = engine.loss_scale
    record["skipped"] = engine.skipped_steps
    record["global_steps"] = engine.global_steps
    record["pieces"] = own_pieces(engine)  # this rank's fp32 masters, read without a gather
    return record


def reference(scales: list[float], world_size: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch, the same recipe: fp32 AdamW masters, an fp16 copy; per rank the gradient of its
    micro-batch's loss times the scale, in fp16, then in fp32 averaged over ranks and unscaled. The injected
    step is skipped. One thread, as in the engine's processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        master = build("mlp")
        optimizer = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        model = build("mlp").half()
        for step in range(STEPS):
            if step == INJECT_AT:
                continue
            inputs, target = global_batch("mlp", step, 4 * world_size)
            grads = None
            for rank in range(world_size):
                mine = slice(rank * 4, rank * 4 + 4)
                loss = loss_fn("mlp", model(inputs[mine].half()), target[mine]) * scales[step]
                got = [g.float() for g in torch.autograd.grad(loss, list(model.parameters()))]
                grads = got if grads is None else [a + b for a, b in zip(grads, got, strict=True)]
            for param, grad in zip(master.parameters(), grads, strict=True):
                param.grad = grad / world_size * (1.0 / scales[step])
            optimizer.step()
            with torch.no_grad():
                for param, copy in zip(master.parameters(), model.parameters(), strict=True):
                    copy.copy_(param)
        return {name: p.detach().clone() for name, p in master.named_parameters()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("stage", [2, 3])
def test_injected_inf_skips_the_step_on_all_ranks_and_halves_the_scale(stage, tmp_path):
    per_rank = run_distributed(_worker, 2, tmp_path, timeout_s=180, stage=stage)
    for record in per_rank:
        assert record["changed"] == [True, True, False, True, True]  # parameters untouched at the injected step
        assert record["skipped"] == 1 and record["global_steps"] == 5
        assert record["scales"][INJECT_AT] == 256.0 and record["scales"][INJECT_AT + 1] == 128.0
        assert record["final_scale"] == 128.0
    # The ranks never diverged: each rank's own master pieces (not a gather, which gives every rank the same
    # values) are what plain PyTorch reaches skipping the injected step.
    ref = reference(per_rank[0]["scales"], 2)
    error = pieces_error([record["pieces"] for record in per_rank], ref)
    print(f"stage {stage}: masters {error:.1e} from plain PyTorch")
    assert error <= 1e-5, f"masters {error:.1e} from plain PyTorch"

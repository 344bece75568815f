"""fp16 with dynamic loss scaling: an inf gradient on one rank skips the step on every rank and lowers the scale."""

import math

import pytest
import torch

import infinity
import infinity.zero
from tests.distributed.harness import run_distributed
from tests.distributed.training import build, global_batch, loss_fn

INJECT_AT = 2


def _snapshot(engine) -> list[torch.Tensor]:
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole, not shards
        return [p.detach().float().clone() for p in engine.module.parameters()]


def _worker(*, rank: int, world_size: int, stage: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 16},
    }
    engine, *_ = infinity.initialize(model=build("mlp"), config=config)
    record = {"scales": [], "changed": [], "params_after": []}
    for step in range(5):
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
    return record


@pytest.mark.parametrize("stage", [2, 3])
def test_injected_inf_skips_the_step_on_all_ranks_and_halves_the_scale(stage, tmp_path):
    per_rank = run_distributed(_worker, 2, tmp_path, timeout_s=180, stage=stage)
    for record in per_rank:
        assert record["changed"] == [True, True, False, True, True]  # parameters untouched at the injected step
        assert record["skipped"] == 1 and record["global_steps"] == 5
        assert record["scales"][INJECT_AT] == 256.0 and record["scales"][INJECT_AT + 1] == 128.0
        assert record["final_scale"] == 128.0
    for a, b in zip(per_rank[0]["params_after"][-1], per_rank[1]["params_after"][-1], strict=True):
        assert torch.equal(a, b)  # the ranks never diverged

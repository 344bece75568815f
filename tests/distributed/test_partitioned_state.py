"""DeepSpeed's partitioned-state helpers (infinity.utils.safe_*) against plain PyTorch given the same edits
([Note: partitioned state access] in infinity/partitioned_state.py).

At world size 1 and 2 (real processes over gloo), at stages 0 and 1, stage 2 with the optimizer in host memory, stage
3 in memory and stage 3 with parameters and optimizer on NVMe (64-element tiles): the engine and plain
PyTorch AdamW train side by side. Between a backward and the step, safe_get_full_grad equals the plain
gradient, and a safe_set_full_grad halving one parameter's gradient is the same halving in the plain run. After
the step, every parameter's fp32 master and Adam states equal the plain ones. Then, mid-training, one large
parameter (its own unit) and one small one (stage 3's persistent unit) get a new master and new Adam states
through the setters, the plain run the same edit; the next steps' losses and parameters equal. The local forms:
the ranks' fragments, in rank order, make up the full value; a local set moves the weight the forward pass
uses on every rank.
"""

from __future__ import annotations

import pytest
import torch

import infinity
import infinity.zero
from infinity import utils as ds_utils
from infinity.partitioned_state import StateAccessError
from tests.distributed.harness import run_distributed
from tests.distributed.training import (
    WEIGHT_DECAY,
    _accumulate_like_the_engine,
    build,
    engine_config,
    global_batch,
    loss_fn,
)

MODEL, BATCH, ACCUMULATION, LR = "transformer", 8, 2, 1e-2
EDITED = ("head.weight", "norm.weight")  # a unit of its own at stage 3; the persistent unit
MODES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2-cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage3": {"stage": 3},
    "stage3-nvme": {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"},
                    "sub_group_size": 64},
}  # fmt: skip


def make_config(mode: str, world_size: int, nvme: str) -> dict:
    settings = dict(MODES[mode])
    config = engine_config(stage=settings.pop("stage"), micro=BATCH // (ACCUMULATION * world_size),
                           accumulation=ACCUMULATION, lr=LR, clip=0.0)  # fmt: skip
    zero = config["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = 64
    for key, value in settings.items():
        zero[key] = {**value, "nvme_path": nvme} if isinstance(value, dict) else value
    if "offload_param" in zero:
        zero["offload_param"]["max_in_cpu"] = 0
    return config


class Plain:
    """Plain PyTorch: fused AdamW on the whole model, gradients summed in the engine's order."""

    def __init__(self, world_size: int) -> None:
        self.model = build(MODEL)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.world_size = world_size
        self.params = dict(self.model.named_parameters())

    def backward(self, step: int) -> float:
        inputs, target = global_batch(MODEL, step, BATCH)
        micro = BATCH // (ACCUMULATION * self.world_size)
        loss, grads = _accumulate_like_the_engine(MODEL, self.model, inputs, target, micro, ACCUMULATION,
                                                  self.world_size)  # fmt: skip
        for param, grad in zip(self.model.parameters(), grads, strict=True):
            param.grad = grad
        return loss.item()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def engine_backward(engine, step: int, *, rank: int, world_size: int) -> float:
    """The window's micro-batches; the last backward is left without its step."""
    micro = engine.train_micro_batch_size_per_gpu()
    inputs, target = global_batch(MODEL, step, BATCH)
    total = torch.zeros(())
    for k in range(ACCUMULATION):
        start = k * micro * world_size + rank * micro
        loss = loss_fn(MODEL, engine(inputs[start : start + micro]), target[start : start + micro])
        engine.backward(loss)
        if k < ACCUMULATION - 1:
            engine.step()
        total += loss.detach() / ACCUMULATION
    if world_size > 1:
        torch.distributed.all_reduce(total)
        total /= world_size
    return total.item()


def _worker(*, rank: int, world_size: int, nvme: str) -> dict:
    torch.set_num_threads(1)
    results = {}
    for mode in MODES:
        engine, *_ = infinity.initialize(model=build(MODEL), config=make_config(mode, world_size, nvme))
        plain = Plain(world_size)
        named = dict(engine.module.named_parameters())
        record = {"losses": [], "plain_losses": [], "grads": {}, "masters": {}, "states": {}, "locals": {}}
        for step in range(6):
            record["losses"].append(engine_backward(engine, step, rank=rank, world_size=world_size))
            record["plain_losses"].append(plain.backward(step))
            if step == 2:  # between backward and step: the gradient
                record["grads"] = {n: ds_utils.safe_get_full_grad(p) for n, p in named.items()}
                record["plain_grads"] = {n: p.grad.clone() for n, p in plain.params.items()}
                halved = ds_utils.safe_get_full_grad(named["blocks.0.linear1.weight"]) * 0.5
                ds_utils.safe_set_full_grad(named["blocks.0.linear1.weight"], halved)
                plain.params["blocks.0.linear1.weight"].grad.mul_(0.5)
            engine.step()
            plain.step()
            if step == 2:  # after the step: masters and states
                for name, param in named.items():
                    record["masters"][name] = ds_utils.safe_get_full_fp32_param(param)
                    record["states"][name] = {k: ds_utils.safe_get_full_optimizer_state(param, k)
                                              for k in ("exp_avg", "exp_avg_sq")}  # fmt: skip
                record["plain_masters"] = {n: p.detach().clone() for n, p in plain.params.items()}
                record["plain_states"] = {n: {k: plain.optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                                          for n, p in plain.params.items()}  # fmt: skip
                for name in EDITED:  # the edit, the same on both sides
                    param, twin = named[name], plain.params[name]
                    new_master = ds_utils.safe_get_full_fp32_param(param) * 0.5 + 0.01
                    new_avg = torch.full(twin.shape, 1e-3)
                    new_avg_sq = torch.full(twin.shape, 1e-4)
                    ds_utils.safe_set_full_fp32_param(param, new_master)
                    ds_utils.safe_set_full_optimizer_state(param, new_avg, "exp_avg")
                    ds_utils.safe_set_full_optimizer_state(param, new_avg_sq, "exp_avg_sq")
                    with torch.no_grad():
                        twin.copy_(new_master)
                    plain.optimizer.state[twin]["exp_avg"].copy_(new_avg)
                    plain.optimizer.state[twin]["exp_avg_sq"].copy_(new_avg_sq)
            if step == 4:  # the local forms: every rank moves its own fragment
                for name in ("embed.weight", "norm.bias"):
                    param = named[name]
                    local = ds_utils.safe_get_local_fp32_param(param)
                    record["locals"][name] = (local.clone(), ds_utils.safe_get_full_fp32_param(param))
                    ds_utils.safe_set_local_fp32_param(param, local + 1e-3)
                    with torch.no_grad():
                        plain.params[name].add_(1e-3)
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            record["params"] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        record["plain_params"] = {n: p.detach().clone() for n, p in plain.params.items()}
        try:
            ds_utils.safe_get_full_grad(named["head.weight"])
        except StateAccessError as e:
            record["grad_after_step"] = str(e)
        engine.destroy()
        results[mode] = record
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"state-w{request.param}")
    (workdir / "nvme").mkdir()
    return run_distributed(_worker, request.param, workdir, timeout_s=300, nvme=str(workdir / "nvme"))


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("mode", list(MODES))
def test_getters_equal_plain_pytorch(results, mode):
    for record in results:  # every rank gets the whole values
        r = record[mode]
        for name, want in r["plain_grads"].items():
            if name == "blocks.0.linear1.weight":
                continue  # read before the halving, compared below through the masters
            close(r["grads"][name], want, f"{mode} grad {name}")
        for name, want in r["plain_masters"].items():
            close(r["masters"][name], want, f"{mode} master {name}")
            for key in ("exp_avg", "exp_avg_sq"):
                close(r["states"][name][key], r["plain_states"][name][key], f"{mode} {key} {name}")


@pytest.mark.parametrize("mode", list(MODES))
def test_edits_mid_training_continue_as_plain_pytorch(results, mode):
    for record in results:
        r = record[mode]
        for step, (got, want) in enumerate(zip(r["losses"], r["plain_losses"], strict=True)):
            assert got == pytest.approx(want, rel=1e-5), f"{mode} step {step}: {got} vs {want}"
        for name, want in r["plain_params"].items():
            close(r["params"][name], want, f"{mode} final {name}")
        assert "between engine.backward() and engine.step()" in r["grad_after_step"]


@pytest.mark.parametrize("mode", list(MODES))
def test_local_fragments_make_up_the_full_value(results, mode):
    for name in ("embed.weight", "norm.bias"):
        locals_ = [record[mode]["locals"][name][0] for record in results]
        full = results[0][mode]["locals"][name][1]
        if len(results) > 1 and mode.startswith("stage3") and name == "embed.weight":  # its unit split evenly
            assert all(0 < local.numel() < full.numel() for local in locals_), [t.numel() for t in locals_]
        if mode == "stage0":  # nothing is partitioned: each rank's fragment is the whole parameter
            locals_ = locals_[:1]
        torch.testing.assert_close(torch.cat(locals_), full.view(-1), rtol=0, atol=0)


def test_helpers_refuse_what_does_not_exist(tmp_path):
    config = make_config("stage3-nvme", 1, str(tmp_path))
    engine, *_ = infinity.initialize(model=build(MODEL), config=config)
    head = dict(engine.module.named_parameters())["head.weight"]
    with pytest.raises(StateAccessError, match="has not stepped param group 0 yet"):
        ds_utils.safe_get_full_optimizer_state(head, "exp_avg")
    with pytest.raises(StateAccessError, match="between engine.backward"):
        ds_utils.safe_get_full_grad(head)
    with pytest.raises(StateAccessError, match=r"must have its full shape \(50, 32\)"):
        ds_utils.safe_set_full_fp32_param(head, torch.zeros(32, 50))
    engine_backward(engine, 0, rank=0, world_size=1)
    engine.step()
    with pytest.raises(StateAccessError, match="keeps no state 'momentum_buffer'.*exp_avg"):
        ds_utils.safe_get_full_optimizer_state(head, "momentum_buffer")
    engine.destroy()
    with pytest.raises(StateAccessError, match="no live infinity training engine"):
        ds_utils.safe_get_full_fp32_param(head)
    assert ds_utils.safe_get_full_fp32_param is infinity.utils.safe_get_full_fp32_param


@pytest.mark.parametrize("stage", [1, 2])
def test_the_gradient_mid_window(stage, tmp_path):
    """Stages 0-1 reduce at the window's end: a read before it is refused (it would be zeros); stages 2-3
    reduce each micro-step: the window's sum so far."""
    config = make_config("stage1" if stage == 1 else "stage2-cpu", 1, str(tmp_path))
    engine, *_ = infinity.initialize(model=build(MODEL), config=config)
    head = dict(engine.module.named_parameters())["head.weight"]
    micro = engine.train_micro_batch_size_per_gpu()
    inputs, target = global_batch(MODEL, 0, micro * ACCUMULATION)
    engine.backward(loss_fn(MODEL, engine(inputs[:micro]), target[:micro]))
    if stage == 1:
        with pytest.raises(StateAccessError, match="reduced at the accumulation boundary"):
            ds_utils.safe_get_full_grad(head)
    else:
        assert ds_utils.safe_get_full_grad(head).abs().sum() > 0
    engine.destroy()

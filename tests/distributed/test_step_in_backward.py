"""The step in backward ([Note: step in backward] in infinity/zero/backward_step.py): at stage 3 with the optimizer
in host memory and nothing that needs the whole gradient, each unit's tiles step in the boundary's backward as its
reduced gradient arrives. The math must not change: every run is compared bitwise with the same run under
``infinity.step_in_backward: false`` (the whole step in engine.step()), at world size 1 and 2 over gloo.

The model uses its modules in another order than it registers them, one of them twice, another under
non-reentrant activation checkpointing; it has a branch the forward never takes (its gradient is all zeros,
reduced at the end of backward: its unit steps then, as the eager step steps it), a frozen layer, a parameter tied
between the embedding and the head (its unit's gradient is final only at the end of backward), and small
parameters kept gathered (persistent: regathered at engine.step()). A learning-rate scheduler runs after every
step, and a checkpoint is saved and resumed; at world size 1 in bf16 with the parameters on NVMe, at world size 2
in fp32. What users do between backward and step that the step in backward cannot honour is refused by name:
reading the gradient or the state, a forward, a save, zero_grad, changing the learning rate, a second backward; a
backward that fails part way is refused until a checkpoint is loaded, and the run then goes on as if it had not
failed; a window of several backwards steps in engine.step() as before.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import infinity
import infinity.zero
from infinity.config import parse_config
from infinity.errors import ConfigError, InfinityError
from infinity.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from tests.distributed.harness import run_distributed
from tests.distributed.test_step_behind_forward import MODEL, assert_same
from tests.distributed.training import VOCAB, global_batch, loss_fn, own_pieces

STEPS, MICRO = 4, 2


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(VOCAB, 32)
        self.late = nn.Linear(32, 32)  # registered before ``early``, used after it
        self.early = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)  # trainable, never in the forward
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.norm = nn.LayerNorm(32)  # 32 elements each: persistent under the threshold below
        self.fail_in_backward = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.fail_in_backward:  # reached by backward after every unit but the embedding's has stepped
            x.register_hook(_fail)
        x = torch.tanh(self.early(torch.tanh(self.early(x))))  # used twice: its gradient is final at the second
        x = torch.tanh(checkpoint(self.late, self.frozen(x), use_reentrant=False))
        return self.norm(x) @ self.embed.weight.t()  # the head is the embedding


def _fail(grad: torch.Tensor) -> None:
    raise RuntimeError("injected: backward fails part way")


def config(step_in_backward: bool | None, *, accumulation: int = 1, nvme: str | None = None, **extra) -> dict:
    result = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 3}},  # fmt: skip
        "zero_optimization": {
            "stage": 3, "reduce_bucket_size": 2000, "sub_group_size": 512, "overlap_comm": True,
            "stage3_param_persistence_threshold": 40, "stage3_prefetch_bucket_size": 3000,
            "offload_optimizer": {"device": "cpu"},
        },  # fmt: skip
        **extra,
    }
    if nvme is not None:  # bf16 with the parameters on NVMe
        result["bf16"] = {"enabled": True}
        result["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
    if step_in_backward is not None:
        result["infinity"] = {"step_in_backward": step_in_backward}
    return result


def train(engine, rank: int, world_size: int, first: int, steps: int, accumulation: int, seen: dict) -> list:
    per_step = MICRO * accumulation * world_size
    losses = []
    for step in range(first, first + steps):
        inputs, target = global_batch(MODEL, step, per_step)
        for k in range(accumulation):
            start = k * MICRO * world_size + rank * MICRO
            loss = loss_fn(MODEL, engine(inputs[start : start + MICRO]), target[start : start + MICRO])
            engine.backward(loss)
            optimizer = engine.zero_optimizer
            seen.setdefault("taken", []).append(optimizer.gradient_taken_by_step)
            seen.setdefault("gradient_held", []).append(optimizer.gradients_in_memory.held_bytes() > 0)
            engine.step()
            losses.append(loss.item())
        seen.setdefault("norm", []).append(engine.get_global_grad_norm())
    return losses


def run_both(rank: int, world_size: int, root: str, accumulation: int = 1, nvme: bool = False) -> dict:
    out = {}
    for mode in (False, None):
        swap = f"{root}/swap-{mode}" if nvme else None
        if swap is not None:
            os.makedirs(swap, exist_ok=True)
        engine, *_ = infinity.initialize(model=Tied(), config=config(mode, accumulation=accumulation, nvme=swap))
        seen: dict = {}
        losses = train(engine, rank, world_size, 0, STEPS, accumulation, seen)
        engine.save_checkpoint(f"{root}/ckpt-{mode}")
        pieces = own_pieces(engine)
        states = {name: safe_get_full_optimizer_state(p, "exp_avg_sq")
                  for name, p in engine.module.named_parameters() if p.requires_grad}  # fmt: skip
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        engine.destroy()
        resumed, *_ = infinity.initialize(model=Tied(), config=config(mode, accumulation=accumulation, nvme=swap))
        resumed.load_checkpoint(f"{root}/ckpt-{mode}")
        more_seen: dict = {}
        more = train(resumed, rank, world_size, STEPS, 2, accumulation, more_seen)
        after = own_pieces(resumed)
        resumed.destroy()
        out[mode] = {"losses": losses, "seen": seen, "pieces": pieces, "states": states, "params": params,
                     "more": more, "more_seen": more_seen, "after": after}  # fmt: skip
    return out


@pytest.mark.parametrize(("world_size", "nvme"), [(1, True), (2, False)])
def test_the_step_in_backward_is_the_step_in_engine_step_bitwise(tmp_path, world_size, nvme):
    results = run_distributed(run_both, world_size, tmp_path, root=str(tmp_path), nvme=nvme)
    for rank, result in enumerate(results):
        eager, in_backward = result[False], result[None]
        for run, taken in ((eager, False), (in_backward, True)):  # the default takes it in backward
            for seen, count in ((run["seen"], STEPS), (run["more_seen"], 2)):
                assert seen.pop("taken") == [taken] * count, rank
                assert seen.pop("gradient_held") == [not taken] * count, rank  # no gradient held at all
        assert_same(eager, in_backward, f"rank {rank}")
        initial = dict(Tied().named_parameters())
        for name, value in eager["params"].items():  # trained: the comparison is not of untouched weights
            assert torch.equal(value, initial[name].to(value.dtype)) == name.startswith("frozen"), name


def test_a_window_of_several_backwards_steps_in_engine_step_as_before(tmp_path):
    result = run_distributed(run_both, 1, tmp_path, root=str(tmp_path), accumulation=2)[0]
    eager, default = result[False], result[None]
    assert default["seen"]["taken"] == [False] * (2 * STEPS)  # the first backward's gradient is held anyway
    assert_same(eager, default, "rank 0")


def _one_backward(engine, step: int = 0) -> torch.Tensor:
    inputs, target = global_batch(MODEL, step, MICRO)
    loss = loss_fn(MODEL, engine(inputs), target)
    engine.backward(loss)
    return loss


def test_what_needs_the_gradient_between_backward_and_step_is_refused_by_name(tmp_path):
    engine, *_ = infinity.initialize(model=Tied(), config=config(None))
    try:
        loss = _one_backward(engine)
        weight = engine.module.early.weight
        refused = {
            "gradient": lambda: safe_get_full_grad(weight),
            "master": lambda: safe_get_full_fp32_param(weight),
            "forward": lambda: engine(global_batch(MODEL, 0, MICRO)[0]),
            "save": lambda: engine.save_checkpoint(str(tmp_path / "ckpt")),
            "zero_grad": lambda: engine.optimizer.zero_grad(),
            "backward": lambda: engine.backward(loss),  # the same loss again: refused before autograd sees it
        }
        for what, call in refused.items():
            with pytest.raises(InfinityError, match="step_in_backward") as error:
                call()
            assert "engine.step()" in str(error.value), what
        assert "safe_get_full_grad" in str(pytest.raises(InfinityError, refused["gradient"]).value)
        assert "ran again before engine.step()" in str(pytest.raises(InfinityError, refused["backward"]).value)
        assert not (tmp_path / "ckpt").exists()
        norm = engine.zero_optimizer.global_grad_norm()  # the norm is kept: the squares of every unit
        assert norm > 0
        engine.step()
        assert engine.get_global_grad_norm() == norm
        _one_backward(engine, 2)
        lr = engine.optimizer.param_groups[0]["lr"]
        engine.optimizer.param_groups[0]["lr"] = 1e-5  # by hand between backward and step: too late
        with pytest.raises(InfinityError, match="param group 0's lr .* in backward"):
            engine.step()
        engine.optimizer.param_groups[0]["lr"] = lr  # put back: the step counts
        engine.step()
        engine.module.fail_in_backward = True  # a backward that fails part way: its step is half taken
        with pytest.raises(RuntimeError, match="injected"):
            _one_backward(engine, 3)
        with pytest.raises(InfinityError, match=r"stopped part way .* \(engine.load_checkpoint\)"):
            engine.step()
    finally:
        engine.destroy()
    engine, *_ = infinity.initialize(model=Tied(), config=config(False))  # the key off: the gradient is there
    try:
        _one_backward(engine)
        assert safe_get_full_grad(engine.module.early.weight).abs().sum() > 0
        engine.step()
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"gradient_clipping": 1.0}, "gradient_clipping needs the whole gradient"),
        ({"fp16": {"enabled": True}}, "fp16's loss scale"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 'offload_optimizer.device "cpu"'),
        ({"zero_optimization": {"stage": 3}}, 'offload_optimizer.device "cpu"'),
        ({"bf16": {"enabled": True}, "infinity": {"offloaded_master": "split"}}, "split"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps > 1"),
    ],
)  # fmt: skip
def test_step_in_backward_true_is_refused_where_it_cannot_act(extra, match):
    raw = {**config(True), **extra}
    raw["infinity"] = {**raw.get("infinity", {}), "step_in_backward": True}
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)
    raw["infinity"].pop("step_in_backward")  # by default it steps in engine.step() there instead
    parse_config(raw)


def test_where_it_cannot_act_by_default_the_step_stays_in_engine_step():
    for extra in ({"gradient_clipping": 1.0}, {"optimizer": {"type": "Adagrad", "params": {"lr": 0.01}}}):
        engine, *_ = infinity.initialize(model=Tied(), config=config(None, **extra))
        try:
            assert not engine.zero_optimizer.steps_in_backward
            _one_backward(engine)
            assert not engine.zero_optimizer.gradient_taken_by_step
            engine.step()
        finally:
            engine.destroy()
    with pytest.raises(ConfigError, match="step_in_backward true: the optimizer's own step"):
        infinity.initialize(model=Tied(), config=config(True, optimizer={"type": "Adagrad", "params": {"lr": 0.01}}))


def _failing_run(rank: int, world_size: int, root: str) -> dict:
    """Two steps and a save; a backward fails part way; what the user tries, then a load; two more steps. The
    same steps without the failure give the reference."""
    out = {}
    for fail in (False, True):
        engine, *_ = infinity.initialize(model=Tied(), config=config(None))
        losses = []
        for step in range(4):
            if step == 2 and fail:
                engine.module.fail_in_backward = True
                with pytest.raises(RuntimeError, match="injected"):
                    _one_backward(engine, step)
                engine.module.fail_in_backward = False
                out["stepped_before_failing"] = engine.zero_optimizer._backward_step.describe()
                with pytest.raises(InfinityError, match="step_in_backward") as error:
                    engine(global_batch(MODEL, step, MICRO)[0])
                out["forward refused"] = str(error.value)
                engine.load_checkpoint(f"{root}/ckpt")
                engine.save_checkpoint(f"{root}/after-load")  # nothing of the failed backward is pending
            inputs, target = global_batch(MODEL, step, MICRO)
            loss = loss_fn(MODEL, engine(inputs), target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step == 1 and not fail:
                engine.save_checkpoint(f"{root}/ckpt")
        out[fail] = {"losses": losses, "pieces": own_pieces(engine)}
        engine.destroy()
    return out


def test_a_backward_that_fails_part_way_is_refused_until_a_load_and_the_run_goes_on(tmp_path):
    result = run_distributed(_failing_run, 1, tmp_path, root=str(tmp_path))[0]
    stepped, of = map(int, result["stepped_before_failing"].split(" units")[0].split(" of "))
    assert 0 < stepped < of, result["stepped_before_failing"]  # the failure came part way through the units
    assert "a forward between engine.backward() and engine.step()" in result["forward refused"]
    reference, recovered = result[False], result[True]
    assert reference["losses"][2:] == recovered["losses"][2:]  # steps 2-3 after the load, as if nothing failed
    assert_same(reference["pieces"], recovered["pieces"], "pieces")


def test_a_step_pre_hook_keeps_the_step_in_engine_step_and_true_refuses_it():
    for wanted in (None, True):
        engine, *_ = infinity.initialize(model=Tied(), config=config(wanted))
        calls = []
        handle = engine.optimizer.optimizer.register_step_pre_hook(lambda *args, calls=calls: calls.append(1))
        try:
            if wanted:
                with pytest.raises(InfinityError, match="step_in_backward true: an optimizer step pre-hook"):
                    _one_backward(engine)
                continue
            _one_backward(engine)
            assert not engine.zero_optimizer.gradient_taken_by_step
            engine.step()
            assert calls == [1]
        finally:
            handle.remove()
            engine.destroy()

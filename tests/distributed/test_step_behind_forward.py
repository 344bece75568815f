"""The step behind the forward ([Note: step behind forward] in infinity/zero/unit_optimizer.py): at stage 3 with
the optimizer on NVMe, engine.step() fixes the step (norm, clipping, hyperparameters) and each unit's tiles step
when the next forward first uses the unit. The math must not change: every run here is compared bitwise with the
same run under ``infinity.step_behind_forward: false`` (the whole step inside engine.step()), at world size 1 and 2
over gloo, with the swap files on the real disk.

What a user does between a step and the next forward is where a late step could show: reading masters, optimizer
states and gathered weights, an evaluation forward under inference_mode, optimizer.zero_grad(), changing the
learning rate by hand (it must act on the next step, not the pending one), a GatheredParameters edit, a master set
by safe_set, offload_states / reload_states, a checkpoint saved and resumed; and a step that fails part way inside
the forward, then goes on. (tests/distributed/test_offload.py runs its stage-3 NVMe matrix, bf16, fp16 with skipped
steps and the gradient on NVMe included, with the step behind the forward, the default, against runs without
offload, bitwise.)
The model uses its modules in another order than it registers them, has a branch the forward never takes (its
unit is stepped when the next backward starts), a frozen layer, and small parameters kept gathered (persistent);
the optimizer's ring has three buffers (the least there is), so reads started ahead for the wrong unit must make way.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import infinity
import infinity.zero
from infinity.config import parse_config
from infinity.errors import ConfigError
from infinity.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param
from tests.distributed.harness import run_distributed
from tests.distributed.training import VOCAB, global_batch, loss_fn, own_pieces

STEPS, MICRO, ACCUMULATION = 5, 2, 2
MODEL = "transformer"  # the token batches of training.global_batch


class OutOfOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(99)
        self.embed = nn.Embedding(VOCAB, 32)
        self.late = nn.Linear(32, 48)  # registered before ``early``, used after it
        self.early = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)  # trainable, never in the forward
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.norm = nn.LayerNorm(48)  # 48 elements each: persistent under the threshold below
        self.head = nn.Linear(48, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.early(self.embed(tokens)))
        x = torch.tanh(self.late(self.frozen(x)))
        return self.head(self.norm(x))


def config(swap: str, behind: bool | None) -> dict:
    nvme = {"device": "nvme", "nvme_path": swap}
    result = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 4}},  # fmt: skip
        "zero_optimization": {
            "stage": 3, "reduce_bucket_size": 2000, "sub_group_size": 512,
            "stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 3000,
            "offload_optimizer": {**nvme, "buffer_count": 2},
            "offload_param": {**nvme, "max_in_cpu": 0, "buffer_count": 3},
        },  # fmt: skip
    }
    if behind is not None:
        result["infinity"] = {"step_behind_forward": behind}
    return result


def train(engine, rank: int, world_size: int, first: int, steps: int, seen: dict) -> list[float]:
    """Trains ``steps`` steps from global step ``first``; between each step and the next forward, reads and
    changes what a user might, recording what it reads in ``seen``."""
    per_step = MICRO * ACCUMULATION * world_size
    head = engine.module.head.weight
    losses = []
    for step in range(first, first + steps):
        inputs, target = global_batch(MODEL, step, per_step)
        total = 0.0
        for k in range(ACCUMULATION):
            start = k * MICRO * world_size + rank * MICRO
            loss = loss_fn(MODEL, engine(inputs[start : start + MICRO]), target[start : start + MICRO])
            if k == 0 and step > STEPS:  # after a step nothing finished: the forward stepped every unit it used,
                # the unused layer's is left for the backward
                seen.setdefault("left_after_forward", []).append(len(engine.zero_optimizer._pending))
            engine.backward(loss)
            engine.step()
            total += loss.item() / ACCUMULATION
        losses.append(total)
        seen.setdefault("pending", []).append(engine.zero_optimizer.step_pending)
        if step == 0:
            seen["master"] = safe_get_full_fp32_param(head)
            seen["exp_avg"] = safe_get_full_optimizer_state(head, "exp_avg")
        elif step == 1:
            with torch.inference_mode():
                seen["eval"] = engine(inputs[:MICRO]).float().clone()
            engine.optimizer.zero_grad()  # a plain PyTorch loop's habit, after the step
        elif step == 2:
            with infinity.zero.GatheredParameters([engine.module.late.weight]):
                seen["late"] = engine.module.late.weight.detach().clone()
            for group in engine.optimizer.param_groups:
                group["lr"] *= 0.5  # by hand, after this step: acts on the next one
            with infinity.zero.GatheredParameters([engine.module.early.bias], modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        engine.module.early.bias.add_(0.01)  # an edit: the master follows it
        elif step == 3:
            engine.offload_states()
            engine.reload_states()
            safe_set_full_fp32_param(engine.module.norm.bias, torch.full((48,), 0.02))
    return losses


def run_both(rank: int, world_size: int, swap_root: str, fail_once: bool = False) -> dict:
    out = {}
    for behind in (False, None):
        swap = f"{swap_root}/swap-{behind}"
        os.makedirs(swap, exist_ok=True)
        engine, *_ = infinity.initialize(model=OutOfOrder(), config=config(swap, behind))
        seen: dict = {}
        if fail_once and behind is None:
            out["injected"] = fail_in_the_forward_once(engine, world_size)
        losses = train(engine, rank, world_size, 0, STEPS, seen)
        engine.save_checkpoint(f"{swap_root}/ckpt-{behind}")  # a step is still pending here
        pieces = own_pieces(engine)
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        engine.destroy()
        resumed, *_ = infinity.initialize(model=OutOfOrder(), config=config(swap, behind))
        resumed.load_checkpoint(f"{swap_root}/ckpt-{behind}")
        more_seen: dict = {}
        more = train(resumed, rank, world_size, STEPS, 2, more_seen)
        after = own_pieces(resumed)
        resumed.destroy()
        out[behind] = {"losses": losses, "seen": seen, "pieces": pieces, "params": params, "more": more,
                       "after": after, "more_seen": more_seen}  # fmt: skip
    return out


def fail_in_the_forward_once(engine, world_size: int) -> dict:
    """The second step's tiles fail once part way through a unit inside the next forward (as a disk error
    would); the forward raises, and the same micro-batch is run again: the tiles left step then, once each."""
    tiled = engine.zero_optimizer.tiled
    calls = {"tiles": 0}
    store_states = tiled.store_states

    def failing(tile, segment, *args, **kwargs):
        store_states(tile, segment, *args, **kwargs)
        calls["tiles"] += 1
        if calls["tiles"] == len(tiled.tiles) + 3:  # the second step, its third tile, updated in its buffer
            calls["failed"] = True
            raise OSError("injected: the disk failed")

    tiled.store_states = failing
    forward = engine.forward

    def forward_once_more(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except OSError:
            assert engine.zero_optimizer.step_pending
            return forward(*args, **kwargs)

    engine.forward = forward_once_more
    return calls


def assert_same(eager, behind, where: str) -> None:
    if isinstance(eager, dict):
        assert eager.keys() == behind.keys(), where
        for key in eager:
            assert_same(eager[key], behind[key], f"{where}.{key}")
    elif isinstance(eager, list | tuple):
        assert len(eager) == len(behind), where
        for k, (a, b) in enumerate(zip(eager, behind, strict=True)):
            assert_same(a, b, f"{where}[{k}]")
    elif isinstance(eager, torch.Tensor):
        assert torch.equal(eager, behind), f"{where}: differs by {(eager - behind).abs().max().item():.3g}"
    else:
        assert eager == behind, where


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_step_behind_the_forward_is_the_step_in_engine_step_bitwise(tmp_path, world_size):
    results = run_distributed(run_both, world_size, tmp_path, swap_root=str(tmp_path))
    for rank, result in enumerate(results):
        eager, behind = result[False], result[None]
        assert eager["seen"].pop("pending") == [False] * STEPS
        assert behind["seen"].pop("pending") == [True] * STEPS  # the default defers
        assert eager["more_seen"].pop("pending") == [False] * 2
        assert behind["more_seen"].pop("pending") == [True] * 2
        assert eager["more_seen"].pop("left_after_forward") == [0]
        assert behind["more_seen"].pop("left_after_forward") == [1]  # the unused layer's unit
        assert_same(eager, behind, f"rank {rank}")
        initial = dict(OutOfOrder().named_parameters())
        for name, value in eager["params"].items():  # trained: the comparison is not of untouched weights
            assert torch.equal(value, initial[name]) == (name.startswith("frozen")), name
    assert not [p for p in tmp_path.glob("swap-*/**/*") if p.is_file()], "swap files left behind"


def test_a_step_that_fails_in_the_forward_steps_its_tiles_left_on_the_next_use(tmp_path):
    result = run_distributed(run_both, 1, tmp_path, swap_root=str(tmp_path), fail_once=True)[0]
    eager, behind = result[False], result[None]
    assert result["injected"].get("failed"), "the failure was not injected"
    for run in (eager, behind):
        run["seen"].pop("pending"), run["more_seen"].pop("pending"), run["more_seen"].pop("left_after_forward")
    assert_same(eager, behind, "rank 0")


@pytest.mark.parametrize(
    ("zero", "extra", "match"),
    [
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "."}}, {}, "needs zero_optimization"),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {}, 'offload_optimizer.device "nvme"'),
        ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "."}},
         {"bf16": {"enabled": True}, "infinity": {"offloaded_master": "split"}}, "do not go together"),
    ],
)  # fmt: skip
def test_step_behind_forward_true_is_refused_where_it_cannot_act(zero, extra, match):
    raw = {"train_batch_size": 2, "zero_optimization": zero, **extra}
    raw.setdefault("infinity", {})["step_behind_forward"] = True
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_step_behind_forward_true_is_refused_for_an_optimizer_that_steps_otherwise(tmp_path):
    raw = config(str(tmp_path), True)
    raw["optimizer"] = {"type": "Adagrad", "params": {"lr": 0.01}}
    with pytest.raises(ConfigError, match="Adagrad's step cannot run unit by unit"):
        infinity.initialize(model=OutOfOrder(), config=raw)
    raw["infinity"] = {}  # by default it steps in engine.step() instead
    engine, *_ = infinity.initialize(model=OutOfOrder(), config=raw)
    try:
        engine.backward(loss_fn(MODEL, engine(global_batch(MODEL, 0, 2)[0]), global_batch(MODEL, 0, 2)[1]))
        engine.step()
        assert not engine.zero_optimizer.step_pending
    finally:
        engine.destroy()

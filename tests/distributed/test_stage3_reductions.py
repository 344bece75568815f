"""Stage 3's gradient reductions hold a bounded number of fp32 buckets, whatever order the model's modules were
registered in and with or without overlap_comm ([Note: launch order] in zero/reducer.py); the math is plain
PyTorch's, and `infinity estimate` counts the same buckets.

The model registers ten 32 x 32 layers in one order and runs them in another, so backward completes their
gradients in neither registration order nor its reverse: launched in the registration order's reverse (as
before), every bucket waited for the one completed last and the whole model's gradient was held in fp32."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import infinity
import infinity.zero
from infinity.budget import Architecture, Owner, RunShape, Where, estimate
from infinity.config import parse_config
from tests.distributed.harness import run_distributed

RTOL = 1e-5
STEPS, MICRO, WIDTH = 4, 4, 32
UNIT = WIDTH * WIDTH + WIDTH  # a layer's unit (no padding needed at world size 1 or 2)


class Shuffled(nn.Module):
    ORDER = (3, 7, 0, 9, 5, 1, 8, 2, 6, 4)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in self.ORDER)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        for index in self.ORDER:
            x = torch.tanh(self.layers[index](x))
        return self.head(x)


def config(**zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def batch(step: int, world_size: int):
    gen = torch.Generator().manual_seed(900 + step)
    return torch.randn(MICRO * world_size, WIDTH, generator=gen), torch.randn(MICRO * world_size, 4, generator=gen)


def _train(rank: int, world_size: int, configs: list[dict]) -> list[dict]:
    """One engine per config, one after the other: losses (mean over ranks), final parameters, stats per step."""
    torch.set_num_threads(1)
    results = []
    for cfg in configs:
        engine, *_ = infinity.initialize(model=Shuffled(), config=cfg)
        losses, stats = [], []
        for step in range(STEPS):
            x, y = batch(step, world_size)
            part = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = F.mse_loss(engine(x[part]), y[part])
            engine.backward(loss)
            engine.step()
            stats.append(engine.zero_stats())
            loss = loss.detach().clone()
            if world_size > 1:
                torch.distributed.all_reduce(loss)
                loss /= world_size
            losses.append(loss.item())
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        engine.destroy()
        results.append({"losses": losses, "params": params, "stats": stats})
    return results


def reference(world_size: int):
    """Plain PyTorch on the same samples; each rank's gradient taken apart and averaged in rank order, as the
    reduction sums them."""
    model = Shuffled()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, world_size)
        total, grads = 0.0, None
        for rank in range(world_size):
            part = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = F.mse_loss(model(x[part]), y[part])
            got = torch.autograd.grad(loss, list(model.parameters()))
            grads = got if grads is None else [a + g for a, g in zip(grads, got, strict=True)]
            total += loss.item() / world_size
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad / world_size
        optimizer.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches(result: dict, ref_losses: list[float], ref_params: dict) -> None:
    for got, want in zip(result["losses"], ref_losses, strict=True):
        assert abs(got - want) <= RTOL * abs(want), (result["losses"], ref_losses)
    for name, want in ref_params.items():
        error = float((result["params"][name] - want).abs().max() / want.abs().max())
        assert error <= RTOL, f"{name}: relative error {error:.2e}"


def peak_buckets(result: dict) -> list[tuple[int, int]]:
    return [(s["peak_grad_buckets"], s["peak_grad_numel"]) for s in result["stats"]]


def test_without_overlap_comm_one_unit_is_reduced_at_a_time(one_thread):
    """overlap_comm false, one process: each unit's gradient is reduced as soon as backward completes it, so one
    bucket is held at a time (before: all eleven until backward ended); `infinity estimate` says the same."""
    (result,) = _train(0, 1, [config(overlap_comm=False)])
    ref_losses, ref_params = reference(1)
    assert_matches(result, ref_losses, ref_params)
    assert all(count == 1 and numel == UNIT for count, numel in peak_buckets(result)), peak_buckets(result)
    assert all(s["reduce_waits"] == 11 for s in result["stats"]), result["stats"]  # one per unit, in backward
    model = Shuffled()
    owners = [Owner(path=n, numels=(m.weight.numel(), m.bias.numel()), trainable=(True, True))
              for n, m in model.named_modules() if isinstance(m, nn.Linear)]  # fmt: skip
    shape = RunShape(world_size=1, micro_batch=MICRO, seq_len=1, dtype_bytes=4, host_available=1 << 34)
    for overlap in (False, True):
        rows = estimate(owners, Architecture(), parse_config(config(overlap_comm=overlap)), shape, cuda=False).rows
        (row,) = [r for r in rows if r.what.startswith("gradient buckets")]
        assert row.where is Where.DEVICE and row.nbytes == 2 * UNIT * 4, row  # the unit filling and one reduced


def test_reductions_launch_in_execution_order_with_a_bounded_number_in_flight(tmp_path):
    """World size 2 over gloo, modules registered out of execution order: with overlap_comm and
    reduce_bucket_size two units, and without overlap_comm, the buckets held at once stay within what is in
    flight plus the unit filling (before: the whole model, eleven buckets); losses and parameters equal plain
    PyTorch's on both ranks."""
    configs = [config(overlap_comm=True, reduce_bucket_size=2 * UNIT), config(overlap_comm=False)]
    per_rank = run_distributed(_train, 2, tmp_path, timeout_s=120, configs=configs)
    ref_losses, ref_params = reference(2)
    for results in per_rank:
        overlapped, synchronous = results
        for result in results:
            assert_matches(result, ref_losses, ref_params)
        assert all(count <= 3 and numel <= 3 * UNIT for count, numel in peak_buckets(overlapped)), (
            peak_buckets(overlapped)
        )
        assert all(count <= 2 for count, _ in peak_buckets(synchronous)), peak_buckets(synchronous)
        assert all(s["reduce_waits"] == 11 for s in synchronous["stats"]), synchronous["stats"]

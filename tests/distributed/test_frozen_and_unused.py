"""How users break ZeRO: frozen and trainable parameters mixed in one module, LoRA-shaped fine-tuning, a subset
of parameters passed to the optimizer, parameters reached through containers, branches not taken.

Each case runs the engine in real processes (gloo) and compares it with plain PyTorch on the same data.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import infinity
import infinity.zero
from tests.distributed.harness import run_distributed
from tests.distributed.training import gradients_on_nvme

RTOL = 1e-5
STEPS = 6
MICRO = 4


class ScaledFrozen(nn.Module):
    """A frozen projection scaled by a trainable vector: y = (x W^T) * scale. Backward needs W (for x's
    gradient) after scale's gradient is already complete."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / math.sqrt(width), requires_grad=False)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        return F.linear(x, self.weight) * self.scale


class Reentrant(nn.Module):
    """Runs a module under reentrant activation checkpointing (its forward without grad, then again in backward,
    where autograd runs through the recomputed graph)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)


class EditsItsInput(nn.Module):
    """Doubles its input in place before using it; the caller reuses the input (a residual), so autograd must
    see the edit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / math.sqrt(width))

    def forward(self, x):
        x.mul_(2)
        return F.linear(x, self.weight)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = EditsItsInput(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)  # addmm does not keep its output for backward, so editing it in place is allowed
        return self.out(torch.tanh(self.block(h) + h))


class LoRALinear(nn.Module):
    """A frozen base Linear with a trainable low-rank adapter (the shape of PEFT's LoRA)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # PEFT starts B at zero; nonzero makes A's gradient nonzero

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class Containers(nn.Module):
    """A parent that hands its children's parameters to a function inside a dict and nested tuples/lists
    without calling the children (the fetch-on-use path of stage 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mix = nn.Linear(32, 32)
        self.gate = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = mix_through_containers({"mix": (self.mix.weight, [self.mix.bias]), "gate": [[self.gate.weight]]}, h)
        return self.out(h)


def mix_through_containers(params: dict, h: torch.Tensor) -> torch.Tensor:
    """A function taking tensors inside containers that takes part in torch's function protocol (as library
    functions do), so modes see it with the containers as its arguments."""
    if torch.overrides.has_torch_function((h,)):
        return torch.overrides.handle_torch_function(mix_through_containers, (h,), params, h)
    weight, (bias,) = params["mix"]
    gate = params["gate"][0][0]
    return torch.tanh(F.linear(h, weight, bias)) * torch.sigmoid(h @ gate.t())


class _ProjectGathered(torch.autograd.Function):
    """h @ w.T with ``w`` handed in directly: the caller gathers it around apply() and the backward gathers it
    again, as TRL's fused LM head does (the engine sees no torch call on the parameter before the function reads
    it)."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, grad):
        h, w = ctx.saved_tensors
        with infinity.zero.GatheredParameters([w]):
            return grad @ w, grad.t() @ h


class _ScoreStashed(torch.autograd.Function):
    """sum(w * target), its gradient taken in the forward and only scaled in the backward, as fused losses do: the
    weight's gradient arrives while its unit is released. (A function of the weight alone: every rank adds the
    same score, so the data-parallel mean is the plain run's.)"""

    @staticmethod
    def forward(ctx, w, target):
        ctx.stashed = target.to(w.dtype)
        return (w * ctx.stashed).sum()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.stashed, None


class _NoWeightGradient(torch.autograd.Function):
    """h @ w.T whose backward gives ``w`` no gradient (returns None for it), as a function that treats a weight as
    a constant does: the parameter is left as plain PyTorch leaves it."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        with infinity.zero.GatheredParameters([w]):
            return grad @ w, None


class CustomFunctions(nn.Module):
    """Children's weights handed to custom autograd functions, gathered around the call, without calling the
    children."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.head = nn.Linear(32, 32, bias=False)
        self.side = nn.Linear(32, 8, bias=False)
        self.constant = nn.Linear(32, 32, bias=False)  # its function gives it no gradient
        self.out = nn.Linear(32, 4)
        self.register_buffer("target", torch.linspace(-1, 1, 8 * 32).view(8, 32))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        with infinity.zero.GatheredParameters([self.head.weight]):
            h = torch.tanh(_ProjectGathered.apply(h, self.head.weight))
        with infinity.zero.GatheredParameters([self.side.weight]):
            score = _ScoreStashed.apply(self.side.weight, self.target)
        with infinity.zero.GatheredParameters([self.constant.weight]):
            h = torch.tanh(_NoWeightGradient.apply(h, self.constant.weight))
        return self.out(h) + 0.01 * score


class UnusedLast(nn.Module):
    """Eight used layers, then one never called, registered last: its bucket is the first one reduced."""

    def __init__(self, width: int = 128, layers: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.unused = nn.Linear(width, width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x[:, :4]


def build(name: str) -> nn.Module:
    torch.manual_seed(1234)
    if name == "scaled-frozen":
        return nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), ScaledFrozen(32), nn.Tanh(), ScaledFrozen(32), nn.Tanh(), nn.Linear(32, 4)
        )
    if name == "scaled-frozen-reentrant":
        return nn.Sequential(
            nn.Linear(16, 32), nn.Tanh(), Reentrant(ScaledFrozen(32)), nn.Tanh(), Reentrant(ScaledFrozen(32)),
            nn.Tanh(), nn.Linear(32, 4),
        )  # fmt: skip
    if name == "inplace-input":
        return Residual()
    if name == "lora":
        return nn.Sequential(
            LoRALinear(16, 64), nn.Tanh(), LoRALinear(64, 64), nn.Tanh(), LoRALinear(64, 64), nn.Tanh(),
            LoRALinear(64, 4),
        )  # fmt: skip
    if name == "containers":
        return Containers()
    if name == "unused":
        return UnusedLast()
    if name == "custom-functions":
        return CustomFunctions()
    raise ValueError(name)


def in_width(name: str) -> int:
    return 128 if name == "unused" else 16


def batch(name: str, step: int, size: int):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(size, in_width(name), generator=gen), torch.randn(size, 4, generator=gen)


def config(stage: int, *, bf16: bool = False, **zero) -> dict:
    result = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    if bf16:
        result["bf16"] = {"enabled": True}
    return result


def optimized(model: nn.Module, subset: str) -> list[nn.Parameter]:
    """The parameters handed to the optimizer: all trainable ones, or only the last layer's ("last")."""
    if subset == "last":
        return list(list(model.children())[-1].parameters())
    return [p for p in model.parameters() if p.requires_grad]


def _engine_run(rank: int, world_size: int, name: str, config: dict, subset: str = "all", steps: int = STEPS,
                swapped_gradients: bool = False):  # fmt: skip
    model = build(name)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    with gradients_on_nvme() if swapped_gradients else contextlib.nullcontext():
        engine, *_ = infinity.initialize(model=model, config=config, model_parameters=optimized(model, subset))
    assert (getattr(engine.zero_optimizer, "gradients", None) is not None) == swapped_gradients
    losses, peaks, buffer_peaks = [], [], []
    reducer = engine.zero_optimizer.reducer
    for step in range(steps):
        x, y = batch(name, step, MICRO * world_size)
        x, y = x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]
        reducer.peak_buffer_bytes = reducer.peak_waiting_bytes = 0
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        buffer_peaks.append((reducer.peak_buffer_bytes, reducer.peak_waiting_bytes))
        loss = loss.detach().clone()
        if world_size > 1:
            torch.distributed.all_reduce(loss)
            loss /= world_size
        losses.append(loss.item())
        if engine.stage3 is not None:
            peaks.append(engine.zero_stats()["peak_live_numel"])
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    result = {
        "losses": losses,
        "params": params,
        "initial": initial,
        "dtypes": {n: p.dtype for n, p in engine.module.named_parameters()},
        "peak_live": peaks,
        "buffer_peaks": buffer_peaks,
        "largest_unit": engine.stage3.table.largest_unit_numel if engine.stage3 is not None else 0,
        "bucket_bytes": [4 * b.padded_numel for layout in getattr(reducer, "layouts", ()) for b in layout.buckets],
    }
    engine.destroy()
    return result


def reference(name: str, world_size: int, subset: str = "all", steps: int = STEPS):
    """Plain PyTorch on the same samples; each rank's micro-batch gradient is taken apart and averaged in rank
    order, as the engine's reduction does, so the sums round alike."""
    model = build(name)
    params = optimized(model, subset)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, fused=True)
    losses = []
    for step in range(steps):
        x, y = batch(name, step, MICRO * world_size)
        total, grads = 0.0, None
        for rank in range(world_size):
            part = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = F.mse_loss(model(x[part]), y[part])
            for param in params:
                param.grad = None
            loss.backward()  # not autograd.grad: reentrant checkpointing refuses it
            got = [None if param.grad is None else param.grad.clone() for param in params]
            grads = got if grads is None else [g if a is None else a + g for a, g in zip(grads, got, strict=True)]
            total += loss.item() / world_size
        for param, grad in zip(params, grads, strict=True):
            param.grad = None if grad is None else grad / world_size
        optimizer.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches(result: dict, ref_losses: list[float], ref_params: dict, rtol: float = RTOL) -> None:
    for got, want in zip(result["losses"], ref_losses, strict=True):
        assert abs(got - want) <= rtol * abs(want), (result["losses"], ref_losses)
    for name, want in ref_params.items():
        got = result["params"][name].float()
        error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        assert error <= rtol, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", ["scaled-frozen", "scaled-frozen-reentrant", "lora", "containers", "inplace-input",
                                  "custom-functions"])  # fmt: skip
def test_stage3_matches_plain_pytorch(name, world_size, tmp_path):
    """Frozen and trainable parameters in one unit (also under reentrant checkpointing); units of frozen
    parameters only; parameters used through containers; a module editing its input in place; weights handed to
    custom autograd functions that gather them themselves (one stashing its gradient in the forward, one giving
    its weight none). Losses and parameters (trainable and frozen) equal plain PyTorch's."""
    results = run_distributed(_engine_run, world_size, tmp_path, timeout_s=180, name=name, config=config(3))
    ref_losses, ref_params = reference(name, world_size)
    for result in results:
        assert_matches(result, ref_losses, ref_params)


@pytest.mark.parametrize(("name", "subset"), [("lora", "all"), ("scaled-frozen-reentrant", "all"),
                                            ("unused", "all"), ("scaled-frozen", "last")])  # fmt: skip
def test_stage3_with_everything_on_nvme_matches_plain_pytorch(name, subset, tmp_path):
    """The same breakages with parameters, optimizer states and gradients on NVMe ([Note: swapped gradients]; the
    gradient forced there, as for a model whose gradient the host share does not hold): frozen units, an unused
    layer, reentrant checkpointing, parameters outside the optimizer."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = {"device": "nvme", "nvme_path": str(nvme)}
    cfg = config(3, offload_optimizer=offload, offload_param={**offload, "max_in_cpu": 0})
    results = run_distributed(
        _engine_run, 2, workdir(tmp_path, "run"), timeout_s=180, name=name, config=cfg, subset=subset,
        swapped_gradients=True,
    )
    ref_losses, ref_params = reference(name, 2, subset=subset)
    for result in results:
        assert_matches(result, ref_losses, ref_params)
    assert not list(nvme.iterdir())


def workdir(tmp_path, name) -> str:
    path = tmp_path / str(name)
    path.mkdir()
    return str(path)


def test_lora_frozen_units_are_released_in_backward(tmp_path):
    """A unit of frozen parameters is released as soon as its module's backward is done, so the live budget
    holds in backward too: peak live numel <= max_live_parameters + the largest unit, every step."""
    base = 64 * 64 + 64
    max_live = base + 2 * 4 * 64  # one base layer and its adapter
    zero = {"stage3_max_live_parameters": max_live, "stage3_prefetch_bucket_size": base}
    for world_size in (1, 2):
        results = run_distributed(
            _engine_run,
            world_size,
            workdir(tmp_path, world_size),
            timeout_s=180,
            name="lora",
            config=config(3, **zero),
        )
        for result in results:
            assert all(peak <= max_live + result["largest_unit"] for peak in result["peak_live"]), result["peak_live"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_subset_of_parameters_in_bf16_trains_only_the_subset(stage, tmp_path):
    """model_parameters with only the last layer: every parameter is cast to bf16; the others do not change."""
    (result,) = run_distributed(
        _engine_run, 1, tmp_path, timeout_s=120, name="scaled-frozen", config=config(stage, bf16=True), subset="last"
    )
    assert all(dtype == torch.bfloat16 for dtype in result["dtypes"].values()), result["dtypes"]
    assert all(math.isfinite(loss) for loss in result["losses"])
    last = {f"6.{key}" for key in ("weight", "bias")}
    for name, value in result["params"].items():
        initial = result["initial"][name].to(torch.bfloat16)
        if name in last:
            assert not torch.equal(value, initial), name
        else:
            assert torch.equal(value, initial), name


@pytest.mark.parametrize("stage", [2, 3])
def test_a_subset_of_parameters_matches_plain_pytorch(stage, tmp_path):
    results = run_distributed(
        _engine_run, 2, tmp_path, timeout_s=180, name="scaled-frozen", config=config(stage), subset="last"
    )
    ref_losses, ref_params = reference("scaled-frozen", 2, subset="last")
    for result in results:
        assert_matches(result, ref_losses, ref_params)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_an_unused_parameter_holds_no_gradient_buffers(stage, world_size, tmp_path):
    """The unused layer's bucket comes first in the fixed reduction order. It must not hold back the others:
    at most one filled bucket waits for its turn (before: all of them, until the end of backward), and at
    stage 2 at most two reductions are in flight besides. The math equals plain PyTorch's (whose unused
    parameter gets no gradient and, without weight decay, does not move)."""
    bucket = 128 * 128 + 128
    cfg = config(stage, reduce_bucket_size=bucket, overlap_comm=True)
    results = run_distributed(_engine_run, world_size, tmp_path, timeout_s=180, name="unused", config=cfg)
    ref_losses, ref_params = reference("unused", world_size)
    one = 4 * (-(-bucket // (8 * world_size)) * 8 * world_size)
    for result in results:
        assert_matches(result, ref_losses, ref_params)
        assert max(waiting for _, waiting in result["buffer_peaks"]) <= one, (result["buffer_peaks"], one)
        if stage == 2 or world_size == 1:  # stage 3 never blocks in backward to free buffers in flight
            assert max(total for total, _ in result["buffer_peaks"]) <= 3 * one, (result["buffer_peaks"], one)


def test_a_gather_inside_backward_keeps_the_unit_for_its_gradients():
    """_ProjectGathered's backward gathers the head weight itself: the unit stays gathered for the gradient's
    accumulation (no second fetch: the pre-accumulation check finds it gathered), counts as live meanwhile, and
    goes when its gradient is in, as any unit after its backward."""
    from infinity.zero.units import UnitState

    engine, *_ = infinity.initialize(model=build("custom-functions"), config=config(3))
    coordinator, table = engine.stage3.coordinator, engine.stage3.table
    head = table.unit_of(engine.module.head.weight)[0]
    seen = []  # (unit, its state, whether it counts as live) as each gradient is about to be accumulated
    original = coordinator.before_param_grad
    coordinator.before_param_grad = lambda unit: (seen.append(
        (unit, table.units[unit].state, unit in coordinator._resident.live)), original(unit))[1]  # fmt: skip
    try:
        for step in range(2):
            x, y = batch("custom-functions", step, MICRO)
            engine.backward(F.mse_loss(engine(x), y))
            assert head.state is UnitState.RELEASED
            engine.step()
        assert (head.index, UnitState.GATHERED, True) in seen, seen  # kept, and counted as live
        assert all(state is UnitState.GATHERED for unit, state, _ in seen if unit == head.index), seen
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_custom_functions_below_stage_3_match_plain_pytorch(stage, tmp_path):
    """The same custom functions where nothing is partitioned (their gathers change nothing): the weight whose
    function gives it no gradient stays as plain PyTorch leaves it, the rest trains as plain PyTorch."""
    results = run_distributed(_engine_run, 1, tmp_path, timeout_s=120, name="custom-functions", config=config(stage))
    ref_losses, ref_params = reference("custom-functions", 1)
    assert_matches(results[0], ref_losses, ref_params)

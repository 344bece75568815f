"""Compact optimizer states ([Note: compact states] in infinity/zero/compact.py): the codecs' precision, and
training with offloaded states stored in bf16 or int8 against the same run with fp32 states (world sizes 1 and 2,
stages 2 and 3, on NVMe): the losses stay within a fraction of a percent, the swap files shrink as the layout
says, a checkpoint resumes bitwise, and what cannot be compact is refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import infinity
from infinity.errors import ConfigError
from infinity.zero.compact import BLOCK, Bf16Codec, Int8Codec
from tests.distributed.harness import run_distributed
from tests.distributed.training import gradients_on_nvme

STEPS = 20


def roundtrip(codec, values: torch.Tensor) -> torch.Tensor:
    stored = torch.empty(codec.stored_bytes(values.numel()), dtype=torch.uint8)
    codec.encode(values, stored)
    out = torch.empty_like(values)
    codec.decode(stored, out)
    return out


@pytest.mark.parametrize("signed", [True, False], ids=["first-moment", "second-moment"])
def test_int8_keeps_relative_precision_over_many_decades(signed):
    """Values spread over 4 decades (a gradient), or 8 (its square): every element the code's range covers (5
    decades below its block's largest, 10 for the square) within 5% of itself, half of them within 2.5%; those
    below it become zero; a partial last block has its own scale; decoding then encoding again is exact (a
    resumed checkpoint re-quantizes to the same codes); an all-zero block stays zero."""
    torch.manual_seed(0)
    numel = 10 * BLOCK + 7
    grad = torch.randn(numel) * torch.logspace(-4, 0, numel)[torch.randperm(numel)]
    values = grad if signed else grad * grad
    codec = Int8Codec(signed=signed)
    assert codec.stored_bytes(values.numel()) == 4 * 11 + values.numel() + 1  # 11 scales, the codes, padding to 4
    got = roundtrip(codec, values)
    largest = torch.cat([block.abs().max().expand(len(block)) for block in values.split(BLOCK)])
    covered = values.abs() >= largest * (1e-5 if signed else 1e-10)
    error = (got - values).abs() / values.abs()
    assert covered.float().mean() > 0.95
    assert error[covered].max() < 0.05 and error[covered].median() < 0.025, (error.max(), error.median())
    assert torch.all(got[~covered].abs() <= largest[~covered] * (1e-5 if signed else 1e-10))
    assert torch.equal(roundtrip(codec, got), got)
    assert torch.equal(roundtrip(codec, torch.zeros(BLOCK)), torch.zeros(BLOCK))


@pytest.mark.parametrize("codec", [Int8Codec(signed=False), Bf16Codec()], ids=["int8", "bf16"])
def test_the_steps_stochastic_rounding_lets_a_slow_second_moment_fall(codec):
    """Adam's second moment with beta2 0.999 stored every step: after 1000 steps, half the gradients become ten
    times smaller. Rounded to nearest, their stored moment cannot follow (a change under half a code step per step
    stays where it is: 2x-3x too high 1000 steps later); the step's stochastic rounding keeps it within 10%."""
    torch.manual_seed(0)
    numel = 16 * BLOCK
    spread = torch.logspace(-3, 0, numel)[torch.randperm(numel)]
    fell = torch.arange(numel) % 2 == 0
    ratios = {}
    for stochastic in (False, True):
        stored = torch.zeros(codec.stored_bytes(numel), dtype=torch.uint8)
        exact, decoded, generator = torch.zeros(numel), torch.empty(numel), torch.Generator()
        for step in range(2000):
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(step)) * spread
            if step >= 1000:
                grad[fell] *= 0.1
            exact.mul_(0.999).add_(grad * grad, alpha=0.001)
            codec.decode(stored, decoded)
            decoded.mul_(0.999).add_(grad * grad, alpha=0.001)
            codec.encode(decoded, stored, generator.manual_seed(step) if stochastic else None)
        codec.decode(stored, decoded)
        ratios[stochastic] = float((decoded[fell] / exact[fell]).median())
    assert ratios[False] > 1.8 and 0.9 < ratios[True] < 1.1, ratios


def test_bf16_states_are_bfloat16_roundings():
    values = torch.randn(1000)
    assert torch.equal(roundtrip(Bf16Codec(), values), values.to(torch.bfloat16).float())


def build(odd: bool = False) -> nn.Module:
    """A regression MLP; ``odd``: widths of 5 and 7, so stage 3's runs (and tiles) hold odd element counts."""
    torch.manual_seed(0)
    if odd:
        return nn.Sequential(nn.Linear(32, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4))
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))


def config(nvme, *, stage: int, state_dtype: str, optimizer: dict | None = None, device: str = "nvme",
           gradient_dtype: str = "fp32", accumulation: int = 1) -> dict:  # fmt: skip
    offload = {"device": device, "nvme_path": str(nvme)} if device == "nvme" else {"device": device}
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
            "gradient_accumulation_steps": accumulation,
            "optimizer": optimizer or {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": offload},
            "infinity": {"optimizer_state_dtype": state_dtype, "offloaded_gradient_dtype": gradient_dtype}}  # fmt: skip


def train(nvme, *, rank: int = 0, world_size: int = 1, stage: int = 3, state_dtype: str = "fp32",
          steps: int = STEPS, save=None, load=None, device: str = "nvme", odd: bool = False,
          gradient_dtype: str = "fp32", accumulation: int = 1) -> dict:  # fmt: skip
    """Losses of steps [resumed step, steps) on a seeded regression (each the mean of its ``accumulation``
    micro-steps); the swap folder's bytes while the engine lives; optionally a checkpoint saved after half the
    steps, or loaded first."""
    os.makedirs(nvme, exist_ok=True)
    cfg = config(nvme, stage=stage, state_dtype=state_dtype, device=device, gradient_dtype=gradient_dtype,
                 accumulation=accumulation)  # fmt: skip
    engine, *_ = infinity.initialize(model=build(odd), config=cfg)
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in range(engine.global_steps, steps):
        total = 0.0
        for micro in range(accumulation):
            seed = step * accumulation + micro
            x = torch.randn(8 * world_size, 32, generator=torch.Generator().manual_seed(seed)).chunk(world_size)[rank]
            loss = ((engine(x) - torch.sin(3 * x[:, :4])) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.item() / accumulation
        losses.append(total)
        if save is not None and step + 1 == steps // 2:
            engine.save_checkpoint(save)
    files = [os.path.join(d, f) for d, _, names in os.walk(nvme) for f in names]  # nvme only
    swap = sum(os.path.getsize(f) for f in files)
    gradients = sum(os.path.getsize(f) for f in files if "-gradients" in os.path.relpath(f, nvme))
    stored = engine.zero_optimizer.tiled.state_bytes()
    engine.destroy()
    return {"losses": losses, "swap_bytes": swap, "state_bytes": stored, "gradient_bytes": gradients}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_compact_states_train_as_fp32_states_in_a_fraction_of_the_bytes(stage, state_dtype, tmp_path):
    """AdamW, everything of the optimizer on NVMe: the losses of 20 steps within 0.5% (bf16: 0.05%) of fp32
    states'; the tiles store 2/3 (bf16: master 4 + 2 x 2 bytes of 12) or about half (int8: 4 + 2 x 1.0625)."""
    want = train(tmp_path / "fp32", stage=stage)
    got = train(tmp_path / state_dtype, stage=stage, state_dtype=state_dtype)
    tolerance = 5e-4 if state_dtype == "bf16" else 5e-3
    assert got["losses"] == pytest.approx(want["losses"], rel=tolerance)
    assert got["losses"] != want["losses"]  # the states were rounded
    ratio = got["state_bytes"] / want["state_bytes"]
    expected = 8 / 12 if state_dtype == "bf16" else (4 + 2 * (1 + 4 / BLOCK)) / 12
    assert expected <= ratio < expected + 0.01, ratio
    assert got["swap_bytes"] < want["swap_bytes"] * (expected + 0.02)


@pytest.mark.parametrize("device", ["nvme", "cpu"])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_compact_checkpoint_resumes_bitwise(state_dtype, device, tmp_path):
    """Saved after 10 steps (the states decoded to fp32, the universal format; in host memory the decoded
    workspace is reused tile after tile, so its writes and reads must finish first) and loaded into a new run
    (encoded again, to the same codes): steps 11-20 are the uninterrupted run's, bitwise. Also with tiles of odd
    element counts (stage 3's runs of a model 5 and 7 wide), whose states' bytes are padded to stay aligned."""
    for odd in (False, True):
        kwargs = {"state_dtype": state_dtype, "device": device, "odd": odd}
        whole = train(tmp_path / f"a{odd}", save=tmp_path / f"ckpt{odd}", **kwargs)
        resumed = train(tmp_path / f"b{odd}", load=tmp_path / f"ckpt{odd}", **kwargs)
        assert resumed["losses"] == whole["losses"][STEPS // 2 :], odd


@pytest.mark.parametrize("accumulation", [1, 3])
def test_bf16_gradients_on_nvme_train_as_fp32_ones(accumulation, tmp_path):
    """Stage 3, the gradient swapped to NVMe with the optimizer ([Note: bf16 gradients] in zero/grads.py): stored
    in bf16 (with int8 states: the compact mode's bytes), the losses of 20 steps stay within 0.5% of fp32
    gradients', with one micro-step per step and with three (each later one read back, added in fp32 and
    rounded again); the gradient's swap file is half the size."""
    with gradients_on_nvme():
        want = train(tmp_path / "fp32", state_dtype="int8", accumulation=accumulation)
        got = train(tmp_path / "bf16", state_dtype="int8", gradient_dtype="bf16", accumulation=accumulation)
    assert got["losses"] == pytest.approx(want["losses"], rel=5e-3)
    assert got["losses"] != want["losses"]  # the gradients were rounded
    assert want["gradient_bytes"] and got["gradient_bytes"] <= want["gradient_bytes"] / 2 + 4096 * 8


def _both_dtypes(*, rank: int, world_size: int, tmp: str) -> dict:
    return {dtype: train(f"{tmp}/{dtype}-{rank}", rank=rank, world_size=world_size, state_dtype=dtype)["losses"]
            for dtype in ("fp32", "int8")}  # fmt: skip


def test_int8_states_at_world_size_2(tmp_path):
    """Two gloo ranks, stage 3, each rank's states quantized in its own tiles: within 0.5% of fp32 states."""
    for result in run_distributed(_both_dtypes, 2, tmp_path, timeout_s=180, tmp=str(tmp_path)):
        assert result["int8"] == pytest.approx(result["fp32"], rel=5e-3)


def test_what_cannot_be_compact_is_refused_by_name(tmp_path):
    """int8 quantizes Adam's moments only (SGD's momentum is refused, naming bf16); compact states need the
    optimizer offloaded."""
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    with pytest.raises(ConfigError, match=r'"int8" quantizes Adam.*SGD keeps \[.momentum_buffer.\]: use "bf16"'):
        infinity.initialize(model=build(), config=config(tmp_path, stage=2, state_dtype="int8", optimizer=sgd))
    in_memory = config(tmp_path, stage=2, state_dtype="bf16")
    del in_memory["zero_optimization"]["offload_optimizer"]
    with pytest.raises(ConfigError, match="optimizer_state_dtype .* needs zero_optimization.offload_optimizer"):
        infinity.initialize(model=build(), config=in_memory)
    with pytest.raises(ConfigError, match="must be one of fp32, bf16, int8"):
        infinity.initialize(model=build(), config=config(tmp_path, stage=2, state_dtype="int4"))
    with pytest.raises(ConfigError, match='offloaded_gradient_dtype "bf16" .* only stage 3 with .*"nvme"'):
        infinity.initialize(model=build(), config=config(tmp_path, stage=2, state_dtype="int8", gradient_dtype="bf16"))
    with pytest.raises(ConfigError, match="offloaded_gradient_dtype must be fp32 or bf16; got 'fp16'"):
        infinity.initialize(model=build(), config=config(tmp_path, stage=3, state_dtype="int8", gradient_dtype="fp16"))

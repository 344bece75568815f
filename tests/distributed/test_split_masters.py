"""Split masters ([Note: split masters] in infinity/zero/split_master.py): the fp32 master stored as 16 bits
beside the bf16 weight. The split and join are exact on the bit patterns but for the one tie that does not fit;
training with bf16 weights and the optimizer offloaded gives the losses of fp32 masters bitwise (stages 2 and 3,
host memory and NVMe, world sizes 1 and 2) in two thirds of the tiles' bytes; a checkpoint resumes bitwise; an
edit of the weights reaches the masters; what cannot split is refused by name."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import infinity
from infinity.errors import ConfigError
from infinity.utils import safe_get_full_fp32_param
from infinity.zero.split_master import MasterSplitter
from tests.distributed.harness import run_distributed

STEPS = 12


def split_and_join(values: torch.Tensor) -> torch.Tensor:
    splitter = MasterSplitter(values.numel())
    residual = torch.empty(values.numel(), dtype=torch.int16)
    splitter.split(values, residual)
    return splitter.join(values.to(torch.bfloat16), residual).clone()


def test_split_then_join_gives_the_master_back():
    """Values over 60 decades, both signs, zeros, infinities, the largest finite and the smallest subnormal come
    back bit for bit, except masters whose low 16 bits are exactly 0x8000 and whose bf16 rounding went down (to
    even): one fp32 ulp toward zero, rounding to the same bf16 weight. NaN stays NaN."""
    torch.manual_seed(0)
    values = torch.randn(1 << 18) * torch.logspace(-30, 30, 1 << 18)
    specials = [0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45]
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F818001, 0x3F807FFF], dtype=torch.int32)
    ties = torch.cat([bits, bits | -(1 << 31)]).view(torch.float32)  # and the same negative
    values = torch.cat([torch.tensor(specials), ties, values])
    got = split_and_join(values)
    changed = got.view(torch.int32) != values.view(torch.int32)
    low = values.view(torch.int32) & 0xFFFF
    rounded_down = values.to(torch.bfloat16).float().abs() < values.abs()
    assert torch.equal(changed, (low == 0x8000) & rounded_down)
    assert changed[len(specials) : len(specials) + len(ties)].tolist() == [True, False, False, False] * 2
    assert torch.equal(got[changed].abs().view(torch.int32), values[changed].abs().view(torch.int32) - 1)
    assert torch.equal(got.to(torch.bfloat16).view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    assert split_and_join(torch.tensor([float("nan")])).isnan().all()


def build(odd: bool = False) -> nn.Module:
    """A regression MLP; ``odd``: widths of 5 and 7, so stage 3's tiles hold odd element counts (the residual's
    bytes are padded for the states after it)."""
    torch.manual_seed(0)
    if odd:
        return nn.Sequential(nn.Linear(32, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4))
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))


def config(nvme, *, stage: int, master: str, device: str, bf16: bool = True, outsized: bool = False,
           states: str = "int8") -> dict:  # fmt: skip
    """AdamW with int8 states (the compact mode). At stage 3 on NVMe the parameters are there too, none kept in
    host memory: the step reads every piece back to join its masters. ``outsized``: staging buffers of 10,000
    elements, so the 256 x 256 layer's piece is read outside the ring (ahead of its edit, into a host buffer)."""
    offload = {"device": device, "nvme_path": str(nvme)} if device == "nvme" else {"device": device}
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "offload_optimizer": offload}
    if stage == 3 and device == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
        if outsized:
            zero["offload_param"]["buffer_size"] = 10_000
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}, "zero_optimization": zero,
            "infinity": {"offloaded_master": master, "optimizer_state_dtype": states}}  # fmt: skip


def train(nvme, *, master: str, stage: int = 3, device: str = "nvme", rank: int = 0, world_size: int = 1,
          odd: bool = False, save=None, load=None, edit: bool = False, outsized: bool = False,
          states: str = "int8") -> dict:  # fmt: skip
    """Losses of steps [resumed step, STEPS); the fp32 masters after them, the tiles' bytes. ``save``: a
    checkpoint after half the steps; ``load``: resumed from one. ``edit``: after half the steps every weight is
    set to a tenth of itself through GatheredParameters, as a user's surgery would."""
    os.makedirs(nvme, exist_ok=True)
    cfg = config(nvme, stage=stage, master=master, device=device, outsized=outsized, states=states)
    engine, *_ = infinity.initialize(model=build(odd), config=cfg)
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in range(engine.global_steps, STEPS):
        x = torch.randn(8 * world_size, 32, generator=torch.Generator().manual_seed(step)).chunk(world_size)[rank]
        loss = ((engine(x).float() - torch.sin(3 * x[:, :4])) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save is not None and step + 1 == STEPS // 2:
            engine.save_checkpoint(save)
        if edit and step + 1 == STEPS // 2:
            params = list(engine.module.parameters())
            with infinity.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
                for param in params:
                    param.mul_(0.1)
    masters = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    state_bytes = engine.zero_optimizer.tiled.state_bytes()
    planned = engine.swap_need.optimizer if engine.swap_need is not None else 0
    optimizer_file = engine.zero_optimizer.tiled.manager.store.layout.total_bytes if device == "nvme" else 0
    engine.destroy()
    return {"losses": losses, "masters": masters, "state_bytes": state_bytes, "planned": planned,
            "optimizer_file": optimizer_file}  # fmt: skip


def assert_same_training(got: dict, want: dict) -> None:
    """The same losses bitwise; the masters within the tie's ulp (2^-24 of each)."""
    assert got["losses"] == want["losses"]
    for mine, theirs in zip(got["masters"], want["masters"], strict=True):
        assert torch.allclose(mine, theirs, rtol=2**-22, atol=0)


@pytest.mark.parametrize(("stage", "device", "states"),
                         [(3, "nvme", "int8"), (3, "cpu", "int8"), (2, "cpu", "int8"), (3, "nvme", "fp32")])
def test_split_masters_train_as_fp32_masters_in_fewer_bytes(stage, device, states, tmp_path):
    """Bitwise losses; the tiles store 2 + 2 x 1.0625 bytes an element instead of 4 + 2 x 1.0625 (fp32 states,
    stepped in place in the segment: 2 + 8 instead of 4 + 8), and on NVMe the plan (the disk check's and
    `infinity estimate`'s arithmetic) counts the file the tiles take."""
    want = train(tmp_path / "fp32", master="fp32", stage=stage, device=device, states=states)
    got = train(tmp_path / "split", master="split", stage=stage, device=device, states=states)
    assert_same_training(got, want)
    ratio = got["state_bytes"] / want["state_bytes"]
    expected = 4.125 / 6.125 if states == "int8" else 10 / 12
    assert expected <= ratio < expected + 0.01, ratio
    if device == "nvme":  # the plan keeps 4 KiB per parameter for runs that param groups may cut
        for run in (got, want):
            assert run["optimizer_file"] <= run["planned"] <= run["optimizer_file"] + 6 * 4096
        assert got["optimizer_file"] < want["optimizer_file"]


def test_an_outsized_piece_is_read_ahead_of_its_edit(tmp_path, monkeypatch):
    """Stage 3 on NVMe with a piece larger than the staging buffers: the step reads it ahead into the host buffer
    its edit takes (one such read each step, each taken by the edit, none dropped), and trains as fp32 masters
    do."""
    from infinity.zero.shards import UnitShards

    taken, dropped = [], []
    edit, drop = UnitShards.edit, UnitShards._drop_reading

    def spy_edit(self, index, **kwargs):
        taken.extend([index] if index in self._reading else [])
        return edit(self, index, **kwargs)

    def spy_drop(self, index=None):
        dropped.extend(self._reading if index is None else [index] if index in self._reading else [])
        drop(self, index)

    monkeypatch.setattr(UnitShards, "edit", spy_edit)
    monkeypatch.setattr(UnitShards, "_drop_reading", spy_drop)
    want = train(tmp_path / "fp32", master="fp32", outsized=True)
    assert not taken
    got = train(tmp_path / "split", master="split", outsized=True)
    assert_same_training(got, want)
    assert len(taken) == STEPS and len(set(taken)) == 1 and not dropped, (taken, dropped)


def test_a_weight_set_between_backward_and_step(tmp_path):
    """Split masters at stage 3 on NVMe with a ring of 2 staging buffers: after backward, before the step, the
    last layer's fp32 master is set (safe_set_full_fp32_param edits its piece: nothing the step reads ahead may
    hold the ring then); the step goes on from the new master, as with fp32 masters."""
    from infinity.utils import safe_set_full_fp32_param

    def run(master: str) -> list:
        cfg = config(tmp_path / master, stage=3, master=master, device="nvme")
        cfg["zero_optimization"]["offload_param"]["buffer_count"] = 2
        os.makedirs(tmp_path / master)
        engine, *_ = infinity.initialize(model=build(), config=cfg)
        last = list(engine.module.parameters())[-2]
        for step in range(3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
            engine.backward(((engine(x).float() - torch.sin(3 * x[:, :4])) ** 2).mean())
            if step == 1:
                safe_set_full_fp32_param(last, torch.full(tuple(last.ds_shape), 0.01))
            engine.step()
        masters = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
        engine.destroy()
        return masters

    for mine, theirs in zip(run("split"), run("fp32"), strict=True):
        assert torch.allclose(mine, theirs, rtol=2**-22, atol=0)


def test_an_edit_of_the_weights_reaches_split_masters(tmp_path):
    """GatheredParameters(modifier_rank=0) scales every weight mid-run at stage 3 on NVMe: the masters follow
    (joined with the new pieces, split again), and training goes on as with fp32 masters."""
    want = train(tmp_path / "fp32", master="fp32", edit=True)
    got = train(tmp_path / "split", master="split", edit=True)
    assert_same_training(got, want)


def test_a_split_master_checkpoint_resumes_bitwise(tmp_path):
    """Saved after half the steps (the masters joined into fp32: the universal format) and loaded into a new run
    (split again against the loaded weights): the rest of the run is the uninterrupted one's, bitwise; also with
    tiles of odd element counts."""
    for odd in (False, True):
        whole = train(tmp_path / f"a{odd}", master="split", odd=odd, save=tmp_path / f"ckpt{odd}")
        resumed = train(tmp_path / f"b{odd}", master="split", odd=odd, load=tmp_path / f"ckpt{odd}")
        assert resumed["losses"] == whole["losses"][STEPS // 2 :], odd
        for mine, theirs in zip(resumed["masters"], whole["masters"], strict=True):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("device", ["nvme", "cpu"])
def test_a_weights_only_load_gives_the_checkpoints_masters(device, tmp_path):
    """A model built under zero.Init, stage 3 (its pieces on NVMe, or in memory with the optimizer in host
    memory): saved after 3 steps, trained 3 more, then loaded without optimizer states. The fp32 masters read
    back are the saved ones, bit for bit: each joined with the weight loaded beside it, not with a copy of the
    piece taken before the load's reads landed."""
    cfg = config(tmp_path, stage=3, master="split", device=device)
    with infinity.zero.Init(config=cfg):
        model = build()
    engine, *_ = infinity.initialize(model=model, config=cfg)

    def steps(count: int) -> None:
        for step in range(count):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
            engine.backward(((engine(x).float() - torch.sin(3 * x[:, :4])) ** 2).mean())
            engine.step()

    steps(3)
    saved = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    engine.save_checkpoint(tmp_path / "ckpt")
    steps(3)
    moved = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(saved, moved, strict=True))
    engine.load_checkpoint(tmp_path / "ckpt", load_optimizer_states=False)
    # the last parameters first: the load's last unit is the one a copy taken too early would still be kept of
    loaded = [safe_get_full_fp32_param(p) for p in reversed(list(engine.module.parameters()))]
    for got, want in zip(loaded, reversed(saved), strict=True):
        assert torch.equal(got, want)
    engine.destroy()


def _both_layouts(*, rank: int, world_size: int, tmp: str) -> dict:
    return {master: train(f"{tmp}/{master}-{rank}", master=master, rank=rank, world_size=world_size)
            for master in ("fp32", "split")}  # fmt: skip


def test_split_masters_at_world_size_2(tmp_path):
    """Two gloo ranks at stage 3 on NVMe, each splitting its own tiles: the losses of fp32 masters, bitwise."""
    for result in run_distributed(_both_layouts, 2, tmp_path, timeout_s=180, tmp=str(tmp_path)):
        assert_same_training(result["split"], result["fp32"])


def test_what_cannot_split_is_refused_by_name(tmp_path):
    """A split needs bf16 weights and the optimizer offloaded; other values are refused."""
    with pytest.raises(ConfigError, match='offloaded_master "split" .* needs bf16.enabled true'):
        infinity.initialize(model=build(), config=config(tmp_path, stage=2, master="split", device="cpu", bf16=False))
    in_memory = config(tmp_path, stage=2, master="split", device="cpu")
    del in_memory["zero_optimization"]["offload_optimizer"]
    in_memory["infinity"] = {"offloaded_master": "split"}
    with pytest.raises(ConfigError, match='offloaded_master "split" .*offload_optimizer.device "cpu" or "nvme"'):
        infinity.initialize(model=build(), config=in_memory)
    with pytest.raises(ConfigError, match="offloaded_master must be fp32 or split; got 'bf16'"):
        infinity.initialize(model=build(), config=config(tmp_path, stage=2, master="bf16", device="cpu"))

"""DeepSpeed's offload_states / reload_states ([Note: parking] in infinity/memory/parking.py): the states leave
memory (here to a file on the real disk: this machine has no accelerator, so its host memory is the device's),
host memory is measured before and after, the engine refuses what needs them while they are away, and once they
are back training continues bitwise as a run that never moved them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.aio.handle import AioHandle
from infinity.errors import ConfigError, StatesOffloadedError
from infinity.memory.host import process_status_bytes
from infinity.memory.parking import Parking


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(4)), nn.Linear(1024, 4))


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage}}  # fmt: skip


def train(engine, steps) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 1024, generator=gen), torch.randn(4, 4, generator=gen)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def weights(engine) -> list[torch.Tensor]:
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [2, 3])
def test_states_go_to_nvme_free_host_memory_and_come_back_bitwise(stage, tmp_path):
    moved, *_ = infinity.initialize(model=model(), config=config(stage))
    kept, *_ = infinity.initialize(model=model(), config=config(stage))
    try:
        train(moved, range(2))
        want = train(kept, range(4))
        before = process_status_bytes("VmRSS")
        moved.offload_states(device="nvme", nvme_path=tmp_path)
        after = process_status_bytes("VmRSS")
        parked = sum(p.nbytes for p in moved._parked.values())
        params = sum(p.numel() for p in kept.module.parameters())
        assert parked >= params * 4 * 3  # fp32 weights, Adam's two states (the masters are the fp32 weights)
        assert before - after >= 0.8 * parked, (before, after, parked)
        assert sorted(f.name.rsplit(".", 1)[1] for f in tmp_path.iterdir()) == ["lp_params", "optim_states"]
        with pytest.raises(StatesOffloadedError, match="forward while offload_states.*reload_states"):
            moved(torch.randn(4, 1024))
        moved.offload_states(device="nvme", nvme_path=tmp_path)  # everything is away already: nothing moves
        moved.reload_states()
        assert list(tmp_path.iterdir()) == []
        got = train(moved, range(2, 4))
        assert got == want[2:]
        assert all(torch.equal(a, b) for a, b in zip(weights(moved), weights(kept), strict=True))
    finally:
        moved.destroy()
        kept.destroy()


def test_optimizer_states_alone_leave_the_model_usable_for_generation(tmp_path):
    """An RLHF loop's shape: the optimizer's states away while the policy generates, back for training."""
    moved, *_ = infinity.initialize(model=model(), config=config(2))
    kept, *_ = infinity.initialize(model=model(), config=config(2))
    try:
        train(moved, range(2))
        train(kept, range(2))
        moved.offload_states(include=["optim_states"], device="nvme", nvme_path=tmp_path)
        with torch.no_grad():
            moved(torch.randn(4, 1024))  # the weights are here
        x = torch.randn(4, 1024)
        moved.backward(moved(x).pow(2).mean())
        with pytest.raises(StatesOffloadedError, match="step while offload_states.*optim_states"):
            moved.step()
        moved.reload_states()
        moved.step()  # the refused step, now that the states are back
        kept.backward(kept(x).pow(2).mean())
        kept.step()
        assert train(moved, range(2, 4)) == train(kept, range(2, 4))
        assert all(torch.equal(a, b) for a, b in zip(weights(moved), weights(kept), strict=True))
    finally:
        moved.destroy()
        kept.destroy()


def test_bad_requests_are_clear_errors_and_destroy_removes_parked_files(tmp_path):
    engine, *_ = infinity.initialize(model=model(), config=config(3))
    try:
        train(engine, range(1))
        with pytest.raises(ConfigError, match="unknown state \\['weights'\\]"):
            engine.offload_states(include=["weights"])
        with pytest.raises(ConfigError, match="device must be 'cpu' or 'nvme'"):
            engine.offload_states(device="disk")
        with pytest.raises(ConfigError, match="needs a folder"):
            engine.offload_states(device="nvme")
        engine.offload_states(device="cpu")  # no accelerator: everything is in host memory already
        assert all(p.nbytes == 0 for p in engine._parked.values())
        engine.reload_states()
        train(engine, range(1, 2))
        engine.offload_states(device="nvme", nvme_path=tmp_path)
        assert list(tmp_path.iterdir())
    finally:
        engine.destroy()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", [2, 3])
def test_what_would_read_parked_memory_is_a_clear_error(stage, tmp_path):
    """A view of a parked storage must not be read: the engine's entry points refuse, the model's parameters are
    empty placeholders meanwhile, stage 3's shards and the tiers refuse I/O."""
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    config_ = {**config(stage), "zero_optimization": zero}
    engine, *_ = infinity.initialize(model=model(), config=config_)
    try:
        train(engine, range(1))
        shapes = [tuple(p.shape) for p in engine.module.parameters()]
        engine.offload_states(device="nvme", nvme_path=tmp_path)
        if stage < 3:
            assert all(p.numel() == 0 for p in engine.module.parameters())
            assert all(v.numel() == 0 for k, v in engine.module.state_dict().items())
        with pytest.raises(StatesOffloadedError, match="save_16bit_model while offload_states"):
            engine.save_16bit_model(tmp_path / "weights")
        with pytest.raises(StatesOffloadedError, match="partitioned-state helper"):
            infinity.utils.safe_get_full_fp32_param(next(engine.module.parameters()))
        with pytest.raises(StatesOffloadedError, match="load_checkpoint while"):
            engine.load_checkpoint(tmp_path / "none")
        if stage == 3:
            gathering = infinity.zero.GatheredParameters(list(engine.module.parameters()))
            with pytest.raises(StatesOffloadedError, match="pieces are away"), gathering:
                pass
        engine.reload_states()
        assert [tuple(p.shape) for p in engine.module.parameters()] == shapes or stage == 3
        train(engine, range(1, 2))
    finally:
        engine.destroy()


def test_states_go_away_kind_by_kind(tmp_path):
    moved, *_ = infinity.initialize(model=model(), config=config(3))
    kept, *_ = infinity.initialize(model=model(), config=config(3))
    try:
        train(moved, range(2))
        train(kept, range(2))
        moved.offload_states(include=["optim_states"], device="nvme", nvme_path=tmp_path)
        kinds = infinity.runtime.zero.offload_config.OffloadStateTypeEnum  # DeepSpeed's enum, or its strings
        moved.offload_states(include=[kinds.optim_states, kinds.lp_params], nvme_path=tmp_path,
                             device=infinity.runtime.zero.offload_config.OffloadDeviceEnum.nvme)  # fmt: skip
        assert sorted(moved._parked) == ["lp_params", "optim_states"]
        moved.reload_states()
        assert train(moved, range(2, 4)) == train(kept, range(2, 4))
    finally:
        moved.destroy()
        kept.destroy()


def test_a_failed_park_brings_back_what_it_moved_and_a_failed_reload_can_be_retried(tmp_path, monkeypatch):
    moved, *_ = infinity.initialize(model=model(), config=config(2))
    kept, *_ = infinity.initialize(model=model(), config=config(2))
    try:
        train(moved, range(2))
        train(kept, range(2))
        writes = []
        original_write, original_read = AioHandle.sync_pwrite, AioHandle.sync_pread

        def failing_write(self, tensor, path, offset=0):
            writes.append(path)
            if len(writes) == 2:
                raise OSError(28, "No space left on device (injected)")
            return original_write(self, tensor, path, offset)

        monkeypatch.setattr(AioHandle, "sync_pwrite", failing_write)
        with pytest.raises(OSError, match="injected"):
            moved.offload_states(include=["optim_states"], device="nvme", nvme_path=tmp_path)
        assert not moved._parked and list(tmp_path.iterdir()) == []
        monkeypatch.setattr(AioHandle, "sync_pwrite", original_write)
        moved.offload_states(include=["optim_states"], device="nvme", nvme_path=tmp_path)
        reads = []

        def failing_read(self, tensor, path, offset=0):
            reads.append(path)
            if len(reads) == 1:
                raise OSError(5, "Input/output error (injected)")
            return original_read(self, tensor, path, offset)

        monkeypatch.setattr(AioHandle, "sync_pread", failing_read)
        with pytest.raises(OSError, match="injected"):
            moved.reload_states()
        assert sorted(moved._parked) == ["optim_states"] and list(tmp_path.iterdir())  # still away, file kept
        moved.reload_states()  # the retry
        assert not moved._parked and list(tmp_path.iterdir()) == []
        assert train(moved, range(2, 4)) == train(kept, range(2, 4))
    finally:
        moved.destroy()
        kept.destroy()


def test_parking_in_host_memory_keeps_every_view(tmp_path):
    """The host path (an accelerator's states to pinned host memory), run here on host tensors."""
    flat = torch.arange(1000, dtype=torch.float32)
    views = [flat[:10], flat[500:]]
    other = torch.ones(64)
    parking = Parking([flat, views[1], other], path=None, aio=None, pin_memory=True)
    assert len(parking.parked) == 2  # one per storage
    parking.park()
    assert flat.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    parking.reload()
    assert torch.equal(views[0], torch.arange(10, dtype=torch.float32)) and views[1][0].item() == 500
    assert torch.equal(other, torch.ones(64))

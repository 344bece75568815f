"""The reduced gradient lives from a window's first reduced piece to the step ([Note: gradient shards]), and in fp32
without offload the stages 0-2 masters are the weights themselves: no byte of either is held through forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import infinity
from infinity.memory import host
from infinity.zero import gradient_shards
from infinity.zero.gradient_shards import GradientShards, keep_across_steps


def test_first_piece_copies_later_ones_add_and_missing_regions_read_as_zeros():
    shards = GradientShards([[(0, 4), (4, 4)]], [8], torch.device("cpu"))
    assert shards.held_bytes() == 0
    shards.write(0, 0, torch.full((4,), 2.0))
    shards.write(0, 0, torch.full((4,), 3.0))
    (flat,) = shards.tensors()
    assert flat.tolist() == [5.0] * 4 + [0.0] * 4  # the second region got nothing: zeros, not leftovers
    assert shards.held_bytes() == 32
    shards.free()
    assert shards.held_bytes() == 0
    shards.write(0, 4, torch.ones(4))  # a new window starts from nothing again
    assert shards.tensors()[0].tolist() == [0.0] * 4 + [1.0] * 4


def test_a_kept_gradient_reads_nothing_of_the_last_window(monkeypatch):
    """[Note: gradient kept across steps]: kept (under KEEP), the tensor stays allocated after free(), and the next
    window's first piece of a region is copied over the old values, and a region that gets none reads zeros."""
    monkeypatch.setattr(host, "keeps_freed_blocks", lambda: True)
    shards = GradientShards([[(0, 4), (4, 4)]], [8], torch.device("cpu"))
    shards.kept_across_steps = True
    shards.write(0, 0, torch.full((4,), 2.0))
    shards.write(0, 4, torch.full((4,), 7.0))
    (flat,) = shards.tensors()
    shards.free()
    assert shards.held_bytes() == 32
    shards.write(0, 0, torch.full((4,), 3.0))
    shards.write(0, 0, torch.full((4,), 1.0))
    (again,) = shards.tensors()
    assert again.data_ptr() == flat.data_ptr()  # the same memory, reused
    assert again.tolist() == [4.0] * 4 + [0.0] * 4
    shards.release()  # within a window: stays
    assert shards.held_bytes() == 32
    shards.free()
    shards.release()  # between windows (empty_partition_cache, offload_states): given back
    assert shards.held_bytes() == 0
    shards.tensors()
    monkeypatch.setattr(host, "keeps_freed_blocks", lambda: False)
    shards.free()  # the heap policy left KEEP (the host ran short): freed after all
    assert shards.held_bytes() == 0


def test_the_gradient_is_kept_only_when_large_and_larger_than_the_first_forwards_heap():
    minimum = gradient_shards.KEPT_GRADIENT_MIN_BYTES
    assert keep_across_steps(minimum, minimum - 1)
    assert not keep_across_steps(minimum, minimum)  # the activations would take its blocks
    assert not keep_across_steps(minimum - 1, 0)  # too small to matter


def _train(model: nn.Module, batch: int, stage: int, steps: int = 3) -> tuple[list[float], list[torch.Tensor], bool]:
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
        "infinity": {"step_in_backward": False},  # stage 3 would step in backward and hold no gradient at all
    }
    engine, *_ = infinity.initialize(model=model, config=config)
    assert host.keeps_freed_blocks()  # training in memory: KEEP (a run the user's glibc settings govern: not here)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(batch, model[0].in_features, generator=gen)
        loss = engine(inputs).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    shards = engine.zero_optimizer.gradients_in_memory
    kept = shards.kept_across_steps and shards.held_bytes() == shards.nbytes  # still allocated after the step
    params = [p.detach().clone() for p in engine.module_state_dict().values()]
    engine.empty_partition_cache()  # between windows: a kept gradient is given back
    kept = kept and shards.held_bytes() == 0
    engine.destroy()
    return losses, params, kept


@pytest.mark.parametrize("stage", [2, 3])
def test_a_gradient_larger_than_the_first_forwards_heap_is_kept_and_changes_nothing(stage, monkeypatch):
    """[Note: gradient kept across steps], with the size threshold lowered to these models': wide layers and a
    batch of 2 (a 2 MiB gradient, a few KiB of activations) keep their gradient between steps; narrower ones and
    a batch of 8192 (0.5 MiB of gradient, 8 MiB activations) free it. Kept or not, the losses and weights are
    bitwise the same; empty_partition_cache gives a kept one back."""

    def wide() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))

    def narrower() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))

    monkeypatch.setattr(gradient_shards, "KEPT_GRADIENT_MIN_BYTES", 256 << 10)
    kept_losses, kept_params, kept = _train(wide(), 2, stage)
    _, _, narrow_kept = _train(narrower(), 8192, stage)  # 0.5 MiB of gradient, 8 MiB per activation
    monkeypatch.setattr(gradient_shards, "KEPT_GRADIENT_MIN_BYTES", 1 << 40)
    freed_losses, freed_params, freed_kept = _train(wide(), 2, stage)
    assert kept and not narrow_kept and not freed_kept
    assert kept_losses == freed_losses
    assert all(torch.equal(a, b) for a, b in zip(kept_params, freed_params, strict=True))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


@pytest.mark.parametrize(("stage", "holes_reused"), [(0, True), (1, True), (2, True), (3, True), (3, False)])
def test_no_gradient_memory_between_the_step_and_the_next_backward(stage, holes_reused, monkeypatch):
    """``holes_reused``: whether the heap takes a freed block back into its hole (torch_cpu_allocator.py); where it
    does not, stage 3 keeps its bucket buffers for the next backward."""
    monkeypatch.setattr(host, "freed_blocks_reused", lambda: holes_reused)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500},
    }
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    optimizer = engine.zero_optimizer
    numel = sum(p.numel() for p in mlp().parameters())
    held, spares_in_the_window = [], []
    for _micro in range(4):
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        held.append(optimizer.gradients_in_memory.held_bytes())
        engine.step()
        held.append(optimizer.gradients_in_memory.held_bytes())
        spares_in_the_window.append(bool(optimizer.reducer._spare))
    # stages 2 and 3 reduce every micro-step into the gradient; stages 0 and 1 at the boundary only
    during = 4 * numel if stage >= 2 else 0
    assert held[0] >= during and held[1] >= during  # the first micro-step: held through the window
    assert held[2] >= 4 * numel and held[3] == 0  # the boundary: reduced, then freed by the step
    reducer = optimizer.reducer
    if stage < 3:
        assert not reducer._spare  # stage 2's spare reduce buffers went with it
    elif holes_reused:  # the heap takes them back into their holes: the forward has their blocks
        assert not reducer._spare and spares_in_the_window[0]  # kept within the window, given back after it
    else:  # stage 3 keeps its bucket buffers for the next backward, within what the estimate counts for them
        kept = sum(b.numel() * 4 for buffers in reducer._spare.values() for b in buffers)
        assert 0 < kept <= reducer.spare_budget_bytes, (kept, reducer.spare_budget_bytes)
    if stage < 3:  # fp32 without offload: the masters are pieces of the weights, no fp32 copy
        assert optimizer.masters_are_weights and optimizer.state_bytes() == 2 * 4 * sum(
            m.numel() for m in optimizer.masters
        )
        weights = {w.untyped_storage().data_ptr() for group in optimizer.weights for w in group}
        assert {m.untyped_storage().data_ptr() for m in optimizer.masters} <= weights
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_with_the_optimizer_offloaded_the_gradient_is_in_host_memory(tmp_path, stage, device):
    """[Note: gradient shards]: the optimizer steps in host memory (or from NVMe through it), so the reduced
    gradient is held there, pinned where asked (on a GPU: streamed in as it is reduced, never whole on the device;
    tests/gpu checks the device's peak). Stage 3 with the optimizer on NVMe too, unless it is larger than a quarter
    of the rank's host share: then it goes to NVMe instead. The engine asks for that home, and the estimate says the
    same (here as on a CUDA machine)."""
    from infinity.budget import Architecture, Owner, RunShape, Where, estimate
    from infinity.config import parse_config

    offload = {"device": device, "pin_memory": True, "nvme_path": str(tmp_path)} if device != "none" else {}
    config = parse_config({"train_micro_batch_size_per_gpu": 1,
                           "zero_optimization": {"stage": stage, "offload_optimizer": offload}})  # fmt: skip
    owners = [Owner(path="layer", numels=(1 << 20,), trainable=(True,))]
    shape = RunShape(world_size=2, micro_batch=1, seq_len=8, dtype_bytes=2, host_available=1 << 34)
    rows = [r for r in estimate(owners, Architecture(), config, shape, cuda=True).rows if "reduced fp32" in r.what]
    want = {"none": Where.DEVICE, "cpu": Where.HOST_PINNED, "nvme": Where.HOST_PINNED}[device]
    assert [r.where for r in rows] == [want]
    if stage == 3 and device == "nvme":  # a share whose quarter is below the rank's 2 MiB of gradient
        small = dataclasses.replace(shape, host_available=1 << 22)
        rows = [r for r in estimate(owners, Architecture(), config, small, cuda=True).rows if "reduced fp32" in r.what]
        assert [r.where for r in rows] == [Where.NVME]  # [Note: swapped gradients] in grads.py
    if want is not Where.NVME:  # what the engine's optimizers make, for a CUDA compute device
        from infinity.memory.tiers import Tier, TierManager
        from infinity.zero.optimizer import Offload, gradient_shards_for

        home = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}[device]
        spec = None if device == "none" else Offload(TierManager(), home, 1 << 20, True, True)
        shards = gradient_shards_for((), torch.device("cuda"), spec)
        assert shards.home == ("device" if want is Where.DEVICE else "host")

"""Each ZeRO-3 knob does what DeepSpeed documents, alone, in a real engine (one process): its effect shows in
zero_stats(). A prefetch budget of 0 stops the all-gathers ahead of use and nothing else: the trace is still
followed for stage3_max_reuse_distance (and so stage3_max_live_parameters, which caps what reuse keeps) and for
reading NVMe pieces ahead.

The model: nine Linear units (33, then eight of 32 x 32 + 32 elements) run in registration order; the trace of
a pass is forward L0..L8, backward L8..L0. Stats are the second step's (the first records the trace)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from infinity.memory import host

UNIT = 32 * 32 + 32
BIG = 10**9


def deep_mlp() -> nn.Module:
    torch.manual_seed(7)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 1))


def second_step_stats(steps: int = 2, **zero) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    engine, *_ = infinity.initialize(model=deep_mlp(), config=config)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 32, generator=gen)).pow(2).mean())
        engine.step()
    stats = engine.zero_stats()
    engine.destroy()
    return stats


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread: tiny models run ~50x slower with 2 contended threads."""


def test_prefetch_bucket_size_zero_stops_prefetch_but_not_reuse():
    """Default budgets: every backward use finds its unit kept from the forward or prefetched. With a prefetch
    budget of 0: no prefetch, yet the units are still kept between forward and backward (max_reuse_distance
    default 1e9), so the backward fetches nothing."""
    default = second_step_stats()
    assert default["prefetches"] > 0 and default["prefetched_fraction"] > 0.9, default
    off = second_step_stats(stage3_prefetch_bucket_size=0)
    assert off["prefetches"] == 0, off
    assert off["fetches"] == 18 and off["on_demand"] == 9 and off["already_gathered"] == 9, off


def test_max_reuse_distance_decides_what_stays_gathered_without_prefetch():
    """max_reuse_distance 0 keeps only the last layer (its backward follows its forward at once); 2 x 33 keeps
    the one before it too (L8's forward and backward lie between its uses); 1e9 keeps every unit."""
    kept = {}
    for reuse in (0, 2 * 33, BIG):
        stats = second_step_stats(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=reuse)
        kept[reuse] = stats["already_gathered"]
        assert stats["fetches"] == 18 and stats["on_demand"] == 18 - kept[reuse], stats
    assert kept == {0: 1, 2 * 33: 2, BIG: 9}, kept


def test_max_live_parameters_caps_what_reuse_keeps_without_prefetch():
    """Without a cap every unit stays gathered from its forward to its backward (the whole model live); with
    stage3_max_live_parameters 3 units, the peak stays within it plus the unit being fetched."""
    whole = second_step_stats(stage3_prefetch_bucket_size=0)
    assert whole["peak_live_numel"] == 8 * UNIT + 33, whole
    capped = second_step_stats(stage3_prefetch_bucket_size=0, stage3_max_live_parameters=3 * UNIT)
    assert capped["peak_live_numel"] <= 4 * UNIT, capped
    assert capped["already_gathered"] < whole["already_gathered"], (capped, whole)


def test_nvme_pieces_are_read_ahead_without_prefetch(tmp_path):
    """Every piece on NVMe (max_in_cpu 0): with a prefetch budget of 0 the next pieces along the trace are still
    read ahead into the staging ring, so gathers do not wait for the disk."""
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    stats = second_step_stats(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0, offload_param=offload)
    assert stats["prefetches"] == 0, stats
    assert stats["read_ahead"] >= 8, stats  # every unit's piece after the first, at least once per pass


class CountsItsParameters(nn.Module):
    """A forward that asks its parameters' sizes (as logging code does) and reads a child's weight directly."""

    def __init__(self) -> None:
        super().__init__()
        self.body = deep_mlp()
        self.counted: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counted.append(sum(p.numel() for p in self.parameters()))
        for p in self.parameters():  # more questions DeepSpeed's released parameters answer without a gather
            len(p) if p.dim() else None, p.data_ptr(), p.type(), p.is_pinned(), p.storage_offset()
            p.untyped_storage(), p.requires_grad_(p.requires_grad)
        scale = self.body[0].weight.T.mean()  # a real use (through .T) of a unit the root does not own
        return self.body(x) * scale


def test_a_forward_asking_sizes_gathers_nothing_and_uses_stay_within_max_live():
    """numel() of a released parameter is 0, as DeepSpeed's (ds_numel holds the whole count; a gathered one
    counts in full), and gathers nothing: counting parameters inside forward used to fetch every unit into the
    root module, the whole model live at once past stage3_max_live_parameters. A real use of another module's
    weight is fetched within the cap."""
    torch.manual_seed(7)
    model = CountsItsParameters()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                              "stage3_max_live_parameters": 3 * UNIT},
    }  # fmt: skip
    engine, *_ = infinity.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 32, generator=gen)).pow(2).mean())
            engine.step()
        stats = engine.zero_stats()
    finally:
        engine.destroy()
    # the second step: the root now fetches the unit it reads (body[0]'s) before it runs, so that one counts
    assert model.counted == [0, 32 * 32 + 32], model.counted
    assert stats["peak_live_numel"] <= 4 * UNIT, stats


@pytest.mark.parametrize("zero", [{"stage3_max_reuse_distance": 0}, {"stage3_max_live_parameters": 2 * UNIT,
                                                                     "stage3_prefetch_bucket_size": 0}])
def test_regathered_units_reuse_their_host_buffers(zero):
    """Units released and gathered again take buffers the pool kept (memory/pool.py): once the trace is
    followed (the second step, which prefetches: more units live at once than the first) a step allocates none,
    whatever the knobs release."""
    stats = second_step_stats(steps=3, **zero)
    assert stats["fetches"] == 18 and stats["already_gathered"] < 9, stats  # units were released and regathered
    assert stats["gather_buffers_made"] == 0, stats


@pytest.mark.parametrize("holes_reused", [False, True])
def test_gradient_buckets_and_outsized_nvme_pieces_reuse_their_buffers(tmp_path, monkeypatch, holes_reused):
    """The host buffers of NVMe pieces too large for the staging ring (buffer_size 512 elements: every unit) are
    kept for the next step: from the third step on none is allocated. So are stage 3's gradient buckets (and
    their pieces) where a freed block would not go back into its hole; where it would (``holes_reused``:
    reducer.drop_spares), they go back after each step and the next backward makes them again."""
    monkeypatch.setattr(host, "freed_blocks_reused", lambda: holes_reused)
    offload = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "buffer_size": 512}
    stats = second_step_stats(steps=3, offload_param=offload)
    assert (stats["grad_buffers_made"] > 0) == holes_reused and stats["outsized_buffers_made"] == 0, stats
    first = second_step_stats(steps=1, offload_param=offload)
    assert first["grad_buffers_made"] > 0 and first["outsized_buffers_made"] > 0, first


@pytest.mark.parametrize("holes_reused", [False, True])
def test_a_step_behind_the_forward_gives_back_the_reductions_spares_at_once(tmp_path, monkeypatch, holes_reused):
    """With the optimizer on NVMe the step runs behind the next forward, which keeps the reduced gradient until
    its last unit has stepped; the reduction's spare buffers are not the step's, so where a freed block goes back
    into its hole they go in engine.step(), before that forward's activations could use their blocks (kept to
    its last unit, ~0.7 GiB of them put the forward's in-use heap at 2.28 GiB against 1.85 without the step behind
    it: GPT-2 small, everything on NVMe, world size 2). Where it
    would not, they stay for the next backward, as without NVMe."""
    monkeypatch.setattr(host, "freed_blocks_reused", lambda: holes_reused)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
    }  # fmt: skip
    engine, *_ = infinity.initialize(model=deep_mlp(), config=config)
    gen = torch.Generator().manual_seed(0)
    optimizer = engine.zero_optimizer
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 32, generator=gen)).pow(2).mean())
            assert optimizer.reducer.spare_bytes > 0  # the buffers backward reduced in, kept for its next bucket
            engine.step()
            assert optimizer.step_pending and optimizer.gradients_in_memory.held_bytes() > 0  # the step's gradient
            assert (optimizer.reducer.spare_bytes > 0) == (not holes_reused), optimizer.reducer.spare_bytes
        engine(torch.randn(4, 32, generator=gen))  # the forward steps every unit: the gradient goes
        assert not optimizer.step_pending and optimizer.gradients_in_memory.held_bytes() == 0
    finally:
        engine.destroy()


def test_a_pass_leaves_none_of_its_hooks_on_the_activations():
    """[Note: multi-grad hooks] in stage3.py: the hooks the engine puts on a module's inputs in forward (to know
    when the module's backward is done) are gone once the pass has ended, after backward and after a forward with
    gradients whose backward never came; left there, each step's kept its autograd nodes alive and fragmented
    the heap."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    model = deep_mlp()
    engine, *_ = infinity.initialize(model=model, config=config)
    seen: list[torch.Tensor] = []
    watch = model[2].register_forward_pre_hook(lambda module, args: seen.append(args[0]))  # after the engine's
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 32)).pow(2).mean())
            engine.step()
        engine(torch.randn(4, 32))  # no backward: the next forward ends this pass
        engine.backward(engine(torch.randn(4, 32)).pow(2).mean())
        engine.step()
    finally:
        watch.remove()
        engine.destroy()
    assert len(seen) == 4 and all(tensor.requires_grad for tensor in seen)
    assert all(not tensor._backward_hooks for tensor in seen), [len(t._backward_hooks or ()) for t in seen]

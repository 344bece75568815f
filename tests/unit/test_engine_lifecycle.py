"""An engine's life in one process: what it logs at start, and that destroy() and `del` give everything back."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import weakref

import psutil
import pytest
import torch
from torch import nn

import infinity

MiB = 1 << 20


def config(stage: int, **zero) -> dict:
    return {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, **zero},
    }


def wide_mlp(width: int = 1024, layers: int = 8) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def a_master(engine) -> torch.Tensor:
    """One of the optimizer's fp32 masters (stage 3: a tile's segment, which holds it)."""
    optimizer = engine.zero_optimizer
    if optimizer.masters:
        return optimizer.masters[0]
    return optimizer.tiled.manager.acquire(optimizer.tiled.tiles[0].name).tensor


def train_and_destroy(model: nn.Module, cfg: dict, steps: int = 2):
    engine, *_ = infinity.initialize(model=model, config=cfg)
    width = model[0].in_features
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, width)).pow(2).mean())
        engine.step()
    flat = engine.stage3.table.shards.flat if engine.stage3 is not None else engine.zero_optimizer.masters[0]
    watched = [weakref.ref(flat), weakref.ref(a_master(engine)), weakref.ref(engine)]
    engine.destroy()
    return watched


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_dropped_engine_frees_its_model_and_shards(stage):
    model = wide_mlp(64, 3)
    watched = train_and_destroy(model, config(stage, stage3_param_persistence_threshold=0))
    watched.append(weakref.ref(model[0].weight))
    del model
    collect()
    alive = [ref() for ref in watched if ref() is not None]
    assert not alive, [type(obj).__name__ for obj in alive]


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_dropped_without_destroy_lets_go_of_the_model(stage):
    """The user keeps the model and drops the engine (no destroy()): the engine's hooks go with it, its training
    state is freed, and (below stage 3, where the model holds its weights) the model trains again."""
    model = wide_mlp(64, 3)
    engine = infinity.initialize(model=model, config=config(stage, stage3_param_persistence_threshold=0))[0]
    engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
    engine.step()
    watched = [weakref.ref(engine), weakref.ref(a_master(engine))]
    del engine
    collect()
    assert all(ref() is None for ref in watched)
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    if stage == 3:
        return  # the weights lived in the dropped engine's shards, as with DeepSpeed: nothing to train again
    engine, *_ = infinity.initialize(model=model, config=config(stage, stage3_param_persistence_threshold=0))
    engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
    engine.step()
    engine.destroy()


def collect() -> None:
    """Twice: the first collection finds the dropped engine and runs its finalizer, which lets go of the hooks'
    owners; those cycles are found by the second."""
    gc.collect()
    gc.collect()


def rss_held() -> int:
    """RSS once the C allocator has given back what it only caches (glibc keeps freed heap pages; that is not
    memory anyone holds)."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("stage", [2, 3])
def test_three_engines_in_a_row_give_their_memory_back(stage):
    """Each engine holds ~130 MiB (a 32 MiB model: bf16 weights, fp32 masters, Adam's two states, gradients).
    After building, training and dropping three in a row, RSS is back near where it was after the first."""
    cfg = {**config(stage, stage3_param_persistence_threshold=0), "bf16": {"enabled": True}}

    def one_engine() -> None:
        train_and_destroy(wide_mlp(), cfg)
        collect()

    for _ in range(2):  # the first ones pay for libraries, thread pools and the allocator's own tables
        one_engine()
    baseline = rss_held()
    for _ in range(3):
        one_engine()
    grown = rss_held() - baseline
    assert grown <= 24 * MiB, f"RSS grew by {grown / MiB:.0f} MiB over three engines"


def test_stage3_that_partitions_nothing_says_so_once(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))  # every parameter under 100000 elements
    with caplog.at_level(logging.WARNING, logger="infinity"):
        engine, *_ = infinity.initialize(model=model, config=config(3))
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
    lines = [r.getMessage() for r in caplog.records if "partitions nothing" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "stage3_param_persistence_threshold=100000" in lines[0] and "Lower" in lines[0]
    engine.destroy()


def test_stage3_that_partitions_something_says_nothing(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    with caplog.at_level(logging.WARNING, logger="infinity"):
        engine, *_ = infinity.initialize(model=model, config=config(3, stage3_param_persistence_threshold=16))
    assert not [r for r in caplog.records if "partitions nothing" in r.getMessage()]
    engine.destroy()

"""DeepSpeed's engine methods that change training state (engine_controls.py) and register_external_parameter,
each against the run that does the same thing without them, or against plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
import infinity.zero


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _config(stage: int, accumulation: int = 1, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}  # fmt: skip


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)


def _backward(engine, seed: int) -> None:
    x, y = _batch(seed)
    engine.backward((engine(x) - y).pow(2).mean())


def _params(engine) -> list[torch.Tensor]:
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_grad_after_each_micro_step_keeps_the_window_as_deepspeed_does(stage):
    """DeepSpeed's engine.zero_grad() clears the model's .grad fields, not ZeRO's accumulated gradient: a loop
    that calls it after every micro-step still steps on the whole window."""
    cleared, *_ = infinity.initialize(model=_model(), config=_config(stage, accumulation=2))
    plain, *_ = infinity.initialize(model=_model(), config=_config(stage, accumulation=2))
    try:
        for step in range(6):
            _backward(cleared, step)
            cleared.step()
            cleared.zero_grad()
            assert all(p.grad is None for p in cleared.module.parameters())
            _backward(plain, step)
            plain.step()
        assert all(torch.equal(a, b) for a, b in zip(_params(cleared), _params(plain), strict=True))
        assert cleared.global_steps == 3
    finally:
        cleared.destroy()
        plain.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_set_train_batch_size_changes_the_accumulation_and_matches_plain_pytorch(stage, tmp_path):
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's AdamW default
    engine, *_ = infinity.initialize(model=model, config=_config(stage))
    try:
        _backward(engine, 0)
        engine.step()
        x, y = _batch(0)
        (reference(x) - y).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _backward(engine, 1)
        with pytest.raises(ValueError, match="middle of gradient accumulation"):
            engine.set_train_batch_size(8)
        engine.step()
        with pytest.raises(ValueError, match="positive multiple of train_micro_batch_size_per_gpu x world size"):
            engine.set_train_batch_size(6)
        x, y = _batch(1)
        (reference(x) - y).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.set_train_batch_size(8)
        assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (8, 2)
        for step in (2, 4):  # windows of two micro-batches: the gradient of 8 samples
            for seed in (step, step + 1):
                _backward(engine, seed)
                engine.step()
            xs, ys = zip(_batch(step), _batch(step + 1), strict=True)
            reference_loss = (reference(torch.cat(xs)) - torch.cat(ys)).pow(2).mean()
            reference_loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert engine.global_steps == 4
        got = _params(engine)
        for mine, want in zip(got, reference.parameters(), strict=True):
            torch.testing.assert_close(mine, want.detach(), rtol=1e-5, atol=1e-6)
        engine.save_checkpoint(tmp_path)  # the count sits on a window boundary
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_boundary_set_by_hand_equals_the_counted_windows(stage, tmp_path):
    manual, *_ = infinity.initialize(model=_model(), config=_config(stage, accumulation=2))
    counted, *_ = infinity.initialize(model=_model(), config=_config(stage, accumulation=2))
    try:
        for window in range(3):
            for k in range(2):  # DeepSpeed's style: passes, then one step()
                manual.set_gradient_accumulation_boundary(k == 1)
                _backward(manual, 2 * window + k)
            manual.step()
            assert manual.was_step_applied()
            for k in range(2):
                _backward(counted, 2 * window + k)
                counted.step()
        assert manual.global_steps == counted.global_steps == 3
        assert all(torch.equal(a, b) for a, b in zip(_params(manual), _params(counted), strict=True))
        manual.save_checkpoint(tmp_path)
        with pytest.raises(ValueError, match="True or False"):
            manual.set_gradient_accumulation_boundary(1)
    finally:
        manual.destroy()
        counted.destroy()


def test_empty_partition_cache_gives_back_the_gathered_memory_and_changes_nothing():
    emptied, *_ = infinity.initialize(model=_model(), config=_config(3))
    plain, *_ = infinity.initialize(model=_model(), config=_config(3))
    try:
        for step in range(3):
            for engine in (emptied, plain):
                _backward(engine, step)
                engine.step()
            with torch.no_grad():
                emptied(_batch(50)[0])
            assert emptied.stage3.table.pool.kept_bytes > 0  # kept for the next gathers
            emptied.empty_partition_cache()
            assert emptied.stage3.table.pool.kept_bytes == 0
            assert all(u.state.value == "released" for u in emptied.stage3.table.units)
        assert all(torch.equal(a, b) for a, b in zip(_params(emptied), _params(plain), strict=True))
    finally:
        emptied.destroy()
        plain.destroy()


class TiedHead(nn.Module):
    """Reads the embedding's weight, a parameter of another module, without calling that module."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(embedding.embedding_dim))
        self.source = [embedding]  # not a child: its weight is external to this module

    def forward(self, x):
        return F.linear(x * self.scale, self.source[0].weight)


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 16)
        self.body = nn.Linear(16, 16)
        self.head = TiedHead(self.embed)

    def forward(self, tokens):
        return self.head(torch.tanh(self.body(self.embed(tokens))))


@pytest.mark.parametrize("register", ["before initialize", "after initialize", False])
def test_register_external_parameter_fetches_the_unit_with_the_module(register, monkeypatch):
    """Declared in the model's construction (DeepSpeed's documented place) or on the engine's model: fetched
    with the module from the first pass; undeclared: found on the fly."""
    model = TiedModel()
    if register == "before initialize":
        infinity.zero.register_external_parameter(model.head, model.embed.weight)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's AdamW default
    engine, *_ = infinity.initialize(model=model, config=_config(3))
    found_on_the_fly = []
    coordinator = engine.stage3.coordinator
    original = coordinator.on_external_use
    monkeypatch.setattr(coordinator, "on_external_use", lambda unit: (found_on_the_fly.append(unit), original(unit)))
    try:
        if register == "after initialize":
            infinity.zero.register_external_parameter(engine.module.head, engine.module.embed.weight)
        for step in range(3):
            tokens = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(engine(tokens).reshape(-1, 20), tokens.reshape(-1))
            engine.backward(loss)
            engine.step()
            F.cross_entropy(reference(tokens).reshape(-1, 20), tokens.reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert (found_on_the_fly == []) == bool(register)  # declared: fetched with the head from the first pass
        for mine, want in zip(_params(engine), reference.parameters(), strict=True):
            torch.testing.assert_close(mine, want.detach(), rtol=1e-5, atol=1e-6)
        infinity.zero.unregister_external_parameter(engine.module.head, engine.module.embed.weight)
        head = engine.stage3.table.modules.index(engine.module.head)
        embed_unit = engine.stage3.table.unit_of(engine.module.embed.weight)[0].index
        assert embed_unit not in engine.stage3.table.module_units[head]
    finally:
        engine.destroy()
    with pytest.raises(TypeError, match="parameter must be a torch.nn.Parameter"):
        infinity.zero.register_external_parameter(model.head, torch.zeros(3))

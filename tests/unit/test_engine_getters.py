"""DeepSpeed's training-state getters on the engine: get_global_grad_norm, get_mom, global_samples,
was_step_applied, checked against a plain PyTorch run and DeepSpeed's documented meaning."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import infinity


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _config(stage: int, optimizer: dict, accumulation: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
            "optimizer": optimizer, "zero_optimization": {"stage": stage}}  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
def test_global_grad_norm_is_plain_pytorchs_norm_before_the_step(stage):
    model = _model()
    reference = copy.deepcopy(model)
    engine, *_ = infinity.initialize(model=model, config=_config(stage, {"type": "SGD", "params": {"lr": 0.1}}))
    try:
        assert engine.get_global_grad_norm() is None  # no step yet
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
        (reference(x) - y).pow(2).mean().backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
        assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-5)
    finally:
        engine.destroy()


def test_get_mom_gives_betas_for_adam_and_momentum_for_sgd():
    adam, *_ = infinity.initialize(model=_model(), config=_config(2, {"type": "AdamW", "params": {
        "lr": 1e-3, "betas": [0.8, 0.95]}}))  # fmt: skip
    sgd, *_ = infinity.initialize(model=_model(), config=_config(2, {"type": "SGD", "params": {
        "lr": 0.1, "momentum": 0.9}}))  # fmt: skip
    try:
        assert [tuple(b) for b in adam.get_mom()] == [(0.8, 0.95)] * len(adam.get_mom())
        assert sgd.get_mom() == [0.9] * len(sgd.get_mom())
    finally:
        adam.destroy()
        sgd.destroy()


def test_was_step_applied_and_global_samples_follow_the_accumulation_window(tmp_path):
    engine, *_ = infinity.initialize(model=_model(), config=_config(2, {"type": "SGD", "params": {"lr": 0.1}}, 2))
    try:
        assert not engine.was_step_applied() and engine.global_samples == 0
        applied = []
        for _ in range(4):  # two windows of two micro-steps
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
            applied.append(engine.was_step_applied())
        assert applied == [False, True, False, True]
        assert engine.global_samples == 2 * engine.train_batch_size() == 16
        engine.save_checkpoint(tmp_path, tag="t")
        engine.global_samples = 0
        engine.load_checkpoint(tmp_path, tag="t")
        assert engine.global_samples == 16
    finally:
        engine.destroy()

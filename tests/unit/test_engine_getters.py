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


def test_config_getters_answer_from_the_config(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
              "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True,
                                    "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
    engine, *_ = infinity.initialize(model=_model(), config=config)
    try:
        assert (engine.bfloat16_enabled(), engine.fp16_enabled(), engine.dynamic_loss_scale()) == (True, False, False)
        assert engine.gradient_clipping() == 0.5 and engine.get_batch_info() == (8, 4, 2)
        assert engine.zero_optimization_partition_weights() and engine.zero_optimization_partition_gradients()
        assert engine.zero_cpu_offload() and engine.zero_offload_param() is None and engine.zero_overlap_comm()
        assert engine.optimizer_name() == "adamw" and engine.optimizer_params() == {"lr": 1e-3}
        state = engine.module_state_dict()  # stage 3: gathered, whole
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            for name, param in engine.module.named_parameters():
                assert torch.equal(state[name], param.detach())
        engine.set_train_micro_batch_size(2)
        assert engine.get_batch_info() == (4, 2, 2)
        with pytest.raises(AttributeError, match="engine.curriculum_learning_enabled is not in infinity: .*own loader"):
            engine.curriculum_learning_enabled()
        with pytest.raises(AttributeError, match="no attribute 'made_up'"):
            engine.made_up  # noqa: B018
    finally:
        engine.destroy()


def test_every_deepspeed_engine_name_is_here_or_refused_with_a_reason():
    """Against DeepSpeed's own engine class (the test extra installs DeepSpeed; read in a child process, so its
    import touches nothing here): each public name is an attribute of infinity's engine, or an AttributeError that
    says why (engine_getters.NOT_HERE)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (the test extra installs it)")
    code = ("from deepspeed.runtime.engine import DeepSpeedEngine as E\n"
            "print(' '.join(n for n in vars(E) if n[0] != '_'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    from infinity.engine import Engine
    from infinity.engine_getters import NOT_HERE

    names = done.stdout.split()
    assert len(names) > 150
    assert [n for n in names if not hasattr(Engine, n) and n not in NOT_HERE] == []

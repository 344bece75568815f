"""The engine's DeepSpeed-style API in a single process (no launcher)."""

import pytest
import torch

import infinity
from infinity import ConfigError
from infinity.config import parse_config
from infinity.engine import build_optimizer


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def base(**extra):
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, **extra}


def test_deepspeed_adam_decouples_weight_decay_unless_told_not_to():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    adam = parse_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert type(build_optimizer(adam, groups, on_cpu=True)) is torch.optim.AdamW
    classic = parse_config({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert type(build_optimizer(classic, [{"params": [torch.nn.Parameter(torch.zeros(2))]}], on_cpu=True)) is (
        torch.optim.Adam
    )


def test_returns_the_deepspeed_tuple_and_counts_steps():
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    engine, optimizer, loader, scheduler = infinity.initialize(
        model=mlp(), config=base(gradient_accumulation_steps=2, zero_optimization={"stage": 2}), training_data=dataset
    )
    assert loader.batch_size == 4 and scheduler is None and optimizer is engine.optimizer
    boundaries = []
    for inputs, target in loader:
        loss = torch.nn.functional.mse_loss(engine(inputs), target)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(loss)
        engine.step()
    assert boundaries == [False, True] * 4
    assert engine.global_steps == 4 and engine.micro_steps == 8
    assert engine.train_batch_size() == 8 and engine.zero_optimization_stage() == 2
    engine.eval()
    assert not engine.module.training


def test_config_scheduler_drives_get_lr():
    config = base(
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.4, "warmup_num_steps": 4, "warmup_type": "linear"},
        }
    )
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    seen = []
    for _ in range(5):
        seen.append(engine.get_lr()[0])
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    assert seen == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_user_optimizer_and_its_scheduler_keep_working():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, returned, _, returned_scheduler = infinity.initialize(
        model=model,
        config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}},
        optimizer=optimizer,
        lr_scheduler=scheduler,
    )
    assert returned_scheduler is scheduler
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    assert engine.get_lr() == [0.125]
    assert optimizer.param_groups[0]["params"][0] is engine.zero_optimizer.masters[0]


def test_unknown_initialize_argument_and_missing_optimizer():
    with pytest.raises(ConfigError, match="does not take mpu_thing"):
        infinity.initialize(model=mlp(), config=base(), mpu_thing=1)
    with pytest.raises(ConfigError, match="no optimizer"):
        infinity.initialize(model=mlp(), config={"train_micro_batch_size_per_gpu": 4})


def test_not_yet_implemented_modes_are_refused_clearly():
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "."}}
    with pytest.raises(ConfigError, match="offload_param.device 'nvme' is not implemented"):
        infinity.initialize(model=mlp(), config=base(zero_optimization=zero))
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "."}}
    with pytest.raises(ConfigError, match="offload_optimizer.device nvme is not implemented"):
        infinity.initialize(model=mlp(), config=base(zero_optimization=zero))


def test_wall_clock_breakdown_is_reported(caplog):
    config = base(steps_per_print=2, wall_clock_breakdown=True)
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    with caplog.at_level("INFO", logger="infinity"):
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
    assert any("forward" in r.message and "optimizer step" in r.message for r in caplog.records)

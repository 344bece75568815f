"""Defaults the engine takes from DeepSpeed: the config optimizers' hyperparameters, the wall-clock breakdown, the
training data loader's sampling, and the config file errors."""

import json
import logging
import os
import re

import pytest
import torch

import infinity
from infinity import ConfigError
from infinity.config import load_json


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def engine_with(optimizer: dict, **extra):
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": optimizer, **extra}
    engine, *_ = infinity.initialize(model=mlp(), config=config)
    return engine


# ---- A. the optimizer section's defaults are DeepSpeed's ----

# FusedAdam and DeepSpeedCPUAdam (deepspeed/ops/adam/fused_adam.py, cpu_adam.py): what DeepSpeed builds for
# "Adam" and "AdamW" unless torch_adam is true.
DEEPSPEED_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}
# DeepSpeed builds "SGD" as torch.optim.SGD(**params): torch's defaults.
TORCH_SGD = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}


@pytest.mark.parametrize(
    "optimizer",
    [
        {"type": "AdamW"},
        {"type": "Adam"},
        {"type": "adamw", "params": {}},
        {"type": "Adam", "params": {"adam_w_mode": False}},
        {"type": "AdamW", "params": {"bias_correction": True}},
    ],
)
@pytest.mark.parametrize("key", sorted(DEEPSPEED_ADAM))
def test_adam_keys_a_config_omits_get_deepspeeds_defaults(optimizer, key):
    group = engine_with(optimizer).optimizer.param_groups[0]
    assert group[key] == DEEPSPEED_ADAM[key]
    assert type(group[key]) is type(DEEPSPEED_ADAM[key])


def test_adamw_with_only_lr_has_no_weight_decay():
    group = engine_with({"type": "AdamW", "params": {"lr": 0.1}}).optimizer.param_groups[0]
    assert group["lr"] == 0.1 and group["weight_decay"] == 0.0


def test_keys_a_config_sets_are_kept():
    params = {"lr": 0.2, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True}
    group = engine_with({"type": "AdamW", "params": params}).optimizer.param_groups[0]
    assert group["lr"] == 0.2 and group["betas"] == (0.8, 0.99) and group["eps"] == 1e-6
    assert group["weight_decay"] == 0.1 and group["amsgrad"] is True


def test_torch_adam_gets_torchs_defaults_as_in_deepspeed():
    """With torch_adam DeepSpeed builds torch.optim.AdamW(**params): torch's weight decay 0.01."""
    group = engine_with({"type": "AdamW", "params": {"torch_adam": True}}).optimizer.param_groups[0]
    assert group["weight_decay"] == 0.01 and group["lr"] == 1e-3


@pytest.mark.parametrize("key", sorted(TORCH_SGD))
def test_sgd_keys_a_config_omits_get_torchs_defaults(key):
    group = engine_with({"type": "SGD"}).optimizer.param_groups[0]
    assert group[key] == TORCH_SGD[key]


def test_bias_correction_false_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"optimizer\.params\.bias_correction"):
        engine_with({"type": "AdamW", "params": {"bias_correction": False}})


@pytest.mark.parametrize("key", ["bias_correction", "amsgrad", "adam_w_mode", "torch_adam"])
def test_adam_switches_must_be_booleans(key):
    with pytest.raises(ConfigError, match=rf"optimizer\.params\.{key}"):
        engine_with({"type": "Adam", "params": {key: "yes"}})


# ---- B. wall_clock_breakdown times every phase ----


def test_wall_clock_breakdown_reports_every_phase_above_zero(caplog):
    engine = engine_with({"type": "AdamW", "params": {"lr": 0.01}}, wall_clock_breakdown=True, steps_per_print=1)
    with caplog.at_level(logging.INFO, logger="infinity"):
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time per step")]
    assert len(lines) == 3
    number = r"([0-9.]+(?:e[+-]?[0-9]+)?) s"
    for line in lines:
        for phase in ("forward", r"backward \(with gradient reduction\)", "optimizer step"):
            found = re.search(rf"{phase} {number}", line)
            assert found, (phase, line)
            assert float(found.group(1)) > 0, (phase, line)


# ---- C. the training data loader shuffles at every world size, a new order each epoch ----


def loader_for(dataset):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}
    _, _, loader, _ = infinity.initialize(model=mlp(), config=config, training_data=dataset)
    return loader


def one_epoch(loader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def sampler_order(dataset, epoch: int) -> list[int]:
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_world_size_one_shuffles_with_a_new_order_each_epoch():
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    loader = loader_for(dataset)
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 8
    epochs = [one_epoch(loader) for _ in range(3)]
    for epoch, order in enumerate(epochs):
        assert sorted(order) == list(range(16))  # every sample once
        assert order == sampler_order(dataset, epoch)  # DeepSpeed's sampler, seed 0: reproducible
    assert epochs[0] != list(range(16))
    assert epochs[0] != epochs[1] != epochs[2]


def test_an_epoch_the_caller_sets_is_used():
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    loader = loader_for(dataset)
    one_epoch(loader)
    loader.sampler.set_epoch(5)
    assert one_epoch(loader) == sampler_order(dataset, 5)
    assert one_epoch(loader) == sampler_order(dataset, 6)


def test_a_partial_pass_still_ends_the_epoch():
    dataset = torch.utils.data.TensorDataset(torch.arange(16))
    loader = loader_for(dataset)
    next(iter(loader))
    assert one_epoch(loader) == sampler_order(dataset, 1)


def test_an_iterable_dataset_is_read_in_its_own_order_at_world_size_one():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return ((torch.tensor(i),) for i in range(8))

    assert one_epoch(loader_for(Stream())) == list(range(8))


# ---- D. a config path that cannot be read is a ConfigError naming it ----


def test_a_directory_as_the_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=rf"{re.escape(repr(str(tmp_path)))}.*JSON file"):
        load_json(tmp_path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_config_is_a_config_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 1}))
    path.chmod(0)
    try:
        with pytest.raises(ConfigError, match=rf"{re.escape(repr(str(path)))}.*permission"):
            infinity.initialize(model=mlp(), config=str(path))
    finally:
        path.chmod(0o600)


def test_a_permission_error_is_a_config_error(tmp_path, monkeypatch):
    """The error the test above provokes, also where that one is skipped (as root): open() refuses."""
    path = tmp_path / "ds.json"
    path.write_text("{}")

    def refuse(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", file)

    monkeypatch.setattr(infinity.config, "open", refuse, raising=False)
    with pytest.raises(ConfigError, match=rf"{re.escape(repr(str(path)))}.*permission"):
        load_json(path)

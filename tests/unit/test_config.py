"""The training config: batch arithmetic, "auto", legacy keys, and every error's text."""

import json
import operator

import pytest

from infinity import ConfigError, parse_config
from infinity.config import AutoValues

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def config(**overrides):
    return {**BASE, **overrides}


@pytest.mark.parametrize(
    "raw,world,expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
        ({"train_batch_size": 8}, 2, (8, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 1, (3, 3, 1)),
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
            2,
            (16, 2, 4),
        ),
    ],
)
def test_any_two_batch_sizes_determine_the_third(raw, world, expected):
    c = parse_config(raw, world_size=world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_batch_mismatch_shows_the_arithmetic():
    raw = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(
        ConfigError,
        match=r"train_batch_size 30 != .* 4 x gradient_accumulation_steps 2 x world "
        r"size 2 = 16",
    ):
        parse_config(raw, world_size=2)


def test_indivisible_batch():
    with pytest.raises(ConfigError, match="not divisible by train_micro_batch_size_per_gpu 4 x world size 2 = 8"):
        parse_config({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 4}, world_size=2)


def test_no_batch_size_at_all():
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        parse_config({"gradient_accumulation_steps": 4})


@pytest.mark.parametrize(
    "raw,message",
    [
        (
            config(zero_optimization={"stage3_max_live_parameter": 1}),
            "zero_optimization.stage3_max_live_parameter: did you mean stage3_max_live_parameters?",
        ),
        (config(train_batch_sise=4), "unknown key config.train_batch_sise: did you mean train_batch_size?"),
        (config(fp16={"enabled": True}, bf16={"enabled": True}), "fp16.enabled and bf16.enabled are both true"),
        (config(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}), "offload_param needs stage 3"),
        (
            config(
                zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x", "max_in_cpu": -1}}
            ),
            "zero_optimization.offload_param.max_in_cpu must be >= 0, got -1",
        ),
        (
            config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
            "offload_optimizer.device is nvme but zero_optimization.offload_optimizer.nvme_path is not set",
        ),
        (config(zero_optimization={"stage": 5}), "zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
        (config(zero_optimization={"stage": "two"}), "zero_optimization.stage must be an integer, got 'two'"),
        (config(zero_optimization={"reduce_bucket_size": 1.5}), "reduce_bucket_size must be a whole number"),
        (config(zero_optimization={"overlap_comm": "yes"}), "zero_optimization.overlap_comm must be true or false"),
        (
            config(zero_optimization={"offload_optimizer": {"device": "gpu"}, "stage": 1}),
            "offload_optimizer.device must be one of none, cpu, nvme, got 'gpu'",
        ),
        (config(gradient_clipping=-1), "gradient_clipping must be a number >= 0"),
        (config(optimizer={"type": "Lamb", "params": {}}), "optimizer.type 'Lamb' is not supported"),
        (config(scheduler={"type": "OneCycle", "params": {}}), "scheduler.type 'OneCycle' is not supported"),
        (config(pipeline={"stages": 2}), "pipeline is a DeepSpeed setting that infinity does not implement"),
        (
            config(activation_checkpointing={"partition_activations": True}),
            "activation_checkpointing is a DeepSpeed setting that infinity does not implement",
        ),
        (
            config(zero_optimization={"zero_quantized_weights": True}),
            "zero_optimization.zero_quantized_weights is a DeepSpeed setting that infinity does not implement",
        ),
        (config(aio={"queue_depth": 0}), "aio.queue_depth must be between 1"),
        (config(fp16={"enabled": True, "loss_scale": -1}), "fp16.loss_scale must be 0 .dynamic. or positive"),
    ],
)
def test_errors_name_the_key_and_the_rule(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


@pytest.mark.parametrize(
    "zero,new_key,mapped",
    [
        (
            {"stage": 2, "cpu_offload": True},
            "offload_optimizer.device",
            {"offload_optimizer.device": "cpu", "offload_optimizer.pin_memory": False},
        ),
        (
            {"stage": 1, "cpu_offload": True, "cpu_offload_use_pin_memory": True},
            "pin_memory",
            {"offload_optimizer.device": "cpu", "offload_optimizer.pin_memory": True},
        ),
        (
            {"stage": 2, "stage3_gather_fp16_weights_on_model_save": True},
            "stage3_gather_16bit_weights_on_model_save",
            {"stage3_gather_16bit_weights_on_model_save": True},
        ),
        ({"stage": 3, "cpu_offload_params": True}, "offload_param.device", {"offload_param.device": "cpu"}),
    ],
    ids=["cpu_offload", "cpu_offload_use_pin_memory", "stage3_gather_fp16", "cpu_offload_params"],
)
def test_legacy_keys_warn_once_and_map(zero, new_key, mapped):
    raw = config(zero_optimization=zero)
    with pytest.warns(DeprecationWarning) as caught:
        parsed = parse_config(raw)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    legacy = [key for key in zero if key != "stage"]
    assert len(deprecations) == len(legacy)  # once per legacy key
    for key in legacy:
        assert sum(f"zero_optimization.{key} is deprecated" in str(w.message) for w in deprecations) == 1, key
    assert any(new_key in str(w.message) for w in deprecations)
    for path, value in mapped.items():
        assert operator.attrgetter(path)(parsed.zero) == value, path
    if mapped is not None:  # the defaults differ, so each mapping above is visible
        defaults = parse_config(config(zero_optimization={"stage": zero["stage"]})).zero
        assert any(operator.attrgetter(path)(defaults) != value for path, value in mapped.items())


def test_observe_only_sections_warn_and_are_ignored():
    with pytest.warns(UserWarning, match="'tensorboard' only observes"):
        parse_config(config(tensorboard={"enabled": True}))


def test_numbers_written_as_5e8():
    c = parse_config(config(zero_optimization={"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8}))
    assert c.zero.reduce_bucket_size == 500_000_000 and isinstance(c.zero.reduce_bucket_size, int)


def test_overlap_comm_defaults():
    assert parse_config(config(zero_optimization={"stage": 2})).zero.overlap_comm is False


def test_hugging_face_style_config_full_of_auto_resolves(tmp_path):
    raw = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": 10},
        },
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0,
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    auto = AutoValues(
        lr=3e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        micro_batch_size=4,
        hidden_size=64,
        model_dtype="bfloat16",
    )
    c = parse_config(path, world_size=2, auto=auto)
    assert c.bf16.enabled and not c.fp16.enabled
    assert c.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert c.scheduler.params["warmup_max_lr"] == 3e-4
    assert c.zero.reduce_bucket_size == 64 * 64
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 1)
    assert json.loads(path.read_text()) == raw  # the user's file is untouched


@pytest.mark.parametrize(
    "raw,message",
    [
        (config(optimizer={"type": "AdamW", "params": {"lr": "auto"}}), 'optimizer.params.lr is "auto"'),
        (
            config(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}),
            'scheduler.params.total_num_steps is "auto"',
        ),
        (config(zero_optimization={"reduce_bucket_size": "auto"}), "zero_optimization.reduce_bucket_size"),
        (config(gradient_clipping="auto"), 'gradient_clipping is "auto"'),
        ({"train_micro_batch_size_per_gpu": "auto"}, 'train_micro_batch_size_per_gpu is "auto"'),
    ],
)
def test_unresolvable_auto_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero2-offload", "zero3"])
def test_ready_configs_load(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.json"
    c = parse_config(path, world_size=2)
    assert c.bf16.enabled and c.train_batch_size == 8
    assert c.zero.stage == int(name[4])
    assert c.zero.offload_optimizer.enabled == name.endswith("offload")
    if name == "zero3":
        assert c.zero.overlap_comm and c.zero.stage3_gather_16bit_weights_on_model_save

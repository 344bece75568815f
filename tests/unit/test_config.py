"""The training config: batch arithmetic, "auto", legacy keys, and every error's text."""

import json
import operator

import pytest

from infinity import ConfigError, parse_config
from infinity.config import AutoError, AutoValues

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
            "zero_optimization.zero_quantized_weights=true is a DeepSpeed setting that infinity does not implement",
        ),
        (
            config(zero_optimization={"stage": 1, "offload_optimizer": {"fast_int": True}}),
            "offload_optimizer.fast_int: did you mean fast_init?",  # a key accepted without effect is still a hint
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
        (
            config(optimizer={"type": "AdamW", "params": {"lr": "auto"}}),
            r"optimizer.params.lr \(initialize\(\) fills it from the param groups of a torch optimizer",
        ),
        (
            config(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}),
            r"nothing to fill them \(set each in the config\): scheduler.params.total_num_steps$",
        ),
        (
            config(zero_optimization={"reduce_bucket_size": "auto"}),
            r"zero_optimization.reduce_bucket_size \(initialize\(\) fills it from the model's config.hidden_size",
        ),
        (config(gradient_clipping="auto"), r"gradient_clipping \(0 disables clipping"),
        ({"train_micro_batch_size_per_gpu": "auto"}, r"train_micro_batch_size_per_gpu \(or set train_batch_size"),
    ],
)
def test_unresolvable_auto_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


NINE_AUTOS = {
    "fp16": {"enabled": "auto"},
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "total_num_steps": "auto"},
    },
}


def test_every_unfilled_auto_is_reported_at_once():
    """Nine "auto" values nothing fills: one error names them all (not one run per key)."""
    with pytest.raises(AutoError) as caught:
        parse_config(config(**NINE_AUTOS))
    keys = ["fp16.enabled", "gradient_clipping", "optimizer.params.lr", "optimizer.params.betas",
            "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
            "scheduler.params.warmup_max_lr", "scheduler.params.total_num_steps"]  # fmt: skip
    assert [u.key for u in caught.value.unfilled] == keys
    message = str(caught.value)
    assert all(key in message for key in keys), message
    assert "fp16.enabled (initialize() fills it from the model's floating-point dtype)" in message


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


# ---- DeepSpeed's field names, and every DeepSpeed key honoured, refused or said to have no effect ----

FIELD_NAMES = {  # DeepSpeed's field name -> its stage3_ alias, and a value other than the default
    "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 1234),
    "param_persistence_threshold": ("stage3_param_persistence_threshold", 77),
    "model_persistence_threshold": ("stage3_model_persistence_threshold", 999),
    "max_live_parameters": ("stage3_max_live_parameters", 4321),
    "max_reuse_distance": ("stage3_max_reuse_distance", 0),
    "gather_16bit_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", True),
}


@pytest.mark.parametrize("name", sorted(FIELD_NAMES))
def test_deepspeeds_field_names_are_the_stage3_keys(name):
    alias, value = FIELD_NAMES[name]
    zero = parse_config(config(zero_optimization={"stage": 3, name: value})).zero
    assert getattr(zero, alias) == value
    both = parse_config(config(zero_optimization={"stage": 3, name: value, alias: value})).zero
    assert getattr(both, alias) == value
    other = not value if isinstance(value, bool) else value + 1
    with pytest.raises(ConfigError, match=f"zero_optimization.{name} and zero_optimization.{alias} are the same "
                                          "setting .* disagree"):  # fmt: skip
        parse_config(config(zero_optimization={"stage": 3, name: value, alias: other}))


def test_field_name_auto_is_filled_like_its_alias():
    auto = AutoValues(hidden_size=64)
    zero = parse_config(config(zero_optimization={"stage": 3, "prefetch_bucket_size": "auto",
                                                  "param_persistence_threshold": "auto"}), auto=auto).zero  # fmt: skip
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert zero.stage3_param_persistence_threshold == 640
    below = parse_config(config(zero_optimization={"stage": 2, "max_live_parameters": "auto"})).zero
    assert below.stage3_max_live_parameters == 1_000_000_000  # a stage-3 knob below stage 3: dropped, as DeepSpeed


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.5])
def test_partial_optimizer_offload_is_refused_by_name(ratio):
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer.ratio=.*infinity offloads all "
                                          r"optimizer states of the chosen device"):  # fmt: skip
        parse_config(config(zero_optimization=zero))


@pytest.mark.parametrize(
    "zero,key",
    [
        ({"stage": 3, "offload_optimizer": {"super_offload": True}}, "offload_optimizer.super_offload"),
        ({"stage": 2, "load_from_fp32_weights": False}, "load_from_fp32_weights"),
        ({"stage": 3, "module_granularity_threshold": 10}, "module_granularity_threshold"),  # the field name
        ({"stage": 3, "zenflow": {"topk_ratio": 0.1}}, "zenflow"),
        ({"stage": 3, "mics_shard_size": 2}, "mics_shard_size"),
    ],
)
def test_settings_not_implemented_are_refused_by_name(zero, key):
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}=.* infinity does not implement"):
        parse_config(config(zero_optimization=zero))


@pytest.fixture
def infinity_info_lines():
    """The `infinity` logger's info lines, each key's "no effect" line said afresh."""
    import logging

    from infinity import config_keys

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("infinity")
    handler, level = Collect(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    said = set(config_keys._SAID)
    config_keys._SAID.clear()
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)
    config_keys._SAID.clear()
    config_keys._SAID.update(said)


def test_keys_without_effect_are_said_once_each(infinity_info_lines):
    zero = {"stage": 3, "round_robin_gradients": True, "allgather_sequential": True, "contiguous_gradients": True,
            "leaf_module": {"classes": ["MoeBlock"]}, "offload_optimizer": {"device": "cpu", "fast_init": True}}
    for _ in range(2):  # a second parse (initialize() after `infinity train`'s check) says nothing new
        parse_config(config(zero_optimization=zero))
    said = [line for line in infinity_info_lines if "has no effect in infinity" in line]
    assert sorted(line.split()[2] for line in said) == [
        "zero_optimization.allgather_sequential",
        "zero_optimization.leaf_module",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.round_robin_gradients",
    ], said  # contiguous_gradients true is what infinity does anyway: nothing to say
    with pytest.raises(ConfigError, match="zero_optimization.round_robin_gradients must be true or false"):
        parse_config(config(zero_optimization={"round_robin_gradients": "yes"}))


def test_keys_for_another_stage_or_device_are_said(infinity_info_lines):
    """A stage-3 knob at stage 2, an nvme-only offload_param key with device cpu: one line each, not dropped."""
    parse_config(config(zero_optimization={"stage": 2, "max_live_parameters": 10, "stage3_prefetch_bucket_size": 0,
                                           "sub_group_size": 5}))
    parse_config(config(zero_optimization={"stage": 3, "allgather_bucket_size": 7,
                                           "offload_param": {"device": "cpu", "max_in_cpu": 5, "buffer_count": 4}}))
    said = sorted(line.split()[2] for line in infinity_info_lines if "has no effect in infinity" in line)
    assert said == [
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.sub_group_size",
    ], said
    infinity_info_lines.clear()
    parse_config(config(zero_optimization={"stage": 3, "max_live_parameters": 10, "sub_group_size": 5,
                                           "offload_param": {"device": "nvme", "nvme_path": "/x", "max_in_cpu": 5}}))
    assert not [line for line in infinity_info_lines if "has no effect" in line], infinity_info_lines


def test_both_names_of_a_key_without_effect_must_agree():
    with pytest.raises(ConfigError, match="use_all_reduce_for_fetch_params .* disagree"):
        parse_config(config(zero_optimization={"stage": 3, "use_all_reduce_for_fetch_params": True,
                                               "stage3_use_all_reduce_for_fetch_params": False}))


@pytest.mark.parametrize("aio", [[1], "x", 3])
def test_an_aio_section_that_is_not_an_object_is_named(aio):
    with pytest.raises(ConfigError, match="aio must be an object"):
        parse_config(config(aio=aio))


def test_legacy_keys_given_with_their_replacement_are_an_error():
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="cpu_offload .deprecated. and "
                                                                            "zero_optimization.offload_optimizer"):
        parse_config(config(zero_optimization={"stage": 2, "cpu_offload": True,
                                               "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}))
    with pytest.warns(DeprecationWarning):  # DeepSpeed's current name for cpu_offload_params
        zero = parse_config(config(zero_optimization={"stage": 3, "cpu_offload_param": True})).zero
    assert zero.offload_param.device == "cpu"


# DeepSpeed's own key lists (its DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig,
# DeepSpeedZeroOffloadOptimizerConfig and aio constants), each with DeepSpeed's default.
DEEPSPEED_ZERO_KEYS = {
    "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 500_000_000,
    "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True, "allgather_bucket_size": 500_000_000,
    "overlap_comm": False, "load_from_fp32_weights": True, "elastic_checkpoint": False, "offload_param": None,
    "offload_optimizer": None, "zenflow": None, "sub_group_size": 1_000_000_000, "cpu_offload_param": None,
    "cpu_offload_use_pin_memory": None, "cpu_offload": None, "prefetch_bucket_size": 50_000_000,
    "param_persistence_threshold": 100_000, "model_persistence_threshold": 2**63 - 1,
    "max_live_parameters": 1_000_000_000, "max_reuse_distance": 1_000_000_000,
    "gather_16bit_weights_on_model_save": False, "module_granularity_threshold": 0,
    "use_all_reduce_for_fetch_params": False, "allgather_sequential": False,
    "stage3_gather_fp16_weights_on_model_save": False, "ignore_unused_parameters": True, "legacy_stage1": False,
    "round_robin_gradients": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False, "zeropp_loco_param": None,
    "mics_shard_size": -1, "mics_hierarchical_params_gather": False, "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False, "override_module_apply": True, "log_trace_cache_warnings": False,
    "enable_sanity_checks": False, "save_muon_momentum_buffer_in_memory": False, "leaf_module": {},
}  # fmt: skip
ZERO_ALIASES = ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold",
                "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential"]  # fmt: skip
DEEPSPEED_OFFLOAD_PARAM_KEYS = {"device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000,
                                "max_in_cpu": 1_000_000_000, "pin_memory": True}  # fmt: skip
DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS = {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True,
                                    "pipeline_read": False, "pipeline_write": False, "fast_init": False,
                                    "ratio": 1.0, "super_offload": False, "cpuadam_cores_perc": 0.8}  # fmt: skip
DEEPSPEED_AIO_KEYS = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                      "overlap_events": True, "use_gds": False}  # fmt: skip


def test_every_deepspeed_key_is_read_and_in_the_readme_table():
    """Each of DeepSpeed's keys, at its default, is accepted (honoured, or without effect); the README's table
    names every one of them."""
    from pathlib import Path

    zero = {k: v for k, v in DEEPSPEED_ZERO_KEYS.items() if v is not None and not k.startswith("cpu_offload")}
    zero["stage"] = 3
    zero.pop("stage3_gather_fp16_weights_on_model_save")  # deprecated: its own test above
    zero["offload_param"] = {**DEEPSPEED_OFFLOAD_PARAM_KEYS, "pin_memory": False}  # pinning needs CUDA
    zero["offload_optimizer"] = {**DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS, "pin_memory": False}
    for key in ("offload_param", "offload_optimizer"):
        zero[key].pop("nvme_path")
    parsed = parse_config(config(zero_optimization=zero, aio=DEEPSPEED_AIO_KEYS))
    assert parsed.zero.stage3_prefetch_bucket_size == 50_000_000
    parse_config(config(zero_optimization={"stage": 3, **{k: DEEPSPEED_ZERO_KEYS[k.removeprefix("stage3_")]
                                                          for k in ZERO_ALIASES}}))  # fmt: skip
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("### Every DeepSpeed key") :]
    table = table[: table.index("\n## ")]
    sections = {"zero_optimization": [*DEEPSPEED_ZERO_KEYS, *ZERO_ALIASES],
                "offload_param": DEEPSPEED_OFFLOAD_PARAM_KEYS, "offload_optimizer": DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS,
                "aio": DEEPSPEED_AIO_KEYS}
    for section, keys in sections.items():
        for key in keys:
            assert f"`{key}`" in table, f"{section}.{key} is missing from the README's table"

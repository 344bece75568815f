"""An Accelerate config's DeepSpeed settings (the file `accelerate config` writes, or the variables `accelerate
launch` exports) become the config Accelerate's DeepSpeed plugin would build, and the engine parses it."""

import json

import pytest

from infinity.config import AutoValues, parse_config
from infinity.errors import ConfigError
from infinity.integrations.accelerate_config import from_environment, from_file, from_settings

ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: nvme
  offload_optimizer_nvme_path: {nvme}
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""


def test_a_config_file_as_accelerate_config_writes_it(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_YAML.format(nvme=tmp_path / "nvme"))
    config = from_file(path)
    assert config == {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                              "offload_param": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True},
    }  # fmt: skip
    parsed = parse_config({**config, "optimizer": {"type": "AdamW"}}, world_size=2, auto=AutoValues(micro_batch_size=4))
    assert (parsed.train_batch_size, parsed.zero.stage, parsed.zero.offload_optimizer.device) == (16, 3, "nvme")


def test_the_launchers_environment():
    environ = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "none",
        "ACCELERATE_GRADIENT_CLIPPING": "none",
        "ACCELERATE_MIXED_PRECISION": "fp16",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "false",
    }
    config = from_environment(environ)
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                           "stage3_gather_16bit_weights_on_model_save": False}  # fmt: skip
    assert config["fp16"] == {"enabled": True} and "gradient_clipping" not in config
    assert config["gradient_accumulation_steps"] == 1  # Accelerate's default
    assert from_environment({"PATH": "/bin"}) is None  # not launched with DeepSpeed settings


def test_defaults_are_accelerates():
    config = from_settings({})
    assert config["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in config["zero_optimization"]


def test_a_deepspeed_config_file_is_used_as_it_is(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}))
    assert from_settings({"deepspeed_config_file": str(ds)}) == json.loads(ds.read_text())
    with pytest.raises(ConfigError, match="ignores gradient_clipping, zero_stage"):
        from_settings({"deepspeed_config_file": str(ds), "zero_stage": 3, "gradient_clipping": 1.0})
    environ = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds), "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    assert from_environment(environ) == json.loads(ds.read_text())  # the launcher's exported defaults beside it


@pytest.mark.parametrize("settings,message", [
    ({"offload_param_device": "nvme"}, "offload_param_nvme_path is not set"),
    ({"offload_optimizer_device": "disk"}, "must be none, cpu or nvme"),
    ({"zero_stage": "three"}, "must be integers"),
    ({"zero3_save_16bit_model": "maybe"}, "true or false"),
])  # fmt: skip
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        from_settings(settings)


def test_a_config_without_deepspeed_is_refused(tmp_path):
    path = tmp_path / "accelerate.json"
    path.write_text(json.dumps({"distributed_type": "MULTI_GPU", "num_processes": 2}))
    with pytest.raises(ConfigError, match="MULTI_GPU"):
        from_file(path)

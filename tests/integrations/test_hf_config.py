"""A DeepSpeed JSON full of "auto" (the kind Transformers' documentation shows) filled from real TrainingArguments
as Transformers fills it for DeepSpeed, then parsed by the engine's own config parser; contradictions are errors
naming both sides."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.config import parse_config
from infinity.errors import ConfigError
from infinity.integrations.hf_config import fill_from_model, fill_from_training_args

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # TrainingArguments needs it
AUTO_CONFIG = json.loads((Path(__file__).parent / "ds_config_zero3_auto.json").read_text())


def training_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  learning_rate=3e-4, adam_beta1=0.85, adam_beta2=0.97, adam_epsilon=1e-7, weight_decay=0.05,
                  max_grad_norm=0.5, warmup_steps=5, report_to=[], use_cpu=True)  # fmt: skip
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def gpt2_config(hidden: int = 64):
    return transformers.GPT2Config(n_embd=hidden, n_layer=1, n_head=2, vocab_size=128)


def test_every_auto_is_filled_as_transformers_fills_it(tmp_path):
    args = training_args(tmp_path)
    config = fill_from_training_args(AUTO_CONFIG, args, world_size=2)
    config = fill_from_model(config, args, model_config=gpt2_config(64), num_training_steps=50)
    assert "auto" not in json.dumps(config)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 2, 16)  # fmt: skip
    assert config["gradient_clipping"] == 0.5
    assert config["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.85, 0.97], "eps": 1e-7, "weight_decay": 0.05}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 5,
                                             "total_num_steps": 50}  # fmt: skip
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (64 * 64, int(0.9 * 64 * 64), 640)  # fmt: skip
    parsed = parse_config(config, world_size=2)  # the engine takes it as it is
    assert parsed.train_batch_size == 16 and parsed.zero.stage == 3 and parsed.gradient_clipping == 0.5
    assert AUTO_CONFIG["optimizer"]["params"]["lr"] == "auto"  # the caller's dict is not modified


def test_explicit_values_that_contradict_the_arguments_name_both(tmp_path):
    config = json.loads(json.dumps(AUTO_CONFIG))
    config["optimizer"]["params"]["lr"] = 1e-3
    config["train_micro_batch_size_per_gpu"] = 8
    with pytest.raises(ConfigError) as info:
        fill_from_training_args(config, training_args(tmp_path), world_size=1)
    message = str(info.value)
    assert "optimizer.params.lr=0.001 vs TrainingArguments learning_rate=0.0003" in message
    assert "train_micro_batch_size_per_gpu=8 vs TrainingArguments per_device_train_batch_size=4" in message
    config = fill_from_training_args(AUTO_CONFIG, training_args(tmp_path), world_size=1)
    config["scheduler"]["params"]["total_num_steps"] = 999
    with pytest.raises(ConfigError, match="total_num_steps=999 vs TrainingArguments num_training_steps"):
        fill_from_model(config, training_args(tmp_path), model_config=gpt2_config(), num_training_steps=50)


def test_equal_explicit_values_and_absent_keys_are_left_alone(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "optimizer": {"type": "AdamW",
              "params": {"lr": 3e-4, "betas": [0.85, 0.97]}}, "bf16": {"enabled": True}}  # fmt: skip
    args = training_args(tmp_path)
    with pytest.raises(ConfigError, match="bf16.enabled=True vs TrainingArguments bf16"):
        fill_from_training_args(config, args, world_size=1)
    del config["bf16"]
    filled = fill_from_training_args(config, args, world_size=1)
    assert filled == config and "train_batch_size" not in filled  # nothing added that the user left out


def test_hidden_size_autos_need_a_hidden_size(tmp_path):
    class NoHidden:
        pass

    config = fill_from_training_args(AUTO_CONFIG, training_args(tmp_path), world_size=1)
    with pytest.raises(ConfigError, match="no hidden_size.*reduce_bucket_size"):
        fill_from_model(config, training_args(tmp_path), model_config=NoHidden(), num_training_steps=10)


def test_the_core_never_imports_transformers():
    code = ("import sys, infinity, infinity.engine, infinity.integrations.hf_config\n"
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules, 'imported'")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_below_stage3_the_stage3_knobs_stay_auto_and_warmup_is_at_least_one(tmp_path):
    """As Transformers: stage 3's hidden-size knobs are filled only at stage 3 (the engine drops them below it),
    and a run without warmup still gets warmup_num_steps 1 (the schedule refuses 0)."""
    config = json.loads(json.dumps(AUTO_CONFIG))
    config["zero_optimization"]["stage"] = 2
    config["zero_optimization"].pop("offload_param", None)  # stage 3 only
    args = training_args(tmp_path, warmup_steps=0)
    config = fill_from_model(fill_from_training_args(config, args, world_size=1), args,
                             model_config=gpt2_config(64), num_training_steps=50)  # fmt: skip
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == "auto" and zero["stage3_param_persistence_threshold"] == "auto"
    assert config["scheduler"]["params"]["warmup_num_steps"] == 1
    parsed = parse_config(config, world_size=1)  # nothing left to fill the stage-3 knobs from: dropped
    assert parsed.zero.stage == 2 and parsed.scheduler is not None


def test_deepspeeds_field_names_are_filled_as_their_stage3_names(tmp_path):
    """DeepSpeed reads prefetch_bucket_size as stage3_prefetch_bucket_size (and so on); an "auto" there is filled
    from the model as the stage3_ name is (Transformers fills only that one)."""
    config = json.loads(json.dumps(AUTO_CONFIG))
    zero = config["zero_optimization"]
    zero["prefetch_bucket_size"] = zero.pop("stage3_prefetch_bucket_size")
    zero["param_persistence_threshold"] = zero.pop("stage3_param_persistence_threshold")
    args = training_args(tmp_path)
    config = fill_from_model(fill_from_training_args(config, args, world_size=1), args,
                             model_config=gpt2_config(64), num_training_steps=50)  # fmt: skip
    zero = config["zero_optimization"]
    assert (zero["prefetch_bucket_size"], zero["param_persistence_threshold"]) == (int(0.9 * 64 * 64), 640)
    parsed = parse_config(config, world_size=1).zero
    assert (parsed.stage3_prefetch_bucket_size, parsed.stage3_param_persistence_threshold) == (int(0.9 * 64 * 64), 640)

"""An Accelerate config's DeepSpeed settings as an infinity config.

`accelerate launch` with `distributed_type: DEEPSPEED` requires the real DeepSpeed package, so an Accelerate user
launches with `--multi_gpu` (or torchrun) instead and keeps their settings: this module reads the
`deepspeed_config:` section of an Accelerate config file (what `accelerate config` writes, YAML or JSON), or the
ACCELERATE_* environment variables `accelerate launch` exports, and builds the config Accelerate's DeepSpeed
plugin would have built from them: the same keys, the same defaults (ZeRO stage 2, no offload, accumulation 1),
batch sizes left "auto" for initialize() to fill. A `deepspeed_config_file` is used as it is; other settings
beside it would be ignored by Accelerate, so here they are an error that names them."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from infinity.config import AUTO, load_json
from infinity.errors import ConfigError

# Accelerate's deepspeed_config keys and the environment variables `accelerate launch` exports for them.
ENVIRONMENT = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
}
MIXED_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"
# Settings Accelerate ignores when a DeepSpeed config file is given (it raises too).
IGNORED_BESIDE_FILE = ("zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                       "offload_param_nvme_path", "zero3_save_16bit_model", "gradient_accumulation_steps",
                       "gradient_clipping")  # fmt: skip


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no", "none", ""):
        return False
    raise ConfigError(f"deepspeed_config.{key} must be true or false, got {value!r}")


def _offload(key: str, device: Any, nvme_path: Any) -> dict | None:
    device = str(device or "none").lower()
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"deepspeed_config.{key}_device must be none, cpu or nvme, got {device!r}")
    if device == "none":
        return None
    section: dict[str, Any] = {"device": device}
    if device == "nvme":
        if nvme_path in (None, "", "none"):
            raise ConfigError(f"deepspeed_config.{key}_device is nvme but {key}_nvme_path is not set; set a folder")
        section["nvme_path"] = str(nvme_path)
    return section


def from_settings(settings: Mapping[str, Any], *, mixed_precision: str | None = None) -> dict:
    """The infinity config for Accelerate's DeepSpeed settings (the `deepspeed_config:` section's keys)."""
    settings = {k: v for k, v in settings.items() if v is not None}
    precision = str(mixed_precision or "no").lower()
    if precision not in ("no", "fp16", "bf16"):
        raise ConfigError(f"mixed_precision {mixed_precision!r} is not supported here: use no, fp16 or bf16")
    config_file = settings.get("deepspeed_config_file")
    if config_file not in (None, "", "none"):
        beside = sorted(k for k in IGNORED_BESIDE_FILE if k in settings)
        if beside:
            raise ConfigError(
                f"deepspeed_config_file {config_file!r} is given, so Accelerate ignores {', '.join(beside)}: put "
                "them in that JSON file instead and remove them from the Accelerate config"
            )
        return load_json(config_file)
    try:
        stage = int(settings.get("zero_stage", 2))
        accumulation = int(settings.get("gradient_accumulation_steps", 1))
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"deepspeed_config: zero_stage and gradient_accumulation_steps must be integers ({e})"
        ) from None
    zero: dict[str, Any] = {"stage": stage}
    for key in ("offload_optimizer", "offload_param"):
        section = _offload(key, settings.get(f"{key}_device"), settings.get(f"{key}_nvme_path"))
        if section is not None:
            zero[key] = section
    save_16bit = _flag("zero3_save_16bit_model", settings.get("zero3_save_16bit_model", False))
    zero["stage3_gather_16bit_weights_on_model_save"] = save_16bit
    config: dict[str, Any] = {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
    }
    clipping = settings.get("gradient_clipping")
    if clipping not in (None, "none"):
        try:
            config["gradient_clipping"] = float(clipping)
        except (TypeError, ValueError):
            raise ConfigError(f"deepspeed_config.gradient_clipping must be a number, got {clipping!r}") from None
    if precision != "no":
        config[precision] = {"enabled": True}
    return config


def from_file(path: str | os.PathLike) -> dict:
    """An Accelerate config file (YAML, or JSON) with `distributed_type: DEEPSPEED` and a `deepspeed_config:`."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"accelerate config {path!r} cannot be read: {e.strerror}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # PyYAML: what Accelerate itself reads its config files with

            data = yaml.safe_load(text)
    except ImportError:
        raise ConfigError(f"reading {path!r} needs PyYAML: pip install pyyaml (or give the config as JSON)") from None
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError
        raise ConfigError(f"accelerate config {path!r} cannot be parsed: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"accelerate config {path!r} must hold a mapping, got {type(data).__name__}")
    kind = str(data.get("distributed_type", "")).upper()
    if kind != "DEEPSPEED" or not isinstance(data.get("deepspeed_config"), dict):
        raise ConfigError(
            f"accelerate config {path!r} has distributed_type {data.get('distributed_type')!r} and no "
            "deepspeed_config section: there are no DeepSpeed settings to carry over"
        )
    return from_settings(data["deepspeed_config"], mixed_precision=data.get("mixed_precision"))


def from_environment(environ: Mapping[str, str] | None = None) -> dict | None:
    """The config from the variables `accelerate launch` exports; None when it exported no DeepSpeed settings."""
    environ = os.environ if environ is None else environ
    settings = {key: environ[name] for key, name in ENVIRONMENT.items() if name in environ}
    if not settings and environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    if settings.get("deepspeed_config_file", "none") != "none":  # the launcher exports its defaults beside it
        return load_json(settings["deepspeed_config_file"])
    return from_settings(settings, mixed_precision=environ.get(MIXED_PRECISION_ENV))

"""The DeepSpeed-style JSON config, parsed once into typed, validated objects.

Each section is checked key by key: an unknown key is an error naming the closest valid one, a value of
the wrong type or range names the key, the value and the rule, and DeepSpeed's legacy names are accepted
with one deprecation warning each. Components receive only their own section's object.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infinity.aio.handle import AioSettings
from infinity.config_keys import (
    OFFLOAD_OPTIMIZER_NO_EFFECT,
    OFFLOAD_OPTIMIZER_REFUSED,
    ZERO_FIELD_NAMES,
    ZERO_NO_EFFECT,
    ZERO_REFUSED,
    is_stage3_knob,
    one_name_each,
    say_no_effect,
    set_aside,
    stage3_name,
)
from infinity.errors import ConfigError

# ---- key-level helpers (shared by every section) ----


def check_keys(section: str, raw: Mapping[str, Any], known: set[str]) -> None:
    """Unknown keys are errors, with the closest valid key as a hint."""
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f": did you mean {close[0]}?" if close else f"; valid keys: {', '.join(sorted(known))}"
            raise ConfigError(f"unknown key {section}.{key}{hint}")


def as_int(key: str, value: Any, *, minimum: int | None = None) -> int:
    """Integers, also when written as 5e8 (JSON floats with no fractional part)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{key} must be a whole number, got {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")
    return value


def as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def warn_legacy(old: str, new: str) -> None:
    warnings.warn(f"config key {old} is deprecated; use {new}", DeprecationWarning, stacklevel=4)


def load_json(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A dict, or the path of a JSON file."""
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config {path!r} is a directory; a JSON file is expected") from None
    except PermissionError:
        raise ConfigError(f"config file {path!r} cannot be read: permission denied") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "INFINITY_COLLECTIVE_TIMEOUT_S"


def collective_timeout_s(configured=None) -> float:
    """The config's collective_timeout, else the environment variable, else the default; seconds, > 0."""
    source, value = "collective_timeout", configured
    if value is None and os.environ.get(TIMEOUT_ENV):
        source, value = TIMEOUT_ENV, os.environ[TIMEOUT_ENV]
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise ConfigError(f"{source} must be a number of seconds > 0, got {value!r}")
    return seconds


# ---- the aio section ----

_AIO_KEYS = {
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "single_submit",
    "overlap_events",
    "use_direct_io",
    "use_gds",
    "thread_count",
}


def parse_aio(raw: Mapping[str, Any] | None) -> AioSettings:
    """The ``aio`` section (DeepSpeed names and defaults) -> AioSettings."""
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"aio must be an object, got {raw!r}")
    raw = dict(raw or {})
    check_keys("aio", raw, _AIO_KEYS)
    if "thread_count" in raw:
        warn_legacy("aio.thread_count", "aio.intra_op_parallelism")
        if "intra_op_parallelism" in raw and raw["intra_op_parallelism"] != raw["thread_count"]:
            raise ConfigError(
                "aio.thread_count and aio.intra_op_parallelism are the same setting and disagree "
                f"({raw['thread_count']} vs {raw['intra_op_parallelism']}); keep only intra_op_parallelism"
            )
        raw["intra_op_parallelism"] = raw.pop("thread_count")
    if raw.pop("use_gds", False):
        raise ConfigError("aio.use_gds (GPUDirect Storage) is not implemented by infinity; remove it or set false")
    kwargs: dict[str, Any] = {}
    for key in ("block_size", "queue_depth", "intra_op_parallelism"):
        if key in raw:
            kwargs[key] = as_int(f"aio.{key}", raw[key])
    for key in ("single_submit", "overlap_events", "use_direct_io"):
        if key in raw:
            kwargs[key] = as_bool(f"aio.{key}", raw[key])
    return AioSettings(**kwargs)


# ---- sections of the training config ----

AUTO = "auto"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp16Config:
    enabled: bool = False
    loss_scale: float = 0.0
    """0 means dynamic loss scaling; any other value is a fixed scale."""
    initial_scale_power: int = 16
    """The dynamic scale starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale is doubled."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every clean step (instead of never)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bf16Config:
    enabled: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    type: str
    """Adam | AdamW | SGD | Adagrad | Lion | a torch.optim class's name (case-insensitive); DeepSpeed's Lamb,
    OneBitAdam, ZeroOneAdam, OneBitLamb, MuAdam(W), MuSGD and Muon are refused naming why."""
    params: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    type: str
    """WarmupLR | WarmupDecayLR | WarmupCosineLR."""
    params: dict = field(default_factory=dict)


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    device: str = "none"
    nvme_path: str | None = None
    buffer_count: int = 4
    pin_memory: bool = False
    pipeline_read: bool = True  # DeepSpeed: false. Here reads ahead / writes behind unless turned off
    pipeline_write: bool = True

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    device: str = "none"
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000  # nvme: elements of the rank's pieces kept in host memory ([Note: unit shards])
    pin_memory: bool = False

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class InfinitySection:
    """The config's "infinity" section: settings DeepSpeed has no key for (DeepSpeed ignores the section)."""

    optimizer_state_dtype: str = "fp32"
    """How offloaded optimizer states are stored: "fp32", "bf16" or "int8" ([Note: compact states] in
    zero/compact.py); the fp32 masters stay fp32."""

    offloaded_gradient_dtype: str = "fp32"
    """How the reduced gradient is stored where it is written to NVMe (stage 3, optimizer on NVMe, the gradient
    too large for its part of host memory: [Note: swapped gradients] in zero/grads.py): "fp32" or "bf16". In
    memory it stays fp32."""

    offloaded_master: str = "fp32"
    """How an offloaded optimizer keeps the fp32 master weights: "fp32" (4 bytes an element), or "split" (bf16
    only: the 16 bits the bf16 weight lacks, 2 bytes an element; the master is joined back from both for the
    step: [Note: split masters] in zero/split_master.py)."""

    step_behind_forward: bool | None = None
    """Stage 3 with the optimizer on NVMe: each unit's tiles step just before the next forward uses the unit, so
    the tiles' reads and writes run behind the forward's compute ([Note: step behind forward] in
    zero/unit_optimizer.py). None (the default): wherever it can (torch's Adam, AdamW or SGD, fp32 masters);
    true: the same, refused where it cannot; false: the whole step runs in engine.step()."""

    step_in_backward: bool | None = None
    """Stage 3 with the optimizer in host memory: each unit's tiles step in the boundary's backward as soon as
    its reduced gradient is final, so the whole gradient is never held ([Note: step in backward] in
    zero/backward_step.py). None (the default): wherever it can (no gradient_clipping, no fp16, torch's Adam,
    AdamW or SGD, fp32 masters, a window of one backward); true: the same, refused where it cannot; false: the
    whole step runs in engine.step(), and the gradient can be read in between."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """The zero_optimization keys that act here (the README's table lists every DeepSpeed key). The stage-3
    knobs keep their stage3_ names; DeepSpeed's field names for them are read as the same keys."""

    stage: int = 0
    overlap_comm: bool = False
    """Launch gradient reductions during backward. DeepSpeed's default is true for stage 3."""
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_model_persistence_threshold: int = 2**63 - 1
    stage3_gather_16bit_weights_on_model_save: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """The whole training config, validated; components receive their own section."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    collective_timeout: float = 300.0
    """Seconds a collective waits for the other ranks before it fails naming itself (not DeepSpeed's: its
    timeout is an argument of deepspeed.init_distributed). Also INFINITY_COLLECTIVE_TIMEOUT_S."""
    fp16: Fp16Config = field(default_factory=Fp16Config)
    bf16: Bf16Config = field(default_factory=Bf16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioSettings = field(default_factory=AioSettings)
    infinity: InfinitySection = field(default_factory=InfinitySection)

    @property
    def compute_dtype_name(self) -> str:
        return "float16" if self.fp16.enabled else "bfloat16" if self.bf16.enabled else "float32"


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoValues:
    """What initialize() knows that can fill "auto" values."""

    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    momentum: float | None = None
    micro_batch_size: int | None = None
    hidden_size: int | None = None
    model_dtype: str | None = None  # "float16" | "bfloat16" | "float32": fills fp16/bf16.enabled "auto"


# DeepSpeed sections that only observe: accepted, with one warning that they do nothing here.
OBSERVE_ONLY = {
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "flops_profiler",
    "comms_logger",
    "memory_breakdown",
    "dump_state",
}
# DeepSpeed settings that would change the math or the memory, which infinity does not implement.
NOT_IMPLEMENTED = {
    "pipeline", "sparse_attention", "compression_training", "data_efficiency", "curriculum_learning", "elasticity",
    "autotuning", "activation_checkpointing", "amp", "communication_data_type", "hybrid_engine", "quantize_training",
    "eigenvalue", "progressive_layer_drop", "data_types", "checkpoint", "nebula", "weight_quantization",
    "torch_autocast", "compile", "tensor_parallel", "sparse_gradients", "prescale_gradients",
    "gradient_predivide_factor", "seq_parallel_communication_data_type", "bfloat16_immediate_grad_update",
}  # fmt: skip
# Accepted without effect: they tune DeepSpeed internals that infinity does not have.
ACCEPTED_NO_EFFECT = {"zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "seed"}
TOP_LEVEL = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "fp16", "bf16", "bfloat16", "optimizer", "scheduler",
    "zero_optimization", "aio", "collective_timeout", "infinity",
} | OBSERVE_ONLY | NOT_IMPLEMENTED | ACCEPTED_NO_EFFECT  # fmt: skip

# DeepSpeed's deprecated zero_optimization keys, read with one deprecation warning each. cpu_offload_params is
# what DeepSpeed's older releases called cpu_offload_param.
_ZERO_LEGACY = {
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_params",
    "cpu_offload_use_pin_memory",
    "stage3_gather_fp16_weights_on_model_save",
}


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _typed_section(cls, section: str, raw: Mapping[str, Any], *, skip: set[str] = frozenset()):
    """Build a flat dataclass from a dict: known keys only, each checked against its annotated type."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section} must be an object, got {raw!r}")
    fields = _fields(cls)
    check_keys(section, {k: v for k, v in raw.items() if k not in skip}, set(fields) | set(skip))
    kwargs = {}
    for key, value in raw.items():
        if key in skip:
            continue
        annotation = str(fields[key].type)
        name = f"{section}.{key}"
        if annotation == "bool":
            kwargs[key] = as_bool(name, value)
        elif annotation == "bool | None":
            kwargs[key] = None if value is None else as_bool(name, value)
        elif annotation == "int":
            kwargs[key] = as_int(name, value, minimum=0)
        elif annotation == "float":
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            kwargs[key] = float(value)
        elif annotation == "dict":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name} must be an object, got {value!r}")
            kwargs[key] = dict(value)
        elif value is None or isinstance(value, str):
            kwargs[key] = value
        else:
            raise ConfigError(f"{name} must be a string, got {value!r}")
    return cls(**kwargs)


def _offload(cls, section: str, raw: Mapping[str, Any] | None, no_effect=None, refused=None):
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"{section} must be an object, got {raw!r}")
    raw = dict(raw or {})
    no_effect, refused = no_effect or {}, refused or {}
    check_keys(section, raw, {*_fields(cls), *no_effect, *refused})
    set_aside(section, raw, no_effect, refused)
    config = _typed_section(cls, section, raw)
    if config.device not in OFFLOAD_DEVICES:
        raise ConfigError(f"{section}.device must be one of {', '.join(OFFLOAD_DEVICES)}, got {config.device!r}")
    if config.device == "nvme" and not config.nvme_path:
        raise ConfigError(
            f"{section}.device is nvme but {section}.nvme_path is not set: give a directory on a fast disk"
        )
    return config


def _legacy_zero(raw: dict) -> None:
    """DeepSpeed's deprecated keys, mapped onto the current ones; given together with the current key, as
    DeepSpeed refuses it, an error (or for the gather flag, when the two disagree)."""
    legacy = {key: raw.pop(key) for key in sorted(_ZERO_LEGACY) if key in raw}
    for old, new, section in (("cpu_offload", "offload_optimizer.device", "offload_optimizer"),
                              ("cpu_offload_param", "offload_param.device", "offload_param"),
                              ("cpu_offload_params", "offload_param.device", "offload_param")):  # fmt: skip
        if old not in legacy:
            continue
        warn_legacy(f"zero_optimization.{old}", f"zero_optimization.{new}")
        if section in raw:
            raise ConfigError(
                f"zero_optimization.{old} (deprecated) and zero_optimization.{section} are both set; keep {section}"
            )
        if as_bool(f"zero_optimization.{old}", legacy[old]):
            raw[section] = {"device": "cpu"}
    if "cpu_offload_use_pin_memory" in legacy:
        warn_legacy("zero_optimization.cpu_offload_use_pin_memory", "offload_optimizer/offload_param.pin_memory")
        for key in ("offload_optimizer", "offload_param"):
            if key in raw and "pin_memory" not in raw[key]:
                raw[key] = {**raw[key], "pin_memory": bool(legacy["cpu_offload_use_pin_memory"])}
    if "stage3_gather_fp16_weights_on_model_save" in legacy:
        old, new = "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
        warn_legacy(f"zero_optimization.{old}", f"zero_optimization.{new}")
        if new in raw and raw[new] != legacy[old]:
            raise ConfigError(f"zero_optimization.{old} (deprecated) and zero_optimization.{new} disagree; keep {new}")
        raw[new] = legacy[old]


def _parse_zero(raw: Mapping[str, Any] | None) -> ZeroConfig:
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"zero_optimization must be an object, got {raw!r}")
    raw = dict(raw or {})
    known = {*_fields(ZeroConfig), *ZERO_FIELD_NAMES, *ZERO_NO_EFFECT, *ZERO_REFUSED, *_ZERO_LEGACY}
    check_keys("zero_optimization", raw, known)  # before any key is set aside: a typo's hint may be one of those
    one_name_each("zero_optimization", raw)  # both names of a key agree, also of one set aside (it names the user's)
    set_aside("zero_optimization", raw, ZERO_NO_EFFECT, ZERO_REFUSED)
    raw = one_name_each("zero_optimization", raw)
    _legacy_zero(raw)
    stage = as_int("zero_optimization.stage", raw.get("stage", 0), minimum=0)
    if stage > 3:
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    param_keys = set(raw["offload_param"]) if isinstance(raw.get("offload_param"), Mapping) else set()
    given = set(raw)
    raw.setdefault("overlap_comm", stage == 3)
    offload_optimizer = _offload(
        OffloadOptimizerConfig, "zero_optimization.offload_optimizer", raw.pop("offload_optimizer", None),
        OFFLOAD_OPTIMIZER_NO_EFFECT, OFFLOAD_OPTIMIZER_REFUSED,
    )  # fmt: skip
    offload_param = _offload(OffloadParamConfig, "zero_optimization.offload_param", raw.pop("offload_param", None))
    zero = _typed_section(ZeroConfig, "zero_optimization", raw)
    zero = dataclasses.replace(zero, offload_optimizer=offload_optimizer, offload_param=offload_param)
    if offload_param.enabled and stage < 3:
        raise ConfigError(
            f"zero_optimization.offload_param needs stage 3 (parameters are only partitioned there), but stage is "
            f"{stage}; set stage to 3 or remove offload_param"
        )
    if offload_optimizer.enabled and stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3; stage is 0")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size"):
        if getattr(zero, key) < 1:
            raise ConfigError(f"zero_optimization.{key} must be >= 1, got {getattr(zero, key)}")
    _say_idle_keys(zero, given, param_keys)
    return zero


_NVME_PARAM_KEYS = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")


def _say_idle_keys(zero: ZeroConfig, given: set[str], param_keys: set[str]) -> None:
    """Keys the user gave that act only at another stage or offload device: one line each, not a silent drop
    (DeepSpeed drops them silently)."""
    for key in sorted(given):
        if zero.stage < 3 and is_stage3_knob(key):
            say_no_effect(f"zero_optimization.{key}", f"a stage-3 knob, and the stage is {zero.stage}")
    if zero.stage == 3 and "allgather_bucket_size" in given:
        say_no_effect("zero_optimization.allgather_bucket_size",
                      "stages 1-2 only (stage 3 gathers unit by unit: stage3_prefetch_bucket_size)")  # fmt: skip
    if zero.stage < 3 and "sub_group_size" in given and zero.offload_optimizer.device != "nvme":
        say_no_effect("zero_optimization.sub_group_size",
                      "at stages 0-2 it sizes NVMe tiles, and offload_optimizer.device is not nvme")  # fmt: skip
    if zero.offload_param.device != "nvme":
        for key in sorted(param_keys & set(_NVME_PARAM_KEYS)):
            say_no_effect(f"zero_optimization.offload_param.{key}",
                          f"nvme only, and offload_param.device is {zero.offload_param.device}")  # fmt: skip


def resolve_batch_sizes(
    train: int | None, micro: int | None, accumulation: int | None, world_size: int
) -> tuple[int, int, int]:
    """DeepSpeed's rule: any two of the three determine the third; all three must agree.

    train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size.
    """

    def arithmetic(t, m, g):
        return (
            f"train_batch_size {t} != train_micro_batch_size_per_gpu {m} x gradient_accumulation_steps {g} x "
            f"world size {world_size} = {m * g * world_size}"
        )

    if train is not None and micro is not None and accumulation is not None:
        if train != micro * accumulation * world_size:
            raise ConfigError(
                arithmetic(train, micro, accumulation) + "; fix one of the three (or drop one and it is computed)"
            )
        return train, micro, accumulation
    if train is not None and micro is not None:
        if train % (micro * world_size):
            raise ConfigError(
                f"train_batch_size {train} is not divisible by train_micro_batch_size_per_gpu {micro} x "
                f"world size {world_size} = {micro * world_size}; gradient_accumulation_steps would not "
                "be a whole number"
            )
        return train, micro, train // (micro * world_size)
    if train is not None and accumulation is not None:
        if train % (accumulation * world_size):
            raise ConfigError(
                f"train_batch_size {train} is not divisible by gradient_accumulation_steps {accumulation}"
                f" x world size {world_size} = {accumulation * world_size}"
            )
        return train, train // (accumulation * world_size), accumulation
    if micro is not None:
        accumulation = accumulation or 1
        return micro * accumulation * world_size, micro, accumulation
    if train is not None:
        if train % world_size:
            raise ConfigError(f"train_batch_size {train} is not divisible by the world size {world_size}")
        return train, train // world_size, 1
    raise ConfigError(
        "set train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs one of them; "
        "gradient_accumulation_steps alone does not fix the batch)"
    )


@dataclass(frozen=True, slots=True)
class Unfilled:
    """An "auto" value nothing filled: its key, and what initialize() fills it from ("" when nothing does)."""

    key: str
    source: str = ""
    note: str = ""


class AutoError(ConfigError):
    """Every "auto" value that could not be filled, in one error. ``unfilled`` lets a front end that is not
    initialize() (`infinity train`) say what to set in its own terms."""

    def __init__(self, unfilled: list[Unfilled]) -> None:
        self.unfilled = tuple(unfilled)
        groups: dict[tuple[str, str], list[str]] = {}
        for item in self.unfilled:
            groups.setdefault((item.source, item.note), []).append(item.key)
        parts = []
        for (source, note), keys in groups.items():
            how = [note] if note else []
            if source:
                how.append(f"initialize() fills {'it' if len(keys) == 1 else 'them'} from {source}")
            parts.append(", ".join(keys) + (f" ({'; '.join(how)})" if how else ""))
        super().__init__('"auto" values with nothing to fill them (set each in the config): ' + "; ".join(parts))


_HIDDEN_SIZE_RULES = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
CLIPPING_NOTE = "0 disables clipping; Hugging Face's default max_grad_norm is 1.0"


def _fill_auto(raw: dict, auto: AutoValues) -> dict:
    """Replace "auto" by values from initialize()'s arguments; the ones left are one AutoError naming them all."""
    raw = json.loads(json.dumps(raw))  # deep copy; the caller's dict is never modified
    unfilled: list[Unfilled] = []

    def fill(node: dict, key: str, name: str, value, source: str, note: str = "") -> None:
        if value is None:
            unfilled.append(Unfilled(name, source, note))
        else:
            node[key] = value

    if raw.get("train_micro_batch_size_per_gpu") == AUTO:
        if auto.micro_batch_size is not None:
            raw["train_micro_batch_size_per_gpu"] = auto.micro_batch_size
        elif raw.get("train_batch_size") in (None, AUTO):  # else it follows from train_batch_size
            source = "the batch_size of a DataLoader passed as training_data="
            unfilled.append(Unfilled("train_micro_batch_size_per_gpu", source, "or set train_batch_size"))
    for section, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        if isinstance(raw.get(section), dict) and raw[section].get("enabled") == AUTO:
            enabled = None if auto.model_dtype is None else auto.model_dtype == dtype
            fill(raw[section], "enabled", f"{section}.enabled", enabled, "the model's floating-point dtype")
    if raw.get("gradient_clipping") == AUTO:
        unfilled.append(Unfilled("gradient_clipping", "", CLIPPING_NOTE))
    optimizer = raw.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("params"), dict):
        params = optimizer["params"]
        sources = {
            "lr": auto.lr,
            "betas": list(auto.betas) if auto.betas else None,
            "eps": auto.eps,
            "weight_decay": auto.weight_decay,
            "momentum": auto.momentum,
        }
        for key, value in params.items():
            if value == AUTO:
                source = "the param groups of a torch optimizer passed as optimizer=" if key in sources else ""
                fill(params, key, f"optimizer.params.{key}", sources.get(key), source)
    scheduler = raw.get("scheduler")
    if isinstance(scheduler, dict) and isinstance(scheduler.get("params"), dict):
        params = scheduler["params"]
        for key, value in params.items():
            if value == AUTO:
                peak = key == "warmup_max_lr"
                fill(params, key, f"scheduler.params.{key}", auto.lr if peak else None,
                     "the lr of a torch optimizer passed as optimizer=" if peak else "")  # fmt: skip
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        below_stage3 = zero.get("stage", 0) != 3
        for key, value in list(zero.items()):
            if value != AUTO:
                continue
            if below_stage3 and is_stage3_knob(key):
                del zero[key]  # as DeepSpeed: a stage-3 knob means nothing below stage 3, "auto" or not
                continue
            rule = _HIDDEN_SIZE_RULES.get(stage3_name(key))
            hidden = auto.hidden_size
            fill(zero, key, f"zero_optimization.{key}", None if rule is None or hidden is None else rule(hidden),
                 "the model's config.hidden_size" if rule else "")  # fmt: skip
    if unfilled:
        raise AutoError(unfilled)
    return raw


def offload_sections(config: str | os.PathLike | Mapping[str, Any]) -> tuple[ZeroConfig, AioSettings]:
    """zero_optimization and aio alone (what zero.Init reads), without the batch sizes a whole parse needs."""
    raw = load_json(config)
    zero = raw.get("zero_optimization")
    if isinstance(zero, Mapping):  # "auto" values need a model: zero.Init only reads offload_param
        raw["zero_optimization"] = {k: v for k, v in zero.items() if v != AUTO}
    return _parse_zero(raw.get("zero_optimization")), parse_aio(raw.get("aio"))


def parse_config(
    config: str | os.PathLike | Mapping[str, Any], *, world_size: int = 1, auto: AutoValues | None = None
) -> Config:
    """Parse and validate a DeepSpeed-style config (a dict or a JSON file path)."""
    raw = _fill_auto(load_json(config), auto or AutoValues())
    check_keys("config", raw, TOP_LEVEL)
    for key in sorted(OBSERVE_ONLY & set(raw)):
        warnings.warn(
            f"config section {key!r} only observes training in DeepSpeed; infinity does not implement it "
            "and ignores it",
            UserWarning,
            stacklevel=3,
        )
    for key in sorted(NOT_IMPLEMENTED & set(raw)):
        value = raw[key]
        harmless = value in (None, False) or (isinstance(value, dict) and not value.get("enabled", True))
        if not harmless:
            raise ConfigError(
                f"{key} is a DeepSpeed setting that infinity does not implement (it would change the "
                f"math or the memory); remove it from the config"
            )
    if "bfloat16" in raw:
        warn_legacy("bfloat16", "bf16")
        raw.setdefault("bf16", raw.pop("bfloat16"))

    batch = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = raw.get(key)
        batch[key] = None if value in (None, AUTO) else as_int(key, value, minimum=1)
    train, micro, accumulation = resolve_batch_sizes(
        batch["train_batch_size"],
        batch["train_micro_batch_size_per_gpu"],
        batch["gradient_accumulation_steps"],
        world_size,
    )
    fp16 = _typed_section(
        Fp16Config, "fp16", raw.get("fp16") or {}, skip={"auto_cast", "fp16_master_weights_and_grads"}
    )
    if (raw.get("fp16") or {}).get("auto_cast") or (raw.get("fp16") or {}).get("fp16_master_weights_and_grads"):
        raise ConfigError("fp16.auto_cast and fp16.fp16_master_weights_and_grads are not implemented; remove them")
    bf16 = _typed_section(Bf16Config, "bf16", raw.get("bf16") or {}, skip={"immediate_grad_update"})
    if fp16.enabled and bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; choose one precision")
    if fp16.enabled and fp16.loss_scale < 0:
        raise ConfigError(f"fp16.loss_scale must be 0 (dynamic) or positive, got {fp16.loss_scale}")
    optimizer = None
    if raw.get("optimizer") is not None:
        optimizer = _typed_section(OptimizerConfig, "optimizer", raw["optimizer"])
        if optimizer.type.lower() not in ("adam", "adamw", "sgd"):
            from infinity.optim import config_optimizer_class  # torch, only for the other names

            if config_optimizer_class(optimizer.type) is None:
                raise ConfigError(
                    f"optimizer.type {optimizer.type!r} is not supported: use Adam, AdamW, SGD, Adagrad, Lion or "
                    "a torch.optim class's name (or pass a torch optimizer to initialize())"
                )
    scheduler = None
    if raw.get("scheduler") is not None:
        scheduler = _typed_section(SchedulerConfig, "scheduler", raw["scheduler"])
        if scheduler.type not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            raise ConfigError(
                f"scheduler.type {scheduler.type!r} is not supported: use WarmupLR, WarmupDecayLR or "
                "WarmupCosineLR (or pass a scheduler to initialize())"
            )
    clipping = raw.get("gradient_clipping", 0.0)
    if isinstance(clipping, bool) or not isinstance(clipping, int | float) or clipping < 0:
        raise ConfigError(f"gradient_clipping must be a number >= 0 (0 disables it), got {clipping!r}")
    zero = _parse_zero(raw.get("zero_optimization"))
    infinity = _parse_infinity({} if raw.get("infinity") is None else raw["infinity"], zero, bf16=bf16.enabled,
                               clipping=float(clipping), fp16=fp16.enabled, accumulation=accumulation)  # fmt: skip
    return Config(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accumulation,
        world_size=world_size,
        gradient_clipping=float(clipping),
        steps_per_print=as_int("steps_per_print", raw.get("steps_per_print", 10), minimum=1),
        wall_clock_breakdown=as_bool("wall_clock_breakdown", raw.get("wall_clock_breakdown", False)),
        collective_timeout=collective_timeout_s(raw.get("collective_timeout")),
        fp16=fp16,
        bf16=bf16,
        optimizer=optimizer,
        scheduler=scheduler,
        zero=zero,
        aio=parse_aio(raw.get("aio")),
        infinity=infinity,
    )


def _parse_infinity(raw: Mapping[str, Any], zero: ZeroConfig, *, bf16: bool, clipping: float = 0.0,
                    fp16: bool = False, accumulation: int = 1) -> InfinitySection:  # fmt: skip
    section = _typed_section(InfinitySection, "infinity", raw)
    dtypes = ("fp32", "bf16", "int8")  # zero/compact.py's STATE_DTYPES
    if section.optimizer_state_dtype not in dtypes:
        raise ConfigError(f"infinity.optimizer_state_dtype must be one of {', '.join(dtypes)}; got "
                          f"{section.optimizer_state_dtype!r}")  # fmt: skip
    if section.optimizer_state_dtype != "fp32" and not zero.offload_optimizer.enabled:
        raise ConfigError(
            f'infinity.optimizer_state_dtype "{section.optimizer_state_dtype}" stores offloaded optimizer states: '
            'it needs zero_optimization.offload_optimizer.device "cpu" or "nvme" (set it, or drop the key)'
        )
    if section.offloaded_gradient_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"infinity.offloaded_gradient_dtype must be fp32 or bf16; got "
                          f"{section.offloaded_gradient_dtype!r}")  # fmt: skip
    if section.offloaded_gradient_dtype != "fp32" and not (zero.stage == 3 and zero.offload_optimizer.device == "nvme"):
        raise ConfigError(
            f'infinity.offloaded_gradient_dtype "{section.offloaded_gradient_dtype}" stores the gradient written '
            "to NVMe, which only stage 3 with zero_optimization.offload_optimizer.device \"nvme\" does (set them, "
            "or drop the key)"
        )
    if section.offloaded_master not in ("fp32", "split"):  # zero/split_master.py's MASTER_LAYOUTS
        raise ConfigError(f"infinity.offloaded_master must be fp32 or split; got "
                          f"{section.offloaded_master!r}")  # fmt: skip
    if section.offloaded_master == "split" and not (zero.offload_optimizer.enabled and bf16):
        raise ConfigError(
            'infinity.offloaded_master "split" keeps the fp32 master as the bf16 weight plus 16 low bits: it needs '
            'bf16.enabled true and zero_optimization.offload_optimizer.device "cpu" or "nvme" (set them, or drop '
            "the key)"
        )
    if section.step_behind_forward and not (zero.stage == 3 and zero.offload_optimizer.device == "nvme"):
        raise ConfigError(
            "infinity.step_behind_forward true hides the optimizer's NVMe reads and writes behind the forward: it "
            'needs zero_optimization.stage 3 and offload_optimizer.device "nvme" (set them, or drop the key)'
        )
    if section.step_behind_forward and section.offloaded_master == "split":
        raise ConfigError(
            'infinity.step_behind_forward true and offloaded_master "split" do not go together: split masters '
            "join with the pieces the step reads ahead itself (drop one of the keys)"
        )
    if section.step_in_backward:
        from infinity.zero.backward_step import config_refusal, refusal  # torch: only where the key is set

        why_not = config_refusal(
            zero, clip_norm=clipping, loss_scaling=fp16, accumulation=accumulation, driven_by_tiles=True,
            split_masters=section.offloaded_master == "split",
        )  # fmt: skip
        if why_not is not None:
            raise ConfigError(refusal(why_not))
    return section

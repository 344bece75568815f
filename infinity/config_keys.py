"""DeepSpeed's zero_optimization and offload keys that infinity reads under another name, accepts without
effect, or refuses: the tables config.py consults before it builds its dataclasses.

[Note: keys without effect]
A DeepSpeed config carries keys that tune DeepSpeed's own internals (how it schedules copies, which collective
it picks, a debugging switch). They change neither the memory nor the math of a run here, so refusing them would
only break configs written for DeepSpeed. Each is accepted, its value type-checked, and said once per process,
as one info line of the `infinity` logger naming the key and why it does nothing here, unless its value asks
for what infinity does anyway (``NoEffect.matches``: e.g. contiguous_gradients true). A key that would change
the memory or the math, and that infinity does not implement, is refused by name (``Refused``). The lines are
said only where the logger shows info lines (rank 0 once the engine set it up): a parse before that, as
`infinity train` makes to check its input, leaves the line for the engine's own parse.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infinity.errors import ConfigError

logger = logging.getLogger("infinity")

# DeepSpeed's zero_optimization declares these fields with the stage3_ name as an alias and accepts either;
# here the stage3_ name is the one kept.
ZERO_FIELD_NAMES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}


def stage3_name(key: str) -> str:
    """The name a zero_optimization key is kept under (a DeepSpeed field name becomes its stage3_ alias)."""
    return ZERO_FIELD_NAMES.get(key, key)


def is_stage3_knob(key: str) -> bool:
    return stage3_name(key).startswith("stage3_")


def one_name_each(section: str, raw: Mapping[str, Any]) -> dict:
    """``raw`` with DeepSpeed's field names replaced by their stage3_ aliases; both given and different is an
    error naming both."""
    out = dict(raw)
    for name, alias in ZERO_FIELD_NAMES.items():
        if name not in out:
            continue
        value = out.pop(name)
        if alias in out and out[alias] != value:
            raise ConfigError(
                f"{section}.{name} and {section}.{alias} are the same setting (DeepSpeed accepts either name) and "
                f"disagree ({_show(value)} vs {_show(out[alias])}); keep one"
            )
        out[alias] = value
    return out


@dataclass(frozen=True, slots=True)
class NoEffect:
    """A DeepSpeed key accepted without effect here ([Note: keys without effect])."""

    kind: type  # bool, int, float or dict: what the value must be
    reason: str
    matches: tuple = ()  # values that ask for what infinity does anyway: then nothing is said


@dataclass(frozen=True, slots=True)
class Refused:
    """A DeepSpeed setting infinity does not implement: any value but ``accepted`` is an error."""

    accepted: tuple
    why: str = "it would change the math or the memory"


ZERO_NO_EFFECT = {
    "contiguous_gradients": NoEffect(bool, "gradients always accumulate into contiguous per-bucket buffers", (True,)),
    "reduce_scatter": NoEffect(
        bool, "each stage has its one reduction (all-reduce at stages 0-1, reduce-scatter at 2-3); the reduced "
        "gradients are the same either way", (True,)),
    "allgather_partitions": NoEffect(bool, "updated weights are always all-gathered", (True,)),
    "round_robin_gradients": NoEffect(bool, "a DeepSpeed copy schedule for CPU offload; the gradients are the same",
                                      (False,)),
    "ignore_unused_parameters": NoEffect(
        bool, "a parameter that gets no gradient always gets a zero gradient, never an error", (True,)),
    "use_multi_rank_bucket_allreduce": NoEffect(
        bool, "each bucket is reduced by one collective; the reduced gradients are the same", (False,)),
    "memory_efficient_linear": NoEffect(bool, "torch's own linear is used", (False,)),
    "elastic_checkpoint": NoEffect(bool, "checkpoints load at any world size, stage or offload mode", (True,)),
    "legacy_stage1": NoEffect(bool, "there is one stage 1", (False,)),
    "log_trace_cache_warnings": NoEffect(
        bool, "a step that runs modules in another order always logs one warning", (True,)),
    "enable_sanity_checks": NoEffect(bool, "DeepSpeed's debugging checks", (False,)),
    "pipeline_loading_checkpoint": NoEffect(bool, "pipeline parallelism is not implemented", (False,)),
    "override_module_apply": NoEffect(
        bool, "under zero.Init a torch call on a partitioned parameter (module.apply's too) always sees it whole",
        (True,)),
    "stage3_use_all_reduce_for_fetch_params": NoEffect(
        bool, "a fetch is one all-gather into the unit's gathered buffer", (False,)),
    "stage3_allgather_sequential": NoEffect(
        bool, "a unit is gathered straight into its own buffer: there is no bucket to copy into", (False,)),
    "save_muon_momentum_buffer_in_memory": NoEffect(bool, "the Muon optimizer is not supported", (False,)),
    "leaf_module": NoEffect(
        dict, "units are whole modules and ranks agree on each fetch, so modules that run on some ranks only "
        "need no marking"),
}  # fmt: skip
ZERO_REFUSED = {
    "zero_hpz_partition_size": Refused((1,)),
    "zero_quantized_weights": Refused((False,)),
    "zero_quantized_gradients": Refused((False,)),
    "zero_quantized_nontrainable_weights": Refused((False,)),
    "mics_shard_size": Refused((-1,)),
    "mics_hierarchical_params_gather": Refused((False,)),
    "zeropp_loco_param": Refused((None,)),
    "zenflow": Refused((None,)),
    "stage3_module_granularity_threshold": Refused((0,)),
    "load_from_fp32_weights": Refused(
        (True,), "load_checkpoint always restores the fp32 masters from the checkpoint's fp32 arrays"),
}
OFFLOAD_OPTIMIZER_NO_EFFECT = {
    "fast_init": NoEffect(bool, "the initial optimizer states are always written tile by tile", (False,)),
    "cpuadam_cores_perc": NoEffect(float, "the step runs torch's optimizer on torch's threads"),
}
OFFLOAD_OPTIMIZER_REFUSED = {
    "ratio": Refused(
        (1.0,), "infinity offloads all optimizer states of the chosen device: partial offload is not implemented"),
    "super_offload": Refused((False,)),
}

_SAID: set[str] = set()


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _check_kind(name: str, kind: type, value: Any) -> None:
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is dict:
        ok = value is None or isinstance(value, Mapping)
    else:  # a number (int or float)
        ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok:
        what = {bool: "true or false", dict: "an object"}.get(kind, "a number")
        raise ConfigError(f"{name} must be {what}, got {value!r}")


def set_aside(section: str, raw: dict, no_effect: Mapping[str, NoEffect], refused: Mapping[str, Refused]) -> None:
    """Removes from ``raw`` the keys of the two tables (a zero_optimization field name counts as its stage3_
    alias): a refused value is an error, a key without effect is said once ([Note: keys without effect])."""
    for key in [k for k in raw if stage3_name(k) in refused]:
        value, rule = raw.pop(key), refused[stage3_name(key)]
        if value is not None and value not in rule.accepted:  # null: not set
            accepted = " or ".join(_show(v) for v in dict.fromkeys(rule.accepted) if v is not None)
            raise ConfigError(
                f"{section}.{key}={_show(value)} is a DeepSpeed setting that infinity does not implement "
                f"({rule.why}); remove it" + (f" or set {accepted}" if accepted else "")
            )
    for key in [k for k in raw if stage3_name(k) in no_effect]:
        value, rule = raw.pop(key), no_effect[stage3_name(key)]
        _check_kind(f"{section}.{key}", rule.kind, value)
        if value not in rule.matches:
            say_no_effect(f"{section}.{key}", rule.reason)


def say_no_effect(name: str, reason: str) -> None:
    """One info line per key and process, where the `infinity` logger shows info lines."""
    if name in _SAID or not logger.isEnabledFor(logging.INFO):
        return
    _SAID.add(name)
    logger.info("config key %s has no effect in infinity: %s", name, reason)

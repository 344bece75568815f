"""A DeepSpeed JSON's "auto" values filled from Transformers' TrainingArguments exactly as Transformers fills them
for DeepSpeed, so a config written for `TrainingArguments(deepspeed=...)` works unchanged.

Two phases, as in Transformers: ``fill_from_training_args`` when the TrainingArguments exist (batch sizes,
clipping, optimizer, precision, the scheduler's learning rates), ``fill_from_model`` once the model and the
number of training steps are known (the hidden-size-based ZeRO knobs, the scheduler's step counts). A key set to
"auto" takes the Trainer's value; a key set explicitly to a different value is an error that names both (the
run would not be the one the TrainingArguments describe); a key that is absent stays absent.

The arguments are read duck-typed (any object with TrainingArguments' field names), so nothing here imports
transformers."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from infinity.config import AUTO
from infinity.config_keys import ZERO_FIELD_NAMES, is_stage3_knob
from infinity.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    key: str  # dotted path in the config
    config_value: Any
    hf_key: str  # what TrainingArguments calls it
    hf_value: Any

    def __str__(self) -> str:
        return f"- config {self.key}={self.config_value!r} vs TrainingArguments {self.hf_key}={self.hf_value!r}"


class _Filler:
    """Walks dotted keys of one config dict, filling "auto" and collecting mismatches."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.mismatches: list[Mismatch] = []

    def _node(self, key: str) -> tuple[dict | None, str]:
        *path, leaf = key.split(".")
        node: Any = self.config
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def is_auto(self, key: str) -> bool:
        node, leaf = self._node(key)
        return node is not None and node.get(leaf) == AUTO

    def fill(self, key: str, value: Any, hf_key: str | None = None) -> None:
        """"auto" -> value; an explicit, different value is a mismatch unless ``hf_key`` is None (fill only)."""
        node, leaf = self._node(key)
        if node is None or leaf not in node:
            return
        current = node[leaf]
        if current == AUTO:
            node[leaf] = value
        elif hf_key is not None and current is not None and not _same(current, value):
            self.mismatches.append(Mismatch(key, current, hf_key, value))

    def raise_mismatches(self) -> None:
        if self.mismatches:
            lines = "\n".join(str(m) for m in self.mismatches)
            raise ConfigError(
                "the config contradicts the TrainingArguments (set these keys to \"auto\" or to the same value):\n"
                + lines
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def fill_from_training_args(config: Mapping[str, Any], args, *, world_size: int) -> dict:
    """Phase 1: what the TrainingArguments say. Returns a new dict; the caller's is not modified."""
    filler = _Filler(copy.deepcopy(dict(config)))
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    filler.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    filler.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    filler.fill("train_batch_size", world_size * micro * accumulation,
                "world size x per_device_train_batch_size x gradient_accumulation_steps")  # fmt: skip
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0)  # not a Trainer argument: filled, never compared
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filler.fill("fp16.enabled", bool(args.fp16 or getattr(args, "fp16_full_eval", False)), "fp16|fp16_full_eval")
    filler.fill("bf16.enabled", bool(args.bf16 or getattr(args, "bf16_full_eval", False)), "bf16|bf16_full_eval")
    filler.raise_mismatches()
    return filler.config


HIDDEN_SIZE_KEYS = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}
# DeepSpeed also reads these two under their field names (prefetch_bucket_size, ...), which Transformers does not
# fill: an "auto" there is filled as the stage3_ name is, not left for DeepSpeed to drop.
HIDDEN_SIZE_KEYS |= {
    f"zero_optimization.{name}": HIDDEN_SIZE_KEYS[f"zero_optimization.{alias}"]
    for name, alias in ZERO_FIELD_NAMES.items()
    if f"zero_optimization.{alias}" in HIDDEN_SIZE_KEYS
}


def hidden_size(model_config) -> int | None:
    """As Transformers picks it: hidden_size, else the largest of hidden_sizes, else the text model's."""
    if getattr(model_config, "hidden_size", None) is not None:
        return int(model_config.hidden_size)
    if getattr(model_config, "hidden_sizes", None):
        return int(max(model_config.hidden_sizes))
    text = getattr(model_config, "text_config", None)
    if text is not None and getattr(text, "hidden_size", None) is not None:
        return int(text.hidden_size)
    return None


def _is_stage3(config: Mapping[str, Any]) -> bool:
    zero = config.get("zero_optimization")
    return isinstance(zero, Mapping) and zero.get("stage") == 3


def fill_from_model(config: Mapping[str, Any], args, *, model_config, num_training_steps: int) -> dict:
    """Phase 2: the hidden-size-based ZeRO knobs and the scheduler's step counts."""
    filler = _Filler(copy.deepcopy(dict(config)))
    autos = [key for key in HIDDEN_SIZE_KEYS if filler.is_auto(key)]
    if autos:
        size = hidden_size(model_config)
        if size is None:
            raise ConfigError(
                f"the model's config has no hidden_size (nor hidden_sizes, nor text_config.hidden_size), so "
                f"{', '.join(autos)} cannot be \"auto\"; set numbers"
            )
        for key in autos:
            if is_stage3_knob(key.removeprefix("zero_optimization.")) and not _is_stage3(filler.config):
                continue  # as Transformers: left "auto" below stage 3, where nothing reads them
            filler.fill(key, HIDDEN_SIZE_KEYS[key](size))
    filler.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    # At least 1, as Transformers fills it: a schedule without warmup still needs a positive warmup_num_steps.
    filler.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
                "warmup_steps")  # fmt: skip
    filler.raise_mismatches()
    return filler.config

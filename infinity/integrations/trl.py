"""TRL's trainers on the infinity engine: the same two class names change as for the Trainer.

    args = InfinitySFTConfig(infinity="ds_config.json", ...)           # was SFTConfig
    trainer = InfinitySFTTrainer(model=model, args=args, ...)          # was SFTTrainer
    (and InfinityDPOConfig / InfinityDPOTrainer for DPOConfig / DPOTrainer)

The choice: InfinityTrainer is the mixin. Each of its overrides calls ``super()``, so it goes first in the bases
of any Trainer subclass and that class's own behaviour runs on the engine unchanged; the arguments class does the
same with InfinityTrainingArguments. The four names here are such pairs, and ``infinity_trainer`` builds the pair
for any other subclass (``infinity_trainer(KTOTrainer, KTOConfig)``), so no TRL trainer needs code of its own here.
What TRL takes from DeepSpeed is given by the engine instead:
- the fused LM head (every TRL loss since 1.x reads ``lm_head.weight`` directly, in a custom autograd function,
  and in its backward): TRL gathers it with ``maybe_gather_lm_head_ctx``, which under DeepSpeed wraps
  ``deepspeed.zero.GatheredParameters``; trl_patches makes it gather a stage-3 parameter of the engine's with
  the engine's GatheredParameters ([Note: TRL's fused head] in trl_patches.py);
- the reference model (DPO): TRL prepares it with DeepSpeed's inference engine; here the accelerator makes it an
  infinity inference engine at stage 3 (partitioned, its pieces on the tier ``offload_param`` names) and a model
  on the device in the compute dtype below (InfinityAccelerator.prepare_model);
- ``sync_ref_model``: the policy's weights are blended into the reference model's with both gathered.
"""

from __future__ import annotations

import dataclasses

from infinity.errors import ConfigError
from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as missing:  # pragma: no cover - the hf extra brings trl
    raise ImportError(
        "infinity.integrations.trl needs TRL: pip install 'infinity[hf]' (or pip install trl)"
    ) from missing

from infinity.integrations import trl_patches

trl_patches.install()


def infinity_trainer(trainer_class: type, config_class: type) -> tuple[type, type]:
    """A Trainer subclass and its arguments class, on the engine: (Infinity<Trainer>, Infinity<Config>), each the
    infinity class first in its bases, so the subclass's own overrides run on top of the engine's. Both are made
    once and kept in this module under their names, so pickle finds them (the Trainer saves its arguments with
    every checkpoint; loading them needs the same call first). A name this module already gives another class
    (its own pairs, or a pair made for another class of the same name) is refused: use that class."""
    made = []
    for base, ours in ((trainer_class, InfinityTrainer), (config_class, InfinityTrainingArguments)):
        name = f"Infinity{base.__name__}"
        existing = globals().get(name)
        if existing is not None and existing.__bases__ != (ours, base):
            raise ConfigError(
                f"infinity_trainer: {name} is already infinity.integrations.trl's name for another class "
                f"({existing.__module__}.{existing.__qualname__}, bases {[b.__qualname__ for b in existing.__bases__]})"
                f": use it, or give {base.__qualname__} another name"
            )
        if existing is None:
            existing = type(name, (ours, base), {"__module__": __name__, "__qualname__": name})
            if ours is InfinityTrainingArguments:
                existing = dataclasses.dataclass(existing)
            globals()[name] = existing
        made.append(existing)
    return made[0], made[1]


@dataclasses.dataclass
class InfinitySFTConfig(InfinityTrainingArguments, SFTConfig):
    """SFTConfig with ``infinity=`` (the DeepSpeed-style config)."""


class InfinitySFTTrainer(InfinityTrainer, SFTTrainer):
    """TRL's SFTTrainer on the engine (``args``: InfinitySFTConfig)."""


@dataclasses.dataclass
class InfinityDPOConfig(InfinityTrainingArguments, DPOConfig):
    """DPOConfig with ``infinity=`` (the DeepSpeed-style config)."""


class InfinityDPOTrainer(InfinityTrainer, DPOTrainer):
    """TRL's DPOTrainer on the engine (``args``: InfinityDPOConfig); the reference model is an inference engine at
    stage 3, as TRL makes it a DeepSpeed inference engine."""


__all__ = ["InfinityDPOConfig", "InfinityDPOTrainer", "InfinitySFTConfig", "InfinitySFTTrainer", "infinity_trainer"]

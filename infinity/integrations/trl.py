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
  ``deepspeed.zero.GatheredParameters``; imported here, it gathers a stage-3 parameter of the engine's with the
  engine's GatheredParameters ([Note: TRL's fused head]);
- the reference model (DPO): TRL prepares it with DeepSpeed's inference engine; here the accelerator makes it an
  infinity inference engine at stage 3 (partitioned, its pieces on the tier ``offload_param`` names) and a model
  on the device in the compute dtype below (InfinityAccelerator.prepare_model);
- ``sync_ref_model``: the policy's weights are blended into the reference model's with both gathered.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from infinity.integrations.transformers import InfinityTrainer, InfinityTrainingArguments

try:
    import trl
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
    from trl.trainer import callbacks as trl_callbacks
    from trl.trainer import utils as trl_utils
except ImportError as missing:  # pragma: no cover - the hf extra brings trl
    raise ImportError(
        "infinity.integrations.trl needs TRL: pip install 'infinity[hf]' (or pip install trl)"
    ) from missing

# [Note: TRL's fused head]
# TRL's losses project the hidden states through the LM head in tiles inside a custom autograd function
# (ChunkedLogProbFunction), handing it ``lm_head.weight`` itself. A custom function's apply() is not a torch call
# that the engine's fetch-on-use sees, and the function reads the weight's shape before any torch call on it: a
# released stage-3 parameter (numel 0, as DeepSpeed's) would be projected through an empty head, and its backward
# would return a gradient of the wrong shape. TRL asks for the gather itself, forward and backward, through
# maybe_gather_lm_head_ctx, which only knows DeepSpeed's parameters: the wrapper below gathers the engine's.


def _partitioned_by_infinity(param) -> bool:
    from infinity.zero.units import stage3_runtime

    return isinstance(param, nn.Parameter) and stage3_runtime(param) is not None


def _gather_lm_head(original, *params):
    """TRL's maybe_gather_lm_head_ctx, also for the engine's stage-3 parameters (every rank runs the same loss,
    so the gather is collective as TRL's is under DeepSpeed)."""
    ours = list({id(p): p for p in params if p is not None and _partitioned_by_infinity(p)}.values())
    if not ours:
        return original(*params)
    from infinity.zero import GatheredParameters

    return GatheredParameters(ours)


def _install_fused_head_gather() -> None:
    current = trl_utils.maybe_gather_lm_head_ctx
    if getattr(current, "__infinity__", False):
        return
    wrapper = functools.wraps(current)(functools.partial(_gather_lm_head, current))
    wrapper.__infinity__ = True
    trl_utils.maybe_gather_lm_head_ctx = wrapper  # the kernel's backward imports it from here at call time


_install_fused_head_gather()


def _sync_target_model(original, model, target_model, alpha):
    """SyncRefModelCallback's blend (target = (1 - alpha) target + alpha model) where either model is the engine's
    at stage 3: module by module, the policy's parameters gathered and the reference's gathered with rank 0's
    blend kept, so no more than one module of each is ever whole."""
    model, target_model = (getattr(m, "module", m) for m in (model, target_model))  # an engine: its model
    if not any(_partitioned_by_infinity(p) for p in (*model.parameters(), *target_model.parameters())):
        return original(model, target_model, alpha)
    from infinity.zero import GatheredParameters

    done: set[int] = set()  # a tied parameter is registered on two modules: blended once
    for source, target in zip(model.modules(), target_model.modules(), strict=True):
        pairs = [(t, s) for t, s in zip(target.parameters(recurse=False), source.parameters(recurse=False),
                                        strict=True) if id(t) not in done]  # fmt: skip
        if not pairs:
            continue
        done.update(id(t) for t, _ in pairs)
        with GatheredParameters([s for _, s in pairs]), GatheredParameters([t for t, _ in pairs], modifier_rank=0):
            for target_param, source_param in pairs:
                target_param.data.mul_(1.0 - alpha).add_(source_param.data, alpha=alpha)


def _install_ref_sync() -> None:
    current = trl_callbacks.SyncRefModelCallback.__dict__["sync_target_model"].__func__
    if getattr(current, "__infinity__", False):
        return
    wrapper = functools.wraps(current)(functools.partial(_sync_target_model, current))
    wrapper.__infinity__ = True
    trl_callbacks.SyncRefModelCallback.sync_target_model = staticmethod(wrapper)


_install_ref_sync()


def infinity_trainer(trainer_class: type, config_class: type) -> tuple[type, type]:
    """A Trainer subclass and its arguments class, on the engine: (Infinity<Trainer>, Infinity<Config>), each the
    infinity class first in its bases, so the subclass's own overrides run on top of the engine's."""
    bases = (InfinityTrainingArguments, config_class)
    config = dataclasses.dataclass(type(f"Infinity{config_class.__name__}", bases, {"__module__": __name__}))
    trainer = type(f"Infinity{trainer_class.__name__}", (InfinityTrainer, trainer_class), {"__module__": __name__})
    return trainer, config


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


__all__ = ["InfinityDPOConfig", "InfinityDPOTrainer", "InfinitySFTConfig", "InfinitySFTTrainer", "infinity_trainer",
           "trl"]  # fmt: skip

"""What TRL takes from DeepSpeed, given by the engine: TRL's fused-head gather and sync_ref_model's blend, extended
to the engine's stage-3 parameters. Installed by infinity.integrations.trl and again by every InfinityTrainer in a
process where TRL is loaded (a TRL trainer class made by hand gets them too; a repeat wraps nothing twice). Kept
apart from trl.py, which imports the Trainer classes, so that transformers.py can install these without an import
circle."""

from __future__ import annotations

import functools
import sys

from torch import nn
from trl.trainer import callbacks as trl_callbacks
from trl.trainer import utils as trl_utils

# [Note: TRL's fused head]
# TRL's losses project the hidden states through the LM head in tiles inside a custom autograd function
# (ChunkedLogProbFunction), handing it ``lm_head.weight`` itself. A custom function's apply() is not a torch call
# that the engine's fetch-on-use sees, and the function reads the weight's shape before any torch call on it: a
# released stage-3 parameter (numel 0, as DeepSpeed's) would be projected through an empty head, and its backward
# would return a gradient of the wrong shape. TRL asks for the gather itself, forward and backward, through
# maybe_gather_lm_head_ctx, which only knows DeepSpeed's parameters: the wrapper below gathers the engine's.


def _partitioned_by_infinity(param) -> bool:
    """A stage-3 parameter of a live engine's, or one zero.Init partitioned before any engine (a model loaded
    partitioned and evaluated before train())."""
    from infinity.zero.init import init_shard
    from infinity.zero.units import stage3_runtime

    return isinstance(param, nn.Parameter) and (stage3_runtime(param) is not None or init_shard(param) is not None)


def _gather_lm_head(original, *params):
    """TRL's maybe_gather_lm_head_ctx, also for the engine's stage-3 parameters (every rank runs the same loss,
    so the gather is collective as TRL's is under DeepSpeed)."""
    ours = list({id(p): p for p in params if p is not None and _partitioned_by_infinity(p)}.values())
    if not ours:
        return original(*params)
    from infinity.zero import GatheredParameters

    return GatheredParameters(ours)


def _install_fused_head_gather() -> None:
    """trl.trainer.utils' helper replaced (its own fused forward and the log-prob kernel's backward look it up
    there at call time), and any TRL module that imported it by name already (the distillation kernel imports it
    once, when first imported) pointed at the wrapper; a module imported later takes the wrapper from utils."""
    original = trl_utils.maybe_gather_lm_head_ctx
    if getattr(original, "__infinity__", False):
        original = original.__wrapped_original__
        wrapper = trl_utils.maybe_gather_lm_head_ctx
    else:
        wrapper = functools.wraps(original)(functools.partial(_gather_lm_head, original))
        wrapper.__infinity__ = True
        wrapper.__wrapped_original__ = original
        trl_utils.maybe_gather_lm_head_ctx = wrapper
    for name, module in list(sys.modules.items()):
        if name.startswith("trl.") and getattr(module, "maybe_gather_lm_head_ctx", None) is original:
            module.maybe_gather_lm_head_ctx = wrapper


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


def install() -> None:
    """Both wrappers (again where TRL modules were imported since: they are pointed at them too). A TRL without
    the fused head (before 1.16) has nothing to wrap there."""
    if hasattr(trl_utils, "maybe_gather_lm_head_ctx"):
        _install_fused_head_gather()
    _install_ref_sync()

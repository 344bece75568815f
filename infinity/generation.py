"""generate() under ZeRO-3 at world size > 1: every rank keeps running forward passes until all have finished.

[Note: synced generation]
At stage 3 every forward takes part in collectives (the fetch rendezvous, [Note: fetch rendezvous] in
zero/rendezvous.py), so when one rank's sequences end early (an eos, a shorter max_new_tokens) it must keep
running dummy forwards until every rank is done, or the others wait in their next fetch for a rank that has left.
Transformers does exactly that with ``generate(synced_gpus=True)``, but turns it on by itself only for real
DeepSpeed ZeRO-3 (an HfDeepSpeedConfig alive) or FSDP; for this engine it would be off. So while a stage-3 engine
at world size > 1 is alive, the model's own ``generate`` defaults ``synced_gpus`` to True: an instance attribute
wrapping the class's method, removed with the engine's hooks. Chosen over patching transformers (whose internals
change between versions) and over an engine-only ``generate`` (DeepSpeed's ZeRO-Inference code calls
``engine.module.generate``, as do Trainer and pipelines). An explicit ``synced_gpus=False`` is respected: ranks
that then stop at different lengths fail within collective_timeout with an error naming the collective. The
wrapper is a plain function in the instance's ``__dict__``, so it does not survive pickling (``torch.save(model)``)
and a deep copy calls the original model's generate; neither means anything for a model whose parameters are
stage-3 placeholders anyway (save_16bit_model gives the weights).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

SYNCED = "synced_gpus"

# [Note: generation gathered once]
# At stage 3 a forward gathers each unit before its module runs and releases it after (within
# stage3_max_live_parameters), and every torch call of the pass goes through the fetch-on-use mode: fine for a
# training step, costly for generate(), which runs one short forward per token (measured: 0.39x plain PyTorch's
# tokens/s on a small GPT-2 with everything in memory). When the whole model fits stage3_max_live_parameters,
# generate() gathers it once for the call (GatheredParameters over every parameter), and forwards without
# gradients then skip the fetching machinery altogether (Stage3.gather), as DeepSpeed users get with TRL's
# unwrap_model_for_generation; the units go back to their pieces when it returns. A model larger than that
# streams its units as before, which the engine says once at initialize().


@dataclass(eq=False, slots=True)
class SyncedGenerate:
    """The installed default; ``remove()`` puts back what was there (a handle among the engine's hooks)."""

    module: nn.Module | None
    previous: object | None  # an instance attribute ``generate`` that was there before, else None

    def remove(self) -> None:
        if self.module is None:
            return
        if self.previous is not None:
            self.module.__dict__["generate"] = self.previous
        else:
            self.module.__dict__.pop("generate", None)
        self.module = None


def default_synced_generate(module: nn.Module, *, synced: bool = True,
                            whole: Callable[[], contextlib.AbstractContextManager] | None = None
                            ) -> SyncedGenerate | None:  # fmt: skip
    """Makes ``module.generate(...)`` pass synced_gpus=True unless the caller gives a value, where ``synced``
    ([Note: synced generation]), and run inside ``whole()`` where given (the model gathered once for the whole
    call: [Note: generation gathered once]). None when the module has no generate taking synced_gpus or passing
    keyword arguments on (not a transformers or PEFT model), or when there is nothing to do."""
    original = getattr(module, "generate", None)
    if original is None or not callable(original) or not (synced or whole):
        return None
    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return None
    names = list(parameters)
    if SYNCED in names:
        position = names.index(SYNCED)  # in the bound method's signature: args before it are positional
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        position = 1 << 30  # a wrapper passing **kwargs on (a PEFT model's generate): only by keyword
    else:
        return None

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if synced and len(args) <= position and kwargs.get(SYNCED) is None:
            kwargs[SYNCED] = True
        with whole() if whole is not None else contextlib.nullcontext():
            return original(*args, **kwargs)

    previous = module.__dict__.get("generate")
    module.__dict__["generate"] = generate
    return SyncedGenerate(module=module, previous=previous)

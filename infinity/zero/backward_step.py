"""The optimizer step taken in the boundary's backward, unit by unit, as each unit's reduced gradient is final.

[Note: step in backward]
With the optimizer offloaded to host memory, the reduced fp32 gradient is the one thing of the step that exists
only between backward and step: 4 bytes an element of the rank's shard, held whole at the end of backward, when
the backward's own buffers are still there. Where nothing needs the whole gradient before the step (no clipping,
no fp16 loss scale to check for overflow) and the window is one backward, each unit's tiles can step as soon as
its reduced piece arrives, and the piece goes back to the reduction's spares at once: no whole gradient is ever
held (on gpt2-large, 2.9 GiB less at the peak). Each tile runs the same kernel on the same gradient values as in
engine.step(), so the results are bitwise the same (tests/distributed/test_step_in_backward.py). A piece reduced
on an accelerator is copied into one reused host buffer first, where the norm is taken as the flat gradient's
would be; the step runs on the thread that runs backward, so on a GPU it does not overlap the device's work.

A unit steps only once every rank has launched its reduction, so after its last use in this backward on every
rank (its gradient is final there too): a peer's gather of its piece after that reads new values only for
parameters it no longer differentiates through. The one use that could see them is a trainable weight read
outside autograd (``w.detach()``) later in the backward than its last differentiable use: unsupported, as
with any step in backward.

What the step needs from the rest of the window is kept as the units step: each piece's squares (the norm
engine.step() reports; the same sum in the same order as the flat gradient's), the hyperparameters (read when the
backward starts, and checked unchanged when the step counts: changing the learning rate between backward and
step would otherwise act a step late without a word). engine.step() then counts the step (the step counts, the
persistent units regathered); nothing is freed, since nothing was held.

Between the two the model is between steps: the weights and states are the new ones, the step counts, the
scheduler and the persistent parameters the old ones. So whatever would read that mix, or needed the gradient,
is refused by name until engine.step(): the gradient helpers, the state helpers, the engine's forward, a save,
optimizer.zero_grad(), a second backward (it would have added up: gradient_accumulation_steps does that); the
model called directly and GatheredParameters are not watched (they see the new weights, the persistent units the
old ones). A backward that stops part way leaves some units stepped: engine.step() refuses, and
engine.load_checkpoint() forgets the half-taken step and the reduction's partial buckets and replaces the state
(at world size 1: with several ranks a failure inside backward ends the run, as any failed collective does).
Where any of that is wanted, ``infinity.step_in_backward: false`` keeps the whole step in engine.step(). The
rule, and the reasons it does not apply elsewhere: ``can_step_in_backward``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KEY = "infinity.step_in_backward"


def can_step_in_backward(*, offloaded_to_host: bool, clip_norm: float, loss_scaling: bool, driven_by_tiles: bool,
                         split_masters: bool) -> str | None:  # fmt: skip
    """None where the step can run in backward, else why not (for the error when the key asks for it): the
    optimizer in host memory (on NVMe its step runs behind the next forward instead, where the disk is idle), no
    clipping and no fp16 loss scaling (both need the whole gradient's norm first), torch's Adam, AdamW or SGD
    driven tile by tile (another class's step keeps state of its own between tiles), unsplit masters."""
    if not offloaded_to_host:
        return 'it needs zero_optimization.stage 3 and offload_optimizer.device "cpu"'
    if clip_norm > 0:
        return "gradient_clipping needs the whole gradient's norm before any unit steps"
    if loss_scaling:
        return "fp16's loss scale needs the whole gradient checked for overflow before any unit steps"
    if not driven_by_tiles:
        return "the optimizer's own step() runs over the whole state (torch's Adam, AdamW and SGD step unit by unit)"
    if split_masters:
        return 'infinity.offloaded_master "split" joins the masters with pieces the step reads ahead itself'
    return None


def config_refusal(zero, *, clip_norm: float, loss_scaling: bool, accumulation: int, driven_by_tiles: bool,
                   split_masters: bool) -> str | None:  # fmt: skip
    """``can_step_in_backward`` on a config's fields (``zero``: its zero_optimization section), and one backward
    a window: None where the step can run in backward, else why not. One rule for the key's check and the
    estimate, so that the two cannot drift apart."""
    why_not = can_step_in_backward(
        offloaded_to_host=zero.stage == 3 and zero.offload_optimizer.device == "cpu", clip_norm=clip_norm,
        loss_scaling=loss_scaling, driven_by_tiles=driven_by_tiles, split_masters=split_masters,
    )  # fmt: skip
    if why_not is None and accumulation > 1:
        why_not = "gradient_accumulation_steps > 1 holds the window's earlier gradients until its last backward"
    return why_not


def config_steps_in_backward(config) -> bool:
    """Whether an engine on this ``Config`` takes the step in backward (``infinity estimate`` counts no whole
    gradient then): ``config_refusal`` with the JSON's optimizer (none named: the estimate's AdamW), and the key
    not false. A client optimizer of another class, or a step pre-hook, keeps the step in engine.step() at run
    time, which this cannot see."""
    if config.infinity.step_in_backward is False:
        return False
    kind = config.optimizer.type.lower() if config.optimizer is not None else "adamw"
    return config_refusal(
        config.zero, clip_norm=config.gradient_clipping, loss_scaling=config.fp16.enabled,
        accumulation=config.gradient_accumulation_steps, driven_by_tiles=kind in ("adam", "adamw", "sgd"),
        split_masters=config.infinity.offloaded_master == "split",
    ) is None  # fmt: skip


def refusal(why_not: str) -> str:
    """What the key set to true says where the step cannot run in backward (``can_step_in_backward``'s reason)."""
    return f"{KEY} true: {why_not} (drop the key, or set it false)"


def hyperparameters(param_groups: Sequence[dict]) -> list[dict[str, float | int | bool]]:
    """The groups' numeric settings: numbers, one-element tensors (a capturable lr), tuples of numbers (betas)."""
    kept = []
    for group in param_groups:
        numbers_of = {}
        for key, value in group.items():
            if key == "params":
                continue
            if torch.is_tensor(value) and value.numel() == 1:
                value = value.item()
            is_numbers = isinstance(value, tuple) and all(isinstance(v, numbers.Number) for v in value)
            if is_numbers or isinstance(value, numbers.Number):
                numbers_of[key] = value
        kept.append(numbers_of)
    return kept


@dataclass(slots=True)
class BackwardStep:
    """One step taken in a backward: which units have stepped, their gradients' squares, the hyperparameters."""

    units: frozenset[int]  # the units with tiles: each steps once
    settings: list[dict[str, float | int | bool]]  # ``hyperparameters`` when the backward started
    squares: dict[int, float] = field(default_factory=dict)  # unit -> its reduced piece's squared norm
    stepped: set[int] = field(default_factory=set)
    gradient: tuple[int, torch.Tensor] | None = None  # the unit stepping now and its reduced piece
    ended: bool = False  # the step counts (engine.step(), or whatever read the state first)

    @property
    def complete(self) -> bool:
        return self.stepped >= self.units

    def changed_setting(self, param_groups: Sequence[dict]) -> str | None:
        """The first hyperparameter that differs from the backward's, described; None if none does."""
        for index, (before, now) in enumerate(zip(self.settings, hyperparameters(param_groups), strict=True)):
            for key, value in before.items():
                if now.get(key, value) != value:
                    return f"param group {index}'s {key} ({value} in backward, {now[key]} at engine.step())"
        return None

    def describe(self) -> str:
        return f"{len(self.stepped)} of {len(self.units)} units stepped"

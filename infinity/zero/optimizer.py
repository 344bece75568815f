"""The partitioned step shared by ZeRO stages 0-3 (optionally offloaded to host memory or NVMe); stages 0-2 lay it
out in bucket_optimizer.py, stage 3 in unit_optimizer.py.

Layout (see [Note: bucket-sharded layout] in partition.py): the model's trainable parameters become views into
flat per-bucket weight buffers in the compute dtype; each rank keeps fp32 masters of its pieces (stage 0: of
everything; in fp32 without offload the masters are those pieces of the weights themselves, one per bucket, with
no copy), the matching fp32 gradient shard while a window's gradients exist ([Note: gradient shards]), and the
optimizer states for exactly those elements. The user's torch optimizer is kept (so schedulers bound to it keep
working) and re-pointed at the masters, as DeepSpeed does. A step: unscale -> overflow check across ranks (fp16)
-> global-norm clipping -> the torch optimizer on the masters (tiles, with offload or at stage 3) -> new
low-precision pieces -> all-gather per bucket.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from infinity.comm import Comm
from infinity.memory.tiers import Tier, TierManager
from infinity.zero import collectives
from infinity.zero.compact import codecs_for
from infinity.zero.elementwise import run_step_hooks, seed_states
from infinity.zero.gradient_shards import GradientShards, gradient_device
from infinity.zero.grads import piece_squares
from infinity.zero.reducer import GradientReducer
from infinity.zero.tiles import TiledStep, cut, rule_for
from infinity.zero.unused import last_uses


@dataclass(frozen=True, slots=True)
class Offload:
    """Where the optimizer's masters and states live when offloaded ([Note: tiles] in tiles.py)."""

    manager: TierManager
    home: Tier  # HOST or NVME
    tile_numel: int  # the plan's: every rank cuts the same tiles ([Note: one plan] in memory/plan.py)
    pipeline_read: bool
    pipeline_write: bool
    gradients: TierManager | None = None  # stage 3 on NVMe: the gradient's tier ([Note: swapped gradients])
    state_dtype: str = "fp32"  # how the tiles store the states ([Note: compact states] in compact.py)
    gradient_dtype: torch.dtype = torch.float32  # how ``gradients`` stores them (infinity.offloaded_gradient_dtype)
    master_layout: str = "fp32"  # "split": residuals beside the bf16 weights ([Note: split masters])


@dataclass(frozen=True, slots=True)
class StepResult:
    stepped: bool  # False when skipped for an fp16 overflow
    grad_norm: float  # global L2 norm of the (unscaled) gradient, before clipping


class PartitionedOptimizer:
    """The step shared by every stage: fp32 masters and the reduced gradient per param group, the user's optimizer
    re-pointed at the masters. Subclasses lay the shards out and publish the new weights."""

    optimizer: torch.optim.Optimizer
    comm: Comm
    stage: int
    device: torch.device
    masters: list[nn.Parameter]
    gradients_in_memory: GradientShards | None  # the reduced gradient ([Note: gradient shards]); None: on NVMe
    reducer: GradientReducer
    _hooks: list
    _no_grad_marks: dict[int, Callable[[], None]]  # id(param) -> what to do when it gets no gradient
    tiled: TiledStep | None = None  # offloaded: masters and states in tiles, no ``masters``
    masters_are_weights: bool = False  # stages 0-2 in fp32 without offload: each master is a piece of the weights
    steps_behind_forward: bool = False  # stage 3, optimizer on NVMe: the step runs behind the next forward
    steps_in_backward: bool = False  # stage 3, optimizer in host memory: the boundary's backward takes the step
    gradient_taken_by_step: bool = False  # ... and did: no gradient exists until the next backward
    steps_taken_in_backward: int = 0

    def _make_tiled(self, optimizer: torch.optim.Optimizer, runs, offload: Offload, masters=None) -> TiledStep:
        # Before any work: an optimizer offload cannot run is a ConfigError.
        rule = rule_for(optimizer, in_memory=offload.home is Tier.DEVICE)
        tiled = TiledStep(
            tiles=cut(runs, offload.tile_numel), rule=rule, manager=offload.manager, home=offload.home,
            grads=self._tile_grad, weights=self._tile_weight, groups=len(optimizer.param_groups),
            pipeline_read=offload.pipeline_read,
            pipeline_write=offload.pipeline_write, masters=masters,
            codecs=codecs_for(offload.state_dtype, rule.states, type(optimizer).__name__),
            split_masters=self._tile_current_weight if offload.master_layout == "split" else None,
            forget_weights=self._forget_current_weights,
        )  # fmt: skip
        for group in optimizer.param_groups:
            group["params"] = []  # the masters live in the tiles; the groups keep the hyperparameters
        optimizer.state.clear()
        return tiled

    def _tile_current_weight(self, tile) -> torch.Tensor:
        """The tile's compute-dtype weights as they are now, read only (split masters join with them)."""
        raise NotImplementedError

    def _forget_current_weights(self) -> None:
        """Lets go of any copy ``_tile_current_weight`` keeps."""

    def _tiles_as_parameters(self) -> None:
        """A rule without its own update: the user's optimizer gets each tile's master as a parameter."""
        if self.tiled.rule.update is None:
            for tile, param in zip(self.tiled.tiles, self.tiled.as_parameters(), strict=True):
                self.optimizer.param_groups[tile.group]["params"].append(param)
            if self.tiled.rule.starts is not None:
                seed_states(self.optimizer, self.tiled.rule.starts)  # a state the class builds in __init__

    def prefetch_states(self, *, gradients: bool = True) -> None:
        """At the end of the boundary's backward: start reading the first tiles of the step (``gradients``
        False: the call at its start, which stages 1-2 do not use)."""
        if self.tiled is not None and gradients:
            self.tiled.prefetch()

    # ---- backward ----
    def begin_backward(self, loss: torch.Tensor, *, boundary: bool, loss_scale: float = 1.0) -> None:
        """Before ``loss.backward()``: parameters that will get no gradient count as done at once
        ([Note: unused parameters] in unused.py). ``loss_scale``: what the loss was multiplied by (fp16)."""
        uses = last_uses(loss)
        self.reducer.begin_backward(boundary=boundary, predicted=self._predicted_order(uses))
        if uses is None:
            return
        for key, mark in self._no_grad_marks.items():
            if key not in uses:
                mark()

    def _predicted_order(self, uses: dict[int, int] | None) -> list[int] | None:
        """The order backward will complete the gradient buckets in, read from the graph (stages 0-2: stage 3
        agrees on its own, [Note: launch order]); None where the graph cannot tell."""
        return None

    def _track_frozen(self, params: list[nn.Parameter], on_grad: Callable[[], None] | None = None) -> None:
        """Parameters the optimizer does not update but autograd may give a gradient (trainable, yet not passed
        to the optimizer): they behave as frozen, their gradients are dropped as they arrive."""
        for param in params:
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(drop_grad(on_grad)))
                if on_grad is not None:
                    self._no_grad_marks[id(param)] = on_grad

    # ---- the step ----
    @property
    def step_pending(self) -> bool:
        """A step is under way behind the next forward ([Note: step behind forward] in unit_optimizer.py)."""
        return False

    def finish_step(self) -> None:
        """Finishes a step under way behind the forward, if any."""

    def abandon_backward_step(self) -> bool:
        """Forgets a step a backward began and did not finish ([Note: step in backward]): a load replaces it.
        Whether there was one."""
        return False

    def step(self, *, loss_scale: float, clip_norm: float, check_overflow: bool) -> StepResult:
        self.finish_step()
        self._collect_grads()
        if loss_scale != 1.0:
            self._scale_grads(1.0 / loss_scale)
        squares = self._global_squares()
        if check_overflow and not math.isfinite(squares):  # an element is not finite on some rank (piece_squares)
            self.zero_grad()
            return StepResult(stepped=False, grad_norm=math.inf)
        norm = math.sqrt(squares)
        if clip_norm > 0:
            coefficient = min(clip_norm / (norm + 1e-6), 1.0)
            if coefficient < 1.0:
                self._scale_grads(coefficient)
        if self.tiled is not None:
            driven = self.tiled.rule.update is not None  # else the user's step() runs, with its hooks
            if driven:
                run_step_hooks(self.optimizer, post=False)
            self._step_tiles()
            if driven:
                run_step_hooks(self.optimizer, post=True)
        else:
            grads = self.grad_shards
            for master, (group, first) in zip(self.masters, self._master_at, strict=True):
                master.grad = grads[group][first : first + master.numel()]
            self.optimizer.step()
            for master in self.masters:
                master.grad = None
            self._publish_weights()
        if not self.step_pending:
            self.zero_grad()
        else:  # the gradient goes once the last unit stepped; the reduction's spare buffers go now
            self.reducer.drop_spares()
        return StepResult(stepped=True, grad_norm=norm)

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        """The window's reduced fp32 gradient per group (stage 3: one flat shard), complete; none on NVMe."""
        return [] if self.gradients_in_memory is None else self.gradients_in_memory.tensors()

    def _collect_grads(self) -> None:
        """Brings the reduced gradients into grad_shards (stages 0-2 reduce straight into them)."""

    def _scale_grads(self, factor: float) -> None:
        for grad in self.grad_shards:
            grad.mul_(factor)

    def _publish_weights(self) -> None:
        raise NotImplementedError

    def _step_tiles(self) -> None:
        raise NotImplementedError

    def _local_squares(self) -> torch.Tensor:
        """This rank's share of the squared global norm, float64, on the device."""
        total = 0.0
        for grad in self.grad_shards:
            total += piece_squares(grad)
        return torch.tensor([total], dtype=torch.float64, device=self.device)

    def _global_squares(self) -> float:
        """The whole gradient's squared L2 norm: squares summed over this rank's disjoint pieces, then across
        ranks (one collective, which is also fp16's overflow check: not finite where any rank's gradient is not)."""
        squares = self._local_squares()
        if self.stage > 0:
            collectives.all_reduce_sum_(self.comm, squares)
        return squares.item()

    def global_grad_norm(self) -> float:
        """L2 norm of the whole gradient."""
        return math.sqrt(self._global_squares())

    def zero_grad(self) -> None:
        """After the step, taken or skipped: the gradient is freed ([Note: gradient shards]), stage 2's spare
        reduce buffers too."""
        if self.gradients_in_memory is not None:
            self.gradients_in_memory.free()
        self.reducer.drop_spares()

    # ---- accounting ----
    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 masters (unless the fp32 weights are the masters: fp32
        without offload, any stage) plus every optimizer state tensor."""
        if self.tiled is not None:
            return self.tiled.state_bytes()
        total = 0 if self.masters_are_weights else sum(m.numel() * m.element_size() for m in self.masters)
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return total

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._no_grad_marks.clear()
        self.reducer.drop_spares(all_of_them=True)
        if self.tiled is not None:
            self.tiled.close()


def gradient_shards_for(layouts, device: torch.device, offload: Offload | None) -> GradientShards:
    """The reduced gradient: in host memory when the optimizer is offloaded ([Note: gradient shards])."""
    offloaded = offload is not None and offload.home is not Tier.DEVICE
    return GradientShards.for_layouts(layouts, gradient_device(device, offloaded=offloaded),
                                      pin_memory=offloaded and offload.manager.pin_memory)  # fmt: skip


def drop_grad(then: Callable[[], None] | None):
    def hook(param: torch.Tensor) -> None:
        param.grad = None
        if then is not None:
            then()

    return hook

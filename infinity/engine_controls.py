"""DeepSpeed's engine methods that change training state between steps: zero_grad, set_train_batch_size,
set_gradient_accumulation_boundary and empty_partition_cache. A mixin of Engine (engine.py), kept apart so the
engine's module stays about forward, backward and step."""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger("infinity")


class EngineControls:
    """Mixed into Engine: it provides config, comm, micro_steps, global_steps, zero_optimizer, stage3 and
    ``_backward_pending``."""

    _boundary_override: bool | None = None

    def zero_grad(self) -> None:
        """DeepSpeed's: drops the gradient accumulated so far in this window (every rank's reduced partition),
        so the next backward starts a fresh one. The window's micro-step count is left as it is."""
        self.zero_optimizer.zero_grad()
        for param in self.module.parameters():
            param.grad = None
        self._backward_pending = False

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch size, reached by changing gradient_accumulation_steps (the micro-batch
        stays). Between optimizer steps only: the window in progress would otherwise be cut to another length."""
        micro, world = self.config.train_micro_batch_size_per_gpu, self.comm.world_size
        if not isinstance(train_batch_size, int) or train_batch_size < 1 or train_batch_size % (micro * world):
            raise ValueError(
                f"set_train_batch_size({train_batch_size!r}): the batch size must be a positive multiple of "
                f"train_micro_batch_size_per_gpu x world size = {micro} x {world} = {micro * world}"
            )
        if self._backward_pending or self.micro_steps % self.config.gradient_accumulation_steps:
            raise ValueError("set_train_batch_size in the middle of gradient accumulation: call it right after the "
                             "engine.step() that ends a window")  # fmt: skip
        accumulation = train_batch_size // (micro * world)
        self.config = dataclasses.replace(self.config, train_batch_size=train_batch_size,
                                          gradient_accumulation_steps=accumulation)  # fmt: skip
        self.micro_steps = self.global_steps * accumulation  # a window boundary under the new length
        logger.info("train batch size now %d (gradient_accumulation_steps %d)", train_batch_size, accumulation)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: overrides whether the next backward ends the accumulation window, for a loop that runs
        its passes and then calls step() once. Set it before each forward/backward; True before the last."""
        if not isinstance(is_boundary, bool):
            raise ValueError(f"set_gradient_accumulation_boundary takes True or False, got {is_boundary!r}")
        self._boundary_override = is_boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def _after_boundary_step(self) -> None:
        """With the boundary set by hand, the micro-step count follows the windows it ended (save_checkpoint
        and set_train_batch_size check that the count sits on a boundary)."""
        if self._boundary_override is not None:
            self.micro_steps = self.global_steps * self.config.gradient_accumulation_steps

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: releases every gathered stage-3 unit (as after a pass; the persistent one stays) and
        gives back the memory kept for the next gathers and reductions. Nothing to do at stages 0-2."""
        if self.stage3 is None:
            return
        coordinator = self.stage3.coordinator
        if coordinator.in_pass:
            coordinator.end_pass()
        self.stage3.table.pool.clear()
        self.stage3.table.shards.drop_spares()
        self.zero_optimizer.reducer.drop_spares(all_of_them=True)

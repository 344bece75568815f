"""Comm: who a collective talks to. Below every layer that communicates (memory/'s collective survey, zero/'s
collectives, the engine's process groups), so none of them imports another for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Comm:
    """Who we talk to: the group, this rank's place in it, and its size; ``name`` and ``timeout_s`` for errors."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    name: str = "data-parallel"
    timeout_s: float | None = None

    @property
    def active(self) -> bool:
        return self.group is not None and self.world_size > 1

"""Comm: who a collective talks to. Below every layer that communicates (memory/'s collective survey, zero/'s
collectives, the engine's process groups), so none of them imports another for it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.distributed as dist

_HOLDING_A_GROUP: dict[int, weakref.ref] = {}  # id -> every live Comm that holds a process group


@dataclass(frozen=True)  # no slots: released Comms are tracked by weak reference
class Comm:
    """Who we talk to: the group, this rank's place in it, and its size; ``name`` and ``timeout_s`` for errors."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    name: str = "data-parallel"
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.group is not None:
            key = id(self)
            _HOLDING_A_GROUP[key] = weakref.ref(self, lambda _, key=key, pop=_HOLDING_A_GROUP.pop: pop(key, None))

    @property
    def active(self) -> bool:
        return self.group is not None and self.world_size > 1


def release_destroyed_process_groups() -> int:
    """At interpreter exit, after the engines' teardown: every Comm whose process group is destroyed lets go of
    it, so that we do not keep it alive into the interpreter's finalization, where gloo's worker threads outlive
    the interpreter and can abort the process ([Note: teardown] in infinity/distributed.py). A group still alive
    (the user's, not destroyed) stays: torch holds it anyway. Returns how many Comms let go."""
    world = getattr(dist.distributed_c10d, "_world", None) if dist.is_initialized() else None
    alive = set(getattr(world, "pg_map", {}))  # the groups torch has not destroyed
    released = 0
    for key, ref in list(_HOLDING_A_GROUP.items()):
        comm = ref()
        if comm is not None and comm.group is not None and comm.group not in alive:
            object.__setattr__(comm, "group", None)  # frozen for its users; only the exit unfreezes it
            _HOLDING_A_GROUP.pop(key, None)
            released += 1
    return released

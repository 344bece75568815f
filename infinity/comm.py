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
            _HOLDING_A_GROUP[key] = weakref.ref(self, lambda _, key=key: _HOLDING_A_GROUP.pop(key, None))

    @property
    def active(self) -> bool:
        return self.group is not None and self.world_size > 1


def release_process_groups() -> int:
    """At interpreter exit, after the engines' teardown: every Comm lets go of its process group, so that a group
    the user destroyed (or that torch still holds) is not kept alive by us into the interpreter's finalization,
    where gloo's worker threads outlive the interpreter and can abort the process ([Note: teardown] in
    infinity/distributed.py). Returns how many Comms let go."""
    released = 0
    for ref in list(_HOLDING_A_GROUP.values()):
        comm = ref()
        if comm is not None and comm.group is not None:
            object.__setattr__(comm, "group", None)  # frozen for its users; only the exit unfreezes it
            released += 1
    _HOLDING_A_GROUP.clear()
    return released

"""Joining the data-parallel group, the groups an engine adds, collective-call checks, and teardown.

[Note: teardown]
A gloo process group that is still alive when the interpreter exits can abort the process ("terminate called
without an active exception", measured in 3-10% of 2-process runs of scripts that end without tearing down),
and a rank that closes a connection while its peer still uses it aborts the peer. So the engine owns the
teardown of what it made: ``Distributed.close()`` (from ``engine.destroy()``, or at interpreter exit for
every engine not yet destroyed) first waits until every rank is closing too (a check on the rendezvous store,
bounded by the timeout), then destroys the groups the engine created, and the default group when an engine
created it and no other engine still uses it. A group the user made is theirs. An engine that is garbage
collected only removes its hooks: the cycle collector runs at a different moment on each rank, where a wait
for the other ranks could stall both; its groups are closed at exit.

A destroyed group must also be let go of: its gloo worker threads run until the last reference to it is gone,
and threads still running when the interpreter finalizes abort the process the same way, after a clean
``destroy_process_group()`` too (measured: a script that trains an engine and destroys the group still had
gloo's 4 threads at its last atexit handler). Two things held it. Every Comm does: at exit, after the engines'
teardown, ``release_destroyed_process_groups`` makes those whose group is destroyed let go. And
torch.distributed.nn.functional, imported lazily by the first torch optimizer (through torch._dynamo),
evaluates ``group.WORLD`` into its functions' default arguments, keeping the default group of that moment
forever: an engine that makes the default group imports that module first, and at exit, once no group is left,
``_forget_destroyed_groups_in_torch_defaults`` clears a destroyed group out of those defaults (where the user
made the group before the module was imported).

[Note: collective calls]
APIs that every rank must call (save_16bit_model, GatheredParameters, destroy) first post their name on the
rendezvous store and wait, up to the collective timeout, for every rank's post of the same call. A rank that
calls one alone gets a CollectiveUsageError saying which call the others made, or that they made none within
the timeout, instead of a gloo crash or a hang. The store, not a process group, carries these checks: a
timed-out check leaves nothing half-sent on a group that later collectives would trip over.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import itertools
import logging
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from infinity.comm import Comm, release_destroyed_process_groups
from infinity.config import DEFAULT_TIMEOUT_S, collective_timeout_s
from infinity.errors import CollectiveUsageError

logger = logging.getLogger("infinity")


@dataclass(slots=True)
class _DefaultGroupOwnership:
    created: bool = False  # an engine created the default group (from torchrun's environment)
    users: int = 0  # live Distributed objects that joined it


_DEFAULT = _DefaultGroupOwnership()
_ENGINE_NUMBERS = itertools.count()
_LIVE: set[Distributed] = set()  # not yet closed: closed at interpreter exit ([Note: teardown])


def _close_at_exit() -> None:
    for distributed in sorted(_LIVE, key=lambda d: -d.number):  # the newest first, the same order on every rank
        distributed.close()
    if release_destroyed_process_groups() + _forget_destroyed_groups_in_torch_defaults():
        gc.collect()  # a group in a reference cycle is destroyed now too, while the interpreter is whole


def _forget_destroyed_groups_in_torch_defaults() -> int:
    """[Note: teardown]: once every group is destroyed, the default arguments of torch.distributed.nn.functional
    that still hold one (evaluated at its import) are set to None, torch's own default. Returns how many."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None or not dist.is_available() or dist.is_initialized():
        return 0
    forgotten = 0
    for function in vars(module).values():
        defaults = getattr(function, "__defaults__", None)
        if isinstance(defaults, tuple) and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            function.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
            forgotten += 1
    return forgotten


atexit.register(_close_at_exit)


@dataclass(eq=False, slots=True)
class Distributed:
    """The process groups one engine uses, which of them it created, and its collective-call checks."""

    comm: Comm  # the data-parallel group
    timeout_s: float
    number: int  # engines are built in the same order on every rank: the number names this one's store keys
    created: list = field(default_factory=list)  # process groups this engine created
    _calls: int = 0
    _closed: bool = False

    def new_comm(self, name: str, *, backend: str | None = None) -> Comm:
        """Another group over the same ranks (every rank must create it, in the same order)."""
        if not self.comm.active:
            return Comm(group=None, rank=self.comm.rank, world_size=self.comm.world_size, name=name)
        group = dist.new_group(
            ranks=list(range(self.comm.world_size)), timeout=datetime.timedelta(seconds=self.timeout_s),
            backend=backend,
        )  # fmt: skip
        self.created.append(group)
        return Comm(group=group, rank=self.comm.rank, world_size=self.comm.world_size, name=name,
                    timeout_s=self.timeout_s)  # fmt: skip

    def check_call(self, api: str) -> None:
        """[Note: collective calls]: every rank must be making this call, or this rank gets a clear error."""
        problem = self._exchange(api)
        if problem is not None:
            raise CollectiveUsageError(
                f"{api} is a collective call: every rank must call it, in the same order, but {problem}. Call it "
                "on every rank (not only under `if rank == 0`)"
            )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """[Note: teardown]. Safe to call twice; never raises (it also runs at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if not dist.is_available() or not dist.is_initialized():
            return  # the user destroyed the default group, and with it every other group
        try:
            problem = self._exchange("destroy")
        except Exception as e:  # noqa: BLE001 - a peer that already exited took the store with it
            problem = f"the other ranks could not be reached ({e})"
        if problem is not None:
            logger.error("infinity: destroy is a collective call, every rank must make it; tearing down although %s",
                         problem)  # fmt: skip
        try:
            for group in self.created:
                dist.destroy_process_group(group)
            self.created.clear()
            if self.comm.active and _DEFAULT.created:
                _DEFAULT.users -= 1
                if _DEFAULT.users == 0:
                    dist.destroy_process_group()
                    _DEFAULT.created = False
        except Exception as e:  # noqa: BLE001 - teardown must not raise at exit
            logger.warning("infinity: process group teardown failed: %s", e)

    def _exchange(self, api: str) -> str | None:
        """Posts ``api`` under this engine's next call number and reads every rank's post. None when all ranks
        make the same call; otherwise what they did instead."""
        if not self.comm.active or not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        prefix = f"infinity/engine{self.number}/call{self._calls}"
        if self._calls >= 2:  # every rank has read call n-2's posts before it posted call n-1: drop ours
            with contextlib.suppress(Exception):
                store.delete_key(f"infinity/engine{self.number}/call{self._calls - 2}/rank{self.comm.rank}")
        self._calls += 1
        store.set(f"{prefix}/rank{self.comm.rank}", api)
        keys = [f"{prefix}/rank{r}" for r in range(self.comm.world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            return f"rank(s) {missing} did not make this call within {self.timeout_s:g} s (collective_timeout)"
        posts = [store.get(key).decode() for key in keys]
        others = {r: post for r, post in enumerate(posts) if post != api}
        if others:
            return "the other ranks made other calls: " + ", ".join(f"rank {r} called {p}" for r, p in others.items())
        return None


def join_process_group(timeout_s: float | None = None) -> Comm:
    """The default process group if the user made one; else one made from torchrun's variables (gloo on CPU,
    NCCL with CUDA); else a single process (world size 1, no collectives)."""
    if dist.is_available() and dist.is_initialized():
        return Comm(group=dist.group.WORLD, rank=dist.get_rank(), world_size=dist.get_world_size())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Comm(group=None, rank=0, world_size=1)
    timeout_s = collective_timeout_s() if timeout_s is None else timeout_s
    import torch.distributed.nn.functional  # noqa: F401 - imported while no group exists ([Note: teardown])

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    _DEFAULT.created = True
    atexit.register(_destroy_unused_default_group)
    return Comm(group=dist.group.WORLD, rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=timeout_s)


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> Distributed:
    """The engine's groups: it joins (or makes) the default group and counts as one of its users. When the user
    made the default group, its timeout is theirs (gloo's default is 30 minutes): the engine then reduces over
    a group of its own, over the same ranks, so that a dead peer fails a step within ``timeout_s``."""
    comm = join_process_group(timeout_s)
    distributed = Distributed(comm=comm, timeout_s=timeout_s, number=next(_ENGINE_NUMBERS))
    if comm.active and _DEFAULT.created:
        _DEFAULT.users += 1
    elif comm.active:
        distributed.comm = distributed.new_comm("data-parallel", backend=dist.get_backend(comm.group))
    _LIVE.add(distributed)
    return distributed


def _destroy_unused_default_group() -> None:
    """At exit: a default group made for zero.Init alone, or outliving its engines, is destroyed too."""
    if _DEFAULT.created and _DEFAULT.users == 0 and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
            dist.destroy_process_group()
        _DEFAULT.created = False


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Collectives on flat buffers: free functions taking the process group explicitly.

At world size 1 (or without a process group) they are no-ops, so a single process needs no launcher.
gloo has no AVG reduction, so averages are a SUM followed by a division.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 names the flat-tensor collectives *_single (the *_tensor names warn); older releases lack them.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class Comm:
    """Who we talk to: the data-parallel group, this rank's place in it, and its size."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    @property
    def active(self) -> bool:
        return self.group is not None and self.world_size > 1


class Pending:
    """An in-flight collective and what to do once it finishes (e.g. divide for an average)."""

    def __init__(self, work, finish=None) -> None:
        self._work = work
        self._finish = finish

    def done(self) -> bool:
        """The collective has completed (waiting would not block)."""
        return self._work is None or self._work.is_completed()

    def then(self, after) -> Pending:
        """This collective followed by ``after()`` once it has finished (this object is used up)."""
        first = self._finish

        def finish() -> None:
            if first is not None:
                first()
            after()

        chained = Pending(self._work, finish)
        self._work, self._finish = None, None
        return chained

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def reduce_scatter_mean(comm: Comm, output: torch.Tensor, flat: torch.Tensor, *, async_op: bool) -> Pending:
    """output <- mean over ranks of this rank's piece of ``flat`` (len(flat) == world_size * len(output))."""
    if not comm.active:
        output.copy_(flat)
        return Pending(None)
    work = _reduce_scatter(output, flat, op=dist.ReduceOp.SUM, group=comm.group, async_op=async_op)
    return Pending(work, lambda: output.div_(comm.world_size)) if async_op else _done(output.div_(comm.world_size))


def all_reduce_mean(comm: Comm, flat: torch.Tensor, *, async_op: bool) -> Pending:
    if not comm.active:
        return Pending(None)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=comm.group, async_op=async_op)
    return Pending(work, lambda: flat.div_(comm.world_size)) if async_op else _done(flat.div_(comm.world_size))


def all_gather_pieces(comm: Comm, flat: torch.Tensor, piece: torch.Tensor, *, async_op: bool) -> Pending:
    """flat <- concatenation of every rank's ``piece``."""
    if not comm.active:
        flat.copy_(piece)
        return Pending(None)
    return Pending(_all_gather(flat, piece, group=comm.group, async_op=async_op))


def all_reduce_sum_(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    if comm.active:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=comm.group)
    return tensor


def all_reduce_max_(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    if comm.active:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=comm.group)
    return tensor


def _done(_) -> Pending:
    return Pending(None)

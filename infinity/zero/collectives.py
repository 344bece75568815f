"""Collectives on flat buffers: free functions taking the process group explicitly.

At world size 1 (or without a process group) they are no-ops, so a single process needs no launcher.
gloo has no AVG reduction, so averages are a SUM followed by a division. At stage 3 two groups carry collectives
in one pass (fetches, reductions); the order they are issued in is [Note: one collective order] in rendezvous.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from infinity.comm import Comm
from infinity.errors import CollectiveError
from infinity.zero.partition import Bucket

# torch 2.13 names the flat-tensor collectives *_single (the *_tensor names warn); older releases lack them.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@contextlib.contextmanager
def _reported(comm: Comm, op: str):
    """A failed or timed-out collective becomes a CollectiveError naming it, the group and the timeout."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError, gloo's) are RuntimeErrors
        raise CollectiveError(op=op, group=comm.name, timeout_s=comm.timeout_s, cause=str(e)) from e


class Pending:
    """An in-flight collective and what to do once it finishes (e.g. divide for an average)."""

    def __init__(self, work, finish=None, *, comm: Comm | None = None, op: str = "") -> None:
        self._work = work
        self._finish = finish
        self._comm = comm
        self._op = op

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

        chained = Pending(self._work, finish, comm=self._comm, op=self._op)
        self._work, self._finish = None, None
        return chained

    def wait(self) -> None:
        if self._work is not None:
            with _reported(self._comm, self._op):
                self._work.wait()
            self._work = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def _started(comm: Comm, op: str, call, finish=None, *, async_op: bool) -> Pending:
    with _reported(comm, op):
        work = call()
    if async_op:
        return Pending(work, finish, comm=comm, op=op)
    if finish is not None:
        finish()
    return Pending(None)


def reduce_scatter_mean(comm: Comm, output: torch.Tensor, flat: torch.Tensor, *, async_op: bool) -> Pending:
    """output <- mean over ranks of this rank's piece of ``flat`` (len(flat) == world_size * len(output))."""
    if not comm.active:
        output.copy_(flat)
        return Pending(None)
    return _started(
        comm, "reduce-scatter", lambda: _reduce_scatter(output, flat, op=dist.ReduceOp.SUM, group=comm.group,
        async_op=async_op), lambda: output.div_(comm.world_size), async_op=async_op,
    )  # fmt: skip


def all_reduce_mean(comm: Comm, flat: torch.Tensor, *, async_op: bool) -> Pending:
    if not comm.active:
        return Pending(None)
    return _started(
        comm, "all-reduce", lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=comm.group, async_op=async_op),
        lambda: flat.div_(comm.world_size), async_op=async_op,
    )  # fmt: skip


def all_gather_pieces(comm: Comm, flat: torch.Tensor, piece: torch.Tensor, *, async_op: bool) -> Pending:
    """flat <- concatenation of every rank's ``piece``."""
    if not comm.active:
        flat.copy_(piece)
        return Pending(None)
    return _started(
        comm, "all-gather", lambda: _all_gather(flat, piece, group=comm.group, async_op=async_op), async_op=async_op
    )


def broadcast_(comm: Comm, tensor: torch.Tensor, *, src: int) -> torch.Tensor:
    """tensor <- rank ``src``'s tensor, on every rank."""
    if comm.active:
        with _reported(comm, f"broadcast from rank {src}"):
            dist.broadcast(tensor, src=src, group=comm.group)
    return tensor


def flat_from_rank0(
    comm: Comm, bucket: Bucket, values: Iterable[torch.Tensor], *, dtype: torch.dtype, device: torch.device,
    broadcast: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The bucket's flat buffer (``bucket.padded_numel``, zero padding) with ``values`` (one per slot, in order)
    at their slots, as rank 0 has them: every rank starts from rank 0's weights, as DeepSpeed broadcasts the
    model at start. The one flatten-pad-broadcast of zero.Init, stage 3's units and the buckets of stages 0-2;
    each cuts its piece with ``bucket.piece_range``. ``values`` is consumed one at a time (a generator keeps one
    whole parameter alive at a time); a lone contiguous value that needs no padding is used in place (no copy:
    under zero.Init a second full-size buffer per module would fragment the heap)."""
    values = iter(values)
    if len(bucket.slots) == 1:
        value = next(values)
        in_place = value.numel() == bucket.padded_numel and value.is_contiguous()
        if in_place and value.dtype == dtype and value.device == device:
            flat = value.view(-1)
        else:
            flat = torch.zeros(bucket.padded_numel, dtype=dtype, device=device)
            flat[: value.numel()].copy_(value.reshape(-1))
    else:
        flat = torch.zeros(bucket.padded_numel, dtype=dtype, device=device)
        for slot, value in zip(bucket.slots, values, strict=True):
            flat[slot.offset : slot.offset + slot.numel].copy_(value.reshape(-1))
    if broadcast:
        broadcast_(comm, flat, src=0)
    return flat


def all_reduce_sum_(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    if comm.active:
        with _reported(comm, "all-reduce (sum)"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=comm.group)
    return tensor


def all_reduce_max_(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    if comm.active:
        with _reported(comm, "all-reduce (max)"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=comm.group)
    return tensor

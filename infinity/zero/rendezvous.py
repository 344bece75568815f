"""The ZeRO-3 fetch rendezvous: how ranks agree on which units to all-gather, so no fetch ever hangs.

[Note: fetch rendezvous]
Every all-gather must be issued in the same order on every rank, even when ranks run different modules (a
rank-dependent branch) or plan different prefetches. So no rank ever all-gathers on its own: a rank that wants
units (needed now, or planned as prefetch along its trace) first takes part in a small exchange on the fetch
group, a header listing them; then every rank all-gathers the union of all ranks' lists, in unit order (a unit
this rank did not ask for goes into a scratch buffer and is dropped). The sequence of collectives is thus a
function of the exchanged headers alone, identical on every rank, whatever each rank's trace or state.
A rank with nothing to ask issues nothing: on an agreed trace every rank asks at the same events (identical
traces, identical plans), and a rank whose header finds the others elsewhere simply waits until they ask next.
A rank that finishes its pass keeps answering with "done" headers (the drain in Coordinator.end_pass) until
every rank is done, so a request is always answered. Gradient reductions use the other group; where they fall
among the fetches is [Note: one collective order]. With one process there is nothing to exchange.
Two more waits keep answering the same way, so no rank ever blocks where a peer may need it for a fetch: the
agreement before each backward on the order gradient reductions launch in (``agree``: every rank's value, once
all ranks are there), and a rank waiting in backward until every peer has launched a reduction (``wait``: a
peer may need a fetch first; [Note: launch order] in reducer.py). Agreeing and waiting ranks list no units:
their header carries a value where the units would be.

[Note: one collective order]
With NCCL the fetches' all-gathers (the fetch group) and the gradients' reduce-scatters (the data-parallel group)
are kernels of two communicators, each on its own stream, and NCCL needs the collectives of communicators used
concurrently to be issued in the same order on every rank: a rank whose all-gather waits for a peer that has
queued it behind a reduce-scatter, itself waiting for this rank, deadlocks as soon as the two kernels cannot run
side by side (CUDA_DEVICE_MAX_CONNECTIONS=1, a device-wide synchronization such as a cudaFree, too few free SMs).
The fetches alone are in one order (the exchanges above), the reductions alone too ([Note: launch order] in
reducer.py), but where a reduction falls among the fetches follows each rank's own backward: a rank whose graph
differs (a rank-dependent branch, parameters unused on one rank) launches it before a fetch that a peer issues
before launching it. So with NCCL (``Coordinator.one_order``) each reduction launched inside the pass is
launched at an exchange: before its k-th launch a rank waits (``wait``, answering fetches, its header saying k)
until every rank is about to launch the same k-th reduction, and each launches it right after that exchange,
before any other collective. Every collective of a pass on either group then directly follows an exchange of
headers, whose sequence is the same on every rank, so the whole order is the same on every rank. Saying k
before launching it is safe: the other ranks' waits for a reduction j need j <= k - 1, launched by every rank
already. What backward leaves is launched the same way before the drain (``launch_rest``); after the pass only
the step's collectives remain, on one group. Over gloo every group has its own connections and threads, so
none of this is needed and none is added. The cost: one header exchange per reduction, and a rank that is ready
first waits there for the others.

Only the protocol lives here (the headers, the drain, the gather taken part in for others); what to ask for,
and what becomes of a unit once gathered, is the coordinator's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from infinity.comm import Comm
from infinity.zero import collectives
from infinity.zero.units import UnitTable, gather_piece

_ASKING = 0  # header status of a rank in its pass
_DONE = -2  # header status of a rank that has finished its pass
_AGREEING = -3  # header status of a rank at the agreement before its backward; its value in the first unit slot
_WAITING = -4  # header status of a rank waiting for the others to launch a reduction; ditto (reductions launched)
_MIN_WIDTH = 16


class Exchanged(NamedTuple):
    """What one exchange of headers agreed on."""

    union: list[int]  # every unit some rank listed, in unit order: the all-gathers to issue, in this order
    statuses: list[int]  # every rank's status, from its first header
    values: list[int]  # every rank's first unit slot, from its first header (an agreeing rank's value)


class FetchRendezvous:
    """The header exchange on ``header_comm`` (host tensors, so a gloo group). Its only state is the header
    width, fixed at construction so that every rank cuts its list into the same rounds."""

    def __init__(self, header_comm: Comm, *, widest_request: int) -> None:
        self.header_comm = header_comm
        self.width = max(_MIN_WIDTH, widest_request)  # units per header round: one module's units fit in one

    def ask(self, wanted: list[int]) -> list[int]:
        """Exchange this rank's wanted units; returns the union every rank must now all-gather, in order."""
        return self._exchange(_ASKING, wanted).union

    def drain(self, answer: Callable[[int], None]) -> None:
        """This rank's pass is over: answer (take part in the gather of) every unit other ranks still ask for,
        until every rank is done."""
        self._until_all(_DONE, answer)

    def wait(self, launched: int, needed: int, answer: Callable[[int], None]) -> None:
        """Answer other ranks' requests until every rank has launched at least ``needed`` reductions of this
        backward (this rank: ``launched``). A rank whose header says it is waiting tells its own count; a rank
        draining has finished its backward, and launched them all before (Coordinator.end_pass)."""
        while True:
            exchanged = self._exchange(_WAITING, [launched])
            pairs = zip(exchanged.statuses, exchanged.values, strict=True)
            if all(status == _DONE or (status == _WAITING and value >= needed) for status, value in pairs):
                return
            for index in exchanged.union:
                answer(index)

    def agree(self, value: int, answer: Callable[[int], None]) -> list[int]:
        """Answer other ranks' requests until every rank has reached its own call; returns every rank's
        ``value`` (>= 0), in rank order."""
        return self._until_all(_AGREEING, answer, value=value).values

    def _until_all(self, status: int, answer: Callable[[int], None], *, value: int = -1) -> Exchanged:
        while True:
            exchanged = self._exchange(status, [] if value < 0 else [value])
            if all(s == status for s in exchanged.statuses):
                return exchanged
            for index in exchanged.union:
                answer(index)

    def _exchange(self, status: int, wanted: list[int]) -> Exchanged:
        """All-gathers headers [status, more, up to ``width`` units] until no rank has more to list. Statuses
        and values are read from every rank's first header; an agreeing or waiting rank's slots are no units."""
        union: set[int] = set()
        first = None
        remaining = list(wanted)
        while True:
            chunk, remaining = remaining[: self.width], remaining[self.width :]
            row = torch.full((2 + self.width,), -1, dtype=torch.int64)
            row[0], row[1] = status, 1 if remaining else 0
            row[2 : 2 + len(chunk)] = torch.tensor(chunk, dtype=torch.int64)
            rows = torch.empty(self.header_comm.world_size * row.numel(), dtype=torch.int64)
            collectives.all_gather_pieces(self.header_comm, rows, row, async_op=False)
            rows = rows.view(self.header_comm.world_size, -1)
            first = rows if first is None else first
            listing = rows[(rows[:, 0] != _AGREEING) & (rows[:, 0] != _WAITING), 2:]  # the rows listing units
            union.update(int(u) for u in listing.flatten().tolist() if u >= 0)
            if not bool((rows[:, 1] == 1).any()):
                return Exchanged(union=sorted(union), statuses=first[:, 0].tolist(), values=first[:, 2].tolist())


def gather_for_others(comm: Comm, table: UnitTable, index: int) -> None:
    """Take part in the all-gather of a unit another rank asked for, into a scratch buffer that is dropped."""
    unit = table.units[index]
    scratch = torch.empty(unit.padded_numel, dtype=unit.full.dtype, device=unit.full.device)
    gather_piece(comm, table.shards, index, unit.bucket, scratch, async_op=False)

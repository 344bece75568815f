"""Pure planning for ZeRO-3: a recorded trace of module uses + DeepSpeed's knobs -> what to prefetch and release.

No process, tensor or collective here; the coordinator feeds it positions and its own bookkeeping.

- Trace: the events of one forward+backward pass, in order; an event is (module entry, phase) and uses some
  units. Distances are measured in parameter traffic: the numel of the units the events in between use.
- Prefetch (stage3_prefetch_bucket_size, stage3_max_live_parameters): walking the trace ahead of the current
  event, take the next units not already resident, in order, while the prefetched-but-unused numel stays within
  prefetch_bucket_size and the gathered numel within max_live_parameters. The first unit that does not fit stops
  the walk (prefetching past it would reorder fetches). Depth is whatever the budgets allow.
- Release (stage3_max_reuse_distance): after a module runs, a unit stays gathered if its next use is within
  max_reuse_distance elements of traffic; otherwise it is released. A unit kept that way yields to a prefetch
  the live budget would otherwise block, when it is not used before the unit being prefetched.
- Each knob acts alone: a prefetch budget of 0 stops the all-gathers ahead of use only; the trace is still
  followed for the reuse decisions and for reading offloaded pieces ahead (plan_swap_in).
- Gradient reductions (reduce_order): the order in which backward completes the units' gradients, predicted
  from the forward's uses ([Note: launch order] in reducer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True, slots=True)
class Event:
    module: int  # index into the unit table's modules
    phase: str  # FORWARD or BACKWARD


@dataclass(frozen=True, slots=True)
class Knobs:
    max_live_numel: int
    prefetch_numel: int  # 0 disables prefetch (and nothing else)
    max_reuse_distance: int


@dataclass(frozen=True, slots=True)
class Trace:
    events: tuple[Event, ...]
    uses: tuple[tuple[int, ...], ...]  # per event: the units it uses
    unit_numel: tuple[int, ...]  # per unit
    _traffic_before: tuple[int, ...] = field(default=(), repr=False)  # numel used by events [0, i)
    _next_use: tuple[dict[int, int], ...] = field(default=(), repr=False)  # per event: unit -> next position

    @staticmethod
    def build(events: Sequence[Event], uses: Sequence[tuple[int, ...]], unit_numel: Sequence[int]) -> Trace:
        traffic = [0]
        for units in uses:
            traffic.append(traffic[-1] + sum(unit_numel[u] for u in units))
        next_use: list[dict[int, int]] = [{} for _ in uses]
        upcoming: dict[int, int] = {}
        for position in range(len(uses) - 1, -1, -1):
            next_use[position] = {u: upcoming[u] for u in uses[position] if u in upcoming}
            for u in uses[position]:
                upcoming[u] = position
        return Trace(tuple(events), tuple(tuple(u) for u in uses), tuple(unit_numel), tuple(traffic), tuple(next_use))

    def __len__(self) -> int:
        return len(self.events)

    def signature(self) -> int:
        """Equal on ranks whose traces (events and the units each uses) are equal. Only ints and bools are
        hashed: a str hash differs between processes."""
        key = tuple((e.module, e.phase == BACKWARD, units) for e, units in zip(self.events, self.uses, strict=True))
        return hash(key) & ((1 << 62) - 1)

    def reuse_distance(self, position: int, unit: int) -> int | None:
        """Traffic between the event at ``position`` and the next one using ``unit``; None if none does."""
        following = self._next_use[position].get(unit)
        if following is None:
            return None
        return self._traffic_before[following] - self._traffic_before[position + 1]


def keep_after_use(trace: Trace, position: int, unit: int, knobs: Knobs) -> bool:
    distance = trace.reuse_distance(position, unit)
    return distance is not None and distance <= knobs.max_reuse_distance


def plan_prefetch(
    trace: Trace, position: int, *, resident: set[int], live_numel: int, prefetched_numel: int, knobs: Knobs
) -> tuple[list[int], int | None]:
    """Units to start gathering now, after the event at ``position`` (-1: before the first event), and the
    trace position of the first unit the live budget (not the prefetch budget) kept out, if any.

    resident: units gathered or in flight; live_numel: their numel; prefetched_numel: the part of it that was
    prefetched and not used yet."""
    live_budget = knobs.max_live_numel - live_numel
    prefetch_budget = knobs.prefetch_numel - prefetched_numel
    chosen: list[int] = []
    for offset, units in enumerate(trace.uses[position + 1 :]):
        for unit in units:
            if unit in resident or unit in chosen:
                continue
            numel = trace.unit_numel[unit]
            if numel > prefetch_budget:
                return chosen, None
            if numel > live_budget:
                return chosen, position + 1 + offset
            chosen.append(unit)
            live_budget -= numel
            prefetch_budget -= numel
    return chosen, None


def used_between(trace: Trace, start: int, end: int) -> set[int]:
    """Units used by the events at positions [start, end]."""
    return {unit for units in trace.uses[start : end + 1] for unit in units}


def plan_swap_in(trace: Trace, position: int, *, resident: set[int], limit: int) -> list[int]:
    """Units whose offloaded pieces should be read ahead after the event at ``position``: the next ``limit``
    distinct units along the trace that are not gathered or in flight, in order of use."""
    chosen: list[int] = []
    for units in trace.uses[position + 1 :]:
        for unit in units:
            if unit not in resident and unit not in chosen:
                chosen.append(unit)
                if len(chosen) == limit:
                    return chosen
    return chosen


def reduce_order(forward_uses: Sequence[tuple[int, ...]], unit_count: int) -> list[int]:
    """The order backward is expected to complete the units' gradients in, from the units the forward's events
    used, in order: the reverse of each unit's first use (backward runs the forward backwards, and a unit used
    several times is complete only once its earliest use is), then the units no event used, last unit first (so
    the persistent unit 0, whose parameters are spread over the whole model, comes last)."""
    seen: dict[int, None] = {}
    for units in forward_uses:
        for unit in units:
            seen.setdefault(unit, None)
    order = list(reversed(seen))
    return order + [unit for unit in range(unit_count - 1, -1, -1) if unit not in seen]


def order_signature(order: Sequence[int]) -> int:
    """Equal on ranks whose orders are equal (ints only: a str hash differs between processes); >= 0."""
    return hash(tuple(order)) & ((1 << 62) - 1)

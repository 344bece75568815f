"""The ZeRO-3 fetch coordinator: records the trace, fetches and prefetches units, releases them, never hangs.
Also the two points where gradient reduction meets the fetch rendezvous: the agreed launch order of a backward's
reductions, and waiting for one inside backward ([Note: launch order] in reducer.py).

Fetches go through the rendezvous of rendezvous.py ([Note: fetch rendezvous] there): the coordinator decides
what to ask for and what to keep, the rendezvous how ranks agree on the all-gathers.

[Note: release after backward]
In backward a unit is released when nothing of that backward can read it any more: every module use that
registered a post-backward (a forward whose inputs required grad: the module's backward then ends when their
gradients exist, as FSDP2 ties it) has finished, and every parameter of the unit that gets a gradient has
accumulated it (autograd checks a gradient against its parameter's shape, so the parameter must be attached
until then). Frozen parameters read by a module's backward are thus kept exactly as long as needed, and a
unit of frozen parameters alone is released as soon as its module's backward is done. Parameters that get no
gradient this backward (an unused branch) are counted as done before backward starts (see unused.py). What is
still gathered when the pass ends is released then.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from infinity.zero.collectives import Comm, Pending
from infinity.zero.rendezvous import FetchRendezvous, gather_for_others
from infinity.zero.schedule import (
    BACKWARD,
    FORWARD,
    Event,
    Knobs,
    Trace,
    keep_after_use,
    order_signature,
    plan_prefetch,
    plan_swap_in,
    reduce_order,
    used_between,
)
from infinity.zero.units import UnitState, UnitTable

logger = logging.getLogger("infinity")


@dataclass(slots=True)
class FetchStats:
    """What fetching (and reducing gradients) cost; ``zero_stats()`` reports these per optimizer step."""

    fetches: int = 0  # uses of a non-persistent unit at an event
    already_gathered: int = 0  # ... found gathered (kept from an earlier use, or a finished prefetch)
    in_flight: int = 0  # ... found being prefetched (waited for the rest)
    on_demand: int = 0  # ... fetched when needed, blocking
    prefetches: int = 0  # all-gathers started ahead of use
    gathered_numel: int = 0  # elements all-gathered, including for other ranks' needs
    peak_live_numel: int = 0  # most elements gathered or in flight at once (persistent ones excluded)
    blocked_s: float = 0.0  # time spent in exchanges, demand fetches and waits
    read_ahead: int = 0  # offloaded (NVMe) pieces whose read was started ahead of their gather
    peak_grad_buckets: int = 0  # most unit gradient buckets held at once (filling, waiting or being reduced)
    peak_grad_numel: int = 0  # ... and most elements (fp32) in them
    reduce_waits: int = 0  # times backward waited for a reduction (overlap_comm off, or reduce_bucket_size full)
    reduce_blocked_s: float = 0.0  # time spent in those waits and in agreeing on the launch order
    passes: int = 0
    gather_buffers_made: int = 0  # host buffers allocated for gathered units (0 once reused: memory/pool.py)
    grad_buffers_made: int = 0  # gradient buckets and reduced pieces allocated (0 once reused: reducer.py)
    outsized_buffers_made: int = 0  # host buffers for NVMe pieces too large for the ring (0 once reused:
    # shards.py)

    @property
    def prefetched_fraction(self) -> float:
        """Share of fetches that did not have to start an all-gather on the spot."""
        return (self.already_gathered + self.in_flight) / self.fetches if self.fetches else 0.0

    def as_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["prefetched_fraction"] = self.prefetched_fraction
        return values

    def merge(self, other: FetchStats) -> None:
        for f in fields(self):
            if f.name.startswith("peak_"):
                setattr(self, f.name, max(getattr(self, f.name), getattr(other, f.name)))
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(slots=True)
class PassState:
    """Where one forward+backward pass (or one forward without gradients) stands."""

    grad_mode: bool
    trace: Trace | None  # the order recorded for this grad mode, followed while on_trace
    on_trace: bool
    position: int = -1  # index in ``trace`` of the latest event, while on_trace
    phase: str = FORWARD  # BACKWARD from the first pre-backward event on
    recorded: list[Event] = field(default_factory=list)
    divergence: tuple[str, str] | None = None  # (expected, actual) where the pass left the trace
    event_position: dict[int, int] = field(default_factory=dict)  # module -> position of its latest forward
    running: list[int] = field(default_factory=list)  # modules whose forward is running, innermost last
    # [Note: release after backward]
    awaiting: dict[int, int] = field(default_factory=dict)  # unit -> module backwards registered, not yet done
    no_grad_forward: set[int] = field(default_factory=set)  # modules whose forward ran without grad (reentrant
    # checkpointing: their backward graph is the one their recomputation builds)
    grads_left: list[int] = field(default_factory=list)  # per unit: parameters whose gradient is still to come


@dataclass(slots=True)
class Residency:
    """Which non-persistent units are gathered or in flight on this rank, and how many elements that is."""

    live: set[int] = field(default_factory=set)
    live_numel: int = 0
    prefetched: set[int] = field(default_factory=set)  # prefetched and not used yet

    def add(self, index: int, numel: int) -> None:
        if index not in self.live:
            self.live.add(index)
            self.live_numel += numel

    def remove(self, index: int, numel: int) -> None:
        if index in self.live:
            self.live.discard(index)
            self.live_numel -= numel
        self.prefetched.discard(index)


class Coordinator:
    """Runtime of ZeRO-3 fetching: follows and records the trace, asks schedule.py what to prefetch and
    release, and fetches through the rendezvous ([Note: fetch rendezvous] in rendezvous.py)."""

    def __init__(self, table: UnitTable, comm: Comm, knobs: Knobs, *, header_comm: Comm | None = None) -> None:
        self.table = table
        self.comm = comm  # the fetch group: unit all-gathers
        self.knobs = knobs
        self._numel = tuple(unit.numel for unit in table.units)
        widest = max(len(u) for u in table.module_units)
        self._rendezvous = FetchRendezvous(header_comm or comm, widest_request=widest)  # headers: a gloo group
        self._traces: dict[bool, Trace] = {}  # by grad mode: a training pass and an eval forward differ
        self._seen_signatures: set[int] = set()
        self._resident = Residency()
        self._grad_params = [0] * len(table.units)  # per unit: parameters that get a gradient in backward
        self._pass_number = 0
        self.in_pass = False
        self.stats = FetchStats()  # this pass
        self.step_stats = FetchStats()  # passes since the last take_step_stats()
        # buffers made so far, per stat, and at the last take_step_stats (each stat is the difference)
        self.made_counters: dict[str, Callable[[], int]] = {
            "gather_buffers_made": lambda: table.pool.stats.made,
            "outsized_buffers_made": lambda: getattr(table.shards, "outsized_made", 0),
        }
        self._made_before: dict[str, int] = {}
        self.reduction_peaks: Callable[[], tuple[int, int]] | None = None  # the reducer's (buckets, numel) held
        # at most since the last call
        self.before_drain: Callable[[], None] | None = None  # the reducer launches what backward left: a rank
        # that says it is done has launched every reduction ([Note: launch order] in reducer.py)
        self.one_order = False  # each reduction in the pass launched at an exchange, so every collective is issued
        # in one order on every rank (NCCL: [Note: one collective order] in rendezvous.py)
        self.after_pass: Callable[[], None] | None = None  # what the pass's hooks leave behind goes (stage3.py,
        # [Note: multi-grad hooks])
        self.whole_held = 0  # GatheredParameters holding every unit (nested): forwards without grad skip fetching
        self.held: dict[int, int] = {}  # unit -> the GatheredParameters blocks holding it: no pass releases it
        self._reset_pass(grad_mode=True)

    # ---- pass boundaries ----
    def begin_pass(self) -> None:
        if self.in_pass:
            self.end_pass()  # a forward that had no backward (evaluation with gradients on)
        self._reset_pass(grad_mode=torch.is_grad_enabled())
        self.in_pass = True
        if self._pass.on_trace:
            self._fetch([], self._plan_prefetch(-1))
            self._stage_ahead(-1)

    def end_pass(self) -> None:
        if not self.in_pass:
            return
        if self._pass.on_trace and self._pass.position != len(self._pass.trace) - 1:
            self._diverge("the end of the pass")
        recorded = Trace.build(
            self._pass.recorded, [self.table.module_units[e.module] for e in self._pass.recorded], self._numel
        )
        if self.before_drain is not None:
            self.before_drain()
        self._drain()
        for index in list(self._resident.live):
            self._release(index)
        self.table.shards.unstage_all()  # the step may rewrite the pieces: read them again next pass
        mode = self._pass.grad_mode
        previous = self._traces.get(mode)
        if previous is None or previous.signature() != recorded.signature():
            signature = recorded.signature()
            if previous is not None and signature not in self._seen_signatures and self._pass.divergence is not None:
                expected, actual = self._pass.divergence
                logger.warning(
                    "ZeRO-3: this pass left the recorded module order (expected %s, got %s); fetched on demand "
                    "from there and re-recorded the order. This warning is not repeated for an order seen before.",
                    expected, actual,
                )  # fmt: skip
            self._seen_signatures.add(signature)
            self._traces[mode] = recorded
        self.in_pass = False
        if self.after_pass is not None:
            self.after_pass()
        self.stats.passes = 1
        self.step_stats.merge(self.stats)

    def take_step_stats(self) -> FetchStats:
        stats, self.step_stats = self.step_stats, FetchStats()
        if self.reduction_peaks is not None:
            stats.peak_grad_buckets, stats.peak_grad_numel = self.reduction_peaks()
        for name, counter in self.made_counters.items():
            made = counter()
            setattr(stats, name, made - self._made_before.get(name, 0))
            self._made_before[name] = made
        return stats

    # ---- gradient reductions: [Note: launch order] in reducer.py ----
    def reduce_order(self) -> list[int]:
        """Before a backward: the units in the order this backward's reductions launch, the same on every rank.
        Predicted from this pass's forward (schedule.reduce_order); ranks whose forwards differ (their
        predictions do) all fall back to the fixed order, last unit first. Every rank takes part (a collective)."""
        forward = [self.table.module_units[e.module] for e in self._pass.recorded if e.phase == FORWARD]
        order = reduce_order(forward if self.in_pass else [], len(self.table.units))
        if self.comm.active:
            started = time.perf_counter()
            values = self._rendezvous.agree(order_signature(order), self._gather_for_others)
            if any(value != values[0] for value in values):
                order = reduce_order([], len(self.table.units))
            self.stats.reduce_blocked_s += time.perf_counter() - started
        return order

    def wait_for_reduction(self, pending: Pending, launched: int, needed: int) -> None:
        """Before the pass ends: waits for this backward's ``needed``-th reduction (this rank has launched
        ``launched``). Until every rank has launched it, this rank keeps answering fetches, since a peer may need
        one before it gets there ([Note: fetch rendezvous]); then the wait cannot hang."""
        started = time.perf_counter()
        if self.comm.active:
            self._rendezvous.wait(launched, needed, self._gather_for_others)
        pending.wait()
        self.stats.reduce_waits += 1
        self.stats.reduce_blocked_s += time.perf_counter() - started

    def before_launch(self, sequence: int) -> None:
        """With ``one_order``: before this backward's ``sequence``-th reduction is launched inside the pass, waits
        (answering fetches) until every rank is about to launch it, so that every rank launches it right after the
        same exchange ([Note: one collective order] in rendezvous.py)."""
        if not self.one_order or not self.comm.active:
            return
        started = time.perf_counter()
        self._rendezvous.wait(sequence, sequence, self._gather_for_others)
        self.stats.reduce_blocked_s += time.perf_counter() - started

    # ---- events ----
    def on_event(self, module: int, phase: str) -> None:
        """The module is about to run (forward) or its backward is about to run: its units must be gathered."""
        if not self.in_pass:
            self.begin_pass()
        if phase == BACKWARD:
            self._pass.phase = BACKWARD
        event = Event(module, phase)
        self._follow_trace(event)
        self._pass.recorded.append(event)
        if phase == FORWARD:
            self._pass.event_position[module] = self._pass.position
            self._pass.running.append(module)
            if self._pass.phase == FORWARD and not torch.is_grad_enabled():
                self._pass.no_grad_forward.add(module)
        units = self.table.module_units[module]
        started = time.perf_counter()
        needs = [u for u in units if self.table.units[u].state is UnitState.RELEASED]
        if needs:
            self._evict_for(sum(self._numel[u] for u in needs), keep=set(units))
        plan = self._plan_prefetch(self._pass.position, about_to_gather=needs) if self._pass.on_trace else []
        self._fetch(needs, plan)
        if self._pass.on_trace:
            self._stage_ahead(self._pass.position)
        self.stats.fetches += len(units)
        self.stats.on_demand += len(needs)
        for index in units:
            unit = self.table.units[index]
            if index in needs:
                continue
            if unit.state is UnitState.IN_FLIGHT:
                self.stats.in_flight += 1
                unit.wait()
            else:
                self.stats.already_gathered += 1
            self._resident.prefetched.discard(index)
        self.stats.blocked_s += time.perf_counter() - started

    def after_forward(self, module: int) -> None:
        """Releases the module's units unless the trace says they are reused soon. Not during backward:
        there a forward is activation-checkpoint recomputation and its backward comes next."""
        if self._pass.running and self._pass.running[-1] == module:
            self._pass.running.pop()
        if self._pass.phase == BACKWARD:
            return
        position = self._pass.event_position.get(module, -1)
        for index in self.table.module_units[module]:
            keep = (
                self._pass.on_trace
                and position >= 0
                and keep_after_use(self._pass.trace, position, index, self.knobs)
                and self._resident.live_numel <= self.knobs.max_live_numel
            )
            if not keep:
                self._release(index)

    def on_external_use(self, unit: int) -> None:
        """The running module's forward used a parameter of a unit it does not own (a module reading a child's
        weight without calling the child). From now on the module fetches that unit too; now it is fetched on
        demand, through an exchange like any fetch."""
        module = self._pass.running[-1] if self._pass.running else 0
        if unit not in self.table.module_units[module]:
            self.table.module_units[module] += (unit,)
        self._fetch_on_demand(unit, keep={unit, *self.table.module_units[module]})

    def _fetch_on_demand(self, unit: int, *, keep: set[int]) -> None:
        """One unit gathered now, outside the trace's plan: room made within max_live (``keep`` stays), counted."""
        started = time.perf_counter()
        self._evict_for(self._numel[unit], keep=keep)
        self._fetch([unit], [])
        self.stats.fetches += 1
        self.stats.on_demand += 1
        self.stats.blocked_s += time.perf_counter() - started

    # ---- the end of a unit's backward: [Note: release after backward] ----
    def set_grad_params(self, counts: list[int]) -> None:
        """Per unit, how many of its parameters get a gradient (trainable ones, optimized or not)."""
        self._grad_params = list(counts)
        self._pass.grads_left = list(counts)

    def expect_module_backward(self, module: int) -> Callable[[], None] | None:
        """The module is about to run forward with inputs that require grad: returns the callback its
        post-backward calls, or None where no such wait applies. A recomputation inside backward only counts
        when the module's first forward ran without grad (reentrant checkpointing runs backward through the
        recomputed graph; non-reentrant recomputation builds a graph that is never run backward)."""
        if not self._pass.grad_mode:
            return None
        if self._pass.phase == BACKWARD and module not in self._pass.no_grad_forward:
            return None
        units = self.table.module_units[module]
        for unit in units:
            self._pass.awaiting[unit] = self._pass.awaiting.get(unit, 0) + 1
        return functools.partial(self._module_backward_done, self._pass_number, units)

    def on_param_grad(self, unit: int) -> None:
        """One parameter of the unit has its gradient (or will get none: unused this backward)."""
        self._pass.grads_left[unit] -= 1
        self._release_if_backward_done(unit)

    def before_param_grad(self, unit: int) -> None:
        """A trainable parameter of the unit is about to have its gradient accumulated, which needs the whole
        parameter (autograd lays the gradient out as the parameter is). A unit released by then, because a custom
        autograd function took the parameter directly and gathered it itself ([Note: TRL's fused head] in
        integrations/trl_patches.py), or kept the gradient from the forward, is gathered again on demand; the
        gradients coming in release it as usual ([Note: release after backward])."""
        self.table.units[unit].wait()
        if self.table.units[unit].state is UnitState.RELEASED:
            self._fetch_on_demand(unit, keep={unit})

    def expects_grads(self, unit: int) -> bool:
        """Inside a backward of this pass, before the unit's gradients are all in: a gather ending now
        (GatheredParameters inside a custom function's backward) leaves the unit to be released as its
        gradients arrive, instead of releasing it for them to be fetched again."""
        return (self.in_pass and self._pass.grad_mode and torch._C._current_graph_task_id() != -1
                and self._pass.grads_left[unit] > 0)  # fmt: skip

    def keep_for_grads(self, unit: int) -> None:
        """A unit a GatheredParameters gathered inside backward stays for its gradients (expects_grads): it counts
        as live (max_live, peak) until they release it."""
        self._resident.add(unit, self._numel[unit])
        self.stats.peak_live_numel = max(self.stats.peak_live_numel, self._resident.live_numel)

    def _module_backward_done(self, pass_number: int, units: tuple[int, ...]) -> None:
        if pass_number != self._pass_number or not self.in_pass:
            return  # a pass that ended without its backward
        for unit in units:
            self._pass.awaiting[unit] -= 1
            self._release_if_backward_done(unit)

    def _release_if_backward_done(self, unit: int) -> None:
        if self._pass.awaiting.get(unit, 0) > 0 or self._pass.grads_left[unit] > 0:
            return
        if not self.table.units[unit].persistent and self.table.units[unit].state is not UnitState.RELEASED:
            self._release(unit)

    # ---- outside a pass (GatheredParameters, saving) ----
    def gather_now(self, indices: list[int]) -> list[bool]:
        """Gathers units for use outside forward/backward (every rank calls this with the same units, as
        GatheredParameters requires); per unit, whether it was released (the caller releases it again). Always a
        rendezvous, so a rank that already holds a unit still answers the ones that do not."""
        for index in indices:
            self.table.units[index].wait()
        wanted = [i for i in indices if self.table.units[i].state is UnitState.RELEASED]
        union = self._rendezvous.ask(wanted) if self.comm.active else wanted
        for index in union:
            if index in wanted:
                self.table.units[index].gather(self.comm, self.table.shards, async_op=False)
            else:
                self._gather_for_others(index)
        return [i in wanted for i in indices]

    def release_now(self, index: int) -> None:
        self._release(index)

    def close(self) -> None:
        """Waits for the all-gathers in flight and releases every unit (the engine is being destroyed)."""
        for index in list(self._resident.live):
            self._release(index)
        self.in_pass = False

    # ---- internals ----
    def _reset_pass(self, *, grad_mode: bool) -> None:
        trace = self._traces.get(grad_mode)  # followed whatever the knobs: each one acts alone (schedule.py)
        self._pass = PassState(
            grad_mode=grad_mode, trace=trace, on_trace=trace is not None, grads_left=list(self._grad_params)
        )
        self._pass_number += 1
        self.stats = FetchStats()

    def _describe(self, event: Event) -> str:
        return f"{self.table.module_names[event.module]} ({event.phase})"

    def _follow_trace(self, event: Event) -> None:
        if not self._pass.on_trace:
            return
        following = self._pass.position + 1
        if following < len(self._pass.trace) and self._pass.trace.events[following] == event:
            self._pass.position = following
            return
        self._diverge(self._describe(event))

    def _diverge(self, actual: str) -> None:
        following = self._pass.position + 1
        expected = (
            self._describe(self._pass.trace.events[following]) if following < len(self._pass.trace) else "the end"
        )
        self._pass.divergence = (expected, actual)
        self._pass.on_trace = False
        self._pass.position = -1

    def _fetch(self, needs: list[int], prefetch: list[int]) -> None:
        """[Note: fetch rendezvous] in rendezvous.py: needs are gathered now, prefetches asynchronously. While the
        step runs behind the forward, a unit not stepped yet is prefetched only when it is the next such unit:
        gathering it steps it, which is compute, so it runs a unit ahead of the forward, not a prefetch bucket
        ahead ([Note: step behind forward] in unit_optimizer.py)."""
        pending = self.table.shards.is_pending
        if pending is not None:
            later = [index for index in prefetch if pending(index)][1:]
            prefetch = [index for index in prefetch if index not in later]
        if not needs and not prefetch:
            return
        union = self._rendezvous.ask(needs + prefetch) if self.comm.active else sorted(set(needs) | set(prefetch))
        for index in union:
            if index in needs:
                self._gather(index, async_op=False)
            elif index in prefetch and self.table.units[index].state is UnitState.RELEASED:
                self._gather(index, async_op=True)
                self._resident.prefetched.add(index)
                self.stats.prefetches += 1
            else:  # another rank asked for it: take part, keep nothing
                self._gather_for_others(index)

    def _stage_ahead(self, position: int) -> None:
        """Offloaded shards (NVMe): start reading the pieces of the next units along the trace that are not
        gathered, as far as the staging buffers go (plan_swap_in: the look-ahead of the all-gathers, longer)."""
        shards = self.table.shards
        capacity = shards.staging_capacity
        if not capacity:
            return
        kept = shards.kept  # pieces max_in_cpu keeps in host memory: nothing to read, no buffer taken
        resident = (self._resident.live | kept) if kept else self._resident.live
        before = shards.read_ahead
        for unit in plan_swap_in(self._pass.trace, position, resident=resident, limit=capacity):
            if not shards.stage(unit):
                break
        self.stats.read_ahead += shards.read_ahead - before

    def _drain(self) -> None:
        """Answer other ranks' requests until every rank is done with its pass."""
        if self.comm.active:
            self._rendezvous.drain(self._gather_for_others)

    def _gather(self, index: int, *, async_op: bool) -> None:
        self.table.units[index].gather(self.comm, self.table.shards, async_op=async_op)
        self._resident.add(index, self._numel[index])
        self.stats.gathered_numel += self._numel[index]
        self.stats.peak_live_numel = max(self.stats.peak_live_numel, self._resident.live_numel)

    def _gather_for_others(self, index: int) -> None:
        gather_for_others(self.comm, self.table, index)
        self.stats.gathered_numel += self._numel[index]

    def _plan_prefetch(self, position: int, about_to_gather: list[int] = ()) -> list[int]:
        plan, blocked_at = self._plan(position, about_to_gather)
        if blocked_at is not None and self._pass.phase == FORWARD:
            # Units kept for reuse and not needed before the blocked one make room for it. Not in backward:
            # there a gathered unit may still wait for its gradients.
            needed = used_between(self._pass.trace, max(position, 0), blocked_at) | set(plan)
            evictable = [
                u
                for u in self._resident.live - self._resident.prefetched - needed
                if self.table.units[u].state is UnitState.GATHERED
            ]
            if evictable:
                for index in evictable:
                    self._release(index)
                plan, _ = self._plan(position, about_to_gather)
        return plan

    def _plan(self, position: int, about_to_gather) -> tuple[list[int], int | None]:
        return plan_prefetch(
            self._pass.trace, position, resident=self._resident.live | set(about_to_gather),
            live_numel=self._resident.live_numel + sum(self._numel[u] for u in about_to_gather),
            prefetched_numel=sum(self._numel[u] for u in self._resident.prefetched), knobs=self.knobs,
        )  # fmt: skip

    def _evict_for(self, numel: int, *, keep: set[int]) -> None:
        """Before a demand fetch beyond max_live_parameters, release units kept for reuse (forward only: in
        backward a gathered unit is waiting for its gradients)."""
        if self._pass.phase == BACKWARD:
            return
        for index in sorted(self._resident.live - keep - self._resident.prefetched, key=lambda u: -self._numel[u]):
            if self._resident.live_numel + numel <= self.knobs.max_live_numel:
                return
            if self.table.units[index].state is UnitState.GATHERED:
                self._release(index)

    def _release(self, index: int) -> None:
        unit = self.table.units[index]
        if unit.persistent or self.held.get(index):
            return
        unit.wait()  # a collective still writing into the buffer must finish first
        unit.release()
        self._resident.remove(index, self._numel[index])

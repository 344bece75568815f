"""Gradient reduction for ZeRO stages 0-3: one collective per bucket, launched in a fixed order.

Each parameter's gradient is taken as soon as autograd has accumulated it (a post-accumulate-grad hook):
it is added, in fp32, into its bucket's flat buffer and ``param.grad`` is freed. Then:
- stages 0 and 1 keep full fp32 buffers across micro-steps and all-reduce them once, at the accumulation
  boundary; each rank copies its piece (stage 0: everything) into its gradient shard;
- stage 2 reduce-scatters every micro-step into the rank's piece and adds it to the gradient shard, so no rank
  keeps a full gradient beyond the buckets in flight. Stage 3 does the same with each unit as a bucket.

[Note: fixed launch order]
Buckets are launched in reverse layout order (the order backward usually completes them), and bucket k only
after every bucket before it in that order: a collective is issued in the same sequence on every rank, whatever
order the hooks fire in. With overlap_comm the launches are asynchronous and happen inside backward, as soon as
the prefix is complete; without it they happen after backward. finish_backward() launches what is left (buckets
with unused parameters contribute zeros) and waits for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from infinity.zero import collectives
from infinity.zero.collectives import Comm, Pending
from infinity.zero.gradient_shards import GradientShards
from infinity.zero.partition import Bucket, GroupLayout


@dataclass(slots=True)
class _BucketState:
    bucket: Bucket
    expected: int  # parameters of the bucket that require grad
    arrived: int = 0
    buffer: torch.Tensor | None = None  # (padded_numel,) fp32, on the compute device; padding always zero
    written: set[int] = field(default_factory=set)  # slot offsets holding a gradient since the last reduction


@dataclass(slots=True)
class GradientReducer:
    comm: Comm
    stage: int
    layouts: tuple[GroupLayout, ...]
    gradients: GradientShards | None  # where this rank's reduced gradient goes (None: ``deliver`` takes it)
    shard_rank: int  # piece index of this rank (0 at stage 0: every rank holds everything)
    device: torch.device
    overlap_comm: bool
    _states: list[_BucketState] = field(default_factory=list)
    _order: list[int] = field(default_factory=list)  # launch order: indices into _states
    _next: int = 0
    _pending: list[Pending] = field(default_factory=list)
    _spare: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # stage 2: reusable buffers by size
    reduce_this_backward: bool = False
    expected: list[int] | None = None  # per bucket: parameters that get gradients (default: all of them)
    keep_spares: bool = True  # stage 3 frees each unit's buffer: its sizes are as many as its modules
    max_in_flight: int | None = 2  # reductions in flight before the oldest is waited for; None: never wait
    # in backward (stage 3: a rank blocked here could not answer a peer's fetch: [Note: fetch rendezvous] in
    # rendezvous.py)
    deliver: Callable[[int, torch.Tensor], None] | None = None  # stage 3, gradients on NVMe: (unit, reduced
    # piece) goes there instead of into ``gradients`` ([Note: swapped gradients] in grads.py)
    peak_buffer_bytes: int = 0  # most bytes of bucket buffers in use at once (reset by the caller)
    peak_waiting_bytes: int = 0  # ... of those filled and waiting for their turn to be reduced (stages 2, 3)
    _waiting_bytes: int = 0
    _in_use_bytes: int = 0  # buffers acquired and not yet returned (stages 0/1 keep theirs)

    def __post_init__(self) -> None:
        for layout in self.layouts:
            for bucket in layout.buckets:
                count = len(bucket.slots) if self.expected is None else self.expected[len(self._states)]
                self._states.append(_BucketState(bucket=bucket, expected=count))
        # Buckets whose parameters are all frozen never get a gradient: no collective for them.
        self._order = [i for i in reversed(range(len(self._states))) if self._states[i].expected > 0]

    def state_index(self, group: int, bucket: int) -> int:
        return sum(len(layout.buckets) for layout in self.layouts[:group]) + bucket

    # ---- called by the engine around each backward ----
    def begin_backward(self, *, boundary: bool) -> None:
        """Stage 2 reduces every micro-step; stages 0/1 only at the accumulation boundary."""
        self.reduce_this_backward = self.stage >= 2 or boundary
        self._next = 0
        for state in self._states:
            state.arrived = 0

    def on_grad(self, state_index: int, offset: int, grad: torch.Tensor) -> None:
        """Called from the parameter's post-accumulate-grad hook."""
        state = self._states[state_index]
        if state.buffer is None:
            state.buffer = self._acquire(state.bucket)
            if self.stage >= 2:  # filled now, reduced when its turn in the launch order comes
                self._waiting_bytes += state.buffer.numel() * 4
                self.peak_waiting_bytes = max(self.peak_waiting_bytes, self._waiting_bytes)
        target = state.buffer[offset : offset + grad.numel()]
        if offset in state.written:
            target.add_(grad.reshape(-1))
        else:  # first gradient for this slot since the last reduction: no need to zero first
            target.copy_(grad.reshape(-1))
            state.written.add(offset)
        if not self.reduce_this_backward:
            return
        self._arrived(state)

    def on_no_grad(self, state_index: int) -> None:
        """A parameter of the bucket gets no gradient this backward ([Note: unused parameters] in unused.py): it
        counts as arrived now, and its slot is reduced as zeros (or as what earlier micro-steps accumulated)."""
        if self.reduce_this_backward:
            self._arrived(self._states[state_index])

    def _arrived(self, state: _BucketState) -> None:
        state.arrived += 1
        if self.overlap_comm and state.arrived == state.expected:
            self._launch_ready_prefix(complete_only=True)
            self._reap_finished()

    def finish_backward(self) -> None:
        if not self.reduce_this_backward:
            return
        self._launch_ready_prefix(complete_only=False)
        for pending in self._pending:
            pending.wait()
        self._pending.clear()

    # ---- internals ----
    def _reap_finished(self) -> None:
        """Finishes the reductions that are complete, so their buffers go back before backward ends."""
        if any(p.done() for p in self._pending):
            still = []
            for pending in self._pending:
                if pending.done():
                    pending.wait()
                else:
                    still.append(pending)
            self._pending = still

    def _launch_ready_prefix(self, *, complete_only: bool) -> None:
        while self._next < len(self._order):
            state = self._states[self._order[self._next]]
            if complete_only and state.arrived < state.expected:
                return
            self._launch(state, async_op=self.overlap_comm)
            self._next += 1

    def _launch(self, state: _BucketState, *, async_op: bool) -> None:
        bucket = state.bucket
        if state.buffer is None:
            state.buffer = self._acquire(bucket)
        elif self.stage >= 2:
            self._waiting_bytes -= state.buffer.numel() * 4
        for slot in bucket.slots:  # parameters that got no gradient contribute zeros
            if slot.offset not in state.written:
                state.buffer[slot.offset : slot.offset + slot.numel].zero_()
        state.written.clear()
        buffer = state.buffer
        if self.stage >= 2:
            piece = torch.empty(bucket.piece_numel, dtype=torch.float32, device=self.device)
            pending = collectives.reduce_scatter_mean(self.comm, piece, buffer, async_op=async_op)
            state.buffer = None  # back to the spares once the collective is done with it

            def finish(piece=piece, buffer=buffer, bucket=bucket):
                if self.deliver is not None:
                    self.deliver(bucket.index, piece)
                else:  # the window's first piece is copied, later ones added ([Note: gradient shards])
                    self.gradients.write(bucket.group, bucket.shard_offset, piece)
                self._in_use_bytes -= buffer.numel() * buffer.element_size()
                if self.keep_spares:
                    self._spare.setdefault(buffer.numel(), []).append(buffer)

        else:
            pending = collectives.all_reduce_mean(self.comm, buffer, async_op=async_op)
            start, end = bucket.piece_range(self.shard_rank)

            def finish(buffer=buffer, bucket=bucket, start=start, end=end):
                self.gradients.write(bucket.group, bucket.shard_offset, buffer[start:end])  # once per window

        self._pending.append(pending.then(finish))
        if self.max_in_flight is not None and len(self._pending) > self.max_in_flight:
            self._pending.pop(0).wait()  # bounds the buffers in flight

    def _acquire(self, bucket: Bucket) -> torch.Tensor:
        """A bucket buffer: a spare one (stage 2 reuses them across buckets and micro-steps) or a new one.
        Only the padding must be zero; every slot is overwritten before it is read. New ones are left empty, so
        their pages are touched as gradients arrive (while backward frees activations), not all at once."""
        numel = bucket.padded_numel
        self._in_use_bytes += numel * 4
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._in_use_bytes)
        spares = self._spare.get(numel)
        buffer = spares.pop() if spares else torch.empty(numel, dtype=torch.float32, device=self.device)
        buffer[bucket.numel :].zero_()
        return buffer

    def drop_spares(self) -> None:
        """After the step: spare buffers go back (stage 2 keeps them across the micro-steps of a window only;
        between windows the forward's activations need the room)."""
        self._spare.clear()

    def buffer_bytes(self) -> int:
        """Bytes of gradient buffers currently held (stage 0/1: full; stage 2: none between micro-steps)."""
        return sum(s.buffer.numel() * 4 for s in self._states if s.buffer is not None)

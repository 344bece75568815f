"""Gradient reduction for ZeRO stages 0-3: one collective per bucket, launched in an order fixed per backward.

Each parameter's gradient is taken as soon as autograd has accumulated it (a post-accumulate-grad hook):
it is added, in fp32, into its bucket's flat buffer and ``param.grad`` is freed. Then:
- stages 0 and 1 keep full fp32 buffers across micro-steps and all-reduce them once, at the accumulation
  boundary; each rank copies its piece (stage 0: everything) into its gradient shard;
- stage 2 reduce-scatters every micro-step into the rank's piece and adds it to the gradient shard, so no rank
  keeps a full gradient beyond the buckets in flight. Stage 3 does the same with each unit as a bucket.

[Note: fixed launch order]
Buckets are launched in an order fixed before backward starts, and bucket k only after every bucket before it in
that order: a collective is issued in the same sequence on every rank, whatever order the hooks fire in. Stages
0-2 start from reverse layout order (the order backward usually completes them; stage 2 then launches in the
order the last backward completed them: [Note: learned order]). Stage 2 launches inside backward, as
soon as the prefix is complete: asynchronously with overlap_comm (at most max_in_flight at once), synchronously
without it, so a bucket's buffer goes back as soon as it is reduced, as DeepSpeed reduces each bucket as it fills
either way (holding them all until backward ends would hold the whole model's fp32 gradient). Stages 0-1 keep
their full buffers across the window and, without overlap_comm, launch after backward. finish_backward()
launches what is left (buckets with unused parameters contribute zeros) and waits for all of them. Stage 3:
[Note: launch order].

[Note: learned order]
Stage 2's fixed order is a guess: where the optimizer's param groups (a Trainer's decay and no-decay groups) or
the modules' registration order differ from the order backward completes the buckets, a bucket filled early waits
for every bucket before it, and the waiting ones add up to the whole model's gradient. So each backward records
the order it completed its buckets in, and the next backward launches in one order merged from every rank's (one
small all-gather before each backward): each bucket at the latest place any rank completed it, so ranks whose
branches took other parameters still launch alike. The first backward has nothing learned yet: it takes the
order the autograd graph predicts (a bucket is complete once the node with the smallest sequence number feeding
its parameters has run: unused.py's last_uses), or the fixed one where the graph hides its leaves (a reentrant
checkpoint). An order that is off only costs memory, never the result.

[Note: launch order]
Stage 3 launches in execution order, and inside backward with or without overlap_comm: a unit's fp32 bucket is
the size of the unit, so holding every bucket until backward ends would hold the whole model's gradient. Before
each backward the ranks agree on the order (``launch_order``, the coordinator's reduce_order): the reverse of
the units' first uses in this pass's forward, which is when backward completes them, whatever order the modules
were registered in; ranks whose forwards differed fall back to the fixed order, last unit first (a bucket
completed early then waits for its turn; results are the same, only memory differs). Then:
- overlap_comm: each reduction is launched asynchronously as its prefix completes; while the elements in
  flight exceed reduce_bucket_size (``in_flight_numel``; one bucket always goes), the oldest is waited for;
- without it each reduction is waited for as soon as it is launched, before backward goes on.
So the buckets held at once are the ones in flight plus the unit whose gradients are arriving, not the model.
A wait inside backward must not hang: a peer may need this rank in a fetch before it gets to launch the same
reduction. So it is the coordinator's ``wait_for_reduction``: this rank keeps answering fetches, its headers
saying how many reductions it has launched, until every rank has launched the awaited one; only then does it
block on it (which cannot hang: every rank's part is under way). Launch counts, not the work's own completion:
gloo's reduce-scatter reports itself complete only once waited for. A rank that has finished its pass has
launched all of its backward's reductions: ``launch_rest`` runs before the pass's drain. The agreement on the
order is an exchange of the same protocol ([Note: fetch rendezvous] in rendezvous.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from infinity.errors import InfinityError
from infinity.memory import host
from infinity.zero import collectives
from infinity.zero.collectives import Comm, Pending
from infinity.zero.gradient_shards import GradientShards
from infinity.zero.partition import Bucket, GroupLayout

MAX_SPARES = 3  # stage 2: reduced buffers kept for reuse (as many as may be in flight, and one filling)


@dataclass(slots=True)
class _BucketState:
    bucket: Bucket
    expected: int  # parameters of the bucket that require grad
    index: int  # its place in GradientReducer._states
    arrived: int = 0
    arrived_slots: set[int] = field(default_factory=set)  # slot offsets whose gradient arrived this backward
    launched: bool = False  # its reduction was launched this backward
    buffer: torch.Tensor | None = None  # (padded_numel,) fp32, on the compute device; padding always zero
    written: set[int] = field(default_factory=set)  # slot offsets holding a gradient since the last reduction


@dataclass(slots=True)
class _InFlight:
    pending: Pending
    numel: int  # elements of its bucket
    sequence: int  # its place in this backward's launches, from 1


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
    _pending: list[_InFlight] = field(default_factory=list)  # launched, not finished, oldest first
    _launched: int = 0  # reductions launched in this backward
    _open: bool = False  # a backward's reductions are not all launched yet
    _fixed_order: list[int] = field(default_factory=list)  # reverse layout order, the same on every rank
    _completed: list[int] = field(default_factory=list)  # stage 2: buckets in the order this backward completed them
    _learned: list[int] | None = None  # stage 2: the last backward's completion order ([Note: learned order])
    _spare: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # stage 2: reusable buffers by size
    _spare_count: int = 0
    _spare_bytes: int = 0
    reduce_this_backward: bool = False
    expected: list[int] | None = None  # per bucket: parameters that get gradients (default: all of them)
    spare_budget_bytes: int | None = None  # stage 3: buffers and pieces are kept across steps for reuse, in use
    # and kept together within this many bytes (memory/pool.py stage3_gradient_numel; 0 on a GPU, whose caching
    # allocator reuses, and where a kept piece could still be read by a copy to the host); None: stage 2's rule
    # (MAX_SPARES buffers, kept within an accumulation window)
    max_in_flight: int | None = 2  # stages 0-2: reductions in flight before the oldest is waited for; None:
    # never (stage 3 bounds them by in_flight_numel, waiting through wait_in_backward)
    deliver: Callable[[int, torch.Tensor], None] | None = None  # stage 3, gradients on NVMe: (unit, reduced
    # piece) goes there instead of into ``gradients`` ([Note: swapped gradients] in grads.py)
    # Stage 3 ([Note: launch order]), set by the stage-3 runtime: the order of each backward's launches (a
    # collective: every rank calls it before its backward); the wait used before the pass ends, given the work,
    # this rank's launches so far and the launches it needs from every rank; reduce_bucket_size
    launch_order: Callable[[], Sequence[int]] | None = None
    wait_in_backward: Callable[[Pending, int, int], None] | None = None
    in_flight_numel: int | None = None  # most elements being reduced at once (one bucket always goes); None: any
    before_launch: Callable[[int], None] | None = None  # stage 3: called with k before this backward's k-th launch
    # inside the pass ([Note: one collective order] in rendezvous.py)
    peak_buffer_bytes: int = 0  # most bytes of bucket buffers held at once, spares too (reset by the caller)
    peak_waiting_bytes: int = 0  # ... of those filled and waiting for their turn to be reduced (stages 2, 3)
    _waiting_bytes: int = 0
    _in_use_bytes: int = 0  # buffers acquired and not yet returned (stages 0/1 keep theirs)
    _in_use_count: int = 0
    _pieces_bytes: int = 0  # stage 3: reduced pieces taken from the spares and not yet delivered
    buffers_made: int = 0  # buffers and pieces allocated rather than reused, since the start
    _step_peak: tuple[int, int] = (0, 0)  # (buffers, elements) held at most since take_peaks()

    def __post_init__(self) -> None:
        for layout in self.layouts:
            for bucket in layout.buckets:
                count = len(bucket.slots) if self.expected is None else self.expected[len(self._states)]
                self._states.append(_BucketState(bucket=bucket, expected=count, index=len(self._states)))
        # Buckets whose parameters are all frozen never get a gradient: no collective for them.
        self._order = [i for i in reversed(range(len(self._states))) if self._states[i].expected > 0]
        self._fixed_order = list(self._order)

    def state_index(self, group: int, bucket: int) -> int:
        return sum(len(layout.buckets) for layout in self.layouts[:group]) + bucket

    # ---- called by the engine around each backward ----
    @property
    def fixed_order(self) -> list[int]:
        return list(self._fixed_order)

    def begin_backward(self, *, boundary: bool, predicted: list[int] | None = None) -> None:
        """Stage 2 reduces every micro-step; stages 0/1 only at the accumulation boundary. ``predicted``: the
        order the graph says this backward completes the buckets in, for stage 2 before it has learned one."""
        self.reduce_this_backward = self.stage >= 2 or boundary
        self._open = self.reduce_this_backward
        self._next = 0
        self._launched = 0
        for state in self._states:
            state.arrived = 0
            state.arrived_slots.clear()
            state.launched = False
        if self.launch_order is not None:
            self._order = [i for i in self.launch_order() if self._states[i].expected > 0]
        elif self.stage == 2:  # every rank calls _agreed (a collective), whatever it brings
            self._order = self._agreed(self._learned or predicted or self._fixed_order)
        self._completed = []

    def on_grad(self, state_index: int, offset: int, grad: torch.Tensor) -> None:
        """Called from the parameter's post-accumulate-grad hook (once per backward, unless reentrant activation
        checkpointing runs the parameter's uses in backward passes of their own: a second gradient is added to the
        first while its bucket waits, and an error once the bucket has been reduced, as DeepSpeed's)."""
        state = self._states[state_index]
        again = self.reduce_this_backward and offset in state.arrived_slots
        if again and state.launched:
            raise InfinityError(
                f"a parameter of gradient bucket {state.index} got a second gradient in one backward after its bucket "
                "was reduced: reentrant activation checkpointing runs a parameter used in two checkpointed segments "
                "in two backward passes; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) (Hugging "
                "Face: gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
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
        if not self.reduce_this_backward or again:
            return
        state.arrived_slots.add(offset)
        self._arrived(state)

    def on_no_grad(self, state_index: int) -> None:
        """A parameter of the bucket gets no gradient this backward ([Note: unused parameters] in unused.py): it
        counts as arrived now, and its slot is reduced as zeros (or as what earlier micro-steps accumulated)."""
        if self.reduce_this_backward:
            self._arrived(self._states[state_index])

    def _arrived(self, state: _BucketState) -> None:
        state.arrived += 1
        if state.arrived == state.expected:
            self._completed.append(state.index)
        if state.arrived == state.expected and (self.overlap_comm or self.stage >= 2):
            self._launch_ready_prefix(complete_only=True)
            self._reap_finished()

    def launch_rest(self) -> None:
        """Stage 3, as the pass ends (before its drain): launches what backward left, so a rank that says it is
        done has launched every reduction of its backward ([Note: launch order])."""
        if self._open:
            self._launch_ready_prefix(complete_only=False)
            self._open = False

    def finish_backward(self) -> None:
        """After backward (at stage 3 after the pass has ended: no rank needs a fetch any more)."""
        if not self.reduce_this_backward:
            return
        self._launch_ready_prefix(complete_only=False, in_backward=False)
        self._open = False
        for flight in self._pending:
            flight.pending.wait()
        self._pending.clear()
        if self.stage == 2:
            done = set(self._completed)
            self._learned = self._completed + [i for i in self._fixed_order if i not in done]

    def _agreed(self, learned: list[int]) -> list[int]:
        """One order from every rank's learned one (a collective: every rank calls it before each backward at
        stage 2): each bucket at the latest place any rank completed it, ties in the fixed order. Where the ranks
        agree that is their order; where they differ (a branch one rank took), every rank computes the same merge
        from the same rows."""
        if not self.comm.active:
            return list(learned)
        mine = torch.tensor(learned, dtype=torch.int64, device=self.device)
        every = torch.empty(mine.numel() * self.comm.world_size, dtype=torch.int64, device=self.device)
        collectives.all_gather_pieces(self.comm, every, mine, async_op=False).wait()
        latest: dict[int, int] = {}
        for row in every.view(self.comm.world_size, -1).tolist():
            for position, index in enumerate(row):
                latest[index] = max(latest.get(index, -1), position)
        fixed = {index: k for k, index in enumerate(self._fixed_order)}
        return sorted(latest, key=lambda index: (latest[index], fixed[index]))

    def take_peaks(self) -> tuple[int, int]:
        """(buffers, elements) of bucket buffers held at most since the last call."""
        peak = self._step_peak
        self._step_peak = (self._in_use_count, self._in_use_bytes // 4)
        return peak

    # ---- internals ----
    def _reap_finished(self) -> None:
        """Finishes the reductions that are complete, so their buffers go back before backward ends."""
        if any(flight.pending.done() for flight in self._pending):
            still = []
            for flight in self._pending:
                if flight.pending.done():
                    flight.pending.wait()
                else:
                    still.append(flight)
            self._pending = still

    def _launch_ready_prefix(self, *, complete_only: bool, in_backward: bool = True) -> None:
        while self._next < len(self._order):
            state = self._states[self._order[self._next]]
            if complete_only and state.arrived < state.expected:
                return
            self._next += 1
            self._launch(state, in_backward=in_backward)

    def _launch(self, state: _BucketState, *, in_backward: bool) -> None:
        if in_backward and self.before_launch is not None:
            self.before_launch(self._launched + 1)  # [Note: one collective order] in rendezvous.py
        # Stage 3 in backward: always asynchronous, then waited for below ([Note: launch order])
        waits_here = in_backward and self.wait_in_backward is not None
        async_op = self.overlap_comm or waits_here
        bucket = state.bucket
        state.launched = True
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
            if self.comm.active or self.device.type != "cpu":  # a device piece may be read by a copy in flight
                piece = (self._take_piece(bucket.piece_numel) if self.spare_budget_bytes is not None
                         else torch.empty(bucket.piece_numel, dtype=torch.float32, device=self.device))  # fmt: skip
                pending = collectives.reduce_scatter_mean(self.comm, piece, buffer, async_op=async_op)
            else:  # one rank on the host: the bucket is its own mean and piece (its delivery copies at once)
                piece, pending = buffer, Pending(None)
            state.buffer = None  # back to the spares once the collective is done with it
            pooled_piece = piece is not buffer and self.spare_budget_bytes is not None  # from _take_piece

            def finish(piece=piece, buffer=buffer, bucket=bucket, pooled_piece=pooled_piece):
                if self.deliver is not None:
                    self.deliver(bucket.index, piece)
                else:  # the window's first piece is copied, later ones added ([Note: gradient shards])
                    self.gradients.write(bucket.group, bucket.shard_offset, piece)
                self._in_use_bytes -= buffer.numel() * buffer.element_size()
                self._in_use_count -= 1
                if pooled_piece:
                    self._pieces_bytes -= piece.numel() * 4
                self._keep_spare(buffer)  # the larger first, where the budget is tight
                if pooled_piece:
                    self._keep_spare(piece)

        else:
            pending = collectives.all_reduce_mean(self.comm, buffer, async_op=async_op)
            start, end = bucket.piece_range(self.shard_rank)

            def finish(buffer=buffer, bucket=bucket, start=start, end=end):
                self.gradients.write(bucket.group, bucket.shard_offset, buffer[start:end])  # once per window

        self._launched += 1
        self._pending.append(_InFlight(pending.then(finish), buffer.numel(), self._launched))
        if waits_here and not self.overlap_comm:  # reduced before backward goes on
            while self._pending:
                self._wait_oldest(in_backward=True)
        elif not async_op:  # stage 2 without overlap_comm: reduced already; its buffer goes back now
            while self._pending:
                self._pending.pop(0).pending.wait()
        elif self.in_flight_numel is not None:  # while more than reduce_bucket_size is in flight (one always goes)
            while len(self._pending) > 1 and sum(f.numel for f in self._pending) > self.in_flight_numel:
                self._wait_oldest(in_backward=waits_here)
        elif self.max_in_flight is not None and len(self._pending) > self.max_in_flight:
            self._pending.pop(0).pending.wait()  # bounds the buffers in flight

    def _wait_oldest(self, *, in_backward: bool) -> None:
        flight = self._pending.pop(0)
        if in_backward:
            self.wait_in_backward(flight.pending, self._launched, flight.sequence)
        else:
            flight.pending.wait()

    def _acquire(self, bucket: Bucket) -> torch.Tensor:
        """A bucket buffer: a spare one (stage 2 reuses them across buckets and micro-steps, stage 3 across
        steps) or a new one.
        Only the padding must be zero; every slot is overwritten before it is read. New ones are left empty, so
        their pages are touched as gradients arrive (while backward frees activations), not all at once."""
        numel = bucket.padded_numel
        self._in_use_bytes += numel * 4
        self._in_use_count += 1
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._in_use_bytes)
        count, elements = self._step_peak
        self._step_peak = (max(count, self._in_use_count), max(elements, self._in_use_bytes // 4))
        buffer = self._spare_or_new(numel, in_use=self._in_use_bytes - numel * 4)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._in_use_bytes + self._spare_bytes)
        buffer[bucket.numel :].zero_()
        return buffer

    def _take_piece(self, numel: int) -> torch.Tensor:
        """A reduced piece's memory: a spare of its size or a new one (filled whole by the collective)."""
        piece = self._spare_or_new(numel, in_use=self._in_use_bytes)
        self._pieces_bytes += numel * 4
        return piece

    def _spare_or_new(self, numel: int, *, in_use: int) -> torch.Tensor:
        spares = self._spare.get(numel)
        if spares:
            self._spare_count -= 1
            self._spare_bytes -= numel * 4  # in use from here on
            return spares.pop()
        if self.spare_budget_bytes is not None:  # kept ones of other sizes make room for the new one
            self._make_room(in_use + self._pieces_bytes + numel * 4)
        self.buffers_made += 1
        return torch.empty(numel, dtype=torch.float32, device=self.device)

    def _make_room(self, needed: int) -> None:
        for size in sorted(self._spare, reverse=True):
            spares = self._spare[size]
            while spares and needed + self._spare_bytes > self.spare_budget_bytes:
                spares.pop()
                self._spare_count -= 1
                self._spare_bytes -= size * 4
        self._spare = {size: spares for size, spares in self._spare.items() if spares}

    def _keep_spare(self, buffer: torch.Tensor) -> None:
        """A reduced bucket's buffer (or piece), kept for the next of its size rather than handed back and
        faulted in again ([Note: buffer reuse] in memory/pool.py): stage 3 within spare_budget_bytes, stage 2 at
        most MAX_SPARES (buckets of many sizes must not keep one buffer each, the whole model's gradient)."""
        nbytes = buffer.numel() * 4
        if self.spare_budget_bytes is not None:
            if self._in_use_bytes + self._pieces_bytes + self._spare_bytes + nbytes > self.spare_budget_bytes:
                return
        elif self._spare_count >= MAX_SPARES:
            return
        self._spare.setdefault(buffer.numel(), []).append(buffer)
        self._spare_count += 1
        self._spare_bytes += nbytes
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._in_use_bytes + self._spare_bytes)

    def abandon_backward(self) -> None:
        """Stages 2-3, after a backward that stopped part way (a load replaces the state next): its filled buckets
        and unfinished reductions are dropped, never delivered, so the next backward starts from nothing."""
        if self.stage < 2:
            return
        self._pending.clear()  # their pieces are not delivered: a step in backward would take them
        for state in self._states:
            state.buffer = None
            state.written.clear()
        self._open = False
        self._in_use_bytes = self._in_use_count = self._pieces_bytes = self._waiting_bytes = 0  # none in use now

    def drop_spares(self, *, all_of_them: bool = False) -> None:
        """After the step: stage 2's spare buffers go back (kept across the micro-steps of a window only; between
        windows the forward's activations need the room). Stage 3 keeps its own within their budget, which the
        estimate counts beside the activations, unless ``all_of_them`` (the engine closes) or the heap takes a
        freed block back without a fault (``host.freed_blocks_reused``): then the forward's activations take
        their blocks and the next backward takes them back (GPT-2 small, bf16, stage 3, world size 2: peak RSS
        3.30 against 3.93 GiB a rank, steps 3.42-3.97 against 3.35-3.92 s in two rounds alternating). A step
        behind the next forward calls this in engine.step(), not when its last unit has stepped: kept until then,
        the same workload with everything on NVMe (benchmarks/train_vs_peers.py's nvme mode) held ~0.7 GiB of
        spares through that forward: its heap's in-use peak 2.28 GiB against 1.85 without the step behind the
        forward, the heap 2.85 against 2.19 GiB, a peak RSS of 3.69-3.83 GiB a rank against 3.03."""
        if self.spare_budget_bytes is not None and not all_of_them and not host.freed_blocks_reused():
            return
        self._spare.clear()
        self._spare_count = 0
        self._spare_bytes = 0

    @property
    def spare_bytes(self) -> int:
        """Bytes of buffers and pieces kept for reuse, none of them in use."""
        return self._spare_bytes

    def buffer_bytes(self) -> int:
        """Bytes of gradient buffers currently held (stage 0/1: full; stage 2: none between micro-steps)."""
        return sum(s.buffer.numel() * 4 for s in self._states if s.buffer is not None)

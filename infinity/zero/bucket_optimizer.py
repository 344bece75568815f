"""ZeRO stages 0, 1 and 2 on the shared partitioned step (optimizer.py): per-bucket flat weights, complete on
every rank, the rank's pieces stepped and gathered back bucket by bucket (tile by tile when offloaded)."""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from infinity.comm import Comm
from infinity.memory.plan import MAX_TILE_GATHERS
from infinity.zero import collectives
from infinity.zero.elementwise import group_starts, seed_states
from infinity.zero.optimizer import Offload, PartitionedOptimizer, gradient_shards_for
from infinity.zero.partition import Bucket, GroupLayout, plan
from infinity.zero.reducer import GradientReducer
from infinity.zero.tiles import Tile


@dataclass(slots=True)
class _TileGather:
    """A tile's weights (or a part of them, within allgather_bucket_size) on their way from every rank
    (ZeroOptimizer._step_tiles)."""

    pending: collectives.Pending
    gathered: torch.Tensor  # (world_size * numel,): rank r's part at [r * numel, (r + 1) * numel)
    flat: torch.Tensor  # the bucket's weights
    bucket: Bucket
    offset: int  # the part's first element within each rank's piece
    numel: int

    def land(self, own_rank: int) -> None:
        self.pending.wait()
        for rank in range(len(self.gathered) // self.numel):
            if rank != own_rank:  # the own range is where the gather read from
                first = self.bucket.piece_range(rank)[0] + self.offset
                self.flat[first : first + self.numel].copy_(self.gathered[rank * self.numel : (rank + 1) * self.numel])



class ZeroOptimizer(PartitionedOptimizer):
    """Stages 0, 1 and 2: parameters are views into per-bucket flat weights, complete on every rank."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        comm: Comm,
        stage: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        overlap_comm: bool,
        offload: Offload | None,
        gather_numel: int,
        frozen: list[nn.Parameter],
    ) -> None:
        """``frozen``: the model's parameters that are not in the optimizer; they are cast to the compute dtype
        and never updated. ``offload``: the masters and states go to tiles in host memory or on NVMe.
        ``gather_numel``: elements per rank in one all-gather of new weights (the plan's, from
        allgather_bucket_size)."""
        self.optimizer = optimizer
        self.comm = comm
        self.stage = stage
        self.compute_dtype = compute_dtype
        self.device = device
        shard_world = 1 if stage == 0 else comm.world_size
        self.shard_rank = 0 if stage == 0 else comm.rank
        self.groups: list[list[nn.Parameter]] = [list(g["params"]) for g in optimizer.param_groups]
        self.layouts: tuple[GroupLayout, ...] = plan(
            [[p.numel() for p in params] for params in self.groups], world_size=shard_world, bucket_numel=bucket_numel
        )
        self.weights: list[list[torch.Tensor]] = []  # [group][bucket] -> (padded_numel,) compute dtype
        self.masters: list[nn.Parameter] = []
        self._master_at: list[tuple[int, int]] = []  # per master: (group, first element in the group's shard)
        self.masters_are_weights = offload is None and compute_dtype == torch.float32
        self.gather_numel = gather_numel  # elements per rank in one gather of new weights (the plan's)
        self.largest_gather_numel = 0  # the most elements one tile gather held (world size x its part)
        if offload is not None:
            runs = [(g, b.index, b.shard_offset, b.piece_numel) for g, layout in enumerate(self.layouts)
                    for b in layout.buckets]  # fmt: skip
            self.tiled = self._make_tiled(optimizer, runs, offload)
        for params, layout in zip(self.groups, self.layouts, strict=True):
            self._flatten_group(params, layout)
        if self.tiled is None:
            starts = group_starts(optimizer)  # before the state goes: how a class that builds it in __init__ starts
            for group in optimizer.param_groups:
                group["params"] = []
            for master, (group, _) in zip(self.masters, self._master_at, strict=True):
                optimizer.param_groups[group]["params"].append(master)
            optimizer.state.clear()
            seed_states(optimizer, starts)
        self.gradients_in_memory = gradient_shards_for(self.layouts, device, offload)
        self.reducer = GradientReducer(
            comm=comm, stage=stage, layouts=self.layouts, gradients=self.gradients_in_memory,
            shard_rank=self.shard_rank, device=device, overlap_comm=overlap_comm,
        )  # fmt: skip
        self._hooks = []
        self._no_grad_marks = {}
        for g, (params, layout) in enumerate(zip(self.groups, self.layouts, strict=True)):
            for bucket in layout.buckets:
                index = self.reducer.state_index(g, bucket.index)
                for slot in bucket.slots:
                    param = params[slot.param_index]
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(index, slot.offset)))
                    self._no_grad_marks[id(param)] = functools.partial(self.reducer.on_no_grad, index)
        for param in frozen:
            if param.is_floating_point():
                param.data = param.data.to(device=device, dtype=compute_dtype)
        self._track_frozen(frozen)

    def _predicted_order(self, uses: dict[int, int] | None) -> list[int] | None:
        """Stage 2's buckets by when backward completes them: a bucket is complete once its last parameter is
        (the smallest sequence number of the nodes feeding its parameters; one without any is complete at once),
        soonest first, ties in the fixed order ([Note: learned order] in reducer.py)."""
        if self.stage != 2 or uses is None:
            return None
        done: dict[int, float] = {}
        for g, (params, layout) in enumerate(zip(self.groups, self.layouts, strict=True)):
            for bucket in layout.buckets:
                numbers = [uses[id(params[slot.param_index])] for slot in bucket.slots
                           if id(params[slot.param_index]) in uses]  # fmt: skip
                done[self.reducer.state_index(g, bucket.index)] = min(numbers, default=math.inf)
        fixed = self.reducer.fixed_order
        return sorted(fixed, key=lambda index: (-done[index], fixed.index(index)))

    # ---- construction ----
    def _flatten_group(self, params: list[nn.Parameter], layout: GroupLayout) -> None:
        """Params become views into per-bucket flat weights; this rank's fp32 master pieces are copied out (into
        the tiles when offloaded: never a whole fp32 shard in memory then), or, where the weights are fp32 in
        memory, are the weights' own pieces (one master per bucket piece: no second fp32 copy of the shard)."""
        alias = self.masters_are_weights
        separate = self.tiled is None and not alias
        master = torch.empty(layout.shard_numel if separate else 0, dtype=torch.float32, device=self.device)
        weights = []
        for bucket in layout.buckets:
            values = (params[slot.param_index].detach() for slot in bucket.slots)
            flat = collectives.flat_from_rank0(self.comm, bucket, values, dtype=torch.float32, device=self.device)
            start, end = bucket.piece_range(self.shard_rank)
            if self.tiled is not None:
                for tile in self.tiled.tiles_of(layout.group, bucket.index):
                    first = start + tile.start - bucket.shard_offset
                    self.tiled.initialize(tile, flat[first : first + tile.numel])
            elif separate:
                master[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel].copy_(flat[start:end])
            else:
                self.masters.append(nn.Parameter(flat[start:end]))
                self._master_at.append((layout.group, bucket.shard_offset))
            flat = flat.to(self.compute_dtype)
            for slot in bucket.slots:
                param = params[slot.param_index]
                param.data = flat[slot.offset : slot.offset + slot.numel].view(param.shape)
            weights.append(flat)
        self.weights.append(weights)
        if separate:
            self.masters.append(nn.Parameter(master))
            self._master_at.append((layout.group, 0))

    def _piece_view(self, tile: Tile) -> torch.Tensor:
        """The tile's elements in its bucket's compute-dtype flat weights."""
        bucket = self.layouts[tile.group].buckets[tile.piece]
        first = bucket.piece_range(self.shard_rank)[0] + tile.start - bucket.shard_offset
        return self.weights[tile.group][tile.piece][first : first + tile.numel]

    def _tile_grad(self, tile: Tile) -> torch.Tensor:
        return self.grad_shards[tile.group][tile.start : tile.start + tile.numel]

    def _tile_weight(self, tile: Tile) -> torch.Tensor:
        return self._piece_view(tile)

    _tile_current_weight = _tile_weight  # the flat weights are in memory: no copy to keep

    def _step_tiles(self) -> None:
        """Each tile's new weights are all-gathered from every rank as soon as it has stepped, behind the following
        tiles' reads and writes (every rank cuts its piece of a bucket into the plan's tiles, at the same offsets,
        so tile k of each rank covers the same range of its piece: [Note: one plan] in memory/plan.py). A bucket
        gathered whole after its last tile would keep the disk idle while it travels (measured: stage 2 with one
        124M-element bucket, world size 2, disk busy 69% of the step). A gather holds world_size x its part of
        the tile: allgather_bucket_size elements at most (the plan's gather_numel per rank), so a tile larger
        than that travels in parts. At most MAX_TILE_GATHERS are in flight."""
        if not self.comm.active:
            self.tiled.step(self.optimizer.param_groups)
            return
        pending: deque[_TileGather] = deque()

        def on_tile(tile: Tile) -> None:
            bucket = self.layouts[tile.group].buckets[tile.piece]
            flat = self.weights[tile.group][tile.piece]
            for first in range(0, tile.numel, self.gather_numel):
                offset = tile.start - bucket.shard_offset + first  # within each rank's piece
                self._gather_part(pending, bucket, flat, offset, min(self.gather_numel, tile.numel - first))

        self.tiled.step(self.optimizer.param_groups, on_tile)
        while pending:
            pending.popleft().land(self.shard_rank)

    def _gather_part(self, pending: deque, bucket: Bucket, flat: torch.Tensor, offset: int, numel: int) -> None:
        """Starts the all-gather of ``numel`` elements from ``offset`` of every rank's piece of the bucket (this
        rank's already in place in ``flat``), through a buffer of world size x numel; first lands the oldest
        gathers, so at most MAX_TILE_GATHERS buffers exist at once."""
        while len(pending) >= MAX_TILE_GATHERS:
            pending.popleft().land(self.shard_rank)
        gathered = torch.empty(numel * self.comm.world_size, dtype=flat.dtype, device=flat.device)
        self.largest_gather_numel = max(self.largest_gather_numel, gathered.numel())
        mine = bucket.piece_range(self.shard_rank)[0] + offset
        handle = collectives.all_gather_pieces(self.comm, gathered, flat[mine : mine + numel], async_op=True)
        pending.append(_TileGather(handle, gathered, flat, bucket, offset, numel))

    def _make_hook(self, state_index: int, offset: int):
        reducer = self.reducer

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:  # a custom function returned None for it: no gradient this backward
                reducer.on_no_grad(state_index)
                return
            reducer.on_grad(state_index, offset, param.grad)
            param.grad = None  # its values live in the fp32 bucket buffer now

        return hook

    def _publish_weights(self) -> None:
        """New low-precision pieces from the masters, gathered so every rank has the full weights. Each rank's
        piece is cast into its own range of the bucket's flat weights, which the gather reads from (in place:
        no copy of the piece). A gather holds at most allgather_bucket_size elements (the plan's gather_numel
        per rank, as at stages 1-2 with offload: a larger piece travels in parts through a buffer of world size
        x the part), and at most MAX_TILE_GATHERS are in flight."""
        pending: deque = deque()
        for layout, weights in zip(self.layouts, self.weights, strict=True):
            for bucket, flat in zip(layout.buckets, weights, strict=True):
                start, end = bucket.piece_range(self.shard_rank)
                if not self.masters_are_weights:  # else stepped in place
                    master = self.masters[layout.group].detach()
                    flat[start:end].copy_(master[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel])
                if self.stage == 0 or not self.comm.active:
                    continue  # every element is ours: nothing to gather
                if end - start <= self.gather_numel:  # one gather, straight into the flat weights
                    while len(pending) >= MAX_TILE_GATHERS:
                        pending.popleft().land(self.shard_rank)
                    whole = collectives.all_gather_pieces(self.comm, flat, flat[start:end], async_op=True)
                    self.largest_gather_numel = max(self.largest_gather_numel, flat.numel())
                    pending.append(_WholeGather(whole))
                    continue
                for offset in range(0, end - start, self.gather_numel):
                    self._gather_part(pending, bucket, flat, offset, min(self.gather_numel, end - start - offset))
        while pending:
            pending.popleft().land(self.shard_rank)


@dataclass(slots=True)
class _WholeGather:
    """A bucket's weights gathered straight into its flat buffer (its piece fits one gather)."""

    pending: collectives.Pending

    def land(self, own_rank: int) -> None:
        self.pending.wait()

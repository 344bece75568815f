"""DeepSpeed's partitioned-state helpers (``deepspeed.utils.safe_get_full_fp32_param`` and the rest): one
parameter's fp32 master, optimizer state or gradient, read or written wherever the rank's partition lives.

[Note: partitioned state access]
A parameter's elements are spread over the ranks' pieces (buckets at stages 1-2, units at stage 3), and each
piece's masters and states over tiles that may sit in host memory or on NVMe. The checkpoint's state map
([Note: checkpoint state map] in checkpoint/state_map.py) already knows, per region, which element range of
which parameter sits where and hands the values out block by block through the tiers; these helpers walk only
the regions that hold the parameter, so a read or write moves its tiles and no more (never the whole model).
The ``full`` forms are collective where DeepSpeed's are: a get sums every rank's fragments into a zero tensor
(an all-reduce; stage 0 holds everything on every rank and needs none); a set takes the whole value on every
rank and writes each rank's own fragments, with no collective. The ``local`` forms see the rank's own
fragment (1-D, possibly empty).

Where DeepSpeed leaves the low-precision weight stale until the next step, a set here also writes the compute-
dtype weight (the flat weights at stages 0-2, the rank's piece at stage 3, and a gathered copy such as the
persistent unit's), so the next forward sees the new value as plain PyTorch would. A local set on a gathered
unit regathers it: collective, as every rank sets its own fragment. The gradient is the window's reduced fp32
gradient, with fp16's loss scale divided out (written back multiplied by it), between a backward and the step;
a gradient on NVMe is refused. Optimizer states exist once the parameter's param group has stepped.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from infinity.checkpoint.state_map import Fragment, Region, StateMap
from infinity.errors import InfinityError
from infinity.zero import collectives
from infinity.zero.units import UnitState


class StateAccessError(InfinityError):
    """A helper was called where the value does not exist (no engine, no gradient yet, an unknown state)."""


@dataclass(frozen=True, slots=True)
class _Place:
    region: Region
    fragment: Fragment


class PartitionedState:
    """One engine's parameters, each with the region fragments that hold its elements on this rank."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.map = StateMap(module=engine.module, optimizer=engine.zero_optimizer, world_size=engine.comm.world_size,
                            rank=engine.comm.rank)  # fmt: skip
        self.places: dict[str, list[_Place]] = {}
        for region in self.map.regions:
            for fragment in region.optimized:
                self.places.setdefault(fragment.name, []).append(_Place(region, fragment))
        self.group_of = {id(p): g for g, params in enumerate(engine.zero_optimizer.groups) for p in params}

    # ---- finding the values ----
    def name_of(self, param: nn.Parameter) -> str | None:
        """The parameter's name when the optimizer updates it; None for a frozen or left-out parameter."""
        if id(param) not in self.group_of:
            return None
        return self.map.names[id(param)]

    def _check_state(self, param: nn.Parameter, key: str) -> None:
        self.map.refresh_state_names()
        group = self.group_of[id(param)]
        if self.map.group_steps()[group] == 0:
            raise StateAccessError(f"the optimizer has not stepped param group {group} yet: its states ({key!r} "
                                   "among them) begin at its first step")  # fmt: skip
        if key not in self.map.state_names:
            raise StateAccessError(f"the optimizer keeps no state {key!r}; its per-element states are "
                                   f"{list(self.map.state_names)}")  # fmt: skip

    def _blocks(self, name: str, *, dirty: bool, key: str | None) -> Iterator[tuple[_Place, torch.Tensor, slice]]:
        """(place, the values of the fragment's part inside a block, that part's range within the parameter),
        tile by tile; the master (``key`` None) or the state ``key``."""
        for place in self.places.get(name, ()):
            region, fragment = place.region, place.fragment
            piece = self._weights_as_masters(region, dirty) if key is None else None
            for block in self.map.blocks(region, dirty=dirty, with_states=key is not None):
                lo = max(fragment.offset, block.start)
                hi = min(fragment.offset + fragment.numel, block.start + block.numel)
                if lo >= hi:
                    continue
                if key is not None:
                    values = block.states[key][lo - block.start : hi - block.start]
                elif block.master is not None:
                    values = block.master[lo - block.start : hi - block.start]
                else:  # stage 3 in fp32 without offload: the piece is the master
                    values = piece[lo - region.start : hi - region.start]
                first = fragment.param_start + lo - fragment.offset
                yield place, values, slice(first, first + hi - lo)
            if piece is not None and dirty:
                self.engine.stage3.table.shards.commit(region.piece)

    def _weights_as_masters(self, region: Region, dirty: bool) -> torch.Tensor | None:
        """Stage 3 in fp32 without offload: the unit's piece, which is the master ([Note: tiles])."""
        tiled = self.engine.zero_optimizer.tiled
        if self.engine.stage3 is None or tiled is None or tiled.masters is None:
            return None
        shards = self.engine.stage3.table.shards
        return shards.edit(region.piece) if dirty else shards.on_device(region.piece)

    # ---- masters and states ----
    def _frame(self, name: str, *, local: bool) -> tuple[int, tuple[int, ...]]:
        """Where a value starts within the parameter and its shape: the whole parameter, or (``local``) this
        rank's fragment, 1-D."""
        if not local:
            return 0, tuple(self.map.optimized[name][0])
        first, end = self._own_fragment(name)
        return first, (end - first,)

    def get(self, param: nn.Parameter, key: str | None, *, local: bool) -> torch.Tensor | None:
        """The fp32 master (``key`` None) or optimizer state ``key``; whole (collective) or this rank's part."""
        name = self.name_of(param)
        if name is None:
            return None
        if key is not None:
            self._check_state(param, key)
        first, shape = self._frame(name, local=local)
        out = torch.zeros(shape, dtype=torch.float32, device=self.engine.device)
        flat = out.view(-1)
        for _, values, span in self._blocks(name, dirty=False, key=key):
            flat[span.start - first : span.stop - first].copy_(values)
        if not local:
            self._sum_over_ranks(out)
        return out

    def set(self, param: nn.Parameter, value: torch.Tensor, key: str | None, *, local: bool) -> None:
        name = self.name_of(param)
        if name is None:
            raise StateAccessError(f"{self._describe(param)} is not updated by the optimizer (frozen, or not in "
                                   "its param groups): it has no fp32 master or optimizer state")  # fmt: skip
        if key is not None:
            self._check_state(param, key)
        first, shape = self._frame(name, local=local)
        flat = self._checked(value, shape, name, local=local).view(-1)
        for _, values, span in self._blocks(name, dirty=True, key=key):
            values.copy_(flat[span.start - first : span.stop - first])
        if key is None:
            self._publish_weight(param, name, flat, local=local)

    def _own_fragment(self, name: str) -> tuple[int, int]:
        """The parameter's elements this rank holds, [first, end) (empty when it holds none)."""
        places = self.places.get(name, [])
        if not places:
            return 0, 0
        first = min(p.fragment.param_start for p in places)
        end = max(p.fragment.param_start + p.fragment.numel for p in places)
        return first, end

    # ---- the compute-dtype weight follows a new master ----
    def _publish_weight(self, param: nn.Parameter, name: str, flat: torch.Tensor, *, local: bool) -> None:
        engine = self.engine
        if engine.stage3 is None:  # stages 0-2: every rank holds the whole weight
            if local:
                first, end = self._own_fragment(name)
                param.data.view(-1)[first:end].copy_(flat)
                self._regather_bucket(param)
            else:
                param.data.copy_(flat.view(param.shape))
            return
        table = engine.stage3.table
        unit, _ = table.unit_of(param)
        if engine.zero_optimizer.tiled.masters is None:  # else the piece itself was written as the master
            first = self._own_fragment(name)[0] if local else 0
            piece = table.shards.edit(unit.index)
            for place in self.places.get(name, ()):
                fragment, offset = place.fragment, place.fragment.offset - place.region.start
                start = fragment.param_start - first
                piece[offset : offset + fragment.numel].copy_(flat[start : start + fragment.numel])
            table.shards.commit(unit.index)
        if unit.state is UnitState.GATHERED:
            if local:
                unit.gather(engine.comm, table.shards, async_op=False)  # every rank set its own fragment
            else:
                param.data.copy_(flat.view(param.shape))

    def _regather_bucket(self, param: nn.Parameter) -> None:
        """Stages 1-2 after a local set: each rank wrote its own fragment; the whole weight is gathered again."""
        optimizer = self.engine.zero_optimizer
        if optimizer.stage == 0 or not self.engine.comm.active:
            return
        group = self.group_of[id(param)]
        for bucket, flat in zip(optimizer.layouts[group].buckets, optimizer.weights[group], strict=True):
            if any(optimizer.groups[group][slot.param_index] is param for slot in bucket.slots):
                start, end = bucket.piece_range(optimizer.shard_rank)
                collectives.all_gather_pieces(self.engine.comm, flat, flat[start:end], async_op=False)

    # ---- gradients ----
    def _gradient(self, param: nn.Parameter) -> tuple[str, list[torch.Tensor]] | None:
        name = self.name_of(param)
        if name is None:
            return None
        engine = self.engine
        if not engine._backward_pending:
            raise StateAccessError("the gradient exists between engine.backward() and engine.step(): call the "
                                   "gradient helpers there")  # fmt: skip
        if engine.zero_optimizer.stage < 2 and not getattr(engine, "_last_backward_at_boundary", False):
            raise StateAccessError("at ZeRO stages 0-1 the gradient is reduced at the accumulation boundary: call "
                                   "the gradient helpers after the backward that ends the window")  # fmt: skip
        shards = engine.zero_optimizer.gradients_in_memory
        if shards is None:
            raise StateAccessError("the gradient is on NVMe with the optimizer (stage 3, a gradient larger than a "
                                   "quarter of the host share), read tile by tile during the step; it cannot be "
                                   "read or written as a tensor")  # fmt: skip
        return name, shards.tensors()

    def _grad_views(self, name: str, tensors: list[torch.Tensor]) -> Iterator[tuple[Fragment, torch.Tensor]]:
        for place in self.places.get(name, ()):
            fragment = place.fragment
            grads = tensors[max(place.region.group, 0)]
            yield fragment, grads[fragment.offset : fragment.offset + fragment.numel]

    def get_grad(self, param: nn.Parameter, *, local: bool) -> torch.Tensor | None:
        found = self._gradient(param)
        if found is None:
            return None
        name, tensors = found
        first, shape = self._frame(name, local=local)
        out = torch.zeros(shape, dtype=torch.float32, device=self.engine.device)
        flat = out.view(-1)
        for fragment, grad in self._grad_views(name, tensors):
            start = fragment.param_start - first
            flat[start : start + fragment.numel].copy_(grad)
        if not local:
            self._sum_over_ranks(out)
        return out.div_(self.engine.loss_scaler.scale)

    def set_grad(self, param: nn.Parameter, value: torch.Tensor, *, local: bool) -> None:
        found = self._gradient(param)
        if found is None:
            raise StateAccessError(f"{self._describe(param)} is not updated by the optimizer: it has no gradient")
        name, tensors = found
        first, shape = self._frame(name, local=local)
        flat = self._checked(value, shape, name, local=local).view(-1)
        for fragment, grad in self._grad_views(name, tensors):
            start = fragment.param_start - first
            grad.copy_(flat[start : start + fragment.numel]).mul_(self.engine.loss_scaler.scale)

    # ---- shared ----
    def _sum_over_ranks(self, out: torch.Tensor) -> None:
        if self.engine.zero_optimizer.stage > 0:
            collectives.all_reduce_sum_(self.engine.comm, out)

    def _checked(self, value, shape, name: str, *, local: bool = False) -> torch.Tensor:
        if not torch.is_tensor(value):
            raise StateAccessError(f"the new value of {name} must be a tensor, got {type(value).__name__}")
        if value.numel() != int(torch.Size(shape).numel()) or (not local and tuple(value.shape) != tuple(shape)):
            what = f"this rank's {shape[0]} elements (1-D)" if local else f"its full shape {tuple(shape)}"
            raise StateAccessError(f"the new value of {name} has shape {tuple(value.shape)}; it must have {what}")
        return value.detach().to(device=self.engine.device, dtype=torch.float32)

    def _describe(self, param: nn.Parameter) -> str:
        name = self.map.names.get(id(param))
        return f"parameter {name!r}" if name is not None else "this parameter"


_ACCESS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its PartitionedState


def state_of(param: nn.Parameter) -> PartitionedState:
    """The partitioned state of the live training engine whose model holds ``param``."""
    from infinity.engine import live_engines  # the engine layer sits above this module's users only

    for engine in live_engines():
        if getattr(engine, "zero_optimizer", None) is None:
            continue
        access = _ACCESS.get(engine)
        if access is None:
            access = _ACCESS[engine] = PartitionedState(engine)
        if id(param) in access.map.names:
            engine.check_states_here("a partitioned-state helper (safe_get/safe_set)")
            engine.finish_step("a partitioned-state helper (safe_get_full_grad, safe_get_full_fp32_param, ...)")
            return access
    raise StateAccessError("this parameter belongs to no live infinity training engine: call the helper on a "
                           "parameter of the model initialize() returned, before engine.destroy()")  # fmt: skip

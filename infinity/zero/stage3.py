"""ZeRO-3 module hooks. They only delegate to the coordinator; all decisions live there and in schedule.py.

- root pre-forward: a pass begins, and _FetchOnUse watches for parameters used by a module that does not own
  them; root post-forward without gradients (evaluation, generate()): the pass ends. With gradients the engine
  ends it after backward. Every rank must run the same number of passes (as with DDP).
- pre-forward of a module using units: fetch them, and hook the inputs that require grad: once their gradients
  exist, the module's backward is done (its post-backward). post-forward: maybe release
  the units, and wrap the outputs in one whose backward is the module's pre-backward: fetch again before its
  backward runs (also when torch.utils.checkpoint recomputes: that is an ordinary forward inside backward).
- gradients: the optimizer's post-accumulate-grad hooks reduce them and call coordinator.on_param_grad; a unit
  is released once its backward is done ([Note: release after backward] in coordinator.py). The reducer
  launches in the order the coordinator agrees on with the other ranks, and waits through it (bind_reducer).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from infinity.config import ZeroConfig
from infinity.distributed import Distributed
from infinity.memory.pool import gathered_units_numel, stage3_gradient_numel
from infinity.zero import collectives
from infinity.zero.coordinator import Coordinator
from infinity.zero.external import declared_external
from infinity.zero.reducer import GradientReducer
from infinity.zero.schedule import BACKWARD, FORWARD, Knobs
from infinity.zero.units import Unit, UnitState, UnitTable, build_units, register_runtime, unregister_runtime

logger = logging.getLogger("infinity")


# Calls that never fetch: attribute reads and writes (units re-point param.data: that is how they attach and
# release) and questions about the tensor's metadata, which a released parameter answers as DeepSpeed's does (numel()
# 0, as its shape (0,); ds_numel and ds_shape hold the whole parameter's). Counting parameters inside a forward must
# not gather the whole model.
_PASS_THROUGH = frozenset({"__get__", "__set__", "__len__", "numel", "nelement", "size", "dim", "ndimension",
                           "element_size", "is_floating_point", "is_complex", "get_device", "is_contiguous", "stride",
                           "storage_offset", "data_ptr", "untyped_storage", "is_pinned", "type", "requires_grad_"})


# Attributes that compute from the values (a view of them): reading one is a use, as a call is.
_VALUE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def _attribute(func) -> str | None:
    """The attribute a descriptor's ``__get__`` reads (``Tensor.T.__get__`` -> "T")."""
    return getattr(getattr(func, "__self__", None), "__name__", None)


class _FetchOnUse(TorchFunctionMode):
    """Active during forward: a torch call given a released parameter (one the running module does not own and
    so did not fetch) fetches its unit first and remembers it as a use of that module. Tensor attribute reads
    and writes (``param.data = ...``, which is how units attach and release) and metadata questions pass through
    (_PASS_THROUGH). The fetch is a
    rendezvous like any other ([Note: fetch rendezvous] in rendezvous.py), so other ranks need not do the same."""

    def __init__(self, table: UnitTable, coordinator: Coordinator) -> None:
        super().__init__()
        self.table = table
        self.coordinator = coordinator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _PASS_THROUGH and not (name == "__get__" and _attribute(func) in _VALUE_ATTRIBUTES):
            return func(*args, **kwargs)
        for value in (*args, *kwargs.values()):
            if isinstance(value, list | tuple | dict):  # parameters inside containers, at any depth
                for leaf in _pytree.tree_leaves(value):
                    self._check(leaf)
            else:
                self._check(value)
        return func(*args, **kwargs)

    def _check(self, value) -> None:
        if type(value) is nn.Parameter and value.numel() == 0:
            found = self.table.unit_of(value)
            if found is not None and found[0].state is not UnitState.GATHERED and found[0].numel > 0:
                self.coordinator.on_external_use(found[0].index)


class _OnBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward calls ``callback`` when their gradients arrive, just before
    the module's backward (the pre-backward fetch)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _on_backward(values, callback_factory: Callable[[], Callable[[], None] | None]):
    """``values`` with its tensors that require grad passed through _OnBackward; unchanged when none does or
    the factory gives no callback. A tensor passed several times stays one object (nn.MultiheadAttention takes
    its self-attention path only when query is key)."""
    leaves, spec = _pytree.tree_flatten(values)
    distinct: dict[int, torch.Tensor] = {}
    for leaf in leaves:
        if torch.is_tensor(leaf) and leaf.requires_grad and leaf.is_floating_point():
            distinct.setdefault(id(leaf), leaf)
    if not distinct:
        return values
    callback = callback_factory()
    if callback is None:
        return values
    wrapped = dict(zip(distinct, _OnBackward.apply(callback, *distinct.values()), strict=True))
    return _pytree.tree_unflatten([wrapped.get(id(leaf), leaf) for leaf in leaves], spec)


def _after_backward(inputs, callback_factory: Callable[[], Callable[[], None] | None]):
    """Calls the factory's callback once the gradients of the inputs that require grad exist: the module's
    backward is then done ([Note: release after backward] in coordinator.py). Hooks on the input tensors
    themselves, not a wrapper: the module sees its inputs unchanged, so an in-place edit of an input keeps its
    meaning for autograd. Returns the hook's handle (None when none was needed), to be removed when the pass
    ends ([Note: multi-grad hooks])."""
    tensors = {
        id(leaf): leaf
        for leaf in _pytree.tree_leaves(inputs)
        if torch.is_tensor(leaf) and leaf.requires_grad and leaf.is_floating_point()
    }
    if not tensors:
        return None
    callback = callback_factory()
    if callback is None:
        return None
    return register_multi_grad_hook(list(tensors.values()), lambda grads: callback(), mode="all")


@dataclass  # no slots: the registry of parameters refers to it weakly
class Stage3:
    table: UnitTable
    coordinator: Coordinator
    handles: list
    check_call: Callable[[str], None]  # [Note: collective calls] in distributed.py
    reduce_bucket_numel: int  # zero_optimization.reduce_bucket_size: most gradient elements reduced at once
    on_piece_edited: Callable[[Unit, torch.Tensor], None] | None = None  # the masters follow an edited shard
    # (given the unit and its piece as it was before the edit)

    def bind_reducer(self, reducer: GradientReducer) -> None:
        """The units' gradient reductions launch in the order the ranks agree on before each backward, at most
        reduce_bucket_size elements in flight, waited for while answering fetches ([Note: launch order] in
        reducer.py); their buffers show in zero_stats()."""
        reducer.launch_order = self.coordinator.reduce_order
        reducer.wait_in_backward = self.coordinator.wait_for_reduction
        reducer.in_flight_numel = self.reduce_bucket_numel
        units = self.table.units
        reducer.spare_budget_bytes = 0 if reducer.device.type != "cpu" else 4 * stage3_gradient_numel(
            persistent=sum(u.padded_numel for u in units if u.persistent),
            units=[u.padded_numel for u in units if not u.persistent], reduce_bucket_numel=self.reduce_bucket_numel,
            overlap_comm=reducer.overlap_comm, world_size=self.coordinator.comm.world_size,
        )  # fmt: skip
        reducer.before_launch = self.coordinator.before_launch  # [Note: one collective order] in rendezvous.py
        self.coordinator.reduction_peaks = reducer.take_peaks
        self.coordinator.made_counters["grad_buffers_made"] = lambda: reducer.buffers_made
        self.coordinator.before_drain = reducer.launch_rest

    # ---- GatheredParameters and saving ----
    def gather(self, params) -> list[tuple[int, bool]]:
        """Gathers the units holding ``params``: (unit, whether it was released and must be released again).
        Every unit gathered: the model is whole until partition(), and a forward without gradients skips the
        fetching machinery (the hooks and the fetch-on-use mode): a generate() at plain PyTorch's speed."""
        units = sorted({found[0].index for p in params if (found := self.table.unit_of(p)) is not None})
        gathered = list(zip(units, self.coordinator.gather_now(units), strict=True))
        held = self.coordinator.held
        for index in units:  # held until partition(): a forward inside the block releases none of them
            held[index] = held.get(index, 0) + 1
        if self._whole(units):
            self.coordinator.whole_held += 1
        return gathered

    def _whole(self, units: list[int]) -> bool:
        return set(units) >= {unit.index for unit in self.table.units if unit.numel > 0}

    def partition(self, gathered: list[tuple[int, bool]], *, modifier_rank: int | None) -> None:
        """Ends a gather: with modifier_rank, its values go to every rank and into the shards first."""
        if self._whole([index for index, _ in gathered]):
            self.coordinator.whole_held -= 1
        held = self.coordinator.held
        for index, _ in gathered:
            held[index] -= 1
            if not held[index]:
                del held[index]
        comm = self.coordinator.comm
        for index, release in gathered:
            unit = self.table.units[index]
            if modifier_rank is not None:
                collectives.broadcast_(comm, unit.full, src=modifier_rank)
                start, end = unit.bucket.piece_range(comm.rank)
                before = self.table.shards.read(index) if self.on_piece_edited is not None else None
                self.table.shards.store(index, unit.full[start:end])
                if self.on_piece_edited is not None:
                    self.on_piece_edited(unit, before)
            if release and self.coordinator.expects_grads(index):
                self.coordinator.keep_for_grads(index)  # released as its gradients arrive, counted as live
            elif release:
                self.coordinator.release_now(index)

    # ---- DeepSpeed's register_external_parameter ----
    def external_use(self, module: nn.Module, param: nn.Parameter, *, used: bool) -> None:
        """``module``'s forward uses (or no longer uses) ``param`` of another module: its unit is fetched with the
        module's own from the start (a use found on the fly, _FetchOnUse, does the same from then on)."""
        found = self.table.unit_of(param)
        positions = [i for i, m in enumerate(self.table.modules) if m is module]
        if found is None or found[0].persistent or not positions:
            return  # not partitioned, always gathered, or a module whose uses are found as they happen
        position, unit = positions[0], found[0].index
        own = {entry[0].index for p in module._parameters.values()
               if p is not None and (entry := self.table.unit_of(p)) is not None}  # fmt: skip
        units = self.table.module_units[position]
        if used and unit not in units:
            self.table.module_units[position] = (*units, unit)
        elif not used and unit in units and unit not in own:
            self.table.module_units[position] = tuple(u for u in units if u != unit)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.coordinator.after_pass is not None:
            self.coordinator.after_pass()  # a pass that never ended leaves its multi-grad hooks otherwise
        self.coordinator.reduction_peaks = self.coordinator.before_drain = self.coordinator.after_pass = None
        self.coordinator.close()
        self.table.shards.close()
        self.table.pool.clear()
        unregister_runtime(self.table.parameters())


def setup_stage3(
    model: nn.Module,
    *,
    distributed: Distributed,
    zero: ZeroConfig,
    dtype: torch.dtype,
    device: torch.device,
    make_shards,
    training: bool = True,
) -> Stage3:
    """Partitions the model into units and installs the hooks; the values move in with ``fill_units`` (units.py).
    ``training``: False for an inference engine (no gradient ever arrives: no hooks for one).
    Fetches get their own groups ([Note: fetch rendezvous] in rendezvous.py): one for the units, and for the
    headers a gloo one where the units travel over NCCL (headers are small host tensors: no device sync)."""
    comm = distributed.comm
    table = build_units(
        model, comm=comm, dtype=dtype, device=device,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        model_persistence_threshold=zero.stage3_model_persistence_threshold, make_shards=make_shards,
    )  # fmt: skip
    knobs = Knobs(
        max_live_numel=zero.stage3_max_live_parameters,
        prefetch_numel=zero.stage3_prefetch_bucket_size,
        max_reuse_distance=zero.stage3_max_reuse_distance,
    )
    _bound_pool(table, knobs)
    fetch = distributed.new_comm("ZeRO-3 fetch")
    on_gloo = not comm.active or dist.get_backend(comm.group) == "gloo"
    headers = fetch if on_gloo else distributed.new_comm("ZeRO-3 fetch header", backend="gloo")
    coordinator = Coordinator(table, fetch, knobs, header_comm=headers)
    coordinator.one_order = not on_gloo  # NCCL: [Note: one collective order] in rendezvous.py
    stage3 = Stage3(
        table=table, coordinator=coordinator, handles=_install_hooks(model, table, coordinator, training=training),
        check_call=distributed.check_call, reduce_bucket_numel=zero.reduce_bucket_size,
    )  # fmt: skip
    if not any(not unit.persistent for unit in table.units) and comm.rank == 0:
        logger.warning(
            "ZeRO-3 partitions nothing: every parameter has at most stage3_param_persistence_threshold=%d "
            "elements, so each rank keeps the whole model. Lower zero_optimization."
            "stage3_param_persistence_threshold (0 partitions every parameter) to partition it.",
            zero.stage3_param_persistence_threshold,
        )
    register_runtime(table.parameters(), stage3)  # how GatheredParameters finds it
    for module, param in declared_external(model):  # register_external_parameter before initialize()
        stage3.external_use(module, param, used=True)
    return stage3


def _bound_pool(table: UnitTable, knobs: Knobs) -> None:
    """The units' StoragePool keeps what the coordinator may hold gathered at once (the persistent unit and
    gathered_units_numel), as the estimate counts it."""
    if not table.units:
        return
    itemsize = table.units[0].full.element_size()
    persistent = sum(u.padded_numel for u in table.units if u.persistent)
    sizes = [u.padded_numel for u in table.units if not u.persistent]
    live = gathered_units_numel(total=sum(sizes), largest=max(sizes, default=0), max_live=knobs.max_live_numel)
    table.pool.budget_bytes = (persistent + live) * itemsize


# [Note: multi-grad hooks]
# torch's register_multi_grad_hook keeps, in the hook it puts on each input, a list of the inputs' autograd nodes,
# and for an activation that hook sits on the activation's own node: a cycle through autograd's C++ objects that
# outlives the backward unless the hook is removed. Left in place, every step leaked a few hundred small objects
# (measured with heaptrack: +342 live allocations between steps 2 and 4 on GPT-2 small), scattered among the
# step's activations, so the C library could not join the freed activations' blocks again: at a 32 MiB mmap
# threshold the heap grew by 150-350 MiB a step with a steady ~0.3 GiB in use (memory/host.py). The pass's hooks
# are removed when the pass ends; the heap then stays flat.


def _before_grad(coordinator: Coordinator, unit: int, grad: torch.Tensor | None) -> None:
    if grad is not None:  # None: a custom function gave the parameter no gradient, nothing to accumulate
        coordinator.before_param_grad(unit)


def _install_hooks(model: nn.Module, table: UnitTable, coordinator: Coordinator, *, training: bool) -> list:
    fetch_on_use = _FetchOnUse(table, coordinator)
    entered: list[bool] = []  # whether the mode was entered by the running root forward
    grad_hooks: list = []  # this pass's multi-grad hook handles ([Note: multi-grad hooks])

    def remove_grad_hooks() -> None:
        while grad_hooks:
            grad_hooks.pop().remove()

    coordinator.after_pass = remove_grad_hooks

    def pre_forward(index, module, args, kwargs):
        if coordinator.whole_held and not torch.is_grad_enabled():
            return  # the whole model is gathered (Stage3.gather): nothing to fetch, nothing to record
        if index == 0:
            coordinator.begin_pass()
            fetch_on_use.__enter__()
            entered.append(True)
        coordinator.on_event(index, FORWARD)
        if torch.is_grad_enabled() and table.module_units[index]:
            handle = _after_backward((args, kwargs), functools.partial(coordinator.expect_module_backward, index))
            if handle is not None:
                grad_hooks.append(handle)

    def post_forward(index, module, args, output):
        if coordinator.whole_held and not torch.is_grad_enabled() and not entered:
            return output
        if index == 0 and entered:
            entered.pop()
            fetch_on_use.__exit__(None, None, None)
        coordinator.after_forward(index)
        if index == 0 and not torch.is_grad_enabled():
            coordinator.end_pass()  # evaluation, generate(): no backward follows
        if torch.is_grad_enabled() and table.module_units[index]:
            return _on_backward(output, lambda: functools.partial(coordinator.on_event, index, BACKWARD))
        return output

    handles = []
    for unit in table.units:  # before accumulation, a released unit is gathered again (Coordinator.before_param_grad)
        if training and not unit.persistent:
            for param in unit.params:
                if param.requires_grad:
                    handles.append(param.register_hook(functools.partial(_before_grad, coordinator, unit.index)))
    for index, module in enumerate(table.modules):
        handles.append(module.register_forward_pre_hook(functools.partial(pre_forward, index), with_kwargs=True))
        handles.append(module.register_forward_hook(functools.partial(post_forward, index), always_call=True))
    return handles

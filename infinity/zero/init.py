"""zero.Init (partition parameters as modules are built) and GatheredParameters (whole parameters for a while).

[Note: zero.Init]
Inside ``Init()``, every nn.Module subclass's ``__init__`` is wrapped: when a module's outermost ``__init__``
returns, each parameter it owns is flattened, padded, made identical on every rank (rank 0's values are
broadcast, as DeepSpeed does) and cut to this rank's piece; the parameter keeps its object and becomes a
0-element placeholder with ``ds_shape``. So no rank holds more than one module's full parameters at a time.

A model's own initialization often runs after its submodules exist (transformers' post_init re-initializes
every Linear and Embedding). Inside the context a TorchFunctionMode sees every torch call; one that takes a
partitioned parameter (``init.normal_(module.weight)``, ``weight.fill_(1)``, ``weight.size()``) runs on the
whole, gathered parameter, which is cut to pieces again afterwards. The random stream is consumed exactly as
without Init, so a seeded model built under Init equals the one built normally. Attribute reads (``.shape``,
``.dtype``) pass through and see the placeholder; ``param.data.normal_()`` writes into the placeholder and is
lost, as in DeepSpeed.

The engine's stage 3 (stage3.py) later regroups these per-parameter pieces into units, one module at a time.

[Note: zero.Init memory]
Freed full-size parameters must really be given back, or the heap grows by a full model anyway: glibc serves
a 64-byte-aligned 16 MiB request from a heap hole only if the hole is larger than 16 MiB, so the holes each
partitioned layer leaves behind are never reused (measured: 32 layers of 16 MiB built under Init peaked at 2x
the model in one process). Inside the context, allocations from 1 MiB up are therefore mmap-backed and return
to the system when freed; on exit the threshold is set to 32 MiB, the ceiling glibc's own adaptive threshold
reaches after large frees.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree
from torch.utils.weak import WeakIdKeyDictionary

from infinity.zero import collectives
from infinity.zero.collectives import Comm
from infinity.zero.partition import ALIGN
from infinity.zero.units import stage3_runtime


@dataclass(slots=True)
class InitShard:
    """This rank's piece of one parameter partitioned by zero.Init."""

    shape: torch.Size
    piece: torch.Tensor  # (padded numel / world_size,)
    comm: Comm

    def gather(self) -> torch.Tensor:
        full = torch.empty(self.piece.numel() * self.comm.world_size, dtype=self.piece.dtype, device=self.piece.device)
        collectives.all_gather_pieces(self.comm, full, self.piece, async_op=False)
        return full[: self.shape.numel()].view(self.shape)


# Which parameters zero.Init partitioned: state kept beside the parameters, not stuck onto them.
_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def init_shard(param: nn.Parameter) -> InitShard | None:
    return _SHARDS.get(param)


def take_whole(param: nn.Parameter) -> torch.Tensor:
    """The whole value of a parameter for the engine's stage 3, which then owns it: a zero.Init piece is gathered
    and dropped (kept, it would hold a second 1/N copy of the model)."""
    shard = init_shard(param)
    if shard is None:
        return param.data
    whole = shard.gather()
    del _SHARDS[param]
    return whole


def _partition(param: nn.Parameter, comm: Comm, *, broadcast: bool, device: torch.device | None = None) -> None:
    """``device``: where the piece lives (the compute device: NCCL broadcasts device tensors); default the
    parameter's own."""
    data = param.data
    device = data.device if device is None else device
    numel = data.numel()
    multiple = comm.world_size * ALIGN
    padded = -(-max(numel, 1) // multiple) * multiple
    if padded == numel and data.is_contiguous() and data.device == device:
        flat = data.view(-1)  # no copy: a second full-size buffer per module would fragment the heap
    else:
        flat = torch.zeros(padded, dtype=data.dtype, device=device)
        flat[:numel].copy_(data.reshape(-1))
    if broadcast:
        collectives.broadcast_(comm, flat, src=0)
    piece_numel = flat.numel() // comm.world_size
    piece = flat[comm.rank * piece_numel : (comm.rank + 1) * piece_numel].clone()
    shard = init_shard(param)
    if shard is None:
        _SHARDS[param] = InitShard(shape=data.shape, piece=piece, comm=comm)
        param.ds_shape = data.shape  # DeepSpeed's public attributes of a partitioned parameter
        param.ds_numel = numel
    else:
        shard.piece.copy_(piece)
    param.data = torch.empty(0, dtype=data.dtype, device=device)


def _restore(param: nn.Parameter, *, keep_edits: bool = True) -> None:
    """Back to the placeholder, keeping this rank's piece of the (possibly edited) whole value."""
    shard = init_shard(param)
    if keep_edits:
        _partition(param, shard.comm, broadcast=False, device=shard.piece.device)
    else:
        param.data = torch.empty(0, dtype=shard.piece.dtype, device=shard.piece.device)


def _placeholders(values) -> list[nn.Parameter]:
    found, seen = [], set()
    for leaf in _pytree.tree_leaves(values):
        partitioned = isinstance(leaf, nn.Parameter) and init_shard(leaf) is not None and leaf.numel() == 0
        if partitioned and id(leaf) not in seen:
            seen.add(id(leaf))
            found.append(leaf)
    return found


class _WholeOnUse(TorchFunctionMode):
    """[Note: zero.Init]: torch calls on a partitioned parameter run on its gathered value."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        params = _placeholders((args, kwargs))
        if not params:
            return func(*args, **kwargs)
        for param in params:
            param.data = init_shard(param).gather()
        try:
            return func(*args, **kwargs)
        finally:
            for param in params:
                _restore(param)


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _set_mmap_threshold(nbytes: int) -> None:
    """[Note: zero.Init memory]. No-op where the C library has no mallopt (not glibc)."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes)


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    pending = [cls]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                pending.append(sub)
    return found


class Init:
    """``with infinity.zero.Init(): model = MyModel()`` builds the model already partitioned.

    Accepts DeepSpeed's arguments ``config`` / ``config_dict_or_path`` (read for offload_param) and
    ``enabled``; the process group is the engine's (torchrun's environment, or one the caller made)."""

    def __init__(self, module=None, *, config=None, config_dict_or_path=None, enabled: bool = True, **_ignored):
        if module is not None:
            raise ValueError("zero.Init(module=...) (partitioning an existing model) is not supported; build it inside")
        self.enabled = enabled
        raw = config if config is not None else config_dict_or_path
        self._check_config(raw)
        self._originals: dict[type, object] = {}
        self._depth: dict[int, int] = {}
        self._mode: _WholeOnUse | None = None
        self.comm: Comm | None = None
        self.device: torch.device | None = None

    @staticmethod
    def _check_config(raw) -> None:
        """The config is read for validation only: pieces are built in memory; initialize() moves them to their
        home (offload_param's host memory or NVMe)."""
        if raw is None:
            return
        from infinity.config import load_json

        load_json(raw)

    def __enter__(self):
        if not self.enabled:
            return self
        from infinity.distributed import compute_device, join_process_group

        self.comm = join_process_group()
        self.device = compute_device()
        _set_mmap_threshold(1 << 20)
        for cls in _all_subclasses(nn.Module) | {nn.Module}:
            self._wrap(cls)
        self._originals[type] = nn.Module.__dict__.get("__init_subclass__")
        init = self

        def init_subclass(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._mode = _WholeOnUse()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self._mode.__exit__(*exc)
        _set_mmap_threshold(32 << 20)
        original_subclass = self._originals.pop(type)
        if original_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = original_subclass
        for cls, original in self._originals.items():
            cls.__init__ = original
        self._originals.clear()

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or cls in self._originals:
            return
        self._originals[cls] = original
        depth = self._depth

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            key = id(module)
            depth[key] = depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                depth[key] -= 1
                if depth[key] == 0:
                    del depth[key]
            if key not in depth:
                self._partition_module(module)

        cls.__init__ = wrapped

    def _partition_module(self, module: nn.Module) -> None:
        for param in module.__dict__.get("_parameters", {}).values():
            if param is not None and init_shard(param) is None:
                _partition(param, self.comm, broadcast=True, device=self.device)


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0): ...`` makes the parameters whole on every rank.

    On exit they are partitioned again; with modifier_rank set, that rank's values are broadcast first, so its
    edits reach every rank (and, after initialize(), the optimizer's fp32 masters). Without it, edits are
    dropped. Collective: every rank must enter with the same parameters, as with DeepSpeed's (after
    initialize(), a rank entering alone gets a CollectiveUsageError)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if isinstance(params, Iterable) else [params]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._init_params: list[nn.Parameter] = []
        self._stage3 = None
        self._units: list[tuple[int, bool]] = []

    def __enter__(self):
        if not self.enabled:
            return self
        runtimes = {id(r): r for p in self.params if (r := stage3_runtime(p)) is not None}
        if len(runtimes) > 1:
            raise ValueError("GatheredParameters: the parameters belong to different engines; gather them separately")
        if runtimes:
            self._stage3 = next(iter(runtimes.values()))
            self._stage3.check_call("GatheredParameters")  # [Note: collective calls] in distributed.py
            self._units = self._stage3.gather(self.params)
        self._init_params = _placeholders(self.params)
        for param in self._init_params:
            param.data = init_shard(param).gather()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for param in self._init_params:
            comm = init_shard(param).comm
            if self.modifier_rank is not None:
                collectives.broadcast_(comm, param.data, src=self.modifier_rank)
            _restore(param, keep_edits=self.modifier_rank is not None)
        if self._stage3 is not None:
            self._stage3.partition(self._units, modifier_rank=self.modifier_rank)

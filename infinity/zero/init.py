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

Each piece goes to its home tier as soon as it is cut, so the device never holds more than the module being
built: with offload_param on NVMe in the config (or ``remote_device="nvme"``) to a swap store of its own
(``InitSwap``): the process holds one module's parameters at a time, so a model larger than host memory can be
built; with offload_param cpu (or ``remote_device="cpu"``) to host memory, so a model whose 1/N share does not fit
the device can be built; else it stays on the compute device. Gathering a parameter brings its piece back to the
compute device (collectives run there); initialize() takes every piece into the engine's own stores, giving each
swapped piece's blocks back to the disk as it is taken (so the engine's files, opened sparse meanwhile, fill the
space the Init copy leaves: [Note: deferred reservation] in memory/nvme_store.py), and the Init store's files go
when the last piece is taken (or at exit).

[Note: zero.Init memory]
Freed full-size parameters must really be given back, or the heap grows by a full model anyway: glibc serves
a 64-byte-aligned 16 MiB request from a heap hole only if the hole is larger than 16 MiB, so the holes each
partitioned layer leaves behind are never reused (measured: 32 layers of 16 MiB built under Init peaked at 2x
the model in one process). Entering the context therefore sets glibc's RETURN policy (infinity/memory/host.py):
allocations from 1 MiB up are mmap-backed and return to the system when freed. The engine's initialize() sets KEEP
for the steps of a run in memory (or on NVMe with a large host share), whose buffers are reused rather than
returned.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree
from torch.utils.weak import WeakIdKeyDictionary

from infinity.aio.handle import AioSettings
from infinity.comm import Comm
from infinity.config_keys import say_no_effect
from infinity.errors import ConfigError, InfinityError
from infinity.logs import install_default_handler
from infinity.memory.host import BUILD, fix_heap_policy
from infinity.memory.plan import check_init_piece, round_up
from infinity.zero import collectives
from infinity.zero.partition import layout_from_runs
from infinity.zero.units import stage3_runtime


@dataclass(frozen=True, slots=True)
class InitNvme:
    """Where zero.Init puts the pieces when they go to NVMe: offload_param.nvme_path and the aio settings."""

    nvme_path: str
    aio: AioSettings



def _global_rank() -> int:
    """This process's rank, before any engine exists (0 without a process group or a launcher)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))

class InitSwap:
    """The NVMe store of one zero.Init context ([Note: zero.Init]): pieces are appended as modules are built.
    The pieces refer to it; when initialize() has taken the last one, it closes and its files go. A failure on
    one rank (a read-only path, a full disk) is raised on every rank, which would otherwise wait in the next
    module's broadcast until the collective timeout."""

    def __init__(self, settings: InitNvme, comm: Comm, device: torch.device) -> None:
        from infinity.aio.handle import AioHandle
        from infinity.memory.nvme_store import NvmeStore
        from infinity.memory.offload import agree_run_id

        self.comm = comm
        self.device = device
        handle = AioHandle.from_settings(settings.aio)
        run_id = f"{agree_run_id(comm)}-init"
        try:
            with self._agreed("opening the zero.Init swap store"):
                self.store = NvmeStore(settings.nvme_path, handle=handle, rank=comm.rank, run_id=run_id).open()
        except BaseException:
            handle.close()
            raise
        self._names = itertools.count()
        weakref.finalize(self, _close_swap, self.store, handle)

    @contextlib.contextmanager
    def _agreed(self, what: str):
        """Runs the block on every rank; if it failed anywhere, every rank raises (the failing one its own error)."""
        failed = torch.zeros(1, device=self.device)
        try:
            yield
        except BaseException:
            failed.fill_(1.0)
            collectives.all_reduce_max_(self.comm, failed)
            raise
        collectives.all_reduce_max_(self.comm, failed)
        if failed.item():
            raise InfinityError(f"zero.Init: {what} failed on another rank (its log has the error)")

    def put(self, piece: torch.Tensor, owner: str) -> SwappedPiece:
        """``owner``: the parameter's shape and module, for the error if the disk is full."""
        name = f"piece{next(self._names)}"
        with self._agreed(f"writing the piece of {owner} to NVMe"):
            try:
                nbytes = piece.numel() * piece.element_size()
                check_init_piece(self.store.nvme_path, nbytes)  # the model's size is unknown here: a floor
                self.store.append(name, nbytes)
            except InfinityError as error:
                error.add_note(f"zero.Init was writing the piece of {owner}")
                raise
            swapped = SwappedPiece(self, name, piece.numel())
            swapped.write(piece)
        return swapped


def _close_swap(store, handle) -> None:
    try:
        store.close()
    finally:
        handle.close()


@dataclass(slots=True)
class SwappedPiece:
    swap: InitSwap  # keeps the store open while any piece lives
    name: str
    numel: int

    def write(self, piece: torch.Tensor) -> None:
        self.swap.store.sync_write(self.name, piece.detach().to("cpu").contiguous())

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=dtype)
        self.read_into(out)
        return out

    def read_into(self, out: torch.Tensor) -> None:
        """Into ``out`` (host memory, the piece's size and dtype): a gather's own slot, no second buffer."""
        self.swap.store.sync_read(self.name, out)

    def discard(self) -> bool:
        """The piece was taken: its blocks go back to the disk ([Note: deferred reservation] in nvme_store.py)."""
        return self.swap.store.discard(self.name)


@dataclass(slots=True)
class InitShard:
    """This rank's piece of one parameter partitioned by zero.Init: in memory (on the compute device, or in host
    memory), or on NVMe (``swapped``)."""

    shape: torch.Size
    piece: torch.Tensor | None  # (padded numel / world_size,), on the device or the host; None when swapped
    comm: Comm
    dtype: torch.dtype
    device: torch.device  # the compute device: where the piece is gathered (NCCL needs device tensors)
    swapped: SwappedPiece | None = None

    def local(self) -> torch.Tensor:
        """The piece on the compute device."""
        piece = self.piece if self.swapped is None else self.swapped.read(self.dtype)
        return piece.to(self.device)

    def set_local(self, piece: torch.Tensor) -> None:
        if self.swapped is None:
            self.piece.copy_(piece)
        else:
            self.swapped.write(piece.to(self.dtype))  # its bytes are read back as the shard's dtype

    def gather(self) -> torch.Tensor:
        """The whole value on the compute device: this rank's piece goes straight into its slot of the gathered
        buffer (read there from NVMe on the host), which is all-gathered in place; one full-size buffer."""
        numel = self.swapped.numel if self.swapped is not None else self.piece.numel()
        full = torch.empty(numel * self.comm.world_size, dtype=self.dtype, device=self.device)
        mine = full[self.comm.rank * numel : (self.comm.rank + 1) * numel]
        if self.swapped is not None and self.device.type == "cpu":
            self.swapped.read_into(mine)
        elif self.swapped is None:
            mine.copy_(self.piece)  # from host memory or the device, no staging copy
        else:
            mine.copy_(self.local())
        collectives.all_gather_pieces(self.comm, full, mine, async_op=False)
        return full[: self.shape.numel()].view(self.shape)


# Which parameters zero.Init partitioned: state kept beside the parameters, not stuck onto them.
_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def init_shard(param: nn.Parameter) -> InitShard | None:
    return _SHARDS.get(param)


def init_swap_bytes(params: Iterable[nn.Parameter]) -> dict[str, int]:
    """Bytes of these parameters' zero.Init pieces on NVMe, by the (absolute) nvme_path they are under."""
    held: dict[str, int] = {}
    for param in params:
        shard = init_shard(param)
        if shard is not None and shard.swapped is not None:
            path = shard.swapped.swap.store.nvme_path
            nbytes = shard.swapped.numel * shard.dtype.itemsize
            held[path] = held.get(path, 0) + round_up(nbytes)  # as the store lays its segments out
    return held


def take_whole(param: nn.Parameter) -> torch.Tensor:
    """The whole value of a parameter for the engine's stage 3, which then owns it: a zero.Init piece is gathered
    and dropped (kept, it would hold a second 1/N copy of the model)."""
    shard = init_shard(param)
    if shard is None:
        return param.data
    whole = shard.gather()
    del _SHARDS[param]
    if shard.swapped is not None:
        shard.swapped.discard()  # the disk holds the model once: the engine's files grow as these go
    return whole


def _partition(
    param: nn.Parameter, comm: Comm, *, broadcast: bool, device: torch.device | None = None,
    swap: InitSwap | None = None, module_of: nn.Module | None = None, host: bool = False,
) -> None:  # fmt: skip
    """``device``: where the parameter is cut and gathered (the compute device: NCCL broadcasts device tensors);
    default the parameter's own. A new piece's home: NVMe through ``swap``, host memory (``host``), else
    ``device``."""
    data = param.data
    device = data.device if device is None else device
    numel = data.numel()
    bucket = layout_from_runs(0, [numel], [[0]], world_size=comm.world_size).buckets[0]
    flat = collectives.flat_from_rank0(comm, bucket, [data], dtype=data.dtype, device=device, broadcast=broadcast)
    start, end = bucket.piece_range(comm.rank)
    piece = flat[start:end]
    shard = init_shard(param)
    if shard is None:
        common = {"shape": data.shape, "comm": comm, "dtype": data.dtype, "device": device}
        if swap is None:  # the home's own copy: the flat buffer of the whole parameter goes now
            kept = piece.to("cpu", copy=True) if host else piece.clone()
            _SHARDS[param] = InitShard(piece=kept, **common)
        else:
            owner = f"a parameter of shape {tuple(data.shape)}"
            if module_of is not None:
                owner += f" in {type(module_of).__name__}"
            _SHARDS[param] = InitShard(piece=None, swapped=swap.put(piece, owner), **common)
        param.ds_shape = data.shape  # DeepSpeed's public attributes of a partitioned parameter
        param.ds_numel = numel
    else:
        shard.set_local(piece)
    param.data = torch.empty(0, dtype=data.dtype, device=device)


def _restore(param: nn.Parameter, *, keep_edits: bool = True) -> None:
    """Back to the placeholder, keeping this rank's piece of the (possibly edited) whole value."""
    shard = init_shard(param)
    if keep_edits:
        _partition(param, shard.comm, broadcast=False, device=shard.device)
    else:
        param.data = torch.empty(0, dtype=shard.dtype, device=shard.device)


MAX_DIMS = 8  # a shape travels as this many numbers (-1 past its last dimension)


def _src_shapes(params: list[nn.Parameter], comm: Comm, src: int) -> list[torch.Size]:
    """Every parameter's shape as rank ``src`` holds it: one broadcast for all, before any rank chooses a path (a
    rank that changed none must still take part in the new shape's broadcast)."""
    local = torch.full((len(params), MAX_DIMS), -1, dtype=torch.int64)
    for row, param in enumerate(params):
        if param.data.dim() > MAX_DIMS:
            raise ValueError(f"GatheredParameters: a parameter of {param.data.dim()} dimensions (at most {MAX_DIMS})")
        local[row, : param.data.dim()] = torch.tensor(param.data.shape, dtype=torch.int64)
    shapes = local.to(init_shard(params[0]).device)
    collectives.broadcast_(comm, shapes, src=src)
    return [torch.Size(int(n) for n in row if n >= 0) for row in shapes.cpu()]


def _repartition(param: nn.Parameter, shard: InitShard, shape: torch.Size, *, src: int) -> None:
    """A gathered parameter whose ``.data`` rank ``src`` set to a tensor of another shape (Transformers' resizing
    of an embedding): src's value becomes the parameter on every rank, cut into new pieces in the same home as
    the old (device, host memory or NVMe). An NVMe piece's old place in the swap file stays unused until
    initialize() takes the pieces."""
    data = param.data.to(shard.device)
    if data.shape != shape:  # this rank did not make the change: src's value arrives
        data = torch.empty(shape, dtype=data.dtype, device=shard.device)
    collectives.broadcast_(shard.comm, data, src=src)
    del _SHARDS[param]
    param.data = data
    on_host = shard.piece is not None and shard.piece.device.type == "cpu" and shard.device.type != "cpu"
    _partition(param, shard.comm, broadcast=False, device=shard.device,
               swap=shard.swapped.swap if shard.swapped is not None else None, host=on_host)  # fmt: skip


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


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    pending = [cls]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                pending.append(sub)
    return found


INIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NO_EFFECT = {
    "pin_memory": "the engine pins the pieces as offload_param.pin_memory says once initialize() takes them",
    "mem_efficient_linear": "torch's own linear is used",
    "fwd_module": "a module's forward that uses another's parameters gathers them itself (an external use)",
}


def _refuse_unsupported(**given) -> None:
    """zero.Init's DeepSpeed arguments for what infinity does not implement: refused by name when set."""
    why = {
        "mpu": "model parallelism is not implemented: every rank is a data-parallel rank",
        "zero_param_parallel_group": "hpZ's secondary partition group is not implemented",
        "zero_quantized_weights": "quantized weights are not implemented",
        "zero_quantized_nontrainable_weights": "quantized weights are not implemented",
        "param_swapper": "the NVMe store is made from offload_param (config_dict_or_path)",
        "tensor_overrides": "tensor creation is not overridden: parameters are cut as the model builds them",
    }
    for name, value in given.items():
        if value not in (None, False):
            raise ConfigError(f"zero.Init({name}=...) is not supported by infinity ({why[name]}); remove it")


def _check_group(group) -> None:
    """The engine partitions over every rank: a zero.Init group must be that one."""
    if group is None:
        return
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    size = dist.get_world_size(group) if world > 1 else 1
    if size != world:
        held = "does not hold this rank" if size < 0 else f"has {size} of the {world} ranks"
        raise ConfigError(
            f"zero.Init: data_parallel_group {held}, but infinity partitions over every rank (the engine's "
            "data-parallel group is the whole world); pass None or the world group"
        )


class Init:
    """``with infinity.zero.Init(): model = MyModel()`` builds the model already partitioned.

    DeepSpeed's arguments, each doing what DeepSpeed documents or refused by name ([Note: zero.Init arguments]):
    ``config_dict_or_path`` (or ``config``; offload_param and aio are read: with offload_param on NVMe or cpu the
    pieces go there as they are cut), ``remote_device`` ("nvme" sends them to offload_param.nvme_path of the
    config even if its device says otherwise; "cpu" keeps them in host memory and "none" on the compute device,
    whatever the config says; None follows the config), ``enabled`` (False: the model is built normally), ``dtype`` (the
    floating-point parameters are cut in it), ``module`` (an existing model is partitioned at once, its
    weights rank 0's) and ``data_parallel_group`` (the group to partition over: every rank, as the engine's).
    The pieces on NVMe stay there until initialize() has moved each into the engine's own swap files: the disk
    holds both for a while.

    [Note: zero.Init arguments]
    DeepSpeed's dtype, when ``dtype`` is not given, is the config's (fp16, bf16, else fp32; fp16 without a
    config); here the pieces keep the dtype the model builds them in, so a model built under Init equals the one
    built without (initialize() casts to the compute dtype either way); pass ``dtype`` to build in 16 bits. The engine
    partitions over every rank (initialize() takes no group), so a ``data_parallel_group`` other than the whole
    world is refused here rather than by the engine later; so are model parallelism (``mpu``), hpZ's secondary
    group, quantized weights, another swapper and tensor-creation overrides. ``pin_memory`` and
    ``mem_efficient_linear`` are said to have no effect (the engine pins what offload_param.pin_memory says
    once initialize() takes the pieces; torch's own linear is used).
    """

    def __init__(self, module: nn.Module | None = None, *, data_parallel_group=None, mem_efficient_linear=None,
                 remote_device: str | None = None, pin_memory: bool | None = None, config_dict_or_path=None,
                 config=None, enabled: bool = True, dtype: torch.dtype | None = None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None, tensor_overrides=None):  # fmt: skip
        _refuse_unsupported(mpu=mpu, zero_param_parallel_group=zero_param_parallel_group,
                            zero_quantized_weights=zero_quantized_weights,
                            zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
                            param_swapper=param_swapper, tensor_overrides=tensor_overrides)  # fmt: skip
        if not isinstance(enabled, bool):
            raise ConfigError(f"zero.Init: enabled must be True or False, got {enabled!r}")
        if dtype not in (None, *INIT_DTYPES):
            raise ConfigError(f"zero.Init: dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype!r}")
        if config is not None and config_dict_or_path is not None and config != config_dict_or_path:
            raise ConfigError("zero.Init: config and config_dict_or_path are the same argument; give one")
        if data_parallel_group is not None and sequence_data_parallel_group is not None:
            raise ConfigError("zero.Init: data_parallel_group and sequence_data_parallel_group both given; give one")
        for name, value in (("pin_memory", pin_memory), ("mem_efficient_linear", mem_efficient_linear)):
            if value is not None:
                # zero.Init may come before any engine has set up the logger's default handler: the line
                # must reach a user who set up no logging all the same (logs.py)
                install_default_handler(_global_rank())
                say_no_effect(f"zero.Init({name}=)", _NO_EFFECT[name])
        self.enabled = enabled
        self.dtype = dtype
        _check_group(data_parallel_group if data_parallel_group is not None else sequence_data_parallel_group)
        raw = config if config is not None else config_dict_or_path
        if dtype is None and enabled:
            _say_dtype(raw)
        self._nvme = self._nvme_settings(raw, remote_device)
        self._host = self._nvme is None and _host_pieces(raw, remote_device)
        self._swap: InitSwap | None = None
        self._originals: dict[type, object] = {}
        self._depth: dict[int, int] = {}
        self._mode: _WholeOnUse | None = None
        self.comm: Comm | None = None
        self.device: torch.device | None = None
        if module is not None and enabled:
            self._partition_existing(module)

    def _join(self) -> None:
        """The process group, the compute device, and the NVMe store if the pieces go there."""
        from infinity.distributed import compute_device, join_process_group

        self.comm = join_process_group()
        self.device = compute_device()
        fix_heap_policy(BUILD)  # [Note: zero.Init memory]
        if self._nvme is not None and self._swap is None:
            self._swap = InitSwap(self._nvme, self.comm, self.device)

    def _partition_existing(self, module: nn.Module) -> None:
        """DeepSpeed's ``Init(module=model)``: a model already built is partitioned now, module by module (each
        parameter's value is rank 0's, as when built under the context)."""
        if not isinstance(module, nn.Module):
            raise ConfigError(f"zero.Init: module must be a torch.nn.Module, got {type(module).__name__}")
        self._join()
        for submodule in module.modules():
            self._partition_module(submodule)
        self._swap = None  # the pieces keep it open until initialize() has taken them

    @staticmethod
    def _nvme_settings(raw, remote_device: str | None) -> InitNvme | None:
        """Where the pieces go when they go to NVMe, else None; the config is validated either way."""
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ConfigError(f'zero.Init: remote_device must be "cpu", "nvme" or None, got {remote_device!r}')
        if raw is None:
            if remote_device == "nvme":
                raise ConfigError('zero.Init(remote_device="nvme") needs config= with offload_param.nvme_path')
            return None
        from infinity.config import offload_sections

        zero, aio = offload_sections(raw)
        if (zero.offload_param.device == "nvme" and remote_device is None) or remote_device == "nvme":
            if not zero.offload_param.nvme_path:
                raise ConfigError(
                    "zero.Init sends the pieces to NVMe but zero_optimization.offload_param.nvme_path is not set: "
                    "set it to a directory on a fast local disk"
                )
            return InitNvme(zero.offload_param.nvme_path, aio)
        return None

    def __enter__(self):
        if not self.enabled:
            return self
        self._join()
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
        self._swap = None  # the pieces keep it open until initialize() has taken them
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
                if self.dtype is not None and param.is_floating_point():
                    param.data = param.data.to(self.dtype)
                _partition(param, self.comm, broadcast=True, device=self.device, swap=self._swap, module_of=module,
                           host=self._host)  # fmt: skip



def _say_dtype(raw) -> None:
    """Where the config computes in 16 bits and dtype= is not given, DeepSpeed would cut the pieces in that dtype;
    here they keep the model's ([Note: zero.Init arguments]): said once, so a store twice the size is no surprise."""
    if raw is None:
        return
    from infinity.config import load_json

    sections = load_json(raw)
    sixteen = [k for k in ("bf16", "fp16") if isinstance(sections.get(k), dict) and sections[k].get("enabled") is True]
    if sixteen and not _DTYPE_SAID:
        _DTYPE_SAID.append(True)
        install_default_handler(_global_rank())
        torch_name = "bfloat16" if sixteen[0] == "bf16" else "float16"
        logging.getLogger("infinity").info(
            "zero.Init: the pieces keep the dtype the model builds them in (DeepSpeed would cut them in the config's "
            "%s); pass dtype=torch.%s to build them in 16 bits", sixteen[0], torch_name)


_DTYPE_SAID: list[bool] = []  # once per process


def _host_pieces(raw, remote_device: str | None) -> bool:
    """Whether the pieces live in host memory: remote_device "cpu", or offload_param cpu in the config when
    remote_device is not given (DeepSpeed's default: the offload_param device)."""
    if remote_device is not None or raw is None:
        return remote_device == "cpu"
    from infinity.config import offload_sections

    return offload_sections(raw)[0].offload_param.device == "cpu"


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=0): ...`` makes the parameters whole on every rank.

    On exit they are partitioned again; with modifier_rank set, that rank's values are broadcast first, so its
    edits reach every rank (and, after initialize(), the optimizer's fp32 masters). Without it, edits are
    dropped. Collective: every rank must enter with the same parameters, as with DeepSpeed's (after
    initialize(), a rank entering alone gets a CollectiveUsageError)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        if fwd_module is not None:
            install_default_handler(_global_rank())
            say_no_effect("GatheredParameters(fwd_module=)", _NO_EFFECT["fwd_module"])
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
        shapes = [None] * len(self._init_params)
        if self.modifier_rank is not None and self._init_params:
            shapes = _src_shapes(self._init_params, init_shard(self._init_params[0]).comm, self.modifier_rank)
        for param, shape in zip(self._init_params, shapes, strict=True):
            shard = init_shard(param)
            if shape is not None and shape != shard.shape:
                _repartition(param, shard, shape, src=self.modifier_rank)  # ``.data`` set to a new shape (a resize)
                continue
            if self.modifier_rank is not None and param.data.shape != shard.shape:  # changed here, not on src
                param.data = torch.empty(shard.shape, dtype=shard.dtype, device=shard.device)
            if self.modifier_rank is not None:
                collectives.broadcast_(shard.comm, param.data, src=self.modifier_rank)
            _restore(param, keep_edits=self.modifier_rank is not None)
        if self._stage3 is not None:
            self._stage3.partition(self._units, modifier_rank=self.modifier_rank)


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """DeepSpeed's (deepspeed.runtime.zero.stage3): the whole model gathered once for the block, so generation
    runs its forwards without fetching (Stage3.gather: [Note: generation gathered once] in infinity/generation.py);
    yields ``model`` (an engine or its module), partitioned again on exit. Collective."""
    with GatheredParameters(list(model.parameters())):
        yield model

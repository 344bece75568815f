"""Load-time partitioning: Transformers' ``from_pretrained`` / ``from_config`` under ZeRO-3 without DeepSpeed.

``HfInfinityConfig(config)`` is infinity's ``HfDeepSpeedConfig``: while it lives (this module holds only a weak
reference, so it goes with whoever owns it, as InfinityTrainingArguments does) and its config is ZeRO stage 3, a
model built by ``from_pretrained`` or ``from_config`` comes out partitioned by ``infinity.zero.Init`` with that
config, and a checkpoint's weights are loaded into the partitions.

[Note: load-time partitioning]
Transformers partitions at load time only for DeepSpeed: its ZeRO-3 branches are taken when
``is_deepspeed_zero3_enabled()`` is true, and each then imports ``deepspeed`` (``deepspeed.zero.Init``,
``GatheredParameters``, ``deepspeed.comm``, DeepSpeed's tensor-constructor wrappers). Setting its flag
(``set_hf_deepspeed_config``) would therefore need a module posing as DeepSpeed, which real code (Accelerate,
Trainer, PEFT) would then mistake for it. So the flag stays off, and for as long as a stage-3 HfInfinityConfig
lives, six methods of ``PreTrainedModel`` are wrapped; each wrapper does what the ZeRO-3 branch of the original
does, with infinity's zero.Init, and otherwise calls the original:

    get_init_context                         the model is built under zero.Init (no meta device, no weight
                                             initialization: the checkpoint overwrites it), as for DeepSpeed
    _from_config                             the model is built under zero.Init without initialization, then
                                             initialized module by module on gathered parameters, by rank 0
    _load_pretrained_model                   the checkpoint goes into the partitions (below)
    _move_missing_keys_from_meta_to_device   nothing to move: nothing was on the meta device
    _initialize_missing_keys                 the weights the checkpoint lacks initialized on gathered parameters
    resize_token_embeddings                  the old embeddings gathered while Transformers builds the new ones
                                             (their new rows initialized as without ZeRO), then partitioned

The last four act only on a model zero.Init partitioned. Transformers' own flag stays false, so nothing else of
Transformers (generate's synced_gpus, the Trainer's DeepSpeed code) changes. The wrappers go when the object does;
with real DeepSpeed installed, nothing changes unless an HfInfinityConfig is alive, and an HfDeepSpeedConfig for
ZeRO-3 alive at the same time is an error.

Loading into the partitions walks the model module by module, as Transformers' ZeRO-3 loader does: the
module's own parameters found in the checkpoint are gathered, rank 0 copies the checkpoint's values into them
(in the parameters' dtype) and its values are broadcast and cut to pieces again; persistent buffers are
broadcast from rank 0. Every rank reads the safetensors headers (names, shapes) and only rank 0 reads values,
one tensor at a time with positional reads rather than a memory map (a mapped checkpoint's pages would stay in
the process's resident set), so a rank holds its 1/N of the model plus one module whole, not the model.
Sharded checkpoints (an index and several files) are one key space; a checkpoint without the base model's
prefix is matched as Transformers matches it; renaming rules of the model (its weight conversion mapping) are
applied; rules that merge or split tensors (MoE experts) need the values, so with those rank 0 reads the whole
checkpoint into memory first.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from infinity.config import load_json, offload_sections
from infinity.errors import ConfigError
from infinity.zero import collectives
from infinity.zero.init import GatheredParameters, Init, init_shard
from infinity.zero.units import stage3_runtime

# The transformers versions whose loading internals the wrappers follow (the hf extra in pyproject.toml pins them)
SUPPORTED_TRANSFORMERS = ((5, 24), (6, 0))

_live: weakref.ref[HfInfinityConfig] | None = None


class HfInfinityConfig:
    """Makes ``from_pretrained`` / ``from_config`` partition at load time while this object lives and its config is
    ZeRO stage 3 ([Note: load-time partitioning]). ``config``: a DeepSpeed-style config dict (kept, not copied,
    so "auto" values filled in later are seen) or the path of a JSON file. The last one made is the one in force."""

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike) -> None:
        self.config: dict[str, Any] = config if isinstance(config, dict) else load_json(config)
        zero, _ = offload_sections(self.config)  # validated now, not halfway through a load
        self.stage = zero.stage
        _make_live(self)

    def is_zero3(self) -> bool:
        return self.stage == 3


def live_config() -> HfInfinityConfig | None:
    return None if _live is None else _live()


def is_zero3_active() -> bool:
    """True while an HfInfinityConfig for ZeRO stage 3 lives: models loaded now are partitioned."""
    config = live_config()
    return config is not None and config.is_zero3()


def _make_live(config: HfInfinityConfig) -> None:
    global _live
    if config.is_zero3():
        _Patches.install()
    else:
        _Patches.uninstall()
    _live = weakref.ref(config)
    weakref.finalize(config, _on_collected, _live)


def _on_collected(ref: weakref.ref) -> None:
    global _live
    if _live is ref:  # still the one in force: loading goes back to Transformers' own
        _live = None
        _Patches.uninstall()


def _partitioned(model: nn.Module) -> bool:
    return any(init_shard(param) is not None for param in model.parameters())


def _check_no_deepspeed_zero3() -> None:
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise ConfigError(
            "both an HfDeepSpeedConfig for ZeRO-3 (DeepSpeed's) and an HfInfinityConfig for ZeRO-3 (infinity's) are "
            "alive, so from_pretrained would partition twice: keep only one (drop the deepspeed= argument or the "
            "HfDeepSpeedConfig object when you use infinity)"
        )


def _raw(cls: type, name: str) -> Any:
    return cls.__dict__[name]


class _Patches:
    """The wrapped ``PreTrainedModel`` methods ([Note: load-time partitioning]); installed while a stage-3
    HfInfinityConfig lives, the originals put back exactly (their descriptors) when it goes."""

    NAMES = (
        "get_init_context",
        "_from_config",
        "_load_pretrained_model",
        "_move_missing_keys_from_meta_to_device",
        "_initialize_missing_keys",
        "resize_token_embeddings",
    )
    originals: dict[str, Any] = {}
    installed: dict[str, Any] = {}

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        import transformers
        from transformers.modeling_utils import PreTrainedModel

        version = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
        missing = [name for name in cls.NAMES if name not in PreTrainedModel.__dict__]
        if not SUPPORTED_TRANSFORMERS[0] <= version < SUPPORTED_TRANSFORMERS[1] or missing:
            low, high = (".".join(map(str, v)) for v in SUPPORTED_TRANSFORMERS)
            raise ImportError(
                f"load-time partitioning (HfInfinityConfig for ZeRO-3) supports transformers >={low},<{high} "
                f"(infinity's hf extra), and this is transformers {transformers.__version__}: install a version "
                f"in that range"
            )
        cls.originals = {name: _raw(PreTrainedModel, name) for name in cls.NAMES}
        cls.installed = _wrappers(cls.originals)
        for name, wrapper in cls.installed.items():
            setattr(PreTrainedModel, name, wrapper)

    @classmethod
    def uninstall(cls) -> None:
        if not cls.installed:
            return
        from transformers.modeling_utils import PreTrainedModel

        for name, wrapper in cls.installed.items():
            if PreTrainedModel.__dict__.get(name) is wrapper:  # someone else's later patch stays theirs
                setattr(PreTrainedModel, name, cls.originals[name])
        cls.installed, cls.originals = {}, {}


def _wrappers(originals: dict[str, Any]) -> dict[str, Any]:
    import transformers.modeling_utils as modeling_utils
    from transformers.initialization import no_init_weights

    get_init_context = originals["get_init_context"].__func__
    from_config = originals["_from_config"].__func__
    load_pretrained = originals["_load_pretrained_model"].__func__
    move_missing = originals["_move_missing_keys_from_meta_to_device"]
    initialize_missing = originals["_initialize_missing_keys"]
    resize = originals["resize_token_embeddings"]

    def init_context(cls, dtype, is_quantized, _is_ds_init_called, allow_all_kernels, *more, **named):
        # ``more``, ``named``: what later releases add, passed on as given (5.25 adds the model's config)
        config = live_config()
        if config is None or not config.is_zero3() or is_quantized:
            return get_init_context(cls, dtype, is_quantized, _is_ds_init_called, allow_all_kernels, *more, **named)
        _check_no_deepspeed_zero3()  # before the original, whose DeepSpeed branch would import deepspeed
        contexts = get_init_context(cls, dtype, is_quantized, _is_ds_init_called, allow_all_kernels, *more, **named)
        contexts = [c for c in contexts if not (isinstance(c, torch.device) and c.type == "meta")]
        if not _is_ds_init_called:  # else an enclosing model's zero.Init partitions this one too
            contexts += [no_init_weights(), Init(config=config.config), modeling_utils.set_zero3_state()]
        return contexts

    def from_config_partitioned(cls, config, **kwargs):
        live = live_config()
        nested = modeling_utils._is_ds_init_called or modeling_utils._is_quantized
        if live is None or not live.is_zero3() or nested:
            return from_config(cls, config, **kwargs)
        _check_no_deepspeed_zero3()
        with no_init_weights(), Init(config=live.config), modeling_utils.set_zero3_state():
            model = from_config(cls, config, **kwargs)
        initialize_partitioned(model)
        model.tie_weights()
        _resize_from_the_top(model)
        return model

    def load_into_partitions(model, state_dict, checkpoint_files, load_config, expected_keys=None):
        if load_config.is_quantized or not _partitioned(model):
            return load_pretrained(model, state_dict, checkpoint_files, load_config, expected_keys)
        if load_config.device_map is not None:
            raise ConfigError(
                "from_pretrained(device_map=...) places whole weights on devices, but under ZeRO-3 (a live "
                "HfInfinityConfig) every rank keeps a piece of each: drop device_map"
            )
        _resize_from_the_top(model)
        return load_checkpoint_into_partitions(model, state_dict, checkpoint_files, load_config), None

    def move_missing_keys(self, missing_keys, *args, **kwargs):
        if _partitioned(self):  # built under zero.Init, not on the meta device: nothing to move
            return None
        return move_missing(self, missing_keys, *args, **kwargs)

    def initialize_missing_keys(self, is_quantized):
        if is_quantized or not _partitioned(self):
            return initialize_missing(self, is_quantized)
        unset = [v for v in self.state_dict(keep_vars=True).values() if not getattr(v, "_is_hf_initialized", False)]
        with GatheredParameters(list({id(v): v for v in unset}.values()), modifier_rank=0):
            self.initialize_weights()
        return None

    def resize_partitioned(self, *args, **kwargs):
        if getattr(self, "_resizing_gathered", False):  # inside resize_gathered, through a subclass's super()
            return resize(self, *args, **kwargs)
        return resize_gathered(self, functools.partial(resize, self), *args, **kwargs)

    return {
        "get_init_context": classmethod(init_context),
        "_from_config": classmethod(from_config_partitioned),
        "_load_pretrained_model": staticmethod(load_into_partitions),
        "_move_missing_keys_from_meta_to_device": move_missing_keys,
        "_initialize_missing_keys": initialize_missing_keys,
        "resize_token_embeddings": resize_partitioned,
    }


def resize_gathered(model: nn.Module, call, *args, **kwargs):
    """resize_token_embeddings on a model zero.Init partitioned: the old embeddings whole while Transformers
    resizes them exactly as it does without ZeRO (its new rows initialized as there: it sets each weight's .data
    to the new tensor, which GatheredParameters cuts into new pieces, rank 0's values on every rank); a module it
    builds anew is partitioned after. ``call``: the resize to run (a model class's own override, which calls
    Transformers' through super(), reads the new shapes while they are still whole)."""
    live = live_config()
    if any(stage3_runtime(p) is not None for p in model.parameters()):
        raise ConfigError("resize_token_embeddings on a model an engine holds: the optimizer's state would "
                          "not follow the new rows; resize before infinity.initialize(), as with DeepSpeed")
    if live is None or not _partitioned(model):
        return call(*args, **kwargs)
    modules = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    model._resizing_gathered = True
    try:
        with GatheredParameters(params, modifier_rank=0):
            result = call(*args, **kwargs)
    finally:
        model._resizing_gathered = False
    Init(module=model, config=live.config)
    return result


def _resize_from_the_top(model: nn.Module) -> None:
    """The model's own resize_token_embeddings (a subclass's override included) runs inside the gather: set on
    the instance, as the models built partitioned here get it."""
    bound = type(model).resize_token_embeddings.__get__(model)
    model.__dict__["resize_token_embeddings"] = functools.partial(resize_gathered, model, bound)


def initialize_partitioned(model: nn.Module) -> None:
    """The model's own weight initialization, module by module in the order of ``initialize_weights`` (children
    first), each module's parameters and its plain children's gathered while rank 0 initializes them. As
    Transformers does for DeepSpeed: zero.Init alone would run the initialization on gathered copies, but loses
    in-place edits of a slice (``init.zeros_(weight[padding_idx])``), and gathering one module at a time keeps
    the memory to a module. The values are those of ``initialize_weights()`` on a model built without
    initialization (``no_init_weights``) from the same random state, not those of a plain build, whose layer
    constructors draw random numbers first."""
    from transformers.initialization import guard_torch_init_functions
    from transformers.modeling_utils import PreTrainedModel

    rank = _comm(model).rank
    custom = model.is_custom_code()

    def apply(module: nn.Module, initialize) -> None:
        for child in module.children():
            apply(child, child._initialize_weights if isinstance(child, PreTrainedModel) else initialize)
        params = list(module.parameters(recurse=False))
        for child in module.children():  # _init_weights may reach into direct children (module.q_proj.weight)
            if not isinstance(child, PreTrainedModel):
                params += child.parameters(recurse=False)
        with GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                initialize(module, custom)

    with torch.no_grad(), guard_torch_init_functions():
        apply(model, model._initialize_weights)


def _comm(model: nn.Module):
    return next(init_shard(p) for p in model.parameters() if init_shard(p) is not None).comm


# --- the checkpoint into the partitions ---------------------------------------------------------------------


@dataclass(slots=True)
class _Entry:
    """One tensor of the checkpoint: its shape everywhere, its value on rank 0 when asked."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


@dataclass(slots=True)
class _Checkpoint:
    """The checkpoint's key space over all its files, read lazily; closes its files on exit."""

    rank: int
    entries: dict[str, _Entry] = field(default_factory=dict)
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def add_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        for key, value in state_dict.items():
            self.entries[key] = _Entry(tuple(value.shape), (lambda v=value: v))

    def add_file(self, path: str, *, weights_only: bool) -> None:
        if path.endswith(".safetensors"):
            self._add_safetensors(path)
            return
        # A pickled (.bin) checkpoint has no header to read shapes from: rank 0 loads it whole (memory-mapped),
        # the others only its shapes
        state_dict = torch.load(
            path, map_location="cpu" if self.rank == 0 else "meta", mmap=self.rank == 0, weights_only=weights_only
        )
        self.add_state_dict(state_dict)

    def _add_safetensors(self, path: str) -> None:
        from safetensors import safe_open

        try:  # positional reads: a memory map would keep every page read resident
            handle = safe_open(path, framework="pt", device="cpu", backend="pread")
        except TypeError:  # a safetensors without the pread backend
            handle = safe_open(path, framework="pt", device="cpu")
        handle = self.stack.enter_context(handle)
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            shape = tuple(handle.get_slice(key).get_shape())
            self.entries[key] = _Entry(shape, (lambda k=key, h=handle: h.get_tensor(k)))

    def materialized(self) -> dict[str, torch.Tensor]:
        """Every value (rank 0) or a meta tensor of its shape (the others): for conversions that merge tensors."""
        values = {}
        for key, entry in self.entries.items():
            values[key] = entry.read() if self.rank == 0 else torch.empty(entry.shape, device="meta")
        return values


def _rename(model: nn.Module, checkpoint: _Checkpoint, expected: Mapping[str, Any], load_config) -> set[str]:
    """The model's renaming rules and the base-model prefix, as Transformers' ZeRO-3 loader applies them; returns
    the checkpoint's keys the renaming dropped as belonging to no parameter of the model (unexpected keys)."""
    mapping = getattr(load_config, "weight_mapping", None) or []
    dropped: set[str] = set()
    if mapping:
        from transformers.core_model_loading import WeightConverter
        from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict

        if any(isinstance(rule, WeightConverter) for rule in mapping):
            state_dict = checkpoint.materialized()
            checkpoint.entries = {}
            for converted in _apply_weight_conversions_to_state_dict(model, state_dict, mapping):
                checkpoint.add_state_dict(converted)
        else:  # renamings only: the values pass through untouched, still unread
            original = dict(checkpoint.entries)
            checkpoint.entries = dict(next(_apply_weight_conversions_to_state_dict(model, dict(original), mapping)))
            kept = {id(entry) for entry in checkpoint.entries.values()}
            dropped = {key for key, entry in original.items() if id(entry) not in kept}
        model._weight_conversions = mapping
    prefix = getattr(model, "base_model_prefix", None)
    if prefix:
        checkpoint.entries = {
            (f"{prefix}.{key}" if key not in expected and f"{prefix}.{key}" in expected else key): entry
            for key, entry in checkpoint.entries.items()
        }
    return dropped


def _modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        yield (f"{name}." if name else ""), module


def load_checkpoint_into_partitions(model: nn.Module, state_dict, checkpoint_files, load_config):
    """The checkpoint's values into a model that zero.Init partitioned ([Note: load-time partitioning]); returns
    Transformers' LoadStateDictInfo (missing, unexpected and mismatched keys) for its finalization."""
    from transformers.utils.loading_report import LoadStateDictInfo

    shard = next(init_shard(p) for p in model.parameters() if init_shard(p) is not None)
    comm, device = shard.comm, shard.device  # device: where collectives run (NCCL needs device tensors)
    expected = model.state_dict(keep_vars=True)
    mismatched: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    loaded: set[str] = set()
    with _Checkpoint(rank=comm.rank) as checkpoint:
        if state_dict is not None:
            checkpoint.add_state_dict(state_dict)
        elif checkpoint_files:
            for path in checkpoint_files:
                checkpoint.add_file(path, weights_only=getattr(load_config, "weights_only", True))
        else:
            raise ValueError("from_pretrained found neither a state dict nor checkpoint files to load")
        dropped = _rename(model, checkpoint, expected, load_config)
        entries = checkpoint.entries

        def usable(key: str, tensor: torch.Tensor) -> bool:
            if key not in entries:
                return False
            shape = tuple(getattr(tensor, "ds_shape", tensor.shape))
            if entries[key].shape == shape:
                return True
            if not load_config.ignore_mismatched_sizes:
                raise ConfigError(
                    f"from_pretrained: {key} has shape {entries[key].shape} in the checkpoint but {shape} in the "
                    "model; pass ignore_mismatched_sizes=True to initialize it instead"
                )
            mismatched.add((key, entries[key].shape, shape))
            return False

        for prefix, module in _modules(model):
            params = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
            params = [(key, p) for key, p in params if usable(key, p)]
            if params:
                with GatheredParameters([p for _, p in params], modifier_rank=0), torch.no_grad():
                    for key, param in params:
                        if comm.rank == 0:
                            param.data.copy_(entries[key].read())
                        param._is_hf_initialized = True
                        loaded.add(key)
            for name, buffer in module.named_buffers(recurse=False):
                key = prefix + name
                if buffer is None or not usable(key, buffer):
                    continue
                with torch.no_grad():
                    value = buffer.to(device, copy=True)
                    if comm.rank == 0:
                        value.copy_(entries[key].read())
                    buffer.copy_(collectives.broadcast_(comm, value, src=0))
                buffer._is_hf_initialized = True
                loaded.add(key)
        unexpected = (set(entries) - set(expected)) | dropped
    return LoadStateDictInfo(
        missing_keys=set(expected) - loaded - {key for key, _, _ in mismatched},
        unexpected_keys=unexpected,
        mismatched_keys=mismatched,
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )

"""`infinity ckpt from-deepspeed DIR OUT`: a DeepSpeed ZeRO checkpoint (stages 1, 2 and 3, fp32, bf16 or fp16, as
DeepSpeed 0.19 writes it) turned into infinity's, so a run begun with DeepSpeed resumes here, at any world size,
with its fp32 masters, Adam states, step counts, LR scheduler and loss scale.

[Note: DeepSpeed's checkpoint layout]
A tag folder holds, per data-parallel rank r, ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (the rank's
partition of the fp32 masters and of the torch optimizer's flat states; ``bf16_`` whenever bf16 is on) and the
model-states file(s): ``mp_rank_00_model_states.pt`` at stages 1-2 (rank 0's), one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank at stage 3. The model states give ``param_shapes``: per
flat buffer (a param group at stages 1-2, a sub-group at stage 3), the parameters in buffer order with their shapes;
``frozen_param_shapes`` / ``frozen_param_fragments`` for parameters without gradients (stages 2-3), ``shared_params``
(alias -> owner, rank 0's file), ``buffer_names``, the counters, the LR scheduler's state, the config, and the user's
client state at the top level.
- Stages 1-2: each group's flat buffer is the group's parameters back to back (with ``param_alignment_paddings``
  after each, where set), padded at the end to a multiple of 2 x world size, and split into equal partitions.
  Rank r's Adam states cover its whole partition; its fp32 masters (``single_partition_of_fp32_groups``) leave the
  end padding out. The torch optimizer's state key is the group's index.
- Stage 3: every parameter is split alone into world-size pieces of ceil(numel / world size) elements (the last
  padded); a sub-group's flat buffer on rank r is its parameters' pieces back to back, in ``param_shapes`` order.
  The state key is the sub-group's index; each param group's ``params`` lists its sub-groups.
The optimizer files hold three DeepSpeed objects (the loss scaler, the stage's enum, a fragment address): they are
read with ``torch.load(weights_only=True)`` with stand-ins allowed under those names, so nothing in the file runs
and DeepSpeed need not be installed. Files are memory-mapped and each parameter is assembled alone from the ranks'
ranges, then written chunk by chunk: the model is never whole in memory.
"""

from __future__ import annotations

import enum
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from infinity.checkpoint.durable import publish_folder, sync_files, write_durably
from infinity.checkpoint.manifest import LATEST, GroupEntry, Manifest, dtype_name, json_safe
from infinity.checkpoint.pickled import refusal
from infinity.checkpoint.save import ENGINE_STATE, json_safe_config
from infinity.checkpoint.state_map import BUFFERS, PARAMS, state_key
from infinity.checkpoint.zarr_store import ArrayMeta, write_array_meta, write_chunk, write_group
from infinity.errors import CheckpointError

# The model-states file's own keys; anything else at its top level is the user's client_state.
DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "ds_zero_partition_groups",
}  # fmt: skip


class _ZeroStage(enum.IntEnum):
    """Stands in for deepspeed.runtime.zero.config.ZeroStageEnum."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _Opaque:
    """Stands in for DeepSpeed's loss scalers and fragment addresses: their fields, nothing else."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


_STAND_INS = [
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_Opaque, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Opaque, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Opaque, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _load(path: str) -> dict:
    """A DeepSpeed .pt file, memory-mapped, read without running code."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch's unpickling errors have many types
        raise CheckpointError(f"{path}: not readable as a DeepSpeed checkpoint file without running code ({e})"
                              ) from None  # fmt: skip


def _rank(path: str) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))


@dataclass(slots=True)
class _Parameter:
    name: str
    shape: torch.Size
    group: int  # the torch param group
    buffer: int  # the flat buffer (stages 1-2: the group; 3: the sub-group)
    offset: int  # first element in the buffer (stages 1-2) or in each rank's piece of it (3)


@dataclass(slots=True)
class _Frozen:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    source: DeepSpeedTag

    def value(self) -> torch.Tensor:
        return self.source.frozen_value(self.name, self.shape)


class DeepSpeedTag:
    """One tag of a DeepSpeed checkpoint, read lazily ([Note: DeepSpeed's checkpoint layout])."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        names = sorted(os.listdir(folder))
        optim = sorted((n for n in names if n.endswith("_optim_states.pt") and "zero_pp_rank_" in n), key=_rank)
        if not optim:
            raise CheckpointError(f"{folder} has no DeepSpeed ZeRO optimizer files (*zero_pp_rank_*_optim_states.pt): "
                                  "is it a ZeRO checkpoint (stage 1, 2 or 3) written by DeepSpeed's "
                                  "save_checkpoint?")  # fmt: skip
        if [_rank(n) for n in optim] != list(range(len(optim))):
            raise CheckpointError(f"{folder}: the optimizer files of ranks {[_rank(n) for n in optim]} are not "
                                  f"0..{len(optim) - 1}: a file is missing")  # fmt: skip
        self.world_size = len(optim)
        self.optim = [_load(os.path.join(folder, n))["optimizer_state_dict"] for n in optim]
        stage3_models = sorted((n for n in names if n.endswith("_model_states.pt") and "zero_pp_rank_" in n), key=_rank)
        if stage3_models:
            self.models = [_load(os.path.join(folder, n)) for n in stage3_models]
        elif "mp_rank_00_model_states.pt" in names:
            self.models = [_load(os.path.join(folder, "mp_rank_00_model_states.pt"))]
        else:
            raise CheckpointError(f"{folder} has no model-states file (mp_rank_00_model_states.pt)")
        self.model = self.models[0]
        stage = self.optim[0].get("zero_stage")
        self.stage = int(stage) if stage is not None else 1  # bf16's optimizer (stage 1) keeps no stage
        if self.stage not in (1, 2, 3):
            raise CheckpointError(f"{folder}: ZeRO stage {self.stage} is not 1, 2 or 3")
        self.config: dict = dict(self.model.get("ds_config") or {})
        self.torch_state = self.optim[0]["optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"]
        if not isinstance(self.torch_state, dict):
            raise CheckpointError(f"{folder}: the optimizer states are saved elastically (zero_optimization."
                                  "elastic_checkpoint), which this conversion does not read")  # fmt: skip
        counts = self.optim[0].get("partition_count", self.world_size)
        count = max(counts) if isinstance(counts, list | tuple) else int(counts)
        if count != self.world_size:
            raise CheckpointError(f"{folder}: the checkpoint was saved by {count} ranks but holds "
                                  f"{self.world_size} ranks' optimizer files: remove files of another run")  # fmt: skip
        self.parameters = self._layout()
        self.states = self._state_names()

    # ---- the layout ----
    def _layout(self) -> list[_Parameter]:
        groups = self.torch_state["param_groups"]
        group_of_buffer = {}
        for g, group in enumerate(groups):
            for buffer in group["params"] if self.stage == 3 else [g]:
                group_of_buffer[buffer] = g
        paddings = self.optim[0].get("param_alignment_paddings")
        found = []
        for buffer, shapes in enumerate(self.model["param_shapes"]):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                found.append(_Parameter(name, torch.Size(shape), group_of_buffer[buffer], buffer, offset))
                numel = math.prod(shape)
                if self.stage == 3:
                    offset += math.ceil(numel / self.world_size)
                else:
                    offset += numel + (paddings[buffer][i] if paddings else 0)
        return found

    def _state_names(self) -> tuple[str, ...]:
        """The torch optimizer's per-element states (exp_avg, exp_avg_sq for Adam; momentum_buffer; ...)."""
        names: dict[str, None] = {}
        for state in self.torch_state["state"].values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() > 1 and key != "step":
                    names.setdefault(key)
        return tuple(names)

    def _partition(self, buffer: int) -> int:
        """Stages 1-2: each rank's share of the group's flat buffer, padding included: the parameters (and their
        alignment gaps) padded to a multiple of 2 x world size, split evenly."""
        paddings = self.optim[0].get("param_alignment_paddings")
        total = sum(math.prod(shape) for shape in self.model["param_shapes"][buffer].values())
        total += sum(paddings[buffer]) if paddings else 0
        step = 2 * self.world_size
        return -(-total // step) * step // self.world_size

    def step_of(self, group: int) -> int:
        buffers = self.torch_state["param_groups"][group]["params"] if self.stage == 3 else [group]
        state = self.torch_state["state"].get(buffers[0], {}) if buffers else {}
        step = state.get("step", 0)
        return int(step.item() if torch.is_tensor(step) else step)

    # ---- the values, one parameter at a time ----
    def values(self, parameter: _Parameter) -> dict[str, torch.Tensor]:
        """The parameter's fp32 master and Adam states, whole."""
        numel = math.prod(parameter.shape)
        found = {}
        for what in ("master", *self.states):
            pieces = [self._piece(rank, parameter, what) for rank in range(self.world_size)]
            # stage 3: every rank's piece, the last padded; 1-2: the ranks' ranges, empty where a rank holds none
            flat = torch.cat(pieces)[:numel] if self.stage == 3 else torch.cat(pieces)
            if flat.numel() != numel:
                raise CheckpointError(f"{self.folder}: {parameter.name} ({what}) has {flat.numel()} of its {numel} "
                                      "elements in the ranks' files: the checkpoint is damaged or of another "
                                      "layout")  # fmt: skip
            found[what] = flat.float().view(parameter.shape)
        return found

    def _flat(self, rank: int, buffer: int, what: str) -> torch.Tensor:
        optim = self.optim[rank]
        if what == "master":
            return optim["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"][buffer]
        state = optim["optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"]["state"][buffer]
        return state[what]

    def _piece(self, rank: int, parameter: _Parameter, what: str) -> torch.Tensor:
        flat = self._flat(rank, parameter.buffer, what)
        numel = math.prod(parameter.shape)
        if self.stage == 3:
            each = math.ceil(numel / self.world_size)
            return flat[parameter.offset : parameter.offset + each]
        partition = self._partition(parameter.buffer)
        first = rank * partition
        lo, hi = max(parameter.offset, first), min(parameter.offset + numel, first + partition)
        return flat[lo - first : hi - first] if lo < hi else flat[:0]

    def frozen(self) -> list[_Frozen]:
        """Parameters without gradients (zero-element ones too), in the model's dtype; each assembled only when
        written."""
        shapes = self.model.get("frozen_param_shapes") or {}
        found = []
        for name, shape in shapes.items():
            fragment = self.model["frozen_param_fragments"].get(name)
            dtype = fragment.dtype if fragment is not None else torch.float32
            found.append(_Frozen(name, torch.Size(shape), dtype, self))
        if self.stage == 1:  # frozen parameters are only in the module's state dict
            module = self.model.get("module") or {}
            optimized = {p.name for p in self.parameters} | set(self.aliases_of())
            buffers = set(self.model.get("buffer_names") or ())
            for name, value in module.items():
                if name not in optimized and name not in buffers:
                    found.append(_Frozen(name, value.shape, value.dtype, self))
        return found

    def frozen_value(self, name: str, shape: torch.Size) -> torch.Tensor:
        numel = math.prod(shape)
        if self.stage == 1:
            return self.model["module"][name].reshape(shape)
        if self.stage == 3:
            return torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in self.models])[:numel].view(shape)
        return self.model["frozen_param_fragments"][name].reshape(shape)

    def buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        module = self.model.get("module") or {}
        for name in self.model.get("buffer_names") or ():
            if name in module:
                yield name, module[name]

    def aliases_of(self) -> dict[str, str]:
        """alias -> owner (rank 0's file)."""
        return dict(self.model.get("shared_params") or {})


def _compute_dtype(config: dict) -> str:
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled"):
        return "bfloat16"
    if (config.get("fp16") or {}).get("enabled"):
        return "float16"
    return "float32"


def _optimizer_class(config: dict) -> str | None:
    """The torch class infinity builds from the config's optimizer (DeepSpeed's Adam decouples weight decay unless
    adam_w_mode is false); None when the run passed its own optimizer (any class may resume then)."""
    spec = config.get("optimizer") or {}
    kind = str(spec.get("type", "")).lower()
    if kind in ("adam", "adamw"):
        adam_w = kind == "adamw" or (spec.get("params") or {}).get("adam_w_mode", True)
        return "AdamW" if adam_w else "Adam"
    return {"sgd": "SGD", "adagrad": "Adagrad", "lion": "Lion"}.get(kind)


def _loss_scaler(optim: dict) -> dict:
    scaler = optim.get("loss_scaler")
    fields = getattr(scaler, "__dict__", {}) if scaler is not None else {}
    return {
        "dynamic": bool(optim.get("dynamic_loss_scale", False)),
        "scale": float(fields.get("cur_scale", 1.0)),
        "hysteresis_left": int(fields.get("cur_hysteresis", fields.get("delayed_shift", 1))),
        "iteration": int(fields.get("cur_iter", 0)),
        "last_overflow": int(fields.get("last_overflow_iter", -1)),
    }


def _client_state(model: dict) -> tuple[dict, list[str]]:
    """The user's client_state (the top-level keys DeepSpeed did not write), less what a weights-only load could
    not read back (named)."""
    kept, dropped = {}, []
    for key, value in model.items():
        if key in DEEPSPEED_KEYS:
            continue
        if refusal(value) is None:
            kept[key] = value
        else:
            dropped.append(key)
    return kept, dropped


def resolve_deepspeed_tag(ckpt_dir: str, tag: str | None) -> str:
    if any(n.endswith("_optim_states.pt") for n in os.listdir(ckpt_dir)):
        return ckpt_dir  # a tag folder itself
    if tag is None:
        latest = os.path.join(ckpt_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointError(f"{ckpt_dir} has no `latest` file; pass --tag (one of its folders)")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{ckpt_dir}: tag {tag!r} has no folder")
    return folder


def from_deepspeed(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None) -> str:
    """Converts a DeepSpeed ZeRO checkpoint into an infinity checkpoint ``out_dir/<tag>`` (``latest`` names it);
    returns its folder. load_checkpoint(out_dir) then resumes it at any world size, stage or offload mode."""
    from infinity import __version__

    source = DeepSpeedTag(resolve_deepspeed_tag(os.fspath(ckpt_dir), tag))
    tag_name = os.path.basename(source.folder.rstrip("/"))
    out_dir = os.fspath(out_dir)
    final = os.path.join(out_dir, tag_name)
    if os.path.exists(final) and not os.path.exists(os.path.join(final, "manifest.json")):
        raise CheckpointError(f"{final} exists and is not an infinity checkpoint (is it the DeepSpeed checkpoint "
                              "itself?): convert into another folder")  # fmt: skip
    if refusal(source.model.get("lr_scheduler")) is not None:
        raise CheckpointError(f"{source.folder}: the LR scheduler's state holds objects a weights-only load could "
                              "not read back; this checkpoint cannot be converted")  # fmt: skip
    tmp = final + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(out_dir, exist_ok=True)
    aliases = source.aliases_of()
    frozen = list(source.frozen())
    buffers = list(source.buffers())
    metas: dict[str, ArrayMeta] = {}
    for parameter in source.parameters:
        for key in (PARAMS + parameter.name, *(state_key(s, parameter.name) for s in source.states)):
            metas[key] = ArrayMeta.plan(tuple(parameter.shape), torch.float32)
    for entry in frozen:
        metas[PARAMS + entry.name] = ArrayMeta.plan(tuple(entry.shape), entry.dtype)
        if math.prod(entry.shape) == 0:  # DeepSpeed lists a zero-element parameter as frozen; it may be trained
            for state in source.states:
                metas[state_key(state, entry.name)] = ArrayMeta.plan(tuple(entry.shape), torch.float32)
    for name, value in buffers:
        metas[BUFFERS + name] = ArrayMeta.plan(tuple(value.shape), value.dtype)
    write_group(tmp)
    for prefix in sorted({key.rsplit("/", 1)[0] for key in metas}):
        parts = prefix.split("/")
        for depth in range(1, len(parts) + 1):
            write_group(tmp, "/".join(parts[:depth]))
    for key, meta in metas.items():
        write_array_meta(tmp, key, meta)
    written: list[str] = []
    for parameter in source.parameters:  # one parameter in memory at a time
        values = source.values(parameter)
        written += _write_array(tmp, PARAMS + parameter.name, metas, values["master"])
        for state in source.states:
            written += _write_array(tmp, state_key(state, parameter.name), metas, values[state])
    for entry in frozen:  # assembled one at a time
        if math.prod(entry.shape):
            written += _write_array(tmp, PARAMS + entry.name, metas, entry.value())
    for name, value in buffers:
        written += _write_array(tmp, BUFFERS + name, metas, value)

    config = source.config
    groups = []
    for g, group in enumerate(source.torch_state["param_groups"]):
        hyper = {k: json_safe(v) for k, v in group.items() if k != "params"}
        names = [p.name for p in source.parameters if p.group == g]
        groups.append(GroupEntry(names, hyper, source.step_of(g)))
    global_steps = int(source.model.get("global_steps", 0))
    micro = int(config.get("train_micro_batch_size_per_gpu") or 1)
    accumulation = int(config.get("gradient_accumulation_steps") or 1)
    client_state, dropped = _client_state(source.model)
    engine_state = {
        "global_steps": global_steps,
        "micro_steps": global_steps * accumulation,
        "skipped_steps": int(source.model.get("skipped_steps", 0)),
        "global_samples": int(source.model.get("global_samples", global_steps * micro * accumulation
                                                * source.world_size)),  # fmt: skip
        "loss_scaler": _loss_scaler(source.optim[0]),
        "lr_scheduler": source.model.get("lr_scheduler"),
        "data_loader": None,
        "client_state": client_state,
    }
    torch.save(engine_state, os.path.join(tmp, ENGINE_STATE))
    sync_files(tmp, [*written, os.path.join(tmp, ENGINE_STATE)])
    zero = config.get("zero_optimization") or {}
    owners: dict[str, list[str]] = {}
    for alias, owner in aliases.items():
        owners.setdefault(owner, []).append(alias)
    manifest = Manifest(
        world_size=source.world_size, stage=source.stage, compute_dtype=_compute_dtype(config),
        offload_optimizer=str((zero.get("offload_optimizer") or {}).get("device", "none")),
        offload_param=str((zero.get("offload_param") or {}).get("device", "none")),
        global_steps=global_steps, micro_steps=engine_state["micro_steps"], skipped_steps=engine_state["skipped_steps"],
        arrays={key: {"shape": list(meta.shape), "dtype": dtype_name(meta.dtype)} for key, meta in metas.items()},
        aliases=owners, groups=groups, state_names=list(source.states), scalar_keys=["step"],
        config=json_safe_config(config),
        library_version=__version__,
        extra={"converted_from": f"DeepSpeed {source.model.get('ds_version', '?')}", "client_state_dropped": dropped,
               **({"optimizer": cls} if (cls := _optimizer_class(config)) else {})},
    )  # fmt: skip
    for entry in frozen:
        manifest.arrays[PARAMS + entry.name]["torch_dtype"] = dtype_name(entry.dtype)
    for name, value in buffers:
        manifest.arrays[BUFFERS + name]["torch_dtype"] = dtype_name(value.dtype)
    manifest.write(tmp)
    publish_folder(tmp, final)
    write_durably(os.path.join(out_dir, LATEST), tag_name)
    return final


def _write_array(root: str, key: str, metas: dict[str, ArrayMeta], value: torch.Tensor) -> list[str]:
    meta = metas[key]
    flat = value.detach().reshape(-1).to(meta.dtype)
    return [write_chunk(root, key, meta, index, flat[slice(*meta.chunk_range(index))])
            for index in range(meta.num_chunks)]  # fmt: skip

"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions, under its names, on infinity's checkpoints: the saved
fp32 weights as a state dict in memory, loaded into a model, or written as files. The checkpoint keeps each
parameter whole by name ([Note: zarr layout] in checkpoint/zarr_store.py), so none of them gathers pieces: they
read arrays. ``infinity ckpt to-fp32`` streams the same conversion without holding the model in memory."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from infinity.aio.buffers import available_host_bytes
from infinity.checkpoint.consolidate import parse_size, read_whole, state_arrays, tag_folder, to_fp32
from infinity.checkpoint.manifest import Manifest
from infinity.errors import CheckpointError
from infinity.memory.nvme_store import _human

HOST_SHARE = 0.75  # of the host's available memory that an in-memory state dict may take


def _fp32_bytes(meta) -> int:
    return meta.numel * (4 if meta.dtype.is_floating_point else meta.dtype.itemsize)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """The checkpoint's parameters (fp32) and persistent buffers as a state dict on the CPU, tied parameters
    under each of their names (one tensor). ``tag``: default the one `latest` names. Refused, before anything is
    read, when it would take more than 3/4 of the host's available memory: ``infinity ckpt to-fp32`` writes it
    as files without holding it. ``lazy_mode`` is DeepSpeed's way around that; here it is refused the same way
    (use the command)."""
    if lazy_mode:
        raise CheckpointError("lazy_mode is not supported: write the state dict as files with `infinity ckpt "
                              "to-fp32 CHECKPOINT OUT` (streamed, never whole in memory) and load them from there")
    folder = tag_folder(checkpoint_dir, tag)
    manifest = Manifest.read(folder)
    arrays = state_arrays(folder, manifest, exclude_frozen_parameters=exclude_frozen_parameters)
    needed = sum(_fp32_bytes(meta) for _, _, meta in arrays)
    available = available_host_bytes()
    if needed > HOST_SHARE * available:
        raise CheckpointError(
            f"{folder}: the fp32 state dict needs {_human(needed)}, more than 3/4 of the {_human(available)} of host "
            f"memory available: write it as files with `infinity ckpt to-fp32 {checkpoint_dir} OUT` (streamed, "
            "never whole in memory)"
        )
    state = {name: read_whole(folder, key, meta) for key, name, meta in arrays}
    for name, others in manifest.aliases.items():
        if name in state:
            for other in others:
                state[other] = state[name]
    return state


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:  # fmt: skip
    """DeepSpeed's: moves ``model`` to the CPU and loads the checkpoint's fp32 weights into it (strict=False, as
    DeepSpeed: a checkpoint saved without frozen parameters leaves the model's own). Returns the model. A model an
    engine holds must not be used with that engine afterwards."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                               max_shard_size: str | int | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:  # fmt: skip
    """DeepSpeed's: the checkpoint's fp32 state dict as files in ``output_dir``: ``model.safetensors`` (sharded
    past ``max_shard_size``, with ``model.safetensors.index.json``) with ``safe_serialization``, streamed; else
    ``pytorch_model.bin`` (or ``pytorch_model-0000k-of-0000n.bin`` + ``pytorch_model.bin.index.json``), built
    one shard at a time in memory, as DeepSpeed does, a tied weight under each of its names (safetensors keeps
    one: transformers ties it again)."""
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    if safe_serialization:
        to_fp32(checkpoint_dir, output_dir, tag=tag, max_shard_size=limit if limit is not None else 1 << 62,
                exclude_frozen_parameters=exclude_frozen_parameters)  # fmt: skip
        return
    folder = tag_folder(checkpoint_dir, tag)
    manifest = Manifest.read(folder)
    arrays = state_arrays(folder, manifest, exclude_frozen_parameters=exclude_frozen_parameters)
    shards: list[list] = [[]]
    size = 0
    for item in arrays:
        nbytes = _fp32_bytes(item[2])
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    os.makedirs(output_dir, exist_ok=True)
    if len(shards) == 1:
        names = ["pytorch_model.bin"]
    else:
        names = [f"pytorch_model-{k + 1:05d}-of-{len(shards):05d}.bin" for k in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        state = {entry: read_whole(folder, key, meta) for key, entry, meta in shard}
        for owner, others in manifest.aliases.items():  # a tied weight under each of its names, one tensor
            if owner in state:
                state.update(dict.fromkeys(others, state[owner]))
        torch.save(state, os.path.join(output_dir, name))
        weight_map.update({entry: name for entry in state})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_fp32_bytes(meta) for *_, meta in arrays)}, "weight_map": weight_map}
        with open(os.path.join(output_dir, "pytorch_model.bin.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")

"""Checkpoint -> a plain fp32 state dict (DeepSpeed's zero_to_fp32), and a summary of what a checkpoint holds.

The checkpoint already stores each parameter whole, by name ([Note: zarr layout] in zarr_store.py), so
consolidation is a copy: each array is streamed chunk by chunk into safetensors shards, never a whole tensor in
memory (peak RSS is bounded by a chunk, 8 MiB, not by the model or its largest tensor). The output is what
transformers reads: ``model.safetensors`` or, beyond ``max_shard_size``, ``model-0000k-of-0000n.safetensors``
files, with ``model.safetensors.index.json`` either way, and the model's ``config.json`` where the checkpoint has
one, in its tag folder or beside it (``infinity train --save`` and the Trainer put it in the save folder), so that
``from_pretrained(out_dir)`` loads it. No infinity is needed to load it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch

from infinity.checkpoint.load import resolve_tag
from infinity.checkpoint.manifest import LATEST, MANIFEST, Manifest
from infinity.checkpoint.safetensors_io import Entry, SafetensorsWriter
from infinity.checkpoint.state_map import BUFFERS, PARAMS
from infinity.checkpoint.zarr_store import read_array_meta, read_range
from infinity.errors import CheckpointError

INDEX = "model.safetensors.index.json"
MODEL_CONFIG = "config.json"  # a transformers model's config, as save_pretrained writes it
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(text: str | int) -> int:
    """"5GB", "500MB", "2GiB" or a number of bytes."""
    if isinstance(text, int):
        return text
    found = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if found is None or found.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: use a number with B, KB, MB, GB (or KiB, MiB, GiB)")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def tag_folder(ckpt_dir: str | os.PathLike, tag: str | None) -> str:
    """The folder of a complete tag (one with a manifest): ``tag``, or the one `latest` names; else an error that
    says what the folder holds."""
    ckpt_dir = os.fspath(ckpt_dir)
    if os.path.exists(os.path.join(ckpt_dir, MANIFEST)):  # a tag folder itself
        return ckpt_dir
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} is not a folder: pass the save_dir given to save_checkpoint (or a tag's "
                              "folder in it)")  # fmt: skip
    complete = tags(ckpt_dir)
    if not complete:
        unfinished = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".tmp")
                            and os.path.isdir(os.path.join(ckpt_dir, n)))  # fmt: skip
        detail = (f"; {', '.join(unfinished)}: saves that never finished (killed, or failed), nothing in them loads"
                  if unfinished else "")  # fmt: skip
        raise CheckpointError(f"{ckpt_dir} holds no complete checkpoint (no tag folder with a {MANIFEST}){detail}")
    resolved = resolve_tag(ckpt_dir, tag)
    if resolved is None:
        raise CheckpointError(f"{ckpt_dir} has no `{LATEST}` file; pass --tag (complete tags: {', '.join(complete)})")
    folder = os.path.join(ckpt_dir, resolved)
    if not os.path.exists(os.path.join(folder, MANIFEST)):
        named = f"tag {resolved!r}" + (f" (named by `{LATEST}`)" if tag is None else "")
        why = "its save never finished" if os.path.isdir(folder) else "no such folder"
        raise CheckpointError(f"{ckpt_dir}: {named} is not a complete checkpoint ({why}); complete tags: "
                              f"{', '.join(complete)}")  # fmt: skip
    return folder


def tags(ckpt_dir: str) -> list[str]:
    """The complete tags in a folder (those with a manifest)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(n for n in os.listdir(ckpt_dir) if os.path.exists(os.path.join(ckpt_dir, n, MANIFEST)))


def _output_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def frozen_names(manifest: Manifest) -> set[str]:
    """Parameters the saved run's optimizer did not update (in none of its param groups)."""
    optimized = {name for group in manifest.groups for name in group.params}
    return {key.removeprefix(PARAMS) for key in manifest.arrays
            if key.startswith(PARAMS) and key.removeprefix(PARAMS) not in optimized}  # fmt: skip


def state_arrays(folder: str, manifest: Manifest, *, exclude_frozen_parameters: bool = False) -> list[tuple]:
    """(key, name, meta) of the parameters and buffers a state dict holds, in the checkpoint's order."""
    frozen = frozen_names(manifest) if exclude_frozen_parameters else set()
    found = []
    for key in manifest.arrays:
        name = key.split("/", 1)[1]
        if key.startswith(BUFFERS) or (key.startswith(PARAMS) and name not in frozen):
            found.append((key, name, read_array_meta(folder, key)))
    return found


def read_whole(folder: str, key: str, meta, *, step_bytes: int = 8 << 20) -> torch.Tensor:
    """One array as a tensor of its shape (floating point as fp32), read chunk by chunk."""
    out = torch.empty(meta.numel, dtype=_output_dtype(meta.dtype))
    step = max(1, step_bytes // meta.dtype.itemsize)
    for first in range(0, meta.numel, step):
        end = min(first + step, meta.numel)
        out[first:end].copy_(read_range(folder, key, meta, first, end))
    return out.view(meta.shape)


def to_fp32(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tag: str | None = None,
            max_shard_size: str | int = "5GB", step_bytes: int = 8 << 20,
            exclude_frozen_parameters: bool = False) -> list[str]:  # fmt: skip
    """Writes the checkpoint's parameters (fp32) and buffers as safetensors shards + index into ``out_dir``;
    returns the files written. Tied parameters appear once, under their first name (as transformers saves them);
    the index's metadata lists the aliases. ``exclude_frozen_parameters``: without the parameters the saved
    run did not train (a LoRA fine-tune's base)."""
    folder = tag_folder(ckpt_dir, tag)
    manifest = Manifest.read(folder)
    limit = parse_size(max_shard_size)
    arrays = state_arrays(folder, manifest, exclude_frozen_parameters=exclude_frozen_parameters)
    entries = [(key, Entry(name, meta.shape, _output_dtype(meta.dtype)), meta) for key, name, meta in arrays]
    shards: list[list] = [[]]
    size = 0
    for item in entries:
        if shards[-1] and size + item[1].nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[1].nbytes
    os.makedirs(out_dir, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]  # fmt: skip
    weight_map: dict[str, str] = {}
    written = []
    for name, shard in zip(names, shards, strict=True):
        path = os.path.join(out_dir, name)
        with SafetensorsWriter(path, [entry for _, entry, _ in shard]) as writer:
            for key, entry, meta in shard:
                step = max(1, step_bytes // meta.dtype.itemsize)
                for first in range(0, meta.numel, step):
                    writer.write(entry.name, read_range(folder, key, meta, first, min(first + step, meta.numel)),
                                 first)  # fmt: skip
                weight_map[entry.name] = name
        written.append(path)
    index = {"metadata": {"total_size": sum(e.nbytes for _, e, _ in entries), "aliases": manifest.aliases,
                          "global_steps": manifest.global_steps}, "weight_map": weight_map}  # fmt: skip
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    written.append(os.path.join(out_dir, INDEX))
    config = model_config(folder)
    if config is not None:
        written.append(shutil.copyfile(config, os.path.join(out_dir, MODEL_CONFIG)))
    return written


def model_config(folder: str) -> str | None:
    """The model's config.json for a tag folder: in it, or in the save folder that holds it."""
    for candidate in (folder, os.path.dirname(os.path.abspath(folder))):
        path = os.path.join(candidate, MODEL_CONFIG)
        if os.path.isfile(path):
            return path
    return None


def describe(ckpt_dir: str | os.PathLike, tag: str | None = None, *, every_array: bool = False) -> str:
    """What `infinity ckpt info` prints (``every_array``: each array's shape, dtype and size, not the 5 largest)."""
    ckpt_dir = os.fspath(ckpt_dir)
    folder = tag_folder(ckpt_dir, tag)
    manifest = Manifest.read(folder)
    lines = []
    parent = os.path.dirname(folder.rstrip("/"))
    latest = resolve_tag(parent, None) if os.path.exists(os.path.join(parent, LATEST)) else None
    lines.append(f"tags in {parent}: {', '.join(tags(parent)) or 'none'} (latest: {latest or 'none'})")
    lines.append(f"tag {os.path.basename(folder.rstrip('/'))}: step {manifest.global_steps} "
                 f"({manifest.skipped_steps} skipped), saved at world size {manifest.world_size}, ZeRO stage "
                 f"{manifest.stage}, {manifest.compute_dtype}, optimizer offload {manifest.offload_optimizer}, "
                 f"parameter offload {manifest.offload_param}, infinity {manifest.library_version}")  # fmt: skip
    total = 0
    kinds: dict[str, list[int]] = {}
    sizes = []
    for key, entry in manifest.arrays.items():
        numel = math.prod(entry["shape"])
        nbytes = numel * torch.empty((), dtype=getattr(torch, entry["dtype"])).element_size()
        total += nbytes
        kind = key.rsplit("/", 1)[0] if key.startswith("optimizer/") else key.split("/", 1)[0]
        counts = kinds.setdefault(kind, [0, 0, 0])
        counts[0] += 1
        counts[1] += numel
        counts[2] += nbytes
        sizes.append((nbytes, key, entry["shape"], entry["dtype"]))
    lines.append(f"{len(manifest.arrays)} arrays, {total / 1e9:.3f} GB:")
    for kind, (count, numel, nbytes) in kinds.items():
        lines.append(f"  {kind:<28} {count:>6} arrays {numel:>15,} elements {nbytes / 1e9:>9.3f} GB")
    lines.append("arrays:" if every_array else "largest arrays (--arrays lists them all):")
    for nbytes, key, shape, dtype in sorted(sizes, reverse=True)[: None if every_array else 5]:
        lines.append(f"  {key:<60} {shape} {dtype} {nbytes / 1e6:.1f} MB")
    for g, group in enumerate(manifest.groups):
        hyper = {k: v for k, v in group.hyperparameters.items() if k in ("lr", "betas", "eps", "weight_decay")}
        lines.append(f"param group {g}: {len(group.params)} parameters, {group.step} steps, {hyper}")
    if manifest.aliases:
        lines.append(f"tied: {manifest.aliases}")
    return "\n".join(lines)

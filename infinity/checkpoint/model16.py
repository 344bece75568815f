"""engine.save_16bit_model: the model's weights in the compute dtype, for inference or `from_pretrained`.

Safetensors by default, written by rank 0 as the weights come: below stage 3 every rank has them whole; at stage 3
they are gathered one unit at a time (every rank takes part; rank 0 writes the unit's tensors into their places
in the file, whose header was written first), so no rank ever holds more than one unit beyond its shard. A tied
weight is stored once, under its first name (transformers re-ties it on load). A file name ending in .bin or .pt
gives DeepSpeed's torch.save file instead (the whole state dict on rank 0). A model with a transformers ``config``
gets its config.json beside the weights, so the folder loads with ``from_pretrained``.
"""

from __future__ import annotations

import os

import torch

from infinity.checkpoint.safetensors_io import Entry, SafetensorsWriter
from infinity.checkpoint.state_map import parameter_names, persistent_buffers


def save_16bit(engine, save_dir: str | os.PathLike, save_filename: str, *,
               exclude_frozen_parameters: bool = False) -> None:  # fmt: skip
    """``exclude_frozen_parameters``: only the parameters the optimizer updates (a LoRA fine-tune's adapters), and
    the buffers; at stage 3 a unit of frozen parameters alone is not even gathered."""
    module = engine.module
    optimized = {id(p) for group in engine.zero_optimizer.groups for p in group} if engine.zero_optimizer else None
    skipped = set() if not exclude_frozen_parameters or optimized is None else {
        id(p) for p in module.parameters() if id(p) not in optimized}  # fmt: skip
    rank0 = engine.comm.rank == 0
    names, _ = parameter_names(module)
    buffers = persistent_buffers(module)
    shapes = _logical_shapes(engine)
    legacy = save_filename.endswith((".bin", ".pt"))
    entries = []  # in state-dict order
    params = dict(module.named_parameters(remove_duplicate=False))
    for key in module.state_dict(keep_vars=True):
        if key in params:
            param = params[key]
            if id(param) in skipped:
                continue
            if names[id(param)] == key or legacy:  # a tied weight's other names: only in torch.save's dict
                dtype = engine.compute_dtype if engine.stage3 is not None else param.dtype
                entries.append(Entry(key, tuple(shapes.get(id(param), param.shape)), dtype))
        elif key in buffers:
            entries.append(Entry(key, tuple(buffers[key].shape), buffers[key].dtype))
    path = os.path.join(os.fspath(save_dir), save_filename)
    state: dict[str, torch.Tensor] = {}
    writer = None
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
        if not legacy:
            writer = SafetensorsWriter(path + ".tmp", entries)

    def take(name: str, value: torch.Tensor) -> None:
        if not rank0:
            return
        if writer is not None:
            writer.write(name, value)
        else:
            state[name] = value.detach().to("cpu", copy=True)

    try:
        if engine.stage3 is None:
            for param in module.parameters():
                if id(param) not in skipped:
                    take(names[id(param)], param)
        else:
            for unit in engine.stage3.table.units:
                wanted = [param for param in unit.params if id(param) not in skipped]
                if not wanted:
                    continue  # the same on every rank: no gather to take part in
                gathered = engine.stage3.gather(unit.params)
                for param in wanted:
                    take(names[id(param)], param)
                engine.stage3.partition(gathered, modifier_rank=None)
        for name, buffer in buffers.items():
            take(name, buffer)
    finally:
        if writer is not None:
            writer.close()
    if not rank0:
        return
    if writer is not None:
        os.replace(path + ".tmp", path)
    else:
        aliases = {name: names[id(param)] for name, param in params.items()}
        torch.save({e.name: state[aliases.get(e.name, e.name)] for e in entries}, path)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(os.fspath(save_dir), "config.json"))


def _logical_shapes(engine) -> dict[int, torch.Size]:
    """Stage 3's parameters are placeholders outside a gather: their shapes come from the units."""
    if engine.stage3 is None:
        return {}
    return {id(p): shape for unit in engine.stage3.table.units for p, shape in zip(unit.params, unit.shapes,
                                                                                    strict=True)}  # fmt: skip

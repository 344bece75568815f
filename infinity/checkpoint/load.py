"""engine.load_checkpoint: each rank reads the ranges its current layout gives it, whatever layout saved them.

The manifest is read and checked first; every array a rank reads is checked against it (shape and dtype, its Zarr
metadata, each chunk file's size), and a parameter of the model that the checkpoint lacks is named before anything
changes. Then, region by region ([Note: checkpoint state map] in state_map.py): the weights (stage 3: the unit
pieces, in the compute dtype; below: every parameter whole), the fp32 masters and, unless told not to, the
optimizer states; then buffers, hyperparameters and step counts, the scheduler, the loss scaler, the counters, the
data loader's position and the RNG.
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch

from infinity.checkpoint import pickled
from infinity.checkpoint.chunk_io import ChunkIO
from infinity.checkpoint.chunks import agree_ok
from infinity.checkpoint.manifest import LATEST, MANIFEST, Manifest
from infinity.checkpoint.save import ENGINE_STATE, agree, check_tag, rng_path
from infinity.checkpoint.state_map import BUFFERS, PARAMS, Block, Region, StateMap, overlaps, state_key
from infinity.checkpoint.zarr_store import ArrayMeta, check_chunk_file, chunk_spans, read_array_meta
from infinity.errors import CheckpointError

logger = logging.getLogger("infinity")


class ArrayReader:
    """Reads flat ranges of the checkpoint's arrays, each checked against the manifest on first use, through
    the I/O engine (chunk_io.py): ``read_into`` issues, ``drain`` waits."""

    def __init__(self, folder: str, manifest: Manifest, io: ChunkIO) -> None:
        self.folder = folder
        self.manifest = manifest
        self.io = io
        self._metas: dict[str, ArrayMeta] = {}
        self._checked: set[tuple[str, int]] = set()

    def meta(self, key: str) -> ArrayMeta:
        meta = self._metas.get(key)
        if meta is not None:
            return meta
        entry = self.manifest.arrays.get(key)
        if entry is None:
            raise CheckpointError(f"{self.folder}: the checkpoint has no array {key!r}")
        meta = read_array_meta(self.folder, key)
        stored = str(meta.dtype).removeprefix("torch.")
        if list(meta.shape) != entry["shape"] or stored != entry["dtype"]:
            raise CheckpointError(
                f"{self.folder}: array {key!r} is {list(meta.shape)} {stored} but the manifest says "
                f"{entry['shape']} {entry['dtype']}: the checkpoint is corrupt"
            )
        self._metas[key] = meta
        return meta

    def read_into(self, key: str, start: int, target: torch.Tensor) -> None:
        """target (flat, contiguous, any dtype) <- elements [start, start + numel) of ``key``, once drained."""
        meta = self.meta(key)
        direct = target.dtype == meta.dtype and target.device.type == "cpu" and target.is_contiguous()
        out = target if direct else torch.empty(target.numel(), dtype=meta.dtype)
        size = meta.dtype.itemsize
        spans = list(chunk_spans(meta, start, start + target.numel()))
        for number, (index, lo, hi, c0) in enumerate(spans):
            path = check_chunk_file(self.folder, key, meta, index)
            last = number == len(spans) - 1
            then = (lambda: target.copy_(out)) if last and not direct else None
            self.io.read(path, out[lo - start : hi - start], (lo - c0) * size, then)

    def drain(self) -> None:
        self.io.drain()

    def check(self, key: str, start: int, numel: int) -> None:
        """The chunk files a read of [start, start + numel) needs exist, whole (before anything is loaded)."""
        meta = self.meta(key)
        for index, *_ in chunk_spans(meta, start, start + numel):
            if (key, index) not in self._checked:
                check_chunk_file(self.folder, key, meta, index)
                self._checked.add((key, index))

    def whole(self, key: str) -> torch.Tensor:
        meta = self.meta(key)
        out = torch.empty(meta.shape, dtype=meta.dtype)
        self.read_into(key, 0, out.view(-1))
        self.drain()
        return out


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    if tag is not None:
        return check_tag(tag)
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return check_tag(f.read().strip())


def _tag_folder(load_dir: str, tag: str) -> str:
    folder = os.path.join(load_dir, tag)
    if os.path.isdir(folder):
        return folder
    # A save of the same tag killed between moving the old folder aside and renaming the new one in (only where
    # the kernel cannot swap them: durable.publish_folder): the old one is complete.
    aside = sorted(n for n in os.listdir(load_dir) if n.startswith(f"{tag}.old-")) if os.path.isdir(load_dir) else []
    for name in aside:
        if os.path.exists(os.path.join(load_dir, name, MANIFEST)):
            logger.warning("load_checkpoint: %s is missing; loading %s, the same tag's previous save", folder, name)
            return os.path.join(load_dir, name)
    tags = sorted(n for n in os.listdir(load_dir) if os.path.exists(os.path.join(load_dir, n, MANIFEST))) if (
        os.path.isdir(load_dir)) else []  # fmt: skip
    raise CheckpointError(f"checkpoint {folder} does not exist; complete tags in {load_dir}: {tags or 'none'}")


def load_engine(engine, load_dir, tag, *, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                load_module_only: bool, weights_only: bool = True):  # fmt: skip
    """Returns (path of the tag loaded, client_state), or (None, None) when there is no ``latest`` (DeepSpeed's
    answer for a folder with nothing to resume)."""
    comm = engine.comm
    load_dir = os.path.abspath(os.fspath(load_dir))
    tag = agree(comm, resolve_tag(load_dir, tag), "tags (or `latest` files)")
    if tag is None:
        logger.warning("load_checkpoint: %s has no `latest` file and no tag was given; nothing loaded",
                       os.path.join(load_dir, LATEST))  # fmt: skip
        return None, None
    folder = _tag_folder(load_dir, tag)
    manifest = Manifest.read(folder)
    return _load(engine, folder, manifest, comm, load_optimizer_states=load_optimizer_states,
                 load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                 weights_only=weights_only)  # fmt: skip


def _load(engine, folder: str, manifest: Manifest, comm, *, load_optimizer_states: bool,
          load_lr_scheduler_states: bool, load_module_only: bool, weights_only: bool):  # fmt: skip
    with_states = load_optimizer_states and not load_module_only
    io = None
    error = None
    try:  # every check first, on every rank: nothing has changed when one fails
        io = ChunkIO(engine.config.aio, max_in_flight_bytes=engine.plan.checkpoint_io_bytes)
        reader = ArrayReader(folder, manifest, io)
        state_map = StateMap(module=engine.module, optimizer=engine.zero_optimizer, world_size=comm.world_size,
                             rank=comm.rank, steps_taken=engine.global_steps - engine.skipped_steps)  # fmt: skip
        excluded = set(manifest.extra.get("frozen_excluded", ()))
        if excluded:  # saved with exclude_frozen_parameters: this run keeps its own values of those
            state_map.exclude_frozen(only=excluded)
        if with_states:
            _check_states(engine, state_map, manifest, folder)
        keys = _key_map(state_map, manifest, reader, with_states)
        for key, start, numel in _planned_reads(engine, state_map, keys, with_states):
            reader.check(key, start, numel)
        saved_state = None if load_module_only else _read_engine_state(folder, weights_only=weights_only)
        saved_rng = None if load_module_only else _read_rng(folder, comm.rank, weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it (agree_ok)
        error = e
    try:
        agree_ok(comm, error, "load_checkpoint")
        client_state: dict = {}
        try:
            _load_arrays(engine, state_map, reader, keys, with_states)
            if with_states:
                _load_hyperparameters(engine, state_map, manifest)
            if saved_state is not None:
                client_state = _apply_engine_state(engine, saved_state, load_lr_scheduler_states)
                _apply_rng(saved_rng)
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        agree_ok(comm, error, "load_checkpoint")
    finally:
        if io is not None:
            io.close()
    if engine.stage3 is not None:
        engine.zero_optimizer._regather_persistent()
    return folder, client_state


def _planned_reads(engine, state_map: StateMap, keys: dict[str, str], with_states: bool):
    """(key, first element, count) of every read the load will make on this rank."""
    if engine.stage3 is None:
        for name, param in _whole_parameters(engine, state_map):
            yield keys[PARAMS + name], 0, param.numel()
    for region in state_map.regions:
        for fragment in [*region.optimized, *region.others]:
            yield keys[PARAMS + fragment.name], fragment.param_start, fragment.numel
        if with_states:
            for fragment in region.optimized:
                for state in state_map.state_names:
                    key = keys.get(state_key(state, fragment.name))
                    if key is not None:
                        yield key, fragment.param_start, fragment.numel
    for name in state_map.buffers:
        yield keys[BUFFERS + name], 0, state_map.specs[BUFFERS + name].meta.numel


def _key_map(state_map: StateMap, manifest: Manifest, reader: ArrayReader, with_states: bool) -> dict[str, str]:
    """Current array key -> the key it was saved under (tied weights are saved under their first name); checks
    that the checkpoint has every array this rank needs, with the model's shapes, before anything changes."""
    saved = {key[len(PARAMS) :] for key in manifest.arrays if key.startswith(PARAMS)}
    keys: dict[str, str] = {}
    missing = []
    states = [s for s in state_map.state_names if s in manifest.state_names] if with_states else []
    for key, spec in state_map.specs.items():
        if key.startswith(BUFFERS):
            keys[key] = key
            if key not in manifest.arrays:
                missing.append(key)
            elif list(reader.meta(key).shape) != list(spec.meta.shape):
                raise CheckpointError(f"{reader.folder}: buffer {key!r} has shape {list(reader.meta(key).shape)} in "
                                      f"the checkpoint but {list(spec.meta.shape)} in the model")  # fmt: skip
            continue
        if not key.startswith(PARAMS):
            continue
        name = key[len(PARAMS) :]
        found = manifest.saved_name(name, saved)
        if found is None:
            missing.append(name)
            continue
        keys[key] = PARAMS + found
        mine_states = [s for s in states if state_key(s, name) in state_map.specs]  # only optimized parameters
        for state in mine_states:
            keys[state_key(state, name)] = state_key(state, found)
        for mine in [key, *(state_key(s, name) for s in mine_states)]:
            shape = list(reader.meta(keys[mine]).shape)
            if shape != list(spec.meta.shape):
                raise CheckpointError(f"{reader.folder}: {mine!r} has shape {shape} in the checkpoint but "
                                      f"{list(spec.meta.shape)} in the model")  # fmt: skip
    if missing:
        raise CheckpointError(
            f"{reader.folder} has no values for {len(missing)} of the model's parameters/buffers: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. Is it a checkpoint of this model?"
        )
    return keys


def _load_arrays(engine, state_map: StateMap, reader: ArrayReader, keys: dict[str, str], with_states: bool) -> None:
    if with_states:
        state_map.make_states(list(reader.manifest.state_names), [g.step for g in reader.manifest.groups])
    if engine.stage3 is None:
        for name, param in _whole_parameters(engine, state_map):
            reader.read_into(keys[PARAMS + name], 0, param.data.view(-1))
        reader.drain()
    shards = engine.stage3.table.shards if engine.stage3 is not None else None
    for region in state_map.regions:
        if shards is not None:
            piece = shards.edit(region.piece, overwrite=not region.keeps_frozen)
            for fragment in [*region.optimized, *region.others]:
                first = fragment.offset - region.start
                reader.read_into(keys[PARAMS + fragment.name], fragment.param_start,
                                 piece[first : first + fragment.numel])  # fmt: skip
            if not shards.edited_in_place():
                reader.drain()  # the piece is a ring buffer (or written out) once committed
            shards.commit(region.piece)
        # with the states, every element of a tile is loaded (master and states): nothing to read from its tier
        for block in state_map.blocks(region, dirty=True, with_states=with_states, overwrite=with_states):
            _fill_block(block, region, reader, keys)
            if block.transient:
                reader.drain()  # before the block's memory (a ring buffer) is given back
    reader.drain()
    with torch.no_grad():
        for name, buffer in state_map.buffers.items():
            buffer.copy_(reader.whole(keys[BUFFERS + name]))
    if with_states:
        groups = reader.manifest.groups
        state_map.set_group_steps([g.step for g in groups], list(reader.manifest.scalar_keys),
                                  [g.scalars for g in groups])


def _check_states(engine, state_map: StateMap, manifest: Manifest, folder: str) -> None:
    """The checkpoint's optimizer matches this one: as many param groups, every state it keeps (the user's
    optimizer gets zero states to load into when it has not stepped yet)."""
    steps = [g.step for g in manifest.groups]
    saved, mine = manifest.extra.get("optimizer"), type(engine.zero_optimizer.optimizer).__name__
    if saved is not None and saved != mine:
        raise CheckpointError(f"{folder} holds the states of a {saved} optimizer, this run's is a {mine}; pass "
                              "load_optimizer_states=False to load the weights only")  # fmt: skip
    if len(steps) != len(engine.zero_optimizer.param_groups):
        raise CheckpointError(f"{folder} has {len(steps)} optimizer param groups, the optimizer has "
                              f"{len(engine.zero_optimizer.param_groups)}; pass load_optimizer_states=False "
                              "to load the weights only")  # fmt: skip
    state_map.declare_states(list(manifest.state_names))
    absent = [s for s in state_map.state_names if s not in manifest.state_names]
    if absent and any(steps):
        raise CheckpointError(f"{folder} has no optimizer state {absent} (saved: {manifest.state_names}); was it "
                              "saved with another optimizer? Pass load_optimizer_states=False")  # fmt: skip


def _whole_parameters(engine, state_map: StateMap):
    for group in engine.zero_optimizer.groups:
        for param in group:
            yield state_map.names[id(param)], param
    yield from state_map.replicated


def _fill_block(block: Block, region: Region, reader: ArrayReader, keys: dict[str, str]) -> None:
    for fragment, lo, hi in overlaps(region.optimized, block.start, block.numel):
        start = fragment.param_start + lo - fragment.offset
        if block.master is not None:
            reader.read_into(keys[PARAMS + fragment.name], start, block.master[lo - block.start : hi - block.start])
        for name, values in block.states.items():
            key = keys.get(state_key(name, fragment.name))
            target = values[lo - block.start : hi - block.start]
            if key is None:
                target.zero_()  # a state the checkpoint has not got; only when no group had stepped
            else:
                reader.read_into(key, start, target)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _load_hyperparameters(engine, state_map: StateMap, manifest: Manifest) -> None:
    """The numbers of each param group (lr, betas, eps, weight_decay, ...), as the saved run had them; flags that
    choose an implementation (fused, foreach, capturable, ...) stay this run's."""
    for group, entry in zip(engine.zero_optimizer.param_groups, manifest.groups, strict=True):
        for key, value in entry.hyperparameters.items():
            numbers = isinstance(value, list) and value and all(_is_number(v) for v in value)
            if key in group and (_is_number(value) or numbers):
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def _read_engine_state(folder: str, *, weights_only: bool) -> dict:
    path = os.path.join(folder, ENGINE_STATE)
    try:
        return pickled.load(path, weights_only=weights_only)  # runs no code unless the user opted in
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None


def _apply_engine_state(engine, state: dict, load_lr_scheduler_states: bool) -> dict:
    engine.global_steps = state["global_steps"]
    engine.micro_steps = state["micro_steps"]
    engine.skipped_steps = state["skipped_steps"]
    engine.global_samples = state.get("global_samples", engine.global_steps * engine.config.train_batch_size)
    accumulation = engine.config.gradient_accumulation_steps
    if engine.micro_steps % accumulation:  # saved with another accumulation (another world size): a boundary here
        engine.micro_steps = engine.global_steps * accumulation
    saved_scaler = state["loss_scaler"]
    if engine.loss_scaler.dynamic and saved_scaler.get("dynamic"):
        engine.loss_scaler.load_state_dict(saved_scaler)  # both fp16 with dynamic scaling: continue its schedule
    elif saved_scaler.get("scale", 1.0) != engine.loss_scaler.scale:
        logger.info("load_checkpoint: the loss scale comes from this run's config (%g), not the checkpoint (%g)",
                    engine.loss_scaler.scale, saved_scaler.get("scale", 1.0))  # fmt: skip
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    loader = engine.training_dataloader
    if state["data_loader"] is not None and hasattr(loader, "resume"):
        loader.resume(state["data_loader"])
    return state["client_state"]


def _read_rng(folder: str, rank: int, *, weights_only: bool) -> dict | None:
    path = rng_path(folder, rank)
    if not os.path.exists(path):
        logger.warning("load_checkpoint: no RNG state for rank %d in %s (saved at another world size, or "
                       "converted from DeepSpeed, which keeps none); this rank's RNG is left as it is",
                       rank, folder)  # fmt: skip
        return None
    return pickled.load(path, weights_only=weights_only, numpy_arrays=True)  # earlier releases: numpy arrays


def _apply_rng(state: dict | None) -> None:
    if state is None:
        return
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict) and "keys" in numpy_state:  # MT19937 as save.rng_state writes it
        numpy_state = (numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])  # fmt: skip
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

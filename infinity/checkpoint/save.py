"""engine.save_checkpoint: every rank writes the chunks it owns, in parallel, into a folder that appears whole.

[Note: crash-safe save]
A save writes ``<save_dir>/<tag>.tmp`` (removed first if an earlier save died there): rank 0 the Zarr metadata,
every rank its chunks ([Note: chunk ownership] in chunks.py) and its RNG state, rank 0 the engine's state. Each
rank makes its files durable (syncfs), the ranks meet, rank 0 writes the manifest (fsynced), renames the folder to
``<save_dir>/<tag>`` and then replaces ``latest`` atomically (a temporary file, fsynced, renamed). A process killed
at any point leaves the previous tags and ``latest`` as they were: a tag folder without a manifest, or named
``.tmp``, is never loaded.

A save that fails (a full disk, a file-size limit, any rank's error: every rank raises) removes what it wrote
before raising: each rank its own files, rank 0 the ``.tmp`` folder (write_durably removes its own temporary
file). The previous tags and ``latest`` are untouched, so the last good checkpoint still loads, and the disk gets
back the space the failed save took. The error names the tag's folder, the bytes the checkpoint takes and the
bytes free in ``save_dir`` once the partial folder is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from infinity.checkpoint.chunk_io import ChunkIO
from infinity.checkpoint.chunks import ChunkWriter, agree_ok
from infinity.checkpoint.durable import free_bytes, publish_folder, sync_files, write_durably
from infinity.checkpoint.manifest import LATEST, GroupEntry, Manifest, dtype_name, json_safe
from infinity.checkpoint.pickled import check_client_state, refusal
from infinity.checkpoint.state_map import PARAMS, StateMap, overlaps, state_key
from infinity.checkpoint.zarr_store import write_array_meta, write_group
from infinity.errors import CheckpointError
from infinity.memory.nvme_store import _human

ENGINE_STATE = "engine_state.pt"
_TAG = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True, slots=True)
class SaveStats:
    seconds: float
    bytes_written: int  # this rank's chunk bytes


def rng_path(folder: str, rank: int) -> str:
    return os.path.join(folder, "rng", f"rank{rank}.pt")


def rng_state() -> dict:
    """Every generator's state as plain data and tensors, so that a weights-only load reads it (pickled.py)."""
    generator = getattr(np.random, "get_bit_generator", None)  # numpy 1.25+
    mt19937 = generator is None or isinstance(generator(), np.random.MT19937)
    numpy_state = np.random.get_state(legacy=mt19937)
    if isinstance(numpy_state, tuple):  # MT19937, numpy's default: its keys as a tensor
        kind, keys, position, has_gauss, cached = numpy_state
        numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}  # fmt: skip
    # else another bit generator (np.random.set_bit_generator): its state is a dict of numbers already
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not _TAG.match(tag) or tag in (".", "..") or tag.endswith(".tmp") or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r}: use letters, digits, '_', '-' and '.' (not 'latest', not "
                              "ending in '.tmp')")  # fmt: skip
    return tag


def agree(comm, value, what: str):
    """Every rank passed the same ``value`` (a tag, a folder), or a CheckpointError on every rank."""
    if not comm.active:
        return value
    values: list = [None] * comm.world_size
    dist.all_gather_object(values, value, group=comm.group)
    if any(v != values[0] for v in values):
        raise CheckpointError(f"ranks passed different {what}: {values}; pass the same on every rank")
    return value


def save_engine(engine, save_dir: str | os.PathLike, tag: str | None, client_state: dict | None,
                save_latest: bool = True, exclude_frozen_parameters: bool = False) -> SaveStats:  # fmt: skip
    started = time.perf_counter()
    comm = engine.comm
    save_dir = os.path.abspath(os.fspath(save_dir))
    tag = agree(comm, check_tag(tag if tag is not None else f"global_step{engine.global_steps}"), "tags")
    agree(comm, save_dir, "save_dir folders")
    final = os.path.join(save_dir, tag)
    tmp = final + ".tmp"
    state_map = StateMap(module=engine.module, optimizer=engine.zero_optimizer, world_size=comm.world_size,
                         rank=comm.rank, steps_taken=engine.global_steps - engine.skipped_steps)  # fmt: skip
    if exclude_frozen_parameters:
        state_map.exclude_frozen()
    error, engine_state = None, None
    try:  # before anything is written: a client_state a weights-only load could not read is refused by key
        if comm.rank == 0:
            engine_state = _loadable(_engine_state(engine, client_state))
    except Exception as e:  # noqa: BLE001 - every rank must learn of it (agree_ok)
        error = e
    agree_ok(comm, error, "save_checkpoint")
    mine: list[str] = []  # the files this rank writes into tmp, for the cleanup after a failure
    try:
        bytes_written = _save(engine, state_map, save_dir, tag, tmp, engine_state, save_latest, mine)
    except BaseException as error:
        _discard(comm, save_dir, tmp, mine)
        if not isinstance(error, Exception):
            raise  # Ctrl-C and the like: as they were, the partial folder gone
        raise _failed(error, save_dir, final, state_map) from error
    return SaveStats(time.perf_counter() - started, bytes_written)


def _save(engine, state_map: StateMap, save_dir: str, tag: str, tmp: str, engine_state: dict | None,
          save_latest: bool, mine: list[str]) -> int:  # fmt: skip
    """The save's three phases, each ended by every rank agreeing it went well ([Note: crash-safe save]); the
    bytes of this rank's chunks. ``engine_state``: rank 0's, checked (``_loadable``)."""
    comm = engine.comm
    final = os.path.join(save_dir, tag)
    error = None
    try:
        if comm.rank == 0:
            _create(tmp, save_dir, state_map)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it (agree_ok)
        error = e
    agree_ok(comm, error, "save_checkpoint")
    writer = None
    try:
        io = ChunkIO(engine.config.aio, max_in_flight_bytes=engine.plan.checkpoint_io_bytes)
        try:
            writer = ChunkWriter(tmp, state_map.specs, comm, io, written=mine)
            _write_arrays(engine, state_map, writer)
            writer.finish()
        finally:
            io.close()
        os.makedirs(os.path.dirname(rng_path(tmp, comm.rank)), exist_ok=True)
        mine.append(rng_path(tmp, comm.rank))
        torch.save(rng_state(), rng_path(tmp, comm.rank))
        if comm.rank == 0:
            mine.append(os.path.join(tmp, ENGINE_STATE))
            torch.save(engine_state, os.path.join(tmp, ENGINE_STATE))
        sync_files(tmp, mine)
        error = None
    except Exception as e:  # noqa: BLE001
        error = e
    agree_ok(comm, error, "save_checkpoint")  # every rank's part is on disk
    try:
        if comm.rank == 0:
            _manifest(engine, state_map).write(tmp)
            publish_folder(tmp, final)
            if save_latest:
                write_durably(os.path.join(save_dir, LATEST), tag)
        error = None
    except Exception as e:  # noqa: BLE001
        error = e
    agree_ok(comm, error, "save_checkpoint")
    return writer.bytes_written


def _discard(comm, save_dir: str, tmp: str, mine: list[str]) -> None:
    """After a failed save: this rank's files go (on a disk of its own, nobody else sees them), and rank 0 removes
    the tag's temporary folder. Best effort: the error being raised is the news."""
    for path in mine:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _failed(error: Exception, save_dir: str, final: str, state_map: StateMap) -> CheckpointError:
    """The error every rank raises for a failed save: what failed, what was cleaned up, what still loads, and the
    room the checkpoint needs."""
    needed = sum(spec.meta.numel * spec.meta.dtype.itemsize for spec in state_map.specs.values())
    try:
        free = f"{_human(free_bytes(save_dir))} free there now"
    except OSError:
        free = "free space unknown"
    latest = os.path.join(save_dir, LATEST)
    try:
        with open(latest) as f:
            kept = f"`latest` still names {f.read().strip()!r}, which loads as before"
    except OSError:
        kept = "no earlier checkpoint in that folder (no `latest`)"
    failed = CheckpointError(
        f"save_checkpoint of {final} failed: {error}. Its partial folder {final}.tmp was removed; {kept}. The "
        f"checkpoint takes about {_human(needed)} ({needed} bytes) in {save_dir}, {free}: free space there or "
        "save to another folder"
    )
    failed.announced = True  # every rank raises it: nobody waits for another in a collective any more
    return failed


def _create(tmp: str, save_dir: str, state_map: StateMap) -> None:
    """Rank 0: the temporary tag folder with the Zarr groups and every array's metadata."""
    os.makedirs(save_dir, exist_ok=True)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)  # an earlier save of this tag died part way
    write_group(tmp)
    for prefix in {key.rsplit("/", 1)[0] for key in state_map.specs}:
        parts = prefix.split("/")
        for depth in range(1, len(parts) + 1):
            write_group(tmp, "/".join(parts[:depth]))
    for key, spec in state_map.specs.items():
        write_array_meta(tmp, key, spec.meta)


def _write_arrays(engine, state_map: StateMap, writer: ChunkWriter) -> None:
    """Region by region, the values this rank holds, then the parameters and buffers every rank holds whole."""
    partitioned = any(spec.owners is not None for spec in state_map.specs.values())
    shards = engine.stage3.table.shards if engine.stage3 is not None else None
    for region in state_map.regions:
        try:
            _write_region(engine, state_map, writer, region, shards)
        except Exception as e:
            if partitioned:
                writer.exchange(error=e)  # the others wait in this exchange: they raise too
            raise
        if partitioned:
            writer.exchange()
    for name, param in state_map.replicated:
        writer.put(PARAMS + name, 0, param.detach())
    for name, buffer in state_map.buffers.items():
        writer.put("buffers/" + name, 0, buffer.detach())


def _write_region(engine, state_map: StateMap, writer: ChunkWriter, region, shards) -> None:
    piece = None
    if shards is not None and (region.others or engine.zero_optimizer.tiled.masters is not None):
        # parameters outside the optimizer; fp32 weights that are masters: the piece itself when in memory
        piece = shards.on_device(region.piece)
        if piece is None:
            piece = shards.read(region.piece)
    for fragment in region.others:
        first = fragment.offset - region.start
        writer.put(PARAMS + fragment.name, fragment.param_start, piece[first : first + fragment.numel])
    for block in state_map.blocks(region, dirty=False):
        for fragment, lo, hi in overlaps(region.optimized, block.start, block.numel):
            start = fragment.param_start + lo - fragment.offset
            if block.master is not None:
                master = block.master[lo - block.start : hi - block.start]
            else:
                master = piece[lo - region.start : hi - region.start]
            writer.put(PARAMS + fragment.name, start, master)
            for name, values in block.states.items():
                writer.put(state_key(name, fragment.name), start, values[lo - block.start : hi - block.start])
        if block.transient:
            writer.drain()  # the block's memory (a ring buffer) is given back next
    # Memory that stays (the shards, tiles in memory, a piece read here, partial chunks) is kept alive by the
    # writes in flight: no wait here, so ranks do not wait for each other's disk at every region


def _engine_state(engine, client_state: dict | None) -> dict:
    loader = engine.training_dataloader
    return {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "global_samples": engine.global_samples,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict(),
        "data_loader": loader.position() if hasattr(loader, "position") else None,
        "client_state": client_state or {},
    }


def _loadable(state: dict) -> dict:
    """The engine state, checked to be readable by a weights-only load (checkpoint/pickled.py): the user's
    client_state by key, the rest (the LR scheduler's state_dict, the loader's position) by name."""
    check_client_state(state["client_state"])
    for key, value in state.items():
        why = None if key == "client_state" else refusal(value)
        if why is not None:
            raise CheckpointError(f"save_checkpoint: the engine state's {key!r} holds an object that loading would "
                                  f"have to run code to build ({why}); a scheduler or loader whose state_dict() "
                                  "returns only tensors, numbers and strings saves")  # fmt: skip
    return state


def _manifest(engine, state_map: StateMap) -> Manifest:
    from infinity import __version__

    zero = engine.config.zero
    arrays = {}
    for key, spec in state_map.specs.items():
        arrays[key] = {"shape": list(spec.meta.shape), "dtype": dtype_name(spec.meta.dtype)}
    for name, dtype in [*((n, p.dtype) for n, p in state_map.replicated), *_stage3_others(engine, state_map)]:
        if PARAMS + name in arrays:  # else left out (exclude_frozen_parameters)
            arrays[PARAMS + name]["torch_dtype"] = dtype_name(dtype)
    for name, buffer in state_map.buffers.items():
        arrays["buffers/" + name]["torch_dtype"] = dtype_name(buffer.dtype)
    steps = state_map.group_steps()
    scalars = state_map.group_scalars()
    groups = []
    for g, group in enumerate(engine.zero_optimizer.param_groups):
        hyper = {k: json_safe(v) for k, v in group.items() if k != "params"}
        groups.append(GroupEntry(state_map.group_names[g], hyper, steps[g], scalars[g]))
    return Manifest(
        world_size=engine.comm.world_size, stage=zero.stage, compute_dtype=dtype_name(engine.compute_dtype),
        offload_optimizer=zero.offload_optimizer.device, offload_param=zero.offload_param.device,
        global_steps=engine.global_steps, micro_steps=engine.micro_steps, skipped_steps=engine.skipped_steps,
        arrays=arrays, aliases=state_map.aliases, groups=groups, state_names=list(state_map.state_names),
        scalar_keys=state_map.scalar_keys(), config=json_safe_config(engine.raw_config),
        library_version=__version__, extra={"optimizer": type(engine.zero_optimizer.optimizer).__name__,
                                            "frozen_excluded": state_map.frozen_excluded},
    )  # fmt: skip


def _stage3_others(engine, state_map: StateMap):
    """(name, dtype) of stage 3's parameters outside the optimizer: they are kept in the compute dtype."""
    if engine.stage3 is None:
        return []
    optimized = {id(p) for group in engine.zero_optimizer.groups for p in group}
    return [(state_map.names[id(p)], engine.compute_dtype) for unit in engine.stage3.table.units
            for p in unit.params if id(p) not in optimized]  # fmt: skip


def json_safe_config(config) -> dict:
    """The config as given, with anything JSON cannot hold written as its str()."""
    return json.loads(json.dumps(config, default=str))

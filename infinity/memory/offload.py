"""From the offload_optimizer config to a tier manager and tile size: the policy of how big and where.

Tile size ([Note: tiles] in zero/tiles.py). Host-memory homes: ``sub_group_size`` elements (DeepSpeed's knob),
tiles only split the work. NVMe homes: the ring holds ``buffer_count`` tiles of [master | states] in host memory,
so a tile is at most ``sub_group_size`` elements and at most what keeps the ring within STAGING_BUDGET_BYTES
(and a quarter of the host memory available now). DeepSpeed sizes its buffers from sub_group_size alone
(default 1e9 elements): on a 124M model its ring takes gigabytes. Here the default never does: a tile of
~5.6M elements (Adam: 64 MiB) is still 64 requests of the default 1 MiB aio block, enough to keep the queue full.

Parameters on NVMe: offload_param.max_in_cpu elements of the rank's pieces stay in host memory ([Note: unit shards]
in zero/shards.py), at most what a quarter of the host memory available now holds, so the default (1e9 elements,
DeepSpeed's) never exhausts RAM.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from infinity.aio.buffers import available_host_bytes
from infinity.aio.handle import AioHandle, AioSettings
from infinity.config import ZeroConfig
from infinity.memory.nvme_store import NvmeStore, default_run_id
from infinity.memory.tiers import Tier, TierManager
from infinity.zero.collectives import Comm
from infinity.zero.partition import GroupLayout
from infinity.zero.shards import UnitShards

logger = logging.getLogger("infinity")

STAGING_BUDGET_BYTES = 256 << 20
MIN_TILE_NUMEL = 1 << 20


def agree_run_id(comm: Comm) -> str:
    """One run id for every rank (rank 0's): it names the run's swap folder."""
    ids = [default_run_id() if comm.rank == 0 else None]
    if comm.active:
        dist.broadcast_object_list(ids, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    return ids[0]


def tile_numel(zero: ZeroConfig, *, state_width: int, nvme: bool) -> int:
    """Elements per tile; ``state_width``: fp32 tensors per element in host buffers (master + optimizer states,
    + the gradient when it is on NVMe too: its ring is as deep)."""
    if not nvme:
        return zero.sub_group_size
    count = max(zero.offload_optimizer.buffer_count, 3)  # the ring optimizer_tiers makes
    budget = min(STAGING_BUDGET_BYTES, available_host_bytes() // 4)
    cap = max(budget // (count * state_width * 4), MIN_TILE_NUMEL)
    return min(zero.sub_group_size, cap)


def host_cache_numel(zero: ZeroConfig, dtype: torch.dtype) -> int:
    """Elements of parameter pieces kept in host memory in front of NVMe: max_in_cpu, within the host budget."""
    return min(zero.offload_param.max_in_cpu, available_host_bytes() // 4 // dtype.itemsize)


def parameter_shards(zero: ZeroConfig, aio: AioSettings, comm: Comm, *, run_id: str | None, dtype: torch.dtype,
                     device: torch.device):  # fmt: skip
    """make_shards for build_units: the home offload_param gives the rank's parameter shard ([Note: unit shards])."""
    spec = zero.offload_param

    def make(layout: GroupLayout, persistent: set[int]) -> UnitShards:
        common = {"dtype": dtype, "device": device, "persistent": persistent, "rank": comm.rank}
        if spec.device == "none":
            return UnitShards(layout, home=Tier.DEVICE, **common)
        if spec.device == "cpu":
            return UnitShards(layout, home=Tier.HOST, manager=TierManager(pin_memory=spec.pin_memory), **common)
        handle = AioHandle.from_settings(aio)
        store = NvmeStore(spec.nvme_path, handle=handle, rank=comm.rank, run_id=f"{run_id}-params")
        manager = TierManager(store=store, handle=handle, buffer_count=max(spec.buffer_count, 1),
                              pin_memory=spec.pin_memory, owner="offload_param")  # fmt: skip
        return UnitShards(layout, home=Tier.NVME, manager=manager, max_piece_numel=spec.buffer_size,
                          host_numel=host_cache_numel(zero, dtype), **common)  # fmt: skip

    return make


def gradient_tier(zero: ZeroConfig, aio: AioSettings, comm: Comm, *, run_id: str | None) -> TierManager | None:
    """Stage 3 with the optimizer on NVMe: the gradient's tier ([Note: swapped gradients] in zero/grads.py), a
    ring as deep as the optimizer's (a tile's gradient is read ahead with its states)."""
    spec = zero.offload_optimizer
    if zero.stage != 3 or spec.device != "nvme":
        return None
    handle = AioHandle.from_settings(aio)
    store = NvmeStore(spec.nvme_path, handle=handle, rank=comm.rank, run_id=f"{run_id}-gradients")
    return TierManager(store=store, handle=handle, buffer_count=max(spec.buffer_count, 3), pin_memory=spec.pin_memory)


def optimizer_tiers(zero: ZeroConfig, aio: AioSettings, comm: Comm, *, run_id: str | None) -> tuple[TierManager, Tier]:
    """The tier manager for offload_optimizer: host homes (device cpu) or the rank's swap store (nvme)."""
    spec = zero.offload_optimizer
    if spec.device != "nvme":
        return TierManager(pin_memory=spec.pin_memory), Tier.HOST
    handle = AioHandle.from_settings(aio)
    store = NvmeStore(spec.nvme_path, handle=handle, rank=comm.rank, run_id=f"{run_id}-optimizer")
    count = max(spec.buffer_count, 3)  # one tile stepping, one reading ahead, one writing behind
    if count != spec.buffer_count and comm.rank == 0:
        logger.info("offload_optimizer.buffer_count %d raised to 3 (reading, stepping, writing)", spec.buffer_count)
    return TierManager(store=store, handle=handle, buffer_count=count, pin_memory=spec.pin_memory), Tier.NVME

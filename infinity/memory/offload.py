"""From the offload sections to tier managers: the swap store of each kind (parameters, optimizer, gradients) and
its staging ring, and the run id that names their folders.

Every size here (ring depth, tile size, the host caches) is the plan's (memory/plan.py, [Note: one plan]), decided
once for every rank; this module decides none. It sits below zero/: the process group is only used (``comm`` is
anything with ``rank``, ``active`` and ``group``), and what a tier holds is its owners' business.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

from infinity.aio.handle import AioHandle, AioSettings
from infinity.config import ZeroConfig
from infinity.memory.nvme_store import NvmeStore, default_run_id
from infinity.memory.plan import Plan
from infinity.memory.tiers import Tier, TierManager

if TYPE_CHECKING:
    from infinity.comm import Comm

logger = logging.getLogger("infinity")


def agree_run_id(comm: Comm) -> str:
    """One run id for every rank (rank 0's): it names the run's swap folder."""
    ids = [default_run_id() if comm.rank == 0 else None]
    if comm.active:
        dist.broadcast_object_list(ids, src=dist.get_global_rank(comm.group, 0), group=comm.group)
    return ids[0]


def _nvme_manager(path: str, aio: AioSettings, *, rank: int, run_id: str, kind: str, buffers: int, pin: bool,
                  owner: str | None = None) -> TierManager:  # fmt: skip
    """[Note: reads beside writes]
    A handle runs its requests in the order they came, so a read started after a few tiles' writes used to wait
    for all of them. Reads are what a step or a forward waits for; writes only have to land before their buffer is
    used again. So each swap store takes two handles, one for its writes and one for its reads, and a read runs
    beside the writes queued before it. The order of a segment's own read and write is the tier manager's:
    it never reads a segment whose write is still in flight (a ring buffer's newest bytes are taken back, a
    loose write is waited for), and it never writes a segment while a read of it started by ``start_read`` is
    still in flight (the write waits for that read). Measured on GPT-2 small with everything on NVMe, world
    size 1: the first units' optimizer tiles, whose reads the forward waits for behind the embedding's 463 MB of
    writes, waited 75-106 ms for a 2-20 MB read with one queue and 3-15 ms with two."""
    handle, read_handle = AioHandle.from_settings(aio), AioHandle.from_settings(aio)
    try:
        store = NvmeStore(path, handle=handle, read_handle=read_handle, rank=rank, run_id=f"{run_id}-{kind}")
    except BaseException:
        handle.close()
        read_handle.close()
        raise
    extra = {} if owner is None else {"owner": owner}
    return TierManager(store=store, handle=handle, read_handle=read_handle, buffer_count=buffers, pin_memory=pin,
                       **extra)  # fmt: skip


def parameter_tier(zero: ZeroConfig, aio: AioSettings, *, rank: int, run_id: str | None,
                   plan: Plan) -> tuple[Tier, TierManager | None]:  # fmt: skip
    """Stage 3: the home offload_param gives the rank's parameter pieces, and its manager (none on the device)."""
    spec = zero.offload_param
    if spec.device == "none":
        return Tier.DEVICE, None
    if spec.device == "cpu":
        return Tier.HOST, TierManager(pin_memory=spec.pin_memory)
    if plan.param_buffers != spec.buffer_count and rank == 0:
        logger.info("offload_param.buffer_count %d raised to %d (a piece read ahead needs a buffer)", spec.buffer_count,
                    plan.param_buffers)  # fmt: skip
    manager = _nvme_manager(spec.nvme_path, aio, rank=rank, run_id=run_id, kind="params", buffers=plan.param_buffers,
                            pin=spec.pin_memory, owner="offload_param")  # fmt: skip
    return Tier.NVME, manager


def gradient_tier(zero: ZeroConfig, aio: AioSettings, *, rank: int, run_id: str | None,
                  plan: Plan) -> TierManager | None:  # fmt: skip
    """Stage 3 with the optimizer on NVMe, where the plan put the gradient there too (it did not fit its part of
    the host share): the gradient's tier ([Note: swapped gradients] in zero/grads.py), a ring as deep as the
    optimizer's (a tile's gradient is read ahead with its states). None: the gradient stays in host memory."""
    spec = zero.offload_optimizer
    if zero.stage != 3 or spec.device != "nvme" or not plan.gradients_on_nvme:
        return None
    return _nvme_manager(spec.nvme_path, aio, rank=rank, run_id=run_id, kind="gradients",
                         buffers=plan.optimizer_buffers, pin=spec.pin_memory)  # fmt: skip


def optimizer_tiers(zero: ZeroConfig, aio: AioSettings, *, rank: int, run_id: str | None,
                    plan: Plan) -> tuple[TierManager, Tier]:  # fmt: skip
    """The tier manager for offload_optimizer: host homes (device cpu) or the rank's swap store (nvme)."""
    spec = zero.offload_optimizer
    if spec.device != "nvme":
        return TierManager(pin_memory=spec.pin_memory), Tier.HOST
    if plan.optimizer_buffers != spec.buffer_count and rank == 0:
        why = "reading, stepping, writing" if plan.optimizer_buffers <= 3 else "the largest unit's tiles and one more"
        logger.info("offload_optimizer.buffer_count %d raised to %d (%s)", spec.buffer_count, plan.optimizer_buffers,
                    why)  # fmt: skip
    manager = _nvme_manager(spec.nvme_path, aio, rank=rank, run_id=run_id, kind="optimizer",
                            buffers=plan.optimizer_buffers, pin=spec.pin_memory)  # fmt: skip
    return manager, Tier.NVME

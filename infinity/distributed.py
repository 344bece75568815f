"""Joining the data-parallel group: torchrun's environment, a group the user made, or a single process."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from infinity.zero.collectives import Comm


def init_distributed(timeout_s: float = 600.0) -> Comm:
    """Use the default process group if the user made one; else make one from torchrun's variables
    (gloo on CPU, NCCL with CUDA); else run as a single process (world size 1, no collectives)."""
    if dist.is_available() and dist.is_initialized():
        return Comm(group=dist.group.WORLD, rank=dist.get_rank(), world_size=dist.get_world_size())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        return Comm(group=dist.group.WORLD, rank=dist.get_rank(), world_size=dist.get_world_size())
    return Comm(group=None, rank=0, world_size=1)


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""DeepSpeed's module-level helpers that a training script calls before initialize(): init_distributed and
add_config_arguments, with DeepSpeed's signatures, so ``import infinity as deepspeed`` keeps such a script's
first lines working."""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from infinity.errors import ConfigError


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:  # fmt: skip
    """DeepSpeed's: joins the default process group from the launcher's variables (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), if it is not joined yet. The backend defaults to NCCL with CUDA, else gloo.
    A single process without those variables stays alone (initialize() then runs at world size 1). MPI
    discovery is not done: launch with torchrun."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if rank < 0 and world_size < 0 and "RANK" not in os.environ:
        return  # one process, no launcher
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs = {"backend": backend, "init_method": init_method}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank >= 0 or world_size >= 0:
        if rank < 0 or world_size < 0:
            raise ConfigError("init_distributed: pass both rank and world_size, or neither (the launcher's)")
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's: adds --deepspeed (a flag) and --deepspeed_config (the JSON config's path) to ``parser``;
    initialize(args=args) reads args.deepspeed_config."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (kept for DeepSpeed's scripts; infinity needs no flag)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config's path")
    return parser

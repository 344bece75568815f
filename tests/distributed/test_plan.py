"""Ranks that see different machines still agree on every size ([Note: one plan] in infinity/memory/plan.py).

Two real processes over gloo, stage 2 with the optimizer on NVMe: at stages 1-2 the new weights are all-gathered
tile by tile, so both ranks must cut their pieces into the same tiles. Here rank 0 sees 64 GiB of available host
memory and rank 1 sees 16 MiB (MemAvailable as every module reads it, replaced in each process): sized from each
rank's own memory, rank 0 cuts its 1,049,600-element piece into one tile and rank 1 into two, and the step's
first gather fails (or hangs until the short collective_timeout). With the plan, both cut the same tiles from
the smaller share, and the run equals plain PyTorch (fused AdamW on the whole batch, one process).

The same run shows the node's host memory divided among its ranks (each gets half of the smaller host's), and
allgather_bucket_size bounding what one gather of new weights holds (every all-gather the step issues is
recorded): a tile of a million elements travels in parts of at most allgather_bucket_size, with the same result,
and so does the in-memory step's bucket without offload_optimizer.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

import infinity
from tests.distributed.harness import run_distributed

WIDTH, STEPS, MICRO, LR = 1024, 2, 2, 1e-3
MEMORY = {0: 64 << 30, 1: 16 << 20}  # the available host memory each rank sees
GATHER_BOUND = 100_000  # allgather_bucket_size of the bounded run


def _model() -> nn.Module:
    torch.manual_seed(7)  # 2,099,200 parameters: one bucket, a piece of 1,049,600 elements per rank
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(MICRO * 2, WIDTH, generator=gen), torch.randn(MICRO * 2, WIDTH, generator=gen)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch in one process: fused AdamW on the whole batch, its gradient the mean of the two ranks' halves
    in the engine's order (Adam turns the rounding of a near-zero gradient into a whole step: summed in another
    order, 60 of the 2M weights land 1e-3 apart, with or without any ZeRO)."""
    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
    losses = []
    for step in range(STEPS):
        inputs, target = _batch(step)
        halves = [F.mse_loss(model(inputs[r * MICRO : (r + 1) * MICRO]), target[r * MICRO : (r + 1) * MICRO])
                  for r in range(2)]  # fmt: skip
        grads = [torch.autograd.grad(loss, params) for loss in halves]
        for param, first, second in zip(params, *grads, strict=True):
            param.grad = (first + second) / 2
        optimizer.step()
        losses.append((halves[0].item() + halves[1].item()) / 2)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _see_host_memory(nbytes: int) -> None:
    """MemAvailable as this process sees it, in every module that reads it."""
    from infinity.aio import buffers

    original = buffers.available_host_bytes
    for name, module in list(sys.modules.items()):
        if name.startswith("infinity") and getattr(module, "available_host_bytes", None) is original:
            module.available_host_bytes = lambda: nbytes


def _record_gathers() -> list[int]:
    """Elements each all-gather of flat buffers holds (its output), as the engine calls it."""
    from infinity.zero import collectives

    sizes: list[int] = []
    original = collectives.all_gather_pieces

    def recorded(comm, flat, piece, *, async_op):
        sizes.append(flat.numel())
        return original(comm, flat, piece, async_op=async_op)

    collectives.all_gather_pieces = recorded
    return sizes


def _train(config: dict, *, rank: int, world_size: int, gathers: list[int]) -> dict:
    model = _model()
    engine, *_ = infinity.initialize(model=model, config=config)
    losses = []
    for step in range(STEPS):
        inputs, target = _batch(step)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = F.mse_loss(engine(inputs[mine]), target[mine])
        engine.backward(loss)
        gathers.clear()
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world_size)
    plan = engine.plan
    result = {
        "losses": losses,
        "params": {name: p.detach().float().clone() for name, p in engine.module.named_parameters()},
        "largest_gather": max(gathers),
        "gathers": len(gathers),
        "plan": (plan.tile_numel, plan.local_ranks, plan.host_share, plan.host_cache_bytes, plan.staging_bytes),
    }
    engine.destroy()
    return result


def _worker(*, rank: int, world_size: int, nvme_path: str) -> dict:
    torch.manual_seed(0)
    _see_host_memory(MEMORY[rank])
    gathers = _record_gathers()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "collective_timeout": 20,  # a rank waiting for a gather its peer never makes fails fast
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
    }
    results = {"default": _train(config, rank=rank, world_size=world_size, gathers=gathers)}
    config["zero_optimization"]["allgather_bucket_size"] = GATHER_BOUND
    results["bounded"] = _train(config, rank=rank, world_size=world_size, gathers=gathers)
    del config["zero_optimization"]["offload_optimizer"]  # the knob bounds the in-memory step's gathers too
    results["in memory, bounded"] = _train(config, rank=rank, world_size=world_size, gathers=gathers)
    results["reference"] = _reference() if rank == 0 else None
    return results


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_ranks_with_different_memory_agree_and_match_pytorch(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    per_rank = run_distributed(_worker, 2, tmp_path, timeout_s=120, nvme_path=str(nvme))
    ref_losses, ref_params = per_rank[0]["reference"]
    for run in ("default", "bounded"):
        plans = {rank: results[run]["plan"] for rank, results in enumerate(per_rank)}
        assert plans[0] == plans[1], f"{run}: the ranks planned differently: {plans}"
        tile, local_ranks, share, cache, staging = plans[0]
        # the node's memory divided among its ranks, from the smaller host's: each rank gets half of 16 MiB
        assert (local_ranks, share, cache, staging) == (2, 8 << 20, 2 << 20, 512 << 10)
        assert tile == 1 << 20  # the smallest tile (MIN_TILE_NUMEL): two tiles per piece on both ranks
        for rank, results in enumerate(per_rank):
            got = results[run]
            assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses, strict=True)) < 1e-5, (
                run, rank, got["losses"], ref_losses
            )  # fmt: skip
            worst = max(_relative(got["params"][name], want) for name, want in ref_params.items())
            assert worst < 1e-5, f"{run}: rank {rank}'s parameters {worst:.1e} from plain PyTorch"
    for rank, results in enumerate(per_rank):
        got = results["in memory, bounded"]
        assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses, strict=True)) < 1e-5
        worst = max(_relative(got["params"][name], want) for name, want in ref_params.items())
        assert worst < 1e-5, f"in memory: rank {rank}'s parameters {worst:.1e} from plain PyTorch"
        assert got["largest_gather"] <= GATHER_BOUND, got["largest_gather"]  # was the whole bucket: 2,099,200
        assert got["gathers"] >= 2 * 1_049_600 // GATHER_BOUND
    for results in per_rank:
        assert results["default"]["largest_gather"] == 2 * (1 << 20)  # world size x a whole tile
        bounded = results["bounded"]
        assert bounded["largest_gather"] <= GATHER_BOUND, bounded["largest_gather"]
        assert bounded["gathers"] >= 2 * 1_049_600 // GATHER_BOUND  # the tiles travelled in parts
    assert not any(nvme.iterdir()), "swap files left after destroy()"

"""[Note: one collective order] in infinity/zero/rendezvous.py: with NCCL every collective of a stage-3 pass, the
fetches' all-gathers (fetch group) and the gradients' reduce-scatters (data-parallel group), is issued in the same
order on every rank, even where the ranks' backwards differ. Gloo does not need it, so setup_stage3 leaves it off
there; here it is switched on by hand over gloo (the same code NCCL runs) and each rank records the collectives it
issues. The model has a rank-dependent branch: rank 1's backward fetches a unit that rank 0's does not use, so
without the waits the ranks launch a reduction on either side of that fetch (checked too, so that this test
keeps exercising the hazard). tests/gpu runs the same model over NCCL."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import infinity
from infinity.zero import collectives
from tests.distributed.harness import run_distributed

STEPS, MICRO = 2, 4


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 32)
        self.extra, self.c = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if dist.is_initialized() and dist.get_rank() == 1:  # rank 0 never uses ``extra``: its gradient is zeros
            h = torch.tanh(self.extra(h))
        return self.c(h)


def config(overlap_comm: bool = True) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": overlap_comm},
    }


def _issued_collectives(rank: int, world_size: int) -> dict:
    """Per (one_order, overlap_comm): the unit all-gathers and gradient reduce-scatters this rank issued, in order
    (header exchanges, int64 tensors, left out), and the losses. Without overlap_comm each reduction is waited
    for inside backward ([Note: launch order] in zero/reducer.py), between the launches' own waits."""
    gather, reduce = collectives.all_gather_pieces, collectives.reduce_scatter_mean
    results = {}
    for one_order, overlap in ((True, True), (False, True), (True, False)):
        engine, *_ = infinity.initialize(model=Branchy(), config=config(overlap))
        default = engine.stage3.coordinator.one_order
        engine.stage3.coordinator.one_order = one_order
        issued, losses = [], []

        def logged_gather(comm, flat, piece, *, async_op, issued=issued):
            if flat.dtype != torch.int64:
                issued.append(("all-gather", flat.numel()))
            return gather(comm, flat, piece, async_op=async_op)

        def logged_reduce(comm, output, flat, *, async_op, issued=issued):
            issued.append(("reduce-scatter", flat.numel()))
            return reduce(comm, output, flat, async_op=async_op)

        collectives.all_gather_pieces, collectives.reduce_scatter_mean = logged_gather, logged_reduce
        try:
            gen = torch.Generator().manual_seed(3)
            for _ in range(STEPS):
                x = torch.randn(MICRO * world_size, 8, generator=gen)
                y = torch.randn(MICRO * world_size, 4, generator=gen)
                part = slice(rank * MICRO, (rank + 1) * MICRO)
                loss = F.mse_loss(engine(x[part]), y[part])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        finally:
            collectives.all_gather_pieces, collectives.reduce_scatter_mean = gather, reduce
        engine.destroy()
        results[one_order, overlap] = {"issued": issued, "losses": losses, "default": default}
    return results


def test_every_rank_issues_fetches_and_reductions_in_one_order(tmp_path):
    ranks = run_distributed(_issued_collectives, 2, tmp_path, timeout_s=120)
    assert [r[True, True]["default"] for r in ranks] == [False, False]  # gloo: off unless asked (NCCL: on)
    for overlap in (True, False):
        ordered = [r[True, overlap]["issued"] for r in ranks]
        assert {op for op, _ in ordered[0]} == {"all-gather", "reduce-scatter"}
        assert ordered[0] == ordered[1], f"overlap_comm {overlap}: with one_order the ranks' orders differ"
    unordered = [r[False, True]["issued"] for r in ranks]
    assert sorted(unordered[0]) == sorted(unordered[1]) and unordered[0] != unordered[1], (
        "without one_order the ranks' orders should differ here (else this test no longer exercises the hazard)"
    )
    for r in ranks:  # only when the reductions are launched changes, not the math
        assert r[True, True]["losses"] == r[False, True]["losses"] == r[True, False]["losses"]

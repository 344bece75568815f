"""Stage 2 reduces each gradient bucket inside backward, as soon as the buckets before it in the launch order are
complete, with or without overlap_comm ([Note: fixed launch order] in zero/reducer.py), as DeepSpeed reduces each
bucket as it fills. Without overlap_comm (stage 2's default) every bucket used to be held until backward ended:
the whole model's gradient in fp32, whatever reduce_bucket_size said. World size 2 over gloo, the tiny
transformer cut into many buckets, accumulation 2: losses and parameters equal plain PyTorch's, and the bucket
buffers held at once stay a few buckets, not the model."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.training import engine_config, pieces_error, train_engine, train_reference

MODEL, STEPS, MICRO, ACCUMULATION, LR, CLIP = "transformer", 3, 2, 2, 1e-2, 1.0
BUCKET = 2000  # elements: the tiny transformer's ~29k trainable elements in many buckets
RTOL = 1e-5


def _reducer_stats(engine) -> dict:
    reducer = engine.zero_optimizer.reducer
    buckets = [state.bucket for state in reducer._states]
    return {"peak_buffer_bytes": reducer.peak_buffer_bytes, "bucket_bytes": [b.padded_numel * 4 for b in buckets]}


def _worker(*, rank: int, world_size: int) -> dict:
    results = {}
    for overlap in (False, True):
        config = engine_config(stage=2, micro=MICRO, accumulation=ACCUMULATION, lr=LR, clip=CLIP, bucket=BUCKET,
                               overlap=overlap)  # fmt: skip
        results[overlap] = train_engine(MODEL, config, steps=STEPS, rank=rank, world_size=world_size,
                                        probe=_reducer_stats)  # fmt: skip
    return results


def test_stage2_reduces_bucket_by_bucket_without_overlap_comm(tmp_path):
    per_rank = run_distributed(_worker, 2, tmp_path, timeout_s=180)
    ref_losses, ref_params = train_reference(MODEL, steps=STEPS, batch=MICRO * ACCUMULATION * 2, lr=LR, clip=CLIP,
                                             split=(MICRO, ACCUMULATION, 2))  # fmt: skip
    for overlap in (False, True):
        for rank, results in enumerate(per_rank):
            got = results[overlap]
            for a, b in zip(got["losses"], ref_losses, strict=True):
                assert abs(a - b) <= RTOL * abs(b), (overlap, rank, got["losses"], ref_losses)
            for name, want in ref_params.items():
                error = float((got["params"][name] - want).abs().max() / want.abs().max())
                assert error <= RTOL, f"overlap_comm {overlap}, rank {rank}, {name}: {error:.1e} from PyTorch"
            sizes = sorted(got["bucket_bytes"], reverse=True)
            assert len(sizes) >= 8, "too few buckets to tell a few from all of them"
            # the bucket being reduced plus those filled before their turn (here: the embedding's, completed last but
            # first in the first backward's order); with overlap_comm two in flight as well; and the reduced
            # buffers kept for reuse (MAX_SPARES, counted since they are held)
            allowed = sum(sizes[:6])
            assert got["peak_buffer_bytes"] <= allowed, (
                f"overlap_comm {overlap}, rank {rank}: {got['peak_buffer_bytes']} bytes of gradient buckets held at "
                f"once, {allowed} allowed, the whole model's {sum(sizes)}"
            )
        assert pieces_error([r[overlap]["pieces"] for r in per_rank], ref_params) <= RTOL


# ---- the launch order learned from backward ([Note: learned order] in zero/reducer.py) ----
WIDTH, LAYERS, GROUPS_STEPS = 32, 16, 3


class Reversed(torch.nn.Module):
    """Linear layers registered in the reverse of the order they run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _groups(model: torch.nn.Module) -> list[dict]:
    """A Trainer's param groups: weights with decay, biases without."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]  # fmt: skip


def _groups_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)


def _groups_reference() -> dict[str, torch.Tensor]:
    model = Reversed()
    optimizer = torch.optim.AdamW(_groups(model), lr=LR, fused=True)
    for step in range(GROUPS_STEPS):
        inputs, target = _groups_batch(step)
        halves = [torch.nn.functional.mse_loss(model(inputs[r * 2 : r * 2 + 2]), target[r * 2 : r * 2 + 2])
                  for r in range(2)]  # fmt: skip
        grads = [torch.autograd.grad(h, list(model.parameters())) for h in halves]
        for param, first, second in zip(model.parameters(), *grads, strict=True):
            param.grad = (first + second) / 2
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _groups_worker(*, rank: int, world_size: int) -> dict:
    import infinity

    results = {}
    for overlap in (False, True):
        model = Reversed()
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
            "stage": 2, "overlap_comm": overlap, "reduce_bucket_size": WIDTH * WIDTH + WIDTH}}  # fmt: skip
        optimizer = torch.optim.AdamW(_groups(model), lr=LR)
        engine, *_ = infinity.initialize(model=model, optimizer=optimizer, config=config)
        peaks = []
        for step in range(GROUPS_STEPS):
            inputs, target = _groups_batch(step)
            reducer = engine.zero_optimizer.reducer
            reducer.peak_buffer_bytes = reducer._in_use_bytes
            mine = slice(rank * 2, rank * 2 + 2)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs[mine]), target[mine]))
            engine.step()
            peaks.append(reducer.peak_buffer_bytes)
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        sizes = [s.bucket.padded_numel * 4 for s in engine.zero_optimizer.reducer._states]
        results[overlap] = {"peaks": peaks, "params": params, "total": sum(sizes), "smallest": min(sizes)}
        engine.destroy()
    return results


def test_stage2_learns_the_order_backward_completes_buckets_in(tmp_path):
    """Param groups by kind (all weights, then all biases: a Trainer's) and layers registered in reverse: the
    fixed order (the groups' layout, reversed) made every bucket filled early wait for the biases', which
    completes last: the whole model's gradient held. The first backward launches in the order the autograd graph
    predicts, later ones in the order the last one completed them: a few buckets are held at once in every
    backward. Parameters equal plain PyTorch's."""
    per_rank = run_distributed(_groups_worker, 2, tmp_path, timeout_s=180)
    want = _groups_reference()
    for rank, results in enumerate(per_rank):
        for overlap, got in results.items():
            for name, value in want.items():
                error = float((got["params"][name] - value).abs().max() / value.abs().max())
                assert error <= RTOL, f"overlap_comm {overlap}, rank {rank}, {name}: {error:.1e} from PyTorch"
            # a weight's bucket filling, two in flight (overlap_comm) or reduced, and the biases' bucket, which
            # fills from the first layer backward reaches to the last
            allowed = 3 * WIDTH * WIDTH * 4 + got["smallest"]
            assert max(got["peaks"]) <= allowed, (f"overlap_comm {overlap}, rank {rank}: buckets held at once "
                                                      f"{got['peaks']}, {allowed} allowed, the model's {got['total']}")


def test_spare_bucket_buffers_are_bounded_when_every_bucket_differs_in_size(one_thread):
    """Stage 2 keeps reduced buffers for the next bucket of their size, at most MAX_SPARES of them: with buckets of
    as many sizes as layers, keeping one each held the whole model's gradient until the step (uncounted)."""
    import infinity
    from infinity.zero.reducer import MAX_SPARES

    widths = [24, 40, 56, 72, 88, 104, 120, 136, 152]
    torch.manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)])
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 1}}  # fmt: skip
    engine, *_ = infinity.initialize(model=model, config=config)
    try:
        reducer = engine.zero_optimizer.reducer
        sizes = sorted({s.bucket.padded_numel * 4 for s in reducer._states}, reverse=True)
        assert len(sizes) >= 8, sizes
        engine.backward(engine(torch.randn(2, widths[0])).pow(2).mean())
        held = sum(b.numel() * 4 for spares in reducer._spare.values() for b in spares)
        engine.step()
    finally:
        engine.destroy()
    assert held <= MAX_SPARES * sizes[0], (held, sizes)
    assert reducer.peak_buffer_bytes <= (MAX_SPARES + 2) * sizes[0], (reducer.peak_buffer_bytes, sum(sizes))
    assert reducer.peak_buffer_bytes >= held  # the spares are counted


class SharedInTwoSegments(torch.nn.Module):
    """One Linear used inside two activation-checkpointed segments."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.shared, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)
        self.reentrant = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), x,
                                                  use_reentrant=self.reentrant)  # fmt: skip
        return self.head(x)


def test_a_second_gradient_after_its_bucket_was_reduced_is_an_error_not_a_wrong_step(one_thread):
    """Reentrant checkpointing runs each segment's backward apart, so the shared parameter gets two gradients in
    one backward; the bucket was reduced after the first (the second used to be added into the next step's, a
    silently wrong gradient). DeepSpeed refuses it too; use_reentrant=False gives the right step."""
    import infinity
    from infinity.errors import InfinityError

    def run(reentrant: bool) -> dict:
        model = SharedInTwoSegments()
        model.reentrant = reentrant
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 1}}  # fmt: skip
        engine, *_ = infinity.initialize(model=model, config=config)
        try:
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        finally:
            engine.destroy()

    with pytest.raises(InfinityError, match="use_reentrant=False"):
        run(reentrant=True)
    got = run(reentrant=False)
    plain = SharedInTwoSegments()
    plain.reentrant = False
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    plain(x).pow(2).mean().backward()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(got[name], param.detach() - param.grad, rtol=1e-5, atol=1e-6)


def _branch_worker(*, rank: int, world_size: int) -> dict:
    """Rank 0 also runs an extra layer first (a branch rank 1 never takes): the ranks' learned orders differ."""
    import infinity

    model = Reversed()
    model.extra = torch.nn.Linear(WIDTH, WIDTH)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": WIDTH * WIDTH + WIDTH}}  # fmt: skip
    engine, *_ = infinity.initialize(model=model, optimizer=torch.optim.AdamW(_groups(model), lr=LR), config=config)
    peaks, orders = [], []
    for step in range(GROUPS_STEPS):
        inputs, target = _groups_batch(step)
        reducer = engine.zero_optimizer.reducer
        reducer.peak_buffer_bytes = 0
        mine = inputs[rank * 2 : rank * 2 + 2]
        if rank == 0:  # first in forward, so completed last in rank 0's backward; rank 1 completes it at once
            mine = torch.tanh(engine.module.extra(mine))
        out = engine(mine)
        engine.backward(torch.nn.functional.mse_loss(out, target[rank * 2 : rank * 2 + 2]))
        orders.append(list(reducer._order))
        engine.step()
        peaks.append(reducer.peak_buffer_bytes)
    total = sum(s.bucket.padded_numel * 4 for s in engine.zero_optimizer.reducer._states)
    engine.destroy()
    return {"peaks": peaks, "orders": orders, "total": total}


def test_ranks_whose_backwards_differ_launch_in_one_merged_order(tmp_path):
    """A branch one rank takes changes its completion order: both ranks merge the rows alike (no hang, the same
    order) and hold a few buckets at once, not the model."""
    first, second = run_distributed(_branch_worker, 2, tmp_path, timeout_s=120)
    assert first["orders"] == second["orders"]
    for result in (first, second):
        assert max(result["peaks"]) <= 5 * (WIDTH * WIDTH + WIDTH) * 4, (result["peaks"], result["total"])

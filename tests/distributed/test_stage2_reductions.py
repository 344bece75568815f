"""Stage 2 reduces each gradient bucket inside backward, as soon as the buckets before it in the launch order are
complete, with or without overlap_comm ([Note: fixed launch order] in zero/reducer.py), as DeepSpeed reduces each
bucket as it fills. Without overlap_comm (stage 2's default) every bucket used to be held until backward ended:
the whole model's gradient in fp32, whatever reduce_bucket_size said. World size 2 over gloo, the tiny
transformer cut into many buckets, accumulation 2: losses and parameters equal plain PyTorch's, and the bucket
buffers held at once stay a few buckets, not the model."""

from __future__ import annotations

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
            # without overlap: the bucket being reduced plus those filled before their turn (here: the embedding's,
            # completed last but first in the launch order, at most); with it, two in flight as well
            allowed = sum(sizes[:4])
            assert got["peak_buffer_bytes"] <= allowed, (
                f"overlap_comm {overlap}, rank {rank}: {got['peak_buffer_bytes']} bytes of gradient buckets held at "
                f"once, {allowed} allowed, the whole model's {sum(sizes)}"
            )
        assert pieces_error([r[overlap]["pieces"] for r in per_rank], ref_params) <= RTOL

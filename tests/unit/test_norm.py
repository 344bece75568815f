"""The global norm's per-piece squares (zero/grads.py piece_squares): fp64 accumulation by chunks, and fp16's
overflow check read from it (not finite exactly when an element is not)."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.zero.grads import HOST_NORM_CHUNK, piece_squares


def test_squares_match_fp64_across_chunk_boundaries():
    torch.manual_seed(0)
    piece = torch.randn(3 * HOST_NORM_CHUNK + 17)
    exact = float(piece.double().square().sum())
    assert piece_squares(piece) == pytest.approx(exact, rel=1e-12)
    assert piece_squares(piece[:0]) == 0.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_element_makes_the_squares_not_finite(bad):
    piece = torch.ones(2 * HOST_NORM_CHUNK)
    piece[HOST_NORM_CHUNK + 3] = bad
    assert not math.isfinite(piece_squares(piece))


def test_the_largest_finite_values_stay_finite():
    """fp32's largest value squared, summed over many elements, fits fp64: no false overflow."""
    piece = torch.full((HOST_NORM_CHUNK + 1,), torch.finfo(torch.float32).max)
    assert math.isfinite(piece_squares(piece))

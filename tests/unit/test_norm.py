"""The global norm's per-piece squares (zero/grads.py piece_squares): fp32 rows summed in fp64, within fp32's
precision of the fp64 sum, and fp16's overflow check read from it (not finite exactly when an element is not)."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.zero.grads import HOST_NORM_BLOCK, HOST_NORM_CHUNK, piece_squares

SIZES = [(17, 1e-12), (3 * HOST_NORM_CHUNK + 17, 1e-12), (HOST_NORM_BLOCK + 17, 1e-8), (3 * HOST_NORM_BLOCK, 1e-8),
         (2 * HOST_NORM_BLOCK + 3 * 64 + 17, 1e-8)]  # the last: a partial last block and a tail  # fmt: skip


@pytest.mark.parametrize("numel, rel", SIZES)
def test_squares_match_fp64(numel, rel):
    """Small pieces summed in fp64; large ones in fp32 rows whose errors average out, below fp32's rounding."""
    torch.manual_seed(0)
    piece = torch.randn(numel)
    exact = float(piece.double().square().sum())
    assert piece_squares(piece) == pytest.approx(exact, rel=rel)
    assert piece_squares(piece[:0]) == 0.0


def test_squares_of_values_spread_over_decades_stay_within_fp32_precision():
    """Many small values beside a few large ones: each fp32 row stays short, the rows add up in fp64."""
    torch.manual_seed(0)
    piece = torch.randn(1 << 22) * torch.rand(1 << 22).pow(8) * 1e3 + 1e-3
    exact = float(piece.double().square().sum())
    assert piece_squares(piece) == pytest.approx(exact, rel=3e-8)
    assert piece_squares(piece.bfloat16()) == pytest.approx(float(piece.bfloat16().double().square().sum()),
                                                            rel=1e-12)  # not fp32: the fp64 chunks  # fmt: skip


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_element_makes_the_squares_not_finite(bad):
    piece = torch.ones(2 * HOST_NORM_BLOCK)
    piece[HOST_NORM_BLOCK + 3] = bad
    assert not math.isfinite(piece_squares(piece))


def test_the_largest_finite_values_stay_finite():
    """fp32's largest value squared overflows an fp32 row; summed again in fp64 it fits: no false overflow."""
    piece = torch.full((HOST_NORM_BLOCK + 1,), torch.finfo(torch.float32).max)
    assert math.isfinite(piece_squares(piece))


def test_a_piece_gives_the_same_squares_wherever_it_starts():
    """The swapped gradient's piece and the in-memory shard's view of it sit at different offsets: the same values
    give bitwise the same squares (clipping is the same in both homes)."""
    torch.manual_seed(0)
    numel = 2 * HOST_NORM_BLOCK + 3 * 64 + 17
    buffer = torch.randn(numel + 5)
    view = buffer[5:]
    assert piece_squares(view) == piece_squares(view.clone())

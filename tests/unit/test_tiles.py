"""tiles.cut ([Note: tiles] in infinity/zero/tiles.py): tiles at multiples of 64 elements inside each run, never
across runs, covering every element once; and the premise they rest on: torch's update on such pieces is bitwise
the update on the whole tensor."""

from __future__ import annotations

import random

import pytest
import torch
from torch.optim import adam, sgd

from infinity.errors import ConfigError
from infinity.zero.tiles import SIMD_NUMEL, cut

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def random_runs(seed: int) -> list[tuple[int, int, int, int]]:
    """(group, piece, start, numel) runs as the optimizers make them: in order, disjoint, gaps between some."""
    rng = random.Random(seed)
    runs, position = [], 0
    for piece in range(rng.randint(1, 8)):
        for group in rng.sample(range(3), rng.randint(1, 3)):
            position += rng.choice([0, 0, 8, 3])  # padding or parameters outside the optimizer
            numel = rng.choice([1, 7, 63, 64, 65, 100, 128, 1000, rng.randint(1, 5000)])
            runs.append((group, piece, position, numel))
            position += numel
    return runs


@pytest.mark.parametrize("tile_numel", [1, 63, 64, 100, 127, 128, 200, 1000, 10**9])
@pytest.mark.parametrize("seed", range(5))
def test_tiles_cover_each_run_exactly_at_multiples_of_64(seed, tile_numel):
    runs = random_runs(seed)
    tiles = cut(runs, tile_numel)
    effective = max(tile_numel // SIMD_NUMEL * SIMD_NUMEL, SIMD_NUMEL)
    assert [t.index for t in tiles] == list(range(len(tiles)))
    assert len({t.name for t in tiles}) == len(tiles)
    covered = {}
    for group, piece, start, numel in runs:
        inside = [t for t in tiles if t.group == group and t.piece == piece and start <= t.start < start + numel]
        assert inside, (group, piece, start, numel)
        assert inside[0].start == start
        for tile in inside:
            assert tile.start + tile.numel <= start + numel  # never past its run
            assert (tile.start - start) % SIMD_NUMEL == 0  # cut at a multiple of 64 from the run's start
            assert 1 <= tile.numel <= effective
        assert all(t.numel == effective for t in inside[:-1])  # only a run's last tile is short
        for tile in inside:
            for element in range(tile.start, tile.start + tile.numel):
                covered[element] = covered.get(element, 0) + 1
    assert sum(numel for *_, numel in runs) == sum(t.numel for t in tiles) == len(covered)
    assert set(covered.values()) == {1}  # every element of every run exactly once, no element outside them


@pytest.mark.parametrize(("tile_numel", "expected"), [(1, 64), (63, 64), (64, 64), (100, 64), (129, 128)])
def test_a_tile_size_is_rounded_down_to_a_multiple_of_64_and_at_least_64(tile_numel, expected):
    tiles = cut([(0, 0, 0, 1000)], tile_numel)
    assert [t.numel for t in tiles[:-1]] == [expected] * (len(tiles) - 1)
    assert tiles[-1].numel == 1000 - expected * (len(tiles) - 1) and 0 < tiles[-1].numel <= expected


def test_a_tile_size_below_one_is_refused():
    for bad in (0, -5):
        with pytest.raises(ConfigError, match="sub_group_size"):
            cut([(0, 0, 0, 10)], bad)


def test_empty_runs_give_no_tiles():
    assert cut([], 64) == []


def adam_steps(pieces: list[slice], *, numel: int, seed: int, fused: bool | None, amsgrad: bool) -> torch.Tensor:
    """Three steps of torch's Adam, each as one call per piece; returns the master and states, concatenated."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen) * 10 * torch.rand(1, generator=gen)
    states = [torch.zeros(numel) for _ in range(3)]
    for step_count in (1, 2, 3):
        for span in pieces:
            adam.adam(
                [master[span]], [grad[span]], [states[0][span]], [states[1][span]],
                [states[2][span]] if amsgrad else [], [torch.tensor(float(step_count))], foreach=False,
                capturable=False, differentiable=False, fused=fused, decoupled_weight_decay=seed % 2 == 0,
                amsgrad=amsgrad, beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.01, eps=1e-8, maximize=False,
            )  # fmt: skip
    return torch.cat([master, *states])


def sizes(count: int) -> list[int]:
    gen = torch.Generator().manual_seed(123)
    return [int(n) for n in torch.randint(100, 5000, (count,), generator=gen)]


@pytest.mark.parametrize("fused", [True, None], ids=["fused", "single-tensor"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_adam_on_tiles_is_bitwise_adam_on_the_whole(fused, amsgrad):
    """The premise of tiling: torch's Adam stepping each tile of cut() (sub_group_size 100: tiles of 64) gives
    bitwise what one call on the whole tensor gives, for tensors of random lengths (scalar tails included)."""
    for seed, numel in enumerate(sizes(12)):
        whole = adam_steps([slice(0, numel)], numel=numel, seed=seed, fused=fused, amsgrad=amsgrad)
        tiles = [slice(t.start, t.start + t.numel) for t in cut([(0, 0, 0, numel)], 100)]
        assert torch.equal(whole, adam_steps(tiles, numel=numel, seed=seed, fused=fused, amsgrad=amsgrad)), numel


def test_pieces_not_cut_at_multiples_of_64_are_not_bitwise_with_fused_adam():
    """Why cut() rounds: the same comparison with pieces of 100 elements fails for torch's fused CPU Adam
    (measured on an AVX2 machine with one thread: all 12 lengths differ), so the check above can fail. Where a
    machine's fused Adam does not care how a tensor is cut, this is skipped: nothing is wrong then."""
    differing = 0
    for seed, numel in enumerate(sizes(12)):
        whole = adam_steps([slice(0, numel)], numel=numel, seed=seed, fused=True, amsgrad=False)
        pieces = [slice(start, start + 100) for start in range(0, numel, 100)]
        differing += not torch.equal(whole, adam_steps(pieces, numel=numel, seed=seed, fused=True, amsgrad=False))
    if differing == 0:
        pytest.skip("this machine's fused Adam gives bitwise equal results for any cut")


def test_sgd_on_tiles_is_bitwise_sgd_on_the_whole():
    numel = 1037
    gen = torch.Generator().manual_seed(1)
    master, grad, buffer = (torch.randn(numel, generator=gen) for _ in range(3))
    whole, tiled = [master.clone(), buffer.clone()], [master.clone(), buffer.clone()]

    def step(m, g, b):
        sgd.sgd([m], [g], [b], foreach=False, fused=None, weight_decay=0.01, momentum=0.9, lr=1e-2, dampening=0.1,
                nesterov=False, maximize=False)  # fmt: skip

    for _ in range(3):
        step(whole[0], grad, whole[1])
        for tile in cut([(0, 0, 0, numel)], 64):
            span = slice(tile.start, tile.start + tile.numel)
            step(tiled[0][span], grad[span], tiled[1][span])
        assert torch.equal(whole[0], tiled[0]) and torch.equal(whole[1], tiled[1])

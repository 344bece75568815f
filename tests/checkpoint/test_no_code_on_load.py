"""Loading a checkpoint runs no code (infinity/checkpoint/pickled.py): its pickled files are read with
torch.load(weights_only=True), a crafted file is refused by name and what it would run never runs, a save refuses a
client_state a weights-only load could not read back, and the user who trusts a checkpoint can opt in."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch

from infinity import CheckpointError
from infinity.checkpoint.save import ENGINE_STATE, rng_path
from tests.checkpoint.test_safety import _engine, _train


class RunsCode:
    """Unpickling it calls os.mkdir(marker): a stand-in for anything a crafted pickle could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


class UserObject:
    """A client_state value of the user's own class: picklable, not readable without running code."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    engine = _engine()
    _train(engine, 2)
    engine.save_checkpoint(folder, tag="good", client_state={"epoch": 3, "note": "ok", "mean": torch.ones(2)})
    engine.destroy()
    return folder


def _copy(saved, tmp_path) -> str:
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    return str(folder)


@pytest.mark.parametrize("which", ["engine state", "rng"])
def test_a_crafted_pickle_is_refused_and_runs_nothing(saved, tmp_path, which):
    folder = _copy(saved, tmp_path)
    marker = str(tmp_path / "the-pickle-ran")
    path = os.path.join(folder, "good", ENGINE_STATE) if which == "engine state" else rng_path(
        os.path.join(folder, "good"), 0)  # fmt: skip
    torch.save({"global_steps": RunsCode(marker)}, path)
    engine = _engine()
    try:
        with pytest.raises(CheckpointError) as refused:
            engine.load_checkpoint(folder, tag="good")
        message = str(refused.value)
        assert path in message and "run code" in message and "weights_only=False" in message, message
        assert "mkdir" in message, message  # torch's own words for what was refused
        assert not os.path.exists(marker), "loading the checkpoint ran the pickle's code"
        assert engine.global_steps == 0  # nothing was loaded
    finally:
        engine.destroy()


def test_a_checkpoint_loads_without_running_code_and_restores_every_generator(saved):
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    engine = _engine()
    try:
        path, client_state = engine.load_checkpoint(saved, tag="good")
        assert path.endswith("good") and engine.global_steps == 2
        assert client_state["epoch"] == 3 and client_state["note"] == "ok" and torch.equal(client_state["mean"],
                                                                                          torch.ones(2))  # fmt: skip
        drawn = (random.random(), float(np.random.rand()), float(torch.rand(())))
        engine.load_checkpoint(saved, tag="good")
        assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == drawn  # the saved RNG again
    finally:
        engine.destroy()


def test_an_earlier_releases_rng_file_with_numpy_arrays_still_loads(saved, tmp_path):
    """RNG files written before: numpy's state pickled as an array; read allowing numpy's arrays only."""
    folder = _copy(saved, tmp_path)
    np.random.seed(5)
    expected = float(np.random.rand())
    np.random.seed(5)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               rng_path(os.path.join(folder, "good"), 0))  # fmt: skip
    np.random.seed(99)
    engine = _engine()
    try:
        engine.load_checkpoint(folder, tag="good")
        assert float(np.random.rand()) == expected
    finally:
        engine.destroy()


def test_another_numpy_bit_generator_is_saved_and_restored(tmp_path):
    """numpy's global generator switched from MT19937 (np.random.set_bit_generator): its state is a dict of
    numbers, saved as it is."""
    original = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(7))
    engine = _engine()
    try:
        _train(engine, 1)
        engine.save_checkpoint(tmp_path, tag="pcg")
        expected = float(np.random.rand())
        np.random.set_bit_generator(np.random.PCG64(8))
        engine.load_checkpoint(tmp_path, tag="pcg")
        assert float(np.random.rand()) == expected
    finally:
        engine.destroy()
        np.random.set_bit_generator(original)


def test_a_client_state_that_needs_code_is_refused_at_save_by_key_and_nothing_is_written(tmp_path):
    engine = _engine()
    try:
        _train(engine, 1)
        with pytest.raises(CheckpointError) as refused:
            engine.save_checkpoint(tmp_path, tag="t", client_state={"epoch": 1, "sampler": UserObject(1)})
        message = str(refused.value)
        assert "client_state['sampler']" in message and "UserObject" in message and "state_dict" in message, message
        assert "free space" not in message and "removed" not in message  # not a disk's failure: nothing to clean
        assert not os.path.exists(tmp_path / "t") and not os.path.exists(tmp_path / "t.tmp")
        assert not os.path.exists(tmp_path / "latest")
    finally:
        engine.destroy()


def test_a_trusted_checkpoint_loads_with_the_opt_in(saved, tmp_path):
    """A checkpoint whose client_state holds the user's own objects (an earlier release saved such): refused by
    default, naming the class; loaded with weights_only=False."""
    folder = _copy(saved, tmp_path)
    path = os.path.join(folder, "good", ENGINE_STATE)
    state = torch.load(path, weights_only=True)
    state["client_state"] = {"sampler": UserObject(7)}
    torch.save(state, path)
    engine = _engine()
    try:
        with pytest.raises(CheckpointError, match="UserObject"):
            engine.load_checkpoint(folder, tag="good")
        _, client_state = engine.load_checkpoint(folder, tag="good", weights_only=False)
        assert isinstance(client_state["sampler"], UserObject) and client_state["sampler"].epoch == 7
    finally:
        engine.destroy()

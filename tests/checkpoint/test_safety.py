"""Checkpoints that users break: a process killed mid-save, damaged files, the wrong model, bad calls.

One process, world size 1 (the distributed cases are in tests/distributed/test_checkpoint.py). The kills are real:
a child process SIGKILLs itself in the middle of save_checkpoint (while writing chunks; after the new tag is in
place but before ``latest`` moves) and the parent checks that the previous tag is what loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import infinity
from infinity import CheckpointError
from tests.distributed.training import TinyTransformer, engine_config, global_batch, loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(stage: int = 2, d_model: int = 32, accumulation: int = 1):
    torch.manual_seed(0)
    config = engine_config(stage=stage, micro=4, accumulation=accumulation, lr=1e-2, clip=1.0)
    engine, *_ = infinity.initialize(model=TinyTransformer(d_model=d_model), config=config)
    return engine


def _train(engine, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, target = global_batch("transformer", step, 4)
            loss = loss_fn("transformer", engine(inputs), target)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after 2 steps, and the losses of 2 more steps from there."""
    folder = tmp_path_factory.mktemp("ckpt")
    engine = _engine()
    _train(engine, 2)
    engine.save_checkpoint(folder, client_state={"epoch": 3})
    after = _train(engine, 2, first=2)
    engine.destroy()
    return folder, after


def _copy(saved, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(saved[0], target)
    return target, os.path.join(target, "global_step2")


def test_loads_latest_and_returns_client_state(saved):
    engine = _engine()
    path, client_state = engine.load_checkpoint(saved[0])
    assert os.path.basename(path) == "global_step2" and client_state == {"epoch": 3}
    assert engine.global_steps == 2
    assert _train(engine, 2, first=2) == saved[1]
    engine.destroy()


def test_nothing_to_load_is_none_and_a_missing_tag_is_named(saved, tmp_path):
    engine = _engine()
    assert engine.load_checkpoint(tmp_path) == (None, None)
    with pytest.raises(CheckpointError, match="global_step9.*does not exist.*global_step2"):
        engine.load_checkpoint(saved[0], tag="global_step9")
    engine.destroy()


def test_a_deleted_chunk_is_named(saved, tmp_path):
    folder, tag = _copy(saved, tmp_path)
    os.remove(os.path.join(tag, "optimizer", "exp_avg", "head.weight", "c.0.0"))
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"optimizer/exp_avg/head.weight.*chunk c.0.0 is missing"):
        engine.load_checkpoint(folder)
    engine.destroy()


def test_a_truncated_chunk_is_named(saved, tmp_path):
    folder, tag = _copy(saved, tmp_path)
    path = os.path.join(tag, "params", "embed.weight", "c.0.0")
    os.truncate(path, os.path.getsize(path) - 4)
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"params/embed.weight.*has \d+ bytes, expected"):
        engine.load_checkpoint(folder)
    engine.destroy()


def test_an_edited_manifest_is_caught(saved, tmp_path):
    folder, tag = _copy(saved, tmp_path)
    path = os.path.join(tag, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["arrays"]["params/head.weight"]["shape"] = [50, 33]
    with open(path, "w") as f:
        json.dump(manifest, f)
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"array 'params/head.weight' is \[50, 32\].*manifest says \[50, 33\]"):
        engine.load_checkpoint(folder)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="manifest cannot be read"):
        engine.load_checkpoint(folder)
    engine.destroy()


def test_an_array_of_the_wrong_shape_for_the_model_is_named(saved):
    engine = _engine(d_model=48)
    with pytest.raises(CheckpointError, match=r"'params/pos' has shape \[8, 32\] in the checkpoint but "
                                              r"\[8, 48\] in the model"):  # fmt: skip
        engine.load_checkpoint(saved[0])
    engine.destroy()


def test_a_model_without_the_parameters_is_refused_before_anything_changes(saved):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine, *_ = infinity.initialize(model=model, config=engine_config(stage=1, micro=4, accumulation=1, lr=1e-2,
                                                                        clip=0.0))  # fmt: skip
    before = model[0].weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"no values for 2 of the model's parameters.*0.weight, 0.bias"):
        engine.load_checkpoint(saved[0])
    assert torch.equal(model[0].weight, before)
    engine.destroy()


def test_another_optimizer_is_refused_unless_only_the_weights_load(saved):
    torch.manual_seed(0)
    model = TinyTransformer()
    config = engine_config(stage=2, micro=4, accumulation=1, lr=1e-2, clip=0.0)
    engine, *_ = infinity.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    with pytest.raises(CheckpointError, match="AdamW optimizer, this run's is a SGD"):
        engine.load_checkpoint(saved[0])
    engine.load_checkpoint(saved[0], load_optimizer_states=False)
    reference = _engine()
    reference.load_checkpoint(saved[0])
    for mine, theirs in zip(model.parameters(), reference.module.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    reference.destroy()
    engine.destroy()


def test_save_inside_gradient_accumulation_is_refused(tmp_path):
    engine = _engine(accumulation=2)
    inputs, target = global_batch("transformer", 0, 4)
    engine.backward(loss_fn("transformer", engine(inputs), target))
    engine.step()
    with pytest.raises(CheckpointError, match="middle of gradient accumulation"):
        engine.save_checkpoint(tmp_path)
    assert not os.listdir(tmp_path)
    engine.destroy()


def test_bad_tags_are_refused(tmp_path):
    engine = _engine()
    for tag in ("latest", "a/b", "x.tmp", ".."):
        with pytest.raises(CheckpointError, match="checkpoint tag"):
            engine.save_checkpoint(tmp_path, tag=tag)
    engine.destroy()


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import infinity.checkpoint.chunk_io as chunk_io
    import infinity.checkpoint.save as save
    from tests.checkpoint.test_safety import _engine, _train

    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint({folder!r}, tag="good")
    _train(engine, 1, first=1)
    if {point!r} == "chunks":
        original, count = chunk_io.ChunkIO.write, [0]
        def dying(self, *args, **kwargs):
            count[0] += 1
            if count[0] == 5:
                self.drain()  # four chunks are on disk
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args, **kwargs)
        chunk_io.ChunkIO.write = dying
    else:
        save.write_durably = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    engine.save_checkpoint({folder!r}, tag="doomed")
    """
)


@pytest.mark.parametrize("point", ["chunks", "latest"])
def test_a_save_killed_midway_leaves_the_previous_tag_loadable(tmp_path, point):
    folder = str(tmp_path / "ckpt")
    child = subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT, folder=folder, point=point)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    with open(os.path.join(folder, "latest")) as f:
        assert f.read() == "good"
    names = set(os.listdir(folder))
    assert "good" in names and ("doomed.tmp" in names if point == "chunks" else "doomed" in names)
    engine = _engine()
    path, _ = engine.load_checkpoint(folder)
    assert os.path.basename(path) == "good" and engine.global_steps == 1
    if point == "chunks":
        with pytest.raises(CheckpointError, match="does not exist"):
            engine.load_checkpoint(folder, tag="doomed")  # the half-written .tmp is never loaded
        engine.save_checkpoint(folder, tag="doomed")  # and a new save of that tag replaces it
        assert "doomed.tmp" not in os.listdir(folder) and "doomed" in os.listdir(folder)
    engine.destroy()



@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """No file of this process may grow past ``nbytes``: the kernel refuses such writes with EFBIG, as it refuses
    them with ENOSPC on a full disk. SIGXFSZ is ignored meanwhile, so the write fails instead of killing us."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_save_that_fails_on_disk_removes_its_folder_and_the_previous_tag_loads(tmp_path, capsys):
    """A save the kernel stops part way (chunk files over a file-size limit: EFBIG, as ENOSPC on a full disk,
    after the smaller files are written) removes its partial folder, leaves `latest` and the previous tag as they
    were, and says what failed, what was removed, what still loads and how much room the checkpoint takes. Then
    `ckpt info` describes the previous tag, and a save with room succeeds."""
    from infinity.checkpoint.cli import main as ckpt_main

    folder = str(tmp_path / "ckpt")
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(folder, tag="good")
    _train(engine, 1, first=1)
    with _file_size_limit(10_000), pytest.raises(CheckpointError) as info:  # the largest chunks are 12 KiB
        engine.save_checkpoint(folder, tag="doomed")
    assert sorted(os.listdir(folder)) == ["good", "latest"]  # no doomed.tmp, no temporary `latest`
    message = str(info.value)
    assert "File too large" in message and os.path.join(folder, "doomed") in message, message
    assert "partial folder" in message and "`latest` still names 'good'" in message, message
    assert re.search(r"takes about [\d.]+ KiB \(\d+ bytes\) in .*, [\d.]+ \w+ free there now", message), message
    engine.save_checkpoint(folder, tag="later")
    engine.destroy()
    engine = _engine()
    path, _ = engine.load_checkpoint(folder, tag="good")
    assert os.path.basename(path) == "good" and engine.global_steps == 1
    engine.destroy()
    assert ckpt_main(["info", folder, "--tag", "good"]) == 0 and "tag good: step 1" in capsys.readouterr().out


def test_info_on_a_folder_without_a_complete_tag_says_so(tmp_path, capsys):
    from infinity.checkpoint.cli import main as ckpt_main

    os.makedirs(tmp_path / "global_step5.tmp" / "params")  # a save killed part way, before any finished
    assert ckpt_main(["info", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert f"{tmp_path} holds no complete checkpoint" in error
    assert "global_step5.tmp: saves that never finished" in error
    (tmp_path / "global_step5.tmp").rename(tmp_path / "global_step5")  # `latest` never written: an unfinished tag
    with open(tmp_path / "latest", "w") as f:
        f.write("global_step5")
    assert ckpt_main(["info", str(tmp_path)]) == 1
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert ckpt_main(["info", str(tmp_path / "missing")]) == 1
    assert "is not a folder" in capsys.readouterr().err


class _Tiny(torch.nn.Module):
    """Every parameter tiny, one of them a scalar, one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.first = torch.nn.Linear(3, 2)
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        self.second = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.second(self.first(x) * self.scale + self.frozen)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_model_of_tiny_and_scalar_parameters_resumes_exactly(tmp_path, stage):
    def run(load: bool, steps: range) -> list[float]:
        torch.manual_seed(0)
        config = engine_config(stage=stage, micro=4, accumulation=1, lr=1e-2, clip=0.0)
        engine, *_ = infinity.initialize(model=_Tiny(), config=config)
        if load:
            engine.load_checkpoint(tmp_path)
        losses = []
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            loss = engine(torch.randn(4, 3, generator=gen)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step == 2 and not load:
                engine.save_checkpoint(tmp_path)
        engine.destroy()
        return losses

    assert run(False, range(6))[3:] == run(True, range(3, 6))


def test_a_backward_not_yet_stepped_is_refused(tmp_path):
    engine = _engine()
    inputs, target = global_batch("transformer", 0, 4)
    engine.backward(loss_fn("transformer", engine(inputs), target))
    with pytest.raises(CheckpointError, match="a backward not yet stepped"):
        engine.save_checkpoint(tmp_path)
    engine.step()
    engine.save_checkpoint(tmp_path)
    engine.destroy()


def _with_buffer(size: int) -> torch.nn.Module:
    model = torch.nn.Linear(3, 3)
    model.register_buffer("table", torch.arange(size, dtype=torch.float32))
    return model


def test_a_buffer_of_another_shape_is_named(tmp_path):
    torch.manual_seed(0)
    config = engine_config(stage=2, micro=4, accumulation=1, lr=1e-2, clip=0.0)
    engine, *_ = infinity.initialize(model=_with_buffer(4), config=config)
    engine.save_checkpoint(tmp_path)
    engine.destroy()
    engine, *_ = infinity.initialize(model=_with_buffer(5), config=config)
    with pytest.raises(CheckpointError, match=r"buffer 'buffers/table' has shape \[4\] in the checkpoint but \[5\]"):
        engine.load_checkpoint(tmp_path)
    engine.destroy()


def test_saving_a_tag_again_replaces_it_whole(tmp_path):
    engine = _engine()
    _train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="same")
    _train(engine, 1, first=1)
    engine.save_checkpoint(tmp_path, tag="same")
    assert sorted(os.listdir(tmp_path)) == ["latest", "same"]
    after = _train(engine, 1, first=2)
    engine.destroy()
    engine = _engine()
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == 2 and _train(engine, 1, first=2) == after
    engine.destroy()


@pytest.mark.parametrize("stages", [(1, 1), (1, "cpu"), ("cpu", 1)])
def test_sgd_momentum_resumes_exactly_across_layouts(tmp_path, stages):
    """torch's SGD keeps no step count: its momentum must still be saved and loaded, into the user's optimizer
    (stage 1 in memory) and into tiles (the optimizer offloaded to host memory), either way."""

    def engine_for(where):
        torch.manual_seed(0)
        model = TinyTransformer()
        config = engine_config(stage=1, micro=4, accumulation=1, lr=1e-2, clip=0.0)
        if where == "cpu":
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return infinity.initialize(model=model, optimizer=optimizer, config=config)[0]

    engine = engine_for(stages[0])
    _train(engine, 2)
    engine.save_checkpoint(tmp_path)
    want = _train(engine, 2, first=2)
    engine.destroy()
    engine = engine_for(stages[1])
    engine.load_checkpoint(tmp_path)
    assert _train(engine, 2, first=2) == want
    engine.destroy()


def test_dropout_and_the_engines_loader_resume_exactly(tmp_path):
    """The RNG (dropout masks) and the loader (its order, its own generator) continue where they were."""
    gen = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=gen), torch.randn(40, 1, generator=gen))

    def run(load: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        config = engine_config(stage=2, micro=4, accumulation=1, lr=1e-2, clip=0.0)
        engine, _, loader, _ = infinity.initialize(model=model, config=config, training_data=data)
        if load:
            engine.load_checkpoint(tmp_path)
        losses, batches = [], iter(loader)
        for step in range(4 if load else 16):
            try:
                inputs, target = next(batches)
            except StopIteration:  # an epoch is 10 batches: the resumed run crosses into the next one
                batches = iter(loader)
                inputs, target = next(batches)
            loss = torch.nn.functional.mse_loss(engine(inputs), target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if step == 11 and not load:
                engine.save_checkpoint(tmp_path)
        engine.destroy()
        return losses

    assert run(False)[12:] == run(True)


def test_what_loads_follows_the_flags(tmp_path):
    """load_module_only: the weights only (and the masters, which follow them); load_optimizer_states=False: not
    the optimizer; load_lr_scheduler_states=False: not the scheduler; save_latest=False leaves `latest` alone."""

    def fresh(seed: int):
        torch.manual_seed(seed)
        config = engine_config(stage=2, micro=4, accumulation=1, lr=1e-2, clip=1.0)
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                              "warmup_num_steps": 10}}  # fmt: skip
        return infinity.initialize(model=TinyTransformer(), config=config)[0]

    source = fresh(0)
    _train(source, 2)
    source.save_checkpoint(tmp_path / "src", client_state={"k": 1})
    weights = [p.detach().clone() for p in source.module.parameters()]
    states = {k: v.clone() for k, v in source.zero_optimizer.optimizer.state[source.zero_optimizer.masters[0]].items()}
    source.destroy()

    engine = fresh(1)  # other initial weights
    _, client_state = engine.load_checkpoint(tmp_path / "src", load_module_only=True)
    assert client_state == {} and engine.global_steps == 0 and engine.lr_scheduler.last_batch_iteration == 0
    assert all(torch.equal(p, w) for p, w in zip(engine.module.parameters(), weights, strict=True))
    assert not engine.zero_optimizer.optimizer.state  # no states were loaded
    engine.destroy()

    engine = fresh(1)
    _, client_state = engine.load_checkpoint(tmp_path / "src", load_lr_scheduler_states=False)
    assert client_state == {"k": 1} and engine.global_steps == 2 and engine.lr_scheduler.last_batch_iteration == 0
    loaded = engine.zero_optimizer.optimizer.state[engine.zero_optimizer.masters[0]]
    assert loaded.keys() == states.keys() and all(torch.equal(loaded[k], v) for k, v in states.items())
    engine.load_checkpoint(tmp_path / "src")
    assert engine.lr_scheduler.last_batch_iteration == 2
    engine.save_checkpoint(tmp_path, tag="kept")
    engine.save_checkpoint(tmp_path, tag="other", save_latest=False)
    with open(tmp_path / "latest") as f:
        assert f.read() == "kept"
    engine.destroy()

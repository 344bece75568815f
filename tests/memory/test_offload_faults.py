"""offload_optimizer nvme in the engine when things go wrong, and what it leaves behind.

One process (the engine runs without torch.distributed at world size 1), real files under pytest's tmp_path
(the real disk), real child processes for a killed run and a script that ends without destroy(). Checked: a
damaged swap file fails the next step with an AioError naming it; an unusable nvme_path or an optimizer that is
not elementwise is a ConfigError at initialize(), before anything is written; a file-size limit is a clear error at
initialize(); a killed run's folder is removed when the next engine starts; nothing is left after destroy() or at
exit; host memory and descriptors stay flat over 50 steps; tier_stats() shows every tile read and written once per
step; edits through GatheredParameters reach the swapped masters; two engines can offload to NVMe at once.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import infinity
import infinity.zero
from infinity.errors import AioError, ConfigError, ShortTransferError
from tests.distributed.training import (
    VOCAB,
    WEIGHT_DECAY,
    build,
    engine_config,
    global_batch,
    gradients_on_nvme,
    loss_fn,
    own_pieces,
)

REPO = Path(__file__).resolve().parents[2]
MODEL = "transformer"


def nvme_config(nvme_path, *, stage: int = 2, clip: float = 1.0, sub_group_size: int | None = None, **offload) -> dict:
    config = engine_config(stage=stage, micro=4, accumulation=1, lr=1e-2, clip=clip)
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_path), **offload}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 64
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    return config


PIPELINED = {"pipeline_read": True, "pipeline_write": True, "buffer_count": 3}
SERIAL = {"pipeline_read": False, "pipeline_write": False}  # each tile waits for its own read and write


def train_step(engine, step: int, model: str = MODEL) -> None:
    inputs, target = global_batch(model, step, 4)
    loss = loss_fn(model, engine(inputs), target)
    engine.backward(loss)
    engine.step()


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))


def swap_files(nvme_path: Path) -> list[Path]:
    return sorted(Path(nvme_path).glob("infinity-*/rank*/swap"))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def nvme(tmp_path) -> Path:
    path = tmp_path / "nvme"
    path.mkdir()
    return path


# ---- a damaged swap file ----
@pytest.mark.parametrize(
    ("damage", "offload"),
    [("truncated", SERIAL), ("deleted", SERIAL), ("deleted", PIPELINED)],
    ids=["truncated", "deleted", "deleted-pipelined"],
)
def test_damaged_swap_file_fails_the_next_step_naming_it(nvme, damage, offload):
    """Between two steps the swap file is truncated or deleted: the next step fails with an AioError naming the
    file (with pipeline_read the first reads start at the end of backward, so backward raises it), a retry fails
    the same way (no hang, no step on lost state), and destroy() still removes everything."""
    engine, *_ = infinity.initialize(model=build(MODEL), config=nvme_config(nvme, **offload))
    try:
        train_step(engine, 0)
        train_step(engine, 1)
        (swap,) = swap_files(nvme)
        if damage == "truncated":
            os.truncate(swap, 100)
            expected, pattern = ShortTransferError, "truncated"
        else:
            swap.unlink()
            expected, pattern = AioError, "deleted"
        before = [p.detach().clone() for p in engine.module.parameters()]
        for attempt in range(2):
            inputs, target = global_batch(MODEL, 2, 4)
            loss = loss_fn(MODEL, engine(inputs), target)
            phase = "backward"
            with pytest.raises(expected, match=pattern) as info:
                engine.backward(loss)
                phase = "step"
                engine.step()
            assert phase == ("backward" if offload.get("pipeline_read") else "step"), attempt
            assert info.value.path == str(swap) and str(swap) in str(info.value)
            if damage == "deleted":
                assert info.value.errno == errno.ENOENT
        assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    finally:
        engine.destroy()
    assert tree(nvme) == []


def test_deleted_gradient_swap_file_fails_the_step_naming_it(nvme):
    """Stage 3 with the gradient on NVMe beside the optimizer ([Note: swapped gradients], where the plan puts a
    gradient too large for host memory; forced here): its swap file deleted
    between steps fails the next step with an AioError naming it, and a retry fails the same way. (A truncated
    one is rewritten whole by the next backward before any read: nothing is lost.)"""
    with gradients_on_nvme():
        engine, *_ = infinity.initialize(model=build(MODEL), config=nvme_config(nvme, stage=3, **SERIAL))
    try:
        train_step(engine, 0)
        (swap,) = sorted(Path(nvme).glob("infinity-*-gradients/rank0/swap"))
        swap.unlink()
        for attempt in range(2):
            with pytest.raises(AioError, match="deleted") as info:
                train_step(engine, 1 + attempt)
            assert info.value.path == str(swap) and info.value.errno == errno.ENOENT, attempt
    finally:
        engine.destroy()
    assert tree(nvme) == []


# ---- unusable nvme_path, unsupported optimizers: ConfigError at initialize ----
@pytest.mark.parametrize("kind", ["missing", "file", "read-only"])
def test_unusable_nvme_path_is_a_config_error_at_initialize(tmp_path, kind):
    path = tmp_path / kind
    if kind == "file":
        path.write_bytes(b"")
    elif kind == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes through permission bits")
        path.mkdir(mode=0o500)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(ConfigError, match=re.escape(repr(str(path)))):
            infinity.initialize(model=build(MODEL), config=nvme_config(path))
    finally:
        if kind == "read-only":
            path.chmod(0o700)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds  # nothing opened for the store is left open
    assert tree(tmp_path) == ([] if kind == "missing" else [kind])


class NormalizedSgd(torch.optim.Optimizer):
    """A user's optimizer that is not elementwise: each step moves a parameter by lr along its gradient's
    direction (the gradient divided by its norm over the whole tensor)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad / (param.grad.norm() + 1e-12), alpha=-group["lr"])


@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_an_optimizer_that_is_not_elementwise_is_a_config_error_naming_it(nvme, device):
    """ZeRO steps flat pieces of parameters: an update that reads the whole tensor would silently change. Refused
    at initialize() with or without offload, before anything is written ([Note: elementwise optimizers])."""
    refused = ((NormalizedSgd, "NormalizedSgd is not elementwise"),
               (torch.optim.Adafactor, "Adafactor cannot step ZeRO's flat partitions"))
    for optimizer_class, named in refused:
        model = build(MODEL)
        config = nvme_config(nvme)
        config["zero_optimization"]["offload_optimizer"]["device"] = device
        del config["optimizer"]
        with pytest.raises(ConfigError, match=named):
            infinity.initialize(model=model, config=config, optimizer=optimizer_class(model.parameters(), lr=1e-3))
        assert tree(nvme) == []


class HalvedLrAdam(torch.optim.Adam):
    """A user's Adam whose step() differs from torch's: it steps with half the learning rate."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] /= 2
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["lr"] *= 2


def test_adam_subclass_with_its_own_step_is_not_silently_replaced(nvme):
    """The tiles run torch's functional Adam, not the optimizer's step(). For a subclass of Adam that overrides
    step(), offload must either refuse it (ConfigError, as for RMSprop) or give the results the same optimizer
    gives without offload; training silently with plain Adam's update instead is wrong. It runs its own step per
    tile ([Note: elementwise optimizers])."""
    results = {}
    for device in ("none", "nvme"):
        model = build(MODEL)
        config = nvme_config(nvme)
        del config["optimizer"]
        if device == "none":
            del config["zero_optimization"]["offload_optimizer"]
        optimizer = HalvedLrAdam(model.parameters(), lr=1e-2, weight_decay=WEIGHT_DECAY)
        engine, *_ = infinity.initialize(model=model, config=config, optimizer=optimizer)
        for step in range(3):
            train_step(engine, step)
        results[device] = [p.detach().clone() for p in engine.module.parameters()]
        engine.destroy()
    unequal = sum(not torch.equal(a, b) for a, b in zip(results["none"], results["nvme"], strict=True))
    assert unequal == 0, f"offload ignored HalvedLrAdam.step(): {unequal} of {len(results['none'])} parameters differ"


# ---- running out of room ----
def test_file_size_limit_is_a_clear_error_at_initialize(nvme):
    """Free space cannot be made scarce cheaply here (the store's own tests cover the free-space check with a
    file larger than the disk). RLIMIT_FSIZE is a real limit an unprivileged process can set: the swap file's
    preallocation then fails with EFBIG (Python ignores SIGXFSZ), and initialize() must say so, naming the file,
    and leave nothing behind. The soft limit is restored at once; the hard one is not touched."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, hard))  # 16 KiB: the lock file fits, the swap file not
    try:
        with pytest.raises(AioError) as info:
            infinity.initialize(model=build(MODEL), config=nvme_config(nvme))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert info.value.errno == errno.EFBIG
    assert info.value.path.startswith(str(nvme)) and info.value.path.endswith("swap")
    assert info.value.path in str(info.value)
    assert tree(nvme) == []


# ---- what is left behind ----
CHILD = """
import sys, time
import torch
torch.set_num_threads(1)
import infinity
from tests.memory.test_offload_faults import nvme_config, swap_files, train_step, MODEL
from tests.distributed.training import build
engine, *_ = infinity.initialize(model=build(MODEL), config=nvme_config(sys.argv[1]))
train_step(engine, 0)
train_step(engine, 1)
print("ready", *swap_files(sys.argv[1]), flush=True)
"""


def spawn(nvme: Path, tail: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD + textwrap.dedent(tail), str(nvme)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_ready(child: subprocess.Popen) -> list[str]:
    words = child.stdout.readline().split()
    if words[:1] != ["ready"]:
        child.kill()
        raise AssertionError(f"the child did not get ready: {words} {child.communicate()[1]}")
    return words[1:]


def test_children_killed_or_ending_without_destroy(tmp_path, caplog):
    """Two real child processes train with nvme offload: one ends its script without destroy() (its files must
    be gone when it has exited), one is SIGKILLed (its folder stays, and the next engine's start removes it,
    saying so, while its own files stay until destroy())."""
    ends, killed = tmp_path / "ends", tmp_path / "killed"
    ends.mkdir()
    killed.mkdir()
    ending = spawn(ends, "")
    victim = spawn(killed, "time.sleep(120)")
    try:
        assert len(wait_ready(ending)) == 1
        (swap,) = wait_ready(victim)
        victim.kill()
        assert victim.wait(timeout=60) == -signal.SIGKILL
        assert ending.wait(timeout=60) == 0, ending.stderr.read()
    finally:
        for child in (ending, victim):
            child.kill()
            child.wait()
    assert tree(ends) == []
    stale = Path(swap).parent
    assert sorted(os.listdir(stale)) == ["lock", "swap"]
    with caplog.at_level(logging.WARNING, logger="infinity"):
        engine, *_ = infinity.initialize(model=build(MODEL), config=nvme_config(killed))
    try:
        assert not stale.exists() and not stale.parent.exists()
        assert [str(stale) in r.getMessage() for r in caplog.records if r.name == "infinity"] == [True]
        (mine,) = swap_files(killed)
        train_step(engine, 0)
    finally:
        engine.destroy()
    assert tree(killed) == []


def test_destroy_leaves_no_files(nvme):
    engine, *_ = infinity.initialize(model=build(MODEL), config=nvme_config(nvme, **PIPELINED))
    train_step(engine, 0)
    assert len(swap_files(nvme)) == 1
    engine.destroy()
    assert tree(nvme) == []


def test_host_memory_and_descriptors_stay_flat_over_50_steps(nvme):
    """50 steps through the NVMe ring (41 tiles, reads ahead and writes behind) after 5 warm-up steps: RSS within
    8 MiB (measured: +0.01 MiB; stage 3 is left out: its RSS settles ~6 MiB higher over 100 steps with or without
    offload, an allocator effect) and not one more open file descriptor or thread."""
    engine, *_ = infinity.initialize(model=build(MODEL), config=nvme_config(nvme, sub_group_size=512, **PIPELINED))
    try:
        assert len(engine.zero_optimizer.tiled.tiles) > 10
        for step in range(5):
            train_step(engine, step)
        process = psutil.Process()
        # Requests borrow the swap file's descriptors (none opened per request); count with no write behind.
        engine.zero_optimizer.tiled.manager.flush()
        gc.collect()
        rss, fds, threads = process.memory_info().rss, len(os.listdir("/proc/self/fd")), process.num_threads()
        for step in range(50):
            train_step(engine, step)
        engine.zero_optimizer.tiled.manager.flush()
        gc.collect()
        grown = (process.memory_info().rss - rss) / (1 << 20)
        assert grown <= 8, f"RSS grew {grown:.1f} MiB over 50 steps"
        assert len(os.listdir("/proc/self/fd")) == fds
        assert process.num_threads() == threads
    finally:
        engine.destroy()



def test_stage3_on_nvme_host_memory_and_descriptors_stay_flat_over_200_steps(nvme):
    """Stage 3 with parameters, optimizer states and the gradient (forced there) on NVMe, every piece read through the
    ring (max_in_cpu 0): after 20 warm-up steps, 200 more leave RSS within 8 MiB of where it was and flat over the
    last 100 (within 1 MiB; measured: +3 MiB over the first 100 steps as the allocator settles, +0.1 MiB over the
    last 100), with not one more open file descriptor or thread."""
    config = nvme_config(nvme, stage=3, sub_group_size=2048, **PIPELINED)  # 14 tiles through a 3-buffer ring
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0,
                                                    "buffer_count": 4}  # fmt: skip
    with gradients_on_nvme():
        engine, *_ = infinity.initialize(model=build(MODEL), config=config)
    try:
        stats = engine.tier_stats()
        assert set(stats["parameters"]["held_bytes"]) == {"nvme"} and set(stats["gradients"]["held_bytes"]) == {"nvme"}
        for step in range(20):
            train_step(engine, step)
        process = psutil.Process()
        gc.collect()
        start, fds, threads = process.memory_info().rss, len(os.listdir("/proc/self/fd")), process.num_threads()
        rss = []
        for step in range(200):
            train_step(engine, 20 + step)
            if step % 10 == 9:
                gc.collect()
                rss.append(process.memory_info().rss)
        mib = [round((r - start) / (1 << 20), 2) for r in rss]
        assert max(mib) <= 8, f"RSS above the warm-up's, MiB, every 10 steps: {mib}"
        assert max(rss[9:]) - rss[9] <= 1 << 20, f"RSS still growing over the last 100 steps, MiB: {mib}"
        assert len(os.listdir("/proc/self/fd")) == fds
        assert process.num_threads() == threads
        # Every step writes every piece back (the forward and backward after it may take them from the ring
        # buffers their writes left, while those still hold them: the step runs behind the forward).
        pieces = len(engine.stage3.table.shards.on_nvme)
        assert pieces >= 2
        assert engine.tier_stats()["parameters"]["traffic"]["nvme_write"]["requests"] >= 200 * pieces
    finally:
        engine.destroy()

# ---- accounting ----
@pytest.mark.parametrize("offload", [SERIAL, PIPELINED], ids=["plain", "pipelined"])
def test_tier_stats_show_every_tile_read_and_written_once_per_step(nvme, offload):
    """Per step, the NVMe reads and writes are exactly the rank's optimizer state (fp32 master + exp_avg +
    exp_avg_sq for AdamW): every tile read once and written once, after the initial write of every tile. Traffic is
    counted when a request is waited for: a step waits for all its reads; without pipeline_write it also waits for
    every write (the initial ones included), with it up to buffer_count writes may still be in flight when a step
    returns; destroy() finishes them."""
    engine, *_ = infinity.initialize(model=build(MODEL), config=nvme_config(nvme, sub_group_size=512, **offload))
    tiles = engine.zero_optimizer.tiled.tiles
    state = engine.optimizer_state_bytes()
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    assert state == 3 * 4 * sum(t.numel for t in tiles) and 3 * 4 * trainable <= state < 3 * 4 * (trainable + 1024)
    assert len(tiles) > 10
    stats = engine.tier_stats()["optimizer"]
    assert stats["held_bytes"] == {"nvme": state}
    largest = max(t.numel for t in tiles) * 3 * 4
    assert stats["staging_bytes"] >= 3 * largest
    assert stats["traffic"]["nvme_read"]["bytes"] == 0
    assert stats["traffic"]["nvme_write"]["bytes"] <= state  # the initial values, some perhaps still in flight
    steps = 4
    try:
        for step in range(steps):
            train_step(engine, step)
            traffic = engine.tier_stats()["optimizer"]["traffic"]
            read, write = traffic["nvme_read"], traffic["nvme_write"]
            assert (read["bytes"], read["requests"]) == ((step + 1) * state, (step + 1) * len(tiles)), step
            if offload.get("pipeline_write"):
                assert (step + 2) * state - 3 * largest <= write["bytes"] <= (step + 2) * state, step
            else:
                assert (write["bytes"], write["requests"]) == ((step + 2) * state, (step + 2) * len(tiles)), step
    finally:
        engine.destroy()
    traffic = engine.tier_stats()["optimizer"]["traffic"]
    assert traffic["nvme_read"]["bytes"] == steps * state
    assert traffic["nvme_write"]["bytes"] == (steps + 1) * state
    assert traffic["nvme_write"]["requests"] == (steps + 1) * len(tiles)


# ---- edits and several engines ----
def test_gathered_parameters_edit_reaches_the_swapped_masters(nvme):
    """Stage 3: an edit under GatheredParameters(modifier_rank=0) goes into the fp32 masters on NVMe, and training
    on from it gives bitwise the run without offload. Without clipping, so that only the masters' path is compared
    (clipping is covered by test_offload.py)."""
    results = {}
    for device in ("none", "nvme"):
        config = nvme_config(nvme, stage=3, clip=0.0, sub_group_size=64, **PIPELINED)
        if device == "none":
            del config["zero_optimization"]["offload_optimizer"]
        engine, *_ = infinity.initialize(model=build(MODEL), config=config)
        for step in range(2):
            train_step(engine, step)
        with infinity.zero.GatheredParameters([engine.module.head.weight], modifier_rank=0):
            engine.module.head.weight.data.fill_(0.25)
        pieces = own_pieces(engine)["head.weight"]  # read from the masters (fp32_shards)
        assert sum(v.numel() for _, v in pieces) == VOCAB * 32 and all(bool((v == 0.25).all()) for _, v in pieces)
        for step in range(2, 4):
            train_step(engine, step)
        with infinity.zero.GatheredParameters(list(engine.module.parameters())):
            results[device] = [p.detach().clone() for p in engine.module.parameters()]
        engine.destroy()
    assert all(torch.equal(a, b) for a, b in zip(results["none"], results["nvme"], strict=True))
    assert tree(nvme) == []


def test_two_engines_offload_to_nvme_at_once(nvme):
    """Two engines alive in one process (a GAN's generator and discriminator, a model and its teacher), both with
    offload_optimizer nvme on the same nvme_path, made within the same second as scripts do: each must get its own
    swap folder, both train, and destroy() removes both."""
    infinity.initialize(model=build("mlp"), config=nvme_config(nvme))[0].destroy()  # warm: the next take ~50 ms
    time.sleep(1.05 - time.time() % 1)  # start just after a second begins: both are made within it
    first, *_ = infinity.initialize(model=build("mlp"), config=nvme_config(nvme))
    try:
        second, *_ = infinity.initialize(model=build("mlp"), config=nvme_config(nvme))
    except BaseException:
        first.destroy()
        raise
    try:
        assert len(swap_files(nvme)) == 2
        for step in range(2):
            train_step(first, step, "mlp")
            train_step(second, step, "mlp")
    finally:
        first.destroy()
        second.destroy()
    assert tree(nvme) == []


def test_parameters_on_nvme_with_another_optimizer_evaluate_and_save(nvme, tmp_path):
    """Stage 3 with parameters on NVMe and a torch optimizer offload cannot run itself (Adagrad: stepped by the
    user's optimizer on the tiles), a ring of one staging buffer: training, an evaluation pass without gradients
    and save_16bit_model give bitwise what the same run with parameters in device memory gives."""
    results = {}
    for params in ("none", "nvme"):
        model = build("transformer")
        config = engine_config(stage=3, micro=4, accumulation=1, lr=1e-2, clip=1.0)
        del config["optimizer"]
        zero = config["zero_optimization"]
        zero.update(stage3_param_persistence_threshold=64, stage3_gather_16bit_weights_on_model_save=True)
        if params == "nvme":
            zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 1, "max_in_cpu": 0}
        optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-2)
        engine, *_ = infinity.initialize(model=model, config=config, optimizer=optimizer)
        losses = []
        for step in range(3):
            inputs, target = global_batch("transformer", step, 4)
            loss = loss_fn("transformer", engine(inputs), target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with torch.no_grad():
            inputs, _ = global_batch("transformer", 99, 4)
            evaluation = engine(inputs).clone()
        engine.save_16bit_model(tmp_path / f"saved-{params}")
        if params == "nvme":
            assert engine.stage3.table.shards.home.value == "nvme"
            assert engine.tier_stats()["parameters"]["traffic"]["nvme_read"]["bytes"] > 0
        engine.destroy()
        saved = load_file(tmp_path / f"saved-{params}" / "model.safetensors")
        results[params] = (losses, evaluation, saved)
    (want_losses, want_eval, want_saved), (losses, evaluation, saved) = results["none"], results["nvme"]
    assert losses == want_losses and torch.equal(evaluation, want_eval)
    assert saved.keys() == want_saved.keys() and all(torch.equal(saved[k], want_saved[k]) for k in saved)
    assert tree(nvme) == []


@pytest.mark.parametrize("failing", ["optimizer", "scheduler"])
def test_a_failed_initialize_leaves_no_hooks_and_no_swap_files(nvme, failing):
    """initialize() failing after the model was partitioned and the swap files made (the optimizer holds a tensor
    that is not the model's, found while its tiles are laid out; or the scheduler factory raises): the error comes
    through, and the model keeps no hook of the engine and nvme_path no file."""
    model = build("transformer")
    config = nvme_config(nvme, stage=3)
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
    kwargs = {}
    if failing == "optimizer":
        del config["optimizer"]
        stray = torch.nn.Parameter(torch.zeros(3))
        kwargs["optimizer"] = torch.optim.AdamW([*model.parameters(), stray], lr=1e-3)
        expected, message = ConfigError, "not a parameter of the model"
    else:

        def broken_scheduler(optimizer):
            raise RuntimeError("the scheduler factory failed")

        kwargs["lr_scheduler"] = broken_scheduler
        expected, message = RuntimeError, "the scheduler factory failed"
    with pytest.raises(expected, match=message):
        infinity.initialize(model=model, config=config, **kwargs)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert tree(nvme) == []


def test_a_buffer_count_the_ring_cannot_use_is_said_not_silently_raised(nvme, caplog):
    """offload_param.buffer_count 0 leaves no buffer to read a piece ahead into: the plan makes it 1, and says so
    (as it says of offload_optimizer's ring, which needs three)."""
    config = nvme_config(nvme, stage=3)
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 0}
    config["zero_optimization"]["offload_optimizer"]["buffer_count"] = 1
    with caplog.at_level(logging.INFO, logger="infinity"):
        engine, *_ = infinity.initialize(model=build(MODEL), config=config)
        engine.destroy()
    lines = [r.getMessage() for r in caplog.records]
    assert "offload_param.buffer_count 0 raised to 1 (a piece read ahead needs a buffer)" in lines, lines
    assert any(line.startswith("offload_optimizer.buffer_count 1 raised to 3") for line in lines), lines

"""The plan's own promises ([Note: one plan] in infinity/memory/plan.py): the node's host memory shared by its
ranks (capped by a container's cgroup, or by INFINITY_HOST_MEMORY_BYTES), and a run the disk cannot hold failing
in one line, with the total and the free space, before anything is written: initialize() sets the whole run's swap
files against the free space before it opens any; zero.Init, which cannot know the model's size, stops before the
disk has less than 10% free.

The free space is read through one function, infinity.memory.plan.disk_space; these tests make it report a small
disk, against which what the run really wrote under its folder is counted (the files are real, on the real disk,
and small: nothing is filled)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn

import infinity
import infinity.engine
from infinity.aio import buffers
from infinity.config import OffloadOptimizerConfig, ZeroConfig
from infinity.errors import ConfigError, TierBudgetError
from infinity.memory import plan as memory_plan
from infinity.memory.nvme_store import can_punch_holes

KiB, MiB = 1 << 10, 1 << 20


class SmallDisk:
    """``disk_space`` of a disk of ``size`` bytes with ``free`` left at the start, less the blocks of every file the
    run has made under ``root`` since."""

    def __init__(self, root, *, free: int, size: int) -> None:
        self.root, self.free, self.size = str(root), free, size
        self.lowest = free  # the least free space any check saw

    def written(self) -> int:
        return sum(os.stat(os.path.join(folder, name)).st_blocks * 512
                   for folder, _, names in os.walk(self.root) for name in names)  # fmt: skip

    def __call__(self, path: str):
        disk = memory_plan.Disk(os.path.abspath(path), 1, max(self.free - self.written(), 0), self.size)
        self.lowest = min(self.lowest, disk.free)
        return disk


def _config(nvme: str, stage: int = 3) -> dict:
    zero = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}
    if stage == 3:
        zero |= {"stage3_param_persistence_threshold": 0, "offload_param": {"device": "nvme", "nvme_path": nvme,
                                                                              "max_in_cpu": 0}}  # fmt: skip
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero}  # fmt: skip


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


@pytest.mark.parametrize("stage", [2, 3])
def test_initialize_refuses_a_run_the_disk_cannot_hold_before_writing(tmp_path, monkeypatch, one_thread, stage):
    """A disk 4 KiB short of what the run's swap files take is refused before any folder is made, and the model is
    left free for the retry on a disk that holds it. The plan's total is the files' real size (stage 2 exactly;
    stage 3 with the room it keeps for runs that param groups may cut: 4 KiB per parameter)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    measured, *_ = infinity.initialize(model=_model(), config=_config(str(nvme), stage))
    files = {owner: manager.store.layout.total_bytes for owner, manager in measured._tier_managers().items()}
    measured.destroy()
    total = sum(files.values())

    disk = SmallDisk(nvme, free=total - 4 * KiB, size=100 * MiB)
    monkeypatch.setattr(memory_plan, "disk_space", disk)
    model = _model()
    with pytest.raises(TierBudgetError) as raised:
        infinity.initialize(model=model, config=_config(str(nvme), stage))
    message = str(raised.value)
    assert "\n" not in message and f"'{nvme}'" in message and f"{memory_plan._human(total - 4 * KiB)} free" in message
    assert list(nvme.iterdir()) == [], "something was written before the check"
    monkeypatch.undo()
    engine, *_ = infinity.initialize(model=model, config=_config(str(nvme), stage))  # the same model: still free
    engine.destroy()

    need = measured.swap_need
    assert f"needs {memory_plan._human(need.parameters + need.optimizer + need.gradients)}" in message
    assert need.parameters == files.get("parameters", 0) and need.gradients >= files.get("gradients", 0)
    assert files["optimizer"] <= need.optimizer <= files["optimizer"] + (0 if stage == 2 else 4 * 4 * KiB)


def test_zero_init_stops_before_the_disk_is_under_a_tenth_free(tmp_path, monkeypatch):
    """zero.Init cannot know the model's size: each piece is checked, and the one that would leave the disk with
    less than 10% of its size free is refused, before it is written (its module named)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    size = 10 * MiB
    disk = SmallDisk(nvme, free=size // 10 + 100 * KiB, size=size)  # 100 KiB above the floor: a few 16 KiB pieces
    monkeypatch.setattr(memory_plan, "disk_space", disk)
    with pytest.raises(TierBudgetError) as raised, infinity.zero.Init(config=_config(str(nvme))):
        nn.Sequential(*(nn.Linear(64, 64) for _ in range(16)))  # a 16 KiB weight and a 4 KiB bias each
    message = str(raised.value)
    assert "\n" not in message and "under 10% of its 10.0 MiB" in message, message
    assert "zero.Init was writing the piece of a parameter of shape" in "".join(raised.value.__notes__)
    assert size // 10 <= disk.lowest < size // 10 + 16 * KiB  # it stopped at the floor, not before nor after
    del raised
    gc.collect()
    assert not any(nvme.iterdir()), "zero.Init's swap files outlived its pieces"


def test_zero_init_pieces_give_their_room_to_the_run_as_initialize_takes_them(tmp_path, monkeypatch, one_thread):
    """zero.Init's pieces on the run's NVMe folder are given back one by one as initialize() takes them, into
    files opened sparse and reserved at the end ([Note: deferred reservation] in infinity/memory/nvme_store.py):
    a disk that had room for the run's files but not for them beside the Init copy trains, and the blocks under
    the folder never exceed the run's files by more than a quarter of the copy (they were the sum: the files
    were preallocated before the first piece was taken). Every run file is reserved at the end."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    if not can_punch_holes(str(nvme)):
        pytest.skip("the temporary folder's filesystem cannot punch holes (the engine gives no credit there)")
    wide = lambda: nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))  # noqa: E731  (8 units of 256 KiB)
    measured, *_ = infinity.initialize(model=wide(), config=_config(str(nvme)))
    files = sum(manager.store.layout.total_bytes for manager in measured._tier_managers().values())
    measured.destroy()

    disk = SmallDisk(nvme, free=files + 256 * KiB, size=files)  # the files (and the plan's slack), not the copy
    monkeypatch.setattr(memory_plan, "disk_space", disk)
    with infinity.zero.Init(config=_config(str(nvme))):
        model = wide()
    init = disk.written()
    assert init > 8 * 256 * KiB
    peak = [init]
    taking = infinity.engine.take_whole

    def take_and_measure(param):
        whole = taking(param)
        peak[0] = max(peak[0], disk.written())
        return whole

    monkeypatch.setattr(infinity.engine, "take_whole", take_and_measure)
    engine, *_ = infinity.initialize(model=model, config=_config(str(nvme)))
    assert peak[0] <= files + init // 4, (peak[0], files, init)
    gc.collect()
    assert disk.written() >= files  # reserved (preallocated) now that the pieces are gone
    x = torch.randn(2, 256)
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("case", ["d-and-d-slash", "no-punch-hole"])
def test_zero_init_copy_is_credited_once_and_only_where_it_gives_room_back(case, tmp_path, monkeypatch, one_thread):
    """The copy counts once for a folder named two ways ("d" for the parameters, "d/" for the optimizer): a disk
    that held the run less half the copy is refused. On a filesystem that cannot punch holes (probed) the copy
    stays until its last piece is taken, so it earns no credit: a disk with room for the run alone is refused."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = _config(str(nvme))
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(nvme) + "/"
    wide = lambda: nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))  # noqa: E731
    measured, *_ = infinity.initialize(model=wide(), config=config)
    files = sum(manager.store.layout.total_bytes for manager in measured._tier_managers().values())
    measured.destroy()
    init = 8 * (256 * 256 * 4 + 4 * KiB)  # the fp32 pieces, each padded to 4 KiB
    if case == "d-and-d-slash" and not can_punch_holes(str(nvme)):
        pytest.skip("the temporary folder's filesystem cannot punch holes (no credit to give twice)")
    if case == "no-punch-hole":
        monkeypatch.setattr(infinity.engine, "can_punch_holes", lambda folder: False)
        free = files + 256 * KiB
    else:
        free = files - init // 2
    monkeypatch.setattr(memory_plan, "disk_space", SmallDisk(nvme, free=free, size=files))
    with infinity.zero.Init(config=config):
        model = wide()
    with pytest.raises(TierBudgetError, match="initialize\\(\\): the run's NVMe swap files needs"):
        infinity.initialize(model=model, config=config)


def test_the_node_is_shared_by_its_ranks_and_every_rank_decides_alike():
    """Pure: the host share is the smallest host's memory over its ranks; a filesystem's need is every rank's on
    that host, and another host's disk is its own."""
    disk = memory_plan.Disk("/swap", 7, free=10 * MiB, size=100 * MiB)
    a = memory_plan.RankFacts("a", 64 * MiB, (disk,))
    b = memory_plan.RankFacts("b", 16 * MiB, (disk,))
    node = memory_plan.Node(rank=0, ranks=(a, a, a, b), paths=("/swap",))
    assert (node.local_ranks, node.host_share) == (3, 16 * MiB)
    memory_plan.check_room(node, {"/swap": 3 * MiB}, what="the run", detail="")  # 9 MiB on a, 3 on b: fits
    with pytest.raises(TierBudgetError, match=r"needs 12.0 MiB on '/swap' on a \(3 rank\(s\) x 4.0 MiB"):
        memory_plan.check_room(node, {"/swap": 4 * MiB}, what="the run", detail="")
    plan = memory_plan.make_plan(ZeroConfig(), world_size=4, local_ranks=node.local_ranks,
                                 host_share=node.host_share, state_width=3)  # fmt: skip
    assert plan.host_cache_bytes == 4 * MiB and plan.staging_bytes == 1 * MiB and plan.tile_numel % 64 == 0
    assert plan.checkpoint_io_bytes == 1 * MiB  # a save's transfers in flight share the node too
    roomy = memory_plan.make_plan(ZeroConfig(), world_size=1, local_ranks=1, host_share=1 << 40, state_width=3)
    assert roomy.checkpoint_io_bytes == memory_plan.CHECKPOINT_IO_BYTES


@pytest.mark.parametrize("stage", [2, 3])
def test_the_gradient_stays_in_host_memory_while_a_quarter_of_the_share_holds_it(stage):
    """Pure: with the optimizer on NVMe, stage 3's reduced fp32 gradient goes to NVMe too only when it is larger
    than a quarter of the rank's host share (its tiles then get a gradient ring, so they are cut smaller); the swap
    files count it only then. Stages 1-2 keep it in host memory whatever its size."""
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadOptimizerConfig(device="nvme", nvme_path="/swap"))
    share, tile_elements = 1024 * MiB, 1 << 22  # rings of 64 MiB: tiles above MIN_TILE_NUMEL either way
    layout = memory_plan.LayoutSizes(runs=(tile_elements,) * 8)

    def plan(gradient_bytes: int):
        made = memory_plan.make_plan(zero, world_size=1, local_ranks=1, host_share=share, state_width=3,
                                     gradient_bytes=gradient_bytes)  # fmt: skip
        return made, memory_plan.swap_need(made, zero, layout, state_width=3, param_itemsize=4)

    fits, fits_need = plan(share // 4)
    larger, larger_need = plan(share // 4 + 1)
    assert not fits.gradients_on_nvme and fits_need.gradients == 0
    assert larger.gradients_on_nvme == (stage == 3)
    if stage == 3:
        assert larger_need.gradients > 0 and larger.tile_numel < fits.tile_numel  # 4 fp32 per element, not 3
    else:
        assert larger_need.gradients == 0 and larger.tile_numel == fits.tile_numel


@pytest.mark.parametrize("stage", [2, 3])
def test_the_optimizer_ring_holds_the_largest_units_tiles_within_its_bounds(stage):
    """Pure ([Note: the lead unit's ring]): at stage 3 with the optimizer on NVMe the ring takes a buffer per tile
    of the largest unit piece, and one more, so the step's first unit is read whole during backward; never fewer
    than buffer_count, never more than LEAD_RING_BYTES or a sixteenth of the share, and the tiles stay the size
    the default ring gives them. Stages 1-2, and a unit that fits the default ring, change nothing."""
    zero = ZeroConfig(stage=stage, offload_optimizer=OffloadOptimizerConfig(device="nvme", nvme_path="/swap"))

    def plan(largest: int, share: int = 16 << 30):
        return memory_plan.make_plan(zero, world_size=1, local_ranks=1, host_share=share, state_width=3,
                                     largest_unit_numel=largest)  # fmt: skip

    default = plan(0)
    tile, buffers = default.tile_numel, default.optimizer_buffers  # 256 MiB in 4 buffers: ~5.6M-element tiles
    buffer_bytes = tile * 12
    gpt2_embedding = plan(38_597_376)  # GPT-2 small's tied embedding at world size 1: 7 tiles
    assert plan(tile).optimizer_buffers == buffers  # one tile and one more: under buffer_count
    huge = plan(262_668_288)  # a 128k-token, 2048-wide embedding: 47 tiles, more than LEAD_RING_BYTES holds
    small_share = plan(38_597_376, share=4 * buffer_bytes * memory_plan.STAGING_PART)  # a sixteenth: 4 buffers
    for made in (gpt2_embedding, huge, small_share):
        assert made.tile_numel == tile
    if stage == 2:
        assert gpt2_embedding.optimizer_buffers == huge.optimizer_buffers == buffers
        return
    assert gpt2_embedding.optimizer_buffers == 8
    assert plan(4 * tile + 1).optimizer_buffers == 6  # 5 tiles and one more: under the cap
    assert huge.optimizer_buffers == memory_plan.LEAD_RING_BYTES // buffer_bytes
    assert small_share.optimizer_buffers == buffers
    on_cpu = ZeroConfig(stage=3, offload_optimizer=OffloadOptimizerConfig(device="cpu"))
    tiny_tiles = ZeroConfig(stage=3, sub_group_size=512,
                            offload_optimizer=OffloadOptimizerConfig(device="nvme", nvme_path="/swap"))  # fmt: skip
    for zero_ in (on_cpu, tiny_tiles):  # no NVMe ring; tiles below MIN_TILE_NUMEL: the ring stays as asked
        made = memory_plan.make_plan(zero_, world_size=1, local_ranks=1, host_share=16 << 30, state_width=3,
                                     largest_unit_numel=38_597_376)  # fmt: skip
        assert made.optimizer_buffers == buffers


def test_a_save_and_a_load_queue_no_more_than_the_plan_allows(tmp_path, monkeypatch, one_thread):
    """The checkpoint's transfers in flight are the plan's, from the rank's host share (a sixteenth of
    INFINITY_HOST_MEMORY_BYTES here: 4 MiB), not a fixed size per rank: the most ever queued stays within it
    (plus the one request that crossed it) while the checkpoint holds several times as much."""
    import torch

    from infinity.checkpoint import chunk_io

    monkeypatch.setenv(memory_plan.HOST_MEMORY_ENV, str(64 * MiB))
    queued = []
    original = chunk_io.ChunkIO._queue

    def recording(self, request, tensor, then):
        original(self, request, tensor, then)
        queued.append((self._bytes, self.max_in_flight_bytes, tensor.numel() * tensor.element_size()))

    monkeypatch.setattr(chunk_io.ChunkIO, "_queue", recording)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # 8 MiB of fp32 weights, 24 MiB with Adam's
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = infinity.initialize(model=model, config=config, model_parameters=model.parameters())
    try:
        engine.backward(engine(torch.randn(2, 512)).pow(2).mean())
        engine.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    finally:
        engine.destroy()
    assert engine.plan.checkpoint_io_bytes == 4 * MiB
    assert sum(nbytes for *_, nbytes in queued) > 4 * engine.plan.checkpoint_io_bytes, "too small to prove it"
    assert {bound for _, bound, _ in queued} == {4 * MiB}
    largest = max(nbytes for *_, nbytes in queued)
    assert max(in_flight for in_flight, *_ in queued) <= 4 * MiB + largest


def test_the_host_memory_to_plan_with_can_be_capped(monkeypatch):
    monkeypatch.setenv(memory_plan.HOST_MEMORY_ENV, str(MiB))
    assert memory_plan.host_memory_bytes() == MiB
    monkeypatch.setenv(memory_plan.HOST_MEMORY_ENV, "lots")
    with pytest.raises(ConfigError, match="INFINITY_HOST_MEMORY_BYTES='lots'"):
        memory_plan.host_memory_bytes()


def test_a_containers_memory_limit_caps_the_host_memory(tmp_path):
    """MemAvailable is the machine's; a container's cgroup may allow less (limit - usage + the inactive page cache
    the kernel reclaims first), the tightest of the cgroup and its ancestors. v2 and v1 layouts."""
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    pod, app = root / "pod", root / "pod" / "app"
    app.mkdir(parents=True)
    for folder, values in ((pod, {"memory.max": 8 << 30, "memory.current": 6 << 30}),
                           (app, {"memory.max": "max", "memory.current": 5 << 30})):  # fmt: skip
        for name, value in values.items():
            (folder / name).write_text(f"{value}\n")
    (pod / "memory.stat").write_text(f"anon 5\ninactive_file {1 << 30}\n")
    proc.write_text("0::/pod/app\n")
    assert buffers.cgroup_room(str(proc), str(root)) == 3 << 30
    (pod / "memory.max").write_text("max\n")
    assert buffers.cgroup_room(str(proc), str(root)) is None

    v1 = root / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{40 << 30}\n")
    proc.write_text("4:memory:/job\n3:cpu:/\n")
    assert buffers.cgroup_room(str(proc), str(root)) == 1 << 30

"""CUDA paths that a CPU machine cannot exercise: stage 3 with parameters on the device and fetch headers on a
gloo side group next to NCCL, zero.Init pieces on the device or in host memory as each module is built, and stage 2
with the optimizer offloaded to the host (device -> host gradient copies that must be complete before the step reads
them), the reduced gradient streamed to pinned host memory rather than held on the device, host pieces rewritten
by the step only after their copy to the device has finished, and ZeRO-Infinity offload of parameters and
optimizer to pinned host memory and NVMe.

Skipped without CUDA; the NCCL tests need two GPUs. `benchmarks/gpu/run_checks.sh` runs them on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import infinity
import infinity.zero
from tests.distributed.training import gradients_on_nvme

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS, MICRO, RTOL = 8, 8, 1e-5


def mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))


def batches():
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(MICRO, 32, generator=gen), torch.randn(MICRO, 4, generator=gen)) for _ in range(STEPS)]


def config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def plain_cuda():
    model = mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        loss = F.mse_loss(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def engine_losses(engine):
    losses = []
    for x, y in batches():
        loss = F.mse_loss(engine(x), y.cuda())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    return losses, params


def assert_close(got, want) -> None:
    (got_losses, got_params), (want_losses, want_params) = got, want
    for a, b in zip(got_losses, want_losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (got_losses, want_losses)
    for name, value in want_params.items():
        error = float((got_params[name] - value).abs().max() / value.abs().max())
        assert error <= 1e-4, f"{name}: {error:.2e}"  # TF32 and cuBLAS split-K differ from run to run


@pytest.mark.parametrize("offload", [False, True])
def test_stage2_on_cuda_matches_plain_pytorch(offload):
    """With the optimizer on the host, each reduced gradient piece is copied device -> host and added at once:
    a non-blocking copy there would be read before it lands (silently wrong gradients)."""
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    engine, *_ = infinity.initialize(model=mlp(), config=config(2, reduce_bucket_size=5000, **zero))
    assert_close(engine_losses(engine), plain_cuda())
    engine.destroy()


def test_stage3_partitions_on_the_device_without_moving_the_whole_model():
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = mlp()  # on the host
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    engine, *_ = infinity.initialize(model=model, config=config(3))
    assert all(p.device.type == "cuda" for p in engine.module.parameters())
    assert engine.stage3.table.shards.flat.device.type == "cuda"
    # one unit's fp32 staging at a time, plus the shard, its fp32 copy and the masters: never the model twice
    assert torch.cuda.max_memory_allocated() - before < 4 * whole, torch.cuda.max_memory_allocated() - before
    assert_close(engine_losses(engine), plain_cuda())
    engine.destroy()


@pytest.mark.parametrize(
    "optimizer_device,param_device,max_in_cpu",
    [("cpu", "cpu", 0), ("nvme", "nvme", 0), ("nvme", "nvme", 10_000), ("nvme", "none", 0)],
)
def test_offload_on_cuda_matches_plain_pytorch(tmp_path, optimizer_device, param_device, max_in_cpu):
    """Offload with CUDA: pinned host homes and staging buffers, gradients copied device -> host for the tiles,
    new weights host -> device, parameter pieces read from NVMe into the gathered buffer on the device. The
    parameter shard and the optimizer tiles must not live in device memory. max_in_cpu 10000 keeps the first
    and last Linear's pieces in pinned host memory (copied host -> device at each gather), the middle on NVMe."""
    zero = {"offload_optimizer": {"device": optimizer_device, "nvme_path": str(tmp_path), "pin_memory": True,
                                  "pipeline_read": True, "pipeline_write": True}}  # fmt: skip
    if param_device != "none":
        zero["offload_param"] = {"device": param_device, "nvme_path": str(tmp_path), "pin_memory": True,
                                 "max_in_cpu": max_in_cpu}  # fmt: skip
    engine, *_ = infinity.initialize(model=mlp(), config=config(3, **zero))
    homes = engine.tier_stats()["optimizer"]["held_bytes"]
    assert set(homes) == {"host" if optimizer_device == "cpu" else "nvme"}
    shards = engine.stage3.table.shards
    assert shards.home.value == {"none": "device", "cpu": "host", "nvme": "nvme"}[param_device]
    assert shards.flat is None or shards.flat.device.type == ("cuda" if param_device == "none" else "cpu")
    if param_device == "nvme":
        assert sorted(shards.kept) == ([0, 2] if max_in_cpu else [])
        assert all(shards.edit(index).is_pinned() and shards.on_device(index) is None for index in shards.kept)
    assert_close(engine_losses(engine), plain_cuda())
    engine.destroy()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("stage", "param_device"), [(2, "none"), (3, "none"), (3, "nvme")])
def test_split_masters_on_cuda_train_as_fp32_masters(tmp_path, stage, param_device):
    """bf16 weights on the device (or their pieces on NVMe), the optimizer in host memory with split masters
    ([Note: split masters]): the first values come from the device and are split on the host, the step joins
    each master with its weights copied device -> host; the losses are fp32 masters' (the same weights)."""

    def run(master: str) -> list[float]:
        zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
        if param_device == "nvme":
            zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
        cfg = {**config(stage, **zero), "bf16": {"enabled": True}, "infinity": {"offloaded_master": master}}
        engine, *_ = infinity.initialize(model=mlp(), config=cfg)
        losses = []
        for x, y in batches():
            loss = F.mse_loss(engine(x).float(), y.cuda())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
        return losses

    want, got = run("fp32"), run("split")
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (got, want)  # cuBLAS may differ run to run; the weights do not


@pytest.mark.parametrize("param_device", ["none", "nvme"])
def test_the_step_behind_the_forward_on_cuda_is_the_step_in_engine_step(tmp_path, param_device):
    """Stage 3, the optimizer on NVMe, weights on the device (or their pieces on NVMe): each unit's tiles step
    inside the next forward's gather ([Note: step behind forward]), writing the new weights into the device piece
    (or the host piece copied to it on the side stream); the weights equal those of the whole step inside
    engine.step(), bitwise (the same kernels on the host, the same copies)."""

    def run(behind: bool) -> tuple[list[float], dict]:
        zero = {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True}}
        if param_device == "nvme":
            zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                                     "max_in_cpu": 0}  # fmt: skip
        cfg = {**config(3, **zero), "infinity": {"step_behind_forward": behind}}
        engine, *_ = infinity.initialize(model=mlp(), config=cfg)
        trained = engine_losses(engine)  # its GatheredParameters block steps the last step's units first
        engine.destroy()
        return trained

    (want_losses, want), (got_losses, got) = run(False), run(True)
    assert all(torch.equal(want[name], got[name]) for name in want)
    for a, b in zip(got_losses, want_losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)  # cuBLAS may differ run to run; the weights do not


def test_the_step_in_backward_on_cuda_is_the_step_in_engine_step():
    """Stage 3, the optimizer in pinned host memory, weights on the device: each unit's reduced piece is copied
    into one reused host buffer and its tiles step inside backward ([Note: step in backward]); the weights and the
    norm equal those of the step in engine.step() (which streams the pieces into the host gradient), bitwise."""

    def run(in_backward: bool) -> tuple[tuple[list[float], dict], list[float]]:
        zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
        cfg = {**config(3, **zero), "infinity": {"step_in_backward": in_backward}}
        engine, *_ = infinity.initialize(model=mlp(), config=cfg)
        norms = []
        engine.step = _and_record_norm(engine, norms)
        trained = engine_losses(engine)
        assert engine.zero_optimizer.steps_taken_in_backward == (STEPS if in_backward else 0)
        engine.destroy()
        return trained, norms

    ((want_losses, want), want_norms), ((got_losses, got), got_norms) = run(False), run(True)
    assert all(torch.equal(want[name], got[name]) for name in want)
    assert got_norms == want_norms
    for a, b in zip(got_losses, want_losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)


def _and_record_norm(engine, norms: list[float]):
    step = engine.step

    def recorded() -> None:
        step()
        norms.append(engine.get_global_grad_norm())

    return recorded


@pytest.mark.parametrize("param_device", ["cpu", "nvme"])
def test_stage_in_copies_run_on_the_side_stream(tmp_path, monkeypatch, param_device):
    """[Note: copy stream]: every host -> device copy of a parameter piece from host memory (a staging buffer, the
    host home, a piece kept after the step) is queued on the side stream, not on the compute stream, and each is
    joined to the compute stream; the results are still plain PyTorch's. (Pieces read from NVMe straight into
    device memory take the I/O engine's bounce path, not counted here.)"""
    from infinity.memory.copies import CopyStream

    seen, joins = [], []
    original_copy, original_join = CopyStream.copy, CopyStream.join

    def copy(self, out, source, **kwargs):
        if out.is_cuda:
            seen.append(torch.cuda.current_stream(out.device) == self.stream)
            torch.cuda._sleep(10**6)  # a slow copy: a missing join would let compute read the buffer too early
        return original_copy(self, out, source, **kwargs)

    def join(self, event, buffer):
        joins.append(event is not None)
        return original_join(self, event, buffer)

    monkeypatch.setattr(CopyStream, "copy", copy)
    monkeypatch.setattr(CopyStream, "join", join)
    zero = {"offload_param": {"device": param_device, "nvme_path": str(tmp_path), "pin_memory": True,
                              "max_in_cpu": 0}}  # fmt: skip
    engine, *_ = infinity.initialize(model=mlp(), config=config(3, **zero))
    got = engine_losses(engine)
    engine.destroy()
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} copies on the compute stream"
    assert joins and all(joins)
    assert_close(got, plain_cuda())


def test_nvme_gradients_accumulate_on_cuda(tmp_path):
    """Stage 3 with the gradient on NVMe with the optimizer ([Note: swapped gradients]; forced: this model's
    gradient would fit the host share): with two micro-steps per step the second reduced piece (on the device) is
    added to the first one read back into a host buffer."""
    zero = {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "max_in_cpu": 0}}
    settings = config(3, **zero)
    settings["train_micro_batch_size_per_gpu"] = MICRO // 2
    settings["gradient_accumulation_steps"] = 2
    with gradients_on_nvme():
        engine, *_ = infinity.initialize(model=mlp(), config=settings)
    assert "gradients" in engine.tier_stats()
    losses = []
    for x, y in batches():
        total = 0.0
        for half in (slice(0, MICRO // 2), slice(MICRO // 2, MICRO)):
            loss = F.mse_loss(engine(x[half]), y[half].cuda())
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        losses.append(total)
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    assert_close((losses, params), plain_cuda())  # the mean over two halves is the mean over the batch
    assert list(tmp_path.iterdir()) == []


def test_zero_init_keeps_pieces_on_the_device():
    with infinity.zero.Init():
        model = mlp()
    pieces = [infinity.zero.init.init_shard(p).piece for p in model.parameters()]
    assert all(piece.device.type == "cuda" for piece in pieces)
    engine, *_ = infinity.initialize(model=model, config=config(3))
    assert_close(engine_losses(engine), plain_cuda())
    engine.destroy()


def deep_mlp() -> nn.Module:
    """64 layers of 512 x 512 (1 MiB each in fp32): a step's gradient is 64 MiB, one layer's is small beside it."""
    torch.manual_seed(5)
    layers = []
    for _ in range(64):
        layers += [nn.Linear(512, 512, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def deep_batches(steps: int):
    gen = torch.Generator().manual_seed(13)
    return [(torch.randn(8, 512, generator=gen), torch.randn(8, 512, generator=gen)) for _ in range(steps)]


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_optimizer_streams_the_gradient_to_pinned_host_memory(stage):
    """[Note: gradient shards]: with offload_optimizer cpu the reduced fp32 gradient (4 bytes per parameter, twice
    the 16-bit weights) lives in pinned host memory and each piece is streamed there as it is reduced: over a
    step (two micro-steps, so pieces are also added on the host) the device's peak stays far below the gradient
    shard, which was allocated whole on the device before; so does the memory the allocator reserves from an empty
    cache (device pieces whose copies lag would show there). The result is plain PyTorch's."""
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "reduce_bucket_size": 512 * 512}
    if stage == 3:  # parameters in host memory; at most four layers gathered at once
        zero.update(offload_param={"device": "cpu", "pin_memory": True}, stage3_max_live_parameters=4 * 512 * 512,
                    stage3_prefetch_bucket_size=2 * 512 * 512, stage3_max_reuse_distance=0)  # fmt: skip
    settings = config(stage, **zero)
    settings.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    settings["optimizer"]["params"]["lr"] = 1e-3
    engine, *_ = infinity.initialize(model=deep_mlp(), config=settings)
    gradient_bytes = 4 * sum(p.numel() for p in deep_mlp().parameters())  # at world size 1: the whole gradient
    losses, peaks, reserved = [], [], []
    for step, (x, y) in enumerate(deep_batches(3)):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before, cached = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        total = 0.0
        for half in (slice(0, 4), slice(4, 8)):
            loss = F.mse_loss(engine(x[half]), y[half].cuda())
            engine.backward(loss)
            if half.start == 0:
                shards = engine.zero_optimizer.gradients_in_memory
                assert shards.home == "host" and shards.held_bytes() >= gradient_bytes
                assert all(t.is_pinned() for t in shards.tensors())
            engine.step()
            total += loss.item() / 2
        losses.append(total)
        if step > 0:  # the first step records the trace and allocates what every step reuses
            peaks.append(torch.cuda.max_memory_allocated() - before)
            reserved.append(torch.cuda.max_memory_reserved() - cached)
    assert max(peaks) < gradient_bytes / 2, f"device peak {max(peaks) / 2**20:.1f} MiB over a step"
    assert max(reserved) < 3 * gradient_bytes / 4, f"reserved {max(reserved) / 2**20:.1f} MiB more over a step"
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()

    model = deep_mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    want = []
    for x, y in deep_batches(3):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    assert_close((losses, params), (want, {n: p.detach().cpu() for n, p in model.named_parameters()}))


@pytest.mark.parametrize("how", ["remote_device", "config"])
def test_zero_init_puts_pieces_in_host_memory_as_each_module_is_built(how):
    """zero.Init with remote_device="cpu" (or offload_param cpu in its config) sends each piece to host memory as
    its module is built ([Note: zero.Init]): the device holds one parameter at a time, never the model's 1/N share
    (here the whole model, at world size 1); initialize() with offload_param cpu then trains it like plain PyTorch."""
    settings = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    arguments = {"remote_device": "cpu"} if how == "remote_device" else {"config": settings}
    width, layers = 1024, 32  # 4 MiB per layer, 128 MiB in all
    layer_bytes = width * width * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with infinity.zero.Init(**arguments):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    assert all(infinity.zero.init.init_shard(p).piece.device.type == "cpu" for p in model.parameters())
    assert held < layer_bytes and peak <= 3 * layer_bytes, f"held {held / 2**20:.0f} MiB, peak {peak / 2**20:.0f}"
    del model
    with infinity.zero.Init(**arguments):
        small = mlp()
    zero = {"offload_param": {"device": "cpu", "pin_memory": True}}
    engine, *_ = infinity.initialize(model=small, config=config(3, **zero))
    assert engine.stage3.table.shards.home.value == "host"
    assert_close(engine_losses(engine), plain_cuda())
    engine.destroy()


def test_the_step_rewrites_a_host_piece_only_after_its_copy_to_the_device():
    """[Note: host copies]: a unit's piece in pinned host memory is copied to the device without blocking when the
    unit is gathered, and rewritten in place by the step. Here the copy is held back on its stream (a sleep
    queued before it); the host's write of new weights must wait for it, or the gather would carry them."""
    zero = {"offload_param": {"device": "cpu", "pin_memory": True}}
    engine, *_ = infinity.initialize(model=mlp(), config=config(3, **zero))
    shards = engine.stage3.table.shards
    assert shards.flat.is_pinned()
    index = engine.stage3.table.units[-1].index
    old = shards.read(index).clone()
    out = torch.empty_like(old, device="cuda")
    with shards.copies.side():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the side stream before the copy starts
        shards.load_into(index, out)
    shards.edit(index).fill_(123.0)  # what the step does with a tile's new weights
    shards.commit(index)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), old), "the copy read weights written after it was queued"
    engine.destroy()


NCCL_SCRIPT = textwrap.dedent(
    """
    import sys, torch, infinity, infinity.zero
    from torch.nn import functional as F
    sys.path.insert(0, sys.argv[1])
    from tests.gpu.test_cuda_paths import batches, config, mlp
    engine, *_ = infinity.initialize(model=mlp(), config=config(3))
    assert torch.distributed.get_backend() == "nccl"
    rank = engine.global_rank
    for x, y in batches():
        half = slice(rank * 4, rank * 4 + 4)
        engine.backward(F.mse_loss(engine(x[half]), y[half].cuda()))
        engine.step()
    print("ok", rank, engine.zero_stats()["prefetched_fraction"], flush=True)
    """
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_stage3_over_nccl(tmp_path):
    """Fetch headers travel on a gloo side group (host tensors, no device sync); units over NCCL."""
    script = tmp_path / "nccl.py"
    script.write_text(NCCL_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
               "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script), root]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok") == 2, done.stdout


ORDER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, infinity
    from torch.nn import functional as F
    sys.path.insert(0, sys.argv[1])
    from infinity.zero import collectives
    from tests.distributed.test_collective_order import MICRO, Branchy, config
    engine, *_ = infinity.initialize(model=Branchy(), config=config())
    assert torch.distributed.get_backend() == "nccl" and engine.stage3.coordinator.one_order
    rank, issued = engine.global_rank, []
    gather, reduce = collectives.all_gather_pieces, collectives.reduce_scatter_mean

    def logged_gather(comm, flat, piece, *, async_op):
        issued.append(["all-gather", comm.name, flat.numel()])
        return gather(comm, flat, piece, async_op=async_op)

    def logged_reduce(comm, output, flat, *, async_op):
        issued.append(["reduce-scatter", comm.name, flat.numel()])
        return reduce(comm, output, flat, async_op=async_op)

    collectives.all_gather_pieces, collectives.reduce_scatter_mean = logged_gather, logged_reduce
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(2 * MICRO, 8, generator=gen), torch.randn(2 * MICRO, 4, generator=gen)
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[part]), y[part].cuda()))
        engine.step()
    torch.cuda.synchronize()
    print("issued", rank, json.dumps(issued), flush=True)
    """
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_fetches_and_reductions_in_one_order_over_nccl(tmp_path):
    """[Note: one collective order]: a rank-dependent branch (tests/distributed/test_collective_order.py) makes the
    ranks' backwards differ; the fetch group's all-gathers and the data-parallel group's reduce-scatters must still
    be issued in one order on every rank. CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream's kernels in one queue,
    so two orders would deadlock (here: time out) rather than pass by luck."""
    script = tmp_path / "order.py"
    script.write_text(ORDER_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
               "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(script), root]  # fmt: skip
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    issued = dict(line.split(" ", 2)[1:] for line in done.stdout.splitlines() if line.startswith("issued "))
    assert set(issued) == {"0", "1"} and issued["0"] == issued["1"], done.stdout[-3000:]

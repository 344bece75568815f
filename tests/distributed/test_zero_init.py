"""zero.Init, GatheredParameters and save_16bit_model, over real gloo processes."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import infinity
import infinity.memory.host
import infinity.zero
from infinity.errors import ConfigError
from infinity.memory.host import process_status_bytes
from infinity.zero.init import init_shard
from tests.distributed.harness import run_distributed
from tests.distributed.training import (
    build,
    engine_config,
    global_batch,
    loss_fn,
    own_pieces,
    pieces_error,
    train_reference,
)

MiB = 2**20


def _nvme_config(nvme_path: str) -> dict:
    return {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme_path}}}


def _construction_peak(rank: int, world_size: int, layers: int, width: int, use_init: bool,
                       nvme_path: str | None = None) -> dict:  # fmt: skip
    # as Init does on entry: the plain build is measured alike
    infinity.memory.host.fix_heap_policy(infinity.memory.host.BUILD)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = process_status_bytes("VmRSS")
    if use_init:
        with infinity.zero.Init(config=None if nvme_path is None else _nvme_config(nvme_path)):
            model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    else:
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    peak = process_status_bytes("VmHWM") - before
    placeholders = all(p.numel() == 0 for p in model.parameters())
    on_disk, left = 0, []
    if nvme_path is not None:
        on_disk = sum(f.stat().st_size for f in Path(nvme_path).rglob(f"rank{rank}/*") if f.name != "lock")
        del model
        gc.collect()
        left = [str(f) for f in Path(nvme_path).rglob(f"rank{rank}/swap")]  # the pieces' store goes with them
    return {"peak": peak, "placeholders": placeholders, "on_disk": on_disk, "left": left}


def test_init_builds_a_model_8x_the_per_rank_budget_within_1_over_n(tmp_path):
    layers, width = 32, 2048  # 32 layers of 16 MiB: 512 MiB; per-rank budget 64 MiB, so 8x
    total, largest = layers * width * width * 4, width * width * 4
    (tmp_path / "init").mkdir()
    partitioned = run_distributed(
        _construction_peak, 2, tmp_path / "init", timeout_s=120, layers=layers, width=width, use_init=True
    )
    for result in partitioned:
        assert result["placeholders"]
        assert result["peak"] <= total / 2 + 2 * largest + 64 * MiB, f"peak {result['peak'] / MiB:.0f} MiB"
    (tmp_path / "plain").mkdir()
    plain = run_distributed(
        _construction_peak, 1, tmp_path / "plain", timeout_s=120, layers=layers, width=width, use_init=False
    )
    assert plain[0]["peak"] >= 0.9 * total  # the measurement sees a whole model when there is one


def test_init_with_nvme_builds_a_model_holding_one_layer_at_a_time(tmp_path):
    """offload_param nvme in the config: each piece goes to NVMe as its layer is built, so the process never
    holds more than a layer or two, whatever the model's size (here 32x a layer, 16x what a rank keeps)."""
    layers, width = 32, 2048
    total, largest = layers * width * width * 4, width * width * 4
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = run_distributed(
        _construction_peak, 2, tmp_path, timeout_s=120, layers=layers, width=width, use_init=True, nvme_path=str(nvme)
    )
    for result in results:
        assert result["placeholders"]
        assert result["peak"] <= 2 * largest + 48 * MiB, f"peak {result['peak'] / MiB:.0f} MiB"
        assert result["on_disk"] >= total / 2  # this rank's pieces are on the disk
        assert not result["left"], "the Init store's files outlived the pieces"


def test_init_refuses_nvme_without_a_path():
    with pytest.raises(ConfigError, match="offload_param.nvme_path is not set"):
        infinity.zero.Init(config={"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    with pytest.raises(ConfigError, match="offload_param.nvme_path is not set"):
        infinity.zero.Init(config={"zero_optimization": {"stage": 3}}, remote_device="nvme")
    with pytest.raises(ConfigError, match='remote_device must be "cpu", "nvme" or None'):
        infinity.zero.Init(remote_device="disk")


def _hf_under_init(rank: int, world_size: int, nvme_path: str | None) -> dict:
    from tests.distributed.training import gpt2

    torch.manual_seed(5)
    plain = gpt2()
    torch.manual_seed(5)
    with infinity.zero.Init(config=None if nvme_path is None else _nvme_config(nvme_path)):
        partitioned = gpt2()
    assert all(p.numel() == 0 for p in partitioned.parameters())
    with infinity.zero.GatheredParameters(list(partitioned.parameters())):
        same = {
            name: torch.equal(p, dict(plain.named_parameters())[name]) for name, p in partitioned.named_parameters()
        }
        tied = partitioned.lm_head.weight is partitioned.transformer.wte.weight
    init_folders = [] if nvme_path is None else list(Path(nvme_path).glob("*-init"))
    inputs, target = global_batch("gpt2", 0, 4)
    plain_loss = loss_fn("gpt2", plain(inputs), target).item()
    engine, *_ = infinity.initialize(
        model=partitioned, config=engine_config(stage=3, micro=4, accumulation=1, lr=1e-3, clip=0.0)
    )
    engine_loss = loss_fn("gpt2", engine(inputs), target).item()
    pieces_left = any(init_shard(p) is not None for p in partitioned.parameters())  # the engine owns them now
    init_files = [] if nvme_path is None else [str(p) for p in Path(nvme_path).glob("*-init")]
    engine.destroy()
    return {"same": same, "tied": tied, "plain_loss": plain_loss, "engine_loss": engine_loss, "left": pieces_left,
            "init_files": init_files, "init_folders": len(init_folders)}  # fmt: skip


@pytest.mark.parametrize("pieces", ["memory", "nvme"])
def test_init_keeps_the_models_own_initialization(tmp_path, pieces):
    pytest.importorskip("transformers")
    nvme = None
    if pieces == "nvme":  # offload_param nvme: the pieces wait on NVMe for initialize()
        nvme = tmp_path / "nvme"
        nvme.mkdir()
    for result in run_distributed(_hf_under_init, 2, tmp_path, timeout_s=240, nvme_path=nvme and str(nvme)):
        assert result["init_folders"] == (pieces == "nvme"), "the pieces were not on NVMe"
        assert not result["init_files"], "initialize() took every piece: the Init store should be gone"
        assert all(result["same"].values()), [n for n, ok in result["same"].items() if not ok]
        assert result["tied"] and not result["left"]
        assert abs(result["engine_loss"] - result["plain_loss"]) <= 1e-6 * result["plain_loss"]
        assert 3.0 < result["plain_loss"] < 5.0  # ~ln(50): a freshly initialized model, not a broken one


def _edit_with_modifier_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    with infinity.zero.Init(data_parallel_group=dist.group.WORLD):  # the engine's group: as without the argument
        early = nn.Linear(4, 4)
    refused = ""
    try:
        infinity.zero.Init(data_parallel_group=dist.new_group([0]))
    except ConfigError as e:
        refused = str(e)
    torch.manual_seed(rank)
    existing = nn.Linear(4, 2)  # each rank's own values: Init(module=) makes them rank 0's, as DeepSpeed does
    infinity.zero.Init(module=existing)
    with infinity.zero.GatheredParameters([existing.weight]):
        existing_seen = existing.weight.detach().clone()
    with infinity.zero.GatheredParameters([early.weight], modifier_rank=1):
        early.weight.data.fill_(2.0 if rank == 1 else -1.0)
    with infinity.zero.GatheredParameters([early.weight]):
        early_seen = early.weight.detach().clone()

    model = build("mlp")
    engine, *_ = infinity.initialize(
        model=model, config=engine_config(stage=3, micro=4, accumulation=1, lr=0.0, clip=0.0)
    )
    weight = engine.module[2].weight
    with infinity.zero.GatheredParameters([weight], modifier_rank=0):
        weight.data.fill_(0.5 if rank == 0 else 9.0)
    with infinity.zero.GatheredParameters([weight]):
        after_exit = weight.detach().clone()
    with infinity.zero.GatheredParameters([weight]):  # without modifier_rank edits are dropped
        weight.data.fill_(-3.0)
    inputs, target = global_batch("mlp", 0, 4)
    engine.backward(loss_fn("mlp", engine(inputs), target))
    engine.step()  # lr 0: the step republishes the masters, which must hold the edit
    with infinity.zero.GatheredParameters([weight]):
        after_step = weight.detach().clone()
    own = {"masters": own_pieces(engine), "shard": own_pieces(engine, masters=False)}  # read without a gather
    engine.destroy()
    return {"early": early_seen, "after_exit": after_exit, "after_step": after_step, "own": own, "refused": refused,
            "existing": existing_seen}  # fmt: skip


def test_gathered_parameters_modifier_rank_edits_reach_every_rank_and_the_masters(tmp_path):
    """Also zero.Init's data_parallel_group (the world's accepted, another refused on every rank) and module=."""
    results = run_distributed(_edit_with_modifier_rank, 2, tmp_path, timeout_s=120)
    torch.manual_seed(0)
    rank0_weight = nn.Linear(4, 2).weight.detach()
    for rank, result in enumerate(results):
        held = "has 1 of the 2 ranks" if rank == 0 else "does not hold this rank"
        assert f"zero.Init: data_parallel_group {held}" in result["refused"], result["refused"]
        assert torch.equal(result["existing"], rank0_weight)
        assert torch.all(result["early"] == 2.0)
        assert torch.all(result["after_exit"] == 0.5)
        assert torch.all(result["after_step"] == 0.5)
    for which in ("masters", "shard"):  # each rank's own pieces hold the edit, and together they cover it
        edited = {"2.weight": torch.full((64, 64), 0.5)}
        assert pieces_error([{"2.weight": r["own"][which]["2.weight"]} for r in results], edited) == 0.0, which


STEPS_16BIT = 3


def _save_16bit(rank: int, world_size: int, save_dir: str, gather: bool) -> dict:
    config = engine_config(stage=3, micro=2, accumulation=1, lr=1e-2, clip=0.0, precision="bf16")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    engine, *_ = infinity.initialize(model=build("transformer"), config=config)
    for step in range(STEPS_16BIT):
        inputs, target = global_batch("transformer", step, 2 * world_size)
        mine = slice(rank * 2, rank * 2 + 2)
        engine.backward(loss_fn("transformer", engine(inputs[mine]), target[mine]))
        engine.step()
    saved = engine.save_16bit_model(save_dir)
    pieces = own_pieces(engine, masters=False)  # this rank's bf16 shard, read without a gather
    engine.destroy()
    return {"saved": saved, "pieces": pieces}


def test_save_16bit_model_loads_into_the_plain_model(tmp_path):
    results = run_distributed(_save_16bit, 2, tmp_path, timeout_s=120, save_dir=str(tmp_path), gather=True)
    assert all(r["saved"] for r in results)
    plain = build("transformer").to(torch.bfloat16)
    initial = {name: p.detach().clone() for name, p in plain.named_parameters()}
    plain.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")), strict=True)
    saved = {name: p.detach() for name, p in plain.named_parameters()}
    assert all(p.dtype == torch.bfloat16 for p in saved.values())
    # What plain PyTorch reaches with the same data and recipe (training.train_reference), in bf16: the saved
    # weights are the trained ones, not the initial ones nor another rank's piece in the wrong place.
    _, ref = train_reference("transformer", steps=STEPS_16BIT, batch=4, lr=1e-2, clip=0.0, dtype=torch.bfloat16,
                             split=(2, 1, 2))  # fmt: skip
    for name, value in saved.items():
        want = ref[name].to(torch.bfloat16)
        assert float((value.float() - want.float()).abs().max() / want.float().abs().max()) <= 2**-8, name
        assert not torch.equal(value, initial[name]), f"{name}: the initial weights were saved"
    # And exactly what the ranks hold, each rank's pieces read on that rank.
    assert pieces_error([r["pieces"] for r in results], {n: v.float() for n, v in saved.items()}) == 0.0


def test_save_16bit_model_at_stage3_needs_the_gather_flag(tmp_path):
    (tmp_path / "out").mkdir()
    results = run_distributed(_save_16bit, 2, tmp_path, timeout_s=120, save_dir=str(tmp_path / "out"), gather=False)
    assert not any(r["saved"] for r in results)
    assert not os.listdir(tmp_path / "out")

"""Checkpoints at world size 2 (real processes over gloo): exact resume in every mode, and resharding.

Exact resume: a run trains 5 steps, saves, trains 5 more; fresh processes load the checkpoint and train the same
5 steps: the fp32 losses and the final parameters must be identical (torch.equal), for stages 0-3 with the
optimizer (and at stage 3 the parameters) in memory, in host memory and on NVMe (max_in_cpu 0: every parameter
piece on disk, saved from and loaded into the swap file, as the tier stats show), with a WarmupLR scheduler
(the learning rate moves every step until its warmup ends, after the resume), gradient accumulation 2 and the
engine's own data loader: the save falls in the middle of an epoch, and the resumed run finishes it and crosses into
the next (the same batches must follow). fp16 runs (stages 2 and 3) start at a loss scale that
overflows, so skipped steps and the scaler's state are part of what must resume. GPT-2 (tied embeddings, frozen
biases) covers parameters saved under one name and parameters outside the optimizer.

Resharding: a stage-3 run on NVMe at world size 2 saves; it is loaded at world size 1 / stage 2 (accumulation 2,
so the global batch is the same), at world size 2 / stage 1, and into stage 3 without offload. Right after the
load each saves again: every array (parameters, exp_avg, exp_avg_sq) must equal the original's bitwise, and
training continues to the unresharded run's losses within fp32 reduction tolerance.

Three spawns in all (two at world size 2, one at world size 1); swap files and checkpoints under tmp_path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

import infinity
import infinity.zero
from infinity.checkpoint.manifest import Manifest
from infinity.checkpoint.zarr_store import read_array_meta, read_range
from tests.distributed.harness import run_distributed
from tests.distributed.training import SEQ, VOCAB, build, engine_config, global_batch, gradients_on_nvme, loss_fn

SAVE_AT, AFTER = 5, 5
MICRO, ACCUMULATION = 2, 2


@dataclasses.dataclass(frozen=True)
class Mode:
    stage: int
    device: str = "none"  # offload_optimizer (and at stage 3 offload_param) device
    model: str = "transformer"
    precision: str = "fp32"

    @property
    def name(self) -> str:
        return f"{self.model}-s{self.stage}-{self.device}-{self.precision}"


MODES = (
    Mode(0),
    Mode(1), Mode(1, "cpu", "gpt2"), Mode(1, "nvme"),
    Mode(2), Mode(2, "cpu"), Mode(2, "nvme"),
    Mode(3), Mode(3, "cpu"), Mode(3, "nvme", "gpt2"),
    Mode(2, precision="fp16"), Mode(3, "nvme", precision="fp16"),
)  # fmt: skip


def _config(mode: Mode, swap: str, *, world_size: int = 2) -> dict:
    accumulation = ACCUMULATION * 2 // world_size
    config = engine_config(stage=mode.stage, micro=MICRO, accumulation=accumulation, lr=1e-2, clip=1.0)
    config["scheduler"] = {"type": "WarmupLR",
                           "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8}}  # fmt: skip
    zero = config["zero_optimization"]
    if mode.device != "none":
        zero["offload_optimizer"] = {"device": mode.device, "nvme_path": swap}
        if mode.stage == 3:
            zero["offload_param"] = {"device": mode.device, "nvme_path": swap}
            if mode.device == "nvme":
                zero["offload_param"]["max_in_cpu"] = 0  # every piece on NVMe (the default keeps these in memory)
    if mode.stage == 3:
        zero["stage3_param_persistence_threshold"] = 40  # the LayerNorms' and biases' persistent unit too
    if mode.precision == "fp16":
        # a scale that overflows now and then (steps skipped before and after the save), and grows every 3 steps
        config["fp16"] = {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 3, "hysteresis": 1}
    return config


def _dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (48, SEQ + 1), generator=gen)  # 12 micro-batches per rank: an epoch = 6 steps
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _engine(mode: Mode, swap: str, *, world_size: int = 2, data: bool = True):
    # fp16 at stage 3 on NVMe: its gradient goes to NVMe with the optimizer ([Note: swapped gradients]), as for a
    # model whose gradient the host share does not hold; the other stage-3 NVMe mode keeps it where the plan does
    swapped = mode.stage == 3 and mode.device == "nvme" and mode.precision == "fp16"
    with gradients_on_nvme() if swapped else contextlib.nullcontext():
        engine, _, loader, _ = infinity.initialize(
            model=build(mode.model), config=_config(mode, swap, world_size=world_size),
            training_data=_dataset() if data else None,
        )  # fmt: skip
    assert (getattr(engine.zero_optimizer, "gradients", None) is not None) == swapped
    return engine, loader


def _param_traffic(engine) -> dict:
    """Parameter pieces on NVMe: bytes read and written so far (writes in flight waited for: they count once
    done), and where the pieces live (tier -> bytes)."""
    stats = engine.tier_stats().get("parameters")
    if stats is None:
        return {}
    engine.stage3.table.shards.manager.flush()
    stats = engine.tier_stats()["parameters"]
    return {"read": stats["traffic"]["nvme_read"]["bytes"], "written": stats["traffic"]["nvme_write"]["bytes"],
            "held": stats["held_bytes"]}  # fmt: skip


def _moved(before: dict, after: dict) -> dict:
    """What a save or a load moved of the parameter pieces on NVMe."""
    if not before:
        return {}
    return {"read": after["read"] - before["read"], "written": after["written"] - before["written"],
            "held": after["held"]}  # fmt: skip


def _train_from_loader(engine, loader, mode: Mode, steps: int, batches: list) -> list[float]:
    """``batches``: [the loader's iterator] (kept across calls, renewed at the end of a pass)."""
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            try:
                inputs, target = next(batches[0])
            except StopIteration:
                batches[0] = iter(loader)
                inputs, target = next(batches[0])
            loss = loss_fn(mode.model, engine(inputs), target)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total)
    return losses


def _train_global(engine, mode: Mode, first: int, steps: int, rank: int, world_size: int) -> list[float]:
    """Explicit global batches of MICRO * ACCUMULATION * 2 samples, the same at any world size."""
    accumulation = engine.gradient_accumulation_steps()
    losses = []
    for step in range(first, first + steps):
        inputs, target = global_batch(mode.model, step, MICRO * ACCUMULATION * 2)
        total = torch.zeros(())
        for k in range(accumulation):
            start = (k * world_size + rank) * MICRO
            loss = loss_fn(mode.model, engine(inputs[start : start + MICRO]), target[start : start + MICRO])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / accumulation
        if world_size > 1:
            torch.distributed.all_reduce(total)
            total /= world_size
        losses.append(total.item())
    return losses


def _params(engine) -> dict[str, torch.Tensor]:
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}


def _save_then_continue(*, rank: int, world_size: int, root: str) -> dict:
    swap = os.path.join(root, "swap")
    out = {}
    for mode in MODES:
        engine, loader = _engine(mode, swap)
        batches = [iter(loader)]
        _train_from_loader(engine, loader, mode, SAVE_AT, batches)
        before = _param_traffic(engine)
        engine.save_checkpoint(os.path.join(root, mode.name), client_state={"note": mode.name, "rank": rank})
        saved = _moved(before, _param_traffic(engine))
        skipped_before = engine.skipped_steps
        losses = _train_from_loader(engine, loader, mode, AFTER, batches)
        out[mode.name] = {"losses": losses, "params": _params(engine), "lr": engine.get_lr(),
                          "skipped": engine.skipped_steps, "scale": engine.loss_scale,
                          "skipped_before": skipped_before, "pieces_moved": saved}  # fmt: skip
        engine.destroy()
    # the resharding source: stage 3 on NVMe, explicit global batches
    source = Mode(3, "nvme")
    engine, _ = _engine(source, swap, data=False)
    _train_global(engine, source, 0, SAVE_AT, rank, world_size)
    engine.save_checkpoint(os.path.join(root, "reshard"))
    out["reshard"] = _train_global(engine, source, SAVE_AT, AFTER, rank, world_size)
    engine.destroy()
    return out


def _load_and_continue(*, rank: int, world_size: int, root: str) -> dict:
    swap = os.path.join(root, "swap")
    out = {}
    for mode in MODES:
        engine, loader = _engine(mode, swap)
        before = _param_traffic(engine)
        path, client_state = engine.load_checkpoint(os.path.join(root, mode.name))
        loaded = _moved(before, _param_traffic(engine))
        assert client_state == {"note": mode.name, "rank": 0}, client_state
        assert path.endswith(f"global_step{SAVE_AT}") and engine.global_steps == SAVE_AT
        losses = _train_from_loader(engine, loader, mode, AFTER, [iter(loader)])
        out[mode.name] = {"losses": losses, "params": _params(engine), "lr": engine.get_lr(),
                          "skipped": engine.skipped_steps, "scale": engine.loss_scale,
                          "pieces_moved": loaded}  # fmt: skip
        engine.destroy()
    out["reshard"] = _reshard_into(root, [Mode(1), Mode(3)], rank, world_size)
    out["failed_save"] = _one_rank_fails_to_save(root, rank)
    return out


def _one_rank_fails_to_save(root: str, rank: int) -> str:
    """Rank 1's chunk writes fail (as on a full disk): both ranks raise, none waits for the other, the partial
    folder is removed, and the previous checkpoint stays the one `latest` names."""
    import infinity.checkpoint.chunk_io as chunk_io

    engine, _ = _engine(Mode(3, "nvme"), os.path.join(root, "swap"), data=False)
    folder = os.path.join(root, "reshard")
    engine.load_checkpoint(folder)
    if rank == 1:
        def full(self, path, values, file_bytes):
            raise infinity.CheckpointError(f"writing {path}: No space left on device (errno 28)")

        chunk_io.ChunkIO.write = full
    try:
        engine.save_checkpoint(folder, tag="doomed")
        message = "no error"
    except infinity.CheckpointError as e:
        message = str(e)
    engine.destroy()
    return message


def _reshard_into(root: str, modes: list[Mode], rank: int, world_size: int) -> dict:
    result = {}
    for mode in modes:
        engine, _ = _engine(mode, os.path.join(root, "swap"), world_size=world_size, data=False)
        engine.load_checkpoint(os.path.join(root, "reshard"))
        engine.save_checkpoint(os.path.join(root, f"resaved-{world_size}-{mode.name}"))
        result[mode.name] = _train_global(engine, mode, SAVE_AT, AFTER, rank, world_size)
        engine.destroy()
    return result


def _reshard_at_one(*, rank: int, world_size: int, root: str) -> dict:
    return _reshard_into(root, [Mode(2)], rank, world_size)


def _arrays(folder: str) -> dict[str, torch.Tensor]:
    manifest = Manifest.read(folder)
    values = {}
    for key in manifest.arrays:
        meta = read_array_meta(folder, key)
        values[key] = read_range(folder, key, meta, 0, meta.numel)
    return values


def test_resume_is_exact_and_reshards(tmp_path):
    root = str(tmp_path)
    for folder in ("swap", "a", "b", "c"):
        os.makedirs(os.path.join(root, folder))
    first = run_distributed(_save_then_continue, 2, tmp_path / "a", timeout_s=400, root=root)
    second = run_distributed(_load_and_continue, 2, tmp_path / "b", timeout_s=400, root=root)
    single = run_distributed(_reshard_at_one, 1, tmp_path / "c", timeout_s=200, root=root)

    for mode in MODES:
        for rank in range(2):
            want, got = first[rank][mode.name], second[rank][mode.name]
            assert got["losses"] == want["losses"], (mode.name, rank, want["losses"], got["losses"])
            assert got["lr"] == want["lr"] and got["skipped"] == want["skipped"], mode.name
            assert got["scale"] == want["scale"], mode.name
            for name, value in want["params"].items():
                assert torch.equal(got["params"][name], value), (mode.name, name)
    for mode in (m for m in MODES if (m.stage, m.device) == (3, "nvme")):  # max_in_cpu 0: every piece on disk
        moved = [(first[rank][mode.name]["pieces_moved"], second[rank][mode.name]["pieces_moved"]) for rank in (0, 1)]
        for saved, loaded in moved:
            assert set(saved["held"]) == {"nvme"}, (mode.name, saved)  # none kept in host memory
            assert loaded["written"] == loaded["held"]["nvme"], (mode.name, loaded)  # the load wrote every piece
        if mode.model == "gpt2":  # its frozen biases are saved from their pieces, read back from NVMe
            assert sum(saved["read"] for saved, _ in moved) > 0, (mode.name, moved)
    for name in ("transformer-s2-none-fp16", "transformer-s3-nvme-fp16"):  # steps taken on both sides; some skipped
        run = first[0][name]
        assert run["skipped_before"] < SAVE_AT and run["skipped"] - run["skipped_before"] < AFTER, run
        assert run["skipped"] > 0, run

    original = _arrays(os.path.join(root, "reshard", f"global_step{SAVE_AT}"))
    assert any(key.startswith("optimizer/exp_avg_sq/") for key in original)
    for folder in ("resaved-1-transformer-s2-none-fp32", "resaved-2-transformer-s1-none-fp32",
                   "resaved-2-transformer-s3-none-fp32"):  # fmt: skip
        resaved = _arrays(os.path.join(root, folder, f"global_step{SAVE_AT}"))
        assert resaved.keys() == original.keys(), folder
        for key, value in original.items():
            assert torch.equal(resaved[key], value), (folder, key)
    for rank in range(2):  # rank 1 failed; rank 0 learned of it: neither hung
        assert "No space left on device" in second[rank]["failed_save"], second[rank]["failed_save"]
    assert "rank 1" in second[0]["failed_save"]
    with open(os.path.join(root, "reshard", "latest")) as f:
        assert f.read() == f"global_step{SAVE_AT}"
    assert sorted(os.listdir(os.path.join(root, "reshard"))) == [f"global_step{SAVE_AT}", "latest"]  # no doomed.tmp
    reference = first[0]["reshard"]
    for losses in (single[0]["transformer-s2-none-fp32"], second[0]["reshard"]["transformer-s1-none-fp32"],
                   second[0]["reshard"]["transformer-s3-none-fp32"]):  # fmt: skip
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    assert not os.listdir(os.path.join(root, "swap"))

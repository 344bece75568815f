"""Consolidation (infinity ckpt to-fp32 / info), the 16-bit save, and the format as other readers see it.

- to-fp32 writes exactly the weights the engine holds (gathered at stage 3 on NVMe), in one shard or many with an
  index, readable by the safetensors library alone; tied weights appear once.
- Peak RSS of consolidating a 1.08 GB checkpoint stays below 0.5 GB above the process's baseline (a child process
  measures its own peak, ru_maxrss, before and after).
- zarr-python opens the checkpoint's arrays and reads what infinity reads.
- A transformers GPT-2 saved with save_16bit_model at stage 3 loads with from_pretrained, weights equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import infinity
import infinity.zero
from infinity.checkpoint.cli import main as ckpt_main
from infinity.checkpoint.consolidate import to_fp32
from infinity.checkpoint.manifest import GroupEntry, Manifest
from infinity.checkpoint.zarr_store import ArrayMeta, read_array_meta, read_range, write_array_meta, write_chunk
from tests.distributed.training import build, engine_config, global_batch, loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trained(model_name: str, config: dict, steps: int = 2):
    engine, *_ = infinity.initialize(model=build(model_name), config=config)
    for step in range(steps):
        inputs, target = global_batch(model_name, step, 4)
        engine.backward(loss_fn(model_name, engine(inputs), target))
        engine.step()
    return engine


def _gathered(engine) -> dict[str, torch.Tensor]:
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}


@pytest.fixture(scope="module")
def stage3_nvme(tmp_path_factory):
    """GPT-2 (tied lm_head, frozen biases) at stage 3 in fp32, parameters and optimizer on NVMe: saved, and its
    gathered weights (fp32: what to-fp32 must write bit for bit)."""
    root = tmp_path_factory.mktemp("s3")
    os.makedirs(root / "swap")
    config = engine_config(stage=3, micro=4, accumulation=1, lr=1e-2, clip=1.0)
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(root / "swap")}
    zero["offload_param"] = {"device": "nvme", "nvme_path": str(root / "swap")}
    engine = _trained("gpt2", config)
    engine.save_checkpoint(root / "ckpt")
    weights = _gathered(engine)
    engine.destroy()
    return root / "ckpt", weights


def test_to_fp32_is_the_engines_weights_in_one_shard_or_many(stage3_nvme, tmp_path):
    folder, weights = stage3_nvme
    files = to_fp32(folder, tmp_path / "one")
    assert [os.path.basename(f) for f in files] == ["model.safetensors", "model.safetensors.index.json"]
    state = load_file(tmp_path / "one" / "model.safetensors")
    assert "lm_head.weight" not in state  # tied to transformer.wte.weight: stored once
    assert set(state) == set(weights) - {"lm_head.weight"}
    for name, value in state.items():
        assert value.dtype == torch.float32 and torch.equal(value, weights[name]), name
    files = to_fp32(folder, tmp_path / "many", max_shard_size="20KB")
    with open(tmp_path / "many" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert len(files) > 3 and set(index["weight_map"]) == set(state)
    assert index["metadata"]["aliases"] == {"transformer.wte.weight": ["lm_head.weight"]}
    merged = {}
    for name in sorted(set(index["weight_map"].values())):
        shard = load_file(tmp_path / "many" / name)
        assert sum(v.numel() * 4 for v in shard.values()) <= 20_000 or len(shard) == 1  # one tensor past the limit
        merged.update(shard)
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)


def test_info_describes_the_checkpoint(stage3_nvme, capsys):
    assert ckpt_main(["info", str(stage3_nvme[0])]) == 0
    out = capsys.readouterr().out
    assert "tag global_step2: step 2" in out and "world size 1, ZeRO stage 3, float32" in out
    assert "optimizer/exp_avg_sq" in out and "tied: {'transformer.wte.weight': ['lm_head.weight']}" in out
    assert ckpt_main(["info", str(stage3_nvme[0]), "--arrays"]) == 0
    listed = capsys.readouterr().out
    assert all(f"params/{name} " in listed for name in stage3_nvme[1] if name != "lm_head.weight")
    assert ckpt_main(["info", str(stage3_nvme[0]), "--tag", "nope"]) == 1
    assert "nope" in capsys.readouterr().err


def test_zarr_python_reads_the_arrays(stage3_nvme):
    zarr = pytest.importorskip("zarr")
    tag = os.path.join(stage3_nvme[0], "global_step2")
    group = zarr.open_group(tag, mode="r")
    for key in ("params/transformer.wte.weight", "optimizer/exp_avg/transformer.h.0.mlp.c_fc.weight"):
        meta = read_array_meta(tag, key)
        ours = read_range(tag, key, meta, 0, meta.numel).view(meta.shape)
        theirs = torch.from_numpy(group[key][...])
        assert theirs.shape == ours.shape and torch.equal(theirs, ours), key


def test_from_pretrained_loads_the_16bit_save(tmp_path):
    from transformers import GPT2LMHeadModel

    config = engine_config(stage=3, micro=4, accumulation=1, lr=1e-2, clip=1.0, precision="bf16")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine = _trained("gpt2", config)
    weights = _gathered(engine)
    assert engine.save_16bit_model(tmp_path)
    engine.destroy()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param.float(), weights[name]), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def _synthetic_checkpoint(folder: str, *, arrays: int, shape: tuple[int, int]) -> None:
    """A checkpoint's files without an engine: ``arrays`` fp32 parameters of ``shape`` (each chunk a distinct
    value, so a misplaced chunk shows)."""
    tag = os.path.join(folder, "big")
    names = []
    for k in range(arrays):
        key = f"params/layer{k}.weight"
        meta = ArrayMeta.plan(shape, torch.float32)
        write_array_meta(tag, key, meta)
        for chunk in range(meta.num_chunks):
            start, end = meta.chunk_range(chunk)
            write_chunk(tag, key, meta, chunk, torch.full((end - start,), float(k * 1000 + chunk)))
        names.append(key)
    Manifest(world_size=1, stage=3, compute_dtype="float32", offload_optimizer="none", offload_param="none",
             global_steps=1, micro_steps=1, skipped_steps=0,
             arrays={n: {"shape": list(shape), "dtype": "float32"} for n in names}, aliases={},
             groups=[GroupEntry([n[7:] for n in names], {}, 1)], state_names=[], scalar_keys=[], config={},
             library_version="test").write(tag)  # fmt: skip
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write("big")


def test_consolidating_a_large_checkpoint_keeps_memory_flat(tmp_path):
    _synthetic_checkpoint(str(tmp_path / "ckpt"), arrays=3, shape=(88_000, 1024))  # 3 x 360 MB = 1.08 GB
    child = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {ROOT!r})
        from infinity.checkpoint.consolidate import to_fp32
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        to_fp32({str(tmp_path / "ckpt")!r}, {str(tmp_path / "out")!r}, max_shard_size="500MB")
        print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, check=True)
    before_kib, after_kib = (int(v) for v in done.stdout.split())
    assert (after_kib - before_kib) * 1024 < 0.5e9, (before_kib, after_kib)
    total = sum(os.path.getsize(tmp_path / "out" / n) for n in os.listdir(tmp_path / "out") if n.endswith("tensors"))
    assert total >= 3 * 88_000 * 1024 * 4
    first = load_file(tmp_path / "out" / "model-00001-of-00003.safetensors")
    meta = read_array_meta(str(tmp_path / "ckpt" / "big"), "params/layer0.weight")
    whole = read_range(str(tmp_path / "ckpt" / "big"), "params/layer0.weight", meta, 0, meta.numel)
    assert torch.equal(first["layer0.weight"].reshape(-1), whole) and whole[-1] == meta.num_chunks - 1

"""DeepSpeed's checkpoint helpers under their names (infinity.utils.zero_to_fp32) and exclude_frozen_parameters
on save_checkpoint and save_16bit_model: a LoRA-style fine-tune saves its adapters only and resumes into a model
whose frozen weights came from elsewhere."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import infinity
import infinity.zero
from infinity.checkpoint.cli import main as ckpt_command
from infinity.errors import CheckpointError
from infinity.utils import safe_get_full_fp32_param
from infinity.utils import zero_to_fp32 as helpers


class LoraLinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update, as PEFT's LoRA builds it."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.01)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(LoraLinear(16, 64), nn.GELU(), LoraLinear(64, 4))


def tied_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 20, bias=False))
    model[2].weight = model[0].weight
    return model


def config(stage: int, nvme=None) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}
    if nvme is not None:
        nvme.mkdir(exist_ok=True)
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme)}
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero}  # fmt: skip


def train(engine, steps) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        if isinstance(engine.module[0], nn.Embedding):
            tokens = torch.randint(0, 20, (4, 5), generator=gen)
            loss = nn.functional.cross_entropy(engine(tokens).reshape(-1, 20), tokens.reshape(-1))
        else:
            x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)
            loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_state_dict_helpers_give_the_masters(stage, tmp_path):
    nvme = tmp_path / "nvme" if stage == 3 else None
    engine, *_ = infinity.initialize(model=tied_model(), config=config(stage, nvme))
    train(engine, range(3))
    masters = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.destroy()

    state = helpers.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert set(state) == {"0.weight", "1.weight", "1.bias", "2.weight"}  # the tied weight under both names
    assert state["2.weight"] is state["0.weight"]
    assert all(torch.equal(state[name], masters[name]) for name in masters)

    fresh = helpers.load_state_dict_from_zero_checkpoint(tied_model(), tmp_path / "ckpt")
    assert all(torch.equal(p, masters[n]) for n, p in fresh.named_parameters())
    assert fresh[2].weight is fresh[0].weight

    helpers.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "bin")
    saved = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert set(saved) == {"0.weight", "1.weight", "1.bias", "2.weight"} and saved["2.weight"] is saved["0.weight"]
    assert torch.equal(saved["1.weight"], masters["1.weight"])
    tied_model().load_state_dict(saved)  # strict
    helpers.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "shards", max_shard_size=700)
    index = json.loads((tmp_path / "shards" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("pytorch_model-") for f in files)
    merged = {k: v for f in files for k, v in torch.load(tmp_path / "shards" / f, weights_only=True).items()}
    assert merged.keys() == saved.keys() and all(torch.equal(merged[k], saved[k]) for k in saved)
    helpers.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "safe", safe_serialization=True)
    assert torch.equal(load_file(tmp_path / "safe" / "model.safetensors")["0.weight"], masters["0.weight"])


def test_a_state_dict_larger_than_the_host_is_refused_naming_the_command(tmp_path, monkeypatch):
    engine, *_ = infinity.initialize(model=tied_model(), config=config(2))
    train(engine, range(1))
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.destroy()
    monkeypatch.setattr(helpers, "available_host_bytes", lambda: 1000)
    with pytest.raises(CheckpointError, match="more than 3/4 of the 1000 bytes .*infinity ckpt to-fp32"):
        helpers.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="lazy_mode is not supported.*infinity ckpt to-fp32"):
        helpers.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", lazy_mode=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_lora_checkpoint_without_frozen_weights_resumes_into_a_base_from_elsewhere(stage, tmp_path):
    nvme = tmp_path / "nvme" if stage == 3 else None
    whole, *_ = infinity.initialize(model=lora_model(), config=config(stage, nvme))
    want = train(whole, range(4))
    with infinity.zero.GatheredParameters(list(whole.module.parameters())):
        want_params = {n: p.detach().clone() for n, p in whole.module.named_parameters()}
    whole.destroy()

    first, *_ = infinity.initialize(model=lora_model(), config=config(stage, nvme))
    got = train(first, range(2))
    first.save_checkpoint(tmp_path / "full")
    first.save_checkpoint(tmp_path / "adapters", exclude_frozen_parameters=True)
    assert first.save_16bit_model(tmp_path / "weights16", exclude_frozen_parameters=True)
    first.destroy()
    adapters = load_file(tmp_path / "weights16" / "model.safetensors")
    assert sorted(adapters) == ["0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b"]
    manifest = json.loads((tmp_path / "adapters" / "global_step2" / "manifest.json").read_text())
    assert not any("base" in key for key in manifest["arrays"])
    frozen = ["0.base.bias", "0.base.weight", "2.base.bias", "2.base.weight"]
    assert sorted(manifest["extra"]["frozen_excluded"]) == frozen
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file())
            for name in ("full", "adapters")}
    assert size["adapters"] < size["full"]
    assert ckpt_command(["to-fp32", str(tmp_path / "full"), str(tmp_path / "out"), "--exclude-frozen-parameters"]) == 0
    assert sorted(load_file(tmp_path / "out" / "model.safetensors")) == sorted(adapters)

    # The base from elsewhere (here: the same initialization, as a base checkpoint gives it), the adapters and
    # their optimizer states from the checkpoint: the run continues as if never stopped.
    resumed, *_ = infinity.initialize(model=lora_model(), config=config(stage, nvme))
    resumed.load_checkpoint(tmp_path / "adapters")
    got += train(resumed, range(2, 4))
    with infinity.zero.GatheredParameters(list(resumed.module.parameters())):
        got_params = {n: p.detach().clone() for n, p in resumed.module.named_parameters()}
    resumed.destroy()
    assert got == want
    assert all(torch.equal(got_params[n], want_params[n]) for n in want_params)

    # A run whose frozen weights differ keeps its own: the checkpoint has none to give.
    other, *_ = infinity.initialize(model=lora_model(seed=7), config=config(stage, nvme))
    other.load_checkpoint(tmp_path / "adapters")
    with infinity.zero.GatheredParameters(list(other.module.parameters())):
        params = {n: p.detach().clone() for n, p in other.module.named_parameters()}
    other.destroy()
    base = dict(lora_model(seed=7).named_parameters())
    assert torch.equal(params["0.base.weight"], base["0.base.weight"])
    saved = helpers.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "adapters")
    assert "0.base.weight" not in saved and torch.equal(params["0.lora_a"], saved["0.lora_a"])


def _lora_resume(*, rank: int, world_size: int, folder: str) -> dict:
    """Stage 3 with world_size ranks: two steps, a save without the frozen base, a fresh engine resuming from it
    (base from the same initialization), two more steps; and the same four steps uninterrupted."""

    def steps(engine, numbers):
        losses = []
        for number in numbers:
            gen = torch.Generator().manual_seed(number)
            x, y = torch.randn(4 * world_size, 16, generator=gen), torch.randn(4 * world_size, 4, generator=gen)
            loss = (engine(x[rank * 4 : (rank + 1) * 4]) - y[rank * 4 : (rank + 1) * 4]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    whole, *_ = infinity.initialize(model=lora_model(), config=config(3))
    want = steps(whole, range(4))
    with infinity.zero.GatheredParameters(list(whole.module.parameters())):
        want_params = {n: p.detach().clone() for n, p in whole.module.named_parameters()}
    whole.destroy()
    first, *_ = infinity.initialize(model=lora_model(), config=config(3))
    got = steps(first, range(2))
    first.save_checkpoint(folder, exclude_frozen_parameters=True)
    first.destroy()
    resumed, *_ = infinity.initialize(model=lora_model(), config=config(3))
    resumed.load_checkpoint(folder)
    got += steps(resumed, range(2, 4))
    with infinity.zero.GatheredParameters(list(resumed.module.parameters())):
        got_params = {n: p.detach().clone() for n, p in resumed.module.named_parameters()}
    resumed.destroy()
    return {"want": want, "got": got, "same": all(torch.equal(got_params[n], want_params[n]) for n in want_params)}


def test_exclude_frozen_parameters_at_world_size_2(tmp_path):
    """Each rank holds pieces of other frozen parameters: the names left out are the model's, on every rank."""
    from tests.distributed.harness import run_distributed

    results = run_distributed(_lora_resume, 2, tmp_path, timeout_s=120, folder=str(tmp_path / "adapters"))
    for result in results:
        assert result["got"] == result["want"] and result["same"]
    manifest = json.loads((tmp_path / "adapters" / "global_step2" / "manifest.json").read_text())
    assert sorted(manifest["extra"]["frozen_excluded"]) == ["0.base.bias", "0.base.weight", "2.base.bias",
                                                           "2.base.weight"]  # fmt: skip

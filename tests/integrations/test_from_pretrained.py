"""from_pretrained / from_config partitioned at load time under an HfInfinityConfig for ZeRO-3, over real gloo
processes: the same values as Transformers' own loading, in 1/N of the memory, and nothing changed otherwise."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import infinity
import infinity.zero
from infinity.errors import ConfigError
from infinity.memory.host import process_status_bytes
from tests.distributed.harness import run_distributed

transformers = pytest.importorskip("transformers", minversion="5.24")  # the pinned range (pyproject.toml)
pytest.importorskip("safetensors")

MiB = 2**20
VOCAB = 128


def _gpt2_config(**overrides):
    values = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)  # fmt: skip
    values.update(overrides)
    return transformers.GPT2Config(**values)


def _llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def _save(model, folder: Path, **kwargs) -> str:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints saved locally: GPT-2 (lm_head tied to wte, so saved once), its base model alone, and a
    Llama (rotary buffers, untied head) cut into several shards with an index."""
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    gpt2 = _save(transformers.GPT2LMHeadModel(_gpt2_config()), root / "gpt2")
    base = _save(transformers.GPT2Model(_gpt2_config()), root / "gpt2-base")
    classifier = _save(transformers.GPT2ForSequenceClassification(_gpt2_config()), root / "gpt2-classifier")
    llama = _save(transformers.LlamaForCausalLM(_llama_config()), root / "llama", max_shard_size="20KB")
    assert len(list(Path(llama).glob("*.safetensors"))) > 2 and (Path(llama) / "model.safetensors.index.json").exists()
    return {"gpt2": gpt2, "gpt2-base": base, "gpt2-classifier": classifier, "llama": llama}


def _stage3(nvme_path: str | None = None) -> dict:
    """One DeepSpeed-style config for both HfInfinityConfig and initialize(), as a user would share it."""
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if nvme_path is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}  # fmt: skip


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _differences(model, plain) -> list[str]:
    """Names whose value or dtype differs from the plain model's (parameters gathered by the caller) or buffers."""
    theirs = dict(plain.named_parameters()) | dict(plain.named_buffers())
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    assert ours.keys() == theirs.keys()
    return [n for n, t in ours.items() if t.dtype != theirs[n].dtype or not torch.equal(t.detach(), theirs[n].detach())]


def _partitioned(model) -> bool:
    return all(p.numel() == 0 and hasattr(p, "ds_shape") for p in model.parameters())


def _rank_bytes(nvme: Path, rank: int) -> int:
    return sum(f.stat().st_size for f in nvme.rglob(f"rank{rank}/*") if f.is_file() and f.name != "lock")


def _load_peak(load) -> int:
    """How far resident memory rose above its level before ``load()`` and a first read of every weight.
    Transformers 5 maps a safetensors checkpoint and its parameters stay views of the mapping until read, so
    the whole model becomes resident at the first forward, not in from_pretrained: the read counts it."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS (the fork server's high-water mark is not ours)
    before = process_status_bytes("VmRSS")
    model = load()
    with torch.no_grad():
        for param in model.parameters():
            param.sum()
    peak = process_status_bytes("VmHWM") - before
    del model
    gc.collect()
    return peak


def _peaks(big: str, tiny: str) -> dict:
    """Resident memory added by loading ``big`` with Transformers' own loading, then partitioned."""
    from transformers import AutoModelForCausalLM

    import infinity.memory.host
    from infinity.integrations.hf_loading import HfInfinityConfig

    # as zero.Init does on entry: both loads are measured alike
    infinity.memory.host.fix_heap_policy(infinity.memory.host.BUILD)
    AutoModelForCausalLM.from_pretrained(tiny)  # Transformers' lazily imported code, loaded before measuring
    plain = _load_peak(lambda: AutoModelForCausalLM.from_pretrained(big))
    hf_config = HfInfinityConfig(_stage3())
    AutoModelForCausalLM.from_pretrained(tiny)
    partitioned = _load_peak(lambda: AutoModelForCausalLM.from_pretrained(big))
    del hf_config
    gc.collect()
    return {"plain": plain, "partitioned": partitioned}


def _load_at_stage3(rank: int, world_size: int, checkpoints: dict, nvme_path: str, big: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import PreTrainedModel

    from infinity.integrations.hf_loading import HfInfinityConfig, is_zero3_active

    original_init_context = PreTrainedModel.__dict__["get_init_context"]
    out: dict = {} if big is None else _peaks(big, checkpoints["gpt2"])  # first, while the process is small
    plain_gpt2 = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    plain_llama = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.bfloat16)

    # GPT-2, its pieces sent to NVMe as zero.Init cuts them, then trained by the engine from the same config
    config = _stage3(nvme_path)
    hf_config = HfInfinityConfig(config)
    out["active"] = is_zero3_active()
    model = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    out["gpt2_partitioned"] = _partitioned(model)
    out["gpt2_tied"] = model.lm_head.weight is model.transformer.wte.weight
    out["on_nvme"] = _rank_bytes(Path(nvme_path), rank)
    out["numel"] = sum(p.ds_numel for p in model.parameters())
    engine, *_ = infinity.initialize(model=model, config=config)
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):
        out["gpt2_differences"] = _differences(engine.module, plain_gpt2)
    out["gpt2_tied_after_initialize"] = engine.module.lm_head.weight is engine.module.transformer.wte.weight
    with torch.no_grad():
        out["gpt2_logits"] = torch.equal(engine(_tokens(1)).logits, plain_gpt2(_tokens(1)).logits)
    engine.destroy()

    # Llama from a sharded checkpoint in bf16 (rotary buffers), the pieces in memory; read back before initialize()
    hf_config = HfInfinityConfig(_stage3())  # the last one made is in force
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.bfloat16)
    out["llama_partitioned"] = _partitioned(model)
    with infinity.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
        out["llama_differences"] = _differences(model, plain_llama)
        out["llama_logits"] = torch.equal(model(_tokens(2)).logits, plain_llama(_tokens(2)).logits)

    # What the checkpoint lacks is initialized as Transformers initializes it (rank 0's values, the same seed),
    # a checkpoint without the base model's prefix is matched, and from_config builds partitioned models too
    from transformers import AutoConfig, GPT2ForSequenceClassification, GPT2LMHeadModel
    from transformers.initialization import no_init_weights

    loaded = {}
    for name in ("plain", "partitioned"):
        if name == "plain":
            hf_config = HfInfinityConfig({"zero_optimization": {"stage": 0}})
        else:
            hf_config = HfInfinityConfig(_stage3())
        torch.manual_seed(7)
        classifier, info = GPT2ForSequenceClassification.from_pretrained(checkpoints["gpt2-base"],
                                                                          output_loading_info=True)  # fmt: skip
        head = GPT2LMHeadModel.from_pretrained(checkpoints["gpt2-base"])
        _, loaded_info = GPT2LMHeadModel.from_pretrained(checkpoints["gpt2-classifier"], output_loading_info=True)
        info = (info, loaded_info)
        llama_config = AutoConfig.from_pretrained(checkpoints["llama"])
        torch.manual_seed(8)
        if name == "partitioned":
            built = AutoModelForCausalLM.from_config(llama_config)
        else:  # the random values of Transformers' ZeRO-3 from_config: initialization after an empty build
            with no_init_weights():
                built = AutoModelForCausalLM.from_config(llama_config)
            torch.manual_seed(8)
            built.initialize_weights()
            built.tie_weights()
        loaded[name] = {"classifier": classifier, "info": info, "head": head, "built": built}
    ours, theirs = loaded["partitioned"], loaded["plain"]
    out["missing_partitioned"] = all(_partitioned(ours[k]) for k in ("classifier", "head", "built"))
    out["loading_info"] = (ours["info"], theirs["info"])
    models = [ours[k] for k in ("classifier", "head", "built")]
    with infinity.zero.GatheredParameters([p for m in models for p in m.parameters()]):
        out["missing_differences"] = {k: _differences(ours[k], theirs[k]) for k in ("classifier", "head", "built")}
        out["padding_row"] = ours["built"].model.embed_tokens.weight[0].abs().max().item()
    with pytest.raises(ConfigError, match="drop device_map"):
        AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"], device_map="cpu")
    with pytest.raises(ConfigError, match=r"transformer.wpe.weight has shape \(16, 32\) in the checkpoint but"):
        AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"], n_positions=32)
    _, info = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"], n_positions=32, ignore_mismatched_sizes=True,
                                                   output_loading_info=True)  # fmt: skip
    out["mismatched"] = info["mismatched_keys"]

    # Stage 2 leaves loading alone, and so does no live object
    hf_config = HfInfinityConfig({"zero_optimization": {"stage": 2}})
    out["stage2_active"] = is_zero3_active()
    out["stage2_untouched"] = PreTrainedModel.__dict__["get_init_context"] is original_init_context
    model = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    out["stage2_whole"] = all(p.numel() > 0 for p in model.parameters()) and not _differences(model, plain_gpt2)
    hf_config = HfInfinityConfig(_stage3())
    del hf_config
    gc.collect()
    out["dropped_active"] = is_zero3_active()
    out["dropped_untouched"] = PreTrainedModel.__dict__["get_init_context"] is original_init_context
    model = AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"])
    out["dropped_whole"] = all(p.numel() > 0 for p in model.parameters()) and not _differences(model, plain_gpt2)
    return out


def _check(results: list[dict], world_size: int) -> None:
    for result in results:
        assert result["active"]
        assert result["gpt2_partitioned"] and result["gpt2_tied"]
        assert result["on_nvme"] >= 4 * result["numel"] / world_size, "this rank's pieces did not go to NVMe"
        assert result["gpt2_differences"] == []
        assert result["gpt2_tied_after_initialize"] and result["gpt2_logits"]
        assert result["llama_partitioned"]
        assert result["llama_differences"] == [] and result["llama_logits"]
        assert result["missing_partitioned"]
        assert result["loading_info"][0] == result["loading_info"][1]
        (missing, unexpected), _ = result["loading_info"]
        assert missing["missing_keys"] == {"score.weight"} and unexpected["unexpected_keys"] == {"score.weight"}
        assert result["missing_differences"] == {"classifier": [], "head": [], "built": []}
        assert result["padding_row"] == 0.0  # init.zeros_(weight[padding_idx]) reached the partitions
        assert result["mismatched"] == {("transformer.wpe.weight", (16, 32), (32, 32))}
        assert not result["stage2_active"] and result["stage2_untouched"] and result["stage2_whole"]
        assert not result["dropped_active"] and result["dropped_untouched"] and result["dropped_whole"]


def test_from_pretrained_under_stage3_at_world_size_1(tmp_path, checkpoints):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = run_distributed(_load_at_stage3, 1, tmp_path, timeout_s=240, checkpoints=checkpoints, nvme_path=str(nvme))
    _check(results, 1)


def test_from_pretrained_under_stage3_at_world_size_2_in_a_share_of_the_memory(tmp_path, checkpoints):
    """Everything of world size 1, and first a 49 MiB GPT-2 loaded both ways: each rank's resident memory rises by
    about half the model plus a layer, where Transformers' own loading holds the whole model."""
    torch.manual_seed(0)
    big = transformers.GPT2LMHeadModel(_gpt2_config(vocab_size=256, n_positions=64, n_embd=512, n_layer=4, n_head=8))
    total = sum(p.numel() * p.element_size() for p in big.parameters())
    largest = max(p.numel() * p.element_size() for p in big.parameters())
    layer = sum(p.numel() * p.element_size() for p in big.transformer.h[0].parameters())
    path = _save(big, tmp_path / "big")
    del big
    (tmp_path / "run").mkdir()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results = run_distributed(
        _load_at_stage3, 2, tmp_path / "run", timeout_s=240, checkpoints=checkpoints, nvme_path=str(nvme), big=path
    )
    for result in results:
        assert result["plain"] >= 0.9 * total  # the measurement sees a whole model when there is one
        budget = total / 2 + layer + 4 * MiB  # about 1/N of the model and one layer
        assert result["partitioned"] <= budget, f"{result['partitioned'] / MiB:.1f} MiB > {budget / MiB:.1f} MiB"
        print(
            f"peak above the start: plain {result['plain'] / MiB:.1f} MiB, partitioned "
            f"{result['partitioned'] / MiB:.1f} MiB (model {total / MiB:.1f} MiB, a layer {layer / MiB:.1f} MiB, its "
            f"largest weight {largest / MiB:.1f} MiB)"
        )
    _check(results, 2)


class _DeepSpeedZero3Config:
    """What Transformers asks of a live HfDeepSpeedConfig (which needs DeepSpeed itself to be made)."""

    config = {"zero_optimization": {"stage": 3}}

    def is_zero3(self) -> bool:
        return True


def test_a_live_deepspeed_zero3_config_beside_ours_is_an_error():
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    from infinity.integrations.hf_loading import HfInfinityConfig, is_zero3_active

    deepspeed_config = _DeepSpeedZero3Config()
    set_hf_deepspeed_config(deepspeed_config)
    try:
        hf_config = HfInfinityConfig({"zero_optimization": {"stage": 3}})
        with pytest.raises(ConfigError, match="both an HfDeepSpeedConfig for ZeRO-3"):
            transformers.AutoModelForCausalLM.from_config(_gpt2_config())
        del hf_config
        gc.collect()
        assert not is_zero3_active()
    finally:
        unset_hf_deepspeed_config()


def test_hf_infinity_config_errors_name_the_config(tmp_path):
    from infinity.integrations.hf_loading import HfInfinityConfig, is_zero3_active

    with pytest.raises(ConfigError, match="does not exist"):
        HfInfinityConfig(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="stage"):
        HfInfinityConfig({"zero_optimization": {"stage": 4}})
    assert not is_zero3_active()

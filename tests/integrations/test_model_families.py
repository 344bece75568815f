"""The families users fine-tune, each a tiny model built locally from its config under a live stage-3
HfInfinityConfig (partitioned as it is built, the parameters then on NVMe): three steps on the engine equal plain
PyTorch AdamW on the same weights (losses within 1e-5 relative), at world size 1 and 2. Encoders with a tied,
biased MLM head (BERT, RoBERTa), decoders (Llama, Mistral, Qwen2, Gemma, OPT, GPT-2), encoder-decoders (T5,
BART) and a vision transformer (ViT, classifying images)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from infinity.integrations.hf_loading import HfInfinityConfig  # noqa: E402
from infinity.zero import GatheredParameters  # noqa: E402
from tests.distributed.harness import run_distributed  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=40, vocab_size=64)  # fmt: skip
T = transformers
FAMILIES = {
    "bert": lambda: (T.BertConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                     T.AutoModelForMaskedLM),
    "roberta": lambda: (T.RobertaConfig(**SMALL, pad_token_id=1, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0), T.AutoModelForMaskedLM),
    "llama": lambda: (T.LlamaConfig(**SMALL, num_key_value_heads=2), T.AutoModelForCausalLM),
    "mistral": lambda: (T.MistralConfig(**SMALL, num_key_value_heads=1), T.AutoModelForCausalLM),
    "qwen2": lambda: (T.Qwen2Config(**SMALL, num_key_value_heads=1), T.AutoModelForCausalLM),
    "opt": lambda: (T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                                max_position_embeddings=40, vocab_size=64, word_embed_proj_dim=32, dropout=0.0),
                    T.AutoModelForCausalLM),
    "gpt2": lambda: (T.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=40, vocab_size=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None),
                     T.AutoModelForCausalLM),
    "gemma": lambda: (T.GemmaConfig(**SMALL, num_key_value_heads=1, head_dim=16), T.AutoModelForCausalLM),
    "vit": lambda: (T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                image_size=16, patch_size=4, num_labels=4, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0), T.AutoModelForImageClassification),
    "t5": lambda: (T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=64, d_kv=16,
                              dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0), T.AutoModelForSeq2SeqLM),
    "bart": lambda: (T.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                                  max_position_embeddings=40, dropout=0.0), T.AutoModelForSeq2SeqLM),
}  # fmt: skip
LR = 1e-3


def batch_halves(family: str, world_size: int) -> list[dict]:
    """A seeded batch of 2, cut into one part per rank: token ids as their own labels, or (ViT) images of 16 x 16
    pixels and a class each."""
    generator = torch.Generator().manual_seed(1)
    if family == "vit":
        pixels, labels = torch.randn(2, 3, 16, 16, generator=generator), torch.tensor([1, 3])
        return [{"pixel_values": p, "labels": y} for p, y in zip(pixels.chunk(world_size), labels.chunk(world_size),
                                                                  strict=True)]  # fmt: skip
    ids = torch.randint(3, 60, (2, 8), generator=generator)
    return [{"input_ids": part, "labels": part} for part in ids.chunk(world_size)]


def train_both(family: str, nvme, *, rank: int = 0, world_size: int = 1) -> tuple[list[float], list[float]]:
    """Three steps of the family's tiny model on the engine (built partitioned, its parameters on NVMe) and of
    plain PyTorch AdamW on the same weights: (engine's losses, plain's losses). At world size 2 each rank trains
    on its half of the batch and the plain twin on the whole batch (the mean of the halves' mean losses: every
    token counts), and the losses compared are those of the rank's half."""
    model_config, auto = FAMILIES[family]()
    offload = {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}
    config = {"train_micro_batch_size_per_gpu": 2 // world_size, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": offload}}
    live = HfInfinityConfig(config)
    torch.manual_seed(0)
    model = auto.from_config(model_config)
    del live
    gc.collect()  # no live config: the plain twin is built whole
    plain = auto.from_config(model_config)
    with GatheredParameters(list(model.parameters())):
        plain.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.0)  # DeepSpeed's AdamW defaults
    engine, *_ = infinity.initialize(model=model, config=config)
    assert engine.stage3.table.shards.home.value == "nvme"
    halves = batch_halves(family, world_size)
    got, want = [], []
    for _ in range(3):
        loss = engine(**halves[rank]).loss
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
        losses = [plain(**half).loss for half in halves]
        (sum(losses) / world_size).backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(losses[rank].item())
    engine.destroy()
    return got, want


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tiny_model_of_each_family_trains_at_stage_3_as_plain_pytorch(family, tmp_path):
    (tmp_path / "nvme").mkdir()
    got, want = train_both(family, tmp_path / "nvme")
    assert got == pytest.approx(want, rel=1e-5), family
    assert got[-1] < got[0]


def _every_family(*, rank: int, world_size: int, tmp: str) -> dict:
    nvme = f"{tmp}/nvme-{rank}"
    os.makedirs(nvme)
    return {family: train_both(family, nvme, rank=rank, world_size=world_size) for family in FAMILIES}


def test_every_family_at_world_size_2(tmp_path):
    """The same at world size 2 (gloo, a swap folder per rank), every family in one distributed run."""
    for result in run_distributed(_every_family, 2, tmp_path, timeout_s=300, tmp=str(tmp_path)):
        for family, (got, want) in result.items():
            assert got == pytest.approx(want, rel=1e-5), family

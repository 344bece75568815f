"""What the fine-tuning examples share, built here so nothing is downloaded: a character tokenizer (one token per
letter a-z, space and full stop), a tiny Llama-shaped causal LM, some learnable text, and the ZeRO-3 config with
the parameters on NVMe that both examples train with."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARACTERS = "abcdefghijklmnopqrstuvwxyz ."


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; the last one ends a text and pads."""
    vocab = {c: i for i, c in enumerate(CHARACTERS)} | {"<eos>": len(CHARACTERS)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", pad_token="<eos>")


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    """Seeded: the same weights on every rank (and for a reference model built the same way)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=vocab_size - 1, bos_token_id=None, eos_token_id=vocab_size - 1)  # fmt: skip
    return LlamaForCausalLM(config)


def alphabet_text(n: int) -> list[str]:
    """Runs of the alphabet from every letter: the next character is always the letter after this one."""
    letters = CHARACTERS[:26]
    return [" ".join(letters[(s + i) % 26] for i in range(8)) + "." for s in range(n)]


def zero3_nvme(nvme_path: str) -> dict:
    """Stage 3, every rank's parameter pieces on NVMe under ``nvme_path``; the rest "auto": the Trainer's
    arguments decide, as they do for DeepSpeed."""
    return {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000,
                              "offload_param": {"device": "nvme", "nvme_path": nvme_path}},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }  # fmt: skip

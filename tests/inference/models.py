"""The tiny GPT-2 the inference tests share: built from a config with a fixed seed, saved with save_pretrained
(no download), loaded back as the plain reference and as the engine's model."""

from __future__ import annotations

import os

import torch

VOCAB = 128


def save_tiny_gpt2(folder) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                        eos_token_id=1, pad_token_id=1)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    return os.fspath(folder)


def load_tiny_gpt2(folder: str):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder).eval()


def stage3_nvme_config(nvme_path: str) -> dict:
    """Every piece on NVMe (max_in_cpu 0) and each unit released after its use, so every forward streams the
    weights from the disk through the staging ring, read ahead along the trace; stage3_max_live_parameters below
    the model's ~31k elements (and room for its prefetch), so generate() streams too rather than gathering the
    model once ([Note: generation gathered once] in infinity/generation.py)."""
    return {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 24000,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 1 << 14,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0},
        },
        "collective_timeout": 60,
    }


def greedy(model, prompt: torch.Tensor, **kwargs) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **kwargs)

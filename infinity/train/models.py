"""The models `infinity train` and `infinity estimate` know by name: transformers config classes with published
shapes, so nothing is downloaded. A path to a config JSON (as `save_pretrained` writes it) names any other model.

Families list their members smallest first: `infinity estimate` walks a family to find the largest member that
fits the machine."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class UnknownModelError(ValueError):
    """A --model that is neither a known name nor a readable config JSON."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    name: str
    family: str  # "gpt2" | "llama"
    fields: dict[str, Any]  # the transformers config's keyword arguments
    note: str  # what it is, in a few words, for --help and the summary
    numel: int | None = None  # distinct parameters, for the named ones (a test counts them)


# Vocabularies of the tiny models are small on purpose: on a CPU the logits dominate a tiny model's step.
CATALOG: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(name="gpt2-tiny", family="gpt2", numel=3_552_768, note="GPT-2: 4 layers of width 256, vocab 512",
                   fields=dict(model_type="gpt2", n_embd=256, n_layer=4, n_head=8, vocab_size=512,
                               n_positions=1024, bos_token_id=511, eos_token_id=511)),
        ModelShape(name="gpt2-small", family="gpt2", numel=124_439_808, note="GPT-2 small, 124M",
                   fields=dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                               n_positions=1024)),
        ModelShape(name="gpt2-medium", family="gpt2", numel=354_823_168, note="GPT-2 medium, 355M",
                   fields=dict(model_type="gpt2", n_embd=1024, n_layer=24, n_head=16, vocab_size=50257,
                               n_positions=1024)),
        ModelShape(name="gpt2-large", family="gpt2", numel=774_030_080, note="GPT-2 large, 774M",
                   fields=dict(model_type="gpt2", n_embd=1280, n_layer=36, n_head=20, vocab_size=50257,
                               n_positions=1024)),
        ModelShape(name="gpt2-xl", family="gpt2", numel=1_557_611_200, note="GPT-2 XL, 1.5B",
                   fields=dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, vocab_size=50257,
                               n_positions=1024)),
        ModelShape(name="llama-tiny", family="llama", numel=3_164_416, note="Llama: 4 layers of width 256, vocab 512",
                   fields=dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, vocab_size=512,
                               max_position_embeddings=2048, tie_word_embeddings=False)),
        ModelShape(name="llama-1b", family="llama", numel=1_235_814_400, note="the shape of Llama 3.2 1B (1.24B)",
                   fields=dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                               tie_word_embeddings=True)),
        ModelShape(name="llama-3b", family="llama", numel=3_212_749_824, note="the shape of Llama 3.2 3B (3.2B)",
                   fields=dict(model_type="llama", hidden_size=3072, intermediate_size=8192,
                               num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                               vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                               tie_word_embeddings=True)),
        ModelShape(name="llama-8b", family="llama", numel=8_030_261_248, note="the shape of Llama 3.1 8B",
                   fields=dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                               tie_word_embeddings=False)),
        ModelShape(name="llama-70b", family="llama", numel=70_553_706_496, note="the shape of Llama 3.1 70B",
                   fields=dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                               vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                               tie_word_embeddings=False)),
    )
}  # fmt: skip


def _size(numel: int) -> str:
    if numel >= 10**9:
        return f"{numel / 1e9:.1f}B"
    return f"{numel / 1e6:.0f}M" if numel >= 10**8 else f"{numel / 1e6:.1f}M"


def named_models() -> str:
    """Every name --model accepts, with its parameter count: what --help, the unknown-model error and the README
    list."""
    return ", ".join(f"{shape.name} ({_size(shape.numel or 0)})" for shape in CATALOG.values())


def family_members(family: str) -> list[ModelShape]:
    """A family's named shapes, smallest first (the catalog's order)."""
    return [shape for shape in CATALOG.values() if shape.family == family]


def resolve(model: str) -> ModelShape:
    """A catalog name, or a config JSON: the shape `hf_config` builds. Errors name the value and the choices."""
    if model in CATALOG:
        return CATALOG[model]
    if model.endswith(".json") or os.path.sep in model:
        try:
            with open(model) as f:
                fields = json.load(f)
        except FileNotFoundError:
            raise UnknownModelError(f"--model {model!r}: no such file") from None
        except (OSError, json.JSONDecodeError) as e:
            raise UnknownModelError(f"--model {model!r} cannot be read as a JSON config: {e}") from None
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise UnknownModelError(
                f"--model {model!r} has no \"model_type\": give a transformers config.json (save_pretrained writes one)"
            )
        family = "llama" if fields["model_type"] == "llama" else str(fields["model_type"])
        return ModelShape(name=os.path.basename(model), family=family, fields=fields, note=f"from {model}")
    raise UnknownModelError(
        f"--model {model!r} is not a known model: choose one of {named_models()}, or a config .json path"
    )


def hf_config(shape: ModelShape, *, seq_len: int | None = None):
    """The transformers config object. Importing transformers here keeps the rest of infinity free of it."""
    from transformers import AutoConfig

    fields = {k: v for k, v in shape.fields.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        config = AutoConfig.for_model(shape.fields["model_type"], **fields)
    except ValueError as e:
        raise UnknownModelError(f"--model {shape.name!r}: transformers cannot build it: {e}") from None
    _check_causal_lm(shape, config.model_type)
    config.use_cache = False  # training: no key/value cache
    if seq_len is not None:
        longest = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        if longest is not None and seq_len > longest:
            raise UnknownModelError(f"--seq-len {seq_len} is longer than {shape.name}'s {longest} positions")
    return config


def _check_causal_lm(shape: ModelShape, model_type: str) -> None:
    """Before transformers' own error, which lists every causal-LM class it knows (kilobytes on one line)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        known = len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        raise UnknownModelError(
            f"--model {shape.name!r}: model type {model_type!r} is not a causal language model; infinity trains the "
            f"{known} model types transformers' AutoModelForCausalLM builds (gpt2, llama, mistral, qwen2, ...)"
        )


def count_parameters(shape: ModelShape) -> int:
    """Distinct parameters (a tied weight once), counted on the meta device: nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(shape))
    return sum(p.numel() for p in model.parameters())

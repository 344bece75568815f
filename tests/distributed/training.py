"""Models, data and training loops shared by the parity tests: plain PyTorch vs the engine.

The engine at world size W runs micro-batches of M samples with G accumulation steps; the reference runs one
backward over the same M*G*W samples per step. The loss is a mean, so both follow the same gradient.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

import infinity
import infinity.zero

VOCAB, SEQ = 50, 8


class TinyTransformer(nn.Module):
    """A small causal transformer. No biases in the blocks: an attention key bias gets a gradient that is
    mathematically zero (softmax ignores a constant shift), so its values are rounding noise that Adam
    normalises into full steps; it would make any two correct implementations disagree."""

    def __init__(self, d_model: int = 32, layers: int = 2, checkpoint: bool = False) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(SEQ, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, nhead=4, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True, bias=False
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=x.dtype)
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, src_mask=mask, is_causal=True, use_reentrant=False)
            else:
                x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def gpt2(*, checkpoint: bool = False) -> nn.Module:
    """A tiny transformers GPT-2 built from a config (no download); lm_head is tied to wte."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    for block in model.transformer.h:
        # The key part of c_attn's bias gets a gradient that is mathematically zero (see TinyTransformer): its
        # rounding noise, normalised by Adam, would make any two correct implementations disagree. Frozen here,
        # which also covers frozen parameters at stage 3.
        block.attn.c_attn.bias.requires_grad_(False)
    if checkpoint:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def build(model_name: str) -> nn.Module:
    """mlp, transformer, gpt2; a "-ckpt" suffix adds activation checkpointing (non-reentrant)."""
    torch.manual_seed(1234)
    base, _, suffix = model_name.partition("-")
    if base == "mlp":
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    if base == "gpt2":
        return gpt2(checkpoint=suffix == "ckpt")
    return TinyTransformer(checkpoint=suffix == "ckpt")


def global_batch(model_name: str, step: int, size: int):
    gen = torch.Generator().manual_seed(10_000 + step)
    if model_name.startswith("mlp"):
        return torch.randn(size, 16, generator=gen), torch.randn(size, 4, generator=gen)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model_name: str, output, target: torch.Tensor) -> torch.Tensor:
    output = getattr(output, "logits", output)  # a transformers ModelOutput
    if model_name.startswith("mlp"):
        return F.mse_loss(output.float(), target.float())
    return F.cross_entropy(output.float().reshape(-1, VOCAB), target.reshape(-1))


def train_reference(
    model_name: str, *, steps: int, batch: int, lr: float, clip: float, dtype=torch.float32, split=None
):
    """Plain PyTorch: fused AdamW on fp32 weights. For bf16, the canonical recipe: fp32 masters, a bf16 copy for
    forward/backward, gradients cast back to fp32 for the step.

    split=(micro, accumulation, world_size) accumulates the gradient over the engine's micro-batches in the
    engine's order (per rank, then across ranks), so the sums round alike: for models where Adam turns rounding
    noise of near-zero gradients into visible steps (GPT-2)."""
    master = build(model_name)
    optimizer = torch.optim.AdamW(master.parameters(), lr=lr, fused=True)
    model = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    losses = []
    for step in range(steps):
        inputs, target = global_batch(model_name, step, batch)
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        model.zero_grad(set_to_none=True)
        if split is None:
            loss = loss_fn(model_name, model(inputs), target)
            loss.backward()
        else:
            loss = _accumulate_like_the_engine(model_name, model, inputs, target, *split)
        if model is not master:
            for p_master, p_model in zip(master.parameters(), model.parameters(), strict=True):
                p_master.grad = p_model.grad.float()
        if clip:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        optimizer.step()
        if model is not master:
            with torch.no_grad():
                for p_master, p_model in zip(master.parameters(), model.parameters(), strict=True):
                    p_model.copy_(p_master)
        losses.append(loss.item())
    return losses, {name: p.detach().float().clone() for name, p in master.named_parameters()}


def _accumulate_like_the_engine(model_name, model, inputs, target, micro, accumulation, world_size):
    params = [p for p in model.parameters() if p.requires_grad]
    per_rank = []
    total_loss = torch.zeros(())
    for rank in range(world_size):
        sums = None
        for k in range(accumulation):
            start = k * micro * world_size + rank * micro
            loss = loss_fn(model_name, model(inputs[start : start + micro]), target[start : start + micro])
            grads = torch.autograd.grad(loss / accumulation, params)
            sums = list(grads) if sums is None else [s + g for s, g in zip(sums, grads, strict=True)]
            total_loss += loss.detach() / accumulation / world_size
        per_rank.append(sums)
    for index, param in enumerate(params):
        grad = per_rank[0][index]
        for sums in per_rank[1:]:
            grad = grad + sums[index]
        param.grad = grad / world_size
    return total_loss


def engine_config(
    *,
    stage: int,
    micro: int,
    accumulation: int,
    lr: float,
    clip: float,
    offload: bool = False,
    precision: str = "fp32",
    bucket: int = 2000,
    overlap: bool = True,
    **extra,
) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": overlap},
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def train_engine(model_name: str, config: dict, *, steps: int, rank: int, world_size: int):
    """Each rank trains on its slice of every global batch; returns losses (this rank's mean of micro-batch
    losses, averaged over ranks) and the final full parameters."""
    model = build(model_name)
    engine, *_ = infinity.initialize(model=model, config=config)
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    per_step = micro * accumulation * world_size
    losses = []
    for step in range(steps):
        inputs, target = global_batch(model_name, step, per_step)
        step_loss = torch.zeros(())
        for k in range(accumulation):
            start = k * micro * world_size + rank * micro
            loss = loss_fn(model_name, engine(inputs[start : start + micro]), target[start : start + micro])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / accumulation
        if world_size > 1:
            torch.distributed.all_reduce(step_loss)
            step_loss /= world_size
        losses.append(step_loss.item())
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole, not shards
        params = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    result = {
        "losses": losses,
        "params": params,
        "state_bytes": engine.optimizer_state_bytes(),
        "global_steps": engine.global_steps,
    }
    engine.destroy()
    return result

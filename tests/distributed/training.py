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

    def __init__(self, d_model: int = 32, layers: int = 2) -> None:
        super().__init__()
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
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def build(model_name: str) -> nn.Module:
    torch.manual_seed(1234)
    if model_name == "mlp":
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    return TinyTransformer()


def global_batch(model_name: str, step: int, size: int):
    gen = torch.Generator().manual_seed(10_000 + step)
    if model_name == "mlp":
        return torch.randn(size, 16, generator=gen), torch.randn(size, 4, generator=gen)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model_name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model_name == "mlp":
        return F.mse_loss(output.float(), target.float())
    return F.cross_entropy(output.float().reshape(-1, VOCAB), target.reshape(-1))


def train_reference(model_name: str, *, steps: int, batch: int, lr: float, clip: float, dtype=torch.float32):
    """Plain PyTorch: fused AdamW on fp32 weights. For bf16, the canonical recipe: fp32 masters, a bf16 copy for
    forward/backward, gradients cast back to fp32 for the step."""
    master = build(model_name)
    optimizer = torch.optim.AdamW(master.parameters(), lr=lr, fused=True)
    model = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    losses = []
    for step in range(steps):
        inputs, target = global_batch(model_name, step, batch)
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        loss = loss_fn(model_name, model(inputs), target)
        model.zero_grad(set_to_none=True)
        loss.backward()
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

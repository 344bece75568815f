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
from infinity.memory import plan as memory_plan
from infinity.zero.partition import overlap

VOCAB, SEQ = 50, 8
WEIGHT_DECAY = 0.01  # AdamW's; set explicitly on both sides, so no test leans on either side's default


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
    model_name: str,
    *,
    steps: int,
    batch: int,
    lr: float,
    clip: float,
    dtype=torch.float32,
    split=None,
    weight_decay: float = WEIGHT_DECAY,
):
    """Plain PyTorch: fused AdamW on fp32 weights. For bf16, the canonical recipe: fp32 masters, a bf16 copy for
    forward/backward, gradients cast back to fp32 for the step.

    split=(micro, accumulation, world_size) accumulates the gradient over the engine's micro-batches in the
    engine's order (per rank, then across ranks), so the sums round alike: for models where Adam turns rounding
    noise of near-zero gradients into visible steps (GPT-2), and for bf16, where each micro-batch's bf16
    gradient is summed in fp32 as the engine does.

    Runs on one thread, as the engine's processes do (harness.py): bf16 matmuls round differently with another
    thread count (measured: 8e-2 apart after 20 steps on the transformer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_reference(model_name, steps, batch, lr, clip, dtype, split, weight_decay)
    finally:
        torch.set_num_threads(threads)


def _train_reference(model_name, steps, batch, lr, clip, dtype, split, weight_decay):
    master = build(model_name)
    optimizer = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
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
            grads = [None if p.grad is None else p.grad.float() for p in model.parameters()]
        else:
            loss, grads = _accumulate_like_the_engine(model_name, model, inputs, target, *split)
        for p_master, grad in zip(master.parameters(), grads, strict=True):
            p_master.grad = grad
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
    """Per rank, the fp32 sum of its micro-batch gradients (each computed in the model's dtype); then the mean
    over ranks. Returns the mean loss and one fp32 gradient per parameter (None for frozen ones)."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_rank = []
    total_loss = torch.zeros(())
    for rank in range(world_size):
        sums = None
        for k in range(accumulation):
            start = k * micro * world_size + rank * micro
            loss = loss_fn(model_name, model(inputs[start : start + micro]), target[start : start + micro])
            grads = [g.float() for g in torch.autograd.grad(loss / accumulation, params)]
            sums = grads if sums is None else [s + g for s, g in zip(sums, grads, strict=True)]
            total_loss += loss.detach() / accumulation / world_size
        per_rank.append(sums)
    mean = {}
    for index, param in enumerate(params):
        grad = per_rank[0][index]
        for sums in per_rank[1:]:
            grad = grad + sums[index]
        mean[id(param)] = grad / world_size
    return total_loss, [mean.get(id(p)) for p in model.parameters()]


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
    weight_decay: float = WEIGHT_DECAY,
    **extra,
) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": overlap},
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def train_engine(model_name: str, config: dict, *, steps: int, rank: int, world_size: int, probe=None):
    """Each rank trains on its slice of every global batch; returns losses (this rank's mean of micro-batch
    losses, averaged over ranks), the final full parameters as GatheredParameters shows them, and this rank's
    own master pieces (own_pieces: read from its shard, no collective); ``probe(engine)``'s dict too, if given,
    taken before the engine is destroyed."""
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
    pieces = own_pieces(engine)
    compute_pieces = own_pieces(engine, masters=False) if engine.stage3 is not None else None
    with infinity.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole, not shards
        params = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    result = {
        "losses": losses,
        "params": params,
        "pieces": pieces,
        "compute_pieces": compute_pieces,
        "state_bytes": engine.optimizer_state_bytes(),
        "global_steps": engine.global_steps,
        **(probe(engine) if probe is not None else {}),
    }
    engine.destroy()
    return result


def own_pieces(engine, *, masters: bool = True) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """What this rank itself holds of each parameter, read straight from its shard (no collective, so a wrong
    piece on one rank cannot be hidden by a gather that hands every rank the same values): parameter name ->
    [(first element in the flattened parameter, fp32 values)]. ``masters``: the optimizer's fp32 masters;
    otherwise (stage 3 only) the compute-dtype shard the units gather from (``stage3.table.shards``).
    Stage 0 ranks hold everything; parameters outside the optimizer (frozen) come from the compute copy."""
    optimizer = engine.zero_optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {n: [] for n in names.values()}

    def take(param, slot, piece: torch.Tensor, start: int, end: int) -> None:
        part = overlap(slot, start, end)
        if part is not None:
            lo, hi = part
            pieces[names[id(param)]].append((lo - slot.offset, piece[lo - start : hi - start].float().cpu().clone()))

    if engine.stage3 is None:
        if not masters:
            raise ValueError("below stage 3 every rank holds the whole compute-dtype model: read the parameters")
        trained = set()
        for params, layout, master in zip(optimizer.groups, optimizer.layouts, fp32_shards(optimizer), strict=True):
            for bucket in layout.buckets:
                start, end = bucket.piece_range(optimizer.shard_rank)
                piece = master.detach()[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel]
                for slot in bucket.slots:
                    trained.add(id(params[slot.param_index]))
                    take(params[slot.param_index], slot, piece, start, end)
        for name, param in engine.module.named_parameters():
            if id(param) not in trained:
                pieces[name].append((0, param.detach().float().reshape(-1).cpu().clone()))
        return pieces
    table = engine.stage3.table
    flat = fp32_shards(optimizer)[0] if masters else shard_snapshot(table.shards).float()
    for unit in table.units:
        bucket = unit.bucket
        start, end = bucket.piece_range(engine.global_rank)
        piece = flat[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel]
        for slot, param in zip(bucket.slots, unit.params, strict=True):
            take(param, slot, piece, start, end)
    return pieces


def pieces_error(per_rank: list[dict], ref: dict[str, torch.Tensor]) -> float:
    """Every rank's own pieces against the reference: the largest max |p - p_ref| / max |p_ref| over tensors.
    Fails unless the pieces of all ranks together cover every element of every parameter."""
    error = 0.0
    for name, want in ref.items():
        flat = want.reshape(-1)
        covered = torch.zeros(flat.numel(), dtype=torch.bool)
        for pieces in per_rank:
            for first, values in pieces[name]:
                assert first + values.numel() <= flat.numel(), f"{name}: a piece runs past the parameter"
                covered[first : first + values.numel()] = True
                deviation = (values - flat[first : first + values.numel()]).abs().max()
                error = max(error, float(deviation / flat.abs().max().clamp_min(1e-12)))
        assert bool(covered.all()), f"{name}: {int((~covered).sum())} elements in no rank's pieces"
    return error


def shard_snapshot(shards) -> torch.Tensor:
    """A stage-3 rank's whole compute-dtype shard (zero/shards.py UnitShards), as a new host tensor: O(shard), for
    comparing with plain PyTorch; the engine itself never holds the shard whole."""
    if shards.flat is not None:
        return shards.flat.detach().cpu().clone()
    shards.manager.flush()
    out = torch.empty(shards.layout.shard_numel, dtype=shards.dtype)
    for bucket in shards.layout.buckets:
        shards.load_into(bucket.index, out[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel])
    return out


def fp32_shards(optimizer) -> list[torch.Tensor]:
    """A rank's fp32 masters, one flat shard per param group (stage 3: one for the whole shard, the pieces of
    parameters outside the optimizer in their compute-dtype values), read from their tiles when offloaded."""
    if getattr(optimizer, "table", None) is not None:  # stage 3 (UnitOptimizer)
        flat = shard_snapshot(optimizer.table.shards).float()
        optimizer.tiled.read_masters(lambda tile: flat[tile.start : tile.start + tile.numel])
        return [flat]
    shards = [torch.zeros(layout.shard_numel, dtype=torch.float32) for layout in optimizer.layouts]
    if optimizer.tiled is None:
        for master, (group, first) in zip(optimizer.masters, optimizer._master_at, strict=True):
            shards[group][first : first + master.numel()].copy_(master.detach())
        return shards
    optimizer.tiled.read_masters(lambda tile: shards[tile.group][tile.start : tile.start + tile.numel])
    return shards


class gradients_on_nvme:  # noqa: N801  (used as a context manager, like torch.no_grad)
    """Within it, stage 3 with the optimizer on NVMe puts the gradient there too, however small: the plan's part of
    the host share for it is made 0 bytes (memory/plan.py GRADIENT_PART; a test model's gradient always fits the
    real quarter), so the swapped-gradient path ([Note: swapped gradients]) stays tested."""

    def __enter__(self):
        self.saved = memory_plan.GRADIENT_PART
        memory_plan.GRADIENT_PART = 1 << 62
        return self

    def __exit__(self, *exc):
        memory_plan.GRADIENT_PART = self.saved
        return False

"""The partitioned optimizer for ZeRO stages 0-2 (optionally offloaded to host memory).

Layout (see [Note: bucket-sharded layout] in partition.py): the model's trainable parameters become views into
flat per-bucket weight buffers in the compute dtype; each rank keeps an fp32 master copy of its pieces (stage 0:
of everything), the matching fp32 gradient shard, and the optimizer states for exactly those elements. The user's
torch optimizer is kept (so schedulers bound to it keep working) and re-pointed at the master shards, as
DeepSpeed does. A step: unscale -> overflow check across ranks (fp16) -> global-norm clipping -> the torch
optimizer on the master shard (on the host with offload) -> new low-precision pieces -> all-gather per bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from infinity.zero import collectives
from infinity.zero.collectives import Comm
from infinity.zero.partition import GroupLayout, plan
from infinity.zero.reducer import GradientReducer


@dataclass(frozen=True, slots=True)
class StepResult:
    stepped: bool  # False when skipped for an fp16 overflow
    grad_norm: float  # global L2 norm of the (unscaled) gradient, before clipping


class ZeroOptimizer:
    """Owns master weights, gradient shards and the optimizer step for stages 0, 1 and 2."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        comm: Comm,
        stage: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        overlap_comm: bool,
        offload: bool,
    ) -> None:
        self.optimizer = optimizer
        self.comm = comm
        self.stage = stage
        self.compute_dtype = compute_dtype
        self.device = device
        self.master_device = torch.device("cpu") if offload else device
        shard_world = 1 if stage == 0 else comm.world_size
        self.shard_rank = 0 if stage == 0 else comm.rank
        self.groups: list[list[nn.Parameter]] = [list(g["params"]) for g in optimizer.param_groups]
        self.layouts: tuple[GroupLayout, ...] = plan(
            [[p.numel() for p in params] for params in self.groups], world_size=shard_world, bucket_numel=bucket_numel
        )
        self.weights: list[list[torch.Tensor]] = []  # [group][bucket] -> (padded_numel,) compute dtype
        self.masters: list[nn.Parameter] = []
        self.grad_shards: list[torch.Tensor] = []
        for params, layout in zip(self.groups, self.layouts, strict=True):
            self._flatten_group(params, layout)
        for group, master in zip(optimizer.param_groups, self.masters, strict=True):
            group["params"] = [master]
        optimizer.state.clear()
        self.reducer = GradientReducer(
            comm=comm, stage=stage, layouts=self.layouts, grad_shards=self.grad_shards, shard_rank=self.shard_rank,
            device=device, overlap_comm=overlap_comm,
        )  # fmt: skip
        self._hooks = []
        for g, (params, layout) in enumerate(zip(self.groups, self.layouts, strict=True)):
            for bucket in layout.buckets:
                index = self.reducer.state_index(g, bucket.index)
                for slot in bucket.slots:
                    self._hooks.append(params[slot.param_index].register_post_accumulate_grad_hook(
                        self._make_hook(index, slot.offset)))  # fmt: skip

    # ---- construction ----
    def _flatten_group(self, params: list[nn.Parameter], layout: GroupLayout) -> None:
        """Params become views into per-bucket flat weights; this rank's fp32 master pieces are copied out."""
        master = torch.empty(layout.shard_numel, dtype=torch.float32, device=self.master_device)
        weights = []
        for bucket in layout.buckets:
            flat = torch.zeros(bucket.padded_numel, dtype=torch.float32, device=self.device)
            for slot in bucket.slots:
                flat[slot.offset : slot.offset + slot.numel].copy_(params[slot.param_index].detach().reshape(-1))
            # Every rank starts from rank 0's weights, as DeepSpeed broadcasts the model at initialization.
            if self.comm.active:
                torch.distributed.broadcast(flat, src=0, group=self.comm.group)
            start, end = bucket.piece_range(self.shard_rank)
            master[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel].copy_(flat[start:end])
            flat = flat.to(self.compute_dtype)
            for slot in bucket.slots:
                param = params[slot.param_index]
                param.data = flat[slot.offset : slot.offset + slot.numel].view(param.shape)
            weights.append(flat)
        self.weights.append(weights)
        self.masters.append(nn.Parameter(master))
        self.grad_shards.append(torch.zeros_like(master))

    def _make_hook(self, state_index: int, offset: int):
        reducer = self.reducer

        def hook(param: torch.Tensor) -> None:
            reducer.on_grad(state_index, offset, param.grad)
            param.grad = None  # its values live in the fp32 bucket buffer now

        return hook

    # ---- the step ----
    def step(self, *, loss_scale: float, clip_norm: float, check_overflow: bool) -> StepResult:
        if loss_scale != 1.0:
            for grad in self.grad_shards:
                grad.mul_(1.0 / loss_scale)
        if check_overflow and self._overflow_anywhere():
            self.zero_grad()
            return StepResult(stepped=False, grad_norm=math.inf)
        norm = self.global_grad_norm()
        if clip_norm > 0:
            coefficient = min(clip_norm / (norm + 1e-6), 1.0)
            if coefficient < 1.0:
                for grad in self.grad_shards:
                    grad.mul_(coefficient)
        for master, grad in zip(self.masters, self.grad_shards, strict=True):
            master.grad = grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self._publish_weights()
        self.zero_grad()
        return StepResult(stepped=True, grad_norm=norm)

    def _overflow_anywhere(self) -> bool:
        local = any(not torch.isfinite(grad).all() for grad in self.grad_shards)
        flag = torch.tensor([1.0 if local else 0.0], device=self.device)
        return bool(collectives.all_reduce_max_(self.comm, flag).item())

    def global_grad_norm(self) -> float:
        """L2 norm of the whole gradient: squares summed over this rank's disjoint pieces, then across ranks."""
        squares = torch.zeros(1, dtype=torch.float64, device=self.device)
        for grad in self.grad_shards:
            squares += torch.linalg.vector_norm(grad).double().to(self.device) ** 2
        if self.stage > 0:
            collectives.all_reduce_sum_(self.comm, squares)
        return math.sqrt(squares.item())

    def _publish_weights(self) -> None:
        """New low-precision pieces from the masters, gathered so every rank has the full weights."""
        pending = []
        for master, layout, weights in zip(self.masters, self.layouts, self.weights, strict=True):
            for bucket, flat in zip(layout.buckets, weights, strict=True):
                piece = master.detach()[bucket.shard_offset : bucket.shard_offset + bucket.piece_numel]
                if self.stage == 0 or not self.comm.active:
                    flat.copy_(piece)  # every element is ours: convert in place, nothing to gather
                else:
                    piece = piece.to(device=self.device, dtype=self.compute_dtype)
                    pending.append(collectives.all_gather_pieces(self.comm, flat, piece, async_op=True))
        for item in pending:
            item.wait()

    def zero_grad(self) -> None:
        for grad in self.grad_shards:
            grad.zero_()

    # ---- accounting ----
    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 masters plus every optimizer state tensor."""
        total = sum(m.numel() * m.element_size() for m in self.masters)
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return total

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
